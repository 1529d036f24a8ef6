"""Model FLOPs utilisation of a run: model FLOPs per token from the shape, the device's peak, MFU per log window.

Gap filled: neither Accelerate nor transformers' Trainer reports MFU (Trainer logs `total_flos`, without a peak);
GPT-NeoX logs FLOPs per step and torchtitan logs MFU. We log `mfu` in `train_log.jsonl` and the trackers, and the
start-up report names the peak it is measured against.

- FLOPs per token (PaLM's appendix B, as torchtitan): 6·N for the matmul parameters N (attention and MLP projections
  and the LM head; embeddings and norms are lookups and elementwise) plus 12·L·H·T for attention's scores and
  values at sequence length T, forward and backward. Activation checkpointing's recomputation is not counted: this
  is model FLOPs, not hardware FLOPs.
- The peak: for known GPUs the datasheet's dense tensor-core rate in the run's precision; elsewhere (CPUs, other
  GPUs, fp32) the best square-GEMM rate measured here in the run's compute dtype or fp32, whichever is faster, which
  the report says.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

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


def flops_per_token(config, seq_length: int) -> float:
    """Training FLOPs (forward + backward) per token of a GPTNeoX-shaped config at `seq_length`."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    intermediate = config.intermediate_size or 4 * hidden
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    kv_width = hidden * kv // config.num_attention_heads  # grouped-query attention: smaller K and V
    mlp_matrices = 3 if getattr(config, "model_type", "") in ("llama", "mistral") else 2  # SwiGLU: gate, up, down
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_width + mlp_matrices * hidden * intermediate
    matmul_params = layers * per_layer + config.vocab_size * hidden  # + the LM head
    return 6 * matmul_params + 12 * layers * hidden * seq_length


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


def mfu(tokens_per_second: float, flops_token: float, peak: Peak, devices: int) -> float:
    """The fraction of `devices` × the peak that the run's model FLOPs reached."""
    return tokens_per_second * flops_token / (peak.flops * devices)
