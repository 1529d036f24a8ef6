"""Which GPTNeoXForCausalLM parameters are sharded, and along which dimension.

One table, keyed by module path like transformers' `base_model_tp_plan`, read by
`apply_tensor_parallel` (to build layers), `gather_full_state_dict` (to merge) and
`load_tp_shard_state_dict` (to slice safetensors), so the three cannot disagree.
"""

from fnmatch import fnmatch

TP_PLAN = {
    "gpt_neox.embed_in": "vocab_embedding",
    "gpt_neox.layers.*.attention.query_key_value": "column",
    "gpt_neox.layers.*.attention.dense": "row",
    "gpt_neox.layers.*.mlp.dense_h_to_4h": "column",
    "gpt_neox.layers.*.mlp.dense_4h_to_h": "row",
    "lm_head": "vocab_head",
}

# With sequence parallelism these replicated modules run on sequence slices: the embedding dropout enters the
# sequence-parallel region, every layer norm leaves it (gathering the sequence for the TP region after it).
SEQUENCE_PARALLEL_PLAN = {
    "gpt_neox.emb_dropout": "enter_sequence_parallel",
    "gpt_neox.layers.*.input_layernorm": "sequence_norm",
    "gpt_neox.layers.*.post_attention_layernorm": "sequence_norm",
    "gpt_neox.final_layer_norm": "sequence_norm",
}

# Column layers split output rows (weight dim 0, bias too); row layers split input columns
# (weight dim 1) and keep the bias whole; vocab layers split vocabulary rows.
_PARTITION_DIMS = {
    "column": {"weight": 0, "bias": 0},
    "row": {"weight": 1},
    "vocab_embedding": {"weight": 0},
    "vocab_head": {"weight": 0},
}


def layer_kind(module_name: str, plan: dict = TP_PLAN) -> str | None:
    """The `plan` kind of `module_name` (TP_PLAN: None when the module stays replicated)."""
    for pattern, kind in plan.items():
        if fnmatch(module_name, pattern):
            return kind
    return None


def partition_dim(state_dict_key: str) -> int | None:
    """The dimension along which `state_dict_key` is split across TP ranks, or None if replicated."""
    module_name, _, tensor_name = state_dict_key.rpartition(".")
    kind = layer_kind(module_name)
    return _PARTITION_DIMS[kind].get(tensor_name) if kind else None
