"""Data faults a user meets, through the user's path: a compressed download cut short, a blended source that gives no
document, prompt-masked data without answers, one huge document, documents cut to max_length in pad mode.

Each is refused in one `error:` line (exit 2, no traceback) naming the file and the fix, or trained on with a line
that says what happened. The in-process runs use recipes/tiny.yaml shrunk to a few steps of a short sequence.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

import pytest
import zstandard

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
from data_common import neox_tokenizer, write_jsonl  # noqa: E402

from neox_hf.data import build_train_loader, document_stream  # noqa: E402
from neox_hf.errors import DataError  # noqa: E402
from neox_hf.recipe import DataConfig, DataSource  # noqa: E402
from tests.conftest import BUNDLED_TOKENIZER, REPO  # noqa: E402

TINY = str(REPO / "recipes" / "tiny.yaml")


@pytest.fixture(scope="module")
def tok():
    return neox_tokenizer()


def run_train(tmp_path: Path, sources: str, capsys, *extra: str) -> tuple[int, str, str]:
    """recipes/tiny.yaml on `sources` (a YAML list), 2 steps of 32 tokens, no eval: (exit code, stdout, stderr)."""
    from neox_hf.cli import train_main as main

    code = main([TINY, "--tokenizer.path", str(BUNDLED_TOKENIZER), "--output.dir", str(tmp_path / "out"),
                 "--data.sources", sources, "--data.validation_fraction", "0", "--model.seq_length", "32",
                 "--train.micro_batch_size", "2", "--train.train_iters", "2", "--train.eval_iters", "0",
                 "--train.log_interval", "1", "--train.precision", "fp32", *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    for needle in needles:
        assert needle in errors[0], errors[0]


def jsonl_bytes(n: int, prefix: str = "doc") -> bytes:
    return "".join(json.dumps({"text": f"{prefix} {i} " + "words and more words " * 20}) + "\n"
                   for i in range(n)).encode()


def cut_in_half(data: bytes) -> bytes:
    return data[: len(data) // 2]


# ----------------------------------------------------------------------------------------------------------------
# a. A compressed file cut short (an interrupted download)
# ----------------------------------------------------------------------------------------------------------------

COMPRESSORS = {"jsonl.gz": gzip.compress, "jsonl.zst": zstandard.ZstdCompressor().compress}


@pytest.mark.parametrize("suffix", sorted(COMPRESSORS))
def test_truncated_compressed_file_is_refused_while_streaming(tmp_path, tok, suffix):
    """The read-time path (no start-up check ran): the error names the file, from inside `datasets` iteration."""
    cut = tmp_path / f"cut.{suffix}"
    cut.write_bytes(cut_in_half(COMPRESSORS[suffix](jsonl_bytes(2000))))
    with pytest.raises(DataError, match=r"cut\.jsonl\.(gz|zst) is truncated \(compressed stream ends early\): "
                                        "download it again"):
        list(document_stream([DataSource(path=str(cut))], tok, epoch=0, seed=1))


@pytest.mark.parametrize("suffix", sorted(COMPRESSORS))
def test_truncated_compressed_file_in_a_glob_is_refused_before_any_batch(tmp_path, tok, suffix):
    """One shard of a glob cut short: refused when the loader is built, before a document of any shard is used."""
    compress = COMPRESSORS[suffix]
    (tmp_path / f"a-0.{suffix}").write_bytes(compress(jsonl_bytes(50, "first")))
    (tmp_path / f"a-1.{suffix}").write_bytes(cut_in_half(compress(jsonl_bytes(2000, "second"))))
    cfg = DataConfig(sources=[DataSource(path=str(tmp_path / f"a-*.{suffix}"))], mode="pack")
    with pytest.raises(DataError, match=f"a-1.{suffix} is truncated"):
        build_train_loader(cfg, tok, seq_length=16, micro_batch_size=1)


def test_truncated_download_is_refused_by_the_cli_in_one_line(tmp_path, capsys, fresh_accelerate_state):
    cut = tmp_path / "pile-00.jsonl.zst"
    cut.write_bytes(cut_in_half(zstandard.ZstdCompressor().compress(jsonl_bytes(2000))))
    code, _, err = run_train(tmp_path, f"[{{path: {cut}}}]", capsys)
    assert_one_line_error(code, err, str(cut), "is truncated", "download it again")
    assert not (tmp_path / "out" / "train_log.jsonl").exists()


@pytest.mark.parametrize("suffix", sorted(COMPRESSORS))
def test_intact_compressed_files_of_several_frames_or_members_read_whole(tmp_path, tok, suffix):
    """`cat a.gz b.gz` and multi-frame zstd (pzstd) are complete files: every document of both parts is read."""
    compress = COMPRESSORS[suffix]
    path = tmp_path / f"two.{suffix}"
    path.write_bytes(compress(jsonl_bytes(30, "one")) + compress(jsonl_bytes(20, "two")))
    rows = [r for r in document_stream([DataSource(path=str(path))], tok, epoch=0, seed=1, shuffle=False)
            if r["skip"] == ""]
    assert len(rows) == 50


# ----------------------------------------------------------------------------------------------------------------
# b. A blended source that gives no document
# ----------------------------------------------------------------------------------------------------------------


def blend(tmp_path: Path, bad_name: str, bad: bytes, weight: float = 0.3) -> list[DataSource]:
    write_jsonl(tmp_path / "good.jsonl", [{"text": f"good document {i} with some words"} for i in range(300)])
    (tmp_path / bad_name).write_bytes(bad)
    return [DataSource(path=str(tmp_path / "good.jsonl"), weight=1 - weight),
            DataSource(path=str(tmp_path / bad_name), weight=weight)]


@pytest.mark.parametrize("content", [b"", b"\n  \n\n"], ids=["empty", "blank-lines"])
def test_an_empty_source_in_a_blend_is_refused_when_the_loader_is_built(tmp_path, tok, content):
    cfg = DataConfig(sources=blend(tmp_path, "empty.jsonl", content), mode="pack")
    with pytest.raises(DataError, match=r"data source `.*empty\.jsonl` holds no document: .*empty\.jsonl is empty"):
        build_train_loader(cfg, tok, seq_length=16, micro_batch_size=2)


@pytest.mark.parametrize("lines,counts", [
    (b"{not json\n" * 5, r"0 empty, \d+ undecodable"),
    (b'{"content": "the wrong field"}\n' * 5, r"0 empty, \d+ undecodable"),
    (b'{"text": ""}\n{"text": "   "}\n' * 3, r"\d+ empty, 0 undecodable"),
], ids=["invalid-json", "wrong-field", "empty-texts"])
def test_a_blended_source_without_a_usable_document_is_refused_by_name(tmp_path, tok, lines, counts):
    """A small bad source is cycled until the good one is used up: refused at the end of the blend's epoch."""
    cfg = DataConfig(sources=blend(tmp_path, "bad.jsonl", lines), mode="pack", buffer_size=50)
    loader = build_train_loader(cfg, tok, seq_length=16, micro_batch_size=2)
    with pytest.raises(DataError, match=rf"data source `.*bad\.jsonl` gave no usable document in a whole epoch "
                                        rf"\({counts}\)"):
        for _ in range(200):
            next(loader)


