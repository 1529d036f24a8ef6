"""Resuming a streamed data position on another number of data-parallel ranks, with no document of the current pass
repeated or skipped.

Gap filled: `datasets.distributed.split_dataset_by_node` gives each rank its own share of the rows (file-wise or
row-wise), and its `state_dict()` is a position in that one share: it cannot be re-split onto another number of
ranks. So the rest of the pass is rebuilt from the old shares and dealt out:

1. every old rank's current chunk is rebuilt from its saved chunk-start position (on its old rank, size and micro
   batch) and what it read but did not train is kept: pad mode, the examples of the batches not emitted and the
   leftover carried on; pack mode, the tokens after the emitted windows, from the first one not yet a target;
2. old rank r's remainder is its own stream continued after that chunk, over as many passes as it takes to finish
   pass E, the newest pass any old rank had begun (so every old share of every pass up to E is read exactly once);
3. the leftovers and remainders are merged round-robin in old-rank order (a finished stream drops out) and merged
   item m goes to new rank m % new_dp_size; a new rank that has its whole share starts pass E + 1 on its own split.

Every new rank reads every old share to keep its own items: the rest of that one pass costs old_dp_size times the
reading and tokenizing. The dealt position is itself exact on the same number of ranks (the merged stream is a
function of the old streams' positions, kept with a one-item look-ahead so the end of the share is known at a chunk
start) and can be resized again (an old position may itself be a dealt one).

Stats and source tallies: the old ranks' totals go to new rank 0 and so does what the old streams read during the
dealt pass; the others count only their own batches, so sums over data-parallel ranks (what the run log reports) stay
the totals.
"""

from __future__ import annotations

import copy
from typing import Optional

import numpy as np

from neox_hf.data.state import STATE_VERSION, changed_data_setting, empty_stats
from neox_hf.data.packing import TokenStream
from neox_hf.errors import DataError

LAYOUT_KEYS = ("dp_rank", "dp_size", "micro_batch_size")  # what a resize may change in a loader's fingerprint


# ----------------------------------------------------------------------------------------------------------------
# The resized position
# ----------------------------------------------------------------------------------------------------------------


def resized_position(loader, states: list[dict]) -> dict:
    """The position of `loader` (a new rank) that continues the old ranks' `states` (index = old dp rank)."""
    _check_states(loader, states)
    old_loaders = [loader._old_rank_loader(state["fingerprint"]) for state in states]
    streams, stats, chunks, unread = [], empty_stats(), [], 0
    for old, state in zip(old_loaders, states):
        old.load_state_dict(state)
        rest, source = old._rest_of_chunk()
        streams.append({"fingerprint": state["fingerprint"], "leftover": packed_items(rest), "leftover_taken": 0,
                        "position": source.position(), "finished": False, "tallies": None})
        stats = {key: stats.get(key, 0) + value for key, value in old.stats.items()}
        chunks.append(state["position"]["chunk_index"])
        unread += sum(item_size(i) for i in rest)
    last_pass = max(_current_pass(stream["position"]) for stream in streams)
    dealt = {"pass": last_pass, "old_size": len(states), "merged": 0, "turn": 0, "pending": None, "primed": False,
             "streams": streams, "read_not_trained": unread}
    return {"dealt": dealt, "epoch": last_pass, "upstream": None, "usable_in_epoch": 0, "tallies": None,
            "chunk_index": max(chunks) + 1, "carry": None,
            "stats": stats if loader.dp_rank == 0 else empty_stats()}


def unchanging_tensors(position: dict) -> list:
    """The packed leftovers of a dealt position and of the dealt positions inside it (read, never written)."""
    if "dealt" not in (position or {}):
        return []
    found = []
    for stream in position["dealt"]["streams"]:
        found += list(stream["leftover"].values()) + unchanging_tensors(stream["position"])
    return found


def describe_dealt(dealt: dict, mode: str, new_size: int) -> str:
    unit = "tokens" if mode == "pack" else "documents"
    ranks = "data-parallel rank's" if dealt["old_size"] == 1 else "data-parallel ranks'"
    return (f"data position: the rest of pass {dealt['pass'] + 1} of {dealt['old_size']} {ranks} "
            f"streamed shares ({dealt['read_not_trained']:,} {unit} read but not yet trained), dealt to {new_size} "
            f"ranks; pass {dealt['pass'] + 2} on {new_size} ranks")


