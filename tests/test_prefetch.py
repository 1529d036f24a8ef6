"""The loop's prefetch thread: batches come back in order, each with the loader position taken right after it was
produced (what a checkpoint records), and on a GPU each is pinned in that thread, not in the step's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from neox_hf.train.prefetch import Prefetcher, pinned
from tests.conftest import REPO, reset_accelerate_state


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


# ----------------------------------------------------------------------------------------------------------------
# `data.num_workers: 1`: the loader in a forked worker process
# ----------------------------------------------------------------------------------------------------------------


class StatsLoader(CountingLoader):
    """CountingLoader that also counts in `stats`, as our loaders count documents; `fail_after` raises a DataError
    after that many batches; `pause` sleeps before each batch (a slow source)."""

    def __init__(self, n: int, fail_after: int | None = None, pause: float = 0.0):
        super().__init__(n)
        self.fail_after, self.pause, self.stats = fail_after, pause, {"documents": 0}

    def __iter__(self):
        import time

        from neox_hf.errors import DataError

        for i in range(self.n):
            if i == self.fail_after:
                raise DataError(f"data source `broken.jsonl`: line {i} is not JSON; fix or remove it")
            time.sleep(self.pause)
            self.produced, self.stats["documents"] = i + 1, self.stats["documents"] + 3
            yield {"input_ids": torch.tensor([i]), "name": f"b{i}"}


def _drained(batches: Prefetcher) -> list:
    try:
        return [(b["name"], int(b["input_ids"]), batches.state_dict(), dict(batches.stats)) for b in batches]
    finally:
        batches.close()


def test_a_worker_process_gives_the_batches_positions_and_counts_the_thread_gives():
    def prepare(batch):  # pinning on a GPU: in the training process, never in the worker
        assert threading.current_thread().name == "neox_hf-prefetch" and os.getpid() == parent
        return batch

    parent = os.getpid()
    in_thread = _drained(Prefetcher(StatsLoader(7), depth=2, workers=0))
    worker = Prefetcher(StatsLoader(7), depth=2, prepare=prepare, workers=1)
    assert worker.worker_pid not in (None, parent)
    assert worker.state_dict() == {"produced": 0} and worker.stats == {"documents": 0}
    in_worker = _drained(worker)
    assert in_worker == in_thread == [(f"b{i}", i, {"produced": i + 1}, {"documents": 3 * (i + 1)}) for i in range(7)]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_loader_error_reaches_the_step_after_the_batches_before_it(workers):
    from neox_hf.errors import DataError

    batches = Prefetcher(StatsLoader(9, fail_after=3), depth=2, workers=workers)
    try:
        assert [next(batches)["name"] for _ in range(3)] == ["b0", "b1", "b2"]
        with pytest.raises(DataError, match=r"^data source `broken.jsonl`: line 3 is not JSON; fix or remove it$"):
            next(batches)
    finally:
        batches.close()


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as gone)."""
    try:
        return not Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (FileNotFoundError, ProcessLookupError):
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_close_stops_the_worker_and_a_killed_worker_is_named_with_the_fix():
    batches = Prefetcher(StatsLoader(10**6, pause=0.01), depth=2, workers=1)
    assert next(batches)["name"] == "b0"
    batches.close()
    assert _gone_within(batches.worker_pid, 5)

    batches = Prefetcher(StatsLoader(10**6, pause=0.01), depth=2, workers=1)
    try:
        next(batches)
        os.kill(batches.worker_pid, signal.SIGKILL)  # the OOM killer's way
        with pytest.raises(RuntimeError, match=r"data worker process \(pid \d+\) exited with status -9 .*"
                                               r"set `data.num_workers: 0`"):
            for _ in range(100):  # the batches already queued come first
                next(batches)
    finally:
        batches.close()


class BigBatches:
    """Endless 2 MB batches: more than a pipe holds, so the worker is often blocked half-way through writing one."""

    def __iter__(self):
        i = 0
        while True:
            i += 1
            yield {"input_ids": torch.full((2**18,), i, dtype=torch.int64)}


