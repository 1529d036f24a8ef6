"""Time and peak memory of building GPT-NeoX's index (data.order: gpt-neox) at Pile scale, sizes only.

    python benchmarks/neox_index.py [--documents 50000000] [--mean-tokens 200] [--seq-length 2048] [--epochs 1]

A synthetic corpus of `documents` sizes (mean `mean-tokens`, so 10B tokens by default: a thirtieth of the 300B-token
Pile) goes through the three stages of `neox_hf.data.neox_order.build_index`: the doc index (all epochs shuffled by
RandomState), the sample index (vectorised: np.searchsorted over cumulative sizes) and the shuffle index. No file is
read or written. The in-run baseline is GPT-NeoX's sample-index loop written in Python (what the C++ helper does),
timed on the first 200,000 samples and extrapolated. Target: ≤ 60 s and ≤ 4 GB on 2 cores.
"""

from __future__ import annotations

import argparse
import resource
import time
import tracemalloc

import numpy as np

from neox_hf.data.neox_order import build_doc_idx, build_sample_idx, build_shuffle_idx
from neox_hf.data.packing import gpt_neox_num_epochs


def python_loop_samples(sizes, doc_idx, seq_length: int, count: int) -> float:
    """Seconds GPT-NeoX's per-sample loop takes for `count` samples, in Python."""
    start = time.perf_counter()
    d, offset = 0, 0
    for _ in range(count):
        remaining = seq_length + 1
        while remaining != 0:
            length = int(sizes[doc_idx[d]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                d, offset = d + 1, 0
    return time.perf_counter() - start


def measure(label: str, fn, rows: list):
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    result = fn()
    rows.append((label, time.perf_counter() - start, (tracemalloc.get_traced_memory()[1] - before) / 2**30))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=50_000_000)
    parser.add_argument("--mean-tokens", type=int, default=200)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--epochs", type=float, default=1.0, help="samples to build, in epochs of the corpus")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 2 * args.mean_tokens, size=args.documents, dtype=np.int32)  # sizes only: no tokens
    tokens = int(sizes.sum(dtype=np.int64))
    num_samples = int((tokens * args.epochs - 1) // args.seq_length)
    epochs = gpt_neox_num_epochs(tokens, args.seq_length, num_samples)
    documents = np.arange(args.documents, dtype=np.int32)

    tracemalloc.start()
    rows: list = []
    np_rng = np.random.RandomState(seed=1234)
    doc_idx = measure("doc index (shuffle of all epochs)", lambda: build_doc_idx(documents, epochs, np_rng), rows)
    sample_idx = measure("sample index (searchsorted)", lambda: build_sample_idx(
        sizes, doc_idx, args.seq_length, epochs, tokens), rows)
    measure("shuffle index", lambda: build_shuffle_idx(len(sample_idx) - 1, np_rng), rows)
    tracemalloc.stop()
    probe = min(200_000, len(sample_idx) - 1)
    loop_seconds = python_loop_samples(sizes, doc_idx, args.seq_length, probe) * (len(sample_idx) - 1) / probe

    print(f"corpus: {args.documents:,} documents, {tokens / 1e9:.2f}B tokens; seq_length {args.seq_length}; "
          f"{epochs} epoch(s), {len(sample_idx) - 1:,} samples")
    print(f"{'stage':<40}{'seconds':>10}{'peak GiB':>10}")
    for label, seconds, peak in rows:
        print(f"{label:<40}{seconds:>10.1f}{peak:>10.2f}")
    print(f"{'total (ours)':<40}{sum(r[1] for r in rows):>10.1f}"
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:>10.2f}  (process peak RSS, inputs included)")
    print(f"{'baseline: per-sample Python loop':<40}{loop_seconds:>10.0f}{'':>10}  (extrapolated from {probe:,} samples)")


if __name__ == "__main__":
    main()