def _check_states(loader, states: list[dict]) -> None:
    mine = _data_settings(loader._fingerprint())
    for rank, state in enumerate(states):
        if state is None or state.get("version") != STATE_VERSION or "fingerprint" not in state:
            raise DataError(f"data-parallel rank {rank}'s data position is missing or of another version; this "
                            "checkpoint's data position cannot be resumed by this version of neox_hf")
        saved = state["fingerprint"]
        changed = changed_data_setting(_data_settings(saved), mine)
        if changed:
            raise DataError(changed)
        if saved.get("dp_rank") != rank or saved.get("dp_size") != len(states):
            raise DataError(f"the data positions given are not those of data-parallel ranks 0..{len(states) - 1} in "
                            f"order (item {rank} was saved by rank {saved.get('dp_rank')} of {saved.get('dp_size')}); "
                            "give every old data-parallel rank's loader state, indexed by its rank")


def _data_settings(fingerprint: dict) -> dict:
    return {key: value for key, value in fingerprint.items() if key not in LAYOUT_KEYS}


def _current_pass(position: dict) -> int:
    """The pass a source position is in: a position at the very start of a pass has finished the one before."""
    if "dealt" in position:
        return position["dealt"]["pass"]
    started = position["upstream"] is not None or position["epoch"] == 0
    return position["epoch"] if started else position["epoch"] - 1


# ----------------------------------------------------------------------------------------------------------------
# Items: pad-mode examples (inputs, labels) and pack-mode token pieces, as kept in a position
# ----------------------------------------------------------------------------------------------------------------


def item_state(item):
    if isinstance(item, TokenStream):
        return item.to_state()
    inputs, labels = item
    return [np.asarray(inputs).tolist(), np.asarray(labels).tolist()]


def item_from_state(state):
    if isinstance(state, dict):
        return TokenStream.from_state(state)
    return np.asarray(state[0], np.int64), np.asarray(state[1], np.int64)


def packed_items(items: list) -> dict:
    """Items as a few flat tensors and their lengths: a position is deep-copied with every batch (the prefetcher keeps
    the one of the last batch consumed), and thousands of token lists would make that slow."""
    import torch

    def flat(arrays, dtype):
        joined = np.concatenate([np.asarray(a, dtype) for a in arrays]) if arrays else np.zeros(0, dtype)
        return torch.from_numpy(joined)

    if items and isinstance(items[0], TokenStream):
        return {"ids": flat([i.ids for i in items], np.int64), "learn": flat([i.learn for i in items], bool),
                "starts": flat([i.starts for i in items], bool), "lengths": flat([[len(i)] for i in items], np.int64)}
    return {"inputs": flat([i[0] for i in items], np.int64), "labels": flat([i[1] for i in items], np.int64),
            "lengths": flat([[len(i[0])] for i in items], np.int64)}


def packed_item(packed: dict, index: int):
    """Item `index` of `packed_items`."""
    lengths = packed["lengths"].numpy()
    start = int(lengths[:index].sum())
    end = start + int(lengths[index])
    if "ids" in packed:
        return TokenStream(*(packed[k][start:end].numpy().copy() for k in ("ids", "learn", "starts")))
    return packed["inputs"][start:end].numpy().copy(), packed["labels"][start:end].numpy().copy()  # as many of each


def item_size(item) -> int:
    """Tokens of a pack piece; 1 for a pad-mode example (a document)."""
    return len(item) if isinstance(item, TokenStream) else 1


def _item_tokens(item) -> int:
    return len(item) if isinstance(item, TokenStream) else len(item[0]) + 1


# ----------------------------------------------------------------------------------------------------------------
# Reading a dealt pass
# ----------------------------------------------------------------------------------------------------------------


class _OldStream:
    """One old rank's items for the dealt pass: its leftover, then its own stream up to the end of pass `last_pass`
    (read through a loader on its old rank and size, whose stats are the dealing rank's or a scratch dict)."""

    def __init__(self, state: dict, old_loader, last_pass: int):
        self.fingerprint, self.finished, self.tallies = state["fingerprint"], state["finished"], state["tallies"]
        self._leftover, self._taken = state["leftover"], state["leftover_taken"]  # the packed items stay as saved
        self._loader, self._last_pass = old_loader, last_pass
        self._source = None if self.finished else old_loader._open_source(state["position"])

    def next_item(self):
        if self._taken < len(self._leftover["lengths"]):
            self._taken += 1
            return packed_item(self._leftover, self._taken - 1)
        while not self.finished:
            stats, tallies = dict(self._loader.stats), copy.deepcopy(getattr(self._source, "tallies", None))
            items = self._loader._take(self._source, 1)
            if self._source.epoch > self._last_pass or (not items and self._source.exhausted):
                self._loader.stats.update(stats)  # that document belongs to the next pass, read on the new split
                self._finish(tallies)
                return None
            if items:
                return items[0]
        return None

    def _finish(self, tallies) -> None:
        self.finished, self.tallies, self._source = True, tallies, None

    def state(self) -> dict:
        return {"fingerprint": self.fingerprint, "leftover": self._leftover, "leftover_taken": self._taken,
                "position": None if self.finished else self._source.position(), "finished": self.finished,
                "tallies": self.tallies}


