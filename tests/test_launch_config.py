"""The launcher's settings reconciled with the recipe, on the environment `accelerate launch` itself computes for an
accelerate config file or its flags (accelerate's own argument parser and `prepare_deepspeed_cmd_env`, nothing
started). tests/test_launch_files.py launches the shipped files for real."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from neox_hf.errors import RecipeError
from neox_hf.hardware import bf16_verdict
from neox_hf.recipe.args import parse_run_args
from tests.conftest import REPO, launch_env

TINY = str(REPO / "recipes" / "tiny.yaml")


def launcher_environment(*launch_args: str) -> dict[str, str]:
    """The ACCELERATE_* variables `accelerate launch LAUNCH_ARGS run_clm_neox.py` gives its processes (DeepSpeed)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args = launch_command_parser().parse_args([*launch_args, "run_clm_neox.py"])
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    # As accelerate's launch_command does before calling the DeepSpeed launcher.
    fields = list(defaults.deepspeed_config) if defaults else []
    if mixed_precision_from_config:
        fields.append("mixed_precision")
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    _, env = prepare_deepspeed_cmd_env(args)
    return {key: value for key, value in env.items() if key.startswith("ACCELERATE_")}


@pytest.fixture
def launched(monkeypatch):
    """Put the environment of an `accelerate launch` in this process."""
    def launch(*launch_args: str) -> dict[str, str]:
        environment = launcher_environment(*launch_args)
        for key, value in environment.items():
            monkeypatch.setenv(key, value)
        return environment

    return launch


def _user_config(tmp_path, **deepspeed) -> str:
    """An accelerate config as `accelerate config` writes it for DeepSpeed on one machine."""
    lines = ["compute_environment: LOCAL_MACHINE", "distributed_type: DEEPSPEED", "deepspeed_config:"]
    lines += [f"  {key}: {value}" for key, value in deepspeed.items() if key != "mixed_precision"]
    lines += ["machine_rank: 0", "num_machines: 1", "num_processes: 2", "use_cpu: false",
              f"mixed_precision: '{deepspeed.get('mixed_precision', 'no')}'"]
    path = tmp_path / "default_config.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_launch_config_fills_what_the_recipe_leaves_unset_and_says_so(launched):
    launched("--config_file", str(REPO / "examples/launch/cpu_2proc_deepspeed.yaml"))
    args = parse_run_args([TINY])
    assert args.recipe.parallel.zero_stage == 2
    assert ("`parallel.zero_stage: 2` comes from the accelerate config (`zero_stage: 2`; the recipe leaves it unset)"
            in args.notices)
    # mixed_precision 'no' is what `accelerate config` writes by default: the recipe's `auto` still decides.
    assert args.recipe.train.precision == ("bf16" if bf16_verdict().faster else "fp32")
    assert ("the accelerate config `mixed_precision: no` is accelerate's default; the recipe's `train.precision` "
            "decides") in args.notices


def test_every_deepspeed_key_of_a_users_accelerate_config_reaches_the_run(tmp_path, launched):
    """zero_stage, both offload devices, accumulation, clipping and mixed precision, with a recipe that leaves them
    unset; the Accelerator then builds (it was accelerate's 'will be ignored' ValueError). The Accelerator is built in
    a process of its own: a DeepSpeed Accelerator leaves a process group and ACCELERATE_USE_DEEPSPEED behind."""
    config = _user_config(tmp_path, zero_stage=3, offload_optimizer_device="cpu", offload_param_device="cpu",
                          gradient_accumulation_steps=2, gradient_clipping=0.5, zero3_init_flag="false",
                          mixed_precision="bf16")
    environment = launched("--config_file", config)
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(f"tokenizer: {{path: {REPO / 'examples/data/gpt-neox-20b-tokenizer.json'}}}\n"
                           f"output: {{dir: {tmp_path / 'out'}}}\n")
    args = parse_run_args([str(recipe_file)])
    p, t = args.recipe.parallel, args.recipe.train
    assert (p.zero_stage, p.offload_optimizer, p.offload_params) == (3, True, True)
    assert (t.gradient_accumulation_steps, t.clip_grad, t.precision) == (2, 0.5, "bf16")
    assert sum("comes from the accelerate config" in notice for notice in args.notices) == 6

    script = tmp_path / "build.py"
    script.write_text(
        "import json, sys\n"
        "from neox_hf.parallel.accelerator import build_accelerator\n"
        "from neox_hf.recipe.args import parse_run_args\n"
        "accelerator = build_accelerator(parse_run_args([sys.argv[1]]).recipe)\n"
        "ds = accelerator.state.deepspeed_plugin.deepspeed_config\n"
        "print(json.dumps({'ds': ds, 'gas': accelerator.gradient_accumulation_steps,"
        " 'mixed': accelerator.mixed_precision}, default=str))\n")
    done = subprocess.run([sys.executable, str(script), str(recipe_file)], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env=launch_env(**environment))
    assert done.returncode == 0, done.stderr[-3000:]
    built = json.loads(done.stdout.strip().splitlines()[-1])
    ds = built["ds"]
    assert ds["zero_optimization"]["stage"] == 3 and ds["gradient_accumulation_steps"] == 2
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"]["enabled"]
    assert (built["gas"], built["mixed"]) == (2, "bf16")


