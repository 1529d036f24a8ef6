"""Padding efficiency and training throughput of each batching mode on GSM8K (one table).

    python benchmarks/padding.py [--steps 3] [--warmup 1] [--batch 16]

For each mode: padding efficiency (real tokens / tokens computed, over --efficiency-batches batches) and
real tokens/s of a full training step (forward + backward + AdamW) on a Pythia-14M-shaped stock
`GPTNeoXForCausalLM` (6 layers, hidden 128, 4 heads, vocab 50304, random init, fp32, 2 torch threads),
with ratios to the baseline (`DataCollatorWithPadding` in random order) measured in the same run.
Then the data pipeline alone (jsonl → batches, tokens/s) against what the training step consumes.
Timings vary with machine load; nothing here is asserted by the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from itertools import islice
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

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


def aligned_labels(ids_rows: list[list[int]], width: int) -> torch.Tensor:
    """Labels for inputs ids[:-1]: ids[1:], -100 beyond each row."""
    labels = torch.full((len(ids_rows), width), -100, dtype=torch.int64)
    for r, ids in enumerate(ids_rows):
        labels[r, : len(ids) - 1] = torch.tensor(ids[1:])
    return labels


def hf_padding_batches(tok, docs, batch, **padding):
    """Baseline: transformers' DataCollatorWithPadding over the stream in its (random) order."""
    from transformers import DataCollatorWithPadding

    collate = DataCollatorWithPadding(tok, return_tensors="pt", **padding)
    for i in range(0, len(docs) - batch + 1, batch):
        rows = docs[i: i + batch]
        out = collate([{"input_ids": ids[:-1]} for ids in rows])
        yield {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"],
               "labels": aligned_labels(rows, out["input_ids"].shape[1])}


def hf_flattening_batches(docs, batch):
    """transformers' padding-free DataCollatorWithFlattening: one row per batch, position_ids restart."""
    from transformers import DataCollatorWithFlattening

    collate = DataCollatorWithFlattening(return_position_ids=True)
    for i in range(0, len(docs) - batch + 1, batch):
        out = collate([{"input_ids": ids} for ids in docs[i: i + batch]])
        labels = torch.full_like(out["labels"], -100)
        labels[:, :-1] = out["labels"][:, 1:]  # the collator leaves the shift to the model; our step does not
        yield {"input_ids": out["input_ids"], "position_ids": out["position_ids"], "labels": labels}


def our_batches(tok, batch, **data):
    from neox_hf.data import build_train_loader
    from neox_hf.recipe import DataConfig, DataSource

    cfg = DataConfig(sources=[DataSource(path=str(GSM8K), template=TEMPLATE)], **data)
    return build_train_loader(cfg, tok, seq_length=SEQ, micro_batch_size=batch)


def real_tokens(b) -> int:
    return int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel()


def efficiency(batches) -> float:
    real = total = 0
    for b in batches:
        real += real_tokens(b)
        total += b["input_ids"].numel()
    return real / total


def tiny_pythia():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=50304, hidden_size=128, num_hidden_layers=6, num_attention_heads=4,
                           intermediate_size=512, max_position_embeddings=2048, rotary_pct=0.25,
                           attn_implementation="sdpa")
    return GPTNeoXForCausalLM(config)


def train_tokens_per_second(streams: dict, steps: int, warmup: int) -> dict:
    """Real tokens/s per mode. Modes take turns step by step on one model, so a change in machine load
    (other jobs on the cores) hits every mode alike instead of whichever happened to run then."""
    model = tiny_pythia().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    iterators = {name: iter(stream) for name, stream in streams.items()}
    real, elapsed = dict.fromkeys(streams, 0), dict.fromkeys(streams, 0.0)
    for i in range(warmup + steps):
        for name, batches in iterators.items():
            b = next(batches)
            start = time.perf_counter()
            inputs = {k: v for k, v in b.items() if k != "labels"}
            logits = model(**inputs, use_cache=False).logits
            loss = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if i >= warmup:
                elapsed[name] += time.perf_counter() - start
                real[name] += real_tokens(b)
    return {name: real[name] / elapsed[name] for name in streams}


def pipeline_tokens_per_second(tok, n_batches: int) -> float:
    """jsonl → tokenized → bucketed → padded batches, nothing else."""
    start = time.perf_counter()
    loader = our_batches(tok, 16, mode="pad", buffer_size=1000)
    real = sum(real_tokens(b) for b in islice(loader, n_batches))
    return real / (time.perf_counter() - start)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3,
                        help="timed training steps per mode (a step takes 2-16 s on 2 cores; 30 needs ~20 min)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--efficiency-batches", type=int, default=150)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    tok = load_tokenizer()
    docs = gsm8k_documents(tok)
    B = args.batch
    modes = {
        f"HF DataCollatorWithPadding, random order, B{B} (baseline)": lambda: hf_padding_batches(tok, docs, B),
        f"HF DataCollatorWithPadding, fixed {SEQ}, B{B}": lambda: hf_padding_batches(tok, docs, B, padding="max_length", max_length=SEQ),
        f"HF DataCollatorWithFlattening, B{B} (padding-free)": lambda: hf_flattening_batches(docs, B),
        f"ours pad, buffer 1000, B{B}": lambda: our_batches(tok, B, mode="pad", buffer_size=1000),
        "ours pad, buffer 1000, budget 4096 tokens": lambda: our_batches(tok, B, mode="pad", buffer_size=1000, max_tokens_per_batch=4096),
        f"ours pack, {SEQ} x B4": lambda: our_batches(tok, 4, mode="pack"),
        f"ours pack isolated, {SEQ} x B4": lambda: our_batches(tok, 4, mode="pack", isolate_documents=True),
    }
    speeds = train_tokens_per_second({name: make() for name, make in modes.items()}, args.steps, args.warmup)
    rows = [(name, efficiency(islice(make(), args.efficiency_batches)), speeds[name]) for name, make in modes.items()]
    base = rows[0][2]
    width = max(len(r[0]) for r in rows)
    print(f"\nGSM8K train ({len(docs)} pairs), GPT-NeoX-20B tokenizer, Pythia-14M-shaped GPTNeoX, fp32, "
          f"{torch.get_num_threads()} threads, {args.steps} timed steps after {args.warmup} warm-up")
    print(f"machine load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (timings scale with it)")
    print(f"{'mode':<{width}}  {'pad efficiency':>14}  {'real tok/s':>10}  {'vs baseline':>11}")
    for name, eff, speed in rows:
        print(f"{name:<{width}}  {eff:>14.1%}  {speed:>10.0f}  {speed / base:>10.2f}x")
    unrounded = efficiency(islice(our_batches(tok, B, mode="pad", buffer_size=1000, pad_to_multiple_of=1),
                                  args.efficiency_batches))
    print(f"ours pad, buffer 1000, B{B} with pad_to_multiple_of 1 (default 8 above): {unrounded:.1%} efficiency")
    pipeline = pipeline_tokens_per_second(tok, args.efficiency_batches)
    consumed = rows[3][2]
    print(f"\ndata pipeline alone (jsonl → pad batches): {pipeline:,.0f} real tok/s = "
          f"{pipeline / consumed:.1f}x what the training step consumes in `ours pad` mode ({consumed:,.0f} tok/s)")


if __name__ == "__main__":
    main()
