"""The rules a recipe's values obey, checked once when the recipe is built: ranges, then the rules between keys.

`validate` is the one entry; the model family's rules are in `neox_hf.recipe.model_rules`, the parallel layouts' in
`neox_hf.recipe.parallel_rules`, the global batch's in `neox_hf.recipe.train_batch`, each optimizer's ranges in
`neox_hf.recipe.checks`. Every refusal is one `RecipeError` line naming the key, the value and the fix.
"""

from __future__ import annotations

import difflib
import re

from neox_hf.errors import RecipeError
from neox_hf.recipe.checks import _require, check_optimizer_hyperparameters
from neox_hf.recipe.keys import OutputConfig, Recipe, TrainConfig
from neox_hf.recipe.model_rules import HIDDEN_ACTIVATIONS, _validate_family
from neox_hf.recipe.parallel_rules import (_validate_context_parallel, _validate_expert_parallel, _validate_fsdp2,
                                           _validate_pipeline, _validate_sequence_parallel)
from neox_hf.recipe.train_batch import _validate_train_batch


# What transformers' save_pretrained accepts as max_shard_size (convert_file_size_to_int).
_SHARD_SIZE = re.compile(r"\d+\s*(GIB|MIB|KIB|GB|MB|KB|gib|mib|kib|gb|mb|kb|GiB|MiB|KiB|Gb|Mb|Kb)")


