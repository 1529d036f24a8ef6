"""GPT-NeoX config files → our recipe dict.

GPT-NeoX configs are YAML with Python literals (`True`), comments, trailing commas and keys written with `-` or
`_`; its launcher merges several files and refuses a key given twice, and a key it does not know. We refuse the same
(an unknown key naming the closest known one), translate every key we understand, refuse the options our GPTNeoX
architecture cannot express (naming the key and what we support), and report every GPT-NeoX key we ignore (logging,
kernel fusions, launcher settings) so nothing is dropped silently.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from neox_hf.errors import RecipeError


@dataclass
class NeoXTranslation:
    recipe: dict  # nested dict for `recipe_from_dict`
    notices: list[str] = field(default_factory=list)  # what was approximated or ignored, printed at start-up
    # How the config orders data it does not name (`split`; `train_data_weights` of a config naming none): for the
    # data the command line gives (`--data.sources`, `neox_hf batches --data-path`), see `place_command_line_data`
    data_defaults: dict = field(default_factory=dict)


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
        _check_known_keys(raw, Path(path))
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
# Known keys
# ----------------------------------------------------------------------------------------------------------------

# Every key GPT-NeoX accepts: the fields of its NeoXArgs dataclasses (megatron/neox_arguments/neox_args.py and
# deepspeed_args.py, grouped by class), at EleutherAI/gpt-neox ea7aefd (2026-05) and in every earlier version of those
# files back to 2021, so configs written for older releases (Pythia's) stay known. GPT-NeoX refuses any other key
# when it builds NeoXArgs; so do we, naming the closest known key.
_GPT_NEOX_KEYS = frozenset("".join((
    # Parallelism
    "is_pipe_parallel model_parallel_size pipe_parallel_size pipe_partition_method sequence_parallel world_size "
    "context_parallel_size "  # GPT-NeoX's context-parallel branch (4969683e); counted out of its dp_world_size
    # Model
    "activation apply_query_key_layer_scaling attention_config attention_softmax_in_fp32 bias_dropout_fusion "
    "bias_gelu_fusion dim_att expansion_factor ffn_dim fp16_lm_cross_entropy fused_kernels_build_path "
    "gmlp_attn_dim gpt_j_residual gpt_j_tied head_size hidden_size init_method init_method_std intermediate_size "
    "layernorm_epsilon layernorm_fusion make_vocab_size_divisible_by mamba_causal_conv_fusion "
    "mamba_inner_func_fusion mamba_selective_fp32_params mamba_selective_scan_fusion mamba_use_bias_in_conv "
    "mamba_use_bias_in_linears max_position_embeddings mlp_multiple_of no_weight_tying norm num_attention_heads "
    "num_kv_heads num_layers num_unique_layers online_dataserver_ips online_dataserver_ports opt_pos_emb_offset "
    "output_layer_init_method output_layer_parallelism param_sharing_style pos_emb precision rms_norm_epsilon "
    "rmsnorm_fusion rope_fusion rotary_emb_base rotary_pct rotary_save_freqs_buffer rpe_max_distance "
    "rpe_num_buckets scaled_masked_softmax_fusion scaled_upper_triang_masked_softmax_fusion scalenorm_epsilon "
    "seq_length serve_model_weights sliding_window_width soft_prompt_tuning sparsity_config te_columnparallel "
    "te_fp8_amax_compute_algo te_fp8_amax_history_len te_fp8_format te_fp8_margin te_fp8_mha te_fp8_wgrad "
    "te_layernorm_mlp te_mha te_rowparallel use_bias_in_attn_linear use_bias_in_mlp use_bias_in_norms "
    "use_cpu_initialization use_flashattn_swiglu use_qk_layernorm weight_server_port "
    # Optimizer
    "lr optimizer_type use_bnb_optimizer zero_allgather_bucket_size zero_contiguous_gradients "
    "zero_reduce_bucket_size zero_reduce_scatter zero_stage "
    # LRScheduler
    "lr_decay_fraction lr_decay_iters lr_decay_style min_lr override_lr_scheduler use_checkpoint_lr_scheduler "
    "warmup "
    # Logging
    "comet_experiment comet_experiment_name comet_others comet_project comet_tags comet_workspace git_hash "
    "gradient_noise_scale_cpu_offload gradient_noise_scale_n_batches log_dir log_grad_norm log_grad_pct_zeros "
    "log_gradient_noise_scale log_interval log_optimizer_states log_param_norm memory_profiling "
    "memory_profiling_path peak_theoretical_tflops profile profile_step_start profile_step_stop tensorboard_dir "
    "use_comet use_wandb wandb_group wandb_host wandb_init_all_ranks wandb_project wandb_run_name wandb_team "
    # Other
    "adlr_autoresume adlr_autoresume_interval deepscale deepscale_config deepspeed_mpi deepspeed_slurm "
    "distributed_backend do_test do_train do_valid eod_mask_loss global_num_gpus iteration lazy_mpu_init "
    "local_rank onnx_safe rank seed short_seq_prob user_script "
    # Tokenizer
    "padded_vocab_size tokenizer_type "
    # Training
    "allow_chopped attention_dropout base_shapes_file batch_size char_level_ppl checkpoint_activations "
    "checkpoint_factor checkpoint_in_cpu checkpoint_num_layers checkpoint_scale "
    "checkpoint_validation_with_forward_pass clip_grad config_files contiguous_checkpointing coord_check "
    "data_impl data_path dataset_impl deepspeed_activation_checkpointing dpo_beta dpo_fp32 dpo_reference_free "
    "dynamic_loss_scale eval_interval eval_iters exit_interval extra_save_iters finetune fp32_reinforce "
    "hidden_dropout hysteresis keep_last_n_checkpoints kl_div_beta kl_impl kto_beta kto_desirable_weight kto_fp32 "
    "kto_undesirable_weight load loss_scale loss_scale_window merge_file min_scale mmap_warmup mup_attn_temp "
    "mup_embedding_mult mup_init_scale mup_output_temp mup_rp_embedding_mult mup_width_scale neg_test_data_paths "
    "neg_test_label_data_paths neg_train_data_paths neg_train_label_data_paths neg_valid_data_paths "
    "neg_valid_label_data_paths no_load_optim no_load_rng no_save_optim no_save_rng num_workers pack_impl "
    "partition_activations pos_test_data_paths pos_test_label_data_paths pos_train_data_paths "
    "pos_train_label_data_paths pos_valid_data_paths pos_valid_label_data_paths profile_backward "
    "reinforce_leave_one_out s3_chunk_size s3_path save save_base_shapes split synchronize_each_layer "
    "test_data_paths test_data_weights test_label_data_paths test_reward_data_paths train_data_paths "
    "train_data_weights train_epochs train_impl train_iters train_label_data_paths train_reward_data_paths "
    "use_mup use_shared_fs valid_data_paths valid_data_weights valid_label_data_paths valid_reward_data_paths "
    "vocab_file weight_by_num_documents weight_decay weighted_sampler_alpha z_loss "
    # Textgen
    "eval_results_prefix eval_tasks maximum_tokens num_samples precompute_model_name prompt_end recompute "
    "return_logits sample_input_file sample_output_file temperature text_gen_type top_k top_p "
    # MoE
    "moe_expert_interval moe_jitter_eps moe_lbl_in_fp32 moe_num_experts moe_router_type moe_top_k "
    # DeepspeedConfig
    "activation_checkpointing amp autotuning bf16 checkpoint comms_logger communication_data_type "
    "compression_training csv_monitor curriculum_learning curriculum_seqlen data_efficiency data_types deepspeed "
    "deepspeed_extra_args dump_state elasticity flops_profiler fp16 fp32_allreduce gradient_accumulation_steps "
    "gradient_clipping gradient_predivide_factor optimizer prescale_gradients scheduler sparse_attention "
    "sparse_gradients steps_per_print tensorboard train_batch_size train_micro_batch_size_per_gpu "
    "wall_clock_breakdown wandb zero_optimization "
    # DeepspeedRunner
    "account autotuning_run comment exclude force_multi hostfile include launcher master_addr master_port "
    "no_ssh_check num_gpus num_nodes "
    # accepted by earlier versions (the Pythia era), renamed or removed since
    "apply_residual_connection_post_layernorm create_moe_param_group detect_nvlink_pairs "
    "enable_expert_tensor_parallelism expert_interval gas geglu genfile gptj_residual greedy label_data_paths "
    "max_tokens mlp_type moe_eval_capacity_factor moe_expert_parallel_size moe_glu moe_loss_coeff "
    "moe_min_capacity moe_token_dropping moe_train_capacity_factor moe_type moe_use_residual num_experts "
    "openai_gelu out_seq_length reset_attention_mask reset_position_ids save_interval save_iters slurm_comment "
    "sparsity test_data_path train_data_path use_tutel valid_data_path zero_allow_untested_optimizer "
)).split())


def _check_known_keys(raw: dict, path: Path) -> None:
    """Refuse a key GPT-NeoX does not know (a typo would otherwise train with the default), naming the closest."""
    for key in raw:
        name = str(key).replace("-", "_")
        if name not in _KNOWN_KEYS:
            raise RecipeError(f"{path}: `{key}` is not a GPT-NeoX option{_closest_key(str(key))}; GPT-NeoX refuses "
                              "unknown keys: fix its spelling or remove it")


def _closest_key(key: str) -> str:
    close = difflib.get_close_matches(key.replace("-", "_"), sorted(_KNOWN_KEYS), n=1, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean `{close[0].replace('_', '-') if '-' in key else close[0]}`?)"


# ----------------------------------------------------------------------------------------------------------------
# Refusals: options that change the architecture in ways GPTNeoX cannot express
# ----------------------------------------------------------------------------------------------------------------

_SUPPORTED_VALUES = {
    "norm": ({"layernorm", "rmsnorm"}, "GPTNeoX uses LayerNorm, the Llama family RMSNorm"),
    "pos_emb": ({"rotary"}, "GPTNeoX and Llama use rotary position embeddings"),
    "activation": ({"gelu", "swiglu"}, "GPTNeoX's MLP is dense → GELU → dense, Llama's is SwiGLU"),
    "tokenizer_type": ({"HFTokenizer", "SPMTokenizer"}, "give a tokenizers JSON file as `vocab_file` (HFTokenizer) "
                       "or an HF tokenizer folder as `--tokenizer.path`"),
    "output_layer_parallelism": ({"column", "row"}, "column or row"),
    "lr_decay_style": ({"cosine", "linear", "constant"}, "cosine, linear or constant"),
}

_MUST_BE_FALSY = {
    "gmlp_attn_dim": "gMLP blocks are not GPTNeoX",
    "use_qk_layernorm": "QK layer norm is not part of GPTNeoX",
    "rotary_interleaved": "GPTNeoX and Llama rotate halves, not interleaved pairs",
    "use_mup": "muP parametrisation is not supported",
}

_GLOBAL_ATTENTION = {"global", "flash", "ring"}


def _refuse(key: str, value: Any, supported: str) -> RecipeError:
    return RecipeError(f"GPT-NeoX option `{key}: {value!r}` is not supported by neox_hf ({supported}); remove it or change it")


def _check_refusals(args: dict) -> None:
    for key, (allowed, supported) in _SUPPORTED_VALUES.items():
        if key in args and args[key] is not None and (not isinstance(args[key], str) or args[key] not in allowed):
            raise _refuse(key, args[key], f"supported: {', '.join(sorted(allowed))}; {supported}")
    for key, reason in _MUST_BE_FALSY.items():
        if args.get(key) not in (None, False, 0, 1 if key == "moe_num_experts" else 0) and reason:
            raise _refuse(key, args[key], reason)
    for block in args.get("attention_config") or []:
        kinds = block[0] if isinstance(block, (list, tuple)) else [block]
        for kind in kinds:
            if not isinstance(kind, str) or kind not in _GLOBAL_ATTENTION:
                raise _refuse("attention_config", kind, "only dense causal attention (global/flash) exists in GPTNeoX; sparse/local/linear attention types do not")
    _check_attention_config_layers(args)


def _check_attention_config_layers(args: dict) -> None:
    """GPT-NeoX expands attention_config ([[kinds], count] blocks; count `all` in a lone block) to one kind per layer
    and refuses a list that does not give every layer exactly one."""
    config, layers = args.get("attention_config"), args.get("num_layers")
    if not config or not isinstance(config, (list, tuple)) or all(isinstance(item, str) for item in config):
        return  # already one kind per layer (or absent): the per-kind check above applies
    covered = 0
    for block in config:
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and isinstance(block[0], (list, tuple))):
            raise RecipeError(f"GPT-NeoX option `attention_config: {config!r}`: each block is [[kinds], count]; "
                              "write it as [[[\"flash\"], NUM_LAYERS]]")
        count = block[1]
        if count == "all" and len(config) == 1:
            return
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise RecipeError(f"GPT-NeoX option `attention_config`: block {block!r} repeats its kinds {count!r} times; "
                              "give a whole number ≥ 1 (or \"all\" in a lone block)")
        covered += len(block[0]) * count
    if isinstance(layers, int) and covered != layers:
        raise RecipeError(f"GPT-NeoX option `attention_config` gives {covered} layers an attention kind but "
                          f"num_layers is {layers}; GPT-NeoX refuses it: make the counts add up to {layers} (or write "
                          "[[[\"flash\"], \"all\"]])")


# ----------------------------------------------------------------------------------------------------------------
# Translation
# ----------------------------------------------------------------------------------------------------------------

def _int(value: Any) -> int:
    """An integer option: a whole number (or its text); `3.5` or `true` is refused, not truncated to 3 or 1."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{value!r} is not a whole number")
    return int(value)


