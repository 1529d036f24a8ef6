"""GPT-NeoX's sample order: which tokens are the batch at step N, exactly as GPT-NeoX (and Pythia) trained on them.

Fills a gap: nothing in `datasets` or `transformers` reproduces Megatron/GPT-NeoX's index mappings, so a run moved
from GPT-NeoX to the HF stack would see different samples at every step. Learned from EleutherAI/gpt-neox
`megatron/data/gpt2_dataset.py`, `data_utils.py`, `blendable_dataset.py`, `samplers.py` (written here anew):

  documents    the items of one `.bin/.idx` prefix; with `data_path` + `split` ("969,30,1") the train / valid / test
               documents are consecutive ranges (`split_document_ranges`), with `train_data_paths` all of them
  doc_idx      the documents repeated for `_num_epochs` epochs, shuffled together by `np.random.RandomState(seed)`
  sample_idx   (position in doc_idx, offset) where each window of seq_length + 1 tokens starts; windows overlap by
               one token. Built with `np.searchsorted` over the cumulative document sizes (GPT-NeoX loops in C++)
  shuffle_idx  every sample id, shuffled by the same RandomState stream (after doc_idx)
  blending     several prefixes: `ceil(num_samples × weight × 1.005)` samples each, interleaved by the greedy
               max-error rule of GPT-NeoX's `build_blending_indices`
  batches      sample j of the stream is the j-th sample; a micro-step takes micro × dp consecutive samples and
               data-parallel rank r its contiguous slice (`DistributedBatchSampler`, interleave off); step s
               is micro-steps [s × accumulation, (s + 1) × accumulation)

The three index arrays are cached beside the data under GPT-NeoX's own names
(`{prefix}_{name}_indexmap_{N}ns_{L}sl_{S}s_{pack_impl}pi[_ac]_{doc,sample,shuffle}_idx.npy`), so GPT-NeoX can read
ours and we read its. Gap filled: GPT-NeoX reuses a cache by its name alone, and the name leaves out the corpus and
the `split`, so after the corpus under that prefix is replaced it reads samples of the old corpus, and after a `split`
change (900,100,0 → 50,50,0) it serves the old split's index: validation documents are trained on. Beside the arrays
`..._source.json` records everything they were built from: the documents of the split, every setting of the name, the
`.idx` size and a hash of the document sizes, and the label tokens where they decide which documents are skipped. A
cache whose record does not match is rebuilt with a one-line note. A cache without a record (GPT-NeoX built it) is
verified against the corpus and the split before it is read: every document of the split and no other, each the
epoch count of times, the sample starts recomputed from them, the shuffle a permutation (the seed, sample count and
sequence length are in its name); it is then read and recorded, or rebuilt with a note. The arrays are saved and
loaded without pickle (`allow_pickle=False`), so a crafted cache runs no code.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from neox_hf.data.indexed import IndexedDataset, indexed_paths
from neox_hf.data.packing import gpt_neox_num_epochs
from neox_hf.data.state import changed_data_setting
from neox_hf.errors import DataError, print_to_stderr
from neox_hf.io import atomic_path, atomic_write_text, load_npy_safely

DEFAULT_SPLIT = "969, 30, 1"  # GPT-NeoX's default `split`


# ----------------------------------------------------------------------------------------------------------------
# Counts: splits, samples per split, blending weights
# ----------------------------------------------------------------------------------------------------------------


def split_document_ranges(split: str, num_documents: int) -> list[int]:
    """[0, end_train, end_valid, num_documents]: GPT-NeoX's `get_train_valid_test_split_` (rounded proportions,
    the rounding error taken off every boundary so the last one is the document count)."""
    text = str(split)
    sep = "," if "," in text else "/" if "/" in text else None
    try:
        parts = [float(s) for s in (text.split(sep) if sep else [text])]
    except ValueError as err:
        raise DataError(f"data.split {split!r}: not comma-separated numbers such as '969,30,1'") from err
    parts = (parts + [0.0, 0.0])[:3]
    total = sum(parts)
    if total <= 0 or any(p < 0 for p in parts):
        raise DataError(f"data.split {split!r}: proportions must be ≥ 0 with a positive sum, e.g. '969,30,1'")
    bounds = [0]
    for part in parts:
        bounds.append(bounds[-1] + int(round(part / total * float(num_documents))))
    diff = bounds[-1] - num_documents
    return [bounds[0]] + [b - diff for b in bounds[1:]]


def split_num_samples(train_iters: int, global_batch: int, eval_interval: int, eval_iters: int) -> list[int]:
    """Samples GPT-NeoX builds for train, valid and test (data_utils.build_train_valid_test_data_loaders)."""
    valid_iters = (train_iters // eval_interval + 1) * eval_iters
    return [train_iters * global_batch, valid_iters * global_batch, eval_iters * global_batch]


def normalized_weights_and_num_samples(weights: Sequence[float], num_samples: int) -> tuple[list[float], list[int]]:
    """Weights summing to 1 and `ceil(num_samples × weight × 1.005)` samples per dataset (0.5% spare so the
    blend never runs dry), as GPT-NeoX's `get_normalized_weights_and_num_samples`."""
    total = sum(weights)
    if total <= 0:
        raise DataError(f"blending weights {list(weights)} must have a positive sum")
    normalized = [w / total for w in weights]
    return normalized, [int(math.ceil(num_samples * w * 1.005)) for w in normalized]


