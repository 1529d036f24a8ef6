"""`parallel.backend: fsdp2` (neox_hf/engines/fsdp2.py) against one process, through `run_clm_neox.py`'s entry
point under torchrun (gloo, fp32, dropout 0, a 2-layer hidden-64 model):

- FSDP2 over 2 data-parallel ranks trains the same 6 steps as one process: losses within 1e-5, final weights within
  1e-4, in pack mode (GPT-NeoX's order: the global batch is layout-free), and as DeepSpeed ZeRO-1 DP2 in pad mode
  (streamed sources are read per data-parallel rank, so one process trains other batches);
- its checkpoint (the layout-free DTensors) resumes on one process, one process's on FSDP2, and FSDP2's on FSDP2,
  each continuing steps 4–6 as the uninterrupted run (tests/test_resume_any_layout.py's bound); `neox_hf export`
  reads an FSDP2 step folder;
- HSDP 2 × 2 and our tensor parallelism (TP2 + sequence parallelism) inside FSDP2 DP2 train as one process too (4
  processes), and TP2 × FSDP2's checkpoint resumes on one process;
- the recipe refuses what the backend does not run, each in one line.

To keep CPU down, the 2-process runs of a phase share one launch (tests/workers/init_layouts.py) and the one-process
runs run in the test process beside it."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, finish_launch, launch_env, train_in_this_process
from tests.test_resume import step_losses
from tests.test_resume_any_layout import TINY, assert_continues, pack_data, pad_data  # noqa: F401 (fixtures)

FSDP2 = ["--parallel.backend", "fsdp2"]
STEP3 = Path("checkpoints") / "step_00000003"


def _one(micro: int = 4) -> list[str]:
    return ["--train.micro_batch_size", str(micro)]


def _dp2() -> list[str]:
    return ["--train.micro_batch_size", "2"]


def start_torchrun_layouts(out_dir: Path, layouts: dict[str, str], num_processes: int = 2):
    """tests/workers/init_layouts.py under torchrun (not `accelerate launch --use_deepspeed`, whose environment asks
    Accelerate for DeepSpeed): each NAME's overrides in OUT_DIR/NAME, one after the other."""
    specs = [f"{name}={overrides}" for name, overrides in layouts.items()]
    worker = REPO / "tests/workers/init_layouts.py"
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                             str(num_processes), str(worker), str(out_dir), *specs, "--"],
                            cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pack_data, pad_data) -> dict[str, Path]:  # noqa: F811
    root = tmp_path_factory.mktemp("fsdp2")
    data = {"pack": pack_data, "pad": pad_data}
    recipe = [str(REPO / "recipes" / "tiny.yaml"), *TINY]

    def args(name, mode, *extra):
        return shlex.join([*recipe, *data[mode], *extra, "--output.dir", str(root / name)])

    def in_process(name, mode, *extra):
        train_in_this_process(shlex.split(args(name, mode, *extra)))

    # Phase 1: the sources (6 steps, a checkpoint at step 3).
    launch = start_torchrun_layouts(root, {"fsdp2_pack": args("fsdp2_pack", "pack", *_dp2(), *FSDP2),
                                           "fsdp2_pad": args("fsdp2_pad", "pad", *_dp2(), *FSDP2),
                                           "zero1_pad": args("zero1_pad", "pad", *_dp2(),
                                                             "--parallel.zero_stage", "1")})
    in_process("one_pack", "pack", *_one())
    finish_launch(launch, "the FSDP2 sources", timeout=600)
    # Phase 2: resumes from step 3.
    resume = lambda source: ["--train.resume", str(root / source / STEP3)]  # noqa: E731
    launch = start_torchrun_layouts(root, {
        "one_to_fsdp2": args("one_to_fsdp2", "pack", *_dp2(), *FSDP2, *resume("one_pack")),
        "fsdp2_to_fsdp2": args("fsdp2_to_fsdp2", "pad", *_dp2(), *FSDP2, *resume("fsdp2_pad")),
        # the same global batch as micro-batches of 1 accumulated twice, layers recomputed in backward
        "fsdp2_ac_gas2": args("fsdp2_ac_gas2", "pack", *FSDP2, "--train.micro_batch_size", "1",
                              "--train.gradient_accumulation_steps", "2",
                              "--parallel.activation_checkpointing", "true"),
        "fsdp2_bf16": args("fsdp2_bf16", "pack", *_dp2(), *FSDP2, "--train.precision", "bf16"),
        "zero1_to_fsdp2": args("zero1_to_fsdp2", "pad", *_dp2(), *FSDP2, *resume("zero1_pad")),
        "fsdp2_to_zero1": args("fsdp2_to_zero1", "pad", *_dp2(), "--parallel.zero_stage", "1",
                               *resume("fsdp2_pad"))})
    in_process("fsdp2_to_one", "pack", *_one(), *resume("fsdp2_pack"))
    finish_launch(launch, "the FSDP2 resumes", timeout=600)
    # 4 processes: HSDP 2 replicas × 2 shards (a micro-batch of 1 per rank); our TP2 (+ sequence parallelism)
    # inside FSDP2 over 2 data-parallel ranks; then TP2 × FSDP2's checkpoint resumed on one process.
    launch = start_torchrun_layouts(root, {
        "hsdp_2x2": args("hsdp_2x2", "pack", *FSDP2, "--parallel.dp_replicate", "2", "--train.micro_batch_size", "1"),
        "tp2_fsdp2_dp2": args("tp2_fsdp2_dp2", "pack", *FSDP2, *_dp2(), "--parallel.tensor_parallel", "2",
                              "--parallel.sequence_parallel", "true")}, num_processes=4)
    finish_launch(launch, "HSDP 2 × 2 and TP2 × FSDP2 DP2", timeout=600)
    in_process("tp2_fsdp2_to_one", "pack", *_one(), *resume("tp2_fsdp2_dp2"))
    in_process("hsdp_to_one", "pack", *_one(), *resume("hsdp_2x2"))
    return {path.name: path for path in root.iterdir() if path.is_dir()}


