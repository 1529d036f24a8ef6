"""Fused LM head + cross-entropy: the loss and its gradients without ever holding [tokens, vocab] logits.

Fills a gap in torch and transformers: `GPTNeoXForCausalLM` computes `hidden @ W^T` for every position (at
Pythia's 50,304-token vocabulary, 3,072 tokens give 618 MB of fp32 logits), `F.cross_entropy` then reads them
several times, and the backward writes a tensor as large again — on a CPU the head costs more than the rest of a
small model. Liger-Kernel's `FusedLinearCrossEntropy` and Apple's Cut Cross-Entropy avoid it on GPUs with Triton
kernels; this is the same computation in PyTorch ops, so it runs on CPU and GPU alike.

Tokens are processed in chunks of rows (`default_chunk_rows`: why not cache-sized). For each chunk:

    logits = h W^T                      [chunk, V]      (the only vocabulary-sized buffer, reused in place)
    m = max_v logits, s = Σ_v exp(logits - m)           all-reduced over `group` for a vocab-parallel head
                                                        (m = 0 on CPU unless s leaves e^±60: `_exp_was_safe`)
    loss_t = log s - (logits_t,target - m) (+ z_loss · (m + log s)²)    the target logit from the rank holding it
    g = softmax · (1 + 2 z_loss log Z) - onehot(target)                 d loss / d logits, in place
    d h = g W,   d W += g^T h

The gradients are computed in the forward and only scaled by the upstream gradient in backward, as Liger does
(3 matmuls per chunk). `recompute=True` keeps nothing but the inputs and recomputes the logits in backward
(4 matmuls): slower, for callers who need the loss's memory between forward and backward back.
`benchmarks/fused_loss.py` measures both against the unfused head.

Tensor parallelism: `weight` is this rank's vocabulary slice [V_local, H] starting at row `vocab_start`; every rank
of `group` passes the same hidden states and labels. The returned gradient of `hidden` is this rank's partial sum:
the caller passes hidden states that went through `copy_to_tp_region` (or a sequence-parallel gather), whose backward
sums the partial gradients over the group — exactly what `VocabParallelLMHead.forward_shard` does; `lm_head_loss`
does it for you.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from neox_hf.errors import NeoXHFError
from neox_hf.ops.library_loss import LIBRARIES, library_head_loss, takes
from neox_hf.parallel.mappings import all_reduce_max, all_reduce_sum, copy_to_tp_region

# Each chunk adds a rank-`rows` update into the whole [V, H] weight gradient, which moves as many bytes as the chunk's
# logits when rows = 2H: chunks must be much taller than 2H, or the weight gradient's memory traffic dominates. Measured
# (benchmarks/fused_loss.py --sweep, 2-core AVX-512 EPYC, 1,024 tokens × hidden 128, fp32): 41 rows (8 MB, "cache
# sized") 3.4 s, 256 rows 0.85 s, 1,024 rows 0.74 s, against 1.09 s unfused. Hence 4H rows, at least 256, at most
# MAX_CHUNK_BYTES of fp32 logits (1,300 rows at a 50k vocabulary; on GPUs this also keeps the chunk large enough to
# fill the device). Without a weight gradient (a frozen head: LoRA; eval) that reason is gone and MIN_CHUNK_ROWS rows
# keep the logits buffer small (50 MB at a 50k vocabulary), which is most of LoRA's activation memory.
MIN_CHUNK_ROWS = 256
MAX_CHUNK_BYTES = 256 * 2**20


def default_chunk_rows(vocab_rows: int, hidden_size: int, weight_grad: bool = True) -> int:
    """Rows per chunk: 4 × hidden_size when the weight gradient is computed, else MIN_CHUNK_ROWS, at least
    MIN_CHUNK_ROWS, at most MAX_CHUNK_BYTES of fp32 logits."""
    cap = max(16, MAX_CHUNK_BYTES // (4 * max(vocab_rows, 1)))
    return min(max(MIN_CHUNK_ROWS, 4 * hidden_size if weight_grad else 0), cap)


@dataclass(frozen=True)
class _Options:
    group: object
    vocab_start: int
    real_vocab_size: int | None
    z_loss: float
    ignore_index: int
    chunk_rows: int
    compute_dtype: torch.dtype
    recompute: bool


# Data-dependent chunk counts, row selection and collectives: torch.compile of a step runs this eagerly (one graph
# break) instead of tracing and specialising on every batch shape.
@torch.compiler.disable
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    group=None,
    vocab_start: int = 0,
    real_vocab_size: int | None = None,
    z_loss: float = 0.0,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    recompute: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token losses as a 0-dim fp32 tensor, number of labelled tokens as a 0-dim int64 tensor).

    Equal to `F.cross_entropy(hidden @ weight.T, labels, reduction="sum", ignore_index=ignore_index)` plus
    `z_loss · Σ log(Z)²` over the labelled tokens. `hidden` is [N, H] or [B, S, H] and `labels` is aligned with it
    (position t predicts labels[t]). With `group`, `weight` is the rank's vocabulary slice starting at
    `vocab_start`; columns at or beyond `real_vocab_size` (vocabulary padding) are left out of the softmax.
    Under autocast the matmuls run in the autocast dtype; softmax and sums are always fp32. Backward may run once.
    """
    width = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != width:
        raise NeoXHFError(f"linear_cross_entropy: weight of shape {tuple(weight.shape)} does not match hidden size {width}")
    flat_hidden, flat_labels = hidden.reshape(-1, width), labels.reshape(-1)
    if flat_labels.shape[0] != flat_hidden.shape[0]:
        raise NeoXHFError(f"linear_cross_entropy: {flat_labels.shape[0]} labels for {flat_hidden.shape[0]} hidden states; "
                          "labels must be aligned with the hidden states (shift them before the call)")
    n_tokens = (flat_labels != ignore_index).sum()
    weight_grad = torch.is_grad_enabled() and weight.requires_grad
    opts = _Options(group, vocab_start, real_vocab_size, float(z_loss), ignore_index,
                    chunk_size or default_chunk_rows(*weight.shape, weight_grad=weight_grad),
                    _compute_dtype(hidden, weight), recompute)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        loss = _LinearCrossEntropy.apply(flat_hidden, weight, flat_labels, opts)
    else:
        loss, _, _ = _chunked_pass(flat_hidden, weight, flat_labels, opts, want_hidden=False, want_weight=False)
    return loss, n_tokens