def weights_by_num_documents(num_documents: Sequence[int], alpha: float) -> list[float]:
    """GPT-NeoX's `weights_by_num_docs`: p ∝ (n / N) ** alpha, times (1 - n / N), normalised."""
    if len(num_documents) == 1:
        return [1.0]
    total = sum(num_documents)
    unbiased = [n / total for n in num_documents]
    probs = [p**alpha for p in unbiased]
    probs = [p / sum(probs) for p in probs]
    weights = [p * (1 - u) for p, u in zip(probs, unbiased)]
    return [w / sum(weights) for w in weights]


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each blended sample, its sample number in that dataset): at each position the dataset whose
    count lags its weight the most (first on ties), GPT-NeoX's `build_blending_indices`. A Python loop over the
    blend (about 2 s per million samples; GPT-NeoX runs it in C++): each step depends on the previous counts, and
    no closed form reproduces its float ties. One dataset needs no loop."""
    if len(weights) == 1:  # one path in train_data_paths: every sample from it, in order
        return np.zeros(size, dtype=np.uint8), np.arange(size, dtype=np.int64)
    w = np.asarray(weights, dtype=np.float64)
    w = (w / np.sum(w)).tolist()
    counts = [0] * len(w)
    dataset_index = np.zeros(size, dtype=np.uint8)
    sample_index = np.zeros(size, dtype=np.int64)
    for i in range(size):
        t = float(max(i, 1))
        best, best_error = 0, w[0] * t - counts[0]
        for d in range(1, len(w)):
            error = w[d] * t - counts[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[i] = best
        sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, sample_index


# ----------------------------------------------------------------------------------------------------------------
# The three index arrays of one GPT2Dataset
# ----------------------------------------------------------------------------------------------------------------


def build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState) -> np.ndarray:
    """The documents of every epoch, shuffled together (int32, as GPT-NeoX's C++ sample builder needs)."""
    doc_idx = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(doc_idx)  # the draws depend only on the length, so dtype and layout match GPT-NeoX's mgrid copy
    return doc_idx


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int,
                     tokens_per_epoch: int) -> np.ndarray:
    """[num_samples + 1, 2] (index into doc_idx, offset) where each window starts — GPT-NeoX's
    `build_sample_idx`, vectorised: window i starts at token i × seq_length of the concatenated doc_idx
    documents and ends on the first token of window i + 1 (an empty document is stepped over, as there)."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    float_samples = (num_epochs * tokens_per_epoch - 1) / seq_length  # GPT-NeoX picks the dtype from this
    dtype = np.int32 if 2 * (float_samples + 1) < np.iinfo(np.int32).max else np.int64
    ends = np.cumsum(sizes[doc_idx], dtype=np.int64)  # ends[k] = tokens up to and including doc_idx[k]
    starts = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length
    k = np.searchsorted(ends, starts, side="right")  # the document holding token `start`
    sample_idx = np.empty((num_samples + 1, 2), dtype=dtype)
    sample_idx[0] = 0
    sample_idx[1:, 0] = k
    sample_idx[1:, 1] = starts - (ends[k] - sizes[doc_idx[k]])
    return sample_idx


def build_shuffle_idx(size: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if size < np.iinfo(np.uint32).max - 1 else np.int64
    shuffle_idx = np.arange(size, dtype=dtype)
    rng.shuffle(shuffle_idx)
    return shuffle_idx


def _pack_until_overflow(documents, sizes, labels, num_samples, seq_length, allow_chopped, rng):
    """GPT-NeoX's `pack_until_overflow`: whole documents (in a reshuffled order, pass after pass) fill a sample
    until the next would overflow seq_length + 1; then it opens the next sample."""
    shuffle_idx = np.arange(num_samples)
    rng.shuffle(shuffle_idx)
    order = np.arange(len(documents))
    rng.shuffle(order)
    sample_idx, doc_idx = [], []
    running, cursor, skipped = 0, 0, 0
    while len(sample_idx) < num_samples:
        doc = int(order[cursor])
        skip = (not allow_chopped and sizes[doc] > seq_length + 1) or (
            labels is not None and np.all(labels.get(doc)[: seq_length + 1] == -100))
        skipped = _count_skip(skipped, skip, len(documents))
        if not skip:
            length = int(sizes[doc])
            if running == 0 or running + length > seq_length + 1:
                sample_idx.append((len(doc_idx), 0))
                running = length
            else:
                running += length
            doc_idx.append(doc)
        cursor += 1
        if cursor == len(documents):
            cursor = 0
            rng.shuffle(order)
    sample_idx.append((len(doc_idx), 0))
    return np.asarray(doc_idx, dtype=np.int64), np.asarray(sample_idx, dtype=np.int64), shuffle_idx


def _unpacked(documents, sizes, labels, num_samples, seq_length, allow_chopped, rng):
    """GPT-NeoX's `unpacked`: one document per sample, documents in file order, samples shuffled."""
    shuffle_idx = np.arange(num_samples)
    rng.shuffle(shuffle_idx)
    sample_idx = np.zeros((num_samples + 1, 2), dtype=np.int64)
    sample_idx[:, 0] = np.arange(num_samples + 1)
    doc_idx, doc, skipped = [], 0, 0
    while len(doc_idx) <= num_samples:
        skip = (not allow_chopped and sizes[doc] > seq_length + 1) or (
            labels is not None and np.all(labels.get(doc)[:seq_length] == -100))
        skipped = _count_skip(skipped, skip, len(documents))
        if not skip:
            doc_idx.append(doc)
        doc = (doc + 1) % len(documents)
    return np.asarray(doc_idx, dtype=np.int64), sample_idx, shuffle_idx