def validate(recipe: Recipe) -> None:
    m, t, p, d = recipe.model, recipe.train, recipe.parallel, recipe.data
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "make_vocab_size_divisible_by"):
        _require(getattr(m, name) > 0, f"`model.{name}` must be > 0, got {getattr(m, name)}")
    _require(
        m.hidden_size % m.num_attention_heads == 0,
        f"`model.hidden_size` ({m.hidden_size}) must be divisible by `model.num_attention_heads` ({m.num_attention_heads})",
    )
    _require(0.0 < m.rotary_pct <= 1.0, f"`model.rotary_pct` must be in (0, 1], got {m.rotary_pct}")
    for name in ("hidden_dropout", "attention_dropout"):
        _require(0.0 <= getattr(m, name) < 1.0, f"`model.{name}` is a probability in [0, 1), got {getattr(m, name)}")
    for name in ("layer_norm_eps", "init_method_std", "rotary_emb_base"):
        _require(getattr(m, name) > 0, f"`model.{name}` must be > 0, got {getattr(m, name)}")
    _require(m.hidden_act in HIDDEN_ACTIVATIONS,
             f"`model.hidden_act` = {m.hidden_act!r} is not an activation transformers knows; use one of "
             f"{', '.join(HIDDEN_ACTIVATIONS)} (GPT-NeoX's bias_gelu_fusion is gelu_new)")
    _validate_family(recipe)
    if m.vocab_size is not None:
        _require(m.vocab_size > 0, f"`model.vocab_size` must be > 0, got {m.vocab_size}")
    if m.intermediate_size is not None:
        _require(m.intermediate_size > 0, f"`model.intermediate_size` must be > 0, got {m.intermediate_size}")
    if m.max_position_embeddings is not None:
        _require(
            m.max_position_embeddings >= m.seq_length,
            f"`model.max_position_embeddings` ({m.max_position_embeddings}) must be ≥ `model.seq_length` ({m.seq_length})",
        )
    for name in ("train_iters", "micro_batch_size", "gradient_accumulation_steps", "log_interval", "eval_interval"):
        _require(getattr(t, name) > 0, f"`train.{name}` must be > 0, got {getattr(t, name)}")
    _validate_train_batch(t)
    _require(t.max_skipped_steps_in_a_row >= 1,
             f"`train.max_skipped_steps_in_a_row` must be ≥ 1, got {t.max_skipped_steps_in_a_row}")
    _require(t.eval_iters >= 0, f"`train.eval_iters` must be ≥ 0, got {t.eval_iters}")
    _require(t.lr > 0, f"`train.lr` must be > 0, got {t.lr}")
    check_optimizer_hyperparameters(t)  # each optimizer's keys in its library's range (recipe/checks.py)
    if t.precision == "fp8":
        _validate_fp8(recipe)
    _require(not t.nesterov or (t.optimizer == "sgd" and t.momentum > 0),
             "`train.nesterov: true` is SGD's Nesterov momentum: it needs `train.optimizer: sgd` and `train.momentum` > 0")
    _require(t.weight_decay >= 0, f"`train.weight_decay` must be ≥ 0, got {t.weight_decay}")
    _require(0 <= t.min_lr <= t.lr, f"`train.min_lr` must be in [0, train.lr={t.lr}], got {t.min_lr}")
    _require(0.0 <= t.warmup < 1.0, f"`train.warmup` is a fraction of the decay steps in [0, 1), got {t.warmup}")
    _require(t.clip_grad >= 0, f"`train.clip_grad` must be ≥ 0 (0 disables clipping), got {t.clip_grad}")
    _require(t.keep_last_n >= 1, f"`train.keep_last_n` must be ≥ 1, got {t.keep_last_n}")
    if t.save_interval is not None:
        _require(t.save_interval > 0, f"`train.save_interval` must be > 0, got {t.save_interval}")
    if t.push_to_hub is not None:
        _require(bool(t.push_to_hub.repo_id), "`train.push_to_hub.repo_id` is required, e.g. `me/pythia-tiny`")
    _require(p.zero_stage in (0, 1, 2, 3), f"`parallel.zero_stage` must be 0, 1, 2 or 3, got {p.zero_stage}")
    _require(not p.offload_params or p.zero_stage == 3,
             f"`parallel.offload_params: true` needs `parallel.zero_stage: 3` (DeepSpeed offloads parameters only "
             f"under ZeRO-3), got zero_stage {p.zero_stage}")
    _require(p.timeout_minutes > 0, f"`parallel.timeout_minutes` must be > 0, got {p.timeout_minutes}")
    _require(p.tensor_parallel >= 1, f"`parallel.tensor_parallel` must be ≥ 1, got {p.tensor_parallel}")
    _require(p.pipeline_parallel >= 1, f"`parallel.pipeline_parallel` must be ≥ 1, got {p.pipeline_parallel}")
    if p.pipeline_parallel > 1:
        _validate_pipeline(recipe)
    _validate_fsdp2(recipe)
    _require(
        not (p.zero_stage == 3 and p.tensor_parallel > 1),
        "`parallel.zero_stage: 3` with `parallel.tensor_parallel > 1` is refused: ZeRO-3 partitions every parameter "
        "over all ranks and would re-shard the tensor-parallel slices; use zero_stage 1 or 2 with tensor parallelism",
    )
    _require(
        m.num_attention_heads % p.tensor_parallel == 0,
        f"`model.num_attention_heads` ({m.num_attention_heads}) must be divisible by `parallel.tensor_parallel` ({p.tensor_parallel})",
    )
    _require(d.pad_to_multiple_of >= 1, f"`data.pad_to_multiple_of` must be ≥ 1, got {d.pad_to_multiple_of}")
    if p.sequence_parallel:
        _validate_sequence_parallel(recipe)
    _require(p.context_parallel >= 1, f"`parallel.context_parallel` must be ≥ 1, got {p.context_parallel}")
    if p.context_parallel > 1:
        _validate_context_parallel(recipe)
    _validate_expert_parallel(recipe)
    _require(0.0 <= d.max_skipped_fraction <= 1.0,
             f"`data.max_skipped_fraction` must be in [0, 1], got {d.max_skipped_fraction}")
    _require(d.buffer_size >= 1, f"`data.buffer_size` must be ≥ 1, got {d.buffer_size}")
    _require(0.0 <= d.validation_fraction < 1.0, f"`data.validation_fraction` must be in [0, 1), got {d.validation_fraction}")
    if d.max_tokens_per_batch is not None:
        _require(d.max_tokens_per_batch > 0, f"`data.max_tokens_per_batch` must be > 0, got {d.max_tokens_per_batch}")
    _validate_data_order(recipe)
    _require(not (m.attn_implementation == "flash_attention_2" and d.isolate_documents and t.micro_batch_size > 1),
             "`model.attn_implementation: flash_attention_2` with `data.isolate_documents: true` would attend across "
             f"documents at `train.micro_batch_size` {t.micro_batch_size}: transformers' flash-attention finds packed "
             "documents (restarting position_ids) only in a batch of one row; use attn_implementation sdpa (a "
             "document mask) or micro_batch_size 1 with more gradient_accumulation_steps")
    for i, s in enumerate(d.sources + d.validation):
        _require(bool(s.path), f"`data.sources[{i}].path` is empty: give a file glob, a .bin/.idx prefix or a dataset name")
        _require(s.weight > 0, f"data source `{s.path}`: `weight` must be > 0, got {s.weight}")
    _validate_objective(recipe)
    _validate_trackers(recipe.output)
    _validate_eval_tasks(t)
    _require(bool(_SHARD_SIZE.fullmatch(str(recipe.output.max_shard_size))),
             f"`output.max_shard_size` = {recipe.output.max_shard_size!r} is not a size; write a whole number and a "
             "unit, e.g. 5GB, 500MB or 2GiB")
    _require(bool(recipe.output.dir.strip()), "`output.dir` is empty: give the folder the run writes, e.g. outputs/run")
    if recipe.peft.method is not None:
        _require(recipe.peft.r > 0, f"`peft.r` must be > 0, got {recipe.peft.r}")
        _require(recipe.peft.alpha > 0, f"`peft.alpha` must be > 0, got {recipe.peft.alpha}")
        _require(0.0 <= recipe.peft.dropout < 1.0, f"`peft.dropout` is a probability in [0, 1), got {recipe.peft.dropout}")
        _require(
            p.tensor_parallel == 1,
            "`peft.method` with `parallel.tensor_parallel > 1` is refused: LoRA wraps nn.Linear layers, which tensor "
            "parallelism replaces; fine-tune adapters with ZeRO data parallelism (tensor_parallel: 1)",
        )



