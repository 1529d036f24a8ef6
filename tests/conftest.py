"""Shared test fixtures: the real data beside the repo, the GPT-NeoX tokenizer, tiny model configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
BUNDLED_TOKENIZER = REPO / "examples" / "data" / "gpt-neox-20b-tokenizer.json"

# Tests never reach a hub: datasets are local files.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def shared(relative: str) -> Path:
    path = SHARED_DATA / relative
    if not path.exists():
        pytest.skip(f"{path} not found: clone the repo beside shared/ to run tests on the real data")
    return path


@pytest.fixture(scope="session")
def tokenizer():
    from neox_hf.interop.tokenizer import load_tokenizer

    return load_tokenizer(str(BUNDLED_TOKENIZER))
