"""Which precision and whether torch.compile: a Pythia-14M-shaped forward + backward with the fused loss, on this CPU.

    python benchmarks/precision.py [--repeats 3] [--batch 16] [--seq 192] [--no-compile]

Variants, each timed round-robin (machine load hits them alike), best of --repeats after a warm-up:
- fp32;
- bf16 autocast (fp32 weights; matmuls in bf16, what `train.precision: bf16` without DeepSpeed runs);
- bf16 weights (the model cast to bf16, as DeepSpeed's bf16 mode runs forward/backward; its fp32 master copy
  and the optimizer step are not in the time);
- torch.compile of the decoder (fp32 and bf16 autocast; the fused loss stays eager): compile time of the first
  call, then step time.
The loss column: max |difference| over the steps from fp32 eager (eager rows) or from eager of the same precision
(compiled rows).
Random GPTNeoX init, random tokens of `--batch × --seq` (3,072 tokens: a GSM8K micro batch of 16). A run takes
about 3 minutes on 2 idle cores, most of it compiling.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_common import cpu_name  # noqa: E402
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM  # noqa: E402

from neox_hf.ops import lm_head_loss  # noqa: E402

PYTHIA_14M = dict(vocab_size=50304, hidden_size=128, num_hidden_layers=6, num_attention_heads=4, intermediate_size=512,
                  max_position_embeddings=2048, rotary_pct=0.25, tie_word_embeddings=False, attn_implementation="sdpa")


def step_fn(model, decoder, ids, labels, autocast: bool):
    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state
            loss, count = lm_head_loss(model.get_output_embeddings(), hidden, labels)
        (loss / count).backward()
        model.zero_grad(set_to_none=True)
        return float(loss.detach() / count)
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=192)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    fp32 = GPTNeoXForCausalLM(GPTNeoXConfig(**PYTHIA_14M)).train()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    ids = torch.randint(0, 50304, (args.batch, args.seq + 1))
    ids, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    variants = {
        "fp32": step_fn(fp32, fp32.gpt_neox, ids, labels, False),
        "bf16 autocast (fp32 weights)": step_fn(fp32, fp32.gpt_neox, ids, labels, True),
        "bf16 weights": step_fn(bf16, bf16.gpt_neox, ids, labels, False),
    }
    compile_seconds = {}
    if not args.no_compile:
        compiled = torch.compile(fp32.gpt_neox)
        for name, autocast in (("torch.compile, fp32", False), ("torch.compile, bf16 autocast", True)):
            step = step_fn(fp32, compiled, ids, labels, autocast)
            start = time.perf_counter()
            step()
            compile_seconds[name] = time.perf_counter() - start
            variants[name] = step
    best, losses = dict.fromkeys(variants, float("inf")), {name: [] for name in variants}
    for _ in range(args.repeats + 1):  # the first round is the warm-up
        for name, step in variants.items():
            start = time.perf_counter()
            losses[name].append(step())
            best[name] = min(best[name], time.perf_counter() - start)
    tokens = ids.numel()
    print(f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads; Pythia-14M shape, "
          f"{args.batch}×{args.seq} tokens, forward + backward with the fused loss, best of {args.repeats}")
    print("| variant | seconds | tokens/s | vs fp32 | loss vs eager reference | first call (compile) s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in variants:
        reference = losses["bf16 autocast (fp32 weights)" if "autocast" in name else "fp32"]
        diff = max(abs(a - b) for a, b in zip(losses[name], reference if "compile" in name else losses["fp32"]))
        first = f"{compile_seconds[name]:.1f}" if name in compile_seconds else ""
        print(f"| {name} | {best[name]:.3f} | {tokens / best[name]:.0f} | {best['fp32'] / best[name]:.2f}× | "
              f"{diff:.2e} | {first} |")


if __name__ == "__main__":
    main()
