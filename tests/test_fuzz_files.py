"""File fuzz over every load path: a damaged file (truncated, bit-flipped, or random bytes after each leading byte
0x00–0xff) is one line naming the file, exit status 2, never a traceback.

Two tiers: each reader every load path goes through (torch.save files: `io.load_torch_safely`, the GPT-NeoX layer and
optimizer readers; `.npy` index caches; `.bin/.idx`; preference jsonl), fed every variant in-process; then the
commands themselves (`convert-neox`, `continue-neox`, `batches`, `merge`, `export`, `--resume`) through
`neox_hf.cli.main` on a sample of them, and two real processes to prove the entry point."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from neox_hf.errors import NeoXHFError
from tests.conftest import REPO, launch_env


def damaged_variants(data: bytes, leading: range = range(256)) -> dict[str, bytes]:
    """Truncated (empty, one byte, half, all but the last), bit-flipped (header, middle, end), and 48 random bytes
    after each leading byte (a pickle's first byte is its opcode: 0x87 makes torch's unpickler raise IndexError)."""
    rng = random.Random(0)
    variants = {"empty": b"", "one-byte": data[:1], "half": data[: len(data) // 2], "last-byte-cut": data[:-1]}
    for at in (0, 1, 8, len(data) // 2, len(data) - 1):
        flipped = bytearray(data)
        flipped[at] ^= 0x10
        variants[f"flip@{at}"] = bytes(flipped)
    for lead in leading:
        variants[f"lead-{lead:02x}"] = bytes([lead]) + bytes(rng.randrange(256) for _ in range(48))
    return variants


def refusals_of(reader, path: Path, original: bytes, leading: range = range(256)) -> tuple[int, list]:
    """Feed `reader(path)` every damaged variant of `original`: (variants tried, the ones that escaped as anything
    but a one-line NeoXHFError naming the file)."""
    escaped = []
    variants = damaged_variants(original, leading)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about an unknown pickle protocol byte: expected here
        for name, data in variants.items():
            path.write_bytes(data)
            try:
                reader(path)
            except NeoXHFError as err:
                if "\n" in str(err) or path.name not in str(err):
                    escaped.append((name, f"not one line naming {path.name}: {err}"))
            except Exception as err:  # noqa: BLE001 — the point of the fuzz
                escaped.append((name, f"{type(err).__name__}: {err}"))
    path.write_bytes(original)
    return len(variants), escaped


# ---------------------------------------------------------------------------------------------------- readers


def test_every_reader_refuses_every_damaged_file_in_one_line_naming_it(tmp_path):
    from neox_hf.data.indexed import IndexedDataset, index_bytes
    from neox_hf.data.preference import read_pairs
    from neox_hf.interop.continue_neox import load_optimizer_file
    from neox_hf.interop.neox_files import load_torch_file
    from neox_hf.io import load_npy_safely, load_torch_safely
    from neox_hf.recipe import DataSource

    torch_file = tmp_path / "state.pt"
    torch.save({"weight": torch.arange(12.0).reshape(3, 4), "step": 7, "names": ["a", "b"]}, torch_file)
    npy = tmp_path / "c_train_indexmap_doc_idx.npy"
    np.save(npy, np.arange(40, dtype=np.int32))
    sizes = [5, 7, 3, 9]
    (tmp_path / "c.idx").write_bytes(index_bytes(sizes, np.uint16))
    (tmp_path / "c.bin").write_bytes(np.arange(sum(sizes), dtype=np.uint16).tobytes())
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": f"yes {i}", "rejected": f"no {i}"}) + "\n"
                             for i in range(8)))
    every, sample = range(256), range(0, 256, 15)  # 0x87 is in both
    cases = {  # name: (reader, file, leading bytes)
        "load_torch_safely": (load_torch_safely, torch_file, every),
        "GPT-NeoX layer file": (load_torch_file, torch_file, sample),
        "GPT-NeoX optimizer partition": (load_optimizer_file, torch_file, sample),
        "index cache .npy": (lambda p: np.asarray(load_npy_safely(p)), npy, every),
        ".idx": (lambda p: IndexedDataset(tmp_path / "c"), tmp_path / "c.idx", every),
        ".bin": (lambda p: IndexedDataset(tmp_path / "c"), tmp_path / "c.bin", sample),
        "preference jsonl": (lambda p: read_pairs([DataSource(path=str(p))]), pairs, sample),
    }
    assert 0x87 in every and 0x87 in sample
    tried, escaped = 0, {}
    for name, (reader, path, leading) in cases.items():
        n, bad = refusals_of(reader, path, path.read_bytes(), leading)
        tried += n
        if bad:
            escaped[name] = bad[:3]
    assert not escaped, escaped
    assert tried >= 900, tried


def test_a_damaged_preference_parquet_is_one_line_naming_it(tmp_path):
    """Parquet goes through `datasets.load_dataset`, whose pyarrow errors (ArrowInvalid, DatasetGenerationError)
    are not the readers' own: a few variants, each a dataset build."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from neox_hf.data.preference import read_pairs
    from neox_hf.recipe import DataSource

    pairs = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"prompt": ["q0", "q1"], "chosen": ["yes", "yes"], "rejected": ["no", "no"]}), pairs)
    tried, escaped = refusals_of(lambda p: read_pairs([DataSource(path=str(p))]), pairs, pairs.read_bytes(),
                                 range(0x80, 0x88, 7))
    assert not escaped, escaped
    assert tried >= 10


