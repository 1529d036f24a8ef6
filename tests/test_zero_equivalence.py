"""One process (plain PyTorch AdamW through Accelerate) vs DeepSpeed layouts through Accelerate's plugin and our
training loop: DP2 ZeRO-1/2/3, TP2, TP2×DP2 (ZeRO-1), and TP2 / TP2×DP2 with sequence parallelism. Same global batch and seed → per-step losses ≤ 1e-5 over 5 steps."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, accelerate_launch_command, save_tiny_gpt_neox
from tests.test_resume import step_losses

WORKER = REPO / "tests" / "workers" / "dp_equivalence.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_gpt_neox(tmp_path_factory.mktemp("dp_model"))


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


@pytest.fixture(scope="module")
def one_process_losses(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    subprocess.run([sys.executable, str(WORKER), str(model_dir), str(out), "0"], check=True, env=_env(), cwd=REPO,
                   timeout=300)
    return step_losses(out)


def _launch(model_dir, out_dir, processes: int, zero_stage: int, tensor_parallel: int, *options: str):
    command = accelerate_launch_command(WORKER, model_dir, out_dir, zero_stage, tensor_parallel, *options,
                                        zero_stage=zero_stage, num_processes=processes)
    done = subprocess.run(command, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


# name: (processes, ZeRO stage, TP, recipe switches). The layouts of one process count run in one launch, one after
# the other (the worker resets Accelerate between them): start-up is most of a launch on 2 cores. ZeRO-3 goes last.
LAYOUTS = {
    "dp2-zero1": (2, 1, 1, ()),
    "dp2-zero2": (2, 2, 1, ()),
    "dp2-zero2-cpu-offload": (2, 2, 1, ("--offload-optimizer",)),
    "tp2": (2, 1, 2, ()),
    "tp2-zero2-activation-checkpointing": (2, 2, 2, ("--activation-checkpointing",)),
    "tp2-sp-zero2-activation-checkpointing": (2, 2, 2, ("--sequence-parallel", "--activation-checkpointing")),
    "dp2-zero3": (2, 3, 1, ()),
    "tp2xdp2-zero1": (4, 1, 2, ()),
    "tp2xdp2-sp-zero1": (4, 1, 2, ("--sequence-parallel",)),
}


@pytest.fixture(scope="module")
def layout_launches(model_dir, tmp_path_factory):
    """processes → (output folder, finished launch) of every layout with that many processes; launched on first use."""
    launches = {}

    def launch(processes: int):
        if processes not in launches:
            out = tmp_path_factory.mktemp(f"layouts{processes}")
            specs = [f"{name}={','.join(map(str, (stage, tp, *options)))}"
                     for name, (n, stage, tp, options) in LAYOUTS.items() if n == processes]
            # --zero_stage only fills Accelerate's plugin defaults: each layout's recipe sets its own stage.
            command = accelerate_launch_command(WORKER, model_dir, out, "--layouts", *specs, zero_stage=1,
                                                num_processes=processes)
            launches[processes] = out, subprocess.run(command, env=_env(), cwd=REPO, capture_output=True, text=True,
                                                      timeout=900)
        return launches[processes]

    return launch


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(layout_launches, one_process_losses, layout):
    processes = LAYOUTS[layout][0]
    out, done = layout_launches(processes)
    assert (out / layout / "train_log.jsonl").is_file(), f"{layout} did not run: " + done.stderr[-4000:]
    got = step_losses(out / layout)
    assert sorted(got) == sorted(one_process_losses) == [1, 2, 3, 4, 5]
    assert got[5] < got[1]  # it trains
    for step, expected in one_process_losses.items():
        assert abs(got[step] - expected) <= 1e-5, (layout, step, got[step], expected)
    if layout == [name for name, spec in LAYOUTS.items() if spec[0] == processes][-1]:  # the launch ended cleanly
        assert done.returncode == 0, done.stderr[-4000:]


def _deepspeed_runs_fp16_here() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().is_fp16_supported()


@pytest.mark.skipif(_deepspeed_runs_fp16_here(), reason="this machine runs DeepSpeed fp16: the scaling test covers it")
@pytest.mark.parametrize("how", ["recipe", "raw-json"])
def test_fp16_is_refused_by_name_where_deepspeed_cannot_run_it(tmp_path, how):
    """An AVX2 CPU has no oneDNN fp16: DeepSpeed would fail inside the engine after building the model on every rank."""
    from neox_hf.errors import RecipeError
    from neox_hf.parallel.accelerator import build_accelerator
    from neox_hf.recipe import recipe_from_dict

    raw = tmp_path / "ds.json"
    raw.write_text(json.dumps({"fp16": {"enabled": True}}))
    parallel = {"zero_stage": 1} if how == "recipe" else {"zero_stage": 1, "deepspeed_config": str(raw)}
    recipe = recipe_from_dict({"parallel": parallel, "train": {"precision": "fp16" if how == "recipe" else "fp32"},
                               "output": {"dir": str(tmp_path / "out")}})
    with pytest.raises(RecipeError, match=r"fp16.*not supported by DeepSpeed's cpu accelerator.*bf16"):
        build_accelerator(recipe)


@pytest.mark.skipif(not _deepspeed_runs_fp16_here(), reason="DeepSpeed's CPU accelerator has no fp16 on this CPU "
                    "(needs AVX512-FP16/AMX); the refusal test covers it")
def test_fp16_dynamic_loss_scaling_skips_overflowing_steps_and_holds_the_lr(model_dir, one_process_losses, tmp_path):
    """DeepSpeed's dynamic loss scaler, started far too high through a raw DeepSpeed JSON override: the first steps
    overflow, are skipped (no update, LR held, as GPT-NeoX does), the scale falls, then training proceeds."""
    override = tmp_path / "ds.json"
    override.write_text(json.dumps({"fp16": {"initial_scale_power": 21}}))
    out = tmp_path / "run"
    _launch(model_dir, out, 2, 2, 1, "--precision", "fp16", "--steps", "12", "--deepspeed-config", str(override))
    log = [r for r in map(json.loads, (out / "train_log.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in log] == list(range(1, 13))
    skipped = [r for r in log if r["skipped"]]
    applied = [r for r in log if not r["skipped"]]
    assert log[0]["skipped"] and log[0]["loss_scale"] == 2.0**21
    assert 2 <= len(skipped) and len(applied) >= 5
    scales = [r["loss_scale"] for r in log]
    assert scales[-1] < 2.0**21 and all(b <= a for a, b in zip(scales, scales[1:]))  # only falls within 12 steps
    # The LR schedule does not advance over skipped steps: the first applied step uses the step-1 LR.
    assert {r["lr"] for r in skipped} | {applied[0]["lr"]} == {log[0]["lr"]}
    # Same model and batch as the fp32 run's first step, computed in fp16.
    assert abs(log[0]["loss"] - one_process_losses[1]) <= 1e-2
    assert all(math.isfinite(r["loss"]) for r in log)
