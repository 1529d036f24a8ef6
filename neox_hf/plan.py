"""`neox_hf plan`: memory and step time per rank of a recipe on N GPUs, by arithmetic, before anything is launched.

    neox_hf plan RECIPE [MORE.yml ...] [--section.key value ...] [--gpus N] [--gpu-memory GB] [--json]

Gap filled: `accelerate estimate-memory` counts weights and Adam only; DeepSpeed's
`estimate_zero2_model_states_mem_needs` / `estimate_zero3_model_states_mem_needs` know ZeRO but not tensor or
pipeline parallelism, activations or the loss. This module knows every part of our layout (the pipeline partition of
`neox_hf.engines.pipeline`, the tensor-parallel split table of `neox_hf.parallel.tp_plan`, the DeepSpeed config
`neox_hf.parallel.accelerator` generates, the fused loss's chunking) and counts, per rank and per pipeline stage:

- params / grads / optimizer: what the engine keeps. Without DeepSpeed (one process) fp32 weights, grads and two
  Adam moments (16 bytes per parameter; bf16 is autocast over fp32 weights). Under DeepSpeed the parameters in the
  run's precision, an fp32 master copy (also when the weights are fp32 already) and two fp32 moments; ZeRO-1 and 2
  hold the data-parallel partition of the reduced gradients at the step (in 16-bit precisions also its fp32 copy,
  as DeepSpeed's estimator counts); ZeRO-1 partitions optimizer states, 2 also gradients, 3 also parameters, over the
  data-parallel group; offload moves the optimizer (and ZeRO-3's parameters) to CPU memory;
- buffers: what DeepSpeed keeps besides: its reduce bucket (`reduce_bucket_size: auto` = hidden²) and the pipeline
  engine's hidden-state buffers; ZeRO-3's gathered layer and prefetch bucket count in the step's peak;
- activations: what autograd saves per transformer layer for one micro-batch (measured layer by layer against
  transformers' GPTNeoXLayer: 3 hidden-sized tensors replicated over tensor-parallel ranks — split by sequence
  parallelism — and 14 split by them; against LlamaDecoderLayer: `_llama_layer_bytes_per_token`), × layers of the
  stage × micro-batches in flight (1F1B: stage i holds up to p − i); with activation checkpointing one input per
  layer plus one layer recomputed. Context parallelism (`parallel.context_parallel`) leaves a rank seq / context
  positions of all of it, plus, while a layer's attention runs, DeepSpeed's Ulysses all-to-all buffers or (FSDP2)
  torch's ring attention's: the whole sequence's keys and values all-gathered, and fp32 gradient buffers;
- loss: the last stage's head + cross-entropy peak: the fused loss's logits chunk (`default_chunk_rows`) and the head's
  weight gradient it computes in the forward (or whole [tokens, vocab] logits unfused).

The peak of a step (`total`) is params + optimizer + buffers + the larger of (gradients held over the step's earlier
micro-batches + activations + loss), the moment the loss runs, and the gradients at the end of backward.
tests/test_plan.py holds these numbers against steps measured on CPU (benchmarks/parallel_memory.py's way: live
tensors before the update, a whole step's peak).

For the training start-up: `plan_summary_line(recipe, gpus)` (one line for `--print-config`) and
`startup_memory_warnings(recipe, device_memory_bytes, gpus)` (a line per stage over the device's memory).
Step time: model FLOPs (`neox_hf.train.mfu.flops_per_token`, × 4/3 with activation checkpointing's recomputation)
at an assumed MFU of the GPU's datasheet peak, stretched by the pipeline bubble (p − 1)/(m + p − 1), plus
data-parallel (ring all-reduce / reduce-scatter volume of the gradients over data × context ranks), tensor-parallel
(four all-reduces of the layer's activations per layer and micro-batch) and context-parallel (Ulysses' four
all-to-alls per layer, or the ring's key/value all-gathers and fp32 key/value gradient rotation; forward and
backward) communication at stated bandwidths. Every assumption is printed.
With a GPU memory, each listed layout also gets the longest sequence it fits (`longest_sequence`), and
`--longest-sequence` ranks layouts by it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

GIB = 2**30
RESERVED_BYTES = 1 * GIB  # CUDA context, NCCL buffers and allocator slack: not available to tensors
DEFAULT_MFU = 0.4
DEFAULT_GPU = "A100"
DP_BANDWIDTH = 25e9  # bytes/s per GPU between nodes (200 Gb/s InfiniBand per GPU)
TP_BANDWIDTH = 150e9  # bytes/s per GPU inside a node (NVLink, one direction, effective)
# Tensors autograd keeps per transformer layer and micro-batch, in units of tokens × hidden (transformers'
# GPTNeoXLayer, parallel residual, sdpa; measured by saved-tensor hooks): replicated over TP ranks — the layer input
# and both layer norms' outputs — and split by TP — q, k, v, the attention output and its transposed copy, the
# dense input, the MLP's 4h input of GELU and its output.
ZERO3_SUB_GROUP_SIZE = 10**9  # DeepSpeed's default `sub_group_size` (elements), which our config leaves as it is
REPLICATED_PER_LAYER = 3
SPLIT_PER_LAYER = 14
# a context-parallel (× tensor-parallel) group up to this size talks over NVLink, beyond it over the network
GPUS_PER_NODE = 8
LONGEST_SEQUENCE_STEP = 1024  # `longest sequence`: the multiple of tokens searched (and of tensor × context)
LONGEST_SEQUENCE_CAP = 2**24  # 16M tokens: past this the table says "≥"


@dataclass(frozen=True)
class Layout:
    pipeline: int
    tensor: int
    data: int
    zero_stage: int
    micro_batch: int
    gradient_accumulation_steps: int
    activation_checkpointing: bool
    sequence_parallel: bool
    backend: str = "deepspeed"  # `parallel.backend`; fsdp2 shards like ZeRO-3 (zero_stage is then 0)
    dp_replicate: int = 1  # FSDP2's HSDP replicas: each shards over data / dp_replicate ranks
    context: int = 1  # `parallel.context_parallel`: each sequence split over this many ranks (Ulysses or ring)
    expert: int = 1  # `parallel.expert_parallel`: each MoE layer's experts split over this many ranks
    experts_over: str = "data"  # `parallel.experts_over`: data-parallel ranks, or the tensor-parallel group (ep = tp)

    @property
    def gpus(self) -> int:
        return self.pipeline * self.tensor * self.context * self.data

    @property
    def sharding_ranks(self) -> int:
        """The ranks ZeRO partitions over and gradients are reduced over: DeepSpeed's sequence-data-parallel group
        (`groups._get_sequence_data_parallel_group`), data × context, since context-parallel ranks hold the same
        weights and see different tokens; FSDP2's mesh makes its context-parallel ranks shards the same way."""
        return self.data * self.context

    @property
    def expert_data(self) -> int:
        """The ranks holding the same experts (`Layout.edp` of neox_hf.parallel.layout): their gradients are reduced,
        and ZeRO / FSDP2 shard their states, over these."""
        return self.sharding_ranks // self.expert if self.experts_over == "data" else self.sharding_ranks

    @property
    def ring(self) -> bool:
        """Context parallelism by torch's ring attention (the FSDP2 engine's), not DeepSpeed's Ulysses: its memory,
        traffic and divisibility rules differ."""
        return self.backend == "fsdp2" and self.context > 1


@dataclass
class StageBytes:
    """Bytes per rank of one pipeline stage (the whole model when pipeline = 1)."""

    stage: int
    params: int
    grads: int
    optimizer: int
    buffers: int
    activations: int
    loss: int
    total: int
    experts: int = 0  # of params + grads + optimizer, the MoE experts' bytes on this rank (their 1/ep share)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer


@dataclass
class LayoutPlan:
    layout: Layout
    stages: list[StageBytes]
    step_seconds: float
    bubble: float
    fits: bool | None = None  # None: no GPU memory given
    memory_limit: int | None = None  # bytes a rank may hold: GPU memory less the reserve
    # the longest seq_length (a multiple of LONGEST_SEQUENCE_STEP) at which this layout still fits; 0: not even
    # one step; None: not searched (no GPU memory given)
    longest_sequence: int | None = None

    @property
    def largest_stage(self) -> StageBytes:
        return max(self.stages, key=lambda s: s.total)

    def to_dict(self) -> dict:
        largest = self.largest_stage
        return {**asdict(self.layout),
                "bytes_per_rank": {key: getattr(largest, key)
                                   for key in ("params", "grads", "optimizer", "buffers", "activations", "loss", "total")},
                "stages": [asdict(s) for s in self.stages], "fits": self.fits,
                "step_seconds": self.step_seconds, "bubble": self.bubble, "longest_sequence": self.longest_sequence}


@dataclass
class Assumptions:
    gpu: str = DEFAULT_GPU
    peak_flops: float = 312e12
    mfu: float = DEFAULT_MFU
    dp_bandwidth: float = DP_BANDWIDTH
    tp_bandwidth: float = TP_BANDWIDTH
    reserved_bytes: int = RESERVED_BYTES
    mfu_source: str = "assumed; `--mfu-from RUN_DIR` takes a run's measured MFU"

    def describe(self) -> str:
        return (f"step time: model FLOPs at MFU {self.mfu:.0%} ({self.mfu_source}) of {self.gpu} "
                f"{self.peak_flops / 1e12:.0f} TFLOP/s, "
                f"data-parallel traffic at {self.dp_bandwidth / 1e9:.0f} GB/s, tensor-parallel at "
                f"{self.tp_bandwidth / 1e9:.0f} GB/s per GPU; fits: total ≤ GPU memory − "
                f"{self.reserved_bytes / GIB:.0f} GiB (CUDA context, NCCL)")


