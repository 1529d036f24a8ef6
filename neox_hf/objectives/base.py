"""What the training step asks of an objective (`neox_hf.objectives` says why the loss is a sum and a count)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from neox_hf.errors import DataError
from neox_hf.ops.context_parallel import sequence_total
from neox_hf.ops.linear_cross_entropy import head_loss
from neox_hf.ops.loss import causal_lm_module, decoder_hidden_states


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
    rows_per_sample: int = 1  # batch rows of one sample: 2 for a pair (chosen, rejected) or a KTO example (+ its KL row)
    # The run's data-parallel process group (None: one replica), set by the engine: what TRL's processes are, for an
    # estimate TRL gathers over them (KTO's KL)
    data_parallel_group = None

    def units(self, batch: dict) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def from_train(cls, train_config) -> "Objective":
        """The objective with its settings from a recipe's `train` section (`neox_hf.recipe.TrainConfig`)."""
        return cls()

    def loss(self, model, batch: dict, *, fused: bool = True, z_loss: float = 0.0) -> ObjectiveLoss:
        raise NotImplementedError


def sequence_logps(model, batch: dict, *, fused: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities [rows], labelled tokens [rows]) of every row of `batch` under `model`: the sum of its
    labelled tokens' log-probabilities. The decoder runs once over all rows; the head loss once per row. A
    context-parallel chunk's sums and counts are summed over its group: every rank gets the whole sequences'."""
    lm = causal_lm_module(model)
    hidden = decoder_hidden_states(lm, batch)
    head, labels = lm.get_output_embeddings(), batch["labels"]
    sums, counts = zip(*(head_loss(head, hidden[i: i + 1], labels[i: i + 1], fused=fused) for i in range(len(labels))))
    return -sequence_total(torch.stack(sums), batch), sequence_total(torch.stack(counts), batch)


def reference_logps_for(batch: dict, reference_model, *, fused: bool, missing: str) -> torch.Tensor:
    """The reference log-probabilities [rows] a preference objective (DPO, KTO) compares with: the precomputed
    `ref_logps` the batch carries, else those of the frozen `reference_model` (no gradient); neither is a DataError
    saying `missing`."""
    if "ref_logps" in batch:
        return batch["ref_logps"].to(device=batch["input_ids"].device, dtype=torch.float32)
    if reference_model is None:
        raise DataError(missing)
    with torch.no_grad():
        return sequence_logps(reference_model, batch, fused=fused)[0].detach()
