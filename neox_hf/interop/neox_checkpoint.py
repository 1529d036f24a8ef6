"""GPT-NeoX-native checkpoints <-> Hugging Face GPTNeoX weights.

GPT-NeoX's ``tools/ckpts/convert_neox_to_hf.py`` no longer works on our stack:
it fills ``embed_out``, which transformers 5's ``GPTNeoXForCausalLM`` calls
``lm_head``, and its plain ``torch.load`` is refused by torch >= 2.6 (the
files hold numpy RNG state). It also always sums row-parallel biases, which is
wrong for sequential-residual models. This module replaces it and adds the way
back (HF -> NeoX sequential layout), bit-exact in both directions.

Parameter layout (``idx`` = GPT-NeoX pipeline layer index, L = num_hidden_layers):

====================  =========================================  =======================
idx                   GPT-NeoX parameters                        HF parameters
====================  =========================================  =======================
0                     ``word_embeddings.weight`` (vocab-parallel) ``gpt_neox.embed_in.weight``
1, L+2                none (``_pre/_post_transformer_block``)
2 .. L+1              see ``LAYER_PARAMS``                       ``gpt_neox.layers.{idx-2}.*``
L+3                   ``norm.{weight,bias}``                     ``gpt_neox.final_layer_norm.*``
L+4 (untied only)     ``final_linear.weight`` (vocab-parallel)   ``lm_head.weight``
====================  =========================================  =======================

Tensor-parallel merge rules are in ``merge_tp_shards``; the file formats are in
``neox_files``. The architecture config is the caller's (translated from the
NeoX YAML elsewhere); here it is only checked against the tensors.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import transformers
from transformers import initialization as hf_init

from neox_hf.errors import CheckpointError
from neox_hf.parallel.tp_plan import (
    COLUMN,
    EMBEDDING_TENSORS,
    FINAL_NORM_TENSORS,
    HEAD_TENSORS,
    LAYER_TENSORS,
    REPLICATED,
    ROW,
    ROW_BIAS,
)
from neox_hf.interop.neox_files import (
    NeoXCheckpointFiles,
    detect_checkpoint_files,
    load_layer_shards,
    write_sequential_checkpoint,
)

# The names and split rules come from the one sharding table (parallel/tp_plan.py), inverted to GPT-NeoX name →
# (HF name, rule).
LAYER_PARAMS: dict[str, tuple[str, str]] = {neox: (hf, rule) for hf, (neox, rule) in LAYER_TENSORS.items()}
# Checkpoints from before GPT-NeoX renamed its MLP (read only; we write the new names).
LEGACY_LAYER_NAMES = {
    "mlp.dense_h_to_4h.weight": "mlp.linear1.weight",
    "mlp.dense_h_to_4h.bias": "mlp.linear1.bias",
    "mlp.dense_4h_to_h.weight": "mlp.linear2.weight",
    "mlp.dense_4h_to_h.bias": "mlp.linear2.bias",
}
# Recomputed from the config by both sides; saved only with `save_inv_freqs`.
IGNORED_PARAMS = {"attention.rotary_emb.inv_freq"}

EMBEDDING_PARAMS = {neox: (hf, rule) for hf, (neox, rule) in EMBEDDING_TENSORS.items()}
FINAL_NORM_PARAMS = {neox: (hf, rule) for hf, (neox, rule) in FINAL_NORM_TENSORS.items()}
FINAL_LINEAR_PARAMS = {neox: (hf, rule) for hf, (neox, rule) in HEAD_TENSORS.items()}


def neox_param_tables(config: transformers.GPTNeoXConfig) -> dict[int, dict[str, tuple[str, str]]]:
    """Return ``{idx: {neox name: (full HF key, TP rule)}}`` for every GPT-NeoX layer with weights."""
    n_layers = config.num_hidden_layers
    tables = {0: EMBEDDING_PARAMS}
    for i in range(n_layers):
        tables[i + 2] = {name: (f"gpt_neox.layers.{i}.{hf}", rule) for name, (hf, rule) in LAYER_PARAMS.items()}
    tables[n_layers + 3] = FINAL_NORM_PARAMS
    if not config.tie_word_embeddings:
        tables[n_layers + 4] = FINAL_LINEAR_PARAMS
    return tables


def expected_hf_shapes(config: transformers.GPTNeoXConfig) -> dict[str, tuple[int, ...]]:
    """Return the HF state-dict keys and shapes that ``config`` implies (lm_head included when tied)."""
    h, ff, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    layer = {
        "input_layernorm.weight": (h,), "input_layernorm.bias": (h,),
        "post_attention_layernorm.weight": (h,), "post_attention_layernorm.bias": (h,),
        "attention.query_key_value.weight": (3 * h, h), "attention.dense.weight": (h, h),
        "mlp.dense_h_to_4h.weight": (ff, h), "mlp.dense_h_to_4h.bias": (ff,),
        "mlp.dense_4h_to_h.weight": (h, ff), "mlp.dense_4h_to_h.bias": (h,),
    }
    if config.attention_bias:
        layer.update({"attention.query_key_value.bias": (3 * h,), "attention.dense.bias": (h,)})
    shapes = {"gpt_neox.embed_in.weight": (vocab, h)}
    for i in range(config.num_hidden_layers):
        shapes.update({f"gpt_neox.layers.{i}.{k}": s for k, s in layer.items()})
    shapes.update({"gpt_neox.final_layer_norm.weight": (h,), "gpt_neox.final_layer_norm.bias": (h,)})
    shapes["lm_head.weight"] = (vocab, h)
    return shapes


# ---------------------------------------------------------------- merging (NeoX -> HF)


def merge_tp_shards(shards: list[torch.Tensor], rule: str, *, parallel_residual: bool, where: str) -> torch.Tensor:
    """Return the full tensor that the per-rank ``shards`` of one parameter represent."""
    try:
        if rule == COLUMN:
            return torch.cat(shards, dim=0)
        if rule == ROW:
            return torch.cat(shards, dim=1)
    except RuntimeError as err:
        shapes = [tuple(s.shape) for s in shards]
        raise CheckpointError(
            f"{where}: TP shards have incompatible shapes {shapes}; the checkpoint is inconsistent"
        ) from err
    if rule == ROW_BIAS:
        return merge_row_parallel_bias(shards, parallel_residual=parallel_residual)
    return merge_replicated(shards, where=where)


def merge_row_parallel_bias(shards: list[torch.Tensor], *, parallel_residual: bool) -> torch.Tensor:
    """Return the bias a RowParallelLinear effectively adds, given each rank's copy.

    Verified against gpt-neox ``megatron/model/transformer.py`` (ParallelTransformerLayer):
    with ``gpt_j_residual`` the attention and MLP are built with ``parallel_output=True``,
    so each rank adds its own bias (``skip_bias_add`` + ``bias_dropout_fn``) to its partial
    output and only then ``self.reduce`` all-reduces the sum: the effective bias is the SUM
    over ranks. Without it, RowParallelLinear all-reduces first and returns the bias
    separately, which the layer adds once: every rank holds the same bias, take rank 0.
    """
    if not parallel_residual:
        return shards[0]
    # Add onto rank 0 rather than torch.sum, whose +0.0 start turns a -0.0 bias into +0.0.
    total = shards[0]
    for shard in shards[1:]:
        total = total + shard
    return total


def merge_replicated(shards: list[torch.Tensor], *, where: str) -> torch.Tensor:
    """Return the one value of a replicated parameter, checking that every rank holds it."""
    for rank, shard in enumerate(shards[1:], start=1):
        if shard.shape != shards[0].shape or not torch.equal(shard, shards[0]):
            raise CheckpointError(
                f"{where}: replicated parameter differs between TP rank 0 and rank {rank}; "
                "the checkpoint is corrupt or its ranks come from different runs"
            )
    return shards[0]


def hf_params_from_layer(
    rank_states: list[dict[str, torch.Tensor]],
    table: dict[str, tuple[str, str]],
    *,
    parallel_residual: bool,
    where: str,
) -> dict[str, torch.Tensor]:
    """Return the HF tensors of one GPT-NeoX layer, merged over its TP ranks."""
    names = [_canonical_names(state, table, where=where) for state in rank_states]
    if any(n.keys() != names[0].keys() for n in names):
        raise CheckpointError(f"{where}: TP ranks hold different parameter names; the checkpoint is inconsistent")
    merged = {}
    for canonical, stored in names[0].items():
        hf_key, rule = table[canonical]
        merged[hf_key] = merge_tp_shards(
            [state[stored] for state in rank_states], rule,
            parallel_residual=parallel_residual, where=f"{where} '{stored}'",
        )
    return merged


def _canonical_names(state: Mapping[str, torch.Tensor], table: dict, *, where: str) -> dict[str, str]:
    """Return ``{canonical name: name as stored}`` for the weights in one rank's layer state."""
    names = {}
    for stored in state:
        if stored in IGNORED_PARAMS:
            continue
        canonical = LEGACY_LAYER_NAMES.get(stored, stored)
        if canonical not in table:
            raise CheckpointError(
                f"{where}: unexpected parameter '{stored}'; HF GPTNeoX cannot represent it "
                f"(expected {sorted(table)}). RMSNorm, learned position embeddings, Transformer Engine, "
                "MoE and GQA checkpoints are not GPTNeoX-compatible"
            )
        names[canonical] = stored
    return names


