"""Sources: every local format gives the same token documents, templates and prompt masks, skipped rows
are counted, weighted blending, per-rank disjointness, and the validation hold-out."""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
from data_common import (GSM8K_PROMPT, gsm8k_rows, gsm8k_source, neox_tokenizer,  # noqa: E402
                         numbered_texts, shared_path, write_jsonl)

from neox_hf.data import build_eval_loader, build_train_loader, document_stream, write_indexed_dataset  # noqa: E402
from neox_hf.data.sources import source_format  # noqa: E402
from neox_hf.errors import DataError  # noqa: E402
from neox_hf.recipe import DataConfig, DataSource  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return neox_tokenizer()


def usable_documents(sources, tok, **kwargs) -> list[list[int]]:
    kwargs.setdefault("shuffle", False)
    return [row["input_ids"] for row in document_stream(sources, tok, epoch=0, seed=1, **kwargs) if row["skip"] == ""]


def expected_ids(tok, texts):
    return [ids + [tok.eos_token_id] for ids in tok(texts, add_special_tokens=False)["input_ids"]]


def write_every_format(tmp_path, rows, tok):
    texts = "".join(json.dumps(r) + "\n" for r in rows).encode()
    write_jsonl(tmp_path / "docs.jsonl", rows)
    (tmp_path / "docs.json").write_text(json.dumps(rows))
    with gzip.open(tmp_path / "docs.jsonl.gz", "wb") as f:
        f.write(texts)
    (tmp_path / "docs.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(texts))
    pq.write_table(pa.table({"text": [r["text"] for r in rows]}), tmp_path / "docs.parquet")
    (tmp_path / "docs.txt").write_text("\n\n".join(r["text"] for r in rows) + "\n")
    write_indexed_dataset([tmp_path / "docs.jsonl"], tok, tmp_path / "docs_text_document")
    return ["docs.jsonl", "docs.json", "docs.jsonl.gz", "docs.jsonl.zst", "docs.parquet", "docs.txt", "docs_text_document"]


def test_every_local_format_gives_the_same_documents(tmp_path, tok):
    rows = numbered_texts("fmt", 25)
    expected = expected_ids(tok, [r["text"] for r in rows])
    for name in write_every_format(tmp_path, rows, tok):
        source = DataSource(path=str(tmp_path / name))
        assert usable_documents([source], tok) == expected, name
    assert source_format(DataSource(path=str(tmp_path / "docs_text_document"))) == "indexed"


def test_non_streaming_gives_the_same_documents(tmp_path, tok):
    rows = numbered_texts("ns", 12)
    write_every_format(tmp_path, rows, tok)
    for name in ("docs.json", "docs.parquet"):
        source = DataSource(path=str(tmp_path / name))
        assert usable_documents([source], tok, streaming=False) == usable_documents([source], tok), name


def test_glob_reads_every_matching_file(tmp_path, tok):
    write_jsonl(tmp_path / "a-0.jsonl", numbered_texts("a0", 5))
    write_jsonl(tmp_path / "a-1.jsonl", numbered_texts("a1", 7))
    assert len(usable_documents([DataSource(path=str(tmp_path / "a-*.jsonl"))], tok)) == 12
    with pytest.raises(DataError, match="no file matches"):
        usable_documents([DataSource(path=str(tmp_path / "b-*.jsonl"))], tok)


def test_tinyshakespeare_is_split_into_speeches_at_blank_lines(tok):
    path = shared_path("corpora/tinyshakespeare/input.txt")
    speeches = [p for p in re.split(r"\n\s*\n", path.read_text()) if p.strip()]
    docs = usable_documents([DataSource(path=str(path))], tok)
    assert len(docs) == len(speeches) > 7000
    assert docs[0] == expected_ids(tok, [speeches[0].strip("\n")])[0]
    assert tok.decode(docs[-1][:-1]) == speeches[-1].strip("\n")


def test_gsm8k_template_joins_fields(tok):
    rows = gsm8k_rows(3)
    docs = usable_documents([gsm8k_source()], tok)[:3]
    assert docs == expected_ids(tok, [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows])


def test_prompt_tokens_are_masked_and_answer_tokens_learned(tok):
    cfg = DataConfig(sources=[gsm8k_source(prompt_template=GSM8K_PROMPT)], mode="pad", validation=[],
                     buffer_size=8, shuffle=False)
    cfg.validation = cfg.sources  # the eval loader gives the stream in file order
    batches = build_eval_loader(cfg, tok, seq_length=512, micro_batch_size=8, max_batches=1)
    rows = {r["question"]: r for r in gsm8k_rows(8)}
    assert len(batches) == 1
    for ids, labels, mask in zip(batches[0]["input_ids"], batches[0]["labels"], batches[0]["attention_mask"]):
        n = int(mask.sum())
        text = tok.decode(ids[:n])
        row = next(r for q, r in rows.items() if text.startswith(f"Question: {q}\n"))
        learned = labels[labels != -100]
        decoded = tok.decode(learned)
        prompt_tokens = len(tok(GSM8K_PROMPT.format(**row), add_special_tokens=False)["input_ids"])
        assert (labels[: prompt_tokens - 2] == -100).all()  # every target inside the prompt is masked
        assert decoded.strip().startswith(row["answer"]) and decoded.endswith("<|endoftext|>")
        assert "Question:" not in decoded
        assert (text + "<|endoftext|>").endswith(decoded)


def test_prompt_that_is_not_a_prefix_is_refused(tok):
    source = gsm8k_source(prompt_template="Q: {question}")
    with pytest.raises(DataError, match="prefix"):
        usable_documents([source], tok)


def test_empty_and_undecodable_documents_are_counted_not_fatal(tmp_path, tok):
    bad = [b'{"text": ""}', b'{"text": "   \\n "}', b'{"other": 1}', b'{"text": null}', b'{"text": 7}',
           b'{"text": "bad \xff\xfe bytes"}', b'{not json', b'{"text": "lone \\ud800 surrogate"}']
    good = [json.dumps(r).encode() for r in numbered_texts("ok", 3)]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(bad + good) + b"\n")
    txt = tmp_path / "mixed.txt"
    txt.write_bytes(b"fine speech\n\nbroken \xff speech\n\nlast speech\n")
    cfg = DataConfig(sources=[DataSource(path=str(path))], mode="pad", buffer_size=3, shuffle=False)
    loader = build_train_loader(cfg, tok, seq_length=64, micro_batch_size=3)
    batch = next(loader)
    assert batch["input_ids"].shape[0] == 3
    assert {k: loader.stats[k] for k in ("documents", "skipped_empty", "skipped_undecodable")} == {
        "documents": 3, "skipped_empty": 2, "skipped_undecodable": 6}
    cfg = DataConfig(sources=[DataSource(path=str(txt))], mode="pad", buffer_size=2, shuffle=False)
    loader = build_train_loader(cfg, tok, seq_length=64, micro_batch_size=2)
    next(loader)
    assert (loader.stats["documents"], loader.stats["skipped_undecodable"]) == (2, 1)