def _assert_same_run(want: Path, got: Path, *, loss_tol: float = 1e-5, weight_tol: float = 1e-4) -> None:
    from safetensors.torch import load_file

    reference, losses = step_losses(want), step_losses(got)
    assert sorted(losses) == sorted(reference) == [1, 2, 3, 4, 5, 6], (reference, losses)
    worst_loss = max(abs(losses[s] - reference[s]) for s in reference)
    assert worst_loss <= loss_tol, (reference, losses)
    a, b = load_file(want / "model.safetensors"), load_file(got / "model.safetensors")
    assert a.keys() == b.keys()
    heads = json.loads((want / "config.json").read_text())["num_attention_heads"]
    worst = {k: (_without_key_bias(a[k], k, heads) - _without_key_bias(b[k], k, heads)).abs().max().item() for k in a}
    assert max(worst.values()) <= weight_tol, sorted(worst.items(), key=lambda kv: kv[1])[-3:]


def _without_key_bias(tensor, name: str, heads: int):
    """The key bias's gradient is zero in exact arithmetic (q·b_k is the same for every key: softmax ignores it), so
    it is rounding noise of the reduction order, which Adam (g / √v) turns into ±lr steps on any two layouts; the
    other tensors are compared whole. GPT-NeoX's fused bias is [heads, (q, k, v), head_dim]."""
    if not name.endswith("attention.query_key_value.bias"):
        return tensor
    per_head = tensor.view(heads, 3, -1)
    return per_head[:, [0, 2]]


@pytest.mark.distributed
def test_fsdp2_dp2_trains_as_one_process_in_pack_mode(runs):
    """GPT-NeoX's order gives every layout the same global batches."""
    _assert_same_run(runs["one_pack"], runs["fsdp2_pack"])


@pytest.mark.distributed
def test_fsdp2_with_activation_checkpointing_and_accumulation_trains_as_one_process(runs):
    _assert_same_run(runs["one_pack"], runs["fsdp2_ac_gas2"])


@pytest.mark.distributed
def test_hsdp_2x2_trains_as_one_process_and_resumes_on_one(runs):
    _assert_same_run(runs["one_pack"], runs["hsdp_2x2"])
    assert_continues(runs["hsdp_2x2"], runs["hsdp_to_one"])  # each replicated chunk written once, read whole
    printed = (runs["hsdp_2x2"].parent / "hsdp_2x2.stdout").read_text()
    assert "layout: 4 data-parallel = 4 process(es), FSDP2 HSDP (2 replicas), precision fp32" in printed
    assert "engine: FSDP2 HSDP (2 replicas × 2 shards)" in printed


@pytest.mark.distributed
def test_tensor_parallel_2_inside_fsdp2_dp2_trains_as_one_process_and_resumes_on_one(runs):
    _assert_same_run(runs["one_pack"], runs["tp2_fsdp2_dp2"])
    printed = (runs["tp2_fsdp2_dp2"].parent / "tp2_fsdp2_dp2.stdout").read_text()
    assert "engine: FSDP2 (2 shards) × tensor parallel 2" in printed
    assert_continues(runs["tp2_fsdp2_dp2"], runs["tp2_fsdp2_to_one"])


