"""A run from scratch starts from the same weights on every layout: each parameter is drawn from a generator seeded by
the run's seed and its transformers name (`neox_hf.model.modeling.initial_tensor`), whether a rank builds the whole
model, one pipeline stage, or its tensor-parallel slices of it (issue 27)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import BUNDLED_TOKENIZER, REPO, finish_launch, launch_env, start_init_layouts

SEED = 7


def _neox_config(**overrides):
    from neox_hf.model.modeling import NeoXConfig

    return NeoXConfig(**{**dict(vocab_size=256, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                intermediate_size=128, tie_word_embeddings=False), **overrides})


def _llama_config():
    from neox_hf.model.llama import NeoXLlamaConfig

    return NeoXLlamaConfig(vocab_size=256, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=False)


def _whole(config, seed=SEED) -> dict[str, torch.Tensor]:
    from neox_hf.model.spec import model_class_for_config
    from neox_hf.engines.build import model_from_seed

    return model_from_seed(model_class_for_config(config), config, seed).state_dict()


def _as_tp_rank(monkeypatch, rank: int, size: int = 2):
    """Split as TP rank `rank` of `size` without a process group: only the tensors are compared here."""
    import neox_hf.parallel.tensor_parallel as tensor_parallel
    from neox_hf.parallel.layout import Layout

    monkeypatch.setattr(tensor_parallel, "_rank_and_size", lambda group: (rank, size))
    return Layout(tp=size, tp_rank=rank)


def _merged(shards: list[dict[str, torch.Tensor]], prefix: str = "") -> dict[str, torch.Tensor]:
    from neox_hf.parallel.tp_plan import partition_dim

    return {key: tensor if (dim := partition_dim(prefix + key)) is None else torch.cat([s[key] for s in shards], dim)
            for key, tensor in shards[0].items()}


@pytest.mark.parametrize("family", ["gpt_neox", "llama", "gpt_neox_tied"])
def test_whole_model_pipeline_stages_and_tp_shards_start_from_the_same_weights(family, monkeypatch):
    """One process whole = two pipeline stages (each part built alone) = two TP ranks' slices, concatenated; every
    value drawn from the seed and the name, so another seed changes every matrix."""
    from neox_hf.model.spec import model_class_for_config
    from neox_hf.engines.build import model_from_seed
    from neox_hf.parallel.layout import Layout
    from neox_hf.engines.pipeline import StageBuilder
    from neox_hf.engines.pipeline.partition import partition_stages, pipeline_layer_infos

    config = {"gpt_neox": _neox_config, "llama": _llama_config,
              "gpt_neox_tied": lambda: _neox_config(tie_word_embeddings=True)}[family]()
    whole = _whole(config)
    builder = StageBuilder(config, Layout(pp=2), seed=SEED)
    infos, parts = pipeline_layer_infos(config), partition_stages(config, 2)
    staged = {}
    for stage in range(2):
        for info in infos[parts[stage]:parts[stage + 1]]:
            for path in info.paths:
                staged.update({f"{path}.{k}": v for k, v in builder.build(path).state_dict().items()})
    assert staged.keys() <= whole.keys() and whole.keys() - staged.keys() <= {"lm_head.weight"}  # tied: one key
    for key, tensor in staged.items():
        assert torch.equal(tensor, whole[key]), key

    shards = []
    for rank in range(2):
        layout = _as_tp_rank(monkeypatch, rank)
        shards.append(model_from_seed(model_class_for_config(config), config, SEED, layout).state_dict())
    merged = _merged(shards)
    assert merged.keys() == whole.keys()
    for key, tensor in merged.items():
        assert torch.equal(tensor, whole[key]), key

    # a pipeline stage's TP slices: the stage builder splits on meta, then fills its slices from the same draws
    path = builder.spec.layer_path(1)
    stage_shards = []
    for rank in range(2):
        layout = _as_tp_rank(monkeypatch, rank)
        stage_shards.append(StageBuilder(config, layout, seed=SEED).build(path).state_dict())
    for key, tensor in _merged(stage_shards, prefix=f"{path}.").items():
        assert torch.equal(tensor, whole[f"{path}.{key}"]), key

    other = _whole(config, seed=SEED + 1)
    assert all(not torch.equal(other[k], whole[k]) for k in whole if whole[k].ndim == 2)


def test_layout_free_init_keeps_gpt_neox_roles_and_constants():
    """Per-role std (small_init, wang_init for the output projections), ones/zeros for norms and biases, and the
    rotary buffers of transformers' own init."""
    from neox_hf.model.modeling import NeoXForCausalLM
    from neox_hf.model.init import init_std
    from neox_hf.engines.build import model_from_seed

    config = _neox_config(hidden_size=64, intermediate_size=256, num_hidden_layers=2)
    model, stock = model_from_seed(NeoXForCausalLM, config, SEED), NeoXForCausalLM(config)
    for (name, buffer), (_, stock_buffer) in zip(model.named_buffers(), stock.named_buffers(), strict=True):
        assert torch.equal(buffer, stock_buffer), name
    whole, stock = model.state_dict(), stock.state_dict()
    assert whole.keys() == stock.keys()
    small = init_std("small_init", hidden_size=64, num_layers=2)
    wang = init_std("wang_init", hidden_size=64, num_layers=2)
    for key, tensor in whole.items():
        if tensor.ndim == 1:
            assert torch.equal(tensor, stock[key]), key  # norm gains, biases
        else:
            std = wang if key.endswith(("attention.dense.weight", "dense_4h_to_h.weight")) else small
            assert abs(tensor.std().item() - std) < 0.1 * std, key