def test_a_large_blended_source_without_a_usable_document_is_refused_early(tmp_path, tok):
    """Its first pass would take the whole run: refused after its first 1,000 documents all failed."""
    cfg = DataConfig(sources=blend(tmp_path, "bad.jsonl", b"{not json\n" * 100_000, weight=0.5), mode="pack",
                     buffer_size=100)
    loader = build_train_loader(cfg, tok, seq_length=16, micro_batch_size=2)
    with pytest.raises(DataError, match=r"bad\.jsonl` gave no usable document in its first 1000 documents"):
        for _ in range(2000):
            next(loader)


def test_a_blend_of_usable_sources_trains_past_an_epoch(tmp_path, tok):
    sources = blend(tmp_path, "other.jsonl", b'{"text": "a short one"}\n{"text": ""}\n')
    loader = build_train_loader(DataConfig(sources=sources, mode="pack", buffer_size=50), tok, seq_length=16,
                                micro_batch_size=2)
    for _ in range(300):
        next(loader)
    assert loader.stats["skipped_empty"] > 0


def test_empty_source_is_refused_by_the_cli_in_one_line(tmp_path, capsys, fresh_accelerate_state):
    sources = blend(tmp_path, "empty.jsonl", b"")
    code, _, err = run_train(tmp_path, "[" + ", ".join(f"{{path: {s.path}, weight: {s.weight}}}" for s in sources)
                             + "]", capsys)
    assert_one_line_error(code, err, "empty.jsonl", "holds no document")


