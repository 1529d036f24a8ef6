"""Fused linear + cross-entropy against the unfused head, at Pythia head shapes, on this machine.

    python benchmarks/fused_loss.py [--repeats 5] [--threads N] [--shapes 14m,70m] [--dtypes fp32,bf16] [--sweep]
                                    [--device cpu|cuda]

For each head shape (Pythia-14M: 3,072 tokens × hidden 128, a GSM8K micro batch of 16; Pythia-70M: 8 × 512 tokens
× hidden 512; vocabulary 50,304) and dtype (fp32; bf16 hidden states and weights), times loss + backward to the
hidden states and the head weight, best of --repeats after a warm-up round, and measures the peak bytes of tensors
allocated on the way (on CPU exactly, by a TorchDispatchMode, since CPU has no allocator statistics; on a GPU the
caching allocator's peak, torch.cuda.max_memory_allocated above what was allocated before):
- unfused: `logits = hidden @ W^T`, `F.cross_entropy(logits.float(), labels, reduction="sum")` (what a
  transformers model does, bf16 logits upcast as GPTNeoX's loss function does);
- fused: `neox_hf.ops.linear_cross_entropy` (gradients computed in the forward);
- fused, recompute: the same, logits recomputed in backward instead (`recompute=True`).
An eighth of the labels are -100 (padding/prompt tokens). GFLOP/s counts the 3 head matmuls (2·N·H·V each) of the
unfused computation for every row; the machine's GEMM peak is measured in the same run (square GEMMs of
1024-3072, 4096-8192 on a GPU, warm-up, best of 5). The variants take turns within each repeat. `--device` defaults
to cuda where torch sees a GPU: inputs are made there (from the same seeded CPU generator, so both devices see the
same numbers) and every timed region is bracketed by torch.cuda.synchronize() (kernels run asynchronously);
`--shapes 160m` (8 × 2048 tokens × hidden 768) is a GPU-sized head. `--sweep` times the fused op at
several chunk sizes instead, round-robin (how `default_chunk_rows` was chosen). One full run (both shapes, both
dtypes) takes about 5 minutes on 2 idle cores; on a loaded machine, many times that.
"""

from __future__ import annotations

import argparse
import sys
import time
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench_common import device_name, gemm_peak, peak_memory, reset_peak_memory, synchronize  # noqa: E402

from neox_hf.ops import linear_cross_entropy  # noqa: E402

VOCAB = 50304
SHAPES = {"14m": ("Pythia-14M head, 3072 tok × 128", 3072, 128),
          "70m": ("Pythia-70M head, 4096 tok × 512", 4096, 512),
          "160m": ("Pythia-160M head, 16384 tok × 768", 16384, 768)}  # a GPU's micro batch of 8 × 2048
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class PeakBytes(TorchDispatchMode):
    """Peak bytes of tensors created inside the block and alive at once (storages counted once)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.largest = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self._track(t.untyped_storage())
        return out

    def _track(self, storage) -> None:
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if key in self._seen or nbytes == 0:
            return
        self._seen.add(key)
        self.live += nbytes
        self.peak, self.largest = max(self.peak, self.live), max(self.largest, nbytes)
        weakref.finalize(storage, self._release, key, nbytes)

    def _release(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes


def unfused(hidden, weight, labels):
    logits = hidden @ weight.t()
    return F.cross_entropy(logits.float(), labels, reduction="sum")


def fused(hidden, weight, labels, **options):
    return linear_cross_entropy(hidden, weight, labels, **options)[0]


def library_variants(device: torch.device) -> dict:
    """On CUDA, the library kernels `train.loss_kernel: auto` picks where installed (neox_hf.ops.library_loss)."""
    from neox_hf.ops.library_loss import LIBRARIES, installed, library_head_loss

    if device.type != "cuda":
        return {}

    class Head(torch.nn.Module):  # a bias-free linear whose weight is the benchmark's tensor
        def __init__(self, weight):
            super().__init__()
            self.weight, self.bias = weight, None

    return {f"{LIBRARIES[kernel]} (train.loss_kernel {kernel})":
            (lambda h, w, y, kernel=kernel: library_head_loss(kernel, Head(w), h, y)[0])
            for kernel in LIBRARIES if installed(kernel)}


def inputs(tokens: int, width: int, dtype: torch.dtype, device: torch.device):
    """Hidden states, head weight and labels on `device`, drawn from one seeded CPU generator (the same numbers on
    every device), moved before anything is timed."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, width, generator=g).to(device, dtype).requires_grad_()
    weight = (0.02 * torch.randn(VOCAB, width, generator=g)).to(device, dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (tokens,), generator=g)
    labels[::8] = -100
    return hidden, weight, labels.to(device)


