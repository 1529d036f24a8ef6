"""The package's layering holds (`.importlinter`; docs/architecture.md): import-linter's contracts over the code as
it stands, function-level imports included, and the contracts catch a back-edge, naming both modules."""

from __future__ import annotations

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
