"""`run_clm_neox.py` (the real entry, `neox_hf.cli.train_main`) with one rank meeting a fault at a chosen step:

    torchrun --standalone --nproc_per_node N tests/workers/fail_at_step.py RANK STEP KIND -- RUN_ARGS...

KIND is where the fault starts, each through the code path a real one takes:
- `data`: the loader of RANK raises a DataError when producing the batch of step STEP (in the prefetch thread, as a
  data source that breaks mid-run does);
- `disk`: RANK's write of its trainer state in the step-STEP checkpoint fails with ENOSPC (a full disk), while the
  other ranks wait in the save's barrier;
- `exception`: RANK raises a RuntimeError after the optimizer step STEP, as a bug would.

Before raising, RANK writes the time (`time.time()`) to `<output.dir>.fault_time`, for the test to measure how long
the launch took to end after it.
"""

import errno
import os
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    split = argv.index("--")
    (rank, step, kind), run_args = argv[:split], argv[split + 1:]
    rank, step = int(rank), int(step)
    if int(os.environ.get("RANK", "0")) == rank:
        marker = Path(run_args[run_args.index("--output.dir") + 1] + ".fault_time")
        {"data": _data_fault, "disk": _disk_fault, "exception": _exception_fault}[kind](step, marker)
    from neox_hf.cli import train_main as run

    return run(run_args)


def _mark(marker: Path) -> None:
    marker.write_text(repr(time.time()))


def _data_fault(step: int, marker: Path) -> None:
    from neox_hf.errors import DataError
    from neox_hf.train.prefetch import Prefetcher

    produce = Prefetcher._items_in_thread

    def items(self):
        for produced, item in enumerate(produce(self), start=1):
            if produced == step:
                _mark(marker)
                raise DataError(f"document {produced} of this rank's shard is corrupt (injected by {__file__})")
            yield item

    Prefetcher._items_in_thread = items


def _disk_fault(step: int, marker: Path) -> None:
    import neox_hf.checkpoint.save as checkpoint  # where save_checkpoint looks the writer up

    write = checkpoint.atomic_torch_save

    def atomic_torch_save(obj, path, *args, **kwargs):
        if f"step_{step:08d}" in str(path):
            _mark(marker)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return write(obj, path, *args, **kwargs)

    checkpoint.atomic_torch_save = atomic_torch_save


def _exception_fault(step: int, marker: Path) -> None:
    import neox_hf.train.loop as loop

    advance = loop._advance_schedule

    def _advance_schedule(run, state, result):
        lr = advance(run, state, result)
        if state.step == step:
            _mark(marker)
            raise RuntimeError(f"injected fault after step {step} (by {__file__})")
        return lr

    loop._advance_schedule = _advance_schedule


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