def test_an_agreeing_value_is_used_and_a_contradicting_one_refused_naming_both(launched):
    launched("--use_deepspeed", "--num_processes", "2", "--zero_stage", "3", "--gradient_accumulation_steps", "4")
    with pytest.raises(RecipeError) as refused:
        parse_run_args([TINY])  # tiny.yaml says gradient_accumulation_steps: 1
    assert str(refused.value) == (
        f"`accelerate launch` sets `gradient_accumulation_steps: 4` but {TINY} sets "
        "`train.gradient_accumulation_steps: 1`; make them agree: pass `--train.gradient_accumulation_steps 4`, or "
        "change or remove `gradient_accumulation_steps` in `accelerate launch`")
    args = parse_run_args([TINY, "--train.gradient_accumulation_steps", "4"])
    assert args.recipe.parallel.zero_stage == 3 and args.recipe.train.gradient_accumulation_steps == 4
    assert "`accelerate launch` `gradient_accumulation_steps: 4` agrees with the recipe's " \
           "`train.gradient_accumulation_steps`" in args.notices


class _WritesRecorded:
    """A stderr that keeps each write call apart, as the pipe a launch's ranks share receives them."""

    def __init__(self):
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self):
        pass


def test_every_rank_writes_its_refusal_in_one_call_so_ranks_cannot_interleave_it(launched, monkeypatch):
    """Every rank of a launch refuses a contradicting accelerate config and all share one stderr pipe. `print` wrote
    the line and its newline in two calls, and CI caught two ranks' lines joined as "error: …error: …"."""
    from neox_hf.cli import train_main as main

    launched("--use_deepspeed", "--num_processes", "2", "--zero_stage", "3")
    stderr = _WritesRecorded()
    monkeypatch.setattr(sys, "stderr", stderr)
    assert main([TINY, "--parallel.zero_stage", "1"]) == 2
    assert len(stderr.writes) == 1
    assert stderr.writes[0].startswith("error: `accelerate launch` sets `zero_stage: 3` but ")
    assert stderr.writes[0].endswith("in `accelerate launch`\n") and stderr.writes[0].count("\n") == 1


def test_accelerates_default_mixed_precision_does_not_contradict_an_fp16_recipe(tmp_path, launched):
    """Every `accelerate config` writes mixed_precision: 'no' unless asked otherwise; the Pythia recipes train fp16."""
    launched("--config_file", _user_config(tmp_path, zero_stage=1))
    args = parse_run_args([str(REPO / "recipes" / "pythia-160m.yaml")])
    assert args.recipe.train.precision == "fp16"
    assert ("the accelerate config `mixed_precision: no` is accelerate's default; the recipe's "
            "`train.precision: fp16` decides") in args.notices


@pytest.mark.parametrize("key,value,message", [
    ("offload_optimizer_device", "nvme", "offloads optimizer states to CPU memory only"),
    ("offload_param_device", "nvme", "offloads parameters to CPU memory only"),
])
def test_what_neox_hf_cannot_run_is_refused_by_name(tmp_path, launched, key, value, message):
    config = _user_config(tmp_path, zero_stage=3, **{key: value})
    launched("--config_file", config, "--offload_param_nvme_path", "/nvme", "--offload_optimizer_nvme_path", "/nvme")
    with pytest.raises(RecipeError, match=message):
        parse_run_args([TINY])