@dataclass
class Plan:
    """The recipe's own layout first, then (with `gpus`) the layouts that fit, fastest first."""

    recipe_layout: LayoutPlan
    ranked: list[LayoutPlan] = field(default_factory=list)
    considered: int = 0
    fitting: int = 0
    gpus: int | None = None
    gpu_memory_bytes: int | None = None
    assumptions: Assumptions = field(default_factory=Assumptions)
    precision: str = "fp32"
    deepspeed: bool = True
    leanest: LayoutPlan | None = None  # of the layouts considered, the one whose largest stage needs least memory
    by_longest_sequence: bool = False  # `ranked` ordered by the longest sequence each fits, not by step time
    seq_length: int = 0  # the recipe's
    note: str | None = None  # why the recipe's row is not on `gpus` (its layout does not divide them)
    host_checkpoint_bytes: int | None = None  # `train.async_checkpoint`: host memory per rank for the copy it writes

    def to_dict(self) -> dict:
        return {"gpus": self.gpus, "gpu_memory_bytes": self.gpu_memory_bytes, "precision": self.precision,
                "note": self.note, "async_checkpoint_host_bytes_per_rank": self.host_checkpoint_bytes,
                "ranked_by": "longest_sequence" if self.by_longest_sequence else "step_seconds",
                "assumptions": asdict(self.assumptions), "layouts_considered": self.considered,
                "layouts_fitting": self.fitting,
                "layouts": [p.to_dict() for p in [self.recipe_layout, *self.ranked]]}


# ----------------------------------------------------------------------------------------------------------------
# The model's shape and parameters per rank
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    config: object  # NeoXConfig at tensor parallel 1
    tokenizer_size: int
    vocab_divisible_by: int
    fixed_vocab: int | None  # model.vocab_size or a pretrained folder's: not padded per TP
    seq_length: int
    cache: dict = field(default_factory=dict, compare=False, repr=False)  # per-(pp, tp) counts: thousands of layouts

    def cached(self, key, compute):
        if key not in self.cache:
            self.cache[key] = compute()
        return self.cache[key]

    def __post_init__(self):
        # plain numbers: a transformers config's attribute access is slow, and thousands of layouts read them
        from neox_hf.model.spec import spec_for_config

        c = self.config
        spec = spec_for_config(c)
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        self.cache.update(hidden=c.hidden_size, layers=c.num_hidden_layers, heads=heads,
                          kv_heads=getattr(c, spec.kv_heads_attr, None) or heads, head_dim=head_dim,
                          intermediate=getattr(c, "intermediate_size", None) or 4 * c.hidden_size,
                          family=spec.family, embedding=f"{spec.embedding}.weight", head=f"{spec.head}.weight",
                          tied=c.tie_word_embeddings, eager=c._attn_implementation == "eager")

    def at_length(self, seq_length: int) -> "ModelShape":
        """The same model at another sequence length (sharing the counts that do not depend on it)."""
        return ModelShape(self.config, self.tokenizer_size, self.vocab_divisible_by, self.fixed_vocab, seq_length,
                          self.cache)

    @property
    def hidden(self) -> int:
        return self.cache["hidden"]

    @property
    def layers(self) -> int:
        return self.cache["layers"]

    @property
    def heads(self) -> int:
        return self.cache["heads"]

    @property
    def kv_heads(self) -> int:
        return self.cache["kv_heads"]

    def vocab_rows(self, tp: int) -> int:
        """Rows of the embedding / head on one tensor-parallel rank (GPT-NeoX pads to divisible_by × TP)."""
        return self.cached(("vocab", tp), lambda: self._vocab_rows(tp))

    def _vocab_rows(self, tp: int) -> int:
        from neox_hf.model.vocab import padded_vocab_size

        base = self.fixed_vocab or self.tokenizer_size
        vocab = base if self.fixed_vocab and base % tp == 0 else padded_vocab_size(base, self.vocab_divisible_by, tp)
        return vocab // tp


def model_shape(recipe) -> ModelShape:
    """The shape the run will build (config from the recipe or the pretrained folder, the tokenizer's size; a
    vocabulary the recipe or the folder fixes needs no tokenizer)."""
    from neox_hf.model.spec import config_class_for_folder, config_from_recipe
    from neox_hf.model.vocab import padded_vocab_size

    m = recipe.model
    if m.from_pretrained:
        config = config_class_for_folder(m.from_pretrained).from_pretrained(m.from_pretrained)
        fixed = config.vocab_size
    else:
        fixed = m.vocab_size
    tokenizer_size = 0 if fixed else _tokenizer_size(recipe.tokenizer.path, recipe.tokenizer.eos_token,
                                                     recipe.tokenizer.pad_token)
    if not m.from_pretrained:
        vocab = fixed or padded_vocab_size(tokenizer_size, m.make_vocab_size_divisible_by)
        config = config_from_recipe(m, vocab_size=vocab)
    config._attn_implementation = m.attn_implementation
    return ModelShape(config, tokenizer_size, m.make_vocab_size_divisible_by, fixed, m.seq_length)


@functools.lru_cache(maxsize=8)
def _tokenizer_size(path: str, eos_token: str, pad_token: str) -> int:
    from neox_hf.data.tokenizer import load_tokenizer

    return len(load_tokenizer(path, eos_token=eos_token, pad_token=pad_token))


@functools.lru_cache(maxsize=8)
def _pipeline_layer_tensors(config_json: str) -> tuple[tuple[tuple[str, int, bool], ...], ...]:
    """Per pipeline layer: (parameter name, elements at TP 1, split over TP ranks) of each tensor, from a model
    described on the meta device (nothing allocated)."""
    import torch

    from neox_hf.engines.pipeline import pipeline_layer_infos
    from neox_hf.model.spec import SPECS
    from neox_hf.parallel.tp_plan import partition_dim

    raw = json.loads(config_json)
    spec = next(spec for spec in SPECS.values() if raw.get("model_type") in spec.model_types)
    model_class = spec.model_class(SimpleNamespace(**raw))  # the class is chosen by model_type alone
    config = model_class.config_class.from_dict(raw)
    with torch.device("meta"):
        model = model_class(config)
    layers = []
    for info in pipeline_layer_infos(config):
        tensors = []
        for path in info.paths:
            for name, p in model.get_submodule(path).named_parameters():
                key = f"{path}.{name}"
                tensors.append((key, p.numel(), partition_dim(key) is not None))
        layers.append(tuple(tensors))
    return tuple(layers)


def layer_parameters_per_rank(shape: ModelShape, tp: int) -> list[int]:
    """Parameters of each pipeline layer on one tensor-parallel rank (the split table's rule per tensor)."""
    return shape.cached(("layers", tp), lambda: _layer_parameters_per_rank(shape, tp))


def _layer_parameters_per_rank(shape: ModelShape, tp: int) -> list[int]:
    counts = []
    for tensors in shape.cached("tensors", lambda: _pipeline_layer_tensors(shape.config.to_json_string())):
        total = 0
        for key, numel, split in tensors:
            if key in (shape.cache["embedding"], shape.cache["head"]):
                total += shape.vocab_rows(tp) * shape.hidden
            else:
                total += numel // tp if split else numel
        counts.append(total)
    return counts


def stage_bounds(shape: ModelShape, pp: int, method: str) -> list[int]:
    from neox_hf.engines.pipeline import partition_stages

    if pp == 1:
        return [0, len(layer_parameters_per_rank(shape, 1))]
    return shape.cached(("parts", pp, method), lambda: partition_stages(shape.config, pp, method))


def stage_parameters(shape: ModelShape, pp: int, tp: int, method: str) -> list[int]:
    """Parameters per rank of each stage; a tied embedding counts on both end stages (DeepSpeed's TiedLayerSpec),
    once without stages."""
    return shape.cached(("stages", pp, tp, method), lambda: _stage_parameters(shape, pp, tp, method))


def _stage_parameters(shape: ModelShape, pp: int, tp: int, method: str) -> list[int]:
    counts, parts = layer_parameters_per_rank(shape, tp), stage_bounds(shape, pp, method)
    per_stage = [sum(counts[parts[s]:parts[s + 1]]) for s in range(len(parts) - 1)]
    if pp == 1 and shape.cache["tied"]:
        per_stage[0] -= counts[-1]
    return per_stage


def stage_transformer_layers(shape: ModelShape, pp: int, method: str) -> list[int]:
    return shape.cached(("stage layers", pp, method), lambda: _stage_transformer_layers(shape, pp, method))


def _stage_transformer_layers(shape: ModelShape, pp: int, method: str) -> list[int]:
    from neox_hf.engines.pipeline import pipeline_layer_infos

    infos, parts = shape.cached("infos", lambda: pipeline_layer_infos(shape.config)), stage_bounds(shape, pp, method)
    return [sum(i.name == "TransformerLayerPipe" for i in infos[parts[s]:parts[s + 1]]) for s in range(len(parts) - 1)]


# ----------------------------------------------------------------------------------------------------------------
# Bytes
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Engine:
    """What keeps the model states: DeepSpeed or not, its precision, ZeRO stage and offload."""

    precision: str  # fp32 / bf16 / fp16
    deepspeed: bool
    zero_stage: int
    data: int
    offload_optimizer: bool = False
    offload_params: bool = False
    fsdp2: bool = False  # torch's fully_shard: fp32 shards of params, grads and Adam over `shard` ranks
    shard: int = 1

    @property
    def weight_bytes(self) -> int:
        """Bytes per parameter as the engine holds it: 16-bit only under DeepSpeed (autocast keeps fp32 weights;
        FSDP2 keeps fp32 shards and casts a layer when it gathers it)."""
        return 2 if self.deepspeed and self.precision in ("bf16", "fp16") else 4

    @property
    def activation_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2


