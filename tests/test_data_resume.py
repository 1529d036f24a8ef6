"""Exact resume: after N batches, state_dict → torch.save → a new loader → load_state_dict gives the
same next batches as the uninterrupted run (1 and 2 ranks, every mode, across buffers and epochs);
and a real two-process run where ranks see disjoint documents and lose none."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
from conftest import launch_env  # noqa: E402
from data_common import batch_documents, gsm8k_rows, gsm8k_source, neox_tokenizer, write_jsonl  # noqa: E402

from neox_hf.data import build_train_loader, document_stream  # noqa: E402
from neox_hf.errors import DataError  # noqa: E402
from neox_hf.recipe import DataConfig  # noqa: E402

WORKERS = os.path.join(os.path.dirname(__file__), "workers")
MODES = {
    "pad": dict(mode="pad"),
    "pad_budget": dict(mode="pad", max_tokens_per_batch=1024),
    "pack": dict(mode="pack"),
    "pack_isolated": dict(mode="pack", isolate_documents=True),
}


@pytest.fixture(scope="module")
def tok():
    return neox_tokenizer()


@pytest.fixture(scope="module")
def gsm120(tmp_path_factory):
    """120 GSM8K pairs: with a 32-document buffer, 20 batches cross several buffers and an epoch."""
    return write_jsonl(tmp_path_factory.mktemp("resume") / "gsm120.jsonl", gsm8k_rows(120))


def round_trip(state: dict) -> dict:
    """Through a file as a checkpoint holds it: torch.save, read back as plain data (`weights_only`, as on resume)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def assert_same_batches(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        assert all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("dp_size", [1, 2])
@pytest.mark.parametrize("mode", list(MODES))
def test_resume_gives_the_uninterrupted_batches(tok, gsm120, mode, dp_size):
    cfg = DataConfig(sources=[gsm8k_source(path=str(gsm120))], buffer_size=32, **MODES[mode])
    seq, batch = (256, 4) if mode.startswith("pad") else (128, 2)
    for rank in range(dp_size):
        def build():
            return build_train_loader(cfg, tok, seq_length=seq, micro_batch_size=batch, dp_rank=rank, dp_size=dp_size)

        run = build()
        uninterrupted = [next(run) for _ in range(25)]
        for n in (3, 17):  # inside the first buffer; after buffers and (for pad) an epoch boundary
            first = build()
            for _ in range(n):
                next(first)
            state = round_trip(first.state_dict())
            resumed = build()
            resumed.load_state_dict(state)
            assert_same_batches([next(resumed) for _ in range(5)], uninterrupted[n: n + 5])


@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_a_resumed_run_checkpointed_again_in_its_first_chunk_resumes_exactly(tok, gsm120, mode):
    """The position of the chunk a resume rebuilt is where that chunk started, not the start of the pass (datasets'
    state_dict() says "start" until a row is pulled after load_state_dict)."""
    cfg = DataConfig(sources=[gsm8k_source(path=str(gsm120))], buffer_size=32, **MODES[mode])
    seq, batch = (256, 4) if mode == "pad" else (128, 2)
    build = lambda: build_train_loader(cfg, tok, seq_length=seq, micro_batch_size=batch)  # noqa: E731
    run = build()
    uninterrupted = [next(run) for _ in range(14)]
    first = build()
    for _ in range(10):
        next(first)
    second = build()
    second.load_state_dict(round_trip(first.state_dict()))
    next(second)  # the 11th batch, same chunk
    third = build()
    third.load_state_dict(round_trip(second.state_dict()))
    assert_same_batches([next(third) for _ in range(3)], uninterrupted[11:14])


@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_a_state_taken_in_process_is_a_snapshot_the_loader_going_on_leaves_alone(tok, gsm120, mode):
    """The prefetch thread keeps each batch's state while the loader runs ahead, and state_dict() shares the chunk's
    carry instead of copying it: the kept state must still equal what it was when taken, chunks later, and resume
    the batches after it."""
    cfg = DataConfig(sources=[gsm8k_source(path=str(gsm120))], buffer_size=30, **MODES[mode])  # pad: 2 left over
    seq, batch = (256, 4) if mode == "pad" else (128, 2)
    build = lambda: build_train_loader(cfg, tok, seq_length=seq, micro_batch_size=batch)  # noqa: E731
    run = build()
    uninterrupted = [next(run) for _ in range(60)]
    loader = build()
    for taken_after in range(1, 40):  # into the first chunk that starts with a carry from the one before
        next(loader)
        state = loader.state_dict()
        if state["position"]["carry"]:
            break
    assert state["position"]["carry"], "the check needs a chunk that carries something into the next"
    taken = round_trip(state)
    for _ in range(12):  # chunks on
        next(loader)
    assert round_trip(state) == taken
    resumed = build()
    resumed.load_state_dict(state)
    assert_same_batches([next(resumed) for _ in range(5)], uninterrupted[taken_after:taken_after + 5])


def test_resume_reproduces_the_stats(tok, gsm120):
    cfg = DataConfig(sources=[gsm8k_source(path=str(gsm120))], mode="pad", buffer_size=32)
    run = build_train_loader(cfg, tok, seq_length=256, micro_batch_size=4)
    for _ in range(12):
        next(run)
    state = run.state_dict()
    for _ in range(5):
        next(run)
    resumed = build_train_loader(cfg, tok, seq_length=256, micro_batch_size=4)
    resumed.load_state_dict(state)
    for _ in range(5):
        next(resumed)
    assert resumed.stats == run.stats


def test_epochs_are_reshuffled(tok, gsm120):
    cfg = DataConfig(sources=[gsm8k_source(path=str(gsm120))], mode="pad", buffer_size=120)  # one buffer = one epoch
    loader = build_train_loader(cfg, tok, seq_length=512, micro_batch_size=4)
    epochs = [[doc for _ in range(30) for doc in batch_documents(next(loader), tok.eos_token_id)] for _ in range(2)]
    assert Counter(epochs[0]) == Counter(epochs[1]) and len(set(epochs[0])) == 120
    assert epochs[0] != epochs[1]


def test_state_from_other_settings_is_refused(tok, gsm120):
    cfg = DataConfig(sources=[gsm8k_source(path=str(gsm120))], mode="pad", buffer_size=32)
    state = build_train_loader(cfg, tok, seq_length=256, micro_batch_size=4).state_dict()
    other = build_train_loader(cfg, tok, seq_length=256, micro_batch_size=8)
    with pytest.raises(DataError, match="micro_batch_size"):
        other.load_state_dict(state)


def test_two_processes_see_disjoint_documents_and_resume_exactly(tmp_path, tok, gsm120):
    env = launch_env(PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0",
           os.path.join(WORKERS, "data_ranks.py"), str(tmp_path), str(gsm120)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"data.rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["resume_exact"] for r in ranks)
    docs = [Counter(map(tuple, r["docs"])) for r in ranks]
    rows = document_stream([gsm8k_source(path=str(gsm120))], tok, epoch=0, seed=1234)
    everything = Counter(tuple(r["input_ids"]) for r in rows if r["skip"] == "")
    assert not set(docs[0]) & set(docs[1]) and docs[0] + docs[1] == everything
    first_batches = [set(map(tuple, r["batch_docs"][:40])) for r in ranks]  # 10 batches × 4, inside epoch 0
    assert not first_batches[0] & first_batches[1]
