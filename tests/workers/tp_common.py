"""Shared by the tp_* workers and tests/test_tensor_parallel.py: the tiny model and batches.

Workers are launched by torchrun with the gloo backend; each rank writes its results with
torch.save to <out>/<name>.rank<R>.pt and the pytest process asserts on them.
"""

import os

import torch
import torch.distributed as dist
from transformers import GPTNeoXConfig

from neox_hf.parallel.mappings import gather_along_dim
from neox_hf.parallel.tp_plan import partition_dim

STEPS = 5
LR = 1e-3


def tiny_config(**overrides) -> GPTNeoXConfig:
    values = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=256,
        vocab_size=256,
        max_position_embeddings=64,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    values.update(overrides)
    return GPTNeoXConfig(**values)


def batch(batch_size: int = 4, seq: int = 16, vocab: int = 256, seed: int = 1, ignore_some: bool = True):
    """(input_ids, labels): labels are unshifted copies of input_ids with a few -100s."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch_size, seq), generator=g)
    labels = input_ids.clone()
    if ignore_some:
        labels[0, 3:6] = -100
        labels[-1, -4:] = -100
    return input_ids, labels


def init_gloo() -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return dist.get_rank()


def gathered_grads(model, tp_group) -> dict:
    """Full-size gradient of every parameter, merged across TP ranks."""
    grads = {}
    for name, param in model.named_parameters():
        dim = partition_dim(name)
        grads[name] = param.grad.clone() if dim is None else gather_along_dim(param.grad, dim, tp_group)
    return grads


def tp_adamw_losses(model, input_ids, labels) -> list[float]:
    """Losses of STEPS AdamW steps on one batch, through the vocab-parallel loss."""

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = tp_causal_lm_loss(model, input_ids, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def save_rank_result(out_dir: str, name: str, result: dict) -> None:
    torch.save(result, os.path.join(out_dir, f"{name}.rank{dist.get_rank()}.pt"))


def tp_causal_lm_loss(model, input_ids, labels, attention_mask=None, position_ids=None, real_vocab_size=None):
    """`model(input_ids, labels=labels).loss` of a tensor-parallel model without gathering logits: transformers'
    label convention (unshifted; position t predicts labels[t + 1]), mean over non-ignored tokens. Test-only:
    training uses `neox_hf.ops.loss.causal_lm_loss` (aligned labels, loss sum)."""
    from neox_hf.parallel.tp_layers import vocab_parallel_cross_entropy

    head = model.get_output_embeddings()
    hidden = model.base_model(input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    # Shift before the head: the last position has no target, so its logits are never needed.
    return vocab_parallel_cross_entropy(head.forward_shard(hidden[:, :-1]), labels[:, 1:], head.group,
                                        head.vocab_start, real_vocab_size)


def tp_logits(model, input_ids, attention_mask=None, position_ids=None):
    """Full [batch, seq, vocab] logits, gathered on every TP rank."""
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
