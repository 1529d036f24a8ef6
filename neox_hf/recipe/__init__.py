"""The typed recipe: one dataclass tree, loaded from YAML, overridden from the command line, validated once.

A run is "defaults + a recipe file (ours or GPT-NeoX's) + `--section.key value` overrides", resolved here and
nowhere else; every other module receives plain values from the resulting `Recipe`.
Errors name the key, the bad value and the fix (closest valid key for typos).

This module imports nothing else of neox_hf except the error type, so every layer may depend on it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from neox_hf.errors import RecipeError
from neox_hf.recipe.checks import check_optimizer_hyperparameters


# ----------------------------------------------------------------------------------------------------------------
# Schema
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """Architecture (GPTNeoX, or the Llama family) or a pretrained folder to start from."""

    from_pretrained: Optional[str] = field(default=None, metadata={
        "help": "An HF model folder or Hub id to start from; its config.json then decides the architecture and the keys "
                "below are ignored.",
        "neox": ""})
    # gpt_neox: transformers' GPTNeoXForCausalLM. llama: LlamaForCausalLM (RMSNorm, gated MLP, grouped-query
    # attention), MistralForCausalLM where sliding_window is set; its defaults: rotary_pct 1, hidden_act silu
    # (SwiGLU), use_parallel_residual false, no biases. A from_pretrained folder's config.json decides instead.
    # mixtral: MixtralForCausalLM (Llama attention, SwiGLU experts in every layer; Llama's defaults). gpt_neox_moe:
    # GPT-NeoX's dropless MoE on GPTNeoX layers (non-gated experts every moe_expert_interval layers, Sinkhorn routing)
    family: Literal["gpt_neox", "llama", "mixtral", "gpt_neox_moe"] = field(default="gpt_neox", metadata={
        "help": "gpt_neox builds transformers' GPTNeoXForCausalLM; llama builds LlamaForCausalLM (MistralForCausalLM with"
                " a sliding_window), with rotary_pct 1, silu, sequential residual and no biases as its defaults; "
                "mixtral builds MixtralForCausalLM (SwiGLU experts in every layer); gpt_neox_moe GPT-NeoX's dropless "
                "MoE (non-gated experts every moe_expert_interval layers, Sinkhorn routing).",
        "neox": "norm, activation"})
    num_layers: int = field(default=2, metadata={"help": "Number of transformer layers.", "neox": "num_layers"})
    hidden_size: int = field(default=64, metadata={"help": "Width of the residual stream.", "neox": "hidden_size"})
    num_attention_heads: int = field(default=4, metadata={
        "help": "Number of attention (query) heads.", "neox": "num_attention_heads"})
    # gpt_neox: the MLP width, default 4 × hidden_size, as GPT-NeoX. llama: the gated MLP's inner width (HF's
    # intermediate_size; GPT-NeoX configs are translated with its 2/3 arithmetic), default that of 4 × hidden_size
    intermediate_size: Optional[int] = field(default=None, metadata={
        "help": "The MLP's inner width (llama: the gated MLP's, GPT-NeoX configs translated with its 2/3 rule); default "
                "from 4 × hidden_size.",
        "neox": "intermediate_size"})
    seq_length: int = field(default=128, metadata={"help": "Training sequence length in tokens.", "neox": "seq_length"})
    max_position_embeddings: Optional[int] = field(default=None, metadata={
        "help": "Longest position the model supports; default seq_length.", "neox": "max_position_embeddings"})
    rotary_pct: float = field(default=0.25, metadata={
        "help": "Fraction of each head's dimensions that rotary embeddings rotate.", "neox": "rotary_pct"})
    rotary_emb_base: float = field(default=10000.0, metadata={
        "help": "Base of the rotary embeddings' frequencies.", "neox": "rotary_emb_base"})
    use_parallel_residual: bool = field(default=True, metadata={
        "help": "Attention and MLP read the same input and add to the residual together (GPT-J style).",
        "neox": "gpt_j_residual"})
    tie_word_embeddings: bool = field(default=False, metadata={
        "help": "Share the input embedding with the output head (GPT-NeoX `no_weight_tying: false`).",
        "neox": "no_weight_tying"})
    vocab_size: Optional[int] = field(default=None, metadata={
        "help": "Embedding rows; default the tokenizer's size padded to make_vocab_size_divisible_by × tensor_parallel.",
        "neox": ""})
    make_vocab_size_divisible_by: int = field(default=128, metadata={
        "help": "The vocabulary is padded to a multiple of this times tensor_parallel, as GPT-NeoX pads it.",
        "neox": "make_vocab_size_divisible_by"})
    hidden_act: str = field(default="gelu", metadata={
        "help": "The MLP's activation, a transformers ACT2FN name; gelu_new is the tanh GELU of GPT-NeoX's "
                "bias_gelu_fusion.",
        "neox": "activation, bias_gelu_fusion"})
    layer_norm_eps: float = field(default=1e-5, metadata={
        "help": "Epsilon of the layer norms (RMSNorm's in the llama family).",
        "neox": "layernorm_epsilon, rms_norm_epsilon"})
    hidden_dropout: float = field(default=0.0, metadata={
        "help": "Dropout on the residual stream.", "neox": "hidden_dropout"})
    attention_dropout: float = field(default=0.0, metadata={
        "help": "Dropout on the attention probabilities.", "neox": "attention_dropout"})
    init_method: Literal["normal", "small_init", "wang_init", "scaled_normal"] = field(default="small_init", metadata={
        "help": "Initialisation of the input-side weights.", "neox": "init_method"})
    output_layer_init_method: Literal["normal", "small_init", "wang_init", "scaled_normal"] = field(default="wang_init", metadata={
        "help": "Initialisation of the output projections of attention and MLP.", "neox": "output_layer_init_method"})
    init_method_std: float = field(default=0.02, metadata={
        "help": "Standard deviation of the normal initialisation.", "neox": "init_method_std"})
    attn_implementation: Literal["sdpa", "eager", "flex_attention", "flash_attention_2"] = field(default="sdpa", metadata={
        "help": "transformers' attention kernel: sdpa, eager, flex_attention or flash_attention_2.", "neox": ""})
    # llama family only (GPT-NeoX num_kv_heads, sliding_window_width, use_bias_in_attn_linear, use_bias_in_mlp)
    num_kv_heads: Optional[int] = field(default=None, metadata={
        "help": "Key/value heads for grouped-query attention (llama family); default num_attention_heads.",
        "neox": "num_kv_heads"})
    sliding_window: Optional[int] = field(default=None, metadata={
        "help": "Attention window in tokens (llama family); builds MistralForCausalLM.",
        "neox": "sliding_window_width"})
    attention_bias: Optional[bool] = field(default=None, metadata={
        "help": "Biases on the attention's q/k/v/o projections; default the family's (gpt_neox yes, llama no).",
        "neox": "use_bias_in_attn_linear"})
    mlp_bias: Optional[bool] = field(default=None, metadata={
        "help": "Biases on the MLP's linears; default the family's (gpt_neox yes, llama no).",
        "neox": "use_bias_in_mlp"})
    # Mixture of experts (model.family mixtral or gpt_neox_moe)
    moe_num_experts: int = field(default=1, metadata={
        "help": "Experts per MoE layer (1: a dense MLP); model.family mixtral and gpt_neox_moe need more than 1.",
        "neox": "moe_num_experts"})
    moe_top_k: Optional[int] = field(default=None, metadata={
        "help": "Experts each token is routed to; default 2 for mixtral (transformers' num_experts_per_tok), 1 for "
                "gpt_neox_moe (GPT-NeoX's default).", "neox": "moe_top_k"})
    moe_expert_interval: int = field(default=1, metadata={
        "help": "gpt_neox_moe: layer i (from 0) has experts when i % moe_expert_interval == 0, the others a dense "
                "MLP; mixtral has experts in every layer (1 only).", "neox": "moe_expert_interval"})
    moe_router_type: Optional[Literal["sinkhorn", "topk"]] = field(default=None, metadata={
        "help": "gpt_neox_moe: sinkhorn (default; Sinkhorn-balanced choice in training, top-k in eval) or topk "
                "(softmax top-k); neither renormalises the chosen weights. mixtral routes as transformers does "
                "(softmax top-k, renormalised).", "neox": "moe_router_type"})
    moe_jitter_eps: Optional[float] = field(default=None, metadata={
        "help": "Multiplicative noise U(1 - eps, 1 + eps) in training: mixtral's router_jitter_noise (on the MoE "
                "input), gpt_neox_moe's topk router input.", "neox": "moe_jitter_eps"})
    moe_aux_loss_coef: Optional[float] = field(default=None, metadata={
        "help": "mixtral: weight of transformers' load-balancing loss (router_aux_loss_coef, default 0.02; 0 "
                "turns it off); gpt_neox_moe has none (Sinkhorn balances), as GPT-NeoX.", "neox": "moe_loss_coeff"})


# What `model.family: llama` changes in ModelConfig's defaults (a key the recipe sets stands).
LLAMA_DEFAULTS = {"rotary_pct": 1.0, "hidden_act": "silu", "use_parallel_residual": False}


@dataclass
class TokenizerConfig:
    """A tokenizers JSON file (GPT-NeoX `vocab_file`) or an HF tokenizer folder / Hub id."""

    path: str = field(default="examples/data/gpt-neox-20b-tokenizer.json", metadata={
        "help": "A tokenizers JSON file or an HF tokenizer folder / Hub id; the default is bundled in the repository.",
        "neox": "vocab_file"})
    eos_token: str = field(default="<|endoftext|>", metadata={
        "help": "The end-of-document token appended between documents.", "neox": ""})
    pad_token: str = field(default="<|padding|>", metadata={
        "help": "The token padded batches are filled with.", "neox": ""})


@dataclass
class DataSource:
    """One corpus: local files by glob (.jsonl/.json/.jsonl.gz/.jsonl.zst/.parquet/.txt), a NeoX `.bin/.idx`
    prefix, or a Hub dataset name."""

    path: str = field(default="", metadata={
        "help": "Local files by glob, a GPT-NeoX .bin/.idx prefix, or a Hub dataset name.",
        "neox": "train_data_paths, data_path"})
    weight: float = field(default=1.0, metadata={
        "help": "Blending weight of this source among the others.", "neox": "train_data_weights"})
    text_key: str = field(default="text", metadata={"help": "The jsonl / parquet column holding the text.", "neox": ""})
    template: Optional[str] = field(default=None, metadata={
        "help": "Builds the text from several columns, e.g. \"Question: {question}\\nAnswer: {answer}\".", "neox": ""})
    prompt_template: Optional[str] = field(default=None, metadata={
        "help": "The leading part of the text that gets no loss (supervised fine-tuning), e.g. \"Question: "
                "{question}\\nAnswer: \".",
        "neox": ""})
    format: Optional[Literal["json", "parquet", "text", "indexed", "hub"]] = field(default=None, metadata={
        "help": "json, parquet, text, indexed (.bin/.idx) or hub; default from the path's suffix.", "neox": ""})
    split: str = field(default="train", metadata={"help": "The split of a Hub dataset to read.", "neox": ""})
    label_path: Optional[str] = field(default=None, metadata={
        "help": "With data.order gpt-neox: a .bin/.idx of labels aligned with path (-100 means no loss).",
        "neox": "train_label_data_paths"})
    # train.objective dpo / rm: the columns of a preference pair (TRL's standard preference format)
    prompt_key: str = field(default="prompt", metadata={
        "help": "DPO / RM: the column holding the prompt of a preference pair.", "neox": ""})
    chosen_key: str = field(default="chosen", metadata={
        "help": "DPO / RM: the column holding the preferred completion.", "neox": ""})
    rejected_key: str = field(default="rejected", metadata={
        "help": "DPO / RM: the column holding the rejected completion.", "neox": ""})
    # train.objective kto: TRL's unpaired preference format (a completion and whether it is desirable)
    completion_key: str = field(default="completion", metadata={
        "help": "KTO: the column holding the completion.", "neox": ""})
    label_key: str = field(default="label", metadata={
        "help": "KTO: the column saying whether the completion is desirable (true / false).", "neox": ""})
    # GPT-NeoX's post-training files (`format: indexed`, train.objective dpo / rm / kto)
    rejected_path: Optional[str] = field(default=None, metadata={
        "help": "dpo / rm: the .bin/.idx prefix of the rejected sequences, item for item with `path` (the chosen).",
        "neox": "neg_train_data_paths"})
    rejected_label_path: Optional[str] = field(default=None, metadata={
        "help": "dpo / rm: the label .bin/.idx of the rejected sequences (-100 = no loss), aligned with "
                "`rejected_path`.", "neox": "neg_train_label_data_paths"})
    reward_path: Optional[str] = field(default=None, metadata={
        "help": "kto: the .bin/.idx of one reward per item (> 0 desirable, < 0 undesirable), aligned with `path`.",
        "neox": "train_reward_data_paths"})


@dataclass
class CurriculumConfig:
    """Sequence-length curriculum (GPT-NeoX `curriculum_learning` through DeepSpeed's CurriculumScheduler, seqlen):
    step s trains on the first L(s) tokens of each sample, L rising from min_difficulty to max_difficulty."""

    min_difficulty: int = field(default=64, metadata={
        "help": "Shortest training length of the curriculum, in tokens.", "neox": "curriculum_learning.min_difficulty"})
    max_difficulty: int = field(default=2048, metadata={
        "help": "Longest training length of the curriculum, usually model.seq_length.",
        "neox": "curriculum_learning.max_difficulty"})
    schedule_type: Literal["fixed_linear", "fixed_root", "fixed_discrete"] = field(default="fixed_linear", metadata={
        "help": "How the length rises: fixed_linear, fixed_root or fixed_discrete.",
        "neox": "curriculum_learning.schedule_type"})
    total_curriculum_step: int = field(default=1000, metadata={
        "help": "fixed_linear / fixed_root: steps from the shortest length to the longest.",
        "neox": "curriculum_learning.schedule_config.total_curriculum_step"})
    difficulty_step: int = field(default=8, metadata={
        "help": "fixed_linear / fixed_root: every length is a multiple of this.",
        "neox": "curriculum_learning.schedule_config.difficulty_step"})
    root_degree: int = field(default=2, metadata={
        "help": "fixed_root: the degree of the root.", "neox": "curriculum_learning.schedule_config.root_degree"})
    difficulty: list[int] = field(default_factory=list, metadata={
        "help": "fixed_discrete: the lengths, in order.", "neox": "curriculum_learning.schedule_config.difficulty"})
    max_step: list[int] = field(default_factory=list, metadata={
        "help": "fixed_discrete: the last step of each length but the last.",
        "neox": "curriculum_learning.schedule_config.max_step"})


@dataclass
class DataConfig:
    """Where examples come from and how they are batched."""

    sources: list[DataSource] = field(default_factory=list, metadata={
        "help": "The training corpora, blended by weight.", "neox": "train_data_paths, data_path"})
    validation: list[DataSource] = field(default_factory=list, metadata={
        "help": "Separate validation corpora.", "neox": "valid_data_paths"})
    validation_fraction: float = field(default=0.0, metadata={
        "help": "Without data.validation, hold out this fraction of the sources by a deterministic hash.",
        "neox": "split"})
    mode: Literal["pack", "pad"] = field(default="pack", metadata={
        "help": "pack joins documents into windows of seq_length + 1 tokens (GPT-NeoX); pad batches documents whole with "
                "dynamic padding.",
        "neox": "dynamic_padding"})
    isolate_documents: bool = field(default=False, metadata={
        "help": "pack: positions restart and attention stays inside each document of a window.", "neox": ""})
    max_length: Optional[int] = field(default=None, metadata={
        "help": "pad: truncate examples to this many tokens; default model.seq_length.", "neox": ""})
    pad_to_multiple_of: int = field(default=8, metadata={
        "help": "pad: batch lengths are rounded up to a multiple of this.", "neox": ""})
    buffer_size: int = field(default=1000, metadata={
        "help": "pad: examples held at once for length bucketing and shuffling.", "neox": ""})
    max_tokens_per_batch: Optional[int] = field(default=None, metadata={
        "help": "pad: a token budget per micro batch instead of a fixed number of examples.", "neox": ""})
    streaming: bool = field(default=True, metadata={
        "help": "Read local files with datasets' streaming instead of loading them whole.", "neox": ""})
    # Where the loader runs: 0 a thread of the training process, 1 a worker process (its Python work off the GIL that
    # launches the step's kernels); auto = 1 on a GPU, 0 on a CPU. One stream read in order, so at most one worker.
    num_workers: Literal["auto", 0, 1] = field(default="auto", metadata={
        "help": "Where the loader runs: 0 a thread of the training process, 1 a worker process; auto is 1 on a GPU, 0 on "
                "a CPU.",
        "neox": ""})
    append_eod: bool = field(default=True, metadata={"help": "Append the eos token after each document.", "neox": ""})
    shuffle: bool = field(default=True, metadata={
        "help": "Shuffle the document stream (data.order stream).", "neox": ""})
    seed: int = field(default=1234, metadata={"help": "Seed of the data order.", "neox": "seed"})
    # stream: our shuffled document stream; gpt-neox: GPT-NeoX's exact sample order (.bin/.idx sources, pack mode;
    # the default for GPT-NeoX configs); preshuffled: Pythia's pre-shuffled rows of seq_length + 1 tokens, in order
    order: Literal["stream", "gpt-neox", "preshuffled"] = field(default="stream", metadata={
        "help": "stream: our shuffled stream; gpt-neox: GPT-NeoX's exact sample order of .bin/.idx sources; preshuffled: "
                "Pythia's pre-shuffled rows in order.",
        "neox": ""})
    split: Optional[str] = field(default=None, metadata={
        "help": "gpt-neox order: splits one source's documents train/valid/test, e.g. \"969,30,1\".", "neox": "split"})
    pack_impl: Literal["packed", "pack_until_overflow", "unpacked"] = field(default="packed", metadata={
        "help": "gpt-neox order: packed, pack_until_overflow or unpacked.", "neox": "pack_impl"})
    allow_chopped: bool = field(default=True, metadata={
        "help": "gpt-neox order, not packed: false drops documents longer than seq_length + 1.",
        "neox": "allow_chopped"})
    eod_mask_loss: bool = field(default=False, metadata={
        "help": "No loss on predictions made from an end-of-document token.", "neox": "eod_mask_loss"})
    weight_by_num_documents: bool = field(default=False, metadata={
        "help": "gpt-neox order: blending weights from document counts, by GPT-NeoX's rule.",
        "neox": "weight_by_num_documents"})
    weighted_sampler_alpha: float = field(default=1.0, metadata={
        "help": "The exponent of weight_by_num_documents' rule.", "neox": "weighted_sampler_alpha"})
    curriculum: Optional[CurriculumConfig] = field(default=None, metadata={
        "help": "A sequence-length curriculum: step s trains on the first L(s) tokens of each sample.",
        "neox": "curriculum_learning"})
    max_skipped_fraction: float = field(default=0.01, metadata={
        "help": "The run fails when more than this fraction of documents cannot be decoded (bad JSON, missing text).",
        "neox": ""})


@dataclass
class ParallelConfig:
    """Distribution: pipeline stages × tensor parallel × data parallel, sharded by DeepSpeed ZeRO (Accelerate's
    DeepSpeed plugin) or by torch's FSDP2 (`backend: fsdp2`, `neox_hf.engines.fsdp2`)."""

    # deepspeed: ZeRO 0–3, pipeline stages, tensor parallelism (GPT-NeoX's engine); fsdp2: torch's fully_shard per
    # decoder layer (parameters, gradients and optimizer states sharded), HSDP with `dp_replicate`
    backend: Literal["deepspeed", "fsdp2"] = field(default="deepspeed", metadata={
        "help": "deepspeed: ZeRO 0–3, pipeline and tensor parallelism; fsdp2: torch's fully_shard per decoder layer.",
        "neox": ""})
    # fsdp2 only: HSDP, the data-parallel ranks as dp_replicate groups of dp / dp_replicate shards (each group holds
    # one whole copy; gradients all-reduced between groups)
    dp_replicate: int = field(default=1, metadata={
        "help": "fsdp2: HSDP with this many groups, each holding one whole copy of the model.", "neox": ""})
    tensor_parallel: int = field(default=1, metadata={
        "help": "Tensor-parallel size: each layer's matrices split over this many ranks.",
        "neox": "model_parallel_size"})
    pipeline_parallel: int = field(default=1, metadata={
        "help": "Pipeline stages: the layers split over this many ranks (DeepSpeed pipeline).",
        "neox": "pipe_parallel_size"})
    # GPT-NeoX `pipe_partition_method`: `type:transformer` balances transformer layers (GPT-NeoX's default), `uniform`
    # balances pipeline layers (embedding and head count as layers), `parameters` balances parameter counts.
    pipe_partition_method: str = field(default="type:transformer", metadata={
        "help": "How layers are balanced over stages: type:transformer, uniform or parameters.",
        "neox": "pipe_partition_method"})
    zero_stage: int = field(default=0, metadata={
        "help": "DeepSpeed ZeRO stage: 0 (none), 1, 2 or 3.", "neox": "zero_optimization.stage"})
    use_deepspeed: Optional[bool] = field(default=None, metadata={
        "help": "Run under DeepSpeed; default when launched with accelerate's DeepSpeed plugin or zero_stage > 0.",
        "neox": ""})
    sequence_parallel: bool = field(default=False, metadata={
        "help": "Megatron sequence parallelism of norms, dropout and residuals; needs tensor_parallel > 1.",
        "neox": "sequence_parallel"})
    # Context (sequence) parallelism, issue 43: every sequence split into this many contiguous chunks over as many
    # ranks; attention exchanges heads for sequence by all-to-all (DeepSpeed's Ulysses). Ranks = pp × tp × cp × dp.
    context_parallel: int = field(default=1, metadata={
        "help": "Split every sequence over this many ranks (Ulysses under deepspeed, ring attention under fsdp2).",
        "neox": ""})
    offload_optimizer: bool = field(default=False, metadata={
        "help": "ZeRO ≥ 1: optimizer states and the fp32 master weights in CPU memory.",
        "neox": "zero_optimization.offload_optimizer"})
    offload_params: bool = field(default=False, metadata={
        "help": "ZeRO-3: parameters in CPU memory between uses.", "neox": ""})
    activation_checkpointing: bool = field(default=False, metadata={
        "help": "Recompute each layer's activations in the backward pass instead of storing them.",
        "neox": "checkpoint_activations"})
    deepspeed_config: Optional[str] = field(default=None, metadata={
        "help": "A DeepSpeed JSON file that replaces the generated one.", "neox": ""})
    # How long a collective waits for every rank: rank-0-only work (the GPT-NeoX index build, lm-eval, the final
    # save and merges) must fit in it. torch's NCCL default is 10 minutes, DeepSpeed's 30.
    timeout_minutes: float = field(default=60.0, metadata={
        "help": "How long a collective waits for every rank; rank-0-only work such as the final save must fit in it.",
        "neox": ""})
    expert_parallel: int = field(default=1, metadata={
        "help": "Split each MoE layer's experts over this many ranks, which send each token to its experts' rank by "
                "all-to-all (1: every rank holds every expert).",
        "neox": "moe_expert_parallel_size"})
    experts_over: Literal["data", "tensor"] = field(default="data", metadata={
        "help": "Which ranks the experts are split over: `data`, ranks that read different batches (DeepSpeed's "
                "and torchtitan's expert parallelism), or `tensor`, the tensor-parallel group (GPT-NeoX's layout, "
                "`expert_parallel` = `tensor_parallel`).",
        "neox": ""})


@dataclass
class PushToHubConfig:
    repo_id: str = field(default="", metadata={"help": "The Hub repository to push to.", "neox": ""})
    private: bool = field(default=False, metadata={"help": "Create the repository private.", "neox": ""})
    revision_per_step: bool = field(default=True, metadata={
        "help": "Push checkpoints to branches step{N} and the final model to main, as Pythia does.", "neox": ""})


@dataclass
class Fp8Config:
    """`train.precision: fp8`: the matmuls of the model's linear layers in FP8 through accelerate's Transformer Engine
    recipe (TERecipeKwargs, delayed scaling), the other ops in bf16 autocast; GPT-NeoX's `te_fp8_*` keys."""

    format: Literal["HYBRID", "E4M3"] = field(default="HYBRID", metadata={
        "help": "HYBRID (E4M3 forward, E5M2 gradients) or E4M3.", "neox": "te_fp8_format"})
    margin: int = field(default=0, metadata={"help": "Scaling factors back off by 2^margin.", "neox": "te_fp8_margin"})
    amax_history_len: int = field(default=1024, metadata={
        "help": "Length of the amax history of delayed scaling.", "neox": "te_fp8_amax_history_len"})
    amax_compute_algo: Literal["max", "most_recent"] = field(default="most_recent", metadata={
        "help": "How the scale is taken from the history: max or most_recent.", "neox": "te_fp8_amax_compute_algo"})
    wgrad: bool = field(default=True, metadata={
        "help": "Weight gradients in FP8 too (false: in the higher precision).", "neox": "te_fp8_wgrad"})


@dataclass
class TrainConfig:
    """Optimisation (GPT-NeoX names where they exist)."""

    train_iters: int = field(default=100, metadata={"help": "Optimizer steps to train.", "neox": "train_iters"})
    micro_batch_size: int = field(default=4, metadata={
        "help": "Sequences per rank per forward pass.", "neox": "train_micro_batch_size_per_gpu"})
    gradient_accumulation_steps: int = field(default=1, metadata={
        "help": "Micro batches accumulated per optimizer step.", "neox": "gradient_accumulation_steps"})
    # GPT-NeoX's global batch (a GPT-NeoX config's train_batch_size): micro × accumulation × data-parallel size must
    # equal it, checked when the launch's data-parallel size is known (None: whatever the launch gives)
    train_batch_size: Optional[int] = field(default=None, metadata={
        "help": "The global batch; micro × accumulation × data-parallel size must equal it (unset: whatever the launch "
                "gives).",
        "neox": "train_batch_size"})
    lr: float = field(default=6e-4, metadata={"help": "Peak learning rate.", "neox": "optimizer.params.lr"})
    min_lr: float = field(default=6e-5, metadata={"help": "Learning rate at the end of the decay.", "neox": "min_lr"})
    warmup: float = field(default=0.01, metadata={
        "help": "Warm-up length as a fraction of lr_decay_iters.", "neox": "warmup"})
    lr_decay_style: Literal["cosine", "linear", "constant"] = field(default="cosine", metadata={
        "help": "Shape of the decay: cosine, linear or constant.", "neox": "lr_decay_style"})
    lr_decay_iters: Optional[int] = field(default=None, metadata={
        "help": "Steps over which the learning rate decays; default train_iters.", "neox": "lr_decay_iters"})
    weight_decay: float = field(default=0.01, metadata={"help": "Weight decay.", "neox": "weight_decay"})
    # GPT-NeoX `optimizer.type` (neox_hf/engines/optimizer.py): adamw (GPT-NeoX's Adam / cpu_adam: FusedAdam and
    # DeepSpeedCPUAdam in AdamW mode), adam (cpu_torch_adam: torch's Adam, L2 decay), lion (DeepSpeed's Lion), sgd
    # (torch's SGD), sm3 (pytorch-optimizer's SM3; no weight decay, as GPT-NeoX's), adam8bit (bitsandbytes' 8-bit
    # Adam, GPT-NeoX use_bnb_optimizer; CUDA only)
    optimizer: Literal["adamw", "adam", "lion", "sgd", "sm3", "adam8bit"] = field(default="adamw", metadata={
        "help": "adamw, adam (L2 decay), lion, sgd, sm3 or adam8bit (bitsandbytes, CUDA only).",
        "neox": "optimizer.type, use_bnb_optimizer"})
    adam_beta1: float = field(default=0.9, metadata={
        "help": "The optimizer's first beta (Adam's first moment, Lion's interpolation).",
        "neox": "optimizer.params.betas"})
    adam_beta2: float = field(default=0.95, metadata={
        "help": "The optimizer's second beta.", "neox": "optimizer.params.betas"})
    adam_eps: float = field(default=1e-8, metadata={
        "help": "The optimizer's epsilon (adam, adamw, adam8bit, sm3).", "neox": "optimizer.params.eps"})
    momentum: float = field(default=0.0, metadata={
        "help": "Momentum of sgd and sm3.", "neox": "optimizer.params.momentum"})
    sm3_beta: float = field(default=0.0, metadata={
        "help": "sm3: moving-average coefficient of the accumulators.", "neox": "optimizer.params.beta"})
    nesterov: bool = field(default=False, metadata={
        "help": "sgd: Nesterov momentum.", "neox": "optimizer.params.nesterov"})
    clip_grad: float = field(default=1.0, metadata={
        "help": "Clip the global gradient norm to this (0: no clipping).", "neox": "gradient_clipping"})
    # auto (the default): bf16 where it trains faster than fp32 (GPUs with bf16 tensor cores, AMX CPUs, AVX512-BF16
    # CPUs whose measured bf16 GEMMs beat fp32's), fp32 elsewhere (neox_hf.hardware.bf16_verdict); the recipe
    # saved with a run records what `auto` resolved to
    # fp8: Transformer Engine FP8 matmuls where the GPU has FP8 tensor cores (compute capability ≥ 8.9), refused
    # elsewhere; never `auto`'s choice
    precision: Literal["fp32", "bf16", "fp16", "fp8", "auto"] = field(default="auto", metadata={
        "help": "fp32, bf16, fp16, fp8 (Transformer Engine, GPUs with FP8) or auto: bf16 where it trains faster than "
                "fp32, else fp32.",
        "neox": "precision, fp16, bf16"})
    fp8: Fp8Config = field(default_factory=Fp8Config, metadata={
        "help": "The FP8 recipe used with precision fp8.", "neox": "te_fp8_*"})
    # fp16: overflow-skipped steps go on (LR held, as GPT-NeoX); more than this many in a row stop the run
    max_skipped_steps_in_a_row: int = field(default=100, metadata={
        "help": "fp16: more overflow-skipped steps than this in a row stop the run.", "neox": ""})
    seed: int = field(default=1234, metadata={"help": "Seed of the initialisation and dropout.", "neox": "seed"})
    log_interval: int = field(default=10, metadata={
        "help": "Log the loss every this many steps.", "neox": "log_interval"})
    eval_interval: int = field(default=50, metadata={
        "help": "Evaluate on the validation data every this many steps.", "neox": "eval_interval"})
    eval_iters: int = field(default=10, metadata={"help": "Validation batches per evaluation.", "neox": "eval_iters"})
    save_interval: Optional[int] = field(default=None, metadata={
        "help": "Save a resumable checkpoint every this many steps (unset: only at the end).",
        "neox": "checkpoint_factor, save_interval"})
    keep_last_n: int = field(default=2, metadata={"help": "Checkpoints kept; older ones are deleted.", "neox": ""})
    # a checkpoint is the state any layout resumes (`layout_free/`, DCP) plus small per-rank states; false: accelerate's
    # / DeepSpeed's per-rank files instead (DeepSpeed's own tools read them), resumable on the same layout only
    layout_free_checkpoint: bool = field(default=True, metadata={
        "help": "Checkpoints hold the state any layout resumes from (DCP) plus small per-rank states; false writes "
                "DeepSpeed's / accelerate's per-rank files instead (for DeepSpeed's tools), resumable on the same "
                "layout only.",
        "neox": ""})
    async_checkpoint: bool = field(default=False, metadata={
        "help": "Write checkpoints in the background: the step waits only while the state is copied to host memory, "
                "and `latest` moves once the write is complete on every rank.", "neox": ""})
    resume: Optional[str] = field(default=None, metadata={
        "help": "auto (the latest checkpoint under output.dir) or a checkpoint path.", "neox": ""})
    push_to_hub: Optional[PushToHubConfig] = field(default=None, metadata={
        "help": "Push checkpoints and the final model to the Hub.", "neox": ""})
    # token: every labelled token of an optimizer step weighs the same, whatever micro-batch or data-parallel rank
    # it fell in (transformers' num_items_in_batch); micro_batch: mean of micro-batch means (GPT-NeoX / Megatron)
    loss_normalization: Literal["token", "micro_batch"] = field(default="token", metadata={
        "help": "token: every labelled token of a step weighs the same; micro_batch: the mean of micro-batch means, as "
                "GPT-NeoX.",
        "neox": ""})
    fused_cross_entropy: bool = field(default=True, metadata={
        "help": "Compute the head and cross-entropy in chunks, never holding the [tokens, vocab] logits.", "neox": ""})
    z_loss: float = field(default=0.0, metadata={
        "help": "Weight of PaLM's z-loss on log(Z)² (0: off).", "neox": "z_loss"})
    # which kernel computes the fused head loss: auto = Liger / Cut Cross-Entropy on CUDA where installed and usable,
    # ours elsewhere; neox = ours always (neox_hf.ops.library_loss)
    loss_kernel: Literal["auto", "neox", "liger", "cce"] = field(default="auto", metadata={
        "help": "The fused loss kernel: auto (Liger or Cut Cross-Entropy on CUDA where usable), neox, liger or cce.",
        "neox": ""})
    # torch.compile of each decoder layer (mask building, rotary tables and the loss stay eager); auto: on CUDA only
    # (on a CPU, inductor's first compile of each layer costs more than a short run gains)
    compile: Literal["auto", True, False] = field(default="auto", metadata={
        "help": "torch.compile each decoder layer; auto compiles on CUDA only.", "neox": ""})
    tf32: bool = field(default=False, metadata={
        "help": "fp32 matmuls on TF32 tensor cores (Ampere and later GPUs); no effect on a CPU.", "neox": ""})
    eval_tasks: list[str] = field(default_factory=list, metadata={
        "help": "lm-evaluation-harness tasks run at each evaluation.", "neox": "eval_tasks"})
    # lm: next-token prediction; dpo: direct preference optimisation; rm: a reward model; kto: Kahneman-Tversky
    # optimisation on unpaired completions (GPT-NeoX `train_impl`)
    objective: Literal["lm", "dpo", "rm", "kto"] = field(default="lm", metadata={
        "help": "lm (next token), dpo (direct preference optimisation), rm (reward model) or kto (unpaired preferences).",
        "neox": "train_impl"})
    dpo_beta: float = field(default=0.1, metadata={"help": "DPO's KL weight β.", "neox": "dpo_beta"})
    dpo_loss_type: Literal["sigmoid", "ipo"] = field(default="sigmoid", metadata={
        "help": "DPO's loss: sigmoid or ipo.", "neox": ""})
    # precompute: the reference model's log-probabilities in one pass over the pairs before training (the starting
    # model; no second model in memory); frozen: a frozen copy of the reference beside the trained model
    dpo_reference: Literal["precompute", "frozen", "none"] = field(default="precompute", metadata={
        "help": "precompute: the reference log-probabilities in one pass before training; frozen: a frozen reference "
                "model beside the trained one; none: no reference (log-ratios against 0).",
        "neox": "dpo_reference_free, precompute_model_name"})
    dpo_reference_model: Optional[str] = field(default=None, metadata={
        "help": "The reference model of DPO and KTO; default model.from_pretrained.", "neox": ""})
    kto_beta: float = field(default=0.1, metadata={"help": "KTO's β.", "neox": "kto_beta"})
    kto_desirable_weight: float = field(default=1.0, metadata={
        "help": "KTO's weight on desirable completions' losses.", "neox": "kto_desirable_weight"})
    kto_undesirable_weight: float = field(default=1.0, metadata={
        "help": "KTO's weight on undesirable completions' losses.", "neox": "kto_undesirable_weight"})


@dataclass
class PeftConfig:
    method: Optional[Literal["lora"]] = field(default=None, metadata={
        "help": "lora trains a LoRA adapter (PEFT) instead of the whole model.", "neox": ""})
    r: int = field(default=8, metadata={"help": "LoRA rank.", "neox": ""})
    alpha: int = field(default=16, metadata={"help": "LoRA scaling alpha.", "neox": ""})
    dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA path.", "neox": ""})
    target_modules: list[str] = field(default_factory=lambda: ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"], metadata={
        "help": "Module names that get adapters.", "neox": ""})
    merge: bool = field(default=False, metadata={
        "help": "Also write a merged plain model folder at the end.", "neox": ""})