def check_hf_state_dict(state: Mapping[str, torch.Tensor], config: transformers.GPTNeoXConfig, *, where: str) -> None:
    """Raise CheckpointError naming every key that is missing, unexpected, or mis-shaped for ``config``."""
    expected = expected_hf_shapes(config)
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: does not match the config: missing {missing[:6]}, unexpected {unexpected[:6]} "
            f"(config: num_hidden_layers={config.num_hidden_layers}, attention_bias={config.attention_bias}, "
            f"tie_word_embeddings={config.tie_word_embeddings})"
        )
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise CheckpointError(
                f"{where}: '{key}' has shape {tuple(state[key].shape)} but the config implies {shape} "
                f"(vocab_size={config.vocab_size} is the padded vocab, hidden_size={config.hidden_size}, "
                f"intermediate_size={config.intermediate_size}); fix the config to match the checkpoint"
            )


def load_neox_state_dict(
    checkpoint_dir: str | os.PathLike,
    config: transformers.GPTNeoXConfig,
    *,
    trust_pickle: bool = False,
) -> dict[str, torch.Tensor]:
    """Return the HF GPTNeoXForCausalLM state dict of a GPT-NeoX checkpoint, TP ranks merged.

    ``checkpoint_dir`` is ``global_stepN/`` or the folder holding ``latest``. Layout and TP
    size come from the file names. Tensors keep the checkpoint's dtype. Tied models get
    ``lm_head.weight`` = ``gpt_neox.embed_in.weight`` (the same tensor).
    """
    files = detect_checkpoint_files(checkpoint_dir)
    if is_llama_config(config):
        return load_llama_neox_state_dict(files, config, trust_pickle=trust_pickle)
    tables = neox_param_tables(config)
    shards = load_layer_shards(files, sorted(tables), trust_pickle=trust_pickle)
    state: dict[str, torch.Tensor] = {}
    for idx, table in tables.items():
        state.update(hf_params_from_layer(
            shards[idx], table, parallel_residual=config.use_parallel_residual, where=_describe_layer(files, idx),
        ))
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["gpt_neox.embed_in.weight"]
    check_hf_state_dict(state, config, where=f"{files.step_dir} ({files.layout} layout, TP {files.tp_size})")
    return state


