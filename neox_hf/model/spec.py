"""One entry per model family: everything the parallel code, the builders and interop need to know about a model.

A `ModelSpec` says which classes build the family, where its modules live (`trunk`, embedding, layers, final norm,
head), which linear is column- or row-parallel (`tp_plan`, checked against transformers' own `base_model_tp_plan`
in the tests), which modules run on sequence slices under sequence parallelism, which layers are output projections
for GPT-NeoX's `output_layer_init_method`, the key/value-head attribute TP splits, and the model's names in GPT-NeoX
checkpoints. Adding a family is one new entry in `SPECS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelSpec:
    family: str  # recipe `model.family`
    model_types: tuple[str, ...]  # config.json `model_type`s of the family
    trunk: str  # the base model's attribute in the CausalLM (`gpt_neox`, `model`)
    embedding: str  # module paths inside the CausalLM
    layers: str
    final_norm: str
    head: str
    # Module path pattern → our TP layer kind (column, row, vocab_embedding, vocab_head)
    tp_plan: dict[str, str] = field(default_factory=dict)
    # Module path pattern → sequence-parallel kind (enter_sequence_parallel, sequence_norm)
    sequence_parallel_plan: dict[str, str] = field(default_factory=dict)
    output_layers: tuple[str, ...] = ()  # module-path suffixes initialised with output_layer_init_method
    kv_heads_attr: str = "num_attention_heads"  # config attribute TP must divide besides the query heads
    # GPTNeoX module leaf names → this family's, so `peft.target_modules` written for GPTNeoX (the default) wraps
    # the same roles here
    from_gpt_neox_names: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def layer_path(self, index: int) -> str:
        return f"{self.layers}.{index}"


GPT_NEOX = ModelSpec(
    family="gpt_neox",
    model_types=("gpt_neox",),
    trunk="gpt_neox",
    embedding="gpt_neox.embed_in",
    layers="gpt_neox.layers",
    final_norm="gpt_neox.final_layer_norm",
    head="lm_head",
    tp_plan={
        "gpt_neox.embed_in": "vocab_embedding",
        "gpt_neox.layers.*.attention.query_key_value": "column",
        "gpt_neox.layers.*.attention.dense": "row",
        "gpt_neox.layers.*.mlp.dense_h_to_4h": "column",
        "gpt_neox.layers.*.mlp.dense_4h_to_h": "row",
        "lm_head": "vocab_head",
    },
    # The embedding dropout enters the sequence-parallel region, every layer norm leaves it.
    sequence_parallel_plan={
        "gpt_neox.emb_dropout": "enter_sequence_parallel",
        "gpt_neox.layers.*.input_layernorm": "sequence_norm",
        "gpt_neox.layers.*.post_attention_layernorm": "sequence_norm",
        "gpt_neox.final_layer_norm": "sequence_norm",
    },
    output_layers=("attention.dense", "mlp.dense_4h_to_h"),
)

LLAMA = ModelSpec(
    family="llama",
    model_types=("llama", "mistral"),
    trunk="model",
    embedding="model.embed_tokens",
    layers="model.layers",
    final_norm="model.norm",
    head="lm_head",
    # q/k/v rows are whole heads ([heads, head_dim], [kv_heads, head_dim]): contiguous row blocks give each rank
    # heads/TP query heads and the kv_heads/TP key/value heads their groups use.
    tp_plan={
        "model.embed_tokens": "vocab_embedding",
        "model.layers.*.self_attn.q_proj": "column",
        "model.layers.*.self_attn.k_proj": "column",
        "model.layers.*.self_attn.v_proj": "column",
        "model.layers.*.self_attn.o_proj": "row",
        "model.layers.*.mlp.gate_proj": "column",
        "model.layers.*.mlp.up_proj": "column",
        "model.layers.*.mlp.down_proj": "row",
        "lm_head": "vocab_head",
    },
    # Llama has no embedding dropout and builds positions and masks from the embeddings: the first layer's input
    # enters the sequence-parallel region; every RMSNorm leaves it.
    sequence_parallel_plan={
        "model.layers.0": "enter_sequence_parallel_layer",
        "model.layers.*.input_layernorm": "sequence_norm",
        "model.layers.*.post_attention_layernorm": "sequence_norm",
        "model.norm": "sequence_norm",
    },
    # GPT-NeoX's attention.dense and mlp.linear2
    output_layers=("self_attn.o_proj", "mlp.down_proj"),
    kv_heads_attr="num_key_value_heads",
    from_gpt_neox_names={"query_key_value": ("q_proj", "k_proj", "v_proj"), "dense": ("o_proj",),
                         "dense_h_to_4h": ("gate_proj", "up_proj"), "dense_4h_to_h": ("down_proj",)},
)

SPECS = {spec.family: spec for spec in (GPT_NEOX, LLAMA)}


def spec_for_family(family: str) -> ModelSpec:
    return SPECS[family]


def spec_for_config(config) -> ModelSpec:
    """The spec of a transformers config (by `model_type`)."""
    model_type = getattr(config, "model_type", None)
    for spec in SPECS.values():
        if model_type in spec.model_types:
            return spec
    known = ", ".join(t for spec in SPECS.values() for t in spec.model_types)
    raise ValueError(f"model_type {model_type!r} is not a family neox_hf trains (known: {known})")


def spec_for_model(model) -> ModelSpec:
    return spec_for_config(model.config)


def family_module_names(model, names) -> list[str]:
    """`names` (module leaf names, e.g. LoRA targets) with GPTNeoX's names replaced by `model`'s family's."""
    mapping = spec_for_model(model).from_gpt_neox_names
    return list(dict.fromkeys(n for name in names for n in mapping.get(name, (name,))))


