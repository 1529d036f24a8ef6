"""Test-only reference of GPT-NeoX's sample order, written step by step from its description (issue 16 and
GPT-NeoX's gpt2_dataset.py / data_utils.py / samplers.py / blendable_dataset.py), with plain loops and no shared code
with neox_hf.data.neox_order, so that the two can be compared row for row."""

from __future__ import annotations

import math

import numpy as np


def split_bounds(split: str, size: int) -> list[int]:
    parts = [float(s) for s in split.replace("/", ",").split(",")]
    while len(parts) < 3:
        parts.append(0.0)
    parts = parts[:3]
    parts = [p / sum(parts) for p in parts]
    bounds = [0]
    for p in parts:
        bounds.append(bounds[-1] + int(round(p * float(size))))
    diff = bounds[-1] - size
    return [bounds[0]] + [b - diff for b in bounds[1:]]


def num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    epochs, total = 0, 0
    while True:
        epochs += 1
        total += tokens_per_epoch
        if (total - 1) // seq_length >= num_samples:
            return epochs


def index(sizes: np.ndarray, documents: np.ndarray, num_samples: int, seq_length: int, seed: int):
    """(doc_idx, sample_idx, shuffle_idx) of the packed implementation."""
    rng = np.random.RandomState(seed=seed)
    tokens = int(np.sum(sizes[documents]))
    epochs = num_epochs(tokens, seq_length, num_samples)
    doc_idx = np.mgrid[0:epochs, 0:len(documents)][1]
    doc_idx[:] = documents
    doc_idx = doc_idx.reshape(-1).astype(np.int32)
    rng.shuffle(doc_idx)
    total_samples = (epochs * tokens - 1) // seq_length
    sample_idx = np.zeros((total_samples + 1, 2), dtype=np.int64)
    d, offset = 0, 0
    for s in range(1, total_samples + 1):
        remaining = seq_length + 1
        while remaining != 0:
            length = int(sizes[doc_idx[d]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                d, offset = d + 1, 0
        sample_idx[s] = (d, offset)
    shuffle_idx = np.arange(total_samples, dtype=np.uint32)
    rng.shuffle(shuffle_idx)
    return doc_idx, sample_idx, shuffle_idx


def read_sample(docs: list[np.ndarray], doc_idx, sample_idx, shuffle_idx, i: int, seq_length: int) -> np.ndarray:
    j = shuffle_idx[i]
    (f, of), (last, ol) = sample_idx[j], sample_idx[j + 1]
    if f == last:
        row = docs[doc_idx[f]][of:ol + 1]
    else:
        row = np.concatenate([docs[doc_idx[f]][of:]] + [docs[doc_idx[k]] for k in range(f + 1, last)]
                             + [docs[doc_idx[last]][:ol + 1]])
    row = np.asarray(row, dtype=np.int64)[:seq_length + 1]
    return np.pad(row, (0, seq_length + 1 - len(row)))


def train_rows(docs: list[np.ndarray], split: str, train_iters: int, global_batch: int, seq_length: int,
               seed: int) -> np.ndarray:
    """All train samples of a data_path run, in training order: [train_iters × global_batch, seq_length + 1]."""
    sizes = np.array([len(d) for d in docs], dtype=np.int32)
    bounds = split_bounds(split, len(docs))
    documents = np.arange(bounds[0], bounds[1], dtype=np.int32)
    doc_idx, sample_idx, shuffle_idx = index(sizes, documents, train_iters * global_batch, seq_length, seed)
    return np.stack([read_sample(docs, doc_idx, sample_idx, shuffle_idx, i, seq_length)
                     for i in range(train_iters * global_batch)])


def rank_rows(rows: np.ndarray, step: int, micro_step: int, rank: int, micro: int, accumulation: int, dp: int):
    """DistributedBatchSampler, interleave off: a loader batch is micro × dp consecutive samples; rank r takes
    [r × micro, (r + 1) × micro) of it; step s is loader batches [s × accumulation, (s + 1) × accumulation)."""
    batch = (step * accumulation + micro_step) * micro * dp
    return rows[batch + rank * micro: batch + (rank + 1) * micro]


def blend(weights: list[float], size: int) -> list[int]:
    """Which dataset each blended sample comes from: the one lagging its share the most."""
    counts = [0] * len(weights)
    total = sum(weights)
    w = [x / total for x in weights]
    chosen = []
    for i in range(size):
        errors = [w[d] * max(i, 1) - counts[d] for d in range(len(w))]
        d = errors.index(max(errors))
        chosen.append(d)
        counts[d] += 1
    return chosen


def per_dataset_samples(weights: list[float], num_samples: int) -> list[int]:
    return [int(math.ceil(num_samples * w / sum(weights) * 1.005)) for w in weights]
