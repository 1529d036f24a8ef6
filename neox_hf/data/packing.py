"""GPT-NeoX packing: documents (each ending in EOD) concatenated and cut into windows of seq_length + 1.

Window i covers tokens [i*T, i*T + T] inclusive, so consecutive windows share one token and no token's
prediction is lost (this is why GPT-NeoX counts samples as (tokens - 1) // T). inputs = window[:-1],
labels = window[1:]. Attention crosses documents, as in GPT-NeoX.

`isolate_documents` keeps the same windows but restarts `position_ids` at each document (and at the window
start, as GPT-NeoX's `reset_position_ids` does), and sends no attention_mask: transformers' GPTNeoX then
builds a block-diagonal mask from the restarts (sdpa, eager, flex). The prediction of a document's first
token from the previous document's EOD is dropped (label -100), because no token of the new document is
visible to that position; with it dropped, the window's loss is exactly the token-weighted mean of each
document's separate loss. Gap filled: transformers' `DataCollatorWithFlattening` does this per batch of
whole examples; it neither cuts a stream into fixed windows nor carries the remainder to the next batch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from neox_hf.data.padding import IGNORE_INDEX


@dataclass
class TokenStream:
    """Concatenated tokens: ids, whether each token is a learned target (not prompt), whether it starts a document."""

    ids: np.ndarray
    learn: np.ndarray
    starts: np.ndarray

    @classmethod
    def empty(cls) -> "TokenStream":
        return cls(np.zeros(0, np.int64), np.zeros(0, bool), np.zeros(0, bool))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index) -> "TokenStream":
        """The tokens at `index` (a slice or an index array), with their flags."""
        return TokenStream(self.ids[index], self.learn[index], self.starts[index])

    @classmethod
    def concat(cls, parts: list["TokenStream"]) -> "TokenStream":
        return cls(*(np.concatenate([getattr(p, k) for p in parts]) for k in ("ids", "learn", "starts")))

    def to_state(self) -> dict:
        return {"ids": self.ids.tolist(), "learn": self.learn.tolist(), "starts": self.starts.tolist()}

    @classmethod
    def from_state(cls, state: dict) -> "TokenStream":
        return cls(np.asarray(state["ids"], np.int64), np.asarray(state["learn"], bool), np.asarray(state["starts"], bool))


def document_pieces(documents: list[tuple[list[int], int]]) -> list[TokenStream]:
    """One TokenStream per (ids, prompt_length) document, in order: built as one array and cut into views, since a
    chunk holds thousands of short documents and numpy calls per document cost more than the tokens."""
    lengths = np.fromiter((len(ids) for ids, _ in documents), np.int64, len(documents))
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    ids = np.fromiter(itertools.chain.from_iterable(ids for ids, _ in documents), np.int64, int(bounds[-1]))
    position = np.arange(len(ids)) - np.repeat(bounds[:-1], lengths)
    prompts = np.fromiter((prompt for _, prompt in documents), np.int64, len(documents))
    learn, starts = position >= np.repeat(prompts, lengths), position == 0
    return [TokenStream(ids[a:b], learn[a:b], starts[a:b]) for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]


def cut_batches(stream: TokenStream, seq_length: int, batch_size: int) -> tuple[list[TokenStream], TokenStream]:
    """(full batches of `batch_size` windows each [B, T+1], the rest) — the rest starts with the last window's
    final token, which the next window shares."""
    n_windows = max(len(stream) - 1, 0) // seq_length
    n_batches = n_windows // batch_size
    batches = []
    for b in range(n_batches):
        starts = (b * batch_size + np.arange(batch_size))[:, None] * seq_length + np.arange(seq_length + 1)
        batches.append(stream[starts])
    used = n_batches * batch_size * seq_length
    rest = stream[used:]
    return batches, rest


def document_position_ids(starts: np.ndarray) -> np.ndarray:
    """[B, T] positions restarting at 0 at each document start and at the window start."""
    starts = starts.copy()
    starts[:, 0] = True
    index = np.broadcast_to(np.arange(starts.shape[1]), starts.shape)
    last_start = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return index - last_start


def pack_batch(windows: TokenStream, *, isolate_documents: bool) -> dict[str, torch.Tensor]:
    """Batch of windows [B, T+1] → input_ids, labels (aligned), and position_ids when isolating."""
    inputs = windows.ids[:, :-1]
    keep = windows.learn[:, 1:].copy()
    if isolate_documents:
        keep &= ~windows.starts[:, 1:]  # a target that opens a new document is not visible from this one
    labels = np.where(keep, windows.ids[:, 1:], IGNORE_INDEX)
    batch = {"input_ids": torch.from_numpy(np.ascontiguousarray(inputs)), "labels": torch.from_numpy(labels)}
    if isolate_documents:
        batch["position_ids"] = torch.from_numpy(document_position_ids(windows.starts[:, :-1]))
    return batch


def gpt_neox_num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Epochs GPT-NeoX needs for `num_samples` windows (megatron/data/gpt2_dataset.py `_num_epochs`): the
    smallest E with (E * tokens_per_epoch - 1) // seq_length >= num_samples (windows share one token)."""
    if tokens_per_epoch <= 0 or seq_length <= 0:
        raise ValueError(f"tokens_per_epoch ({tokens_per_epoch}) and seq_length ({seq_length}) must be > 0")
    needed = num_samples * seq_length + 1  # tokens for num_samples overlapping windows
    return max(1, -(-needed // tokens_per_epoch))
