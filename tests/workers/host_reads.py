"""Host reads of whole runs of the real entry point (`neox_hf.cli.train_main`) on each layout of one launch, counted
by tests/conftest.py's HostReads dispatch mode on every rank (tests/test_host_syncs.py):

    accelerate launch --use_deepspeed --num_processes 2 ... tests/workers/host_reads.py OUT_DIR \
        NAME="--parallel.tensor_parallel 2" ... -- RUN_ARGS...

Each NAME runs RUN_ARGS plus its overrides twice, with `--train.train_iters` 2 and 6 (logged once, at the end), and
writes OUT_DIR/NAME.rank{R}.json: {"2": {op: count}, "6": {op: count}}.
"""

import json
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the suite-wide conftest helpers
from conftest import (HostReads, end_process_group, layout_runs_argv, reset_accelerate_state,  # noqa: E402
                      runs_sharing_one_process_group)


def main(argv: list[str]) -> int:
    from neox_hf.cli import train_main

    out_dir, layouts, common = layout_runs_argv(argv)
    rank = int(os.environ.get("RANK", "0"))
    with runs_sharing_one_process_group():
        for name, overrides in layouts:
            counts = {}
            for steps in (2, 6):
                mode = HostReads()
                with mode:
                    status = train_main([*common, *shlex.split(overrides), "--train.train_iters", str(steps),
                                         "--train.log_interval", str(steps),
                                         "--output.dir", str(out_dir / f"{name}-{steps}")])
                reset_accelerate_state()
                if status:
                    return status
                counts[str(steps)] = mode.counts
            (out_dir / f"{name}.rank{rank}.json").write_text(json.dumps(counts))
    end_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
