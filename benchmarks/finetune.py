"""LoRA vs full fine-tuning on GSM8K with a Pythia-14M-shaped GPTNeoX: trainable parameters, tokens/s, peak memory,
answer-only eval loss before/after, with the fused linear + cross-entropy (the training default) and without it.
One command, one table:

    OMP_NUM_THREADS=1 python benchmarks/finetune.py [--steps 200] [--micro-batch 4] [--losses fused,unfused]

The loss is `neox_hf.ops.loss.causal_lm_loss` (sum over labelled tokens, divided by their count here), fused or not;
where that module is absent (before the loop's rewrite) the same computation is done here from `neox_hf.ops`.

The model is randomly initialised (Pythia-14M shape: 6 layers, hidden 128, 4 heads, vocab 50304, untied), so the
losses show that training works, not GSM8K skill. Each mode runs in its own fresh process so memory does not leak
between them. Peak memory = peak RSS growth during the training steps over the RSS before the first step (model,
data and eval batches already built), sampled every 2 ms by a thread from /proc/self/statm: it covers gradients,
optimizer states and activations (glibc's freed blocks are trimmed before the baseline is taken).

What dominates peak memory here: the untied 50304×128 embedding and head are 92% of the 14M parameters, so full
fine-tuning adds their gradients and two Adam states (~3 × 56 MB); LoRA freezes them (0.7% trainable). Unfused, the
activations are shared by both: the [B, T, 50304] fp32 logits, their log-softmax and their gradient (LoRA still
back-propagates through the frozen head) are ~3 × 50 MB per 256-token sequence, so LoRA's saving shrinks as the
micro batch grows (ratio ~0.88 at batch 4). The fused loss never holds them (one chunk of rows at a time), and with
the head frozen it computes no weight gradient at all, so LoRA keeps its saving. A run with the defaults takes about
10 minutes on one core (4 modes × 200 steps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GSM8K_FULL = Path("/work/shared/data/corpora/gsm8k/train.jsonl")
GSM8K_SAMPLE = REPO / "examples" / "data" / "gsm8k-sample.jsonl"
TEMPLATE = "Question: {question}\nAnswer: {answer}"
PROMPT_TEMPLATE = "Question: {question}\nAnswer: "
LR = {"lora": 3e-3, "full": 1e-3}
EVAL_PROBLEMS = 64


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Highest RSS seen by a sampling thread while the `with` block runs."""

    def __enter__(self):
        self.peak, self._stop = _rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def loss_function(fused: bool):
    """batch → (loss sum, labelled tokens): the training loss of neox_hf, fused or not."""
    try:
        from neox_hf.ops.loss import causal_lm_loss
    except ImportError:  # before the loop's rewrite: the same computation from the op
        return lambda model, batch: _head_loss(model, batch, fused)
    return lambda model, batch: causal_lm_loss(model, batch, fused=fused)


def _head_loss(model, batch: dict, fused: bool):
    from neox_hf.ops.linear_cross_entropy import cross_entropy_sum, lm_head_loss

    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    hidden = lm.base_model(**inputs, use_cache=False).last_hidden_state
    head = lm.get_output_embeddings()
    return lm_head_loss(head, hidden, batch["labels"]) if fused else cross_entropy_sum(head(hidden), batch["labels"])


def evaluate(loss_fn, model, batches: list[dict]) -> float:
    """Token-weighted mean loss over the eval batches."""
    import torch

    model.eval()
    with torch.no_grad():
        sums = [loss_fn(model, b) for b in batches]
    model.train()
    return float(sum(s for s, _ in sums) / sum(n for _, n in sums))


