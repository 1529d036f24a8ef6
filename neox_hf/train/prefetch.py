"""Batches prepared ahead of the step, in a background thread or a worker process, with the loader position that
belongs to each batch.

Gap filled: `torch.utils.data.DataLoader` workers would need a map-style or picklable dataset and lose our exact
resume position (workers run ahead of training); Accelerate's loaders wrap the same. Here the loader runs ahead of
the step, and every batch carries the loader's `state_dict()` (and its document counts, `stats`) taken right after
it was produced, so a checkpoint records the position of the last batch the step *consumed*, not of the last one
prefetched, and resume stays exact.

Where the loader runs (`data.num_workers`):
- 0, a thread of the training process. Tokenizers and torch release the GIL for their heavy parts, but the rest of
  the data work (datasets' rows, packing, collating) is Python holding the GIL, and every torch op the training
  thread launches gives the GIL up and must win it back: on 2 AVX2 cores (`benchmarks/data_worker.py`, packed 8 × 2048
  Tiny Shakespeare windows) the training thread launched 0.42-0.60 of the small torch ops per second it launched with
  no data, against 0.68-0.89 with the loader in a worker process (whose remaining cost there is sharing two cores).
  On a CPU the step's ops are long and the cores are busy with them, so a thread costs little there (Pythia-14M
  shape, fp32: 775 tokens/s with the thread, 596 with a worker taking a core); on a GPU the host must launch kernels
  as fast as the GPU runs them.
- 1, one worker process forked from the training process, as torch's DataLoader forks its workers: the loader's
  Python work holds another interpreter's GIL. It reads the same stream in the same order (one reader, so resume
  stays exact; more workers would need the stream split, which changes the order). The worker touches no GPU and no
  process group; it dies with the training process (PR_SET_PDEATHSIG on Linux; elsewhere its next write fails), a
  worker that dies is named with the fix instead of a wait for ever, and an error in it reaches the step as the same
  exception (a `DataError` still ends the run in one line). Batches cross a pipe pickled (this process's own child,
  not a file we load), not through shared memory, which a container's small /dev/shm would cap.

For a GPU the thread also pins each batch (`pinned`): the loop's `non_blocking` copy to the device is asynchronous
only from page-locked memory; from pageable memory CUDA copies synchronously, and the host stops running ahead of the
queued step (torch's DataLoader does the same with `pin_memory=True`, in its own thread).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import queue
import signal
import threading
import time
import traceback

import torch

_DONE = object()


def pinned(batch):
    """The batch (a dict) with its tensors in page-locked host memory; anything else unchanged."""
    if not isinstance(batch, dict):
        return batch
    return {k: v.pin_memory() if torch.is_tensor(v) else v for k, v in batch.items()}


def workers_for(setting, device_type: str, start_methods=None) -> int:
    """The worker processes `data.num_workers` stands for on this device: `auto` is one on a GPU (the training
    process's GIL is kept for launching kernels) and none on a CPU (the cores run the step's ops). The worker is forked
    (the loader as it is, nothing pickled), so where the platform cannot fork (Windows) `auto` stays in the thread and
    an explicit 1 is refused with the fix. `start_methods` defaults to this platform's."""
    can_fork = "fork" in (multiprocessing.get_all_start_methods() if start_methods is None else start_methods)
    if setting == "auto":
        return 1 if device_type == "cuda" and can_fork else 0
    if setting == 1 and not can_fork:
        from neox_hf.errors import RecipeError

        raise RecipeError("`data.num_workers: 1` needs a platform that can fork a worker process (Linux, macOS); "
                          "set `data.num_workers: 0` to read the data in a thread")
    return int(setting)


def _snapshot(loader, stateful: bool):
    """(state_dict, stats) of the loader right after a batch: the position a checkpoint of that batch records."""
    stats = getattr(loader, "stats", None)
    return (loader.state_dict() if stateful else None), (dict(stats) if stats is not None else None)


