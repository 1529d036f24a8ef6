"""How fast the training thread launches torch ops while the data is read ahead: no data, the loader in a thread of
the training process (`data.num_workers: 0`), the loader in a worker process (`data.num_workers: 1`).

    python benchmarks/data_worker.py [--seconds 8] [--batch 8] [--seq 2048] [--ops-per-batch 2000,8000]

Why: on a GPU the step's time is the GPU's only while the host launches kernels at least as fast as the GPU runs
them (a Pythia-160M step of 8 × 2048 tokens is ~2,000 kernels in ~66 ms on an H200: ~30,000 launches/s). Every torch
op gives the GIL up and must win it back; a loader thread doing Python work (datasets' rows, packing, collating)
holds the GIL meanwhile, and the launching thread waits. This measures that on any machine, with no GPU: the training
thread runs small in-place torch ops (each one an op dispatch, as a kernel launch is) and takes one batch every
`--ops-per-batch` ops from the prefetcher the training loop uses (`neox_hf.train.prefetch.Prefetcher`), over the
data of `benchmarks/train_throughput.py` (packed Tiny Shakespeare windows, the bundled GPT-NeoX-20B tokenizer). The
baseline, measured in the same run, is the same ops with no loader at all.

On a machine with few cores the worker process still costs the launching thread something: it takes a core (and
the tokenizer's threads more). Measured on 2 AVX2 cores: with the loader in a thread 0.42-0.60 of the launch rate with
no data, in a worker 0.68-0.89.

Columns: ops/s counts only the time spent launching (waiting for a batch is left out and shown apart), so it is the
launch rate the data work leaves the training thread. The loader's own rate (tokens/s with nothing else running) is
printed first: where a step needs batches faster than that, the run is data-bound whichever way it is read.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_common import cpu_name  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"


def loader(batch: int, seq: int):
    from neox_hf.data.loader import build_train_loader
    from neox_hf.data.tokenizer import load_tokenizer
    from neox_hf.recipe import recipe_from_dict

    with tempfile.TemporaryDirectory() as tmp:
        recipe = recipe_from_dict({
            "model": {"num_layers": 1, "hidden_size": 64, "num_attention_heads": 4, "seq_length": seq,
                      "max_position_embeddings": seq},
            "tokenizer": {"path": str(DATA / "gpt-neox-20b-tokenizer.json")},
            "data": {"sources": [{"path": str(DATA / "tinyshakespeare.txt"), "format": "text"}], "mode": "pack"},
            "train": {"train_iters": 1, "micro_batch_size": batch}, "output": {"dir": tmp}})
    tokenizer = load_tokenizer(recipe.tokenizer.path)
    return build_train_loader(recipe.data, tokenizer, seq_length=seq, micro_batch_size=batch, seed=0)


def loader_tokens_per_second(batch: int, seq: int, seconds: float) -> float:
    batches = loader(batch, seq)
    next(batches)  # opening the stream is start-up, not the rate
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        next(batches)
        count += 1
    return count * batch * seq / (time.perf_counter() - start)


def launch_rate(seconds: float, ops_per_batch: int, batches=None) -> tuple[float, float, int]:
    """(ops/s while launching, seconds waited for batches, batches taken) of this thread launching small torch
    ops, one batch taken every `ops_per_batch` ops when `batches` is given."""
    x = torch.zeros(16)
    launching, rounds, start = 0.0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        for _ in range(ops_per_batch):
            x.add_(1.0)
        launching += time.perf_counter() - t0
        rounds += 1
        if batches is not None:
            next(batches)
    waited = batches.take_wait() if batches is not None else 0.0
    return rounds * ops_per_batch / launching, waited, rounds if batches is not None else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0, help="per row")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--ops-per-batch", default="2000,8000", help="comma-separated")
    args = parser.parse_args()
    from neox_hf.train.prefetch import Prefetcher

    torch.set_num_threads(1)  # a launching thread: the ops are tiny, their cost is the dispatch
    print(f"{cpu_name()}, torch {torch.__version__}; {args.batch} × {args.seq} packed Tiny Shakespeare windows")
    rate = loader_tokens_per_second(args.batch, args.seq, args.seconds)
    print(f"loader alone: {rate:,.0f} tokens/s ({rate / (args.batch * args.seq):.1f} batches/s)")
    print("| ops per batch | data read in | ops/s launched | vs no data | waited for data | batches |")
    print("|---:|---|---:|---:|---:|---:|")
    for ops in map(int, args.ops_per_batch.split(",")):
        alone, _, _ = launch_rate(args.seconds, ops)
        print(f"| {ops} | no data (baseline) | {alone:,.0f} | 1.00 | | |")
        for workers, where in ((0, "a thread (num_workers 0)"), (1, "a worker process (num_workers 1)")):
            batches = Prefetcher(loader(args.batch, args.seq), workers=workers)
            try:
                next(batches)  # the first batch opens the stream: start-up, not the steady state
                launched, waited, taken = launch_rate(args.seconds, ops, batches)
            finally:
                batches.close()
            print(f"| {ops} | {where} | {launched:,.0f} | {launched / alone:.2f} | {waited:.1f} s of "
                  f"{args.seconds:.0f} | {taken} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
