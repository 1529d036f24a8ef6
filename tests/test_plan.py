"""`neox_hf plan` against measurement and against DeepSpeed's own estimators.

The measurement test trains a 4-layer, hidden-128 GPTNeoX (the bundled tokenizer's 50k vocabulary, micro batch 4 ×
256 tokens, fp32) under 8 layouts — one process; DP2 ZeRO-1/2/3; TP2; TP2 with sequence parallelism; pipeline 2;
pipeline 2 × TP2 — and holds the plan of the same recipe to what every rank measured (tests/workers/plan_measure.py,
as benchmarks/parallel_memory.py measures): model states (params + grads + optimizer + DeepSpeed's buffers, live just
before the weights are updated) within 5%, the step's peak within 15%.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, accelerate_launch_command, launch_env

WORKER = REPO / "tests" / "workers" / "plan_measure.py"
NEOX_20B = REPO.parent / "shared" / "data" / "neox-configs" / "20B.yml"

# name: (processes, ZeRO stage, TP, PP, flags) — the required layouts, grouped by process count into one launch each
LAYOUTS = {
    "one-process": (1, 0, 1, 1, ()),
    "dp2-zero1": (2, 1, 1, 1, ()),
    "dp2-zero2": (2, 2, 1, 1, ()),
    "tp2": (2, 1, 2, 1, ()),
    "tp2-sp": (2, 1, 2, 1, ("sp",)),
    "pipeline2": (2, 1, 1, 2, ()),
    "dp2-zero3": (2, 3, 1, 1, ()),  # ZeRO-3 last: transformers treats later models as partitioned while it lives
    "pipeline2-tp2": (4, 1, 2, 2, ()),
}


def _layout_argument(name: str) -> str:
    _, zero, tp, pp, flags = LAYOUTS[name]
    return f"{name}={','.join(map(str, (zero, tp, pp, *flags)))}"


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """name → the per-rank measurements; the three launches run side by side (start-up is most of their time)."""
    out = tmp_path_factory.mktemp("plan_measure")
    running = []
    for processes in sorted({spec[0] for spec in LAYOUTS.values()}):
        names = [_layout_argument(n) for n, spec in LAYOUTS.items() if spec[0] == processes]
        args = [out, "--layouts", *names]
        command = ([sys.executable, str(WORKER), *map(str, args)] if processes == 1
                   else accelerate_launch_command(WORKER, *args, num_processes=processes))
        running.append(subprocess.Popen(command, env=launch_env(), cwd=REPO, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True))
    for process in running:
        _, stderr = process.communicate(timeout=900)
        assert process.returncode == 0, stderr[-4000:]
    return {name: [json.loads(f.read_text()) for f in sorted((out / name).glob("rank*.json"))] for name in LAYOUTS}


def _planned_stages(name: str):
    from neox_hf.plan import plan_for_recipe
    from neox_hf.recipe import recipe_from_dict

    sys.path.insert(0, str(WORKER.parent))
    from plan_measure import recipe_dict

    processes, zero, tp, pp, flags = LAYOUTS[name]
    recipe = recipe_from_dict(recipe_dict("unused", zero=zero, tp=tp, pp=pp, sp="sp" in flags))
    return plan_for_recipe(recipe, gpus=processes).recipe_layout.stages


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_plan_matches_measured_memory_per_rank(measured, name):
    ranks = measured[name]
    assert len(ranks) == LAYOUTS[name][0]
    stages = _planned_stages(name)
    for rank in ranks:
        stage = stages[rank["stage"]]
        states = stage.model_states + stage.buffers
        assert states == pytest.approx(rank["model_states"], rel=0.05), (name, rank, stage)
        assert stage.total == pytest.approx(rank["total"], rel=0.15), (name, rank, stage)


# ----------------------------------------------------------------------------------------------------------------
# Fast tier: DeepSpeed's estimators, the command, the start-up lines
# ----------------------------------------------------------------------------------------------------------------


def _recipe(*argv):
    from neox_hf.recipe.args import parse_run_args

    return parse_run_args(list(argv)).recipe


def _data_parallel_recipe(path: str, zero: int):
    return _recipe(path, "--train.precision", "bf16", "--parallel.zero_stage", str(zero), "--parallel.pipeline_parallel",
                   "1", "--parallel.tensor_parallel", "1")


@pytest.mark.parametrize("path", ["recipes/pythia-1b.yaml", "recipes/20b.yaml"])
@pytest.mark.parametrize("data", [2, 8, 64])
def test_zero2_model_states_agree_with_deepspeed_estimator(path, data):
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from neox_hf.plan import model_shape, plan_for_recipe, stage_parameters

    recipe = _data_parallel_recipe(str(REPO / path), 2)
    total = stage_parameters(model_shape(recipe), 1, 1, recipe.parallel.pipe_partition_method)[0]
    _, deepspeed_bytes = estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=data, cpu_offload=False)
    planned = plan_for_recipe(recipe, gpus=data).recipe_layout.stages[0].model_states
    assert planned == pytest.approx(deepspeed_bytes, rel=0.05)


@pytest.mark.parametrize("path", ["recipes/pythia-1b.yaml", "recipes/20b.yaml"])
@pytest.mark.parametrize("data", [2, 8, 64])
def test_zero3_model_states_agree_with_deepspeed_estimator(path, data):
    """DeepSpeed's estimator counts 18 bytes per parameter over the data-parallel ranks + 4 × the largest layer. The
    plan counts what stage3.py allocates, which differs by two terms the estimator leaves out: the 16-bit gradient
    partition (`grad_partitions_flat_buffer`, 2 bytes per parameter of the partition, alive across steps) and the
    fp32 gradient copy being made one optimizer sub-group (`sub_group_size`, 1e9 elements) at a time. With those
    named, the two agree within 5%."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    from neox_hf.plan import (ZERO3_SUB_GROUP_SIZE, engine_for, layer_parameters_per_rank, model_shape,
                              plan_for_recipe, stage_parameters, zero3_gathered_layer_bytes)

    recipe = _data_parallel_recipe(str(REPO / path), 3)
    shape = model_shape(recipe)
    total = stage_parameters(shape, 1, 1, recipe.parallel.pipe_partition_method)[0]
    largest = max(layer_parameters_per_rank(shape, 1))
    _, deepspeed_bytes, _ = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=data,
                                                                  cpu_offload=False)
    plan = plan_for_recipe(recipe, gpus=data).recipe_layout
    planned = plan.stages[0].model_states + zero3_gathered_layer_bytes(engine_for(recipe, plan.layout, "bf16"), largest)
    partition = total / data
    omitted = 2 * partition - 4 * max(0.0, partition - ZERO3_SUB_GROUP_SIZE)
    assert planned == pytest.approx(deepspeed_bytes + omitted, rel=0.05)


