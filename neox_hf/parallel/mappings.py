"""All tensor-parallel communication, as four autograd functions plus three no-grad helpers.

Every collective neox_hf's TP layers perform lives here, so a reader who wants to know
"where do ranks talk?" reads one file. The four mappings come in mirrored pairs: each
function's backward is the other one's forward, which is what keeps gradients exact when
activations move between a replicated region (every TP rank holds the same tensor) and a
partitioned one (each rank holds a slice of the last dimension).

    copy_to_tp_region      identity   | all-reduce   enter a partitioned region
    reduce_from_tp_region  all-reduce | identity     leave it by summing partial results
    gather_from_tp_region  all-gather | split        leave it by concatenating slices
    scatter_to_tp_region   split      | all-gather   enter it by slicing

With a group of size 1 every function is the identity, so the same layers run unsharded.
"""

import torch
import torch.distributed as dist


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    if _group_size(group) == 1:
        return tensor
    tensor = tensor.clone()  # never mutate an autograd input in place
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def _split_last_dim(tensor: torch.Tensor, group) -> torch.Tensor:
    size = _group_size(group)
    if size == 1:
        return tensor
    return tensor.chunk(size, dim=-1)[dist.get_rank(group)].contiguous()


def gather_along_dim(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenation of every rank's `tensor` along `dim`, in group-rank order (no autograd)."""
    size = _group_size(group)
    if size == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts, dim=dim)


def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """Element-wise sum over the group, outside autograd (for custom autograd functions that
    write their own backward, such as the vocab-parallel cross-entropy)."""
    return _all_reduce_sum(tensor.detach(), group)


def all_reduce_max(tensor: torch.Tensor, group) -> torch.Tensor:
    """Element-wise max over the group, detached: only used for numerical shifts
    (e.g. log-sum-exp) whose value does not change the result, so it needs no gradient."""
    tensor = tensor.detach().clone()
    if _group_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


class _CopyToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # Each rank's slice of the next layer contributes part of dL/dx; sum them.
        return _all_reduce_sum(grad, ctx.group), None


class _ReduceFromTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad):
        # d(sum_r x_r)/dx_r = 1 and the upstream gradient is already replicated.
        return grad, None


class _GatherFromTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


class _ScatterToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along_dim(grad, -1, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """`x` unchanged; its gradient is all-reduced over `group` in backward."""
    return _CopyToTPRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of `x` over `group`; gradient passes through unchanged."""
    return _ReduceFromTPRegion.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's `x` concatenated along the last dim; backward keeps this rank's slice."""
    return _GatherFromTPRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice of the last dim of `x`; backward all-gathers the gradient."""
    return _ScatterToTPRegion.apply(x, group)
