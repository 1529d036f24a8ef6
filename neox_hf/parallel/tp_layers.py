"""Tensor-parallel layers, the sequence-parallel layer norm, and the vocab-parallel cross-entropy.

Each layer holds only this rank's slice of the weight, under the same attribute names as
the `nn.Linear` / `nn.Embedding` it replaces (`weight`, `bias`), so `state_dict()` keys stay
identical to stock transformers. All communication goes through `mappings.py`.

Sharded parameters carry `tensor_model_parallel=True` and `partition_dim`, the attributes
DeepSpeed's `is_model_parallel_parameter` reads so gradient-norm clipping counts each
shard once and replicated parameters (layer norms, row-parallel biases) once per TP group.

With `sequence_parallel` (Megatron's), activations between the TP regions are split along the
sequence: a layer norm normalises its rank's positions and gathers the whole sequence for the
column-parallel layer after it, and a row-parallel layer reduce-scatters its partial sums back
to sequence slices. Replicated parameters used on sequence slices (norms, row biases) then get
partial gradients, which `copy_to_tp_region` sums over the TP group in backward.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from neox_hf.parallel.mappings import (
    all_reduce_max,
    all_reduce_sum,
    copy_to_tp_region,
    gather_along_dim,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
)


def _group_rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _shard_parameter(tensor: torch.Tensor, partition_dim: int) -> nn.Parameter:
    param = nn.Parameter(tensor)
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    return param


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A's output rows split: each rank computes a slice of Y's last dim."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, gather_output: bool = False,
                 sequence_parallel: bool = False):
        super().__init__()
        self.weight = _shard_parameter(weight, 0)
        self.bias = _shard_parameter(bias, 0) if bias is not None else None
        self.group = group
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel

    def forward_shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the output's last dim."""
        if not self.sequence_parallel:
            return F.linear(copy_to_tp_region(x, self.group), self.weight, self.bias)
        # `x` comes from a sequence-parallel gather, whose backward already sums the ranks' partial input gradients.
        if x.shape[1] % _group_size(self.group) == 0:
            return _LinearKeepingSequenceSlice.apply(x, self.weight, self.bias, self.group)
        return F.linear(x, self.weight, self.bias)  # the head after the causal shift: seq - 1 positions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.forward_shard(x)
        return gather_from_tp_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A's input columns split; X arrives already split along its last dim."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, sequence_parallel: bool = False):
        super().__init__()
        self.weight = _shard_parameter(weight, 1)
        # The bias is replicated and added once after the reduce; adding it on every rank
        # before the reduce would make the effective bias tp_size * b.
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.group = group
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if not self.sequence_parallel:
            y = reduce_from_tp_region(partial, self.group)
            return y + self.bias if self.bias is not None else y
        y = reduce_scatter_to_sequence_region(partial, self.group)
        # Each rank adds the bias to its own positions only: its gradient is a partial sum, all-reduced in backward.
        return y + copy_to_tp_region(self.bias, self.group) if self.bias is not None else y