def _returns_within(seconds: float, call):
    """call()'s result or exception, or a test failure if it has not returned after `seconds` (a hang)."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as err:  # the caller asserts on it
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    return outcome


def test_a_worker_killed_or_stopped_half_way_through_a_batch_neither_hangs_nor_is_misread():
    batches = Prefetcher(BigBatches(), depth=1, workers=1)
    try:
        assert int(next(batches)["input_ids"][0]) == 1
        assert _returns_within(10, batches.close) == {"value": None}  # the worker was blocked writing a batch
        assert _gone_within(batches.worker_pid, 5)
    finally:
        batches.close()

    batches = Prefetcher(BigBatches(), depth=1, workers=1)
    try:
        assert int(next(batches)["input_ids"][0]) == 1
        import time

        time.sleep(1)  # the queue is full and the pipe half-full: the worker is stuck in a write
        os.kill(batches.worker_pid, signal.SIGKILL)
        outcome = _returns_within(20, lambda: [int(next(batches)["input_ids"][0]) for _ in range(10)])
        assert isinstance(outcome.get("error"), RuntimeError) and "exited with status -9" in str(outcome["error"])
    finally:
        batches.close()


def test_the_worker_dies_with_a_killed_training_process():
    """A SIGKILLed run must not leave its worker behind, holding the run's stdout open (a launcher or a test
    reading that pipe would wait for ever) and a core busy."""
    script = ("import sys, time\n"
              "sys.path.insert(0, sys.argv[1])\n"
              "from tests.test_prefetch import StatsLoader\n"
              "from neox_hf.train.prefetch import Prefetcher\n"
              "batches = Prefetcher(StatsLoader(10**9, pause=0.001), depth=2, workers=1)\n"
              "next(batches)\n"
              "print(batches.worker_pid, flush=True)\n"
              "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script, str(REPO)], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(parent.stdout.readline())
        assert _alive(worker)
        parent.kill()
        parent.wait(timeout=10)
        assert _gone_within(worker, 5)
        assert parent.stdout.read() == ""  # end of file: no process holds the pipe any more
    finally:
        parent.kill()


@pytest.mark.distributed  # slow tier: three whole runs in process
def test_training_with_a_worker_process_equals_the_thread_and_resumes_exactly(tmp_path, fresh_accelerate_state, capfd):
    from neox_hf.recipe import recipe_from_dict
    from neox_hf.train import loop

    def run(folder: str, workers, **train) -> list[float]:
        recipe = recipe_from_dict({
            "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "seq_length": 32},
            "tokenizer": {"path": str(REPO / "examples/data/gpt-neox-20b-tokenizer.json")},
            "data": {"sources": [{"path": str(REPO / "examples/data/tinyshakespeare.txt")}], "num_workers": workers},
            "train": {"train_iters": 6, "lr_decay_iters": 6, "micro_batch_size": 2, "eval_iters": 0, "log_interval": 1,
                      "precision": "fp32", **train},  # equal losses: an fp32 claim
            "output": {"dir": str(tmp_path / folder), "tensorboard": False},
        })
        losses = loop.train(recipe).train_losses
        reset_accelerate_state()
        return losses

    straight = run("thread", "auto")  # on a CPU `auto` reads in the thread (the cores run the step's ops)
    assert "data: read ahead in a thread of the training process (`data.num_workers: auto`)" in capfd.readouterr().out
    assert run("resumed", 1, train_iters=3, save_interval=3) == straight[:3]
    out = capfd.readouterr()
    assert "data: read ahead in a worker process" in out.out and "fork" not in out.err  # no tokenizers fork warning
    assert run("resumed", 1, resume="auto") == straight[3:]  # the worker's positions, as checkpointed, resume exactly


def test_auto_reads_in_a_worker_process_on_a_gpu_and_in_the_thread_on_a_cpu():
    from neox_hf.train.prefetch import workers_for

    assert [workers_for("auto", "cuda"), workers_for("auto", "cpu"), workers_for(0, "cuda"), workers_for(1, "cpu")] \
        == [1, 0, 0, 1]


def test_where_no_fork_exists_auto_uses_the_thread_and_one_worker_is_refused_with_the_fix():
    from neox_hf.errors import RecipeError
    from neox_hf.train.prefetch import workers_for

    windows = ["spawn"]
    assert [workers_for("auto", "cuda", windows), workers_for(0, "cuda", windows)] == [0, 0]
    with pytest.raises(RecipeError, match=r"needs a platform that can fork .* set `data.num_workers: 0`"):
        workers_for(1, "cuda", windows)


@pytest.mark.parametrize("value", [True, 1.0, "1"])
def test_a_worker_count_of_another_type_is_refused_not_read_as_one(value):
    from neox_hf.errors import RecipeError
    from neox_hf.recipe import recipe_from_dict

    with pytest.raises(RecipeError, match=r"`data.num_workers` = .* is not one of 'auto', 0, 1"):
        recipe_from_dict({"data": {"num_workers": value}})


def test_more_than_one_worker_is_refused_naming_the_values():
    from neox_hf.errors import RecipeError
    from neox_hf.recipe import recipe_from_dict

    with pytest.raises(RecipeError, match=r"`data.num_workers` = 2 is not one of 'auto', 0, 1"):
        recipe_from_dict({"data": {"num_workers": 2}})
