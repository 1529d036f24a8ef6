"""Shared by tests/test_data_*.py and the data_* torchrun workers: the real tokenizer, the real corpora,
small generated files, and what a batch's rows say about the documents in it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the suite-wide conftest helpers
from conftest import SHARED_DATA  # noqa: E402
from conftest import shared as shared_path  # noqa: E402

GSM8K_TEMPLATE = "Question: {question}\nAnswer: {answer}"
GSM8K_PROMPT = "Question: {question}\nAnswer: "


def neox_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(shared_path("tokenizers/gpt-neox-20b.json")),
                                   eos_token="<|endoftext|>", pad_token="<|padding|>")


def gsm8k_source(**overrides):
    from neox_hf.recipe import DataSource

    values = dict(path=str(shared_path("corpora/gsm8k/train.jsonl")), template=GSM8K_TEMPLATE)
    values.update(overrides)
    return DataSource(**values)


def gsm8k_rows(n: int) -> list[dict]:
    with open(shared_path("corpora/gsm8k/train.jsonl")) as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def numbered_texts(prefix: str, n: int) -> list[dict]:
    """Rows whose text names the row, so a document can be traced through batches."""
    return [{"text": f"{prefix} document number {i} says {i * 7 % 13} things."} for i in range(n)]


def batch_documents(batch, eos_id: int) -> list[tuple[int, ...]]:
    """Pad-mode rows back to the documents they hold (inputs + last label), as token tuples."""
    docs = []
    for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"]):
        n = int(mask.sum())
        docs.append(tuple(ids[:n].tolist()) + (int(labels[n - 1]),))
    return docs