def _describe_layer(files: NeoXCheckpointFiles, idx: int) -> str:
    if files.layout == "pipeline":
        return str(files.step_dir / f"layer_{idx:02d}-model_*-model_states.pt")
    return f"{files.step_dir / 'mp_rank_*_model_states.pt'} 'sequential.{idx}.*'"


def neox_to_hf_model(
    checkpoint_dir: str | os.PathLike,
    config: transformers.GPTNeoXConfig,
    *,
    model_class: type[transformers.PreTrainedModel] = transformers.GPTNeoXForCausalLM,
    trust_pickle: bool = False,
    dtype: torch.dtype = torch.float32,
) -> transformers.PreTrainedModel:
    """Return a ``model_class`` (in eval mode, ``dtype``) holding the GPT-NeoX checkpoint's weights."""
    state = load_neox_state_dict(checkpoint_dir, config, trust_pickle=trust_pickle)
    # Random init is wasted work: every weight is overwritten below (and checked to be).
    with hf_init.no_init_weights():
        model = model_class(config)
    # no_init_weights also skips init_weights' tying, so a tied lm_head would be a copy.
    model.tie_weights()
    model = model.to(dtype)
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(
            f"{checkpoint_dir}: {model_class.__name__} does not take these weights: missing "
            f"{result.missing_keys[:6]}, unexpected {result.unexpected_keys[:6]}; pass a GPTNeoX model class"
        )
    return model.eval()


