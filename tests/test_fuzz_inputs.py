"""Bad input, as a new user types it: recipe values, YAML files, command-line arguments, files and folders.

Every case must exit with status 2, print exactly one `error:` line that names the problem (the needle) and no
`Traceback`. All run in-process through the entry-point functions (`neox_hf.cli.train_main`, `neox_hf.cli.main`) and
fail before any model is built, so the whole file takes seconds once the libraries are imported.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import BUNDLED_TOKENIZER, REPO

TINY = str(REPO / "recipes" / "tiny.yaml")

# (id, extra arguments after recipes/tiny.yaml --print-config, needle of the error line)
RECIPE_VALUES = [
    ("lr-inf", ["--train.lr", ".inf"], "finite"),
    ("lr-nan", ["--train.lr", ".nan"], "finite"),
    ("lr-inf-string", ["--train.lr", "inf"], "finite"),
    ("lr-negative", ["--train.lr", "-1"], "train.lr"),
    ("lr-word", ["--train.lr", "fast"], "train.lr"),
    ("adam-beta1-one", ["--train.adam_beta1", "1.0"], "adam_beta1"),
    ("adam-beta2-above-one", ["--train.adam_beta2", "1.5"], "adam_beta2"),
    ("adam-eps-zero", ["--train.adam_eps", "0"], "adam_eps"),
    ("weight-decay-negative", ["--train.weight_decay", "-0.1"], "weight_decay"),
    ("dropout-above-one", ["--model.hidden_dropout", "1.5"], "hidden_dropout"),
    ("attention-dropout-negative", ["--model.attention_dropout", "-0.1"], "attention_dropout"),
    ("unknown-activation", ["--model.hidden_act", "gleu"], "hidden_act"),
    ("shard-size-word", ["--output.max_shard_size", "banana"], "max_shard_size"),
    ("shard-size-fraction", ["--output.max_shard_size", "1.5GB"], "max_shard_size"),
    ("zero-layers", ["--model.num_layers", "0"], "num_layers"),
    ("heads-do-not-divide", ["--model.hidden_size", "30"], "divisible"),
    ("hidden-size-float", ["--model.hidden_size", "1.5"], "hidden_size"),
    ("zero-stage-5", ["--parallel.zero_stage", "5"], "zero_stage"),
    ("precision-fp4", ["--train.precision", "fp4"], "precision"),  # fp8 is a precision (refused where no FP8 GPU)
    ("keep-last-zero", ["--train.keep_last_n", "0"], "keep_last_n"),
    ("warmup-above-one", ["--train.warmup", "1.5"], "warmup"),
    ("min-lr-above-lr", ["--train.min_lr", "1"], "min_lr"),
    ("validation-fraction-one", ["--data.validation_fraction", "1"], "validation_fraction"),
    ("micro-batch-zero", ["--train.micro_batch_size", "0"], "micro_batch_size"),
    ("rotary-zero", ["--model.rotary_pct", "0"], "rotary_pct"),
    ("eval-iters-negative", ["--train.eval_iters", "-1"], "eval_iters"),
    ("layer-norm-eps-zero", ["--model.layer_norm_eps", "0"], "layer_norm_eps"),
    ("skipped-fraction-two", ["--data.max_skipped_fraction", "2"], "max_skipped_fraction"),
    ("peft-dropout-one", ["--peft.method", "lora", "--peft.dropout", "1.0"], "peft.dropout"),
    ("output-dir-empty", ["--output.dir", ""], "output.dir"),
    ("source-weight-zero", ["--data.sources", "[{path: a.jsonl, weight: 0}]"], "weight"),
    ("sources-not-a-list", ["--data.sources", "a.jsonl"], "data.sources"),
    ("unknown-section", ["--trian.lr", "1"], "trian"),
    ("unknown-key", ["--train.lrr", "1"], "did you mean `lr`"),
    ("override-without-value", ["--train.lr"], "has no value"),
    ("override-without-key", ["--train", "1"], "unknown option '--train'"),
    ("override-bad-yaml", ["--train.lr", "[1"], "not valid YAML"),
    ("flag-typo", ["--resum"], "did you mean --resume"),
    ("resume-and-overwrite", ["--resume", "--overwrite"], "--overwrite"),
    ("seq-length-above-positions", ["--model.max_position_embeddings", "64"], "max_position_embeddings"),
]


def run_train(argv: list[str], capsys) -> tuple[int, str]:
    from neox_hf.cli import train_main as main

    code = main(argv)
    return code, capsys.readouterr().err


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """`neox_hf ARGV` through the CLI's entry function in this process: its exit status and what it wrote to stderr
    (`capsys`, or `capfd` to read the file descriptor, where a library's own log handler writes too)."""
    from neox_hf.cli import main

    capsys.readouterr()  # only what this command writes
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse
        code = exit_.code
    return code, capsys.readouterr().err


def assert_one_line_error(code: int, err: str, needle: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert needle in errors[0], errors[0]


@pytest.mark.parametrize("args,needle", [c[1:] for c in RECIPE_VALUES], ids=[c[0] for c in RECIPE_VALUES])
def test_bad_recipe_value_is_refused_in_one_line(args, needle, capsys):
    assert_one_line_error(*run_train([TINY, "--print-config", *args], capsys), needle)


YAML_FILES = [
    ("duplicate-key", "train:\n  lr: 1.0e-3\n  lr: 2.0e-3\n", "appears twice"),
    ("duplicate-section", "train:\n  lr: 1.0e-3\ntrain:\n  seed: 1\n", "appears twice"),
    ("syntax-error", "train:\n  lr: [1, 2\n", "not valid YAML"),
    ("top-level-list", "- train\n- model\n", "mapping"),
    ("section-not-mapping", "train: 3\n", "mapping"),
    ("unknown-section", "trainer:\n  lr: 1\n", "trainer"),
]


@pytest.mark.parametrize("text,needle", [c[1:] for c in YAML_FILES], ids=[c[0] for c in YAML_FILES])
def test_bad_yaml_file_is_refused_in_one_line(text, needle, tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    assert_one_line_error(*run_train([str(recipe), "--print-config"], capsys), needle)


def test_undecodable_and_missing_recipe_files_are_refused(tmp_path, capsys):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert_one_line_error(*run_train([str(binary), "--print-config"], capsys), "binary.yaml")
    assert_one_line_error(*run_train([str(tmp_path / "nope.yaml")], capsys), "not found")
    assert_one_line_error(*run_train(["--print-config"], capsys), "no recipe given")


def _bad_files(tmp: Path) -> dict[str, Path]:
    corrupt = tmp / "corrupt-tokenizer.json"
    corrupt.write_text('{"model": ')
    blocker = tmp / "a-file"
    blocker.write_text("x")
    used = tmp / "used"
    used.mkdir()
    (used / "train_log.jsonl").write_text('{"step": 1}\n')
    jsonl = tmp / "docs.jsonl"
    jsonl.write_text('{"text": "a line"}\n')
    truncated = tmp / "cut.parquet"
    truncated.write_bytes(b"PAR1" + b"\0" * 64)  # a download cut short: the footer and its magic are missing
    return {"corrupt": corrupt, "blocker": blocker, "used": used, "jsonl": jsonl, "truncated": truncated}


# Cases that pass --print-config's validation and are refused when training starts, before the model is built.
RUNTIME = [
    ("eos-token-typo", ["--tokenizer.eos_token", "<|endoftxt|>"], "did you mean '<|endoftext|>'"),
    ("pad-token-typo", ["--tokenizer.pad_token", "<|pad|>"], "pad_token"),
    ("tokenizer-missing", ["--tokenizer.path", "{tmp}/missing.json"], "not found"),
    ("tokenizer-corrupt", ["--tokenizer.path", "{corrupt}"], "not a valid tokenizers JSON"),
    ("from-pretrained-missing", ["--model.from_pretrained", "{tmp}/no-model"], "from_pretrained"),
    ("from-pretrained-not-a-model", ["--model.from_pretrained", "{tmp}"], "config.json"),
    ("from-pretrained-hub-id-offline", ["--model.from_pretrained", "no-such-org/no-such-model"], "offline_marker"),
    ("data-missing", ["--data.sources", "[{{path: {tmp}/none.jsonl}}]"], "no file matches"),
    ("data-no-suffix", ["--data.sources", "[{{path: {tmp}/x/data}}]"], "format"),
    ("data-jsonl-as-parquet", ["--data.sources", "[{{path: {jsonl}, format: parquet}}]"], "is not a Parquet file"),
    ("data-parquet-truncated", ["--data.sources", "[{{path: {truncated}}}]"], "truncated?"),
    ("output-under-a-file", ["--output.dir", "{blocker}/out"], "cannot be written"),
    ("output-is-a-file", ["--output.dir", "{blocker}"], "is a file"),
    ("output-holds-a-run", ["--output.dir", "{used}"], "--overwrite"),
    ("resume-path-missing", ["--train.resume", "{tmp}/ckpt", "--output.dir", "{tmp}/o2"], "not found"),
    ("hub-repo-id-with-space", ["--train.push_to_hub", "{{repo_id: my org/tiny}}"], "is not a Hub repository id"),
    ("hub-repo-id-three-parts", ["--train.push_to_hub", "{{repo_id: a/b/c}}"], "write it as owner/name"),
    ("accelerate-config-contradicts", ["--parallel.zero_stage", "1", "ENV:ACCELERATE_DEEPSPEED_ZERO_STAGE=3"],
     "sets `zero_stage: 3` but"),
]


@pytest.mark.parametrize("args,needle", [c[1:] for c in RUNTIME], ids=[c[0] for c in RUNTIME])
def test_bad_run_setting_is_refused_before_the_model_is_built(args, needle, tmp_path, capsys, monkeypatch,
                                                            fresh_accelerate_state):
    files = _bad_files(tmp_path)
    for setting in [a for a in args if a.startswith("ENV:")]:  # what `accelerate launch` puts in the environment
        monkeypatch.setenv(*setting[4:].split("=", 1))
    args = [a.format(tmp=tmp_path, **files) for a in args if not a.startswith("ENV:")]
    if needle == "offline_marker":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        needle = "not in the local Hub cache"
    base = [TINY, "--tokenizer.path", str(BUNDLED_TOKENIZER), "--output.dir", str(tmp_path / "out"),
            "--data.sources", f"[{{path: {REPO / 'examples' / 'data' / 'tinyshakespeare.txt'}}}]"]
    assert_one_line_error(*run_train([*base, *args], capsys), needle)


def test_fp16_without_deepspeed_on_cpu_is_refused(tmp_path, capsys, fresh_accelerate_state):
    import torch

    if torch.cuda.is_available():
        pytest.skip("fp16 without DeepSpeed is valid on a GPU")
    code, err = run_train([TINY, "--train.precision", "fp16", "--output.dir", str(tmp_path / "o")], capsys)
    assert_one_line_error(code, err, "fp16")
    assert "bf16" in err


def test_push_to_hub_without_a_token_is_refused_before_training(tmp_path, capsys, monkeypatch, fresh_accelerate_state):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    code, err = run_train([TINY, "--train.push_to_hub", "{repo_id: me/tiny}", "--output.dir", str(tmp_path / "o")],
                          capsys)
    assert_one_line_error(code, err, "token")


def _cli_fixtures(tmp: Path) -> dict[str, Path]:
    random = tmp / "random"
    random.mkdir()
    (random / "notes.txt").write_text("hello")
    run_folder = tmp / "finished-run"
    (run_folder / "checkpoints").mkdir(parents=True)
    (run_folder / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    bad_json = tmp / "bad.jsonl"
    bad_json.write_text('{"text": "fine"}\n{not json\n')
    wrong_key = tmp / "wrong-key.jsonl"
    wrong_key.write_text('{"body": "a document"}\n')
    (tmp / "corrupt.jsonl.gz").write_bytes(b"not gzip at all\n")
    adapter = tmp / "broken-adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{not json")
    return {"random": random, "run": run_folder, "bad_json": bad_json, "wrong_key": wrong_key, "adapter": adapter}


CLI = [
    ("no-command", [], "required"),
    ("unknown-command", ["fly"], "invalid choice"),
    ("generate-negative-temperature", ["generate", "{random}", "--prompt", "x", "--temperature", "-1"], "--temperature"),
    ("generate-top-p-above-one", ["generate", "{random}", "--prompt", "x", "--top-p", "2"], "--top-p"),
    ("generate-zero-tokens", ["generate", "{random}", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
    ("generate-missing-model", ["generate", "{tmp}/none", "--prompt", "x"], "not found"),
    ("generate-no-mode", ["generate", "{random}"], "required"),
    ("eval-random-folder", ["eval", "{random}", "--data", "{bad_json}"], "config.json"),
    ("eval-corrupt-adapter-config", ["eval", "{adapter}", "--data", "{bad_json}"], "adapter_config.json"),
    ("generate-corrupt-adapter-config", ["generate", "{adapter}", "--prompt", "x"], "adapter_config.json"),
    ("eval-batch-size-zero", ["eval", "{random}", "--data", "{bad_json}", "--batch-size", "0"], "--batch-size"),
    ("export-finished-run", ["export", "{run}", "{tmp}/o"], "checkpoints"),
    ("export-random-folder", ["export", "{random}", "{tmp}/o"], "not a neox_hf training checkpoint"),
    ("export-missing", ["export", "{tmp}/none", "{tmp}/o"], "not found"),
    ("export-neox-random-folder", ["export-neox", "{random}", "{tmp}/o"], "config.json"),
    ("export-neox-missing", ["export-neox", "{tmp}/none", "{tmp}/o"], "not found"),
    ("export-neox-tp-zero", ["export-neox", "{random}", "{tmp}/o", "--tp", "0"], "--tp"),
    ("export-neox-tp-word", ["export-neox", "{random}", "{tmp}/o", "--tp", "two"], "--tp"),
    ("preprocess-wrong-text-key", ["preprocess", "{wrong_key}", "--tokenizer", str(BUNDLED_TOKENIZER),
                                   "--output-prefix", "{tmp}/c"], "--text-key"),
    ("preprocess-invalid-json", ["preprocess", "{bad_json}", "--tokenizer", str(BUNDLED_TOKENIZER),
                                 "--output-prefix", "{tmp}/c"], "bad.jsonl:2"),
    ("preprocess-corrupt-gzip", ["preprocess", "{tmp}/corrupt.jsonl.gz", "--tokenizer", str(BUNDLED_TOKENIZER),
                                 "--output-prefix", "{tmp}/c"], "corrupt.jsonl.gz: cannot be read"),
    ("preprocess-missing-input", ["preprocess", "{tmp}/none.jsonl", "--tokenizer", str(BUNDLED_TOKENIZER),
                                  "--output-prefix", "{tmp}/c"], "not found"),
    ("preprocess-workers-zero", ["preprocess", "{bad_json}", "--tokenizer", str(BUNDLED_TOKENIZER),
                                 "--output-prefix", "{tmp}/c", "--workers", "0"], "--workers"),
    ("merge-missing-base", ["merge", "{tmp}/none", "{random}", "{tmp}/o"], "adapter_config.json"),
    ("convert-neox-missing", ["convert-neox", "{tmp}/none", "--config", "{tmp}/none.yml", "{tmp}/o"], "none"),
    ("train-subcommand-typo", ["train", TINY, "--print-confg"], "did you mean --print-config"),
]


@pytest.mark.parametrize("args,needle", [c[1:] for c in CLI], ids=[c[0] for c in CLI])
def test_bad_cli_use_is_refused_in_one_line(args, needle, tmp_path, capsys):
    files = _cli_fixtures(tmp_path)
    args = [a.format(tmp=tmp_path, **files) for a in args]
    assert_one_line_error(*run_cli(args, capsys), needle)
    assert not list(tmp_path.glob("**/.tmp-*")), "a failed command left temporary files"


def test_push_without_a_token_says_so_before_any_retry(tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    folder = _cli_fixtures(tmp_path)["run"]
    assert_one_line_error(*run_cli(["push", str(folder), "me/model"], capsys), "no Hugging Face token")


def test_the_fuzz_covers_at_least_forty_bad_inputs():
    cases = len(RECIPE_VALUES) + len(YAML_FILES) + 3 + len(RUNTIME) + 2 + len(CLI) + 1
    assert cases >= 40, cases


def _neox_and_merge_fixtures(tmp: Path) -> dict[str, Path]:
    model = '"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 32'
    files = {"typo": '{"num-layer": 2, "hidden-size": 64, "num-attention-heads": 4}',
             "batch": '{%s, "train_batch_size": 30, "train_micro_batch_size_per_gpu": 8}' % model,
             "vocab": '{%s, "vocab-file": "/nowhere/20B_tokenizer.json"}' % model}
    paths = {}
    for name, text in files.items():
        paths[f"neox_{name}"] = tmp / f"{name}.yml"
        paths[f"neox_{name}"].write_text(text)
    for base in ("base-a", "base-b"):
        (tmp / base).mkdir()
        (tmp / base / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    adapter = tmp / "adapter-of-a"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp / "base-a")}))
    return {**paths, "base_b": tmp / "base-b", "adapter_a": adapter}


NEOX_AND_MERGE = [
    ("neox-key-typo", ["train", "{neox_typo}", "--print-config"], "did you mean `num-layers`"),
    ("neox-batch-triple-inconsistent", ["train", "{neox_batch}", "--print-config"], "train_batch_size 30"),
    ("convert-neox-vocab-file-missing", ["convert-neox", "{tmp}/none", "--config", "{neox_vocab}", "{tmp}/o"],
     "/nowhere/20B_tokenizer.json"),
    ("merge-adapter-of-another-base", ["merge", "{base_b}", "{adapter_a}", "{tmp}/o"], "--force"),
]


@pytest.mark.parametrize("args,needle", [c[1:] for c in NEOX_AND_MERGE], ids=[c[0] for c in NEOX_AND_MERGE])
def test_bad_gpt_neox_config_or_merge_is_refused_in_one_line(args, needle, tmp_path, capsys):
    files = _neox_and_merge_fixtures(tmp_path)
    args = [a.format(tmp=tmp_path, **files) for a in args]
    assert_one_line_error(*run_cli(args, capsys), needle)
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------------------------------------------
# Issue 41's fuzz of the newer inputs: preference rows, GPT-NeoX Llama-family configs, `neox_hf plan` arguments and
# the accelerate config keys `accelerate launch` puts in the environment. Each is refused before anything trains.

GOOD_PAIR = {"prompt": "Question: is it? Answer:", "chosen": " yes it is", "rejected": " no"}

# (id, the row written five times, needle); rows are refused by `neox_hf eval --objective rm` before any model loads,
# through the reader training uses (`read_pairs`)
PREFERENCE_ROWS = [
    ("no-chosen", {"prompt": "p", "rejected": "r"}, "no row with string fields"),
    ("no-rejected", {"prompt": "p", "chosen": "c"}, "no row with string fields"),
    ("no-prompt", {"chosen": "c", "rejected": "r"}, "no row with string fields"),
    ("chosen-a-number", {**GOOD_PAIR, "chosen": 3}, "no row with string fields"),
    ("rejected-null", {**GOOD_PAIR, "rejected": None}, "no row with string fields"),
    ("prompt-a-list", {**GOOD_PAIR, "prompt": ["p"]}, "no row with string fields"),
    ("chosen-chat-messages", {**GOOD_PAIR, "chosen": [{"role": "assistant", "content": "x"}]}, "--chosen-key"),
    ("fields-booleans", {"prompt": True, "chosen": False, "rejected": True}, "no row with string fields"),
    ("row-a-list", ["p", "c", "r"], "no row with string fields"),
    ("row-a-string", "p c r", "no row with string fields"),
    ("row-a-number", 7, "no row with string fields"),
    ("chosen-equals-rejected", {**GOOD_PAIR, "rejected": GOOD_PAIR["chosen"]}, "every one of its 5 pairs"),
    ("all-empty-strings", {"prompt": "", "chosen": "", "rejected": ""}, "every one of its 5 pairs"),
    # JSON's escape for half a UTF-16 pair decodes to a str the tokenizer raised a TypeError traceback on
    ("lone-surrogate", '{"prompt": "p \\ud800", "chosen": "c", "rejected": "r"}', "no row with string fields"),
    ("invalid-utf8", b'{"prompt": "\xff\xfe", "chosen": "c", "rejected": "r"}', "no row with string fields"),
    ("whole-file-one-json-array", [GOOD_PAIR] * 2, "no row with string fields"),
    ("empty-file", None, "no row with string fields"),
]


def _row_line(row) -> bytes:
    if isinstance(row, bytes):
        return row
    return (row if isinstance(row, str) and row.startswith("{") else json.dumps(row)).encode("utf-8")


@pytest.mark.parametrize("row,needle", [c[1:] for c in PREFERENCE_ROWS], ids=[c[0] for c in PREFERENCE_ROWS])
def test_bad_preference_rows_are_refused_in_one_line(row, needle, tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_bytes(b"" if row is None else (_row_line(row) + b"\n") * 5)
    code, err = run_cli(["eval", str(tmp_path / "no-model"), "--objective", "rm", "--data", str(pairs)], capsys)
    assert_one_line_error(code, err, needle)


def test_a_lone_surrogate_row_among_good_ones_is_skipped_not_a_traceback(tmp_path):
    from neox_hf.data.preference import read_pairs
    from neox_hf.recipe import DataSource

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_bytes(_row_line(GOOD_PAIR) + b"\n" + b'{"prompt": "\\udfff", "chosen": "c", "rejected": "r"}\n')
    stats: dict = {}
    assert read_pairs([DataSource(path=str(pairs))], stats=stats) == [tuple(GOOD_PAIR.values())]
    assert stats["skipped_undecodable"] == 1


# (id, file under neox-llama-configs, text replaced, replacement, needle): `neox_hf train FILE --print-config`
LLAMA_CONFIGS = [
    ("hidden-size-word", "mistral/7B.yml", '"hidden_size": 4096', '"hidden_size": "big"', "hidden_size"),
    ("hidden-size-negative", "mistral/7B.yml", '"hidden_size": 4096', '"hidden_size": -4096', "hidden_size"),
    ("num-layers-fraction", "mistral/7B.yml", '"num_layers": 32', '"num_layers": 3.5', "3.5 is not a whole number"),
    ("num-layers-zero", "mistral/7B.yml", '"num_layers": 32', '"num_layers": 0', "num_layers"),
    ("heads-negative", "mistral/7B.yml", '"num_attention_heads": 32', '"num_attention_heads": -32',
     "num_attention_heads"),
    ("kv-heads-do-not-divide", "mistral/7B.yml", '"num_kv_heads": 8', '"num_kv_heads": 5', "must divide"),
    ("kv-heads-zero", "mistral/7B.yml", '"num_kv_heads": 8', '"num_kv_heads": 0', "num_kv_heads: 0` must be ≥ 1"),
    ("kv-heads-word", "mistral/7B.yml", '"num_kv_heads": 8', '"num_kv_heads": "eight"', "num_kv_heads"),
    ("kv-heads-above-heads", "mistral/7B.yml", '"num_kv_heads": 8', '"num_kv_heads": 64', "must divide"),
    ("activation-unknown", "mistral/7B.yml", '"activation": "swiglu"', '"activation": "swishglu"', "activation"),
    ("activation-a-number", "mistral/7B.yml", '"activation": "swiglu"', '"activation": 3', "activation"),
    ("norm-unknown", "mistral/7B.yml", '"norm": "rmsnorm"', '"norm": "batchnorm"', "norm"),
    ("norm-a-list", "mistral/7B.yml", '"norm": "rmsnorm"', '"norm": ["rmsnorm"]', "norm"),
    ("rms-eps-negative", "mistral/7B.yml", '"rms_norm_epsilon": 1.0e-5', '"rms_norm_epsilon": -1.0e-5',
     "layer_norm_eps"),
    ("rms-eps-word", "mistral/7B.yml", '"rms_norm_epsilon": 1.0e-5', '"rms_norm_epsilon": "tiny"', "rms_norm_epsilon"),
    ("intermediate-negative", "mistral/7B.yml", '"intermediate_size": 14336', '"intermediate_size": -1',
     "intermediate_size"),
    ("window-negative", "mistral/7B.yml", '"sliding_window_width": 4096', '"sliding_window_width": -1',
     "sliding_window"),
    ("rotary-base-word", "mistral/7B.yml", '"rotary_emb_base": 10000', '"rotary_emb_base": "big"', "rotary_emb_base"),
    ("seq-length-negative", "mistral/7B.yml", '"seq_length": 8192', '"seq_length": -8192', "seq_length"),
    ("pos-emb-unknown", "mistral/7B.yml", '"pos_emb": "rotary"', '"pos_emb": "alibi2"', "pos_emb"),
    ("rotary-pct-two", "mistral/7B.yml", '"rotary_pct": 1', '"rotary_pct": 2', "rotary_pct"),
    ("no-weight-tying-word", "mistral/7B.yml", '"no_weight_tying": true', '"no_weight_tying": "yes"',
     "'yes' is not true or false"),
    ("attention-bias-word", "mistral/7B.yml", '"use_bias_in_attn_linear": false', '"use_bias_in_attn_linear": "no"',
     "'no' is not true or false"),
    ("positions-below-seq-length", "mistral/7B.yml", '"max_position_embeddings": 131072',
     '"max_position_embeddings": 16', "max_position_embeddings"),
    ("model-parallel-negative", "mistral/7B.yml", '"model_parallel_size": 1', '"model_parallel_size": -1',
     "model_parallel_size: -1` must be ≥ 0"),
    ("pipe-parallel-word", "mistral/7B.yml", '"pipe_parallel_size": 1', '"pipe_parallel_size": "one"',
     "pipe_parallel_size"),
    ("attention-config-short", "mistral/7B.yml", '"attention_config": [[["flash"], 32]]',
     '"attention_config": [[["flash"], 31]]', "gives 31 layers an attention kind but num_layers is 32"),
    ("mlp-bias-word", "llama/7B.yml", '"use_bias_in_mlp": False', '"use_bias_in_mlp": "False"',
     "is not true or false"),
    ("vocab-divisor-zero", "llama/7B.yml", '"make_vocab_size_divisible_by": 1', '"make_vocab_size_divisible_by": 0',
     "make_vocab_size_divisible_by"),
]


@pytest.mark.parametrize("name,old,new,needle", [c[1:] for c in LLAMA_CONFIGS], ids=[c[0] for c in LLAMA_CONFIGS])
def test_bad_gpt_neox_llama_config_value_is_refused_in_one_line(name, old, new, needle, tmp_path, capsys):
    from tests.conftest import shared

    text = shared(f"neox-llama-configs/{name}").read_text()
    assert old in text, old
    config = tmp_path / "config.yml"
    config.write_text(text.replace(old, new))
    assert_one_line_error(*run_cli(["train", str(config), "--print-config"], capsys), needle)


PLAN_ARGS = [
    ("gpus-negative", ["--gpus", "-1"], "--gpus"),
    ("gpus-zero", ["--gpus", "0"], "--gpus"),
    ("gpus-word", ["--gpus", "two"], "--gpus"),
    ("gpus-fraction", ["--gpus", "2.5"], "--gpus"),
    ("gpu-memory-negative", ["--gpu-memory", "-40"], "--gpu-memory"),
    ("gpu-memory-zero", ["--gpu-memory", "0"], "--gpu-memory"),
    ("gpu-memory-word", ["--gpu-memory", "lots"], "--gpu-memory"),
    ("gpu-memory-nan", ["--gpu-memory", "nan"], "--gpu-memory"),
    ("gpu-memory-infinite", ["--gpu-memory", "inf"], "--gpu-memory must be a finite number"),  # an OverflowError
    ("mfu-negative", ["--mfu", "-0.5"], "--mfu"),
    ("mfu-zero", ["--mfu", "0"], "--mfu"),
    ("mfu-above-one", ["--mfu", "1.5"], "--mfu"),
    ("mfu-nan", ["--mfu", "nan"], "--mfu"),
    ("top-zero", ["--top", "0"], "--top must be ≥ 1"),  # listed nothing and exited 0
    ("top-negative", ["--top", "-3"], "--top must be ≥ 1"),  # listed all but the last three
    ("top-word", ["--top", "x"], "--top"),
    ("gpu-unknown", ["--gpu", "h900"], "no datasheet peak known"),
    ("gpu-empty", ["--gpu", ""], "no datasheet peak known"),
    ("mfu-from-missing", ["--mfu-from", "{tmp}/none"], "--mfu-from"),
]


@pytest.mark.parametrize("args,needle", [c[1:] for c in PLAN_ARGS], ids=[c[0] for c in PLAN_ARGS])
def test_bad_plan_argument_is_refused_in_one_line(args, needle, tmp_path, capsys):
    args = [a.format(tmp=tmp_path) for a in args]
    assert_one_line_error(*run_cli(["plan", TINY, *args], capsys), needle)


# (id, what `accelerate launch` put in the environment, needle): `run_clm_neox.py tiny.yaml --print-config`
ACCELERATE_ENV = [
    ("zero-stage-word", {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "three"}, "`zero_stage: three`"),  # was a ValueError
    ("zero-stage-7", {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "7"}, "zero_stage"),
    ("zero-stage-negative", {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "-1"}, "zero_stage"),
    ("accumulation-word", {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "many"}, "`gradient_accumulation_steps: many`"),
    ("accumulation-fraction", {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "1.5"}, "not a whole number ≥ 1"),
    ("accumulation-zero", {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "0"}, "not a whole number ≥ 1"),
    ("accumulation-negative", {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "-2"}, "not a whole number ≥ 1"),
    ("clipping-word", {"ACCELERATE_GRADIENT_CLIPPING": "high"}, "gradient_clipping: high"),
    ("clipping-negative", {"ACCELERATE_GRADIENT_CLIPPING": "-1"}, "gradient_clipping"),
    ("mixed-precision-fp4", {"ACCELERATE_MIXED_PRECISION": "fp4"}, "mixed_precision: fp4"),
    ("mixed-precision-word", {"ACCELERATE_MIXED_PRECISION": "half"}, "mixed_precision: half"),
    ("offload-optimizer-disk", {"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "disk"},
     "`offload_optimizer_device: disk`, which is not an offload device"),  # was silently no offload
    ("offload-optimizer-nvme", {"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "nvme"}, "nvme"),
    ("offload-param-gpu", {"ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "gpu"},
     "`offload_param_device: gpu`, which is not an offload device"),
    ("dynamo-cudagraphs", {"ACCELERATE_DYNAMO_BACKEND": "cudagraphs"}, "dynamo_backend: CUDAGRAPHS"),
    ("fsdp-version-1", {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "`fsdp_version: 1`"),
    ("distributed-type-megatron", {"ACCELERATE_USE_MEGATRON_LM": "1"}, "`distributed_type: MEGATRON_LM`"),
]


@pytest.mark.parametrize("env,needle", [c[1:] for c in ACCELERATE_ENV], ids=[c[0] for c in ACCELERATE_ENV])
def test_bad_accelerate_config_key_is_refused_in_one_line(env, needle, capsys, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert_one_line_error(*run_train([TINY, "--print-config"], capsys), needle)


def test_the_fuzz_of_the_newer_inputs_covers_at_least_forty():
    cases = len(PREFERENCE_ROWS) + 1 + len(LLAMA_CONFIGS) + len(PLAN_ARGS) + len(ACCELERATE_ENV)
    assert cases >= 40, cases


def test_preprocess_of_a_lone_surrogate_document_names_its_line(tmp_path, capsys):
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "a good document"}\n{"text": "half a pair \\ud800 here"}\n')
    code, err = run_cli(["preprocess", str(docs), "--tokenizer", str(BUNDLED_TOKENIZER), "--output-prefix",
                         str(tmp_path / "c")], capsys)
    assert_one_line_error(code, err, "docs.jsonl:2: `text` is not Unicode text")  # was the tokenizer's TypeError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]  # nothing half-written


# ----------------------------------------------------------------------------------------------------------------
# Typed fuzz of GPT-NeoX config values: every key of the shared GPT-NeoX configs (and every key the translator reads
# that they lack) with a value of the wrong type, length or range, through the translator and the recipe validation
# ----------------------------------------------------------------------------------------------------------------

SHARED_NEOX_CONFIGS = sorted(p for p in (REPO.parent / "shared" / "data").glob("neox-*configs/**/*.yml")
                             if p.name != "train_config.yml")


def _mutants(value) -> list:
    """Wrong type, string for number and the reverse, wrong length, out of range."""
    if isinstance(value, bool):
        return ["yes", 2, [True], {"on": True}]
    if isinstance(value, (int, float)):
        return [str(value), "many", -1, 0, 10**12, 3.5, True, float("nan"), float("inf"), [value], {"v": value}]
    if isinstance(value, str):
        return [7, 1.5, True, [value], {"v": value}, ""]
    if isinstance(value, list):
        return [value[:1], value + value[-1:], [], "abc", 0.9, [None] * len(value), [{"x": 1}] * len(value)]
    if isinstance(value, dict):
        return ["abc", 7, [1], {}]
    return ["abc", 7, -1, [1], {"a": 1}, True]


def _value_paths(tree: dict, prefix: tuple = ()):
    for key, value in tree.items():
        yield prefix + (key,), value
        if isinstance(value, dict):
            yield from _value_paths(value, prefix + (key,))
        elif isinstance(value, list):
            yield from ((prefix + (key, i), item) for i, item in enumerate(value[:2])
                        if not isinstance(item, (dict, list)))


def _typed_fuzz_cases() -> list[tuple[Path, tuple, object]]:
    """(config, key path, mutant): each (key path, mutant) once, from the first shared config that has the key; then
    every key the translator reads that none has, put into Pythia 160M."""
    from neox_hf import neox_yaml as ny

    seen, cases = set(), []
    for path in SHARED_NEOX_CONFIGS:
        for keys, value in _value_paths(ny.read_neox_files([path])):
            for mutant in _mutants(value):
                if (keys, repr(mutant)) not in seen:
                    seen.add((keys, repr(mutant)))
                    cases.append((path, keys, mutant))
    read = (set(ny._DIRECT) | set(ny._INTEGER_OPTIONS) | set(ny._SUPPORTED_VALUES) | set(ny._MUST_BE_FALSY)
            | set(ny._VALUE_SHAPES) | set(ny._FP8_KEYS) | ny._FAMILY_KEYS)
    present = {keys[0] for keys, _ in seen}
    pythia = next(p for p in SHARED_NEOX_CONFIGS if p.name == "160M.yml")
    for key in sorted(read - present):
        cases += [(pythia, (key,), mutant) for mutant in ("abc", 7, -1, 3.5, [1], {"a": 1}, True)]
    # every third case (each key path keeps at least one of its mutants, each mutant kind many keys): seconds
    return cases[::3]


def _translate_and_validate(args: dict):
    from neox_hf.neox_yaml import translate_neox_args
    from neox_hf.recipe import recipe_from_dict

    return recipe_from_dict(translate_neox_args(args).recipe, source="fuzz")


def test_typed_fuzz_of_every_gpt_neox_key_gives_one_line_refusals_never_a_traceback():
    import copy

    from neox_hf.errors import NeoXHFError
    from neox_hf.neox_yaml import read_neox_files

    assert len(SHARED_NEOX_CONFIGS) >= 20, SHARED_NEOX_CONFIGS
    cases, bases, tracebacks, refused = _typed_fuzz_cases(), {}, [], 0
    assert len(cases) >= 300 and len({keys[0] for _, keys, _ in cases}) >= 100, len(cases)
    for path, keys, mutant in cases:
        if path not in bases:
            bases[path] = read_neox_files([path])
        args = copy.deepcopy(bases[path])
        place = args
        for key in keys[:-1]:
            place = place[key]
        place[keys[-1]] = mutant
        try:
            _translate_and_validate(args)
        except NeoXHFError as err:
            refused += 1
            if "\n" in str(err) or not str(err):
                tracebacks.append((path.name, keys, mutant, f"not one line: {err!r}"))
        except Exception as err:  # noqa: BLE001 — the point: nothing else may escape
            tracebacks.append((path.name, keys, mutant, f"{type(err).__name__}: {err}"))
    assert not tracebacks, f"{len(tracebacks)} of {len(cases)}: {tracebacks[:5]}"
    assert refused >= len(cases) // 3, (refused, len(cases))  # most mutants are refused, not silently translated


NEOX_KNOWN_BAD_VALUES = [
    ("betas-one-number", {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9]}}},
     "`optimizer.params.betas: [0.9]` must be a list of two numbers"),
    ("betas-a-number", {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": 0.9}}},
     "`optimizer.params.betas: 0.9` must be a list of two numbers"),
    ("optimizer-a-string", {"optimizer": "Lion"}, "`optimizer: 'Lion'` must be a mapping"),
    ("zero-stage-list", {"zero_optimization": {"stage": [1]}}, "zero_optimization.stage"),
    ("split-words", {"data_path": "corpus", "split": "most,some"}, "`split: 'most,some'`"),
    ("attention-config-number", {"attention_config": 0.9}, "`attention_config: 0.9` must be a list"),
]


@pytest.mark.parametrize("values,needle", [c[1:] for c in NEOX_KNOWN_BAD_VALUES],
                         ids=[c[0] for c in NEOX_KNOWN_BAD_VALUES])
def test_known_bad_gpt_neox_values_are_refused_through_the_cli(values, needle, tmp_path, capsys):
    config = {"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 32,
              "max-position-embeddings": 32, "train_micro_batch_size_per_gpu": 1, **values}
    path = tmp_path / "neox.yml"
    path.write_text(json.dumps(config))
    assert_one_line_error(*run_train([str(path), "--print-config"], capsys), needle)


@pytest.mark.parametrize("name", ["mamba/mamba-130M.yml", "mamba/mamba-1.4B.yml", "rwkv/170M.yml"])
def test_gpt_neox_mamba_and_rwkv_configs_are_refused_naming_the_architecture(name, capsys):
    path = REPO.parent / "shared" / "data" / "neox-other-arch-configs" / name
    architecture = "RWKV" if name.startswith("rwkv") else "Mamba"
    code, err = run_train([str(path), "--print-config"], capsys)
    assert_one_line_error(code, err, f"builds {architecture}")
    assert "silu" not in err
