"""A typed, validated `Recipe` from a plain nested dict (a merged YAML tree): unknown keys refused with the closest
valid one, each value checked against its field's type, `train.precision: auto` settled, then every rule checked."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Literal, Union

from neox_hf.errors import RecipeError
from neox_hf.recipe.keys import LLAMA_DEFAULTS, Recipe
from neox_hf.recipe.validate import validate


def recipe_from_dict(raw: dict, source: str = "recipe") -> Recipe:
    """Typed, validated Recipe from a nested dict (keys may use '-' for '_', as GPT-NeoX users write them)."""
    recipe = _build(Recipe, _with_family_defaults(raw), path="", source=source)
    return settled(recipe)


def settled(recipe: Recipe) -> Recipe:
    """`recipe` with `train.precision: auto` resolved for this device (or the checkpoint it resumes), validated.
    The start-up notices of that choice are in `recipe.settled_notices` (not a recipe key: never serialised)."""
    from neox_hf.recipe.precision import settle_precision

    notices = settle_precision(recipe)
    validate(recipe)
    recipe.settled_notices = [*getattr(recipe, "settled_notices", []), *notices]
    return recipe


def _with_family_defaults(raw: dict) -> dict:
    """`raw` with the Llama family's defaults under `model` where it names `family: llama`."""
    model = raw.get("model") if isinstance(raw, dict) else None
    if not isinstance(model, dict) or model.get("family") not in ("llama", "mixtral"):
        return raw
    keys = {str(k).replace("-", "_") for k in model}
    return {**raw, "model": {**{k: v for k, v in LLAMA_DEFAULTS.items() if k not in keys}, **model}}


def _build(cls, raw: Any, path: str, source: str):
    if not isinstance(raw, dict):
        raise RecipeError(f"{source}: `{path or 'top level'}` must be a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise RecipeError(f"{source}: unknown key `{_join(path, key)}`{_did_you_mean(name, fields)}")
        values[name] = _coerce(hints[name], value, _join(path, name), source)
    return cls(**values)


def _join(path: str, key) -> str:
    return f"{path}.{key}" if path else str(key)


def _did_you_mean(name: str, valid) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
    hint = f"; did you mean `{close[0]}`?" if close else ""
    return f"{hint} Valid keys here: {', '.join(sorted(valid))}"


def _coerce(hint, value, path: str, source: str):
    """Check `value` against the type hint; convert only the lossless cases (int → float, 1e-4 strings → float)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        return _coerce(non_none[0], value, path, source)
    if origin is Literal:
        # Same type as well as equal: `true` == 1 and `1.0` == 1 in Python, but a YAML `true` for a 0/1 setting is
        # a mistake to name, not a worker count.
        if not any(value == a and type(value) is type(a) for a in args):
            raise RecipeError(f"{source}: `{path}` = {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise RecipeError(f"{source}: `{path}` must be a list, got {value!r}")
        return [_coerce(args[0], v, f"{path}[{i}]", source) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path, source)
    return _coerce_scalar(hint, value, path, source)


def _coerce_scalar(hint, value, path: str, source: str):
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif hint is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads `1e-4` as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise RecipeError(f"{source}: `{path}` must be a finite number, got {value!r}")
            return number
    elif hint is str:
        if isinstance(value, str):
            return value
    else:
        return value
    raise RecipeError(f"{source}: `{path}` must be {hint.__name__}, got {value!r} ({type(value).__name__})")
