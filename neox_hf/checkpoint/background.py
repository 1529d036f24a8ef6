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

from neox_hf.checkpoint.layout_free import FOLDER, Chunk, first_failure, one_process_is_meant, save_planner
from neox_hf.errors import RecipeError


class BackgroundWrites:
    """At most one checkpoint write in flight, for one run (every rank holds one). `start` is collective.

    `overlap`: the host copy too is made beside training (a thread), and the next optimizer step waits for it before
    it changes a parameter or moment (a step pre-hook on the optimizer `start` is given); else the save waits for it."""

    def __init__(self, *, pinned: bool, overlap: bool = False):
        self._pinned, self._overlap = pinned, overlap
        self._pool: ThreadPoolExecutor | None = None
        self._job: Future | None = None
        self._staged: Future | None = None
        self._group = None
        self._stager = None
        self._hooked: set[int] = set()
        self._abandoned = threading.Event()

    @property
    def in_flight(self) -> bool:
        return self._job is not None and not self._job.done()

    def start(self, tensors: dict, folder: Path, publish, failed=None, optimizer=None) -> None:
        """Copy `tensors` (this rank's layout-free chunks) to host memory (now, or beside the next step's forward and
        backward with `overlap`, finished before `optimizer` steps); write them under `folder/layout_free` in the
        background, then call `publish()` (rank 0's rename and `latest`; None elsewhere). A failed write is raised
        by the next `wait` as `failed(error)` returns it (the save's own report: a full disk in one line).
        Collective."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        self.wait()
        distributed = dist.is_available() and dist.is_initialized()
        if distributed and self._group is None:  # collective: every rank's first save creates it
            self._group = dist.new_group(backend="gloo")
        if self._stager is None:
            self._stager = HostCopies(pinned=self._pinned, overlap=self._overlap)
        overlap = self._overlap and optimizer is not None
        if overlap:
            self._hook(optimizer)
        self._stager.overlap = overlap
        writer = dcp.FileSystemWriter(str(Path(folder) / FOLDER), sync_files=False)
        with one_process_is_meant():
            response = dcp.async_save(tensors, storage_writer=writer, planner=save_planner(),
                                      process_group=self._group, async_stager=self._stager, no_dist=not distributed)
        future = getattr(response, "upload_completion", response)
        self._staged = getattr(response, "staging_completion", None)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="neox_hf-checkpoint")
        self._abandoned.clear()
        self._job = self._pool.submit(self._finish, future, publish, failed or (lambda err: err))

    def _hook(self, optimizer) -> None:
        """Make `optimizer`'s step wait for the host copy in flight (once per optimizer): the torch optimizer that
        changes the parameters and moments, through Accelerate's and DeepSpeed's wrappers."""
        while hasattr(optimizer, "optimizer"):
            optimizer = optimizer.optimizer
        if id(optimizer) not in self._hooked and hasattr(optimizer, "register_step_pre_hook"):
            optimizer.register_step_pre_hook(lambda *args: self.wait_for_host_copy())
            self._hooked.add(id(optimizer))

    def wait_for_host_copy(self) -> None:
        """Block until the host copy in flight is made (the write may go on); its failure is the write's."""
        staged, self._staged = self._staged, None
        if staged is not None:
            try:
                staged.result()
            except Exception:  # noqa: BLE001 — reported by `wait`, as the write's failure
                pass

    def _finish(self, future: Future, publish, failed) -> None:
        try:
            future.result()
            if publish is not None and not self._abandoned.is_set():
                publish()
        except BaseException as err:  # noqa: BLE001 — DCP's CheckpointException is a BaseException
            cause = err if isinstance(err, Exception) else first_failure(err)
            raise failed(cause) from cause

    def wait(self) -> None:
        """Block until the write in flight (if any) is written and published; raise what it raised."""
        self.wait_for_host_copy()
        job, self._job = self._job, None
        if job is not None:
            job.result()

    def abandon(self) -> None:
        """Leave the write in flight unpublished (after an error): `latest` keeps naming the previous checkpoint."""
        self._abandoned.set()
        self.wait_for_host_copy()
        self._job = None

    def close(self) -> None:
        """Wait for the write in flight, then free the host buffers and the threads."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None


class HostCopies:
    """The host copy of a checkpoint's tensors (DCP's `AsyncStager` protocol): plain tensors, DTensors' local shards
    and `Chunk`s' rows into host buffers kept from one save to the next (pinned where a GPU is); with `overlap`, made
    in a thread (`stage` returns its future; DCP's writer waits for it).

    Gap filled: torch's `DefaultStager` copies tensors and DTensors only (any other value is refused), so a ZeRO
    rank's `Chunk` of rows could not pass it; a `Chunk` made of pieces is copied piece by piece, never joined
    first."""

    should_synchronize_after_execute = False

    def __init__(self, *, pinned: bool, overlap: bool = False):
        self.pinned, self.overlap = pinned, overlap
        self._buffers: dict = {}
        self._pool: ThreadPoolExecutor | None = None

    def stage(self, state_dict: dict):
        if not self.overlap:
            return self._copy(state_dict)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="neox_hf-host-copy")
        return self._pool.submit(self._copy, state_dict)

    def _copy(self, state_dict: dict) -> dict:
        import torch
        from torch.distributed.tensor import DTensor

        staged, on_device = {}, False
        for key, value in state_dict.items():
            if isinstance(value, Chunk):
                local = self._host_joined(key, value) if value.pieces is not None else self._host(key, value.local)
                staged[key] = Chunk(local, value.offsets, value.shape)
            elif isinstance(value, DTensor):
                local = self._host(key, value.to_local())
                staged[key] = DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                                 shape=value.shape, stride=value.stride())
            elif isinstance(value, torch.Tensor):
                staged[key] = self._host(key, value)
            else:
                staged[key] = value
            on_device = on_device or getattr(getattr(value, "device", None), "type", "cpu") != "cpu"
        if on_device:
            torch.cuda.synchronize()  # the non-blocking copies are complete before the write reads them
        return staged

    def _buffer(self, key: str, shape, dtype):
        """The host buffer kept for `key` from one save to the next, new where the shape or dtype changed."""
        import torch

        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
            buffer = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.pinned and torch.cuda.is_available())
            self._buffers[key] = buffer
        return buffer

    def _host(self, key: str, tensor):
        buffer = self._buffer(key, tensor.shape, tensor.dtype)
        buffer.copy_(tensor.detach(), non_blocking=self.pinned)
        return buffer

    def _host_joined(self, key: str, chunk: Chunk):
        """`chunk`'s pieces copied one after the other into the host buffer of its box (never joined on the
        device first)."""
        buffer = self._buffer(key, chunk.box, chunk.dtype)
        flat, at = buffer.view(-1), 0
        for piece in chunk.pieces:
            flat[at:at + piece.numel()].copy_(piece.detach().reshape(-1), non_blocking=self.pinned)
            at += piece.numel()
        return buffer

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._buffers.clear()


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
