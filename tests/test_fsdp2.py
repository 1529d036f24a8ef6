"""`parallel.backend: fsdp2` (neox_hf/engines/fsdp2.py) against one process, through `run_clm_neox.py`'s entry
point under torchrun (gloo, fp32, dropout 0, a 2-layer hidden-64 model):

- FSDP2 over 2 data-parallel ranks trains the same 6 steps as one process: losses within 1e-5, final weights within
  1e-4, in pack mode (GPT-NeoX's order: the global batch is layout-free), and as DeepSpeed ZeRO-1 DP2 in pad mode
  (streamed sources are read per data-parallel rank, so one process trains other batches);
- its checkpoint (the layout-free DTensors, the one format it writes) is intact after every rank was SIGKILLed in the
  middle of the next save, and resumes on one process continuing steps 4–6 as the uninterrupted run (the resumes
  onto and from one process, DeepSpeed ZeRO-2/3, TP and pipeline stages are tests/test_resume_any_layout.py's);
  `neox_hf export` reads an FSDP2 step folder;
- with gradient accumulation FSDP2 reduce-scatters once per step (counted by torch's CommDebugMode), not once per
  micro-batch, and still trains as one process;
- LoRA under FSDP2 DP2 trains as one process's LoRA run and saves the same adapter folder;
- HSDP 2 × 2 and our tensor parallelism (TP2 + sequence parallelism) inside FSDP2 DP2 train as one process too (4
  processes), and TP2 × FSDP2's checkpoint resumes on one process;
- the recipe refuses what the backend does not run, each in one line.

To keep CPU down, the 2-process runs share one launch (tests/workers/fsdp2_layouts.py: init_layouts.py with the
collective count and the kill), the 4-process ones another, and the one-process runs run in the test process."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, finish_launch, start_torchrun_layouts, train_in_this_process
from tests.test_resume import step_losses
from tests.test_resume_any_layout import TINY, assert_continues, pack_data, pad_data  # noqa: F401 (fixtures)

FSDP2 = ["--parallel.backend", "fsdp2"]
# LoRA as tests/test_finetune.py trains it (no dropout: equal runs), clipped hard enough that every step clips
LORA = ["--peft.method", "lora", "--peft.r", "4", "--peft.alpha", "8", "--peft.dropout", "0", "--train.clip_grad",
        "0.05"]
STEP3 = Path("checkpoints") / "step_00000003"


def _one(micro: int = 4) -> list[str]:
    return ["--train.micro_batch_size", str(micro)]


def _dp2() -> list[str]:
    return ["--train.micro_batch_size", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pack_data, pad_data) -> dict[str, Path]:  # noqa: F811
    root = tmp_path_factory.mktemp("fsdp2")
    data = {"pack": pack_data, "pad": pad_data}
    recipe = [str(REPO / "recipes" / "tiny.yaml"), *TINY]

    def args(name, mode, *extra):
        return shlex.join([*recipe, *data[mode], *extra, "--output.dir", str(root / name)])

    def in_process(name, mode, *extra):
        train_in_this_process(shlex.split(args(name, mode, *extra)))

    # One 2-process launch: the sources (6 steps, a checkpoint at step 3) and the other 2-process runs; last,
    # fsdp2_pack again, killed (kill -9 of every rank) in the middle of its step-6 checkpoint save, which ends the
    # launch. The one-process reference trains meanwhile in this process.
    launch = start_torchrun_layouts(root, {
        "fsdp2_pack": args("fsdp2_pack", "pack", *_dp2(), *FSDP2),
        "fsdp2_pad": args("fsdp2_pad", "pad", *_dp2(), *FSDP2),
        "zero1_pad": args("zero1_pad", "pad", *_dp2(), "--parallel.zero_stage", "1"),
        # the same global batch as micro-batches of 1 accumulated twice, layers recomputed in backward
        "fsdp2_ac_gas2": args("fsdp2_ac_gas2", "pack", *FSDP2, "--train.micro_batch_size", "1",
                              "--train.gradient_accumulation_steps", "2", "--parallel.activation_checkpointing",
                              "true"),
        "fsdp2_bf16": args("fsdp2_bf16", "pack", *_dp2(), *FSDP2, "--train.precision", "bf16"),
        "fsdp2_lora": args("fsdp2_lora", "pack", *_dp2(), *FSDP2, *LORA),
        "fsdp2_killed": args("fsdp2_killed", "pack", *_dp2(), *FSDP2)},
        probes=("--count", "fsdp2_pack", "--count", "fsdp2_ac_gas2", "--kill-in-save", "fsdp2_killed:6"))
    in_process("one_pack", "pack", *_one())
    in_process("one_lora", "pack", *_one(), *LORA)
    output, _ = launch.communicate(timeout=900)
    finished = ("fsdp2_pack", "fsdp2_pad", "zero1_pad", "fsdp2_ac_gas2", "fsdp2_bf16", "fsdp2_lora")
    statuses = [root / f"{name}.status" for name in finished]
    assert [s.read_text() if s.is_file() else None for s in statuses] == ["0"] * len(finished), output[-5000:]
    assert launch.returncode != 0 and (root / "fsdp2_killed.killed").is_file(), output[-5000:]
    killed = root / "fsdp2_killed"
    (root / "fsdp2_killed.at_kill.json").write_text(json.dumps({  # what the kill left, before the resume cleans up
        "latest": (killed / "checkpoints" / "latest").read_text(),
        "checkpoints": sorted(p.name for p in (killed / "checkpoints").iterdir()),
        "final_folder": (killed / "config.json").exists()}))
    # The killed run resumed (`--resume`: its `latest`) on one process: FSDP2's layout-free step 3 on another layout
    # (one process → FSDP2 is tests/test_resume_any_layout.py's).
    in_process("fsdp2_killed", "pack", *_one(), "--resume")
    resume = lambda source: ["--train.resume", str(root / source / STEP3)]  # noqa: E731
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


def _assert_same_run(want: Path, got: Path, *, loss_tol: float = 1e-5, weight_tol: float = 1e-4,
                     steps: list[int] = [1, 2, 3, 4, 5, 6]) -> None:  # noqa: B006 (read only)
    from safetensors.torch import load_file

    reference, losses = step_losses(want), step_losses(got)
    assert sorted(losses) == sorted(reference) == steps, (reference, losses)
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
def test_lora_under_fsdp2_dp2_trains_and_saves_the_adapter_as_one_process(runs):
    """LoRA adapters applied before fully_shard (FSDP2 shards the frozen base and the adapters per parameter): the
    6 steps' losses within 1e-5 and gradient norms too (clipped to 0.05 every step: the norm is the adapters' alone,
    as one process's, whose base has no gradients), and the adapter folder (adapter_model.safetensors +
    adapter_config.json, gathered from the shards) within 1e-4 of one process's, loaded by stock PEFT onto the base.
    The optimizer holds the adapters only: the checkpoint (FSDP2's layout-free state: parameters and Adam's two
    moments of what the optimizer steps) has 3 tensors for each of the 16 adapter matrices and none of the base."""
    import torch.distributed.checkpoint as dcp
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    want, got = runs["one_lora"], runs["fsdp2_lora"]
    reference, losses = step_losses(want), step_losses(got)
    assert sorted(losses) == sorted(reference) == [1, 2, 3, 4, 5, 6], (reference, losses)
    assert max(abs(losses[s] - reference[s]) for s in reference) <= 1e-5, (reference, losses)
    norms = [[json.loads(line)["grad_norm"] for line in (run / "train_log.jsonl").read_text().splitlines()]
             for run in (want, got)]
    assert all(n > 0.05 for n in norms[0]) and max(abs(a - b) for a, b in zip(*norms)) <= 1e-5, norms
    a, b = load_file(want / "adapter_model.safetensors"), load_file(got / "adapter_model.safetensors")
    assert a.keys() == b.keys() and len(a) == 16 and all("lora_" in key for key in a), sorted(b)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-4
    assert max(a[k].abs().max().item() for k in a if "lora_B" in k) > 1e-3  # trained off lora_B's zeros
    configs = [json.loads((run / "adapter_config.json").read_text()) for run in (want, got)]
    for config in configs:  # peft writes the target set in the process's hash order
        config["target_modules"] = sorted(config["target_modules"])
        config.pop("base_model_name_or_path")
    assert configs[0] == configs[1]
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(got / STEP3))
    loaded = dict(PeftModel.from_pretrained(base, got).named_parameters())
    assert all(torch.equal(loaded[k.replace(".weight", ".default.weight")], b[k]) for k in b)
    saved = dcp.FileSystemReader(str(got / STEP3 / "layout_free")).read_metadata().state_dict_metadata
    assert len(saved) == 3 * 16 and all("lora_" in key for key in saved), sorted(saved)


@pytest.mark.distributed
def test_fsdp2_dp2_trains_as_deepspeed_dp2_in_pad_mode(runs):
    """Streamed sources are read per data-parallel rank (other batches than one process's): FSDP2 DP2 against
    DeepSpeed ZeRO-1 DP2, which tests/test_zero_equivalence.py holds to one process on fixed batches."""
    _assert_same_run(runs["zero1_pad"], runs["fsdp2_pad"])


@pytest.mark.distributed
def test_fsdp2_accumulation_reduces_gradients_once_per_step(runs):
    """With 2 micro-batches per step FSDP2 reduce-scatters the gradients in the last micro-batch's backward only:
    the run makes as many reduce-scatters as the same 6 steps without accumulation (one per sharded group and step;
    twice as many if every micro-batch reduced), and still trains as one process
    (test_fsdp2_with_activation_checkpointing_and_accumulation_trains_as_one_process)."""
    counts = {name: json.loads((runs[name].parent / f"{name}.collectives.json").read_text())
              for name in ("fsdp2_pack", "fsdp2_ac_gas2")}
    reduce_scatters = {name: sum(calls for op, calls in counted.items() if "reduce_scatter" in op)
                       for name, counted in counts.items()}
    groups = 2 + 2  # the 2 decoder layers, the decoder (embeddings, final norm), the head; the model root holds none
    assert reduce_scatters == {"fsdp2_pack": 6 * groups, "fsdp2_ac_gas2": 6 * groups}, counts


@pytest.mark.distributed
def test_a_kill_during_an_fsdp2_save_loses_nothing_and_its_checkpoint_resumes_on_one_process(runs):
    """Every rank SIGKILLed in the middle of the step-6 save (its layout-free chunks written, not its trainer state
    or rename): `latest` still names step 3 and the half-written step 6 is staging only; `--resume` removes the
    staging and continues from step 3 (FSDP2's layout-free state, read on one process) as the uninterrupted FSDP2 run
    did: steps 4-6 within 1e-5 (every layout trains GPT-NeoX's order as one process within it), weights as
    tests/test_resume_any_layout.py bounds them."""
    at_kill = json.loads((runs["fsdp2_killed"].parent / "fsdp2_killed.at_kill.json").read_text())
    assert at_kill == {"latest": "step_00000003", "checkpoints": [".tmp-step_00000006", "latest", "step_00000003"],
                       "final_folder": False}, at_kill
    expected, got = step_losses(runs["fsdp2_pack"]), step_losses(runs["fsdp2_killed"])
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert all(abs(got[step] - expected[step]) <= 1e-5 for step in (4, 5, 6)), (expected, got)
    assert_continues(runs["fsdp2_pack"], runs["fsdp2_killed"])
    left = sorted(p.name for p in (runs["fsdp2_killed"] / "checkpoints").iterdir())
    assert left == ["latest", "step_00000003", "step_00000006"], left


@pytest.mark.distributed
def test_an_fsdp2_step_folder_holds_one_format(runs):
    """The layout-free state (DCP of the DTensors: each rank's chunks once) beside each rank's trainer state and RNG
    state and the config + tokenizer that make the folder exportable: no second, per-rank copy of the model or the
    optimizer (no Accelerate/FSDP `pytorch_model_fsdp*`, `optimizer*.bin`, safetensors of a rank's shards)."""
    step = runs["fsdp2_pack"] / STEP3
    assert sorted(str(p.relative_to(step)) for p in step.rglob("*") if p.is_file()) == [
        "config.json", "layout_free/.metadata", "layout_free/__0_0.distcp", "layout_free/__1_0.distcp",
        "random_states_0.pkl", "random_states_1.pkl", "tokenizer.json", "tokenizer_config.json",
        "trainer_state_rank0.pt", "trainer_state_rank1.pt"]


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
# Per-layer torch.compile under FSDP2 (the GPU tier: tests/test_cuda.py's convention)
# ----------------------------------------------------------------------------------------------------------------

COMPILE_DEVICE = os.environ.get("NEOX_HF_TEST_DEVICE", "cuda")


@pytest.mark.cuda
@pytest.mark.skipif(COMPILE_DEVICE == "cuda" and not torch.cuda.is_available(),
                    reason="needs a CUDA GPU (NEOX_HF_TEST_DEVICE=cpu runs the body on CPU)")
def test_fsdp2_with_per_layer_compile_trains_as_eager_fsdp2(tmp_path, capsys, monkeypatch, fresh_accelerate_state):
    """`train.compile: true` under FSDP2: each decoder layer compiled before fully_shard (torchtitan's order), FSDP2's
    hooks eager around the compiled forward; 4 steps of FSDP2 on one process (a group of one: the same hooks,
    all-gathers and reduce-scatters over one rank) against the same run eager, fp32 with full-precision matmuls:
    losses within 1e-5; weights within 1e-3, test_resume_any_layout's bound, not 1e-4: inductor's fused kernels
    sum in another order, and where an element's gradient is rounding noise (embedding rows, the key bias) Adam's
    g/√v turns the noise's sign into steps of up to lr (2e-3) — on CPU the worst was 1.4e-4, an embedding row, with
    every other tensor within 1e-5. On the GPU (inductor's Triton kernels; not yet run on one here) or, with
    NEOX_HF_TEST_DEVICE=cpu, on CPU (its C++ kernels; FSDP2 DP2 under torchrun measured the same). Compiling costs
    ~45 s of CPU on 2 cores, hence this tier rather than the CPU suite."""
    from tests.test_cuda import in_process_run, tiny_run_args

    if COMPILE_DEVICE != "cuda":
        monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # TF32 would round both runs' inputs differently
    try:
        for setting in ("false", "true"):
            printed = in_process_run(*tiny_run_args(tmp_path / setting, *FSDP2, "--train.compile", setting,
                                                    "--train.train_iters", "4", "--model.num_layers", "2",
                                                    "--model.hidden_dropout", "0", "--model.attention_dropout", "0"),
                                     capsys=capsys)
    finally:
        torch.set_float32_matmul_precision(previous)
    assert "each decoder layer compiled" in printed, printed[-2000:]
    _assert_same_run(tmp_path / "false", tmp_path / "true", weight_tol=1e-3, steps=[1, 2, 3, 4])


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
    for train, refusal in (({"precision": "fp16"}, r"`train.precision: fp16` with `parallel.backend: fsdp2` is "),):
        with pytest.raises(RecipeError, match=refusal):
            recipe_from_dict({"parallel": {"backend": "fsdp2"}, "train": {"precision": "fp32", **train}})
    with pytest.raises(RecipeError, match=r"`peft.method` with `parallel.dp_replicate > 1` \(HSDP\) is refused"):
        recipe_from_dict({"parallel": {"backend": "fsdp2", "dp_replicate": 2}, "train": {"precision": "fp32"},
                          "peft": {"method": "lora"}})
    recipe_from_dict({"parallel": {"backend": "fsdp2"}, "train": {"precision": "fp32"}, "peft": {"method": "lora"}})


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