def lm_head_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, *, z_loss: float = 0.0,
                 ignore_index: int = -100, chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, labelled-token count) of `head` (the model's output embeddings) on the final hidden states.

    A `VocabParallelLMHead` runs vocab-parallel with the same gradient contract as its `forward_shard`; a bias-free
    `nn.Linear` runs fused; anything else (a LoRA-wrapped head, a head with a bias) computes full logits and the
    unfused `cross_entropy_sum`.
    """
    from neox_hf.parallel.tp_layers import VocabParallelLMHead  # parallel imports nothing from ops

    if isinstance(head, VocabParallelLMHead):
        # Without sequence parallelism the head's input is replicated: its partial gradients are summed over the
        # group by copy_to_tp_region. With it, the final norm's sequence gather already reduce-scatters them.
        x = hidden if head.sequence_parallel else copy_to_tp_region(hidden, head.group)
        return linear_cross_entropy(x, head.weight, labels, group=head.group, vocab_start=head.vocab_start,
                                    z_loss=z_loss, ignore_index=ignore_index, chunk_size=chunk_size)
    if _unsharded_class(head) is nn.Linear and head.bias is None:
        return linear_cross_entropy(hidden, head.weight, labels, z_loss=z_loss, ignore_index=ignore_index,
                                    chunk_size=chunk_size)
    return cross_entropy_sum(head(hidden), labels, z_loss=z_loss, ignore_index=ignore_index)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, *, z_loss: float = 0.0,
                      ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused (loss sum, labelled-token count) from full logits, with the same z-loss as the fused op."""
    flat, flat_labels = logits.flatten(0, -2).float(), labels.reshape(-1)
    keep = flat_labels != ignore_index
    loss = F.cross_entropy(flat, flat_labels, reduction="sum", ignore_index=ignore_index)
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(flat, dim=-1).square().masked_fill(~keep, 0.0).sum()
    return loss, keep.sum()


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """One autograd node for head + loss. By default the forward leaves the finished gradients on `ctx` (the size
    of `hidden` and of `weight`, which training allocates anyway) and backward scales them in place."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, opts):
        ctx.opts = opts
        if opts.recompute:
            ctx.save_for_backward(hidden, weight, labels)
            loss, _, _ = _chunked_pass(hidden, weight, labels, opts, want_hidden=False, want_weight=False)
            return loss
        loss, ctx.grad_hidden, ctx.grad_weight = _chunked_pass(
            hidden, weight, labels, opts, want_hidden=ctx.needs_input_grad[0], want_weight=ctx.needs_input_grad[1])
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.opts.recompute:
            hidden, weight, labels = ctx.saved_tensors
            _, grad_hidden, grad_weight = _chunked_pass(
                hidden, weight, labels, ctx.opts, want_hidden=ctx.needs_input_grad[0], want_weight=ctx.needs_input_grad[1])
        else:
            if not hasattr(ctx, "grad_hidden"):
                raise RuntimeError("linear_cross_entropy: backward may run only once (its gradients are scaled in place)")
            grad_hidden, grad_weight = ctx.grad_hidden, ctx.grad_weight
            del ctx.grad_hidden, ctx.grad_weight
        # In place, and a 0-dim tensor: no copy of the gradients and no host synchronisation.
        for grad in (grad_hidden, grad_weight):
            if grad is not None:
                grad.mul_(grad_loss)
        return grad_hidden, grad_weight, None, None


def _kept_rows(labels: torch.Tensor, ignore_index: int) -> torch.Tensor | None:
    """Indices of the labelled rows, on CPU, where skipping padding and prompt tokens saves their matmuls; None when
    every row is labelled, and on accelerators, where finding them would synchronise with the host (the chunks there
    mask the ignored rows instead)."""
    if labels.device.type != "cpu":
        return None
    rows = (labels != ignore_index).nonzero().squeeze(1)
    return None if rows.numel() == labels.numel() else rows


def _chunked_pass(hidden, weight, labels, opts: _Options, *, want_hidden: bool, want_weight: bool):
    """(loss sum, d loss / d hidden or None, d loss / d weight or None), one chunk of rows at a time."""
    rows = _kept_rows(labels, opts.ignore_index)
    h = hidden if rows is None else hidden.index_select(0, rows)
    y = labels if rows is None else labels.index_select(0, rows)
    with torch.autocast(hidden.device.type, enabled=False):
        h_compute, w_compute = h.to(opts.compute_dtype), weight.to(opts.compute_dtype)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty(h.shape, dtype=hidden.dtype, device=hidden.device) if want_hidden else None
        # Accumulated over chunks in fp32 whatever the weight's dtype.
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        buffers = _LogitBuffers(min(opts.chunk_rows, h.shape[0]), weight.shape[0], opts.compute_dtype, hidden.device)
        for start in range(0, h.shape[0], opts.chunk_rows):
            end = start + opts.chunk_rows
            loss += _chunk(h_compute[start:end], w_compute, y[start:end], opts,
                           None if grad_h is None else grad_h[start:end], grad_w, buffers)
    if grad_h is not None and rows is not None:
        grad_h = torch.zeros_like(hidden).index_copy_(0, rows, grad_h)
    if grad_w is not None and grad_w.dtype != weight.dtype:
        grad_w = grad_w.to(weight.dtype)
    return loss, grad_h, grad_w


class _LogitBuffers:
    """The chunk's logits in the compute dtype, allocated once per call and reused by every chunk (a fresh [chunk, V]
    tensor per chunk costs its page faults again on CPU: a 512 × 50,304 fp32 head matmul measured 70 ms into a new
    tensor, 48 ms into a reused one; on GPUs it keeps the caching allocator from fragmenting), and the fp32 space
    where exp and its row sums are computed when the compute dtype is lower.

    Where that fp32 space lives is the difference between devices. On an accelerator it is a second [chunk, V]
    buffer: a cast in, the shifted exp, a cast back. On CPU each of those is a pass of the whole chunk through main
    memory (two casts of 512 × 50,304 took 16 of the 31 ms these steps cost per chunk in bf16, measured on a 2-vCPU
    Xeon), so the work runs CPU_BLOCK_BYTES of rows at a time in a scratch that stays in cache: one read and one
    write of the chunk in its own dtype. The results are the same to the bit: the logits are already rounded to the
    compute dtype by the matmul, and exp and the sums run in fp32 either way."""

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, device):
        self.z = torch.empty(rows, vocab, dtype=dtype, device=device)
        scratch_rows = rows if device.type != "cpu" else max(1, CPU_BLOCK_BYTES // (4 * max(vocab, 1)))
        self.scratch = None if dtype == torch.float32 else torch.empty(
            min(rows, scratch_rows), vocab, dtype=torch.float32, device=device)

    def logits(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """`h @ w.T` for this chunk's rows in the compute dtype, in the reused buffer."""
        return torch.mm(h, w.t(), out=self.z[: h.shape[0]])

    def exp_and_row_sums(self, z: torch.Tensor, shift: torch.Tensor | None) -> torch.Tensor:
        """Replaces `z` by exp(z - shift) (in its dtype) and returns the fp32 row sums of exp, computed in fp32."""
        sums = torch.empty(z.shape[0], dtype=torch.float32, device=z.device)
        block = z.shape[0] if self.scratch is None else self.scratch.shape[0]
        for start in range(0, z.shape[0], block):
            rows = z[start:start + block]
            work = rows if self.scratch is None else self.scratch[: rows.shape[0]].copy_(rows)
            if shift is not None:
                work.sub_(shift[start:start + block].unsqueeze(1))
            work.exp_()
            torch.sum(work, dim=1, out=sums[start:start + block])
            if work is not rows:
                rows.copy_(work)
        return sums


