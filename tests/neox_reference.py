"""A reference GPT-NeoX forward pass, computed rank by rank from tensor-parallel shards.

Written from GPT-NeoX's equations (megatron/model/transformer.py), not from
transformers' model, so comparing it with an HF model tests the converter
rather than restating it. Each TP rank computes its partial outputs from its own
shards and the "all-reduce" is an explicit sum, which is what makes the
row-parallel bias rule observable: with parallel (GPT-J) residuals every rank
adds its own bias before the reduce, with sequential residuals the bias is added
once after it.

Shards are given as ``ranks[r][idx][param]`` with GPT-NeoX's layer indices and
parameter names (0 = embedding, 2..L+1 = layers, L+3 = final norm, L+4 = final_linear).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

RankLayers = list[dict[int, dict[str, torch.Tensor]]]

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def vocab_parallel_embedding(ranks: RankLayers, input_ids: torch.Tensor) -> torch.Tensor:
    """Each rank looks up the ids in its vocab slice, zeroes the others; the reduce sums."""
    out = 0
    start = 0
    for rank in ranks:
        table = rank[0]["word_embeddings.weight"]
        local = input_ids - start
        in_range = (local >= 0) & (local < table.shape[0])
        out = out + table[local.clamp(0, table.shape[0] - 1)] * in_range[..., None]
        start += table.shape[0]
    return out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_partial_rotary(x: torch.Tensor, rotary_ndims: int, base: float) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; rotate the first rotary_ndims dims, pass the rest."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_ndims, 2, dtype=torch.float32) / rotary_ndims))
    freqs = torch.outer(torch.arange(x.shape[2], dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    rot, rest = x[..., :rotary_ndims], x[..., rotary_ndims:]
    rot = rot * emb.cos() + rotate_half(rot) * emb.sin()
    return torch.cat((rot, rest), dim=-1)


def rank_attention_partial(p: dict[str, torch.Tensor], x: torch.Tensor, head_dim: int, rotary_ndims: int, base: float):
    """Return this rank's attention output before the reduce (no dense bias)."""
    batch, seq, _ = x.shape
    qkv = F.linear(x, p["attention.query_key_value.weight"], p["attention.query_key_value.bias"])
    qkv = qkv.view(batch, seq, -1, 3, head_dim).permute(3, 0, 2, 1, 4)  # [3, b, heads_r, s, hd]
    q = apply_partial_rotary(qkv[0], rotary_ndims, base)
    k = apply_partial_rotary(qkv[1], rotary_ndims, base)
    v = qkv[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    context = (probs @ v).transpose(1, 2).reshape(batch, seq, -1)
    return F.linear(context, p["attention.dense.weight"])


def rank_mlp_partial(p: dict[str, torch.Tensor], x: torch.Tensor, act) -> torch.Tensor:
    """Return this rank's MLP output before the reduce (no linear2 bias)."""
    return F.linear(act(F.linear(x, p["mlp.linear1.weight"], p["mlp.linear1.bias"])), p["mlp.linear2.weight"])


def layer_norm(x: torch.Tensor, p: dict[str, torch.Tensor], prefix: str, eps: float) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], p[f"{prefix}.weight"], p[f"{prefix}.bias"], eps)


def transformer_layer(layer_shards: list[dict[str, torch.Tensor]], x: torch.Tensor, cfg) -> torch.Tensor:
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rotary_ndims = int(head_dim * cfg.rope_parameters["partial_rotary_factor"])
    base = cfg.rope_parameters["rope_theta"]
    act, eps = ACTIVATIONS[cfg.hidden_act], cfg.layer_norm_eps
    if cfg.use_parallel_residual:
        # x + reduce(sum_r [attn_r(ln1(x)) + b_attn_r + mlp_r(ln2(x)) + b_mlp_r])
        total = 0
        for p in layer_shards:
            attn = rank_attention_partial(p, layer_norm(x, p, "input_layernorm", eps), head_dim, rotary_ndims, base)
            mlp = rank_mlp_partial(p, layer_norm(x, p, "post_attention_layernorm", eps), act)
            total = total + attn + p["attention.dense.bias"] + mlp + p["mlp.linear2.bias"]
        return x + total
    # x = x + reduce(attn_r) + b_attn; x = x + reduce(mlp_r) + b_mlp (biases once, from any rank)
    ln1 = layer_norm(x, layer_shards[0], "input_layernorm", eps)
    attn = sum(rank_attention_partial(p, ln1, head_dim, rotary_ndims, base) for p in layer_shards)
    x = x + attn + layer_shards[0]["attention.dense.bias"]
    ln2 = layer_norm(x, layer_shards[0], "post_attention_layernorm", eps)
    mlp = sum(rank_mlp_partial(p, ln2, act) for p in layer_shards)
    return x + mlp + layer_shards[0]["mlp.linear2.bias"]


def neox_reference_logits(ranks: RankLayers, cfg, input_ids: torch.Tensor) -> torch.Tensor:
    """Return [batch, seq, vocab] logits of the GPT-NeoX model held in ``ranks``."""
    n_layers = cfg.num_hidden_layers
    x = vocab_parallel_embedding(ranks, input_ids)
    for i in range(n_layers):
        x = transformer_layer([rank[i + 2] for rank in ranks], x, cfg)
    x = layer_norm(x, ranks[0][n_layers + 3], "norm", cfg.layer_norm_eps)
    if cfg.tie_word_embeddings:
        heads = [rank[0]["word_embeddings.weight"] for rank in ranks]
    else:
        heads = [rank[n_layers + 4]["final_linear.weight"] for rank in ranks]
    # Each rank produces its vocab slice of the logits; gathering concatenates them.
    return torch.cat([F.linear(x, w) for w in heads], dim=-1)
