"""tests/workers/init_layouts.py (several runs of the real entry point in one launch) with two probes a run can be
given by name, for tests/test_fsdp2.py:

    torchrun --standalone --nproc_per_node N tests/workers/fsdp2_layouts.py [--count NAME]... \
        [--kill-in-save NAME:STEP] OUT_DIR NAME="--parallel.backend fsdp2 ..." ... -- RUN_ARGS...

- `--count NAME`: the run NAME trains under a dispatch mode that counts every c10d collective (FSDP2's reduce-scatters
  included) and rank 0 writes what it counted, `{op: calls}`, to OUT_DIR/NAME.collectives.json;
- `--kill-in-save NAME:STEP`: in the run NAME, every rank SIGKILLs itself in the middle of the step-STEP checkpoint
  save, once its layout-free chunks are written (DCP's metadata too) and before the trainer state, the rename of the
  staging folder and `latest`: `kill -9` of the whole job during the save. The launch then fails, so that run goes
  last; rank 0 writes OUT_DIR/NAME.killed first (the staging folder it leaves).
"""

import contextlib
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import init_layouts  # noqa: E402


def main(argv: list[str]) -> int:
    counted, kills = set(), {}
    while argv[0] in ("--count", "--kill-in-save"):
        flag, value, argv = argv[0], argv[1], argv[2:]
        if flag == "--count":
            counted.add(value)
        else:
            name, step = value.rsplit(":", 1)
            kills[name] = int(step)
    out_dir = Path(argv[0])

    @contextlib.contextmanager
    def around(name: str):
        with contextlib.ExitStack() as stack:
            if name in kills:
                stack.enter_context(_killed_in_save(kills[name], out_dir / f"{name}.killed"))
            if name in counted:
                stack.enter_context(_counted(out_dir / f"{name}.collectives.json"))
            yield

    return init_layouts.main(argv, around=around)


@contextlib.contextmanager
def _counted(path: Path):
    """Every c10d collective the run issues (FSDP2's all-gathers and reduce-scatters, the loop's all-reduces), seen
    where PyTorch dispatches them. (torch's CommDebugMode counts the same ops, but its module tracker fails on the
    loop's forward hooks.)"""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Collectives(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                self.calls[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with Collectives() as collectives:
        yield
    if int(os.environ.get("RANK", "0")) == 0:
        path.write_text(json.dumps(dict(collectives.calls)))


@contextlib.contextmanager
def _killed_in_save(step: int, marker: Path):
    import neox_hf.checkpoint.save as checkpoint  # where save_checkpoint looks the writer up

    write = checkpoint.save_layout_free

    def save_layout_free(tensors, folder, *args, **kwargs):
        written = write(tensors, folder, *args, **kwargs)
        if Path(folder).name.endswith(checkpoint.checkpoint_name(step)):
            if int(os.environ.get("RANK", "0")) == 0:
                marker.write_text(str(folder))
            os.kill(os.getpid(), signal.SIGKILL)  # no flush, no atexit, no exception handler: as `kill -9`
        return written

    checkpoint.save_layout_free = save_layout_free
    try:
        yield
    finally:
        checkpoint.save_layout_free = write


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
