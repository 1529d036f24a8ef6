"""The package's layering holds (`.importlinter`; docs/architecture.md): import-linter's contracts over the code as
it stands, function-level imports included, and the contracts catch a back-edge, naming both modules."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` over the package under `root` (that tree's code, not an installed copy)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--config", str(root / ".importlinter"), "--no-cache"], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)


def test_every_import_contract_is_kept():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_an_import_from_a_lower_layer_up_fails_naming_both_modules(tmp_path):
    """A function-level import from the recipe up to the training loop (the kind of edge that made five cycles) is
    reported as a broken layers contract with the importer and the imported module."""
    shutil.copytree(REPO / "neox_hf", tmp_path / "neox_hf", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / ".importlinter", tmp_path / ".importlinter")
    recipe = tmp_path / "neox_hf" / "recipe" / "precision.py"
    recipe.write_text(recipe.read_text() + "\n\ndef _upward():\n    from neox_hf.train import loop  # noqa: F401\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "neox_hf layers, top to bottom BROKEN" in result.stdout
    assert "neox_hf.recipe.precision -> neox_hf.train.loop" in result.stdout, result.stdout[-3000:]


def neox_hf_names_imported_outside_the_package() -> list[tuple[str, int, str, str]]:
    """(file, line, module, name) for each `from neox_hf... import name` in the repository's Python outside the
    package: the tests, their workers, benchmarks and examples, which import-linter does not read."""
    found = []
    for path in sorted(REPO.rglob("*.py")):
        rel = path.relative_to(REPO)
        if rel.parts[0] in {"neox_hf", "build", "site"} or rel.parts[0].startswith("."):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(rel))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("neox_hf"):
                found += [(str(rel), node.lineno, node.module, alias.name) for alias in node.names]
    return found


def test_every_name_imported_from_the_package_outside_it_exists():
    """A name moved inside the package breaks a worker script only when its launch runs (a distributed test, minutes
    into the suite); this finds it in the fast tier, by the name the script imports."""
    missing = []
    for rel, line, module, name in neox_hf_names_imported_outside_the_package():
        imported = importlib.import_module(module)
        is_submodule = hasattr(imported, "__path__") and importlib.util.find_spec(f"{module}.{name}") is not None
        if not hasattr(imported, name) and not is_submodule:
            missing.append(f"{rel}:{line}: {module} has no {name}")
    assert len(neox_hf_names_imported_outside_the_package()) > 100
    assert not missing, "\n".join(missing)