# ---------------------------------------------------------------- splitting (HF -> NeoX)


def split_tp_tensor(tensor: torch.Tensor, rule: str, tp_size: int, *, parallel_residual: bool) -> list[torch.Tensor]:
    """Return one shard per TP rank of a full tensor, the inverse of ``merge_tp_shards``."""
    if rule == COLUMN:
        parts = tensor.chunk(tp_size, dim=0)
    elif rule == ROW:
        parts = tensor.chunk(tp_size, dim=1)
    elif rule == ROW_BIAS and parallel_residual:
        # The ranks' biases are summed on import, so rank 0 holds the full bias and the
        # others -0.0: x + (-0.0) == x bit for bit (even for x = +0.0), for any tp_size,
        # whereas bias / tp_size is exact only for powers of two. Training is unaffected:
        # every rank gets the same gradient, so only the (preserved) sum matters.
        parts = [tensor] + [torch.full_like(tensor, -0.0) for _ in range(tp_size - 1)]
    else:  # replicated, or a sequential-residual bias that is added once after the reduce
        parts = [tensor] * tp_size
    # clone: torch.save writes a view's whole storage, which would put every rank's
    # shard into every file.
    return [part.clone() for part in parts]


def neox_rank_modules(
    state: Mapping[str, torch.Tensor], config: transformers.GPTNeoXConfig, tp_size: int
) -> list[dict[str, torch.Tensor]]:
    """Return, per TP rank, the ``module`` dict of a sequential-layout GPT-NeoX checkpoint."""
    _check_tp_divisibility(config, tp_size)
    modules: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]
    for idx, table in neox_param_tables(config).items():
        for neox_name, (hf_key, rule) in table.items():
            if hf_key not in state:  # e.g. attention biases when config.attention_bias is False
                continue
            parts = split_tp_tensor(state[hf_key], rule, tp_size, parallel_residual=config.use_parallel_residual)
            for module, part in zip(modules, parts):
                module[f"sequential.{idx}.{neox_name}"] = part
    return modules


def _check_tp_divisibility(config: transformers.GPTNeoXConfig, tp_size: int) -> None:
    sizes = {"vocab_size": config.vocab_size, "num_attention_heads": config.num_attention_heads,
             "intermediate_size": config.intermediate_size}
    for name, size in sizes.items():
        if tp_size < 1 or size % tp_size:
            raise CheckpointError(f"tp_size={tp_size} does not divide config.{name}={size}; choose a tp_size that does")


