"""GPT-NeoX / Megatron memory-mapped indexed datasets (`<prefix>.bin` + `<prefix>.idx`).

Fills a gap: neither `datasets` nor `transformers` reads or writes the format GPT-NeoX's
`tools/datasets/preprocess_data.py` produces, so corpora tokenized for GPT-NeoX (The Pile, Pythia's
deduplicated Pile) could not be reused. The layout, learned from `megatron/data/indexed_dataset.py`:

    .idx  magic b"MMIDIDX\\x00\\x00" | version uint64 LE (=1) | dtype code uint8 | len(sizes) uint64 |
          len(doc_idx) uint64 | sizes int32[len] | pointers int64[len] (byte offsets into .bin) |
          doc_idx int64[len(doc_idx)] (item index where each document starts, then the total)
    .bin  the token ids of every item, back to back, in the dtype named by the code

preprocess_data.py writes one item per document (no sentence splitting), so doc_idx = [0, 1, ..., N].
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from neox_hf.data.files import is_unicode_text, open_text_file
from neox_hf.errors import DataError
from neox_hf.io import atomic_path

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, len(sizes), len(doc_idx)


def indexed_paths(prefix: str | Path) -> tuple[Path, Path]:
    """(`<prefix>.bin`, `<prefix>.idx`); a prefix given with either suffix is accepted."""
    prefix = str(prefix)
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            prefix = prefix[: -len(suffix)]
    return Path(prefix + ".bin"), Path(prefix + ".idx")


def is_indexed_prefix(path: str | Path) -> bool:
    return indexed_paths(path)[1].is_file()


def best_fitting_dtype(vocab_size: int):
    """GPT-NeoX's rule: uint16 while every id fits below 65,500, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def dtype_code(dtype) -> int:
    return next(code for code, dt in DTYPE_CODES.items() if np.dtype(dt) == np.dtype(dtype))