def _count_skip(skipped: int, skip: bool, num_documents: int) -> int:
    """Consecutive skipped documents; a whole pass of them would loop forever (GPT-NeoX hangs there)."""
    skipped = skipped + 1 if skip else 0
    if skipped > num_documents:
        raise DataError("every document is skipped (longer than seq_length + 1 with allow_chopped: false, or labels "
                        "all -100): no sample can be built; allow chopping or check the label data")
    return skipped


@dataclass(frozen=True)
class IndexSpec:
    """What one GPT2Dataset index depends on; `files` are GPT-NeoX's cache names for it."""

    prefix: str  # the .bin/.idx prefix (no suffix)
    name: str  # "train" / "valid" / "test" with `split`, "train_0", "valid_1"… with several paths
    documents: tuple[int, int]  # [first, last) item range
    num_samples: int
    seq_length: int
    seed: int
    pack_impl: str = "packed"
    allow_chopped: bool = True

    def stem(self) -> str:
        return (f"{self.prefix}_{self.name}_indexmap_{self.num_samples}ns_{self.seq_length}sl_{self.seed}s_"
                f"{self.pack_impl}pi{'_ac' if self.allow_chopped else ''}")

    def files(self) -> dict[str, Path]:
        return {kind: Path(f"{self.stem()}_{kind}_idx.npy") for kind in ("doc", "sample", "shuffle")}

    def source_record_file(self) -> Path:
        """Beside the arrays: what they were built from (see `index_source`)."""
        return Path(f"{self.stem()}_source.json")


def build_index(spec: IndexSpec, sizes: np.ndarray, labels: Optional[IndexedDataset] = None):
    """(doc_idx, sample_idx, shuffle_idx, num_epochs) computed in memory, as `_build_index_mappings` does."""
    documents = np.arange(*spec.documents, dtype=np.int32)
    if len(documents) == 0:
        raise DataError(f"{spec.prefix}: the {spec.name} split has no documents; change data.split")
    rng = np.random.RandomState(seed=spec.seed)
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    if spec.pack_impl == "packed":
        if tokens_per_epoch <= 1:
            raise DataError(f"{spec.prefix}: the {spec.name} documents hold {tokens_per_epoch} token(s); "
                            "a window needs at least 2")
        epochs = gpt_neox_num_epochs(tokens_per_epoch, spec.seq_length, spec.num_samples)
        doc_idx = build_doc_idx(documents, epochs, rng)
        sample_idx = build_sample_idx(np.asarray(sizes, np.int32), doc_idx, spec.seq_length, epochs, tokens_per_epoch)
        return doc_idx, sample_idx, build_shuffle_idx(len(sample_idx) - 1, rng), epochs
    build = _pack_until_overflow if spec.pack_impl == "pack_until_overflow" else _unpacked
    return (*build(documents, sizes, labels, spec.num_samples, spec.seq_length, spec.allow_chopped, rng), None)


def _index_settings(spec: IndexSpec) -> dict:
    """Every setting the arrays depend on, the split's document range included (GPT-NeoX's name leaves it out)."""
    return {"split_documents": list(spec.documents), "num_samples": spec.num_samples, "seq_length": spec.seq_length,
            "seed": spec.seed, "pack_impl": spec.pack_impl, "allow_chopped": spec.allow_chopped}