# The fp32 scratch of a CPU chunk in a lower dtype: a few rows of the vocabulary that stay in a core's L2 cache.
# Measured (512 × 50,304 bf16, 2-vCPU Xeon, cast + exp + sum + cast back): 4 rows 20.8 ms, 8 rows 18.5, 16 rows
# 22.0, whole chunk 27; the whole bf16 head + loss of 3,072 tokens was as fast with 1 to 4 MiB (0.74-0.76 s) and
# slower below (256 KiB: 0.80 s). 1 MiB leaves room in the smaller L2 caches of other CPUs.
CPU_BLOCK_BYTES = 2**20


def _chunk(h, w, y, opts: _Options, grad_h_out, grad_w, buffers: _LogitBuffers) -> torch.Tensor:
    """Loss sum of one chunk of rows; writes d loss / d h into `grad_h_out` and adds d loss / d W into `grad_w`.

    The [chunk, V] buffer is touched by as few passes as possible (each streams it through memory): the matmul
    writes it, exp and its sum read it, and the gradient matmuls read the unnormalised exp(z - shift) directly.
    The softmax normalisation (and the z-loss factor) is a per-row scale applied to the [chunk, H] operands instead,
    and the one-hot term is subtracted as rows of W / h: d loss / d z = diag(scale) E - onehot, so
    d h = diag(scale) (E W) - W[target] and d W = E^T (diag(scale) h) - onehot^T h.
    """
    z = _masked_logits(h, w, opts, buffers)
    width = z.shape[1]
    local = y - opts.vocab_start
    here = (local >= 0) & (local < width)
    local = local.masked_fill(~here, 0)
    target = z.gather(1, local.unsqueeze(1)).squeeze(1).float().masked_fill(~here, 0.0)
    # On CPU, exp without the max shift first, and the shift only where the sums show it was needed (one pass over
    # [chunk, V] fewer); on accelerators reading the sums on the host would synchronise, so the shift always applies.
    # So it does in fp16, whose largest value is e^11: unshifted, exp of a confident logit is inf there.
    unshifted = z.device.type == "cpu" and torch.finfo(z.dtype).max >= math.exp(EXP_SAFE_LOGIT)
    shift = None if unshifted else _row_max(z, opts)
    # One collective for both: Σ exp over the whole vocabulary, and the target logit from the rank that holds it.
    sum_exp, target = all_reduce_sum(torch.stack([buffers.exp_and_row_sums(z, shift), target]), opts.group)
    if shift is None and not _exp_was_safe(sum_exp):
        z = _masked_logits(h, w, opts, buffers)  # exp overwrote them; a chunk this far off is rare
        shift = _row_max(z, opts)
        sum_exp = all_reduce_sum(buffers.exp_and_row_sums(z, shift), opts.group)
    log_z = sum_exp.log() if shift is None else sum_exp.log() + shift
    kept = y != opts.ignore_index
    token_loss = log_z - target
    scale = sum_exp.reciprocal()
    if opts.z_loss:
        token_loss = token_loss + opts.z_loss * log_z.square()
        scale = scale * (1.0 + 2.0 * opts.z_loss * log_z)
    loss = token_loss.masked_fill(~kept, 0.0).sum()
    if grad_h_out is None and grad_w is None:
        return loss
    exp_z = z
    scale = scale.masked_fill(~kept, 0.0).unsqueeze(1)
    # Rows whose target column lies in this rank's slice, as a mask: indices (nonzero) would make the host wait for
    # the device once per chunk. Rows outside it subtract zeros (from row 0 of the slice, where `local` points them).
    missed = ~(here & kept).unsqueeze(1)
    if grad_h_out is not None:
        if grad_h_out.dtype == exp_z.dtype:
            torch.mm(exp_z, w, out=grad_h_out)
        else:
            grad_h_out.copy_(torch.mm(exp_z, w))
        grad_h_out.mul_(scale.to(grad_h_out.dtype))
        grad_h_out.sub_(w.index_select(0, local).to(grad_h_out.dtype).masked_fill_(missed, 0.0))
    if grad_w is not None:
        scaled_h = h * scale.to(h.dtype)
        if exp_z.dtype == grad_w.dtype:
            grad_w.addmm_(exp_z.t(), scaled_h)
        else:  # bf16 matmul (fp32 accumulation inside), each chunk's product added in fp32
            grad_w.add_(torch.mm(exp_z.t(), scaled_h))
        grad_w.index_add_(0, local, h.to(grad_w.dtype).masked_fill(missed, 0.0), alpha=-1)
    return loss