class IndexedDataset:
    """Read-only view of one `.bin/.idx` pair; `document(i)` returns the token ids of document i.

    Every size and offset is checked against the file lengths once, at open, so a truncated or
    inconsistent file fails here with its name rather than as garbage tokens mid-training.
    """

    def __init__(self, prefix: str | Path):
        self.bin_path, self.idx_path = indexed_paths(prefix)
        if not self.idx_path.is_file():
            raise DataError(f"{self.idx_path}: index file not found; a `format: indexed` source needs both "
                            f"{self.bin_path.name} and {self.idx_path.name} (write them with write_indexed_dataset)")
        if not self.bin_path.is_file():
            raise DataError(f"{self.bin_path}: data file not found next to {self.idx_path.name}; copy the .bin too")
        self.dtype, self.sizes, self.pointers, self.doc_idx = _read_index(self.idx_path)
        self._tokens = _open_bin(self.bin_path, self.dtype, self.sizes, self.pointers)

    def __len__(self) -> int:
        return len(self.doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def document(self, i: int) -> np.ndarray:
        first, last = int(self.doc_idx[i]), int(self.doc_idx[i + 1])
        if first == last:
            return np.zeros(0, dtype=self.dtype)
        start = int(self.pointers[first]) // self._tokens.itemsize
        stop = start + int(self.sizes[first:last].sum(dtype=np.int64))
        return self._tokens[start:stop]

    def get(self, item: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of item `item` from `offset`, `length` of them (default: to its end): GPT-NeoX's
        `MMapIndexedDataset.get`, which its samplers read items with."""
        size = int(self.sizes[item])
        stop = size if length is None else min(offset + length, size)
        start = int(self.pointers[item]) // self._tokens.itemsize
        return self._tokens[start + offset: start + stop]


def _read_index(idx_path: Path):
    if idx_path.stat().st_size < _HEADER.size:  # numpy cannot memory-map an empty file
        raise DataError(f"{idx_path}: truncated index ({idx_path.stat().st_size} bytes, header needs {_HEADER.size}); "
                        "rewrite it")
    raw = np.memmap(idx_path, mode="r", dtype=np.uint8)
    if len(raw) < _HEADER.size:
        raise DataError(f"{idx_path}: truncated index ({len(raw)} bytes, header needs {_HEADER.size}); rewrite it")
    magic, version, code, n_sizes, n_docs = _HEADER.unpack(bytes(raw[: _HEADER.size]))
    if magic != MAGIC:
        raise DataError(f"{idx_path}: bad magic {magic!r}, expected {MAGIC!r}: not a GPT-NeoX mmap index "
                        "(the old `TNTIDX` cached format is not supported; re-run preprocess_data.py)")
    if version != VERSION:
        raise DataError(f"{idx_path}: index version {version}, only version {VERSION} is supported")
    if code not in DTYPE_CODES:
        raise DataError(f"{idx_path}: dtype code {code} is not an integer token dtype ({sorted(DTYPE_CODES)})")
    expected = _HEADER.size + 4 * n_sizes + 8 * n_sizes + 8 * n_docs
    if len(raw) != expected:
        raise DataError(f"{idx_path}: {len(raw)} bytes but the header promises {expected} "
                        f"({n_sizes} items, {n_docs} doc_idx entries): truncated or inconsistent; rewrite it")
    offset = _HEADER.size
    sizes = np.frombuffer(raw, dtype=np.int32, count=n_sizes, offset=offset)
    pointers = np.frombuffer(raw, dtype=np.int64, count=n_sizes, offset=offset + 4 * n_sizes)
    doc_idx = np.frombuffer(raw, dtype=np.int64, count=n_docs, offset=offset + 12 * n_sizes)
    if n_docs == 0 or doc_idx[0] != 0 or doc_idx[-1] != n_sizes or np.any(np.diff(doc_idx) < 0):
        raise DataError(f"{idx_path}: doc_idx must rise from 0 to the item count {n_sizes}; the index is corrupt")
    if np.any(sizes < 0):
        raise DataError(f"{idx_path}: negative item sizes; the index is corrupt")
    return DTYPE_CODES[code], sizes, pointers, doc_idx


def _open_bin(bin_path: Path, dtype, sizes: np.ndarray, pointers: np.ndarray) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    expected = int(pointers[-1]) + int(sizes[-1]) * itemsize if len(sizes) else 0
    actual = bin_path.stat().st_size
    if actual != expected:
        raise DataError(f"{bin_path}: {actual} bytes but its index says {expected} "
                        "(truncated copy or a .bin from another run); re-copy or rewrite both files")
    if len(sizes) and not np.array_equal(pointers, _pointers(sizes, itemsize)):
        raise DataError(f"{bin_path.with_suffix('.idx')}: pointers do not match the sizes; the index is corrupt")
    if actual == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(bin_path, mode="r", dtype=dtype)


def _pointers(sizes: np.ndarray, itemsize: int) -> np.ndarray:
    pointers = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(np.asarray(sizes[:-1], dtype=np.int64) * itemsize, out=pointers[1:])
    return pointers


# ----------------------------------------------------------------------------------------------------------------
# Writer
# ----------------------------------------------------------------------------------------------------------------


def write_indexed_dataset(jsonl_paths, tokenizer, out_prefix: str | Path, *, text_key: str = "text",
                          append_eod: bool = True, workers: int = 1, batch_size: int = 1000,
                          counts: dict | None = None) -> tuple[Path, Path]:
    """Tokenize `.jsonl` (also `.gz` / `.zst`) files into `<out_prefix>.bin/.idx`, byte-compatible with
    GPT-NeoX's `preprocess_data.py --jsonl-keys text_key [--append-eod]` with the same tokenizer.

    As there: empty texts are dropped, each document is one item ended by EOD when `append_eod`, the dtype
    is uint16 below a 65,500-token vocabulary, else int32. `workers > 1` tokenizes batches in a process pool
    (order kept). Both files are written to temporary names and renamed, so a crash never leaves a pair that
    looks complete (and nothing is left on failure). A run that finds no document with a string `text_key`
    field raises DataError instead of writing an empty corpus. `counts`, when given, receives "documents" and
    "skipped" (lines without a string `text_key`). Returns (bin_path, idx_path).
    """
    bin_path, idx_path = indexed_paths(out_prefix)
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    dtype = best_fitting_dtype(len(tokenizer))
    eod = tokenizer.eos_token_id
    if append_eod and eod is None:
        raise DataError("write_indexed_dataset: append_eod=True but the tokenizer has no eos_token; "
                        "build it with eos_token='<|endoftext|>' or pass append_eod=False")
    sizes: list[int] = []
    counts = {} if counts is None else counts
    counts.update(documents=0, skipped=0)
    with atomic_path(bin_path) as tmp_bin, atomic_path(idx_path) as tmp_idx:
        with open(tmp_bin, "wb") as out:
            for ids in _tokenized_documents(jsonl_paths, tokenizer, text_key, workers, batch_size, counts):
                if append_eod:
                    ids.append(eod)
                out.write(np.asarray(ids, dtype=dtype).tobytes(order="C"))
                sizes.append(len(ids))
        if not sizes:
            raise DataError(f"no document has a non-empty string field {text_key!r} ({counts['skipped']} line(s) "
                            f"without one{_keys_seen(counts)}); pass --text-key with the field that holds the text")
        with open(tmp_idx, "wb") as out:
            out.write(index_bytes(sizes, dtype))
    counts["documents"] = len(sizes)
    return bin_path, idx_path


def _keys_seen(counts: dict) -> str:
    keys = counts.get("keys_seen")
    return f"; the lines have keys {sorted(keys)}" if keys else ""


def index_bytes(sizes: list[int], dtype) -> bytes:
    """The `.idx` contents for one-item-per-document data of the given item sizes."""
    sizes_arr = np.asarray(sizes, dtype=np.int32)
    doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
    header = _HEADER.pack(MAGIC, VERSION, dtype_code(dtype), len(sizes_arr), len(doc_idx))
    pointers = _pointers(sizes_arr, np.dtype(dtype).itemsize)
    return header + sizes_arr.tobytes() + pointers.tobytes() + doc_idx.tobytes()


def _tokenized_documents(jsonl_paths, tokenizer, text_key: str, workers: int, batch_size: int,
                         counts: dict) -> Iterator[list[int]]:
    batches = _text_batches(_jsonl_texts(jsonl_paths, text_key, counts), batch_size)
    if workers <= 1:
        encoded = (_encode(tokenizer, batch) for batch in batches)
        yield from (ids for batch in encoded for ids in batch if ids)
        return
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        for batch in pool.imap(_encode_in_worker, batches):
            yield from (ids for ids in batch if ids)


def _jsonl_texts(jsonl_paths, text_key: str, counts: dict) -> Iterator[str]:
    paths = [jsonl_paths] if isinstance(jsonl_paths, (str, Path)) else list(jsonl_paths)
    for path in paths:
        try:
            yield from _texts_of_file(path, text_key, counts)
        except DataError:
            raise
        except EOFError as err:  # gzip's (and data/files.py's zstd reader's) word for a file cut short
            raise DataError(f"{path} is truncated (compressed stream ends early): download it again") from err
        except Exception as err:  # gzip / zstandard / OS errors of a damaged or mislabelled file
            raise DataError(f"{path}: cannot be read ({type(err).__name__}: {err}); the file is damaged or its suffix "
                            "does not match its compression (.jsonl, .jsonl.gz, .jsonl.zst)") from err


def _texts_of_file(path, text_key: str, counts: dict) -> Iterator[str]:
    import json

    with open_text_file(path) as lines:
        for line_no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                text = row.get(text_key)
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
                raise DataError(f"{path}:{line_no}: not a JSON object ({err}); fix or remove the line") from err
            if isinstance(text, str) and not is_unicode_text(text):
                raise DataError(f"{path}:{line_no}: `{text_key}` is not Unicode text (a lone surrogate, e.g. a JSON "
                                "\\ud800 escape without its pair); fix or remove the line")
            if isinstance(text, str) and text:  # preprocess_data.py also drops empty documents
                yield text
            elif not isinstance(text, str):
                counts["skipped"] = counts.get("skipped", 0) + 1
                counts.setdefault("keys_seen", set()).update(map(str, row))


def _text_batches(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]


_WORKER_TOKENIZER = None


def _init_worker(tokenizer) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer


def _encode_in_worker(texts: list[str]) -> list[list[int]]:
    return _encode(_WORKER_TOKENIZER, texts)
