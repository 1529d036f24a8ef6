"""Documents from recipe `DataSource`s as one `datasets.IterableDataset`: read, blend, shard per rank, tokenize.

Every source becomes a stream of rows `{input_ids, prompt_length, skip, source}`:
  input_ids      token ids of the document, EOD appended when `append_eod` (indexed data already has it)
  prompt_length  leading tokens that are prompt (`prompt_template`): their labels are masked downstream
  skip           "" for a usable document, else why it is not used: "empty", "undecodable", "split"
                 (held out for the other split; not counted as a loss of data)
  source         the source's index in the list given to `document_stream` (a blended source that gives
                 nothing is refused by name downstream)

Library verbs used: `IterableDataset.from_generator` (sharded by file so `split_dataset_by_node` can give
whole files to ranks), `load_dataset(streaming=...)` for parquet / JSON-array files / Hub names,
`interleave_datasets` for GPT-NeoX-style weighted blending, `split_dataset_by_node` for data parallelism,
`map(batched=True)` for tokenization with the fast tokenizer, and `IterableDataset.state_dict()` for the
exact upstream position on resume.

Gap filled: `datasets`' json/text builders abort the whole stream on one line of invalid UTF-8 or JSON, and
its text builder has no "document" notion. Our line readers turn such a line into a row with
`skip="undecodable"` (counted, never a crash), and `.txt` files are split into documents at blank lines
(Tiny Shakespeare: one document per speech; a file without blank lines is one document). A compressed file cut
short (an interrupted download) is refused naming it: gzip raises a bare EOFError at the cut and zstandard's
stream reader silently stops there, so it would otherwise be trained on up to the cut.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import random
import zlib
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from neox_hf.data.files import open_text_file
from neox_hf.data.indexed import IndexedDataset, indexed_paths, is_indexed_prefix
from neox_hf.errors import DataError, first_line
from neox_hf.recipe import DataSource

COLUMNS = ["input_ids", "prompt_length", "skip", "source"]
JSON_LINE_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst", ".jsonl.zstd")
SHARDS_PER_INDEXED_SOURCE = 16  # document ranges, so ranks and epochs can take different orders


# ----------------------------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------------------------


def source_format(source: DataSource) -> str:
    """json | jsonl | parquet | text | indexed | hub, from `format` or the path's suffix."""
    path = source.path
    if source.format == "indexed" or (source.format is None and is_indexed_prefix(path)):
        return "indexed"
    if source.format in ("parquet", "text", "hub"):
        return source.format
    if source.format == "json":
        return "jsonl" if not path.endswith(".json") else "json"
    if path.endswith(JSON_LINE_SUFFIXES):
        return "jsonl"
    if path.endswith(".json"):
        return "json"
    if path.endswith(".parquet"):
        return "parquet"
    if path.endswith(".txt"):
        return "text"
    if not any(ch in path for ch in "*?[/") and not Path(path).exists():
        return "hub"
    raise DataError(f"data source `{path}`: cannot tell the format from the suffix; use .jsonl/.json/.jsonl.gz/"
                    ".jsonl.zst/.parquet/.txt, a .bin/.idx prefix, or set `format:` on the source")


def resolve_files(source: DataSource) -> list[str]:
    """The files a local source's glob names, sorted so every rank and run sees the same list."""
    files = sorted(glob.glob(str(Path(source.path).expanduser()), recursive=True))
    files = [f for f in files if Path(f).is_file()]
    if not files:
        raise DataError(f"data source `{source.path}`: no file matches; check the path/glob "
                        "(relative paths are from the working directory)")
    return files


# ----------------------------------------------------------------------------------------------------------------
# Compressed files: whole, or refused naming the file
# ----------------------------------------------------------------------------------------------------------------

COMPRESSED_SUFFIXES = (".gz", ".zst", ".zstd")
STARTUP_SCAN_BYTES = 256 * 2**20  # compressed bytes verified when the loader is built (~1-3 s); the rest as read
_SCAN_CHUNK = 2**20
_verified: set[tuple[str, int, int]] = set()  # (path, size, mtime) of compressed files found whole


