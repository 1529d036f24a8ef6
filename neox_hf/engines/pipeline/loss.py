"""The last stage's loss: the head applied inside the loss function (fused with the cross-entropy, vocab-parallel
under TP), so no stage returns [batch, seq, vocab] logits; each micro-batch's loss weighted as the plain engine
weighs it (`neox_hf.ops.weighting`)."""

from __future__ import annotations

import torch
from torch import nn

from neox_hf.ops.weighting import backward_scale


IGNORE_INDEX = -100


def head_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, *, fused: bool = True,
              z_loss: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ token cross-entropies, labelled tokens) of the last stage: the one head loss of `neox_hf.ops`, as training
    without stages computes it (fused chunked cross-entropy by default, vocab-parallel under TP)."""
    from neox_hf.ops import head_loss as shared_head_loss  # ops imports parallel's TP layers: import at call time

    return shared_head_loss(head, hidden, labels, fused=fused, z_loss=z_loss)


class StageLoss:
    """`loss_fn(outputs, labels)` of the PipelineModule, run on the last stage for every micro-batch: the head loss
    weighted by `backward_scale` (the step sets `step_units`, `gas` and `dp` before the schedule runs). Every call
    records (loss_sum, tokens) for evaluation's token-weighted totals."""

    def __init__(self, normalization: str = "token", fused: bool = True):
        self.normalization, self.fused = normalization, fused
        self.step_units, self.gas, self.dp = torch.ones((), dtype=torch.float64), 1, 1
        self.head_provider = None
        self.records: list[torch.Tensor] = []

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss_sum, tokens = head_loss(self.head_provider(), hidden, labels, fused=self.fused)
        self.records.append(torch.stack([loss_sum.detach().double(), tokens.double()]))
        scale = backward_scale(self.normalization, tokens.double(), self.step_units.to(tokens.device),
                               gas=self.gas, dp=self.dp)
        return loss_sum * scale.to(loss_sum.dtype)
