"""Command line → Recipe: recipe files (ours or GPT-NeoX's), then `--section.key value` overrides, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from neox_hf.neox_yaml import looks_like_neox_config, read_neox_files, translate_neox_args
from neox_hf.recipe import Recipe, load_yaml_file, merge_dicts, parse_overrides, recipe_from_dict

USAGE = "run_clm_neox.py RECIPE.yaml [MORE.yml ...] [--section.key value ...] [--print-config] [--resume]"


@dataclass
class RunArgs:
    recipe: Recipe
    notices: list[str] = field(default_factory=list)
    print_config: bool = False


def parse_run_args(argv: list[str]) -> RunArgs:
    """Split files / flags / overrides; translate GPT-NeoX files; merge in order; validate."""
    files, rest, print_config, resume = _split_argv(argv)
    if not files:
        from neox_hf.errors import RecipeError

        raise RecipeError(f"no recipe given. Usage: {USAGE}")
    raw, notices = _read_recipe_files(files)
    raw = merge_dicts(raw, parse_overrides(rest))
    if resume:
        raw = merge_dicts(raw, {"train": {"resume": "auto"}})
    recipe = recipe_from_dict(raw, source=", ".join(files))
    return RunArgs(recipe=recipe, notices=notices, print_config=print_config)


def _split_argv(argv: list[str]) -> tuple[list[str], list[str], bool, bool]:
    files, rest = [], []
    print_config = resume = False
    for i, arg in enumerate(argv):
        if arg == "--print-config":
            print_config = True
        elif arg == "--resume":
            resume = True
        elif not arg.startswith("--") and not (rest and rest[-1].startswith("--") and "=" not in rest[-1]):
            files.append(arg)
        else:
            rest.append(arg)
    return files, rest, print_config, resume


def _read_recipe_files(files: list[str]) -> tuple[dict, list[str]]:
    """Our recipes merge in order; GPT-NeoX files are merged together (as its launcher does) and translated."""
    ours, neox = [], []
    for path in files:
        raw = load_yaml_file(path)
        (neox if looks_like_neox_config(raw) else ours).append((path, raw))
    merged: dict = {}
    notices: list[str] = []
    if neox:
        translation = translate_neox_args(read_neox_files([Path(p) for p, _ in neox]))
        merged, notices = translation.recipe, translation.notices
    for _, raw in ours:
        merged = merge_dicts(merged, raw)
    return merged, notices
