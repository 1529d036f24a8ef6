"""`--section.key value` command-line overrides, and the merge of recipe trees (later files and overrides win)."""

from __future__ import annotations

import yaml

from neox_hf.errors import RecipeError
from neox_hf.recipe.loading import _one_line


def parse_overrides(argv: list[str]) -> dict:
    """`--train.lr 3e-4 --parallel.zero_stage=2` → nested dict; values are parsed as YAML scalars/lists."""
    overrides: dict = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise RecipeError(f"unexpected argument {arg!r}: overrides look like `--section.key value`")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise RecipeError(f"override `--{key}` has no value: write `--{key} VALUE`")
            value = argv[i + 1]
            i += 1
        if "." not in key:
            raise RecipeError(f"override `--{key}` must name a section and a key, e.g. `--train.lr 3e-4`")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise RecipeError(f"override `--{key}`: value {value!r} is not valid YAML ({_one_line(err)}); quote it") from err
        _set_nested(overrides, key.replace("-", "_").split("."), parsed)
        i += 1
    return overrides


def _set_nested(tree: dict, keys: list[str], value) -> None:
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    tree[keys[-1]] = value


def merge_dicts(base: dict, update: dict) -> dict:
    """Recursive merge; `update` wins. Neither input is modified."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_dicts(merged[key], value)
        else:
            merged[key] = value
    return merged
