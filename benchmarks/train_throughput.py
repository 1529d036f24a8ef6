"""Training-step throughput of Pythia shapes against the device's peak: stock transformers vs neox_hf, MFU.

    python benchmarks/train_throughput.py [--steps 3] [--warmup 2] [--threads N] [--precision fp32,bf16]
    python benchmarks/train_throughput.py --shape 410m,1b --precision bf16 --batch 8 --seq 2048 \\
        --fused both --steps 10 --warmup 3          # the GPU run issue 17 asks for (MFU ≥ 50% of dense bf16)
    bash benchmarks/gpu_check.sh                    # 160m and 410m, bf16, fused and unfused, after the cuda tests

    python benchmarks/train_throughput.py --rows stock,stock-compile,trainer,neox,neox-no-compile,neox-own-loss \
        --shape 160m --precision bf16 --batch 8 --seq 2048     # benchmarks/gpu_profile.sh's matrix

`--device` defaults to cuda where torch sees a GPU (the first one, as Accelerate picks it), else cpu.

Rows (`--rows`, comma-separated; the first is the baseline every ratio is taken against): `stock` (stock
`GPTNeoXForCausalLM`, a plain PyTorch loop, its default AdamW), `stock-compile` (the same with each decoder layer
torch.compiled), `trainer` (transformers' `Trainer`: bf16, `adamw_torch_fused`, sdpa), `neox` (our loop with the
recipe's defaults), and our loop with one piece off: `neox-no-compile` (`train.compile: false`), `neox-own-loss`
(`train.loss_kernel: neox`, our PyTorch fused loss instead of a library kernel), `neox-unfused`
(`train.fused_cross_entropy: false`), `neox-thread-data` (the data read where `data.num_workers: auto` does not:
in the training process's thread on a GPU, a worker process on a CPU). `--fused both` and `--workers both` add the
`neox-unfused` and `neox-thread-data` rows (what benchmarks/gpu_check.sh asks for).

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
measured GEMM rate is used), the median step in ms, on a GPU the peak memory of each loop
(torch.cuda.max_memory_allocated), for our loop the time per step it waited for data (`data_wait_s` of its
train_log.jsonl), and each row's tokens/s against the first row's. An MFU above 100% of the measured peak means the peak was under-measured (the machine's load changed during
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
import statistics
import sys
import tempfile
from dataclasses import dataclass
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


@dataclass
class Timed:
    seconds: float  # per step, mean over the timed steps
    median_ms: float
    peak_bytes: int | None
    data_wait_ms: float | None = None  # our loop: per step, from its train_log.jsonl


def timed(clock, warmup: int, steps: int, peak: int | None, data_wait_ms: float | None = None) -> Timed:
    return Timed(clock.seconds(warmup, steps) / steps, 1e3 * statistics.median(clock.step_seconds(warmup, steps)),
                 peak, data_wait_ms)


def stock_seconds(config, shape: tuple[int, int], warmup: int, steps: int, precision: str, device: torch.device,
                  compile_layers: bool = False) -> tuple[Timed, object]:
    """(timing, the model) of stock GPTNeoXForCausalLM in a plain PyTorch loop (random tokens, HF's loss), each
    decoder layer torch.compiled where `compile_layers`."""
    reset_peak_memory(device)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(config).to(device).train()
    if compile_layers:
        for layer in model.gpt_neox.layers:
            layer.compile()
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
    return timed(clock, warmup, steps, peak_memory(device)), model.cpu()


def trainer_seconds(config, shape: tuple[int, int], warmup: int, steps: int, precision: str, device: torch.device
                    ) -> Timed:
    """Timing of transformers' `Trainer` on stock GPTNeoXForCausalLM (sdpa), random tokens: bf16 as
    `TrainingArguments(bf16=True)`, its default fused AdamW, no logging or saving inside the timed steps."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    batch, seq = shape
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(0, config.vocab_size, ((warmup + steps) * batch, seq), generator=generator)
    dataset = Dataset.from_dict({"input_ids": rows.tolist(), "labels": rows.tolist()})
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(config)
    with tempfile.TemporaryDirectory() as tmp:
        arguments = TrainingArguments(output_dir=tmp, per_device_train_batch_size=batch, max_steps=warmup + steps,
                                      learning_rate=1e-4, bf16=precision == "bf16", optim="adamw_torch_fused",
                                      logging_steps=10**6, save_strategy="no", report_to=[], max_grad_norm=1.0,
                                      dataloader_num_workers=0, use_cpu=device.type == "cpu", disable_tqdm=True)
        reset_peak_memory(device)
        with StepClock() as clock, contextlib.redirect_stdout(io.StringIO()):
            Trainer(model=model, args=arguments, train_dataset=dataset).train()
        reset_accelerate_state()
    return timed(clock, warmup, steps, peak_memory(device))


def ours_seconds(config, shape: tuple[int, int], warmup: int, steps: int, precision: str, device: torch.device,
                 train_settings: dict | None = None, workers="auto") -> Timed:
    """Timing of `train(recipe)`: the same model shape, packed Tiny Shakespeare windows of seq + 1 tokens, the
    recipe's defaults but for `train_settings`."""
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
                      "lr": 1e-4, "eval_iters": 0, **(train_settings or {})},
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
    waits = [entry["data_wait_s"] for entry in log[warmup:]]
    return timed(clock, warmup, steps, peak, 1e3 * sum(waits) / len(waits))


