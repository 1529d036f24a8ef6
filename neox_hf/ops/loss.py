"""The one causal-LM loss of neox_hf: training, eval, benchmarks and tests all call `causal_lm_loss`.

It returns `(sum of token losses, number of labelled tokens)`, never a mean, so the caller decides the weighting:
the training step divides by the labelled tokens of the whole optimizer step (every micro-batch, every
data-parallel rank), eval by the tokens of the whole eval set. Averaging per-batch means instead weighs a token of a
short batch more than one of a long batch — the bug transformers fixed in `Trainer` with `num_items_in_batch`.

One label convention: `batch["labels"]` is already aligned with the input positions (position t predicts
labels[t]; the data loader shifts), -100 is ignored.

The loss is computed from the decoder's final hidden states, never from `model(...).logits`, by `neox_hf.ops.head_loss`
(shared with the pipeline's last stage): with `train.fused_cross_entropy` (the default) the chunked linear +
cross-entropy, vocab-parallel under TP, which never materialises [tokens, vocab] logits; otherwise the head's own
sharded loss (TP) or full logits.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from neox_hf.ops.linear_cross_entropy import head_loss

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")

# transformers' SDPA attention under a name with no mask function of its own: `create_causal_mask` then hands the
# attention the mask it was given as is (None: SDPA's `is_causal`, the flash / memory-efficient kernels), instead of
# inspecting `position_ids` for packed documents, which reads a device value on the host every forward
# (masking_utils `find_packed_sequence_indices`: one CUDA sync per micro-batch).
CAUSAL_SDPA = "neox_hf_causal_sdpa"
AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)

# The key of a context-parallel chunk's `SequenceChunk` in its batch (`neox_hf.ops.context_parallel.sequence_chunk`).
SEQUENCE_CHUNK = "sequence_chunk"


def causal_lm_loss(model, batch: dict, *, fused: bool = True, z_loss: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ token cross-entropies, labelled-token count) of one batch; both 0-dim tensors on the batch's device."""
    lm = causal_lm_module(model)
    hidden = decoder_hidden_states(lm, batch)
    return head_loss(lm.get_output_embeddings(), hidden, batch["labels"], fused=fused, z_loss=z_loss)


def decoder_hidden_states(lm, batch: dict) -> torch.Tensor:
    """The decoder's last hidden states [B, T, H] for a batch of our loaders, without a host sync under SDPA.

    Our batches are right-padded or packed (`neox_hf.data`), so under causal attention a real token never attends to
    a pad after it: the padding mask changes nothing a label reads, and SDPA runs causal with no mask at all. Packed
    documents kept apart (`position_ids` restarting at each document) get their block-diagonal causal mask built
    here on the device, as transformers would build it after reading the positions on the host. Other attention
    implementations get the batch's own mask and positions, as before, except flex attention, which is handed the
    documents' `BlockMask` built here the same way (its masked blocks are skipped, not computed). A context-parallel
    chunk (`neox_hf.ops.context_parallel`) runs with the attention it names, which masks the whole sequence."""
    chunk = batch.get(SEQUENCE_CHUNK)
    if chunk is not None:  # this rank's chunk of context-parallel sequences: its attention builds the mask
        with attention_implementation(lm.config, chunk.attention):
            return lm.base_model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=None,
                                 use_cache=False, isolate_documents=chunk.isolate_documents).last_hidden_state
    implementation = lm.config._attn_implementation
    position_ids = batch.get("position_ids")
    if implementation == "flex_attention":
        mask = document_block_mask(position_ids, *batch["input_ids"].shape, device=batch["input_ids"].device)
        return lm.base_model(input_ids=batch["input_ids"], position_ids=position_ids, attention_mask=mask,
                             use_cache=False).last_hidden_state
    if implementation != "sdpa":
        return lm.base_model(**{k: batch[k] for k in MODEL_INPUTS if k in batch}, use_cache=False).last_hidden_state
    mask = None if position_ids is None else document_causal_mask(position_ids)
    with attention_implementation(lm.config, CAUSAL_SDPA):
        return lm.base_model(input_ids=batch["input_ids"], position_ids=position_ids, attention_mask=mask,
                             use_cache=False).last_hidden_state


def document_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool: position i attends to j ≤ i of the same document; a document starts where its position
    id is 0 (GPT-NeoX's `reset_position_ids`, our packer's `isolate_documents`)."""
    documents = torch.cumsum(position_ids == 0, dim=-1)
    same = documents.unsqueeze(-1) == documents.unsqueeze(-2)
    causal = torch.ones(position_ids.shape[-1], position_ids.shape[-1], dtype=torch.bool,
                        device=position_ids.device).tril()
    return (same & causal).unsqueeze(1)


def document_block_mask(position_ids: torch.Tensor | None, batch: int, length: int, *, device):
    """flex attention's `BlockMask` of `document_causal_mask` (plain causal without `position_ids`), built on the
    device without reading a value on the host."""
    from torch.nn.attention.flex_attention import create_block_mask

    if position_ids is None:
        def mask_mod(b, h, q, kv):
            return kv <= q
    else:
        documents = torch.cumsum(position_ids.expand(batch, -1) == 0, dim=-1)

        def mask_mod(b, h, q, kv):
            return (documents[b, q] == documents[b, kv]) & (kv <= q)
    return create_block_mask(mask_mod, batch, None, length, length, device=device)


@contextlib.contextmanager
def attention_implementation(config, name: str):
    """`config` runs attention through `name` inside the block: the modules read it at every forward."""
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


def causal_lm_module(model):
    """The `GPTNeoXForCausalLM` inside a DeepSpeed engine (`.module`) and a PEFT wrapper (`get_base_model()`).

    Calling its decoder directly, instead of the wrapper's forward, is safe for what we launch: one process, or
    DeepSpeed (whose ZeRO-3 hooks sit on the submodules themselves; the one thing its forward adds that a step
    needs, starting a micro-batch in ZeRO's accumulation count, the engine does before each micro-batch:
    `PlainEngine.before_micro_batch`). Multi-process runs always go through DeepSpeed (parallel/accelerator.py) or
    FSDP2 (hooks on the sharded modules), never DDP, whose gradient hooks need its own forward.
    """
    module = getattr(model, "module", model)
    return module.get_base_model() if hasattr(module, "get_base_model") else module