@pytest.mark.distributed
def test_fsdp2_bf16_keeps_fp32_masters_and_follows_the_fp32_run(runs):
    """bf16 compute, fp32 sharded masters and reductions: the saved weights are fp32 and the losses stay within bf16's
    rounding of the fp32 run's."""
    from safetensors.torch import load_file

    import torch

    reference, losses = step_losses(runs["one_pack"]), step_losses(runs["fsdp2_bf16"])
    assert max(abs(losses[s] - reference[s]) for s in reference) <= 0.05, (reference, losses)
    assert all(t.dtype == torch.float32 for t in load_file(runs["fsdp2_bf16"] / "model.safetensors").values())


@pytest.mark.distributed
def test_fsdp2_dp2_trains_as_deepspeed_dp2_in_pad_mode(runs):
    """Streamed sources are read per data-parallel rank (other batches than one process's): FSDP2 DP2 against
    DeepSpeed ZeRO-1 DP2, which tests/test_zero_equivalence.py holds to one process on fixed batches."""
    _assert_same_run(runs["zero1_pad"], runs["fsdp2_pad"])


@pytest.mark.distributed
def test_fsdp2_checkpoint_is_layout_free_and_resumes_on_one_process(runs):
    step = runs["fsdp2_pack"] / STEP3
    assert (step / "layout_free" / ".metadata").is_file()
    assert not (step / "model.safetensors").exists()  # no second, per-rank copy of the weights
    assert_continues(runs["fsdp2_pack"], runs["fsdp2_to_one"])


@pytest.mark.distributed
def test_one_process_checkpoint_resumes_on_fsdp2(runs):
    assert_continues(runs["one_pack"], runs["one_to_fsdp2"])
    printed = (runs["one_to_fsdp2"].parent / "one_to_fsdp2.stdout").read_text()
    assert "resuming step 3 written by 1 process without DeepSpeed on FSDP2 on 2 processes" in printed, printed[-2000:]


@pytest.mark.distributed
def test_deepspeed_and_fsdp2_resume_each_others_checkpoints(runs):
    """ZeRO-1 DP2 ↔ FSDP2 DP2 in pad mode (the same data-parallel size keeps each rank's streamed position)."""
    assert_continues(runs["zero1_pad"], runs["zero1_to_fsdp2"])
    assert_continues(runs["fsdp2_pad"], runs["fsdp2_to_zero1"])
    printed = (runs["fsdp2_to_zero1"].parent / "fsdp2_to_zero1.stdout").read_text()
    assert "resuming step 3 written by FSDP2 on 2 processes on DeepSpeed ZeRO-1 on 2 processes" in printed


@pytest.mark.distributed
def test_fsdp2_resumes_on_the_same_layout(runs):
    assert_continues(runs["fsdp2_pad"], runs["fsdp2_to_fsdp2"])