def _masked_logits(h, w, opts: _Options, buffers: _LogitBuffers) -> torch.Tensor:
    """The chunk's logits with the vocabulary padding's columns at -inf (left out of the softmax)."""
    z = buffers.logits(h, w)
    if opts.real_vocab_size is not None and opts.real_vocab_size < opts.vocab_start + z.shape[1]:
        z[:, max(opts.real_vocab_size - opts.vocab_start, 0):] = float("-inf")
    return z


def _row_max(z: torch.Tensor, opts: _Options) -> torch.Tensor:
    """fp32 row maxima over the whole vocabulary (all ranks of a vocab-parallel head), the shift for exp. It only
    shifts the exponent and cancels in the loss, so it is all-reduced without a gradient."""
    return all_reduce_max(z.amax(dim=1).float(), opts.group)


# Unshifted, exp(z) in fp32 (and bf16, with the same exponent range) neither overflows nor loses precision to
# subnormals while every row's Σ exp lies within e^±EXP_SAFE_LOGIT: then the largest logit is below 60 and above
# -60 - log V (-71 at a 50k vocabulary), far from exp's limits (±87), and the gradient matmuls' E W stays finite.
EXP_SAFE_LOGIT = 60.0


def _exp_was_safe(sum_exp: torch.Tensor) -> bool:
    """Whether the unshifted exp of every row stayed in range; read on the host (only called on CPU)."""
    return bool(((sum_exp >= math.exp(-EXP_SAFE_LOGIT)) & (sum_exp <= math.exp(EXP_SAFE_LOGIT))).all())


