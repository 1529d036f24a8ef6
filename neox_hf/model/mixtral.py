"""The Mixtral family: transformers' `MixtralForCausalLM` (Llama attention, SwiGLU experts in every layer, a softmax
top-k router renormalised over the chosen experts, `router_aux_loss_coef`, `router_jitter_noise`), plus GPT-NeoX's
initialisation; nothing forked.

What we add, as for Llama (`llama.py`): GPT-NeoX's `init_method` / `output_layer_init_method` (the experts' 3-D
`gate_up_proj` as GPT-NeoX's w1 / w3, `down_proj` as its output layer w2), the router's records for the router loss
and the logged routing statistics (`neox_hf.model.moe`), and a config that serialises as the stock one
(`model_type: mixtral`, `architectures: ["MixtralForCausalLM"]`), so stock transformers loads what we save without
`trust_remote_code`. The experts run through transformers' experts kernels (`grouped_mm` where torch has it, CUDA
and CPU alike: faster than `eager`'s loop over experts and `batched_mm`'s per-token copies on this stack).

GPT-NeoX's Llama-style MoE configs (`norm: rmsnorm`, `activation: swiglu`, `moe_num_experts`) are translated to this
family (`neox_hf.neox_yaml`): the gated experts GPT-NeoX defines for Llama layers (`ParallelGroupedLLaMAMLP`) with
Mixtral's router, the one transformers has for that architecture.
"""

from __future__ import annotations

import math

from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import MixtralConfig, MixtralForCausalLM, MixtralModel
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralPreTrainedModel, MixtralTopKRouter

from neox_hf.model.init import _NeoXInitMixin
from neox_hf.model.moe import ExpertsKernels, attach_router_records, init_experts_, init_router_
from neox_hf.model.spec import ModelSpec, family_config_kwargs, register_family

_STOCK_ARCHITECTURES = {"NeoXMixtralForCausalLM": "MixtralForCausalLM", "NeoXMixtralModel": "MixtralModel"}


@strict
class NeoXMixtralConfig(MixtralConfig):
    """MixtralConfig with GPT-NeoX's init options; serialises as a stock `mixtral` config."""

    init_method: str = "small_init"
    output_layer_init_method: str = "wang_init"

    def to_dict(self) -> dict:
        output = super().to_dict()
        if output.get("architectures"):
            output["architectures"] = [_STOCK_ARCHITECTURES.get(a, a) for a in output["architectures"]]
        return output


class _MixtralInit(ExpertsKernels, _NeoXInitMixin):
    def _init_weights(self, module):
        if isinstance(module, MixtralExperts):
            return init_experts_(module, self.config, up="gate_up_proj", down="down_proj")
        if isinstance(module, MixtralTopKRouter):
            return init_router_(module.weight, self.config)
        return super()._init_weights(module)


class NeoXMixtralModel(_MixtralInit, MixtralModel):
    config_class = NeoXMixtralConfig


class NeoXMixtralForCausalLM(_MixtralInit, MixtralForCausalLM):
    """`MixtralForCausalLM` with GPT-NeoX initialisation and recorded routers; same weights, keys, config and
    forward."""

    config_class = NeoXMixtralConfig

    def __init__(self, config):
        MixtralPreTrainedModel.__init__(self, config)
        self.model = NeoXMixtralModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.router_aux_loss_coef = config.router_aux_loss_coef
        self.num_experts = config.num_local_experts
        self.num_experts_per_tok = config.num_experts_per_tok
        self.post_init()
        attach_router_records(self, [layer.mlp.gate for layer in self.model.layers], self.model,
                              num_experts=config.num_local_experts, top_k=config.num_experts_per_tok)