def is_compressed(path) -> bool:
    return str(path).endswith(COMPRESSED_SUFFIXES)


def check_compressed_file(path) -> None:
    """Decompress `path` to nowhere; DataError naming it when the stream ends early (an interrupted download) or
    is not valid. Decompressing costs a few % of tokenizing the same text, and each version of a file is checked
    once per process."""
    path = str(path)
    stat = os.stat(path)
    key = (os.path.abspath(path), stat.st_size, stat.st_mtime_ns)
    if key in _verified:
        return
    try:
        whole = stat.st_size > 0 and (_gzip_is_whole(path) if path.endswith(".gz") else _zstd_is_whole(path))
    except _decompression_errors() as err:
        raise _compressed_file_error(path, err) from None
    if not whole:
        raise _compressed_file_error(path, EOFError())
    _verified.add(key)


def _gzip_is_whole(path: str) -> bool:
    try:
        with gzip.open(path, "rb") as f:  # reads every member, as `cat a.gz b.gz` makes
            while f.read(_SCAN_CHUNK):
                pass
    except EOFError:
        return False
    return True


def _zstd_is_whole(path: str) -> bool:
    """A decompression object says when its frame ended (`eof`); the file is whole when no frame is left open.
    Frames follow one another (pzstd, `cat a.zst b.zst`): each one's `unused_data` starts the next."""
    import zstandard

    decompressor = zstandard.ZstdDecompressor()
    frame, in_frame = decompressor.decompressobj(), False
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_SCAN_CHUNK), b""):
            while chunk:
                frame.decompress(chunk)
                in_frame = not frame.eof
                if in_frame:
                    break
                chunk, frame = frame.unused_data, decompressor.decompressobj()
    return not in_frame


def _decompression_errors() -> tuple:
    import zstandard

    return EOFError, zlib.error, gzip.BadGzipFile, zstandard.ZstdError


def _compressed_file_error(path: str, err: BaseException) -> DataError:
    if isinstance(err, EOFError):
        return DataError(f"{path} is truncated (compressed stream ends early): download it again")
    kind = "gzip" if path.endswith(".gz") else "zstd"
    return DataError(f"{path} is not a valid {kind} file ({err}): download it again, or rename it to its real suffix")


def file_lines(path) -> Iterator[bytes]:
    """The lines of a local file (plain, .gz, .zst), a compressed one verified whole before its first line."""
    if is_compressed(path):
        check_compressed_file(path)
    try:
        with open_text_file(path) as lines:
            yield from lines
    except _decompression_errors() as err:  # changed since it was verified
        raise _compressed_file_error(str(path), err) from None


def check_sources(sources: list[DataSource], *, scan_bytes: int = STARTUP_SCAN_BYTES) -> None:
    """Start-up checks of local line-based sources (jsonl, txt), cheap enough to run before the model is built:
    their compressed files are whole (the first `scan_bytes` of them; the files of a larger corpus are verified one
    by one when first read), and each source has a non-blank line (an empty source would leave its blending weight
    to the others)."""
    for source in sources:
        if source_format(source) not in ("jsonl", "text"):
            continue
        files = resolve_files(source)
        for path in filter(is_compressed, files):
            size = os.path.getsize(path)
            if size <= scan_bytes:
                check_compressed_file(path)
                scan_bytes -= size
        if not any(_has_a_line(path) for path in files):
            what = f"{files[0]} is" if len(files) == 1 else f"its {len(files)} files are"
            raise DataError(f"data source `{source.path}` holds no document: {what} empty (no non-blank line); "
                            "give the right path, or drop the source")


def _has_a_line(path: str) -> bool:
    try:
        with open_text_file(path) as lines:
            return any(line.strip() for line in lines)
    except _decompression_errors() as err:
        raise _compressed_file_error(path, err) from None


# ----------------------------------------------------------------------------------------------------------------
# Rows → text
# ----------------------------------------------------------------------------------------------------------------