class _LinearKeepingSequenceSlice(torch.autograd.Function):
    """`F.linear` of a sequence-gathered input that saves only this rank's sequence slice for backward, and all-gathers
    it again there (Megatron's sequence-parallel linear). Saving the gathered input itself would keep a whole
    [batch, seq, hidden] tensor per column layer alive until backward, undoing most of what sequence parallelism
    saves. The input gradient is returned whole: the gather before this layer reduce-scatters it."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias, ctx.x_dtype = group, bias is not None, x.dtype
        # Only the weight gradient needs the input; a frozen weight keeps nothing, as F.linear would. The slice is
        # cloned so that nothing keeps the gathered input itself alive.
        own = x.chunk(_group_size(group), dim=1)[_group_rank(group)] if ctx.needs_input_grad[1] else None
        ctx.save_for_backward(own.clone(memory_format=torch.contiguous_format) if own is not None else None, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        own, weight = ctx.saved_tensors
        compute = grad_out.dtype  # under autocast the forward ran in it; backward runs outside autocast
        grad_x = grad_out.matmul(weight.to(compute)).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        rows = grad_out.flatten(0, -2)
        grad_w = None
        if ctx.needs_input_grad[1]:
            x = gather_along_dim(own, 1, ctx.group)
            grad_w = rows.t().matmul(x.flatten(0, -2).to(compute)).to(weight.dtype)
        grad_b = rows.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


class SequenceParallelLayerNorm(nn.Module):
    """A LayerNorm applied to this rank's sequence slice, whose output is gathered to the whole sequence for the
    tensor-parallel region that follows it (attention, MLP or the head). Holds the wrapped norm's own parameters
    under the same names, so state-dict keys do not change."""

    def __init__(self, norm: nn.LayerNorm, group):
        super().__init__()
        self.weight, self.bias = norm.weight, norm.bias
        self.normalized_shape, self.eps = norm.normalized_shape, norm.eps
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Each rank normalises different positions, so the weight and bias gradients are partial sums.
        weight = copy_to_tp_region(self.weight, self.group)
        bias = copy_to_tp_region(self.bias, self.group) if self.bias is not None else None
        return gather_from_sequence_region(F.layer_norm(x, self.normalized_shape, weight, bias, self.eps), self.group)


class SequenceParallelRMSNorm(nn.Module):
    """`SequenceParallelLayerNorm` for the Llama family's RMSNorm (LlamaRMSNorm's arithmetic: fp32 normalisation,
    weight applied in the input's dtype); holds the wrapped norm's `weight` under the same name."""

    def __init__(self, norm: nn.Module, group):
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tp_region(self.weight, self.group)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return gather_from_sequence_region(weight * h.to(x.dtype), self.group)


class EnterSequenceParallel(nn.Module):
    """Runs `module` (the embedding dropout) on this rank's sequence slice of the replicated embeddings: from here
    to the last layer norm, activations are split along the sequence."""

    def __init__(self, module: nn.Module, group):
        super().__init__()
        self.module = module
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(scatter_to_sequence_region(x, self.group))


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows [vocab_start, vocab_start + rows) live on this rank."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, group):
        super().__init__()
        self.weight = _shard_parameter(weight, 0)
        self.vocab_start = vocab_start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local_ids = input_ids - self.vocab_start
        foreign = (local_ids < 0) | (local_ids >= self.weight.shape[0])
        # Foreign ids look up row 0 and are zeroed, so after the sum exactly one rank
        # contributes each token's embedding.
        embeds = F.embedding(local_ids.masked_fill(foreign, 0), self.weight)
        embeds = embeds.masked_fill(foreign.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(embeds, self.group)


class VocabParallelLMHead(ColumnParallelLinear):
    """The output projection split along the vocabulary. `forward` gathers full logits so
    the stock `GPTNeoXForCausalLM.forward` / `generate` keep working; training calls `loss_sum`,
    which keeps the logits sharded."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, group, sequence_parallel: bool = False):
        super().__init__(weight, None, group, gather_output=True, sequence_parallel=sequence_parallel)
        self.vocab_start = vocab_start

    def loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ cross-entropy over labelled tokens, their count) from the final hidden states, labels aligned with
        them. The hook `neox_hf.ops.loss.head_loss` looks for: a head that can compute its own loss."""
        loss = vocab_parallel_cross_entropy(self.forward_shard(hidden), labels, self.group, self.vocab_start,
                                            reduction="sum")
        return loss, (labels != -100).sum()


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    group,
    vocab_start: int | None = None,
    real_vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy over non-ignored tokens (`reduction` "mean" or "sum"), from each rank's vocab slice of the
    logits.

    `labels` must already be aligned with `logits_shard` (shape `logits_shard.shape[:-1]`),
    exactly as for `F.cross_entropy` (the data loader shifts them).
    `vocab_start` defaults to `rank * shard_width`. Columns at or beyond `real_vocab_size`
    (vocabulary padding) are excluded from the softmax. `logits_shard` is not modified.

    Never builds the [*, vocab] tensor: three all-reduces of [*]-shaped tensors (max,
    sum of exponentials, target logit) give log(sum_v e^{z_v}) - z_target.
    """
    width = logits_shard.shape[-1]
    if vocab_start is None:
        vocab_start = _group_rank(group) * width
    loss_sum = _VocabParallelCrossEntropy.apply(logits_shard, labels, group, vocab_start, real_vocab_size, ignore_index)
    if reduction == "sum":
        return loss_sum
    return loss_sum / (labels != ignore_index).sum().clamp(min=1)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over a vocab-sharded softmax as one autograd node (Megatron's layout of the computation).

    Written from autograd ops, the same math keeps about eight shard-sized [*, vocab / TP] intermediates alive
    (shifted logits, exponentials, masks, their gradients), which at a 50k vocabulary is more than the fused
    `F.cross_entropy` of the unsharded model keeps for the whole vocabulary. Here one fp32 working buffer becomes the
    softmax in forward, is the only thing saved, and is turned into the gradient in place in backward; so the loss
    needs the logits shard plus one buffer of the same size at its peak. Backward may therefore run only once.
    """

    @staticmethod
    def forward(ctx, logits_shard, labels, group, vocab_start, real_vocab_size, ignore_index):
        probs = torch.empty(logits_shard.shape, dtype=torch.float32, device=logits_shard.device)
        probs.copy_(logits_shard)  # contiguous, so backward can index it flat
        width = probs.shape[-1]
        if real_vocab_size is not None and real_vocab_size < vocab_start + width:
            probs[..., max(real_vocab_size - vocab_start, 0):] = float("-inf")
        # The max only shifts the exponent for stability; its value cancels.
        probs.sub_(all_reduce_max(probs.max(dim=-1).values, group).unsqueeze(-1))

        local_labels = labels - vocab_start
        on_this_rank = (local_labels >= 0) & (local_labels < width)
        local_labels = local_labels.masked_fill(~on_this_rank, 0)
        picked = probs.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(~on_this_rank, 0.0)
        target_logit = all_reduce_sum(picked, group)

        probs.exp_()
        sum_exp = all_reduce_sum(probs.sum(dim=-1), group)
        probs.div_(sum_exp.unsqueeze(-1))

        keep = labels != ignore_index
        loss_sum = (sum_exp.log() - target_logit).masked_fill(~keep, 0.0).sum()
        ctx.save_for_backward(probs, local_labels, on_this_rank, keep)
        ctx.logits_dtype = logits_shard.dtype
        return loss_sum

    @staticmethod
    def backward(ctx, grad_loss):
        probs, local_labels, on_this_rank, keep = ctx.saved_tensors
        # d loss_t / d z_v = softmax_v - [v == target_t], for each kept token t (the loss is their sum).
        grad = probs
        flat = grad.view(-1, grad.shape[-1])
        rows = torch.arange(flat.shape[0], device=flat.device)
        flat[rows, local_labels.reshape(-1)] -= on_this_rank.reshape(-1).to(flat.dtype)
        grad.mul_((keep.to(grad.dtype) * grad_loss).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None, None
