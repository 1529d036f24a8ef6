"""Pipeline parallelism: pipeline 2, pipeline 2 × tensor 2 and pipeline 2 × data 2 (ZeRO-1) must train as one process.

The multi-process runs are `accelerate launch --use_deepspeed` of tests/workers/pipe_train.py (DeepSpeed's pipeline
engine on gloo); this process computes the one-process reference on the same micro-batches with stock transformers
and plain AdamW: token-weighted loss over the step's 4 micro-batches, clipping 1.0, the recipe's LR schedule.

A launch costs ~20 s (2 processes) to ~40 s (4) of start-up on 2 cores, a run a few seconds: the runs of one process
count share one launch (`pipe_train.py --runs`, one after the other, each into its own folder), held by the
module-scoped fixtures `two_process_runs` and `four_process_runs`; the end-to-end run of the real entry point is the
2-process launch's last run (`--entry`). A pipeline killed mid-step and mid-save, and preempted, resumes exactly in the fault matrix
(tests/test_failure_preemption.py).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import GPTNeoXForCausalLM

from tests.conftest import REPO, accelerate_launch_command, launch_env

WORKERS = REPO / "tests" / "workers"
sys.path.insert(0, str(WORKERS))
from pipe_common import STEPS, eval_batches, rank_micro_batches, recipe_dict, tiny_config  # noqa: E402

LOSS_TOL, WEIGHT_TOL, LOGIT_TOL = 1e-5, 1e-3, 1e-4


def _env():
    return launch_env(PYTHONPATH=os.pathsep.join([str(REPO), str(WORKERS)]))


def launch(out_dir, model_dir, processes: int, *args, check: bool = True):
    command = accelerate_launch_command(WORKERS / "pipe_train.py", model_dir, out_dir, *args, zero_stage=1,
                                        num_processes=processes)
    done = subprocess.run(command, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    if check:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-5000:]
    return done


class MergedLaunch:
    """One launch of several pipe_train runs (`--runs`): `run(name)` is a run's folder, or a failure naming the run
    and showing the launch's output."""

    def __init__(self, out_dir, names: list[str], done: subprocess.CompletedProcess):
        self.out_dir, self.names, self.done = out_dir, names, done

    def run(self, name: str):
        finished = f"pipe_train run {name}: done" in self.done.stdout and (self.out_dir / name / "eval.json").exists()
        if name == self.names[-1]:
            finished = finished and self.done.returncode == 0
        assert finished, (f"run {name!r} of the launch of runs {self.names} did not finish (exit "
                          f"{self.done.returncode}):\n" + self.done.stdout[-2000:] + self.done.stderr[-5000:])
        return self.out_dir / name


def launch_runs(out_dir, model_dir, processes: int, runs: dict[str, list]) -> MergedLaunch:
    """The runs (name → pipe_train options) trained one after the other in one launch, each into out_dir/name."""
    specs = [f"{name}={shlex.join(map(str, options))}" for name, options in runs.items()]
    return MergedLaunch(out_dir, list(runs), launch(out_dir, model_dir, processes, "--runs", *specs, check=False))


def step_log(out_dir) -> dict[int, dict]:
    lines = (out_dir / "train_log.jsonl").read_text().splitlines()
    return {entry["step"]: entry for entry in map(json.loads, lines)}  # a resumed step overwrites its killed copy


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipe_models")
    for name, overrides in {"untied": {}, "tied": {"tie_word_embeddings": True}}.items():
        torch.manual_seed(0)
        GPTNeoXForCausalLM(tiny_config(**overrides)).save_pretrained(root / name)
    return root


def _forward_sums(model, batch) -> tuple[torch.Tensor, int]:
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    logits = model(**inputs, use_cache=False).logits  # with a cache, transformers ignores document position ids
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum")
    return loss, int((batch["labels"] != -100).sum())