def _bool(value: Any) -> bool:
    """A true/false option: `true`, `false` (or 1, 0); a string such as "no" is refused, not read as true."""
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    raise ValueError(f"{value!r} is not true or false")


# NeoX key → (recipe path, converter)
_DIRECT: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "num_layers": ("model.num_layers", _int),
    "hidden_size": ("model.hidden_size", _int),
    "num_attention_heads": ("model.num_attention_heads", _int),
    "intermediate_size": ("model.intermediate_size", _int),
    "seq_length": ("model.seq_length", _int),
    "max_position_embeddings": ("model.max_position_embeddings", _int),
    "rotary_pct": ("model.rotary_pct", float),
    "rotary_emb_base": ("model.rotary_emb_base", float),
    "gpt_j_residual": ("model.use_parallel_residual", _bool),
    "no_weight_tying": ("model.tie_word_embeddings", lambda v: not _bool(v)),
    "make_vocab_size_divisible_by": ("model.make_vocab_size_divisible_by", _int),
    "layernorm_epsilon": ("model.layer_norm_eps", float),
    "hidden_dropout": ("model.hidden_dropout", float),
    "attention_dropout": ("model.attention_dropout", float),
    "init_method": ("model.init_method", str),
    "output_layer_init_method": ("model.output_layer_init_method", str),
    "init_method_std": ("model.init_method_std", float),
    "vocab_file": ("tokenizer.path", str),
    "model_parallel_size": ("parallel.tensor_parallel", lambda v: max(_int(v), 1)),
    "checkpoint_activations": ("parallel.activation_checkpointing", _bool),
    "train_iters": ("train.train_iters", _int),
    "lr_decay_iters": ("train.lr_decay_iters", _int),
    "lr_decay_style": ("train.lr_decay_style", str),
    "warmup": ("train.warmup", float),
    "min_lr": ("train.min_lr", float),
    "weight_decay": ("train.weight_decay", float),
    "gradient_clipping": ("train.clip_grad", float),
    "seed": ("train.seed", _int),
    "log_interval": ("train.log_interval", _int),
    "eval_interval": ("train.eval_interval", _int),
    "eval_iters": ("train.eval_iters", _int),
    "checkpoint_factor": ("train.save_interval", _int),
    "save_interval": ("train.save_interval", _int),
    "save": ("output.dir", str),
    "dynamic_padding": ("data.mode", lambda v: "pad" if _bool(v) else "pack"),
}

# Keys that change nothing in what we compute: kernels, logging, launcher, GPT-NeoX-internal bookkeeping.
_NO_EFFECT = {
    "scaled_upper_triang_masked_softmax_fusion", "scaled_masked_softmax_fusion", "rope_fusion", "layernorm_fusion",
    "bias_dropout_fusion", "fp32_allreduce", "partition_activations", "synchronize_each_layer", "checkpoint_num_layers",
    "contiguous_checkpointing", "checkpoint_in_cpu", "distributed_backend", "wall_clock_breakdown", "steps_per_print",
    "log_dir", "num_workers", "data_impl", "extra_save_iters", "keep_last_n_checkpoints", "launcher",
    "hostfile", "include", "exclude", "master_port", "wandb_team", "wandb_host", "wandb_init_all_ranks",
    "comet_workspace", "comet_tags", "comet_others", "memory_profiling", "profile", "log_grad_norm", "log_param_norm", "log_optimizer_states",
    "log_gradient_noise_scale", "sparsity_config", "gpt_j_tied",
    # GPT-NeoX builds its LayerNorm / RMSNorm without reading use_bias_in_norms (megatron/model/transformer.py)
    "use_bias_in_norms", "use_flashattn_swiglu", "checkpoint_validation_with_forward_pass", "amp", "zero_allow_untested_optimizer",
    "zero_allgather_partitions", "gas", "prescale_gradients", "gradient_predivide_factor", "merge_file",
}

# Besides GPT-NeoX's own keys, the few this translation has always read that GPT-NeoX never had (dynamic_padding,
# rotary_interleaved, zero_allgather_partitions) stay accepted.
_KNOWN_KEYS = _GPT_NEOX_KEYS | set(_DIRECT) | _NO_EFFECT | set(_SUPPORTED_VALUES) | set(_MUST_BE_FALSY)