def _register_stock_key_renames() -> None:
    """Give our classes stock Mixtral's checkpoint conversion (per-expert `block_sparse_moe.experts.N.w1/w2/w3` ↔ the
    3-D `mlp.experts.gate_up_proj` / `down_proj`): transformers applies it by class name or `model_type`, but skips
    classes defined outside the library unless registered by name, so a stock folder would load with random
    experts."""
    from transformers.conversion_mapping import (get_checkpoint_conversion_mapping,
                                                 register_checkpoint_conversion_mapping)

    stock = get_checkpoint_conversion_mapping("mixtral")
    if stock is None:
        return
    for name in ("NeoXMixtralForCausalLM", "NeoXMixtralModel"):
        register_checkpoint_conversion_mapping(name, stock, overwrite=True)


_register_stock_key_renames()


def gated_expert_width(hidden_size: int, multiple_of: int = 256) -> int:
    """GPT-NeoX's default per-expert width of gated experts (`ParallelGroupedLLaMAMLP`): int(8/3 × hidden) rounded
    up to a multiple of 256 (each of the gate and up projections; HF's `intermediate_size`)."""
    return multiple_of * math.ceil(int(2 * hidden_size * 4 / 3) / multiple_of)


def mixtral_config_from_recipe(model_cfg, *, vocab_size: int, bos_token_id: int | None = 0,
                               eos_token_id: int | None = 0, pad_token_id: int | None = None) -> NeoXMixtralConfig:
    """NeoXMixtralConfig from a recipe's `model` section: the router loss is on (`output_router_logits`) when its
    coefficient is above 0 (transformers' default coefficient 0.02 where the recipe gives none)."""
    coef = 0.02 if model_cfg.moe_aux_loss_coef is None else model_cfg.moe_aux_loss_coef
    return NeoXMixtralConfig(
        **family_config_kwargs(model_cfg, vocab_size=vocab_size, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                               pad_token_id=pad_token_id),
        num_key_value_heads=model_cfg.num_kv_heads or model_cfg.num_attention_heads,
        intermediate_size=model_cfg.intermediate_size or gated_expert_width(model_cfg.hidden_size),
        rope_parameters={"rope_type": "default", "rope_theta": float(model_cfg.rotary_emb_base)},
        rms_norm_eps=model_cfg.layer_norm_eps,
        sliding_window=model_cfg.sliding_window,
        num_local_experts=model_cfg.moe_num_experts,
        num_experts_per_tok=model_cfg.moe_top_k or 2,
        router_aux_loss_coef=float(coef),
        output_router_logits=coef > 0,
        router_jitter_noise=float(model_cfg.moe_jitter_eps or 0.0),
    )


MIXTRAL = ModelSpec(
    family="mixtral",
    model_types=("mixtral",),
    trunk="model",
    embedding="model.embed_tokens",
    layers="model.layers",
    final_norm="model.norm",
    head="lm_head",
    # Attention and the vocabulary as Llama's; the experts and the router stay whole on every TP rank here (expert
    # parallelism splits the experts: `parallel.expert_parallel`).
    tp_plan={
        "model.embed_tokens": "vocab_embedding",
        "model.layers.*.self_attn.q_proj": "column",
        "model.layers.*.self_attn.k_proj": "column",
        "model.layers.*.self_attn.v_proj": "column",
        "model.layers.*.self_attn.o_proj": "row",
        "lm_head": "vocab_head",
    },
    sequence_parallel_plan={
        "model.layers.0": "enter_sequence_parallel_layer",
        "model.layers.*.input_layernorm": "sequence_norm",
        "model.layers.*.post_attention_layernorm": "sequence_norm",
        "model.norm": "sequence_norm",
    },
    # GPT-NeoX's attention.dense and the experts' w2
    output_layers=("self_attn.o_proj", "experts.down_proj"),
    kv_heads_attr="num_key_value_heads",
    # LoRA's GPT-NeoX names: attention only (the experts are 3-D parameters, not linears)
    from_gpt_neox_names={"query_key_value": ("q_proj", "k_proj", "v_proj"), "dense": ("o_proj",),
                         "dense_h_to_4h": (), "dense_4h_to_h": ()},
    model_class=lambda config: NeoXMixtralForCausalLM,
    config_from_recipe=mixtral_config_from_recipe,
)
register_family(MIXTRAL)
