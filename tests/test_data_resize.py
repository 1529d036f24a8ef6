"""A streamed data position resumed on another number of data-parallel ranks: the old ranks each trained a different
number of batches (none, inside a chunk, past a pass); every new rank loads all their states and reads until it starts
pass E + 1 (E: the newest pass an old rank had begun). What trained before and after the resize, plus what the new
ranks carry into pass E + 1, is every old rank's share of passes 0..E exactly once (pad: the examples by their tokens;
pack: the multiset of tokens, windows' shared tokens counted once). In process, on 120 GSM8K pairs."""

from __future__ import annotations

import os
import sys
from collections import Counter

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
from data_common import gsm8k_source  # noqa: E402

from neox_hf.data import build_train_loader, document_stream  # noqa: E402
from neox_hf.errors import DataError  # noqa: E402
from neox_hf.recipe import DataConfig  # noqa: E402
from tests.test_data_resume import gsm120, round_trip, tok  # noqa: E402,F401  (fixtures shared)

SHAPES = {"pad": (256, 4), "pack": (128, 2)}  # seq_length, micro_batch_size of the old run


def config(path, mode: str, **settings) -> DataConfig:
    return DataConfig(sources=[gsm8k_source(path=str(path))], mode=mode, buffer_size=32, **settings)


def build(cfg, tok, rank: int, size: int, micro_batch_size=None):
    seq, batch = SHAPES[cfg.mode]
    return build_train_loader(cfg, tok, seq_length=seq, micro_batch_size=micro_batch_size or batch, dp_rank=rank,
                              dp_size=size)


def train(loaders, takes) -> tuple[list, list]:
    """(the batches each loader gave, each one's state after them)."""
    batches = [[next(loader) for _ in range(k)] for loader, k in zip(loaders, takes)]
    return batches, [round_trip(loader.state_dict()) for loader in loaders]


def resized(cfg, tok, states, size: int, micro_batch_size=None):
    loaders = [build(cfg, tok, rank, size, micro_batch_size) for rank in range(size)]
    for loader in loaders:
        loader.load_resized_states(states)
    return loaders


def read_dealt_pass(loader) -> tuple[list, object, dict]:
    """(the batches of the dealt pass, the carry they leave to pass E + 1, the stats when pass E + 1 starts)."""
    batches = []
    while True:
        batch = next(loader)
        position = loader.state_dict()["position"]
        if "dealt" not in position:
            return batches, position["carry"], position["stats"]
        batches.append(batch)


def covered(cfg, batches: list, carry=None, *, fresh: bool = True) -> Counter:
    """Pad: the examples (input tokens) trained and carried. Pack: the tokens of the loader's stream that were
    trained or carried: every window's tokens, a window's first token once (it is the previous one's last)."""
    if cfg.mode == "pad":
        seen = Counter(tuple(ids[: int(mask.sum())].tolist()) for batch in batches
                       for ids, mask in zip(batch["input_ids"], batch["attention_mask"]))
        return seen + Counter(tuple(inputs) for inputs, _ in (carry or []))
    tokens, windows = Counter(), 0
    for batch in batches:
        for ids, labels in zip(batch["input_ids"], batch["labels"]):
            window = ids.tolist() + [int(labels[-1])]  # (no prompt masking, no isolation: every label is the token)
            tokens.update(window[1:] if windows or not fresh else window)
            windows += 1
    if carry:
        tokens.update(carry["ids"][1:] if windows or not fresh else carry["ids"])
    return tokens


def shares(cfg, tok, size: int, last_pass: int, first_pass: int = 0) -> tuple[Counter, int]:
    """Every rank's share of passes first_pass..last_pass, as `covered` counts them, and how many documents."""
    seq, _ = SHAPES[cfg.mode]
    want, documents = Counter(), 0
    for rank in range(size):
        for epoch in range(first_pass, last_pass + 1):
            rows = document_stream(cfg.sources, tok, epoch=epoch, seed=1234, dp_rank=rank, dp_size=size)
            for row in rows:
                if row["skip"] != "":
                    continue
                documents += 1
                if cfg.mode == "pad":
                    want[tuple(row["input_ids"][: seq + 1][:-1])] += 1
                else:
                    want.update(row["input_ids"])
    return want, documents


def dealt_pass(loaders) -> int:
    return loaders[0].state_dict()["position"]["dealt"]["pass"]


def summed_stats(loaders) -> Counter:
    total = Counter()
    for loader in loaders:
        total.update(loader.stats)
    return total


CASES = [(1, 2, (9,)), (2, 1, (0, 20)), (2, 3, (5, 17))]  # old size, new size, batches each old rank trained
VARIANTS = {"pad_budget": dict(max_tokens_per_batch=1024)}


@pytest.mark.parametrize("mode,old_size,new_size,takes", [(mode, *case) for mode in ("pad", "pack") for case in CASES]
                         + [("pad_budget", *CASES[2])])
def test_resize_covers_the_pass_exactly_once(tok, gsm120, mode, old_size, new_size, takes):
    cfg = config(gsm120, mode.split("_")[0], **VARIANTS.get(mode, {}))
    if cfg.mode == "pack":
        takes = tuple(3 * k for k in takes)  # pack windows are ~3× as many: the same spread of positions
    old = [build(cfg, tok, rank, old_size) for rank in range(old_size)]
    before, states = train(old, takes)
    new = resized(cfg, tok, states, new_size)
    if all(takes):  # (an old rank that took no batch has not read its first chunk yet; the new ranks read it)
        assert summed_stats(new) == summed_stats(old)  # the old totals, on new rank 0
    last_pass = dealt_pass(new)
    after = [read_dealt_pass(loader) for loader in new]
    got = sum((covered(cfg, b) for b in before), Counter()) + sum((covered(cfg, b, c) for b, c, _ in after), Counter())
    want, documents = shares(cfg, tok, old_size, last_pass)
    assert got == want, (sum((got - want).values()), sum((want - got).values()))
    assert sum(stats["documents"] for _, _, stats in after) == documents  # each read document counted once
    assert all(state["position"]["epoch"] == last_pass + 1 for state in (n.state_dict() for n in new))


