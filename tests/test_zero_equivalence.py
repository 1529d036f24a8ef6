"""One process (plain PyTorch AdamW through Accelerate) vs DeepSpeed layouts through Accelerate's plugin and our
training loop: DP2 ZeRO-1/2/3, TP2, TP2×DP2 (ZeRO-1). Same global batch and seed → per-step losses ≤ 1e-5 over 5 steps."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from tests.conftest import REPO
from tests.test_resume import step_losses
from tests.test_train import free_port

WORKER = REPO / "tests" / "workers" / "dp_equivalence.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=256, max_position_embeddings=64)
    folder = tmp_path_factory.mktemp("dp_model")
    GPTNeoXForCausalLM(config).save_pretrained(folder)
    return folder


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


@pytest.fixture(scope="module")
def one_process_losses(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    subprocess.run([sys.executable, str(WORKER), str(model_dir), str(out), "0"], check=True, env=_env(), cwd=REPO, timeout=300)
    return step_losses(out)


@pytest.mark.parametrize(
    "zero_stage,tensor_parallel,processes",
    [(1, 1, 2), (2, 1, 2), (3, 1, 2), (1, 2, 2), (1, 2, 4)],
    ids=["dp2-zero1", "dp2-zero2", "dp2-zero3", "tp2", "tp2xdp2-zero1"],
)
def test_layout_matches_one_process(model_dir, one_process_losses, tmp_path, zero_stage, tensor_parallel, processes):
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes), "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--use_deepspeed", "--zero_stage", str(zero_stage),
        "--main_process_port", str(free_port()), str(WORKER), str(model_dir), str(tmp_path), str(zero_stage),
        str(tensor_parallel),
    ]
    done = subprocess.run(command, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    got = step_losses(tmp_path)
    assert sorted(got) == sorted(one_process_losses) == [1, 2, 3, 4, 5]
    assert got[5] < got[1]  # it trains
    for step, expected in one_process_losses.items():
        assert abs(got[step] - expected) <= 1e-5, (zero_stage, tensor_parallel, step, got[step], expected)