# ----------------------------------------------------------------------------------------------------------------
# c. Prompt-masked data without answers
# ----------------------------------------------------------------------------------------------------------------

SFT_TEMPLATE, SFT_PROMPT = "Question: {question}\nAnswer: {answer}", "Question: {question}\nAnswer: "


def sft_file(tmp_path: Path, answers: list[str]) -> Path:
    rows = [{"question": f"what is {i} plus {i}?", "answer": a} for i, a in enumerate(answers)]
    return write_jsonl(tmp_path / "sft.jsonl", rows)


def sft_source(path: Path, **overrides) -> str:
    fields = dict(path=str(path), template=SFT_TEMPLATE, prompt_template=SFT_PROMPT, **overrides)
    return "[{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in fields.items()) + "}]"


@pytest.mark.parametrize("append_eod", ["true", "false"])
@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_prompt_masked_data_without_answers_is_refused(tmp_path, capsys, fresh_accelerate_state, mode, append_eod):
    """Every answer empty: nothing to learn (or only EOD after every prompt), which trained at loss 0.0 / NaN."""
    path = sft_file(tmp_path, [""] * 8)
    code, _, err = run_train(tmp_path, sft_source(path), capsys, "--data.mode", mode, "--data.append_eod", append_eod)
    assert_one_line_error(code, err, "sft.jsonl", "no document with answer tokens", "`template` / `prompt_template`")
    assert not (tmp_path / "out" / "train_log.jsonl").exists()


def test_prompt_template_equal_to_template_is_refused(tmp_path, tok):
    path = sft_file(tmp_path, [str(2 * i) for i in range(8)])
    source = DataSource(path=str(path), template=SFT_PROMPT, prompt_template=SFT_PROMPT)
    loader = build_train_loader(DataConfig(sources=[source], mode="pad"), tok, seq_length=64, micro_batch_size=2)
    with pytest.raises(DataError, match="sft.jsonl` gave no document with answer tokens"):
        next(loader)


def test_some_empty_answers_learn_only_eod_and_are_counted(tmp_path, tok):
    """With EOD appended, an empty answer still teaches the model to stop after that prompt: kept, counted, noted."""
    from neox_hf.data import DataNotes

    answers = ["", "4", "", "8", "10", "", "14", "16"]
    cfg = DataConfig(sources=[DataSource(path=str(sft_file(tmp_path, answers)), template=SFT_TEMPLATE,
                                         prompt_template=SFT_PROMPT)], mode="pad", buffer_size=8, shuffle=False)
    loader = build_train_loader(cfg, tok, seq_length=64, micro_batch_size=8)
    batch = next(loader)
    learned = (batch["labels"] != -100).sum(dim=1).tolist()
    assert sorted(learned)[:3] == [1, 1, 1] and min(sorted(learned)[3:]) > 1  # the EOD alone, three times
    assert (loader.stats["documents"], loader.stats["no_answer"]) == (8, 3)
    notes = DataNotes(max_length=64)
    assert notes.lines(loader.stats) == ["3 of 8 documents have no answer tokens after `prompt_template`: only their "
                                         "EOD is learned (if that is not meant, check `template` / `prompt_template` "
                                         "and the answer field)"]
    assert notes.lines({**loader.stats, "no_answer": 5}) == []  # said again when it has doubled
    assert len(notes.lines({**loader.stats, "no_answer": 6})) == 1


def test_empty_answers_without_eod_are_skipped_not_trained_at_zero_tokens(tmp_path, tok):
    """Without EOD an empty answer has no labelled token at all: it is skipped (as empty), so no row of a batch is
    all -100."""
    answers = ["", "4", "", "8", "10", "", "14", "16"]
    cfg = DataConfig(sources=[DataSource(path=str(sft_file(tmp_path, answers)), template=SFT_TEMPLATE,
                                         prompt_template=SFT_PROMPT)], mode="pad", buffer_size=5, shuffle=False,
                     append_eod=False)
    loader = build_train_loader(cfg, tok, seq_length=64, micro_batch_size=5)
    batch = next(loader)
    assert ((batch["labels"] != -100).sum(dim=1) > 0).all()
    assert (loader.stats["documents"], loader.stats["skipped_empty"]) == (5, 3)


