"""Resume after SIGKILL: 10 steps straight vs 5 steps, kill -9, `--resume`, 5 more — steps 5–10 match ≤ 1e-6
(DP2 ZeRO-2 and TP2). The uninterrupted runs' final folders are checked too: full weights after ZeRO-2, TP shards
merged into a folder stock transformers loads after TP2 (one launch serves both checks: start-up is most of it).
The killed runs are `run_clm_neox.py` under `accelerate launch`, as a user starts them; the references and the
resumes run the same entry point, both layouts per launch."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, accelerate_launch_command, finish_launch, launch_env, start_init_layouts
from tests.test_checkpoint_faults import assert_every_checkpoint_exports
from tests.test_train import SMALL, shakespeare_sources


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
    env = launch_env()
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


# name: (ZeRO stage, the layout's own recipe flags)
# (ZeRO-2 killed mid-step and resumed: tests/test_failure_preemption.py's fault matrix; DeepSpeed's own per-rank files
# resumed on their layout: tests/test_security.py's untouched resume)
LAYOUTS = {
    "tp2": (1, ["--parallel.zero_stage", "1", "--parallel.tensor_parallel", "2"]),
}


@dataclass
class KilledAndResumed:
    straight: Path  # the uninterrupted run's folder
    straight_stdout: str
    resumed: Path  # killed after its step-5 checkpoint, then resumed
    latest_when_killed: str
    saved_before_kill: bool  # whether the killed run had written its final folder
    resumed_stdout: str
    task: Path | None  # the lm-eval task the TP2 reference scored at its end


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, KilledAndResumed]:
    """Each layout's runs: the uninterrupted reference in a launch of the real entry point
    (tests/workers/init_layouts.py), beside it `run_clm_neox.py` launched and SIGKILLed after its step-5 checkpoint,
    then the resume."""
    root = tmp_path_factory.mktemp("sigkill")
    common = [str(REPO / "recipes" / "tiny.yaml"), *SMALL, "--train.train_iters", "10", "--train.save_interval", "5",
              "--train.eval_iters", "0", "--data.sources", shakespeare_sources()]
    # lm-eval at the end of the TP2 reference only: it runs after the last step, so the losses compared are untouched.
    # Imported here: tests.test_eval_tasks skips its whole module without lm_eval, and would skip every module that
    # imports from this one at module level (the cuda tier on a machine without lm_eval).
    task = None
    if importlib.util.find_spec("lm_eval"):
        from tests.test_eval_tasks import local_task

        task = local_task(root)
    eval_task = {"tp2": ["--train.eval_tasks", f"[{task}]"] if task else []}
    references = start_init_layouts(root / "straight", {name: shlex.join([*flags, *eval_task.get(name, [])])
                                                        for name, (_, flags) in LAYOUTS.items()}, *common)
    killed = {}
    for name, (zero_stage, flags) in LAYOUTS.items():
        resumed = root / "resumed" / name
        launch_and_kill_after_checkpoint([*common, *flags, "--output.dir", str(resumed)], resumed, zero_stage=zero_stage)
        killed[name] = ((resumed / "checkpoints" / "latest").read_text(), (resumed / "config.json").exists())
    finish_launch(references, "the references")
    finish_launch(start_init_layouts(root / "resumed", {name: shlex.join([*flags, "--resume"])
                                                        for name, (_, flags) in LAYOUTS.items()}, *common),
                  "the resumes")
    return {name: KilledAndResumed(root / "straight" / name, (root / "straight" / f"{name}.stdout").read_text(),
                                   root / "resumed" / name, *killed[name],
                                   (root / "resumed" / f"{name}.stdout").read_text(), task if name == "tp2" else None)
            for name in LAYOUTS}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_resume_after_sigkill_matches_uninterrupted_run(runs, name, tmp_path, capsys):
    run = runs[name]
    if name == "tp2":
        assert_tp2_folder_is_merged(run.straight, run.straight_stdout)
        if run.task:
            assert_eval_tasks_match_the_saved_folder(run.straight, run.task, step=10)
    assert_every_checkpoint_exports(run.straight, tmp_path / "exports", capsys)  # step 5 (not the latest) and step 10
    written = sorted(p.parent.name for p in (run.straight / "checkpoints").glob("step_*/layout_free"))
    assert written == ["step_00000005", "step_00000010"], written
    assert run.latest_when_killed == "step_00000005"
    assert not run.saved_before_kill  # the killed run never reached its final save
    assert "resumed from" in run.resumed_stdout and "at step 5" in run.resumed_stdout, run.resumed_stdout[-2000:]
    expected, got = step_losses(run.straight), step_losses(run.resumed)
    assert sorted(got) == list(range(1, 11))
    for step in range(5, 11):
        assert abs(got[step] - expected[step]) <= 1e-6, (step, got[step], expected[step])


def assert_eval_tasks_match_the_saved_folder(out: Path, task: Path, step: int) -> None:
    """The main process scored a copy built from the gathered TP shards during training; the same task on the saved
    folder (the same final weights) gives the same numbers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from neox_hf.eval_tasks import run_eval_tasks
    from neox_hf.checkpoint.run_log import read_run_log

    logged = read_run_log(out).evals[-1]
    assert logged["step"] == step
    saved = run_eval_tasks(AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out), [str(task)])
    assert {k: logged[k] for k in saved} == pytest.approx(saved, rel=1e-5)


def assert_tp2_folder_is_merged(out: Path, stdout: str) -> None:
    """A TP2 run's final folder: the vocabulary padded as GPT-NeoX pads it, every shard merged back, stock-loadable."""
    from safetensors.torch import load_file
    from transformers import GPTNeoXForCausalLM

    assert "tensor parallel 2" in stdout
    assert "vocab 50432" in stdout  # padded to a multiple of 128 × TP 2, as GPT-NeoX does
    model = GPTNeoXForCausalLM.from_pretrained(out)
    assert load_file(out / "model.safetensors")["embed_out.weight"].shape == (50432, 64)
    assert model.gpt_neox.layers[0].attention.query_key_value.weight.shape == (192, 64)  # all heads merged back


@pytest.mark.distributed  # slow tier: a whole (tiny) run, then its resume
def test_resuming_a_checkpoint_past_train_iters_is_refused_naming_the_step(tmp_path, capsys, fresh_accelerate_state):
    """It would train nothing and save the longer run's model under a recipe.yaml that says the shorter one."""
    from neox_hf.cli import train_main as main

    out = tmp_path / "run"
    common = [str(REPO / "recipes" / "tiny.yaml"), "--model.hidden_size", "32", "--model.seq_length", "32",
              "--train.micro_batch_size", "2", "--train.eval_iters", "0", "--train.save_interval", "4",
              "--output.tensorboard", "false", "--train.precision", "fp32", "--output.dir", str(out)]
    assert main([*common, "--train.train_iters", "4"]) == 0
    saved = (out / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert main([*common, "--train.train_iters", "2", "--resume"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "is at step 4, past `train.train_iters` 2: pass `--train.train_iters 4` or more" in error
    assert (out / "model.safetensors").read_bytes() == saved  # the finished run's model is untouched
