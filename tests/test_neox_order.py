"""GPT-NeoX's sample order (data.order: gpt-neox): `neox_hf batches` and the training loader against a test-only
reference written from the description (tests/neox_order_reference.py), row for row; resume; the index cache under
GPT-NeoX's names, built once and reused (also when GPT-NeoX built it); blending counts; the pack implementations,
labels and eod masks; Pythia's pre-shuffled rows; the sequence-length curriculum."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch
import yaml

sys.path.insert(0, os.path.dirname(__file__))
import neox_order_reference as ref  # noqa: E402

from neox_hf.cli import main as cli_main  # noqa: E402
from neox_hf.data import build_eval_loader, build_neox_valid_loader, build_train_loader, tokens_per_epoch  # noqa: E402
from neox_hf.data.indexed import IndexedDataset, index_bytes  # noqa: E402
from neox_hf.data.neox_order import (BatchLayout, IndexSpec, blending_indices, build_index,  # noqa: E402
                                     normalized_weights_and_num_samples, split_document_ranges, split_samples,
                                     weights_by_num_documents)
from neox_hf.errors import DataError, RecipeError  # noqa: E402
from neox_hf.neox_yaml import translate_neox_args  # noqa: E402
from neox_hf.recipe import recipe_from_dict  # noqa: E402

EOD = 0
SEQ, MICRO, ACC, DP, ITERS = 16, 2, 2, 2, 8  # global batch 8; 64 samples of 17 tokens need two epochs


class Tok:
    """The only tokenizer fact GPT-NeoX's order uses: the EOD id."""

    eos_token_id = EOD


def write_corpus(prefix, docs: list[np.ndarray], dtype=np.uint16) -> str:
    np.concatenate(docs).astype(dtype).tofile(f"{prefix}.bin")
    with open(f"{prefix}.idx", "wb") as f:
        f.write(index_bytes([len(d) for d in docs], dtype))
    return str(prefix)


