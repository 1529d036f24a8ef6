"""Megatron-style tensor parallelism applied to an unmodified `transformers.GPTNeoXForCausalLM`.

Why not a library verb: DeepSpeed AutoTP shards query_key_value / dense_h_to_4h and
dense / dense_4h_to_h, but keeps the embedding whole and gathers full logits; transformers'
`tp_plan="auto"` gives equal logits under torchrun + gloo but also gathers the logits
(`lm_head: colwise_gather_output`). Neither gives a vocab-parallel embedding and a loss
that never materialises [batch, seq, vocab] logits, which is what makes large vocabularies
affordable under TP. So we write the layers ourselves, Megatron-style: four small autograd
mappings (`mappings.py`) and layers a few lines long (`tp_layers.py`), applied from outside
the model according to one plan (`tp_plan.py`), as torchtitan applies its parallelisms.

Sequence parallelism (`sequence_parallel=True`, Megatron's) also splits, along the sequence, the
activations the TP regions leave replicated: embedding dropout, layer norms, residual sums.
Their memory per rank falls by the TP size, and so does what activation checkpointing keeps
per layer (the layer input). Same communication volume: each all-reduce becomes a
reduce-scatter plus an all-gather. The mask, positions and rotary embeddings are built by the
unmodified `GPTNeoXModel.forward` from the whole sequence, before the split; the sequence
length must be divisible by the TP size.

After `apply_tensor_parallel` the model is still a working `GPTNeoXForCausalLM`:
`model(...)`, `model(..., labels=...)` and `generate` give full (gathered) logits. Training's
loss (`neox_hf.ops.loss`) calls the head's `loss_sum`, which keeps logits sharded along the vocabulary.

Attention needs no patching: `GPTNeoXAttention.forward` reshapes with -1 heads
(`(*input_shape, -1, 3 * head_size)`) and `head_size` is fixed at construction, so a
query_key_value with fewer output rows simply runs fewer heads. The config is left
describing the full model so `save_pretrained` of the merged weights stays correct.
"""

import torch
import torch.distributed as dist
from torch import nn
from transformers import GPTNeoXForCausalLM

from neox_hf.errors import NeoXHFError
from neox_hf.model.spec import SPECS, spec_for_model
from neox_hf.parallel.mappings import scatter_to_sequence_region
from neox_hf.parallel.tp_layers import (
    ColumnParallelLinear,
    EnterSequenceParallel,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    SequenceParallelRMSNorm,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    vocab_parallel_cross_entropy,
)
from neox_hf.parallel.tp_checkpoint import (
    gather_full_state_dict,
    load_tp_shard_state_dict,
    pad_vocab,
)
from neox_hf.parallel.tp_groups import (
    DeepSpeedMPU,
    ParallelGroups,
    build_parallel_groups,
    deepspeed_initialize_with_mpu,
)
from neox_hf.parallel.tp_plan import SEQUENCE_PARALLEL_PLAN, TP_PLAN, layer_kind

__all__ = [
    "from_pretrained_tensor_parallel",
    "apply_tensor_parallel",
    "apply_tensor_parallel_to_part",
    "check_tp_divisibility",
    "vocab_parallel_cross_entropy",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "SequenceParallelLayerNorm",
    "EnterSequenceParallel",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "ParallelGroups",
    "build_parallel_groups",
    "DeepSpeedMPU",
    "deepspeed_initialize_with_mpu",
    "gather_full_state_dict",
    "load_tp_shard_state_dict",
    "pad_vocab",
    "TP_PLAN",
]


