"""The loop's prefetch thread: batches come back in order, each with the loader position taken right after it was
produced (what a checkpoint records), and on a GPU each is pinned in that thread, not in the step's."""

from __future__ import annotations

import threading

import pytest
import torch

from neox_hf.train.prefetch import Prefetcher, pinned


class CountingLoader:
    """Batches {"input_ids": [i], "name": "b{i}"} with a state_dict of how many it has produced."""

    def __init__(self, n: int):
        self.n, self.produced = n, 0

    def __iter__(self):
        for i in range(self.n):
            self.produced = i + 1
            yield {"input_ids": torch.tensor([i]), "name": f"b{i}"}

    def state_dict(self):
        return {"produced": self.produced}


def test_prepare_runs_in_the_prefetch_thread_and_keeps_each_batch_with_its_position():
    threads = []

    def prepare(batch):
        threads.append(threading.current_thread().name)
        return {**batch, "input_ids": batch["input_ids"] * 10}

    batches = Prefetcher(CountingLoader(6), depth=2, prepare=prepare)
    try:
        assert batches.state_dict() == {"produced": 0}
        seen = []
        for batch in batches:
            seen.append((batch["name"], int(batch["input_ids"]), batches.state_dict()["produced"]))
    finally:
        batches.close()
    assert seen == [(f"b{i}", 10 * i, i + 1) for i in range(6)]
    assert threads == ["neox_hf-prefetch"] * 6


def test_pinned_leaves_what_is_not_a_tensor_and_what_is_not_a_dict():
    assert pinned([1, 2]) == [1, 2]
    assert pinned({"name": "x", "seq": 3}) == {"name": "x", "seq": 3}


@pytest.mark.cuda  # in the GPU tier (benchmarks/gpu_check.sh runs -m cuda)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA (its twin: the test above)")
def test_pinned_batches_are_page_locked_and_equal():
    batch = {"input_ids": torch.arange(6).reshape(2, 3), "name": "x"}
    out = pinned(batch)
    assert out["input_ids"].is_pinned() and torch.equal(out["input_ids"], batch["input_ids"]) and out["name"] == "x"
