"""Training-step throughput of Pythia shapes against the device's peak: stock transformers vs neox_hf, MFU.

    python benchmarks/train_throughput.py [--steps 3] [--warmup 2] [--threads N] [--precision fp32,bf16]
    python benchmarks/train_throughput.py --shape 410m,1b --precision bf16 --batch 8 --seq 2048 \\
        --fused both --steps 10 --warmup 3          # the GPU run issue 17 asks for (MFU ≥ 50% of dense bf16)
    bash benchmarks/gpu_check.sh                    # 160m and 410m, bf16, fused and unfused, after the cuda tests

`--device` defaults to cuda where torch sees a GPU (the first one, as Accelerate picks it), else cpu.

For each shape and precision, in one run: the GEMM peak (square GEMMs — 1024-3072 on CPU, 4096-8192 on a GPU —
each warmed up, best of 5, the fastest size kept), stock transformers `GPTNeoXForCausalLM` trained by a plain
PyTorch loop (AdamW, HF's own loss; bf16 autocast for bf16), and our `neox_hf.train.loop.train(recipe)` (packed
Tiny Shakespeare windows, the same model shape, batch and precision, so whatever the loop does by default is
measured, the default log interval included: logging every step, as this benchmark did until the H200 run of
issue 25, adds a host sync and a log write per step; `--fused both` adds a row with `train.fused_cross_entropy: false`). Both loops are timed by the same
global optimizer-step hook (on a GPU it synchronises first), warm-up steps left out. Prints tokens/s, achieved
FLOP/s, MFU against the measured peak and, on GPUs whose datasheet peak is known, against that dense peak too (the
part named by torch.cuda.get_device_name() and matched in neox_hf.train.mfu's table, which the training loop's MFU
uses too: SXM and NVL/PCIe parts differ, e.g. H200 989 vs H200 NVL 835 TFLOP/s; an unknown part is named and only the
measured GEMM rate is used), on a GPU the peak memory of each loop (torch.cuda.max_memory_allocated), and our ratio to
stock. An MFU above 100% of the measured peak means the peak was under-measured (the machine's load changed during
the run): the run then fails (exit status 1) instead of printing it as a result. Model FLOPs per token follow the
PaLM appendix: 6·N (N = parameters that take part in matmuls: everything except the input embedding) + 12·L·H·T.
Text and tokenizer are the bundled ones (examples/data), so a fresh clone runs it. On a CPU without AVX512-BF16 /
AMX bf16 matmuls are emulated: pass --precision fp32.
A default run (Pythia-70M, 8 × 512, CPU) takes about 4 minutes on 2 idle cores (each step ~3-6 s).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_common import (StepClock, device_name, gemm_peak, peak_memory, reset_accelerate_state,  # noqa: E402
                          reset_peak_memory)
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"  # in every clone (../shared/data is not)
TEXT = DATA / "tinyshakespeare.txt"
TOKENIZER = DATA / "gpt-neox-20b-tokenizer.json"
# Pythia's GPT-NeoX configs (pythia/*.yml): layers, hidden size, attention heads; 4·hidden MLP, untied head.
PYTHIA_SHAPES = {"14m": (6, 128, 4), "70m": (6, 512, 8), "160m": (12, 768, 12), "410m": (24, 1024, 16),
                 "1b": (16, 2048, 8), "1.4b": (24, 2048, 16)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def pythia_config(shape: str) -> GPTNeoXConfig:
    layers, hidden, heads = PYTHIA_SHAPES[shape]
    return GPTNeoXConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                         intermediate_size=4 * hidden, vocab_size=50304, max_position_embeddings=2048, rotary_pct=0.25,
                         use_parallel_residual=True, tie_word_embeddings=False)


def model_flops_per_token(config: GPTNeoXConfig, model, seq: int) -> float:
    matmul_params = sum(p.numel() for n, p in model.named_parameters() if "embed_in" not in n and p.ndim == 2)
    return 6 * matmul_params + 12 * config.num_hidden_layers * config.hidden_size * seq


def stock_seconds(config, shape: tuple[int, int], warmup: int, steps: int, precision: str, device: torch.device
                  ) -> tuple[float, object, int | None]:
    """(seconds per step, the model, peak GPU bytes or None) of stock GPTNeoXForCausalLM in a plain PyTorch loop
    (random tokens, HF's loss)."""
    reset_peak_memory(device)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    with StepClock() as clock:
        for _ in range(warmup + steps):
            ids = torch.randint(0, config.vocab_size, shape, generator=generator).to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    peak = peak_memory(device)
    return clock.seconds(warmup, steps) / steps, model.cpu(), peak


def ours_seconds(config, shape: tuple[int, int], warmup: int, steps: int, precision: str, fused: bool,
                 device: torch.device, workers="auto") -> tuple[float, int | None]:
    """(seconds per step, peak GPU bytes or None) of `train(recipe)`: the same model shape, packed Tiny Shakespeare
    windows of seq + 1 tokens."""
    from neox_hf.recipe import recipe_from_dict
    from neox_hf.train.loop import train

    batch, seq = shape
    with tempfile.TemporaryDirectory() as tmp:
        recipe = recipe_from_dict({
            "model": {"num_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
                      "num_attention_heads": config.num_attention_heads, "intermediate_size": config.intermediate_size,
                      "vocab_size": config.vocab_size, "seq_length": seq, "max_position_embeddings": 2048},
            "tokenizer": {"path": str(TOKENIZER)},
            "data": {"sources": [{"path": str(TEXT), "format": "text"}], "mode": "pack", "num_workers": workers},
            "train": {"train_iters": warmup + steps, "micro_batch_size": batch, "precision": precision,
                      "lr": 1e-4, "eval_iters": 0, "fused_cross_entropy": fused},
            "output": {"dir": tmp, "tensorboard": False},
        })
        reset_peak_memory(device)
        with StepClock() as clock, contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            train(recipe)  # its report and progress bars would break up the table (an exception still propagates)
        peak = peak_memory(device)
        reset_accelerate_state()  # the next precision builds a new Accelerator in this process
        log = [json.loads(line) for line in (Path(tmp) / "train_log.jsonl").read_text().splitlines()]
    if len(log) != warmup + steps:
        raise RuntimeError(f"train(recipe) logged {len(log)} steps, {warmup + steps} expected")
    return clock.seconds(warmup, steps) / steps, peak


def datasheet_peak(device: torch.device, precision: str) -> float | None:
    """The dense tensor-core peak of this GPU's datasheet (neox_hf.train.mfu's table, as the training loop's MFU);
    None on CPU, in fp32, and for a GPU the table does not name."""
    from neox_hf.hardware import datasheet_peak as named_part_peak

    if device.type != "cuda":
        return None
    return named_part_peak(torch.cuda.get_device_name(device), precision)


def table_row(shape: str, precision: str, what: str, tflops: float | None = None, tok_s: str = "", mfu: str = "",
              sheet_mfu: str = "", peak_bytes: int | None = None, *, gpu: bool = False) -> None:
    flops = f"{tflops:8.3f}" if tflops is not None else ""
    memory = f" {peak_bytes / 2**30:>8.2f} |" if peak_bytes is not None else f" {'':>8} |"
    print(f"| {shape:5} | {precision:9} | {what:40} | {tok_s:>9} | {flops:>8} | {mfu:>6} | {sheet_mfu:>13} |"
          + (memory if gpu else ""))  # peak memory: a GPU column (CPU has no allocator statistics)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out (at least 1: the first holds set-up)")
    parser.add_argument("--precision", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--shape", default="70m", help=f"comma-separated Pythia shapes: {', '.join(PYTHIA_SHAPES)}")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda: the first visible GPU, as Accelerate picks it for our loop")
    parser.add_argument("--fused", choices=["on", "both"], default="on",
                        help="both: also our loop with train.fused_cross_entropy false")
    parser.add_argument("--workers", choices=["auto", "both"], default="auto",
                        help="both: also our loop (fused loss) reading its data where `data.num_workers: auto` does "
                             "not: in the training process's thread on a GPU, in a worker process on a CPU")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    args.warmup = max(args.warmup, 1)
    unknown = [s for s in args.shape.split(",") if s not in PYTHIA_SHAPES]
    if unknown or any(p not in DTYPES for p in args.precision.split(",")):
        parser.error(f"unknown --shape {unknown} or --precision {args.precision}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here")
    if args.device == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "true"  # our loop's Accelerator would otherwise take a visible GPU
    return args


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    shape, tokens = (args.batch, args.seq), args.batch * args.seq
    on_gpu = device.type == "cuda"
    print(f"{device_name(device)}, torch {torch.__version__}, {args.threads} CPU threads")
    print(f"{args.batch}×{args.seq} tokens/step, {args.steps} timed steps after {args.warmup} warm-up")
    if on_gpu and "bf16" in args.precision.split(",") and datasheet_peak(device, "bf16") is None:
        print(f"{device_name(device)} is a part neox_hf.train.mfu's datasheet table does not name: MFU is against the "
              "GEMM rate measured here only")
    print(f"| {'shape':5} | {'precision':9} | {'what':40} | {'tokens/s':>9} | {'TFLOP/s':>8} | {'MFU':>6} | "
          f"{'datasheet MFU':>13} |" + (f" {'peak GiB':>8} |" if on_gpu else ""))
    print(f"|{'-' * 7}|{'-' * 11}|{'-' * 42}|{'-' * 11}|{'-' * 10}|{'-' * 8}|{'-' * 15}|"
          + ("-" * 10 + "|" if on_gpu else ""))
    failed = []
    for name in args.shape.split(","):
        config = pythia_config(name)
        for precision in args.precision.split(","):
            torch.set_num_threads(args.threads)
            peak, n = gemm_peak(DTYPES[precision], device=device)
            sheet = datasheet_peak(device, precision)
            row = functools.partial(table_row, name, precision, gpu=on_gpu)
            no_sheet = "unknown part" if on_gpu and precision == "bf16" else ""
            row(f"GEMM peak ({n}² square, best of 5)", peak / 1e12,
                sheet_mfu=f"{sheet / 1e12:.0f} datasheet" if sheet else no_sheet)
            stock_time, stock_model, stock_memory = stock_seconds(config, shape, args.warmup, args.steps, precision,
                                                                  device)
            flops_token = model_flops_per_token(config, stock_model, args.seq)
            del stock_model
            timed = [("stock transformers + PyTorch loop", stock_time, stock_memory)]
            for fused in ([True, False] if args.fused == "both" else [True]):
                torch.set_num_threads(args.threads)
                seconds, memory = ours_seconds(config, shape, args.warmup, args.steps, precision, fused, device)
                timed.append((f"neox_hf train(recipe){'' if fused else ', unfused loss'}", seconds, memory))
            if args.workers == "both":  # the data read where `auto` does not read it on this device
                other = 0 if on_gpu else 1
                torch.set_num_threads(args.threads)
                seconds, memory = ours_seconds(config, shape, args.warmup, args.steps, precision, True, device, other)
                timed.append((f"neox_hf, data in {'its thread' if other == 0 else 'a worker process'}", seconds, memory))
            for what, seconds, memory in timed:
                flops = flops_token * tokens / seconds
                row(what, flops / 1e12, f"{tokens / seconds:.0f}", f"{100 * flops / peak:5.1f}%",
                    f"{100 * flops / sheet:5.1f}%" if sheet else "", memory)
                if flops > peak:
                    failed.append(f"{name} {precision} {what}: MFU {100 * flops / peak:.0f}%")
            row("ratio neox_hf / stock tokens/s", tok_s=f"{stock_time / timed[1][1]:.2f}×")
    if failed:
        print("FAILED: MFU above 100% (" + "; ".join(failed) + "): the GEMM peak was under-measured, most likely "
              "because the machine's load changed during the run; rerun on an idle machine", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
