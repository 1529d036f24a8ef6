"""GPT-NeoX's Llama-family models (RMSNorm, SwiGLU, grouped-query attention, sliding windows) on transformers'
`LlamaForCausalLM` / `MistralForCausalLM`, plus GPT-NeoX's initialisation; nothing forked.

GPT-NeoX builds these from its own `ParallelMLP` / `ParallelSelfAttention` (`norm: rmsnorm`, `activation: swiglu`,
`num_kv_heads`, `sliding_window_width`); the weights map one to one onto transformers' Llama (GPT-NeoX rotates
halves, as HF Llama does). A sliding window selects Mistral, whose modules and weights are Llama's plus the window.

What we add, as for GPTNeoX (`modeling.py`): GPT-NeoX's `init_method` / `output_layer_init_method`, and a config that
serialises as the stock one (`model_type: llama|mistral`, `architectures: ["LlamaForCausalLM"]`), so stock
transformers loads what we save without `trust_remote_code`.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel, MistralConfig, MistralForCausalLM, MistralModel
from transformers.models.llama.modeling_llama import LlamaPreTrainedModel
from transformers.models.mistral.modeling_mistral import MistralPreTrainedModel

from neox_hf.model.init import _NeoXInitMixin
from neox_hf.model.spec import ModelSpec, family_config_kwargs, register_family

_STOCK_ARCHITECTURES = {"NeoXLlamaForCausalLM": "LlamaForCausalLM", "NeoXLlamaModel": "LlamaModel",
                        "NeoXMistralForCausalLM": "MistralForCausalLM", "NeoXMistralModel": "MistralModel"}


def gated_mlp_widths(ffn_dim: int, multiple_of: int) -> tuple[int, int]:
    """(linear1 rows, inner width) that GPT-NeoX's `ParallelMLP` builds for a gated activation (swiglu, geglu) from
    `ffn_dim` (`intermediate_size`, else `expansion_factor` × hidden, else 4 × hidden): two thirds of it, so the gated
    MLP has as many parameters as the dense one; linear1 (both halves) rounded up to 2 × `mlp_multiple_of`, the inner
    width (linear2's input, HF's `intermediate_size`) halved and rounded up to `mlp_multiple_of`. Llama-2-7B's
    `intermediate_size: 32768` → (22016, 11008). Where linear1 is not twice the inner width GPT-NeoX's own forward
    fails (its gated activation halves linear1's output for linear2)."""
    two_thirds = int(ffn_dim * 2 / 3)
    linear1 = 2 * multiple_of * ((two_thirds + 2 * multiple_of - 1) // (2 * multiple_of))
    inner = multiple_of * ((two_thirds // 2 + multiple_of - 1) // multiple_of)
    return linear1, inner


def gated_mlp_width(ffn_dim: int, multiple_of: int) -> int:
    """The inner width of `gated_mlp_widths`."""
    return gated_mlp_widths(ffn_dim, multiple_of)[1]


def _stock_to_dict(output: dict) -> dict:
    if output.get("architectures"):
        output["architectures"] = [_STOCK_ARCHITECTURES.get(a, a) for a in output["architectures"]]
    return output


@strict
class NeoXLlamaConfig(LlamaConfig):
    """LlamaConfig with GPT-NeoX's init options; serialises as a stock `llama` config."""

    init_method: str = "small_init"
    output_layer_init_method: str = "wang_init"

    def to_dict(self) -> dict:
        return _stock_to_dict(super().to_dict())


@strict
class NeoXMistralConfig(MistralConfig):
    """MistralConfig with GPT-NeoX's init options; serialises as a stock `mistral` config."""

    init_method: str = "small_init"
    output_layer_init_method: str = "wang_init"

    def to_dict(self) -> dict:
        return _stock_to_dict(super().to_dict())


class NeoXLlamaModel(_NeoXInitMixin, LlamaModel):
    config_class = NeoXLlamaConfig


class NeoXLlamaForCausalLM(_NeoXInitMixin, LlamaForCausalLM):
    """`LlamaForCausalLM` with GPT-NeoX initialisation; same weights, keys, config and forward."""

    config_class = NeoXLlamaConfig

    def __init__(self, config):
        # The trunk is NeoXLlamaModel so that transformers' per-submodel init reaches our `_init_weights`.
        LlamaPreTrainedModel.__init__(self, config)
        self.model = NeoXLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


class NeoXMistralModel(_NeoXInitMixin, MistralModel):
    config_class = NeoXMistralConfig


class NeoXMistralForCausalLM(_NeoXInitMixin, MistralForCausalLM):
    """`MistralForCausalLM` (Llama + a sliding attention window) with GPT-NeoX initialisation."""

    config_class = NeoXMistralConfig

    def __init__(self, config):
        MistralPreTrainedModel.__init__(self, config)
        self.model = NeoXMistralModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


def llama_config_from_recipe(model_cfg, *, vocab_size: int, bos_token_id: int | None = 0, eos_token_id: int | None = 0,
                             pad_token_id: int | None = None):
    """NeoXLlamaConfig (NeoXMistralConfig where `model.sliding_window` is set) from a recipe's `model` section."""
    kwargs = dict(
        **family_config_kwargs(model_cfg, vocab_size=vocab_size, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                               pad_token_id=pad_token_id),
        num_key_value_heads=model_cfg.num_kv_heads or model_cfg.num_attention_heads,
        intermediate_size=llama_intermediate_size(model_cfg),
        rope_parameters={"rope_type": "default", "rope_theta": float(model_cfg.rotary_emb_base)},
        rms_norm_eps=model_cfg.layer_norm_eps,
    )
    if model_cfg.sliding_window:
        return NeoXMistralConfig(sliding_window=model_cfg.sliding_window, **kwargs)
    return NeoXLlamaConfig(attention_bias=bool(model_cfg.attention_bias), mlp_bias=bool(model_cfg.mlp_bias), **kwargs)


def llama_intermediate_size(model_cfg) -> int:
    """The MLP's inner width (HF `intermediate_size`): the recipe's, else GPT-NeoX's gated arithmetic on 4 × hidden
    with Llama's multiple of 256."""
    return model_cfg.intermediate_size or gated_mlp_width(4 * model_cfg.hidden_size, 256)


def llama_model_class(config):
    """Our class for a Llama-family config (Mistral where it has a sliding window)."""
    return NeoXMistralForCausalLM if getattr(config, "model_type", "llama") == "mistral" else NeoXLlamaForCausalLM


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
    model_class=llama_model_class,
    config_from_recipe=llama_config_from_recipe,
)
register_family(LLAMA)