def document_texts(source: DataSource, row) -> tuple[Optional[str], Optional[str], str]:
    """(text, prompt, error) of one raw row: `template` (str.format over fields) or `text_key`;
    the prompt is `prompt_template` over the same fields and must be a prefix of the text."""
    if not isinstance(row, dict):
        return None, None, "undecodable"
    try:
        text = source.template.format(**row) if source.template else row.get(source.text_key)
        prompt = source.prompt_template.format(**row) if source.prompt_template else None
    except (KeyError, IndexError, ValueError, AttributeError):
        return None, None, "undecodable"  # a missing field; an all-missing source fails at epoch end (loader)
    if not isinstance(text, str):
        return None, None, "undecodable"
    if prompt is not None and not text.startswith(prompt):
        raise DataError(f"data source `{source.path}`: prompt_template {source.prompt_template!r} is not a prefix "
                        f"of template {source.template!r}; the template must start with the prompt")
    return text, prompt, ""


def _json_line_rows(files: list[str], source: DataSource) -> Iterator[dict]:
    for path in files:
        for line in file_lines(path):
            if not line.strip():
                continue
            try:
                row = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                yield _text_row(None, None, "undecodable")
                continue
            yield _text_row(*document_texts(source, row))


def _paragraph_rows(files: list[str], source: DataSource) -> Iterator[dict]:
    """Documents of `.txt` files: runs of non-blank lines (a blank line ends a document)."""
    for path in files:
        paragraph: list[bytes] = []
        for line in file_lines(path):
            if line.strip():
                paragraph.append(line)
            elif paragraph:
                yield _decoded_paragraph(paragraph, source)
                paragraph = []
        if paragraph:
            yield _decoded_paragraph(paragraph, source)


def _decoded_paragraph(lines: list[bytes], source: DataSource) -> dict:
    try:
        text = b"".join(lines).decode("utf-8").rstrip("\n")
    except UnicodeDecodeError:
        return _text_row(None, None, "undecodable")
    return _text_row(*document_texts(source, {"text": text, source.text_key: text}))


def _text_row(text, prompt, error) -> dict:
    return {"text": text, "prompt": prompt, "error": error}


def _texts_from_table_batch(batch: dict, *, source: DataSource) -> dict:
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    texts, prompts, errors = zip(*(document_texts(source, row) for row in rows)) if rows else ((), (), ())
    return {"text": list(texts), "prompt": list(prompts), "error": list(errors)}


# ----------------------------------------------------------------------------------------------------------------
# Tokenization and the held-out rule
# ----------------------------------------------------------------------------------------------------------------