def index_source(spec: IndexSpec, sizes: np.ndarray, labels: Optional[IndexedDataset] = None) -> dict:
    """What the index arrays of `spec` depend on: the settings (`_index_settings`), the document sizes (and the `.idx`
    size, a cheap first check), and for the unpacked implementations the label tokens, which decide the documents they
    skip. Token values do not matter: the arrays hold positions."""
    idx = Path(f"{spec.prefix}.idx")
    source = {"idx_bytes": idx.stat().st_size if idx.is_file() else None, "documents": int(len(sizes)),
              "sizes_sha256": hashlib.sha256(np.ascontiguousarray(sizes, dtype=np.int32)).hexdigest(),
              "settings": _index_settings(spec)}
    if labels is not None and spec.pack_impl != "packed":
        with open(labels.bin_path, "rb") as f:
            source["labels_sha256"] = hashlib.file_digest(f, "sha256").hexdigest()
    return source


_VERIFY = "verify"  # a cache whose record does not say which split it indexes (GPT-NeoX's, an older neox_hf's)


def _stale_reason(spec: IndexSpec, source: dict) -> Optional[str]:
    """Why the cached arrays of `spec` cannot be used for `source` ("" when there is no cache yet), None when their
    record matches, `_VERIFY` when no record says which split they index (`_unrecorded_cache_mismatch` checks)."""
    files, record_file = spec.files(), spec.source_record_file()
    present = [f for f in files.values() if f.is_file()]
    if not present:
        return ""
    if len(present) < len(files):
        return f"{next(f.name for f in files.values() if not f.is_file())} is missing"
    try:
        recorded = json.loads(record_file.read_text())
    except FileNotFoundError:
        return _VERIFY  # GPT-NeoX's own cache: `_unrecorded_cache_mismatch` verifies it against the corpus
    except (OSError, ValueError):
        return f"{record_file.name} is unreadable"
    if recorded == source:
        return None
    if not isinstance(recorded, dict):
        return f"{record_file.name} is not a record of this cache"
    idx = f"{spec.prefix}.idx"
    if recorded.get("documents") != source["documents"]:
        return f"it was built for {recorded.get('documents')} documents and {idx} now holds {source['documents']:,}"
    if recorded.get("sizes_sha256") != source["sizes_sha256"]:
        return f"the document sizes in {idx} changed since it was built (the corpus was replaced)"
    settings = recorded.get("settings")
    if settings is None:  # an older neox_hf's record: the corpus matches; the split is verified as GPT-NeoX's cache's
        return _VERIFY
    if isinstance(settings, dict) and settings.get("split_documents") != source["settings"]["split_documents"]:
        return (f"it indexes documents {_range(settings.get('split_documents'))} of {idx} (another data.split) and "
                f"this split's are {_range(source['settings']['split_documents'])}")
    if settings != source["settings"]:
        changed = sorted(k for k in source["settings"] if not isinstance(settings, dict) or settings.get(k) !=
                         source["settings"][k])
        return f"it was built with other {', '.join(changed) or 'settings'}"
    return "the label data changed since it was built" if "labels_sha256" in source else "its record differs"


def _range(documents) -> str:
    return f"[{documents[0]:,}, {documents[1]:,})" if isinstance(documents, list) and len(documents) == 2 else "?"


def _unrecorded_cache_mismatch(spec: IndexSpec, sizes: np.ndarray) -> Optional[str]:
    """Why a cache without a record (GPT-NeoX's) does not index `spec`'s split of this corpus; None when it does.

    Its name fixes the seed, sample count, sequence length and packing; what it leaves out is checked from the arrays:
    doc_idx holds every document of the split and no other, each the same number of epochs GPT-NeoX's rule gives;
    sample_idx is the window starts recomputed from that doc_idx and the document sizes; shuffle_idx is a permutation
    of the samples. The shuffle's draw itself is the seed's (in the name). Only GPT-NeoX's default `packed`
    implementation is verified; the others are rebuilt (their arrays depend on skips this check cannot replay)."""
    if spec.pack_impl != "packed":
        return f"there is no {spec.source_record_file().name} and a {spec.pack_impl} index cannot be verified"
    try:
        doc_idx, sample_idx, shuffle_idx = (load_npy_safely(f) for f in spec.files().values())
    except (DataError, OSError, ValueError, EOFError) as err:
        return f"it is unreadable ({err})"
    first, last = spec.documents
    tokens_per_epoch = int(np.sum(sizes[first:last], dtype=np.int64))
    if tokens_per_epoch <= 1:
        return "its split holds no tokens"
    epochs = gpt_neox_num_epochs(tokens_per_epoch, spec.seq_length, spec.num_samples)
    if doc_idx.ndim != 1 or len(doc_idx) != epochs * (last - first) or len(doc_idx) == 0 or \
            doc_idx.min() < first or doc_idx.max() >= last or \
            np.any(np.bincount(np.asarray(doc_idx, np.int64) - first, minlength=last - first) != epochs):
        return (f"it does not index documents {_range([first, last])} of {spec.prefix}.idx {epochs} time(s) each "
                "(another data.split, or another corpus)")
    expected = build_sample_idx(np.asarray(sizes, np.int32), np.asarray(doc_idx), spec.seq_length, epochs,
                                tokens_per_epoch)
    if sample_idx.shape != expected.shape or not np.array_equal(sample_idx, expected):
        return f"its sample starts do not match the document sizes in {spec.prefix}.idx (another corpus)"
    if shuffle_idx.ndim != 1 or len(shuffle_idx) != len(expected) - 1 or \
            not np.array_equal(np.sort(np.asarray(shuffle_idx, np.int64)), np.arange(len(expected) - 1)):
        return "its shuffle is not a permutation of its samples"
    return None


