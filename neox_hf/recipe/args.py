"""Command line → Recipe: recipe files (ours or GPT-NeoX's), then `--section.key value` overrides, validated once."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path

from neox_hf.errors import UsageError
from neox_hf.neox_yaml import looks_like_neox_config, place_command_line_data, read_neox_files, translate_neox_args
from neox_hf.recipe.launcher import reconcile_with_launcher
from neox_hf.recipe import Recipe, load_yaml_file, merge_dicts, parse_overrides, recipe_from_dict

USAGE = ("run_clm_neox.py RECIPE.yaml [MORE.yml ...] [--section.key value ...] [--print-config] [--resume | --overwrite]")
FLAGS = ("--print-config", "--resume", "--overwrite", "--help")


@dataclass
class RunArgs:
    recipe: Recipe
    notices: list[str] = field(default_factory=list)
    print_config: bool = False
    overwrite: bool = False  # replace what an earlier run left in output.dir


def parse_run_args(argv: list[str]) -> RunArgs:
    """Split files / flags / overrides; translate GPT-NeoX files; merge in order; validate."""
    files, rest, flags = _split_argv(argv)
    print_config, resume, overwrite = "--print-config" in flags, "--resume" in flags, "--overwrite" in flags
    if not files:
        raise UsageError(f"no recipe given. Usage: {USAGE}")
    if resume and overwrite:
        raise UsageError("--resume continues the run in output.dir and --overwrite replaces it: give one of them")
    raw, notices, data_defaults, ours = _read_recipe_files(files)
    overrides = parse_overrides(rest)
    # data named by our recipe files or the command line takes the GPT-NeoX config's order keys
    raw = place_command_line_data(merge_dicts(raw, overrides), merge_dicts(ours, overrides), data_defaults)
    if resume:
        raw = merge_dicts(raw, {"train": {"resume": "auto"}})
    source = ", ".join(files) + (" with the command-line overrides" if rest else "")
    raw, launch_notices = reconcile_with_launcher(raw, source)
    recipe = recipe_from_dict(raw, source=source)
    return RunArgs(recipe=recipe, notices=notices + launch_notices, print_config=print_config, overwrite=overwrite)


def _split_argv(argv: list[str]) -> tuple[list[str], list[str], set[str]]:
    """(recipe files, `--section.key value` overrides, flags). A `--word` that is neither a flag nor an override
    (a typo such as `--resum`) is refused here, before it could swallow the next argument as its value."""
    files, rest, flags = [], [], set()
    for arg in argv:
        name = arg.split("=", 1)[0]
        awaiting_value = bool(rest) and rest[-1].startswith("--") and "=" not in rest[-1]
        if name in FLAGS:
            flags.add(name)
        elif awaiting_value:
            rest.append(arg)  # e.g. the -1 of `--train.seed -1`
        elif arg.startswith("-") and "." not in name:
            raise UsageError(f"unknown option {arg!r}{_closest_flag(name)}; flags are {', '.join(FLAGS)} and "
                             "overrides look like `--section.key value`. Usage: " + USAGE)
        elif not arg.startswith("--"):
            files.append(arg)
        else:
            rest.append(arg)
    return files, rest, flags


def _closest_flag(name: str) -> str:
    close = difflib.get_close_matches(name, FLAGS, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _read_recipe_files(files: list[str]) -> tuple[dict, list[str], dict, dict]:
    """Our recipes merge in order; GPT-NeoX files are merged together (as its launcher does) and translated: the
    recipe dict, the notices, the GPT-NeoX data keys for data named elsewhere (NeoXTranslation.data_defaults), and
    what our recipe files alone say."""
    ours, neox = [], []
    for path in files:
        raw = load_yaml_file(path)
        (neox if looks_like_neox_config(raw) else ours).append((path, raw))
    merged: dict = {}
    notices: list[str] = []
    data_defaults: dict = {}
    if neox:
        translation = translate_neox_args(read_neox_files([Path(p) for p, _ in neox]))
        merged, notices, data_defaults = translation.recipe, translation.notices, translation.data_defaults
    own: dict = {}
    for _, raw in ours:
        own = merge_dicts(own, raw)
    return merge_dicts(merged, own), notices, data_defaults, own
