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
        with open(path, "rb") as raw:
            yield io.BufferedReader(_ZstdFrames(raw, path), buffer_size=1 << 20)
    else:
        with open(path, "rb") as f:
            yield f


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of every frame of a `.zst` file (pzstd writes several); EOFError, as gzip raises, when
    the file ends inside a frame. zstandard's `stream_reader` ends quietly where the file does: a download cut short
    read as a shorter corpus (`neox_hf preprocess` wrote it whole)."""

    def __init__(self, raw, path: str):
        import zstandard

        self._raw, self._path, self._dctx = raw, path, zstandard.ZstdDecompressor()
        self._frame = None  # the decompressor of the frame being read; None between frames
        self._out, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._pos == len(self._out):
            chunk = self._raw.read(1 << 17)
            if not chunk:
                if self._frame is not None:
                    raise EOFError(f"{self._path} ends inside a zstd frame")
                return 0
            self._out, self._pos = self._decompress(chunk), 0
        n = min(len(buffer), len(self._out) - self._pos)
        buffer[:n] = self._out[self._pos:self._pos + n]
        self._pos += n
        return n

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            if self._frame is None:
                self._frame = self._dctx.decompressobj()
            out.append(self._frame.decompress(data))
            data = b""
            if self._frame.eof:  # the rest of the chunk starts the next frame
                data, self._frame = self._frame.unused_data, None
        return b"".join(out)


def is_unicode_text(text: str) -> bool:
    """Whether `text` is Unicode the tokenizer can take: JSON's `\\ud800` escape (half a UTF-16 pair) decodes to a
    lone surrogate, on which the tokenizer raised a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