def model_state_bytes(params: int, engine: Engine) -> dict[str, int]:
    """params / grads (at the optimizer step) / optimizer bytes per rank for `params` parameters on this rank."""
    w, d, stage = engine.weight_bytes, engine.data, engine.zero_stage
    if engine.fsdp2:  # every state an fp32 shard (MixedPrecisionPolicy casts only the gathered layer)
        partition = math.ceil(params / engine.shard)
        return {"params": 4 * partition, "grads": 4 * partition, "optimizer": 8 * partition}
    if not engine.deepspeed:
        return {"params": 4 * params, "grads": 4 * params, "optimizer": 8 * params}
    sixteen_bit = w == 2
    master = 4 * params if sixteen_bit else 0  # ZeRO-0: fp32 master only when the weights are 16-bit
    if stage == 0:
        return {"params": w * params, "grads": w * params + (4 * params if sixteen_bit else 0),
                "optimizer": master + 8 * params}
    partition = math.ceil(params / d)
    # The reduced gradients' partition, and in 16-bit precisions its fp32 copy the optimizer step reads (ZeRO-3
    # makes it one optimizer sub-group at a time).
    fp32_copy = min(partition, ZERO3_SUB_GROUP_SIZE) if stage == 3 else partition
    grads = w * partition + (4 * fp32_copy if sixteen_bit else 0)
    optimizer = 12 * partition  # fp32 master + two Adam moments, whatever the weights' dtype
    weights = w * partition if stage == 3 else w * params
    if engine.offload_optimizer:
        optimizer, grads = 0, w * partition
    if engine.offload_params and stage == 3:
        weights = 0
    return {"params": weights, "grads": grads, "optimizer": optimizer}


def backward_gradient_bytes(params: int, engine: Engine) -> int:
    """Gradient bytes alive at the end of a backward: whole gradients until the reduction at the accumulation
    boundary (no DeepSpeed, ZeRO-0 and ZeRO-1), the partition for ZeRO-2/3 (reduced while backward runs)."""
    if engine.fsdp2:  # reduce-scattered layer by layer while backward runs
        return 4 * math.ceil(params / engine.shard)
    if not engine.deepspeed or engine.zero_stage <= 1:
        return engine.weight_bytes * params
    return engine.weight_bytes * math.ceil(params / engine.data)


def deepspeed_buffer_bytes(shape: ModelShape, engine: Engine, largest_layer: int) -> int:
    """DeepSpeed's reduce bucket (`reduce_bucket_size: auto` = hidden² elements, as accelerate fills it)."""
    if not engine.deepspeed or engine.zero_stage == 0 or engine.data == 1:
        return 0
    return engine.weight_bytes * shape.hidden ** 2


def zero3_gathered_bytes(shape: ModelShape, engine: Engine, largest_layer: int) -> int:
    """ZeRO-3's parameters gathered whole while a layer runs: the largest layer and the prefetch bucket
    (`stage3_prefetch_bucket_size: auto` = 0.9 × hidden²)."""
    if engine.fsdp2:  # the running layer and the one prefetched, gathered in the compute dtype
        return 0 if engine.shard == 1 else 2 * engine.activation_bytes * largest_layer
    if not (engine.deepspeed and engine.zero_stage == 3 and engine.data > 1):
        return 0
    return engine.weight_bytes * (largest_layer + int(0.9 * shape.hidden ** 2))


def zero3_gathered_layer_bytes(engine: Engine, largest_layer: int) -> int:
    """The largest layer's parameters and gradient, whole, in the weights' dtype (DeepSpeed's estimator: 4 bytes ×
    the largest layer's parameters in 16-bit)."""
    return 2 * engine.weight_bytes * largest_layer


def local_tokens(shape: ModelShape, layout: Layout) -> int:
    """Tokens of one micro-batch on one rank: context parallelism gives each rank seq_length / context of them."""
    return layout.micro_batch * shape.seq_length // layout.context


def pipeline_buffer_bytes(shape: ModelShape, layout: Layout, stage: int, element: int) -> int:
    """Hidden-state buffers DeepSpeed's PipelineEngine keeps between steps (measured): the first stage the received
    gradient; the others the receive buffer and, per pipe buffer (max(2, min(p − i, m)), its TrainSchedule), the
    input, that input's gradient and the tensor sent on."""
    if layout.pipeline == 1:
        return 0
    hidden = local_tokens(shape, layout) * shape.hidden * element
    if stage == 0:
        return hidden
    buffers = max(2, min(layout.pipeline - stage, layout.gradient_accumulation_steps))
    return hidden * (1 + 3 * buffers)


def layer_activation_bytes(shape: ModelShape, layout: Layout, element: int) -> int:
    """Bytes autograd keeps for one transformer layer and one micro-batch, per tensor- and context-parallel rank.
    Under context parallelism a rank keeps its seq / context positions of everything but attention's q, k, v and
    output, which after Ulysses' all-to-all are the whole sequence's for heads / context of the heads: as many
    elements, so the whole layer falls by the context-parallel size. The ring keeps its own positions of all heads,
    its keys and values repeated to the query heads (grouped-query attention expanded before the ring)."""
    t, tokens = layout.tensor, local_tokens(shape, layout)
    if shape.cache["family"] in ("llama", "mixtral"):  # Mixtral: Llama attention, plus its experts below
        kv_heads = shape.heads if layout.ring else shape.kv_heads
        per_token = _llama_layer_bytes_per_token(shape, t, layout.sequence_parallel, element, kv_heads)
        per_token += moe_layer_extra_bytes_per_token(shape, layout, element)  # 0 for a dense model
    else:
        replicated = REPLICATED_PER_LAYER * shape.hidden / (t if layout.sequence_parallel else 1)
        per_token = (replicated + SPLIT_PER_LAYER * shape.hidden / t) * element
    scores = 0
    if shape.cache["eager"]:  # scores and probabilities, [batch, heads / (t × c), seq, seq]
        scores = 2 * layout.micro_batch * shape.heads * shape.seq_length ** 2 / (t * layout.context) * element
    return int(per_token * tokens + scores)


def _llama_layer_bytes_per_token(shape: ModelShape, tp: int, sequence_parallel: bool, element: int,
                                 kv_heads: int | None = None) -> float:
    """transformers' LlamaDecoderLayer (sdpa), measured by saved-tensor hooks (tests/test_plan.py holds it to a
    measurement): per RMSNorm its input in fp32 (the norm upcasts), the normalised value and its weighted output
    (replicated over tensor-parallel ranks, split by sequence parallelism) plus an fp32 rsqrt per token; split by
    tensor parallelism: q and the attention output (heads × head_dim), k and v (kv_heads × head_dim), sdpa's fp32
    log-sum-exp per head, and four MLP tensors of the intermediate width (gate, its SiLU, up, their product).
    `kv_heads`: the key/value heads attention saves (default the model's)."""
    c = shape.cache
    kv_heads = c["kv_heads"] if kv_heads is None else kv_heads
    replicated = 2 * ((4 + 2 * element) * c["hidden"] + 4) / (tp if sequence_parallel else 1)
    split = (element * (2 * c["heads"] * c["head_dim"] + 2 * kv_heads * c["head_dim"] + 4 * c["intermediate"])
             + 4 * c["heads"]) / tp
    return replicated + split


def all_to_all_bytes(shape: ModelShape, layout: Layout, element: int) -> int:
    """Context parallelism's transient buffers while one layer's attention runs (DeepSpeed's
    `UlyssesSPAttentionHF`): q, k and v each copied into the all-to-all's send layout and received, and the
    output sent back the same way; one layer at a time, in the forward and again in the backward."""
    if layout.context == 1:
        return 0
    c = shape.cache
    width = (2 * c["heads"] + 2 * c["kv_heads"]) * c["head_dim"] / layout.tensor
    return int(2 * width * local_tokens(shape, layout) * element)


def ring_width(shape: ModelShape, layout: Layout) -> float:
    """Elements per token of keys (or values) on a tensor-parallel rank in torch's ring: all query heads' worth,
    since key/value heads are repeated to the query heads before the ring."""
    return shape.heads * shape.cache["head_dim"] / layout.tensor


def ring_buffer_bytes(shape: ModelShape, layout: Layout, element: int) -> int:
    """torch's ring attention's transient buffers while one layer's attention runs (its backward, the larger): the
    all-gather rotater materialises the whole sequence's keys and values (the forward does too), and the backward
    adds fp32 gradients of the local q, k and v and the fp32 key/value gradients it passes round the ring."""
    if layout.context == 1:
        return 0
    width, local = ring_width(shape, layout), local_tokens(shape, layout)
    whole_kv = 2 * width * local * layout.context * element
    return int(whole_kv + 3 * width * local * 4 + 2 * width * local * 4)


def context_parallel_buffer_bytes(shape: ModelShape, layout: Layout, element: int) -> int:
    """The context-parallel attention's transient bytes for one layer: the ring's under FSDP2, Ulysses' else."""
    return (ring_buffer_bytes if layout.ring else all_to_all_bytes)(shape, layout, element)


