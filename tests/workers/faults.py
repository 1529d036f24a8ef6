"""The fault matrix of one engine in one elastic launch: an uninterrupted reference run, then the same run meeting one
fault per attempt, the launcher restarting every rank after each (torch elastic's `--max_restarts`, as a cluster
job is set up to) and each restart resuming with `--resume`:

    torchrun --standalone --nproc_per_node N --max_restarts K tests/workers/faults.py RANK PLAN OUT -- RUN_ARGS...

PLAN is `KIND@STEP,...`, one fault per attempt (attempt i = TORCHELASTIC_RESTART_COUNT), on rank RANK:
- `kill-step@S`: SIGKILL inside the forward of step S (the other ranks wait in the step's collectives);
- `kill-save@S`: SIGKILL inside the checkpoint write of step S, once this rank's tensor files are written and before
  the save is complete (with `train.async_checkpoint`, in the background write, steps going on beside it);
- `term-eval@S`: SIGTERM during the evaluation after step S (preemption: the run stops at the next agreed step with
  a checkpoint, exit 75), and SIGTERM again while that checkpoint is written.

Attempt 0 first trains the reference in OUT/straight (rank 0 prints nothing of it); every attempt trains OUT/faulty.
Each attempt writes its start time to OUT/attemptI.start before anything is imported, and the fault's time to
OUT/attemptI.fault, for the test to time how long the launch took to end the faulty attempt; OUT/attemptI.latest
is what `latest` named when the fault struck.
"""

import os
import signal
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    split = argv.index("--")
    (rank, plan, out), run_args = argv[:split], argv[split + 1:]
    out, attempt = Path(out), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    me = int(os.environ.get("RANK", "0"))
    if attempt:  # torch 2.13's elastic restart on gloo hangs in init_process_group on the agent's store: a store of
        # the attempt's own, on a port every rank derives alike
        os.environ.update(TORCHELASTIC_USE_AGENT_STORE="False", MASTER_PORT=str(int(os.environ["MASTER_PORT"]) + attempt))
    if me == 0:
        (out / f"attempt{attempt}.start").write_text(repr(time.time()))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import reset_accelerate_state, runs_sharing_one_process_group
    from neox_hf.cli import train_main as run

    faults = [fault.split("@") for fault in plan.split(",")]
    with runs_sharing_one_process_group():
        if attempt == 0:
            status = run([*run_args, "--output.dir", str(out / "straight")])
            if status:
                return status
            reset_accelerate_state()
        if attempt < len(faults) and me == int(rank):
            kind, step = faults[attempt]
            marker = out / f"attempt{attempt}"
            {"kill-step": _kill_in_step, "kill-save": _kill_in_save, "term-eval": _term_in_eval}[kind](
                int(step), marker, out / "faulty")
        return run([*run_args, "--output.dir", str(out / "faulty"), *(["--resume"] if attempt else [])])


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