def apply_tensor_parallel(model: GPTNeoXForCausalLM, tp_group, sequence_parallel: bool = False) -> GPTNeoXForCausalLM:
    """`model` (a GPTNeoX or Llama-family CausalLM) with every module of its family's TP plan replaced, in place, by
    a layer holding this rank's slice (and, with `sequence_parallel`, every module of its sequence-parallel plan by
    its sequence-split form). `tp_group=None` means a TP size of 1 (same layers, no communication)."""
    try:
        spec = spec_for_model(model)
    except (ValueError, AttributeError) as err:
        raise NeoXHFError(f"apply_tensor_parallel supports the model families {', '.join(SPECS)} "
                          f"(GPTNeoXForCausalLM, LlamaForCausalLM, MistralForCausalLM), got {type(model).__name__}") from err
    rank, size = _rank_and_size(tp_group)
    check_tp_divisibility(model, size)
    head = model.get_output_embeddings()  # None for a reward model: its scalar `score` head stays replicated
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    for name, module in list(model.named_modules()):
        kind = layer_kind(name, spec.tp_plan)
        sequence_kind = layer_kind(name, spec.sequence_parallel_plan) if sequence_parallel else None
        if kind is not None:
            model.set_submodule(name, _parallel_layer(kind, module, rank, size, tp_group, sequence_parallel))
        elif sequence_kind == "enter_sequence_parallel_layer":
            # The first decoder layer takes this rank's sequence slice; positions and masks were built whole before.
            module.register_forward_pre_hook(_scatter_hidden_states(tp_group), with_kwargs=True)
        elif sequence_kind == "sequence_norm":
            norm = SequenceParallelRMSNorm if hasattr(module, "variance_epsilon") else SequenceParallelLayerNorm
            model.set_submodule(name, norm(module, tp_group))
        elif sequence_kind is not None:
            model.set_submodule(name, EnterSequenceParallel(module, tp_group))
    if tied:
        # One shard serves both ends, as one full matrix did.
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    return model


