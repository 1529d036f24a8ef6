"""GPT-NeoX's post-training as its users have it: its four configs (`post-training/configs/llama3-8b-{sft,dpo,rm,
kto}.yml`, verbatim in ../shared/data) train on files GPT-NeoX's own `preprocess_data_with_chat_template.py` wrote
(tests/data/neox_post_training, README there), laid out under the relative paths the configs name, shrunk by
command-line overrides to a tiny Llama; the same conversations as prompt / chosen / rejected (or completion / label)
jsonl, rendered through the same chat template, train to the same losses and metrics (fp32, 4 steps); and
`neox_hf preprocess --chat-template` writes the script's files byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO, shared, train_in_this_process
from tests.test_fuzz_inputs import assert_one_line_error, run_cli, run_train

os.environ.setdefault("WANDB_DISABLED", "true")

DATA = REPO / "tests" / "data" / "neox_post_training"
CONFIGS = shared("neox-post-training-configs")
# The template the fixtures were written with (ChatML-like; the GPT-NeoX-20B vocabulary has no chat tokens, so its
# markers are plain text, which also exercises the script's token-prefix slicing across turns)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# What GPT-NeoX's script was run with for each fixture prefix (README): our preprocess options
SCRIPT_RUNS = {
    "dpo": ("pairs", ["--jsonl-keys", "chosen", "rejected", "--only-last"]),
    "sft": ("pairs", ["--jsonl-keys", "chosen"]),
    "rm": ("pairs", ["--jsonl-keys", "chosen", "rejected", "--for-rm"]),
    "kto": ("kto", ["--jsonl-keys", "messages", "--reward-key", "reward", "--binary-reward", "--only-last"]),
    "ktoraw": ("kto", ["--jsonl-keys", "messages", "--reward-key", "reward"]),
    "user": ("pairs", ["--jsonl-keys", "chosen", "--generation-role", "user"]),
}
TINY = ["--model.num_layers", "2", "--model.hidden_size", "32", "--model.num_attention_heads", "4",
        "--model.num_kv_heads", "2", "--model.intermediate_size", "64", "--model.seq_length", "128",
        "--model.max_position_embeddings", "128", "--parallel.tensor_parallel", "1", "--parallel.use_deepspeed", "false",
        "--parallel.activation_checkpointing", "false", "--train.precision", "fp32", "--train.train_iters", "4",
        "--train.micro_batch_size", "2", "--train.gradient_accumulation_steps", "1", "--train.lr", "1e-2",
        "--train.warmup", "0", "--train.eval_interval", "4", "--train.eval_iters", "2", "--train.save_interval", "100",
        "--output.report_to", "[]", "--output.tensorboard", "false"]


def chat_tokenizer_folder(folder: Path) -> Path:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(shared("tokenizers/gpt-neox-20b.json")),
                                        eos_token="<|endoftext|>", pad_token="<|padding|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines()]


def _split(tokenizer, chat: list[dict]) -> tuple[str, str]:
    """(prompt, completion) texts of a conversation: the template up to the last turn with the generation prompt,
    and the rest of the rendered conversation."""
    prompt = tokenizer.apply_chat_template(chat[:-1], tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template(chat, tokenize=False)
    assert whole.startswith(prompt)
    return prompt, whole[len(prompt):]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return chat_tokenizer_folder(tmp_path_factory.mktemp("chat_tokenizer"))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tok_dir):
    """A folder laid out as GPT-NeoX's post-training configs name their files (data/…, checkpoints/neox_converted/…
    /tokenizer), the fixtures copied in; a tiny Llama start with the chat tokenizer; the conversations as jsonl."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("post_training")
    shutil.copytree(tok_dir, root / "checkpoints" / "neox_converted" / "llama3-8b-instruct" / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                         intermediate_size=64, vocab_size=50304, max_position_embeddings=128, rms_norm_eps=1e-5,
                         rope_theta=500000.0, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(root / "start")
    tokenizer.save_pretrained(root / "start")
    names = {}
    for kind in ("dpo", "rm"):
        for split in ("train", "val"):
            for side in ("chosen", "rejected"):
                for label in ("", "_label"):
                    names[f"pairwise/llama3_{kind}_{split}_{side}{label}_document"] = f"{kind}_{side}{label}_document"
    for split in ("train", "test"):
        for label in ("", "_label", "_reward"):
            names[f"kto/llama3_{split}_messages{label}_document"] = f"kto_messages{label}_document"
        for label in ("", "_label"):
            names[f"sft/llama3_{split}_messages{label}_document"] = f"sft_chosen{label}_document"
    for target, fixture in names.items():
        (root / "data" / target).parent.mkdir(parents=True, exist_ok=True)
        for suffix in (".bin", ".idx"):
            shutil.copy(DATA / f"{fixture}{suffix}", root / "data" / f"{target}{suffix}")
    pairs = []
    for row in _rows("pairs"):
        prompt, chosen = _split(tokenizer, row["chosen"])
        assert _split(tokenizer, row["rejected"])[0] == prompt
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": _split(tokenizer, row["rejected"])[1]})
    _jsonl(root / "pairs.jsonl", pairs)
    _jsonl(root / "kto.jsonl", [dict(zip(("prompt", "completion"), _split(tokenizer, row["messages"])),
                                     label=row["reward"]) for row in _rows("kto")])
    return root


# ----------------------------------------------------------------------------------------------------------------
# preprocess --chat-template: GPT-NeoX's script's bytes
# ----------------------------------------------------------------------------------------------------------------


def _assert_script_files(folder: Path, prefix: str) -> None:
    expected = sorted(p.name for p in DATA.glob(f"{prefix}_*_document.*"))
    assert sorted(p.name for p in folder.glob(f"{prefix}_*")) == expected
    for name in expected:
        assert (folder / name).read_bytes() == (DATA / name).read_bytes(), name


def test_preprocess_chat_template_writes_gpt_neox_scripts_bytes(tok_dir, tmp_path, capsys):
    """Every option of GPT-NeoX's script, byte for byte: `neox_hf preprocess --chat-template` for --only-last on two
    keys, and the function it calls (one tokenizer load) for the other option sets."""
    from neox_hf.data.neox_post_training import write_chat_documents
    from neox_hf.data.tokenizer import load_tokenizer

    source, options = SCRIPT_RUNS["dpo"]
    code, err = run_cli(["preprocess", "--chat-template", str(DATA / f"{source}.jsonl"), "--tokenizer", str(tok_dir),
                         "--output-prefix", str(tmp_path / "dpo"), *options], capsys)
    assert code == 0, err
    _assert_script_files(tmp_path, "dpo")
    tokenizer = load_tokenizer(str(tok_dir))
    flags = {"--only-last": "only_last", "--for-rm": "for_rm", "--binary-reward": "binary_reward"}
    for prefix, (source, options) in SCRIPT_RUNS.items():
        if prefix == "dpo":
            continue
        keys = options[1: next((i for i, o in enumerate(options[1:], 1) if o.startswith("--")), len(options))]
        kwargs = {name: True for flag, name in flags.items() if flag in options}
        for flag, name in (("--reward-key", "reward_key"), ("--generation-role", "generation_role")):
            if flag in options:
                kwargs[name] = options[options.index(flag) + 1]
        write_chat_documents([str(DATA / f"{source}.jsonl")], tokenizer, str(tmp_path / prefix), keys=keys, **kwargs)
        _assert_script_files(tmp_path, prefix)


def test_preprocess_no_mask_and_bad_rows(tok_dir, tmp_path, capsys):
    """--no-mask: GPT-NeoX's script fails (KeyError on the label file it did not open); here the documents alone, every
    token trained. A row without the conversation or with a string reward is one line, nothing written."""
    from neox_hf.data import IndexedDataset

    tok = tok_dir
    base = ["preprocess", "--chat-template", "--tokenizer", str(tok)]
    code, err = run_cli([*base, str(DATA / "pairs.jsonl"), "--output-prefix", str(tmp_path / "nm"), "--jsonl-keys",
                         "chosen", "--no-mask"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nm_chosen_document.bin", "nm_chosen_document.idx"]
    assert IndexedDataset(tmp_path / "nm_chosen_document").get(0).tolist() == \
        IndexedDataset(DATA / "sft_chosen_document").get(0).tolist()[:-1]  # the template's tokens, no EOS
    bad = _jsonl(tmp_path / "bad.jsonl", [{"messages": "hi", "reward": True}])
    code, err = run_cli([*base, str(bad), "--output-prefix", str(tmp_path / "b"), "--jsonl-keys", "messages"], capsys)
    assert_one_line_error(code, err, "`messages` is not a list of {role, content} turns")
    bad = _jsonl(tmp_path / "bad2.jsonl", _rows("kto")[:1] + [{**_rows("kto")[1], "reward": "yes"}])
    code, err = run_cli([*base, str(bad), "--output-prefix", str(tmp_path / "b"), "--jsonl-keys", "messages",
                         "--reward-key", "reward"], capsys)
    assert_one_line_error(code, err, "the reward is str 'yes'")
    assert not list(tmp_path.glob("b_*"))


# ----------------------------------------------------------------------------------------------------------------
# The configs as given, and the same data from jsonl
# ----------------------------------------------------------------------------------------------------------------


def _train(workdir: Path, name: str, *extra: str) -> tuple[list[dict], dict, str]:
    """Train GPT-NeoX's `llama3-8b-NAME.yml` in `workdir` (its relative data paths), from the tiny start: the step
    lines, the final eval line and what it printed."""
    from neox_hf.checkpoint.run_log import read_run_log

    out = workdir / "runs" / f"{name}-{len(extra)}"
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        printed = train_in_this_process([str(CONFIGS / f"llama3-8b-{name}.yml"), "--model.from_pretrained",
                                         str(workdir / "start"), *TINY, "--output.dir", str(out), *extra])
    finally:
        os.chdir(cwd)
    log = read_run_log(out)
    return log.steps, (log.evals[-1] if log.evals else None), printed


def _jsonl_sources(path: Path) -> list[str]:
    return ["--data.sources", f"[{{path: {path}}}]", "--data.validation", f"[{{path: {path}}}]"]


def _assert_same_run(ours: tuple, theirs: tuple, metrics: tuple[str, ...]) -> None:
    (steps_a, eval_a, _), (steps_b, eval_b, _) = ours, theirs
    assert len(steps_a) == len(steps_b) == 4
    for a, b in zip(steps_a, steps_b):
        for key in ("loss", *metrics):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-6), (a["step"], key, a[key], b[key])
    assert eval_a["loss"] == pytest.approx(eval_b["loss"], rel=1e-6, abs=1e-6)
    assert steps_a[-1]["loss"] != steps_a[0]["loss"]  # it trained


@pytest.mark.distributed  # in-process whole runs
def test_dpo_config_trains_on_gpt_neox_pairs_as_on_the_same_jsonl(workdir):
    from neox_hf.objectives.dpo import METRICS

    neox = _train(workdir, "dpo")
    assert "preference pairs (dpo): 8 pairs" in neox[2]
    _assert_same_run(neox, _train(workdir, "dpo", *_jsonl_sources(workdir / "pairs.jsonl")), METRICS)


@pytest.mark.distributed
def test_rm_config_trains_on_gpt_neox_pairs_as_on_the_same_jsonl(workdir):
    from neox_hf.objectives.rm import METRICS

    neox = _train(workdir, "rm")
    _assert_same_run(neox, _train(workdir, "rm", *_jsonl_sources(workdir / "pairs.jsonl")), METRICS)


@pytest.mark.distributed
def test_kto_config_trains_on_gpt_neox_rewards_as_on_the_same_jsonl(workdir):
    from neox_hf.objectives.kto import METRICS

    neox = _train(workdir, "kto")
    assert "16 examples (8 desirable)" in neox[2]
    _assert_same_run(neox, _train(workdir, "kto", *_jsonl_sources(workdir / "kto.jsonl")), METRICS)


@pytest.mark.distributed
def test_sft_config_trains_on_label_documents(workdir):
    """The SFT config (train_label_data_paths, pack_impl: unpacked, GPT-NeoX's sample order): the first step's loss
    is stock transformers' cross-entropy of the starting model over the tokens whose label is not -100, averaged
    per token (the batch as `data.order: gpt-neox` reads it: the label documents, -100 on the prompt turns)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from neox_hf.data import build_train_loader
    from neox_hf.data.tokenizer import load_tokenizer
    from neox_hf.recipe.args import parse_run_args

    steps, _, _ = _train(workdir, "sft", "--train.eval_iters", "0")
    assert len(steps) == 4 and steps[-1]["loss"] < steps[0]["loss"]
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        recipe = parse_run_args([str(CONFIGS / "llama3-8b-sft.yml"), "--model.from_pretrained", str(workdir / "start"),
                                 *TINY]).recipe
        loader = build_train_loader(recipe.data, load_tokenizer(str(workdir / "start")), seq_length=128,
                                    micro_batch_size=2, seed=recipe.data.seed, train_iters=4)
        batch = next(loader)
    finally:
        os.chdir(cwd)
    labels = batch["labels"]
    assert 0 < int((labels != -100).sum()) < int((batch["input_ids"] != 0).sum()) // 2  # the prompts are masked
    model = AutoModelForCausalLM.from_pretrained(workdir / "start", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert steps[0]["loss"] == pytest.approx(float(expected), rel=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# Reading the files: what does not fit, what has no label, rewards
# ----------------------------------------------------------------------------------------------------------------


def _pairwise_source(prefix: str = "dpo"):
    from neox_hf.recipe import DataSource

    return DataSource(path=str(DATA / f"{prefix}_chosen_document"), format="indexed",
                      rejected_path=str(DATA / f"{prefix}_rejected_document"),
                      label_path=str(DATA / f"{prefix}_chosen_label_document"),
                      rejected_label_path=str(DATA / f"{prefix}_rejected_label_document"))


def _loader(tokenizer, source, objective: str, seq_length: int, **data):
    from neox_hf.data.preference import PreferenceLoader
    from neox_hf.recipe import DataConfig

    cfg = DataConfig(sources=[source], mode="pad", shuffle=False, **data)
    return PreferenceLoader(cfg, tokenizer, cfg.sources, objective=objective, seq_length=seq_length,
                            micro_batch_size=2, dp_rank=0, dp_size=1, seed=1, role="all", cycle=False)


def test_allow_chopped_drops_or_cuts_as_gpt_neox_and_says_how_many(tokenizer):
    """GPT-NeoX's unpacked pairwise index: with allow_chopped false a pair with a side longer than seq_length + 1 is
    dropped; else the side is cut to seq_length + 1 tokens, the last input still predicting token seq_length."""
    from neox_hf.data import IndexedDataset

    sizes = IndexedDataset(DATA / "dpo_chosen_document").sizes
    rejected = IndexedDataset(DATA / "dpo_rejected_document").sizes
    seq = 38
    too_long = int(sum(max(a, b) > seq + 1 for a, b in zip(sizes, rejected)))
    assert 0 < too_long < len(sizes)
    kept = _loader(tokenizer, _pairwise_source(), "dpo", seq, allow_chopped=False)
    assert kept.num_pairs == len(sizes) - too_long
    assert f"{too_long} dropped as longer than max_length + 1 = {seq + 1} (allow_chopped: false)" in kept.describe()
    cut = _loader(tokenizer, _pairwise_source(), "dpo", seq)
    # cut, less the pairs with no labelled token left in the first seq_length (GPT-NeoX skips those too)
    label_docs = [IndexedDataset(DATA / f"dpo_{side}_label_document") for side in ("chosen", "rejected")]
    kept_files = [i for i in range(len(sizes)) if all((d.get(i)[:seq] != -100).any() for d in label_docs)]
    assert cut.num_pairs == len(kept_files) < len(sizes)
    assert f"{len(sizes) - len(kept_files)} skipped with no labelled token" in cut.describe()
    longest = max(kept_files, key=lambda i: sizes[i])
    assert sizes[longest] > seq + 1
    batch = cut.batch_of([kept_files.index(longest)])
    labels = label_docs[0].get(longest)
    assert batch["input_ids"].shape[1] == seq
    expected = [t if t >= 0 else -100 for t in labels[1: seq + 1].tolist()]
    assert batch["labels"][0].tolist() == expected  # GPT-NeoX's label[1:seq_length + 1]


def test_pairs_without_a_labelled_token_are_skipped_and_counted(tokenizer):
    # seq_length 8: every label document is -100 over its first 8 tokens (the prompt), so GPT-NeoX skips them all
    from neox_hf.data.preference import EmptyPairs

    with pytest.raises(EmptyPairs, match="no usable preference pair"):
        _loader(tokenizer, _pairwise_source(), "dpo", 8)


def test_rm_rows_end_at_the_final_eos_gpt_neox_scores(tokenizer):
    """`--for-rm` files: tokens + EOS + EOS, only the last EOS labelled: GPT-NeoX's reward is the value at the
    position that predicts it (the first EOS), which is where transformers' pooling reads the last non-pad token."""
    from neox_hf.data import IndexedDataset

    loader = _loader(tokenizer, _pairwise_source("rm"), "rm", 128)
    batch = loader.batch_of([0])
    doc = IndexedDataset(DATA / "rm_chosen_document").get(0).tolist()
    length = int(batch["attention_mask"][0].sum())
    assert batch["input_ids"][0, :length].tolist() == doc[:-1] and doc[-2:] == [0, 0]


def test_kto_rewards_and_a_one_sided_file_warns(tokenizer, capsys, tmp_path):
    from neox_hf.recipe import DataSource

    source = DataSource(path=str(DATA / "kto_messages_document"), format="indexed",
                        label_path=str(DATA / "kto_messages_label_document"),
                        reward_path=str(DATA / "kto_messages_reward_document"))
    from neox_hf.data.preference import PreferenceLoader
    from neox_hf.recipe import DataConfig

    cfg = DataConfig(sources=[source], mode="pad")
    kw = dict(objective="kto", seq_length=128, micro_batch_size=2, dp_rank=0, dp_size=1, seed=1, role="all")
    loader = PreferenceLoader(cfg, tokenizer, cfg.sources, cycle=True, **kw)
    assert [label for _, _, label in loader.pairs] == [True, False] * 8 and "warning" not in capsys.readouterr().err
    # the script without --binary-reward stores a false reward as 0: GPT-NeoX gives it no loss; skipped, and the
    # file is then one-sided: one warning line
    raw = DataSource(path=str(DATA / "ktoraw_messages_document"), format="indexed",
                     label_path=str(DATA / "ktoraw_messages_label_document"),
                     reward_path=str(DATA / "ktoraw_messages_reward_document"))
    cfg = DataConfig(sources=[raw], mode="pad")
    loader = PreferenceLoader(cfg, tokenizer, cfg.sources, cycle=True, **kw)
    assert loader.num_pairs == 8 and "8 with reward 0 skipped" in loader.describe()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "every one of the 8 KTO examples" in err[0] and "is desirable" in err[0]
    # a jsonl KTO file whose labels are all false warns the same way; a string label is named as KTO's `label`
    rows = [{"prompt": "Q: a", "completion": " b", "label": False}, {"prompt": "Q: c", "completion": " d",
                                                                       "label": False}]
    _jsonl(tmp_path / "neg.jsonl", rows)
    cfg = DataConfig(sources=[DataSource(path=str(tmp_path / "neg.jsonl"))], mode="pad")
    PreferenceLoader(cfg, tokenizer, cfg.sources, cycle=True, **kw)
    assert "is undesirable" in capsys.readouterr().err
    _jsonl(tmp_path / "str.jsonl", [{**row, "label": "good"} for row in rows])
    cfg = DataConfig(sources=[DataSource(path=str(tmp_path / "str.jsonl"))], mode="pad")
    from neox_hf.errors import DataError

    with pytest.raises(DataError, match="KTO's `label` .* `label` is str 'good', not true / false"):
        PreferenceLoader(cfg, tokenizer, cfg.sources, cycle=True, **kw)


# ----------------------------------------------------------------------------------------------------------------
# The keys
# ----------------------------------------------------------------------------------------------------------------


def _translate(args: dict):
    from neox_hf.neox_yaml import translate_neox_args

    return translate_neox_args(args)


def test_reference_keys_translate():
    pairs = {"train_impl": "dpo", "dataset_impl": "pairwise", "pack_impl": "unpacked",
             "pos_train_data_paths": ["c"], "neg_train_data_paths": ["r"]}
    assert _translate({**pairs, "dpo_reference_free": True}).recipe["train"]["dpo_reference"] == "none"
    pre = _translate({**pairs, "precompute_model_name": "sft"})
    assert pre.recipe["train"]["dpo_reference"] == "precompute"
    assert any("`…_sft` files GPT-NeoX stores beside the pairs are not read" in n for n in pre.notices)
    data = pre.recipe["data"]
    assert data["sources"] == [{"format": "indexed", "path": "c", "rejected_path": "r"}]
    assert (data["mode"], data["order"], data["validation"]) == ("pad", "stream", [])


@pytest.mark.parametrize("args,key,words", [
    ({"train_impl": "reinforce"}, "train_impl", "generate and score completions offline"),
    ({"dataset_impl": "online"}, "dataset_impl", "never unpickles"),
    ({"train_impl": "dpo", "dataset_impl": "pairwise", "pos_train_data_paths": ["c"], "neg_train_data_paths": ["r"]},
     "pack_impl", "GPT-NeoX refuses packed pairwise"),
    ({"train_impl": "rm", "dataset_impl": "pairwise", "pack_impl": "pack_until_overflow",
      "pos_train_data_paths": ["c"], "neg_train_data_paths": ["r"]}, "pack_impl", "set pack_impl: unpacked"),
    ({"train_impl": "dpo", "dataset_impl": "pairwise", "pack_impl": "unpacked", "pos_train_data_paths": ["c"]},
     "neg_train_data_paths", "one rejected prefix"),
    ({"train_impl": "kto", "pack_impl": "unpacked", "train_data_paths": ["d"]}, "train_reward_data_paths",
     "--binary-reward"),
    ({"dataset_impl": "pairwise"}, "dataset_impl", "read by train_impl dpo or rm"),
])
def test_what_gpt_neox_refuses_is_refused_by_name(args, key, words):
    from neox_hf.errors import RecipeError

    with pytest.raises(RecipeError, match=key) as caught:
        _translate(args)
    assert words in str(caught.value)


def test_reference_free_dpo_compares_with_zero(tokenizer):
    """`train.dpo_reference: none` (GPT-NeoX's dpo_reference_free): −log σ(β(π_c − π_r)), no reference needed."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from neox_hf.objectives.base import sequence_logps
    from neox_hf.objectives.dpo import DPOObjective

    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1,
                                             intermediate_size=32, vocab_size=50304))
    batch = _loader(tokenizer, _pairwise_source(), "dpo", 128).batch_of([0, 1])
    out = DPOObjective(beta=0.5, reference_free=True).loss(model, batch)
    logps = sequence_logps(model, batch)[0]
    expected = -torch.nn.functional.logsigmoid(0.5 * (logps[:2] - logps[2:])).sum()
    torch.testing.assert_close(out.loss_sum, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.metric_sums["rewards/chosen"], 0.5 * logps[:2].sum().detach())


def write_neox_pairs(rows: list[dict], tokenizer, prefix: Path) -> dict:
    """prompt / chosen / rejected rows as GPT-NeoX pairwise files (PREFIX_{chosen,rejected}[_label]_document, int32),
    tokenised as the jsonl path tokenises them (TRL's rule), labels on the completion: the `DataSource` fields that
    read them. For a launch that must see the same pairs from both forms (tests/test_objective_layouts.py)."""
    import numpy as np

    from neox_hf.data.indexed import index_bytes
    from neox_hf.data.preference import tokenize_dpo_pairs

    tokenised = tokenize_dpo_pairs([(r["prompt"], r["chosen"], r["rejected"]) for r in rows], tokenizer)
    fields = {}
    for side, index in (("chosen", 1), ("rejected", 2)):
        docs = [(list(t[0]) + list(t[index]), [-100] * len(t[0]) + list(t[index])) for t in tokenised]
        for kind, column in (("", 0), ("_label", 1)):
            name = f"{prefix}_{side}{kind}_document"
            items = [np.asarray(doc[column], dtype=np.int32) for doc in docs]
            Path(f"{name}.bin").write_bytes(b"".join(item.tobytes() for item in items))
            Path(f"{name}.idx").write_bytes(index_bytes([len(item) for item in items], np.int32))
        fields["path" if side == "chosen" else "rejected_path"] = f"{prefix}_{side}_document"
        fields["label_path" if side == "chosen" else "rejected_label_path"] = f"{prefix}_{side}_label_document"
    return {"format": "indexed", **fields}


def test_bin_idx_pairs_batch_as_the_jsonl_they_came_from(tokenizer, tmp_path):
    """The evidence the layouts rest on: the .bin/.idx form of a jsonl file gives the preference loader the same
    DPO micro-batches on every data-parallel rank (tests/test_objective_layouts.py then trains a DP2 layout from it;
    RM reads `--for-rm` files, whose equality the rm config test shows)."""
    objective = "dpo"
    import torch

    from neox_hf.data.preference import PreferenceLoader
    from neox_hf.recipe import DataConfig, DataSource

    rows = [{"prompt": f"Question {i}: which colour?\nAnswer: ", "chosen": "blue " * (1 + i % 3),
             "rejected": "red " * (2 + i % 2)} for i in range(10)]
    _jsonl(tmp_path / "pairs.jsonl", rows)
    neox = DataSource(**write_neox_pairs(rows, tokenizer, tmp_path / "p"))
    for rank in (0, 1):
        batches = []
        for source in (DataSource(path=str(tmp_path / "pairs.jsonl")), neox):
            cfg = DataConfig(sources=[source], mode="pad", seed=7)
            loader = PreferenceLoader(cfg, tokenizer, cfg.sources, objective=objective, seq_length=64,
                                      micro_batch_size=2, dp_rank=rank, dp_size=2, seed=7, role="all", cycle=True)
            batches.append([next(loader) for _ in range(6)])
        for a, b in zip(*batches):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
