"""How much each micro-batch's loss weighs in an optimizer step: the one place with that arithmetic, for every
engine and objective.

An objective's loss over a micro-batch is a sum over its units (labelled tokens for `lm`, pairs for `dpo`/`rm`) and
a count of them. The engines — Accelerate, DeepSpeed, DeepSpeed's pipeline — divide what is backpropagated by the
accumulation steps and average gradients over data-parallel ranks. So a micro-batch backpropagates
`loss_sum × backward_scale(...)`:

- `token` (default): gas × dp / N, N = the step's units over every micro-batch and data-parallel rank, counted before
  the first backward → the gradient of Σ unit losses / N: every token (pair) weighs the same wherever it fell
  (transformers' `num_items_in_batch`);
- `micro_batch`: 1 / units → the mean of per-micro-batch means (GPT-NeoX / Megatron).

The step's logged loss is what its gradient is of: Σ over micro-batches and ranks of loss_sum × scale, / (gas × dp).
"""

from __future__ import annotations

import torch


def backward_scale(normalization: str, units: torch.Tensor, step_units: torch.Tensor, *, gas: int,
                   dp: int) -> torch.Tensor:
    """The multiplier of one micro-batch's loss sum before backward (a device tensor: no wait for the host)."""
    if normalization == "token":
        return gas * dp / step_units.clamp(min=1)
    return 1.0 / units.clamp(min=1)


def step_loss(weighted_sum: torch.Tensor, *, gas: int, dp: int) -> torch.Tensor:
    """The step's loss from Σ loss_sum × backward_scale over its micro-batches and data-parallel ranks."""
    return weighted_sum / (gas * dp)