def test_offload_params_needs_zero3(tmp_path, launched):
    launched("--config_file", _user_config(tmp_path, zero_stage=2, offload_param_device="cpu"))
    with pytest.raises(RecipeError, match=r"`parallel.offload_params: true` needs `parallel.zero_stage: 3`"):
        parse_run_args([TINY])


def test_a_recipe_built_in_python_is_checked_against_the_launcher_too(launched, fresh_accelerate_state):
    """A script calling train(recipe) under `accelerate launch --zero_stage 2` with a ZeRO-1 recipe: refused, not
    silently run at the recipe's stage; `train.precision: auto` takes the launcher's mixed precision."""
    from neox_hf.parallel.accelerator import build_accelerator
    from neox_hf.recipe import recipe_from_dict

    launched("--use_deepspeed", "--num_processes", "2", "--zero_stage", "2", "--mixed_precision", "bf16")
    with pytest.raises(RecipeError, match=r"`accelerate launch` sets `zero_stage: 2` but the recipe sets "
                                          r"`parallel.zero_stage: 1`"):
        build_accelerator(recipe_from_dict({"parallel": {"zero_stage": 1}}))
    recipe = recipe_from_dict({"parallel": {"zero_stage": 2}, "train": {"precision": "auto"}})
    from neox_hf.recipe.launcher import check_recipe_agrees_with_launcher

    check_recipe_agrees_with_launcher(recipe)
    assert recipe.train.precision == "bf16"


def test_the_recipes_collective_timeout_reaches_the_process_group(tmp_path):
    """`parallel.timeout_minutes` is passed whatever the device (it was passed only on CPU, so CUDA runs had NCCL's
    10 minutes for rank-0-only work). A fresh process: the group is created once per process."""
    script = tmp_path / "timeout.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from neox_hf.recipe import recipe_from_dict\n"
        "from neox_hf.parallel.accelerator import build_accelerator\n"
        "build_accelerator(recipe_from_dict({'parallel': {'zero_stage': 1, 'timeout_minutes': 7},"
        " 'train': {'precision': 'fp32'}, 'output': {'dir': %r}}))\n"
        "group = dist.distributed_c10d._get_default_group()\n"
        "print('timeout', group._get_backend(torch.device('cpu')).options._timeout)\n" % str(tmp_path / "out"))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=launch_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert "timeout 0:07:00" in done.stdout


@pytest.mark.parametrize("zero_stage,accumulation,fp32_accumulation", [(2, 4, True), (1, 2, True), (2, 1, False),
                                                                       (0, 4, False)])
def test_bf16_gradients_accumulate_in_fp32_where_deepspeed_supports_it(zero_stage, accumulation, fp32_accumulation):
    """In the DeepSpeed JSON the Accelerator is built with (ZeRO-0 refuses bf16 weights with fp32 accumulation; runs
    of ZeRO-1 and -2 with it were checked to train)."""
    from neox_hf.parallel.accelerator import deepspeed_config
    from neox_hf.recipe import recipe_from_dict

    recipe = recipe_from_dict({"parallel": {"zero_stage": zero_stage, "use_deepspeed": True},
                               "train": {"precision": "bf16", "gradient_accumulation_steps": accumulation}})
    ds = deepspeed_config(recipe.parallel, recipe.train)
    assert (ds.get("data_types", {}).get("grad_accum_dtype") == "fp32") is fp32_accumulation


@pytest.mark.distributed  # two processes
def test_ranks_that_settled_different_precisions_are_refused_on_every_rank():
    """`auto` is settled per process (measured GEMM rates on an AVX512-BF16 CPU without AMX): ranks that disagreed
    would build engines of different dtypes and hang at their first all-reduce. Every rank refuses, naming each one's
    precision; ranks that agree go on."""
    from tests.conftest import free_port

    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, str(REPO / "tests/workers/precision_agreement.py"), "bf16,bf16",
                               "fp32,bf16"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=launch_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for rank in (0, 1)]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    for (out, err), rank in zip(outputs, ranks):
        assert rank.returncode == 0, err[-2000:]
        agreed, refused = out.splitlines()
        assert agreed == "agreed"
        assert refused.startswith("error: the ranks settled `train.precision` differently (rank 0 fp32, rank 1 bf16;")
        assert refused.endswith("set `train.precision: fp32` or `bf16`")
