"""TP=2 worker for tests/test_fused_cross_entropy.py: the fused loss through a VocabParallelLMHead. Usage:
    torchrun --nproc_per_node 2 tests/workers/fused_ce_tp2.py <out_dir>
Each rank holds half of the head's vocabulary rows; it saves the loss, the count, the gradient of the hidden states
(replicated, or with sequence parallelism this rank's sequence slice, gathered) and the head-weight gradient gathered
over the ranks, for the pytest process to compare.
"""

import os
import sys

import torch
from tp_common import init_gloo, save_rank_result

from neox_hf.ops import lm_head_loss
from neox_hf.parallel.mappings import gather_along_dim, gather_from_sequence_region, split_along_dim
from neox_hf.parallel.tp_layers import VocabParallelLMHead

VOCAB, WIDTH = 256, 16


def case():
    """(hidden [B, S, H], full head weight [V, H], labels with -100s): the same on every rank and in pytest."""
    g = torch.Generator().manual_seed(21)
    hidden = 2 * torch.randn(4, 12, WIDTH, generator=g)
    weight = torch.randn(VOCAB, WIDTH, generator=g) / WIDTH**0.5
    labels = torch.randint(0, VOCAB, (4, 12), generator=g)
    labels[0, :5] = -100
    labels[2, 7:] = -100
    return hidden, weight, labels


def run(group, z_loss, sequence_parallel=False):
    hidden, weight, labels = case()
    rank, size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    rows = VOCAB // size
    head = VocabParallelLMHead(weight[rank * rows:(rank + 1) * rows].clone(), rank * rows, group,
                               sequence_parallel=sequence_parallel)
    if sequence_parallel:
        # As after the final SequenceParallelLayerNorm: each rank holds a slice of the sequence, gathered for the head.
        own = split_along_dim(hidden, 1, group).requires_grad_()
        loss, count = lm_head_loss(head, gather_from_sequence_region(own, group), labels, z_loss=z_loss, chunk_size=10)
    else:
        own = hidden.requires_grad_()
        loss, count = lm_head_loss(head, own, labels, z_loss=z_loss, chunk_size=10)
    (3.0 * loss).backward()
    d_hidden = gather_along_dim(own.grad, 1, group) if sequence_parallel else own.grad
    return {"loss": loss.detach(), "count": int(count), "d_hidden": d_hidden,
            "d_weight": gather_along_dim(head.weight.grad, 0, group)}


def main(out_dir):
    init_gloo()
    group = torch.distributed.new_group([0, 1])
    save_rank_result(out_dir, "plain", run(group, 0.0))
    save_rank_result(out_dir, "z_loss", run(group, 1e-3))
    save_rank_result(out_dir, "sequence_parallel", run(group, 0.0, sequence_parallel=True))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
