"""Model FLOPs utilisation of a run: model FLOPs per token from the shape, the device's peak, MFU per log window.

Gap filled: neither Accelerate nor transformers' Trainer reports MFU (Trainer logs `total_flos`, without a peak);
GPT-NeoX logs FLOPs per step and torchtitan logs MFU. We log `mfu` in `train_log.jsonl` and the trackers, and the
start-up report names the peak it is measured against.

- FLOPs per token (PaLM's appendix B, as torchtitan): 6·N for the matmul parameters N (attention and MLP projections
  and the LM head; embeddings and norms are lookups and elementwise) plus 12·L·H·T for attention's scores and
  values at sequence length T, forward and backward. Activation checkpointing's recomputation is not counted: this
  is model FLOPs, not hardware FLOPs.
- The peak: for known GPUs the datasheet's dense tensor-core rate in the run's precision; elsewhere (CPUs, other
  GPUs, fp32) the best square-GEMM rate measured here in the run's compute dtype or fp32, whichever is faster, which
  the report says.
"""

from __future__ import annotations

from neox_hf.hardware import Peak


def flops_per_token(config, seq_length: int) -> float:
    """Training FLOPs (forward + backward) per token of a GPTNeoX-shaped config at `seq_length`."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    intermediate = config.intermediate_size or 4 * hidden
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    kv_width = hidden * kv // config.num_attention_heads  # grouped-query attention: smaller K and V
    gated = getattr(config, "model_type", "") in ("llama", "mistral", "mixtral")
    mlp_matrices = 3 if gated else 2  # SwiGLU: gate, up, down
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_width + mlp_matrices * hidden * intermediate
    matmul_params = layers * per_layer + config.vocab_size * hidden  # + the LM head
    experts = getattr(config, "num_local_experts", None) or getattr(config, "moe_num_experts", 1)
    if experts > 1:  # a mixture of experts: its active parameters (top-k experts and the router, in its MoE layers)
        top_k = getattr(config, "num_experts_per_tok", None) or config.moe_top_k
        interval = getattr(config, "moe_expert_interval", 1)
        moe_layers = len(range(0, layers, interval))
        matmul_params += moe_layers * hidden * ((top_k - 1) * mlp_matrices * intermediate + experts)
    return 6 * matmul_params + 12 * layers * hidden * seq_length


def mfu(tokens_per_second: float, flops_token: float, peak: Peak, devices: int) -> float:
    """The fraction of `devices` × the peak that the run's model FLOPs reached."""
    return tokens_per_second * flops_token / (peak.flops * devices)
