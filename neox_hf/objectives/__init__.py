"""Training objectives as plug-ins (`train.objective: lm | dpo | rm | kto`): each owns its batch format, its loss
and its logged metrics; any engine runs any objective.

The loss is a sum and a count (`ObjectiveLoss`), never a mean, for the reason `neox_hf.ops.loss` gives for tokens:
the step divides the sum by the units of the whole optimizer step (every micro-batch, every data-parallel rank), so
micro-batching and data parallelism do not change the loss. The unit is a labelled token for `lm`, a preference pair
for `dpo` and `rm`, an example for `kto` (TRL averages its per-pair losses over the batch; summed pairs over the
step's pairs is the same mean when every micro-batch holds P pairs, and the exact mean when one holds fewer).

Batch formats: `lm` the loaders of `neox_hf.data.loader`; `dpo` / `rm` / `kto` those of `neox_hf.data.preference`
(2P rows, chosen first, `pair_index`; dpo also `labels`, and `ref_logps` once attached by
`neox_hf.objectives.dpo.attach_reference_logps`; kto the examples then their KL sequences, `labels`, `label`).
"""

from __future__ import annotations

from neox_hf.errors import RecipeError
from neox_hf.objectives.base import Objective, ObjectiveLoss
from neox_hf.objectives.dpo import DPOObjective
from neox_hf.objectives.kto import KTOObjective
from neox_hf.objectives.lm import LMObjective
from neox_hf.objectives.rm import RewardObjective

# `train.objective` → its class: adding an objective is its module plus one line here.
OBJECTIVES: dict[str, type[Objective]] = {"lm": LMObjective, "dpo": DPOObjective, "rm": RewardObjective,
                                           "kto": KTOObjective}


def build_objective(train_config) -> Objective:
    """The objective of a recipe's `train` section (`neox_hf.recipe.TrainConfig`)."""
    name = train_config.objective
    if name not in OBJECTIVES:
        raise RecipeError(f"`train.objective: {name}` is not one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name].from_train(train_config)


__all__ = ["OBJECTIVES", "Objective", "ObjectiveLoss", "build_objective"]
