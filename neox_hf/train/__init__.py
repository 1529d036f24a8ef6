"""Training: the loop, LR schedule, checkpoints and resume."""

from __future__ import annotations

import os
import sys
import traceback

from neox_hf.errors import NeoXHFError, print_to_stderr


def main(argv: list[str] | None = None) -> int:
    """`run_clm_neox.py` entry: parse → (print config | train). Bad input exits 2 with the message; a run stopped by
    SIGTERM / SIGUSR1 exits 75 after its checkpoint (neox_hf.train.preemption). A rank of a multi-process run that
    fails says so in one line naming itself and exits at once (README: "Failures and preemption")."""
    from neox_hf.train.args import USAGE, parse_run_args

    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(f"usage: {USAGE}")
        return 0
    try:
        args = parse_run_args(argv)
    except NeoXHFError as err:
        print_to_stderr(f"error: {err}")
        return 2
    if args.print_config:
        print(args.recipe.to_yaml(), end="")
        for notice in [*args.notices, *getattr(args.recipe, "settled_notices", [])]:
            print(f"# note: {notice}")
        print(f"# {_plan_line(args.recipe)}")
        return 0
    from neox_hf.train.loop import train
    from neox_hf.train.preemption import PREEMPTED_EXIT_STATUS, Preempted

    try:
        train(args.recipe, notices=args.notices, overwrite=args.overwrite)
    except Preempted as stopped:
        print_to_stderr(f"\n{_rank_prefix()}{stopped}")
        return _end_rank(PREEMPTED_EXIT_STATUS)
    except NeoXHFError as err:
        # A failure mid-run leaves the progress bar's line open (it ends in \r): start the error on a line of its own.
        print_to_stderr(f"\nerror: {_rank_prefix()}{err}")
        return _end_rank(2)
    except Exception as err:
        if not _several_ranks():
            raise  # one process: the traceback, as Python ends it
        if _lost_a_peer(err):  # not this rank's failure: the rank that ended has said why
            print_to_stderr(f"\n{_rank_prefix()}stopped: another rank ended (its own line says why): "
                            f"{str(err).splitlines()[0][:200]}")
        else:
            traceback.print_exc()
            print_to_stderr(f"error: {_rank_prefix()}{type(err).__name__}: {err}")
        return _end_rank(1)
    return 0


def _several_ranks() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank_prefix() -> str:
    """`rank R of N: ` in a multi-process run (which rank failed), nothing in one process."""
    import torch.distributed as dist

    return f"rank {dist.get_rank()} of {dist.get_world_size()}: " if _several_ranks() else ""


def _end_rank(status: int) -> int:
    """In a multi-process run, end this process now with `status`, skipping the interpreter's teardown and any
    collective: the teardown (a process group whose peers still wait in a collective) held a failed rank ~4 s on
    gloo, and the launcher ends the other ranks only once one has exited. What matters is written already
    (checkpoints are saved atomically, the train log line by line); stdout and stderr are flushed here. One process
    returns `status` to its caller."""
    if not _several_ranks():
        return status
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _lost_a_peer(err: BaseException) -> bool:
    """Whether `err` is a collective failing because another rank's process ended: gloo's transport reports the
    closed connection ("Connection closed by peer", "Broken pipe"), NCCL "remote process exited"; or a checkpoint
    save whose staging folder a failed rank removed."""
    from neox_hf.train.checkpoint import SaveAbandoned

    text = str(err)
    return isinstance(err, SaveAbandoned) or "gloo/transport" in text or "remote process exited" in text


def _plan_line(recipe) -> str:
    """`neox_hf plan`'s one line for the recipe's own layout (memory per rank), for `--print-config`."""
    from neox_hf.plan import plan_summary_line

    try:
        return plan_summary_line(recipe)
    except NeoXHFError as err:  # the config printed is still right; say why there is no plan
        return f"plan: not available for this recipe ({err})"
