"""Real tokens/s of a training step on GSM8K: neox_hf against what a transformers user runs (one table).

    python benchmarks/padding.py [--steps 8] [--warmup 2] [--batch 16] [--precision fp32|bf16] [--repeats 1]

Pythia-14M-shaped GPTNeoX (6 layers, hidden 128, 4 heads, vocab 50304, random init), 2 torch threads, each
mode in turn on the same GSM8K stream (question + answer, every token trained on):
- baseline: transformers `Trainer` + `DataCollatorForLanguageModeling` (pad to the longest in the batch) +
  `train_sampling_strategy="group_by_length"` (what a transformers user runs for variable-length fine-tuning), with
  the Trainer's default optimizer (`adamw_torch_fused` for torch ≥ 2.8: the same fused AdamW kernel neox_hf uses);
- `Trainer` + `DataCollatorWithFlattening` (padding-free: one row per batch, position ids restart per document);
- `Trainer` + pad to longest in random order (the old baseline of this file, for reference);
- neox_hf: `neox_hf.train.loop.train(recipe)` in `pad` mode (length-bucketed dynamic padding) and in `pack` mode;
  row 6 is the pad row in the recipe default `train.precision: auto` (what it picks here, whatever --precision says:
  `--precision bf16 --modes 1,6` sets the Trainer's bf16 against what a neox_hf user gets by default).
Real tokens = positions that are trained on (labelled tokens), counted from the batches of the timed steps.
Step times come from a global optimizer-step hook (`torch.optim.optimizer.register_optimizer_step_post_hook`), so
both loops are timed the same way, whole steps including data loading; the first --warmup steps are left out.
Padding efficiency = real tokens / positions computed over the timed steps. Timings vary with machine load (the
load average is printed; on shared virtual cores by ±20% from one minute to the next): `--repeats R` runs every mode
R times, round-robin, and keeps each mode's best. Nothing here is asserted by the tests. A run with the defaults takes about 3 minutes on
2 idle cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from contextlib import contextmanager
from itertools import islice
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_common import StepClock, cpu_name, reset_accelerate_state  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
GSM8K = SHARED / "corpora" / "gsm8k" / "train.jsonl"
TEMPLATE = "Question: {question}\nAnswer: {answer}"
SEQ = 512


def load_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(SHARED / "tokenizers" / "gpt-neox-20b.json"),
                                   eos_token="<|endoftext|>", pad_token="<|padding|>")


def gsm8k_documents(tok) -> list[list[int]]:
    """Every GSM8K pair as token ids + EOD, in a seeded random order (what a shuffled stream gives)."""
    with open(GSM8K) as f:
        texts = [TEMPLATE.format(**json.loads(line)) for line in f]
    ids = tok(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    docs = [d[:SEQ] + [tok.eos_token_id] for d in ids]
    random.Random(0).shuffle(docs)
    return docs


def tiny_pythia():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=50304, hidden_size=128, num_hidden_layers=6, num_attention_heads=4,
                           intermediate_size=512, max_position_embeddings=2048, rotary_pct=0.25,
                           tie_word_embeddings=False, attn_implementation="sdpa")
    return GPTNeoXForCausalLM(config)


def trainer_run(tok, docs, collator: str, sampling: str, args) -> dict:
    """Real tokens/s and padding efficiency of transformers' Trainer over the timed steps."""
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening, Trainer, TrainingArguments

    pad = DataCollatorForLanguageModeling(tok, mlm=False, return_tensors="pt")
    flatten = DataCollatorWithFlattening(return_position_ids=True)
    seen: list[tuple[int, int]] = []  # (labelled positions, positions computed) of each batch, in step order

    def collate(features):
        rows = [{"input_ids": f["input_ids"]} for f in features]
        out = flatten(rows) if collator == "flatten" else pad(rows)
        # The model shifts labels internally: position t of labels[1:] is what position t is trained on.
        seen.append((int((out["labels"][:, 1:] != -100).sum()), out["input_ids"].numel()))
        return out

    dataset = Dataset.from_dict({"input_ids": docs, "length": [len(d) for d in docs]})
    with tempfile.TemporaryDirectory() as tmp:
        training_args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=args.batch, max_steps=args.warmup + args.steps,
            learning_rate=1e-5, lr_scheduler_type="constant", optim="adamw_torch_fused", weight_decay=0.0,
            train_sampling_strategy=sampling, use_cpu=True, report_to="none", save_strategy="no",
            logging_strategy="no", bf16=args.precision == "bf16", remove_unused_columns=False,
            dataloader_drop_last=True, disable_tqdm=True, seed=0)
        trainer = Trainer(model=tiny_pythia(), args=training_args, train_dataset=dataset,
                          data_collator=collate)
        with StepClock() as clock:
            trainer.train()
    timed = seen[args.warmup: args.warmup + args.steps]
    real = sum(r for r, _ in timed)
    return {"tokens_per_s": real / clock.seconds(args.warmup, args.steps),
            "efficiency": real / sum(n for _, n in timed)}


def ours_recipe(out_dir: str, args, micro_batch_size: int, precision: str | None = None, **data) -> dict:
    return {
        "model": {"num_layers": 6, "hidden_size": 128, "num_attention_heads": 4, "intermediate_size": 512,
                  "seq_length": SEQ, "max_position_embeddings": 2048, "rotary_pct": 0.25},
        "tokenizer": {"path": str(SHARED / "tokenizers" / "gpt-neox-20b.json")},
        "data": {"sources": [{"path": str(GSM8K), "template": TEMPLATE}], **data},
        "train": {"train_iters": args.warmup + args.steps, "lr": 1e-5, "min_lr": 1e-5, "lr_decay_style": "constant",
                  "warmup": 0.0, "weight_decay": 0.0, "precision": precision or args.precision, "log_interval": 1,
                  "eval_iters": 0, "micro_batch_size": micro_batch_size},
        "output": {"dir": out_dir, "tensorboard": False},
    }