@pytest.mark.distributed
def test_export_reads_an_fsdp2_step_folder(runs, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file

    from neox_hf.cli import main

    source = runs["fsdp2_pack"]
    assert main(["export", str(source / "checkpoints" / "step_00000006"), str(tmp_path / "hf")]) == 0, \
        capsys.readouterr().err
    want, got = load_file(source / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


# ----------------------------------------------------------------------------------------------------------------
# The recipe: what the backend refuses, in one line each (fast tier)
# ----------------------------------------------------------------------------------------------------------------


def _recipe(**parallel):
    from neox_hf.recipe import recipe_from_dict

    return recipe_from_dict({"parallel": parallel, "train": {"precision": "fp32"}})


def test_backend_defaults_to_deepspeed_and_unknown_values_are_refused():
    from neox_hf.errors import RecipeError

    assert _recipe().parallel.backend == "deepspeed"
    assert _recipe(backend="fsdp2", dp_replicate=2).parallel.dp_replicate == 2
    with pytest.raises(RecipeError, match=r"`parallel.backend` = 'fsdp' is not one of 'deepspeed', 'fsdp2'"):
        _recipe(backend="fsdp")


@pytest.mark.parametrize("key, value, why", [
    ("zero_stage", 3, "it is a DeepSpeed setting"),
    ("pipeline_parallel", 2, "pipeline stages run on DeepSpeed's pipeline engine"),
    ("deepspeed_config", "ds.json", "it is a DeepSpeed setting"),
])
def test_fsdp2_refuses_deepspeed_keys_by_name(key, value, why):
    from neox_hf.errors import RecipeError

    refusal = rf"`parallel.{key}: {value}` with `parallel.backend: fsdp2` is refused: {why}"
    with pytest.raises(RecipeError, match=refusal):
        _recipe(backend="fsdp2", **{key: value})


def test_hsdp_needs_fsdp2_and_fsdp2_refuses_what_it_does_not_run():
    from neox_hf.errors import RecipeError
    from neox_hf.recipe import recipe_from_dict

    with pytest.raises(RecipeError, match=r"`parallel.dp_replicate` \(HSDP\) needs `parallel.backend: fsdp2`"):
        _recipe(dp_replicate=2)
    for train, refusal in (({"precision": "fp16"}, r"`train.precision: fp16` with `parallel.backend: fsdp2` is "),
                           ({"compile": True}, r"`train.compile: true` with `parallel.backend: fsdp2` is ")):
        with pytest.raises(RecipeError, match=refusal):
            recipe_from_dict({"parallel": {"backend": "fsdp2"}, "train": {"precision": "fp32", **train}})


def test_an_accelerate_fsdp_config_that_contradicts_the_recipe_is_refused():
    from neox_hf.errors import RecipeError
    from neox_hf.recipe.launcher import reconcile_with_launcher

    fsdp = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    raw, notes = reconcile_with_launcher({}, "recipe.yaml", fsdp)
    assert raw["parallel"]["backend"] == "fsdp2"
    with pytest.raises(RecipeError, match=r"sets `use_fsdp: true` but recipe.yaml sets "
                                          r"`parallel.backend: deepspeed`"):
        reconcile_with_launcher({"parallel": {"backend": "deepspeed"}}, "recipe.yaml", fsdp)
    with pytest.raises(RecipeError, match=r"`fsdp_version: 1`: neox_hf shards with FSDP2 only"):
        reconcile_with_launcher({}, "recipe.yaml", {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"})


def test_a_deepspeed_launch_of_an_fsdp2_recipe_is_refused_naming_the_launchers_that_work():
    from neox_hf.errors import RecipeError
    from neox_hf.recipe.launcher import check_recipe_agrees_with_launcher

    with pytest.raises(RecipeError, match=r"--use_deepspeed` .* with `parallel.backend: fsdp2`: launch it with "
                                          r"`torchrun .* or an FSDP accelerate config"):
        check_recipe_agrees_with_launcher(_recipe(backend="fsdp2"), {"ACCELERATE_USE_DEEPSPEED": "true"})
    check_recipe_agrees_with_launcher(_recipe(backend="fsdp2"), {})


# ----------------------------------------------------------------------------------------------------------------
# `neox_hf plan`: FSDP2 layouts ranked beside DeepSpeed's (fast tier)
# ----------------------------------------------------------------------------------------------------------------


def _plan_recipe(*argv):
    from neox_hf.recipe.args import parse_run_args

    return parse_run_args([str(REPO / "recipes" / "tiny.yaml"), "--train.precision", "bf16", *argv]).recipe


def test_plan_of_an_fsdp2_recipe_shards_every_model_state_over_a_replica():
    """HSDP 2 × 2: params, grads and Adam are fp32 shards over the 2 ranks of a replica, 16 bytes per parameter / 2
    (DeepSpeed ZeRO-3 on the same ranks keeps 16-bit weights beside its fp32 masters)."""
    from neox_hf.plan import plan_for_recipe, stage_parameters, model_shape

    recipe = _plan_recipe("--parallel.backend", "fsdp2", "--parallel.dp_replicate", "2")
    own = plan_for_recipe(recipe, gpus=4).recipe_layout
    assert (own.layout.backend, own.layout.dp_replicate, own.layout.data) == ("fsdp2", 2, 4)
    params = stage_parameters(model_shape(recipe), 1, 1, "type:transformer")[0]
    stage = own.stages[0]
    shard = -(-params // 2)
    assert (stage.params, stage.grads, stage.optimizer) == (4 * shard, 4 * shard, 8 * shard)
    four_shards = plan_for_recipe(_plan_recipe("--parallel.backend", "fsdp2"), gpus=4).recipe_layout.stages[0]
    assert four_shards.model_states == 16 * -(-params // 4)


def test_plan_ranks_fsdp2_layouts_beside_deepspeed_ones(capsys):
    from neox_hf.cli import main
    from neox_hf.plan import plan_for_recipe

    plan = plan_for_recipe(_plan_recipe(), gpus=4, top=10_000)
    backends = {(p.layout.backend, p.layout.dp_replicate > 1) for p in plan.ranked}
    assert backends == {("deepspeed", False), ("fsdp2", False), ("fsdp2", True)}
    assert all(p.layout.pipeline == 1 for p in plan.ranked if p.layout.backend == "fsdp2")
    assert [p.step_seconds for p in plan.ranked] == sorted(p.step_seconds for p in plan.ranked)
    assert main(["plan", str(REPO / "recipes/tiny.yaml"), "--parallel.backend", "fsdp2", "--parallel.dp_replicate",
                 "2", "--gpus", "4"]) == 0
    assert "recipe: pipe 1 × tensor 1 × data 4, FSDP2 HSDP 2 × 2, micro" in capsys.readouterr().out
