"""The recipe's key reference, rendered from the dataclasses' field metadata (`help`, `neox`).

The recipe dataclasses are the one place a key is described; this module turns them into the docs page
`docs/reference/recipe-keys.md` and into `run_clm_neox.py --help`. argparse cannot describe a nested, YAML-typed
recipe (its keys are `--section.key` overrides parsed in `neox_hf.recipe.parse_overrides`), so the help text is
rendered here from the same fields.
"""

from __future__ import annotations

import dataclasses
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Literal, Union

from neox_hf.recipe import Recipe, DataSource
from neox_hf.recipe.args import USAGE

# One section per Recipe field, with what it is for (the page's headings).
SECTIONS = {
    "model": "The architecture, or a pretrained folder to start from.",
    "tokenizer": "The tokenizer and its special tokens.",
    "data": "Where examples come from and how they are batched.",
    "parallel": "How the run is spread over processes.",
    "train": "Optimisation, precision, checkpoints, evaluation and the objective.",
    "peft": "LoRA fine-tuning through PEFT.",
    "output": "Where the run writes, and the trackers it reports to.",
}

FLAGS = (
    ("--print-config", "print the fully resolved recipe (and the plan of its layout) and exit"),
    ("--resume", "continue the run in output.dir from its latest checkpoint (train.resume: auto)"),
    ("--overwrite", "replace what an earlier run left in output.dir"),
    ("-h, --help", "show this help and exit"),
)


@dataclass(frozen=True)
class Key:
    """One recipe key: its dotted name, type and default as a reader writes them, and its description."""

    name: str
    type: str
    default: str
    help: str
    neox: str


def recipe_keys() -> list[Key]:
    """Every key of the recipe, section by section in declaration order (a source's keys under `data.sources[]`)."""
    keys: list[Key] = []
    for section in dataclasses.fields(Recipe):
        keys += _keys_of(_hints(Recipe)[section.name], section.name)
    return keys


def undescribed_keys() -> list[str]:
    """Keys whose field has no `help` metadata (a test keeps this empty)."""
    return [k.name for k in recipe_keys() if not k.help.strip()]


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _keys_of(cls, prefix: str) -> list[Key]:
    keys = []
    for f in dataclasses.fields(cls):
        hint = _hints(cls)[f.name]
        name = f"{prefix}.{f.name}"
        keys.append(Key(name, type_name(hint), default_text(f), f.metadata.get("help", ""),
                        f.metadata.get("neox", "")))
        inner = _dataclass_inside(hint)
        if inner is not None and inner is not DataSource:
            keys += _keys_of(inner, name)
        elif inner is DataSource and f.name == "sources":
            keys += _keys_of(DataSource, f"{prefix}.sources[]")
    return keys


def _dataclass_inside(hint):
    """The dataclass a field holds (directly, optionally, or as list items), else None."""
    for arg in [hint, *typing.get_args(hint)]:
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def type_name(hint) -> str:
    """`Optional[int]` → "int or null", `Literal["a", "b"]` → "a | b", `list[str]` → "list of str"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return f"{type_name(rest[0])} or null"
    if origin is Literal:
        return " | ".join(_yaml_scalar(a) for a in args)
    if origin is list:
        inner = args[0]
        return "list of sources" if inner is DataSource else f"list of {type_name(inner)}"
    if dataclasses.is_dataclass(hint):
        return "mapping"
    return getattr(hint, "__name__", str(hint))


def default_text(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(value):
            return "(its keys' defaults)"
        return _yaml_scalar(value)
    return _yaml_scalar(f.default)


def _yaml_scalar(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return '""'
    if isinstance(value, list):
        return "[" + ", ".join(_yaml_scalar(v) for v in value) + "]"
    return str(value)


def render_recipe_reference() -> str:
    """The Markdown page of every recipe key (docs/reference/recipe-keys.md)."""
    lines = [
        "# Recipe keys",
        "",
        "<!-- Generated from neox_hf/recipe/keys.py by `python tools/generate_docs.py`; do not edit. -->",
        "",
        "Every key a recipe can set, with its type, its default and the GPT-NeoX key that becomes it.",
        "Set a key in a recipe file under its section, or on the command line as `--section.key VALUE`.",
        "The GPT-NeoX column names the config key that `run_clm_neox.py` translates into it; a blank means GPT-NeoX has",
        "no such key. [Coming from GPT-NeoX](../coming-from-gpt-neox.md) lists the keys that are refused or ignored.",
        "A source of `data.validation` takes the same keys as one of `data.sources`.",
        "",
    ]
    keys = recipe_keys()
    for section, purpose in SECTIONS.items():
        lines += [f"## {section}", "", purpose, "", "| key | type | default | meaning | GPT-NeoX |", "|---|---|---|---|---|"]
        for k in keys:
            if k.name.split(".")[0] == section:
                neox = ", ".join(f"`{n.strip()}`" for n in k.neox.split(",")) if k.neox else ""
                lines.append(f"| `{k.name}` | {_cell(k.type)} | `{_cell(k.default)}` | {_cell(k.help)} | {neox} |")
        lines.append("")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_train_help() -> str:
    """`run_clm_neox.py --help` / `neox_hf train --help`: usage, flags, and every key as an override."""
    lines = [f"usage: {USAGE}", "", "Train a model from a recipe: defaults, then each recipe file (ours or a GPT-NeoX",
             "config), then the --section.key VALUE overrides (values are YAML).", "", "flags:"]
    lines += [f"  {flag:<16}{text}" for flag, text in FLAGS]
    keys = recipe_keys()
    for section, purpose in SECTIONS.items():
        lines += ["", f"{section}: {purpose}"]
        for k in keys:
            if k.name.split(".")[0] == section and k.type != "mapping" and "[]" not in k.name:
                lines.append(f"  --{k.name} {_metavar(k.type)} (default {k.default})")
                text = k.help + (f" [GPT-NeoX: {k.neox}]" if k.neox else "")
                lines += textwrap.wrap(text, 110, initial_indent="      ", subsequent_indent="      ",
                                       break_on_hyphens=False)
    lines += ["", "data.sources is a YAML list of sources, e.g. --data.sources '[{path: data.jsonl}]'; a source's",
              "keys: " + ", ".join(k.name.split("[].")[1] for k in keys if "[]." in k.name) + ".",
              "Every key, with its meaning: docs/reference/recipe-keys.md"]
    return "\n".join(lines) + "\n"


def _metavar(type_text: str) -> str:
    if " | " in type_text:
        return "{" + type_text.replace(" | ", ",") + "}"
    return type_text.replace(" or null", "").replace("list of ", "LIST[").upper() + ("]" if "list of" in type_text else "")