def head_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, *, fused: bool | str = True,
              z_loss: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The one head loss of neox_hf (training, eval, pipeline last stages): (Σ token cross-entropies, labelled
    tokens) of `head` on the final hidden states, labels aligned, -100 ignored.

    `fused` (train.fused_cross_entropy) takes the chunked op of `lm_head_loss`; otherwise a vocab-parallel head uses
    its unfused sharded cross-entropy and a plain head full logits. Under ZeRO-3 the weight is a partition that
    DeepSpeed gathers only around the head module's own forward and backward, so the fused op runs as that forward
    (`_as_module_forward`); likewise a head FSDP2 shards as its own group (`neox_hf.engines.fsdp2`). `fused` may name
    a library kernel (`liger`, `cce`: `neox_hf.ops.library_loss`), which computes the loss where it can take the head;
    ours everywhere else.
    """
    if fused in LIBRARIES and takes(head):
        loss = functools.partial(library_head_loss, fused, head, z_loss=z_loss)
        if hasattr(head.weight, "ds_id"):  # a ZeRO-3 partition (an FSDP2 head is not taken: ours runs it)
            return _as_module_forward(head, loss, hidden, labels)
        return loss(hidden, labels)
    if fused and (hasattr(getattr(head, "weight", None), "ds_id") or _fsdp_sharded(head)):  # ZeRO-3 / FSDP2 shards
        return _as_module_forward(head, lambda h, y: lm_head_loss(head, h, y, z_loss=z_loss), hidden, labels)
    if fused:
        return lm_head_loss(head, hidden, labels, z_loss=z_loss)
    own_loss = getattr(head, "loss_sum", None)
    if own_loss is not None and not z_loss:
        return own_loss(hidden, labels)
    if own_loss is not None:  # z-loss needs log Z, which only the (vocab-parallel) fused op computes without logits
        return lm_head_loss(head, hidden, labels, z_loss=z_loss)
    return cross_entropy_sum(head(hidden), labels, z_loss=z_loss)


def _fsdp_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _unsharded_class(module: nn.Module) -> type:
    """The module's own class: FSDP2's fully_shard turns a `Class` into `FSDPClass(FSDPModule, Class)`."""
    cls = type(module)
    return cls.__bases__[1] if _fsdp_sharded(module) and len(cls.__bases__) == 2 else cls


def _as_module_forward(module: nn.Module, function, *args):
    """`function(*args)` called as `module`'s forward: DeepSpeed ZeRO-3's module hooks then gather the module's
    partitioned parameters for it and again before its backward (a fused op reading `module.weight` outside the
    module's call would see an empty partition, and its weight gradient would not match the parameter).
    Gap filled: DeepSpeed's `GatheredParameters` gathers for the forward only."""
    forward = module.forward
    module.forward = function
    try:
        return module(*args)
    finally:
        module.forward = forward
