"""NeoXConfig / NeoXForCausalLM: transformers' GPTNeoX, plus GPT-NeoX's initialisation, nothing forked.

What we add over `transformers.GPTNeoXForCausalLM`:
- GPT-NeoX's `init_method` / `output_layer_init_method` (`normal`, `scaled_normal`, `small_init`, `wang_init`) for
  training from scratch; transformers only knows one `initializer_range` for every layer.
- Files we save are stock GPTNeoX files (`model_type: gpt_neox`, `architectures: ["GPTNeoXForCausalLM"]`,
  `embed_out.weight`), so stock transformers loads them without `trust_remote_code`.
- A layout-free init (`initial_tensor`): each parameter drawn from a generator seeded by the run's seed and the
  parameter's name, so a run from scratch starts from the same weights whole, as pipeline stages or as TP shards
  (transformers' init walks modules in order on one global generator, so its draws depend on what a rank builds).
- transformers renames the stored `embed_out.weight` to `lm_head.weight` with a conversion mapping keyed by the
  class name `GPTNeoXForCausalLM`; a subclass of another name would silently get a random `lm_head`, so we register
  the same mapping for our class names.

The model knows nothing of distribution: tensor parallelism and ZeRO are applied from outside (`neox_hf.parallel`).
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXModel
from transformers.conversion_mapping import (
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
)
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXPreTrainedModel

from neox_hf.model.init import _NeoXInitMixin
from neox_hf.model.spec import ModelSpec, family_config_kwargs, register_family

# Our class name → the stock class name written into config.json `architectures`.
_STOCK_ARCHITECTURES = {"NeoXForCausalLM": "GPTNeoXForCausalLM", "NeoXModel": "GPTNeoXModel"}


@strict
class NeoXConfig(GPTNeoXConfig):
    """GPTNeoXConfig with GPT-NeoX's init options; serialises as a stock `gpt_neox` config.

    The two extra keys are harmless to stock transformers (it keeps unknown keys as attributes).
    """

    init_method: str = "small_init"
    output_layer_init_method: str = "wang_init"

    def to_dict(self) -> dict:
        output = super().to_dict()
        if output.get("architectures"):
            output["architectures"] = [_STOCK_ARCHITECTURES.get(a, a) for a in output["architectures"]]
        return output


class NeoXModel(_NeoXInitMixin, GPTNeoXModel):
    config_class = NeoXConfig


class NeoXForCausalLM(_NeoXInitMixin, GPTNeoXForCausalLM):
    """`GPTNeoXForCausalLM` with GPT-NeoX initialisation; same weights, keys, config and forward."""

    config_class = NeoXConfig

    def __init__(self, config: NeoXConfig):
        # Same three modules as the stock __init__, but the trunk is NeoXModel so that transformers' per-submodel
        # init dispatch reaches our `_init_weights` for every layer.
        GPTNeoXPreTrainedModel.__init__(self, config)
        self.gpt_neox = NeoXModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


def _register_stock_key_renames() -> None:
    """Give our classes the stock `embed_out` ↔ `lm_head` rename (keyed by class name in transformers)."""
    stock = get_checkpoint_conversion_mapping("GPTNeoXForCausalLM")
    if stock is None:  # an older transformers that stores lm_head as embed_out natively
        return
    for name in ("NeoXForCausalLM",):
        register_checkpoint_conversion_mapping(name, stock, overwrite=True)


_register_stock_key_renames()


def config_from_recipe(
    model_cfg, *, vocab_size: int, bos_token_id: int | None = 0, eos_token_id: int | None = 0, pad_token_id: int | None = None
) -> NeoXConfig:
    """NeoXConfig from a recipe's `model` section (a `neox_hf.recipe.ModelConfig`), the padded vocab size and the
    tokenizer's special ids."""
    return NeoXConfig(
        **family_config_kwargs(model_cfg, vocab_size=vocab_size, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                               pad_token_id=pad_token_id),
        intermediate_size=model_cfg.intermediate_size or 4 * model_cfg.hidden_size,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(model_cfg.rotary_emb_base),
            "partial_rotary_factor": float(model_cfg.rotary_pct),
        },
        use_parallel_residual=model_cfg.use_parallel_residual,
        layer_norm_eps=model_cfg.layer_norm_eps,
        hidden_dropout=model_cfg.hidden_dropout,
    )


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
    model_class=lambda config: NeoXForCausalLM,
    config_from_recipe=config_from_recipe,
)
register_family(GPT_NEOX)