# --- the real entry point on four layouts ------------------------------------------------------------------------

RUN = ["recipes/tiny.yaml", "--model.hidden_size", "64", "--model.num_layers", "4", "--model.seq_length", "64",
       # GPT-NeoX pads the vocabulary to 128 × TP: pinned so that every layout has the same embedding shape
       "--model.vocab_size", "50432", "--train.train_iters", "1", "--train.lr", "1e-9", "--train.min_lr", "1e-10",
       "--train.eval_iters", "1", "--train.log_interval", "1", "--train.precision", "fp32", "--train.seed", "11",
       "--output.tensorboard", "false", "--data.validation_fraction", "0"]
LAYOUTS = {"dp2": "--parallel.zero_stage 2 --train.micro_batch_size 2",
           "tp2": "--parallel.tensor_parallel 2 --parallel.zero_stage 1 --train.micro_batch_size 4",
           "pp2": "--parallel.pipeline_parallel 2 --parallel.zero_stage 1 --train.micro_batch_size 4",
           # last: transformers keeps treating later models as ZeRO-3 partitioned while a ZeRO-3 config lives
           "zero3": "--parallel.zero_stage 3 --train.micro_batch_size 2"}


def _periodic_validation(path) -> str:
    """Validation documents of 63 tokens + EOD: the packed stream repeats every seq_length tokens, so every sample is
    the same sequence and 2 data-parallel ranks × 2 samples evaluate what 1 process × 4 samples does (a stream is
    split across ranks by documents)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(BUNDLED_TOKENIZER))
    text = tokenizer.decode(tokenizer.encode((REPO / "examples/data/tinyshakespeare.txt").read_text()[:2000]).ids[:63])
    assert len(tokenizer.encode(text).ids) == 63
    path.write_text("".join(json.dumps({"text": text}) + "\n" for _ in range(16)))
    return f"[{{path: {path}}}]"


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """One process (`python run_clm_neox.py`) beside one 2-process launch running DP2 ZeRO-2, TP2, pipeline 2, DP2 ZeRO-3
    through the same entry point (tests/workers/init_layouts.py), all from scratch with the same seed."""
    tmp = tmp_path_factory.mktemp("layout_free_init")
    # the same small file trains too: the tiny step at lr 1e-9 needs no real text, and tokenizing it costs nothing
    sources = _periodic_validation(tmp / "periodic.jsonl")
    run = [*RUN, "--data.sources", sources, "--data.validation", sources]
    one = subprocess.Popen([sys.executable, "run_clm_neox.py", *run, "--train.micro_batch_size", "4",
                            "--output.dir", str(tmp / "one")], cwd=REPO, env=launch_env(), text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    launch = start_init_layouts(tmp, LAYOUTS, *run)
    out, _ = one.communicate(timeout=600)
    assert one.returncode == 0, out[-3000:]
    finish_launch(launch, "the 2-process layouts", timeout=600)
    return tmp


def _step0_eval(folder) -> float:
    lines = [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines()]
    return next(line["eval"]["loss"] for line in lines if line["step"] == 0 and "eval" in line)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_evaluates_and_saves_what_one_process_does_at_step_0(layout_runs, layout):
    """Step-0 eval loss within 1e-6 and the saved stock folders' weights within 1e-6 (one step at lr 1e-9 apart from
    the init), against one process."""
    reference, other = layout_runs / "one", layout_runs / layout
    assert abs(_step0_eval(other) - _step0_eval(reference)) < 1e-6
    expected, got = load_file(reference / "model.safetensors"), load_file(other / "model.safetensors")
    assert got.keys() == expected.keys()
    for key, tensor in expected.items():
        torch.testing.assert_close(got[key], tensor, rtol=0, atol=1e-6, msg=key)