def test_plan_json_for_20b_on_96_gpus_of_40_gb(capsys):
    from neox_hf.cli import main

    from neox_hf.plan import GIB, plan_for_recipe

    recipe = _recipe(str(REPO / "recipes/20b.yaml"))
    start = time.perf_counter()  # the planning itself; the command adds its imports (torch, transformers, DeepSpeed)
    plan_for_recipe(recipe, gpus=96, gpu_memory_bytes=40 * GIB)
    assert time.perf_counter() - start < 10
    assert main(["plan", str(REPO / "recipes/20b.yaml"), "--gpus", "96", "--gpu-memory", "40", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    own, *ranked = plan["layouts"]
    assert {k: own[k] for k in ("pipeline", "tensor", "data", "zero_stage", "micro_batch",
                                "gradient_accumulation_steps", "activation_checkpointing", "sequence_parallel")} == {
        "pipeline": 4, "tensor": 2, "data": 12, "zero_stage": 1, "micro_batch": 4, "gradient_accumulation_steps": 32,
        "activation_checkpointing": True, "sequence_parallel": False}
    assert own["fits"] is True and len(own["stages"]) == 4
    assert set(own["bytes_per_rank"]) >= {"params", "grads", "optimizer", "activations", "loss", "total"}
    assert own["bubble"] == pytest.approx(3 / 35)
    # the first and last stages differ (embedding; head and loss), the loss only on the last
    assert [s["loss"] > 0 for s in own["stages"]] == [False, False, False, True]
    assert own["stages"][0]["activations"] > own["stages"][3]["activations"]  # 1F1B: stage i holds p − i
    assert ranked and all(layout["fits"] for layout in ranked)
    assert [layout["step_seconds"] for layout in ranked] == sorted(layout["step_seconds"] for layout in ranked)
    for layout in ranked:
        assert layout["pipeline"] * layout["tensor"] * layout["context"] * layout["data"] == 96
        assert layout["micro_batch"] * layout["gradient_accumulation_steps"] * layout["data"] == 4 * 32 * 12


@pytest.mark.skipif(not NEOX_20B.is_file(), reason="GPT-NeoX's configs sit in ../shared/data")
def test_plan_reads_gpt_neox_configs():
    from neox_hf.plan import plan_for_recipe

    ours = plan_for_recipe(_recipe(str(REPO / "recipes/20b.yaml")), gpus=96).recipe_layout
    # the config's vocab_file is GPT-NeoX's download path; the same tokenizer is bundled here
    theirs = plan_for_recipe(_recipe(str(NEOX_20B), "--tokenizer.path", str(REPO / "recipes/../examples/data/"
                                                                             "gpt-neox-20b-tokenizer.json")),
                             gpus=96).recipe_layout
    assert theirs.layout == ours.layout
    assert [s.model_states for s in theirs.stages] == [s.model_states for s in ours.stages]


def test_plan_table_and_bad_input(capsys):
    from neox_hf.cli import main

    assert main(["plan", str(REPO / "recipes/tiny.yaml"), "--train.micro_batch_size", "2", "--gpus", "2"]) == 0
    table = capsys.readouterr().out
    assert "recipe: pipe 1 × tensor 1 × data 2" in table and "micro 2" in table and "MFU 40%" in table
    for argv in (["recipes/tiny.yaml", "--train.lrr", "1"], ["recipes/tiny.yaml", "--gpus", "two"]):
        assert main(["plan", *(str(REPO / a) if a.endswith(".yaml") else a for a in argv)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err


def test_gpus_the_recipe_s_layout_does_not_divide_are_planned_and_the_plan_says_so(capsys):
    """Issue 49: `--gpus 12` for the 20B's pipeline 4 × tensor 2 was refused; now the recipe's row is its layout on
    its own 8 GPUs, one line says so, and the layouts ranked are the factorisations of 12, at the recipe's batch.
    (A GPT-NeoX train_batch_size that the layout's data-parallel size on N cannot keep is still refused, naming the
    counts that keep it: tests/test_neox_fidelity.py.)"""
    from neox_hf.cli import main

    assert main(["plan", str(REPO / "recipes/20b.yaml"), "--gpus", "12"]) == 0
    lines = capsys.readouterr().out.splitlines()
    notes = [line for line in lines if line.startswith("note:")]
    assert notes == ["note: --gpus 12 is not a multiple of the recipe's layout (pipeline 4 × tensor 2 = 8 per "
                     "replica): the recipe's row is its layout on 8 GPUs; ranked below, the layouts 12 GPUs allow, "
                     "each at its global batch of 128"]
    assert any(line.startswith("| recipe: pipe 4 × tensor 2 × data 1, ZeRO-1, micro 4 × accumulation 32") for line in lines)
    ranked = [re.match(r"\| pipe (\d+) × tensor (\d+) × data (\d+),.* micro (\d+) × accumulation (\d+)", line)
              for line in lines[lines.index(next(l for l in lines if "layouts on 12 GPUs" in l)) + 1:]]
    assert ranked and all(m and int(m[1]) * int(m[2]) * int(m[3]) == 12 for m in ranked)
    assert all(int(m[4]) * int(m[5]) * int(m[3]) == 128 for m in ranked)


def test_startup_lines_name_each_stage_over_the_device():
    from neox_hf.plan import GIB, plan_summary_line, startup_memory_warnings

    recipe = _recipe(str(REPO / "recipes/20b.yaml"))
    warnings = startup_memory_warnings(recipe, 8 * GIB, gpus=96)
    assert len(warnings) == 4 and all(f"stage {s}" in w for s, w in enumerate(warnings))
    assert startup_memory_warnings(recipe, 80 * GIB, gpus=96) == []
    assert plan_summary_line(recipe, gpus=96).startswith("plan: pipe 4 × tensor 2 × data 12, ZeRO-1")


def test_plan_reads_a_gpt_neox_config_written_here(tmp_path):
    """The twin of `test_plan_reads_gpt_neox_configs` on every machine (no ../shared/data): a GPT-NeoX-format config
    plans the same layout and model states as the neox_hf recipe it translates to."""
    from neox_hf.plan import plan_for_recipe

    tokenizer = str(REPO / "examples/data/gpt-neox-20b-tokenizer.json")
    neox = tmp_path / "small.yml"
    neox.write_text(json.dumps({
        "num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 512,
        "max_position_embeddings": 512, "pipe_parallel_size": 2, "model_parallel_size": 2,
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8, "zero_optimization": {"stage": 1},
        "fp16": {"enabled": True}}))
    ours = tmp_path / "small.yaml"
    ours.write_text(json.dumps({
        "model": {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 512},
        "tokenizer": {"path": tokenizer},
        "parallel": {"pipeline_parallel": 2, "tensor_parallel": 2, "zero_stage": 1},
        "train": {"micro_batch_size": 4, "gradient_accumulation_steps": 8, "precision": "fp16"}}))
    theirs = plan_for_recipe(_recipe(str(neox), "--tokenizer.path", tokenizer), gpus=8).recipe_layout
    mine = plan_for_recipe(_recipe(str(ours)), gpus=8).recipe_layout
    assert theirs.layout == mine.layout and mine.layout.pipeline == 2 and mine.layout.tensor == 2
    assert [s.model_states for s in theirs.stages] == [s.model_states for s in mine.stages]


def test_plan_takes_the_mfu_a_run_measured_and_says_so(tmp_path, capsys):
    """`--mfu-from RUN_DIR`: the median MFU of the run's logged windows replaces the assumed 40%, step times scale by
    40% / measured, and the table names the run; the device run's matrix.md (gpu_profile.sh) works the same way."""
    from neox_hf.cli import main

    run = tmp_path / "run"
    run.mkdir()
    logged = [0.31, 0.2, 0.25, None]  # None: a window logged before the peak was known
    (run / "train_log.jsonl").write_text("".join(json.dumps({"step": 10 * (i + 1), "loss": 3.0,
                                                            **({"mfu": m} if m is not None else {})}) + "\n"
                                                for i, m in enumerate(logged)))
    recipe = [str(REPO / "recipes/20b.yaml"), "--gpus", "96", "--gpu-memory", "80", "--json"]
    assert main(["plan", *recipe]) == 0
    assumed = json.loads(capsys.readouterr().out)
    assert main(["plan", *recipe, "--mfu-from", str(run)]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["assumptions"]["mfu"] == 0.25 and "median of 3 logged windows" in measured["assumptions"]["mfu_source"]
    own_assumed, own_measured = assumed["layouts"][0], measured["layouts"][0]
    compute_share = own_measured["step_seconds"] / own_assumed["step_seconds"]
    assert 1.0 < compute_share <= 0.4 / 0.25 + 1e-9  # compute slows by 40/25; communication does not change

    matrix = tmp_path / "matrix.md"
    matrix.write_text("| shape | precision | what | tokens/s | step ms | TFLOP/s | MFU | datasheet MFU | data wait ms | "
                      "vs first |\n| 160m | bf16 | neox_hf train(recipe) | 300000 | 50.0 | 300.000 | 45.0% | 33.5% | "
                      "0.10 | 1.31× |\n")
    assert main(["plan", str(REPO / "recipes/tiny.yaml"), "--gpus", "2", "--mfu-from", str(matrix)]) == 0
    assert "MFU 34% (measured on the device" in capsys.readouterr().out
    assert main(["plan", str(REPO / "recipes/tiny.yaml"), "--mfu-from", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "--mfu-from" in err


# ----------------------------------------------------------------------------------------------------------------
# Context parallelism (issue 43) and the Llama family
# ----------------------------------------------------------------------------------------------------------------

TINY_LLAMA = ["recipes/tiny-llama.yaml", "--model.vocab_size", "1024", "--train.precision", "bf16"]


def _saved_bytes_of_a_llama_layer(config, tokens: int) -> int:
    """What autograd keeps for one transformers LlamaDecoderLayer (bf16 weights, as DeepSpeed's bf16 holds them) on
    one row of `tokens` positions, by saved-tensor hooks (storages counted once, weights and rotary tables left out)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    return _saved_bytes_of_a_decoder_layer(LlamaDecoderLayer, LlamaRotaryEmbedding, config, tokens)


def _saved_bytes_of_a_decoder_layer(layer_class, rotary_class, config, tokens: int) -> int:
    import torch

    torch.manual_seed(0)
    layer = layer_class(config, 0).to(torch.bfloat16)
    x = torch.randn(1, tokens, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(tokens)[None]
    cos, sin = (t.detach() for t in rotary_class(config)(x, positions))
    saved = {}

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        layer(x, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
    left_out = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), cos, sin)}
    return sum(n for ptr, n in saved.items() if ptr not in left_out)


def test_llama_layer_activations_match_saved_tensors_and_fall_by_the_context_parallel_size():
    """The plan's Llama layer (grouped-query attention: 4 query, 2 key/value heads) against what autograd saves, at
    context parallel 1 and 2: a context-parallel rank keeps its seq/2 positions of the norms and the MLP, and after
    Ulysses' all-to-all the whole sequence of q, k, v and the attention output for half the heads — as many elements
    as one process's layer on seq/2 positions, which is what is measured for it."""
    from neox_hf.plan import Layout, layer_activation_bytes, model_shape

    shape = model_shape(_recipe(*(str(REPO / a) if a.endswith(".yaml") else a for a in TINY_LLAMA)))
    assert (shape.heads, shape.kv_heads, shape.seq_length) == (4, 2, 128)
    config = shape.config
    config._attn_implementation = "sdpa"
    for context in (1, 2):
        layout = Layout(1, 1, 1, 2, 1, 1, False, False, context=context)
        planned = layer_activation_bytes(shape, layout, element=2)
        assert planned == pytest.approx(_saved_bytes_of_a_llama_layer(config, 128 // context), rel=0.01), context
    one = layer_activation_bytes(shape, Layout(1, 1, 1, 2, 1, 1, False, False), 2)
    assert layer_activation_bytes(shape, Layout(1, 1, 1, 2, 1, 1, False, False, context=2), 2) == one // 2


def test_context_parallel_rows_by_arithmetic():
    """Context parallelism in the plan, by hand: activations and the loss's tokens fall by c; ZeRO shards over data ×
    context (DeepSpeed's sequence-data-parallel group), so context 2 × data 1 holds what data 2 holds; the step adds
    four all-to-alls per layer (forward, backward, and the recompute under checkpointing); candidates keep whole
    query and key/value heads per rank and no pipeline stages, FSDP2 or TP sequence parallelism."""
    from neox_hf.plan import (Assumptions, Layout, all_to_all_bytes, candidate_layouts, context_parallel_seconds,
                              engine_for, model_shape, stage_bytes)

    recipe = _recipe(*(str(REPO / a) if a.endswith(".yaml") else a for a in TINY_LLAMA))
    shape = model_shape(recipe)
    method = recipe.parallel.pipe_partition_method

    def stage(layout):
        return stage_bytes(shape, layout, engine_for(recipe, layout, "bf16"), True, method)[0]

    for zero in (0, 1, 2, 3):
        cp2 = stage(Layout(1, 1, 1, zero, 4, 1, False, False, context=2))
        dp2 = stage(Layout(1, 1, 2, zero, 4, 1, False, False))
        assert (cp2.params, cp2.grads, cp2.optimizer) == (dp2.params, dp2.grads, dp2.optimizer), zero
    whole = stage(Layout(1, 1, 1, 2, 4, 1, False, False))
    split = stage(Layout(1, 1, 1, 2, 4, 1, False, False, context=2))
    assert split.activations == pytest.approx(whole.activations / 2, abs=8)
    assert split.loss < whole.loss

    h, hd, layers = shape.hidden, shape.cache["head_dim"], shape.layers
    layout = Layout(1, 1, 1, 2, 4, 3, True, False, context=2)
    tokens = 4 * 128 // 2
    assert all_to_all_bytes(shape, layout, 2) == 2 * (2 * 4 + 2 * 2) * hd * tokens * 2  # send + receive of q, k, v, out
    sent = (2 - 1) / 2 * (2 * 4 + 2 * 2) * hd * tokens * 2
    assumptions = Assumptions()
    assert context_parallel_seconds(shape, layout, engine_for(recipe, layout, "bf16"), assumptions) == pytest.approx(
        sent * 3 * layers * 3 / assumptions.tp_bandwidth)  # 3 passes (checkpointing) × layers × 3 micro-batches
    assert h == 128

    layouts = candidate_layouts(recipe, shape, 8, 8)
    contexts = {(l.tensor, l.context) for l in layouts if l.backend == "deepspeed"}
    assert (1, 2) in contexts and (2, 1) in contexts and (1, 4) not in contexts and (2, 2) not in contexts  # 2 KV heads
    assert all(l.pipeline == 1 and not l.sequence_parallel for l in layouts if l.context > 1)
    assert all(l.gpus == 8 for l in layouts)


TINY_LLAMA_RING = [*TINY_LLAMA, "--parallel.backend", "fsdp2", "--parallel.zero_stage", "0",
                   "--parallel.context_parallel", "2"]


def _ring_recipe(*more):
    return _recipe(*(str(REPO / a) if a.endswith(".yaml") else a for a in [*TINY_LLAMA_RING, *more]))


def test_ring_recipe_plans_and_its_activations_fall_by_the_context_parallel_size():
    """A recipe of torch's ring attention (FSDP2 with context parallel 2) is planned as its own layout; at a long
    sequence each ring rank keeps about half of what the same FSDP2 layout keeps without context parallelism (its
    keys and values repeated to the query heads make it a little more than half), and FSDP2 shards over the
    context-parallel ranks too."""
    from dataclasses import replace

    from neox_hf.plan import engine_for, model_shape, plan_for_recipe, stage_bytes

    recipe = _ring_recipe("--model.seq_length", "8192", "--model.max_position_embeddings", "8192")
    plan = plan_for_recipe(recipe, gpus=4, gpu_memory_bytes=80 * 2**30)
    own = plan.recipe_layout.layout
    assert (own.backend, own.context, own.data, own.ring) == ("fsdp2", 2, 2, True)
    assert engine_for(recipe, own, "bf16").shard == 4
    assert plan.recipe_layout.longest_sequence % 1024 == 0 and plan.recipe_layout.longest_sequence > 8192

    shape = model_shape(recipe)
    method = recipe.parallel.pipe_partition_method

    def activations(layout):
        return stage_bytes(shape, layout, engine_for(recipe, layout, "bf16"), True, method)[0].activations

    whole = replace(own, context=1)
    assert activations(own) <= 0.6 * activations(whole)


def test_ring_layouts_need_heads_divisible_by_tensor_only():
    """Heads that do not divide by tensor × context but do by tensor: the ring (FSDP2) layouts of that split are
    candidates, Ulysses' (DeepSpeed) are not; a ring needs the sequence in 2 × context head-tail chunks."""
    from neox_hf.plan import candidate_layouts, model_shape

    shape = model_shape(_ring_recipe())  # 4 query, 2 key/value heads, 128 tokens
    layouts = candidate_layouts(_ring_recipe(), shape, 8, 8)
    tensor_2_context_2 = [l for l in layouts if (l.tensor, l.context) == (2, 2)]
    assert tensor_2_context_2 and all(l.ring and l.backend == "fsdp2" for l in tensor_2_context_2)
    assert {l.dp_replicate for l in tensor_2_context_2} == {1, 2}  # every HSDP replica count, as at context 1
    assert any(l.ring for l in layouts if (l.tensor, l.context) == (1, 8))  # 128 tokens = 16 chunks
    short = model_shape(_ring_recipe("--model.seq_length", "24", "--model.max_position_embeddings", "24"))
    assert not any(l.context == 8 for l in candidate_layouts(_ring_recipe(), short, 8, 8))  # 24 % 16


def test_ring_step_time_has_a_context_parallel_term_growing_with_the_sequence():
    """The ring's key/value all-gathers and gradient rotation cost time, more at longer sequences and more again
    with checkpointing (its recomputed forward all-gathers keys and values once more)."""
    from neox_hf.plan import Assumptions, Layout, context_parallel_seconds, engine_for, model_shape

    recipe, shape = _ring_recipe(), model_shape(_ring_recipe())
    engine = engine_for(recipe, Layout(1, 1, 2, 0, 1, 4, False, False, "fsdp2", 1, 2), "bf16")

    def seconds(seq, checkpointing=False):
        at = Layout(1, 1, 2, 0, 1, 4, checkpointing, False, "fsdp2", 1, 2)
        return context_parallel_seconds(shape.at_length(seq), at, engine, Assumptions())

    assert 0 < seconds(1024) < seconds(4096)
    assert seconds(1024, checkpointing=True) > seconds(1024)


def test_plan_lists_ring_layouts_for_llama2_7b_at_32k(capsys):
    """`neox_hf plan` names ring layouts apart from Ulysses' ("context 8 (ring)", FSDP2), in the ranking and as an
    FSDP2 recipe's own layout."""
    from neox_hf.cli import main

    argv = ["plan", str(REPO / "recipes/llama2-7b-32k.yaml"), "--gpus", "8", "--gpu-memory", "80"]
    assert main([*argv, "--longest-sequence", "--top", "40"]) == 0
    table = capsys.readouterr().out
    assert re.search(r"\| pipe 1 × tensor 1 × context 8 \(ring\) × data 1, FSDP2, .*\|  yes \|", table)
    assert re.search(r"\| pipe 1 × tensor 1 × context 8 × data 1, ZeRO-3, .*\|  yes \|", table)
    assert main([*argv, "--parallel.backend", "fsdp2", "--parallel.zero_stage", "0", "--top", "1"]) == 0
    assert "recipe: pipe 1 × tensor 1 × context 8 (ring) × data 1, FSDP2, micro 1" in capsys.readouterr().out


def test_llama2_7b_at_32k_on_8_gpus_of_80_gb(capsys):
    """The issue's question: Llama-2-7B at 32,768 tokens on 8 GPUs of 80 GB. recipes/llama2-7b-32k.yaml's layout —
    context parallel 8, ZeRO-2, no activation checkpointing — fits, and the plan names the longest sequence it and
    every listed layout would fit; `--longest-sequence` ranks the layouts by it."""
    from neox_hf.cli import main

    argv = ["plan", str(REPO / "recipes/llama2-7b-32k.yaml"), "--gpus", "8", "--gpu-memory", "80"]
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    own, *ranked = plan["layouts"]
    assert {k: own[k] for k in ("pipeline", "tensor", "context", "data", "zero_stage", "micro_batch",
                                "activation_checkpointing")} == {
        "pipeline": 1, "tensor": 1, "context": 8, "data": 1, "zero_stage": 2, "micro_batch": 1,
        "activation_checkpointing": False}
    assert own["fits"] is True and 40 < own["bytes_per_rank"]["total"] / 2**30 < 60
    assert 32768 <= own["longest_sequence"] < 131072  # without checkpointing: ~74k tokens
    assert any(layout["context"] == 8 for layout in ranked) and all(layout["fits"] for layout in ranked)
    assert all(layout["longest_sequence"] >= 32768 for layout in ranked)

    assert main([*argv, "--longest-sequence", "--top", "3"]) == 0
    table = capsys.readouterr().out
    assert "recipe: pipe 1 × tensor 1 × context 8 × data 1, ZeRO-2, micro 1 × accumulation 32" in table
    longest = re.search(r"longest sequence on 8 GPUs of 80.00 GiB: (\d+) tokens \((.*)\)", table)
    assert longest and int(longest.group(1)) > 500_000 and "checkpointing" in longest.group(2)

    for bad in (["--gpus", "8", "--longest-sequence"], ["--gpus", "8", "--parallel.context_parallel", "3"]):
        assert main(["plan", str(REPO / "recipes/llama2-7b-32k.yaml"), *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err


# ---- the expert dimension (MoE) ----

MIXTRAL = "recipes/tiny-mixtral.yaml"


def _fp32_recipe(path, *overrides):
    return _recipe(path, "--train.precision", "fp32", *overrides)


def test_moe_experts_memory_per_rank_is_the_parameter_arithmetic():
    """tiny-mixtral: 2 layers × 8 SwiGLU experts of 3 × 128 × 128 parameters; fp32 weights, grads and two Adam
    moments are 16 bytes per parameter: 12.0 MiB on one process, 6.0 MiB per rank at EP2 (as measured)."""
    from neox_hf.plan import expert_parameters, model_shape, plan_for_recipe

    experts = 2 * 8 * 3 * 128 * 128
    assert expert_parameters(model_shape(_fp32_recipe(MIXTRAL))) == experts
    one = plan_for_recipe(_fp32_recipe(MIXTRAL), 1).recipe_layout.stages[0]
    ep2 = plan_for_recipe(_fp32_recipe(MIXTRAL, "--parallel.expert_parallel", "2"), 2).recipe_layout
    assert ep2.layout.expert == 2 and ep2.layout.data == 2
    assert one.experts == 16 * experts == 12 * 2**20
    assert ep2.stages[0].experts == 16 * experts // 2 == 6 * 2**20
    assert one.model_states - ep2.stages[0].model_states == 6 * 2**20  # the dense part is the same 16 bytes each
    # ZeRO-2 on 4 ranks, EP2: the experts' grads and optimizer states shard over the 2 ranks holding the same experts
    zero2 = plan_for_recipe(_fp32_recipe(MIXTRAL, "--parallel.expert_parallel", "2", "--parallel.zero_stage", "2"), 4)
    assert zero2.recipe_layout.stages[0].experts == (4 + (4 + 12) // 2) * experts // 2
    # FSDP2 gathers a layer with its rank's half of the experts while it runs
    from neox_hf.plan import largest_layer_on_rank

    small_vocab = ("--model.vocab_size", "256")  # so that a transformer layer is the largest
    fsdp = _fp32_recipe(MIXTRAL, "--parallel.expert_parallel", "2", "--parallel.backend", "fsdp2", *small_vocab)
    layer = 2 * 128 * 128 + 2 * 128 * 64 + 8 * 128 + 2 * 128  # q, o; k, v (2 of 4 heads); router; two norms
    layout = plan_for_recipe(fsdp, 2).recipe_layout.layout
    assert largest_layer_on_rank(model_shape(fsdp), layout) == layer + experts // 2 // 2  # a layer's half


def test_moe_step_time_counts_active_parameters_and_the_all_to_all():
    from neox_hf.plan import active_parameters, expert_parameters, model_shape, plan_for_recipe, total_parameters
    from neox_hf.train.mfu import flops_per_token

    recipe = _fp32_recipe(MIXTRAL)
    shape = model_shape(recipe)
    experts = expert_parameters(shape)
    assert active_parameters(shape) == total_parameters(shape) - experts + experts * 2 // 8
    # the model FLOPs are 6 × the active matmul parameters (not the total) + attention's 12·L·H·T
    c = shape.config
    embedding = c.vocab_size * c.hidden_size
    norms = (2 * c.num_hidden_layers + 1) * c.hidden_size
    active_matmul = active_parameters(shape) - embedding - norms
    attention = 12 * c.num_hidden_layers * c.hidden_size * shape.seq_length
    assert flops_per_token(c, shape.seq_length) == 6 * active_matmul + attention
    one = plan_for_recipe(recipe, 1)
    tokens = recipe.train.micro_batch_size * shape.seq_length
    a = one.assumptions
    assert one.recipe_layout.step_seconds == pytest.approx(
        (6 * active_matmul + attention) * tokens / (a.peak_flops * a.mfu), rel=1e-12)
    # EP2 on 2 ranks (DeepSpeed, ZeRO-0): the same compute, the all-to-all (4 × tokens × top_k × hidden × 4 bytes ×
    # (ep − 1)/ep per layer, NVLink inside the node) and the dense gradients' all-reduce over the expert group
    # (2 × ½ × 4 bytes each, data-parallel traffic); the experts' own gradients have no other holder to reduce with
    ep2 = plan_for_recipe(_fp32_recipe(MIXTRAL, "--parallel.expert_parallel", "2"), 2).recipe_layout.step_seconds
    all_to_all = 4 * tokens * 2 * 128 * 4 * 0.5 * c.num_hidden_layers / a.tp_bandwidth
    dense_all_reduce = 2 * 0.5 * 4 * (total_parameters(shape) - experts) / a.dp_bandwidth
    assert ep2 == pytest.approx(one.recipe_layout.step_seconds + all_to_all + dense_all_reduce, rel=1e-12)


def test_moe_candidate_layouts_name_the_expert_dimension_and_leave_out_what_moe_refuses():
    from neox_hf.plan import candidate_layouts, model_shape

    recipe = _fp32_recipe(MIXTRAL)
    shape = model_shape(recipe)
    layouts = candidate_layouts(recipe, shape, 4, 16)
    assert layouts and not any(l.pipeline > 1 or l.context > 1 or l.sequence_parallel for l in layouts)
    assert not any(l.backend == "deepspeed" and l.zero_stage == 3 for l in layouts)
    experts = {(l.expert, l.experts_over, l.tensor, l.backend) for l in layouts}
    assert {(2, "data", 1, "deepspeed"), (4, "data", 1, "fsdp2"), (2, "tensor", 2, "deepspeed"),
            (4, "tensor", 4, "fsdp2")} <= experts
    assert not any(l.expert > 1 and l.experts_over == "data" and l.tensor > 1 and l.backend == "deepspeed"
                   for l in layouts)  # the recipe refuses it
    assert not any(l.expert > 1 and l.dp_replicate > 1 for l in layouts)
    from neox_hf.plan import describe_layout
    from dataclasses import replace

    row = describe_layout(next(l for l in layouts if l.expert == 2 and l.experts_over == "data"))
    assert "data 4, expert 2, ZeRO-" in row
    assert "expert 2 over tensor" in describe_layout(replace(layouts[0], tensor=2, expert=2, experts_over="tensor"))


def test_dense_plan_has_no_expert_dimension():
    """A dense recipe's layouts and bytes are what they were: no expert rows, the model states one engine's."""
    from neox_hf.plan import (candidate_layouts, engine_for, model_shape, model_state_bytes, plan_for_recipe,
                              stage_parameters)

    recipe = _fp32_recipe("recipes/tiny.yaml")
    shape = model_shape(recipe)
    layouts = candidate_layouts(recipe, shape, 4, 16)
    assert all(l.expert == 1 for l in layouts) and any(l.pipeline > 1 for l in layouts)
    plan = plan_for_recipe(recipe, 4)
    for p in [plan.recipe_layout, *plan.ranked]:
        engine = engine_for(recipe, p.layout, plan.precision)
        n = stage_parameters(shape, p.layout.pipeline, p.layout.tensor, recipe.parallel.pipe_partition_method)
        for s in p.stages:
            assert s.experts == 0
            assert (s.params, s.grads, s.optimizer) == tuple(model_state_bytes(n[s.stage], engine).values())


def _saved_bytes_of_a_mixtral_layer(config, tokens: int) -> int:
    """`_saved_bytes_of_a_llama_layer` for transformers' MixtralDecoderLayer with the `grouped_mm` experts kernel."""
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer, MixtralRotaryEmbedding

    config._experts_implementation, config._attn_implementation = "grouped_mm", "sdpa"
    return _saved_bytes_of_a_decoder_layer(MixtralDecoderLayer, MixtralRotaryEmbedding, config, tokens)


@pytest.mark.parametrize("top_k", [1, 2])
def test_mixtral_layer_activations_match_saved_tensors(top_k):
    from neox_hf.plan import Layout, layer_activation_bytes, model_shape

    shape = model_shape(_fp32_recipe(MIXTRAL, "--model.moe_top_k", str(top_k)))
    config = shape.config
    planned = layer_activation_bytes(shape, Layout(1, 1, 1, 2, 1, 1, False, False), element=2)
    assert planned == pytest.approx(_saved_bytes_of_a_mixtral_layer(config, shape.seq_length), rel=0.01)


def test_moe_gpus_that_do_not_hold_the_recipe_s_expert_groups_are_refused(capsys):
    from neox_hf import cli

    assert cli.main(["plan", MIXTRAL, "--parallel.expert_parallel", "2", "--gpus", "3"]) == 2
    assert "give --gpus 6" in capsys.readouterr().err
