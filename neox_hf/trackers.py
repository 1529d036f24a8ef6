"""Experiment trackers for a run: which ones (`log_with`) and how to start them (`init_trackers` arguments).

Accelerate owns the trackers (TensorBoard, Weights & Biases, Comet, MLflow, Aim); the recipe says which
(`output.report_to`, plus TensorBoard while `output.tensorboard` is true), the project and the run name. The gap
filled here: Accelerate logs whatever `config` it is given, and some trackers (TensorBoard's hparams) take only
scalars, so the resolved recipe is flattened to `section.key` scalars with secrets removed before it is handed over.

Where each tracker writes: TensorBoard under `OUT/runs/PROJECT/`, wandb under `OUT/wandb/` (`WANDB_MODE=offline`
keeps it there), Aim's repository under `OUT/runs/`, MLflow and Comet where their own settings say.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from neox_hf.recipe import Recipe

REDACTED = "<redacted>"
# A key whose name says it holds a credential is never logged, whatever its value.
_SECRET_KEY = re.compile(r"^(\w+_)?(token|secret|password|api_?key|credentials?)$", re.IGNORECASE)
# Values that carry a credential inside them: Hugging Face / wandb-style tokens, and user:password@ in URLs.
_SECRET_VALUES = (
    re.compile(r"\bhf_[A-Za-z0-9]{20,}"),
    re.compile(r"(?<=://)[^/\s:@]+:[^/\s@]+(?=@)"),
)


def tracker_names(recipe: Recipe) -> list[str]:
    """Accelerate's `log_with` list: `output.report_to` in order, plus tensorboard while `output.tensorboard`."""
    names = list(dict.fromkeys(recipe.output.report_to))
    if recipe.output.tensorboard and "tensorboard" not in names:
        names.append("tensorboard")
    return names


def run_name(recipe: Recipe) -> str:
    """`output.run_name`, else the output folder's name (`outputs/tiny` → `tiny`)."""
    return recipe.output.run_name or Path(recipe.output.dir).resolve().name


def init_tracker_kwargs(recipe: Recipe) -> dict[str, Any]:
    """Keyword arguments for `accelerator.init_trackers(**kwargs)`: project, the flat recipe, per-tracker names."""
    name = run_name(recipe)
    out = str(Path(recipe.output.dir).resolve())
    per_tracker: dict[str, dict] = {}
    names = tracker_names(recipe)
    if "wandb" in names:
        per_tracker["wandb"] = {"name": name, "dir": out}
    if "mlflow" in names:
        per_tracker["mlflow"] = {"run_name": name}
    if "comet_ml" in names:
        import comet_ml  # validated importable by the recipe

        per_tracker["comet_ml"] = {"experiment_config": comet_ml.ExperimentConfig(name=name)}
    return {"project_name": recipe.output.project, "config": tracker_config(recipe), "init_kwargs": per_tracker}


def tracker_config(recipe: Recipe) -> dict[str, Any]:
    """The resolved recipe as `section.key → scalar` (lists and nested values as text), secrets redacted."""
    flat: dict[str, Any] = {}
    _flatten(recipe.to_dict(), "", flat)
    return {key: _redact(key, value) for key, value in flat.items()}


def _flatten(tree: dict, prefix: str, out: dict) -> None:
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            _flatten(value, f"{path}.", out)
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[path] = value
        else:
            out[path] = str(value)


def _redact(key: str, value: Any) -> Any:
    if _SECRET_KEY.match(key.rsplit(".", 1)[-1]) and not key.endswith(("eos_token", "pad_token")):
        return REDACTED if value not in (None, "") else value
    if isinstance(value, str):
        for pattern in _SECRET_VALUES:
            value = pattern.sub(REDACTED, value)
    return value
