"""fp16 overflow-skipped steps, on every machine: the loop's logger, schedule and guards given a skipped step's real
result (an infinite gradient norm, sometimes an infinite loss), as DeepSpeed's dynamic loss scaler reports it.

Only DeepSpeed's fp16 kernels are hardware-gated (AVX512-FP16 / AMX CPUs, GPUs): the end-to-end twins of these tests,
in tests/test_zero_equivalence.py, run where they exist. What happens to a skipped step after the kernel is ours and is
checked here wherever the suite runs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from neox_hf.errors import TrainingDiverged
from neox_hf.recipe import recipe_from_dict
from neox_hf.checkpoint import TrainState
from neox_hf.train.guards import OverflowGuard
from neox_hf.train.loop import History, StepLogger, TrainingRun, _advance_schedule
from neox_hf.train.schedule import build_lr_scheduler
from neox_hf.parallel.layout import StepResult


def _train_log(run) -> list[dict]:
    """train_log.jsonl, parsed strictly: NaN / Infinity (which Python's json writes by default) are refused."""
    def refuse(constant):
        raise ValueError(f"non-finite JSON constant {constant}")

    lines = (Path(run.recipe.output.dir) / "train_log.jsonl").read_text().splitlines()
    return [json.loads(line, parse_constant=refuse) for line in lines]


@pytest.fixture
def run(tmp_path, fresh_accelerate_state):
    """A one-process run's real Accelerator, optimizer and LR schedule (warm-up, so every applied step moves the LR)."""
    from accelerate import Accelerator

    recipe = recipe_from_dict({"train": {"train_iters": 10, "lr": 1e-3, "min_lr": 1e-4, "warmup": 0.5,
                                         "max_skipped_steps_in_a_row": 3, "precision": "fp32"},
                               "output": {"dir": str(tmp_path / "run"), "tensorboard": False}})
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.train.lr)
    scheduler = build_lr_scheduler(optimizer, recipe.train)
    return TrainingRun(Accelerator(cpu=True), recipe, model, optimizer, scheduler, loader=[], eval_batches=[])


def _result(loss: float, grad_norm: float, skipped: bool) -> StepResult:
    return StepResult(loss=torch.tensor(loss), tokens=torch.tensor(64), samples=torch.tensor(4),
                      grad_norm=torch.tensor(grad_norm), skipped=skipped)


def _take_steps(run, state, logger, steps: list[tuple[StepResult, float]]) -> list[float]:
    """The loop's bookkeeping for each (result, loss scale after it): LR schedule, log record. Returns the LRs used."""
    lrs = []
    for result, scale in steps:
        lr = _advance_schedule(run, state, result)
        logger.record(result, lr, scale, data_wait=0.0)
        lrs.append(lr)
    return lrs


def test_a_skipped_step_is_logged_in_strict_json_the_lr_held_and_the_run_goes_on(run):
    state = TrainState()
    logger = StepLogger(run, state, History())
    lrs = _take_steps(run, state, logger, [
        (_result(10.9, math.inf, skipped=True), 2.0**16),  # gradients overflowed: no update
        (_result(math.inf, math.nan, skipped=True), 2.0**15),  # the loss itself overflowed fp16
        (_result(10.8, 3.5, skipped=False), 2.0**15),
        (_result(10.6, 3.1, skipped=False), 2.0**15),
    ])
    logger.flush()  # the crash was here: json.dumps(..., allow_nan=False) of the infinite grad_norm

    log = _train_log(run)
    assert [entry["step"] for entry in log] == [1, 2, 3, 4]
    assert [entry["skipped"] for entry in log] == [True, True, False, False]
    assert [entry["loss_scale"] for entry in log] == [2.0**16, 2.0**15, 2.0**15, 2.0**15]
    assert "grad_norm" not in log[0] and "grad_norm" not in log[1] and log[2]["grad_norm"] == pytest.approx(3.5)
    assert log[0]["loss"] == pytest.approx(10.9) and log[1]["loss"] is None
    # As GPT-NeoX: the schedule does not advance over skipped steps, so the first applied step uses the step-1 LR.
    assert lrs[0] == lrs[1] == lrs[2] < lrs[3]
    assert state.step == 4 and state.skipped_steps == 2
    assert state.consumed_samples == 16  # skipped steps consumed their data, as in GPT-NeoX