def _scatter_hidden_states(group):
    def hook(module, args, kwargs):
        if args:
            return (scatter_to_sequence_region(args[0], group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": scatter_to_sequence_region(kwargs["hidden_states"], group)}

    return hook


def apply_tensor_parallel_to_part(module: nn.Module, path: str, tp_group, sequence_parallel: bool = False) -> nn.Module:
    """`module`, found at `path` inside a GPTNeoXForCausalLM (e.g. `gpt_neox.layers.3`, `lm_head`), with its TP_PLAN
    modules replaced by this rank's slices, as `apply_tensor_parallel` does for the whole model; returns the module
    (a new one when `path` itself is in the plan). Pipeline stages hold parts of the model, keyed by the same paths.
    Sequence parallelism is not applied to parts."""
    if sequence_parallel:
        raise NeoXHFError("sequence parallelism is not supported on model parts (pipeline stages)")
    rank, size = _rank_and_size(tp_group)
    for name, child in list(module.named_modules()):
        kind = layer_kind(f"{path}.{name}" if name else path)
        if kind is None:
            continue
        layer = _parallel_layer(kind, child, rank, size, tp_group, False)
        if not name:
            return layer
        module.set_submodule(name, layer)
    return module


def check_tp_divisibility(model: GPTNeoXForCausalLM, tp_size: int) -> None:
    """Raise NeoXHFError, saying how to fix it, when `model` cannot be split `tp_size` ways."""
    config = model.config
    if config.num_attention_heads % tp_size:
        raise NeoXHFError(
            f"num_attention_heads={config.num_attention_heads} is not divisible by tensor parallel "
            f"size {tp_size}; each rank must hold whole heads, so choose tp_size from "
            f"{_divisors(config.num_attention_heads)}"
        )
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if kv_heads % tp_size:
        raise NeoXHFError(
            f"num_key_value_heads={kv_heads} is not divisible by tensor parallel size {tp_size}; each rank must hold "
            f"whole key/value heads (they are not replicated), so choose tp_size from {_divisors(kv_heads)}"
        )
    if config.intermediate_size % tp_size:
        raise NeoXHFError(
            f"intermediate_size={config.intermediate_size} is not divisible by tensor parallel "
            f"size {tp_size}; choose a tp_size that divides it"
        )
    vocab = model.get_input_embeddings().weight.shape[0]
    if vocab % tp_size:
        raise NeoXHFError(
            f"vocab size {vocab} is not divisible by tensor parallel size {tp_size}. Pad it first, as "
            f"GPT-NeoX does (to a multiple of make_vocab_size_divisible_by x tp): "
            f"pad_vocab(model, padded_vocab_size({vocab}, divisible_by=128, tp={tp_size}))"
        )


def _parallel_layer(kind: str, module: nn.Module, rank: int, size: int, group, sequence_parallel: bool) -> nn.Module:
    def shard(tensor, dim):
        return tensor.detach().chunk(size, dim=dim)[rank].clone()

    if kind == "column":
        # For query_key_value this splits along heads: GPTNeoX interleaves q,k,v per head
        # (rows are [num_heads, 3, head_size]), so contiguous row blocks are whole heads.
        bias = shard(module.bias, 0) if module.bias is not None else None
        return ColumnParallelLinear(shard(module.weight, 0), bias, group, sequence_parallel=sequence_parallel)
    if kind == "row":
        bias = module.bias.detach().clone() if module.bias is not None else None
        return RowParallelLinear(shard(module.weight, 1), bias, group, sequence_parallel=sequence_parallel)
    rows = module.weight.shape[0] // size
    if kind == "vocab_embedding":
        # The embedding's output stays replicated (GPTNeoXModel builds masks and positions from it); the sequence
        # split happens right after, at the embedding dropout.
        return VocabParallelEmbedding(shard(module.weight, 0), rank * rows, group)
    return VocabParallelLMHead(shard(module.weight, 0), rank * rows, group, sequence_parallel=sequence_parallel)


def _rank_and_size(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def from_pretrained_tensor_parallel(model_class, folder: str, groups: ParallelGroups, padded_vocab: int | None = None,
                                    sequence_parallel: bool = False, **config_kwargs):
    """A tensor-parallel model from an HF folder, reading only this rank's slices from the safetensors files.

    The full model is never materialised: it is built on the meta device, split, then filled with this rank's
    slices (`load_tp_shard_state_dict`), so a rank's peak memory while loading is about one shard, not the model.
    `padded_vocab` (GPT-NeoX padding for a vocabulary TP does not divide) adds zero rows the same way, slice by slice;
    the new size is recorded in `config.vocab_size`.
    Gap filled: transformers' `from_pretrained` materialises every weight before any splitting we can apply.
    """
    config = model_class.config_class.from_pretrained(folder, **config_kwargs)
    if padded_vocab is not None:
        if padded_vocab < config.vocab_size or padded_vocab % groups.tp_size:
            raise NeoXHFError(f"padded_vocab {padded_vocab} must be ≥ the stored {config.vocab_size} and divisible by "
                              f"tp={groups.tp_size}")
        config.vocab_size = padded_vocab
    with torch.device("meta"):
        model = model_class(config)
    model = materialise(apply_tensor_parallel(model, groups.tp_group, sequence_parallel=sequence_parallel))
    model.load_state_dict(load_tp_shard_state_dict(folder, config, groups.tp_rank, groups.tp_size), strict=True)
    return model.eval()


def materialise(model: nn.Module, device="cpu") -> nn.Module:
    """A whole CausalLM built on the meta device (split or not), moved to `device` uninitialised, to be filled by a
    loader or `init_from_seed_`; the rotary buffers (not in any checkpoint) are rebuilt.

    Materialising meta parameters creates new Parameter objects: the TP flags DeepSpeed reads for gradient clipping
    (`tensor_model_parallel`, `partition_dim`) and the head's tie to the embedding are restored, or clipping would
    count shards wrongly and a tied head would train apart."""
    head = model.get_output_embeddings()  # None for a reward model: its scalar `score` head stays replicated
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    flags = {name: {k: v for k, v in vars(p).items() if k != "_is_hf_initialized"}
             for name, p in model.named_parameters()}
    model.to_empty(device=device)
    for name, param in model.named_parameters():  # the tie is broken until restored below: a head of its own here
        for key, value in flags.get(name, {}).items():
            setattr(param, key, value)
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    rotary = model.base_model.rotary_emb
    model.base_model.rotary_emb = type(rotary)(config=model.config).to(device)
    return model


def init_from_seed_(module: nn.Module, config, seed: int, *, prefix: str = "", tp_rank: int = 0,
                    tp_size: int = 1) -> nn.Module:
    """`module` (found at `prefix` in the CausalLM; materialised, contents undefined) with every parameter set to its
    layout-free initial value (`neox_hf.model.modeling.initial_tensor`). A TP shard (`partition_dim` set by the TP
    layers) draws its parameter's full tensor, keeps its slice and frees the rest, so a rank's peak is its own shards
    plus the largest single tensor, and the values are those of the whole model on one process.
    Gap filled: transformers' init (and torchtitan's `init_weights`) draw on one global generator in module order,
    so the values depend on which modules, and which slices, a rank builds."""
    from neox_hf.model.init import initial_tensor

    with torch.no_grad():
        for name, param in module.named_parameters():
            key = f"{prefix}.{name}" if prefix else name
            dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
            shape = list(param.shape)
            if dim is not None:
                shape[dim] *= tp_size
            full = initial_tensor(config, key, shape, seed)
            param.copy_(full if dim is None else full.chunk(tp_size, dim=dim)[tp_rank])
    return module
