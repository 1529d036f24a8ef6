"""GPT-NeoX configs mean here what they mean in GPT-NeoX: the run's seed orders the data wherever the data path comes
from, train_batch_size follows GPT-NeoX's batch rule, and a key GPT-NeoX would refuse is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

import neox_order_reference as ref
from test_neox_order import ACC, DP, ITERS, MICRO, SEQ, corpus, write_neox_config  # noqa: F401  (corpus: fixture)

from neox_hf.batches import recipe_for_batches, step_batches
from neox_hf.errors import RecipeError
from neox_hf.neox_yaml import load_neox_recipe_dict, translate_neox_args
from neox_hf.recipe import recipe_from_dict
from neox_hf.recipe.args import parse_run_args
from tests.conftest import SHARED_DATA


def without_key(config: str, key: str, out) -> str:
    """The GPT-NeoX config `config` with `key` removed (JSON is a GPT-NeoX config too)."""
    raw = yaml.safe_load(open(config).read())
    del raw[key]
    out.write_text(json.dumps(raw))
    return str(out)


def test_config_seed_orders_the_batches_when_the_data_path_comes_from_the_command_line(tmp_path, corpus):  # noqa: F811
    prefix, docs = corpus
    written = write_neox_config(tmp_path, prefix, seed=42)
    pathless = without_key(written, "data-path", tmp_path / "pathless.yml")
    expected = ref.train_rows(docs, "969,30,1", ITERS, MICRO * ACC * DP, SEQ, seed=42)

    def rows(recipe):
        return step_batches(recipe, DP, 0, ITERS)

    np.testing.assert_array_equal(rows(recipe_for_batches([written], None, None)), expected)
    # `neox_hf batches CONFIG --data-path PREFIX`
    np.testing.assert_array_equal(rows(recipe_for_batches([pathless], prefix, None)), expected)
    # run_clm_neox.py CONFIG --data.sources ...: the config's seed, not the recipe default
    recipe = parse_run_args([pathless, "--data.sources", f"[{{path: {prefix}, format: indexed}}]",
                             "--data.order", "gpt-neox", "--data.split", "969,30,1"]).recipe
    assert (recipe.data.seed, recipe.train.seed) == (42, 42)
    np.testing.assert_array_equal(rows(recipe), expected)


# Every GPT-NeoX data key that shapes the sample order, set away from its default (weights: over two corpora)
ORDER_KEYS = {
    "seed": {"seed": 42},
    "split": {"split": "80,15,5"},
    "seq_length": {"seq-length": SEQ // 2, "max-position-embeddings": SEQ // 2},
    "pack_impl": {"pack_impl": "pack_until_overflow"},
    "allow_chopped": {"pack_impl": "unpacked", "allow_chopped": False},
    "weights": {"train_data_weights": [3, 1]},
}


@pytest.mark.parametrize("key", sorted(ORDER_KEYS))
def test_every_order_key_of_the_config_applies_to_data_given_on_the_command_line(tmp_path, corpus, key):  # noqa: F811
    """The batches of a config naming its data = those of the same config with the data on the command line
    (`neox_hf batches --data-path`, `--data.sources`), key by key; and the key changes them (else the test is void)."""
    prefix, _ = corpus
    second = ref_corpus(tmp_path)
    base = {"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": SEQ,
            "max-position-embeddings": SEQ, "train-iters": ITERS, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": ACC, "seed": 1234, "tokenizer_type": "HFTokenizer"}
    paths = [prefix, second] if key == "weights" else [prefix]
    naming = {"train_data_paths": paths} if key == "weights" else {"data-path": prefix}

    def config(name, **keys):
        path = tmp_path / f"{name}.yml"
        path.write_text(json.dumps({**base, **keys}))
        return str(path)

    def rows(recipe):
        # GPT-NeoX's cache names hold no split bounds: a cache left by another run would hide a dropped split
        for cache in tmp_path.glob("*_indexmap_*.npy"):
            cache.unlink()
        return step_batches(recipe, DP, 0, ITERS)

    expected = rows(recipe_for_batches([config("named", **naming, **ORDER_KEYS[key])], None, None))
    default = {"train_data_weights": [1, 1]} if key == "weights" else {}
    assert not np.array_equal(expected, rows(recipe_for_batches([config("default", **naming, **default)], None, None)))
    pathless = config("pathless", **ORDER_KEYS[key])
    sources = json.dumps([{"path": p, "format": "indexed"} for p in paths])
    recipe = parse_run_args([pathless, "--data.sources", sources, "--data.order", "gpt-neox"]).recipe
    np.testing.assert_array_equal(rows(recipe), expected)  # run_clm_neox.py CONFIG --data.sources ...
    if len(paths) == 1:  # neox_hf batches CONFIG --data-path PREFIX
        np.testing.assert_array_equal(rows(recipe_for_batches([pathless], prefix, None)), expected)


def ref_corpus(tmp_path) -> str:
    from test_neox_order import random_docs, write_corpus

    return write_corpus(tmp_path / "second_text_document", random_docs(40, seed=9))


def test_data_path_on_the_command_line_is_gpt_neox_s_data_path_whatever_the_config_names(tmp_path, corpus):  # noqa: F811
    """`--data-path P` is GPT-NeoX's data_path: split by the config's `split` (its default where it has none), also
    where the config itself names train_data_paths (which GPT-NeoX does not split)."""
    prefix, _ = corpus
    base = {"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": SEQ,
            "max-position-embeddings": SEQ, "train-iters": ITERS, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": ACC, "tokenizer_type": "HFTokenizer"}
    named, listed = tmp_path / "named.yml", tmp_path / "listed.yml"
    named.write_text(json.dumps({**base, "data-path": prefix}))
    listed.write_text(json.dumps({**base, "train_data_paths": [prefix]}))
    expected = recipe_for_batches([str(named)], None, None)
    assert expected.data.split == "969, 30, 1"
    assert recipe_for_batches([str(listed)], None, None).data.split is None  # train_data_paths: not split
    assert recipe_for_batches([str(listed)], prefix, None).data.split == "969, 30, 1"


def test_weights_without_data_must_match_the_command_line_s_sources(tmp_path, corpus):  # noqa: F811
    prefix, _ = corpus
    path = tmp_path / "weights.yml"
    path.write_text(json.dumps({"num-layers": 2, "train_data_weights": [3, 1]}))
    with pytest.raises(RecipeError, match="train_data_weights has 2 entries but the command line gives 1"):
        parse_run_args([str(path), "--data.sources", f"[{{path: {prefix}, format: indexed}}]"])


def neox_file(tmp_path, text: str, name: str = "run.yml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text,closest", [
    ('{"num-layer": 2, "hidden-size": 64, "num-attention-heads": 4}', "`num-layers`"),
    ('{"num_layers": 2, "hiden_size": 64}', "`hidden_size`"),
    ('{"num_layers": 2, "train_micro_batch_size_per_gp": 4}', "`train_micro_batch_size_per_gpu`"),
])
def test_a_key_gpt_neox_does_not_know_is_refused_naming_the_closest(tmp_path, text, closest):
    # GPT-NeoX's NeoXArgs refuses an unknown key; a note at start-up would train a different model (2 layers → 6)
    with pytest.raises(RecipeError, match=f"did you mean {closest}"):
        parse_run_args([neox_file(tmp_path, text)])


def test_gpt_neox_keys_without_a_counterpart_here_stay_notes(tmp_path):
    text = ('{"num_layers": 2, "finetune": true, "log_dir": "logs", "text_gen_type": "unconditional",'
            ' "gptj_residual": false}')
    notices = parse_run_args([neox_file(tmp_path, text)]).notices
    assert any("log_dir" in n for n in notices)  # no effect here
    untranslated = next(n for n in notices if "finetune" in n)
    assert "text_gen_type" in untranslated and "gptj_residual" in untranslated  # an older GPT-NeoX's name is known too


@pytest.mark.parametrize("path", sorted(SHARED_DATA.glob("neox*-configs/**/*.yml")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_gpt_neox_config_uses_only_known_keys(path):
    try:
        load_neox_recipe_dict([path])
    except RecipeError as err:  # refused for its architecture (Mamba and RWKV by name), never for an unknown key
        assert ("is not supported by neox_hf" in str(err) or "neox_hf trains transformers only" in str(err)) and \
            "did you mean" not in str(err), err


# ----------------------------------------------------------------------------------------------------------------
# train_batch_size: GPT-NeoX's batch rule
# ----------------------------------------------------------------------------------------------------------------

ABSENT = object()  # the key is not in the config (gradient_accumulation_steps then defaults to 1 in GPT-NeoX)


def gpt_neox_batch(dp: int, train_batch, micro, accumulation):
    """(micro, accumulation) GPT-NeoX trains with on `dp` data-parallel ranks, or None where it refuses the config:
    NeoXArgs.calculate_batch_parameters then check_batch_parameters (megatron/neox_arguments/arguments.py), written
    out branch by branch; NeoXArgs' default gradient_accumulation_steps is 1, None only when the config says null."""
    tb, mb = (None if v is ABSENT else v for v in (train_batch, micro))
    gas = 1 if accumulation is ABSENT else accumulation
    if tb is not None and mb is not None and gas is not None:
        pass
    elif tb is not None and mb is not None:
        gas = tb // mb // dp
    elif tb is not None and gas is not None:
        mb = tb // dp // gas
    elif mb is not None and gas is not None:
        tb = mb * gas * dp
    elif tb is not None:
        gas, mb = 1, tb // dp
    elif mb is not None:
        tb, gas = mb * dp, 1
    else:
        return None
    if min(tb, mb, gas) <= 0 or tb != mb * gas * dp:
        return None
    return mb, gas


