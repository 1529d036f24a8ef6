"""The layout object: rank order equal to DeepSpeed's pipeline topology, and launches that cannot give a recipe's
layout refused with the command that works (one line, exit 2, no traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from neox_hf.errors import LaunchError
from neox_hf.parallel.layout import check_launch, dp_group_ranks, global_rank, pp_group_ranks, tp_group_ranks
from neox_hf.recipe import recipe_from_dict
from tests.conftest import REPO, free_port, launch_env

SMALL = ["--model.hidden_size", "32", "--model.num_layers", "1", "--model.seq_length", "32",
         "--train.micro_batch_size", "2", "--train.train_iters", "2", "--train.eval_iters", "1",
         "--output.tensorboard", "false"]


@pytest.mark.parametrize("pp,dp,tp", [(1, 4, 1), (1, 2, 2), (2, 1, 2), (2, 2, 2), (4, 1, 2), (3, 2, 1)])
def test_group_ranks_are_deepspeeds_pipe_data_model_topology(pp, dp, tp):
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    assert tp_group_ranks(pp, dp, tp) == topology.get_axis_comm_lists("model") or tp == 1
    assert dp_group_ranks(pp, dp, tp) == topology.get_axis_comm_lists("data") or dp == 1
    assert pp_group_ranks(pp, dp, tp) == topology.get_axis_comm_lists("pipe") or pp == 1
    for rank in range(pp * dp * tp):
        coord = topology.get_coord(rank)
        assert global_rank(coord.pipe, coord.data, coord.model, dp=dp, tp=tp) == rank


def test_a_process_count_the_layout_does_not_divide_names_the_launch(monkeypatch):
    recipe = recipe_from_dict({"parallel": {"tensor_parallel": 2}})
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(LaunchError, match=r"3 processes .* multiple of 2.*--use_deepspeed --num_processes 2"):
        check_launch(recipe, "recipe.yaml")
    monkeypatch.setenv("WORLD_SIZE", "4")
    check_launch(recipe, "recipe.yaml")  # TP2 × DP2


def _refusal(command: list[str], *, launcher: bool = False) -> str:
    env = launch_env()
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    if launcher:
        # accelerate's launcher turns any non-zero exit of its child into its own CalledProcessError traceback
        # (exit 1); the child — our process — exited 2 with one line and no traceback of its own.
        assert done.returncode == 1 and "returned non-zero exit status 2" in done.stderr, done.stderr[-3000:]
        assert "neox_hf/" not in done.stderr
    else:
        assert done.returncode == 2, done.stderr[-3000:]
        assert "Traceback" not in done.stderr
    # accelerate's launcher echoes its child's stderr in its own message: the same line may appear twice.
    lines = {line for line in done.stderr.splitlines() if line.startswith("error:")}
    assert len(lines) == 1, done.stderr[-3000:]
    return lines.pop()


def test_tensor_parallel_under_plain_python_names_the_deepspeed_launch(tmp_path):
    line = _refusal([sys.executable, "run_clm_neox.py", "recipes/tiny.yaml", "--parallel.tensor_parallel", "2",
                     "--output.dir", str(tmp_path)])
    assert "needs 2 processes" in line
    assert "accelerate launch --use_deepspeed --num_processes 2 run_clm_neox.py recipes/tiny.yaml" in line


@pytest.mark.distributed  # slow tier: a whole run in a subprocess or in process
def test_accelerate_launch_without_deepspeed_starts_one_process_and_is_told_the_flag(tmp_path):
    # On CPU, `accelerate launch --num_processes 2` without --use_deepspeed silently starts ONE process.
    line = _refusal([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
                     "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
                     "run_clm_neox.py", "recipes/tiny.yaml", "--parallel.tensor_parallel", "2",
                     "--output.dir", str(tmp_path)], launcher=True)
    assert "--use_deepspeed --num_processes 2" in line


@pytest.mark.distributed  # slow tier: a whole run in a subprocess or in process
def test_zero_in_a_single_plain_process_trains(tmp_path):
    # DeepSpeed needs launcher variables even for one rank; a plain `python` run with ZeRO-2 gets them.
    env = launch_env()
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "run_clm_neox.py", "recipes/tiny.yaml", *SMALL, "--parallel.zero_stage", "2",
                           "--output.dir", str(tmp_path)], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ZeRO stage 2" in done.stdout and (tmp_path / "model.safetensors").is_file()
