"""GPT-NeoX's dropless mixture of experts (GPT-NeoX main: megatron/model/moe.py, moe_mlp.py, router.py) on
transformers' GPTNeoX: a GPTNeoXForCausalLM whose MLP, in every `moe_expert_interval`-th layer from layer 0, is a
router and non-gated experts. Nothing of GPTNeoX is forked: the model is built by transformers' classes and the MoE
layers' MLP is swapped for `GPTNeoXMoEBlock`.

This file is self-contained (torch and transformers only): a folder saved by neox_hf carries it, and transformers
loads that folder with `trust_remote_code=True` (`AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)`). No stock transformers class has GPT-NeoX attention with experts: the MoE classes of
transformers are Llama-attention models (Mixtral, Qwen-MoE, OLMoE, …) or differ in routing (NemotronH's non-gated
experts route by sigmoid with a correction bias); none renormalises nothing after a softmax top-k and balances by
Sinkhorn, as GPT-NeoX does.

What GPT-NeoX computes, and so this model:
- router: a bias-free linear [hidden → experts] (GPT-NeoX's `router.layer`);
- `sinkhorn` (GPT-NeoX's default, its training router): in training the experts are chosen by Sinkhorn-balancing
  the fp32 router logits (3 iterations, tolerance 1e-4, over the micro-batch's tokens), the weights are the
  softmax (sigmoid when top-1) of the logits at the chosen experts, not renormalised; in evaluation and generation the
  top-k of that softmax, not renormalised (GPT-NeoX's inference path);
- `topk`: the softmax top-k, not renormalised, with multiplicative jitter U(1 - eps, 1 + eps) of the router's input in
  training when `moe_jitter_eps` is set;
- experts: w1 [experts × width, hidden] and w2 [experts × width, hidden], no biases, act(x w1ᵀ) w2 (GPT-NeoX's
  `ParallelGroupedMLP`), stored as transformers' 3-D expert layout `up_proj` [experts, width, hidden] and
  `down_proj` [experts, hidden, width] and run by transformers' experts kernels (`grouped_mm`, `batched_mm`,
  `eager`);
- the MoE layer's output is added without dropout (GPT-NeoX's MoE branch); dropless: every token reaches its top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import GPTNeoXConfig, GPTNeoXModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.integrations import use_experts_implementation
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXForCausalLM, GPTNeoXPreTrainedModel


@strict
class GPTNeoXMoEConfig(GPTNeoXConfig):
    """GPTNeoXConfig plus GPT-NeoX's MoE settings (its own key names)."""

    model_type = "gpt_neox_moe"

    moe_num_experts: int = 8
    moe_top_k: int = 1
    moe_expert_interval: int = 1
    moe_router_type: str = "sinkhorn"
    moe_jitter_eps: float | None = None
    moe_intermediate_size: int | None = None  # each expert's width; default intermediate_size

    def is_moe_layer(self, index: int) -> bool:
        return index % self.moe_expert_interval == 0


