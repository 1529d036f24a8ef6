"""The run folder's files: their names (one place) and the writers and readers of `train_log.jsonl`.

`output.dir` holds the model (weights, config, tokenizer, `recipe.yaml`, `run.png`, the card) beside run state:
`checkpoints/`, `hub_steps/`, `runs/` (TensorBoard), `merged/`, `train_log.jsonl` (and the run lock, `guards`).

`train_log.jsonl`: what a run leaves of its progress, one JSON object a line, written by the main process.

Two kinds of line, told apart by their keys:
- a step: `{"step", "loss", "lr", "consumed_samples", "consumed_tokens", "time"[, "skipped", "loss_scale"]}`
  (written by the loop after every optimizer step; `time` is wall-clock seconds, for tokens per second);
- an evaluation: `{"step", "eval": {"loss": ..., "lambada_openai/acc": ...}}` — held-out loss and lm-eval scores.
A resumed run appends again from its checkpoint's step; readers keep the last line of each step. An evaluation line
replaces one of the same step (a resume from the last checkpoint evaluates that step again).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from neox_hf.errors import NeoXHFError
from neox_hf.io import atomic_write_text

LOG_NAME = "train_log.jsonl"
RECIPE_NAME = "recipe.yaml"  # the resolved recipe, beside the weights
PLOT_NAME = "run.png"  # `neox_hf plot`: losses, LR, tokens/s, lm-eval scores
CHECKPOINTS_DIR, HUB_STEPS_DIR, TENSORBOARD_DIR, MERGED_DIR = "checkpoints", "hub_steps", "runs", "merged"
RUN_STATE = (CHECKPOINTS_DIR, HUB_STEPS_DIR, TENSORBOARD_DIR, LOG_NAME, MERGED_DIR)  # what makes a folder a run's


@dataclass
class RunLog:
    steps: list[dict] = field(default_factory=list)  # step lines, one per step (the last written), by step
    evals: list[dict] = field(default_factory=list)  # {"step": N, **values}, one per step, by step


def append_eval_entry(output_dir, step: int, values: dict[str, float]) -> None:
    """One evaluation line: held-out loss and/or lm-eval scores at `step`, replacing an evaluation line of the same
    step a killed run left: the final evaluation is logged after the last checkpoint, so a run killed before its end
    and resumed from that checkpoint evaluates the same step again (a run evaluates a step once)."""
    path = Path(output_dir) / LOG_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"step": step, "eval": values}) + "\n"
    lines = path.read_text().splitlines(keepends=True) if path.is_file() else []
    kept = [old for old in lines if not _is_eval_line_of(old, step)]
    if len(kept) == len(lines):
        with path.open("a") as log_file:
            log_file.write(line)
    else:
        atomic_write_text(path, "".join(old if old.endswith("\n") else f"{old}\n" for old in kept) + line)


def _is_eval_line_of(line: str, step: int) -> bool:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and "eval" in record and record.get("step") == step


def read_run_log(output_dir) -> RunLog:
    """Step and evaluation lines of `OUT/train_log.jsonl`, the last line of each step kept (resumes rewrite)."""
    path = Path(output_dir) / LOG_NAME
    if not path.is_file():
        raise NeoXHFError(f"{path} not found: give the output folder of a neox_hf run (it holds train_log.jsonl)")
    steps: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            # A run killed mid-write leaves a truncated last line; anywhere else it is corruption.
            if number == len(lines):
                continue
            raise NeoXHFError(f"{path}:{number} is not JSON; the log is corrupt (delete the line to plot the rest)")
        if "eval" in record:
            evals[record["step"]] = {**evals.get(record["step"], {}), "step": record["step"], **record["eval"]}
        elif "loss" in record:
            steps[record["step"]] = record
    return RunLog([steps[s] for s in sorted(steps)], [evals[s] for s in sorted(evals)])


def record_evaluation(accelerator, output_dir, step: int, eval_loss: float | None, task_scores: dict[str, float],
                      *, perplexity: bool = True) -> None:
    """Send an evaluation to the trackers and to train_log.jsonl (main process). Every rank may call it.
    `perplexity`: the loss is a per-token cross-entropy (objective lm), so exp(loss) means something."""
    values: dict[str, float] = {}
    if eval_loss is not None:
        values["loss"] = eval_loss
        if perplexity:
            values["perplexity"] = math.exp(min(eval_loss, 50))
    values.update(task_scores)
    if not values:
        return
    accelerator.log({f"eval/{key}": value for key, value in values.items()}, step=step)
    if accelerator.is_main_process:
        append_eval_entry(output_dir, step, values)


def append_step_entries(output_dir, entries: list[dict]) -> None:
    """One JSON line per optimizer step: the exact per-step losses, also across resumes."""
    path = Path(output_dir) / LOG_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as log_file:
        log_file.writelines(step_log_line(entry) + "\n" for entry in entries)


def step_log_line(entry: dict) -> str:
    """One `train_log.jsonl` line; strict JSON (a non-finite value is a bug: `check_finite` runs first, and the entry
    of an overflow-skipped fp16 step leaves its non-finite values out)."""
    return json.dumps(entry, allow_nan=False)


def truncate_train_log(output_dir, step: int) -> int:
    """Drop `train_log.jsonl` lines of steps after `step` (written by a run this one resumes behind, or torn by a
    kill mid-write), so the log holds each step once. Returns the number of lines dropped."""
    path = Path(output_dir) / LOG_NAME
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry_step = json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError, TypeError):
            dropped += 1
            continue
        if entry_step <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        atomic_write_text(path, "".join(f"{line}\n" for line in kept))
    return dropped
