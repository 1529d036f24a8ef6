"""Several runs of the real entry point (`neox_hf.cli.train_main`, what `run_clm_neox.py` calls) in one launch, one
after the other, resetting Accelerate between them: a launch costs ~15 s of start-up on 2 cores, a tiny run a few.

    accelerate launch --use_deepspeed --num_processes 2 ... tests/workers/init_layouts.py [--keep-going] OUT_DIR \
        NAME="--parallel.tensor_parallel 2" ... -- RUN_ARGS...

Each NAME runs `RUN_ARGS` plus its own overrides with `--output.dir OUT_DIR/NAME`; what rank 0 prints during it goes
to `OUT_DIR/NAME.stdout` (the start-up report a test reads) and `OUT_DIR/NAME.stderr`, its exit status to
`OUT_DIR/NAME.status`. A run that fails stops the launch with its exit status, unless `--keep-going` (runs expected
to be refused, one process: a refusal leaves no process group to agree on). A ZeRO-3 run goes last (transformers keeps
its ZeRO-3 config for later models).
"""

import contextlib
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the suite-wide conftest helpers
from conftest import layout_runs_argv, reset_accelerate_state, runs_sharing_one_process_group  # noqa: E402


def main(argv: list[str], around=None) -> int:
    """`around(name)`, where given, is a context manager each run NAME runs inside (a probe of a test's worker:
    tests/workers/fsdp2_layouts.py)."""
    from neox_hf.cli import train_main as run

    keep_going = argv[:1] == ["--keep-going"]
    argv = argv[1:] if keep_going else argv
    out_dir, layouts, common = layout_runs_argv(argv)
    rank = int(os.environ.get("RANK", "0"))
    with runs_sharing_one_process_group():
        for name, overrides in layouts:
            environ = dict(os.environ)
            written = {kind: out_dir / f"{name}.{kind}" if rank == 0 else Path(os.devnull) for kind in ("stdout", "stderr")}
            with written["stdout"].open("w") as stdout, written["stderr"].open("w") as stderr, \
                    contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), \
                    (around(name) if around else contextlib.nullcontext()):
                status = run([*common, *shlex.split(overrides), "--output.dir", str(out_dir / name)])
            if rank == 0:
                (out_dir / f"{name}.status").write_text(str(status))
            if status and not keep_going:
                if rank == 0:  # the refusal, where the launch's output shows it
                    sys.stderr.write(written["stderr"].read_text()[-5000:])
                return status
            reset_accelerate_state()
            # as the run's own process would, its settings end with it: an Accelerator with a DeepSpeed plugin sets
            # ACCELERATE_USE_DEEPSPEED=true, which a later FSDP2 run would take for a DeepSpeed launch and refuse
            os.environ.clear()
            os.environ.update(environ)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
