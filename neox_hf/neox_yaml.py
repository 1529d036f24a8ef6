"""GPT-NeoX config files → our recipe dict.

GPT-NeoX configs are YAML with Python literals (`True`), comments, trailing commas and keys written with `-` or
`_`; its launcher merges several files and refuses a key given twice. We translate every key we understand, refuse
the options our GPTNeoX architecture cannot express (naming the key and what we support), and report every key we
ignore (logging, kernel fusions, launcher settings) so nothing is dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from neox_hf.errors import RecipeError


@dataclass
class NeoXTranslation:
    recipe: dict  # nested dict for `recipe_from_dict`
    notices: list[str] = field(default_factory=list)  # what was approximated or ignored, printed at start-up


def looks_like_neox_config(raw: dict) -> bool:
    """Our recipes have sections (model:, train:, …); GPT-NeoX configs are flat with keys like num-layers."""
    keys = {str(k).replace("-", "_") for k in raw}
    return bool(keys & {"num_layers", "hidden_size", "num_attention_heads", "seq_length", "train_iters", "optimizer"}) and not (
        keys & {"model", "train", "data", "parallel"}
    )


def read_neox_files(paths: list[str | Path]) -> dict:
    """Merge GPT-NeoX config files as its launcher does: `-` → `_`, a key in two files is an error."""
    merged: dict = {}
    origin: dict = {}
    for path in paths:
        raw = _read_one(Path(path))
        for key, value in raw.items():
            name = str(key).replace("-", "_")
            if name in merged:
                raise RecipeError(f"{path}: key `{key}` is already set by {origin[name]}; GPT-NeoX refuses duplicate keys across config files")
            merged[name] = value
            origin[name] = str(path)
    return merged


def _read_one(path: Path) -> dict:
    if not path.is_file():
        raise RecipeError(f"GPT-NeoX config not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: cannot parse as a GPT-NeoX config (YAML): {err}") from err
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a GPT-NeoX config must be a mapping of keys")
    return raw


# ----------------------------------------------------------------------------------------------------------------
# Refusals: options that change the architecture in ways GPTNeoX cannot express
# ----------------------------------------------------------------------------------------------------------------

_SUPPORTED_VALUES = {
    "norm": ({"layernorm"}, "GPTNeoX uses LayerNorm"),
    "pos_emb": ({"rotary"}, "GPTNeoX uses rotary position embeddings"),
    "activation": ({"gelu"}, "GPTNeoX's MLP is dense → GELU → dense"),
    "tokenizer_type": ({"HFTokenizer"}, "give a tokenizers JSON file as `vocab_file` (HFTokenizer)"),
    "output_layer_parallelism": ({"column", "row"}, "column or row"),
    "lr_decay_style": ({"cosine", "linear", "constant"}, "cosine, linear or constant"),
}

_MUST_BE_FALSY = {
    "use_bnb_optimizer": "8-bit optimizers are not wired",
    "gmlp_attn_dim": "gMLP blocks are not GPTNeoX",
    "use_qk_layernorm": "QK layer norm is not part of GPTNeoX",
    "mlp_multiple_of": None,  # only a rounding hint for swiglu; harmless when falsy
    "num_kv_heads": "grouped-query attention is not part of GPTNeoX",
    "moe_num_experts": "mixture of experts is not part of GPTNeoX",
    "sliding_window_width": "sliding-window attention is not part of GPTNeoX",
    "rotary_interleaved": "GPTNeoX rotates halves, not interleaved pairs",
    "use_mup": "muP parametrisation is not supported",
}

_GLOBAL_ATTENTION = {"global", "flash", "ring"}


def _refuse(key: str, value: Any, supported: str) -> RecipeError:
    return RecipeError(f"GPT-NeoX option `{key}: {value!r}` is not supported by neox_hf ({supported}); remove it or change it")


def _check_refusals(args: dict) -> None:
    for key, (allowed, supported) in _SUPPORTED_VALUES.items():
        if key in args and args[key] is not None and args[key] not in allowed:
            raise _refuse(key, args[key], f"supported: {', '.join(sorted(allowed))}; {supported}")
    for key, reason in _MUST_BE_FALSY.items():
        if args.get(key) not in (None, False, 0, 1 if key == "moe_num_experts" else 0) and reason:
            raise _refuse(key, args[key], reason)
    for block in args.get("attention_config") or []:
        kinds = block[0] if isinstance(block, (list, tuple)) else [block]
        for kind in kinds:
            if kind not in _GLOBAL_ATTENTION:
                raise _refuse("attention_config", kind, "only dense causal attention (global/flash) exists in GPTNeoX; sparse/local/linear attention types do not")


# ----------------------------------------------------------------------------------------------------------------
# Translation
# ----------------------------------------------------------------------------------------------------------------

# NeoX key → (recipe path, converter)
_DIRECT: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "num_layers": ("model.num_layers", int),
    "hidden_size": ("model.hidden_size", int),
    "num_attention_heads": ("model.num_attention_heads", int),
    "intermediate_size": ("model.intermediate_size", int),
    "seq_length": ("model.seq_length", int),
    "max_position_embeddings": ("model.max_position_embeddings", int),
    "rotary_pct": ("model.rotary_pct", float),
    "rotary_emb_base": ("model.rotary_emb_base", float),
    "gpt_j_residual": ("model.use_parallel_residual", bool),
    "no_weight_tying": ("model.tie_word_embeddings", lambda v: not v),
    "make_vocab_size_divisible_by": ("model.make_vocab_size_divisible_by", int),
    "layernorm_epsilon": ("model.layer_norm_eps", float),
    "hidden_dropout": ("model.hidden_dropout", float),
    "attention_dropout": ("model.attention_dropout", float),
    "init_method": ("model.init_method", str),
    "output_layer_init_method": ("model.output_layer_init_method", str),
    "init_method_std": ("model.init_method_std", float),
    "vocab_file": ("tokenizer.path", str),
    "model_parallel_size": ("parallel.tensor_parallel", lambda v: max(int(v), 1)),
    "checkpoint_activations": ("parallel.activation_checkpointing", bool),
    "train_iters": ("train.train_iters", int),
    "lr_decay_iters": ("train.lr_decay_iters", int),
    "lr_decay_style": ("train.lr_decay_style", str),
    "warmup": ("train.warmup", float),
    "min_lr": ("train.min_lr", float),
    "weight_decay": ("train.weight_decay", float),
    "gradient_clipping": ("train.clip_grad", float),
    "train_micro_batch_size_per_gpu": ("train.micro_batch_size", int),
    "gradient_accumulation_steps": ("train.gradient_accumulation_steps", int),
    "seed": ("train.seed", int),
    "log_interval": ("train.log_interval", int),
    "eval_interval": ("train.eval_interval", int),
    "eval_iters": ("train.eval_iters", int),
    "checkpoint_factor": ("train.save_interval", int),
    "save_interval": ("train.save_interval", int),
    "save": ("output.dir", str),
    "dynamic_padding": ("data.mode", lambda v: "pad" if v else "pack"),
}

# Keys that change nothing in what we compute: kernels, logging, launcher, GPT-NeoX-internal bookkeeping.
_NO_EFFECT = {
    "scaled_upper_triang_masked_softmax_fusion", "scaled_masked_softmax_fusion", "rope_fusion", "layernorm_fusion",
    "bias_dropout_fusion", "fp32_allreduce", "partition_activations", "synchronize_each_layer", "checkpoint_num_layers",
    "contiguous_checkpointing", "checkpoint_in_cpu", "distributed_backend", "wall_clock_breakdown", "steps_per_print",
    "log_dir", "num_workers", "data_impl", "extra_save_iters", "keep_last_n_checkpoints", "launcher",
    "hostfile", "include", "exclude", "master_port", "wandb_team", "wandb_host", "wandb_init_all_ranks",
    "comet_workspace", "comet_tags", "comet_others", "memory_profiling", "profile", "log_grad_norm", "log_param_norm", "log_optimizer_states",
    "log_gradient_noise_scale", "sparsity_config", "gpt_j_tied", "use_bias_in_norms", "use_bias_in_attn_linear",
    "mlp_multiple_of", "checkpoint_validation_with_forward_pass", "amp", "zero_allow_untested_optimizer",
    "zero_allgather_partitions", "gas", "prescale_gradients", "gradient_predivide_factor", "merge_file",
}


def translate_neox_args(args: dict) -> NeoXTranslation:
    """Recipe dict + notices from merged GPT-NeoX args (keys already `_`-normalised)."""
    _check_refusals(args)
    recipe: dict = {}
    notices: list[str] = []
    # Checked by _check_refusals: a supported value needs no translation.
    handled = set(_DIRECT) | _NO_EFFECT | set(_SUPPORTED_VALUES) | {"attention_config"}
    for key, (path, convert) in _DIRECT.items():
        if key in args and args[key] is not None:
            _put(recipe, path, _convert(key, args[key], convert))
    if args.get("bias_gelu_fusion"):
        # GPT-NeoX's fused bias-GELU kernel computes the tanh approximation, not the exact erf GELU.
        _put(recipe, "model.hidden_act", "gelu_new")
        notices.append("bias_gelu_fusion: true → model.hidden_act: gelu_new (the tanh GELU GPT-NeoX's fused kernel computes)")
    handled |= {"bias_gelu_fusion", "expansion_factor"}
    if args.get("intermediate_size") is None and args.get("expansion_factor") and "hidden_size" in args:
        _put(recipe, "model.intermediate_size", int(float(args["expansion_factor"]) * int(args["hidden_size"])))
    handled |= _translate_optimizer(args, recipe, notices)
    handled |= _translate_zero(args, recipe)
    handled |= _translate_precision(args, recipe)
    handled |= _translate_pipeline(args, recipe)
    handled |= _translate_sequence_parallel(args, recipe, notices)
    handled |= _translate_data(args, recipe, notices)
    handled |= _translate_logging(args, recipe, notices)
    handled |= set(_MUST_BE_FALSY)
    ignored = sorted(k for k in args if k not in handled)
    no_effect = sorted(k for k in args if k in _NO_EFFECT)
    if no_effect:
        notices.append("no effect here (kernels, logging, launcher): " + ", ".join(no_effect))
    if ignored:
        notices.append("not translated (unknown to neox_hf; check they are not needed): " + ", ".join(ignored))
    return NeoXTranslation(recipe=recipe, notices=notices)


def _convert(key: str, value: Any, convert: Callable[[Any], Any]) -> Any:
    try:
        return convert(value)
    except (TypeError, ValueError) as err:
        raise RecipeError(f"GPT-NeoX option `{key}: {value!r}` has the wrong type: {err}") from err


def _put(tree: dict, dotted: str, value: Any) -> None:
    *sections, leaf = dotted.split(".")
    for section in sections:
        tree = tree.setdefault(section, {})
    tree[leaf] = value


def _translate_optimizer(args: dict, recipe: dict, notices: list[str]) -> set[str]:
    optimizer = args.get("optimizer")
    if not optimizer:
        return {"optimizer"}
    kind = str(optimizer.get("type", "Adam"))
    if kind.lower() not in ("adam", "adamw", "cpu_adam", "cpu_torch_adam", "fused_adam"):
        raise _refuse("optimizer.type", kind, "neox_hf trains with AdamW (Adam with decoupled weight decay, as GPT-NeoX's Adam)")
    if kind.lower().startswith("cpu"):
        _put(recipe, "parallel.offload_optimizer", True)
        notices.append(f"optimizer.type {kind} → parallel.offload_optimizer: true")
    params = optimizer.get("params", {}) or {}
    if "lr" in params:
        _put(recipe, "train.lr", float(params["lr"]))
    if "betas" in params:
        _put(recipe, "train.adam_beta1", float(params["betas"][0]))
        _put(recipe, "train.adam_beta2", float(params["betas"][1]))
    if "eps" in params:
        _put(recipe, "train.adam_eps", float(params["eps"]))
    if "weight_decay" in params and "weight_decay" not in args:
        _put(recipe, "train.weight_decay", float(params["weight_decay"]))
    return {"optimizer"}


def _translate_zero(args: dict, recipe: dict) -> set[str]:
    zero = args.get("zero_optimization") or {}
    if "stage" in zero:
        _put(recipe, "parallel.zero_stage", int(zero["stage"]))
    if zero.get("cpu_offload") or (zero.get("offload_optimizer") or {}).get("device") == "cpu":
        _put(recipe, "parallel.offload_optimizer", True)
    return {"zero_optimization"}


def _translate_precision(args: dict, recipe: dict) -> set[str]:
    fp16 = args.get("fp16") or {}
    bf16 = args.get("bf16") or {}
    precision = args.get("precision")
    if precision in ("fp16", "bfloat16", "bf16", "fp32"):
        _put(recipe, "train.precision", {"bfloat16": "bf16"}.get(precision, precision))
    elif bf16.get("enabled"):
        _put(recipe, "train.precision", "bf16")
    elif fp16.get("enabled", fp16.get("fp16", False)):
        _put(recipe, "train.precision", "fp16")
    else:  # GPT-NeoX trains fp32 when its config enables neither; our default (`auto`) would pick bf16 on some devices
        _put(recipe, "train.precision", "fp32")
    return {"fp16", "bf16", "precision"}


def _translate_pipeline(args: dict, recipe: dict) -> set[str]:
    # GPT-NeoX: 0 = sequential model, 1 = pipeline engine with one stage; both are one stage here.
    stages = int(args.get("pipe_parallel_size") or 0)
    if stages > 1:
        _put(recipe, "parallel.pipeline_parallel", stages)
    if args.get("pipe_partition_method"):
        _put(recipe, "parallel.pipe_partition_method", str(args["pipe_partition_method"]))
    return {"pipe_parallel_size", "pipe_partition_method"}


def _translate_sequence_parallel(args: dict, recipe: dict, notices: list[str]) -> set[str]:
    if args.get("sequence_parallel"):
        if int(args.get("model_parallel_size") or 1) > 1:
            _put(recipe, "parallel.sequence_parallel", True)
        else:
            # Megatron switches it off the same way: without tensor parallelism there is nothing to split.
            notices.append("sequence_parallel: true has no effect with model_parallel_size 1; not enabled")
    return {"sequence_parallel"}


def _translate_data(args: dict, recipe: dict, notices: list[str]) -> set[str]:
    """Data paths, weights and labels; a config that names its data gets GPT-NeoX's exact sample order
    (`data.order: gpt-neox`): `data_path` + `split` (default "969, 30, 1") or `train_data_paths` blended by weight."""
    paths = args.get("train_data_paths") or ([args["data_path"]] if args.get("data_path") else [])
    weights = args.get("train_data_weights") or [1.0] * len(paths)
    if len(weights) != len(paths):
        raise RecipeError(f"train_data_weights has {len(weights)} entries but train_data_paths has {len(paths)}; give one weight per path")
    labels = args.get("train_label_data_paths") or []
    if labels and len(labels) != len(paths):
        raise RecipeError(f"train_label_data_paths has {len(labels)} entries but train_data_paths has {len(paths)}; give one per path")
    if paths:
        sources = [{"path": p, "weight": float(w), "format": "indexed"} for p, w in zip(paths, weights)]
        for source, label in zip(sources, labels):
            source["label_path"] = label
        _put(recipe, "data.sources", sources)
        _put(recipe, "data.order", "gpt-neox")
    if args.get("seed") is not None:
        # GPT-NeoX shuffles its index with the run's seed, also when the data path comes from the command line
        # (`neox_hf batches --data-path`, `--data.sources`), so the seed cannot wait for the config to name data.
        _put(recipe, "data.seed", _convert("seed", args["seed"], int))
    valid = args.get("valid_data_paths") or []
    if valid and valid != paths:
        valid_weights = args.get("valid_data_weights") or [1.0] * len(valid)
        _put(recipe, "data.validation", [{"path": p, "weight": float(w), "format": "indexed"}
                                         for p, w in zip(valid, valid_weights)])
    if paths and not args.get("train_data_paths"):
        _put(recipe, "data.split", str(args.get("split") or DEFAULT_SPLIT))
    elif args.get("split") and not args.get("train_data_paths"):
        parts = [float(x) for x in str(args["split"]).split(",")]
        if len(parts) >= 2 and sum(parts) > 0:
            _put(recipe, "data.validation_fraction", parts[1] / sum(parts))
    for key in ("pack_impl", "allow_chopped", "eod_mask_loss", "weight_by_num_documents", "weighted_sampler_alpha"):
        if args.get(key) is not None:
            _put(recipe, f"data.{key}", args[key])
    _translate_curriculum(args.get("curriculum_learning"), recipe)
    if args.get("test_data_paths"):
        notices.append("test_data_paths are not used during training (evaluate afterwards with `neox_hf eval`)")
    if args.get("load"):
        notices.append(f"load: {args['load']} → resume from it with `--train.resume PATH`, or import a GPT-NeoX checkpoint with `neox_hf convert-neox`")
    return {"train_data_paths", "train_data_weights", "data_path", "valid_data_paths", "valid_data_weights",
            "test_data_paths", "test_data_weights", "split", "load", "label_data_paths", "train_label_data_paths",
            "pack_impl", "allow_chopped", "eod_mask_loss", "weight_by_num_documents", "weighted_sampler_alpha",
            "curriculum_learning", "curriculum_seqlen"}


DEFAULT_SPLIT = "969, 30, 1"  # GPT-NeoX's default `split`
_CURRICULUM_SCHEDULE_KEYS = ("total_curriculum_step", "difficulty_step", "root_degree", "difficulty", "max_step")


def _translate_curriculum(curriculum, recipe: dict) -> None:
    """GPT-NeoX's DeepSpeed `curriculum_learning` block → data.curriculum (only the seqlen metric exists)."""
    if not curriculum or not curriculum.get("enabled", False):
        return
    kind = curriculum.get("curriculum_type", "seqlen")
    if kind != "seqlen":
        raise _refuse("curriculum_learning.curriculum_type", kind, "only the seqlen curriculum is supported")
    block = {k: curriculum[k] for k in ("min_difficulty", "max_difficulty", "schedule_type") if k in curriculum}
    schedule = curriculum.get("schedule_config") or {}
    block.update({k: schedule[k] for k in _CURRICULUM_SCHEDULE_KEYS if k in schedule})
    _put(recipe, "data.curriculum", block)


