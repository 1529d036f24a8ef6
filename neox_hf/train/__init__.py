"""Training: the loop, LR schedule, checkpoints and resume."""

from __future__ import annotations

import sys

from neox_hf.errors import NeoXHFError, print_to_stderr


def main(argv: list[str] | None = None) -> int:
    """`run_clm_neox.py` entry: parse → (print config | train). Bad input exits 2 with the message."""
    from neox_hf.recipe.args import USAGE, parse_run_args

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

    try:
        train(args.recipe, notices=args.notices, overwrite=args.overwrite)
    except NeoXHFError as err:
        # A failure mid-run leaves the progress bar's line open (it ends in \r): start the error on a line of its own.
        print_to_stderr(f"\nerror: {err}")
        return 2
    return 0


def _plan_line(recipe) -> str:
    """`neox_hf plan`'s one line for the recipe's own layout (memory per rank), for `--print-config`."""
    from neox_hf.plan import plan_summary_line

    try:
        return plan_summary_line(recipe)
    except NeoXHFError as err:  # the config printed is still right; say why there is no plan
        return f"plan: not available for this recipe ({err})"
