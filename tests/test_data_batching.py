"""Batching modes: pad (fixed batch and token budget), pack, and document-isolated pack — invariants on
GSM8K, and the equivalence of an isolated packed window with its documents run separately."""

from __future__ import annotations

import os
import sys
from collections import Counter
from itertools import islice

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
from data_common import batch_documents, gsm8k_source, neox_tokenizer, numbered_texts, write_jsonl  # noqa: E402

from neox_hf.data import build_eval_loader, build_train_loader, document_stream, gpt_neox_num_epochs  # noqa: E402
from neox_hf.errors import DataError  # noqa: E402
from neox_hf.recipe import DataConfig, DataSource  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return neox_tokenizer()


@pytest.fixture(scope="module")
def small_gsm8k(tmp_path_factory):
    """The first 300 GSM8K pairs as their own file, so finite (eval) passes see every document."""
    from data_common import gsm8k_rows

    path = write_jsonl(tmp_path_factory.mktemp("gsm") / "gsm300.jsonl", gsm8k_rows(300))
    return gsm8k_source(path=str(path))


def stream_documents(source, tok) -> Counter:
    rows = document_stream([source], tok, epoch=0, seed=0, shuffle=False)
    return Counter(tuple(r["input_ids"]) for r in rows if r["skip"] == "")


def check_pad_batch(batch, pad_id, multiple):
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    assert ids.dtype == labels.dtype == torch.int64 and ids.shape == labels.shape == mask.shape
    assert ids.shape[1] % multiple == 0
    lengths = mask.sum(1)
    assert lengths.max() > ids.shape[1] - multiple  # padded to the longest, rounded up, no further
    for row, n in enumerate(lengths.tolist()):
        assert mask[row, :n].all() and not mask[row, n:].any()  # real tokens first
        assert (ids[row, n:] == pad_id).all() and (labels[row, n:] == -100).all()  # no padding in labels
        assert torch.equal(labels[row, : n - 1], ids[row, 1:n])  # labels aligned: target of t is token t+1


def test_pad_mode_on_gsm8k_reaches_98_percent_efficiency_at_batch_16(tok):
    cfg = DataConfig(sources=[gsm8k_source()], mode="pad", buffer_size=1000, pad_to_multiple_of=1)
    loader = build_train_loader(cfg, tok, seq_length=512, micro_batch_size=16)
    batches = list(islice(loader, 62))  # one buffer: 1000 // 16 batches
    for batch in batches:
        assert batch["input_ids"].shape[0] == 16
        check_pad_batch(batch, tok.pad_token_id, 1)
    stats = loader.stats
    assert stats["real_tokens"] / (stats["real_tokens"] + stats["padded_tokens"]) >= 0.98
    # batch order is shuffled: lengths are not sorted over the stream
    widths = [b["input_ids"].shape[1] for b in batches]
    assert widths != sorted(widths) and widths != sorted(widths, reverse=True)
    # except that the widest batch comes first, as in transformers' LengthGroupedSampler (out-of-memory at step 1)
    assert widths[0] == max(widths) and widths[1:] != sorted(widths[1:], reverse=True)


@pytest.mark.parametrize("budget", [None, 2048])
def test_pad_mode_loses_no_document_and_respects_the_budget(tok, small_gsm8k, budget):
    cfg = DataConfig(validation=[small_gsm8k], mode="pad", buffer_size=64, max_tokens_per_batch=budget)
    batches = build_eval_loader(cfg, tok, seq_length=512, micro_batch_size=8, max_batches=10_000)
    seen = Counter(doc for b in batches for doc in batch_documents(b, tok.eos_token_id))
    assert seen == stream_documents(small_gsm8k, tok)
    for batch in batches:
        check_pad_batch(batch, tok.pad_token_id, 8)
        if budget:
            assert batch["input_ids"].numel() <= budget
        else:
            assert batch["input_ids"].shape[0] <= 8
    if budget:
        assert max(b["input_ids"].shape[0] for b in batches) > 8  # short examples share a budget


def test_pad_mode_truncates_at_max_length_and_counts_it(tok, small_gsm8k):
    cfg = DataConfig(sources=[small_gsm8k], mode="pad", buffer_size=300, max_length=100, pad_to_multiple_of=1)
    loader = build_train_loader(cfg, tok, seq_length=512, micro_batch_size=4)
    batches = list(islice(loader, 75))
    long_docs = sum(len(doc) > 101 for doc in stream_documents(small_gsm8k, tok).elements())
    assert loader.stats["truncated"] == long_docs > 0
    assert max(b["input_ids"].shape[1] for b in batches) == 100