def hf_state_dict_for_export(model_or_state_dict, config: transformers.GPTNeoXConfig) -> dict[str, torch.Tensor]:
    """Return the model's HF state dict, checked against ``config``, with ``lm_head.weight`` named so."""
    if isinstance(model_or_state_dict, torch.nn.Module):
        state = dict(model_or_state_dict.state_dict())
    else:
        state = dict(model_or_state_dict)
    # Files written by save_pretrained still call the output embedding embed_out.
    if "embed_out.weight" in state:
        state["lm_head.weight"] = state.pop("embed_out.weight")
    embed = state.get("gpt_neox.embed_in.weight")
    if config.tie_word_embeddings and embed is not None:
        lm_head = state.setdefault("lm_head.weight", embed)
        if not torch.equal(lm_head, embed):
            raise CheckpointError(
                "model to export: config.tie_word_embeddings=True but lm_head.weight differs from "
                "gpt_neox.embed_in.weight; set tie_word_embeddings=False (GPT-NeoX no_weight_tying: true)"
            )
    check_hf_state_dict(state, config, where="model to export")
    return {key: tensor.detach().cpu() for key, tensor in state.items()}


def export_neox_checkpoint(
    model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
    config: transformers.GPTNeoXConfig,
    out_dir: str | os.PathLike,
    *,
    tp_size: int = 1,
    step: int = 0,
) -> str:
    """Write a GPT-NeoX sequential-layout checkpoint (``global_step{step}/`` + ``latest``); return its folder.

    GPT-NeoX loads it with ``pipe_parallel_size: 0``, ``model_parallel_size: tp_size``
    and ``finetune: true`` (there is no optimizer state).
    """
    if is_llama_config(config):
        state = model_or_state_dict.state_dict() if isinstance(model_or_state_dict, torch.nn.Module) else model_or_state_dict
        return str(write_sequential_checkpoint(llama_rank_modules(state, config, tp_size), out_dir, step))
    state = hf_state_dict_for_export(model_or_state_dict, config)
    return str(write_sequential_checkpoint(neox_rank_modules(state, config, tp_size), out_dir, step))


# ---------------------------------------------------------------- the Llama family (LlamaForCausalLM, Mistral)
#
# GPT-NeoX builds Llama from the same ParallelSelfAttention / ParallelMLP, with RMSNorm (`scale`) and per-rank fused
# tensors (megatron/model/transformer.py): a rank's query_key_value is [q_r; k_r; v_r] under grouped-query attention
# (`gqa_project`) and [heads_r, 3, head_dim] rows otherwise (the interleaved MHA view); a rank's linear1 is
# [up_r; gate_r] (Gated_Activation: `x, gate = chunk(2)`, act(gate) * x), as tools/ckpts/convert_hf_llama_to_neox.py
# writes it.

LLAMA_LAYER_PARAMS: dict[str, tuple[str, str]] = {
    "input_layernorm.scale": ("input_layernorm.weight", REPLICATED),
    "post_attention_layernorm.scale": ("post_attention_layernorm.weight", REPLICATED),
    "attention.dense.weight": ("self_attn.o_proj.weight", ROW),
    "attention.dense.bias": ("self_attn.o_proj.bias", ROW_BIAS),
    "mlp.linear2.weight": ("mlp.down_proj.weight", ROW),
    "mlp.linear2.bias": ("mlp.down_proj.bias", ROW_BIAS),
}
_LLAMA_FUSED = ("attention.query_key_value.weight", "attention.query_key_value.bias", "mlp.linear1.weight",
                "mlp.linear1.bias")


def is_llama_config(config) -> bool:
    return getattr(config, "model_type", None) in ("llama", "mistral")


def _llama_indices(config) -> dict[str, int]:
    n = config.num_hidden_layers
    return {"embedding": 0, "final_norm": n + 3, **({} if config.tie_word_embeddings else {"head": n + 4})}