def load_or_build_index(spec: IndexSpec, sizes: np.ndarray, labels: Optional[IndexedDataset] = None, *,
                        build: bool = True):
    """(doc_idx, sample_idx, shuffle_idx) memory-mapped from GPT-NeoX-named caches. With `build` (rank 0) they are
    built and saved first when missing or when their record (`index_source`) no longer matches the corpus; each file
    is written under a temporary name and renamed, and the record last, so a crash leaves no cache that looks
    complete."""
    files = spec.files()
    if build:
        source = index_source(spec, sizes, labels)
        stale = _stale_reason(spec, source)
        if stale is _VERIFY:  # GPT-NeoX's own cache: read it if it fits
            stale = _unrecorded_cache_mismatch(spec, sizes)
            if stale is None:
                _write_record(spec, source)
        if stale is not None:
            if stale:
                print_to_stderr(f"note: GPT-NeoX index cache {Path(spec.stem()).name}_*.npy rebuilt: {stale}")
            _save_index(spec, build_index(spec, sizes, labels)[:3], source)
    missing = [str(f) for f in files.values() if not f.is_file()]
    if missing:
        raise DataError(f"GPT-NeoX index cache missing after rank 0 built it: {missing[0]}; the data folder must be "
                        "on a file system every rank sees")
    return tuple(load_npy_safely(files[k]) for k in ("doc", "sample", "shuffle"))


def _save_index(spec: IndexSpec, arrays, source: dict) -> None:
    path = spec.source_record_file()
    try:
        path.unlink(missing_ok=True)  # no record while the arrays change: a crash then means "rebuild"
        for path, array in zip(spec.files().values(), arrays):
            with atomic_path(path) as tmp, open(tmp, "wb") as f:  # a file object: np.save would append .npy to a name
                np.save(f, array, allow_pickle=False)
    except OSError as err:
        raise DataError(f"cannot write the GPT-NeoX index cache {path}: {err}; make the data folder "
                        "writable (GPT-NeoX caches its indices beside the data too)") from err
    _write_record(spec, source)


def _write_record(spec: IndexSpec, source: dict) -> None:
    path = spec.source_record_file()
    try:
        atomic_write_text(path, json.dumps(source, indent=1) + "\n")
    except OSError as err:
        raise DataError(f"cannot write the GPT-NeoX index cache {path}: {err}; make the data folder "
                        "writable (GPT-NeoX caches its indices beside the data too)") from err


# ----------------------------------------------------------------------------------------------------------------
# Reading samples
# ----------------------------------------------------------------------------------------------------------------


