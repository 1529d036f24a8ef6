"""Shared by the benchmarks: the machine's name, its measured GEMM peak, GPU peak memory, and one way of timing
training steps."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch


def status_mb(field: str) -> float:
    """A /proc/self/status memory field (VmRSS, VmHWM, ...) in MB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def cpu_name() -> str:
    """The CPU model and its matrix extensions, from /proc/cpuinfo (Linux) or platform."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "CPU")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    extensions = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({os.cpu_count()} logical CPUs; {', '.join(extensions) or 'no AVX2'})"


def device_name(device: torch.device | str) -> str:
    """The GPU's name as torch reports it (the datasheet tables match on it), or the CPU's."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def reset_accelerate_state() -> None:
    """Forget Accelerate's singletons between runs in one process: the next run may use another precision, which
    the previous run's AcceleratorState would refuse."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def reset_peak_memory(device: torch.device | str) -> None:
    """Start a peak-memory measurement (CUDA's allocator statistics; CPU has none)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device | str) -> int | None:
    """Peak bytes the CUDA caching allocator handed out to tensors since `reset_peak_memory` (what `torch.cuda.
    max_memory_allocated` reports: tensors, not the allocator's reserve); None on CPU."""
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def synchronize() -> None:
    """Wait for queued GPU work (a no-op on CPU): GPU kernels run asynchronously to the Python that launched them."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def best_seconds(fn, repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def gemm_peak(dtype: torch.dtype, sizes=None, repeats: int = 5, device: torch.device | str = "cpu"
              ) -> tuple[float, int]:
    """(FLOP/s, n) of the fastest square n×n GEMM: each size warmed up twice, best of `repeats`. One short GEMM
    without warm-up under-measures the peak (an MFU above 100% was printed that way). GPUs need larger sizes."""
    device = torch.device(device)
    sizes = sizes or ((4096, 8192) if device.type == "cuda" else (1024, 2048, 3072))
    best = (0.0, 0)
    for n in sizes:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        gemms = 10 if device.type == "cuda" else 1  # one 8192² bf16 GEMM is ~1 ms on a GPU: time several
        seconds = best_seconds(lambda: [torch.mm(a, b) for _ in range(gemms)], repeats, warmup=2) / gemms
        best = max(best, (2 * n**3 / seconds, n))
    return best


class StepClock:
    """Wall-clock time of every optimizer step of whichever loop runs, from a global post-step hook: a stock loop,
    transformers' Trainer and our `train(recipe)` are timed by the same code, whole steps (data, forward, backward,
    clipping, update, logging). Only the first optimizer that steps is timed: wrappers that are optimizers too
    (DeepSpeed's ZeRO optimizer around the torch AdamW) fire the hook twice per step."""

    def __enter__(self):
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.times = [time.perf_counter()]
        self._timed = None
        self._handle = register_optimizer_step_post_hook(self._tick)
        return self

    def _tick(self, optimizer, *_):
        if self._timed is None:
            self._timed = id(optimizer)
        if id(optimizer) == self._timed:
            synchronize()  # on a GPU the step has only been queued
            self.times.append(time.perf_counter())

    def __exit__(self, *exc):
        self._handle.remove()

    def step_seconds(self, first: int, count: int) -> list[float]:
        """Each of steps first .. first+count-1 on its own."""
        self.seconds(first, count)  # enough steps ran
        return [b - a for a, b in zip(self.times[first:first + count], self.times[first + 1:first + count + 1])]

    def seconds(self, first: int, count: int) -> float:
        """Time of steps first .. first+count-1 (0-based); step 0 also holds the set-up, so warm-up starts there."""
        if len(self.times) < first + count + 1:
            raise RuntimeError(f"only {len(self.times) - 1} optimizer steps ran, {first + count} expected")
        return self.times[first + count] - self.times[first]
