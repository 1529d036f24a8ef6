"""GPT-NeoX `.bin/.idx`: header bytes as preprocess_data.py writes them, round trip, errors name the file."""

from __future__ import annotations

import os
import struct
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
from data_common import gsm8k_rows, neox_tokenizer, shared_path, write_jsonl  # noqa: E402

from neox_hf.data import (IndexedDataset, build_eval_loader, gpt_neox_num_epochs, tokens_per_epoch,  # noqa: E402
                          write_indexed_dataset)
from neox_hf.data.indexed import best_fitting_dtype  # noqa: E402
from neox_hf.errors import DataError  # noqa: E402
from neox_hf.recipe import DataConfig, DataSource  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return neox_tokenizer()


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    folder = tmp_path_factory.mktemp("indexed")
    rows = [{"text": r["question"]} for r in gsm8k_rows(150)] + [{"text": ""}]  # the empty doc is dropped
    return write_jsonl(folder / "questions.jsonl", rows), [r["text"] for r in rows[:-1]]


def test_round_trip_and_header_bytes(tmp_path, tok, questions):
    path, texts = questions
    bin_path, idx_path = write_indexed_dataset([path], tok, tmp_path / "q_text_document")
    expected = [ids + [0] for ids in tok(texts, add_special_tokens=False)["input_ids"]]
    sizes = np.array([len(ids) for ids in expected], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1].astype(np.int64) * 2)])
    header = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8) + struct.pack("<QQ", len(sizes), len(sizes) + 1)
    assert idx_path.read_bytes() == header + sizes.tobytes() + pointers.astype(np.int64).tobytes() + np.arange(len(sizes) + 1, dtype=np.int64).tobytes()
    assert bin_path.read_bytes() == np.concatenate(expected).astype(np.uint16).tobytes()
    data = IndexedDataset(tmp_path / "q_text_document")
    assert len(data) == len(texts) and data.num_tokens == sizes.sum()
    assert all(data.document(i).tolist() == ids for i, ids in enumerate(expected))
    assert not list(tmp_path.glob("*.tmp"))  # written to temporary names, then renamed


def test_without_eod_and_with_worker_processes(tmp_path, tok, questions):
    path, texts = questions
    write_indexed_dataset([path], tok, tmp_path / "one", append_eod=False)
    write_indexed_dataset([path], tok, tmp_path / "two", append_eod=False, workers=2, batch_size=40)
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "two.bin").read_bytes()
    assert (tmp_path / "one.idx").read_bytes() == (tmp_path / "two.idx").read_bytes()
    assert IndexedDataset(tmp_path / "one").document(0).tolist() == tok(texts[0], add_special_tokens=False)["input_ids"]


def test_dtype_follows_gpt_neox_rule():
    assert best_fitting_dtype(50277) == np.uint16
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32


def test_indexed_source_packs_like_the_jsonl_it_came_from(tmp_path, tok, questions):
    path, _ = questions
    write_indexed_dataset([path], tok, tmp_path / "q")
    as_indexed = DataConfig(validation=[DataSource(path=str(tmp_path / "q"))], mode="pack")
    as_jsonl = DataConfig(validation=[DataSource(path=str(path))], mode="pack")
    a = build_eval_loader(as_indexed, tok, seq_length=64, micro_batch_size=4, max_batches=50)
    b = build_eval_loader(as_jsonl, tok, seq_length=64, micro_batch_size=4, max_batches=50)
    assert len(a) == len(b) > 5
    assert all((x["input_ids"] == y["input_ids"]).all() and (x["labels"] == y["labels"]).all() for x, y in zip(a, b))


def test_tokens_per_epoch_exact_from_index_and_counted_for_jsonl(tmp_path, tok, questions):
    path, texts = questions
    write_indexed_dataset([path], tok, tmp_path / "q")
    total = sum(len(ids) + 1 for ids in tok(texts, add_special_tokens=False)["input_ids"])
    assert tokens_per_epoch(DataConfig(sources=[DataSource(path=str(tmp_path / "q"), format="indexed")]), tok) == total
    assert tokens_per_epoch(DataConfig(sources=[DataSource(path=str(path))]), tok) == total
    two = DataConfig(sources=[DataSource(path=str(path)), DataSource(path=str(tmp_path / "q"))])
    assert tokens_per_epoch(two, tok) is None


def test_gsm8k_tokens_per_epoch_feeds_gpt_neox_epoch_count(tok):
    path = shared_path("corpora/gsm8k/train.jsonl")
    tokens = tokens_per_epoch(DataConfig(sources=[DataSource(path=str(path), text_key="question")]), tok)
    assert tokens is not None and 300_000 < tokens < 600_000
    assert gpt_neox_num_epochs(tokens, 2048, (tokens - 1) // 2048) == 1
    assert gpt_neox_num_epochs(tokens, 2048, (tokens - 1) // 2048 + 1) == 2


def _written(tmp_path, tok, questions):
    write_indexed_dataset([questions[0]], tok, tmp_path / "d")
    return tmp_path / "d.bin", tmp_path / "d.idx"


def test_truncated_bin_names_the_file(tmp_path, tok, questions):
    bin_path, _ = _written(tmp_path, tok, questions)
    bin_path.write_bytes(bin_path.read_bytes()[:-10])
    with pytest.raises(DataError, match=r"d\.bin.*truncated"):
        IndexedDataset(tmp_path / "d")


def test_bad_magic_and_truncated_index_name_the_file(tmp_path, tok, questions):
    _, idx_path = _written(tmp_path, tok, questions)
    good = idx_path.read_bytes()
    idx_path.write_bytes(b"TNTIDX\x00\x00\x00" + good[9:])
    with pytest.raises(DataError, match=r"d\.idx.*bad magic"):
        IndexedDataset(tmp_path / "d")
    idx_path.write_bytes(good[:-8])
    with pytest.raises(DataError, match=r"d\.idx.*truncated"):
        IndexedDataset(tmp_path / "d")
    idx_path.write_bytes(good[:20])
    with pytest.raises(DataError, match=r"d\.idx.*truncated"):
        IndexedDataset(tmp_path / "d")


def test_missing_idx_names_the_file(tmp_path, tok, questions):
    bin_path, idx_path = _written(tmp_path, tok, questions)
    idx_path.unlink()
    with pytest.raises(DataError, match=r"d\.idx.*not found"):
        IndexedDataset(tmp_path / "d")
    cfg = DataConfig(validation=[DataSource(path=str(tmp_path / "d"), format="indexed")], mode="pack")
    with pytest.raises(DataError, match=r"d\.idx"):
        build_eval_loader(cfg, tok, seq_length=16, micro_batch_size=1, max_batches=1)