def one_process(model_dir, mode: str, tmp_path, dp_for_eval: int = 1):
    """(per-step losses, tokens, eval losses before/after, trained model) of the one-process reference."""
    from neox_hf.recipe import recipe_from_dict
    from neox_hf.engines.optimizer import build_optimizer
    from neox_hf.train.schedule import build_lr_scheduler

    recipe = recipe_from_dict(recipe_dict(tmp_path / "reference"))
    model = GPTNeoXForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = build_optimizer(model, recipe.train)
    scheduler = build_lr_scheduler(optimizer, recipe.train)
    evals = {"before": _eval(model, mode, dp_for_eval)}
    losses, tokens, norms, samples = {}, {}, {}, {}
    for step in range(1, STEPS + 1):
        micro_batches = rank_micro_batches(step, mode, 0, 1)
        total_tokens = sum(int((mb["labels"] != -100).sum()) for mb in micro_batches)
        step_sum = 0.0
        for mb in micro_batches:
            loss_sum, _ = _forward_sums(model, mb)
            (loss_sum / total_tokens).backward()
            step_sum += loss_sum.item()
        norms[step] = torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.train.clip_grad).item()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses[step], tokens[step] = step_sum / total_tokens, total_tokens
        samples[step] = sum(mb["input_ids"].shape[0] for mb in micro_batches)
    evals["after"] = _eval(model, mode, dp_for_eval)
    return losses, tokens, norms, evals, model, samples


@torch.no_grad()
def _eval(model, mode: str, dp: int) -> float:
    total, count = 0.0, 0
    for rank in range(dp):
        for batch in eval_batches(mode, rank, dp):
            loss_sum, n = _forward_sums(model, batch)
            total, count = total + loss_sum.item(), count + n
    return total / count


def assert_same_training(out_dir, reference, mode: str):
    losses, tokens, norms, evals, model, samples = reference
    log = step_log(out_dir)
    assert sorted(log) == list(range(1, STEPS + 1))
    assert norms[1] > 1.0  # clipping is active: the norm DeepSpeed clips by must be the whole model's
    for step in log:
        assert abs(log[step]["loss"] - losses[step]) <= LOSS_TOL, (step, log[step]["loss"], losses[step])
        assert abs(log[step]["grad_norm"] - norms[step]) <= 1e-4, (step, log[step]["grad_norm"], norms[step])
        step_tokens = log[step]["consumed_tokens"] - (log[step - 1]["consumed_tokens"] if step > 1 else 0)
        step_samples = log[step]["consumed_samples"] - (log[step - 1]["consumed_samples"] if step > 1 else 0)
        assert step_tokens == tokens[step] and step_samples == samples[step] and not log[step].get("skipped", False)
    got_evals = json.loads((out_dir / "eval.json").read_text())
    for when in ("before", "after"):
        assert abs(got_evals[when] - evals[when]) <= LOSS_TOL, (when, got_evals, evals)
    # The merged folder is a stock GPTNeoX folder, and it is the one-process model.
    folder = out_dir / "final"
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["GPTNeoXForCausalLM"]
    merged = GPTNeoXForCausalLM.from_pretrained(folder, dtype=torch.float32)
    expected = model.state_dict()
    got = merged.state_dict()
    assert sorted(got) == sorted(expected)
    worst = max(expected, key=lambda k: (got[k] - expected[k]).abs().max().item())
    assert (got[worst] - expected[worst]).abs().max().item() <= WEIGHT_TOL, worst
    batch = rank_micro_batches(1, mode, 0, 1)[0]
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    with torch.no_grad():
        assert (merged(**inputs, use_cache=False).logits - model(**inputs, use_cache=False).logits).abs().max().item() <= LOGIT_TOL


# `accelerate launch run_clm_neox.py` with `parallel.pipeline_parallel: 2` (the real loop, end to end): the last run of
# the 2-process launch (`pipe_train.py --runs loop="--entry ..."`), in the processes the launcher started
ENTRY_POINT_RUN = [REPO / "recipes" / "tiny.yaml", "--parallel.pipeline_parallel", "2", "--parallel.zero_stage", "1",
                   "--model.seq_length", "32", "--train.train_iters", "2", "--train.gradient_accumulation_steps", "2",
                   "--train.micro_batch_size", "2", "--train.eval_iters", "1", "--train.save_interval", "2",
                   "--output.tensorboard", "false"]


