"""Shared test fixtures: the real data beside the repo, the GPT-NeoX tokenizer, tiny model configs."""

from __future__ import annotations

import os
import socket
import sys
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch_command(script, *args, zero_stage: int, num_processes: int = 2) -> list[str]:
    """`accelerate launch` of `script` with DeepSpeed ZeRO `zero_stage` on gloo, fp32, on a free port."""
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(num_processes), "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--use_deepspeed", "--zero_stage", str(zero_stage),
        "--main_process_port", str(free_port()), str(script), *map(str, args),
    ]


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed: launches several processes (accelerate launch / torchrun)")


@pytest.fixture(scope="session")
def tokenizer():
    from neox_hf.interop.tokenizer import load_tokenizer

    return load_tokenizer(str(BUNDLED_TOKENIZER))
