"""Context parallelism on the FSDP2 engine (`parallel.backend: fsdp2` with `parallel.context_parallel: N`): torch's
context parallelism, ring attention over the N ranks of a context-parallel group, injected through transformers'
attention registry into the unmodified model.

Every sequence is dealt in torch's head-tail order (`neox_hf.ops.context_parallel.sequence_chunk` with `HEAD_TAIL`:
2N chunks, rank r holding r and 2N − 1 − r), the order torch's load balancer gives and its ring assumes when it skips
the blocks above the causal diagonal; positions, labels (shifted before the split) and the loss sums go with every
token as on the DeepSpeed engine's Ulysses path. Inside attention each rank keeps its queries and the key/value
blocks go round the ring (`_cp_options.rotate_method`: torch's all-gather by default); the partial results are merged
by their log-sum-exp in fp32. The attention is causal over the whole sequence: torch's ring takes no mask, so packed
documents cannot be kept apart here (the recipe refuses `data.isolate_documents` with this backend; the Ulysses path
masks them) and pad mode relies on right padding, which causal attention never reads.

This is torch's own ring: `F.scaled_dot_product_attention` is called on DTensors sharded on the sequence dimension
over the context-parallel mesh, and torch's context-parallel dispatcher (`_enable_context_parallel_dispatcher`, what
torchtitan enables) routes the SDPA kernel to `_templated_ring_attention` and its backward.

Gap filled: torch (2.13) routes only CUDA's SDPA kernels (flash, memory-efficient, cuDNN) to the ring; on CPU, SDPA
is `_scaled_dot_product_flash_attention_for_cpu`, which DTensor has no rule for, so context parallelism does not run
there at all. `enable_ring_dispatch` registers CPU's flash kernel (forward and backward) with the same templated ring
torch uses for CUDA's, so CI runs torch's ring algorithm, our sharding, the load balancing and the FSDP2 wiring on
gloo, and only the per-block kernel differs from a GPU's. accelerate (1.16) has the CUDA path
(`ParallelismConfig(cp_size=…)`, `maybe_context_parallel`) but shards its own buffers in place around each step and
drops attention masks by hooks, while ours are sharded per micro-batch inside the step after it has counted them, as
on the Ulysses path; it is not used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from neox_hf.errors import NeoXHFError

RING = "neox_hf_ring_sdpa"


def register_ring_attention(mesh) -> str:
    """Register torch's ring attention over the 1-D context-parallel `mesh` in transformers' attention registry; the
    name `sequence_chunk` batches (in `HEAD_TAIL` order) run with. Registered again by each run (a process that
    trains several layouts in turn gets the latest run's mesh)."""
    enable_ring_dispatch()

    def ring_attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0,
                       isolate_documents=False, **kwargs):
        return _ring_sdpa(module, query, key, value, mesh, scaling=scaling, dropout=dropout,
                          isolate_documents=isolate_documents)

    AttentionInterface.register(RING, ring_attention)
    return RING


def _ring_sdpa(module, query, key, value, mesh, *, scaling, dropout, isolate_documents):
    """transformers' attention signature: query [B, H, T/N, D], key/value [B, KV, T/N, D] of this rank's chunks →
    ([B, T/N, H, D], None). Key/value heads are repeated for grouped-query attention first (torch's ring kernels
    take equal heads)."""
    from torch.distributed.tensor import DTensor, Shard
    from transformers.integrations.sdpa_attention import repeat_kv

    if isolate_documents:  # the recipe refuses it; a batch with document positions must not train across them
        raise NeoXHFError("torch's ring attention is causal over the whole sequence and cannot keep packed documents "
                          "apart; set `data.isolate_documents: false` or use `parallel.backend: deepspeed`")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    q, k, v = (DTensor.from_local(x.contiguous(), mesh, [Shard(2)], run_check=False) for x in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout if module.training else 0.0, is_causal=True,
                                         scale=scaling)
    return out.to_local().transpose(1, 2).contiguous(), None


def enable_ring_dispatch() -> None:
    """torch's context-parallel dispatcher on, its head-tail load balancing on (our `HEAD_TAIL` chunks), and CPU's
    flash SDPA kernel routed to the same ring as CUDA's. Process-wide, as torch's options are; idempotent."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import (_cp_options,
                                                                         _enable_context_parallel_dispatcher)

    _enable_context_parallel_dispatcher()
    _cp_options.enable_load_balance = True
    aten = torch.ops.aten
    DTensor._op_dispatcher._custom_op_handlers.update({
        aten._scaled_dot_product_flash_attention_for_cpu.default: _cpu_ring_forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _cpu_ring_backward,
    })


def _cpu_ring_forward(op_call, args, kwargs):
    """DTensor handler of `_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask,
    scale)` → (output, logsumexp): torch's templated ring over the mesh with CPU's kernel per block."""
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

    query, key, value = args[:3]
    dropout_p, is_causal = _positional(args, kwargs, 3, "dropout_p", 0.0), _positional(args, kwargs, 4, "is_causal",
                                                                                       False)
    _refuse_mask(kwargs)
    mesh = query.device_mesh
    out, logsumexp = _templated_ring_attention(mesh.get_group(), 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                                               query.to_local(), key.to_local(), value.to_local(), is_causal=is_causal,
                                               dropout_p=dropout_p, scale=kwargs.get("scale"))
    return _sharded(mesh, out), _sharded(mesh, logsumexp)


def _cpu_ring_backward(op_call, args, kwargs):
    """DTensor handler of `_scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, logsumexp,
    dropout_p, is_causal, *, attn_mask, scale)` → (grad_q, grad_k, grad_v): torch's templated ring backward."""
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention_backward)

    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = args[:8]
    _refuse_mask(kwargs)
    mesh = query.device_mesh
    grads = _templated_ring_attention_backward(
        mesh.get_group(), 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=grad_out.to_local(), grad_out_name="grad_out", query=query.to_local(), key=key.to_local(),
        value=value.to_local(), out=out.to_local(), logsumexp=logsumexp.to_local(), is_causal=is_causal,
        dropout_p=dropout_p, scale=kwargs.get("scale"))
    return tuple(_sharded(mesh, grad) for grad in grads[:3])


def _positional(args, kwargs, index: int, name: str, default):
    return args[index] if len(args) > index else kwargs.get(name, default)


def _refuse_mask(kwargs) -> None:
    if kwargs.get("attn_mask") is not None:
        raise NeoXHFError("torch's ring attention takes no attention mask (causal only)")


def _sharded(mesh, local: torch.Tensor):
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, mesh, [Shard(2)], run_check=False)
