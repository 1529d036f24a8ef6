"""Resume after SIGKILL: 10 steps straight vs 5 steps, kill -9, `--resume`, 5 more — steps 6–10 match ≤ 1e-6
(DP2 ZeRO-2 and TP2), and the TP2 run's final folder loads in stock transformers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, accelerate_launch_command
from tests.test_train import SMALL, launch, shakespeare_sources


def step_losses(output_dir: Path) -> dict[int, float]:
    """Last logged loss of every step (a killed run may have logged steps the resumed run redoes)."""
    losses = {}
    for line in (output_dir / "train_log.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:  # evaluation lines carry "eval" instead
            losses[record["step"]] = record["loss"]
    return losses


def launch_and_kill_after_checkpoint(args: list[str], output_dir: Path, *, zero_stage: int) -> None:
    """Start a 2-process run, SIGKILL the whole process group once the step-5 checkpoint is complete."""
    command = accelerate_launch_command(REPO / "run_clm_neox.py", *args, zero_stage=zero_stage)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    latest = output_dir / "checkpoints" / "latest"
    deadline = time.time() + 600
    try:
        while not latest.is_file():
            assert process.poll() is None, "the run ended before writing its checkpoint"
            assert time.time() < deadline, "no checkpoint within 10 minutes"
            time.sleep(0.2)
    finally:
        kill_process_tree(process)


def kill_process_tree(process: subprocess.Popen) -> None:
    """SIGKILL the launcher and every worker: torch elastic starts workers in sessions of their own, so killing
    the launcher's process group alone would leave them training."""
    import psutil

    family = [process.pid] + [child.pid for child in psutil.Process(process.pid).children(recursive=True)]
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)  # not a clean exit: no flush, no atexit, no final save
        except ProcessLookupError:
            pass
    process.wait()
    psutil.wait_procs([p for p in psutil.process_iter() if p.pid in family[1:]], timeout=30)


@pytest.mark.parametrize("zero_stage,tensor_parallel", [(2, 1), (1, 2)], ids=["dp2-zero2", "tp2"])
def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path, zero_stage, tensor_parallel):
    common = [str(REPO / "recipes" / "tiny.yaml"), *SMALL, "--train.train_iters", "10", "--train.save_interval", "5",
              "--train.eval_iters", "0", "--data.sources", shakespeare_sources(), "--parallel.zero_stage", str(zero_stage),
              "--parallel.tensor_parallel", str(tensor_parallel)]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    launch([*common, "--output.dir", str(straight)], zero_stage=zero_stage)
    launch_and_kill_after_checkpoint([*common, "--output.dir", str(resumed)], resumed, zero_stage=zero_stage)
    assert (resumed / "checkpoints" / "latest").read_text() == "step_00000005"
    assert not (resumed / "config.json").exists()  # the killed run never reached its final save
    done = launch([*common, "--output.dir", str(resumed), "--resume"], zero_stage=zero_stage)
    assert "resumed from" in done.stdout and "at step 5" in done.stdout, done.stdout[-2000:]
    expected, got = step_losses(straight), step_losses(resumed)
    assert sorted(got) == list(range(1, 11))
    for step in range(6, 11):
        assert abs(got[step] - expected[step]) <= 1e-6, (step, got[step], expected[step])
    assert abs(got[5] - expected[5]) <= 1e-6


def test_tp2_run_saves_a_merged_folder_stock_transformers_loads(tmp_path):
    from safetensors.torch import load_file
    from transformers import GPTNeoXForCausalLM

    out = tmp_path / "tp2"
    done = launch([str(REPO / "recipes" / "tiny.yaml"), *SMALL, "--parallel.tensor_parallel", "2", "--parallel.zero_stage", "1",
                   "--data.sources", shakespeare_sources(), "--output.dir", str(out)], zero_stage=1)
    assert "tensor parallel 2" in done.stdout
    assert "vocab 50432" in done.stdout  # padded to a multiple of 128 × TP 2, as GPT-NeoX does
    model = GPTNeoXForCausalLM.from_pretrained(out)
    assert load_file(out / "model.safetensors")["embed_out.weight"].shape == (50432, 64)
    assert model.gpt_neox.layers[0].attention.query_key_value.weight.shape == (192, 64)  # all heads merged back
