"""Pipeline parallelism: pipeline 2, pipeline 2 × tensor 2 and pipeline 2 × data 2 (ZeRO-1) must train as one process.

The multi-process runs are `accelerate launch --use_deepspeed` of tests/workers/pipe_train.py (DeepSpeed's pipeline
engine on gloo); this process computes the one-process reference on the same micro-batches with stock transformers
and plain AdamW: token-weighted loss over the step's 4 micro-batches, clipping 1.0, the recipe's LR schedule.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import GPTNeoXForCausalLM

from tests.conftest import REPO, accelerate_launch_command

WORKERS = REPO / "tests" / "workers"
sys.path.insert(0, str(WORKERS))
from pipe_common import GAS, STEPS, eval_batches, rank_micro_batches, recipe_dict, tiny_config  # noqa: E402

LOSS_TOL, WEIGHT_TOL, LOGIT_TOL = 1e-5, 1e-3, 1e-4


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                PYTHONPATH=os.pathsep.join([str(REPO), str(WORKERS)]))


def launch(out_dir, model_dir, processes: int, *args, check: bool = True):
    command = accelerate_launch_command(WORKERS / "pipe_train.py", model_dir, out_dir, *args, zero_stage=1,
                                        num_processes=processes)
    done = subprocess.run(command, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    if check:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-5000:]
    return done


def step_log(out_dir) -> dict[int, dict]:
    lines = (out_dir / "train_log.jsonl").read_text().splitlines()
    return {entry["step"]: entry for entry in map(json.loads, lines)}  # a resumed step overwrites its killed copy


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipe_models")
    for name, overrides in {"untied": {}, "tied": {"tie_word_embeddings": True}}.items():
        torch.manual_seed(0)
        GPTNeoXForCausalLM(tiny_config(**overrides)).save_pretrained(root / name)
    return root


def _forward_sums(model, batch) -> tuple[torch.Tensor, int]:
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    logits = model(**inputs, use_cache=False).logits  # with a cache, transformers ignores document position ids
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum")
    return loss, int((batch["labels"] != -100).sum())


def one_process(model_dir, mode: str, tmp_path, dp_for_eval: int = 1):
    """(per-step losses, tokens, eval losses before/after, trained model) of the one-process reference."""
    from neox_hf.recipe import recipe_from_dict
    from neox_hf.train.loop import build_optimizer
    from neox_hf.train.schedule import build_lr_scheduler

    recipe = recipe_from_dict(recipe_dict(tmp_path / "reference"))
    model = GPTNeoXForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = build_optimizer(model, recipe)
    scheduler = build_lr_scheduler(optimizer, recipe.train)
    evals = {"before": _eval(model, mode, dp_for_eval)}
    losses, tokens = {}, {}
    for step in range(1, STEPS + 1):
        micro_batches = rank_micro_batches(step, mode, 0, 1)
        total_tokens = sum(int((mb["labels"] != -100).sum()) for mb in micro_batches)
        step_sum = 0.0
        for mb in micro_batches:
            loss_sum, _ = _forward_sums(model, mb)
            (loss_sum / total_tokens).backward()
            step_sum += loss_sum.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.train.clip_grad)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses[step], tokens[step] = step_sum / total_tokens, total_tokens
    evals["after"] = _eval(model, mode, dp_for_eval)
    return losses, tokens, evals, model


@torch.no_grad()
def _eval(model, mode: str, dp: int) -> float:
    total, count = 0.0, 0
    for rank in range(dp):
        for batch in eval_batches(mode, rank, dp):
            loss_sum, n = _forward_sums(model, batch)
            total, count = total + loss_sum.item(), count + n
    return total / count


def assert_same_training(out_dir, reference, mode: str):
    losses, tokens, evals, model = reference
    log = step_log(out_dir)
    assert sorted(log) == list(range(1, STEPS + 1))
    for step in log:
        assert abs(log[step]["loss"] - losses[step]) <= LOSS_TOL, (step, log[step]["loss"], losses[step])
        assert log[step]["tokens"] == tokens[step] and log[step]["samples"] == GAS * 4 and not log[step]["skipped"]
    got_evals = json.loads((out_dir / "eval.json").read_text())
    for when in ("before", "after"):
        assert abs(got_evals[when] - evals[when]) <= LOSS_TOL, (when, got_evals, evals)
    # The merged folder is a stock GPTNeoX folder, and it is the one-process model.
    folder = out_dir / "final"
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["GPTNeoXForCausalLM"]
    merged = GPTNeoXForCausalLM.from_pretrained(folder, dtype=torch.float32)
    expected = model.state_dict()
    got = merged.state_dict()
    assert sorted(got) == sorted(expected)
    worst = max(expected, key=lambda k: (got[k] - expected[k]).abs().max().item())
    assert (got[worst] - expected[worst]).abs().max().item() <= WEIGHT_TOL, worst
    batch = rank_micro_batches(1, mode, 0, 1)[0]
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    with torch.no_grad():
        assert (merged(**inputs, use_cache=False).logits - model(**inputs, use_cache=False).logits).abs().max().item() <= LOGIT_TOL


@pytest.fixture(scope="module")
def pp2_run(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("pp2")
    launch(out, models / "untied", 2, "--pp", "2")
    return out


def test_pipeline2_trains_as_one_process_and_saves_a_stock_folder(models, pp2_run, tmp_path):
    assert_same_training(pp2_run, one_process(models / "untied", "pack", tmp_path), "pack")
    report = (pp2_run / "report.txt").read_text()
    assert "pipeline stage 0: embedding + layers 0–1" in report
    assert "pipeline stage 1: layers 2–3 + final norm + head" in report
    assert "bubble (p−1)/(m+p−1) = 0.200" in report  # (2 − 1) / (4 + 2 − 1)


def test_pipeline2_x_tensor2_pad_mode_with_activation_checkpointing(models, tmp_path):
    out = tmp_path / "run"
    launch(out, models / "untied", 4, "--pp", "2", "--tp", "2", "--mode", "pad", "--activation-checkpointing")
    assert_same_training(out, one_process(models / "untied", "pad", tmp_path), "pad")


def test_pipeline2_x_data2_zero1_tied_embeddings_isolated_documents(models, tmp_path):
    out = tmp_path / "run"
    launch(out, models / "tied", 4, "--pp", "2", "--mode", "isolate")
    assert_same_training(out, one_process(models / "tied", "isolate", tmp_path, dp_for_eval=2), "isolate")


def test_sigkill_at_step3_then_resume_continues_exactly(models, pp2_run, tmp_path):
    out = tmp_path / "run"
    killed = launch(out, models / "untied", 2, "--pp", "2", "--kill-at-step", "3", check=False)
    assert killed.returncode != 0 and not (out / "final").exists()
    assert (out / "checkpoints" / "latest").read_text() == "step_00000002"
    launch(out, models / "untied", 2, "--pp", "2", "--resume")
    straight, resumed = step_log(pp2_run), step_log(out)
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        assert abs(resumed[step]["loss"] - straight[step]["loss"]) <= 1e-6, step


def test_export_of_a_pipeline_checkpoint_equals_the_final_folder(pp2_run, tmp_path):
    from safetensors.torch import load_file

    from neox_hf.cli import main

    assert main(["export", str(pp2_run / "checkpoints"), str(tmp_path / "exported")]) == 0
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    final = load_file(pp2_run / "final" / "model.safetensors")
    assert sorted(exported) == sorted(final)
    assert all(torch.equal(exported[k], final[k]) for k in final)