def batch_args(train_batch, micro, accumulation, **layout) -> dict:
    args = {"train_batch_size": train_batch, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accumulation, **layout}
    return {k: v for k, v in args.items() if v is not ABSENT}


def translated_batch(args: dict):
    """(micro, accumulation) of the translation, None when it refuses, and its notices."""
    try:
        translation = translate_neox_args(args)
    except RecipeError:
        return None, []
    train = recipe_from_dict(translation.recipe).train
    return (train.micro_batch_size, train.gradient_accumulation_steps), translation.notices


TRIPLES = [(tb, mb, gas) for tb in (ABSENT, 30, 32, 64) for mb in (ABSENT, 4, 8) for gas in (ABSENT, None, 1, 2, 3)
           if not (tb is ABSENT and mb is ABSENT)]  # neither: no batch to derive (a model-only file)


@pytest.mark.parametrize("gpus,model_parallel,pipe", [(1, 1, 0), (4, 1, 1), (8, 2, 1), (16, 2, 2)])
def test_batch_follows_gpt_neox_when_the_config_fixes_the_gpu_count(gpus, model_parallel, pipe):
    dp = gpus // (model_parallel * max(pipe, 1))
    layout = {"global_num_gpus": gpus, "model_parallel_size": model_parallel, "pipe_parallel_size": pipe}
    for triple in TRIPLES:
        got, _ = translated_batch(batch_args(*triple, **layout))
        assert got == gpt_neox_batch(dp, *triple), (triple, dp)