def test_token_budget_below_one_example_is_refused(tok, small_gsm8k):
    cfg = DataConfig(sources=[small_gsm8k], mode="pad", max_tokens_per_batch=100)
    with pytest.raises(DataError, match="max_tokens_per_batch"):
        build_train_loader(cfg, tok, seq_length=512, micro_batch_size=4)


def concatenated_stream(source, tok) -> list[int]:
    rows = document_stream([source], tok, epoch=0, seed=0, shuffle=False)
    return [t for r in rows if r["skip"] == "" for t in r["input_ids"]]


def test_pack_windows_are_the_document_stream_cut_with_one_shared_token(tok, small_gsm8k):
    T, B = 128, 4
    cfg = DataConfig(validation=[small_gsm8k], mode="pack", buffer_size=50)
    batches = build_eval_loader(cfg, tok, seq_length=T, micro_batch_size=B, max_batches=10_000)
    tokens = torch.tensor(concatenated_stream(small_gsm8k, tok))
    windows = [(ids, labels) for b in batches for ids, labels in zip(b["input_ids"], b["labels"])]
    assert len(windows) == (len(tokens) - 1) // T // B * B  # only the last incomplete batch is dropped
    for k, (ids, labels) in enumerate(windows):
        assert torch.equal(ids, tokens[k * T: (k + 1) * T]) and torch.equal(labels, tokens[k * T + 1: (k + 1) * T + 1])
    assert set(batches[0]) == {"input_ids", "labels"}


def test_isolated_pack_restarts_positions_and_drops_cross_document_targets(tok, small_gsm8k):
    cfg = DataConfig(validation=[small_gsm8k], mode="pack", isolate_documents=True, buffer_size=50)
    batch = build_eval_loader(cfg, tok, seq_length=256, micro_batch_size=4, max_batches=1)[0]
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    eod = tok.eos_token_id
    for row in range(ids.shape[0]):
        assert pos[row, 0] == 0
        after_eod = torch.zeros_like(ids[row], dtype=torch.bool)
        after_eod[1:] = ids[row, :-1] == eod
        assert torch.equal(pos[row] == 0, after_eod | (torch.arange(ids.shape[1]) == 0))
        assert torch.equal(pos[row, 1:][~after_eod[1:]], pos[row, :-1][~after_eod[1:]] + 1)
        next_starts = torch.cat([after_eod[1:], (ids[row, -1] == eod).view(1)])
        assert (labels[row][next_starts] == -100).all()  # EOD → next document's first token is not learned
        assert torch.equal(labels[row][~next_starts][:-1], ids[row, 1:][~next_starts[:-1]])


def test_isolated_window_loss_equals_token_weighted_per_document_loss(tok, small_gsm8k):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=50304, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=256, max_position_embeddings=512, attn_implementation="sdpa")
    model = GPTNeoXForCausalLM(config).eval()
    cfg = DataConfig(validation=[small_gsm8k], mode="pack", isolate_documents=True, buffer_size=50)
    batch = build_eval_loader(cfg, tok, seq_length=384, micro_batch_size=2, max_batches=1)[0]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        packed = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        total, count, n_docs = 0.0, 0, 0
        for ids, labels, pos in zip(batch["input_ids"], batch["labels"], batch["position_ids"]):
            bounds = (pos == 0).nonzero().flatten().tolist() + [len(ids)]
            for a, b in zip(bounds[:-1], bounds[1:]):
                alone = model(input_ids=ids[a:b][None], use_cache=False).logits[0]
                total += F.cross_entropy(alone, labels[a:b], ignore_index=-100, reduction="sum").item()
                count += int((labels[a:b] != -100).sum())
                n_docs += 1
    assert n_docs >= 4
    assert abs(packed.item() - total / count) <= 1e-5


def test_gpt_neox_num_epochs_hand_computed():
    # smallest E with (E * tokens - 1) // seq >= samples
    assert gpt_neox_num_epochs(1000, 100, 9) == 1      # 999 // 100 = 9
    assert gpt_neox_num_epochs(1000, 100, 10) == 2     # 9 < 10; 1999 // 100 = 19
    assert gpt_neox_num_epochs(1000, 100, 19) == 2
    assert gpt_neox_num_epochs(1000, 100, 20) == 3     # 1999 // 100 = 19 < 20
    assert gpt_neox_num_epochs(1000, 100, 0) == 1      # GPT-NeoX always counts at least one epoch
    assert gpt_neox_num_epochs(2049, 2048, 1) == 1     # exactly one window of 2048 + 1 tokens
    assert gpt_neox_num_epochs(2048, 2048, 1) == 2


