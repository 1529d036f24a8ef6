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

import torch

from neox_hf.ops.linear_cross_entropy import head_loss

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def causal_lm_loss(model, batch: dict, *, fused: bool = True, z_loss: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ token cross-entropies, labelled-token count) of one batch; both 0-dim tensors on the batch's device."""
    lm = causal_lm_module(model)
    hidden = lm.base_model(**{k: batch[k] for k in MODEL_INPUTS if k in batch}, use_cache=False).last_hidden_state
    return head_loss(lm.get_output_embeddings(), hidden, batch["labels"], fused=fused, z_loss=z_loss)


def causal_lm_module(model):
    """The `GPTNeoXForCausalLM` inside a DeepSpeed engine (`.module`) and a PEFT wrapper (`get_base_model()`).

    Calling its decoder directly, instead of the wrapper's forward, is safe for what we launch: one process, or
    DeepSpeed (whose ZeRO-3 hooks sit on the submodules themselves). Multi-process runs always go through DeepSpeed
    (parallel/accelerator.py), never DDP, whose gradient hooks need its own forward.
    """
    module = getattr(model, "module", model)
    return module.get_base_model() if hasattr(module, "get_base_model") else module