def _validate_objective(recipe: Recipe) -> None:
    """Preference objectives read pairs, which only the streamed, padded data path batches (a pair never split)."""
    t, d = recipe.train, recipe.data
    if t.objective == "lm":
        return
    _require(t.dpo_beta > 0, f"`train.dpo_beta` must be > 0, got {t.dpo_beta}")
    _require(d.mode == "pad", f"`train.objective: {t.objective}` trains on preference pairs, batched with padding; "
                              f"set `data.mode: pad` (got {d.mode})")
    _require(d.order == "stream", f"`train.objective: {t.objective}` reads preference pairs from jsonl/parquet/Hub "
                                  f"sources; `data.order: {d.order}` is for pretraining token streams (use stream)")
    _require(recipe.parallel.pipeline_parallel == 1,
             f"`train.objective: {t.objective}` with `parallel.pipeline_parallel > 1` is refused: a pair's two "
             "sequences are compared on the last stage, which DeepSpeed's pipeline schedule does not give one "
             "scalar per sequence; use tensor parallelism and ZeRO instead")
    if t.objective == "kto":
        _require(t.kto_beta > 0, f"`train.kto_beta` must be > 0, got {t.kto_beta}")
        for name in ("kto_desirable_weight", "kto_undesirable_weight"):
            _require(getattr(t, name) > 0, f"`train.{name}` must be > 0, got {getattr(t, name)}")
        _require(t.micro_batch_size > 1, "`train.objective: kto` estimates its KL term from the other completions of "
                                         "a micro-batch (TRL's rule): set `train.micro_batch_size` ≥ 2")
        _require(recipe.model.from_pretrained is not None,
                 "`train.objective: kto` needs a reference model: set `model.from_pretrained` (a frozen copy of the "
                 "starting model is the reference)")
    if t.objective == "dpo" and t.dpo_reference != "none" and not (t.dpo_reference_model or recipe.model.from_pretrained):
        raise RecipeError("`train.objective: dpo` needs a reference model: set `model.from_pretrained` (the "
                          "reference defaults to the starting model) or `train.dpo_reference_model`")


def _validate_fp8(recipe: Recipe) -> None:
    """FP8 runs through accelerate's Transformer Engine recipe on one model replica per GPU; what has not been
    verified with it is refused by name (the GPU itself is checked when the Accelerator is built)."""
    t, p = recipe.train, recipe.parallel
    _require(t.fp8.margin >= 0, f"`train.fp8.margin` must be ≥ 0, got {t.fp8.margin}")
    _require(t.fp8.amax_history_len >= 1, f"`train.fp8.amax_history_len` must be ≥ 1, got {t.fp8.amax_history_len}")
    for name, value, what in (("parallel.zero_stage", p.zero_stage, "DeepSpeed ZeRO"),
                              ("parallel.tensor_parallel", p.tensor_parallel - 1, "tensor parallelism"),
                              ("parallel.pipeline_parallel", p.pipeline_parallel - 1, "the pipeline engine")):
        _require(not value, f"`train.precision: fp8` with {what} (`{name}`) is refused: accelerate's Transformer "
                            f"Engine FP8 is wired here for data parallelism without DeepSpeed only; use "
                            "`train.precision: bf16` with it")


