"""examples/launch/: every Accelerate config loads with Accelerate's own loader and says the documented number of
processes and machines; the SLURM script starts one `accelerate launch` per node with a config that fits its
allocation; the CPU config really starts two processes."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType

from tests.conftest import REPO, free_port

LAUNCH = REPO / "examples" / "launch"

# file → (distributed type, processes over all machines, machines, ZeRO stage or None)
DOCUMENTED = {
    "one_gpu.yaml": (DistributedType.NO, 1, 1, None),
    "8gpu_zero1_tp2.yaml": (DistributedType.DEEPSPEED, 8, 1, 1),
    "2x8gpu_pipeline.yaml": (DistributedType.DEEPSPEED, 16, 2, 1),
    "cpu_2proc_deepspeed.yaml": (DistributedType.DEEPSPEED, 2, 1, 2),
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


@pytest.mark.distributed  # starts two processes
def test_cpu_config_starts_two_processes(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n")
    done = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(LAUNCH / "cpu_2proc_deepspeed.yaml"),
         "--main_process_port", str(free_port()), str(probe)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(re.findall(r"rank \d of \d", done.stdout)) == ["rank 0 of 2", "rank 1 of 2"]
