"""`train.loss_kernel`: which kernel computes the fused head loss. The choice is ours (tested here on every machine);
the library kernels themselves run on CUDA only and are compared with the unfused loss in test_cuda.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from neox_hf.errors import RecipeError
from neox_hf.ops.library_loss import loss_kernel, takes
from neox_hf.recipe import TrainConfig

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def everything_installed(kernel: str) -> bool:
    return True


def only(*names):
    return lambda kernel: kernel in names


@pytest.mark.parametrize("settings,device,tp,available,expected", [
    ({}, CUDA, 1, everything_installed, "liger"),  # auto prefers Liger on CUDA
    ({}, CUDA, 1, only("cce"), "cce"),
    ({"z_loss": 1e-4}, CUDA, 1, only("cce"), "neox"),  # CCE has no z-loss: ours keeps it
    ({"z_loss": 1e-4}, CUDA, 1, everything_installed, "liger"),  # Liger's lse_square_scale is the z-loss
    ({}, CUDA, 2, everything_installed, "neox"),  # the vocab-parallel head is ours
    ({}, CUDA, 1, only(), "neox"),  # nothing installed
    ({}, CPU, 1, everything_installed, "neox"),  # Triton kernels: CUDA only
    ({"fused_cross_entropy": False}, CUDA, 1, everything_installed, "unfused"),
    ({"loss_kernel": "neox"}, CUDA, 1, everything_installed, "neox"),
    ({"loss_kernel": "cce"}, CUDA, 1, everything_installed, "cce"),
])
def test_the_kernel_auto_and_named_choices_take(settings, device, tp, available, expected):
    assert loss_kernel(TrainConfig(**settings), device, tp, available=available) == expected


@pytest.mark.parametrize("settings,device,tp,available,reason", [
    ({"loss_kernel": "liger"}, CPU, 1, everything_installed, "for CUDA GPUs and this run is on cpu"),
    ({"loss_kernel": "liger"}, CUDA, 2, everything_installed, "tensor parallelism 2 splits the head"),
    ({"loss_kernel": "cce", "z_loss": 1e-4}, CUDA, 1, everything_installed, "computes no z-loss"),
    ({"loss_kernel": "liger"}, CUDA, 1, only(), "liger_kernel is not installed"),
])
def test_a_named_library_that_cannot_run_is_refused_naming_why(settings, device, tp, available, reason):
    with pytest.raises(RecipeError, match=reason):
        loss_kernel(TrainConfig(**settings), device, tp, available=available)


def test_a_run_naming_a_library_kernel_on_this_cpu_is_refused_in_one_line(tmp_path, capsys):
    from neox_hf.cli import train_main

    from tests.conftest import REPO

    code = train_main([str(REPO / "recipes" / "tiny.yaml"), "--train.loss_kernel", "liger",
                       "--output.dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for CPUs")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "`train.loss_kernel: liger` cannot run here" in errors[0], err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_library_kernels_take_plain_bias_free_heads_only():
    """A head with a bias, or any module around a linear (LoRA's wrapper, our vocab-parallel head), stays ours."""
    assert takes(nn.Linear(8, 16, bias=False))
    assert not takes(nn.Linear(8, 16, bias=True))
    assert not takes(nn.Sequential(nn.Linear(8, 16, bias=False)))