@dataclass
class OutputConfig:
    dir: str = field(default="outputs/run", metadata={
        "help": "The run folder: checkpoints, logs and the final model.", "neox": "save"})
    max_shard_size: str = field(default="5GB", metadata={
        "help": "Largest safetensors shard of the saved model, e.g. 5GB.", "neox": ""})
    tensorboard: bool = field(default=True, metadata={
        "help": "Log to TensorBoard (adds tensorboard to report_to).", "neox": "tensorboard_dir"})
    report_to: list[str] = field(default_factory=list, metadata={
        "help": "Trackers: tensorboard, wandb, comet_ml, mlflow, aim.", "neox": "use_wandb, use_comet"})
    run_name: Optional[str] = field(default=None, metadata={
        "help": "The run's name in the trackers; default the output folder's name.",
        "neox": "wandb_group, comet_experiment_name"})
    project: str = field(default="neox_hf", metadata={
        "help": "The trackers' project (wandb / Comet project, MLflow experiment).",
        "neox": "wandb_project, comet_project"})


@dataclass
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ----------------------------------------------------------------------------------------------------------------
# Building a typed tree from plain dicts
# ----------------------------------------------------------------------------------------------------------------


def recipe_from_dict(raw: dict, source: str = "recipe") -> Recipe:
    """Typed, validated Recipe from a nested dict (keys may use '-' for '_', as GPT-NeoX users write them)."""
    recipe = _build(Recipe, _with_family_defaults(raw), path="", source=source)
    return settled(recipe)