def translate_neox_args(args: dict) -> NeoXTranslation:
    """Recipe dict + notices from merged GPT-NeoX args (keys already `_`-normalised)."""
    _refuse_other_architectures(args)
    _check_value_shapes(args)
    args = _normalised_integers(args)
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
    handled |= _translate_family(args, recipe, notices)
    handled |= _translate_moe(args, recipe, notices)
    handled |= _translate_objective(args, recipe, notices)
    handled |= _translate_batch(args, recipe, notices)
    handled |= _translate_optimizer(args, recipe, notices)
    handled |= _translate_zero(args, recipe)
    handled |= _translate_precision(args, recipe, notices)
    handled |= _translate_pipeline(args, recipe)
    handled |= _translate_sequence_parallel(args, recipe, notices)
    data_defaults: dict = {}
    handled |= _translate_data(args, recipe, notices, data_defaults)
    handled |= _translate_post_training_data(args, recipe, notices)
    handled |= _translate_logging(args, recipe, notices)
    handled |= set(_MUST_BE_FALSY)
    ignored = sorted(k for k in args if k not in handled)
    no_effect = sorted(k for k in args if k in _NO_EFFECT)
    if no_effect:
        notices.append("no effect here (kernels, logging, launcher): " + ", ".join(no_effect))
    if ignored:
        notices.append("GPT-NeoX options not translated (no counterpart in neox_hf; check they are not needed): "
                       + ", ".join(ignored))
    return NeoXTranslation(recipe=recipe, notices=notices, data_defaults=data_defaults)


def place_command_line_data(raw: dict, given: dict, defaults: dict) -> dict:
    """`raw` (the translated config merged with the command line) with the config's data keys applied to the data the
    command line names (`given`: what the command line and our recipe files say), as GPT-NeoX applies them to a
    `--data-path` given at launch: `split` divides one corpus in GPT-NeoX's order (GPT-NeoX's data_path mode) unless
    the command line gives its own, and `train_data_weights` of a config naming no data weigh the sources in the
    order given, where a source gives no weight of its own."""
    given_data = given.get("data") if isinstance(given.get("data"), dict) else {}
    sources = given_data.get("sources")
    if not defaults or not isinstance(sources, list) or not sources:
        return raw
    data = dict(raw["data"])
    if data.get("order") == "gpt-neox" and "split" not in given_data and len(sources) == 1 and "split" in defaults:
        data["split"] = defaults["split"]
    elif "split" not in given_data and len(sources) != 1 and data.get("split") is not None:
        data["split"] = None  # the config's data_path split does not apply to several sources (train_data_paths mode)
    weights = defaults.get("weights")
    if weights:
        if len(weights) != len(sources):
            raise RecipeError(f"train_data_weights has {len(weights)} entries but the command line gives "
                              f"{len(sources)} data source(s); give one source per weight, or a weight on each source")
        data["sources"] = [{"weight": w, **s} if isinstance(s, dict) else s for s, w in zip(sources, weights)]
    return {**raw, "data": data}


_FAMILY_KEYS = {"norm", "activation", "num_kv_heads", "sliding_window_width", "mlp_multiple_of", "rms_norm_epsilon",
                "use_bias_in_attn_linear", "use_bias_in_mlp", "layernorm_epsilon", "intermediate_size",
                "expansion_factor", "tokenizer_type"}