@pytest.fixture(scope="module")
def two_process_runs(models, tmp_path_factory) -> MergedLaunch:
    """The 2-process runs, in one launch: pipeline 2 in fp32 (`pp2`) and in bf16 (`bf16`, as launched with
    `--mixed_precision bf16`), then the entry point's pipeline-2 run (`loop`)."""
    out_dir = tmp_path_factory.mktemp("pipe_2proc")
    return launch_runs(out_dir, models / "untied", 2, {
        "pp2": ["--pp", "2"],
        "bf16": ["--pp", "2", "--precision", "bf16", "--launcher-precision", "bf16"],
        "loop": ["--entry", *ENTRY_POINT_RUN, "--output.dir", out_dir / "loop"],
    })


@pytest.fixture(scope="module")
def four_process_runs(models, tmp_path_factory) -> MergedLaunch:
    """The 4-process runs, in one launch: pipeline 2 × tensor 2 in pad mode with activation checkpointing
    (`pp2_tp2_pad`) and pipeline 2 × data 2 (ZeRO-1) on the tied model with isolated documents (`pp2_dp2_isolate`)."""
    return launch_runs(tmp_path_factory.mktemp("pipe_4proc"), models / "untied", 4, {
        "pp2_tp2_pad": ["--pp", "2", "--tp", "2", "--mode", "pad", "--activation-checkpointing"],
        "pp2_dp2_isolate": ["--model-dir", models / "tied", "--pp", "2", "--mode", "isolate"],
    })


@pytest.fixture(scope="module")
def pp2_run(two_process_runs):
    return two_process_runs.run("pp2")


def test_pipeline2_trains_as_one_process_and_saves_a_stock_folder(models, pp2_run, tmp_path):
    assert_same_training(pp2_run, one_process(models / "untied", "pack", tmp_path), "pack")
    report = (pp2_run / "report.txt").read_text()
    assert "pipeline stage 0: embedding + layers 0–1" in report
    assert "pipeline stage 1: layers 2–3 + final norm + head" in report
    assert "bubble (p−1)/(m+p−1) = 0.200" in report  # (2 − 1) / (4 + 2 − 1)


def test_pipeline2_x_tensor2_pad_mode_with_activation_checkpointing(models, four_process_runs, tmp_path):
    """Padded micro-batches of varying length and row count (dynamic shapes between stages)."""
    out = four_process_runs.run("pp2_tp2_pad")
    assert_same_training(out, one_process(models / "untied", "pad", tmp_path), "pad")
    assert_export_equals_final(out, tmp_path / "exported")  # stages × TP shards of DeepSpeed's layer files merged


def test_pipeline2_x_data2_zero1_tied_embeddings_isolated_documents(models, four_process_runs, tmp_path):
    out = four_process_runs.run("pp2_dp2_isolate")
    assert_same_training(out, one_process(models / "tied", "isolate", tmp_path, dp_for_eval=2), "isolate")


def test_export_of_a_pipeline_checkpoint_equals_the_final_folder(pp2_run, tmp_path):
    assert_export_equals_final(pp2_run, tmp_path / "exported")


def assert_export_equals_final(run_dir, exported_dir):
    from safetensors.torch import load_file

    from neox_hf.cli import main

    assert main(["export", str(run_dir / "checkpoints"), str(exported_dir)]) == 0
    exported = load_file(exported_dir / "model.safetensors")
    final = load_file(run_dir / "final" / "model.safetensors")
    assert sorted(exported) == sorted(final)
    assert all(torch.equal(exported[k], final[k]) for k in final)


# ---------------------------------------------------------------------------------------------------------------
# One process: partition, report, stage materialisation
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method,parts", [("type:transformer", [0, 3, 7]), ("uniform", [0, 4, 7]),
                                          ("parameters", [0, 3, 7])])
def test_partition_methods_split_the_pipeline_layers(method, parts):
    from neox_hf.engines.pipeline import partition_stages

    assert partition_stages(tiny_config(), 2, method) == parts  # embedding, 4 layers, final norm, head


def test_gpt_neox_20b_partition_puts_11_transformer_layers_on_each_of_4_stages():
    from neox_hf.engines.pipeline import partition_stages, pipeline_layer_infos

    config = tiny_config(num_hidden_layers=44)
    parts = partition_stages(config, 4)
    infos = pipeline_layer_infos(config)
    per_stage = [sum(i.name == "TransformerLayerPipe" for i in infos[a:b]) for a, b in zip(parts, parts[1:])]
    assert per_stage == [11, 11, 11, 11]


