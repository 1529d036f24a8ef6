"""Recipe checks that need a table per choice: each optimizer's hyperparameters in the range its library accepts.

Gap filled: torch.optim, lion-pytorch, pytorch-optimizer and bitsandbytes check their arguments when the optimizer is
constructed, which is after the model is built (minutes for a real one), and say it as a bare `ValueError` /
`AssertionError` without the recipe key; torch's SGD accepts a momentum ≥ 1, which trains and diverges. Here each
optimizer's keys are checked at recipe validation against the library's own ranges (read from its constructor),
narrowed only where the library's range holds a value that cannot train (`why` says which).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from neox_hf.errors import RecipeError


def _require(condition: bool, message: str) -> None:
    """The one-line refusal every recipe rule raises (`tools/generate_docs.py` lists the messages of its calls)."""
    if not condition:
        raise RecipeError(message)


@dataclass(frozen=True)
class Range:
    """`low`..`high` with each end open or closed; `why`, where the library accepts more than this: what that more
    does."""

    low: float
    high: float = math.inf
    closed_low: bool = True
    closed_high: bool = False
    why: str = ""

    def holds(self, value: float) -> bool:
        above = value >= self.low if self.closed_low else value > self.low
        below = value <= self.high if self.closed_high else value < self.high
        return above and below  # NaN holds in no range

    def describe(self) -> str:
        if self.high == math.inf:
            return f"{'≥' if self.closed_low else '>'} {self.low:g}"
        return f"in {'[' if self.closed_low else '('}{self.low:g}, {self.high:g}{']' if self.closed_high else ')'}"


_BETA = Range(0.0, 1.0)  # torch's Adam/AdamW and bitsandbytes: 0 ≤ β < 1
_EPS = Range(0.0, closed_low=False, why="the libraries accept 0, which divides 0 by 0 wherever a gradient is 0 (an "
                                        "embedding row no token used yet): NaN weights")
_DECAY = Range(0.0)  # torch and bitsandbytes: weight_decay ≥ 0
_LION_BETA = Range(0.0, 1.0, closed_high=True)  # lion-pytorch asserts 0 ≤ β ≤ 1 (β2 = 1: signSGD, still a method)

# `train.optimizer` → (the library class it builds, {recipe key: its range}); the keys the optimizer reads.
OPTIMIZER_RANGES: dict[str, tuple[str, dict[str, Range]]] = {
    "adamw": ("torch.optim.AdamW", {"adam_beta1": _BETA, "adam_beta2": _BETA, "adam_eps": _EPS, "weight_decay": _DECAY}),
    "adam": ("torch.optim.Adam", {"adam_beta1": _BETA, "adam_beta2": _BETA, "adam_eps": _EPS, "weight_decay": _DECAY}),
    "sgd": ("torch.optim.SGD", {
        "momentum": Range(0.0, 1.0, why="torch accepts any momentum ≥ 0, but from 1 on the velocity never decays: "
                                        "each step is larger than the last and training diverges"),
        "weight_decay": _DECAY}),
    "lion": ("lion_pytorch.Lion", {"adam_beta1": _LION_BETA, "adam_beta2": _LION_BETA, "weight_decay": Range(
        0.0, why="lion-pytorch does not check it; a negative decay grows every weight at each step")}),
    # pytorch-optimizer's SM3: momentum in [0, 1), beta in [0, 1], eps ≥ 0; it reads no weight decay
    "sm3": ("pytorch_optimizer.SM3", {
        "momentum": Range(0.0, 1.0),
        "sm3_beta": Range(0.0, 1.0, why="pytorch-optimizer accepts 1, which keeps the accumulators at zero: each "
                                        "update is the gradient divided by √eps"),
        "adam_eps": _EPS}),
    "adam8bit": ("bitsandbytes.optim.Adam8bit",
                 {"adam_beta1": _BETA, "adam_beta2": _BETA, "adam_eps": _EPS, "weight_decay": _DECAY}),
}

# Where a GPT-NeoX config sets each key (neox_yaml translates it), for a user who wrote the GPT-NeoX name.
_NEOX_NAMES = {"adam_beta1": "optimizer.params.betas[0]", "adam_beta2": "optimizer.params.betas[1]",
               "adam_eps": "optimizer.params.eps", "momentum": "optimizer.params.momentum",
               "sm3_beta": "optimizer.params.beta", "weight_decay": "weight_decay"}


def check_optimizer_hyperparameters(train) -> None:
    """Each hyperparameter `train.optimizer` reads, in its library's range: one line naming the key, the value, the
    range and the library, or nothing. The keys it does not read are not checked (SGD has no betas)."""
    library, ranges = OPTIMIZER_RANGES[train.optimizer]
    for key, allowed in ranges.items():
        value = getattr(train, key)
        if allowed.holds(value):
            continue
        why = f" ({allowed.why})" if allowed.why else ""
        raise RecipeError(f"`train.{key}` (GPT-NeoX {_NEOX_NAMES[key]}) is {value:g}; `train.optimizer: "
                          f"{train.optimizer}` ({library}) needs it {allowed.describe()}{why}")