def _translate_family(args: dict, recipe: dict, notices: list[str]) -> set[str]:
    """`norm: rmsnorm` + `activation: swiglu` is GPT-NeoX's Llama family (transformers' LlamaForCausalLM, Mistral with
    a sliding window); LayerNorm + GELU is GPTNeoX. A mix neither model expresses is refused naming the key."""
    norm, activation = args.get("norm") or "layernorm", args.get("activation") or "gelu"
    llama = norm == "rmsnorm" or activation == "swiglu"
    if llama and norm != "rmsnorm":
        raise _refuse("norm", norm, "`activation: swiglu` builds transformers' Llama, whose norm is RMSNorm; set "
                                    "norm: rmsnorm")
    if llama and activation != "swiglu":
        raise _refuse("activation", activation, "`norm: rmsnorm` builds transformers' Llama, whose MLP is SwiGLU; set "
                                                "activation: swiglu")
    if args.get("tokenizer_type") == "SPMTokenizer":
        if str(args.get("vocab_file") or "").endswith(".model"):
            raise _refuse("vocab_file", args["vocab_file"], "a SentencePiece .model file is not read here; give the "
                          "model's HF tokenizer folder or tokenizer.json as vocab_file or --tokenizer.path")
        notices.append("tokenizer_type: SPMTokenizer → give the model's HF tokenizer folder (or tokenizer.json) as "
                       "--tokenizer.path, with --tokenizer.eos_token / --tokenizer.pad_token of that vocabulary")
    kv = args.get("num_kv_heads")
    heads = args.get("num_attention_heads")
    gqa = kv not in (None, 0) and kv != heads
    if not llama:
        for key, value, why in (("num_kv_heads", kv if gqa else None, "grouped-query attention"),
                                ("sliding_window_width", args.get("sliding_window_width"), "sliding-window attention"),
                                ("use_bias_in_attn_linear", args.get("use_bias_in_attn_linear") is False,
                                 "attention without biases"),
                                ("use_bias_in_mlp", args.get("use_bias_in_mlp") is False, "an MLP without biases")):
            if value:
                raise _refuse(key, args[key], f"{why} is not part of GPTNeoX; the Llama family (norm: rmsnorm, "
                                              "activation: swiglu) has it")
        multiple = int(args.get("mlp_multiple_of") or 1)
        if multiple > 1 and args.get("intermediate_size"):
            width = multiple * ((int(args["intermediate_size"]) + multiple - 1) // multiple)
            if width != int(args["intermediate_size"]):
                _put(recipe, "model.intermediate_size", width)
                notices.append(f"intermediate_size {args['intermediate_size']} rounded up to mlp_multiple_of "
                               f"{multiple}: {width}, as GPT-NeoX's ParallelMLP builds it")
        return {"norm", "activation", "num_kv_heads", "mlp_multiple_of", "use_bias_in_attn_linear", "use_bias_in_mlp"}
    _put(recipe, "model.family", "llama")
    for key, refused, why in (("rotary_pct", float(args.get("rotary_pct", 1.0)) != 1.0,
                               "Llama rotates every head dimension; set rotary_pct: 1"),
                              ("gpt_j_residual", bool(args.get("gpt_j_residual")),
                               "Llama adds attention then MLP in sequence; set gpt_j_residual: false"),
                              ("hidden_dropout", bool(args.get("hidden_dropout")),
                               "Llama has no dropout on the residual stream; set hidden_dropout: 0")):
        if refused:
            raise _refuse(key, args[key], why)
    _put(recipe, "model.use_parallel_residual", False)
    _put(recipe, "model.hidden_act", "silu")
    if gqa:
        _put(recipe, "model.num_kv_heads", _convert("num_kv_heads", kv, _int))
    if args.get("sliding_window_width"):
        _put(recipe, "model.sliding_window", _convert("sliding_window_width", args["sliding_window_width"], _int))
        notices.append(f"sliding_window_width {args['sliding_window_width']} → MistralForCausalLM (Llama with a "
                       "sliding attention window)")
    # GPT-NeoX's RMSNorm default epsilon is 1e-8; layernorm_epsilon is not read for rmsnorm.
    _put(recipe, "model.layer_norm_eps", _convert("rms_norm_epsilon", args.get("rms_norm_epsilon", 1e-8), float))
    notices.append("rmsnorm: transformers' LlamaRMSNorm computes x / sqrt(mean(x²) + eps); GPT-NeoX's RMSNorm "
                   "x / (sqrt(mean(x²)) + eps): equal to ~eps relative")
    biases = []
    for key, field in (("use_bias_in_attn_linear", "attention_bias"), ("use_bias_in_mlp", "mlp_bias")):
        on = _convert(key, args.get(key, True), _bool)  # GPT-NeoX's default is True
        if on and args.get("sliding_window_width"):
            if key in args:
                raise _refuse(key, args[key], "the sliding window builds MistralForCausalLM, whose linears have no "
                                              "biases; set it false")
            # Only GPT-NeoX's default asks for them, in a config GPT-NeoX's own MLP arithmetic may not run (below).
            notices.append(f"{key} absent: GPT-NeoX's default (true) would add biases, which MistralForCausalLM "
                           f"(the sliding window's model) lacks; built without them (set {key}: false to agree)")
            on = False
        _put(recipe, f"model.{field}", on)
        if on:
            biases.append(f"{key} {'true' if key in args else 'absent (GPT-NeoX default true)'} → model.{field}: true")
    if biases:
        notices.append("GPT-NeoX builds these biases, so this model has them too (Llama's own checkpoints have "
                       "none): " + "; ".join(biases))
    ffn = args.get("intermediate_size")
    source = f"intermediate_size {ffn}"
    if not ffn and args.get("expansion_factor"):
        ffn = int(float(args["expansion_factor"]) * int(args["hidden_size"]))
        source = f"expansion_factor {args['expansion_factor']} × hidden_size = {ffn}"
    elif not ffn:
        ffn = 4 * int(args.get("hidden_size") or 0)
        source = f"4 × hidden_size = {ffn} (no intermediate_size)"
    multiple = _convert("mlp_multiple_of", args.get("mlp_multiple_of") or 1, _int)
    if ffn:
        from neox_hf.model.llama import gated_mlp_widths

        linear1, inner = gated_mlp_widths(int(ffn), multiple)
        _put(recipe, "model.intermediate_size", inner)
        notices.append(f"MLP inner width {inner}: GPT-NeoX's ParallelMLP takes {source}, × 2/3 = "
                       f"{int(int(ffn) * 2 / 3)} for the gated activation, halves it and rounds up to mlp_multiple_of "
                       f"{multiple} (the width GPT-NeoX builds, whatever the file's number suggests)")
        if linear1 != 2 * inner:
            notices.append(f"warning: GPT-NeoX itself cannot run this config: its linear1 rounds to {linear1} rows "
                           f"(a multiple of 2 × mlp_multiple_of), not 2 × {inner}, and its SwiGLU halves would not "
                           f"fit linear2; built here with inner width {inner} (linear2's); set mlp_multiple_of, or "
                           "--model.intermediate_size for the width you mean")
    return _FAMILY_KEYS


# GPT-NeoX `train_impl` → train.objective
_OBJECTIVES = {"normal": "lm", "dpo": "dpo", "rm": "rm", "kto": "kto"}
_KTO_KEYS = ("kto_beta", "kto_desirable_weight", "kto_undesirable_weight")


def _translate_objective(args: dict, recipe: dict, notices: list[str]) -> set[str]:
    """GPT-NeoX's `train_impl` and its DPO and KTO keys (their data files: `_translate_post_training_data`);
    REINFORCE and the online data server are refused."""
    impl = args.get("train_impl") or "normal"
    if impl == "reinforce":
        raise _refuse("train_impl", impl, "REINFORCE needs GPT-NeoX's online generation loop, which neox_hf does not "
                      "have; generate and score completions offline, then train on them with train_impl: kto "
                      "(`neox_hf preprocess --chat-template --reward-key`) or dpo (pairs), or use TRL's online "
                      "trainers")
    if impl not in _OBJECTIVES:
        raise _refuse("train_impl", impl, "train.objective is lm (normal), dpo, rm or kto")
    if args.get("dataset_impl") == "online":
        raise _refuse("dataset_impl", "online", "GPT-NeoX's online data server sends pickled batches over a socket, "
                      "which neox_hf never unpickles; write the data to files (`neox_hf preprocess --chat-template`) "
                      "and use dataset_impl gpt2 or pairwise")
    _put(recipe, "train.objective", _OBJECTIVES[impl])
    if args.get("dpo_beta") is not None:
        _put(recipe, "train.dpo_beta", _convert("dpo_beta", args["dpo_beta"], float))
    if impl == "dpo" and _bool(args.get("dpo_reference_free") or False):
        _put(recipe, "train.dpo_reference", "none")
    elif impl == "dpo" and args.get("precompute_model_name"):
        _put(recipe, "train.dpo_reference", "precompute")
        notices.append(f"precompute_model_name: {args['precompute_model_name']} → train.dpo_reference: precompute (the "
                       "reference's log-probabilities computed once at start-up from model.from_pretrained; the "
                       f"`…_{args['precompute_model_name']}` files GPT-NeoX stores beside the pairs are not read)")
    elif args.get("precompute_model_name"):
        notices.append("precompute_model_name has no effect here: " + (
            "KTO's reference is a frozen copy of the starting model (its KL sequences change every micro-batch)"
            if impl == "kto" else "it names reference log-probabilities for train_impl dpo / kto"))
    if args.get("dpo_fp32") is False:
        notices.append("dpo_fp32: false has no effect: DPO log-probabilities are computed in fp32 here")
    if impl == "kto":
        for key in _KTO_KEYS:
            if args.get(key) is not None:
                _put(recipe, f"train.{key}", _convert(key, args[key], float))
        if args.get("kto_fp32") is False:
            notices.append("kto_fp32: false has no effect: KTO log-probabilities are computed in fp32 here")
    unused = sorted(k for k in args if (k.startswith("kto_") and impl != "kto")
                    or k in ("kl_div_beta", "kl_impl", "fp32_reinforce", "reinforce_leave_one_out"))
    if unused:
        notices.append("no effect without train_impl kto / reinforce: " + ", ".join(unused))
    kto = [k for k in args if k.startswith("kto_")]
    return {"train_impl", "dpo_beta", "dpo_reference_free", "precompute_model_name", "dpo_fp32", *kto, *unused}


# Integer options read outside _DIRECT's converters, converted once (and their sign checked) before translation.
_INTEGER_OPTIONS = {"pipe_parallel_size": 0, "model_parallel_size": 0, "num_kv_heads": 1, "mlp_multiple_of": 1}


def _normalised_integers(args: dict) -> dict:
    converted = dict(args)
    for key, least in _INTEGER_OPTIONS.items():
        if converted.get(key) is None:
            continue
        converted[key] = _convert(key, converted[key], _int)
        if converted[key] < least:
            raise RecipeError(f"GPT-NeoX option `{key}: {converted[key]}` must be ≥ {least}")
    return converted


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


def _translate_batch(args: dict, recipe: dict, notices: list[str]) -> set[str]:
    """Micro batch and accumulation by GPT-NeoX's rule (NeoXArgs.calculate_batch_parameters, then its check that
    train_batch_size = micro × accumulation × data-parallel size), with NeoXArgs' default gradient_accumulation_steps
    of 1 when the config does not set it (an explicit null lets the rule derive it).

    The data-parallel size is GPT-NeoX's global_num_gpus / (pipeline × model parallel). When the config fixes the GPU
    count (`global_num_gpus`, or `num_gpus` per node × `num_nodes`) the rule is applied exactly. Otherwise the count is
    the launch's: micro batch and accumulation given stand as they are (GPT-NeoX never changes them) and a
    train_batch_size they cannot reach at any data-parallel size is refused; one they reach is recorded in a note
    naming that size, and as `train.train_batch_size`, which the launch must reach (`parallel.layout.check_launch`
    refuses it otherwise, as GPT-NeoX does, unless `--train.gradient_accumulation_steps` makes up the difference).
    Where the rule divides train_batch_size by the size (no micro batch, or accumulation null) it is applied on the
    launch's data-parallel size, as GPT-NeoX applies it on the GPUs it finds (one process for a plain python run and
    `--print-config`). A config with neither train_batch_size nor a micro batch (a model-only
    file) keeps the recipe's defaults.
    """
    keys = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "global_num_gpus",
            "num_gpus", "num_nodes", "context_parallel_size"}
    _translate_context_parallel(args, recipe)
    train_batch = _batch_value(args, "train_batch_size")
    micro = _batch_value(args, "train_micro_batch_size_per_gpu")
    accumulation = _batch_value(args, "gradient_accumulation_steps", absent=1)
    if train_batch is None and micro is None:
        if accumulation is not None:
            _put(recipe, "train.gradient_accumulation_steps", accumulation)
        return keys
    dp = _data_parallel_size(args)
    if dp is None and train_batch is not None and (micro is None or accumulation is None):
        dp, processes = _launch_data_parallel_size(args)  # GPT-NeoX divides by the GPUs it runs on: the launch's
        micro, accumulation = _batch_for(dp, train_batch, micro, accumulation, whose="this launch's processes")
        notices.append(f"batch: GPT-NeoX's rule on this launch's {dp} data-parallel process(es) ({processes} "
                       f"process(es){'' if processes > 1 else ': a plain python run or --print-config'}) gives micro "
                       f"batch {micro} × accumulation {accumulation}; a launch of other size derives its own")
    elif dp is None:
        micro, accumulation = _batch_for_any_launch(train_batch, micro, accumulation, notices)
    else:
        micro, accumulation = _batch_for(dp, train_batch, micro, accumulation)
        notices.append(f"batch: GPT-NeoX's rule on {dp} data-parallel process(es) (the config's GPU count) gives "
                       f"micro batch {micro} × accumulation {accumulation}; launch {dp} data-parallel processes here")
    _put(recipe, "train.micro_batch_size", micro)
    _put(recipe, "train.gradient_accumulation_steps", accumulation)
    if train_batch is not None:  # the launch must reach it, as GPT-NeoX's check_batch_parameters asks
        _put(recipe, "train.train_batch_size", train_batch)
    return keys


def _batch_value(args: dict, key: str, absent: int | None = None) -> int | None:
    if key not in args:
        return absent
    if args[key] is None:
        return None
    value = _convert(key, args[key], _int)
    if value <= 0:
        raise RecipeError(f"GPT-NeoX option `{key}: {value}` must be > 0, as GPT-NeoX requires")
    return value


def _data_parallel_size(args: dict) -> int | None:
    """GPT-NeoX's dp_world_size where the config fixes the GPU count; None where the launch decides it (GPT-NeoX
    then counts its hostfile's or the machine's GPUs)."""
    gpus = _batch_value(args, "global_num_gpus")
    if gpus is None and args.get("num_gpus") and args.get("num_nodes"):
        per_node, nodes = _convert("num_gpus", args["num_gpus"], _int), _convert("num_nodes", args["num_nodes"], _int)
        gpus = per_node * nodes if per_node > 0 and nodes > 0 else None  # num_nodes -1: every node of the hostfile
    if gpus is None:
        return None
    model_parallel = _model_parallel_size(args)
    if gpus % model_parallel:
        raise RecipeError(f"global_num_gpus {gpus} is not a multiple of pipe_parallel_size × model_parallel_size "
                          f"{'× context_parallel_size ' if _context_parallel(args) > 1 else ''}({model_parallel}); "
                          "GPT-NeoX refuses "
                          "it: give a GPU count that holds whole model replicas")
    return gpus // model_parallel