class DealtStream:
    """This rank's items of the merged old streams: merged item m is this rank's when m % dp_size == dp_rank. One item
    is read ahead (`pending`) so that the end of the share is known when a chunk starts."""

    def __init__(self, dealt: dict, loader):
        self._dealt = dealt
        self._rank, self._size = loader.dp_rank, loader.dp_size
        stats = loader.stats if loader.dp_rank == 0 else dict(loader.stats)  # rank 0 counts what the old streams read
        self._streams = []
        for state in dealt["streams"]:
            old = loader._old_rank_loader(state["fingerprint"])
            old.stats = stats
            self._streams.append(_OldStream(state, old, dealt["pass"]))
        self._merged, self._turn = dealt["merged"], dealt["turn"]
        self._pending = None if dealt["pending"] is None else item_from_state(dealt["pending"])
        if not dealt["primed"]:
            self._pending = self._next_own()

    @property
    def finished(self) -> bool:
        return self._pending is None

    def take(self, n: int, max_tokens: float = float("inf")) -> list:
        items, tokens = [], 0
        while len(items) < n and tokens < max_tokens and self._pending is not None:
            items.append(self._pending)
            tokens += _item_tokens(self._pending)
            self._pending = self._next_own()
        return items

    def summed_tallies(self) -> Optional[list]:
        """The old streams' source tallies added up (None when none was kept)."""
        kept = [s.tallies for s in self._streams if s.tallies]
        if not kept:
            return None
        return [{key: sum(t[i][key] for t in kept) for key in kept[0][i]} for i in range(len(kept[0]))]

    def state(self) -> dict:
        return {**self._dealt, "merged": self._merged, "turn": self._turn, "primed": True,
                "pending": None if self._pending is None else item_state(self._pending),
                "streams": [s.state() for s in self._streams]}

    def _next_own(self):
        while True:
            item = self._next_merged()
            if item is None:
                return None
            mine = self._merged % self._size == self._rank
            self._merged += 1
            if mine:
                return item

    def _next_merged(self):
        """The next item round-robin over the old streams in rank order, a finished one dropping out."""
        for offset in range(len(self._streams)):
            index = (self._turn + offset) % len(self._streams)
            stream = self._streams[index]
            item = None if stream.finished else stream.next_item()
            if item is not None:
                self._turn = (index + 1) % len(self._streams)
                return item
        return None


class ResizedPass:
    """A loader's source inside a resized pass: its dealt share, then pass E + 1 on its own split."""

    exhausted = False  # training streams cycle

    def __init__(self, loader, position: dict):
        self._loader, self._pass = loader, position["dealt"]["pass"]
        self._dealt: Optional[DealtStream] = DealtStream(position["dealt"], loader)
        self._reader, self._epoch = None, self._pass
        self._switch_when_dealt()

    @property
    def epoch(self) -> int:
        """The pass of the items last taken (the dealt ones belong to pass E even once the reader is at E + 1)."""
        return self._epoch

    @property
    def tallies(self):
        return None if self._reader is None else self._reader.tallies

    def take_items(self, n: int, max_tokens: float = float("inf"), cut_at: Optional[int] = None) -> list:
        if self._reader is None:
            items = self._dealt.take(n, max_tokens)  # already cut by the old ranks' readers
            self._switch_when_dealt()
            if items:
                return items  # a chunk ends with the dealt pass, as one ends with a pass
        items = self._loader._items_of_docs(self._reader.take(n, max_tokens, cut_at))
        self._epoch = self._reader.epoch
        return items

    def position(self) -> dict:
        if self._reader is not None:
            return self._reader.position()
        return {"dealt": self._dealt.state(), "epoch": self._pass, "upstream": None, "usable_in_epoch": 0,
                "tallies": None}

    def _switch_when_dealt(self) -> None:
        if self._reader is not None or not self._dealt.finished:
            return
        tallies = self._dealt.summed_tallies() if self._loader.dp_rank == 0 else None
        self._reader = self._loader._reader_at({"epoch": self._pass + 1, "upstream": None, "usable_in_epoch": 0,
                                                "tallies": tallies})
        self._dealt = None