def test_the_issue_s_config_and_gpu_counts_from_num_gpus_and_num_nodes():
    # micro 8, train_batch_size 32: GPT-NeoX runs it on 4 data-parallel GPUs with accumulation 1, refuses it on one
    assert translated_batch(batch_args(32, 8, ABSENT))[0] == (8, 1)
    assert translated_batch(batch_args(32, 8, ABSENT, global_num_gpus=1))[0] is None
    assert translated_batch(batch_args(32, 8, None, global_num_gpus=1))[0] == (8, 4)  # accumulation derived
    assert translated_batch(batch_args(32, 8, None, num_gpus=2, num_nodes=2))[0] == (8, 1)
    with pytest.raises(RecipeError, match="global_num_gpus"):  # 6 GPUs cannot hold pipeline 4 replicas
        translate_neox_args(batch_args(32, 8, ABSENT, global_num_gpus=6, pipe_parallel_size=4))
    with pytest.raises(RecipeError, match="train_batch_size 30"):
        translate_neox_args(batch_args(30, 8, ABSENT))


# ----------------------------------------------------------------------------------------------------------------
# train_batch_size where the data-parallel size is known: the launch, `neox_hf plan --gpus`, `neox_hf batches`
# ----------------------------------------------------------------------------------------------------------------

# Issue 45's config: GPT-NeoX runs it only on 4 data-parallel GPUs (gradient_accumulation_steps absent: 1).
BATCH_CONFIG = {"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": SEQ,
                "max-position-embeddings": SEQ, "train-iters": 2, "train_micro_batch_size_per_gpu": 8,
                "train_batch_size": 32, "split": "969,30,1", "seed": 1234, "tokenizer_type": "HFTokenizer"}
# fp32, no dropout, every step logged: the runs below compare losses
RUN_OVERRIDES = ["--train.eval_iters", "0", "--train.log_interval", "1", "--train.precision", "fp32",
                 "--output.tensorboard", "false", "--model.hidden_dropout", "0", "--model.attention_dropout", "0"]