def _qkv_split(config, tp_size: int) -> tuple[bool, int, int, int]:
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv != heads, heads // tp_size, kv // tp_size, head_dim


def _rank_qkv_to_hf(tensors: list[torch.Tensor], config) -> list[torch.Tensor]:
    """GPT-NeoX's per-rank query_key_value (weight or bias) → full q, k, v."""
    gqa, heads, kv, head_dim = _qkv_split(config, len(tensors))
    parts = []
    for t in tensors:
        if gqa:
            parts.append(torch.split(t, [heads * head_dim, kv * head_dim, kv * head_dim], dim=0))
        else:
            view = t.reshape(heads, 3, head_dim, *t.shape[1:])
            parts.append(tuple(view[:, j].reshape(heads * head_dim, *t.shape[1:]) for j in range(3)))
    return [torch.cat([p[j] for p in parts], dim=0) for j in range(3)]


def _hf_qkv_to_ranks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config, tp_size: int) -> list[torch.Tensor]:
    gqa, heads, _, head_dim = _qkv_split(config, tp_size)
    ranks = []
    for q_r, k_r, v_r in zip(q.chunk(tp_size, 0), k.chunk(tp_size, 0), v.chunk(tp_size, 0)):
        if gqa:
            ranks.append(torch.cat([q_r, k_r, v_r], dim=0).clone())
        else:
            stacked = torch.stack([x.reshape(heads, head_dim, *x.shape[1:]) for x in (q_r, k_r, v_r)], dim=1)
            ranks.append(stacked.reshape(3 * heads * head_dim, *q_r.shape[1:]).clone())
    return ranks


def load_llama_neox_state_dict(files: NeoXCheckpointFiles, config, *, trust_pickle: bool = False) -> dict:
    """The HF Llama / Mistral state dict of a GPT-NeoX Llama-style checkpoint (any layout, any TP)."""
    n, where = config.num_hidden_layers, f"{files.step_dir} ({files.layout} layout, TP {files.tp_size})"
    outer = _llama_indices(config)
    shards = load_layer_shards(files, sorted([*outer.values(), *range(2, n + 2)]), trust_pickle=trust_pickle)
    state = {"model.embed_tokens.weight": merge_tp_shards([s["word_embeddings.weight"] for s in shards[0]], COLUMN,
                                                          parallel_residual=False, where=where),
             "model.norm.weight": merge_tp_shards([s["norm.scale"] for s in shards[outer["final_norm"]]], REPLICATED,
                                                  parallel_residual=False, where=where)}
    if "head" in outer:
        state["lm_head.weight"] = merge_tp_shards([s["final_linear.weight"] for s in shards[outer["head"]]], COLUMN,
                                                  parallel_residual=False, where=where)
    else:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    for i in range(n):
        ranks, prefix = shards[i + 2], f"model.layers.{i}."
        known = set(LLAMA_LAYER_PARAMS) | set(_LLAMA_FUSED) | IGNORED_PARAMS
        unexpected = sorted(set(ranks[0]) - known)
        if unexpected:
            raise CheckpointError(f"{_describe_layer(files, i + 2)}: unexpected parameters {unexpected}; a Llama-style "
                                  f"GPT-NeoX layer holds {sorted(known - IGNORED_PARAMS)}")
        for name, (hf, rule) in LLAMA_LAYER_PARAMS.items():
            if name in ranks[0]:
                state[prefix + hf] = merge_tp_shards([r[name] for r in ranks], rule, parallel_residual=False,
                                                     where=f"{_describe_layer(files, i + 2)} '{name}'")
        for kind in ("weight", "bias"):
            if f"attention.query_key_value.{kind}" in ranks[0]:
                q, k, v = _rank_qkv_to_hf([r[f"attention.query_key_value.{kind}"] for r in ranks], config)
                state.update({f"{prefix}self_attn.{p}_proj.{kind}": t for p, t in zip("qkv", (q, k, v))})
            if f"mlp.linear1.{kind}" in ranks[0]:
                halves = [r[f"mlp.linear1.{kind}"].chunk(2, dim=0) for r in ranks]
                state[f"{prefix}mlp.up_proj.{kind}"] = torch.cat([h[0] for h in halves], dim=0)
                state[f"{prefix}mlp.gate_proj.{kind}"] = torch.cat([h[1] for h in halves], dim=0)
    _check_llama_state_dict(state, config, where=where)
    return state