@pytest.mark.parametrize("counted_at_start", [True, False])
def test_a_parquet_text_source_damaged_inside_a_page_is_one_line_naming_it(tmp_path, capsys, monkeypatch,
                                                                         fresh_accelerate_state, counted_at_start):
    """Its footer is whole (the start-up check passes); a page in the middle is not. Read by the start-up's token
    count (a small corpus) or, for a corpus too large to count, first by the training loop's data thread: either way
    exit 2 and one line naming the file and its row group."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from neox_hf.cli import main

    words = [" ".join(random.Random(i).choice(["the", "cat", "sat", "on", "a", "mat"]) for _ in range(40))
             for i in range(200)]
    path = tmp_path / "texts.parquet"
    pq.write_table(pa.table({"text": words}), path, row_group_size=25)
    damaged = bytearray(path.read_bytes())
    damaged[len(damaged) // 2: len(damaged) // 2 + 64] = bytes(64)
    path.write_bytes(bytes(damaged))
    if not counted_at_start:
        monkeypatch.setattr("neox_hf.data.loader.CHEAP_COUNT_BYTES", 0)
    code, err = _run(["train", str(REPO / "recipes" / "tiny.yaml"), "--data.sources", f"[{{path: {path}}}]",
                      "--train.train_iters", "20", "--train.eval_iters", "0", "--train.precision", "fp32",
                      "--output.dir", str(tmp_path / "out")], capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert len(errors) == 1 and str(path) in errors[0] and "row group" in errors[0], errors


# ---------------------------------------------------------------------------------------------------- commands


def _run(argv: list[str], capsys) -> tuple[int, str]:
    from neox_hf.cli import main

    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def _assert_refused(argv: list[str], damaged: Path, capsys, variant: str) -> None:
    """Refused: exit 2, one `error:` line naming the damaged file. A flipped bit may also go unnoticed where the
    format has no checksum (a token of a .bin, a zip's local header that torch does not read): exit 0 then, but
    never a traceback."""
    code, err = _run(argv, capsys)
    assert "Traceback" not in err, err
    if variant.startswith("flip") and code == 0:
        return
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and damaged.name in errors[0], (argv, code, err[-2000:])


COMMAND_VARIANTS = ("half", "flip@8", "lead-87", "lead-50", "lead-ff")  # 0x50: a zip's "PK" starts so


@pytest.fixture(scope="module")
def neox_checkpoint(tmp_path_factory):
    """A GPT-NeoX checkpoint as export-neox writes it (one mp_rank_00_model_states.pt) of a tiny model, and its
    config."""
    from transformers import GPTNeoXForCausalLM

    from neox_hf.interop.convert import neox_hf_config, neox_recipe_and_tokenizer
    from neox_hf.interop.neox_checkpoint import export_neox_checkpoint

    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("neox")
    # a 100-word vocabulary: GPT-NeoX-20B's tokenizer takes a second and a half to load, at every command below
    vocab = {"<|endoftext|>": 0, "<|padding|>": 1, **{f"w{i}": i for i in range(2, 100)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(folder / "words.json"))
    config = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
              "max_position_embeddings": 16, "rotary_pct": 0.25, "no_weight_tying": True, "gpt_j_residual": True,
              "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}, "data_path": "none",
              "vocab_file": str(folder / "words.json"), "tokenizer_type": "HFTokenizer", "train_iters": 2,
              "make_vocab_size_divisible_by": 128}
    config_path = folder / "neox.yml"
    config_path.write_text(json.dumps(config))
    recipe, tokenizer = neox_recipe_and_tokenizer([str(config_path)])
    hf_config = neox_hf_config(recipe, tokenizer)
    torch.manual_seed(0)
    step_dir = Path(export_neox_checkpoint(GPTNeoXForCausalLM(hf_config), hf_config, folder / "ckpt", step=2))
    return step_dir, config_path


def test_convert_and_continue_neox_refuse_a_damaged_checkpoint_file(neox_checkpoint, tmp_path, capsys):
    step_dir, config = neox_checkpoint
    layer = step_dir / "mp_rank_00_model_states.pt"
    original = layer.read_bytes()
    optimizer = step_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    try:
        for name in COMMAND_VARIANTS:
            layer.write_bytes(damaged_variants(original)[name])
            _assert_refused(["convert-neox", str(step_dir), "--config", str(config), str(tmp_path / name)], layer,
                            capsys, name)
            assert not (tmp_path / name).exists() or name.startswith("flip")  # nothing half-written
        layer.write_bytes(original)
        for name in COMMAND_VARIANTS:
            optimizer.write_bytes(damaged_variants(original)[name])
            _assert_refused(["continue-neox", str(step_dir), "--config", str(config), "--out",
                             str(tmp_path / f"run-{name}")], optimizer, capsys, name)
    finally:
        layer.write_bytes(original)
        optimizer.unlink(missing_ok=True)


def test_batches_refuses_a_damaged_bin_or_idx(tmp_path, capsys):
    from neox_hf.data.indexed import index_bytes

    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 50000, size=int(rng.integers(4, 30))) for _ in range(40)]
    prefix = tmp_path / "corpus_text_document"
    config = tmp_path / "neox.yml"
    config.write_text(json.dumps({"num_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
                                  "max_position_embeddings": 16, "train_micro_batch_size_per_gpu": 2,
                                  "train_iters": 4, "seed": 1}))
    originals = {".bin": np.concatenate(docs).astype(np.uint16).tobytes(),
                 ".idx": index_bytes([len(d) for d in docs], np.uint16)}
    for suffix, original in originals.items():
        damaged = prefix.with_suffix(suffix)
        for name in COMMAND_VARIANTS:
            for other, data in originals.items():
                prefix.with_suffix(other).write_bytes(data)
            damaged.write_bytes(damaged_variants(original)[name])
            _assert_refused(["batches", str(config), "--data-path", str(prefix), "--data-parallel", "1",
                             "--start-step", "0", "--end-step", "2", "--output", str(tmp_path / "rows.npy")],
                            damaged, capsys, name)


def test_merge_refuses_a_damaged_adapter(tmp_path, capsys):
    from peft import LoraConfig, get_peft_model
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    base = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1,
                                            num_attention_heads=4, intermediate_size=64,
                                            max_position_embeddings=16))
    base.save_pretrained(tmp_path / "base")
    adapter = get_peft_model(base, LoraConfig(r=2, target_modules=["query_key_value"]))
    adapter.save_pretrained(tmp_path / "adapter")
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    original = weights.read_bytes()
    for name in COMMAND_VARIANTS:
        weights.write_bytes(damaged_variants(original)[name])
        _assert_refused(["merge", str(tmp_path / "base"), str(tmp_path / "adapter"), str(tmp_path / f"out-{name}"),
                         "--force"], weights, capsys, name)
        assert not (tmp_path / f"out-{name}").exists() or name.startswith("flip")


@pytest.mark.distributed  # a process of its own: seconds of imports
def test_a_damaged_file_is_exit_2_and_one_line_in_a_real_process(neox_checkpoint, tmp_path):
    # The 0x87 case of the report, through the installed entry point in a process of its own.
    step_dir, config = neox_checkpoint
    layer = step_dir / "mp_rank_00_model_states.pt"
    original = layer.read_bytes()
    layer.write_bytes(damaged_variants(original)["lead-87"])
    try:
        done = subprocess.run([sys.executable, "-m", "neox_hf.cli", "convert-neox", str(step_dir), "--config",
                               str(config), str(tmp_path / "out")], capture_output=True, text=True,
                              env=launch_env(), cwd=REPO, timeout=300)
    finally:
        layer.write_bytes(original)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(errors) == 1 and layer.name in errors[0] and "IndexError" in errors[0], errors


# ---------------------------------------------------------------------------------------------------- a run


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory, neox_checkpoint):
    """One in-process training step in GPT-NeoX's order with `split` 50,50,0, on a corpus whose folder already holds
    GPT-NeoX's index cache of split 969,30,1 under the very name the run reads (the name has no split): the run's
    start-up and its checkpoint (for export and --resume below)."""
    from neox_hf.data.indexed import index_bytes
    from neox_hf.data.neox_order import split_document_ranges
    from tests.conftest import train_in_this_process

    folder = tmp_path_factory.mktemp("run")
    words = neox_checkpoint[1].parent / "words.json"
    rng = np.random.default_rng(5)
    docs = [np.append(rng.integers(2, 100, size=int(rng.integers(4, 30))), 0) for _ in range(60)]
    prefix = folder / "corpus_text_document"
    np.concatenate(docs).astype(np.uint16).tofile(f"{prefix}.bin")
    Path(f"{prefix}.idx").write_bytes(index_bytes([len(d) for d in docs], np.uint16))
    recipe = {"model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
                        "max_position_embeddings": 16, "make_vocab_size_divisible_by": 128},
              "tokenizer": {"path": str(words), "eos_token": "<|endoftext|>", "pad_token": "<|padding|>"},
              "data": {"order": "gpt-neox", "sources": [{"path": str(prefix), "format": "indexed"}],
                       "split": "969,30,1", "seed": 1234},
              "train": {"train_iters": 1, "micro_batch_size": 2, "eval_iters": 0, "save_interval": 1,
                        "precision": "fp32", "log_interval": 1},
              "output": {"dir": str(folder / "out"), "tensorboard": False}}
    path = folder / "recipe.yaml"
    path.write_text(json.dumps(recipe))
    from neox_hf.cli import main

    assert main(["batches", str(path), "--data-parallel", "1", "--start-step", "0", "--end-step", "1", "--output",
                 str(folder / "rows.npy")]) == 0  # GPT-NeoX's cache of 969,30,1 (its record removed: GPT-NeoX's own)
    next(folder.glob("*_source.json")).unlink()
    printed = train_in_this_process([str(path), "--data.split", "50,50,0"])
    train_documents = split_document_ranges("50,50,0", len(docs))[1]
    return folder, printed, train_documents


def test_a_training_run_after_a_split_change_reads_a_fresh_index(one_step_run):
    folder, printed, train_documents = one_step_run
    (record,) = folder.glob("*_train_indexmap_*_source.json")
    assert json.loads(record.read_text())["settings"]["split_documents"] == [0, train_documents]
    doc_idx = np.load(str(record).replace("_source.json", "_doc_idx.npy"))
    assert doc_idx.max() < train_documents  # no validation document in the index the run trained on


def _train_index(folder: Path, seed: int) -> tuple[dict, np.ndarray]:
    """The record and document order of the train-split index cache of `seed` in `folder`."""
    (record,) = folder.glob(f"*_train_indexmap_*_{seed}s_*_source.json")
    return json.loads(record.read_text()), np.load(str(record).replace("_source.json", "_doc_idx.npy"))


def test_a_training_run_after_a_seed_change_or_a_corpus_change_reads_a_fresh_index(one_step_run, tmp_path, capsys,
                                                                                   fresh_accelerate_state):
    """Each change through a training run: another `data.seed` trains on an index of that seed (GPT-NeoX's name holds
    the seed); the corpus replaced under the same name is noticed (sizes fingerprint), rebuilt with a one-line note,
    and the run trains on the new corpus's documents only."""
    import shutil

    from neox_hf.cli import main
    from neox_hf.data.indexed import index_bytes
    from tests.conftest import reset_accelerate_state

    folder, _, train_documents = one_step_run
    recipe = json.loads((folder / "recipe.yaml").read_text())
    recipe["output"]["dir"] = str(tmp_path / "seed99")
    (tmp_path / "seed.yaml").write_text(json.dumps(recipe))
    assert main(["train", str(tmp_path / "seed.yaml"), "--data.split", "50,50,0", "--data.seed", "99"]) == 0
    (record_99, order_99), (_, order_1234) = _train_index(folder, 99), _train_index(folder, 1234)
    assert record_99["settings"]["seed"] == 99 and record_99["settings"]["split_documents"] == [0, train_documents]
    assert not np.array_equal(order_99, order_1234)

    corpus = tmp_path / "corpus"  # a copy: the other tests of this module keep the fixture's corpus
    corpus.mkdir()
    for path in folder.glob("corpus_text_document.*"):
        shutil.copy(path, corpus)
    recipe["data"]["sources"] = [{"path": str(corpus / "corpus_text_document"), "format": "indexed"}]
    for run in ("before", "after"):
        recipe["output"]["dir"] = str(tmp_path / run)
        (tmp_path / f"{run}.yaml").write_text(json.dumps(recipe))
        if run == "after":  # 20 documents where there were 60, under the same name and record
            rng = np.random.default_rng(6)
            docs = [np.append(rng.integers(2, 100, size=int(rng.integers(20, 40))), 0) for _ in range(20)]
            np.concatenate(docs).astype(np.uint16).tofile(corpus / "corpus_text_document.bin")
            (corpus / "corpus_text_document.idx").write_bytes(index_bytes([len(d) for d in docs], np.uint16))
        capsys.readouterr()
        reset_accelerate_state()
        assert main(["train", str(tmp_path / f"{run}.yaml"), "--data.split", "50,50,0"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "index cache" in line and "rebuilt" in line]
    assert len(notes) == 1 and notes[0].startswith("note: "), notes
    record, order = _train_index(corpus, 1234)
    assert record["documents"] == 20 and record["settings"]["split_documents"] == [0, 10]
    assert order.max() < 10  # the new corpus's train split only


def test_export_and_resume_refuse_a_damaged_checkpoint_file(one_step_run, tmp_path, capsys):
    from tests.conftest import reset_accelerate_state

    folder, _, _ = one_step_run
    step = next((folder / "out" / "checkpoints").glob("step_*"))
    weights = step / "model.safetensors"
    original = weights.read_bytes()
    try:
        for name in ("half", "flip@8", "lead-87", "lead-ff"):
            weights.write_bytes(damaged_variants(original)[name])
            _assert_refused(["export", str(step), str(tmp_path / f"hf-{name}")], weights, capsys, name)
    finally:
        weights.write_bytes(original)
    for damaged in ("trainer_state_rank0.pt", "random_states_0.pkl", "optimizer.bin", "model.safetensors"):
        path = step / damaged
        original = path.read_bytes()
        path.write_bytes(damaged_variants(original)["lead-87"])
        reset_accelerate_state()
        try:
            _assert_refused(["train", str(folder / "recipe.yaml"), "--data.split", "50,50,0", "--train.train_iters",
                             "2", "--resume"], path, capsys, "lead-87")
        finally:
            path.write_bytes(original)
            reset_accelerate_state()
