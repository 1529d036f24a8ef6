"""`train.objective: dpo`: direct preference optimisation (Rafailov et al. 2023), as TRL's `DPOTrainer` computes it.

A sequence's log-probability is the sum over its completion tokens, taken from the decoder's hidden states by the
one head loss of neox_hf (`neox_hf.ops.head_loss`: fused chunked, vocab-parallel under TP), one row at a time:
−Σ cross-entropy of a row is its log-probability. Loss per pair, with π / ref the policy / reference log-probs and
c / r the chosen / rejected sequences:
  sigmoid  −log σ(β·((π_c − ref_c) − (π_r − ref_r)))
  ipo      ((π_c − ref_c)/n_c − (π_r − ref_r)/n_r − 1/(2β))², n the completion tokens (TRL's length normalisation)
Metrics (TRL's names), per pair: rewards/chosen = β(π_c − ref_c), rewards/rejected, rewards/margins (their
difference), rewards/accuracies (chosen reward > rejected reward), logps/chosen, logps/rejected.

The reference: `batch["ref_logps"]` ([2P], chosen rows first; precomputed once by `reference_logps` and added by
`attach_reference_logps`), else a frozen model set as `DPOObjective.reference_model` (forwarded with no grad); none
with `reference_free` (`train.dpo_reference: none`, GPT-NeoX's `dpo_reference_free`): ref = 0, the loss
−log σ(β(π_c − π_r)) and the rewards β·π.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn.functional as F

from neox_hf.errors import DataError
from neox_hf.model.moe import micro_batch_router_loss
from neox_hf.objectives.base import Objective, ObjectiveLoss, reference_logps_for, sequence_logps
from neox_hf.ops.context_parallel import counts_sequences
from neox_hf.ops.loss import causal_lm_module

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def dpo_losses(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, *, beta: float,
               loss_type: str = "sigmoid", chosen_tokens: Optional[torch.Tensor] = None,
               rejected_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-pair DPO losses [P] from the log-ratios π − ref of the chosen and rejected sequences (TRL's formulas)."""
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * (chosen_logratios - rejected_logratios))
    if loss_type == "ipo":
        delta = chosen_logratios / chosen_tokens.clamp(min=1) - rejected_logratios / rejected_tokens.clamp(min=1)
        return (delta - 1 / (2 * beta)) ** 2
    raise ValueError(f"train.dpo_loss_type must be sigmoid or ipo, got {loss_type!r}")


