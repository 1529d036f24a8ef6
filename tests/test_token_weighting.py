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

# name: worker `--runs` spec. Every configuration of one process count trains in one worker invocation, one after
# the other (the worker resets Accelerate between them, each run starts from the saved model and the recipe's seed):
# start-up (~10 s a process, ~20 s a launch of two on 2 cores) is most of the cost, the 3 steps well under a second.
# Before: 6 one-process runs and 4 launches; now 1 of each.
ONE_PROCESS = {
    "ref-plain": "micro=8,acc=1", "ref-sft": "micro=8,acc=1,sft",  # the reference: one big batch
    "acc2-plain": "micro=4,acc=2", "acc2-sft": "micro=4,acc=2,sft",
    "mb-plain": "micro=4,acc=2,norm=micro_batch", "mb-sft": "micro=4,acc=2,norm=micro_batch,sft",
}
TWO_PROCESSES = {  # DeepSpeed, launched: data parallel 2 × micro 4, then tensor parallel 2 with accumulation 2
    "dp2-plain": "micro=4,acc=1", "dp2-sft": "micro=4,acc=1,sft",
    "tp2-plain": "micro=4,acc=2,tp=2", "tp2-sft": "micro=4,acc=2,tp=2,sft",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_gpt_neox(tmp_path_factory.mktemp("tw_model"))


def _env():
    return launch_env(PYTHONPATH=str(REPO))


def _specs(runs: dict) -> list[str]:
    return [f"{name}={spec}" for name, spec in runs.items()]


@pytest.fixture(scope="module")
def one_process(model_dir, tmp_path_factory):
    """(output folder, finished process) of all ONE_PROCESS runs, trained in one `python` worker process."""
    out = tmp_path_factory.mktemp("tw_one")
    done = subprocess.run([sys.executable, str(WORKER), str(model_dir), str(out), "--runs", *_specs(ONE_PROCESS)],
                          env=_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    return ONE_PROCESS, out, done


@pytest.fixture(scope="module")
def launched(model_dir, tmp_path_factory):
    """(output folder, finished launch) of all TWO_PROCESSES runs, trained in one 2-process `accelerate launch`."""
    out = tmp_path_factory.mktemp("tw_two")
    command = accelerate_launch_command(WORKER, model_dir, out, "--runs", *_specs(TWO_PROCESSES), num_processes=2)
    done = subprocess.run(command, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=900)
    return TWO_PROCESSES, out, done


def _result(runs, name):
    """One run's (per-step losses, final weights); fails naming the run where it did not finish."""
    table, out, done = runs
    assert (out / name / "weights.pt").is_file(), (f"run {name} did not finish (the worker stops at the first run "
                                                   "that fails; its error ends the output below): "
                                                   + done.stderr[-4000:])
    if name == list(table)[-1]:  # the process trained every run of its table and ended cleanly
        assert done.returncode == 0, f"run {name}: " + done.stderr[-4000:]
    return step_losses(out / name), torch.load(out / name / "weights.pt")


def assert_same(result, reference, name):
    (losses, weights), (ref_losses, ref_weights) = result, reference
    assert sorted(losses) == sorted(ref_losses) == [1, 2, 3], (name, losses, ref_losses)
    assert max(abs(losses[s] - ref_losses[s]) for s in ref_losses) <= LOSS_TOL, (name, losses, ref_losses)
    assert set(weights) == set(ref_weights), name
    worst = max(ref_weights, key=lambda k: (weights[k] - ref_weights[k]).abs().max())
    assert (weights[worst] - ref_weights[worst]).abs().max() <= WEIGHT_TOL, (name, worst)


@pytest.fixture(scope="module", params=["plain", "sft"])
def reference(request, one_process):
    """(variant, reference result): micro 8 × accumulation 1, plain or prompt-masked (SFT) batches."""
    return request.param, _result(one_process, f"ref-{request.param}")


def test_accumulation_weighs_tokens_like_one_big_batch(one_process, reference):
    variant, ref = reference
    name = f"acc2-{variant}"
    assert_same(_result(one_process, name), ref, name)


def test_gpt_neox_micro_batch_normalisation_differs_on_the_same_data(one_process, reference):
    variant, (ref_losses, _) = reference
    name = f"mb-{variant}"
    losses, _ = _result(one_process, name)
    # the short micro-batch's mean weighs as much as the long one's
    assert abs(losses[1] - ref_losses[1]) > 1e-3, (name, losses[1], ref_losses[1])


def test_data_parallel_ranks_weigh_tokens_like_one_big_batch(launched, reference):
    variant, ref = reference
    name = f"dp2-{variant}"
    assert_same(_result(launched, name), ref, name)


def test_tensor_parallel_with_accumulation_weighs_tokens_like_one_big_batch(launched, reference):
    variant, ref = reference
    name = f"tp2-{variant}"
    assert_same(_result(launched, name), ref, name)
