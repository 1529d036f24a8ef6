"""Every labelled token weighs the same in a step, whatever layout carries it (issue: the mean of micro-batch means
weighted a token of a short batch ~8× one of a long batch).

Same 8 variable-length examples per step through our real loop: micro 8 × accumulation 1 (the reference),
micro 4 × accumulation 2, data parallel 2 × micro 4 (two processes, DeepSpeed) and tensor parallel 2 with
micro 4 × accumulation 2 → per-step losses ≤ 1e-5 and weights ≤ 1e-4 after 3 fp32 steps; plain and prompt-masked
(SFT) batches. GPT-NeoX's `micro_batch` normalisation is shown to differ on the same data, so the check has teeth.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, accelerate_launch_command, launch_env, save_tiny_gpt_neox
from tests.test_resume import step_losses

WORKER = REPO / "tests" / "workers" / "token_weighting.py"
LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-4
pytestmark = pytest.mark.distributed  # every test runs the loop in worker processes (two of them launched)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_gpt_neox(tmp_path_factory.mktemp("tw_model"))


def _env():
    return launch_env(PYTHONPATH=str(REPO))


def one_process(model_dir, out, *args):
    done = subprocess.run([sys.executable, str(WORKER), str(model_dir), str(out), *args], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return _result(out)


def launched(model_dir, out, processes, *args):
    command = accelerate_launch_command(WORKER, model_dir, out, *args, num_processes=processes)
    done = subprocess.run(command, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return _result(out)


def _result(out):
    return step_losses(out), torch.load(out / "weights.pt")


def assert_same(result, reference):
    (losses, weights), (ref_losses, ref_weights) = result, reference
    assert sorted(losses) == sorted(ref_losses) == [1, 2, 3]
    assert max(abs(losses[s] - ref_losses[s]) for s in ref_losses) <= LOSS_TOL, (losses, ref_losses)
    assert set(weights) == set(ref_weights)
    worst = max(ref_weights, key=lambda k: (weights[k] - ref_weights[k]).abs().max())
    assert (weights[worst] - ref_weights[worst]).abs().max() <= WEIGHT_TOL, worst


@pytest.fixture(scope="module", params=["plain", "sft"])
def reference(request, model_dir, tmp_path_factory):
    sft = ["--sft"] if request.param == "sft" else []
    out = tmp_path_factory.mktemp(f"ref_{request.param}")
    return sft, one_process(model_dir, out, "--micro", "8", "--accumulation", "1", *sft)


def test_accumulation_weighs_tokens_like_one_big_batch(model_dir, reference, tmp_path):
    sft, ref = reference
    assert_same(one_process(model_dir, tmp_path / "acc2", "--micro", "4", "--accumulation", "2", *sft), ref)


def test_gpt_neox_micro_batch_normalisation_differs_on_the_same_data(model_dir, reference, tmp_path):
    sft, (ref_losses, _) = reference
    losses, _ = one_process(model_dir, tmp_path / "mb", "--micro", "4", "--accumulation", "2",
                            "--normalization", "micro_batch", *sft)
    assert abs(losses[1] - ref_losses[1]) > 1e-3  # the short micro-batch's mean weighs as much as the long one's


def test_data_parallel_ranks_weigh_tokens_like_one_big_batch(model_dir, reference, tmp_path):
    sft, ref = reference
    assert_same(launched(model_dir, tmp_path / "dp2", 2, "--micro", "4", "--accumulation", "1", *sft), ref)


def test_tensor_parallel_with_accumulation_weighs_tokens_like_one_big_batch(model_dir, reference, tmp_path):
    sft, ref = reference
    assert_same(launched(model_dir, tmp_path / "tp2", 2, "--micro", "4", "--accumulation", "2", "--tp", "2", *sft), ref)