def test_bad_partitions_are_refused_by_name():
    from neox_hf.errors import RecipeError
    from neox_hf.engines.pipeline import partition_stages

    with pytest.raises(RecipeError, match="type:attention.*matches none"):
        partition_stages(tiny_config(), 2, "type:attention")
    with pytest.raises(RecipeError, match="empty"):
        partition_stages(tiny_config(num_hidden_layers=2), 6, "uniform")  # 5 pipeline layers, 6 stages


def test_startup_report_names_layers_parameters_and_bubble():
    from neox_hf.engines.pipeline import bubble_fraction, partition_stages, pipeline_report

    config = tiny_config(tie_word_embeddings=True)
    lines = pipeline_report(config, partition_stages(config, 2), micro_batches=4, tp=2)
    assert lines[0].startswith("pipeline stage 0: embedding + layers 0–1; ")
    assert lines[1].startswith("pipeline stage 1: layers 2–3 + final norm + head (tied to the embedding); ")
    assert "per tensor-parallel rank" in lines[0] and lines[2].endswith("= 0.200")
    assert bubble_fraction(4, 32) == pytest.approx(3 / 35)  # GPT-NeoX-20B: 4 stages, 32 micro-batches


def test_stage_builder_reads_only_its_tensors_and_initialises_like_gpt_neox(models):
    from neox_hf.model import NeoXConfig
    from neox_hf.model.init import init_std
    from neox_hf.parallel.layout import Layout
    from neox_hf.engines.pipeline import StageBuilder

    config = NeoXConfig.from_pretrained(models / "untied")
    stock = GPTNeoXForCausalLM.from_pretrained(models / "untied")
    loaded = StageBuilder(config, Layout(), folder=str(models / "untied")).build("gpt_neox.layers.2")
    for key, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, stock.state_dict()[f"gpt_neox.layers.2.{key}"]), key
    torch.manual_seed(0)
    fresh = StageBuilder(config, Layout()).build("gpt_neox.layers.3")
    assert not any(p.is_meta for p in fresh.parameters())
    qkv, out = fresh.attention.query_key_value.weight, fresh.mlp.dense_4h_to_h.weight
    small = init_std("small_init", hidden_size=32, num_layers=4)
    wang = init_std("wang_init", hidden_size=32, num_layers=4)
    assert abs(qkv.std().item() - small) < 0.15 * small and abs(out.std().item() - wang) < 0.15 * wang
    assert torch.equal(fresh.input_layernorm.weight, torch.ones(32))


def test_training_loop_runs_pipeline_stages_end_to_end(two_process_runs):
    """`accelerate launch run_clm_neox.py` with `parallel.pipeline_parallel: 2` (its arguments run through the entry
    point's function in the processes of the 2-process launch): the stage report at start-up, the token-weighted
    steps, eval, a checkpoint and the merged stock folder, through the real loop."""
    out, done = two_process_runs.out_dir / "loop", two_process_runs.done
    status = two_process_runs.out_dir / "loop.status"
    assert done.returncode == 0 and status.is_file() and status.read_text() == "0", \
        done.stdout[-2000:] + done.stderr[-5000:]
    stdout = (two_process_runs.out_dir / "loop.stdout").read_text()
    assert "pipeline stage 0: embedding + layer 0; " in stdout
    assert "pipeline stage 1: layer 1 + final norm + head; " in stdout
    assert "2 pipeline stages = 2 process(es)" in stdout
    entries = list(map(json.loads, (out / "train_log.jsonl").read_text().splitlines()))
    assert [e["step"] for e in entries if "lr" in e] == [1, 2]  # the optimizer steps (eval records sit beside them)
    assert [e["step"] for e in entries if "eval" in e] == [0, 2]  # pipeline eval before and after training
    assert (out / "checkpoints" / "latest").read_text() == "step_00000002"
    model = GPTNeoXForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == 50304


def test_pipeline2_bf16_trains_close_to_fp32(models, two_process_runs, tmp_path):
    out = two_process_runs.run("bf16")
    losses = one_process(models / "untied", "pack", tmp_path)[0]
    log = step_log(out)
    assert all(abs(log[s]["loss"] - losses[s]) <= 2e-2 for s in losses), (log, losses)
    assert GPTNeoXForCausalLM.from_pretrained(out / "final").config.num_hidden_layers == 4