def settled(recipe: Recipe) -> Recipe:
    """`recipe` with `train.precision: auto` resolved for this device (or the checkpoint it resumes), validated.
    The start-up notices of that choice are in `recipe.settled_notices` (not a recipe key: never serialised)."""
    from neox_hf.recipe.precision import settle_precision

    notices = settle_precision(recipe)
    validate(recipe)
    recipe.settled_notices = [*getattr(recipe, "settled_notices", []), *notices]
    return recipe


def _with_family_defaults(raw: dict) -> dict:
    """`raw` with the Llama family's defaults under `model` where it names `family: llama`."""
    model = raw.get("model") if isinstance(raw, dict) else None
    if not isinstance(model, dict) or model.get("family") not in ("llama", "mixtral"):
        return raw
    keys = {str(k).replace("-", "_") for k in model}
    return {**raw, "model": {**{k: v for k, v in LLAMA_DEFAULTS.items() if k not in keys}, **model}}


def _build(cls, raw: Any, path: str, source: str):
    if not isinstance(raw, dict):
        raise RecipeError(f"{source}: `{path or 'top level'}` must be a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise RecipeError(f"{source}: unknown key `{_join(path, key)}`{_did_you_mean(name, fields)}")
        values[name] = _coerce(hints[name], value, _join(path, name), source)
    return cls(**values)


def _join(path: str, key) -> str:
    return f"{path}.{key}" if path else str(key)


def _did_you_mean(name: str, valid) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
    hint = f"; did you mean `{close[0]}`?" if close else ""
    return f"{hint} Valid keys here: {', '.join(sorted(valid))}"


def _coerce(hint, value, path: str, source: str):
    """Check `value` against the type hint; convert only the lossless cases (int → float, 1e-4 strings → float)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        return _coerce(non_none[0], value, path, source)
    if origin is Literal:
        # Same type as well as equal: `true` == 1 and `1.0` == 1 in Python, but a YAML `true` for a 0/1 setting is
        # a mistake to name, not a worker count.
        if not any(value == a and type(value) is type(a) for a in args):
            raise RecipeError(f"{source}: `{path}` = {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise RecipeError(f"{source}: `{path}` must be a list, got {value!r}")
        return [_coerce(args[0], v, f"{path}[{i}]", source) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path, source)
    return _coerce_scalar(hint, value, path, source)


def _coerce_scalar(hint, value, path: str, source: str):
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif hint is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads `1e-4` as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise RecipeError(f"{source}: `{path}` must be a finite number, got {value!r}")
            return number
    elif hint is str:
        if isinstance(value, str):
            return value
    else:
        return value
    raise RecipeError(f"{source}: `{path}` must be {hint.__name__}, got {value!r} ({type(value).__name__})")


# ----------------------------------------------------------------------------------------------------------------
# Validation (ranges and cross-field rules)
# ----------------------------------------------------------------------------------------------------------------


# transformers' ACT2FN names (tests/test_reliability.py checks the list against transformers.activations).
HIDDEN_ACTIVATIONS = (
    "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_accurate", "gelu_python", "gelu_10", "quick_gelu",
    "relu", "relu2", "relu6", "leaky_relu", "silu", "swish", "mish", "tanh", "sigmoid", "linear", "hardswish",
)
# What transformers' save_pretrained accepts as max_shard_size (convert_file_size_to_int).
_SHARD_SIZE = re.compile(r"\d+\s*(GIB|MIB|KIB|GB|MB|KB|gib|mib|kib|gb|mb|kb|GiB|MiB|KiB|Gb|Mb|Kb)")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise RecipeError(message)


def _validate_family(recipe: Recipe) -> None:
    """What each family's transformers model can express (the keys of the other family are refused by name)."""
    m, tp = recipe.model, recipe.parallel.tensor_parallel
    if m.from_pretrained is not None:
        return  # the folder's config.json decides the architecture
    _validate_moe(recipe)
    if m.family in ("gpt_neox", "gpt_neox_moe"):
        for name in ("num_kv_heads", "sliding_window"):
            _require(getattr(m, name) is None, f"`model.{name}` is a Llama-family option; set `model.family: llama` "
                                               "(GPTNeoX has neither grouped-query nor sliding-window attention)")
        for name in ("attention_bias", "mlp_bias"):
            _require(getattr(m, name) in (None, True), f"`model.{name}: false` is not expressible in GPTNeoX, whose "
                                                       "linears always have biases; use `model.family: llama`")
        return
    _require(m.rotary_pct == 1.0, f"`model.rotary_pct` must be 1 with `model.family: llama` (Llama rotates every "
                                  f"head dimension), got {m.rotary_pct}")
    _require(not m.use_parallel_residual, "`model.use_parallel_residual: true` is not expressible in Llama (sequential "
                                          "attention then MLP, GPT-NeoX gpt_j_residual: false); set it false")
    _require(m.hidden_dropout == 0.0, f"`model.hidden_dropout` ({m.hidden_dropout}) is not expressible in Llama (no "
                                      "dropout on the residual stream); set it 0")
    kv = m.num_kv_heads or m.num_attention_heads
    _require(kv > 0 and m.num_attention_heads % kv == 0,
             f"`model.num_kv_heads` ({kv}) must divide `model.num_attention_heads` ({m.num_attention_heads}): each "
             "key/value head serves a whole group of query heads")
    _require(kv % tp == 0,
             f"`parallel.tensor_parallel` ({tp}) must divide `model.num_kv_heads` ({kv}): each rank holds whole "
             f"key/value heads (GPT-NeoX does not replicate them either); choose a TP size ≤ {kv} that divides it")
    if m.sliding_window is not None:
        _require(m.sliding_window > 0, f"`model.sliding_window` must be > 0, got {m.sliding_window}")
        _require(not m.attention_bias and not m.mlp_bias,
                 "`model.sliding_window` with `model.attention_bias` / `model.mlp_bias` is not expressible: the "
                 "sliding window builds MistralForCausalLM, whose linears have no biases")


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


def _validate_fsdp2(recipe: Recipe) -> None:
    """What `parallel.backend: fsdp2` runs (neox_hf.engines.fsdp2); DeepSpeed's own keys are refused by name."""
    p, t = recipe.parallel, recipe.train
    _require(p.dp_replicate >= 1, f"`parallel.dp_replicate` must be ≥ 1, got {p.dp_replicate}")
    if p.backend != "fsdp2":
        _require(p.dp_replicate == 1, "`parallel.dp_replicate` (HSDP) needs `parallel.backend: fsdp2`; DeepSpeed "
                                      "shards over every data-parallel rank")
        return
    for key, off in (("zero_stage", 0), ("pipeline_parallel", 1), ("offload_optimizer", False),
                     ("offload_params", False), ("deepspeed_config", None), ("use_deepspeed", None)):
        why = {"pipeline_parallel": "pipeline stages run on DeepSpeed's pipeline engine",
               "offload_optimizer": "CPU offload under FSDP2 (CPUOffloadPolicy) is not wired yet",
               "offload_params": "CPU offload under FSDP2 (CPUOffloadPolicy) is not wired yet"
               }.get(key, "it is a DeepSpeed setting; FSDP2 always shards parameters, gradients and optimizer states")
        _require(getattr(p, key) == off or (key == "use_deepspeed" and p.use_deepspeed is False),
                 f"`parallel.{key}: {getattr(p, key)}` with `parallel.backend: fsdp2` is refused: {why}; remove it "
                 "or use `parallel.backend: deepspeed`")
    _require(t.precision not in ("fp16", "fp8"),
             f"`train.precision: {t.precision}` with `parallel.backend: fsdp2` is refused: "
             + ("FSDP2 needs a sharded loss scaler, not wired yet" if t.precision == "fp16" else
                "Transformer Engine's FP8 layers are not combined with fully_shard here yet")
             + "; use bf16 (fp32 masters and reductions)")
    _require(recipe.peft.method is None or p.dp_replicate == 1,
             "`peft.method` with `parallel.dp_replicate > 1` (HSDP) is refused (LoRA under FSDP2 is tested on one "
             "sharded dimension); remove `parallel.dp_replicate` or use `parallel.backend: deepspeed`")


def _validate_train_batch(t: TrainConfig) -> None:
    """A train_batch_size no data-parallel size reaches is refused here; one that needs another size than the
    launch's, at launch (`train_batch_disagreement`)."""
    if t.train_batch_size is None:
        return
    _require(t.train_batch_size > 0, f"`train.train_batch_size` must be > 0, got {t.train_batch_size}")
    per_replica = t.micro_batch_size * t.gradient_accumulation_steps
    if t.train_batch_size % per_replica:
        fix = (f"pass a --train.gradient_accumulation_steps that divides {t.train_batch_size // t.micro_batch_size}"
               if t.train_batch_size % t.micro_batch_size == 0 else
               f"pass a --train.micro_batch_size that divides {t.train_batch_size}")
        raise RecipeError(f"`train.train_batch_size` {t.train_batch_size} is not micro batch {t.micro_batch_size} × "
                          f"gradient_accumulation_steps {t.gradient_accumulation_steps} × any number of data-parallel "
                          f"processes; GPT-NeoX refuses it: {fix}")


def data_parallel_for_train_batch(t: TrainConfig) -> int | None:
    """The data-parallel size at which micro × accumulation gives train_batch_size (None: the recipe sets none)."""
    if t.train_batch_size is None:
        return None
    return t.train_batch_size // (t.micro_batch_size * t.gradient_accumulation_steps)


def accumulation_for_train_batch(t: TrainConfig, data_parallel: int) -> int | None:
    """The gradient_accumulation_steps that gives train_batch_size on `data_parallel` ranks, None where none does."""
    if t.train_batch_size is None:
        return None
    accumulation, rest = divmod(t.train_batch_size, t.micro_batch_size * data_parallel)
    return accumulation if accumulation and not rest else None


def train_batch_disagreement(t: TrainConfig, data_parallel: int) -> str | None:
    """None when the recipe's train_batch_size is micro × accumulation × `data_parallel` (or it sets none); else the
    sentence saying how they disagree, as GPT-NeoX's check_batch_parameters refuses it (the caller adds the fixes
    its entry point offers: `data_parallel_for_train_batch`, `accumulation_for_train_batch`)."""
    if t.train_batch_size is None:
        return None
    trained = t.micro_batch_size * t.gradient_accumulation_steps * data_parallel
    if trained == t.train_batch_size:
        return None
    return (f"train_batch_size {t.train_batch_size} is not micro batch {t.micro_batch_size} × "
            f"gradient_accumulation_steps {t.gradient_accumulation_steps} × {data_parallel} data-parallel "
            f"process(es) (= {trained}); GPT-NeoX refuses it")


def _validate_pipeline(recipe: Recipe) -> None:
    """What DeepSpeed's pipeline engine (and GPT-NeoX) can run with pipeline stages."""
    m, p = recipe.model, recipe.parallel
    _require(
        p.zero_stage <= 1,
        f"`parallel.zero_stage: {p.zero_stage}` with `parallel.pipeline_parallel > 1` is refused: ZeRO-2/3 partition "
        "gradients (and ZeRO-3 parameters) across data-parallel ranks after every backward, while a pipeline stage "
        "accumulates gradients over all micro-batches in flight before one reduction; DeepSpeed's pipeline engine "
        "refuses it, as GPT-NeoX does. Use zero_stage 1 (optimizer states sharded) or 0",
    )
    method = p.pipe_partition_method
    _require(
        method in ("uniform", "parameters") or (method.startswith("type:") and len(method) > 5),
        f"`parallel.pipe_partition_method` must be `type:transformer` (GPT-NeoX's default), `uniform`, `parameters` "
        f"or `type:<layer class regex>`, got {method!r}",
    )
    _require(
        m.from_pretrained is not None or m.num_layers >= p.pipeline_parallel,
        f"`model.num_layers` ({m.num_layers}) must be ≥ `parallel.pipeline_parallel` ({p.pipeline_parallel}): every "
        "stage needs at least one transformer layer",
    )
    _require(
        not p.sequence_parallel,
        "`parallel.sequence_parallel` with `parallel.pipeline_parallel > 1` is not supported yet: the activations "
        "sent between stages are whole sequences; use sequence_parallel: false with pipeline stages",
    )
    _require(recipe.peft.method is None,
             "`peft.method` with `parallel.pipeline_parallel > 1` is refused: fine-tune adapters with ZeRO data "
             "parallelism (pipeline_parallel: 1)")
    _require(recipe.train.z_loss == 0.0,
             "`train.z_loss` with `parallel.pipeline_parallel > 1` is not supported yet: the last stage's loss is the "
             "cross-entropy alone; set train.z_loss: 0 or pipeline_parallel: 1")


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


def _validate_sequence_parallel(recipe: Recipe) -> None:
    """Every batch's sequence length must split evenly over the tensor-parallel ranks."""
    m, p, d = recipe.model, recipe.parallel, recipe.data
    tp = p.tensor_parallel
    _require(tp > 1, "`parallel.sequence_parallel: true` needs `parallel.tensor_parallel` > 1: it splits along the "
                     "sequence what tensor parallelism leaves replicated")
    _require(m.seq_length % tp == 0, f"`parallel.sequence_parallel` needs `model.seq_length` ({m.seq_length}) divisible "
                                     f"by `parallel.tensor_parallel` ({tp})")
    if d.mode == "pad":
        _require(d.pad_to_multiple_of % tp == 0,
                 f"`parallel.sequence_parallel` with `data.mode: pad` needs `data.pad_to_multiple_of` "
                 f"({d.pad_to_multiple_of}) to be a multiple of `parallel.tensor_parallel` ({tp})")
        max_length = d.max_length or m.seq_length
        _require(max_length % tp == 0, f"`parallel.sequence_parallel` needs `data.max_length` ({max_length}) divisible "
                                       f"by `parallel.tensor_parallel` ({tp})")


def _validate_context_parallel(recipe: Recipe) -> None:
    """What `parallel.context_parallel` > 1 runs, each refusal naming the key and the fix: DeepSpeed's Ulysses
    attention on the plain engine (every sequence in contiguous chunks, heads exchanged by all-to-all), or torch's
    ring attention on the FSDP2 engine (head-tail chunks, key/value blocks passed round the ranks)."""
    m, p, t = recipe.model, recipe.parallel, recipe.train
    cp, ring = p.context_parallel, p.backend == "fsdp2"
    _require(p.pipeline_parallel == 1, "`parallel.context_parallel` > 1 with `parallel.pipeline_parallel` > 1 is "
                                       "refused (not wired into the pipeline stages); use pipeline_parallel: 1")
    _require(not p.sequence_parallel, "`parallel.context_parallel` > 1 with `parallel.sequence_parallel: true` is "
                                      "refused (the sequence is already split over the context-parallel ranks); "
                                      "set sequence_parallel: false")
    if ring:
        _validate_ring_attention(recipe)
    else:
        _validate_ulysses(recipe)
    _require(m.attn_implementation == "sdpa",
             f"`model.attn_implementation: {m.attn_implementation}` with `parallel.context_parallel` > 1 is refused: "
             "the context-parallel attention runs SDPA; use attn_implementation: sdpa")
    _require(m.sliding_window is None, "`model.sliding_window` with `parallel.context_parallel` > 1 is refused (the "
                                       "context-parallel attention is causal over the whole sequence); remove it")
    _require(t.objective in ("lm", "dpo", "rm", "kto"), f"`train.objective: {t.objective}` with "
             "`parallel.context_parallel` > 1 is refused (it does not split its sequences); use context_parallel: 1")
    _require(t.objective == "lm" or t.loss_normalization == "token",
             f"`train.objective: {t.objective}` with `parallel.context_parallel` > 1 and `train.loss_normalization: "
             "micro_batch` is refused (the group's first rank counts each pair's loss); use loss_normalization: token")
    _require(recipe.peft.method is None, "`peft.method` with `parallel.context_parallel` > 1 is refused (not tested); "
                                         "use context_parallel: 1")
    chunks = 2 * cp if ring else cp
    _require(m.seq_length % chunks == 0, f"`model.seq_length` ({m.seq_length}) must be divisible by {chunks} "
                                         + ("(2 × `parallel.context_parallel`): every rank trains a head and a tail "
                                            "chunk" if ring else "(`parallel.context_parallel`): every rank trains an "
                                                                 "equal chunk"))


def _validate_ulysses(recipe: Recipe) -> None:
    m, p = recipe.model, recipe.parallel
    cp, tp = p.context_parallel, p.tensor_parallel
    split = f"`parallel.context_parallel` ({cp})" + (f" × `parallel.tensor_parallel` ({tp})" if tp > 1 else "")
    _require(m.num_attention_heads % (cp * tp) == 0,
             f"`model.num_attention_heads` ({m.num_attention_heads}) must be divisible by {split}: Ulysses gives each "
             "rank whole heads; choose a context_parallel that divides the heads")
    kv_heads = m.num_kv_heads or m.num_attention_heads
    _require(kv_heads % (cp * tp) == 0,
             f"`model.num_kv_heads` ({kv_heads}) must be divisible by {split}: Ulysses gives each rank whole key/value "
             "heads; choose a context_parallel that divides them")


def _validate_ring_attention(recipe: Recipe) -> None:
    """torch's ring attention takes no mask: causal over the whole sequence only."""
    _require(not recipe.data.isolate_documents,
             "`data.isolate_documents: true` with `parallel.context_parallel` > 1 and `parallel.backend: fsdp2` is "
             "refused: torch's ring attention is causal over the whole sequence and cannot keep packed documents "
             "apart; set isolate_documents: false or use `parallel.backend: deepspeed` (Ulysses masks documents)")


# ----------------------------------------------------------------------------------------------------------------
# Files and overrides
# ----------------------------------------------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys silently; a recipe that sets `lr` twice is a mistake to report."""


def _mapping_without_duplicates(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise RecipeError(f"{loader.name}: key `{key}` appears twice in one mapping (lines {seen[key] + 1} and "
                              f"{key_node.start_mark.line + 1}); keep one")
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def load_yaml_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}. Give a path such as recipes/tiny.yaml")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise RecipeError(f"cannot read recipe file {path}: {err}. Give a UTF-8 YAML file") from err
    try:
        raw = yaml.load(text, Loader=_loader_for(path)) or {}
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: not valid YAML: {_one_line(err)}") from err
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping of sections, got {type(raw).__name__}")
    return raw


def _loader_for(path: Path):
    def make(stream):
        loader = _UniqueKeyLoader(stream)
        loader.name = str(path)
        return loader

    return make


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def parse_overrides(argv: list[str]) -> dict:
    """`--train.lr 3e-4 --parallel.zero_stage=2` → nested dict; values are parsed as YAML scalars/lists."""
    overrides: dict = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise RecipeError(f"unexpected argument {arg!r}: overrides look like `--section.key value`")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise RecipeError(f"override `--{key}` has no value: write `--{key} VALUE`")
            value = argv[i + 1]
            i += 1
        if "." not in key:
            raise RecipeError(f"override `--{key}` must name a section and a key, e.g. `--train.lr 3e-4`")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise RecipeError(f"override `--{key}`: value {value!r} is not valid YAML ({_one_line(err)}); quote it") from err
        _set_nested(overrides, key.replace("-", "_").split("."), parsed)
        i += 1
    return overrides


def _set_nested(tree: dict, keys: list[str], value) -> None:
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    tree[keys[-1]] = value


def merge_dicts(base: dict, update: dict) -> dict:
    """Recursive merge; `update` wins. Neither input is modified."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_dicts(merged[key], value)
        else:
            merged[key] = value
    return merged

def _validate_expert_parallel(recipe: Recipe) -> None:
    """What `parallel.expert_parallel` > 1 runs (`neox_hf.parallel.expert_parallel`), each refusal naming the key and
    the fix. Whether the model has experts, and whether their number divides, is checked when the model is split."""
    p = recipe.parallel
    ep = p.expert_parallel
    _require(ep >= 1, f"`parallel.expert_parallel` must be ≥ 1, got {ep}")
    if ep == 1:
        return
    over_tensor = p.experts_over == "tensor"
    refusals = (
        (p.pipeline_parallel > 1, "`parallel.pipeline_parallel` > 1", "use pipeline_parallel: 1"),
        (p.zero_stage == 3, "`parallel.zero_stage: 3`", "use zero_stage 0-2, or `parallel.backend: fsdp2`"),
        (p.sequence_parallel, "`parallel.sequence_parallel: true`", "set sequence_parallel: false"),
        (p.dp_replicate > 1, "`parallel.dp_replicate` > 1 (HSDP)", "use dp_replicate: 1"),
        (recipe.peft.method is not None, "`peft.method`", "train the full model, or expert_parallel: 1"),
        (not over_tensor and p.tensor_parallel > 1 and p.backend != "fsdp2", "`parallel.tensor_parallel` > 1 and "
         "`parallel.experts_over: data` on DeepSpeed (its one data-parallel group cannot reduce the experts over the "
         "tensor-parallel ranks too)", "set `parallel.experts_over: tensor` (GPT-NeoX's layout: the experts split over "
         "the tensor-parallel group) with expert_parallel = tensor_parallel, or `parallel.backend: fsdp2`"),
        (over_tensor and p.tensor_parallel != ep, f"`parallel.experts_over: tensor` and `parallel.tensor_parallel: "
         f"{p.tensor_parallel}`", f"set tensor_parallel: {ep}, or experts_over: data"),
        (over_tensor and p.context_parallel > 1, "`parallel.experts_over: tensor` and `parallel.context_parallel` > 1",
         "use experts_over: data"),
    )
    for refused, what, fix in refusals:
        _require(not refused, f"`parallel.expert_parallel: {ep}` with {what} is refused (not supported); {fix}")


# ----------------------------------------------------------------------------------------------------------------
# Mixture of experts
# ----------------------------------------------------------------------------------------------------------------

_MOE_FAMILIES = {"mixtral": "llama", "gpt_neox_moe": "gpt_neox"}  # MoE family → its dense family


def _validate_moe(recipe: Recipe) -> None:
    """The `moe_*` keys against the family that builds them; what the MoE model cannot run with is refused by name."""
    m, p = recipe.model, recipe.parallel
    moe_of = {dense: moe for moe, dense in _MOE_FAMILIES.items()}
    if m.family not in _MOE_FAMILIES:
        _require(m.moe_num_experts == 1, f"`model.moe_num_experts: {m.moe_num_experts}` needs an MoE family: set "
                                         f"`model.family: {moe_of[m.family]}` ({m.family}'s layers with experts)")
        set_keys = [k for k in ("moe_top_k", "moe_router_type", "moe_jitter_eps", "moe_aux_loss_coef")
                    if getattr(m, k) is not None] + (["moe_expert_interval"] if m.moe_expert_interval != 1 else [])
        _require(not set_keys, f"`model.{set_keys[0] if set_keys else ''}` is an MoE option; set `model.family: "
                               f"{moe_of[m.family]}` and `model.moe_num_experts` > 1, or remove it")
        return
    _require(m.moe_num_experts > 1, f"`model.family: {m.family}` needs `model.moe_num_experts` > 1, got "
                                    f"{m.moe_num_experts} (for a dense model use `model.family: {_MOE_FAMILIES[m.family]}`)")
    top_k = m.moe_top_k or (2 if m.family == "mixtral" else 1)
    _require(1 <= top_k <= m.moe_num_experts, f"`model.moe_top_k` ({top_k}) must be in [1, model.moe_num_experts = "
                                              f"{m.moe_num_experts}]")
    _require(m.moe_jitter_eps is None or 0 <= m.moe_jitter_eps < 1,
             f"`model.moe_jitter_eps` must be in [0, 1), got {m.moe_jitter_eps}")
    _require(m.moe_aux_loss_coef is None or m.moe_aux_loss_coef >= 0,
             f"`model.moe_aux_loss_coef` must be ≥ 0, got {m.moe_aux_loss_coef}")
    if m.family == "mixtral":
        _require(m.moe_expert_interval == 1, "`model.moe_expert_interval` > 1 is not expressible in "
                 "MixtralForCausalLM, which has experts in every layer; set it 1 (or use `model.family: gpt_neox_moe`)")
        _require(m.moe_router_type is None, f"`model.moe_router_type: {m.moe_router_type}` is GPT-NeoX's routing, on "
                 "`model.family: gpt_neox_moe`; mixtral routes as MixtralForCausalLM (softmax top-k, renormalised): "
                 "remove it")
        _require(not m.attention_bias and not m.mlp_bias, "`model.attention_bias` / `model.mlp_bias` are not "
                 "expressible in MixtralForCausalLM, whose linears have no biases; remove them")
    else:
        _require(m.moe_expert_interval >= 1, f"`model.moe_expert_interval` must be ≥ 1, got {m.moe_expert_interval}")
        _require(not m.moe_aux_loss_coef, "`model.moe_aux_loss_coef` with `model.family: gpt_neox_moe` is refused: "
                 "GPT-NeoX's dropless MoE has no load-balancing loss (Sinkhorn balances); remove it or use mixtral")
        _require(not m.use_parallel_residual, "`model.use_parallel_residual: true` with `model.family: gpt_neox_moe` "
                 "is refused: GPT-NeoX's MoE layers under gpt_j_residual add the experts' output alone (the attention "
                 "output is lost); set it false (GPT-NeoX gpt_j_residual: false, as 125M-dmoe.yml)")
    experts = {"gate_up_proj", "up_proj", "down_proj", "gate_proj", "experts", "w1", "w2", "w3", "gate"}
    named = sorted(experts & set(recipe.peft.target_modules)) if recipe.peft.method else []
    _require(not named, f"`peft.target_modules` names {', '.join(named)}: the experts of `model.family: {m.family}` "
             "are 3-D parameters, not linear layers, and LoRA on them is not wired here; LoRA trains the attention "
             "(query_key_value / dense, or q_proj / k_proj / v_proj / o_proj): remove them")
    for refused, what in ((p.pipeline_parallel > 1, "`parallel.pipeline_parallel` > 1"),
                          (p.sequence_parallel, "`parallel.sequence_parallel: true`"),
                          (p.context_parallel > 1, "`parallel.context_parallel` > 1"),
                          (p.zero_stage == 3, "`parallel.zero_stage: 3`")):
        _require(not refused, f"{what} with `model.family: {m.family}` is refused (the experts and the router "
                              "loss are not wired into it); use tensor, expert or data parallelism with ZeRO 0–2")
