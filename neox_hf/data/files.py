"""Opening corpus files: plain, `.gz` or `.zst` (The Pile ships `.jsonl.zst`).

Its own module so that both the `.bin/.idx` writer (indexed.py) and the document sources (sources.py) use it
without importing each other: sources imports indexed, never the reverse.
"""

from __future__ import annotations

import contextlib
import gzip
import io
from typing import Iterator


@contextlib.contextmanager
def open_text_file(path) -> Iterator[io.BufferedIOBase]:
    """A binary line iterator over a plain, `.gz` or `.zst` file."""
    path = str(path)
    if path.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            yield f
    elif path.endswith((".zst", ".zstd")):
        import zstandard

        with open(path, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as reader:
            yield io.BufferedReader(reader)
    else:
        with open(path, "rb") as f:
            yield f