class GPT2Samples:
    """Samples of one prefix in GPT-NeoX order: `self[i]` is (tokens, labels or None), seq_length + 1 each, read as
    `GPT2Dataset.__getitem__` reads them (short samples padded with 0, labels with -100; long ones cut)."""

    def __init__(self, data: IndexedDataset, spec: IndexSpec, labels: Optional[IndexedDataset] = None, *,
                 build: bool = True):
        self.data, self.labels, self.spec = data, labels, spec
        if labels is not None and not np.array_equal(labels.sizes, data.sizes):
            raise DataError(f"label data {labels.idx_path} does not match {data.idx_path} item for item; "
                            "train_label_data_paths must be aligned with the token data")
        self.doc_idx, self.sample_idx, self.shuffle_idx = load_or_build_index(spec, data.sizes, labels, build=build)

    def __len__(self) -> int:
        return min(len(self.shuffle_idx) - 1, len(self.sample_idx) - 1)

    def describe(self) -> str:
        docs = self.spec.documents[1] - self.spec.documents[0]
        epochs = f"{len(self.doc_idx) // docs} epoch(s) of " if self.spec.pack_impl == "packed" else ""
        return (f"{self.spec.name}: {self.spec.num_samples:,} samples from {epochs}{docs:,} documents "
                f"(index {self.spec.files()['doc'].name[:-len('_doc_idx.npy')]}_*.npy)")

    def __getitem__(self, i: int):
        j = i
        try:
            j = int(self.shuffle_idx[i])
            (doc_f, off_f), (doc_l, off_l) = self.sample_idx[j].tolist(), self.sample_idx[j + 1].tolist()
            reads = [self._read(self.data, doc_f, off_f, doc_l, off_l)]
            if self.labels is not None:
                reads.append(self._read(self.labels, doc_f, off_f, doc_l, off_l))
        except IndexError:
            # GPT-NeoX's own fallback (the last unpacked / pack_until_overflow sample reads past doc_idx)
            return self[j % len(self)]
        length = self.spec.seq_length + 1
        tokens = _fit(reads[0], length, 0)
        return tokens, (_fit(reads[1], length, -100) if self.labels is not None else None)

    def _read(self, data: IndexedDataset, doc_f: int, off_f: int, doc_l: int, off_l: int) -> np.ndarray:
        doc = self.doc_idx
        if doc_f == doc_l:
            return data.get(int(doc[doc_f]), offset=off_f, length=off_l - off_f + 1)
        parts = [data.get(int(doc[doc_f]), offset=off_f)]
        parts += [data.get(int(doc[k])) for k in range(doc_f + 1, doc_l)]
        parts.append(data.get(int(doc[doc_l]), length=off_l + 1))
        return np.concatenate(parts)


def _fit(row: np.ndarray, length: int, pad: int) -> np.ndarray:
    row = np.asarray(row, dtype=np.int64)[:length]
    return np.pad(row, (0, length - len(row)), constant_values=pad) if len(row) < length else row


class BlendedSamples:
    """Several prefixes blended by weight, as GPT-NeoX's `BlendableDataset`."""

    def __init__(self, datasets: list, weights: Sequence[float]):
        self.datasets = datasets
        self.dataset_index, self.sample_index = blending_indices(weights, sum(len(d) for d in datasets))

    def __len__(self) -> int:
        return len(self.dataset_index)

    def describe(self) -> str:
        return "; ".join(d.describe() for d in self.datasets)

    def __getitem__(self, i: int):
        return self.datasets[int(self.dataset_index[i])][int(self.sample_index[i])]


class RowSamples:
    """Pythia's pre-shuffled files: every item is one sample of seq_length + 1 tokens; the order is the row order
    (Pythia's `utils/batch_viewer.py`)."""

    def __init__(self, data: IndexedDataset, seq_length: int):
        wrong = np.flatnonzero(data.sizes != seq_length + 1)
        if len(wrong):
            raise DataError(f"{data.idx_path}: item {int(wrong[0])} has {int(data.sizes[wrong[0]])} tokens, but "
                            f"data.order: preshuffled needs rows of seq_length + 1 = {seq_length + 1} "
                            "(Pythia's pre-shuffled files have 2049-token rows: set model.seq_length 2048)")
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def describe(self) -> str:
        return f"{len(self.data):,} pre-shuffled rows of {self.data.bin_path}, read in order"

    def __getitem__(self, i: int):
        return np.asarray(self.data.get(i), dtype=np.int64), None


# ----------------------------------------------------------------------------------------------------------------
# From a data config to the sample stream of one split
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchLayout:
    """Who reads what: GPT-NeoX's train_batch_size = micro × accumulation × data-parallel size."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    dp_size: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.dp_size

    def rank_sample_ids(self, micro_step: int, dp_rank: int, stream_length: int) -> np.ndarray:
        """Sample ids rank `dp_rank` reads at global micro-step `micro_step` (the loader wraps like GPT-NeoX's
        cycled DataLoader once `stream_length` is used up)."""
        per_micro = self.micro_batch_size * self.dp_size
        micro_steps = stream_length // per_micro
        if micro_steps == 0:
            raise DataError(f"only {stream_length} samples, fewer than one micro-step of {per_micro}")
        first = (micro_step % micro_steps) * per_micro + dp_rank * self.micro_batch_size
        return np.arange(first, first + self.micro_batch_size)

    def step_sample_ids(self, start_step: int, end_step: int, stream_length: int) -> np.ndarray:
        """Sample ids of the global batches of steps [start_step, end_step), in order: rank 0's slice of the first
        micro-step, rank 1's, …, then the next micro-step — the same ids `rank_sample_ids` hands out."""
        micro = np.arange(start_step * self.gradient_accumulation_steps, end_step * self.gradient_accumulation_steps)
        return np.concatenate([self.rank_sample_ids(int(m), r, stream_length)
                               for m in micro for r in range(self.dp_size)]) if len(micro) else np.zeros(0, np.int64)


def _label_prefix(source) -> Optional[IndexedDataset]:
    return IndexedDataset(source.label_path) if getattr(source, "label_path", None) else None


