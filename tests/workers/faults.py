"""The fault matrix of several engines in one elastic launch: for each engine, an uninterrupted reference run, then
the same run meeting one fault per attempt, the launcher restarting every rank after each (torch elastic's
`--max_restarts`, as a cluster job is set up to) and each restart resuming with `--resume`:

    torchrun --standalone --nproc_per_node N --max_restarts K tests/workers/faults.py RANK PLAN OUT \
        ENGINE="OVERRIDES" [ENGINE="OVERRIDES" ...] -- RUN_ARGS...

K is (number of engines) × (faults in PLAN). PLAN is `KIND@STEP,...`, the faults every engine meets, one per attempt,
on rank RANK:
- `kill-step@S`: SIGKILL inside the forward of step S (the other ranks wait in the step's collectives);
- `kill-save@S`: SIGKILL inside the checkpoint write of step S, once this rank's tensor files are written and before
  the save is complete (with `train.async_checkpoint`, in the background write, steps going on beside it);
- `term-eval@S`: SIGTERM during the evaluation after step S (preemption: the run stops at the next agreed step with
  a checkpoint, exit 75), and SIGTERM again while that checkpoint is written.

The engines take their turns: launch attempt A (TORCHELASTIC_RESTART_COUNT) is fault A % F of engine A // F. An
engine's first attempt trains its reference in OUT/ENGINE/straight (RUN_ARGS, then its OVERRIDES, shell-quoted), then
OUT/ENGINE/faulty until the fault; its later attempts resume OUT/ENGINE/faulty. The attempt after an engine's last
fault first resumes that engine's faulty run to its end (the restart the matrix proves exact), then starts the next
engine: one launch's start-up per fault, and no launch for a reference or the last resume.
Each attempt writes its start time to OUT/attemptA.start before anything is imported; a fault writes its time to
OUT/ENGINE/attemptI.fault (I: the fault's place in PLAN), for the test to time how long the launch took to end the
faulty attempt, and what `latest` named when it struck to OUT/ENGINE/attemptI.latest. What each rank writes to
stderr while an engine's runs train is also appended to OUT/ENGINE/rankR.stderr (the rank's stop lines, per engine).
"""

import contextlib
import os
import signal
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    split = argv.index("--")
    (rank, plan, out, *engine_specs), run_args = argv[:split], argv[split + 1:]
    out, attempt = Path(out), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    me = int(os.environ.get("RANK", "0"))
    if attempt:  # torch 2.13's elastic restart on gloo hangs in init_process_group on the agent's store: a store of
        # the attempt's own, on a port every rank derives alike
        os.environ.update(TORCHELASTIC_USE_AGENT_STORE="False", MASTER_PORT=str(int(os.environ["MASTER_PORT"]) + attempt))
    if me == 0:
        (out / f"attempt{attempt}.start").write_text(repr(time.time()))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import shlex

    from conftest import reset_accelerate_state, runs_sharing_one_process_group
    from neox_hf.cli import train_main

    faults = [fault.split("@") for fault in plan.split(",")]
    engines = [(name, shlex.split(overrides)) for name, _, overrides in (s.partition("=") for s in engine_specs)]
    engine, fault = divmod(attempt, len(faults))

    def run(index: int, folder: str, *extra: str) -> int:
        name, overrides = engines[index]
        (out / name).mkdir(exist_ok=True)
        environ = dict(os.environ)
        with _tee_stderr(out / name / f"rank{me}.stderr"):
            status = train_main([*run_args, *overrides, "--output.dir", str(out / name / folder), *extra])
        reset_accelerate_state()
        # as the run's own process would, its settings end with it: a DeepSpeed run's Accelerator sets
        # ACCELERATE_USE_DEEPSPEED=true, which a later FSDP2 run would take for a DeepSpeed launch and refuse
        os.environ.clear()
        os.environ.update(environ)
        return status

    def failed(index: int, folder: str, status: int) -> int:
        """A run no fault struck failed: said in OUT/failed (a restart would hide it), and the attempt ends."""
        with (out / "failed").open("a") as said:
            said.write(f"rank {me}, attempt {attempt}: {engines[index][0]}/{folder} exited {status}\n")
        return status

    with runs_sharing_one_process_group():
        if engine and not fault:  # the last restart of the engine before: its faulty run resumed to the end
            status = run(engine - 1, "faulty", "--resume")
            if status:
                return failed(engine - 1, "faulty", status)
            if engine == len(engines):
                return 0
        if not fault:
            status = run(engine, "straight")
            if status:
                return failed(engine, "straight", status)
        if me == int(rank):
            kind, step = faults[fault]
            folder = out / engines[engine][0]
            {"kill-step": _kill_in_step, "kill-save": _kill_in_save, "term-eval": _term_in_eval}[kind](
                int(step), folder / f"attempt{fault}", folder / "faulty")
        return run(engine, "faulty", *(["--resume"] if fault else []))