def test_pack_carries_documents_across_buffers_without_loss(tmp_path, tok):
    path = write_jsonl(tmp_path / "n.jsonl", numbered_texts("carry", 97))
    source = DataSource(path=str(path))
    cfg = DataConfig(validation=[source], mode="pack", buffer_size=7)
    batches = build_eval_loader(cfg, tok, seq_length=16, micro_batch_size=3, max_batches=10_000)
    flat = torch.cat([torch.cat([b["input_ids"], b["labels"][:, -1:]], 1) for b in batches])
    tokens = concatenated_stream(source, tok)
    joined = [t for k, w in enumerate(flat.tolist()) for t in (w if k == 0 else w[1:])]
    assert joined == tokens[: len(joined)] and len(tokens) - len(joined) < 16 * 3 + 1


def test_document_pieces_flag_each_documents_prompt_and_first_token():
    from neox_hf.data.packing import document_pieces

    pieces = document_pieces([([5, 6, 7], 2), ([8], 0), ([9, 10], 0), ([11, 12, 13, 14], 4)])
    assert [p.ids.tolist() for p in pieces] == [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]
    assert [p.learn.tolist() for p in pieces] == [[False, False, True], [True], [True, True], [False] * 4]
    assert [p.starts.tolist() for p in pieces] == [[True, False, False], [True], [True, False], [True, False, False, False]]
    assert document_pieces([]) == []


def _tiny_neox(implementation: str):
    from neox_hf.model import NeoXConfig, NeoXForCausalLM

    torch.manual_seed(0)
    config = NeoXConfig(vocab_size=50304, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=256, max_position_embeddings=512)
    config._attn_implementation = implementation
    return NeoXForCausalLM(config).eval()


def test_the_losses_decoder_call_equals_transformers_own_masks(tok, small_gsm8k):
    """`ops.loss.decoder_hidden_states` (SDPA with no mask, or the documents' mask built on the device: no host read)
    gives transformers' own hidden states for isolated packed documents (its packed-sequence detection), packed
    windows, and right-padded rows (every real token; the pads' own states are never labelled)."""
    from neox_hf.ops.loss import decoder_hidden_states

    model = _tiny_neox("sdpa")
    isolated = build_eval_loader(DataConfig(validation=[small_gsm8k], mode="pack", isolate_documents=True,
                                            buffer_size=50), tok, seq_length=256, micro_batch_size=2, max_batches=1)[0]
    packed = build_eval_loader(DataConfig(validation=[small_gsm8k], mode="pack", buffer_size=50), tok,
                               seq_length=256, micro_batch_size=2, max_batches=1)[0]
    padded = build_eval_loader(DataConfig(validation=[small_gsm8k], mode="pad", buffer_size=50), tok,
                               seq_length=256, micro_batch_size=4, max_batches=1)[0]
    assert (padded["attention_mask"] == 0).any()  # rows of several lengths
    with torch.no_grad():
        for batch in (isolated, packed, padded):
            inputs = {k: batch[k] for k in ("input_ids", "position_ids", "attention_mask") if k in batch}
            theirs = model.gpt_neox(**inputs, use_cache=False).last_hidden_state
            ours = decoder_hidden_states(model, batch)
            real = batch["attention_mask"].bool() if "attention_mask" in batch else torch.ones_like(batch["input_ids"],
                                                                                                    dtype=torch.bool)
            assert (ours[real] - theirs[real]).abs().max().item() <= 1e-5
    assert model.config._attn_implementation == "sdpa"  # restored after each call


@pytest.mark.distributed  # slow tier: transformers compiles flex attention on its first call
def test_flex_attention_on_isolated_documents_equals_sdpa(tok, small_gsm8k):
    """`model.attn_implementation: flex_attention` is handed the documents' BlockMask (masked blocks skipped, built
    on the device): the same hidden states as the SDPA path, and not those of attention across documents."""
    from neox_hf.ops.loss import decoder_hidden_states

    batch = build_eval_loader(DataConfig(validation=[small_gsm8k], mode="pack", isolate_documents=True,
                                         buffer_size=50), tok, seq_length=256, micro_batch_size=2, max_batches=1)[0]
    across = {k: v for k, v in batch.items() if k != "position_ids"}
    with torch.no_grad():
        sdpa = decoder_hidden_states(_tiny_neox("sdpa"), batch)
        flex_model = _tiny_neox("flex_attention")
        flex = decoder_hidden_states(flex_model, batch)
        flex_across = decoder_hidden_states(flex_model, across)
    assert (flex - sdpa).abs().max().item() <= 1e-4
    assert (flex_across - sdpa).abs().max().item() > 1e-2