def _prefix(path: str) -> str:
    return str(indexed_paths(path)[0])[: -len(".bin")]


def split_samples(data_cfg, role: str, *, seq_length: int, train_iters: int, layout: BatchLayout,
                  eval_interval: int, eval_iters: int, seed: int, build: bool = True):
    """The GPT-NeoX sample stream of `role` ("train" / "valid" / "test"), or None when there is none.

    One source with `data.split`: GPT-NeoX's `data_path` mode (documents split by ranges). Otherwise GPT-NeoX's
    `train_data_paths` mode: `data.sources` (train) or `data.validation` (valid) blended by weight."""
    counts = dict(zip(("train", "valid", "test"),
                      split_num_samples(train_iters, layout.global_batch, eval_interval, eval_iters)))
    pack_impl, chopped = data_cfg.pack_impl, data_cfg.allow_chopped
    if data_cfg.order == "preshuffled":
        sources = data_cfg.sources if role == "train" else data_cfg.validation if role == "valid" else []
        if not sources:
            return None
        if len(sources) != 1:
            raise DataError("data.order: preshuffled reads exactly one pre-shuffled .bin/.idx prefix per split")
        return RowSamples(IndexedDataset(sources[0].path), seq_length)
    if data_cfg.split is not None:
        if len(data_cfg.sources) != 1:
            raise DataError(f"data.split splits one corpus (GPT-NeoX data_path); there are {len(data_cfg.sources)} "
                            "sources: give train/validation sources with weights instead, or one source")
        source = data_cfg.sources[0]
        data = IndexedDataset(source.path)
        bounds = split_document_ranges(data_cfg.split, len(data.sizes))
        index = ("train", "valid", "test").index(role)
        if bounds[index + 1] <= bounds[index]:
            return None
        spec = IndexSpec(_prefix(source.path), role, (bounds[index], bounds[index + 1]), counts[role], seq_length,
                         seed, pack_impl, chopped)
        return GPT2Samples(data, spec, _label_prefix(source), build=build)
    sources = data_cfg.sources if role == "train" else data_cfg.validation if role == "valid" else []
    if not sources:
        return None
    datas = [IndexedDataset(s.path) for s in sources]
    weights = [s.weight for s in sources]
    if data_cfg.weight_by_num_documents:
        weights = weights_by_num_documents([len(d.sizes) for d in datas], data_cfg.weighted_sampler_alpha)
    weights, per_dataset = normalized_weights_and_num_samples(weights, counts[role])
    datasets = [GPT2Samples(d, IndexSpec(_prefix(s.path), f"{role}_{i}", (0, len(d.sizes)), n, seq_length, seed,
                                         pack_impl, chopped), _label_prefix(s), build=build)
                for i, (s, d, n) in enumerate(zip(sources, datas, per_dataset))]
    return BlendedSamples(datasets, weights)