@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_a_dealt_pass_resumes_exactly_and_resizes_again(tok, gsm120, mode):
    """1 → 2 ranks, a checkpoint inside the dealt pass: on 2 ranks it resumes to the same batches; on 3 it is dealt
    again (the old positions are themselves dealt), and the pass is still covered exactly once."""
    cfg = config(gsm120, mode)
    scale = 2 if mode == "pack" else 1
    before, states = train([build(cfg, tok, 0, 1)], [11 * scale])
    middle = resized(cfg, tok, states, 2)
    middle_batches, middle_states = train(middle, [2 * scale, 9 * scale])
    continued = [[next(loader) for _ in range(4)] for loader in middle]
    for rank in range(2):
        same = build(cfg, tok, rank, 2)
        same.load_state_dict(middle_states[rank])
        for x, y in zip([next(same) for _ in range(4)], continued[rank]):
            assert all(torch.equal(x[k], y[k]) for k in x)
    last = resized(cfg, tok, middle_states, 3)
    last_pass = dealt_pass(last)
    assert last_pass == middle_states[0]["position"]["dealt"]["pass"]
    after = [read_dealt_pass(loader) for loader in last]
    got = (covered(cfg, before[0]) + sum((covered(cfg, b) for b in middle_batches), Counter())
           + sum((covered(cfg, b, c) for b, c, _ in after), Counter()))
    want, documents = shares(cfg, tok, 1, last_pass)
    assert got == want, (sum((got - want).values()), sum((want - got).values()))
    assert sum(stats["documents"] for _, _, stats in after) == documents


def test_a_resize_may_change_the_micro_batch_and_no_data_setting(tok, gsm120):
    cfg = config(gsm120, "pad")
    _, states = train([build(cfg, tok, rank, 2) for rank in range(2)], [3, 4])
    new = resized(cfg, tok, states, 1, micro_batch_size=8)
    assert next(new[0])["input_ids"].shape[0] == 8
    assert new[0].describe_position().startswith(
        "data position: the rest of pass 1 of 2 data-parallel ranks' streamed shares (")
    other = build(DataConfig(sources=cfg.sources, mode="pad", buffer_size=64), tok, 0, 1)
    with pytest.raises(DataError, match="buffer_size"):
        other.load_resized_states(states)
    with pytest.raises(DataError, match="not those of data-parallel ranks 0..0"):
        build(cfg, tok, 0, 1).load_resized_states(states[1:])
    with pytest.raises(DataError, match="give every old rank's state to `load_resized_states`"):
        build(cfg, tok, 0, 1).load_state_dict(states[0])  # one rank's position alone cannot move


def test_the_curriculum_goes_on_from_the_same_step(tok, gsm120):
    """2 ranks × accumulation 1 → 1 rank × accumulation 2 (the same global batch): step 5 stays step 5."""
    from neox_hf.recipe import CurriculumConfig

    cfg = DataConfig(sources=[gsm8k_source(path=str(gsm120))], mode="pad", buffer_size=32,
                     curriculum=CurriculumConfig(min_difficulty=16, max_difficulty=256, total_curriculum_step=10))
    old = [build_train_loader(cfg, tok, seq_length=256, micro_batch_size=4, dp_rank=r, dp_size=2) for r in range(2)]
    _, states = train(old, [5, 5])
    new = build_train_loader(cfg, tok, seq_length=256, micro_batch_size=4, gradient_accumulation_steps=2)
    new.load_resized_states(states)
    assert new.micro_batches == 10
    next(new)
    assert new.curriculum_seq_length == old[0].curriculum.seq_length_at(5)
    assert new.describe_position().startswith("data position: the rest of pass 1 of 2 data-parallel ranks'")


@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_a_resize_from_ranks_inside_and_past_a_dealt_pass(tok, gsm120, mode):
    """1 → 2 ranks; rank 0 still in the dealt pass 0, rank 1 already in pass 1 on the 2-rank split; → 3 ranks: pass 0
    (of the 1-rank split) and pass 1 (of the 2-rank split) are each covered exactly once."""
    cfg = config(gsm120, mode)
    scale = 2 if mode == "pack" else 1
    before, states = train([build(cfg, tok, 0, 1)], [11 * scale])
    middle_batches, middle_states = train(resized(cfg, tok, states, 2), [2 * scale, 20 * scale - 5 * (scale - 1)])
    assert "dealt" in middle_states[0]["position"] and middle_states[1]["position"]["epoch"] == 1
    last = resized(cfg, tok, middle_states, 3)
    assert dealt_pass(last) == 1
    after = [read_dealt_pass(loader) for loader in last]
    got = (covered(cfg, before[0]) + sum((covered(cfg, b) for b in middle_batches), Counter())
           + sum((covered(cfg, b, c) for b, c, _ in after), Counter()))
    first, first_documents = shares(cfg, tok, 1, 0)
    second, second_documents = shares(cfg, tok, 2, 1, first_pass=1)
    assert got == first + second, (sum((got - first - second).values()), sum((first + second - got).values()))
    assert sum(stats["documents"] for _, _, stats in after) == first_documents + second_documents
