"""All tensor-parallel communication, as autograd functions in mirrored pairs plus no-grad helpers.

Every collective neox_hf's TP layers perform lives here, so a reader who wants to know
"where do ranks talk?" reads one file. Each function's backward is its mirror's forward,
which is what keeps gradients exact when activations move between a replicated region
(every TP rank holds the same tensor) and a partitioned one.

Tensor parallelism partitions the last (hidden) dimension:

    copy_to_tp_region      identity   | all-reduce   enter a partitioned region
    reduce_from_tp_region  all-reduce | identity     leave it by summing partial results
    gather_from_tp_region  all-gather | split        leave it by concatenating slices
    scatter_to_tp_region   split      | all-gather   enter it by slicing

Sequence parallelism (Megatron's) partitions the sequence dimension (dim 1 of
[batch, seq, hidden]) between the TP regions, where layer norms, dropout and residuals run:

    scatter_to_sequence_region         split          | all-gather       replicated → sequence slices
    gather_from_sequence_region        all-gather     | reduce-scatter   slices → a TP region's input
    reduce_scatter_to_sequence_region  reduce-scatter | all-gather       a TP region's partial sums → slices

With a group of size 1 every function is the identity, so the same layers run unsharded.
"""

import torch
import torch.distributed as dist

from neox_hf.errors import NeoXHFError


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    if _group_size(group) == 1:
        return tensor
    tensor = tensor.clone()  # never mutate an autograd input in place
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def _split_last_dim(tensor: torch.Tensor, group) -> torch.Tensor:
    return split_along_dim(tensor, -1, group)


def split_along_dim(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous slice of `tensor` along `dim` (no autograd); `dim` must split evenly."""
    size = _group_size(group)
    if size == 1:
        return tensor
    _check_splits(tensor, dim, size)
    return tensor.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


def _reduce_scatter_along_dim(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum over the group, of which this rank keeps its slice along `dim` (a list-form reduce_scatter: gloo's
    tensor form only splits dim 0)."""
    size = _group_size(group)
    if size == 1:
        return tensor
    _check_splits(tensor, dim, size)
    chunks = [chunk.contiguous() for chunk in tensor.chunk(size, dim=dim)]
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, op=dist.ReduceOp.SUM, group=group)
    return out


def _check_splits(tensor: torch.Tensor, dim: int, size: int) -> None:
    if tensor.shape[dim] % size:
        raise NeoXHFError(
            f"cannot split a tensor of shape {tuple(tensor.shape)} along dim {dim} over {size} tensor-parallel ranks. "
            f"With sequence parallelism the sequence length must be divisible by the tensor-parallel size: pad "
            f"inputs to a multiple of {size} (data.pad_to_multiple_of, seq_length), or run this model without "
            f"sequence_parallel (e.g. for token-by-token generation)"
        )


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


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_along_dim(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        # The input was replicated: every rank needs the gradient of the whole sequence.
        return gather_along_dim(grad, 1, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_along_dim(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        # Each rank's TP region used every position with its own slice of the weights, so the gradient of a position
        # is the sum over ranks; the rank holding that position keeps it.
        return _reduce_scatter_along_dim(grad, 1, ctx.group), None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_along_dim(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along_dim(grad, 1, ctx.group), None


def scatter_to_sequence_region(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice of the sequence (dim 1) of a replicated `x`; backward all-gathers the gradient."""
    return _ScatterToSequenceRegion.apply(x, group)


def gather_from_sequence_region(x: torch.Tensor, group) -> torch.Tensor:
    """The whole sequence from every rank's slice; backward reduce-scatters (sums the TP region's partial gradients)."""
    return _GatherFromSequenceRegion.apply(x, group)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of the partial results `x` over the group, this rank keeping its sequence slice; backward all-gathers."""
    return _ReduceScatterToSequenceRegion.apply(x, group)


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
