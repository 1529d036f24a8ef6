"""examples/launch/: every Accelerate config loads with Accelerate's own loader and says the documented number of
processes and machines, and every file starts a real (tiny, 3-step) run: the CPU file as written, the GPU files with
only the process count overridden, the multi-node file as two machine ranks on 127.0.0.1, and slurm.sbatch through
stand-in `srun` / `scontrol` that run its command for node ids 0 and 1 on this machine."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType

from tests.conftest import REPO, free_port, launch_env

LAUNCH = REPO / "examples" / "launch"

# file → (distributed type, processes over all machines, machines, ZeRO stage or None)
DOCUMENTED = {
    "one_gpu.yaml": (DistributedType.NO, 1, 1, None),
    "8gpu_zero1_tp2.yaml": (DistributedType.DEEPSPEED, 8, 1, 1),
    "8gpu_deepspeed.yaml": (DistributedType.DEEPSPEED, 8, 1, None),  # names no stage: the recipe's runs
    "2x8gpu_pipeline.yaml": (DistributedType.DEEPSPEED, 16, 2, 1),
    "cpu_2proc_deepspeed.yaml": (DistributedType.DEEPSPEED, 2, 1, 2),
    "cpu_2proc_fsdp2.yaml": (DistributedType.FSDP, 2, 1, None),
}


def test_every_launch_config_is_documented():
    assert sorted(p.name for p in LAUNCH.glob("*.yaml")) == sorted(DOCUMENTED)


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_launch_config_loads_with_accelerate_and_gives_the_documented_layout(name):
    config = load_config_from_file(str(LAUNCH / name))
    distributed_type, processes, machines, zero_stage = DOCUMENTED[name]
    assert (config.distributed_type, config.num_processes, config.num_machines) == (distributed_type, processes, machines)
    if zero_stage is not None:
        assert config.deepspeed_config["zero_stage"] == zero_stage
    elif distributed_type == DistributedType.DEEPSPEED:
        assert "zero_stage" not in config.deepspeed_config
    if machines > 1:  # every node runs its own launcher: no pdsh/hostfile
        assert config.deepspeed_config["deepspeed_multinode_launcher"] == "standard"
    # Each file shows the command that uses it.
    assert f"--config_file examples/launch/{name}" in (LAUNCH / name).read_text()


def test_slurm_script_launches_once_per_node_with_a_config_that_fits_the_allocation():
    script = (LAUNCH / "slurm.sbatch").read_text()
    assert subprocess.run(["bash", "-n", str(LAUNCH / "slurm.sbatch")]).returncode == 0
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script, flags=re.M))
    assert sbatch["ntasks-per-node"] == "1"  # one launcher per node
    config_path = re.search(r"CONFIG=\$\{CONFIG:-(\S+)\}", script).group(1)
    config = load_config_from_file(str(REPO / config_path))
    assert config.num_machines == int(sbatch["nodes"])
    assert config.num_processes == int(sbatch["nodes"]) * int(sbatch["gpus-per-node"])
    launch = script[script.index("srun"):]
    assert "accelerate launch --config_file $CONFIG" in launch
    assert "--machine_rank \\$SLURM_NODEID" in launch and "--main_process_ip $HEAD_NODE" in launch


# ----------------------------------------------------------------------------------------------------------------
# Every launch file starts a real run: tiny sizes, 3 steps, the bundled Tiny Shakespeare
# ----------------------------------------------------------------------------------------------------------------

SMALL_RUN = ["--model.hidden_size", "64", "--model.seq_length", "64", "--train.micro_batch_size", "2",
             "--train.train_iters", "3", "--train.eval_iters", "1", "--train.log_interval", "1",
             "--output.tensorboard", "false"]


def _env(**extra) -> dict:
    return launch_env(**extra)


def _accelerate_launch(*args) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", *map(str, args)]


def _assert_trained(out: Path, steps: int = 3) -> None:
    """The run finished: every step logged, the model folder written."""
    logged = [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert logged == list(range(1, steps + 1))
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


@pytest.mark.distributed
def test_cpu_launch_file_as_written_trains_zero2_from_the_accelerate_config(tmp_path):
    """The file's zero_stage (the recipe leaves it unset) runs, and the start-up report says where it came from."""
    out = tmp_path / "run"
    done = subprocess.run(
        _accelerate_launch("--config_file", LAUNCH / "cpu_2proc_deepspeed.yaml", "--main_process_port", free_port(),
                           "run_clm_neox.py", "recipes/tiny.yaml", *SMALL_RUN, "--output.dir", out),
        capture_output=True, text=True, timeout=600, cwd=REPO, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "layout: 2 data-parallel = 2 process(es), ZeRO stage 2" in done.stdout
    assert ("note: `parallel.zero_stage: 2` comes from the accelerate config (`zero_stage: 2`; the recipe leaves it "
            "unset)") in done.stdout
    _assert_trained(out)


@pytest.mark.distributed
def test_cpu_fsdp2_launch_file_as_written_trains_on_the_fsdp2_backend(tmp_path):
    """The file's distributed_type FSDP (fsdp_version 2) picks `parallel.backend: fsdp2`, which the recipe leaves
    unset; the run saves a checkpoint and trains to the end."""
    out = tmp_path / "run"
    done = subprocess.run(
        _accelerate_launch("--config_file", LAUNCH / "cpu_2proc_fsdp2.yaml", "--main_process_port", free_port(),
                           "run_clm_neox.py", "recipes/tiny.yaml", *SMALL_RUN, "--train.save_interval", 2,
                           "--output.dir", out),
        capture_output=True, text=True, timeout=600, cwd=REPO, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "layout: 2 data-parallel = 2 process(es), FSDP2" in done.stdout
    assert ("note: `parallel.backend: fsdp2` comes from `accelerate launch` (`use_fsdp: true`; the recipe leaves it "
            "unset)") in done.stdout
    assert (out / "checkpoints" / "step_00000002" / "layout_free" / ".metadata").is_file()
    _assert_trained(out)


@pytest.mark.distributed
def test_single_node_gpu_launch_file_trains_tp2_with_only_the_process_count_overridden(tmp_path):
    """8gpu_zero1_tp2.yaml with its documented overrides (TP2, ZeRO-1, which agree with the file), on 2 processes."""
    out = tmp_path / "run"
    done = subprocess.run(
        _accelerate_launch("--config_file", LAUNCH / "8gpu_zero1_tp2.yaml", "--num_processes", 2,
                           "--main_process_port", free_port(), "run_clm_neox.py", "recipes/tiny.yaml", *SMALL_RUN,
                           "--parallel.tensor_parallel", 2, "--parallel.zero_stage", 1, "--output.dir", out),
        capture_output=True, text=True, timeout=600, cwd=REPO, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "layout: 1 data-parallel × tensor parallel 2 = 2 process(es), ZeRO stage 1" in done.stdout
    assert "note: the accelerate config `zero_stage: 1` agrees with the recipe's `parallel.zero_stage`" in done.stdout
    _assert_trained(out)


@pytest.mark.distributed
def test_node_launch_file_without_a_stage_trains_the_recipes_zero3(tmp_path):
    """8gpu_deepspeed.yaml names no ZeRO stage: the recipe's stage 3 runs (2 processes here, the count overridden),
    and the start-up report does not say the accelerate config decided it."""
    out = tmp_path / "run"
    done = subprocess.run(
        _accelerate_launch("--config_file", LAUNCH / "8gpu_deepspeed.yaml", "--num_processes", 2,
                           "--main_process_port", free_port(), "run_clm_neox.py", "recipes/tiny.yaml", *SMALL_RUN,
                           "--parallel.zero_stage", 3, "--output.dir", out),
        capture_output=True, text=True, timeout=600, cwd=REPO, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "layout: 2 data-parallel = 2 process(es), ZeRO stage 3" in done.stdout
    assert "comes from the accelerate config (`zero_stage" not in done.stdout
    _assert_trained(out)


def _two_machine_ranks(command_for_rank, timeout: int = 600) -> list[subprocess.CompletedProcess]:
    """Start machine ranks 0 and 1 at once (each blocks in the rendezvous until the other arrives)."""
    processes = [subprocess.Popen(command_for_rank(rank), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  cwd=REPO, env=_env()) for rank in (0, 1)]
    results = []
    for process in processes:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise
        results.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    return results


@pytest.mark.distributed
def test_multi_node_launch_file_trains_a_pipeline_over_two_machine_ranks(tmp_path):
    """2x8gpu_pipeline.yaml as two nodes on 127.0.0.1, one process each: pipeline 2 (stage i on machine i)."""
    out, port = tmp_path / "run", free_port()
    ranks = _two_machine_ranks(lambda rank: _accelerate_launch(
        "--config_file", LAUNCH / "2x8gpu_pipeline.yaml", "--num_processes", 2, "--machine_rank", rank,
        "--main_process_ip", "127.0.0.1", "--main_process_port", port, "run_clm_neox.py", "recipes/tiny.yaml",
        *SMALL_RUN, "--parallel.pipeline_parallel", 2, "--parallel.zero_stage", 1, "--output.dir", out))
    for rank in ranks:
        assert rank.returncode == 0, rank.stderr[-3000:]
    assert "layout: 1 data-parallel × 2 pipeline stages = 2 process(es)" in ranks[0].stdout
    _assert_trained(out)


STAND_IN_SRUN = """#!/bin/bash
# srun for one allocation of $SLURM_NNODES nodes on this machine: runs the command once per node id, all at once.
while [[ "$1" == --* ]]; do shift; done
status=0
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node "$@" &
    pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""

STAND_IN_SCONTROL = """#!/bin/bash
# `scontrol show hostnames LIST`: every node of the stand-in allocation is this machine.
for ((node = 0; node < SLURM_NNODES; node++)); do echo 127.0.0.1; done
"""


@pytest.mark.distributed
def test_slurm_script_runs_one_launcher_per_node_on_stand_in_nodes(tmp_path):
    """slurm.sbatch as sbatch would run it on a 2-node allocation with one GPU per node: stand-in srun / scontrol on
    PATH start its command for node ids 0 and 1 on this machine; the two launchers train one pipeline-2 run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", STAND_IN_SRUN), ("scontrol", STAND_IN_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    accelerate_bin = Path(sys.executable).parent
    out = tmp_path / "run"
    env = _env(PATH=f"{bin_dir}:{accelerate_bin}:{os.environ['PATH']}", SLURM_NNODES="2", SLURM_GPUS_ON_NODE="1",
               SLURM_JOB_NODELIST="node[0-1]", PORT=str(free_port()))
    done = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), "recipes/tiny.yaml", *SMALL_RUN,
                           "--parallel.pipeline_parallel", "2", "--output.dir", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "layout: 1 data-parallel × 2 pipeline stages = 2 process(es)" in done.stdout
    _assert_trained(out)


@pytest.mark.distributed
def test_an_accelerate_config_contradicting_the_recipe_is_refused_in_one_line(tmp_path):
    """The user's own default accelerate config (HF_HOME/accelerate/default_config.yaml, as `accelerate config` writes
    it) asks for ZeRO-1 and the recipe for ZeRO-3: refused before any model is built, naming both and the fix."""
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "accelerate" / "default_config.yaml").write_text(
        (LAUNCH / "cpu_2proc_deepspeed.yaml").read_text().replace("zero_stage: 2", "zero_stage: 1"))
    out = tmp_path / "run"
    done = subprocess.run(
        _accelerate_launch("--main_process_port", free_port(), "run_clm_neox.py", "recipes/tiny.yaml", *SMALL_RUN,
                           "--parallel.zero_stage", 3, "--output.dir", out),
        capture_output=True, text=True, timeout=600, cwd=REPO, env=_env(HF_HOME=str(tmp_path)))
    assert done.returncode != 0
    errors = sorted({line for line in done.stderr.splitlines() if line.startswith("error: ")})
    assert errors == ["error: the accelerate config sets `zero_stage: 1` but recipes/tiny.yaml with the command-line "
                      "overrides sets `parallel.zero_stage: 3`; make them agree: pass `--parallel.zero_stage 1`, or "
                      "change or remove `zero_stage` in the accelerate config"], done.stderr[-3000:]
    assert "will be ignored" not in done.stderr and not out.exists()