def ours_run(tok, args, precision: str | None = None, **data) -> dict:
    """Real tokens/s of `neox_hf.train.loop.train(recipe)` (labelled tokens from its train_log.jsonl) and the padding
    efficiency of its loader; in `precision` where given, else --precision's."""
    from neox_hf.recipe import recipe_from_dict
    from neox_hf.train.loop import train

    batch = data.pop("micro_batch_size", args.batch)
    with tempfile.TemporaryDirectory() as tmp:
        recipe = recipe_from_dict(ours_recipe(tmp, args, batch, precision, **data))
        with StepClock() as clock, _quiet():
            train(recipe)
        log = [json.loads(line) for line in (Path(tmp) / "train_log.jsonl").read_text().splitlines()]
    tokens = log[args.warmup + args.steps - 1]["consumed_tokens"] - log[args.warmup - 1]["consumed_tokens"]
    torch.set_num_threads(2)
    return {"tokens_per_s": tokens / clock.seconds(args.warmup, args.steps),
            "efficiency": efficiency(islice(our_batches(tok, batch, **data), 50))}


@contextmanager
def _quiet():
    """Our loop prints its start-up report and progress; the table is what this benchmark shows."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        yield


def our_batches(tok, batch, **data):
    from neox_hf.data import build_train_loader
    from neox_hf.recipe import DataConfig, DataSource

    cfg = DataConfig(sources=[DataSource(path=str(GSM8K), template=TEMPLATE)], **data)
    return build_train_loader(cfg, tok, seq_length=SEQ, micro_batch_size=batch)


def efficiency(batches) -> float:
    real = total = 0
    for b in batches:
        real += int((b["labels"] != -100).sum())
        total += b["input_ids"].numel()
    return real / total


def pipeline_tokens_per_second(tok, n_batches: int) -> float:
    """jsonl → tokenized → bucketed → padded batches, nothing else."""
    start = time.perf_counter()
    loader = our_batches(tok, 16, mode="pad", buffer_size=1000)
    real = sum(int((b["labels"] != -100).sum()) for b in islice(loader, n_batches))
    return real / (time.perf_counter() - start)


def auto_precision() -> str:
    """What the recipe default `train.precision: auto` trains in on this machine."""
    from neox_hf.recipe.precision import resolve_precision
    from neox_hf.recipe import TrainConfig

    return resolve_precision(TrainConfig(precision="auto"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per mode (a step takes 1-3 s on 2 cores)")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing (at least 1: set-up)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--modes", default="all", help="comma-separated row numbers (1-6) to run; 1 is the baseline")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every mode, round-robin; the best is shown")
    args = parser.parse_args(argv)
    args.warmup, args.repeats = max(args.warmup, 1), max(args.repeats, 1)
    torch.set_num_threads(2)
    tok = load_tokenizer()
    docs = gsm8k_documents(tok)
    B = args.batch
    modes = [
        (f"Trainer, pad to longest, group_by_length, B{B} (baseline)",
         lambda: trainer_run(tok, docs, "pad", "group_by_length", args)),
        (f"Trainer, DataCollatorWithFlattening, B{B} (padding-free)",
         lambda: trainer_run(tok, docs, "flatten", "random", args)),
        (f"Trainer, pad to longest, random order, B{B}", lambda: trainer_run(tok, docs, "pad", "random", args)),
        (f"neox_hf pad, buffer 1000, B{B}", lambda: ours_run(tok, args, mode="pad", buffer_size=1000)),
        (f"neox_hf pack, {SEQ} x B4", lambda: ours_run(tok, args, mode="pack", micro_batch_size=4)),
        (f"neox_hf pad, buffer 1000, B{B}, `precision: auto` ({auto_precision()} here)",
         lambda: ours_run(tok, args, precision="auto", mode="pad", buffer_size=1000)),
    ]
    chosen = range(len(modes)) if args.modes == "all" else [int(m) - 1 for m in args.modes.split(",")]
    best: dict[int, dict] = {}
    for _ in range(args.repeats):
        for i in chosen:
            result = modes[i][1]()
            torch.set_num_threads(2)  # Trainer / Accelerate may change it
            reset_accelerate_state()  # the next mode may run another precision, which Accelerate's singletons would refuse
            if i not in best or result["tokens_per_s"] > best[i]["tokens_per_s"]:
                best[i] = result
    rows = [(modes[i][0], best[i]) for i in chosen]
    base = rows[0][1]["tokens_per_s"]
    width = max(len(r[0]) for r in rows)
    print(f"\nGSM8K train ({len(docs)} pairs), GPT-NeoX-20B tokenizer, Pythia-14M-shaped GPTNeoX, {args.precision}, "
          f"{torch.get_num_threads()} threads, {args.steps} timed steps after {args.warmup} warm-up, best of {args.repeats}")
    print(cpu_name())
    print(f"machine load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (timings scale with it)")
    print(f"| {'mode':<{width}} | pad efficiency | real tok/s | vs row 1 |")
    print(f"|{'-' * (width + 2)}|---:|---:|---:|")
    for name, r in rows:
        print(f"| {name:<{width}} | {r['efficiency']:>14.1%} | {r['tokens_per_s']:>10.0f} | "
              f"{r['tokens_per_s'] / base:>7.2f}x |")
    pipeline = pipeline_tokens_per_second(tok, 150)
    print(f"\ndata pipeline alone (jsonl → pad batches): {pipeline:,.0f} real tok/s")


if __name__ == "__main__":
    main()