def _launch_data_parallel_size(args: dict) -> tuple[int, int]:
    """(data-parallel size, processes) of the launch this config is read in: torchrun / accelerate launch set
    WORLD_SIZE before our code runs (a plain python run, `--print-config`, `plan`: one process). neox_yaml sits below
    the parallel layer, so it reads the variable itself."""
    import os

    processes = int(os.environ.get("WORLD_SIZE", "1"))
    model_parallel = _model_parallel_size(args)
    if processes % model_parallel:
        raise RecipeError(f"this launch's {processes} process(es) are not a multiple of pipe_parallel_size × "
                          f"model_parallel_size × context_parallel_size ({model_parallel}); GPT-NeoX refuses it: "
                          "launch whole model replicas")
    return processes // model_parallel, processes


def _model_parallel_size(args: dict) -> int:
    """Ranks of one model replica as GPT-NeoX counts them: pipe_parallel_size 0 (no pipeline engine) is one stage,
    and its context-parallel branch divides by context_parallel_size too (dp_world_size = global_num_gpus / pp /
    (mp × cp)); expert-parallel ranks are data-parallel ranks there (nothing divides by them)."""
    stages, tensor_parallel = (max(int(args.get(key) or 1), 1) for key in ("pipe_parallel_size", "model_parallel_size"))
    return stages * tensor_parallel * _context_parallel(args)


def _context_parallel(args: dict) -> int:
    return max(int(args.get("context_parallel_size") or 1), 1)


def _batch_for(dp: int, train_batch: int | None, micro: int | None, accumulation: int | None,
               whose: str = "the config's GPU count") -> tuple[int, int]:
    """GPT-NeoX's calculate_batch_parameters + check_batch_parameters on `dp` data-parallel ranks."""
    if micro is None:
        accumulation = accumulation or 1
        micro = train_batch // dp // accumulation
    elif accumulation is None:
        accumulation = train_batch // micro // dp if train_batch is not None else 1
    if train_batch is not None and (micro < 1 or accumulation < 1 or train_batch != micro * accumulation * dp):
        raise RecipeError(f"train_batch_size {train_batch} is not train_micro_batch_size_per_gpu {micro} × "
                          f"gradient_accumulation_steps {accumulation} × {dp} data-parallel process(es) ({whose} over "
                          "pipeline × model parallel; gradient_accumulation_steps is 1 when absent); "
                          "GPT-NeoX refuses it: make them agree")
    return micro, accumulation


def _batch_for_any_launch(train_batch: int | None, micro: int | None, accumulation: int | None,
                          notices: list[str]) -> tuple[int, int]:
    if train_batch is None:  # GPT-NeoX derives train_batch_size; a null accumulation is 1 at every size
        return micro, accumulation or 1
    if micro is None or accumulation is None:
        missing = "train_micro_batch_size_per_gpu" if micro is None else "gradient_accumulation_steps"
        raise RecipeError(f"train_batch_size {train_batch} without {missing}: GPT-NeoX derives it from the number of "
                          f"GPUs, which is the launch's; set {missing} (micro batch × accumulation × data-parallel "
                          f"processes = {train_batch}), or global_num_gpus")
    replicas, rest = divmod(train_batch, micro * accumulation)
    if rest or not replicas:
        raise RecipeError(f"train_batch_size {train_batch} is not train_micro_batch_size_per_gpu {micro} × "
                          f"gradient_accumulation_steps {accumulation} × any number of data-parallel processes; "
                          f"GPT-NeoX refuses it: make train_batch_size a multiple of {micro * accumulation}"
                          + (" (or set gradient_accumulation_steps, 1 when absent)" if accumulation == 1 else ""))
    notices.append(f"train_batch_size {train_batch} = micro batch {micro} × accumulation {accumulation} × {replicas} "
                   f"data-parallel processes: GPT-NeoX runs this config only on {replicas}; launch {replicas} "
                   "data-parallel processes here for its global batch (another launch is refused; on fewer, pass the "
                   "--train.gradient_accumulation_steps that keeps it)")
    return micro, accumulation


