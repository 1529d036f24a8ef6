"""One rank's failure ends a multi-process launch in seconds, naming that rank, with the last checkpoint intact;
SIGTERM / SIGUSR1 (preemption) stop every rank at one agreed step after a checkpoint (exit 75), and `--resume`
continues it exactly; a `.zst` cut short is refused. The failures are started by tests/workers/fail_at_step.py on one
rank of a real launch of the entry point; the signals are real signals to real processes."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zstandard

from neox_hf.checkpoint import checkpoint_name, is_complete_checkpoint
from neox_hf.train.preemption import PREEMPTED_EXIT_STATUS
from tests.conftest import REPO, accelerate_launch_command, launch_env, reset_accelerate_state
from tests.test_checkpoint_lifecycle import tiny_args


def step_losses(output_dir: Path) -> dict[int, float]:
    """The last logged loss of every step."""
    losses = {}
    for line in (output_dir / "train_log.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            losses[record["step"]] = record["loss"]
    return losses


def checkpoint_folders(output_dir: Path) -> list[str]:
    return sorted(p.name for p in (output_dir / "checkpoints").iterdir() if p.name != "latest")


def latest_checkpoint(output_dir: Path) -> str:
    name = (output_dir / "checkpoints" / "latest").read_text().strip()
    assert is_complete_checkpoint(output_dir / "checkpoints" / name), name
    return name


# ----------------------------------------------------------------------------------------------------------------
# 1. One rank fails: the launch ends within seconds, that rank's error line says why, the last checkpoint is intact
# ----------------------------------------------------------------------------------------------------------------

# (processes, failing rank, step, kind, what its error line says)
FAULTS = [
    (2, 1, 6, "disk", "no space left on"),  # in the step-6 checkpoint save, the others waiting in its barrier
    (2, 1, 5, "data", "is corrupt"),  # from the prefetch thread, the other rank in the step's all-reduce
    (4, 2, 5, "exception", "RuntimeError: injected fault after step 5"),
]


@pytest.mark.parametrize("processes,rank,step,kind,says", FAULTS, ids=[f"{f[0]}proc-{f[3]}" for f in FAULTS])
def test_a_failing_rank_ends_the_launch_at_once_naming_itself(processes, rank, step, kind, says, small_text, tmp_path):
    """Before: a failed rank spent ~4 s in the interpreter's teardown (destroying a process group its peers still
    waited in) before the launcher could end the others, and said nothing of which rank it was."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               str(REPO / "tests" / "workers" / "fail_at_step.py"), str(rank), str(step), kind, "--",
               *tiny_args(out, small_text, "--train.precision", "fp32", "--train.log_interval", "1", steps=30,
                          save=2, keep=3)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=launch_env(), timeout=600)
    ended = time.time()
    assert done.returncode != 0, done.stderr[-3000:]
    fault = float(Path(f"{out}.fault_time").read_text())
    assert ended - fault < 30, f"the launch ended {ended - fault:.1f} s after the fault"
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-5000:]
    assert errors[0].startswith(f"error: rank {rank} of {processes}: ") and says in errors[0], errors[0]
    assert latest_checkpoint(out) == checkpoint_name(4)
    # Nothing but staging besides them: a rank still writing when the failed one removed the staging can leave a
    # `.tmp-step_*` folder (a resume removes it).
    assert [name for name in checkpoint_folders(out) if not name.startswith(".tmp-")] == \
        [checkpoint_name(2), checkpoint_name(4)]
    print(f"{kind} on rank {rank} of {processes}: the launch ended {ended - fault:.1f} s after the fault")


# ----------------------------------------------------------------------------------------------------------------
# 2. Preemption
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.distributed  # slow tier: three whole trainings in this process, ~20 s
def test_sigusr1_in_one_process_checkpoints_the_next_step_and_resume_matches_an_uninterrupted_run(
        small_text, tmp_path, capsys, fresh_accelerate_state):
    """In this process: SIGUSR1 (SLURM's warning before the time limit) once step 3 is logged; the run stops after
    the step it was in, with its checkpoint, returning 75; `--resume` gives an uninterrupted run's losses."""
    from neox_hf.cli import train_main as main

    def args(out, *extra):
        return tiny_args(out, small_text, "--train.precision", "fp32", "--train.log_interval", "1", *extra,
                         steps=12, save=100)

    assert main(args(tmp_path / "straight")) == 0
    reset_accelerate_state()
    out = tmp_path / "preempted"
    late = []  # a signal after the run's steps lands here instead of ending pytest
    previous = signal.signal(signal.SIGUSR1, lambda *_: late.append(True))
    sender = threading.Thread(target=_signal_once_logged, args=(out / "train_log.jsonl", 3), daemon=True)
    sender.start()
    try:
        status = main(args(out))
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert status == PREEMPTED_EXIT_STATUS and not late, capsys.readouterr().err[-3000:]
    stopped = max(step_losses(out))
    assert 3 <= stopped < 12
    assert f"stopped on SIGUSR1 after step {stopped}" in capsys.readouterr().err
    assert latest_checkpoint(out) == checkpoint_name(stopped)
    reset_accelerate_state()
    assert main(args(out, "--resume")) == 0
    assert step_losses(out) == pytest.approx(step_losses(tmp_path / "straight"), abs=1e-6)


