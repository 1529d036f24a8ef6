"""What this machine can do, asked once: CPU feature flags, measured GEMM rates, whether bf16 trains faster than
fp32 here (the verdict `train.precision: auto` follows), whether DeepSpeed's accelerator runs fp16, and each device's
peak FLOP/s for MFU.

The lowest layer above `errors`/`io`: it imports no recipe, so the recipe (which settles `auto` from the verdict),
the accelerator builder, the MFU report and `neox_hf plan` all ask here and nothing here asks them.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

# Read instead of /proc/cpuinfo's flags when set: the suite (and a user) can see what `auto` and the fp16 gate decide
# on another CPU, e.g. NEOX_HF_CPU_FLAGS="avx2 fma" (AVX2-only) or "avx512f avx512_bf16 amx_bf16 avx512_fp16" (AMX).
CPU_FLAGS_OVERRIDE = "NEOX_HF_CPU_FLAGS"


def deepspeed_runs_fp16() -> bool:
    """Whether DeepSpeed's accelerator here trains fp16: a GPU, or a CPU whose oneDNN has fp16 kernels (AVX512-FP16 /
    AMX-FP16). Under NEOX_HF_CPU_FLAGS the CPU answer is the one those flags would give (it can only be narrowed:
    flags claiming fp16 on a CPU without it do not give DeepSpeed the kernels)."""
    from deepspeed.accelerator import get_accelerator

    supported = bool(get_accelerator().is_fp16_supported())
    if torch.cuda.is_available() or os.environ.get(CPU_FLAGS_OVERRIDE) is None:
        return supported
    return supported and bool(_cpu_flags() & {"avx512_fp16", "amx_fp16"})


def native_bf16(cpu_flags: set[str] | None = None) -> str | None:
    """Why this machine has bf16 matmul instructions ("this CPU has amx_bf16", a CUDA GPU of compute capability ≥ 8),
    or None where bf16 is emulated (AVX2-only CPUs: far slower than fp32). Having them does not make bf16 faster:
    `bf16_verdict` decides that. `cpu_flags` defaults to /proc/cpuinfo's; given, the question is about that CPU, GPU
    or not."""
    if _asks_about_this_gpu(cpu_flags):
        major, _ = torch.cuda.get_device_capability()
        return f"{torch.cuda.get_device_name()} (compute capability {major}.x) has bf16 tensor cores" if major >= 8 else None
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
    native = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    if not native:
        return None
    return f"this CPU has {native[0]}" + (f" (as {CPU_FLAGS_OVERRIDE} says)" if _flags_overridden(cpu_flags) else "")


class Bf16Verdict(NamedTuple):
    """Whether bf16 trains faster than fp32 here (what `train.precision: auto` picks) and why, as one phrase."""
    faster: bool
    why: str


# bf16 is chosen on an AVX512-BF16 CPU without AMX only where its GEMMs beat fp32's by this much: autocast adds a cast
# around every matmul, and the two rates measured at start-up vary by ±10% with the machine's load.
BF16_GEMM_ADVANTAGE = 1.25


def bf16_verdict(cpu_flags: set[str] | None = None, measure=None) -> Bf16Verdict:
    """Whether bf16 is faster than fp32 on this device. A GPU with bf16 tensor cores and an AMX CPU: yes (AMX's bf16
    tiles run several times fp32's rate). An AVX2-only CPU: no (emulated). An AVX512-BF16 CPU without AMX: measured,
    because the instruction alone is not enough: on a Xeon whose AMX the hypervisor hides (Emerald Rapids, 2 vCPUs)
    bf16 GEMMs ran at 170 GFLOP/s against fp32's 340, and a bf16 run trained GSM8K at 0.59x fp32's tokens/s.
    `measure(dtype) -> FLOP/s` defaults to `measured_gemm_rate` on this CPU (~0.3 s for both, once per process).
    Under NEOX_HF_CPU_FLAGS the flags alone decide (another CPU's GEMMs cannot be measured here): a bf16 flag means bf16.
    Given `cpu_flags`, the verdict is that CPU's, GPU or not."""
    native = native_bf16(cpu_flags)
    if native is None:
        return Bf16Verdict(False, "bf16 is emulated on this device: slower than fp32")
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
    if _asks_about_this_gpu(cpu_flags) or "amx_bf16" in flags or _flags_overridden(cpu_flags):
        return Bf16Verdict(True, native)
    measure = measure or _cpu_gemm_rate
    bf16, fp32 = measure(torch.bfloat16), measure(torch.float32)
    rates = f"its bf16 GEMMs measured {bf16 / 1e9:.0f} GFLOP/s against fp32's {fp32 / 1e9:.0f}"
    if bf16 >= BF16_GEMM_ADVANTAGE * fp32:
        return Bf16Verdict(True, f"{native} without AMX, and {rates}")
    return Bf16Verdict(False, f"{native} but no AMX, and {rates}: bf16 is slower than fp32")


def _cpu_gemm_rate(dtype: torch.dtype) -> float:
    """FLOP/s of this CPU's GEMMs in `dtype` (measured once per process: the MFU peak reuses it)."""
    return measured_gemm_rate(dtype, torch.device("cpu"))[0]


def _asks_about_this_gpu(cpu_flags: set[str] | None) -> bool:
    """Whether the question is about this machine's GPU: no CPU flags given, and torch sees a GPU."""
    return cpu_flags is None and torch.cuda.is_available()


def _flags_overridden(cpu_flags: set[str] | None) -> bool:
    """Whether the flags in question are NEOX_HF_CPU_FLAGS's (no flags given, and the variable set)."""
    return cpu_flags is None and os.environ.get(CPU_FLAGS_OVERRIDE) is not None


def _cpu_flags() -> set[str]:
    """This CPU's feature flags, or NEOX_HF_CPU_FLAGS's (space- or comma-separated) where it is set."""
    override = os.environ.get(CPU_FLAGS_OVERRIDE)
    if override is not None:
        return set(override.replace(",", " ").split())
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# Dense (no sparsity) bf16 / fp16 tensor-core peaks from NVIDIA's datasheets, FLOP/s, matched against
# torch.cuda.get_device_name() in this order (the more specific name first: "H100 PCIe" before "H100").
DATASHEET_BF16 = (
    ("H200 NVL", 835e12), ("H200", 989e12),
    ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),
    ("A100", 312e12), ("L40S", 362e12), ("A10G", 70e12), ("L4", 121e12),
)
_COMPUTE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Peak:
    flops: float  # per device, FLOP/s
    source: str  # what the number is, for the start-up report


def datasheet_peak(device_name: str, precision: str) -> float | None:
    if precision not in ("bf16", "fp16"):
        return None
    return next((peak for part, peak in DATASHEET_BF16 if part in device_name), None)


def device_peak(device: torch.device, precision: str, measure=None) -> Peak:
    """This device's peak FLOP/s in the run's precision: the datasheet's for known GPUs, else measured
    (`measure(dtype, device) -> (FLOP/s, n)`, `measured_gemm_rate` unless given)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        sheet = datasheet_peak(name, precision)
        if sheet is not None:
            return Peak(sheet, f"{name} datasheet dense {precision}, {sheet / 1e12:.0f} TFLOP/s")
    # A bf16/fp16 run still runs some matmuls in fp32, and some CPUs run fp32 GEMMs faster than bf16 ones (measured
    # 163 vs 84 GFLOP/s on one AVX512-BF16 core): the peak is the faster of the two, so MFU stays below 1.
    measure = measure or measured_gemm_rate
    candidates = {name: measure(_COMPUTE_DTYPE[name], device) for name in {precision, "fp32"}}
    fastest = max(candidates, key=lambda name: candidates[name][0])
    flops, n = candidates[fastest]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "this CPU"
    return Peak(flops, f"{flops / 1e12:.3g} TFLOP/s, the best {n}² {fastest} GEMM measured on {where}")


def measured_gemm_rate(dtype: torch.dtype, device: torch.device, repeats: int = 2) -> tuple[float, int]:
    """(FLOP/s, n) of the fastest square GEMM of a few sizes, each warmed up once, best of `repeats` blocks. Short
    (about 0.2 s on a CPU) because every run pays it at start-up; measured once per process and dtype (the
    `train.precision: auto` verdict and the MFU peak share it).
    On a CPU the time counts CPU time too (`_timed`): another process sharing the cores at start-up would otherwise
    lower the peak, and the run's MFU would read above 1 once the cores are free again. That is why each timed block
    is a run of GEMMs lasting at least `_BLOCK_S`: Linux updates a thread's CPU time only at scheduler ticks, and
    single ~5 ms GEMMs read up to twice the rate on 2 threads (654 against 340 GFLOP/s on an Emerald Rapids vCPU pair).
    A dtype the device emulates stays short too: a GEMM over `_LONG_GEMM_S` is long enough to time on its own (no
    further repeats), and after a size whose GEMM took over `_LAST_SIZE_S` the larger size (about 8x the time) is
    not tried. bf16 on an AVX2-only CPU runs at ~1 GFLOP/s: it stops at 512² (~0.6 s)."""
    return _measured_gemm_rate(dtype, torch.device(device), repeats)


@functools.lru_cache(maxsize=None)
def _measured_gemm_rate(dtype: torch.dtype, device: torch.device, repeats: int) -> tuple[float, int]:
    sizes = (4096, 8192) if device.type == "cuda" else (512, 1024)
    # Its own generator: the global one seeds the run's dropout, and whether (and how many sizes) this measures
    # depends on the cache and the machine's speed; drawing from it made a run's losses depend on both.
    generator = torch.Generator(device=device).manual_seed(0)
    best = (0.0, 0)
    for n in sizes:
        a, b = (torch.randn(n, n, device=device, generator=generator).to(dtype) for _ in range(2))
        one = _timed(lambda: torch.mm(a, b), device)  # also the warm-up
        if one > _LONG_GEMM_S:  # long enough to be its own measurement
            best = max(best, (2 * n**3 / one, n))
        else:
            count = min(64, int(_BLOCK_S / max(one, 1e-6)) + 1)
            for _ in range(repeats):
                seconds = _timed(lambda: [torch.mm(a, b) for _ in range(count)], device) / count
                best = max(best, (2 * n**3 / seconds, n))
        if one > _LAST_SIZE_S:
            break
    return best


_BLOCK_S = 0.03  # a timed block of GEMMs lasts at least this long (CPU time is exact only over several ticks)
_LONG_GEMM_S = 0.25  # a GEMM this long is timed once
_LAST_SIZE_S = 0.05  # after a GEMM this long, no larger size (8x as long, times 1 + repeats)


def _timed(work, device: torch.device) -> float:
    """Seconds `work` took on `device`. On a CPU the shorter of the wall time and the CPU time per intra-op thread:
    the CPU time leaves out time the cores served another process, the wall time leaves out threads spin-waiting."""
    _synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    _synchronize(device)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return min(wall, cpu / torch.get_num_threads()) if device.type == "cpu" else wall


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fp8_unsupported_reason(gpu: tuple[str, tuple[int, int]] | None = None,
                           transformer_engine: bool | None = None) -> str | None:
    """Why `train.precision: fp8` cannot run (no CUDA GPU, a GPU without FP8 tensor cores, no Transformer Engine), or
    None where it can. FP8 matmuls need compute capability 8.9 (Ada) or 9.0+ (Hopper). `gpu` (name, capability) and
    `transformer_engine` default to this machine's; given, the question is about that machine."""
    if gpu is None and torch.cuda.is_available():
        gpu = (torch.cuda.get_device_name(), torch.cuda.get_device_capability())
    if gpu is None:
        return "there is no CUDA GPU here (FP8 matmuls need an Ada or Hopper GPU, compute capability ≥ 8.9)"
    name, (major, minor) = gpu
    if (major, minor) < (8, 9):
        return (f"{name} (compute capability {major}.{minor}) has no FP8 tensor cores "
                "(they need ≥ 8.9: Ada, Hopper or later)")
    if transformer_engine is None:
        from accelerate.utils import is_transformer_engine_available

        transformer_engine = is_transformer_engine_available()
    if not transformer_engine:
        return "Transformer Engine is not installed (`pip install transformer-engine[pytorch]`)"
    return None

