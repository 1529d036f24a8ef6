"""What a data loader's saved position holds that both the loader and its resize (`data/resize.py`, continuing
the old data-parallel ranks' positions on a new layout) read: the state's version and the per-run stats counters."""

from __future__ import annotations

STATE_VERSION = 1
STAT_KEYS = ("documents", "skipped_empty", "skipped_undecodable", "truncated", "no_answer", "real_tokens",
             "padded_tokens")


def empty_stats() -> dict:
    return {key: 0 for key in STAT_KEYS}