class Prefetcher:
    """`prepare`, when given, is applied to each batch in the background thread (`pinned` for a GPU); `workers=1`
    runs the loader in a forked worker process, 0 in the thread."""

    def __init__(self, loader, depth: int = 4, prepare=None, workers: int = 0):
        if workers not in (0, 1):
            raise ValueError(f"workers must be 0 or 1, got {workers}")
        self.loader = loader
        self._prepare = prepare
        self._stateful = hasattr(loader, "state_dict")
        self._consumed_state, self.stats = _snapshot(loader, self._stateful)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._worker = _WorkerProcess(loader, self._stateful) if workers else None
        items = self._worker.items(self._stop) if self._worker else self._items_in_thread()
        self._thread = threading.Thread(target=self._produce, args=(items,), name="neox_hf-prefetch", daemon=True)
        self._thread.start()
        self.wait_seconds = 0.0  # time the consumer spent blocked on data since the last `take_wait`

    def _items_in_thread(self):
        for batch in self.loader:
            yield (batch, *_snapshot(self.loader, self._stateful))

    def _produce(self, items) -> None:
        try:
            for batch, state, stats in items:
                if self._stop.is_set():
                    return
                if self._prepare is not None:
                    batch = self._prepare(batch)
                self._put((batch, state, stats))
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
        batch, self._consumed_state, self.stats = item
        return batch

    def take_wait(self) -> float:
        """Seconds spent waiting for data since the last call."""
        waited, self.wait_seconds = self.wait_seconds, 0.0
        return waited

    def state_dict(self):
        return self._consumed_state

    @property
    def worker_pid(self) -> int | None:
        return self._worker.pid if self._worker else None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._worker is not None:
            self._worker.stop()


class _WorkerProcess:
    """The loader iterated in a forked child; `items` yields (batch, state, stats) in the order it produced them.

    One pipe, each end held by one process only: the worker's death is an end of file here (not a read that waits for
    ever on a half-written batch), and this side closing its end is the worker's signal to stop (its next write
    fails). The pipe's buffer and the prefetch queue bound how far the worker runs ahead."""

    def __init__(self, loader, stateful: bool):
        context = multiprocessing.get_context("fork")  # the loader as it is (tokenizer, position): nothing to pickle
        self._reader, writer = context.Pipe(duplex=False)
        self._process = context.Process(target=_serve, args=(loader, stateful, writer, self._reader),
                                        name="neox_hf-data", daemon=True)
        self._process.start()
        writer.close()
        self.pid = self._process.pid

    def items(self, stop: threading.Event):
        while not stop.is_set():
            if not self._reader.poll(0.5):
                continue
            try:
                kind, payload = pickle.loads(self._reader.recv_bytes())
            except (EOFError, OSError):  # OSError: it died half-way through writing a batch
                raise self._exited() from None
            if kind == "done":
                return
            if kind == "error":
                raise payload
            yield payload

    def _exited(self) -> RuntimeError:
        self._process.join(timeout=5)
        return RuntimeError(f"the data worker process (pid {self.pid}) exited with status {self._process.exitcode} "
                            "before the data ended (killed? out of memory?); set `data.num_workers: 0` to read the "
                            "data in the training process")

    def stop(self) -> None:
        self._reader.close()  # the worker's next write fails and it exits
        self._process.join(timeout=5)
        if self._process.is_alive():  # busy in one long document: its batches are not wanted any more
            self._process.kill()
            self._process.join()


def _serve(loader, stateful: bool, writer, reader) -> None:
    """The worker's body: every batch with its position, then "done", or the error that ended the loader; it stops
    when a write fails (the training process closed its end, or died)."""
    reader.close()  # the training process's end only: a write fails once it closes it
    _die_with_parent()
    # Ctrl-C and a preemption signal (SLURM signals every process of the job) are the training process's to handle:
    # it stops the worker, after its checkpoint for a preemption (neox_hf.train.preemption).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    torch.set_num_threads(1)  # torch's DataLoader workers do the same: the parent's cores run the step
    try:
        for batch in loader:
            _send(writer, "batch", (batch, *_snapshot(loader, stateful)))
        _send(writer, "done", None)
    except (BrokenPipeError, ConnectionResetError):
        return  # stopped, or the training process is gone: nobody reads any more
    except BaseException as err:
        with contextlib.suppress(OSError):  # nobody may be reading any more
            _send(writer, "error", _portable_error(err))


def _send(writer, kind: str, payload) -> None:
    writer.send_bytes(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL))


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when the training process dies, even mid-document (elsewhere its next
    write fails)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _portable_error(err: BaseException) -> BaseException:
    """The error as it is where it survives pickling (our DataError, OSError, ...), else a RuntimeError carrying the
    worker's traceback."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        return RuntimeError(f"the data worker process failed:\n{text}")
