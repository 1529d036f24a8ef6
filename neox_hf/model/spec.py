"""One entry per model family: everything the parallel code, the builders and interop need to know about a model.

A `ModelSpec` says which classes build the family, where its modules live (`trunk`, embedding, layers, final norm,
head), which linear is column- or row-parallel (`tp_plan`, checked against transformers' own `base_model_tp_plan`
in the tests), which modules run on sequence slices under sequence parallelism, which layers are output projections
for GPT-NeoX's `output_layer_init_method`, the key/value-head attribute TP splits, and the model's names in GPT-NeoX
checkpoints. Adding a family is one module that builds its classes and calls `register_family(ModelSpec(...))`,
plus its import in `neox_hf/model/__init__.py`: this registry imports no family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from neox_hf.errors import RecipeError


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
    # config → our CausalLM class (GPT-NeoX init, stock weights and config); recipe `model` section → config
    model_class: Callable | None = field(default=None, compare=False)
    config_from_recipe: Callable | None = field(default=None, compare=False)

    def layer_path(self, index: int) -> str:
        return f"{self.layers}.{index}"


SPECS: dict[str, ModelSpec] = {}  # filled by the family modules as `neox_hf.model` imports them


def register_family(spec: ModelSpec) -> ModelSpec:
    """Add a family to the registry; its module calls this when imported (`neox_hf/model/__init__.py` imports
    every family, and Python imports that package before any of its modules)."""
    SPECS[spec.family] = spec
    return spec


def spec_for_family(family: str) -> ModelSpec:
    return SPECS[family]


def spec_for_config(config) -> ModelSpec:
    """The spec of a transformers config (by `model_type`)."""
    return spec_for_model_type(getattr(config, "model_type", None))


def spec_for_model_type(model_type: str | None, where: str = "") -> ModelSpec:
    """The spec registered for a config.json `model_type`; a RecipeError listing the registered ones otherwise
    (`where`: the folder, for the message)."""
    for spec in SPECS.values():
        if model_type in spec.model_types:
            return spec
    raise RecipeError(f"{where or 'the model'} is a {model_type!r} model (config.json model_type), which neox_hf does "
                      f"not train; it trains {trained_model_types()}: give a model of one of those")


def trained_model_types() -> str:
    """The registered families and their model_types, for messages: `gpt_neox (gpt_neox), llama (llama, mistral)`."""
    return ", ".join(f"{spec.family} (model_type {' / '.join(spec.model_types)})" for spec in SPECS.values())


def spec_for_model(model) -> ModelSpec:
    return spec_for_config(model.config)


def family_module_names(model, names) -> list[str]:
    """`names` (module leaf names, e.g. LoRA targets) with GPTNeoX's names replaced by `model`'s family's."""
    mapping = spec_for_model(model).from_gpt_neox_names
    return list(dict.fromkeys(n for name in names for n in mapping.get(name, (name,))))


def model_class_for_config(config):
    """Our CausalLM class (GPT-NeoX init, stock weights and config) for a transformers config."""
    return spec_for_config(config).model_class(config)


def config_class_for_folder(folder: str):
    """Our config class for an HF folder, by its config.json `model_type`."""
    from transformers import AutoConfig

    stock = AutoConfig.from_pretrained(folder)
    return model_class_for_config(stock).config_class


def config_from_recipe(model_cfg, **kwargs):
    """The family's transformers config from a recipe's `model` section (`neox_hf.recipe.ModelConfig`)."""
    return spec_for_family(model_cfg.family).config_from_recipe(model_cfg, **kwargs)


def family_config_kwargs(model_cfg, *, vocab_size: int, bos_token_id: int | None, eos_token_id: int | None,
                         pad_token_id: int | None) -> dict:
    """The config values every model family takes the same way from a recipe's `model` section (sizes, init,
    dropout, special ids); each family's builder adds its own (norm, MLP width, rotary, attention layout)."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=model_cfg.hidden_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        hidden_act=model_cfg.hidden_act,
        max_position_embeddings=model_cfg.max_position_embeddings or model_cfg.seq_length,
        tie_word_embeddings=model_cfg.tie_word_embeddings,
        attention_dropout=model_cfg.attention_dropout,
        initializer_range=model_cfg.init_method_std,
        init_method=model_cfg.init_method,
        output_layer_init_method=model_cfg.output_layer_init_method,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
