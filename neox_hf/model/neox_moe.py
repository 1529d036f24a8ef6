"""The `gpt_neox_moe` family: GPT-NeoX's own dropless MoE (`125M-dmoe.yml`) on GPTNeoX layers, trained as GPT-NeoX
computes it (`modeling_gpt_neox_moe`: Sinkhorn or top-k routing without renormalisation, non-gated experts every
`moe_expert_interval` layers), plus GPT-NeoX's initialisation and the router records of `neox_hf.model.moe`.

No stock transformers class computes this (see `modeling_gpt_neox_moe`'s docstring), so the saved folder carries
`modeling_gpt_neox_moe.py` and an `auto_map`: stock transformers loads it with `trust_remote_code=True`, and the
start-up report says so. The experts are transformers' experts kernels (`@use_experts_implementation`, 3-D
`up_proj` / `down_proj`, experts on dim 0).
"""

from __future__ import annotations

import math
from pathlib import Path

from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from neox_hf.model import modeling_gpt_neox_moe as remote
from neox_hf.model.init import _NeoXInitMixin
from neox_hf.model.moe import ExpertsKernels, attach_router_records, init_experts_, init_router_
from neox_hf.model.spec import ModelSpec, family_config_kwargs, register_family

REMOTE_FILE = "modeling_gpt_neox_moe.py"
_AUTO_MAP = {"AutoConfig": "modeling_gpt_neox_moe.GPTNeoXMoEConfig",
             "AutoModel": "modeling_gpt_neox_moe.GPTNeoXMoEModel",
             "AutoModelForCausalLM": "modeling_gpt_neox_moe.GPTNeoXMoEForCausalLM"}
_REMOTE_ARCHITECTURES = {"NeoXMoEForCausalLM": "GPTNeoXMoEForCausalLM", "NeoXMoEModel": "GPTNeoXMoEModel"}
STARTUP_LINE = ("model: GPT-NeoX's dropless MoE has no stock transformers class: the saved folder carries "
                f"{REMOTE_FILE} and loads with AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)")


@strict
class NeoXMoEConfig(remote.GPTNeoXMoEConfig):
    """GPTNeoXMoEConfig with GPT-NeoX's init options; serialises as the folder's own remote-code config."""

    init_method: str = "small_init"
    output_layer_init_method: str = "wang_init"

    def to_dict(self) -> dict:
        output = super().to_dict()
        if output.get("architectures"):
            output["architectures"] = [_REMOTE_ARCHITECTURES.get(a, a) for a in output["architectures"]]
        output["auto_map"] = dict(_AUTO_MAP)
        return output


class _NeoXMoEInit(ExpertsKernels, _NeoXInitMixin):
    def _init_weights(self, module):
        if isinstance(module, remote.GPTNeoXMoEExperts):
            return init_experts_(module, self.config, up="up_proj", down="down_proj")
        if isinstance(module, remote.GPTNeoXMoERouter):
            return init_router_(module.weight, self.config)
        return super()._init_weights(module)


class NeoXMoEModel(_NeoXMoEInit, remote.GPTNeoXMoEModel):
    config_class = NeoXMoEConfig


class NeoXMoEForCausalLM(_NeoXMoEInit, remote.GPTNeoXMoEForCausalLM):
    """GPTNeoXMoEForCausalLM with GPT-NeoX initialisation and recorded routers; `save_pretrained` adds the modeling
    file the folder's `auto_map` names."""

    config_class = NeoXMoEConfig
    _trunk_class = NeoXMoEModel
    startup_note = STARTUP_LINE

    def __init__(self, config):
        super().__init__(config)
        routers = [layer.mlp.gate for layer in self.gpt_neox.layers if isinstance(layer.mlp, remote.GPTNeoXMoEBlock)]
        attach_router_records(self, routers, self.gpt_neox, num_experts=config.moe_num_experts,
                              top_k=config.moe_top_k)

    def save_pretrained(self, save_directory, *args, **kwargs):
        super().save_pretrained(save_directory, *args, **kwargs)
        (Path(save_directory) / REMOTE_FILE).write_text(Path(remote.__file__).read_text())


