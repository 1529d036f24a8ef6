"""Recipe files: YAML read with duplicate keys refused (PyYAML keeps the last silently), one-line errors."""

from __future__ import annotations

from pathlib import Path

import yaml

from neox_hf.errors import RecipeError


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys silently; a recipe that sets `lr` twice is a mistake to report."""


def _mapping_without_duplicates(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise RecipeError(f"{loader.name}: key `{key}` appears twice in one mapping (lines {seen[key] + 1} and "
                              f"{key_node.start_mark.line + 1}); keep one")
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def load_yaml_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}. Give a path such as recipes/tiny.yaml")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise RecipeError(f"cannot read recipe file {path}: {err}. Give a UTF-8 YAML file") from err
    try:
        raw = yaml.load(text, Loader=_loader_for(path)) or {}
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: not valid YAML: {_one_line(err)}") from err
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping of sections, got {type(raw).__name__}")
    return raw


def _loader_for(path: Path):
    def make(stream):
        loader = _UniqueKeyLoader(stream)
        loader.name = str(path)
        return loader

    return make


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())
