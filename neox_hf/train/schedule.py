"""GPT-NeoX's learning-rate schedule: linear warmup over a fraction of the decay steps, then cosine/linear to min_lr.

Gap filled: transformers' `get_cosine_schedule_with_warmup` decays to 0 and counts warmup in steps; GPT-NeoX
(megatron/learning_rates.py) decays to `min_lr`, counts warmup as `warmup × lr_decay_iters`, and holds `min_lr`
after `lr_decay_iters`.
"""

from __future__ import annotations

import math

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


class GPTNeoXLRScheduler:
    """Sets `lr_at(step)` on every param group of the live optimizer, once per optimizer step.

    Not a torch LambdaLR: DeepSpeed ZeRO rebuilds the optimizer's param groups (ZeRO-3 merges and flattens them), so a
    scheduler that remembers one base lr per group at construction breaks. Setting the lr on whatever groups exist is
    what DeepSpeed's own schedulers do.
    """

    def __init__(self, optimizer, train: TrainConfig):
        self.optimizer = optimizer
        self.train = train
        self.step_count = 0
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step_count, self.train)

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [lr_at(self.step_count, self.train)]

    def state_dict(self) -> dict:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])
        self._apply()


def build_lr_scheduler(optimizer, train: TrainConfig) -> GPTNeoXLRScheduler:
    """Build it on the optimizer returned by `accelerator.prepare` (the one DeepSpeed really steps)."""
    return GPTNeoXLRScheduler(optimizer, train)
