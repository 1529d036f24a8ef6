"""Training-step throughput on the Pythia-70M shape at 8 × 512 tokens, against the machine's measured GEMM peak.

    python benchmarks/train_throughput.py [--steps 3] [--warmup 2] [--threads N] [--precision fp32,bf16]

For each precision, in one run: the GEMM peak (square GEMMs of 1024-3072, each warmed up, best of 5, the fastest
size kept), stock transformers `GPTNeoXForCausalLM` trained by a plain PyTorch loop (AdamW, HF's own loss; bf16
autocast for bf16), and our `neox_hf.train.loop.train(recipe)` (packed Tiny Shakespeare, 8 × 512, the same model
shape and precision, so whatever the loop does by default — fused loss, compile — is measured). Both loops are timed
by the same global optimizer-step hook, warm-up steps left out. Prints tokens/s, achieved FLOP/s, MFU against the
peak of the precision trained, and our ratio to stock. An MFU above 100% means the peak was under-measured (the
machine's load changed during the run): the run then fails (exit status 1) instead of printing it as a result.
Model FLOPs per token follow the PaLM appendix: 6·N (N = parameters that take part in matmuls: everything except the
input embedding) + 12·L·H·T. On a CPU without AVX512-BF16 / AMX bf16 matmuls are emulated: pass --precision fp32.
A default run takes about 3 minutes on 2 idle cores (each step ~3-6 s).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_common import StepClock, cpu_name, gemm_peak  # noqa: E402
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM  # noqa: E402

BATCH, SEQ = 8, 512
SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
TEXT = SHARED / "corpora" / "tinyshakespeare" / "input.txt"
PYTHIA_70M = dict(num_hidden_layers=6, hidden_size=512, num_attention_heads=8, intermediate_size=2048, vocab_size=50304,
                  max_position_embeddings=2048, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def model_flops_per_token(config: GPTNeoXConfig, model) -> float:
    matmul_params = sum(p.numel() for n, p in model.named_parameters() if "embed_in" not in n and p.ndim == 2)
    return 6 * matmul_params + 12 * config.num_hidden_layers * config.hidden_size * SEQ


def stock_seconds(config, warmup: int, steps: int, precision: str) -> tuple[float, object]:
    """Seconds per step of stock GPTNeoXForCausalLM in a plain PyTorch loop (random tokens, HF's loss)."""
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    with StepClock() as clock:
        for _ in range(warmup + steps):
            ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=generator)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return clock.seconds(warmup, steps) / steps, model


def ours_seconds(warmup: int, steps: int, precision: str) -> float:
    """Seconds per step of `train(recipe)`: the same shape, packed Tiny Shakespeare windows of SEQ + 1 tokens."""
    from neox_hf.recipe import recipe_from_dict
    from neox_hf.train.loop import train

    c = PYTHIA_70M
    with tempfile.TemporaryDirectory() as tmp:
        recipe = recipe_from_dict({
            "model": {"num_layers": c["num_hidden_layers"], "hidden_size": c["hidden_size"],
                      "num_attention_heads": c["num_attention_heads"], "intermediate_size": c["intermediate_size"],
                      "vocab_size": c["vocab_size"], "seq_length": SEQ, "max_position_embeddings": 2048},
            "tokenizer": {"path": str(SHARED / "tokenizers" / "gpt-neox-20b.json")},
            "data": {"sources": [{"path": str(TEXT), "format": "text"}], "mode": "pack"},
            "train": {"train_iters": warmup + steps, "micro_batch_size": BATCH, "precision": precision,
                      "lr": 1e-4, "log_interval": 1, "eval_iters": 0},
            "output": {"dir": tmp, "tensorboard": False},
        })
        with StepClock() as clock, contextlib.redirect_stdout(io.StringIO()):
            train(recipe)
        _reset_accelerate_state()  # the next precision builds a new Accelerator in this process
        log = [json.loads(line) for line in (Path(tmp) / "train_log.jsonl").read_text().splitlines()]
    if len(log) != warmup + steps:
        raise RuntimeError(f"train(recipe) logged {len(log)} steps, {warmup + steps} expected")
    return clock.seconds(warmup, steps) / steps


def _reset_accelerate_state() -> None:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out (at least 1: the first holds set-up)")
    parser.add_argument("--precision", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    args.warmup = max(args.warmup, 1)
    config = GPTNeoXConfig(**PYTHIA_70M)
    tokens = BATCH * SEQ
    print(f"{cpu_name()}, torch {torch.__version__}, {args.threads} threads")
    print(f"Pythia-70M shape, {BATCH}×{SEQ} tokens/step, {args.steps} timed steps after {args.warmup} warm-up")
    print(f"| {'precision':9} | {'what':38} | {'tokens/s':>9} | {'GFLOP/s':>8} | {'MFU':>6} |")
    print(f"|{'-' * 11}|{'-' * 40}|{'-' * 11}|{'-' * 10}|{'-' * 8}|")
    failed = []
    for precision in args.precision.split(","):
        torch.set_num_threads(args.threads)
        peak, n = gemm_peak(DTYPES[precision])
        stock_time, stock_model = stock_seconds(config, args.warmup, args.steps, precision)
        torch.set_num_threads(args.threads)
        ours_time = ours_seconds(args.warmup, args.steps, precision)
        flops_token = model_flops_per_token(config, stock_model)
        print(f"| {precision:9} | {f'GEMM peak ({n}² square, best of 5)':38} | {'':9} | {peak / 1e9:8.1f} | {'':6} |")
        for name, seconds in (("stock transformers + PyTorch loop", stock_time), ("neox_hf train(recipe)", ours_time)):
            flops = flops_token * tokens / seconds
            print(f"| {precision:9} | {name:38} | {tokens / seconds:9.0f} | {flops / 1e9:8.1f} | "
                  f"{100 * flops / peak:5.1f}% |")
            if flops > peak:
                failed.append(f"{precision} {name}: MFU {100 * flops / peak:.0f}%")
        print(f"| {precision:9} | {'ratio neox_hf / stock tokens/s':38} | {stock_time / ours_time:8.2f}× | | |")
    if failed:
        print("FAILED: MFU above 100% (" + "; ".join(failed) + "): the GEMM peak was under-measured, most likely "
              "because the machine's load changed during the run; rerun on an idle machine", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