def build_split_samples(data_cfg, role: str, **kwargs):
    """`split_samples` with the index built once: global rank 0 builds and saves the caches, the others wait at a
    barrier and then memory-map them (GPT-NeoX does the same with an all-reduce)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return split_samples(data_cfg, role, **kwargs)
    error = None
    if dist.get_rank() == 0:
        try:
            split_samples(data_cfg, role, **kwargs)
        except DataError as err:  # the other ranks must still reach the barrier, then fail on the same cause
            error = err
    dist.barrier()
    if error is not None:
        raise error
    return split_samples(data_cfg, role, build=False, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Batches and the loader
# ----------------------------------------------------------------------------------------------------------------


def rows_to_batch(rows: list, *, eod_id: Optional[int], eod_mask_loss: bool) -> dict:
    """GPT-NeoX's `_get_batch` on rows of seq_length + 1 tokens: inputs = row[:-1], labels = row[1:] (or the label
    data, -100 where it is negative), and with `eod_mask_loss` no loss on a prediction made from an EOD token."""
    import torch

    tokens = np.stack([tokens for tokens, _ in rows])
    inputs = tokens[:, :-1]
    if rows[0][1] is not None:
        label_rows = np.stack([labels for _, labels in rows])[:, 1:]
        labels = np.where(label_rows >= 0, label_rows, -100)
    else:
        labels = tokens[:, 1:].copy()
    if eod_mask_loss and eod_id is not None:
        labels[inputs == eod_id] = -100
    return {"input_ids": torch.from_numpy(np.ascontiguousarray(inputs)), "labels": torch.from_numpy(labels)}


STATE_VERSION = 1


class NeoXOrderLoader:
    """This rank's micro-batches in GPT-NeoX's order, from step `start_step` on; resumable by position alone.

    Under a curriculum every batch carries `curriculum_seq_length` (also the loader attribute: the last batch's)."""

    def __init__(self, samples, layout: BatchLayout, dp_rank: int, *, eod_id: Optional[int], eod_mask_loss: bool,
                 fingerprint: dict, curriculum=None, start_step: int = 0):
        if not 0 <= dp_rank < layout.dp_size:
            raise DataError(f"dp_rank {dp_rank} is outside dp_size {layout.dp_size}")
        self.samples, self.layout, self.dp_rank = samples, layout, dp_rank
        self.eod_id, self.eod_mask_loss, self.fingerprint = eod_id, eod_mask_loss, fingerprint
        self.curriculum = curriculum
        self.micro_step = start_step * layout.gradient_accumulation_steps  # GPT-NeoX: iteration × accumulation
        self.curriculum_seq_length: Optional[int] = None
        self.stats = {"real_tokens": 0, "padded_tokens": 0}

    def __iter__(self) -> "NeoXOrderLoader":
        return self

    def describe(self) -> str:
        """One line for the start-up report: GPT-NeoX's sample counts, epochs and index files."""
        return f"data order {self.fingerprint['order']}: {self.samples.describe()}"

    def __next__(self) -> dict:
        ids = self.layout.rank_sample_ids(self.micro_step, self.dp_rank, len(self.samples))
        batch = rows_to_batch([self.samples[int(i)] for i in ids], eod_id=self.eod_id, eod_mask_loss=self.eod_mask_loss)
        if self.curriculum is not None:
            step = self.micro_step // self.layout.gradient_accumulation_steps
            self.curriculum_seq_length = self.curriculum.seq_length_at(step)
            batch = truncate_batch(batch, self.curriculum_seq_length)
        self.micro_step += 1
        self.stats["real_tokens"] += batch["input_ids"].numel()
        return batch

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "order": "gpt-neox", "fingerprint": dict(self.fingerprint),
                "micro_step": self.micro_step}

    def load_state_dict(self, state: dict) -> None:
        if state.get("order") != "gpt-neox" and isinstance(state.get("fingerprint"), dict):
            # a streamed loader's position (its fingerprint has no `order`: data.order stream)
            raise DataError(changed_data_setting(state["fingerprint"], self.fingerprint, skip=_LAYOUT_KEYS))
        if state.get("order") != "gpt-neox" or state.get("version") != STATE_VERSION:
            raise DataError("this checkpoint's data position was not saved in GPT-NeoX order (data.order); resume "
                            "with the data settings it was saved with, or start fresh")
        saved, ours = state["fingerprint"], self.fingerprint
        changed = changed_data_setting(saved, ours, skip=_LAYOUT_KEYS)
        if changed:
            raise DataError(changed)
        self.micro_step = _micro_step_on_this_layout(int(state["micro_step"]), saved, ours)

    def describe_position(self) -> str:
        """What the restored position means on this layout (the resume's start-up line)."""
        per_micro = self.layout.micro_batch_size * self.layout.dp_size
        return (f"data position: sample {self.micro_step * per_micro} of GPT-NeoX's order (layout-free), read by "
                f"{self.layout.dp_size} data-parallel rank(s) × {self.layout.micro_batch_size} samples × "
                f"{self.layout.gradient_accumulation_steps} micro-steps")


# The fingerprint keys that say how samples are dealt to ranks, not which samples come in which order.
_LAYOUT_KEYS = ("micro_batch_size", "accumulation", "dp_rank", "dp_size")


def _without_layout(fingerprint: dict) -> dict:
    return {k: v for k, v in fingerprint.items() if k not in _LAYOUT_KEYS}


def _micro_step_on_this_layout(micro_step: int, saved: dict, ours: dict) -> int:
    """The sample index is layout-free: micro-step × samples per micro-step. Another layout continues from the same
    sample when its global batch is the same (otherwise the step → sample mapping, and training, would change)."""
    def per_micro(f):
        return f["micro_batch_size"] * f["dp_size"]

    def global_batch(f):
        return per_micro(f) * f["accumulation"]

    if global_batch(saved) != global_batch(ours):
        raise DataError(f"the checkpoint's global batch is {global_batch(saved)} samples, this run's "
                        f"{global_batch(ours)}: set train.micro_batch_size × gradient_accumulation_steps × data-parallel "
                        "size to the same global batch")
    return micro_step * per_micro(saved) // per_micro(ours)


def truncate_batch(batch: dict, length: int) -> dict:
    """Every [batch, seq] tensor cut to its first `length` positions (GPT-NeoX's seqlen curriculum), and the length
    recorded as `batch["curriculum_seq_length"]` (a plain int: the loop logs it for the batch it consumed, which a
    prefetching loop cannot read from the loader, already ahead)."""
    cut = {k: (v[:, :length].contiguous() if getattr(v, "dim", lambda: 0)() == 2 else v) for k, v in batch.items()}
    cut["curriculum_seq_length"] = length
    return cut
