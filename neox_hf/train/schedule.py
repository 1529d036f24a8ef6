"""GPT-NeoX's learning-rate schedule: linear warmup over a fraction of the decay steps, then cosine/linear to min_lr.

Gap filled: transformers' `get_cosine_schedule_with_warmup` decays to 0 and counts warmup in steps; GPT-NeoX
(megatron/learning_rates.py) decays to `min_lr`, counts warmup as `warmup × lr_decay_iters`, and holds `min_lr`
after `lr_decay_iters`.
"""

from __future__ import annotations

import math

import torch

from neox_hf.recipe import TrainConfig


def lr_at(step: int, train: TrainConfig) -> float:
    """Learning rate after `step` optimizer steps (step 0 = the first update)."""
    decay_iters = train.lr_decay_iters or train.train_iters
    warmup_iters = int(train.warmup * decay_iters)
    if warmup_iters > 0 and step < warmup_iters:
        return train.lr * (step + 1) / warmup_iters
    if train.lr_decay_style == "constant":
        return train.lr
    if step >= decay_iters:
        return train.min_lr
    progress = (step - warmup_iters) / max(1, decay_iters - warmup_iters)
    if train.lr_decay_style == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (math.cos(math.pi * progress) + 1.0)
    return train.min_lr + (train.lr - train.min_lr) * factor


def build_lr_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR on the raw optimizer; the loop steps it once per optimizer step (not per micro-batch)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, train) / train.lr)