def run_mode(mode: str, fused: bool, steps: int, micro_batch: int, data_file: Path) -> dict:
    """Train one mode for `steps` steps in this process; return its measurements."""
    import torch

    from neox_hf.data import build_eval_loader, build_train_loader
    from neox_hf.finetune import trainable_parameters_report, wrap_with_peft
    from neox_hf.data.tokenizer import load_tokenizer
    from neox_hf.model import NeoXConfig, NeoXForCausalLM
    from neox_hf.recipe import DataConfig, DataSource, PeftConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokenizer = load_tokenizer(str(REPO / "examples" / "data" / "gpt-neox-20b-tokenizer.json"))
    config = NeoXConfig(num_hidden_layers=6, hidden_size=128, num_attention_heads=4, intermediate_size=512,
                           vocab_size=50304, max_position_embeddings=2048, rotary_pct=0.25, tie_word_embeddings=False,
                           hidden_dropout=0.0, attention_dropout=0.0, use_cache=False)
    model = NeoXForCausalLM(config)
    if mode == "lora":
        model = wrap_with_peft(model, PeftConfig(method="lora", r=8, alpha=16, dropout=0.0))
    source = DataSource(path=str(data_file), template=TEMPLATE, prompt_template=PROMPT_TEMPLATE)
    data_cfg = DataConfig(sources=[source], validation_fraction=0.02, mode="pad", max_length=256, buffer_size=256)
    loader = iter(build_train_loader(data_cfg, tokenizer, seq_length=256, micro_batch_size=micro_batch, seed=1))
    # Eval in batches of 1 so its (forward-only) peak stays below training's and cannot hide in the baseline.
    eval_batches = build_eval_loader(data_cfg, tokenizer, seq_length=256, micro_batch_size=1, max_batches=EVAL_PROBLEMS)
    loss_fn = loss_function(fused)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR[mode], weight_decay=0.0)
    before = evaluate(loss_fn, model, eval_batches)
    batches = [next(loader) for _ in range(steps)]  # tokenized before timing: measure the model, not the tokenizer
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    model.train()
    _release_freed_memory()
    start_rss = _rss_bytes()
    with PeakRSS() as peak:
        start = time.perf_counter()
        for batch in batches:
            loss_sum, count = loss_fn(model, batch)
            (loss_sum / count.clamp(min=1)).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
    after = evaluate(loss_fn, model, eval_batches)
    trainable = sum(p.numel() for p in params)
    return {"mode": mode, "loss": "fused" if fused else "unfused", "report": trainable_parameters_report(model), "trainable": trainable,
            "total": sum(p.numel() for p in model.parameters()), "tokens_per_s": tokens / elapsed,
            "peak_mb": (peak.peak - start_rss) / 2**20, "eval_before": before, "eval_after": after,
            "eval_tokens": sum(int((b["labels"] != -100).sum()) for b in eval_batches), "lr": LR[mode]}


def _release_freed_memory() -> None:
    """glibc keeps freed blocks (eval activations) mapped; trim them so training's growth is measured in full."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def table(rows: dict, steps: int, micro_batch: int, data_file: Path) -> str:
    lines = [
        f"GSM8K LoRA vs full fine-tuning — Pythia-14M shape (6×128, vocab 50304, untied), RANDOM INIT, "
        f"{steps} steps × micro batch {micro_batch}, fp32 CPU, 1 thread; data {data_file}",
        f"{'':8} {'loss':8} {'trainable':>12} {'of total':>9} {'tokens/s':>9} {'peak MB':>8} {'eval before':>12} "
        f"{'eval after':>11} {'lr':>7}",
    ]
    for row in rows.values():
        lines.append(f"{row['mode']:8} {row['loss']:8} {row['trainable']:>12,} {100 * row['trainable'] / row['total']:>8.2f}% "
                     f"{row['tokens_per_s']:>9.0f} {row['peak_mb']:>8.1f} {row['eval_before']:>12.4f} "
                     f"{row['eval_after']:>11.4f} {row['lr']:>7.0e}")
    for loss in ("fused", "unfused"):
        lora, full = rows.get(("lora", loss)), rows.get(("full", loss))
        if lora and full:
            lines.append(f"{loss} loss, LoRA / full: peak memory {lora['peak_mb'] / full['peak_mb']:.2f} (target ≤ 0.70), "
                         f"tokens/s {lora['tokens_per_s'] / full['tokens_per_s']:.2f}")
    any_row = next(iter(rows.values()))
    lines += [
        f"eval = answer-only loss (prompt masked) on {any_row['eval_tokens']:,} held-out answer tokens "
        f"(first {EVAL_PROBLEMS} problems of the 2% hash hold-out); strictly lower after: "
        + ", ".join(f"{r['mode']} {r['loss']} {r['eval_after'] < r['eval_before']}" for r in rows.values()),
        "peak MB = peak RSS growth during the training steps (thread sampling /proc/self/statm every 2 ms)",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--losses", default="fused,unfused", help="comma-separated: fused, unfused")
    parser.add_argument("--data", default=str(GSM8K_FULL if GSM8K_FULL.is_file() else GSM8K_SAMPLE))
    parser.add_argument("--worker", choices=["lora", "full"], help=argparse.SUPPRESS)
    parser.add_argument("--loss", choices=["fused", "unfused"], default="fused", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_mode(args.worker, args.loss == "fused", args.steps, args.micro_batch, Path(args.data))))
        return 0
    rows = {}
    for loss in args.losses.split(","):
        for mode in ("lora", "full"):  # one after the other: parallel runs would share the cores and skew tokens/s
            command = [sys.executable, __file__, "--worker", mode, "--loss", loss, "--steps", str(args.steps),
                       "--micro-batch", str(args.micro_batch), "--data", args.data]
            done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if done.returncode != 0:
                print(done.stderr[-4000:], file=sys.stderr)
                return done.returncode
            rows[(mode, loss)] = json.loads(done.stdout.strip().splitlines()[-1])
    print(table(rows, args.steps, args.micro_batch, Path(args.data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
