"""The one family of exceptions neox_hf raises for bad input.

Every message names the offending key / file and says how to fix it.
They subclass ValueError so callers that already catch ValueError keep working.
"""

import sys


class NeoXHFError(ValueError):
    """Base class: bad input that the user can fix."""


class RecipeError(NeoXHFError):
    """A recipe (YAML, GPT-NeoX config, or CLI override) is malformed."""


class DataError(NeoXHFError):
    """A data source is missing, malformed or inconsistent."""


class CheckpointError(NeoXHFError):
    """A checkpoint is missing, truncated, corrupt or incompatible."""


class HubError(NeoXHFError):
    """Talking to the Hugging Face Hub failed in a way retrying cannot fix."""


class LaunchError(NeoXHFError):
    """The launch (process count, launcher flags) cannot give the recipe's layout."""


class TrainingDiverged(NeoXHFError):
    """The loss or gradient norm became non-finite: the recipe's optimisation settings diverge."""


class UsageError(NeoXHFError):
    """A command-line argument or flag is wrong (not a recipe value)."""


def first_line(err: BaseException) -> str:
    """The first line of `err`'s message (its type's name when it has none): what a one-line refusal quotes."""
    return next(iter(str(err).strip().splitlines()), type(err).__name__)


def print_to_stderr(line: str) -> None:
    """Write `line` and its newline to stderr in ONE write call.

    The ranks of a launch share one stderr pipe, and `print` writes the text and its newline in two calls on Python's
    unbuffered stderr, so two ranks refusing the same recipe at once could interleave as "error: …error: …\n\n".
    One write of a line under PIPE_BUF (4 KiB) is atomic on a pipe.
    """
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()
