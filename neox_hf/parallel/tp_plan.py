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

# Column layers split output rows (weight dim 0, bias too); row layers split input columns
# (weight dim 1) and keep the bias whole; vocab layers split vocabulary rows.
_PARTITION_DIMS = {
    "column": {"weight": 0, "bias": 0},
    "row": {"weight": 1},
    "vocab_embedding": {"weight": 0},
    "vocab_head": {"weight": 0},
}


def layer_kind(module_name: str) -> str | None:
    """The TP_PLAN kind of `module_name`, or None when the module stays replicated."""
    for pattern, kind in TP_PLAN.items():
        if fnmatch(module_name, pattern):
            return kind
    return None


def partition_dim(state_dict_key: str) -> int | None:
    """The dimension along which `state_dict_key` is split across TP ranks, or None if replicated."""
    module_name, _, tensor_name = state_dict_key.rpartition(".")
    kind = layer_kind(module_name)
    return _PARTITION_DIMS[kind].get(tensor_name) if kind else None
