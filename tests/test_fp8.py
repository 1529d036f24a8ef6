"""FP8 (issue 44): GPT-NeoX's `te_fp8_*` keys and `train.precision: fp8` become accelerate's Transformer Engine FP8
recipe where the GPU has FP8 tensor cores, and are refused by name elsewhere — never silently bf16. The CPU tier
covers the translation, the recipe accelerate is handed and the refusal; a GPU with FP8 runs tests/test_cuda.py."""

from __future__ import annotations

import pytest
import torch

from neox_hf.errors import RecipeError
from neox_hf.neox_yaml import translate_neox_args
from neox_hf.parallel.accelerator import check_fp8_supported, fp8_recipe_arguments
from neox_hf.recipe import recipe_from_dict
from test_fuzz_inputs import TINY, assert_one_line_error, run_train

NEOX_FP8 = {"bf16": {"enabled": True}, "te_fp8_format": "e4m3", "te_fp8_margin": 1, "te_fp8_amax_history_len": 16,
            "te_fp8_amax_compute_algo": "max", "te_fp8_wgrad": False}


def test_te_fp8_keys_become_the_fp8_recipe_accelerate_is_handed():
    translation = translate_neox_args(NEOX_FP8)
    train = recipe_from_dict(translation.recipe).train
    assert train.precision == "fp8"
    assert (train.fp8.format, train.fp8.margin, train.fp8.amax_history_len, train.fp8.amax_compute_algo,
            train.fp8.wgrad) == ("E4M3", 1, 16, "max", False)
    assert any("train.precision: fp8" in n and "in place of the config's bf16" in n for n in translation.notices)
    import dataclasses

    from accelerate.utils import TERecipeKwargs

    arguments = fp8_recipe_arguments(train)
    assert set(arguments) == {f.name for f in dataclasses.fields(TERecipeKwargs)}  # every field given
    assert {k: arguments[k] for k in ("fp8_format", "margin", "amax_history_len", "amax_compute_algo",
                                      "override_linear_precision", "use_autocast_during_eval")} == {
        "fp8_format": "E4M3", "margin": 1, "amax_history_len": 16, "amax_compute_algo": "max",
        "override_linear_precision": (False, False, True), "use_autocast_during_eval": False}


def test_without_te_fp8_keys_the_precision_is_the_config_s():
    assert recipe_from_dict(translate_neox_args({"bf16": {"enabled": True}}).recipe).train.precision == "bf16"
    notices = translate_neox_args({"te_columnparallel": True}).notices
    assert any("te_columnparallel" in n and "no effect" in n for n in notices)


@pytest.mark.parametrize("neox,key", [
    ({"te_fp8_mha": True}, "te_fp8_mha"),
    ({"te_fp8_format": "e5m2"}, "te_fp8_format"),
    ({"te_fp8_amax_compute_algo": "mean"}, "te_fp8_amax_compute_algo"),
])
def test_what_accelerate_s_fp8_recipe_cannot_express_is_refused_by_name(neox, key):
    with pytest.raises(RecipeError, match=key):
        translate_neox_args(neox)


@pytest.mark.parametrize("parallel,words", [
    ({"zero_stage": 1}, "DeepSpeed ZeRO"),
    ({"tensor_parallel": 2}, "tensor parallelism"),
])
def test_fp8_with_what_it_was_not_verified_with_is_refused(parallel, words):
    with pytest.raises(RecipeError, match=words):
        recipe_from_dict({"train": {"precision": "fp8"}, "parallel": parallel})


def test_fp8_on_a_machine_without_fp8_is_refused_by_name_never_bf16(tmp_path, capsys, fresh_accelerate_state):
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this GPU has FP8 tensor cores")
    with pytest.raises(RecipeError, match="`train.precision: fp8` cannot run here"):
        check_fp8_supported()
    code, err = run_train([TINY, "--train.precision", "fp8", "--output.dir", str(tmp_path / "o")], capsys)
    assert_one_line_error(code, err, "`train.precision: fp8` cannot run here")
    assert "train.precision: bf16" in err


@pytest.mark.parametrize("gpu,transformer_engine,reason", [
    (None, True, "there is no CUDA GPU here"),
    (("NVIDIA A100-SXM4-80GB", (8, 0)), True, "compute capability 8.0) has no FP8 tensor cores"),
    (("NVIDIA H100 80GB HBM3", (9, 0)), False, "Transformer Engine is not installed"),
    (("NVIDIA L40S", (8, 9)), True, None),
    (("NVIDIA H100 80GB HBM3", (9, 0)), True, None),
])
def test_the_fp8_verdict_for_each_kind_of_machine(gpu, transformer_engine, reason):
    """The decision the GPU-gated tests rely on, asked about other machines on any machine (as the bf16 verdict)."""
    from neox_hf.hardware import fp8_unsupported_reason

    got = fp8_unsupported_reason(gpu, transformer_engine)
    assert got is None if reason is None else reason in got, got