# ----------------------------------------------------------------------------------------------------------------
# d. One very large document
# ----------------------------------------------------------------------------------------------------------------


def counting_tokenizer():
    """The real GPT-NeoX tokenizer, counting the characters it is asked to tokenize."""
    from transformers import PreTrainedTokenizerFast

    from data_common import shared_path

    class CountingTokenizer(PreTrainedTokenizerFast):
        characters = 0

        def __call__(self, text, *args, **kwargs):
            type(self).characters += sum(map(len, text)) if isinstance(text, list) else len(text)
            return super().__call__(text, *args, **kwargs)

    return CountingTokenizer(tokenizer_file=str(shared_path("tokenizers/gpt-neox-20b.json")),
                             eos_token="<|endoftext|>", pad_token="<|padding|>")


def one_megabyte_document(tmp_path: Path) -> tuple[Path, int]:
    text = " ".join(f"word{i % 997} and more" for i in range(100_000))[: 2**20]
    return write_jsonl(tmp_path / "big.jsonl", [{"text": text}]), len(text)


@pytest.mark.parametrize("mode,passes", [("pack", 1), ("pad", 2)])
def test_a_one_megabyte_document_is_tokenized_once_per_pass_not_once_per_buffer_slot(tmp_path, mode, passes):
    """A corpus of one huge document: the loader filled a buffer of `buffer_size` documents by reading the corpus
    `buffer_size` times (1,000 tokenizations of 1 MB, minutes and gigabytes before the first step). Now a buffer
    also stops at `buffer_size` windows' worth of tokens: the first batch costs one read of the document in pack
    mode (its ~260k tokens make thousands of windows), and one read per example in pad mode (each is the document's
    first max_length tokens)."""
    tok = counting_tokenizer()
    path, characters = one_megabyte_document(tmp_path)
    cfg = DataConfig(sources=[DataSource(path=str(path))], mode=mode)  # the default buffer of 1,000 documents
    loader = build_train_loader(cfg, tok, seq_length=64, micro_batch_size=2)
    batch = next(loader)
    assert batch["input_ids"].shape == (2, 64)
    assert loader.stats["documents"] == passes
    assert type(tok).characters == passes * characters
    if mode == "pack":
        for _ in range(100):  # the next batches are cut from the same buffer: no more tokenizing
            next(loader)
        assert type(tok).characters == characters


# ----------------------------------------------------------------------------------------------------------------
# e. Documents cut to max_length in pad mode
# ----------------------------------------------------------------------------------------------------------------


def long_and_short_documents(tmp_path: Path) -> Path:
    rows = [{"text": ("a long document that goes on " * 30 if i % 3 == 0 else f"short {i}")} for i in range(30)]
    return write_jsonl(tmp_path / "long.jsonl", rows)


def test_pad_mode_counts_documents_cut_to_max_length_and_says_so(tmp_path, tok):
    from neox_hf.data import DataNotes

    cfg = DataConfig(sources=[DataSource(path=str(long_and_short_documents(tmp_path)))], mode="pad", buffer_size=30,
                     max_length=32, shuffle=False)
    loader = build_train_loader(cfg, tok, seq_length=64, micro_batch_size=3)
    batches = [next(loader) for _ in range(10)]
    assert max(b["input_ids"].shape[1] for b in batches) == 32
    assert (loader.stats["documents"], loader.stats["truncated"]) == (30, 10)
    assert DataNotes(max_length=32).lines(loader.stats) == [
        "10 of 30 documents were longer than max_length (32 tokens) and were cut to it; raise `data.max_length` or use "
        "`data.mode: pack` to train on their ends"]


def test_a_run_in_pad_mode_says_how_many_documents_were_cut(tmp_path, capsys, fresh_accelerate_state):
    code, out, err = run_train(tmp_path, f"[{{path: {long_and_short_documents(tmp_path)}}}]", capsys,
                               "--data.mode", "pad", "--data.shuffle", "false")
    assert code == 0, err
    assert "documents were longer than max_length (32 tokens) and were cut to it" in out