def timed_seconds(fn) -> float:
    """Wall time of `fn()` with the GPU's queued work drained before and after (no-ops on CPU)."""
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - start


def loss_and_backward(loss_fn, hidden, weight, labels):
    grads = torch.autograd.grad(loss_fn(hidden, weight, labels), [hidden, weight])
    return grads


def peak_bytes(loss_fn, hidden, weight, labels) -> tuple[int, int]:
    """(peak live bytes, largest single allocation) of loss + backward; the returned gradients are counted. On a GPU
    the peak is the allocator's (it also sees library workspaces), above what was allocated before."""
    device = hidden.device
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    reset_peak_memory(device)
    with PeakBytes() as tracker:
        grads = loss_and_backward(loss_fn, hidden, weight, labels)
        del grads
    allocator_peak = peak_memory(device)
    return (tracker.peak if allocator_peak is None else allocator_peak - before), tracker.largest


def compare(shape_key: str, dtype_key: str, repeats: int, peak: float, device: torch.device) -> list[tuple]:
    """The three variants take turns within each repeat (machine load hits them alike); best time of each."""
    title, tokens, width = SHAPES[shape_key]
    hidden, weight, labels = inputs(tokens, width, DTYPES[dtype_key], device)
    flops = 3 * 2 * tokens * width * VOCAB
    variants = {"unfused (logits + F.cross_entropy)": unfused, "fused": fused,
                "fused, recompute in backward": lambda h, w, y: fused(h, w, y, recompute=True)}
    variants.update(library_variants(device))
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(repeats + 1):  # the first round is the warm-up
        for name, fn in variants.items():
            seconds = timed_seconds(lambda: loss_and_backward(fn, hidden, weight, labels))
            best[name] = min(best[name], seconds)
    rows = []
    for name, fn in variants.items():
        mem, largest = peak_bytes(fn, hidden, weight, labels)
        rows.append((f"{title}, {dtype_key}", name, best[name], flops / best[name] / peak, mem, largest))
    return rows


def sweep(repeats: int, shapes: list[str], dtypes: list[str], device: torch.device) -> None:
    """Chunk sizes take turns within each repeat, so a change in machine load hits them alike; best time kept."""
    print("| shape, dtype | chunk rows | chunk MB (fp32 logits) | seconds (best) |")
    print("|---|---:|---:|---:|")
    for shape_key in shapes:
        title, tokens, width = SHAPES[shape_key]
        for dtype_key in dtypes:
            hidden, weight, labels = inputs(tokens, width, DTYPES[dtype_key], device)
            sizes = [rows for rows in (64, 256, 512, 1024, 2048) if rows < tokens]
            best = dict.fromkeys(sizes, float("inf"))
            for _ in range(repeats + 1):  # the first round is the warm-up
                for rows in sizes:
                    seconds = timed_seconds(lambda: loss_and_backward(
                        lambda h, w, y: fused(h, w, y, chunk_size=rows), hidden, weight, labels))
                    best[rows] = min(best[rows], seconds)
            for rows in sizes:
                print(f"| {title}, {dtype_key} | {rows} | {rows * VOCAB * 4 / 2**20:.0f} | {best[rows]:.3f} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--shapes", default="14m,70m")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--sweep", action="store_true", help="time the fused op at several chunk sizes")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here")
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    print(f"{device_name(device)}, torch {torch.__version__}, {args.threads} threads, best of {args.repeats} after a "
          "warm-up")
    if args.sweep:
        return sweep(args.repeats, args.shapes.split(","), args.dtypes.split(","), device)
    peaks = {key: gemm_peak(dtype, device=device)[0] for key, dtype in DTYPES.items() if key in args.dtypes.split(",")}
    print("GEMM peak (best square GEMM, best of 5): " + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in peaks.items()))
    print("| head shape, dtype | loss + backward | seconds | % of GEMM peak | peak MB | largest tensor MB | vs unfused |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for shape_key in args.shapes.split(","):
        for dtype_key in args.dtypes.split(","):
            rows = compare(shape_key, dtype_key, args.repeats, peaks[dtype_key], device)
            base = rows[0][2]
            for where, name, seconds, mfu, mem, largest in rows:
                print(f"| {where} | {name} | {seconds:.3f} | {100 * mfu:.0f}% | {mem / 2**20:.0f} | "
                      f"{largest / 2**20:.0f} | {base / seconds:.2f}× |")


if __name__ == "__main__":
    main()
