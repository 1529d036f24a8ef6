"""Training objectives as plug-ins (`train.objective: lm | dpo | rm`): each owns its batch format, its loss and its
logged metrics; any engine runs any objective.

The loss is a sum and a count (`ObjectiveLoss`), never a mean, for the reason `neox_hf.train.loss` gives for tokens:
the step divides the sum by the units of the whole optimizer step (every micro-batch, every data-parallel rank), so
micro-batching and data parallelism do not change the loss. The unit is a labelled token for `lm` and a preference
pair for `dpo` and `rm` (TRL averages its per-pair losses over the batch; summed pairs over the step's pairs is the
same mean when every micro-batch holds P pairs, and the exact mean when one holds fewer).

Batch formats: `lm` the loaders of `neox_hf.data.loader`; `dpo` / `rm` those of `neox_hf.data.preference` (2P rows,
chosen first, `pair_index`; dpo also `labels`, and `ref_logps` once attached by
`neox_hf.objectives.dpo.attach_reference_logps`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ObjectiveLoss:
    loss_sum: torch.Tensor  # 0-dim, Σ of the loss over this micro-batch's units, differentiable
    units: torch.Tensor  # 0-dim, how many units (labelled tokens for lm, pairs for dpo/rm)
    metric_sums: dict[str, torch.Tensor] = field(default_factory=dict)  # TRL's metric names → 0-dim Σ over units, detached


class Objective:
    """What the training step asks of an objective. `units(batch)` is known before the forward (the step sums it over
    micro-batches and ranks before the first backward); `loss(model, batch)` runs the forward."""

    name: str = ""
    unit: str = ""
    metric_names: tuple[str, ...] = ()

    def units(self, batch: dict) -> torch.Tensor:
        raise NotImplementedError

    def loss(self, model, batch: dict, *, fused: bool = True, z_loss: float = 0.0) -> ObjectiveLoss:
        raise NotImplementedError


def build_objective(train_config) -> Objective:
    """The objective of a recipe's `train` section (`neox_hf.recipe.TrainConfig`)."""
    name = train_config.objective
    if name == "lm":
        from neox_hf.objectives.lm import LMObjective

        return LMObjective()
    if name == "dpo":
        from neox_hf.objectives.dpo import DPOObjective

        return DPOObjective(beta=train_config.dpo_beta, loss_type=train_config.dpo_loss_type)
    if name == "rm":
        from neox_hf.objectives.rm import RewardObjective

        return RewardObjective()
    from neox_hf.errors import RecipeError

    raise RecipeError(f"`train.objective: {name}` is not one of lm, dpo, rm")


__all__ = ["Objective", "ObjectiveLoss", "build_objective"]
