"""The `neox_hf` command line end to end: a GPT-NeoX TP2 checkpoint + its YAML → `convert-neox` → a folder stock
transformers loads with the GPT-NeoX reference logits; `export-neox` back; `preprocess` → `.bin/.idx`; and
`export` of a ZeRO-3 training checkpoint → the same weights as the run's final folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

from neox_reference import neox_reference_logits
from test_neox_checkpoint import HEADS, HIDDEN, INPUT_IDS, LAYERS, random_neox_shards, tiny_config, write_neox_checkpoint
from tests.conftest import REPO, launch_env


def neox_hf(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "neox_hf.cli", *args], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env=launch_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def word_tokenizer(path: Path, size: int = 100) -> Path:
    """A 100-token tokenizers JSON with GPT-NeoX's special tokens at ids 0 and 1 (GPT-NeoX pads it to 128 rows)."""
    vocab = {"<|endoftext|>": 0, "<|padding|>": 1, **{f"w{i}": i for i in range(2, size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


@pytest.mark.distributed  # slow tier: a whole run in a subprocess or in process
def test_convert_neox_tp2_checkpoint_via_cli(tmp_path):
    config = tiny_config(parallel_residual=True, tied=False)
    ranks = random_neox_shards(config, tp=2)
    write_neox_checkpoint(ranks, tmp_path / "ckpt", "pipeline")
    tokenizer_file = word_tokenizer(tmp_path / "tok.json")
    neox_yaml = tmp_path / "tiny.yml"
    neox_yaml.write_text(
        '{\n  "num-layers": %d, "hidden-size": %d, "num-attention-heads": %d, "seq-length": 64,\n'
        '  "max-position-embeddings": 64, "rotary-pct": 0.5, "gpt-j-residual": true, "no-weight-tying": true,\n'
        '  "make-vocab-size-divisible-by": 64, "model-parallel-size": 2, "bias-gelu-fusion": false,\n'
        '  "tokenizer-type": "HFTokenizer", "vocab-file": "%s",\n}\n' % (LAYERS, HIDDEN, HEADS, tokenizer_file)
    )
    out = tmp_path / "hf"
    neox_hf("convert-neox", str(tmp_path / "ckpt"), "--config", str(neox_yaml), str(out))
    model = AutoModelForCausalLM.from_pretrained(out).eval()  # stock transformers, no remote code
    assert json.loads((out / "config.json").read_text())["architectures"] == ["GPTNeoXForCausalLM"]
    assert AutoTokenizer.from_pretrained(out).pad_token == "<|padding|>"
    with torch.no_grad():
        logits = model(INPUT_IDS).logits
    torch.testing.assert_close(logits, neox_reference_logits(ranks, config, INPUT_IDS), atol=1e-5, rtol=0)

    back = tmp_path / "neox_again"
    neox_hf("export-neox", str(out), str(back), "--tp", "2", "--step", "3")
    assert sorted(p.name for p in (back / "global_step3").iterdir()) == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]


def test_preprocess_writes_gpt_neox_indexed_dataset(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t}) for t in ["Hello world", "", "GPT-NeoX packs documents"]) + "\n")
    neox_hf("preprocess", str(jsonl), "--tokenizer", str(REPO / "examples/data/gpt-neox-20b-tokenizer.json"),
            "--output-prefix", str(tmp_path / "corpus"), "--append-eod")
    from neox_hf.data import IndexedDataset

    dataset = IndexedDataset(tmp_path / "corpus")
    assert len(dataset) == 2  # the empty document is dropped, as GPT-NeoX's preprocess_data.py does
    assert list(dataset.document(0)) == [12092, 1533, 0]  # "Hello world" + EOD
    assert (tmp_path / "corpus.idx").read_bytes()[:9] == b"MMIDIDX\x00\x00"


def tiny_neox_yaml(path: Path, extra: str = "") -> Path:
    """The GPT-NeoX config of `tiny_config(parallel_residual=False, tied=True)` at TP 2, naming no vocab file."""
    path.write_text(
        '{"num-layers": %d, "hidden-size": %d, "num-attention-heads": %d, "seq-length": 64, "rotary-pct": 0.5,\n'
        ' "gpt-j-residual": false, "no-weight-tying": false, "model-parallel-size": 2%s}\n'
        % (LAYERS, HIDDEN, HEADS, extra)
    )
    return path


def test_convert_neox_without_tokenizer_reads_the_vocabulary_from_the_checkpoint(tmp_path):
    config = tiny_config(parallel_residual=False, tied=True)  # 128 rows: not GPT-NeoX-20B's 50,304
    ranks = random_neox_shards(config, tp=2, seed=3)
    write_neox_checkpoint(ranks, tmp_path / "ckpt", "sequential")
    out = tmp_path / "hf"
    neox_yaml = tiny_neox_yaml(tmp_path / "tiny.yml")
    done = neox_hf("convert-neox", str(tmp_path / "ckpt"), "--config", str(neox_yaml), str(out))
    assert "vocabulary size 128 read from the checkpoint" in done.stdout and "--tokenizer" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 128
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(INPUT_IDS).logits
    torch.testing.assert_close(logits, neox_reference_logits(ranks, config, INPUT_IDS), atol=1e-5, rtol=0)


def test_convert_neox_refuses_a_vocab_file_that_is_not_here(tmp_path, capsys):
    from neox_hf.cli import main

    write_neox_checkpoint(random_neox_shards(tiny_config(parallel_residual=False, tied=True), tp=2), tmp_path / "ckpt",
                          "sequential")
    # as on a machine without the training data: guessing the vocabulary would drop the tokenizer silently
    neox_yaml = tiny_neox_yaml(tmp_path / "tiny.yml", ', "vocab-file": "/nowhere/20B_tokenizer.json"')
    assert main(["convert-neox", str(tmp_path / "ckpt"), "--config", str(neox_yaml), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "/nowhere/20B_tokenizer.json" in err and "--tokenizer" in err, err
    assert not (tmp_path / "hf").exists()