def test_a_non_finite_loss_on_an_applied_step_still_stops_the_run(run):
    state = TrainState()
    logger = StepLogger(run, state, History())
    _take_steps(run, state, logger, [(_result(10.9, 3.0, skipped=False), 2.0**16),
                                     (_result(math.nan, 3.0, skipped=False), 2.0**16)])
    with pytest.raises(TrainingDiverged, match=r"diverged at step 2 \(loss nan\)"):
        logger.flush()


def test_overflow_guard_stops_when_a_skip_leaves_the_loss_scale_at_its_floor_after_writing_the_log(run):
    state = TrainState()
    logger = StepLogger(run, state, History())
    guard = OverflowGuard(100, floor=1.0, output_dir=run.recipe.output.dir)
    steps = [(_result(10.9, math.inf, True), 4.0), (_result(10.9, 2.0, False), 4.0),
             (_result(10.9, math.inf, True), 2.0), (_result(10.9, math.inf, True), 1.0)]
    with pytest.raises(TrainingDiverged) as stopped:
        for result, scale in steps:
            _take_steps(run, state, logger, [(result, scale)])
            guard.after_step(state.step, result.skipped, scale, flush=logger.flush)
    message = str(stopped.value)
    assert "loss scale fell to its floor (1) at step 4" in message and "bf16" in message and "\n" not in message
    assert [entry["step"] for entry in _train_log(run)] == [1, 2, 3, 4]


def test_overflow_guard_counts_skips_in_a_row_and_an_applied_step_resets_the_count():
    guard = OverflowGuard(3, floor=None)  # torch's GradScaler has no floor
    for step in range(1, 4):
        guard.after_step(step, True, 2.0**-step)
    guard.after_step(4, False, 2.0**-3)  # applied: the count starts again
    for step in range(5, 8):
        guard.after_step(step, True, 2.0**-step)
    with pytest.raises(TrainingDiverged, match=r"step 8 was the 4th fp16 overflow-skipped step in a row \(more than "
                                               r"`train.max_skipped_steps_in_a_row` 3\)"):
        guard.after_step(8, True, 2.0**-8)


def test_max_skipped_steps_in_a_row_is_validated():
    from neox_hf.errors import RecipeError

    with pytest.raises(RecipeError, match=r"max_skipped_steps_in_a_row` must be ≥ 1, got 0"):
        recipe_from_dict({"train": {"max_skipped_steps_in_a_row": 0}})


def test_a_fused_optimizer_step_the_grad_scaler_skipped_is_seen_as_skipped():
    """fp16 without DeepSpeed (torch AMP): with the fused AdamW GradScaler always calls optimizer.step() and the kernel
    skips the update itself, so a 'was step() called' test (Accelerate's optimizer_step_was_skipped) says applied.
    The scaler's back-off is what tells. The CPU GradScaler runs the same logic as the CUDA one."""
    from neox_hf.engines.scaler import scaler_backed_off

    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([param], lr=0.1, fused=True)
    calls = []
    optimizer.register_step_post_hook(lambda *_: calls.append(1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)

    def step(loss_factor: float) -> bool:
        before = float(scaler.get_scale())
        optimizer.zero_grad()
        scaler.scale(param.sum() * loss_factor).backward()
        scaler.step(optimizer)
        scaler.update()
        return scaler_backed_off(scaler, before)

    assert step(float("inf")) is True
    assert calls == [1] and torch.equal(param.detach(), torch.ones(4))  # step() ran, nothing was updated
    assert step(1.0) is False and not torch.equal(param.detach(), torch.ones(4))