@contextlib.contextmanager
def _tee_stderr(path: Path):
    """sys.stderr also appended to `path` (the run's lines are written through sys.stderr as they are printed)."""
    stderr = sys.stderr

    class Tee:
        def __init__(self, copy):
            self.copy = copy

        def write(self, text):
            self.copy.write(text)
            self.copy.flush()
            return stderr.write(text)

        def __getattr__(self, name):
            return getattr(stderr, name)

    with path.open("a") as copy:
        sys.stderr = Tee(copy)
        try:
            yield
        finally:
            sys.stderr = stderr


def _strike(marker: Path, faulty: Path, sig: int) -> None:
    latest = faulty / "checkpoints" / "latest"
    marker.with_suffix(".latest").write_text(latest.read_text() if latest.is_file() else "")
    marker.with_suffix(".fault").write_text(repr(time.time()))
    os.kill(os.getpid(), sig)


def _steps_done(faulty: Path) -> int:
    """Steps this run has logged (every step is logged: `--train.log_interval 1`)."""
    import json

    log = faulty / "train_log.jsonl"
    return sum("loss" in json.loads(line) for line in log.read_text().splitlines()) if log.is_file() else 0


def _kill_in_step(step: int, marker: Path, faulty: Path) -> None:
    import neox_hf.train.loop as loop

    build = loop.build_engine

    def build_engine(*args, **kwargs):
        engine = build(*args, **kwargs)
        train_step, calls = engine.train_step, []

        def with_fault(micro_batches):
            calls.append(1)
            resumed_at = getattr(engine, "_fault_start", None)
            if resumed_at is None:
                resumed_at = engine._fault_start = _steps_done(faulty)
            if resumed_at + len(calls) == step:  # the first module of this rank's forward
                module = getattr(engine.model, "module", engine.model)
                for leaf in (m for m in module.modules() if not list(m.children())):
                    leaf.register_forward_pre_hook(lambda *_: _strike(marker, faulty, signal.SIGKILL))
            return train_step(micro_batches)

        engine.train_step = with_fault
        return engine

    loop.build_engine = build_engine


def _kill_in_save(step: int, marker: Path, faulty: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def with_fault(self, plan, planner):
        written = write_data(self, plan, planner)
        if f"step_{step:08d}" in str(self.path):
            written.wait()  # this rank's files are written; the save is not complete
            _strike(marker, faulty, signal.SIGKILL)
        return written

    FileSystemWriter.write_data = with_fault


def _term_in_eval(step: int, marker: Path, faulty: Path) -> None:
    """SIGTERM in the evaluation after step S; then SIGTERM again once the checkpoint it stops with is being written
    (a scheduler and the launcher each send one): that save must complete and the run stop once."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    import neox_hf.train.loop as loop

    evaluate, write_data, struck = loop._eval_and_log, FileSystemWriter.write_data, []

    def with_fault(run, state, history):
        if state.step == step:
            _strike(marker, faulty, signal.SIGTERM)  # handled: the run goes on to a checkpoint and exit 75
            struck.append(True)
        return evaluate(run, state, history)

    def with_second_signal(self, plan, planner):
        if struck and not marker.with_suffix(".second").exists():
            marker.with_suffix(".second").write_text(str(self.path))
            os.kill(os.getpid(), signal.SIGTERM)
        return write_data(self, plan, planner)

    loop._eval_and_log = with_fault
    FileSystemWriter.write_data = with_second_signal


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