def _signal_once_logged(log: Path, step: int) -> None:
    import os

    while not (log.is_file() and len(log.read_text().splitlines()) >= step):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGUSR1)


def test_sigusr1_to_the_launcher_set_up_as_the_slurm_script_does_stops_its_ranks_with_a_checkpoint(small_text,
                                                                                                   tmp_path):
    """examples/launch/slurm.sbatch's environment for `accelerate launch` (the launcher forwards SIGUSR1 to its ranks
    and waits for them): SIGUSR1 to the launcher alone ends it with 128 + 10, the status the script requeues on,
    after both ranks stopped at one step with its checkpoint."""
    script = (REPO / "examples" / "launch" / "slurm.sbatch").read_text()
    exported = dict(pair.split("=", 1) for pair in shlex.split(re.search(r"^export (.+)$", script, re.M).group(1)))
    assert set(exported) == {"PET_SIGNALS_TO_HANDLE", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"}
    out = tmp_path / "run"
    launch = subprocess.Popen(
        accelerate_launch_command(REPO / "run_clm_neox.py", *tiny_args(
            out, small_text, "--train.precision", "fp32", "--train.log_interval", "2", steps=40, save=2, keep=5)),
        cwd=REPO, env=launch_env(**exported), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    latest = out / "checkpoints" / "latest"
    deadline = time.time() + 600
    while not latest.is_file():
        assert launch.poll() is None, launch.stdout.read()[-5000:]
        assert time.time() < deadline
        time.sleep(0.02)
    launch.send_signal(signal.SIGUSR1)
    output, _ = launch.communicate(timeout=300)
    assert launch.returncode == 128 + signal.SIGUSR1 and "status -eq 138" in script, output[-5000:]
    stopped = re.findall(r"rank (\d) of 2: stopped on SIGUSR1 after step (\d+)", output)
    assert sorted(rank for rank, _ in stopped) == ["0", "1"] and len({step for _, step in stopped}) == 1, output[-5000:]
    assert latest_checkpoint(out) == checkpoint_name(int(stopped[0][1]))


# ----------------------------------------------------------------------------------------------------------------
# 3. A .zst cut short
# ----------------------------------------------------------------------------------------------------------------


def test_preprocess_refuses_a_zst_cut_at_a_block_end_in_one_line(tmp_path, capsys):
    """The cut falls where a block of whole lines ends, inside the frame: zstandard's stream_reader ends quietly
    there (the last assertion), so preprocess wrote a shorter corpus or, reading it through a BufferedReader, blamed
    line 31 for bad JSON; never that the file was cut."""
    from neox_hf.cli import main

    lines = [json.dumps({"text": f"document {i} " + "words " * 40}).encode() + b"\n" for i in range(400)]
    compressor = zstandard.ZstdCompressor().compressobj()
    first = b"".join(compressor.compress(line) for line in lines[:200])
    first += compressor.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)  # a block boundary after line 200
    cut = tmp_path / "pile-00.jsonl.zst"
    cut.write_bytes(first)  # the rest of the frame (lines 200-399, the frame's end) never arrived
    code = main(["preprocess", str(cut), "--tokenizer", str(REPO / "examples/data/gpt-neox-20b-tokenizer.json"),
                 "--output-prefix", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert [line for line in err.splitlines() if line.startswith("error:")] == \
        [f"error: {cut} is truncated (compressed stream ends early): download it again"], err
    assert not list(tmp_path.glob("out*"))
    with zstandard.ZstdDecompressor().stream_reader(cut.open("rb")) as reader:  # no error: 200 lines, then "EOF"
        assert reader.read() == b"".join(lines[:200])


# ----------------------------------------------------------------------------------------------------------------
# 4. The fault matrix: kill -9 of one rank mid-step and mid-save, SIGTERM mid-eval, on each engine
# ----------------------------------------------------------------------------------------------------------------

# engine: its flags. ZeRO-2 writes its checkpoints in the background (`train.async_checkpoint`): its mid-save kill
# strikes while the background write is half done (the killed rank's tensor files written, not the others' or the
# metadata) and the steps go on beside it.
MATRIX_ENGINES = {
    "zero2-async": ["--parallel.zero_stage", "2", "--train.async_checkpoint", "true"],
    "fsdp2": ["--parallel.backend", "fsdp2", "--parallel.use_deepspeed", "false"],
    "pipeline2": ["--parallel.pipeline_parallel", "2", "--parallel.zero_stage", "1", "--model.num_layers", "2"],
    "cp2": ["--parallel.context_parallel", "2", "--parallel.zero_stage", "2"],
}
# One attempt per fault on rank 1, then a last attempt that finishes: checkpoints every 3 steps, eval every 4.
# kill-step@5 (latest: step 3) → resume 3; kill-save@9 (latest: 6, 9 half written) → resume 6; SIGTERM in the eval
# after step 8 → stop after step 9 with its checkpoint (exit 75) → resume 9 → 12.
MATRIX_PLAN = "kill-step@5,kill-save@9,term-eval@8"


@pytest.fixture(scope="module")
def fault_matrix(small_text, tmp_path_factory) -> tuple[Path, str]:
    """One elastic launch (tests/workers/faults.py) of every engine's matrix, the engines taking turns: an engine's
    reference run, then its run meeting each fault, the launcher restarting every rank after each and the restart
    resuming; the restart after an engine's last fault finishes it and starts the next engine (13 attempts for 4
    engines where 4 launches took 16). (the folder, the launch's whole output)"""
    out = tmp_path_factory.mktemp("fault_matrix")
    args = tiny_args(out / "unused", small_text, "--train.precision", "fp32", "--train.log_interval", "1",
                     "--train.eval_iters", "1", "--train.eval_interval", "4", steps=12, save=3, keep=3)
    at = args.index("--output.dir")
    del args[at:at + 2]
    faults = MATRIX_PLAN.split(",")
    engines = [f"{name}={shlex.join(flags)}" for name, flags in MATRIX_ENGINES.items()]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "--max_restarts", str(len(faults) * len(engines)), str(REPO / "tests" / "workers" / "faults.py"), "1",
               MATRIX_PLAN, str(out), *engines, "--", *args]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=launch_env(), timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    failed = out / "failed"  # a reference or last resume that failed (the launcher restarted it as a fault)
    assert not failed.exists(), failed.read_text() + done.stderr[-5000:]
    return out, done.stdout + done.stderr


@pytest.mark.parametrize("engine", list(MATRIX_ENGINES))
def test_fault_matrix_each_fault_ends_the_launch_at_once_and_the_resume_is_exact(engine, fault_matrix):
    """The engine's turn in the matrix's elastic launch: each fault ends its attempt within 30 s (its time to the
    next attempt's start), `latest` named a whole checkpoint of an earlier step when it struck (the mid-save one: the
    one before the save it struck), and the losses of every step equal the reference's."""
    root, output = fault_matrix
    out = root / engine
    faults = MATRIX_PLAN.split(",")
    first = list(MATRIX_ENGINES).index(engine) * len(faults)  # the launch attempt of the engine's first fault
    ended = [float((root / f"attempt{first + i + 1}.start").read_text()) - float((out / f"attempt{i}.fault").read_text())
             for i in range(len(faults))]
    print(f"{engine}: each fault to the next attempt's start: " + ", ".join(f"{s:.1f} s" for s in ended))
    assert all(seconds < 30 for seconds in ended), ended
    assert [(out / f"attempt{i}.latest").read_text() for i in range(len(faults))] == \
        [checkpoint_name(3), checkpoint_name(6), checkpoint_name(6)]
    # rank 0, never signalled, stops at the step rank 1 does; the second SIGTERM, during that step's save, changes
    # nothing (the resume starts from that checkpoint)
    stops = re.findall(r"rank (\d) of 2: stopped on SIGTERM after step (\d+)",
                       "".join((out / f"rank{rank}.stderr").read_text() for rank in (0, 1)))
    assert sorted(set(stops)) == [("0", "9"), ("1", "9")], output[-5000:]
    assert checkpoint_name(9) in (out / "attempt2.second").read_text()
    faulty, straight = step_losses(out / "faulty"), step_losses(out / "straight")
    assert sorted(faulty) == list(range(1, 13))
    assert faulty == pytest.approx(straight, abs=1e-6)
    assert latest_checkpoint(out / "faulty") == checkpoint_name(12)