def _register_auto_classes() -> None:
    """Our process resolves `model_type: gpt_neox_moe` without remote code (folders, export, generate, eval); a
    load with `trust_remote_code=True` still runs the folder's own file."""
    AutoConfig.register("gpt_neox_moe", remote.GPTNeoXMoEConfig, exist_ok=True)
    AutoModelForCausalLM.register(remote.GPTNeoXMoEConfig, remote.GPTNeoXMoEForCausalLM, exist_ok=True)


_register_auto_classes()


def gpt_neox_moe_config_from_recipe(model_cfg, *, vocab_size: int, bos_token_id: int | None = 0,
                                    eos_token_id: int | None = 0, pad_token_id: int | None = None) -> NeoXMoEConfig:
    """NeoXMoEConfig from a recipe's `model` section (GPTNeoX's keys as `modeling.config_from_recipe`, plus MoE)."""
    return NeoXMoEConfig(
        **family_config_kwargs(model_cfg, vocab_size=vocab_size, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                               pad_token_id=pad_token_id),
        intermediate_size=model_cfg.intermediate_size or 4 * model_cfg.hidden_size,
        rope_parameters={"rope_type": "default", "rope_theta": float(model_cfg.rotary_emb_base),
                         "partial_rotary_factor": float(model_cfg.rotary_pct)},
        use_parallel_residual=model_cfg.use_parallel_residual,
        layer_norm_eps=model_cfg.layer_norm_eps,
        hidden_dropout=model_cfg.hidden_dropout,
        # GPT-NeoX's ParallelGroupedMLP: intermediate_size, else 4 × hidden rounded up to a multiple of 256 (the
        # dense layers keep 4 × hidden)
        moe_intermediate_size=model_cfg.intermediate_size or 256 * math.ceil(4 * model_cfg.hidden_size / 256),
        moe_num_experts=model_cfg.moe_num_experts,
        moe_top_k=model_cfg.moe_top_k or 1,
        moe_expert_interval=model_cfg.moe_expert_interval,
        moe_router_type=model_cfg.moe_router_type or "sinkhorn",
        moe_jitter_eps=model_cfg.moe_jitter_eps,
        router_aux_loss_coef=0.0,
        output_router_logits=False,
    )


GPT_NEOX_MOE = ModelSpec(
    family="gpt_neox_moe",
    model_types=("gpt_neox_moe",),
    trunk="gpt_neox",
    embedding="gpt_neox.embed_in",
    layers="gpt_neox.layers",
    final_norm="gpt_neox.final_layer_norm",
    head="lm_head",
    # Attention (and the dense layers' MLP) as GPTNeoX's; the experts and routers stay whole on every TP rank here
    tp_plan={
        "gpt_neox.embed_in": "vocab_embedding",
        "gpt_neox.layers.*.attention.query_key_value": "column",
        "gpt_neox.layers.*.attention.dense": "row",
        "gpt_neox.layers.*.mlp.dense_h_to_4h": "column",
        "gpt_neox.layers.*.mlp.dense_4h_to_h": "row",
        "lm_head": "vocab_head",
    },
    sequence_parallel_plan={
        "gpt_neox.emb_dropout": "enter_sequence_parallel",
        "gpt_neox.layers.*.input_layernorm": "sequence_norm",
        "gpt_neox.layers.*.post_attention_layernorm": "sequence_norm",
        "gpt_neox.final_layer_norm": "sequence_norm",
    },
    output_layers=("attention.dense", "mlp.dense_4h_to_h", "experts.down_proj"),
    model_class=lambda config: NeoXMoEForCausalLM,
    config_from_recipe=gpt_neox_moe_config_from_recipe,
)
register_family(GPT_NEOX_MOE)
