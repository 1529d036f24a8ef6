"""`train.objective: lm`: next-token prediction, the loss of `neox_hf.ops.loss.causal_lm_loss` per labelled token;
for a mixture of experts in training, plus its router loss weighed as the micro-batch's tokens (`neox_hf.model.moe`)."""

from __future__ import annotations

import torch

from neox_hf.data.padding import IGNORE_INDEX
from neox_hf.model.moe import micro_batch_router_loss
from neox_hf.objectives.base import Objective, ObjectiveLoss
from neox_hf.ops.loss import causal_lm_loss, causal_lm_module


class LMObjective(Objective):
    name, unit, metric_names = "lm", "token", ()

    def units(self, batch: dict) -> torch.Tensor:
        return (batch["labels"] != IGNORE_INDEX).sum()

    def loss(self, model, batch: dict, *, fused: bool = True, z_loss: float = 0.0) -> ObjectiveLoss:
        loss_sum, tokens = causal_lm_loss(model, batch, fused=fused, z_loss=z_loss)
        router_loss = micro_batch_router_loss(causal_lm_module(model), batch, tokens)  # MoE: weighed as the tokens
        if router_loss is not None:
            loss_sum = loss_sum + router_loss
        return ObjectiveLoss(loss_sum=loss_sum, units=tokens, metric_sums={})