@pytest.fixture(scope="module")
def batch_config(tmp_path_factory) -> str:
    from test_neox_order import random_docs, write_corpus

    folder = tmp_path_factory.mktemp("batch32")
    prefix = write_corpus(folder / "corpus_text_document", random_docs(300, seed=5, max_len=40))
    path = folder / "batch32.yml"
    path.write_text(json.dumps({**BATCH_CONFIG, "data-path": prefix}))
    return str(path)


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_a_one_process_launch_of_a_config_gpt_neox_runs_on_four_is_refused(batch_config, tmp_path, capsys,
                                                                          fresh_accelerate_state):
    from neox_hf.cli import train_main as main

    assert main([batch_config, *RUN_OVERRIDES, "--output.dir", str(tmp_path / "run")]) == 2
    line = _error_line(capsys)
    # the three numbers, and both fixes
    assert "train_batch_size 32 is not micro batch 8 × gradient_accumulation_steps 1 × 1 data-parallel" in line, line
    assert "--num_processes 4 run_clm_neox.py" in line and "--train.gradient_accumulation_steps 4" in line, line
    assert not (tmp_path / "run" / "train_log.jsonl").exists()
    # an accumulation that no data-parallel size makes 32 is refused before any launch question
    assert main([batch_config, *RUN_OVERRIDES, "--train.gradient_accumulation_steps", "3",
                 "--output.dir", str(tmp_path / "run3")]) == 2
    assert "any number of data-parallel processes" in _error_line(capsys)
    # outside a launch, --print-config keeps the note saying what the launch must be
    assert main([batch_config, "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "train_batch_size: 32" in printed and "GPT-NeoX runs this config only on 4" in printed, printed
    assert "pipe 1 × tensor 1 × data 4, ZeRO-0, micro 8 × accumulation 1" in printed, printed  # the plan line


@pytest.fixture(scope="module")
def batch_runs(batch_config, tmp_path_factory) -> dict[str, tuple]:
    """name → (output folder, what rank 0 printed): the config on 4 data-parallel processes (one launch), and on one
    process with the accumulation that keeps its batch (in this process)."""
    import shlex

    from tests.conftest import finish_launch, start_init_layouts, train_in_this_process

    root = tmp_path_factory.mktemp("batch_runs")
    launch = start_init_layouts(root, {"dp4": ""}, batch_config, *RUN_OVERRIDES, num_processes=4)
    accumulated = train_in_this_process([batch_config, *RUN_OVERRIDES, "--train.gradient_accumulation_steps", "4",
                                         "--output.dir", str(root / "accumulated")])
    finish_launch(launch, "the 4-process run of the train_batch_size 32 config")
    return {"dp4": (root / "dp4", (root / "dp4.stdout").read_text()),
            "accumulated": (root / "accumulated", accumulated)}


def test_four_data_parallel_processes_and_the_accumulation_override_train_the_config_s_batch(batch_runs):
    from tests.test_resume import step_losses

    (dp4, dp4_printed), (accumulated, accumulated_printed) = batch_runs["dp4"], batch_runs["accumulated"]
    assert "batch: micro 8 × accumulation 1 × dp 4 = 32 samples/step" in dp4_printed, dp4_printed
    assert "batch: micro 8 × accumulation 4 × dp 1 = 32 samples/step" in accumulated_printed, accumulated_printed
    # GPT-NeoX's order deals the same 32 samples to a step at any layout of 32: the same losses (fp32)
    want, got = step_losses(dp4), step_losses(accumulated)
    assert sorted(want) == sorted(got) == [1, 2]
    for step in want:
        assert abs(want[step] - got[step]) <= 1e-5, (step, want[step], got[step])


def test_plan_and_batches_keep_the_config_s_batch(batch_config, tmp_path, capsys):
    from neox_hf.cli import main

    assert main(["plan", batch_config, "--gpus", "2", "--json"]) == 0
    layouts = json.loads(capsys.readouterr().out)["layouts"]
    assert (layouts[0]["data"], layouts[0]["micro_batch"], layouts[0]["gradient_accumulation_steps"]) == (2, 8, 2)
    assert len(layouts) > 1 and all(
        p["micro_batch"] * p["gradient_accumulation_steps"] * p["data"] == 32 for p in layouts), layouts
    assert main(["plan", batch_config, "--gpus", "8"]) == 2  # micro 8 on 8 replicas is 64 at least
    assert "--gpus 4" in _error_line(capsys)

    out = tmp_path / "steps.npy"
    assert main(["batches", batch_config, "--data-parallel", "2", "--start-step", "0", "--end-step", "1",
                 "--output", str(out)]) == 2
    line = _error_line(capsys)
    assert "1 × 2 data-parallel" in line and "--data-parallel 4" in line and "gradient_accumulation_steps: 2" in line
    assert not out.exists()
    assert main(["batches", batch_config, "--data-parallel", "4", "--start-step", "0", "--end-step", "1",
                 "--output", str(out)]) == 0
    assert np.load(out).shape == (32, SEQ + 1)