def _translate_logging(args: dict, recipe: dict, notices: list[str]) -> set[str]:
    """Trackers (wandb, Comet, TensorBoard) and lm-eval tasks during training."""
    trackers = [name for key, name in (("use_wandb", "wandb"), ("use_comet", "comet_ml")) if args.get(key)]
    if trackers:
        _put(recipe, "output.report_to", trackers)
    # One project / run name serves every tracker here; wandb's names win over Comet's when both are given.
    project = args.get("wandb_project") or args.get("comet_project")
    if project and trackers:
        _put(recipe, "output.project", str(project))
    name = args.get("wandb_group") or args.get("comet_experiment_name")
    if name and trackers:
        # GPT-NeoX groups runs under wandb_group (each run gets a random suffix); here the group names the run.
        _put(recipe, "output.run_name", str(name))
    if args.get("tensorboard_dir"):
        _put(recipe, "output.tensorboard", True)
        notices.append(f"tensorboard_dir: {args['tensorboard_dir']} → TensorBoard on, writing under OUTPUT/runs/ "
                       "(output.dir decides where)")
    if args.get("eval_tasks"):
        _put(recipe, "train.eval_tasks", [str(t) for t in args["eval_tasks"]])
    return {"use_wandb", "wandb_project", "wandb_group", "use_comet", "comet_project", "comet_experiment_name",
            "tensorboard_dir", "eval_tasks"}


def load_neox_recipe_dict(paths: list[str | Path]) -> NeoXTranslation:
    """Read, merge and translate GPT-NeoX config files."""
    return translate_neox_args(read_neox_files(paths))


