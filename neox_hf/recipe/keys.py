"""The recipe's keys: one dataclass per section, each field with its type, default and description.

This is the one place a key is described: `metadata={"help": ..., "neox": ...}` on every field gives the reference
page (`python tools/generate_docs.py`), `run_clm_neox.py --help` and the GPT-NeoX name each key translates from.
Parsing a dict into these classes is `neox_hf.recipe.build`; the rules between keys are `neox_hf.recipe.validate`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

import yaml


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
