"""The one sharding table: every GPTNeoX tensor's Hugging Face name, GPT-NeoX name and tensor-parallel split rule.

Read by `apply_tensor_parallel` (which layer replaces which module: `TP_PLAN`), `gather_full_state_dict` and
`load_tp_shard_state_dict` (`partition_dim`), and `interop/neox_checkpoint` (GPT-NeoX names and merge/split rules),
so the three cannot disagree.

The module-level plan is transformers' own (`GPTNeoXConfig.base_model_tp_plan` + the head's `_tp_plan`), translated
to our layer kinds; `transformers_tp_plan()` derives it and the tests check it still agrees with the table below.
Where transformers gathers the head's output (`colwise_gather_output`) we keep the logits sharded for the loss;
the split of the weight is the same.
"""

from fnmatch import fnmatch

# How a tensor is split over tensor-parallel ranks.
COLUMN = "column"  # output rows sharded (column-parallel linear, vocab-parallel embedding / head): dim 0
ROW = "row"  # input columns sharded (row-parallel linear weight): dim 1
ROW_BIAS = "row_bias"  # row-parallel bias: whole on every rank, added once after the reduce (GPT-NeoX: see merge)
REPLICATED = "replicated"  # layer norms: one full copy per rank
_SPLIT_DIM = {COLUMN: 0, ROW: 1}

# HF tensor name inside a GPTNeoX layer → (GPT-NeoX name inside its layer, rule). QKV rows are [heads, 3, head_dim],
# so contiguous row blocks are whole heads on both sides and ranks concatenate with no reordering.
LAYER_TENSORS: dict[str, tuple[str, str]] = {
    "input_layernorm.weight": ("input_layernorm.weight", REPLICATED),
    "input_layernorm.bias": ("input_layernorm.bias", REPLICATED),
    "post_attention_layernorm.weight": ("post_attention_layernorm.weight", REPLICATED),
    "post_attention_layernorm.bias": ("post_attention_layernorm.bias", REPLICATED),
    "attention.query_key_value.weight": ("attention.query_key_value.weight", COLUMN),
    "attention.query_key_value.bias": ("attention.query_key_value.bias", COLUMN),
    "attention.dense.weight": ("attention.dense.weight", ROW),
    "attention.dense.bias": ("attention.dense.bias", ROW_BIAS),
    "mlp.dense_h_to_4h.weight": ("mlp.linear1.weight", COLUMN),
    "mlp.dense_h_to_4h.bias": ("mlp.linear1.bias", COLUMN),
    "mlp.dense_4h_to_h.weight": ("mlp.linear2.weight", ROW),
    "mlp.dense_4h_to_h.bias": ("mlp.linear2.bias", ROW_BIAS),
}
# Tensors outside the layers: HF name → (GPT-NeoX name in its own pipeline layer, rule).
EMBEDDING_TENSORS = {"gpt_neox.embed_in.weight": ("word_embeddings.weight", COLUMN)}
FINAL_NORM_TENSORS = {
    "gpt_neox.final_layer_norm.weight": ("norm.weight", REPLICATED),
    "gpt_neox.final_layer_norm.bias": ("norm.bias", REPLICATED),
}
HEAD_TENSORS = {"lm_head.weight": ("final_linear.weight", COLUMN)}

# Module path → the layer that replaces it under TP (our kinds), and the sequence-parallel plan: each family's
# entry in neox_hf.model.spec (the GPTNeoX names below are its spec's).
from neox_hf.model.modeling import GPT_NEOX  # noqa: E402
from neox_hf.model.spec import SPECS, spec_for_model  # noqa: E402

TP_PLAN = GPT_NEOX.tp_plan
SEQUENCE_PARALLEL_PLAN = GPT_NEOX.sequence_parallel_plan

# The Llama family (LlamaForCausalLM, MistralForCausalLM): HF tensor inside a layer → rule. GPT-NeoX stores q/k/v as
# one query_key_value and gate/up as one linear1 per TP rank (interop/neox_checkpoint.py merges and splits them).
LLAMA_LAYER_RULES: dict[str, str] = {
    "input_layernorm.weight": REPLICATED,
    "post_attention_layernorm.weight": REPLICATED,
    **{f"self_attn.{p}_proj.{t}": COLUMN for p in "qkv" for t in ("weight", "bias")},
    "self_attn.o_proj.weight": ROW,
    "self_attn.o_proj.bias": ROW_BIAS,
    **{f"mlp.{p}_proj.{t}": COLUMN for p in ("gate", "up") for t in ("weight", "bias")},
    "mlp.down_proj.weight": ROW,
    "mlp.down_proj.bias": ROW_BIAS,
}
LLAMA_OUTER_RULES = {"model.embed_tokens.weight": COLUMN, "model.norm.weight": REPLICATED, "lm_head.weight": COLUMN}

# transformers' parallel styles → our layer kinds (same split of the weight).
_TRANSFORMERS_STYLES = {"colwise": "column", "rowwise": "row", "embedding_rowwise": "vocab_embedding",
                        "colwise_gather_output": "vocab_head"}


def transformers_tp_plan(family: str = "gpt_neox") -> dict[str, str]:
    """transformers' plan of a family (`base_model_tp_plan` under the trunk's name, the head's `_tp_plan`) in our
    kinds. Llama's base plan leaves the embedding out; the spec splits it along the vocabulary as GPT-NeoX does."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

    config, model = {"gpt_neox": (GPTNeoXConfig, GPTNeoXForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[family]
    trunk = SPECS[family].trunk
    plan = {f"{trunk}.{k}": v for k, v in (config.base_model_tp_plan or {}).items()}
    plan.update(getattr(model, "_tp_plan", None) or {})
    return {name: _TRANSFORMERS_STYLES.get(style, style) for name, style in plan.items()}


def plan_for(model) -> dict[str, str]:
    """The TP plan of `model`'s family."""
    return spec_for_model(model).tp_plan


def layer_kind(module_name: str, plan: dict | None = None) -> str | None:
    """The `plan` kind of `module_name` (default: every family's TP plan, whose paths do not overlap; None when the
    module stays replicated)."""
    if plan is None:
        return next((kind for spec in SPECS.values() if (kind := layer_kind(module_name, spec.tp_plan))), None)
    for pattern, kind in plan.items():
        if fnmatch(module_name, pattern):
            return kind
    return None


def split_rule(state_dict_key: str) -> str | None:
    """The table's rule for an HF state-dict key (None for keys the table does not hold, e.g. rotary buffers)."""
    for table in (EMBEDDING_TENSORS, FINAL_NORM_TENSORS, HEAD_TENSORS):
        if state_dict_key in table:
            return table[state_dict_key][1]
    if state_dict_key in LLAMA_OUTER_RULES:
        return LLAMA_OUTER_RULES[state_dict_key]
    prefix, sep, rest = state_dict_key.partition(".layers.")
    _, _, inner = rest.partition(".")
    if sep and prefix == "gpt_neox" and inner in LAYER_TENSORS:
        return LAYER_TENSORS[inner][1]
    if sep and prefix == "model" and inner in LLAMA_LAYER_RULES:
        return LLAMA_LAYER_RULES[inner]
    return None


def partition_dim(state_dict_key: str) -> int | None:
    """The dimension along which `state_dict_key` is split across TP ranks, or None if replicated."""
    return _SPLIT_DIM.get(split_rule(state_dict_key))
