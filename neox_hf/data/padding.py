"""Dynamic padding with length bucketing and token budgets, for streamed (iterable) data.

Gap filled: transformers' `DataCollatorWithPadding` pads whatever order it is given, so a random stream
of GSM8K-like lengths wastes ~45% of the compute on padding, and it has no length bucketing or token
budget for iterable streams (`group_by_length` in Trainer needs a map-style dataset with known lengths).
`DataCollatorWithFlattening` is padding-free but only fast with flash-attn varlen kernels; on sdpa/CPU
it costs attention over the whole flattened row.

How bucketing keeps the stream unbiased: the loader fills a buffer of `buffer_size` examples, sorts it by
length, cuts it into batches and shuffles the *batches* with a seeded RNG. Every example of a buffer is
emitted within that buffer's batches, so the mix of lengths over each buffer is the stream's own; only
the composition of a batch is correlated (similar lengths together). With a fixed batch size the
`len % B` examples that would form a ragged batch are chosen at random (not the longest) and carried
into the next buffer, so no length is systematically delayed.
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE_INDEX = -100


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_length(longest: int, multiple: int, max_length: int) -> int:
    """Longest input rounded up to `multiple`, never past `max_length` (positions beyond it may not exist)."""
    return min(round_up(longest, multiple), max(longest, max_length))


def example_from_document(ids: list[int], prompt_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels) of one document, labels already aligned: labels[t] = ids[t + 1], with the targets
    that lie inside the prompt masked to -100 (supervised fine-tuning learns only the answer)."""
    ids = np.asarray(ids, dtype=np.int64)
    labels = ids[1:].copy()
    labels[: max(prompt_length - 1, 0)] = IGNORE_INDEX
    return ids[:-1], labels


def fixed_size_batches(lengths: list[int], batch_size: int, rng: np.random.Generator | None):
    """(batches, leftover): index lists of `batch_size` examples of similar length, and the `len % B`
    randomly chosen indices that do not fill a batch (carried to the next buffer by the caller)."""
    order = np.arange(len(lengths))
    n_left = len(lengths) % batch_size
    leftover = np.sort(rng.choice(order, n_left, replace=False)) if (n_left and rng is not None) else order[len(order) - n_left:]
    keep = np.setdiff1d(order, leftover)
    keep = keep[np.argsort(np.asarray(lengths)[keep], kind="stable")]
    batches = [keep[i: i + batch_size].tolist() for i in range(0, len(keep), batch_size)]
    return batches, leftover.tolist()


def token_budget_batches(lengths: list[int], max_tokens: int, multiple: int, max_length: int) -> list[list[int]]:
    """Index lists, shortest first, each as large as fits `B × padded_longest ≤ max_tokens`."""
    order = np.argsort(np.asarray(lengths), kind="stable").tolist()
    batches, current = [], []
    for i in order:
        width = padded_length(lengths[i], multiple, max_length)  # sorted: the newest example is the longest
        if current and (len(current) + 1) * width > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def pad_batch(examples: list[tuple[np.ndarray, np.ndarray]], *, pad_id: int, multiple: int,
              max_length: int) -> dict[str, torch.Tensor]:
    """input_ids / labels / attention_mask [B, T] with T = longest rounded up to `multiple`;
    padding has attention 0 and label -100."""
    width = padded_length(max(len(inputs) for inputs, _ in examples), multiple, max_length)
    input_ids = np.full((len(examples), width), pad_id, dtype=np.int64)
    labels = np.full((len(examples), width), IGNORE_INDEX, dtype=np.int64)
    attention = np.zeros((len(examples), width), dtype=np.int64)
    for row, (inputs, targets) in enumerate(examples):
        input_ids[row, : len(inputs)] = inputs
        labels[row, : len(targets)] = targets
        attention[row, : len(inputs)] = 1
    return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels),
            "attention_mask": torch.from_numpy(attention)}
