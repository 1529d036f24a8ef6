"""The `mpu` DeepSpeed expects, answered from our `Layout` (parallel/layout.py).

Layout is Megatron's: consecutive global ranks form a TP group (they exchange activations
every layer, so they should share a node), and ranks with the same TP rank form a DP group.
With world 4 and tp 2: TP groups [0,1] [2,3]; DP groups [0,2] [1,3].
"""

import functools
from contextlib import contextmanager
from types import SimpleNamespace

import torch.distributed as dist

from neox_hf.errors import NeoXHFError
from neox_hf.parallel.layout import Layout, build_layout, dp_cp_group_ranks


# The layout object replaces the old TP × DP-only `ParallelGroups`; the name stays for the TP helpers' signatures.
ParallelGroups = Layout


def build_parallel_groups(tp_size: int) -> Layout:
    """The layout of `tp_size`-way tensor parallelism × data parallelism over the whole world (no pipeline).
    Collective: every rank must call it, after `torch.distributed.init_process_group`."""
    if not dist.is_initialized():
        raise NeoXHFError("build_parallel_groups needs torch.distributed initialised; launch with torchrun")
    world = dist.get_world_size()
    if tp_size < 1 or world % tp_size != 0:
        raise NeoXHFError(
            f"tensor parallel size {tp_size} must divide the world size {world}; "
            f"choose tp_size from {[d for d in range(1, world + 1) if world % d == 0]}"
        )
    return build_layout(SimpleNamespace(pipeline_parallel=1, tensor_parallel=tp_size))


class DeepSpeedMPU:
    """The "model parallel unit" `deepspeed.initialize(mpu=...)` queries (see
    deepspeed/utils/groups.py and deepspeed/utils/bwc.py): with it, ZeRO partitions and
    reduces gradients over the DP group only, and gradient clipping counts TP shards once.

    Deliberately has no `initialize_sequence_parallel`: DeepSpeed takes that attribute to
    mean a Megatron-DeepSpeed sequence-parallel mpu and then ignores our DP group.

    With context parallelism DeepSpeed's "data-parallel" group is our dp × cp group: its ranks hold the same
    parameters (each trained a chunk of the same sequences), so ZeRO shards over them and gradients are averaged
    over them (the step's loss scale counts dp × cp: `neox_hf.ops.weighting`).
    """

    def __init__(self, groups: ParallelGroups):
        self.groups = groups

    def get_model_parallel_rank(self) -> int:
        if self.groups.experts_over_data:  # the ranks whose parameters differ: the expert group (tp is 1)
            return self.groups.ep_rank
        return self.groups.tp_rank

    def get_model_parallel_world_size(self) -> int:
        if self.groups.experts_over_data:
            return self.groups.ep
        return self.groups.tp_size

    def get_model_parallel_group(self):
        if self.groups.experts_over_data:
            return self.groups.ep_group
        # never None: DeepSpeed's ZeRO-0 fp32 clipping (runtime/utils.clip_grad_norm_) sums the squared gradient norm
        # over this group, and None is the whole world — every data- and context-parallel replica counted again
        # (the norm × √replicas, clipping steps one process would not clip)
        if self.groups.tp == 1 and self.groups.tp_self_group is not None:
            return self.groups.tp_self_group
        return self.groups.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return dist.get_global_rank(self.get_model_parallel_group(), 0)

    # With experts over data-parallel ranks, DeepSpeed's data-parallel group is the expert-data-parallel one (the
    # ranks holding the same experts): `neox_hf.parallel.expert_parallel.divide_gradients_for_deepspeed` averages
    # the dense gradients over the expert group before DeepSpeed's reduction.
    def get_data_parallel_rank(self) -> int:
        if self.groups.experts_over_data:
            return self.groups.dp_cp_rank // self.groups.ep
        return self.groups.dp_cp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.groups.edp if self.groups.experts_over_data else self.groups.dp_cp

    def get_data_parallel_group(self):
        return self.groups.edp_group if self.groups.experts_over_data else self.groups.dp_cp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        g = self.groups
        if g.experts_over_data:
            return dist.get_process_group_ranks(g.edp_group)
        return dp_cp_group_ranks(g.pp, g.dp, g.tp, g.cp)[g.pp_rank * g.tp + g.tp_rank]

    def get_pipe_parallel_world_size(self) -> int:
        return self.groups.pp

    def get_pipe_parallel_rank(self) -> int:
        return self.groups.pp_rank


@contextmanager
def deepspeed_initialize_with_mpu(mpu: DeepSpeedMPU):
    """Within the block, `deepspeed.initialize` receives `mpu=mpu` unless given one.

    Fills a gap in accelerate 1.16: `Accelerator._prepare_deepspeed` calls
    `deepspeed.initialize(model=..., config_params=...)` and passes an mpu only for its own
    Ulysses sequence parallelism. It looks `deepspeed.initialize` up at call time, so
    wrapping `accelerator.prepare(model, optimizer)` in this block is enough. Presetting
    `deepspeed.utils.groups.mpu` instead is not: DeepSpeedConfig only divides the world
    by the TP size when handed the mpu, so its batch-size check fails (4 != 2 * 1 * 4).
    """
    import deepspeed

    original = deepspeed.initialize

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        if kwargs.get("mpu") is None:
            kwargs["mpu"] = mpu
        return original(*args, **kwargs)

    deepspeed.initialize = initialize
    try:
        yield
    finally:
        deepspeed.initialize = original