def sinkhorn(cost: torch.Tensor, tol: float = 0.0001, max_iter: int = 3) -> torch.Tensor:
    """GPT-NeoX's `SinkhornRouter.sinkhorn`: exp(cost) scaled towards equal row and column sums, at most `max_iter`
    iterations (stopping once the column scale moves less than `tol` on average)."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = 1 / (cost.size(1) * torch.sum(cost, 0))
    eps = 0.00000001
    d1_old = d1
    for _ in range(max_iter):
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
        if error < tol:  # a host read per iteration, as GPT-NeoX's
            break
    return d1 * cost * d0.unsqueeze(1)


class GPTNeoXMoERouter(nn.Module):
    """GPT-NeoX's router: (logits [tokens, experts], weights [tokens, k], experts [tokens, k])."""

    def __init__(self, config: GPTNeoXMoEConfig):
        super().__init__()
        self.top_k, self.router_type, self.jitter_eps = config.moe_top_k, config.moe_router_type, config.moe_jitter_eps
        self.weight = nn.Parameter(torch.empty(config.moe_num_experts, config.hidden_size))

    def _activation(self, logits: torch.Tensor) -> torch.Tensor:
        if self.top_k == 1:
            return torch.sigmoid(logits)
        return torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)

    def forward(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, hidden_states.shape[-1])
        if self.router_type == "topk":
            if self.training and self.jitter_eps is not None:
                noise = torch.rand(hidden_states.size(), dtype=hidden_states.dtype, device=hidden_states.device)
                hidden_states = hidden_states * ((1.0 - self.jitter_eps) + noise * (2 * self.jitter_eps))
            logits = F.linear(hidden_states, self.weight)
            scores = logits.softmax(dim=-1)
            weights, experts = torch.topk(scores, self.top_k, dim=-1)
            return logits, weights, experts
        logits = F.linear(hidden_states, self.weight)
        if self.training:
            with torch.no_grad():
                _, experts = torch.topk(sinkhorn(logits.to(torch.float32)), k=self.top_k, dim=1)
            weights = torch.gather(self._activation(logits), 1, experts)
        else:
            weights, experts = torch.topk(self._activation(logits), k=self.top_k, dim=1)
        return logits, weights, experts


@use_experts_implementation(has_gate=False)
class GPTNeoXMoEExperts(nn.Module):
    """Non-gated experts in transformers' 3-D layout: act(x up_projᵀ[e]) down_projᵀ[e]."""

    def __init__(self, config: GPTNeoXMoEConfig):
        super().__init__()
        width = config.moe_intermediate_size or config.intermediate_size
        self.num_experts, self.hidden_dim, self.intermediate_dim = config.moe_num_experts, config.hidden_size, width
        self.up_proj = nn.Parameter(torch.empty(self.num_experts, width, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, width))
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """The eager path (one expert at a time); the experts kernels replace it."""
        output = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            token, slot = torch.where(top_k_index == expert)
            if token.numel() == 0:
                continue
            out = F.linear(self.act_fn(F.linear(hidden_states[token], self.up_proj[expert])), self.down_proj[expert])
            output.index_add_(0, token, (out * top_k_weights[token, slot, None]).to(output.dtype))
        return output


class GPTNeoXMoEBlock(nn.Module):
    """GPT-NeoX's `ParallelDroplessMoE`: route, then every token through its top-k experts, weighted."""

    def __init__(self, config: GPTNeoXMoEConfig):
        super().__init__()
        self.gate = GPTNeoXMoERouter(config)
        self.experts = GPTNeoXMoEExperts(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        _, weights, experts = self.gate(flat)
        return self.experts(flat, experts, weights.to(flat.dtype)).reshape(shape)


class _MoEInit:
    """transformers' normal(initializer_range) for the experts and the router, as for its own MoE classes."""

    def _init_weights(self, module):
        if isinstance(module, GPTNeoXMoEExperts):
            for param in (module.up_proj, module.down_proj):
                init.normal_(param, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, GPTNeoXMoERouter):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        else:
            super()._init_weights(module)


class GPTNeoXMoEModel(_MoEInit, GPTNeoXModel):
    config_class = GPTNeoXMoEConfig

    def __init__(self, config: GPTNeoXMoEConfig):
        super().__init__(config)
        for index, layer in enumerate(self.layers):
            if config.is_moe_layer(index):
                layer.mlp = GPTNeoXMoEBlock(config)
                layer.post_mlp_dropout = nn.Identity()  # GPT-NeoX adds the MoE output without dropout
        self.post_init()


class GPTNeoXMoEForCausalLM(_MoEInit, GPTNeoXForCausalLM):
    config_class = GPTNeoXMoEConfig

    def __init__(self, config: GPTNeoXMoEConfig):
        GPTNeoXPreTrainedModel.__init__(self, config)
        self.gpt_neox = self._trunk_class(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    _trunk_class = GPTNeoXMoEModel