# GPT-NeoX `optimizer.type` (lower case, as its get_optimizer compares it) → (train.optimizer, offload, the keyword
# arguments GPT-NeoX passes through from optimizer.params, the library's defaults where the config omits them)
_OPTIMIZER_TYPES = {
    "adam": ("adamw", False, {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction"}),
    "adamw": ("adamw", False, {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction"}),
    "fused_adam": ("adamw", False, {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction"}),
    "cpu_adam": ("adamw", True, {"lr", "betas", "eps", "weight_decay", "adamw_mode", "bias_correction"}),
    "cpu_torch_adam": ("adam", True, {"lr", "betas", "eps", "weight_decay"}),
    "lion": ("lion", False, {"lr", "betas", "weight_decay"}),
    "sgd": ("sgd", False, {"lr", "momentum", "nesterov", "weight_decay"}),
    "sm3": ("sm3", False, {"lr", "momentum", "beta", "eps"}),
}
# FusedAdam / DeepSpeedCPUAdam / torch's Adam: betas (0.9, 0.999), eps 1e-8; Lion: betas (0.9, 0.99)
_LIBRARY_BETAS = {"adamw": (0.9, 0.999), "adam": (0.9, 0.999), "lion": (0.9, 0.99)}
_REFUSED_OPTIMIZERS = {
    "onebitadam": "DeepSpeed builds 1-bit Adam inside its own engine over its compressed NCCL/MPI communication "
                  "backend, which neox_hf's Accelerate path never hands it (and which needs CUDA); use Adam",
    "madgrad_wd": "no maintained package computes GPT-NeoX's MADGRAD with decoupled weight decay (its own copy: "
                  "decay before the step; pytorch-optimizer's MADGRAD decays after it, and the madgrad package is "
                  "unmaintained); use Adam or Lion",
}


def _translate_optimizer(args: dict, recipe: dict, notices: list[str]) -> set[str]:
    """GPT-NeoX's `optimizer` block (its type and the params it passes to the optimizer) and `use_bnb_optimizer` →
    train.optimizer and its settings; the library's defaults where the params omit betas / eps, as GPT-NeoX gets
    them. Types that cannot run here are refused by name, as are params GPT-NeoX would pass that have no setting."""
    optimizer = args.get("optimizer")
    if not optimizer:
        if args.get("use_bnb_optimizer"):
            _put(recipe, "train.optimizer", "adam8bit")
        return {"optimizer", "use_bnb_optimizer"}
    kind = str(optimizer.get("type", "Adam"))
    if kind.lower() in _REFUSED_OPTIMIZERS:
        raise _refuse("optimizer.type", kind, _REFUSED_OPTIMIZERS[kind.lower()])
    if kind.lower() not in _OPTIMIZER_TYPES:
        raise _refuse("optimizer.type", kind, "GPT-NeoX's Adam, cpu_adam, cpu_torch_adam, Lion, SGD and SM3 are; "
                                              "OneBitAdam and madgrad_wd are refused by name")
    name, offload, accepted = _OPTIMIZER_TYPES[kind.lower()]
    if args.get("use_bnb_optimizer"):
        if name != "adamw" or offload:
            raise _refuse("use_bnb_optimizer", True, f"GPT-NeoX reads it for optimizer.type Adam only, not {kind}")
        name = "adam8bit"  # GPT-NeoX: bitsandbytes' Adam8bit in place of FusedAdam
        notices.append("use_bnb_optimizer: true → train.optimizer: adam8bit (bitsandbytes' 8-bit Adam; CUDA only)")
    _put(recipe, "train.optimizer", name)
    if offload:
        _put(recipe, "parallel.offload_optimizer", True)
        notices.append(f"optimizer.type {kind} → parallel.offload_optimizer: true")
    params = optimizer.get("params", {}) or {}
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise _refuse(f"optimizer.params.{unknown[0]}", params[unknown[0]],
                      f"{kind}'s params translated here are {', '.join(sorted(accepted))}")
    for key, default in (("adam_w_mode", True), ("adamw_mode", True), ("bias_correction", True)):
        if key in params and bool(params[key]) != default:
            raise _refuse(f"optimizer.params.{key}", params[key], f"only {key}: {default} (GPT-NeoX's default) is "
                                                                  "built here")
    if "lr" in params:
        _put(recipe, "train.lr", _convert("optimizer.params.lr", params["lr"], float))
    betas = params.get("betas", _LIBRARY_BETAS.get(name if name != "adam8bit" else "adamw"))
    if betas is not None:
        _put(recipe, "train.adam_beta1", _convert("optimizer.params.betas", betas[0], float))
        _put(recipe, "train.adam_beta2", _convert("optimizer.params.betas", betas[1], float))
    if "eps" in params:
        _put(recipe, "train.adam_eps", _convert("optimizer.params.eps", params["eps"], float))
    elif name in ("adamw", "adam", "adam8bit"):
        _put(recipe, "train.adam_eps", 1e-8)
    elif name == "sm3":
        _put(recipe, "train.adam_eps", 1e-30)  # SM3's default
    if "beta" in params:
        _put(recipe, "train.sm3_beta", _convert("optimizer.params.beta", params["beta"], float))
    if "momentum" in params:
        _put(recipe, "train.momentum", _convert("optimizer.params.momentum", params["momentum"], float))
    if "nesterov" in params:
        _put(recipe, "train.nesterov", _convert("optimizer.params.nesterov", params["nesterov"], bool))
    if "weight_decay" in params and "weight_decay" not in args:
        _put(recipe, "train.weight_decay", _convert("optimizer.params.weight_decay", params["weight_decay"], float))
    return {"optimizer", "use_bnb_optimizer"}


def _translate_zero(args: dict, recipe: dict) -> set[str]:
    zero = args.get("zero_optimization") or {}
    if "stage" in zero:
        _put(recipe, "parallel.zero_stage", int(zero["stage"]))
    if zero.get("cpu_offload") or (zero.get("offload_optimizer") or {}).get("device") == "cpu":
        _put(recipe, "parallel.offload_optimizer", True)
    return {"zero_optimization"}


# GPT-NeoX's Transformer Engine FP8 recipe keys → train.fp8 (accelerate's TERecipeKwargs)
_FP8_KEYS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "te_fp8_format": ("format", lambda v: {"hybrid": "HYBRID", "e4m3": "E4M3"}[str(v).lower()]),
    "te_fp8_margin": ("margin", int),
    "te_fp8_amax_history_len": ("amax_history_len", int),
    "te_fp8_amax_compute_algo": ("amax_compute_algo", lambda v: {"max": "max", "most_recent": "most_recent"}[str(v)]),
    "te_fp8_wgrad": ("wgrad", bool),
}
_TE_LAYERS = ("te_columnparallel", "te_rowparallel", "te_layernorm_mlp", "te_mha")


def _translate_precision(args: dict, recipe: dict, notices: list[str]) -> set[str]:
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
    _translate_fp8(args, recipe, notices)
    return {"fp16", "bf16", "precision", *_FP8_KEYS, "te_fp8_mha", *_TE_LAYERS}


def _translate_fp8(args: dict, recipe: dict, notices: list[str]) -> None:
    """`te_fp8_*` → train.precision: fp8 with its recipe (refused at start-up where the GPU has no FP8: never silently
    bf16). `te_fp8_mha` (FP8 attention) has no counterpart in accelerate's recipe and is refused; the TE layer keys
    choose kernels (accelerate swaps in Transformer Engine's linear layers for FP8 itself)."""
    if args.get("te_fp8_mha"):
        raise _refuse("te_fp8_mha", args["te_fp8_mha"], "FP8 attention is not part of accelerate's Transformer Engine "
                                                        "recipe; FP8 here covers the linear layers: set it false")
    fp8 = [key for key in _FP8_KEYS if args.get(key) is not None]
    layers = [key for key in _TE_LAYERS if args.get(key)]
    if not fp8:
        if layers:
            notices.append(f"{', '.join(layers)}: Transformer Engine kernels, no effect here (FP8 needs te_fp8_* keys "
                           "or `train.precision: fp8`)")
        return
    for key in fp8:
        field, convert = _FP8_KEYS[key]
        try:
            _put(recipe, f"train.fp8.{field}", convert(args[key]))
        except (KeyError, TypeError, ValueError):
            raise _refuse(key, args[key], "GPT-NeoX's values are hybrid / e4m3 (format) and max / most_recent "
                                          "(amax_compute_algo)") from None
    other = recipe["train"]["precision"]
    _put(recipe, "train.precision", "fp8")
    notices.append(f"{', '.join(fp8)} → train.precision: fp8 (accelerate's Transformer Engine FP8 recipe for the "
                   f"linear layers, bf16 autocast elsewhere, in place of the config's {other}); refused at start-up "
                   "where the GPU has no FP8 tensor cores")


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


def _translate_data(args: dict, recipe: dict, notices: list[str], defaults: dict) -> set[str]:
    """Data paths, weights and labels; a config that names its data gets GPT-NeoX's exact sample order
    (`data.order: gpt-neox`): `data_path` + `split` (default "969, 30, 1") or `train_data_paths` blended by weight."""
    paths = args.get("train_data_paths") or ([args["data_path"]] if args.get("data_path") else [])
    weights = args.get("train_data_weights") or [1.0] * len(paths)
    if paths and len(weights) != len(paths):
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
        _put(recipe, "data.seed", _convert("seed", args["seed"], _int))
    valid = args.get("valid_data_paths") or []
    if valid and valid != paths:
        valid_weights = args.get("valid_data_weights") or [1.0] * len(valid)
        _put(recipe, "data.validation", [{"path": p, "weight": float(w), "format": "indexed"}
                                         for p, w in zip(valid, valid_weights)])
    if paths and not args.get("train_data_paths"):
        _put(recipe, "data.split", str(args.get("split") or DEFAULT_SPLIT))
    elif args.get("split") and not args.get("train_data_paths"):
        # without data here, the split still holds out a fraction for our streamed order; for GPT-NeoX's order it
        # splits the command line's corpus as it would the config's (place_command_line_data)
        parts = [float(x) for x in str(args["split"]).split(",")]
        if len(parts) >= 2 and sum(parts) > 0:
            _put(recipe, "data.validation_fraction", parts[1] / sum(parts))
    for key in ("pack_impl", "allow_chopped", "eod_mask_loss", "weight_by_num_documents", "weighted_sampler_alpha"):
        if args.get(key) is not None:
            _put(recipe, f"data.{key}", args[key])
    _translate_curriculum(args.get("curriculum_learning"), recipe)
    defaults["split"] = str(args.get("split") or DEFAULT_SPLIT)  # for one corpus given on the command line
    if not paths:
        if args.get("train_data_weights"):
            defaults["weights"] = [_convert("train_data_weights", w, float) for w in args["train_data_weights"]]
    if args.get("test_data_paths"):
        notices.append("test_data_paths are not used during training (evaluate afterwards with `neox_hf eval`)")
    if args.get("load"):
        notices.append(f"load: {args['load']} → continue that GPT-NeoX run (Adam, LR and data position) with `neox_hf "
                       "continue-neox`, or import its weights with `neox_hf convert-neox`")
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




# ----------------------------------------------------------------------------------------------------------------
# GPT-NeoX's post-training data files (`preprocess_data_with_chat_template.py`): pairs for dpo / rm, rewarded
# documents for kto, read by neox_hf.data.preference through neox_hf.data.neox_post_training
# ----------------------------------------------------------------------------------------------------------------

_PAIR_KEYS = tuple(f"{side}_{split}_{kind}data_paths" for side in ("pos", "neg") for split in ("train", "valid", "test")
                   for kind in ("", "label_"))
_REWARD_KEYS = ("train_reward_data_paths", "valid_reward_data_paths", "test_reward_data_paths")


def _paths_of(args: dict, key: str) -> list:
    value = args.get(key) or []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _refuse(key, value, "a list of .bin/.idx prefixes")
    return value


def _aligned_paths(args: dict, keys: dict[str, str], anchor: str) -> list[dict]:
    """One source per path of `args[anchor]`, each `keys` field taken from the list of the same position."""
    lists = {field: _paths_of(args, key) for field, key in keys.items()}
    count = len(lists["path"])
    for field, values in lists.items():
        if values and len(values) != count:
            raise RecipeError(f"{keys[field]} has {len(values)} entries but {anchor} has {count}; give one per path")
    return [{"format": "indexed", **{f: v[i] for f, v in lists.items() if v}} for i in range(count)]


def _post_training_sources(args: dict, impl: str, split: str) -> list[dict]:
    if impl in ("dpo", "rm"):
        keys = {"path": f"pos_{split}_data_paths", "rejected_path": f"neg_{split}_data_paths",
                "label_path": f"pos_{split}_label_data_paths", "rejected_label_path": f"neg_{split}_label_data_paths"}
        sources = _aligned_paths(args, keys, f"pos_{split}_data_paths")
        if len(_paths_of(args, keys["rejected_path"])) != len(sources):
            raise RecipeError(f"neg_{split}_data_paths must name one rejected prefix per pos_{split}_data_paths entry")
        return sources
    keys = {"path": f"{split}_data_paths", "label_path": f"{split}_label_data_paths",
            "reward_path": f"{split}_reward_data_paths"}
    return _aligned_paths(args, keys, f"{split}_data_paths")


def _translate_post_training_data(args: dict, recipe: dict, notices: list[str]) -> set[str]:
    """`dataset_impl`, the pos_/neg_ pair paths (dpo, rm) and the reward paths (kto) → `data.sources` /
    `data.validation` of GPT-NeoX .bin/.idx prefixes, read one pair / example per row (`data.mode: pad`, `data.order:
    stream`). What GPT-NeoX itself refuses (packed pairs or rewards, pairs without pairwise data) is refused here too."""
    impl = args.get("train_impl") or "normal"
    dataset_impl = args.get("dataset_impl") or "gpt2"
    if dataset_impl not in ("gpt2", "pairwise"):
        raise _refuse("dataset_impl", dataset_impl, "gpt2 (documents, KTO's rewarded documents) or pairwise (dpo, rm)")
    pair_keys = [k for k in _PAIR_KEYS if args.get(k)]
    reward_keys = [k for k in _REWARD_KEYS if args.get(k)]
    handled = {"dataset_impl", *_PAIR_KEYS, *_REWARD_KEYS, "valid_label_data_paths", "test_label_data_paths"}
    if impl in ("dpo", "rm") and not args.get("pos_train_data_paths"):
        return handled  # pairs come from data.sources on the command line or in a recipe
    if impl in ("dpo", "rm") and dataset_impl != "pairwise":
        raise _refuse("dataset_impl", dataset_impl, f"train_impl {impl} reads chosen / rejected pairs: GPT-NeoX needs "
                      "dataset_impl: pairwise with pos_/neg_train_data_paths (its preprocess_data_with_chat_template.py "
                      "files), and so does neox_hf; or give jsonl pairs as data.sources")
    if impl not in ("dpo", "rm") and (dataset_impl == "pairwise" or pair_keys):
        raise _refuse("dataset_impl" if dataset_impl == "pairwise" else pair_keys[0], dataset_impl if
                      dataset_impl == "pairwise" else args[pair_keys[0]], "pairwise data is read by train_impl dpo or "
                      "rm")
    if impl == "kto" and args.get("train_data_paths") and not args.get("train_reward_data_paths"):
        raise RecipeError("train_impl: kto with train_data_paths needs train_reward_data_paths (one reward per "
                          "document: `neox_hf preprocess --chat-template --reward-key KEY --binary-reward`)")
    if impl not in ("dpo", "rm", "kto"):
        if reward_keys:
            notices.append(f"{', '.join(reward_keys)}: no effect without train_impl kto")
        labels = _paths_of(args, "valid_label_data_paths")
        validation = (recipe.get("data") or {}).get("validation") or []
        if labels and len(labels) == len(validation):
            for source, label in zip(validation, labels):
                source["label_path"] = label
        return handled
    if impl == "kto" and not args.get("train_data_paths"):
        if reward_keys:
            raise _refuse(reward_keys[0], args[reward_keys[0]], "a reward file goes with the documents it scores: "
                          "give train_data_paths (and train_label_data_paths) beside it")
        return handled  # KTO rows come from data.sources on the command line or in a recipe
    pack = args.get("pack_impl") or "packed"
    if pack != "unpacked":
        raise _refuse("pack_impl", pack, "one pair or rewarded document per sample: GPT-NeoX refuses packed "
                      "pairwise and reward data, and pack_until_overflow would sum several pairs' log-probabilities "
                      "into one; set pack_impl: unpacked")
    data = recipe.setdefault("data", {})
    data["sources"] = _post_training_sources(args, impl, "train")
    data["validation"] = _post_training_sources(args, impl, "valid")
    data.update({"mode": "pad", "order": "stream", "split": None})
    if args.get("pos_test_data_paths"):
        notices.append("test data paths are not used during training (evaluate afterwards with `neox_hf eval`)")
    notices.append(f"train_impl {impl}: GPT-NeoX's {'pairs' if impl != 'kto' else 'rewarded documents'} read one "
                   "per row, padded (data.mode: pad); the order is neox_hf's preference order (every "
                   f"{'pair' if impl != 'kto' else 'example'} once per epoch, shuffled by data.seed), not GPT-NeoX's "
                   "unpacked index")
    return handled


# ----------------------------------------------------------------------------------------------------------------
# Values of the wrong type or shape, and architectures that are not transformers: one line each, before translation
# ----------------------------------------------------------------------------------------------------------------

# GPT-NeoX's attention_config kinds that are whole other architectures (megatron/model/mamba, megatron/model/rwkv):
# their configs also set `activation: silu`, which would otherwise be refused first, hiding what the file is.
_OTHER_ARCHITECTURES = {
    "mamba": "Mamba (a selective state-space model, GPT-NeoX's megatron/model/mamba)",
    "rwkv": "RWKV (a recurrent model, GPT-NeoX's megatron/model/rwkv)",
}


def _refuse_other_architectures(args: dict) -> None:
    """A GPT-NeoX Mamba or RWKV config is refused naming the architecture: neox_hf trains GPTNeoX and Llama only."""
    kinds = set()
    config = args.get("attention_config")
    for block in config if isinstance(config, (list, tuple)) else []:
        first = block[0] if isinstance(block, (list, tuple)) and block else block
        kinds.update(k for k in (first if isinstance(first, (list, tuple)) else [first]) if isinstance(k, str))
    for kind, name in _OTHER_ARCHITECTURES.items():
        if kind in kinds:
            raise RecipeError(f"GPT-NeoX option `attention_config` builds {name}: neox_hf trains transformers only "
                              "(GPTNeoX and Llama families); this config cannot be trained here")


# What each key the translator reads must be, beyond `_DIRECT`'s converters: GPT-NeoX's own type (NeoXArgs annotates
# each field and its `validate_types` refuses a mismatch) or the shape DeepSpeed reads (`optimizer`, `zero_optimization`).
_NUMBER, _TEXT, _MAPPING, _LIST = "a number", "text", "a mapping", "a list"
_VALUE_SHAPES: dict[str, str] = {
    **{key: _MAPPING for key in ("optimizer", "zero_optimization", "fp16", "bf16", "curriculum_learning")},
    **{key: _LIST for key in ("train_data_paths", "valid_data_paths", "test_data_paths", "train_data_weights",
                              "valid_data_weights", "test_data_weights", "train_label_data_paths",
                              "label_data_paths", "eval_tasks", "attention_config")},
    **{key: _TEXT for key in ("train_impl", "split", "data_path", "norm", "activation", "precision", "pos_emb",
                              "pipe_partition_method", "tokenizer_type", "vocab_file", "wandb_project",
                              "comet_project", "wandb_group", "comet_experiment_name", "tensorboard_dir", "load",
                              "pack_impl", "precompute_model_name")},
    **{key: _NUMBER for key in ("expansion_factor", "rms_norm_epsilon", "dpo_beta", "weighted_sampler_alpha",
                                "sliding_window_width", "kto_beta", "kto_desirable_weight",
                                "kto_undesirable_weight")},
}
_NESTED_SHAPES: dict[tuple[str, str], str] = {
    ("optimizer", "type"): _TEXT, ("optimizer", "params"): _MAPPING, ("zero_optimization", "stage"): _NUMBER,
    ("zero_optimization", "offload_optimizer"): _MAPPING, ("curriculum_learning", "schedule_config"): _MAPPING,
    ("curriculum_learning", "curriculum_type"): _TEXT,
}
_OPTIMIZER_NUMBERS = ("lr", "eps", "weight_decay", "momentum", "beta")


def _shape_error(key: str, value: Any, shape: str, example: str = "") -> RecipeError:
    got = "null" if value is None else type(value).__name__
    hint = f", e.g. {example}" if example else ""
    return RecipeError(f"GPT-NeoX option `{key}: {value!r}` must be {shape} (got {got}){hint}; GPT-NeoX refuses it "
                       "too: fix the value")


def _is_shape(value: Any, shape: str) -> bool:
    if shape == _NUMBER:  # YAML reads `1e-8` (no dot) as text: a number written so is a number, as float() reads it
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                return False
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # not NaN
    return isinstance(value, {_TEXT: str, _MAPPING: dict, _LIST: (list, tuple)}[shape])


def _check_value_shapes(args: dict) -> None:
    """Every structured or typed key the translator reads, checked for its type and shape (`betas` two numbers,
    `zero_optimization.stage` 0–3, …) before translation reads into it, so a wrong value is one line naming the key,
    never a TypeError from deep inside the translation. A null stays allowed (GPT-NeoX's default)."""
    examples = {"optimizer": "{type: Adam, params: {lr: 0.0006, betas: [0.9, 0.95], eps: 1.0e-8}}",
                "split": "'969,30,1'", "attention_config": "[[[\"flash\"], NUM_LAYERS]]"}
    for key, shape in _VALUE_SHAPES.items():
        if args.get(key) is not None and not _is_shape(args[key], shape):
            raise _shape_error(key, args[key], shape, examples.get(key, ""))
    for (key, inner), shape in _NESTED_SHAPES.items():
        block = args.get(key) or {}
        if block.get(inner) is not None and not _is_shape(block[inner], shape):
            raise _shape_error(f"{key}.{inner}", block[inner], shape)
    stage = (args.get("zero_optimization") or {}).get("stage")
    if stage is not None and (isinstance(stage, bool) or stage not in (0, 1, 2, 3)):
        raise _shape_error("zero_optimization.stage", stage, "0, 1, 2 or 3")
    _check_list_items(args)
    _check_optimizer_params(((args.get("optimizer") or {}).get("params")) or {})


def _check_list_items(args: dict) -> None:
    for key in ("train_data_paths", "valid_data_paths", "test_data_paths", "train_label_data_paths",
                "label_data_paths", "eval_tasks"):
        for item in args.get(key) or []:
            if not isinstance(item, str):
                raise _shape_error(key, args[key], "a list of text (paths or task names)")
    for key in ("train_data_weights", "valid_data_weights", "test_data_weights"):
        for item in args.get(key) or []:
            if not _is_shape(item, _NUMBER) or float(item) < 0:
                raise _shape_error(key, args[key], "a list of numbers ≥ 0, one per data path")
    split = args.get("split")
    if split is not None:
        try:
            parts = [float(part) for part in split.replace("/", ",").split(",")]
        except ValueError:
            raise _shape_error("split", split, "comma-separated proportions", "'969,30,1'") from None
        if any(part < 0 or part != part for part in parts) or sum(parts) <= 0:
            raise _shape_error("split", split, "proportions ≥ 0 with a positive sum", "'969,30,1'")


def _check_optimizer_params(params: dict) -> None:
    betas = params.get("betas")
    if betas is not None and (not isinstance(betas, (list, tuple)) or len(betas) != 2
                              or not all(_is_shape(b, _NUMBER) for b in betas)):
        raise _shape_error("optimizer.params.betas", betas, "a list of two numbers", "[0.9, 0.95]")
    for name in _OPTIMIZER_NUMBERS:
        if params.get(name) is not None and not _is_shape(params[name], _NUMBER):
            raise _shape_error(f"optimizer.params.{name}", params[name], _NUMBER)


def _translate_context_parallel(args: dict, recipe: dict) -> None:
    """GPT-NeoX's `context_parallel_size` (its context-parallel branch) → parallel.context_parallel."""
    size = args.get("context_parallel_size")
    if size is None:
        return
    size = _convert("context_parallel_size", size, _int)
    if size < 1:
        raise RecipeError(f"GPT-NeoX option `context_parallel_size: {size}` must be ≥ 1")
    if size > 1:
        _put(recipe, "parallel.context_parallel", size)


# ----------------------------------------------------------------------------------------------------------------
# Mixture of experts: GPT-NeoX main's dropless MoE, and the DeepSpeed-MoE / MegaBlocks era's keys
# ----------------------------------------------------------------------------------------------------------------

# Old-era keys with nothing to do in a dropless MoE here (kernels, optimizer groups, capacities unused when no token
# is dropped); `moe_use_residual` only changed DeepSpeed-MoE layers (moe_type: deepspeed, refused below).
_MOE_NO_EFFECT = ("moe_lbl_in_fp32", "create_moe_param_group", "use_tutel", "moe_train_capacity_factor",
                  "moe_eval_capacity_factor", "moe_min_capacity", "moe_use_residual")
_MOE_KEYS = {"moe_num_experts", "num_experts", "moe_top_k", "moe_expert_interval", "expert_interval",
             "moe_router_type", "moe_jitter_eps", "moe_loss_coeff", "moe_type", "moe_token_dropping", "moe_glu",
             "moe_expert_parallel_size", "enable_expert_tensor_parallelism", *_MOE_NO_EFFECT}


def _translate_moe(args: dict, recipe: dict, notices: list[str]) -> set[str]:
    """`moe_num_experts` > 1 (older configs: `num_experts`) → an MoE family: GPT-NeoX layers → `gpt_neox_moe` (GPT-NeoX
    main's dropless MoE: non-gated experts every `moe_expert_interval` layers, Sinkhorn or top-k routing without
    renormalisation, no load-balancing loss); Llama-style layers → `mixtral` (MixtralForCausalLM: the gated experts
    GPT-NeoX defines for Llama layers, ParallelGroupedLLaMAMLP, with Mixtral's router and load-balancing loss).
    The DeepSpeed-MoE era's keys are translated where they still mean something and refused by name otherwise."""
    experts = args.get("moe_num_experts", args.get("num_experts"))
    if "num_experts" in args and "moe_num_experts" not in args:
        notices.append(f"num_experts {args['num_experts']} → model.moe_num_experts (GPT-NeoX's later name)")
    experts = _convert("moe_num_experts", experts if experts is not None else 1, _int)
    if experts <= 1:
        return _MOE_KEYS
    if args.get("moe_type", "megablocks") != "megablocks":
        raise _refuse("moe_type", args["moe_type"], "DeepSpeed-MoE's capacity-limited gating is not reproduced; the "
                                                   "dropless MegaBlocks MoE (moe_type: megablocks, GPT-NeoX main's) is")
    if args.get("moe_token_dropping"):
        raise _refuse("moe_token_dropping", args["moe_token_dropping"], "every token reaches its top-k experts here "
                                                                         "(dropless, as GPT-NeoX main); set it false")
    mixtral = recipe.get("model", {}).get("family") == "llama"
    _put(recipe, "model.family", "mixtral" if mixtral else "gpt_neox_moe")
    _put(recipe, "model.moe_num_experts", experts)
    if args.get("moe_top_k") is not None:
        _put(recipe, "model.moe_top_k", _convert("moe_top_k", args["moe_top_k"], _int))
    else:
        _put(recipe, "model.moe_top_k", 1)  # GPT-NeoX's default (Mixtral's own is 2)
    interval_key = "moe_expert_interval" if "moe_expert_interval" in args else "expert_interval"
    interval = _convert(interval_key, args.get(interval_key, 1), _int)
    if args.get("moe_jitter_eps") is not None:
        _put(recipe, "model.moe_jitter_eps", _convert("moe_jitter_eps", args["moe_jitter_eps"], float))
    if mixtral:
        _translate_mixtral(args, recipe, notices, interval_key, interval)
    else:
        _translate_gpt_neox_moe(args, recipe, notices, interval)
    if _int(args.get("moe_expert_parallel_size") or 1) > 1:
        _put(recipe, "parallel.expert_parallel", _convert("moe_expert_parallel_size",
                                                          args["moe_expert_parallel_size"], _int))
    ignored = [k for k in _MOE_NO_EFFECT if k in args]
    if ignored:
        notices.append("no effect on a dropless MoE here: " + ", ".join(ignored))
    if args.get("enable_expert_tensor_parallelism"):
        notices.append("enable_expert_tensor_parallelism: where experts live is `parallel.expert_parallel` here")
    return _MOE_KEYS


def _translate_mixtral(args: dict, recipe: dict, notices: list[str], interval_key: str, interval: int) -> None:
    if interval != 1:
        raise _refuse(interval_key, args[interval_key], "Llama-style MoE layers build MixtralForCausalLM, which has "
                                                        "experts in every layer; set it 1")
    for key, name in (("use_bias_in_attn_linear", "attention_bias"), ("use_bias_in_mlp", "mlp_bias")):
        if args.get(key) is True:
            raise _refuse(key, True, "MixtralForCausalLM's linears have no biases; set it false")
        _put(recipe, f"model.{name}", False)
    notices[:] = [n for n in notices if not n.startswith("GPT-NeoX builds these biases")]
    hidden = int(args.get("hidden_size") or 0)
    width = args.get("intermediate_size") or 256 * -(-int(2 * hidden * 4 / 3) // 256)
    _put(recipe, "model.intermediate_size", _convert("intermediate_size", width, _int))
    coef = _convert("moe_loss_coeff", args["moe_loss_coeff"], float) if "moe_loss_coeff" in args else 0.02
    _put(recipe, "model.moe_aux_loss_coef", coef)
    notices.append(f"moe_num_experts with rmsnorm + swiglu → MixtralForCausalLM: gated SwiGLU experts of width {width} "
                   "(GPT-NeoX's ParallelGroupedLLaMAMLP; GPT-NeoX main's dMoE builds ParallelGroupedMLP with a "
                   "non-gated swish instead), routed by Mixtral's softmax top-k renormalised over the chosen experts "
                   f"with its load-balancing loss (weight {coef}"
                   + (", moe_loss_coeff" if "moe_loss_coeff" in args else ", transformers' default")
                   + f"); moe_router_type {args.get('moe_router_type', 'sinkhorn')} and the biases do not apply")
    if args.get("moe_jitter_eps") is not None:
        notices.append("moe_jitter_eps → Mixtral's router_jitter_noise, which jitters the experts' input as well as "
                       "the router's (GPT-NeoX's top-k router jitters the router's input only)")


def _translate_gpt_neox_moe(args: dict, recipe: dict, notices: list[str], interval: int) -> None:
    if args.get("moe_glu"):
        raise _refuse("moe_glu", args["moe_glu"], "GPT-NeoX layers' experts are non-gated (GPT-NeoX main's "
                                                  "ParallelGroupedMLP); use rmsnorm + swiglu for gated experts")
    if args.get("moe_loss_coeff"):
        raise _refuse("moe_loss_coeff", args["moe_loss_coeff"], "GPT-NeoX main's dropless MoE has no load-balancing "
                                                                "loss (Sinkhorn balances); remove it or set 0")
    _put(recipe, "model.moe_expert_interval", interval)
    router = args.get("moe_router_type") or "sinkhorn"
    _put(recipe, "model.moe_router_type", router)
    hidden = int(args.get("hidden_size") or 0)
    width = args.get("intermediate_size") or 256 * -(-4 * hidden // 256)  # the model computes it the same way
    notices.append(f"moe_num_experts {args.get('moe_num_experts', args.get('num_experts'))} → GPT-NeoX's dropless MoE "
                   f"every {interval} layer(s) from layer 0 (non-gated experts of width {width}, {router} routing, no "
                   "renormalisation, no load-balancing loss); saved as a folder transformers loads with "
                   "trust_remote_code=True")
