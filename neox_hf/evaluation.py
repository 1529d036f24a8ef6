"""`neox_hf eval`: token-weighted loss and perplexity of a saved model (full or adapter folder) on a local file.

Gap filled: transformers' `Trainer.evaluate` averages per-batch mean losses (wrong for dynamically padded or
prompt-masked batches) and the Hub's `perplexity` metric downloads and runs its own model. Here batches come from
our data layer (same `template` / `prompt_template` / `text_key` options as training, labels already aligned),
every labelled token counts once, and the shipped `evaluate` module `neox_hf/metrics/perplexity` turns the
(loss sum, token count) pairs into perplexity offline. With a prompt template the answer-only loss is reported
beside the loss over the whole text.

For lm-evaluation-harness benchmarks use `lm_eval --model hf --model_args pretrained=FOLDER` on a merged folder.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import evaluate
import torch
import torch.nn.functional as F

from neox_hf.data import build_eval_loader
from neox_hf.errors import DataError, UsageError
from neox_hf.inference import load_for_inference
from neox_hf.io import atomic_write_text
from neox_hf.recipe import DataConfig, DataSource

PERPLEXITY_METRIC = Path(__file__).resolve().parent / "metrics" / "perplexity"
ALL_BATCHES = 10**9


def load_perplexity_metric():
    """The shipped perplexity module, loaded by path (no Hub access)."""
    return evaluate.load(str(PERPLEXITY_METRIC))


def evaluate_model(model_path, data_file, *, tokenizer_path: str | None = None, template: str | None = None,
                   prompt_template: str | None = None, text_key: str = "text", seq_length: int | None = None,
                   batch_size: int = 8, max_batches: int | None = None, device: str = "auto") -> dict:
    """{"loss", "perplexity", "tokens"} over every token of each document, plus "answer_loss",
    "answer_perplexity", "answer_tokens" (prompt tokens masked) when `prompt_template` is given."""
    model, tokenizer = load_for_inference(model_path, tokenizer_path, device=device)
    seq_length = seq_length or model.config.max_position_embeddings
    source = DataSource(path=str(data_file), text_key=text_key, template=template)
    scores = _score(model, _eval_batches(source, tokenizer, seq_length, batch_size, max_batches))
    result = {"model": str(model_path), "data": str(data_file), **scores}
    if prompt_template is not None:
        answer_source = DataSource(path=str(data_file), text_key=text_key, template=template,
                                   prompt_template=prompt_template)
        answer = _score(model, _eval_batches(answer_source, tokenizer, seq_length, batch_size, max_batches))
        result.update({f"answer_{key}": value for key, value in answer.items()})
    return result


def _eval_batches(source: DataSource, tokenizer, seq_length: int, batch_size: int, max_batches: int | None) -> list[dict]:
    data_cfg = DataConfig(validation=[source], mode="pad", shuffle=False)
    batches = build_eval_loader(data_cfg, tokenizer, seq_length=seq_length, micro_batch_size=batch_size,
                                max_batches=max_batches or ALL_BATCHES)
    if not batches:
        raise DataError(f"{source.path}: no document with at least two tokens to evaluate "
                        f"(text_key {source.text_key!r}, template {source.template!r})")
    return batches


@torch.no_grad()
def batch_loss_sum(model, batch: dict) -> tuple[float, int]:
    """(Σ cross-entropy over labelled tokens, number of labelled tokens) of one batch, in float64."""
    inputs = {k: batch[k].to(model.device) for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    logits = model(**inputs, use_cache=False).logits
    labels = batch["labels"].to(model.device)
    losses = F.cross_entropy(logits.double().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return float(losses), int((labels != -100).sum())


def _score(model, batches: list[dict]) -> dict:
    metric = load_perplexity_metric()
    for batch in batches:
        loss_sum, tokens = batch_loss_sum(model, batch)
        metric.add_batch(losses=[loss_sum], token_counts=[tokens])
    scores = metric.compute()
    return {"loss": scores["mean_loss"], "perplexity": scores["perplexity"], "tokens": scores["tokens"]}


# ----------------------------------------------------------------------------------------------------------------
# `neox_hf eval MODEL --data FILE`
# ----------------------------------------------------------------------------------------------------------------


def add_eval_arguments(parser) -> None:
    parser.add_argument("model", help="model folder, or adapter folder of a LoRA run")
    parser.add_argument("--data", required=True, help="jsonl / json / txt / parquet file (or glob) to evaluate on")
    parser.add_argument("--tokenizer", default=None, help="tokenizer JSON or folder (default: the model folder's)")
    parser.add_argument("--text-key", default="text", help="jsonl field holding the text (default: text)")
    parser.add_argument("--template", default=None, help='join fields, e.g. "Question: {question}\\nAnswer: {answer}"')
    parser.add_argument("--prompt-template", default=None,
                        help='prompt part, masked for the answer-only loss, e.g. "Question: {question}\\nAnswer: "')
    parser.add_argument("--seq-length", type=int, default=None, help="truncate documents (default: model context)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-batches", type=int, default=None, help="evaluate only the first N batches")
    parser.add_argument("--output", default=None, help="also write the results to this JSON file")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto (default): the GPU where torch sees one, else the CPU")


def run_eval(args) -> int:
    for flag, value in (("--batch-size", args.batch_size), ("--seq-length", args.seq_length),
                        ("--max-batches", args.max_batches)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be ≥ 1, got {value}")
    result = evaluate_model(args.model, args.data, tokenizer_path=args.tokenizer, template=_unescape(args.template),
                            prompt_template=_unescape(args.prompt_template), text_key=args.text_key,
                            seq_length=args.seq_length, batch_size=args.batch_size, max_batches=args.max_batches,
                            device=args.device)
    print(format_eval_result(result))
    if args.output:
        atomic_write_text(args.output, json.dumps(result, indent=2) + "\n")
    return 0


def _unescape(template: str | None) -> str | None:
    """Shells pass `\\n` literally; templates mean a newline."""
    return None if template is None else template.replace("\\n", "\n")


def format_eval_result(result: dict) -> str:
    lines = [f"loss {result['loss']:.4f}  perplexity {_finite(result['perplexity'])}  over {result['tokens']:,} tokens"]
    if "answer_loss" in result:
        lines.append(f"answer-only loss {result['answer_loss']:.4f}  perplexity {_finite(result['answer_perplexity'])}"
                     f"  over {result['answer_tokens']:,} tokens")
    return "\n".join(lines)


def _finite(value: float) -> str:
    return f"{value:.2f}" if math.isfinite(value) else "inf"