# Our loop with one piece off: the row's name → train settings (and where its data is read).
OURS = {"neox": {}, "neox-no-compile": {"compile": False}, "neox-own-loss": {"loss_kernel": "neox"},
        "neox-unfused": {"fused_cross_entropy": False}, "neox-thread-data": {}}
ROWS = ("stock", "stock-compile", "trainer", *OURS)
TITLES = {"stock": "stock transformers + PyTorch loop", "stock-compile": "stock, each layer torch.compiled",
          "trainer": "transformers Trainer (fused AdamW)", "neox": "neox_hf train(recipe)",
          "neox-no-compile": "neox_hf, train.compile false", "neox-own-loss": "neox_hf, loss_kernel neox",
          "neox-unfused": "neox_hf, unfused loss", "neox-thread-data": "neox_hf, data read where auto does not"}


def row_timing(row: str, config, shape, args, precision: str, device: torch.device) -> Timed:
    if row in ("stock", "stock-compile"):
        return stock_seconds(config, shape, args.warmup, args.steps, precision, device, row == "stock-compile")[0]
    if row == "trainer":
        return trainer_seconds(config, shape, args.warmup, args.steps, precision, device)
    workers = (0 if device.type == "cuda" else 1) if row == "neox-thread-data" else "auto"
    return ours_seconds(config, shape, args.warmup, args.steps, precision, device, OURS[row], workers)


def datasheet_peak(device: torch.device, precision: str) -> float | None:
    """The dense tensor-core peak of this GPU's datasheet (neox_hf.train.mfu's table, as the training loop's MFU);
    None on CPU, in fp32, and for a GPU the table does not name."""
    from neox_hf.hardware import datasheet_peak as named_part_peak

    if device.type != "cuda":
        return None
    return named_part_peak(torch.cuda.get_device_name(device), precision)


HEADER = ("| shape | precision | what                                     |  tokens/s |  step ms | TFLOP/s |   MFU | datasheet MFU "
          "| data wait ms | vs first |")


def table_row(shape: str, precision: str, what: str, tflops: float | None = None, tok_s: str = "", mfu: str = "",
              sheet_mfu: str = "", peak_bytes: int | None = None, *, gpu: bool = False, step_ms: str = "",
              wait_ms: str = "", ratio: str = "") -> None:
    flops = f"{tflops:7.3f}" if tflops is not None else ""
    memory = f" {peak_bytes / 2**30:>8.2f} |" if peak_bytes is not None else f" {'':>8} |"
    print(f"| {shape:5} | {precision:9} | {what:40} | {tok_s:>9} | {step_ms:>8} | {flops:>7} | {mfu:>5} | "
          f"{sheet_mfu:>13} | {wait_ms:>12} | {ratio:>8} |"
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
    parser.add_argument("--rows", default=None,
                        help=f"comma-separated rows, the first the baseline: {', '.join(ROWS)} (default: stock,neox)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    if args.rows is None:
        args.rows = "stock,neox" + (",neox-unfused" if args.fused == "both" else "") + (
            ",neox-thread-data" if args.workers == "both" else "")
    if any(row not in ROWS for row in args.rows.split(",")):
        parser.error(f"--rows {args.rows}: each row is one of {', '.join(ROWS)}")
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
    print(HEADER + (" peak GiB |" if on_gpu else ""))
    print("|" + "|".join("-" * (len(cell) + 0) for cell in HEADER.split("|")[1:-1]) + "|" + ("-" * 10 + "|" if on_gpu else ""))
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
            flops_token = model_flops_per_token(config, GPTNeoXForCausalLM(config), args.seq)
            first = None
            for what in args.rows.split(","):
                torch.set_num_threads(args.threads)
                timing = row_timing(what, config, shape, args, precision, device)
                first = first or timing
                flops = flops_token * tokens / timing.seconds
                wait = f"{timing.data_wait_ms:.2f}" if timing.data_wait_ms is not None else ""
                row(TITLES[what], flops / 1e12, f"{tokens / timing.seconds:.0f}", f"{100 * flops / peak:4.1f}%",
                    f"{100 * flops / sheet:5.1f}%" if sheet else "", timing.peak_bytes,
                    step_ms=f"{timing.median_ms:.1f}", wait_ms=wait, ratio=f"{first.seconds / timing.seconds:.2f}×")
                if flops > peak:
                    failed.append(f"{name} {precision} {what}: MFU {100 * flops / peak:.0f}%")
                sys.stdout.flush()  # a row as soon as it is measured: a run cut short by its time limit keeps it
    if failed:
        print("FAILED: MFU above 100% (" + "; ".join(failed) + "): the GEMM peak was under-measured, most likely "
              "because the machine's load changed during the run; rerun on an idle machine", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