def test_a_source_with_no_usable_document_fails_with_the_reason(tmp_path, tok):
    write_jsonl(tmp_path / "q.jsonl", [{"question": "x"}] * 4)
    cfg = DataConfig(sources=[DataSource(path=str(tmp_path / "q.jsonl"), text_key="content")], mode="pack")
    with pytest.raises(DataError, match="4 undecodable"):
        next(build_train_loader(cfg, tok, seq_length=16, micro_batch_size=1))


def test_blending_follows_the_weights_and_the_seed(tmp_path, tok):
    write_jsonl(tmp_path / "a.jsonl", [{"text": f"alpha {i}"} for i in range(10_000)])
    write_jsonl(tmp_path / "b.jsonl", [{"text": f"beta {i}"} for i in range(10_000)])
    sources = [DataSource(path=str(tmp_path / "a.jsonl"), weight=7.0), DataSource(path=str(tmp_path / "b.jsonl"), weight=3.0)]
    alpha = tok("alpha", add_special_tokens=False)["input_ids"][0]

    def first_tokens(seed, n):
        stream = document_stream(sources, tok, epoch=0, seed=seed)
        return [row["input_ids"][0] for _, row in zip(range(n), stream)]

    firsts = first_tokens(5, 10_000)
    share = sum(t == alpha for t in firsts) / len(firsts)
    assert abs(share - 0.7) < 0.015  # 3 standard deviations of a 10k-draw binomial
    assert first_tokens(5, 500) == firsts[:500]
    assert first_tokens(6, 500) != firsts[:500]


@pytest.mark.parametrize("n_files", [1, 2])
def test_ranks_see_disjoint_documents_and_none_is_lost(tmp_path, tok, n_files):
    for f in range(n_files):
        write_jsonl(tmp_path / f"r{f}.jsonl", numbered_texts(f"file{f}", 51 + f))
    source = DataSource(path=str(tmp_path / "r*.jsonl"))
    everything = Counter(map(tuple, usable_documents([source], tok)))
    ranks = [Counter(map(tuple, usable_documents([source], tok, dp_rank=r, dp_size=2, shuffle=True))) for r in (0, 1)]
    assert not set(ranks[0]) & set(ranks[1])
    assert ranks[0] + ranks[1] == everything
    assert min(sum(r.values()) for r in ranks) > 0


def test_validation_fraction_holds_out_documents_train_never_sees(tmp_path, tok):
    write_jsonl(tmp_path / "v.jsonl", numbered_texts("held", 400))
    source = DataSource(path=str(tmp_path / "v.jsonl"))
    train = set(map(tuple, usable_documents([source], tok, role="train", fraction=0.2)))
    held = set(map(tuple, usable_documents([source], tok, role="validation", fraction=0.2)))
    assert not train & held and len(train | held) == 400
    assert 0.13 < len(held) / 400 < 0.27
    cfg = DataConfig(sources=[source], mode="pad", validation_fraction=0.2, buffer_size=50)
    evals = build_eval_loader(cfg, tok, seq_length=64, micro_batch_size=8, max_batches=100)
    again = build_eval_loader(cfg, tok, seq_length=64, micro_batch_size=8, max_batches=100)
    assert sum(b["input_ids"].shape[0] for b in evals) == len(held)
    assert all((a["input_ids"] == b["input_ids"]).all() for a, b in zip(evals, again))
    assert build_eval_loader(DataConfig(sources=[source]), tok, seq_length=64, micro_batch_size=8, max_batches=4) == []
