"""Training throughput and peak memory of a tiny Mixtral (8 experts, top-2): neox_hf against stock transformers.

    python benchmarks/moe.py [--steps 3] [--warmup 1] [--batch 4] [--seq 128] [--device cpu|cuda]

One table, one run. The baseline is stock `MixtralForCausalLM` trained by a plain PyTorch loop (AdamW, HF's loss with
the router loss, random tokens), with each of transformers' experts kernels (`eager`: a loop over the experts;
`batched_mm`: per-token gathered weights; `grouped_mm`: torch's grouped GEMM) and the fastest of them as the
baseline every ratio is taken against (`batched_mm` only with `--rows`: its per-token weight copies take ~7.7 GB
at the default shape). Then neox_hf's `train(recipe)` of the same shape (family mixtral: the same
stock model class, packed Tiny Shakespeare windows, the recipe's defaults: fused head loss, router loss per
micro-batch), and a dense model with the same active parameters (family llama, SwiGLU of width top-k × the
expert width: the FLOPs of a token through its two experts, minus the router) under neox_hf.

Each row runs in its own process, so that the peak memory is that row's: on a GPU the CUDA allocator's peak
(`torch.cuda.max_memory_allocated`), on a CPU the process's resident high-water mark (VmHWM, which includes the
interpreter and libraries: compare rows with each other). Both loops are timed by the same optimizer-step hook
(`bench_common.StepClock`), warm-up steps left out; tokens/s counts the batch × seq tokens of each step.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.bench_common import (  # noqa: E402
    StepClock,
    device_name,
    peak_memory,
    reset_accelerate_state,
    reset_peak_memory,
    status_mb,
)

TOKENIZER = REPO / "examples" / "data" / "gpt-neox-20b-tokenizer.json"
TEXT = REPO / "examples" / "data" / "tinyshakespeare.txt"
SHAPE = dict(layers=4, hidden=256, heads=8, kv_heads=4, experts=8, top_k=2, expert_width=512, vocab=50304)
KERNELS = ("eager", "batched_mm", "grouped_mm")


def stock_row(kernel: str, args) -> dict:
    """Stock MixtralForCausalLM with `kernel`, a plain PyTorch loop, random tokens."""
    from transformers import MixtralConfig, MixtralForCausalLM

    s, device = SHAPE, torch.device(args.device)
    config = MixtralConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                           num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                           intermediate_size=s["expert_width"], num_local_experts=s["experts"],
                           num_experts_per_tok=s["top_k"], output_router_logits=True, router_aux_loss_coef=0.02,
                           max_position_embeddings=2048)
    config._experts_implementation = kernel
    torch.manual_seed(0)
    reset_peak_memory(device)
    model = MixtralForCausalLM(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    with StepClock() as clock:
        for _ in range(args.warmup + args.steps):
            ids = torch.randint(0, s["vocab"], (args.batch, args.seq), generator=generator).to(device)
            model(input_ids=ids, labels=ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return _result(clock, args, device)


def neox_row(family: str, args) -> dict:
    """neox_hf's `train(recipe)`: the Mixtral family, or the dense Llama of the same active parameters."""
    from neox_hf.recipe import recipe_from_dict
    from neox_hf.train.loop import train

    s, device = SHAPE, torch.device(args.device)
    model = {"family": family, "num_layers": s["layers"], "hidden_size": s["hidden"],
             "num_attention_heads": s["heads"], "num_kv_heads": s["kv_heads"], "seq_length": args.seq,
             "max_position_embeddings": 2048}
    if family == "mixtral":
        model.update(intermediate_size=s["expert_width"], moe_num_experts=s["experts"], moe_top_k=s["top_k"])
    else:
        model.update(intermediate_size=s["top_k"] * s["expert_width"])
    with tempfile.TemporaryDirectory() as tmp:
        recipe = recipe_from_dict({
            "model": model, "tokenizer": {"path": str(TOKENIZER)},
            "data": {"sources": [{"path": str(TEXT), "format": "text"}], "mode": "pack"},
            "train": {"train_iters": args.warmup + args.steps, "micro_batch_size": args.batch, "precision": "fp32",
                      "lr": 1e-4, "eval_iters": 0},
            "output": {"dir": tmp, "tensorboard": False},
        })
        reset_peak_memory(device)
        with StepClock() as clock, contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            train(recipe)
        result = _result(clock, args, device)
        reset_accelerate_state()
    return result


def _result(clock, args, device) -> dict:
    seconds = clock.seconds(args.warmup, args.steps) / args.steps
    peak = peak_memory(device)
    return {"tokens_per_s": args.batch * args.seq / seconds,
            "peak_mb": peak / 2**20 if peak is not None else status_mb("VmHWM")}


ROWS = {**{f"stock-{k}": (stock_row, k) for k in KERNELS}, "neox-mixtral": (neox_row, "mixtral"),
        "neox-dense": (neox_row, "llama")}
TITLES = {"stock-eager": "stock Mixtral, experts eager", "stock-batched_mm": "stock Mixtral, experts batched_mm",
          "stock-grouped_mm": "stock Mixtral, experts grouped_mm", "neox-mixtral": "neox_hf Mixtral (recipe)",
          "neox-dense": "neox_hf dense Llama, same active params"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    # batched_mm gathers each token's expert weights: at this shape ~7.7 GB and 0.07× grouped_mm on a 2-core CPU
    # (a run of all five rows): left out of the default rows, ask for it with --rows
    parser.add_argument("--rows", default=",".join(r for r in ROWS if r != "stock-batched_mm"),
                        help="comma-separated, from: " + ", ".join(ROWS))
    parser.add_argument("--row", help=argparse.SUPPRESS)  # one row, in a child process: prints its JSON
    return parser.parse_args(argv)


def run_child(row: str, args) -> dict:
    command = [sys.executable, __file__, "--row", row, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--batch", str(args.batch), "--seq", str(args.seq), "--device", args.device]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"row {row} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.row:
        function, what = ROWS[args.row]
        print(json.dumps(function(what, args)))
        return 0
    rows = args.rows.split(",")
    results = {row: run_child(row, args) for row in rows}
    stock = [r for r in rows if r.startswith("stock-")]
    baseline = max(stock, key=lambda r: results[r]["tokens_per_s"]) if stock else rows[0]
    s = SHAPE
    print(f"MoE training throughput on {device_name(args.device)}, fp32: {s['layers']} layers, hidden {s['hidden']}, "
          f"{s['experts']} experts × width {s['expert_width']}, top-{s['top_k']}, vocab {s['vocab']}, "
          f"batch {args.batch} × seq {args.seq}; {args.warmup} warm-up + {args.steps} timed steps; "
          f"baseline: {TITLES[baseline]} (the fastest stock kernel)")
    print(f"| {'row':<42} | {'tokens/s':>9} | {'vs baseline':>11} | {'peak memory MB':>14} |")
    print(f"|{'-' * 44}|{'-' * 10}:|{'-' * 12}:|{'-' * 15}:|")
    for row in rows:
        r = results[row]
        ratio = r["tokens_per_s"] / results[baseline]["tokens_per_s"]
        print(f"| {TITLES[row]:<42} | {r['tokens_per_s']:>9.0f} | {ratio:>10.2f}× | {r['peak_mb']:>14.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
