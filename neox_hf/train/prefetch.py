"""Batches prepared in a background thread, with the loader position that belongs to each batch.

Gap filled: `torch.utils.data.DataLoader` workers would need a map-style or picklable dataset and lose our exact
resume position (workers run ahead of training); Accelerate's loaders wrap the same. Here one thread tokenizes,
packs and collates ahead of the step (tokenizers and torch release the GIL for the heavy parts), and every batch
carries the loader's `state_dict()` taken right after it was produced, so a checkpoint records the position of
the last batch the step *consumed*, not of the last one prefetched, and resume stays exact.

For a GPU the thread also pins each batch (`pinned`): the loop's `non_blocking` copy to the device is asynchronous
only from page-locked memory; from pageable memory CUDA copies synchronously, and the host stops running ahead of the
queued step (torch's DataLoader does the same with `pin_memory=True`, in its own thread).
"""

from __future__ import annotations

import queue
import threading
import time

import torch

_DONE = object()


def pinned(batch):
    """The batch (a dict) with its tensors in page-locked host memory; anything else unchanged."""
    if not isinstance(batch, dict):
        return batch
    return {k: v.pin_memory() if torch.is_tensor(v) else v for k, v in batch.items()}


class Prefetcher:
    """`prepare`, when given, is applied to each batch in the background thread (`pinned` for a GPU)."""

    def __init__(self, loader, depth: int = 4, prepare=None):
        self.loader = loader
        self._prepare = prepare
        self._consumed_state = loader.state_dict() if hasattr(loader, "state_dict") else None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="neox_hf-prefetch", daemon=True)
        self._thread.start()
        self.wait_seconds = 0.0  # time the consumer spent blocked on data since the last `take_wait`

    def _produce(self) -> None:
        iterator = iter(self.loader)
        stateful = hasattr(self.loader, "state_dict")
        try:
            while not self._stop.is_set():
                batch = next(iterator)
                if self._prepare is not None:
                    batch = self._prepare(batch)
                self._put((batch, self.loader.state_dict() if stateful else None))
        except StopIteration:
            self._put(_DONE)
        except BaseException as err:  # surfaced in the consumer, with its own traceback or message
            self._put(err)

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        start = time.perf_counter()
        item = self._queue.get()
        self.wait_seconds += time.perf_counter() - start
        if item is _DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        batch, self._consumed_state = item
        return batch

    def take_wait(self) -> float:
        """Seconds spent waiting for data since the last call."""
        waited, self.wait_seconds = self.wait_seconds, 0.0
        return waited

    def state_dict(self):
        return self._consumed_state

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