def is_held_out(content: bytes, fraction: float) -> bool:
    """Deterministic validation hold-out: a document is held out when the hash of its content falls below
    `fraction`; independent of rank, epoch, file order and blending, so train never sees a held-out doc."""
    if fraction <= 0.0:
        return False
    digest = hashlib.blake2b(content, digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64 < fraction


def _keeps(held_out: bool, role: str) -> bool:
    return role == "all" or (role == "validation") == held_out


def _tokenize_batch(batch: dict, *, tokenizer, append_eod: bool, role: str, fraction: float, index: int) -> dict:
    """Batched map: text → ids (one fast-tokenizer call per batch); prompt length via character offsets
    (a token belongs to the prompt only if it ends inside it, so BPE merges across the seam stay learned)."""
    n = len(batch["text"])
    ids: list[list[int]] = [[] for _ in range(n)]
    prompt_lengths, skips = [0] * n, list(batch["error"])
    todo = []
    for i, text in enumerate(batch["text"]):
        if skips[i]:
            continue
        try:
            content = text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates from a JSON escape
            skips[i] = "undecodable"
            continue
        if not _keeps(is_held_out(content, fraction), role):
            skips[i] = "split"
        elif not text.strip():
            skips[i] = "empty"
        else:
            todo.append(i)
    with_prompt = any(batch["prompt"][i] is not None for i in todo)
    encoded = tokenizer([batch["text"][i] for i in todo], add_special_tokens=False,
                        return_attention_mask=False, return_offsets_mapping=with_prompt) if todo else {}
    for k, i in enumerate(todo):
        doc = list(encoded["input_ids"][k])
        if not doc:
            skips[i] = "empty"
            continue
        prompt = batch["prompt"][i]
        if prompt is not None:
            prompt_lengths[i] = sum(1 for _, end in encoded["offset_mapping"][k] if end <= len(prompt))
        ids[i] = doc + [tokenizer.eos_token_id] if append_eod else doc
    return {"input_ids": ids, "prompt_length": prompt_lengths, "skip": skips, "source": [index] * n}


def _indexed_rows(shards: list, role: str, fraction: float, index: int) -> Iterator[dict]:
    """Generator for `from_generator`: each shard is (prefix, first_doc, last_doc)."""
    for prefix, first, last in shards:
        data = IndexedDataset(prefix)
        for i in range(first, last):
            doc = np.asarray(data.document(i))
            if not len(doc):
                yield {"input_ids": [], "prompt_length": 0, "skip": "empty", "source": index}
            elif not _keeps(is_held_out(doc.astype(np.int64).tobytes(), fraction), role):
                yield {"input_ids": [], "prompt_length": 0, "skip": "split", "source": index}
            else:
                yield {"input_ids": doc.tolist(), "prompt_length": 0, "skip": "", "source": index}


# ----------------------------------------------------------------------------------------------------------------
# One source, then the blended per-rank stream
# ----------------------------------------------------------------------------------------------------------------


def source_dataset(source: DataSource, tokenizer, *, epoch: int, seed: int, shuffle: bool, streaming: bool,
                   append_eod: bool, role: str, fraction: float, index: int = 0):
    """The token rows of one source for one epoch (file / shard order reshuffled with seed + epoch); `index`
    is its place in the blend, carried by every row."""
    import datasets

    fmt = source_format(source)
    order = random.Random(seed + epoch)
    if fmt == "indexed":
        shards = _indexed_shards(source)
        if shuffle:
            order.shuffle(shards)
        rows = {"shards": shards, "role": role, "fraction": fraction, "index": index}
        # No `features=` on our generators: given features, datasets encodes and decodes every row through them in
        # Python (`_apply_feature_types_on_example`), which was half the loader's time on short documents; our rows
        # are already the Python types those features would give.
        return datasets.IterableDataset.from_generator(_indexed_rows, gen_kwargs=rows)
    texts = _text_dataset(source, fmt, order if shuffle else None, streaming)
    return texts.map(_tokenize_batch, batched=True, remove_columns=["text", "prompt", "error"], features=_token_features(),
                     fn_kwargs={"tokenizer": tokenizer, "append_eod": append_eod, "role": role, "fraction": fraction,
                                "index": index})


def _text_dataset(source: DataSource, fmt: str, order: Optional[random.Random], streaming: bool):
    import datasets

    if fmt == "hub":
        raw = datasets.load_dataset(source.path, split=source.split, streaming=streaming)
        return _extracted(raw if streaming else raw.to_iterable_dataset(), source)
    files = resolve_files(source)
    if order is not None:
        order.shuffle(files)
    if fmt in ("jsonl", "text"):
        reader = _json_line_rows if fmt == "jsonl" else _paragraph_rows
        return datasets.IterableDataset.from_generator(
            reader, gen_kwargs={"files": files, "source": source})  # untyped rows: see source_dataset
    builder = "parquet" if fmt == "parquet" else "json"
    raw = datasets.load_dataset(builder, data_files=files, split="train", streaming=streaming)
    return _extracted(raw if streaming else raw.to_iterable_dataset(num_shards=len(files)), source)


def _extracted(raw, source: DataSource):
    columns = raw.column_names
    return raw.map(_texts_from_table_batch, batched=True, remove_columns=columns, features=_text_features(),
                   fn_kwargs={"source": source})


def _indexed_shards(source: DataSource) -> list:
    num_docs = len(IndexedDataset(source.path))
    bounds = np.linspace(0, num_docs, min(SHARDS_PER_INDEXED_SOURCE, max(num_docs, 1)) + 1).astype(int)
    prefix = str(indexed_paths(source.path)[0])[: -len(".bin")]
    return [(prefix, int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def _text_features():
    from datasets import Features, Value

    return Features({"text": Value("string"), "prompt": Value("string"), "error": Value("string")})


def _token_features():
    from datasets import Features, List, Value

    return Features({"input_ids": List(Value("int64")), "prompt_length": Value("int64"), "skip": Value("string"),
                     "source": Value("int64")})


def document_stream(sources: list[DataSource], tokenizer, *, epoch: int, seed: int, dp_rank: int = 0, dp_size: int = 1,
                    shuffle: bool = True, streaming: bool = True, append_eod: bool = True, role: str = "all",
                    fraction: float = 0.0):
    """This rank's token rows for one epoch: sources blended by weight (GPT-NeoX train_data_weights) with
    `interleave_datasets(..., seed=seed + epoch, stopping_strategy="all_exhausted")` (small corpora are
    repeated until every source is used up once), then split so ranks get disjoint rows and none is lost.

    role: "train" drops documents held out by `fraction`, "validation" keeps only those, "all" keeps all.
    """
    from datasets import interleave_datasets
    from datasets.distributed import split_dataset_by_node

    if not sources:
        raise DataError("data.sources is empty: give at least one source with a `path`")
    if not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank {dp_rank} is outside dp_size {dp_size}: pass the data-parallel rank and size")
    parts = [source_dataset(source, tokenizer, epoch=epoch, seed=seed, shuffle=shuffle, streaming=streaming,
                            append_eod=append_eod, role=role, fraction=fraction, index=index)
             for index, source in enumerate(sources)]
    if len(parts) == 1:
        stream = parts[0]
    else:
        total = sum(s.weight for s in sources)
        stream = interleave_datasets(parts, probabilities=[s.weight / total for s in sources], seed=seed + epoch,
                                     stopping_strategy="all_exhausted")
    if dp_size > 1:
        stream = split_dataset_by_node(stream, rank=dp_rank, world_size=dp_size)
    return stream


def rows_naming_damaged_files(stream, sources: list[DataSource]) -> Iterator[dict]:
    """The rows of `stream` (a `document_stream`); a reader error mid-stream becomes one line naming the damaged file.

    Fills a gap of `datasets`' streaming parquet / json builders: a file whose footer is whole but whose pages are
    damaged passes the start-up check and fails mid-iteration with pyarrow's error (`OSError: Corrupt snappy
    compressed data`, `ArrowInvalid`), which names no file. Our own readers (jsonl, text, .bin/.idx) name theirs."""
    try:
        yield from stream
    except DataError:
        raise
    except _table_reader_errors() as err:
        raise _damaged_table_source(sources, err) from err


def _table_reader_errors() -> tuple:
    import pyarrow
    from datasets.exceptions import DatasetGenerationError

    return OSError, pyarrow.ArrowException, DatasetGenerationError


def _damaged_table_source(sources: list[DataSource], err: BaseException) -> DataError:
    """The first file of a parquet / json source that cannot be read whole (read again only now, on the failure
    path), or, where each reads, the error named with the sources that go through `datasets`."""
    through_datasets = [s for s in sources if source_format(s) in ("parquet", "json")]
    for source in through_datasets:
        for path in resolve_files(source):
            why = _unreadable_table(path, source_format(source))
            if why:
                return DataError(f"{path} is damaged ({why}): write it again, or drop it from data.sources")
    named = ", ".join(s.path for s in through_datasets) or ", ".join(s.path for s in sources)
    first = (str(err).strip().splitlines() or [""])[0]
    return DataError(f"reading data source {named} failed mid-stream ({type(err).__name__}: {first}); check its "
                     "files are whole and readable")


def _unreadable_table(path: str, fmt: str) -> str:
    """Why the whole of `path` cannot be read ("" when it can)."""
    import pyarrow
    import pyarrow.parquet as pq

    try:
        if fmt == "parquet":
            table = pq.ParquetFile(path)
            for group in range(table.num_row_groups):
                try:
                    table.read_row_group(group)
                except (OSError, pyarrow.ArrowException) as err:
                    return f"row group {group + 1} of {table.num_row_groups}: {first_line(err)}"
        else:
            with open_text_file(path) as f:
                json.load(f)
    except (OSError, pyarrow.ArrowException, ValueError, UnicodeDecodeError) as err:
        return first_line(err)
    return ""