def model_class_for_config(config):
    """Our CausalLM class (GPT-NeoX init, stock weights and config) for a transformers config."""
    spec = spec_for_config(config)
    if spec.family == "gpt_neox":
        from neox_hf.model.modeling import NeoXForCausalLM

        return NeoXForCausalLM
    from neox_hf.model.llama import llama_model_class

    return llama_model_class(config)


def config_class_for_folder(folder: str):
    """Our config class for an HF folder, by its config.json `model_type`."""
    from transformers import AutoConfig

    stock = AutoConfig.from_pretrained(folder)
    return model_class_for_config(stock).config_class


def from_pretrained_whole(model_class, folder, *, new_weights: tuple[str, ...] = (), **kwargs):
    """`model_class.from_pretrained(folder, **kwargs)`, or CheckpointError naming the weights the folder lacks, unless
    each starts with one of `new_weights` (a head the recipe adds on purpose: the rm objective's `score`).
    Gap filled: transformers draws missing weights at random and only prints a load report, so a reward model's
    folder loaded as a causal LM would train, evaluate and generate with a random LM head, exit 0."""
    from neox_hf.errors import CheckpointError

    model, info = model_class.from_pretrained(folder, output_loading_info=True, **kwargs)
    missing = sorted(k for k in info["missing_keys"] if not k.startswith(new_weights))
    if missing:
        stored = ", ".join(model.config.architectures or ["an unnamed architecture"])
        named = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        hint = ("a reward model's folder has no LM head: give the causal-LM folder it was trained from (or "
                "`neox_hf eval --objective rm` to score with it)" if stored.endswith("ForSequenceClassification")
                else "give a folder saved from the same kind of model")
        raise CheckpointError(f"{folder} holds {stored} weights without {named}, which {type(model).__name__} needs "
                              f"(they would be drawn at random); {hint}")
    return model


def config_from_recipe(model_cfg, **kwargs):
    """The family's transformers config from a recipe's `model` section (`neox_hf.recipe.ModelConfig`)."""
    if model_cfg.family == "llama":
        from neox_hf.model.llama import llama_config_from_recipe

        return llama_config_from_recipe(model_cfg, **kwargs)
    from neox_hf.model.modeling import config_from_recipe as neox_config_from_recipe

    return neox_config_from_recipe(model_cfg, **kwargs)
