"""Preemption: SIGTERM or SIGUSR1 (what Kubernetes and SLURM send before they kill a job; SLURM's `--signal=USR1@…`
comes ahead of the time limit) end the run at a step boundary that every rank agrees on, after a checkpoint, with
exit status `PREEMPTED_EXIT_STATUS`; `--resume` continues it exactly.

Gap filled: neither Accelerate nor DeepSpeed handles these signals, and without a handler a signal ends every rank at
once, losing the steps since the last checkpoint. A signal may reach the ranks at different steps, so no rank acts on
its own: the ranks agree at log steps (`train.log_interval`), where the loop already stops the host for the logged
losses, through one all-reduce of a flag; no step pays a host sync for it. One process checks its flag every step.
The handlers are installed for the steps only: during start-up and the final evaluation and save a signal ends the
run at once, as without them.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

# EX_TEMPFAIL (sysexits.h): stopped on request with a checkpoint written; running again with --resume continues.
PREEMPTED_EXIT_STATUS = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """Raised by the loop on every rank once the ranks agreed to stop: the checkpoint of `step` is written."""

    def __init__(self, step: int, signal_name: str):
        super().__init__(f"stopped on {signal_name} after step {step}, with its checkpoint written: run the same "
                         "command with --resume to continue")
        self.step = step


class StopRequest:
    """While active (a `with` block, in the main thread): the first SIGTERM / SIGUSR1 asks the run to stop; later ones
    change nothing (a scheduler and the launcher forwarding to its workers may each send one, and a second signal
    must not cut short the checkpoint the first one asked for). The previous handlers are restored on exit."""

    def __init__(self):
        self.signal: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopRequest":
        try:
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        except ValueError:  # not the main thread (a notebook's worker thread): signals keep their default action
            self._previous = {}
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def _handle(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum

    def agreed(self, device, world_size: int) -> str | None:
        """The name of the signal that stops the run when any rank has received one, else None. Collective when
        `world_size` > 1: every rank calls it at the same steps."""
        flag = 0 if self.signal is None else int(self.signal)
        if world_size > 1:
            import torch.distributed as dist

            reduced = torch.tensor([flag], device=device)
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
            flag = int(reduced.item())
        return signal.Signals(flag).name if flag else None


# -- how a rank of a multi-process run ends (README: "Failures and preemption") ------------------------------


def several_ranks() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_prefix() -> str:
    """`rank R of N: ` in a multi-process run (which rank failed), nothing in one process."""
    import torch.distributed as dist

    return f"rank {dist.get_rank()} of {dist.get_world_size()}: " if several_ranks() else ""


def end_rank(status: int) -> int:
    """In a multi-process run, end this process now with `status`, skipping the interpreter's teardown and any
    collective: the teardown (a process group whose peers still wait in a collective) held a failed rank ~4 s on
    gloo, and the launcher ends the other ranks only once one has exited. What matters is written already
    (checkpoints are saved atomically, the train log line by line); stdout and stderr are flushed here. One process
    returns `status` to its caller."""
    if not several_ranks():
        return status
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def lost_a_peer(err: BaseException) -> bool:
    """Whether `err` is a collective failing because another rank's process ended: gloo's transport reports the
    closed connection ("Connection closed by peer", "Broken pipe"), NCCL "remote process exited"; or a checkpoint
    save whose staging folder a failed rank removed."""
    from neox_hf.checkpoint import SaveAbandoned

    text = str(err)
    return isinstance(err, SaveAbandoned) or "gloo/transport" in text or "remote process exited" in text