def stage_activation_bytes(shape: ModelShape, layout: Layout, layers: int, stage: int, element: int) -> int:
    """Activations of a stage's layers for the micro-batches it holds (1F1B: stage i holds up to p − i), plus the
    hidden states entering the final norm and the head."""
    in_flight = min(layout.pipeline - stage, layout.gradient_accumulation_steps) if layout.pipeline > 1 else 1
    per_layer = layer_activation_bytes(shape, layout, element)
    layer_input = local_tokens(shape, layout) * shape.hidden * element
    if layout.sequence_parallel:
        layer_input //= layout.tensor
    if layout.activation_checkpointing:
        # each layer keeps its input; backward recomputes one layer (of one micro-batch) at a time
        kept = in_flight * layers * layer_input + per_layer
    else:
        kept = in_flight * layers * per_layer
    return kept + 2 * layer_input


def loss_bytes(shape: ModelShape, layout: Layout, fused: bool, engine: Engine) -> int:
    """Peak of the head + cross-entropy on the last stage, beyond the activations: the fused loss's fp32 logits
    chunk (plus its 16-bit copy), the head's weight gradient it computes in the forward, the hidden states'
    gradient; unfused, whole [tokens, vocab/TP] logits, their log-softmax and gradient."""
    from neox_hf.ops.linear_cross_entropy import default_chunk_rows

    vocab, hidden = shape.vocab_rows(layout.tensor), shape.hidden
    tokens = local_tokens(shape, layout)  # each context-parallel rank's loss runs on its own positions
    sixteen_bit = engine.activation_bytes == 2
    if not fused:  # logits, their fp32 log-softmax and its gradient (+ the 16-bit logits)
        return tokens * vocab * (4 * 3 + (2 if sixteen_bit else 0))
    rows = min(tokens, default_chunk_rows(vocab, hidden))
    logits = rows * vocab * (4 + (2 if sixteen_bit else 0))
    weight_grad = vocab * hidden * (4 + (engine.weight_bytes if engine.weight_bytes == 2 else 0))
    return logits + weight_grad + tokens * hidden * 4


def stage_bytes(shape: ModelShape, layout: Layout, engine: Engine, fused_loss: bool, method: str) -> list[StageBytes]:
    params = stage_parameters(shape, layout.pipeline, layout.tensor, method)
    layers = stage_transformer_layers(shape, layout.pipeline, method)
    largest_layer = largest_layer_on_rank(shape, layout)  # the embedding and head are layers too
    stages = []
    for s, (n, n_layers) in enumerate(zip(params, layers)):
        parts = model_state_parts(shape, layout, engine, n)  # a dense model: [(n, engine)]
        states = {k: sum(model_state_bytes(m, e)[k] for m, e in parts) for k in ("params", "grads", "optimizer")}
        activations = stage_activation_bytes(shape, layout, n_layers, s, engine.activation_bytes)
        loss = loss_bytes(shape, layout, fused_loss, engine) if s == layout.pipeline - 1 else 0
        buffers = (deepspeed_buffer_bytes(shape, engine, largest_layer)
                   + pipeline_buffer_bytes(shape, layout, s, engine.activation_bytes))
        # ZeRO-3 keeps its gradient partition in one flat buffer from step to step
        held_grads = engine.weight_bytes * math.ceil(n / engine.data) if engine.deepspeed and engine.zero_stage == 3 else 0
        persistent = states["params"] + states["optimizer"] + buffers + held_grads
        grads_at_backward = sum(backward_gradient_bytes(m, e) for m, e in parts) - held_grads
        # Over several micro-batches (accumulation, a pipeline's) the gradients of the earlier ones are held while
        # the next runs its forward and loss; with one, the loss's moment precedes every gradient but the head's.
        accumulated = grads_at_backward if layout.gradient_accumulation_steps > 1 else 0
        one_layer = (layer_activation_bytes(shape, layout, engine.activation_bytes)
                     + context_parallel_buffer_bytes(shape, layout, engine.activation_bytes))
        gathered = zero3_gathered_bytes(shape, engine, largest_layer)  # + that layer's whole gradient in backward
        peak = max(accumulated + activations + max(loss, one_layer) + gathered,  # a backward's transients: ~one layer's
                   grads_at_backward + 2 * one_layer + 2 * gathered, states["grads"] - held_grads)
        stages.append(StageBytes(s, states["params"], states["grads"], states["optimizer"], buffers, activations, loss,
                                 persistent + peak, expert_state_bytes(parts)))
    return stages


# ----------------------------------------------------------------------------------------------------------------
# Time
# ----------------------------------------------------------------------------------------------------------------


def step_seconds(shape: ModelShape, layout: Layout, engine: Engine, params_per_rank: int, assumptions: Assumptions,
                 ) -> float:
    """Compute at the assumed MFU stretched by the pipeline bubble, plus data- and tensor-parallel traffic."""
    from neox_hf.train.mfu import flops_per_token

    micro = layout.gradient_accumulation_steps
    tokens = layout.micro_batch * micro * layout.data * shape.seq_length  # a context-parallel group shares a sequence
    per_token = shape.cached(("flops", shape.seq_length), lambda: flops_per_token(shape.config, shape.seq_length))
    flops = per_token * tokens * (4 / 3 if layout.activation_checkpointing else 1)
    compute = flops / layout.gpus / (assumptions.peak_flops * assumptions.mfu)
    compute /= 1 - bubble(layout)
    # gradients are reduced over the data × context-parallel ranks (DeepSpeed's group: the expert-data-parallel
    # ranks when experts are over data, `engine_for`)
    d = engine.data if engine.deepspeed else layout.sharding_ranks
    ring = 2 * (d - 1) / d * engine.weight_bytes * params_per_rank * (1.5 if engine.zero_stage == 3 else 1)
    if engine.fsdp2:
        # each shard group all-gathers every layer twice (forward, backward; compute dtype) and reduce-scatters its
        # fp32 gradient; HSDP's replicas then all-reduce their shards
        s, r = engine.shard, layout.dp_replicate
        ring = ((s - 1) / s * params_per_rank * (2 * engine.activation_bytes + 4)
                + 2 * (r - 1) / r * 4 * params_per_rank / s)
    t = layout.tensor
    layers_micro = shape.layers / layout.pipeline * micro
    tp_volume = (4 * 2 * (t - 1) / t * local_tokens(shape, layout) * shape.hidden * engine.activation_bytes
                 * layers_micro)
    return (compute + ring / assumptions.dp_bandwidth + tp_volume / assumptions.tp_bandwidth
            + context_parallel_seconds(shape, layout, engine, assumptions)
            + expert_seconds(shape, layout, engine, params_per_rank, assumptions))


def context_parallel_seconds(shape: ModelShape, layout: Layout, engine: Engine, assumptions: Assumptions) -> float:
    """Ulysses' four all-to-alls per layer (q, k and v in, the output back) in the forward, again for their
    gradients in the backward, and once more in checkpointing's recomputed forward: each rank sends (c − 1) / c of
    its share. The ring's traffic per layer: `ring_bytes_per_layer`. Over NVLink while tensor × context fits in a
    node, over the network beyond it."""
    c = layout.context
    if c == 1:
        return 0.0
    if layout.ring:
        per_step = ring_bytes_per_layer(shape, layout, engine.activation_bytes)
    else:
        passes = 3 if layout.activation_checkpointing else 2
        per_step = all_to_all_bytes(shape, layout, engine.activation_bytes) / 2 * (c - 1) / c * passes
    volume = per_step * shape.layers / layout.pipeline * layout.gradient_accumulation_steps
    inside_node = layout.tensor * c <= GPUS_PER_NODE
    return volume / (assumptions.tp_bandwidth if inside_node else assumptions.dp_bandwidth)


def ring_bytes_per_layer(shape: ModelShape, layout: Layout, element: int) -> float:
    """Bytes a rank receives in one layer of one micro-batch under torch's ring attention: the other ranks' keys
    and values all-gathered in each forward (twice with checkpointing's recompute) and again in the backward, and
    the fp32 key/value gradients passed on at each of the backward's c − 1 steps."""
    c, width, local = layout.context, ring_width(shape, layout), local_tokens(shape, layout)
    gather = 2 * width * local * c * element * (c - 1) / c
    forwards = 2 if layout.activation_checkpointing else 1
    return gather * (forwards + 1) + 2 * width * local * 4 * (c - 1)


def bubble(layout: Layout) -> float:
    from neox_hf.engines.pipeline import bubble_fraction

    return bubble_fraction(layout.pipeline, layout.gradient_accumulation_steps) if layout.pipeline > 1 else 0.0


# ----------------------------------------------------------------------------------------------------------------
# Plans
# ----------------------------------------------------------------------------------------------------------------


def recipe_precision(recipe) -> str:
    from neox_hf.recipe.precision import resolve_precision

    return resolve_precision(recipe.train)