def random_docs(n: int, seed: int, max_len: int = 24) -> list[np.ndarray]:
    """Documents ending in EOD, some empty (stepped over by the index), token ids naming nothing."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        length = 0 if i % 17 == 5 else int(rng.integers(1, max_len))
        docs.append(np.append(rng.integers(1, 50000, size=length - 1), EOD) if length else np.zeros(0, np.int64))
    return docs


@pytest.fixture()
def corpus(tmp_path):
    docs = random_docs(60, seed=3)
    return write_corpus(tmp_path / "corpus_text_document", docs), docs


def data_cfg(prefix, **overrides):
    values = {"order": "gpt-neox", "split": "969,30,1", "seed": 1234, "sources": [{"path": prefix}]}
    values.update(overrides)
    return recipe_from_dict({"model": {"seq_length": SEQ}, "data": values}).data


def train_loader(cfg, rank, start_step=0, dp=DP, acc=ACC):
    return build_train_loader(cfg, Tok(), seq_length=SEQ, micro_batch_size=MICRO, dp_rank=rank, dp_size=dp,
                              seed=cfg.seed, gradient_accumulation_steps=acc, train_iters=ITERS, start_step=start_step)


def write_neox_config(tmp_path, prefix, seed) -> str:
    """The same run as a GPT-NeoX config (flat keys, Python literals) naming its data_path and split."""
    path = tmp_path / f"neox{seed}.yml"
    path.write_text(f'{{"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": {SEQ},\n'
                    f' "max-position-embeddings": {SEQ}, "train-iters": {ITERS}, "train_micro_batch_size_per_gpu": {MICRO},\n'
                    f' "gradient_accumulation_steps": {ACC}, "data-path": "{prefix}", "split": "969,30,1",\n'
                    f' "seed": {seed}, "tokenizer_type": "HFTokenizer",}}\n')
    return str(path)


def write_recipe(tmp_path, prefix, seed, **data) -> str:
    recipe = {"model": {"seq_length": SEQ},
              "train": {"train_iters": ITERS, "micro_batch_size": MICRO, "gradient_accumulation_steps": ACC},
              "data": {"order": "gpt-neox", "split": "969,30,1", "seed": seed, "sources": [{"path": prefix}], **data}}
    path = tmp_path / f"recipe{seed}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def test_split_ranges_are_gpt_neox_rounding():
    assert split_document_ranges("969, 30, 1", 1000) == [0, 969, 999, 1000]
    for split, n in [("969,30,1", 60), ("995,4,1", 123), ("90/5/5", 7), ("1", 10), ("8,2", 11)]:
        assert split_document_ranges(split, n) == ref.split_bounds(split, n)
    with pytest.raises(DataError, match="data.split"):
        split_document_ranges("a,b", 10)


@pytest.mark.parametrize("seed", [1234, 7])
def test_batches_command_and_loader_match_the_reference_row_for_row(tmp_path, corpus, seed):
    prefix, docs = corpus
    expected = ref.train_rows(docs, "969,30,1", ITERS, MICRO * ACC * DP, SEQ, seed)
    tokens = sum(len(d) for d in docs[:split_document_ranges("969,30,1", len(docs))[1]])
    assert ref.num_epochs(tokens, SEQ, ITERS * 8) == 2  # the corpus is read twice, shuffled together
    out = tmp_path / "steps.npy"
    config = write_recipe(tmp_path, prefix, seed) if seed == 1234 else write_neox_config(tmp_path, prefix, seed)
    assert cli_main(["batches", config, "--data-parallel", str(DP), "--start-step", "0",
                     "--end-step", str(ITERS), "--output", str(out)]) == 0
    rows = np.load(out)
    assert rows.dtype == np.int64 and rows.shape == (ITERS * 8, SEQ + 1)
    # the cache holds GPT-NeoX's arrays in its dtypes (int32 doc index, int32 sample index while small, uint32 shuffle)
    stem = f"{prefix}_train_indexmap_{ITERS * 8}ns_{SEQ}sl_{seed}s_packedpi_ac"
    sizes = np.array([len(d) for d in docs], dtype=np.int32)
    want = ref.index(sizes, np.arange(split_document_ranges("969,30,1", len(docs))[1], dtype=np.int32), ITERS * 8,
                     SEQ, seed)
    for kind, array, dtype in zip(("doc", "sample", "shuffle"), want, (np.int32, np.int32, np.uint32)):
        cached = np.load(f"{stem}_{kind}_idx.npy")
        assert cached.dtype == dtype
        np.testing.assert_array_equal(cached, array)
    np.testing.assert_array_equal(rows, expected)
    partial = tmp_path / "steps3to5.npy"
    assert cli_main(["batches", write_recipe(tmp_path, prefix, seed), "--data-parallel", str(DP), "--start-step", "3",
                     "--end-step", "5", "--output", str(partial)]) == 0
    np.testing.assert_array_equal(np.load(partial), expected[3 * 8:5 * 8])

    cfg = data_cfg(prefix, seed=seed)
    loaders = [train_loader(cfg, r) for r in range(DP)]
    for step in range(ITERS):
        for k in range(ACC):
            for r, loader in enumerate(loaders):
                batch = next(loader)
                want = ref.rank_rows(rows, step, k, r, MICRO, ACC, DP)
                np.testing.assert_array_equal(batch["input_ids"].numpy(), want[:, :-1])
                np.testing.assert_array_equal(batch["labels"].numpy(), want[:, 1:])


def test_resume_at_step_k_continues_identically(corpus):
    prefix, _ = corpus
    cfg = data_cfg(prefix)
    straight = train_loader(cfg, 1)
    batches = [next(straight) for _ in range(ITERS * ACC)]
    k = 3
    fresh = train_loader(cfg, 1, start_step=k)  # GPT-NeoX: start at iteration × accumulation
    assert all(torch.equal(next(fresh)["input_ids"], b["input_ids"]) for b in batches[k * ACC:])
    first = train_loader(cfg, 1)
    for _ in range(k * ACC):
        next(first)
    state = first.state_dict()
    resumed = train_loader(cfg, 1)
    resumed.load_state_dict(state)
    assert all(torch.equal(next(resumed)["labels"], b["labels"]) for b in batches[k * ACC:])
    other = train_loader(data_cfg(prefix, seed=99), 1)
    with pytest.raises(DataError, match="saved with `data.seed: 1234` and this run has `data.seed: 99`"):
        other.load_state_dict(state)
    streamed = {"version": state["version"], "fingerprint": {"mode": "pack", "seq_length": SEQ, "seed": 1234},
                "position": {}, "emitted": 0}  # what a `data.order: stream` run saves
    with pytest.raises(DataError, match="saved with `data.order: stream` and this run has `data.order: gpt-neox`: "
                                        "resume with `--data.order stream`"):
        other.load_state_dict(streamed)


def test_index_cache_has_gpt_neox_names_is_built_once_and_reused(tmp_path):
    docs = random_docs(20000, seed=1, max_len=200)
    prefix = write_corpus(tmp_path / "big_text_document", docs)
    cfg = data_cfg(prefix)
    first = next(train_loader(cfg, 0))
    stem = f"{prefix}_train_indexmap_{ITERS * 8}ns_{SEQ}sl_1234s_packedpi_ac"
    files = sorted(str(p) for p in tmp_path.glob("*.npy"))
    assert files == sorted(f"{stem}_{kind}_idx.npy" for kind in ("doc", "sample", "shuffle"))
    mtimes = [os.stat(f).st_mtime_ns for f in files]
    again = next(train_loader(cfg, 0))
    assert torch.equal(first["input_ids"], again["input_ids"])
    assert [os.stat(f).st_mtime_ns for f in files] == mtimes  # read, not rewritten (no timing asserted: shared cores)
    # A cache GPT-NeoX wrote is read as it is: put a different shuffle under its name and the batches follow it.
    shuffle = np.load(f"{stem}_shuffle_idx.npy")
    np.save(f"{stem}_shuffle_idx.npy", shuffle[::-1].copy())
    foreign = next(train_loader(cfg, 0))
    assert not torch.equal(foreign["input_ids"], first["input_ids"])


def test_blending_weights_give_gpt_neox_counts_and_order(tmp_path):
    a = write_corpus(tmp_path / "a", random_docs(40, seed=4))
    b = write_corpus(tmp_path / "b", random_docs(30, seed=5))
    num_samples = ITERS * 8
    weights, counts = normalized_weights_and_num_samples([3.0, 1.0], num_samples)
    assert weights == [0.75, 0.25] and counts == ref.per_dataset_samples([3.0, 1.0], num_samples) == [49, 17]
    cfg = recipe_from_dict({"model": {"seq_length": SEQ}, "data": {
        "order": "gpt-neox", "sources": [{"path": a, "weight": 3.0}, {"path": b, "weight": 1.0}]}}).data
    blend = split_samples(cfg, "train", seq_length=SEQ, train_iters=ITERS, layout=BatchLayout(MICRO, ACC, DP),
                          eval_interval=1000, eval_iters=0, seed=1234)
    names = sorted(p.name for p in tmp_path.glob("*_doc_idx.npy"))
    assert names == [f"a_train_0_indexmap_49ns_{SEQ}sl_1234s_packedpi_ac_doc_idx.npy",
                     f"b_train_1_indexmap_17ns_{SEQ}sl_1234s_packedpi_ac_doc_idx.npy"]
    chosen = blend.dataset_index.tolist()
    assert chosen == ref.blend([0.75, 0.25], len(chosen))
    first = np.bincount(chosen[:num_samples], minlength=2)
    assert first.tolist() == [48, 16]  # 3 : 1 exactly over the run's 64 samples
    idx, sample = blending_indices([0.5, 0.3, 0.2], 1000)
    assert np.bincount(idx).tolist() == [500, 300, 200]
    assert all(sample[idx == d].tolist() == list(range(n)) for d, n in enumerate([500, 300, 200]))
    assert weights_by_num_documents([40, 30], 1.0) == pytest.approx([0.5, 0.5])  # p(1 - p) is symmetric
    low = weights_by_num_documents([900, 100], 0.3)  # alpha < 1 lifts the small corpus above its 10%
    assert low[1] > 0.1 and sum(low) == pytest.approx(1.0)
    docs_weighted = recipe_from_dict({"model": {"seq_length": SEQ}, "data": {
        "order": "gpt-neox", "weight_by_num_documents": True, "weighted_sampler_alpha": 0.3,
        "sources": [{"path": a}, {"path": b}]}}).data
    split_samples(docs_weighted, "train", seq_length=SEQ, train_iters=ITERS, layout=BatchLayout(MICRO, ACC, DP),
                  eval_interval=1000, eval_iters=0, seed=1234)


def test_labels_eod_mask_and_unpacked_samples(tmp_path):
    docs = random_docs(30, seed=6)
    prefix = write_corpus(tmp_path / "sft", docs)
    labels = [np.where(np.arange(len(d)) < len(d) // 2, -100, d) for d in docs]  # first half of each doc is prompt
    label_prefix = write_corpus(tmp_path / "sft_label", labels, dtype=np.int32)
    cfg = data_cfg(prefix, split="1", pack_impl="unpacked", eod_mask_loss=True,
                   sources=[{"path": prefix, "label_path": label_prefix}])
    batch = next(train_loader(cfg, 0, dp=1, acc=1))
    spec = IndexSpec(prefix, "train", (0, 30), ITERS * MICRO, SEQ, 1234, "unpacked")
    doc_idx, sample_idx, shuffle_idx = build_index(spec, np.array([len(d) for d in docs]), IndexedDataset(label_prefix))[:3]
    assert 5 not in doc_idx.tolist()  # the empty document has no label to learn: skipped
    for row in range(MICRO):
        j = int(shuffle_idx[row])
        doc, following = docs[doc_idx[j]], docs[doc_idx[j + 1]]
        tokens = np.concatenate([doc, following[:1]])[:SEQ + 1]
        tokens = np.pad(tokens, (0, SEQ + 1 - len(tokens)))  # unpacked rows are padded with 0, as GPT-NeoX
        label = np.concatenate([labels[doc_idx[j]], labels[doc_idx[j + 1]][:1]])[:SEQ + 1]
        label = np.pad(label, (0, SEQ + 1 - len(label)), constant_values=-100)
        want = np.where(label[1:] >= 0, label[1:], -100)
        want[tokens[:-1] == EOD] = -100  # eod_mask_loss: no loss predicted from an EOD position
        np.testing.assert_array_equal(batch["input_ids"][row].numpy(), tokens[:-1])
        np.testing.assert_array_equal(batch["labels"][row].numpy(), want)
    overflow = data_cfg(prefix, split="1", pack_impl="pack_until_overflow", allow_chopped=False)
    rows = next(train_loader(overflow, 0, dp=1, acc=1))["input_ids"]
    assert rows.shape == (MICRO, SEQ)
    long_docs = write_corpus(tmp_path / "long", [np.arange(1, SEQ + 5)] * 3)
    with pytest.raises(DataError, match="every document is skipped"):
        train_loader(data_cfg(long_docs, split="1", pack_impl="unpacked", allow_chopped=False), 0, dp=1, acc=1)


def test_preshuffled_rows_are_read_in_row_order(tmp_path):
    rows = [np.arange(i * 100, i * 100 + SEQ + 1) for i in range(40)]
    prefix = write_corpus(tmp_path / "pile_0.87_deduped_text_document", rows)
    cfg = data_cfg(prefix, order="preshuffled", split=None)
    loaders = [train_loader(cfg, r, start_step=2) for r in range(DP)]
    for step in (2, 3):
        for k in range(ACC):
            for r, loader in enumerate(loaders):
                first = (step * ACC + k) * MICRO * DP + r * MICRO
                assert next(loader)["input_ids"][:, 0].tolist() == [i * 100 for i in range(first, first + MICRO)]
    bad = write_corpus(tmp_path / "short", [np.arange(SEQ)] * 4)
    with pytest.raises(DataError, match="seq_length \\+ 1"):
        train_loader(data_cfg(bad, order="preshuffled", split=None), 0)


@pytest.mark.parametrize("schedule,expected", [
    (dict(schedule_type="fixed_linear", total_curriculum_step=4, difficulty_step=4), [4, 8, 12, 16, 16, 16]),
    (dict(schedule_type="fixed_root", total_curriculum_step=4, difficulty_step=4, root_degree=2), [8, 12, 12, 16, 16, 16]),
    (dict(schedule_type="fixed_discrete", difficulty=[4, 8, 16], max_step=[2, 3]), [4, 4, 8, 16, 16, 16]),
])
def test_curriculum_lengths_follow_the_schedule(corpus, schedule, expected):
    prefix, _ = corpus
    # step s trains on L(s + 1): fixed_linear L(t) = floor(t/4 × (16 - 4) + 4) rounded down to a multiple of 4
    cfg = data_cfg(prefix, curriculum={"min_difficulty": 4, "max_difficulty": SEQ, **schedule})
    loader = train_loader(cfg, 0)
    widths, logged = [], []
    for _ in range(6 * ACC):
        batch = next(loader)
        widths.append(batch["input_ids"].shape[1])
        logged.append(batch["curriculum_seq_length"])
        assert loader.curriculum_seq_length == batch["curriculum_seq_length"]
    assert widths[::ACC] == widths[1::ACC] == logged[::ACC] == expected
    resumed = train_loader(cfg, 0, start_step=3)
    assert next(resumed)["labels"].shape[1] == expected[3]


def test_gpt_neox_config_translates_order_split_weights_labels_curriculum():
    args = {"data_path": "data/pile_text_document", "split": "995,4,1", "seed": 42, "pack_impl": "packed", "seq_length": 2048,
            "eod_mask_loss": True, "curriculum_learning": {
                "enabled": True, "curriculum_type": "seqlen", "min_difficulty": 64, "max_difficulty": 2048,
                "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 20000, "difficulty_step": 8}}}
    data = recipe_from_dict(translate_neox_args(args).recipe).data
    assert (data.order, data.split, data.seed, data.eod_mask_loss) == ("gpt-neox", "995,4,1", 42, True)
    assert (data.curriculum.min_difficulty, data.curriculum.total_curriculum_step) == (64, 20000)
    assert recipe_from_dict(translate_neox_args({"data_path": "x"}).recipe).data.split == "969, 30, 1"
    blended = recipe_from_dict(translate_neox_args({
        "train_data_paths": ["a", "b"], "train_data_weights": [2, 1], "train_label_data_paths": ["a_l", "b_l"],
        "weight_by_num_documents": True, "weighted_sampler_alpha": 0.5}).recipe).data
    assert blended.split is None and [s.weight for s in blended.sources] == [2.0, 1.0]
    assert [s.label_path for s in blended.sources] == ["a_l", "b_l"] and blended.weighted_sampler_alpha == 0.5
    with pytest.raises(RecipeError, match="curriculum_type"):
        translate_neox_args({"curriculum_learning": {"enabled": True, "curriculum_type": "vocab"}})


def test_recipe_refuses_what_the_order_cannot_read(tmp_path):
    with pytest.raises(RecipeError, match="not one"):
        recipe_from_dict({"data": {"order": "gpt-neox", "sources": [{"path": "x.jsonl", "format": "json"}]}})
    with pytest.raises(RecipeError, match="data.mode: pack"):
        recipe_from_dict({"data": {"order": "gpt-neox", "mode": "pad"}})
    with pytest.raises(RecipeError, match="data.split"):
        recipe_from_dict({"data": {"split": "969,30,1"}})
    with pytest.raises(RecipeError, match="max_difficulty"):
        recipe_from_dict({"model": {"seq_length": 16}, "data": {"curriculum": {"max_difficulty": 32}}})


def test_valid_split_and_epoch_report_follow_gpt_neox(corpus):
    prefix, docs = corpus
    cfg = data_cfg(prefix, split="80,20,0")
    bounds = split_document_ranges("80,20,0", len(docs))
    assert tokens_per_epoch(cfg, Tok()) == sum(len(d) for d in docs[:bounds[1]])
    valid = build_eval_loader(cfg, Tok(), seq_length=SEQ, micro_batch_size=MICRO, max_batches=2,
                              gradient_accumulation_steps=ACC, train_iters=ITERS, eval_interval=4, eval_iters=1)
    assert len(valid) == 2 and valid[0]["input_ids"].shape == (MICRO, SEQ)
    valid_tokens = set(np.concatenate(docs[bounds[1]:bounds[2]]).tolist())
    assert set(valid[0]["input_ids"].flatten().tolist()) <= valid_tokens
    args = dict(seq_length=SEQ, micro_batch_size=MICRO, gradient_accumulation_steps=ACC, train_iters=ITERS,
                eval_interval=4, eval_iters=1)
    stream = build_neox_valid_loader(cfg, Tok(), **args)
    assert torch.equal(next(stream)["input_ids"], valid[0]["input_ids"])
    every = [next(stream)["input_ids"] for _ in range(4)]
    resumed = build_neox_valid_loader(cfg, Tok(), iteration=6, **args)  # (6 × 2) // 4 × 1 = micro-batch 3
    assert torch.equal(next(resumed)["input_ids"], every[2])
    assert build_neox_valid_loader(data_cfg(prefix, split="1"), Tok(), **args) is None


@pytest.mark.distributed
def test_two_processes_build_the_index_once_and_read_their_slices(tmp_path, corpus):
    """Real data parallelism: rank 0 builds the cache, rank 1 waits and reads it; each reads what `neox_hf batches`
    lists for it."""
    import subprocess

    prefix, docs = corpus
    from conftest import free_port, launch_env
    env = launch_env(PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")]))

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           os.path.join(os.path.dirname(__file__), "workers", "neox_order_ranks.py"), str(tmp_path), prefix, str(ITERS)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert len(list(tmp_path.glob("corpus_text_document_train_indexmap_*.npy"))) == 3
    assert not list(tmp_path.glob("*.tmp*"))
    expected = ref.train_rows(docs, "969,30,1", ITERS, MICRO * ACC * DP, SEQ, 1234)
    for rank in range(DP):
        got = np.load(tmp_path / f"neox.rank{rank}.npy")
        for micro_step in range(ITERS * ACC):
            step, k = divmod(micro_step, ACC)
            np.testing.assert_array_equal(got[micro_step], ref.rank_rows(expected, step, k, rank, MICRO, ACC, DP))


def test_curriculum_and_eod_mask_in_the_stream_order_too(tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
    from data_common import gsm8k_rows, neox_tokenizer, write_jsonl

    tok = neox_tokenizer()
    path = write_jsonl(tmp_path / "q.jsonl", [{"text": r["question"]} for r in gsm8k_rows(40)])
    cfg = recipe_from_dict({"model": {"seq_length": 32}, "data": {
        "sources": [{"path": str(path)}], "eod_mask_loss": True, "curriculum": {
            "min_difficulty": 8, "max_difficulty": 32, "schedule_type": "fixed_linear", "total_curriculum_step": 3,
            "difficulty_step": 8}}}).data
    loader = build_train_loader(cfg, tok, seq_length=32, micro_batch_size=2, gradient_accumulation_steps=1)
    batches = [next(loader) for _ in range(4)]
    assert [b["input_ids"].shape[1] for b in batches] == [16, 24, 32, 32]  # L(t) = floor(t/3 × 24 + 8), multiple of 8
    assert loader.curriculum_seq_length == 32
    masked = [b["labels"][b["input_ids"] == tok.eos_token_id] for b in batches]
    assert sum(len(m) for m in masked) > 0 and all((m == -100).all() for m in masked)
    resumed = build_train_loader(cfg, tok, seq_length=32, micro_batch_size=2, gradient_accumulation_steps=1)
    first = build_train_loader(cfg, tok, seq_length=32, micro_batch_size=2, gradient_accumulation_steps=1)
    next(first)
    resumed.load_state_dict(first.state_dict())
    assert torch.equal(next(resumed)["input_ids"], batches[1]["input_ids"])


def test_batches_command_on_a_pythia_config_with_preshuffled_rows_and_bad_input(tmp_path, capsys):
    from conftest import shared

    config = shared("neox-configs/pythia/160M.yml")  # micro batch 32, no accumulation, seq_length 2048
    rows = np.arange(96 * 2049, dtype=np.int64).reshape(96, 2049) % 50000
    prefix = write_corpus(tmp_path / "document", list(rows))
    out = tmp_path / "step2.npy"
    assert cli_main(["batches", str(config), "--data-path", prefix, "--order", "preshuffled", "--data-parallel", "1",
                     "--start-step", "2", "--end-step", "3", "--output", str(out)]) == 0
    np.testing.assert_array_equal(np.load(out), rows[64:96])  # Pythia's batch_viewer: rows [N × batch, (N + 1) × batch)
    capsys.readouterr()
    bad = tmp_path / "bad.npy"
    assert cli_main(["batches", str(config), "--data-path", prefix, "--data-parallel", "1", "--start-step", "3",
                     "--end-step", "1", "--output", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--start-step" in err and not bad.exists()
    assert cli_main(["batches", str(config), "--data-parallel", "1", "--start-step", "0", "--end-step", "1",
                     "--output", str(bad)]) == 2
    assert "--data-path" in capsys.readouterr().err


def rank_batches(cfg) -> list[torch.Tensor]:
    """Every micro-batch of the run, rank by rank (input_ids and labels side by side)."""
    out = []
    for rank in range(DP):
        loader = train_loader(cfg, rank)
        out += [torch.cat([b["input_ids"], b["labels"]], dim=1) for b in (next(loader) for _ in range(ITERS * ACC))]
    return out


@pytest.mark.parametrize("documents", [60, 45], ids=["same-count", "fewer-documents"])
def test_index_cache_is_rebuilt_when_the_corpus_beside_it_is_replaced(tmp_path, capsys, documents):
    # GPT-NeoX reuses a cache by its name: a cache of the old corpus read wrong samples (same count) or indexed past
    # the new corpus's end (fewer documents). The record beside it says what it was built from.
    prefix = write_corpus(tmp_path / "corpus_text_document", random_docs(60, seed=3))
    cfg = data_cfg(prefix)
    rank_batches(cfg)
    capsys.readouterr()
    new = random_docs(documents, seed=8)
    write_corpus(tmp_path / "corpus_text_document", new)  # the same name, another corpus
    got = rank_batches(cfg)
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == 1 and "_train_indexmap_" in notes[0] and "rebuilt" in notes[0], notes
    assert ("changed since it was built" if documents == 60 else f"now holds {documents}") in notes[0]
    (tmp_path / "fresh").mkdir()
    want = rank_batches(data_cfg(write_corpus(tmp_path / "fresh" / "corpus_text_document", new)))
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))
    rank_batches(cfg)  # now it matches: read, not rebuilt
    assert capsys.readouterr().err == ""


def test_gpt_neox_cache_without_a_record_is_verified_and_read_not_rebuilt(tmp_path, capsys):
    # A cache GPT-NeoX wrote records nothing: it is checked against the corpus and the split, then read as it is (no
    # rebuild, its files untouched) and recorded; one built for another split is rebuilt with a note.
    prefix = write_corpus(tmp_path / "corpus_text_document", random_docs(60, seed=3))
    cfg = data_cfg(prefix)
    first = rank_batches(cfg)
    arrays = {p.name: (p.stat().st_ino, p.read_bytes()) for p in tmp_path.glob("*.npy")}
    (record,) = tmp_path.glob("*_source.json")
    assert record.name.endswith("packedpi_ac_source.json")
    record.unlink()
    capsys.readouterr()
    again = rank_batches(cfg)
    assert capsys.readouterr().err == ""
    assert record.is_file() and {p.name: (p.stat().st_ino, p.read_bytes()) for p in tmp_path.glob("*.npy")} == arrays
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    # an older neox_hf's record (no split in it): verified the same way, read, and its record completed
    older = json.loads(record.read_text())
    del older["settings"]
    record.write_text(json.dumps(older))
    rank_batches(cfg)
    assert capsys.readouterr().err == "" and "settings" in json.loads(record.read_text())
    assert {p.name: (p.stat().st_ino, p.read_bytes()) for p in tmp_path.glob("*.npy")} == arrays
    # GPT-NeoX's cache of split 969,30,1 under the name a 50,50,0 run reads (the name has no split)
    record.unlink()
    other = rank_batches(data_cfg(prefix, split="50,50,0"))
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == 1 and "rebuilt" in notes[0] and "does not index documents [0, 30)" in notes[0], notes
    (tmp_path / "fresh").mkdir()
    want = rank_batches(data_cfg(write_corpus(tmp_path / "fresh" / "c", random_docs(60, seed=3)), split="50,50,0"))
    assert all(torch.equal(a, b) for a, b in zip(other, want))


def _batches_rows(tmp_path, config, data_path, name, *more) -> np.ndarray:
    out = tmp_path / f"{name}.npy"
    assert cli_main(["batches", config, "--data-path", str(data_path), "--data-parallel", "1", "--start-step", "0",
                     "--end-step", str(ITERS), "--output", str(out), *more]) == 0
    return np.load(out)


def test_batches_after_a_split_seed_or_corpus_change_reads_a_fresh_index(tmp_path, capsys):
    # The bug: the cache name has no split, so `split` 900,100,0 then 50,50,0 served the first call's index and the
    # validation documents of the second were trained on. Each change must give what a fresh folder gives.
    shared, fresh = tmp_path / "shared", tmp_path / "fresh"
    shared.mkdir(), fresh.mkdir()
    docs = random_docs(60, seed=3)
    prefix = write_corpus(shared / "corpus_text_document", docs)
    cases = [("default", None, 1234, docs), ("900", "900,100,0", 1234, docs), ("5050", "50,50,0", 1234, docs),
             ("seed", "50,50,0", 7, docs), ("corpus", "50,50,0", 7, random_docs(60, seed=11))]
    seen = []
    for i, (name, split, seed, corpus_docs) in enumerate(cases):
        folder = tmp_path / f"cfg{i}"
        folder.mkdir()
        config = write_recipe(folder, prefix, seed, **({"split": split} if split else {}))
        write_corpus(shared / "corpus_text_document", corpus_docs)
        capsys.readouterr()
        got = _batches_rows(tmp_path, config, prefix, name)
        err = capsys.readouterr().err
        alone = fresh / name
        alone.mkdir()
        want = _batches_rows(tmp_path, config, write_corpus(alone / "corpus_text_document", corpus_docs), f"{name}-fresh")
        np.testing.assert_array_equal(got, want)
        assert not any(np.array_equal(got, before) for before in seen), name
        seen.append(got)
        if name in ("5050", "corpus"):  # the same cache name as the call before: rebuilt, saying why
            assert "rebuilt" in err and ("another data.split" in err or "changed since" in err), err
    # validation documents of 50,50,0 (documents 30..59) never reach its training rows
    train_tokens = set(np.concatenate(docs[:30]).tolist())
    valid_only = set(np.concatenate(docs[30:]).tolist()) - train_tokens - {EOD}
    assert not valid_only & set(seen[2].ravel().tolist())


def test_batches_for_steps_that_cannot_fit_on_disk_are_refused_before_any_index_is_built(tmp_path, capsys):
    """A far end step was OOM-killed without a word; the rows now go straight to a memory-mapped .npy, so the disk
    must hold them: refused in one line saying how many steps fit."""
    from conftest import shared

    config = shared("neox-configs/pythia/160M.yml")  # 32 × 2049 int64 = 0.5 MiB a step
    rows = np.arange(96 * 2049, dtype=np.int64).reshape(96, 2049) % 50000
    prefix = write_corpus(tmp_path / "document", list(rows))
    out = tmp_path / "far.npy"
    assert cli_main(["batches", str(config), "--data-path", prefix, "--order", "preshuffled", "--data-parallel", "1",
                     "--start-step", "0", "--end-step", str(10**12), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "write fewer steps per call (at most" in err and "--end-step" in err
    assert not out.exists() and not list(tmp_path.glob("far.npy*"))
