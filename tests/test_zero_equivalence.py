"""One process (plain PyTorch AdamW through Accelerate) vs DeepSpeed layouts through Accelerate's plugin and our
training loop: DP2 ZeRO-1/2/3 (ZeRO-2 also with the batches read in a worker process per rank), TP2, TP2×DP2 (ZeRO-1), and TP2 / TP2×DP2 with sequence parallelism. Same global batch and seed → per-step losses ≤ 1e-5 over 5 steps."""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from tests.conftest import (REPO, accelerate_launch_command, launch_env, one_process_equivalence_run,
                            save_tiny_gpt_neox)
from tests.test_resume import step_losses

WORKER = REPO / "tests" / "workers" / "dp_equivalence.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_gpt_neox(tmp_path_factory.mktemp("dp_model"))


def _env():
    return launch_env()


@pytest.fixture(scope="module")
def one_process_losses(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    one_process_equivalence_run(model_dir, out)
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
    # Each rank forks its data worker under a gloo process group and a DeepSpeed engine (`data.num_workers: 1`).
    "dp2-zero2-data-worker": (2, 2, 1, ("--data-workers", "1")),
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
            # No --zero_stage: each layout's recipe sets its own stage (a launcher stage would contradict the others).
            command = accelerate_launch_command(WORKER, model_dir, out, "--layouts", *specs, num_processes=processes)
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
    from neox_hf.hardware import deepspeed_runs_fp16

    return deepspeed_runs_fp16()  # NEOX_HF_CPU_FLAGS can make an fp16 CPU decide as an AVX2-only one does


@pytest.mark.parametrize("how", ["recipe", "raw-json"])
def test_fp16_is_refused_by_name_where_deepspeed_cannot_run_it(tmp_path, how, monkeypatch):
    """An AVX2 CPU has no oneDNN fp16: DeepSpeed would fail inside the engine after building the model on every rank.
    Runs on every CPU: where DeepSpeed has fp16 the gate is made to decide as on an AVX2-only CPU."""
    import torch

    from neox_hf.errors import RecipeError

    if torch.cuda.is_available():
        pytest.skip("GPUs run DeepSpeed fp16")
    monkeypatch.setenv("NEOX_HF_CPU_FLAGS", "avx2 fma")
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
    log = [r for r in strict_train_log(out) if "loss" in r]
    assert [r["step"] for r in log] == list(range(1, 13))
    assert all("grad_norm" not in r for r in log if r["skipped"])  # infinite: left out, the line stays strict JSON
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


def strict_train_log(out) -> list[dict]:
    """train_log.jsonl, parsed refusing NaN / Infinity (Python's json would read them back)."""
    def refuse(constant):
        raise ValueError(f"non-finite JSON constant {constant}")

    return [json.loads(line, parse_constant=refuse) for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.skipif(not _deepspeed_runs_fp16_here(), reason="DeepSpeed's CPU accelerator has no fp16 on this CPU "
                    "(needs AVX512-FP16/AMX); tests/test_overflow_skips.py covers the guard everywhere")
def test_fp16_run_whose_loss_scale_reaches_its_floor_stops_naming_the_step(tmp_path):
    """The user's path: run_clm_neox.py, 2 processes, ZeRO-2, a loss scale far too high that may not fall below
    2^28: steps 1 and 2 overflow and are skipped, the second leaves the scale at its floor, and the run stops there
    with one line (DeepSpeed would raise a bare Exception at the next overflow)."""
    override = tmp_path / "ds.json"
    override.write_text(json.dumps({"fp16": {"initial_scale_power": 30, "min_loss_scale": 2**28, "hysteresis": 1}}))
    out = tmp_path / "run"
    command = accelerate_launch_command(
        REPO / "run_clm_neox.py", REPO / "recipes" / "tiny.yaml", "--parallel.zero_stage", "2", "--train.precision",
        "fp16", "--parallel.deepspeed_config", override, "--train.train_iters", "8", "--train.eval_iters", "0",
        "--train.log_interval", "4", "--model.hidden_size", "64", "--model.seq_length", "64",
        "--train.micro_batch_size", "2", "--output.dir", out, "--output.tensorboard", "false", zero_stage=2)
    done = subprocess.run(command, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors and "the fp16 loss scale fell to its floor (2.68435e+08) at step 2" in errors[0], done.stderr[-3000:]
    log = strict_train_log(out)
    assert [(r["step"], r["skipped"], r["loss_scale"]) for r in log] == [(1, True, 2.0**29), (2, True, 2.0**28)]
    assert not (out / "model.safetensors").exists()  # nothing of a run that stopped is saved as its result


@pytest.mark.skipif(not _deepspeed_runs_fp16_here(), reason="DeepSpeed's CPU accelerator has no fp16 on this CPU "
                    "(needs AVX512-FP16/AMX); tests/test_fused_cross_entropy.py's fp16 test covers the loss everywhere")
def test_fp16_fine_tuning_of_a_confident_model_applies_its_steps(tmp_path):
    """The user's path: run_clm_neox.py fine-tuning a saved model in DeepSpeed fp16. A trained model's logits reach
    beyond 11, where exp overflows fp16; the fused loss must keep its gradients finite, or the loss scaler takes
    every step for an overflow and skips it (what the loss did on CPU before it shifted fp16 logits by their max)."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=50304, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=256, max_position_embeddings=64)
    model = GPTNeoXForCausalLM(config)
    model.get_output_embeddings().weight.data.mul_(25.0)  # logits as large as a trained model's
    with torch.no_grad():
        assert model(torch.arange(32)[None]).logits.max() > 15  # beyond fp16's exp range (11.09)
    model.save_pretrained(tmp_path / "confident")
    override = tmp_path / "ds.json"
    override.write_text(json.dumps({"fp16": {"initial_scale_power": 8}}))  # low: no overflow of the scaled loss
    out = tmp_path / "run"
    command = accelerate_launch_command(
        REPO / "run_clm_neox.py", REPO / "recipes" / "tiny.yaml", "--model.from_pretrained", tmp_path / "confident",
        "--parallel.zero_stage", "1", "--train.precision", "fp16", "--parallel.deepspeed_config", override,
        "--train.train_iters", "3", "--train.eval_iters", "0", "--train.log_interval", "1", "--model.seq_length", "64",
        "--train.micro_batch_size", "2", "--output.dir", out, "--output.tensorboard", "false", zero_stage=1,
        num_processes=1)
    done = subprocess.run(command, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    log = [r for r in strict_train_log(out) if "loss" in r]
    assert [(r["step"], r["skipped"]) for r in log] == [(1, False), (2, False), (3, False)]