def _validate_data_order(recipe: Recipe) -> None:
    """GPT-NeoX's order and the curriculum: what they need from the rest of the recipe."""
    d, m = recipe.data, recipe.model
    if d.order != "stream":
        _require(d.mode == "pack", f"`data.order: {d.order}` reproduces GPT-NeoX's packed samples; set `data.mode: pack`")
        _require(not d.isolate_documents, f"`data.order: {d.order}` gives GPT-NeoX's samples as they are; "
                                          "set `data.isolate_documents: false`")
        for s in d.sources + d.validation:
            _require(s.format in (None, "indexed") and not s.template and not s.prompt_template,
                     f"`data.order: {d.order}` reads GPT-NeoX .bin/.idx prefixes; source `{s.path}` is not one "
                     "(tokenize it with `neox_hf preprocess`, or use `data.order: stream`)")
    if d.split is not None:
        _require(d.order == "gpt-neox", "`data.split` splits documents as GPT-NeoX does; it needs `data.order: gpt-neox` "
                                         "(or remove it: `--data.split null`, and hold out with data.validation_fraction)")
    for s in d.sources + d.validation:
        _require(s.label_path is None or d.order == "gpt-neox" or recipe.train.objective != "lm",
                 f"data source `{s.path}`: `label_path` needs `data.order: gpt-neox`")
    _require(d.weighted_sampler_alpha > 0, f"`data.weighted_sampler_alpha` must be > 0, got {d.weighted_sampler_alpha}")
    c = d.curriculum
    if c is not None:
        _require(0 < c.min_difficulty <= c.max_difficulty <= m.seq_length,
                 f"`data.curriculum` needs 0 < min_difficulty ({c.min_difficulty}) ≤ max_difficulty "
                 f"({c.max_difficulty}) ≤ model.seq_length ({m.seq_length})")
        if c.schedule_type == "fixed_discrete":
            _require(len(c.difficulty) >= 1 and len(c.difficulty) == len(c.max_step) + 1,
                     "`data.curriculum` fixed_discrete needs `difficulty` with one more entry than `max_step`, "
                     "e.g. difficulty: [256, 1024, 2048], max_step: [100, 500]")
            _require(all(0 < x <= m.seq_length for x in c.difficulty),
                     f"`data.curriculum.difficulty` entries must be in [1, model.seq_length={m.seq_length}]")
        else:
            _require(c.total_curriculum_step > 0 and c.difficulty_step > 0 and c.root_degree > 0,
                     "`data.curriculum` total_curriculum_step, difficulty_step and root_degree must be > 0")
        if recipe.parallel.sequence_parallel:
            tp = recipe.parallel.tensor_parallel
            lengths = (c.difficulty if c.schedule_type == "fixed_discrete" else [c.difficulty_step, c.max_difficulty])
            _require(all(x % tp == 0 for x in lengths),
                     f"`data.curriculum` with sequence parallelism: every length must split over tensor_parallel ({tp}); "
                     "make difficulty_step / max_difficulty (fixed_discrete: each difficulty) multiples of it")


# report_to name → (module Accelerate imports, pip package)
TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "comet_ml": ("comet_ml", "comet_ml"),
    "mlflow": ("mlflow", "mlflow"),
    "aim": ("aim", "aim"),
}


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _validate_trackers(output: OutputConfig) -> None:
    """Known tracker names, each installed: refused here rather than after the model is built."""
    for name in output.report_to:
        close = difflib.get_close_matches(str(name), list(TRACKERS), n=1, cutoff=0.5)
        _require(name in TRACKERS, f"`output.report_to` names {name!r}, which is not one of {', '.join(TRACKERS)}"
                                   + (f"; did you mean {close[0]}?" if close else ""))
        module, package = TRACKERS[name]
        _require(_installed(module), f"`output.report_to` names {name} but {module} is not installed: pip install {package}")
    _require(len(set(output.report_to)) == len(output.report_to), f"`output.report_to` repeats a tracker: {output.report_to}")
    _require(bool(output.project.strip()), "`output.project` is empty: give the tracker project name, e.g. neox_hf")
    if output.run_name is not None:
        _require(bool(output.run_name.strip()), "`output.run_name` is empty: give a name or leave it out (default: the output folder's name)")


def _validate_eval_tasks(train: TrainConfig) -> None:
    if not train.eval_tasks:
        return
    for i, task in enumerate(train.eval_tasks):
        _require(bool(task.strip()), f"`train.eval_tasks[{i}]` is empty: give an lm-evaluation-harness task name such as lambada_openai")
    _require(len(set(train.eval_tasks)) == len(train.eval_tasks), f"`train.eval_tasks` repeats a task: {train.eval_tasks}")
    _require(_installed("lm_eval"), "`train.eval_tasks` needs lm-evaluation-harness, which is not installed: "
                                    'pip install -e ".[eval]" (or pip install lm-eval)')
