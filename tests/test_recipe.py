"""Recipes: our YAML, GPT-NeoX's own configs, overrides, --print-config, and errors that name the key."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from neox_hf.errors import RecipeError
from neox_hf.neox_yaml import load_neox_recipe_dict, read_neox_files
from neox_hf.recipe import recipe_from_dict
from neox_hf.recipe.args import parse_run_args
from tests.conftest import REPO, SHARED_DATA, launch_env

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
NEOX_CONFIGS = sorted(SHARED_DATA.glob("neox-configs/**/*.yml"))


def test_every_recipe_file_parses():
    assert len(RECIPES) >= 11
    for path in RECIPES:
        parse_run_args([str(path)])


@pytest.mark.skipif(not NEOX_CONFIGS, reason="shared/data/neox-configs not beside the repo")
@pytest.mark.parametrize("path", NEOX_CONFIGS, ids=lambda p: p.name)
def test_every_gpt_neox_config_parses(path):
    args = parse_run_args([str(path)])
    assert args.recipe.model.num_layers > 0 and args.recipe.train.lr > 0


def test_20b_recipe_matches_gpt_neox_20b():
    r = parse_run_args([str(REPO / "recipes" / "20b.yaml")]).recipe
    m, t, p = r.model, r.train, r.parallel
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (44, 6144, 64, 2048)
    assert m.rotary_pct == 0.25 and m.use_parallel_residual and not m.tie_word_embeddings
    assert (t.lr, t.adam_beta1, t.adam_beta2, t.adam_eps, t.min_lr) == (9.7e-5, 0.9, 0.95, 1e-8, 9.7e-6)
    assert (t.lr_decay_style, t.warmup, t.weight_decay, t.clip_grad) == ("cosine", 0.01, 0.01, 1.0)
    assert (t.micro_batch_size, t.gradient_accumulation_steps, p.zero_stage, p.tensor_parallel) == (4, 32, 1, 2)
    assert (p.pipeline_parallel, p.pipe_partition_method) == (4, "type:transformer")  # GPT-NeoX's 20B layout
    from neox_hf.model.vocab import padded_vocab_size

    assert padded_vocab_size(50277, m.make_vocab_size_divisible_by, p.tensor_parallel) == 50432


@pytest.mark.skipif(not NEOX_CONFIGS, reason="shared/data/neox-configs not beside the repo")
def test_neox_20b_config_translates_architecture_and_says_what_it_changed():
    translation = load_neox_recipe_dict([SHARED_DATA / "neox-configs" / "20B.yml"])
    recipe = recipe_from_dict(translation.recipe)
    assert recipe.model.hidden_act == "gelu_new"  # bias_gelu_fusion computes the tanh GELU
    assert recipe.parallel.tensor_parallel == 2 and recipe.train.precision == "fp16"
    # GPT-NeoX's layout: pipeline 4 × tensor 2 (no longer folded into data-parallel ranks).
    assert (recipe.parallel.pipeline_parallel, recipe.parallel.pipe_partition_method) == (4, "type:transformer")
    assert not any("pipe_parallel_size" in n for n in translation.notices)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_gpt_neox_python_literals_dash_keys_and_merge(tmp_path):
    a = _write(tmp_path, "a.yml", '{\n  # model\n  "num-layers": 2, "hidden_size": 64, "num-attention-heads": 4,\n  "gpt_j_residual": True,\n}\n')
    b = _write(tmp_path, "b.yml", '{"seq-length": 32, "optimizer": {"type": "Adam", "params": {"lr": 3.0e-4, "betas": [0.9, 0.99],}},}')
    recipe = parse_run_args([str(a), str(b)]).recipe
    assert (recipe.model.num_layers, recipe.model.seq_length, recipe.train.lr, recipe.train.adam_beta2) == (2, 32, 3e-4, 0.99)
    dup = _write(tmp_path, "dup.yml", '{"num_layers": 4}')
    with pytest.raises(RecipeError, match="num_layers.*already set"):
        read_neox_files([a, dup])


@pytest.mark.parametrize(
    "text,key",
    [
        ('{"num_layers": 2, "pos_emb": "alibi"}', "pos_emb"),
        ('{"num_layers": 2, "norm": "rmsnorm"}', "norm"),
        ('{"num_layers": 2, "activation": "swiglu"}', "activation"),
        ('{"num_layers": 2, "attention_config": [[["sparse_fixed"], 2]]}', "attention_config"),
        ('{"num_layers": 2, "optimizer": {"type": "madgrad_wd"}}', "optimizer.type"),
    ],
)
def test_inexpressible_gpt_neox_options_are_refused(tmp_path, text, key):
    path = _write(tmp_path, "bad.yml", text)
    with pytest.raises(RecipeError, match=key):
        parse_run_args([str(path)])


def test_dynamic_padding_switch_maps_to_pad_mode(tmp_path):
    path = _write(tmp_path, "pad.yml", '{"num_layers": 2, "dynamic_padding": true}')
    assert parse_run_args([str(path)]).recipe.data.mode == "pad"


def test_overrides_are_validated_like_the_file():
    tiny = str(REPO / "recipes" / "tiny.yaml")
    recipe = parse_run_args([tiny, "--train.lr", "3e-4", "--parallel.zero_stage=2"]).recipe
    assert recipe.train.lr == 3e-4 and recipe.parallel.zero_stage == 2
    with pytest.raises(RecipeError, match=r"unknown key `train.lrr`; did you mean `lr`"):
        parse_run_args([tiny, "--train.lrr", "1"])
    with pytest.raises(RecipeError, match=r"`train.micro_batch_size` must be int, got 'four'"):
        parse_run_args([tiny, "--train.micro_batch_size", "four"])
    with pytest.raises(RecipeError, match=r"`parallel.zero_stage` must be 0, 1, 2 or 3, got 5"):
        parse_run_args([tiny, "--parallel.zero_stage", "5"])
    with pytest.raises(RecipeError, match=r"`data.mode` = 'padd' is not one of"):
        parse_run_args([tiny, "--data.mode", "padd"])


def test_sequence_parallel_is_checked_against_the_tensor_parallel_size():
    assert recipe_from_dict({"parallel": {"tensor_parallel": 2, "sequence_parallel": True}}).parallel.sequence_parallel
    refusals = [
        ({"parallel": {"sequence_parallel": True}}, r"needs `parallel.tensor_parallel` > 1"),
        ({"model": {"seq_length": 129}, "parallel": {"tensor_parallel": 2, "sequence_parallel": True}},
         r"`model.seq_length` \(129\) divisible by `parallel.tensor_parallel` \(2\)"),
        ({"data": {"mode": "pad", "pad_to_multiple_of": 3}, "parallel": {"tensor_parallel": 2, "sequence_parallel": True}},
         r"`data.pad_to_multiple_of` \(3\) to be a multiple of `parallel.tensor_parallel` \(2\)"),
        ({"data": {"mode": "pad", "max_length": 101}, "parallel": {"tensor_parallel": 2, "sequence_parallel": True}},
         r"`data.max_length` \(101\) divisible"),
    ]
    for settings, message in refusals:
        with pytest.raises(RecipeError, match=message):
            recipe_from_dict(settings)


def test_gpt_neox_sequence_parallel_needs_model_parallelism(tmp_path):
    with_tp = _write(tmp_path, "sp.yml", '{"num_layers": 2, "model_parallel_size": 2, "sequence_parallel": true}')
    assert parse_run_args([str(with_tp)]).recipe.parallel.sequence_parallel
    without = _write(tmp_path, "sp1.yml", '{"num_layers": 2, "model_parallel_size": 1, "sequence_parallel": true}')
    run = parse_run_args([str(without)])
    assert not run.recipe.parallel.sequence_parallel
    assert any("sequence_parallel: true has no effect" in notice for notice in run.notices)


def test_zero3_with_tensor_parallel_is_refused_with_reason():
    with pytest.raises(RecipeError, match="ZeRO-3 partitions every parameter"):
        recipe_from_dict({"parallel": {"zero_stage": 3, "tensor_parallel": 2}})


def test_missing_recipe_file_names_it(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found: .*nope.yaml"):
        parse_run_args([str(tmp_path / "nope.yaml")])


def _run_cli(*args):
    return subprocess.run([sys.executable, str(REPO / "run_clm_neox.py"), *args], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env=launch_env())


def test_print_config_prints_resolved_yaml_and_exits_0():
    done = _run_cli("recipes/tiny.yaml", "--train.lr", "1e-3", "--print-config")
    assert done.returncode == 0, done.stderr
    printed = yaml.safe_load(done.stdout)
    assert printed["train"]["lr"] == 1e-3 and printed["model"]["num_layers"] == 2
    assert recipe_from_dict(printed).train.lr == 1e-3  # the printed recipe is itself a valid recipe


def test_print_config_of_bad_recipe_exits_nonzero_with_the_error():
    done = _run_cli("recipes/tiny.yaml", "--model.hidden_size", "-1", "--print-config")
    assert done.returncode != 0
    assert "model.hidden_size" in done.stderr


@pytest.mark.parametrize("overrides,message", [
    ({"parallel": {"pipeline_parallel": 2, "zero_stage": 2}}, r"zero_stage: 2.*pipeline_parallel > 1.*refused.*zero_stage 1"),
    ({"parallel": {"pipeline_parallel": 2, "zero_stage": 3}}, r"zero_stage: 3.*pipeline_parallel > 1.*refused"),
    ({"parallel": {"pipeline_parallel": 2, "pipe_partition_method": "balanced"}}, r"pipe_partition_method.*'balanced'"),
    ({"parallel": {"pipeline_parallel": 4}, "model": {"num_layers": 2}}, r"num_layers.*\(2\).*pipeline_parallel.*\(4\)"),
    ({"parallel": {"pipeline_parallel": 0}}, r"pipeline_parallel` must be ≥ 1"),
    ({"parallel": {"pipeline_parallel": 2}, "train": {"z_loss": 1e-4}}, r"z_loss.*pipeline_parallel > 1.*not supported"),
])
def test_pipeline_layouts_deepspeed_cannot_run_are_refused_with_the_reason(overrides, message):
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict(overrides)


def test_pipeline_with_zero1_is_accepted():
    recipe = recipe_from_dict({"parallel": {"pipeline_parallel": 2, "zero_stage": 1, "pipe_partition_method": "uniform"}})
    assert (recipe.parallel.pipeline_parallel, recipe.parallel.pipe_partition_method) == (2, "uniform")


# ----------------------------------------------------------------------------------------------------------------
# train.precision: auto
# ----------------------------------------------------------------------------------------------------------------

def test_native_bf16_is_read_from_the_cpu_flags():
    from neox_hf.hardware import native_bf16

    assert native_bf16({"avx2", "avx512f", "avx512_bf16"}) == "this CPU has avx512_bf16"
    assert native_bf16({"avx2", "amx_bf16", "avx512_bf16"}) == "this CPU has amx_bf16"
    assert native_bf16({"avx2", "fma"}) is None  # bf16 emulated: slower than fp32


def _rates(bf16: float, fp32: float):
    """A GEMM-rate measurement giving these FLOP/s (another CPU's: this one's would only compare its own load)."""
    import torch

    return lambda dtype: {torch.bfloat16: bf16, torch.float32: fp32}[dtype]


def _never_measured(dtype):
    raise AssertionError(f"measured {dtype} where the flags decide")


@pytest.mark.parametrize("flags,measure,faster,why", [
    # AVX512-BF16 without AMX: the measured rates decide (an Emerald Rapids VM with AMX hidden measured these two)
    ({"avx2", "avx512f", "avx512_bf16"}, _rates(170e9, 340e9), False,
     r"avx512_bf16 but no AMX, and its bf16 GEMMs measured 170 GFLOP/s against fp32's 340: bf16 is slower"),
    ({"avx2", "avx512f", "avx512_bf16"}, _rates(500e9, 340e9), True, r"avx512_bf16 without AMX.*500 GFLOP/s"),
    ({"avx2", "avx512f", "avx512_bf16"}, _rates(400e9, 340e9), False, r"slower"),  # under the 1.25x margin
    ({"avx2", "avx512_bf16", "amx_bf16"}, _never_measured, True, r"^this CPU has amx_bf16$"),
    ({"avx2", "fma"}, _never_measured, False, r"emulated"),
])
def test_auto_picks_bf16_only_where_it_is_faster(flags, measure, faster, why):
    """Given flags, the verdict is that CPU's on any machine (a GPU's own is read from its compute capability)."""
    from neox_hf.hardware import bf16_verdict
    from neox_hf.recipe.precision import resolve_precision
    from neox_hf.recipe import TrainConfig

    verdict = bf16_verdict(flags, measure=measure)
    assert verdict.faster is faster and re.search(why, verdict.why), verdict
    assert resolve_precision(TrainConfig(precision="auto"), verdict=verdict) == ("bf16" if faster else "fp32")
    assert resolve_precision(TrainConfig(precision="fp32"), verdict=verdict) == "fp32"  # an explicit value stays


def test_the_cpu_flags_variable_decides_without_measuring(monkeypatch):
    """CI's second pass: NEOX_HF_CPU_FLAGS claiming avx512_bf16 takes the bf16 branch on any CPU, an AVX2-only one's
    the fp32 branch; nothing is measured (another CPU's GEMMs cannot be measured here)."""
    import torch

    from neox_hf.hardware import bf16_verdict

    if torch.cuda.is_available():
        pytest.skip("a GPU decides by its compute capability")
    monkeypatch.setenv("NEOX_HF_CPU_FLAGS", "avx2 fma avx512f avx512_bf16")
    assert bf16_verdict(measure=_never_measured) == (True, "this CPU has avx512_bf16 (as NEOX_HF_CPU_FLAGS says)")
    monkeypatch.setenv("NEOX_HF_CPU_FLAGS", "avx2 fma")
    assert not bf16_verdict(measure=_never_measured).faster


def test_auto_precision_is_resolved_into_the_recipe_the_run_reports_and_saves(tmp_path, fresh_accelerate_state):
    from neox_hf.hardware import bf16_verdict
    from neox_hf.parallel.accelerator import build_accelerator

    recipe = recipe_from_dict({"train": {"precision": "auto"}, "output": {"dir": str(tmp_path)}})
    accelerator = build_accelerator(recipe)
    assert recipe.train.precision == ("bf16" if bf16_verdict().faster else "fp32")
    assert accelerator.mixed_precision == ("bf16" if bf16_verdict().faster else "no")
    assert "precision: auto" not in recipe.to_yaml()


def test_auto_is_the_default_but_a_gpt_neox_config_keeps_gpt_neoxs_precision(tmp_path):
    from neox_hf.hardware import bf16_verdict
    from neox_hf.recipe import Recipe

    here = "bf16" if bf16_verdict().faster else "fp32"
    assert Recipe().train.precision == "auto"
    assert recipe_from_dict({}).train.precision == here  # settled while the recipe is built, before validation
    plain = _write(tmp_path, "plain.yml", '{"num_layers": 2}')  # neither fp16 nor bf16: GPT-NeoX trains fp32
    assert parse_run_args([str(plain)]).recipe.train.precision == "fp32"
    bf16 = _write(tmp_path, "bf16.yml", '{"num_layers": 2, "bf16": {"enabled": true}}')
    assert parse_run_args([str(bf16)]).recipe.train.precision == "bf16"
    overridden = parse_run_args([str(plain), "--train.precision", "auto"]).recipe
    assert overridden.train.precision == here
    assert any("`train.precision: auto` chose" in n for n in overridden.settled_notices)


def test_print_config_says_what_auto_chose_and_why(capsys):
    from neox_hf.hardware import bf16_verdict
    from neox_hf.cli import train_main as main

    assert main([str(REPO / "recipes" / "tiny.yaml"), "--print-config"]) == 0
    printed = capsys.readouterr().out
    here = "bf16" if bf16_verdict().faster else "fp32"
    assert yaml.safe_load(printed)["train"]["precision"] == here  # the `# note` lines are YAML comments
    assert f"# note: `train.precision: auto` chose {here} on this device ({bf16_verdict().why})" in printed


def test_flash_attention_with_isolated_documents_in_rows_of_more_than_one_is_refused():
    """transformers' flash-attention path detects packed documents from position_ids only at batch size 1: with more
    rows it would silently attend across the documents isolate_documents separates."""
    settings = {"model": {"attn_implementation": "flash_attention_2"}, "data": {"isolate_documents": True}}
    with pytest.raises(RecipeError, match=r"flash_attention_2.*isolate_documents.*micro_batch_size` 4.*batch of one"):
        recipe_from_dict({**settings, "train": {"micro_batch_size": 4}})
    recipe_from_dict({**settings, "train": {"micro_batch_size": 1, "gradient_accumulation_steps": 4}})
    recipe_from_dict({"model": {"attn_implementation": "sdpa"}, "data": {"isolate_documents": True}})


def test_tf32_is_off_unless_the_recipe_asks(tmp_path, fresh_accelerate_state):
    """`train.tf32` reaches torch's matmul and cuDNN flags (they exist on CPU builds too; only a GPU uses them)."""
    import torch

    from neox_hf.parallel.accelerator import build_accelerator

    try:
        build_accelerator(recipe_from_dict({"train": {"precision": "fp32", "tf32": True}, "output": {"dir": str(tmp_path)}}))
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        build_accelerator(recipe_from_dict({"train": {"precision": "fp32"}, "output": {"dir": str(tmp_path)}}))
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False


def test_print_config_ends_with_the_plans_line_for_the_recipes_layout(capsys):
    """`--print-config` shows what `neox_hf plan` says of the recipe's own layout: memory per rank before launch."""
    from neox_hf.cli import train_main as main

    assert main([str(REPO / "recipes" / "tiny.yaml"), "--print-config", "--parallel.zero_stage", "1"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("# plan: pipe 1 × tensor 1 × data 1, ZeRO-1, micro 8 × accumulation 1") and "GiB per rank" in last