def recipe_layout(recipe, gpus: int | None = None) -> Layout:
    """The recipe's layout on `gpus`. A recipe with a train_batch_size (GPT-NeoX's) keeps it: without `gpus` on the
    data-parallel size that reaches it, on `gpus` with the accumulation that does (`check_gpus_hold_layout` refuses
    a count where none does)."""
    from neox_hf.recipe import accumulation_for_train_batch, data_parallel_for_train_batch

    p, t = recipe.parallel, recipe.train
    model_parallel = p.pipeline_parallel * p.tensor_parallel * p.context_parallel
    if gpus is None:
        dp = least_expert_data(p, data_parallel_for_train_batch(t) or 1)
    else:
        dp = max(1, gpus // model_parallel)
    accumulation = accumulation_for_train_batch(t, dp) or t.gradient_accumulation_steps
    return Layout(p.pipeline_parallel, p.tensor_parallel, dp, p.zero_stage, t.micro_batch_size, accumulation,
                  p.activation_checkpointing, p.sequence_parallel, p.backend, p.dp_replicate, p.context_parallel,
                  p.expert_parallel, p.experts_over)


def engine_for(recipe, layout: Layout, precision: str) -> Engine:
    p = recipe.parallel
    if layout.backend == "fsdp2":
        # each HSDP replica shards over its data ranks × their context-parallel ranks (the engine's `dp_shard`)
        shards = max(1, layout.sharding_ranks // layout.dp_replicate)
        return Engine(precision, False, 0, layout.sharding_ranks, fsdp2=True, shard=shards)
    deepspeed = layout.gpus > 1 or layout.zero_stage > 0 or bool(p.use_deepspeed) or p.deepspeed_config is not None
    # ZeRO partitions over DeepSpeed's sequence-data-parallel group: data × context ranks
    return Engine(precision, deepspeed, layout.zero_stage, deepspeed_data_ranks(layout), p.offload_optimizer,
                  p.offload_params)


def plan_layout(recipe, shape: ModelShape, layout: Layout, precision: str, assumptions: Assumptions,
                gpu_memory_bytes: int | None) -> LayoutPlan:
    engine = engine_for(recipe, layout, precision)
    method = recipe.parallel.pipe_partition_method
    stages = stage_bytes(shape, layout, engine, recipe.train.fused_cross_entropy, method)
    dense = max(stage_parameters(shape, layout.pipeline, layout.tensor, method)) - expert_parameters(shape)
    seconds = step_seconds(shape, layout, engine, dense, assumptions)
    limit = None if gpu_memory_bytes is None else gpu_memory_bytes - assumptions.reserved_bytes
    fits = None if limit is None else max(s.total for s in stages) <= limit
    return LayoutPlan(layout, stages, seconds, bubble(layout), fits, limit)


def longest_sequence(recipe, shape: ModelShape, layout: Layout, precision: str, limit: int) -> int:
    """The longest seq_length, a multiple of LONGEST_SEQUENCE_STEP (and of the ranks a sequence is split over), at
    which `layout`'s largest rank stays within `limit` bytes; 0 when not even the first multiple fits, the cap
    (LONGEST_SEQUENCE_CAP) when that fits. Memory only grows with the length, so doubling then bisecting finds it."""
    engine = engine_for(recipe, layout, precision)
    method, fused = recipe.parallel.pipe_partition_method, recipe.train.fused_cross_entropy
    step = math.lcm(LONGEST_SEQUENCE_STEP, sequence_divisor(layout))

    def fits(multiple: int) -> bool:
        at = shape.at_length(multiple * step)
        return max(s.total for s in stage_bytes(at, layout, engine, fused, method)) <= limit

    cap = LONGEST_SEQUENCE_CAP // step
    if not fits(1):
        return 0
    low = 1  # fits; double until a multiple does not, then bisect between
    while low < cap and fits(min(2 * low, cap)):
        low = min(2 * low, cap)
    if low == cap:
        return cap * step
    high = min(2 * low, cap)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low * step


def sequence_divisor(layout: Layout) -> int:
    """What seq_length must divide by: the ring's 2 × context head-tail chunks, Ulysses' context chunks, and the
    tensor-parallel ranks that sequence parallelism splits it over."""
    if layout.ring:
        return 2 * layout.context
    return layout.context * (layout.tensor if layout.sequence_parallel else 1)


def candidate_layouts(recipe, shape: ModelShape, gpus: int, global_batch: int, micro_batches=None) -> list[Layout]:
    """Every pipeline × tensor × context × data factorisation of `gpus`, ZeRO stage — or FSDP2 without pipeline
    stages, with each HSDP replica count —, micro batch (accumulation keeping the global batch; `micro_batches`
    restricts them), activation checkpointing and sequence parallelism the recipe's validation would accept.
    Context parallelism goes with tensor parallelism, not with pipeline stages or TP's sequence parallelism: with
    DeepSpeed and ZeRO 0–3 it is Ulysses (query and key/value heads must divide by tensor × context, the sequence by
    context), with FSDP2 torch's ring attention (heads must divide by tensor only, the sequence by 2 × context)."""
    heads = shape.heads
    layouts = []
    for pp in _divisors(gpus):
        if pp > shape.layers:
            continue
        for tp in _divisors(gpus // pp):
            if heads % tp:
                continue
            for cp in _divisors(gpus // (pp * tp)):
                dp = gpus // (pp * tp * cp)
                if global_batch % dp:
                    continue
                for backend, zero, replicas in _sharding_options(shape, pp, tp, cp, dp):
                    for micro in _divisors(global_batch // dp):
                        if micro_batches is not None and micro not in micro_batches:
                            continue
                        gas = global_batch // dp // micro
                        for checkpointing in (False, True):
                            for sp in _sequence_parallel_options(pp, tp, shape.seq_length) if cp == 1 else (False,):
                                layouts.append(Layout(pp, tp, dp, zero, micro, gas, checkpointing, sp, backend,
                                                      replicas, cp))
    return moe_layouts(shape, layouts)


def _sharding_options(shape: ModelShape, pp: int, tp: int, cp: int, dp: int) -> list[tuple[str, int, int]]:
    """(backend, ZeRO stage, HSDP replicas) of the layouts a pp × tp × cp × dp split may take: DeepSpeed's ZeRO
    stages where its context parallelism (Ulysses) fits, FSDP2 with every replica count where its (the ring) does."""
    options = []
    if cp == 1 or _context_parallel_fits(shape, pp, tp, cp):
        options += [("deepspeed", zero, 1) for zero in _zero_stages(pp, tp)]
    if pp == 1 and (cp == 1 or _ring_fits(shape, tp, cp)):
        options += [("fsdp2", 0, replicas) for replicas in _divisors(dp)]
    return options


def _context_parallel_fits(shape: ModelShape, pp: int, tp: int, cp: int) -> bool:
    """Ulysses: each rank takes whole query and key/value heads of the whole sequence."""
    return (pp == 1 and shape.heads % (tp * cp) == 0 and shape.kv_heads % (tp * cp) == 0
            and shape.seq_length % cp == 0)


def _ring_fits(shape: ModelShape, tp: int, cp: int) -> bool:
    """The ring: each rank keeps every head of its tensor-parallel split and two of the 2 × cp head-tail chunks."""
    return shape.heads % tp == 0 and shape.kv_heads % tp == 0 and shape.seq_length % (2 * cp) == 0


def _zero_stages(pp: int, tp: int) -> list[int]:
    # recipe validation: pipelines take ZeRO ≤ 1, tensor parallelism no ZeRO-3
    return [s for s in (0, 1, 2, 3) if not (pp > 1 and s > 1) and not (tp > 1 and s == 3)]


def _sequence_parallel_options(pp: int, tp: int, seq: int) -> tuple[bool, ...]:
    return (False, True) if tp > 1 and pp == 1 and seq % tp == 0 else (False,)


def _divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in √n steps (`--gpus 1000000000` counted to a billion: 242 s)."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return small + [n // k for k in reversed(small) if k * k != n]


def plan_for_recipe(recipe, gpus: int | None = None, gpu_memory_bytes: int | None = None, *, top: int = 10,
                    assumptions: Assumptions | None = None, precision: str | None = None,
                    by_longest_sequence: bool = False) -> Plan:
    """The plan of `recipe`: its own layout (on `gpus`, default pipeline × tensor × context), and with `gpus` every
    layout that fits `gpu_memory_bytes`, fastest first (the `top` of them). With `gpu_memory_bytes` each listed
    layout also gets the longest sequence it fits; `by_longest_sequence` ranks the layouts at micro batch 1 by it
    instead (longest first, then fastest). `precision` stands for `train.precision: auto` (default: what `auto`
    resolves to on this machine)."""
    assumptions = assumptions or Assumptions()
    shape = model_shape(recipe)
    precision = recipe.train.precision if recipe.train.precision != "auto" else precision or recipe_precision(recipe)
    note = recipe_layout_off_gpus(recipe, gpus)
    own_layout = recipe_layout(recipe, None if note else gpus)
    own = plan_layout(recipe, shape, own_layout, precision, assumptions, gpu_memory_bytes)
    plan = Plan(own, gpus=gpus, gpu_memory_bytes=gpu_memory_bytes, assumptions=assumptions, precision=precision,
                deepspeed=engine_for(recipe, own_layout, precision).deepspeed, note=note)
    if gpus is not None:
        global_batch = (recipe.train.train_batch_size  # a GPT-NeoX config's batch: every layout proposed keeps it
                        or own_layout.micro_batch * own_layout.gradient_accumulation_steps * own_layout.data)
        micro_batches = {1} if by_longest_sequence else None
        plans = [plan_layout(recipe, shape, layout, precision, assumptions, gpu_memory_bytes)
                 for layout in candidate_layouts(recipe, shape, gpus, global_batch, micro_batches)]
        fitting = [p for p in plans if p.fits is not False]
        plan.considered, plan.fitting = len(plans), len(fitting)
        plan.leanest = min(plans, key=lambda p: p.largest_stage.total, default=None)
        if by_longest_sequence and gpu_memory_bytes is not None:
            for p in plans:
                p.longest_sequence = longest_sequence(recipe, shape, p.layout, precision, p.memory_limit)
            plan.ranked = sorted((p for p in plans if p.longest_sequence),
                                 key=lambda p: (-p.longest_sequence, p.step_seconds))[:top]
        else:
            plan.ranked = sorted(fitting, key=lambda p: (p.step_seconds, p.largest_stage.total))[:top]
    plan.by_longest_sequence, plan.seq_length = by_longest_sequence, shape.seq_length
    plan.host_checkpoint_bytes = async_checkpoint_host_bytes(recipe, shape, own_layout)
    if gpu_memory_bytes is not None:
        for p in [own, *plan.ranked]:
            if p.longest_sequence is None:
                p.longest_sequence = longest_sequence(recipe, shape, p.layout, precision, p.memory_limit)
    return plan


# ----------------------------------------------------------------------------------------------------------------
# For the training start-up and --print-config
# ----------------------------------------------------------------------------------------------------------------


def plan_summary_line(recipe, gpus: int | None = None) -> str:
    """One line: the recipe's layout and its largest rank's bytes (for `--print-config`)."""
    plan = plan_for_recipe(recipe, gpus)
    largest = plan.recipe_layout.largest_stage
    return (f"plan: {describe_layout(plan.recipe_layout.layout)}, {plan.precision}: "
            f"{_gib(largest.total)} GiB per rank at most (stage {largest.stage}: params {_gib(largest.params)}, grads "
            f"{_gib(largest.grads)}, optimizer {_gib(largest.optimizer)}, activations {_gib(largest.activations)}, "
            f"loss {_gib(largest.loss)} GiB); `neox_hf plan` for other layouts")


def startup_memory_warnings(recipe, device_memory_bytes: int, gpus: int | None = None) -> list[str]:
    """One line per pipeline stage whose planned peak exceeds `device_memory_bytes` less the CUDA context's reserve
    (empty when all fit), as `neox_hf plan --gpu-memory` decides `fits`."""
    plan = plan_for_recipe(recipe, gpus)
    layout = plan.recipe_layout
    limit = device_memory_bytes - plan.assumptions.reserved_bytes
    where = "" if layout.layout.pipeline == 1 else " of stage {stage}"
    return [f"warning: the plan puts {_gib(s.total)} GiB on each rank{where.format(stage=s.stage)} ({describe_layout(layout.layout)}), "
            f"more than this GPU's {_gib(device_memory_bytes)} GiB: expect out-of-memory; run `neox_hf plan "
            f"RECIPE --gpus {layout.layout.gpus} --gpu-memory {device_memory_bytes / GIB:.0f}` for layouts that fit"
            for s in layout.stages if s.total > limit]


def gpu_memory_warnings(recipe, layout) -> list[str]:
    """On a GPU: a line per pipeline stage whose planned peak exceeds this device's memory (the hook the training
    entry point hands `neox_hf.train.loop.train`, printed before the model is built); nothing elsewhere."""
    import torch

    if not torch.cuda.is_available():
        return []
    memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return startup_memory_warnings(recipe, memory, gpus=layout.world_size)


# ----------------------------------------------------------------------------------------------------------------
# Mixture of experts: the expert dimension
# ----------------------------------------------------------------------------------------------------------------


def moe_settings(shape: ModelShape) -> tuple[int, int, int]:
    """(experts per MoE layer, experts each token is routed to, MoE layers) of the model; (1, 1, 0) for a dense one.
    Mixtral's config names them num_local_experts / num_experts_per_tok, GPT-NeoX's dMoE moe_num_experts /
    moe_top_k / moe_expert_interval (layer i is MoE when i % interval == 0)."""
    return shape.cached("moe", lambda: _moe_settings(shape.config))


def _moe_settings(config) -> tuple[int, int, int]:
    experts = getattr(config, "num_local_experts", None) or getattr(config, "moe_num_experts", None) or 1
    if experts <= 1:
        return 1, 1, 0
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "moe_top_k", None) or 1
    interval = getattr(config, "moe_expert_interval", None) or 1
    return experts, top_k, len(range(0, config.num_hidden_layers, interval))


def expert_parameters(shape: ModelShape) -> int:
    """The experts' parameters of the whole model (every MoE layer's 3-D expert tensors, at expert parallel 1); 0
    for a dense model. The router is a dense parameter: every rank holds it whole."""
    return shape.cached("expert parameters", lambda: _expert_parameters(shape))


def _expert_parameters(shape: ModelShape) -> int:
    from neox_hf.parallel.expert_parallel import is_expert_parameter

    if moe_settings(shape)[2] == 0:
        return 0
    tensors = shape.cached("tensors", lambda: _pipeline_layer_tensors(shape.config.to_json_string()))
    return sum(numel for layer in tensors for key, numel, _ in layer if is_expert_parameter(key))


def total_parameters(shape: ModelShape) -> int:
    """Every parameter of the model (a tied embedding once)."""
    return sum(stage_parameters(shape, 1, 1, "parameters"))


def active_parameters(shape: ModelShape) -> int:
    """Parameters one token runs through: the dense parts, the router and top_k of each MoE layer's experts."""
    experts, top_k, _ = moe_settings(shape)
    return total_parameters(shape) - expert_parameters(shape) + expert_parameters(shape) * top_k // experts


def deepspeed_data_ranks(layout: Layout) -> int:
    """The data-parallel group DeepSpeed reduces and partitions over: with experts over data ranks, its mpu's group
    is the expert-data-parallel one (`neox_hf.parallel.expert_parallel`), so dense ZeRO states shard over dp / ep."""
    return layout.expert_data if layout.expert > 1 else layout.sharding_ranks


def model_state_parts(shape: ModelShape, layout: Layout, engine: Engine, params: int) -> list[tuple[int, Engine]]:
    """(parameters on this rank, the engine state that holds them) of a stage of `params` parameters counted at
    expert parallel 1: a dense model [(params, engine)]; an MoE model its dense part and its 1/ep share of the
    experts, whose ZeRO-1/2 or FSDP2 states shard over the expert-data-parallel ranks (dp / ep with experts over
    data, dp with experts over the tensor-parallel group)."""
    experts = expert_parameters(shape)
    if experts == 0:
        return [(params, engine)]
    edp = layout.expert_data
    expert_engine = Engine(engine.precision, engine.deepspeed, engine.zero_stage, edp, engine.offload_optimizer,
                           engine.offload_params, engine.fsdp2, edp)
    return [(params - experts, engine), (math.ceil(experts / layout.expert), expert_engine)]


def expert_state_bytes(parts: list[tuple[int, Engine]]) -> int:
    """The experts' params + grads + optimizer bytes on this rank (0 for a dense model)."""
    if len(parts) == 1:
        return 0
    return sum(model_state_bytes(*parts[1]).values())


def expert_seconds(shape: ModelShape, layout: Layout, engine: Engine, dense_params: int,
                   assumptions: Assumptions) -> float:
    """The expert dimension's traffic per step, 0 for a dense model: each MoE layer's token all-to-all, four per
    micro-batch (dispatch and combine, forward and backward; two more when checkpointing recomputes the forward),
    each rank sending (ep − 1) / ep of its tokens × top_k hidden states; the experts' gradients reduced over the
    expert-data-parallel ranks; and, on DeepSpeed with experts over data, the dense gradients averaged over the
    expert group at every micro-batch (`divide_gradients_for_deepspeed`'s hooks)."""
    experts = expert_parameters(shape)
    if experts == 0:
        return 0.0
    _, top_k, moe_layers = moe_settings(shape)
    ep, micro, element = layout.expert, layout.gradient_accumulation_steps, engine.activation_bytes
    over_tensor = layout.experts_over == "tensor"
    # with experts over the tensor-parallel group, each of its ranks dispatches a disjoint slice of the one batch
    tokens = local_tokens(shape, layout) / (layout.tensor if over_tensor else 1)
    passes = 3 if layout.activation_checkpointing else 2
    all_to_all = 2 * passes * tokens * top_k * shape.hidden * element * (ep - 1) / ep * moe_layers * micro
    group_span = layout.tensor * (1 if over_tensor else ep)  # consecutive ranks: NVLink while they share a node
    group_bandwidth = assumptions.tp_bandwidth if group_span <= GPUS_PER_NODE else assumptions.dp_bandwidth
    e, local = layout.expert_data, experts / ep
    if engine.fsdp2:
        reduce = (e - 1) / e * local * (2 * element + 4)
    else:
        reduce = 2 * (e - 1) / e * engine.weight_bytes * local
    hooks = 0.0
    if engine.deepspeed and ep > 1 and not over_tensor:
        hooks = 2 * (ep - 1) / ep * engine.weight_bytes * dense_params * micro
    # the hooks' all-reduce is data-parallel gradient traffic: at the bandwidth the plan gives the rest of it
    return all_to_all / group_bandwidth + (hooks + reduce) / assumptions.dp_bandwidth


def moe_layer_extra_bytes_per_token(shape: ModelShape, layout: Layout, element: int) -> float:
    """What a Mixtral layer (transformers' MixtralDecoderLayer, `grouped_mm` experts, sdpa) saves per token beyond
    the Llama layer's formula, fitted to saved-tensor hooks (tests/test_plan.py holds it within 1%): per routed
    copy (top_k of them) the token's hidden state sent to its expert and the expert's output, four expert-width
    tensors (gate, its SiLU, up, their product) and 40 bytes of routing indices and weights; the router's fp32
    logits and probabilities; less the dense MLP's four tensors the formula counted. Experts are not split by tensor
    parallelism; with experts over the tensor-parallel group each of its ranks routes 1/tp of the tokens."""
    experts, top_k, moe_layers = moe_settings(shape)
    if moe_layers == 0 or shape.cache["family"] != "mixtral":
        return 0.0
    c, t = shape.cache, layout.tensor
    routed = top_k * (element * (2 * c["hidden"] + 4 * c["intermediate"]) + 40) + 4 * experts + 4
    routed /= t if layout.experts_over == "tensor" and layout.expert > 1 else 1
    return (routed - element * 4 * c["intermediate"] / t) * moe_layers / c["layers"]


def largest_layer_on_rank(shape: ModelShape, layout: Layout) -> int:
    """The parameters of the largest pipeline layer on one rank (what FSDP2 gathers while it runs): a MoE layer
    holds its 1/ep share of the experts."""
    counts = layer_parameters_per_rank(shape, layout.tensor)
    if layout.expert == 1:
        return max(counts)
    from neox_hf.parallel.expert_parallel import is_expert_parameter

    tensors = shape.cached("tensors", lambda: _pipeline_layer_tensors(shape.config.to_json_string()))
    experts = [sum(n for key, n, _ in layer if is_expert_parameter(key)) for layer in tensors]
    return max(n - e + e // layout.expert for n, e in zip(counts, experts))


def least_expert_data(parallel, dp: int) -> int:
    """The data-parallel size of the recipe's own layout without `--gpus`: with experts over data, a multiple of
    `parallel.expert_parallel` (the launcher refuses fewer data ranks than it)."""
    ep = parallel.expert_parallel
    return math.lcm(dp, ep) if ep > 1 and parallel.experts_over == "data" else dp


def check_gpus_hold_experts(parallel, gpus: int, model_parallel: int) -> None:
    """UsageError when the recipe's experts over data do not divide the data-parallel ranks `gpus` leave."""
    from neox_hf.errors import UsageError

    ep, dp = parallel.expert_parallel, gpus // model_parallel
    if ep > 1 and parallel.experts_over == "data" and dp % ep:
        raise UsageError(f"--gpus {gpus}: `parallel.expert_parallel: {ep}` splits the experts over data-parallel "
                         f"ranks, and {gpus} GPUs give {dp} of them, not a multiple of {ep}; give --gpus "
                         f"{model_parallel * math.lcm(dp, ep)}, or another expert_parallel")


def moe_layouts(shape: ModelShape, layouts: list[Layout]) -> list[Layout]:
    """`layouts` as an MoE model takes them (a dense model's unchanged): without pipeline stages, sequence or
    context parallelism and ZeRO-3, which the recipe refuses with experts; each with every expert-parallel size
    that divides the experts and the data-parallel ranks (HSDP only at ep 1; on DeepSpeed, experts over data only
    without tensor parallelism), and GPT-NeoX's layout, the experts over the tensor-parallel group (ep = tp)."""
    experts = moe_settings(shape)[0]
    if experts == 1:
        return layouts
    out = []
    for layout in layouts:
        if (layout.pipeline > 1 or layout.sequence_parallel or layout.context > 1
                or (layout.backend == "deepspeed" and layout.zero_stage == 3)):
            continue
        out.append(layout)
        if layout.backend == "deepspeed" and layout.tensor > 1:
            data_sizes = []
        elif layout.dp_replicate > 1:
            continue
        else:
            data_sizes = [ep for ep in _divisors(layout.data) if ep > 1 and experts % ep == 0]
        out += [replace(layout, expert=ep) for ep in data_sizes]
        if layout.tensor > 1 and experts % layout.tensor == 0 and layout.dp_replicate == 1:
            out.append(replace(layout, expert=layout.tensor, experts_over="tensor"))
    return out


# ----------------------------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------------------------


def add_plan_arguments(parser) -> None:
    """`neox_hf plan`'s options; the recipe files and `--section.key value` overrides are the rest of the line (an
    argparse subcommand would refuse the overrides as unknown options), re-read by `run_plan`."""
    _add_options(parser)
    parser.add_argument("recipe", nargs=argparse.REMAINDER,
                        help="recipe or GPT-NeoX YAML file(s), then --section.key value overrides")


def _add_options(parser) -> None:
    parser.add_argument("--gpus", type=int, default=None, help="plan every layout on this many GPUs")
    parser.add_argument("--gpu-memory", type=float, default=None, help="GiB per GPU (e.g. 40, 80)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    parser.add_argument("--top", type=int, default=10, help="how many fitting layouts to list (default 10)")
    parser.add_argument("--longest-sequence", action="store_true",
                        help="with --gpus and --gpu-memory: rank the layouts (at micro batch 1) by the longest "
                             "seq_length each fits, longest first, instead of by step time")
    parser.add_argument("--mfu", type=float, default=DEFAULT_MFU, help=f"assumed MFU (default {DEFAULT_MFU})")
    parser.add_argument("--mfu-from", default=None, metavar="RUN",
                        help="take the MFU a run measured: its output folder (or train_log.jsonl: the median of its "
                             "logged `mfu`), or benchmarks/gpu_profile.sh's matrix.md (neox_hf's datasheet MFU)")
    parser.add_argument("--gpu", default=DEFAULT_GPU, help=f"GPU whose datasheet peak sets the time (default {DEFAULT_GPU})")


class _OptionParser(argparse.ArgumentParser):
    def error(self, message: str):
        from neox_hf.errors import UsageError

        raise UsageError(f"neox_hf plan: {message}; see `neox_hf plan --help`")


def split_plan_argv(args) -> tuple[argparse.Namespace, list[str]]:
    """(the options, wherever on the line they stood; the recipe files and overrides, in order)."""
    parser = _OptionParser(prog="neox_hf plan", add_help=False, allow_abbrev=False)
    _add_options(parser)
    parser.set_defaults(**{k: v for k, v in vars(args).items() if k != "recipe"})
    return parser.parse_known_args(list(args.recipe))


def run_plan(args) -> int:
    # DeepSpeed logs to stdout when imported; `--json` owes programs a stdout holding the JSON object alone
    options, recipe_argv = split_plan_argv(args)
    with contextlib.redirect_stdout(sys.stderr):
        plan = _plan_from_options(options, recipe_argv)
    print(json.dumps(plan.to_dict()) if options.json else "\n".join(plan_table(plan)))
    return 0


def _plan_from_options(args, recipe_argv: list[str]) -> Plan:
    from neox_hf.errors import UsageError

    if args.gpus is not None and args.gpus < 1:
        raise UsageError(f"--gpus must be ≥ 1, got {args.gpus}")
    if args.gpu_memory is not None and not 0 < args.gpu_memory < float("inf"):
        raise UsageError(f"--gpu-memory must be a finite number of GiB > 0 (e.g. 80), got {args.gpu_memory}")
    if args.top < 1:
        raise UsageError(f"--top must be ≥ 1 (how many fitting layouts to list), got {args.top}")
    if not 0 < args.mfu <= 1:
        raise UsageError(f"--mfu must be in (0, 1], got {args.mfu}")
    recipe = read_recipe(recipe_argv)
    check_gpus_hold_layout(recipe, args.gpus)
    memory = None if args.gpu_memory is None else int(args.gpu_memory * GIB)
    # planned for GPUs elsewhere: `auto` is bf16 on every GPU with a datasheet peak here (compute capability ≥ 8)
    assumptions = assumptions_for(args.gpu, args.mfu)
    if args.mfu_from is not None:
        assumptions.mfu, assumptions.mfu_source = measured_mfu(args.mfu_from)
    if args.longest_sequence and (args.gpus is None or memory is None):
        raise UsageError("--longest-sequence ranks the layouts on --gpus N GPUs of --gpu-memory GiB by the longest "
                         "sequence each fits: give both")
    plan = plan_for_recipe(recipe, args.gpus, memory, top=args.top, assumptions=assumptions, precision="bf16",
                           by_longest_sequence=args.longest_sequence)
    check_some_layout_fits(plan)
    return plan


def read_recipe(argv: list[str]):
    """The recipe of the command line, as training reads and validates it (context parallelism's head rule
    included)."""
    from neox_hf.recipe.args import parse_run_args

    return parse_run_args(argv).recipe


def check_some_layout_fits(plan: Plan) -> None:
    """UsageError saying why, when `--gpus` was given and no layout fits (a table of "the 0 fastest" said nothing)."""
    from neox_hf.errors import UsageError

    if plan.gpus is None or plan.ranked:
        return
    if plan.leanest is None:
        raise UsageError(f"no layout splits the recipe over {plan.gpus} GPUs: pipeline stages must not outnumber the "
                         "layers, tensor (× context) parallel must divide the attention heads and data parallel the "
                         "global batch; give another --gpus")
    lean = plan.leanest
    raise UsageError(f"none of the {plan.considered} layouts on {plan.gpus} GPUs fits in {_gib(plan.gpu_memory_bytes)} "
                     f"GiB per GPU: the leanest ({describe_layout(lean.layout)}) needs "
                     f"{_gib(lean.largest_stage.total)} GiB on its largest rank; give more --gpu-memory or more --gpus, or a smaller model")


def measured_mfu(source: str) -> tuple[float, str]:
    """(MFU, where it was measured) from a run's train_log.jsonl (the median of the MFU of its logged windows, each
    against the peak its start-up report names: the datasheet's on a known GPU) or from gpu_profile.sh's matrix table
    (the `neox_hf train(recipe)` row's datasheet MFU)."""
    from neox_hf.errors import UsageError

    path = Path(source)
    if path.suffix == ".md" and path.is_file():
        for line in path.read_text().splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) > 7 and cells[2] == "neox_hf train(recipe)" and cells[7].endswith("%"):
                return float(cells[7].rstrip("%")) / 100, f"measured on the device: {source}, {cells[0]} {cells[1]}"
        raise UsageError(f"--mfu-from {source}: no `neox_hf train(recipe)` row with a datasheet MFU in it; give "
                         "benchmarks/gpu_profile.sh's matrix.md from a GPU run, or a run's output folder")
    log = path / "train_log.jsonl" if path.is_dir() else path
    if not log.is_file():
        raise UsageError(f"--mfu-from {source}: neither a run folder with train_log.jsonl nor a matrix.md; give the "
                         "output.dir of a run on the GPUs you plan for")
    values = []
    for line in log.read_text().splitlines():
        try:
            value = json.loads(line).get("mfu")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(value, (int, float)) and 0 < value <= 1:
            values.append(float(value))
    if not values:
        raise UsageError(f"--mfu-from {source}: {log} logs no `mfu`; a run logs it at each log interval once its "
                         "model shape and device peak are known")
    values.sort()
    return values[len(values) // 2], f"measured by {source}: the median of {len(values)} logged windows"


def assumptions_for(gpu: str, mfu: float) -> Assumptions:
    from neox_hf.errors import UsageError
    from neox_hf.hardware import DATASHEET_BF16, datasheet_peak

    peak = datasheet_peak(gpu, "bf16")
    if peak is None:
        raise UsageError(f"--gpu {gpu!r}: no datasheet peak known; use one of {', '.join(n for n, _ in DATASHEET_BF16)}")
    return Assumptions(gpu=gpu, peak_flops=peak, mfu=mfu)


def check_gpus_hold_layout(recipe, gpus: int | None) -> None:
    from neox_hf.errors import UsageError

    from neox_hf.recipe import accumulation_for_train_batch, data_parallel_for_train_batch

    p = recipe.parallel
    need = p.pipeline_parallel * p.tensor_parallel * p.context_parallel
    if gpus is None or gpus % need:
        return  # the recipe's layout does not divide the GPUs: the plan ranks what they allow (recipe_layout_off_gpus)
    check_gpus_hold_experts(p, gpus, need)
    t = recipe.train
    if gpus is not None and t.train_batch_size is not None and accumulation_for_train_batch(t, gpus // need) is None:
        dp, per_replica = gpus // need, f" (× {need} per replica)" if need > 1 else ""
        raise UsageError(f"--gpus {gpus}: train_batch_size {t.train_batch_size} is not micro batch "
                         f"{t.micro_batch_size} × any gradient_accumulation_steps × {dp} data-parallel processes, so "
                         f"the recipe's layout cannot keep the config's batch on {gpus} GPUs; give --gpus "
                         f"{data_parallel_for_train_batch(t) * need} (a data-parallel size dividing "
                         f"{t.train_batch_size // t.micro_batch_size}{per_replica}), or another "
                         "--train.micro_batch_size")


def recipe_layout_off_gpus(recipe, gpus: int | None) -> str | None:
    """None where the recipe's pipeline × tensor × context size divides `gpus`; else the one line saying so: the plan
    then shows the recipe's layout on its own GPU count and ranks the layouts `gpus` allow, at its global batch."""
    if gpus is None:
        return None
    p, t = recipe.parallel, recipe.train
    need = p.pipeline_parallel * p.tensor_parallel * p.context_parallel
    if gpus % need == 0:
        return None
    own = recipe_layout(recipe, None)
    batch = t.train_batch_size or own.micro_batch * own.gradient_accumulation_steps * own.data
    context = f" × context {p.context_parallel}" if p.context_parallel > 1 else ""
    return (f"--gpus {gpus} is not a multiple of the recipe's layout (pipeline {p.pipeline_parallel} × tensor "
            f"{p.tensor_parallel}{context} = {need} per replica): the recipe's row is its layout on {own.gpus} GPUs; "
            f"ranked below, the layouts {gpus} GPUs allow, each at its global batch of {batch}")


def describe_layout(layout: Layout) -> str:
    if layout.backend == "fsdp2":
        r = layout.dp_replicate  # replicas × shards, the context-parallel ranks among the shards
        sharding = f"FSDP2 HSDP {r} × {layout.sharding_ranks // r}" if r > 1 else "FSDP2"
    else:
        sharding = f"ZeRO-{layout.zero_stage}"
    context = f" × context {layout.context}{' (ring)' if layout.ring else ''}" if layout.context > 1 else ""
    parts = [f"pipe {layout.pipeline} × tensor {layout.tensor}{context} × data {layout.data}", sharding,
             f"micro {layout.micro_batch} × accumulation {layout.gradient_accumulation_steps}"]
    if layout.expert > 1:
        parts.insert(1, f"expert {layout.expert}" + (" over tensor" if layout.experts_over == "tensor" else ""))
    if layout.activation_checkpointing:
        parts.append("checkpointing")
    if layout.sequence_parallel:
        parts.append("sequence parallel")
    return ", ".join(parts)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


_COLUMNS = ("params", "grads", "optimizer", "activations", "loss", "total")


def plan_table(plan: Plan) -> list[str]:
    header = (f"| {'layout':<104} | " + " | ".join(f"{c:>9}" for c in _COLUMNS)
              + " | fits | step s | bubble | longest seq |")
    lines = [f"GiB per rank ({plan.precision}; the recipe's pipeline stages each, other layouts their largest stage); "
             f"{plan.assumptions.describe()}",
             "grads: at the optimizer step (ZeRO's reduced partition); whole gradients held while a step's micro-batches "
             "run (no ZeRO, ZeRO-1, pipelines) count in total, which is the step's peak, not the columns' sum; "
             f"longest seq: the longest seq_length (a multiple of {LONGEST_SEQUENCE_STEP}) at which the layout, its "
             "micro batch as listed, still fits", header,
             "|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|"]
    own = plan.recipe_layout
    lines += [f"note: {plan.note}"] if plan.note else []
    lines += _rows(own, "recipe: ", every_stage=True)
    lines += async_checkpoint_lines(plan)
    if plan.gpus is not None:
        memory = f" in {_gib(plan.gpu_memory_bytes)} GiB" if plan.gpu_memory_bytes else ""
        if plan.by_longest_sequence:
            lines.append(f"{plan.fitting} of {plan.considered} layouts at micro batch 1 on {plan.gpus} GPUs "
                         f"fit{memory} at seq_length {plan.seq_length}; the {len(plan.ranked)} that fit the longest "
                         "sequences:")
        else:
            lines.append(f"{plan.fitting} of {plan.considered} layouts on {plan.gpus} GPUs fit{memory}"
                         f"; the {len(plan.ranked)} fastest:")
        for p in plan.ranked:
            lines += _rows(p, "")
        if plan.by_longest_sequence and plan.ranked:
            best = plan.ranked[0]
            lines.append(f"longest sequence on {plan.gpus} GPUs of {_gib(plan.gpu_memory_bytes)} GiB: "
                         f"{_longest(best.longest_sequence).strip()} tokens ({describe_layout(best.layout)})")
    return lines


def _longest(n: int | None) -> str:
    if n is None:
        return "–"
    return f"≥{n}" if n >= LONGEST_SEQUENCE_CAP else str(n)


def _rows(p: LayoutPlan, prefix: str, every_stage: bool = False) -> list[str]:
    """The recipe's layout: a row per stage; the others: their largest stage."""
    rows = []
    for s in (p.stages if every_stage else [p.largest_stage]):
        fits = {None: "  – ", True: " yes", False: "  NO"}[p.fits if p.fits is None else s.total <= p.memory_limit]
        name = prefix + describe_layout(p.layout) + (f" [stage {s.stage}]" if p.layout.pipeline > 1 else "")
        cells = " | ".join(f"{_gib(getattr(s, c)):>9}" for c in _COLUMNS)
        rows.append(f"| {name:<104} | {cells} | {fits} | {p.step_seconds:6.2f} | {p.bubble:6.3f} | "
                    f"{_longest(p.longest_sequence):>11} |")
    return rows


# ----------------------------------------------------------------------------------------------------------------
# `train.async_checkpoint`: the host memory of the copy a background checkpoint writes (neox_hf.checkpoint.background)
# ----------------------------------------------------------------------------------------------------------------


def async_checkpoint_host_bytes(recipe, shape: ModelShape, layout: Layout) -> int | None:
    """Host bytes per rank that `train.async_checkpoint` copies its checkpoint into (fp32 master + Adam's two moments
    of the rank's chunk: its stage's TP shard split over data × context ranks); None when it is off."""
    from neox_hf.checkpoint.background import host_copy_bytes

    if not recipe.train.async_checkpoint:
        return None
    stage = max(stage_parameters(shape, layout.pipeline, layout.tensor, recipe.parallel.pipe_partition_method))
    parts = model_state_parts(shape, layout, engine_for(recipe, layout, "fp32"), stage)
    dense = host_copy_bytes(parts[0][0], shards=layout.data * layout.context)
    # an MoE rank copies its 1/ep share of the experts, whose states shard over the ranks holding the same experts
    return dense + sum(host_copy_bytes(params, shards=layout.expert_data) for params, _ in parts[1:])


def async_checkpoint_lines(plan: Plan) -> list[str]:
    if plan.host_checkpoint_bytes is None:
        return []
    per_rank = plan.host_checkpoint_bytes
    return [f"async checkpoint: {_gib(per_rank)} GiB of host memory per rank ({_gib(per_rank * GPUS_PER_NODE)} GiB "
            f"per node of {GPUS_PER_NODE} GPUs), pinned, for the copy written in the background"]