class DPOObjective(Objective):
    name, unit, metric_names = "dpo", "pair", METRICS
    rows_per_sample = 2

    @classmethod
    def from_train(cls, train_config) -> "DPOObjective":
        return cls(beta=train_config.dpo_beta, loss_type=train_config.dpo_loss_type,
                   reference_free=train_config.dpo_reference == "none")

    def __init__(self, beta: float = 0.1, loss_type: str = "sigmoid", reference_model=None,
                 reference_free: bool = False):
        if beta <= 0:
            raise ValueError(f"train.dpo_beta must be > 0, got {beta}")
        dpo_losses(torch.zeros(1), torch.zeros(1), beta=beta, loss_type=loss_type,
                   chosen_tokens=torch.ones(1), rejected_tokens=torch.ones(1))  # refuses an unknown loss type now
        self.beta, self.loss_type, self.reference_model = beta, loss_type, reference_model
        self.reference_free = reference_free

    def units(self, batch: dict) -> torch.Tensor:
        """Pairs of the batch; 0 on a context-parallel rank other than its group's first (`counts_sequences`)."""
        return torch.tensor(batch["input_ids"].shape[0] // 2 * counts_sequences(batch), device=batch["input_ids"].device)

    def loss(self, model, batch: dict, *, fused: bool = True, z_loss: float = 0.0) -> ObjectiveLoss:
        """z_loss is not applied: it would change the log-probabilities DPO compares (TRL has none either). Under
        context parallelism every rank of the group computes the whole pairs' loss; the first reports it."""
        logps, tokens = sequence_logps(model, batch, fused=fused)
        ref = self._reference(batch, fused)
        pairs = logps.shape[0] // 2
        chosen, rejected = logps[:pairs], logps[pairs:]
        chosen_ratio, rejected_ratio = chosen - ref[:pairs], rejected - ref[pairs:]
        losses = dpo_losses(chosen_ratio, rejected_ratio, beta=self.beta, loss_type=self.loss_type,
                            chosen_tokens=tokens[:pairs], rejected_tokens=tokens[pairs:])
        with torch.no_grad():
            reward_c, reward_r = self.beta * chosen_ratio, self.beta * rejected_ratio
            metrics = {"rewards/chosen": reward_c.sum(), "rewards/rejected": reward_r.sum(),
                       "rewards/accuracies": (reward_c > reward_r).float().sum(),
                       "rewards/margins": (reward_c - reward_r).sum(),
                       "logps/chosen": chosen.sum(), "logps/rejected": rejected.sum()}
        counted = float(counts_sequences(batch))
        loss_sum = losses.sum() * counted
        router_loss = micro_batch_router_loss(causal_lm_module(model), batch, self.units(batch))  # MoE, as TRL's
        if router_loss is not None:
            loss_sum = loss_sum + router_loss
        return ObjectiveLoss(loss_sum=loss_sum, units=self.units(batch),
                             metric_sums={k: v.detach() * counted for k, v in metrics.items()})

    def _reference(self, batch: dict, fused: bool) -> torch.Tensor:
        if self.reference_free:
            return torch.zeros(batch["input_ids"].shape[0], device=batch["input_ids"].device)
        return reference_logps_for(batch, self.reference_model, fused=fused, missing=(
            "a DPO batch needs `ref_logps` (attach_reference_logps with a precomputed table) or "
            "DPOObjective.reference_model (a frozen reference)"))


@torch.no_grad()
def reference_logps(model, batches: Iterable[dict], *, num_pairs: int, fused: bool = True) -> torch.Tensor:
    """[num_pairs, 2] float64: (chosen, rejected) log-probabilities under `model` of every pair the batches hold, at
    row `pair_index`; NaN for pairs no batch holds. Runs `model` in eval mode (dropout off) with no grad and puts
    its training mode back.

    Single-process semantics: every batch is forwarded here, on the batches' device. With several data-parallel
    ranks each rank fills the rows of its `PreferenceLoader.reference_batches()`; the full table is the sum over
    ranks of `torch.nan_to_num(table)` (every pair is computed by exactly one rank; a repeated pair lands on the same
    row with the same value). ZeRO-3 needs the same number of batches on every rank (`reference_batches` gives it).
    """
    table = torch.full((num_pairs, 2), float("nan"), dtype=torch.float64)
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            logps = sequence_logps(model, batch, fused=fused)[0].double().cpu()
            index = batch["pair_index"].cpu()
            pairs = len(index)
            table[index, 0], table[index, 1] = logps[:pairs], logps[pairs:]
    finally:
        model.train(was_training)
    return table


def attach_reference_logps(batch: dict, table: torch.Tensor) -> dict:
    """`batch` with `ref_logps` [2P] (chosen rows, then rejected) looked up by `pair_index` in a `reference_logps`
    table; DataError naming the pairs the table lacks."""
    index = batch["pair_index"].cpu()
    rows = table[index]
    missing = torch.isnan(rows).any(dim=1)
    if missing.any():
        raise DataError(f"no reference log-probabilities for pairs {index[missing].tolist()[:5]}: precompute them over "
                        "every pair (merge the data-parallel ranks' tables) before training")
    ref = torch.cat([rows[:, 0], rows[:, 1]]).to(device=batch["input_ids"].device, dtype=torch.float32)
    return {**batch, "ref_logps": ref}