def _check_llama_state_dict(state: Mapping[str, torch.Tensor], config, *, where: str) -> None:
    from neox_hf.model.spec import model_class_for_config

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in model_class_for_config(config)(config).state_dict().items()}
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    wrong = [k for k in expected.keys() & state.keys() if tuple(state[k].shape) != expected[k]]
    if missing or unexpected or wrong:
        raise CheckpointError(f"{where}: does not match the config: missing {missing[:6]}, unexpected {unexpected[:6]}, "
                              f"shapes differ for {[(k, tuple(state[k].shape), expected[k]) for k in wrong[:3]]} "
                              f"(hidden {config.hidden_size}, intermediate {config.intermediate_size}, heads "
                              f"{config.num_attention_heads}/{config.num_key_value_heads} key-value, biases "
                              f"attention {getattr(config, 'attention_bias', False)} mlp {getattr(config, 'mlp_bias', False)})")


def llama_rank_modules(state: Mapping[str, torch.Tensor], config, tp_size: int) -> list[dict[str, torch.Tensor]]:
    """Per TP rank, the `module` dict of a sequential-layout GPT-NeoX Llama-style checkpoint."""
    state = dict(state)
    for size, name in ((config.num_key_value_heads, "num_key_value_heads"), (config.intermediate_size,
                       "intermediate_size"), (config.vocab_size, "vocab_size")):
        if tp_size < 1 or size % tp_size:
            raise CheckpointError(f"tp_size={tp_size} does not divide config.{name}={size}; choose a tp_size that does")
    _check_llama_state_dict({**state, "lm_head.weight": state.get("lm_head.weight", state["model.embed_tokens.weight"])},
                            config, where="model to export")
    modules: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]

    def put(idx, name, parts):
        for module, part in zip(modules, parts):
            module[f"sequential.{idx}.{name}"] = part.detach().cpu().clone()

    outer = _llama_indices(config)
    put(0, "word_embeddings.weight", state["model.embed_tokens.weight"].chunk(tp_size, 0))
    for i in range(config.num_hidden_layers):
        prefix, idx = f"model.layers.{i}.", i + 2
        for name, (hf, rule) in LLAMA_LAYER_PARAMS.items():
            if prefix + hf in state:
                put(idx, name, split_tp_tensor(state[prefix + hf], rule, tp_size, parallel_residual=False))
        for kind in ("weight", "bias"):
            if f"{prefix}self_attn.q_proj.{kind}" in state:
                q, k, v = (state[f"{prefix}self_attn.{p}_proj.{kind}"] for p in "qkv")
                put(idx, f"attention.query_key_value.{kind}", _hf_qkv_to_ranks(q, k, v, config, tp_size))
            if f"{prefix}mlp.up_proj.{kind}" in state:
                ups, gates = (state[f"{prefix}mlp.{p}_proj.{kind}"].chunk(tp_size, 0) for p in ("up", "gate"))
                put(idx, f"mlp.linear1.{kind}", [torch.cat([u, g], dim=0) for u, g in zip(ups, gates)])
    put(outer["final_norm"], "norm.scale", [state["model.norm.weight"]] * tp_size)
    if "head" in outer:
        put(outer["head"], "final_linear.weight", state["lm_head.weight"].chunk(tp_size, 0))
    return modules
