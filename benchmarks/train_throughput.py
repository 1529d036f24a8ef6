"""Training-step throughput on the Pythia-70M shape at 8 × 512 tokens, against the machine's matmul peak.

    python benchmarks/train_throughput.py [--steps 2] [--warmup 1] [--threads N] [--precision fp32|bf16]

Measured in one run: the fp32 and bf16 matmul peak (square GEMMs), stock transformers GPTNeoXForCausalLM trained by a
plain PyTorch loop (AdamW, HF's own loss; bf16 autocast with --precision bf16), and our training step
(`neox_hf.train.loop.causal_lm_loss` under an Accelerator built from a recipe with the same precision). Prints
tokens/s, achieved FLOP/s and MFU against the matmul peak of the precision trained, and our ratio to stock.
Default fp32: on CPUs without native bf16 (AVX2 only, like this project's machines) bf16 GEMMs are emulated and a
bf16 step of this model takes many minutes; pass --precision bf16 where the CPU has AMX / AVX-512 BF16. Model FLOPs per token follow the PaLM
appendix: 6·N (N = parameters that take part in matmuls: everything except the input embedding) + 12·L·H·T.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

BATCH, SEQ = 8, 512
PYTHIA_70M = dict(num_hidden_layers=6, hidden_size=512, num_attention_heads=8, intermediate_size=2048, vocab_size=50304,
                  max_position_embeddings=2048, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False)


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.matmul(a, b)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.matmul(a, b)
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def model_flops_per_token(config: GPTNeoXConfig, model) -> float:
    matmul_params = sum(p.numel() for n, p in model.named_parameters() if "embed_in" not in n and p.ndim == 2)
    return 6 * matmul_params + 12 * config.num_hidden_layers * config.hidden_size * SEQ


def batches(vocab: int):
    generator = torch.Generator().manual_seed(0)
    while True:
        ids = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=generator)
        yield ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def time_steps(step, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def stock_step_time(config, warmup, steps, precision: str) -> tuple[float, object]:
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = batches(config.vocab_size)

    def step():
        ids, _ = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return time_steps(step, warmup, steps), model


def ours_step_time(config, warmup, steps, precision: str) -> float:
    from neox_hf.model import NeoXConfig, NeoXForCausalLM
    from neox_hf.parallel.accelerator import build_accelerator
    from neox_hf.recipe import recipe_from_dict
    from neox_hf.train.loop import build_optimizer, causal_lm_loss

    recipe = recipe_from_dict({"train": {"precision": precision, "micro_batch_size": BATCH}, "output": {"tensorboard": False}})
    accelerator = build_accelerator(recipe)
    torch.manual_seed(0)
    model = NeoXForCausalLM(NeoXConfig(**config.to_dict())).train()
    model, optimizer = accelerator.prepare(model, build_optimizer(model, recipe))
    data = batches(config.vocab_size)

    def step():
        ids, labels = next(data)
        with accelerator.accumulate(model):
            loss, _ = causal_lm_loss(model, {"input_ids": ids, "labels": labels})
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return time_steps(step, warmup, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = GPTNeoXConfig(**PYTHIA_70M)
    peak32 = matmul_peak(torch.float32)
    peak16 = matmul_peak(torch.bfloat16, n=2048 if args.precision == "bf16" else 256, repeats=5 if args.precision == "bf16" else 2)
    peak = peak16 if args.precision == "bf16" else peak32
    stock_time, stock_model = stock_step_time(config, args.warmup, args.steps, args.precision)
    ours_time = ours_step_time(config, args.warmup, args.steps, args.precision)
    flops_token = model_flops_per_token(config, stock_model)
    tokens = BATCH * SEQ
    print(f"Pythia-70M shape, {BATCH}×{SEQ} tokens/step, {args.threads} threads, {args.steps} timed steps, {args.precision}; "
          f"model FLOPs/token {flops_token / 1e6:.1f}M")
    print(f"| {'what':46} | {'tokens/s':>9} | {'GFLOP/s':>8} | {'MFU vs ' + args.precision + ' peak':>17} |")
    print(f"|{'-' * 48}|{'-' * 11}|{'-' * 10}|{'-' * 19}|")
    print(f"| {'matmul peak fp32 (2048² GEMM)':46} | {'':9} | {peak32 / 1e9:8.1f} | {'':17} |")
    print(f"| {'matmul peak bf16 (square GEMM)':46} | {'':9} | {peak16 / 1e9:8.1f} | {'':17} |")
    for name, seconds in ((f"stock transformers + PyTorch loop", stock_time), ("neox_hf training step", ours_time)):
        flops = flops_token * tokens / seconds
        print(f"| {name:46} | {tokens / seconds:9.0f} | {flops / 1e9:8.1f} | {100 * flops / peak:16.1f}% |")
    print(f"ratio neox_hf / stock tokens/s: {stock_time / ours_time:.2f}×")


if __name__ == "__main__":
    main()
