"""GPT-NeoX's global batch (`train.train_batch_size`): micro × accumulation × data-parallel size must equal it.

A size no data-parallel size reaches is refused when the recipe is validated; one that needs another size than the
launch gives is found at launch (`train_batch_disagreement`), with the fixes from the two helpers below.
"""

from __future__ import annotations

from neox_hf.errors import RecipeError
from neox_hf.recipe.checks import _require
from neox_hf.recipe.keys import TrainConfig


def _validate_train_batch(t: TrainConfig) -> None:
    """A train_batch_size no data-parallel size reaches is refused here; one that needs another size than the
    launch's, at launch (`train_batch_disagreement`)."""
    if t.train_batch_size is None:
        return
    _require(t.train_batch_size > 0, f"`train.train_batch_size` must be > 0, got {t.train_batch_size}")
    per_replica = t.micro_batch_size * t.gradient_accumulation_steps
    if t.train_batch_size % per_replica:
        fix = (f"pass a --train.gradient_accumulation_steps that divides {t.train_batch_size // t.micro_batch_size}"
               if t.train_batch_size % t.micro_batch_size == 0 else
               f"pass a --train.micro_batch_size that divides {t.train_batch_size}")
        raise RecipeError(f"`train.train_batch_size` {t.train_batch_size} is not micro batch {t.micro_batch_size} × "
                          f"gradient_accumulation_steps {t.gradient_accumulation_steps} × any number of data-parallel "
                          f"processes; GPT-NeoX refuses it: {fix}")


def data_parallel_for_train_batch(t: TrainConfig) -> int | None:
    """The data-parallel size at which micro × accumulation gives train_batch_size (None: the recipe sets none)."""
    if t.train_batch_size is None:
        return None
    return t.train_batch_size // (t.micro_batch_size * t.gradient_accumulation_steps)


def accumulation_for_train_batch(t: TrainConfig, data_parallel: int) -> int | None:
    """The gradient_accumulation_steps that gives train_batch_size on `data_parallel` ranks, None where none does."""
    if t.train_batch_size is None:
        return None
    accumulation, rest = divmod(t.train_batch_size, t.micro_batch_size * data_parallel)
    return accumulation if accumulation and not rest else None


def train_batch_disagreement(t: TrainConfig, data_parallel: int) -> str | None:
    """None when the recipe's train_batch_size is micro × accumulation × `data_parallel` (or it sets none); else the
    sentence saying how they disagree, as GPT-NeoX's check_batch_parameters refuses it (the caller adds the fixes
    its entry point offers: `data_parallel_for_train_batch`, `accumulation_for_train_batch`)."""
    if t.train_batch_size is None:
        return None
    trained = t.micro_batch_size * t.gradient_accumulation_steps * data_parallel
    if trained == t.train_batch_size:
        return None
    return (f"train_batch_size {t.train_batch_size} is not micro batch {t.micro_batch_size} × "
            f"gradient_accumulation_steps {t.gradient_accumulation_steps} × {data_parallel} data-parallel "
            f"process(es) (= {trained}); GPT-NeoX refuses it")
