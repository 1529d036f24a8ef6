"""Checkpoint writes in the background (`train.async_checkpoint`): the step waits only while this rank's layout-free
tensors are copied to host memory (pinned where a GPU is); torch.distributed.checkpoint writes them from a thread
beside training, and the checkpoint is published (`step_…` renamed from its staging folder, `latest` moved, old
checkpoints pruned) only once the write is complete on every rank.

Gap filled: `torch.distributed.checkpoint.async_save` copies and writes, but knows nothing of a checkpoint being
published: `latest` must not name a folder some rank is still writing, and a run must not start the next write, end,
or stop on a preemption signal with one in flight. torchtitan's `CheckpointManager` (async_mode `async` /
`async_with_pinned_mem`) does the same around the same call; this is ours for the neox_hf checkpoint layout.

Why every rank's write is complete when rank 0's future is: DCP's save ends with a gather of every rank's write
results to the coordinator, which writes `.metadata` only then (`_DistWrapper.all_reduce("write", …)`), and each rank
writes its small files (trainer state, RNG) before it joins that collective. The background collectives run on a
gloo group of their own, so they never interleave with the step's collectives on the default group.

A write in flight is never waited for after an error (a peer that died would hold its collective for gloo's timeout):
it is abandoned, its staging folder left unpublished, and `latest` keeps naming the previous whole checkpoint; a kill
-9 at any moment leaves the same.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path


class BackgroundWrites:
    """At most one checkpoint write in flight, for one run (every rank holds one). `start` is collective."""

    def __init__(self, *, pinned: bool):
        self._pinned = pinned
        self._pool: ThreadPoolExecutor | None = None
        self._job: Future | None = None
        self._group = None
        self._stager = None
        self._abandoned = threading.Event()

    @property
    def in_flight(self) -> bool:
        return self._job is not None and not self._job.done()

    def start(self, tensors: dict, folder: Path, publish, failed=None) -> None:
        """Copy `tensors` (this rank's layout-free chunks) to host memory now; write them under `folder/layout_free`
        in the background, then call `publish()` (rank 0's rename and `latest`; None elsewhere). A failed write is
        raised by the next `wait` as `failed(error)` returns it (the save's own report: a full disk in one line).
        Collective."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        from neox_hf.checkpoint.layout_free import FOLDER, one_process_is_meant

        self.wait()
        distributed = dist.is_available() and dist.is_initialized()
        if distributed and self._group is None:  # collective: every rank's first save creates it
            self._group = dist.new_group(backend="gloo")
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # pinned host buffers, reused from one save to the next (the stager caches them); a CPU run copies plainly
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=self._pinned, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=self._pinned))
        writer = dcp.FileSystemWriter(str(Path(folder) / FOLDER), sync_files=False)
        with one_process_is_meant():
            future = dcp.async_save(tensors, storage_writer=writer, process_group=self._group,
                                    async_stager=self._stager, no_dist=not distributed)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="neox_hf-checkpoint")
        self._abandoned.clear()
        self._job = self._pool.submit(self._finish, future, publish, failed or (lambda err: err))

    def _finish(self, future: Future, publish, failed) -> None:
        from neox_hf.checkpoint.layout_free import first_failure

        try:
            future.result()
            if publish is not None and not self._abandoned.is_set():
                publish()
        except BaseException as err:  # noqa: BLE001 — DCP's CheckpointException is a BaseException
            cause = err if isinstance(err, Exception) else first_failure(err)
            raise failed(cause) from cause

    def wait(self) -> None:
        """Block until the write in flight (if any) is written and published; raise what it raised."""
        job, self._job = self._job, None
        if job is not None:
            job.result()

    def abandon(self) -> None:
        """Leave the write in flight unpublished (after an error): `latest` keeps naming the previous checkpoint."""
        self._abandoned.set()
        self._job = None

    def close(self) -> None:
        """Wait for the write in flight, then free the pinned buffers and the thread."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None


def host_copy_bytes(parameters: int, *, shards: int) -> int:
    """Host memory a background checkpoint's copy takes on one rank: its 1/`shards` of every parameter's fp32 master
    value and Adam's two moments (12 bytes a parameter), what `neox_hf plan` counts for `train.async_checkpoint`."""
    return 12 * parameters // max(shards, 1)


def check_host_memory(parameters: int, *, shards: int, local_ranks: int | None = None,
                      available: int | None = None) -> None:
    """Refuse `train.async_checkpoint` where this node's ranks' host copies would not fit in the memory available
    now (one line, before the first step): a copy that does not fit would swap or be killed mid-run. `local_ranks`:
    the launcher's LOCAL_WORLD_SIZE (torchrun's and accelerate's), 1 without one."""
    import os

    from neox_hf.errors import RecipeError

    if local_ranks is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    if available is None:
        import psutil

        available = psutil.virtual_memory().available
    need = host_copy_bytes(parameters, shards=shards) * local_ranks
    if need > available:
        raise RecipeError(f"`train.async_checkpoint: true` copies the checkpoint to host memory: {need / 2**30:.1f} GiB "
                          f"for this node's {local_ranks} rank(s), {available / 2**30:.1f} GiB available; set "
                          "`train.async_checkpoint: false` (the step then waits for the write), or use more nodes")
