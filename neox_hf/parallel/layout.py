"""The layout of a run: sizes, ranks and process groups of pipeline × data × context × tensor parallelism.

One object, always present (all sizes 1 in a single process), built once from the recipe and the launch — the role
of torchtitan's `ParallelDims`. Everything else asks it instead of computing "world = tp × dp" or testing
`groups is None`: which data-parallel slice of the batches this rank reads, which ranks hold the loss, which group a
reduction runs over. A new parallel dimension is a new field here.

Rank order is Megatron's and DeepSpeed's `PipeModelDataParallelTopology` (axes pipe, data, model; model fastest),
with Megatron's context-parallel axis between data and model:
    rank = pp_rank × (dp × cp × tp) + dp_rank × (cp × tp) + cp_rank × tp + tp_rank
so the ranks of a tensor-parallel group are consecutive (they exchange activations every layer and should share a
node), then those of a context-parallel group (an all-to-all per layer), and with pp = cp = 1 this is the layout the
TP code has always used. The ranks of one data-parallel rank's context-parallel group read the same batches and each
trains one chunk of every sequence; they hold the same parameters, so gradients are reduced (and ZeRO shards) over
the dp × cp ranks of a model shard (`dp_cp_group`), while the data is dealt over the dp ranks only.

`check_launch(recipe)` runs before any Accelerator or process group exists, so a launch that cannot give the layout
is refused with the exact command to use, not with a process-group traceback.
"""

from __future__ import annotations

import math
import os
import shlex
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from neox_hf.errors import LaunchError
from neox_hf.recipe import accumulation_for_train_batch, data_parallel_for_train_batch, train_batch_disagreement


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    tp: int = 1
    dp: int = 1
    pp_rank: int = 0
    tp_rank: int = 0
    dp_rank: int = 0
    tp_group: object = None  # None when tp == 1: no communication
    dp_group: object = None  # None when dp == 1
    pp_group: object = None  # None when pp == 1
    cp: int = 1  # context parallelism: every sequence split into cp contiguous chunks, one per rank
    cp_rank: int = 0
    cp_group: object = None  # None when cp == 1
    dp_cp_group: object = None  # the dp × cp ranks holding the same parameters (gradients, ZeRO); None when 1 rank
    # The tensor-parallel group even when tp == 1 (this rank alone), for DeepSpeed's mpu: DeepSpeed's fp32 ZeRO-0
    # clipping all-reduces the squared norm over `get_model_parallel_group()`, where None means every rank
    tp_self_group: object = None
    # Expert parallelism (`neox_hf.parallel.expert_parallel`): each MoE layer's experts split over `ep` ranks that
    # exchange tokens by all-to-all. `experts_over` "data": the ep ranks are consecutive ranks of the dp × cp axis
    # (different tokens, the same dense parameters; dp_cp index = edp_rank × ep + ep_rank, DeepSpeed's MoE order);
    # "tensor": GPT-NeoX's layout, the experts split over the tensor-parallel group (ep = tp, one batch).
    ep: int = 1
    ep_rank: int = 0
    ep_group: object = None  # None when ep == 1
    experts_over: str = "data"
    # the ranks holding the same experts (their gradients are reduced, ZeRO / FSDP2 shard them, over it): dp × cp / ep
    # ranks with experts over data, the dp × cp group with experts over the TP group
    edp_group: object = None

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.cp * self.dp

    @property
    def rank(self) -> int:
        return global_rank(self.pp_rank, self.dp_rank, self.tp_rank, dp=self.dp, tp=self.tp, cp=self.cp,
                           cp_rank=self.cp_rank)

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same parameters and average their gradients: data × context parallel."""
        return self.dp * self.cp

    @property
    def dp_cp_rank(self) -> int:
        return self.dp_rank * self.cp + self.cp_rank

    @property
    def edp(self) -> int:
        """Ranks that hold the same experts: data × context parallel, less the ranks the experts are split over."""
        return self.dp_cp // self.ep if self.experts_over == "data" else self.dp_cp

    @property
    def experts_over_data(self) -> bool:
        """Whether experts are split over ranks that read different tokens (their dense gradients then need the
        expert group's sum too: `neox_hf.parallel.expert_parallel`)."""
        return self.ep > 1 and self.experts_over == "data"

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """The ranks that compute (and hold) the loss."""
        return self.pp_rank == self.pp - 1

    # The names the tensor-parallel code and DeepSpeed's mpu protocol read (formerly `ParallelGroups`).
    @property
    def tp_size(self) -> int:
        return self.tp

    @property
    def dp_size(self) -> int:
        return self.dp

    def describe(self) -> str:
        parts = [f"{self.dp} data-parallel"]
        if self.cp > 1:
            parts.append(f"context parallel {self.cp}")
        if self.tp > 1:
            parts.append(f"tensor parallel {self.tp}")
        if self.ep > 1:
            over = "the tensor-parallel group" if self.experts_over == "tensor" else "data-parallel ranks"
            parts.append(f"expert parallel {self.ep} (over {over})")
        if self.pp > 1:
            parts.append(f"{self.pp} pipeline stages")
        return " × ".join(parts) + f" = {self.world_size} process(es)"


@dataclass
class StepResult:
    """What one optimizer step reports, whichever engine ran it (`neox_hf.engines`: plain or pipeline)."""

    loss: torch.Tensor  # 0-dim, on device: the step's loss as the recipe normalises it, the same on every rank
    tokens: torch.Tensor  # 0-dim: labelled tokens of the step over every micro-batch and data-parallel rank
    samples: torch.Tensor  # 0-dim: sequences of the step over every data-parallel rank
    grad_norm: torch.Tensor | None  # before clipping, when the optimizer path reports it
    skipped: bool  # fp16 overflow: no update
    metrics: dict = field(default_factory=dict)  # the objective's metrics (name → 0-dim mean over the step's units)


def deepspeed_grad_norm(engine) -> torch.Tensor | None:
    """The step's gradient norm as a DeepSpeed engine (plain or pipeline) reports it, as a tensor: DeepSpeed returns
    a float or a tensor depending on the path; a tensor is kept as it is (no wait for the device)."""
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return norm if torch.is_tensor(norm) else torch.tensor(float(norm))


def dp_sum(layout: Layout, tensor: torch.Tensor) -> torch.Tensor:
    """Sum over the data-parallel group: one value per batch a rank read (tensor- and context-parallel ranks of one
    group read the same batches: counted once)."""
    if layout.dp > 1:
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=layout.dp_group)
    return tensor


def shard_sum(layout: Layout, tensor: torch.Tensor) -> torch.Tensor:
    """Sum over the data- and context-parallel ranks: one value per sequence chunk a rank trained (a loss sum, a
    token count; each context-parallel rank holds its own chunk's), never scaled by the number of chunks."""
    if layout.cp == 1:
        return dp_sum(layout, tensor)
    tensor = tensor.clone()
    dist.all_reduce(tensor, group=layout.dp_cp_group)
    return tensor


def global_rank(pp_rank: int, dp_rank: int, tp_rank: int, *, dp: int, tp: int, cp: int = 1, cp_rank: int = 0) -> int:
    return ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank


def _ranks(pp: int, dp: int, tp: int, cp: int):
    """Every (pp_rank, dp_rank, cp_rank, tp_rank) with its global rank."""
    return [((p, d, c, t), global_rank(p, d, t, dp=dp, tp=tp, cp=cp, cp_rank=c))
            for p in range(pp) for d in range(dp) for c in range(cp) for t in range(tp)]


def _groups(pp: int, dp: int, tp: int, cp: int, varying: tuple[int, ...]) -> list[list[int]]:
    """The groups of ranks that differ only along the axes `varying` (0 pp, 1 dp, 2 cp, 3 tp), in rank order."""
    groups: dict[tuple, list[int]] = {}
    for coords, rank in _ranks(pp, dp, tp, cp):
        key = tuple(c for axis, c in enumerate(coords) if axis not in varying)
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


def tp_group_ranks(pp: int, dp: int, tp: int, cp: int = 1) -> list[list[int]]:
    return _groups(pp, dp, tp, cp, (3,))


def dp_group_ranks(pp: int, dp: int, tp: int, cp: int = 1) -> list[list[int]]:
    return _groups(pp, dp, tp, cp, (1,))


def cp_group_ranks(pp: int, dp: int, tp: int, cp: int = 1) -> list[list[int]]:
    return _groups(pp, dp, tp, cp, (2,))


def dp_cp_group_ranks(pp: int, dp: int, tp: int, cp: int = 1) -> list[list[int]]:
    return _groups(pp, dp, tp, cp, (1, 2))


def pp_group_ranks(pp: int, dp: int, tp: int, cp: int = 1) -> list[list[int]]:
    return _groups(pp, dp, tp, cp, (0,))


def launch_world_size() -> int:
    """Processes the launcher started (torchrun / accelerate launch set WORLD_SIZE; plain python: 1)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def required_model_parallel(parallel) -> int:
    """Processes one data-parallel rank needs: pipeline stages × tensor-parallel × context-parallel ranks."""
    return parallel.pipeline_parallel * parallel.tensor_parallel * getattr(parallel, "context_parallel", 1)


def check_launch(recipe, recipe_path: str | None = None) -> None:
    """Refuse, with the command that works, a launch whose process count cannot hold the recipe's layout.

    On CPU `accelerate launch --num_processes N` without `--use_deepspeed` silently starts ONE process, so a layout
    that needs N processes arriving with WORLD_SIZE 1 gets the DeepSpeed launch spelled out. A recipe with a
    `train.train_batch_size` (GPT-NeoX's) that micro × accumulation × this launch's data-parallel size misses is
    refused as GPT-NeoX refuses it, naming both ways to reach it.
    """
    p = recipe.parallel
    need = required_model_parallel(p)
    world = launch_world_size()
    if world % need == 0:
        _check_expert_groups(p, world // need * getattr(p, "context_parallel", 1), need, recipe_path)
        _check_train_batch(recipe, world // need, need, recipe_path)
        return
    what = " × ".join(f"{name} {size}" for name, size in (("pipeline", p.pipeline_parallel), ("tensor parallel", p.tensor_parallel),
                                                          ("context parallel", p.context_parallel)) if size > 1)
    if world == 1:
        raise LaunchError(
            f"the recipe's layout ({what}) needs {need} processes (or a multiple), but this is a single process; "
            f"launch it with: {launch_command(need, recipe_path, backend=p.backend)}"
        )
    raise LaunchError(
        f"{world} processes cannot hold the recipe's layout ({what} = {need} per model replica): the number of "
        f"processes must be a multiple of {need}; launch it with: "
        f"{launch_command(need, recipe_path, backend=p.backend)}"
    )


def _check_expert_groups(parallel, data_cp: int, model_parallel: int, recipe_path: str | None) -> None:
    """Experts over data-parallel ranks need a multiple of `expert_parallel` of them (× context parallel)."""
    ep = getattr(parallel, "expert_parallel", 1)
    if ep == 1 or getattr(parallel, "experts_over", "data") != "data" or data_cp % ep == 0:
        return
    cp = getattr(parallel, "context_parallel", 1)
    processes = model_parallel * ep // math.gcd(ep, cp) if cp > 1 else model_parallel * ep
    raise LaunchError(f"`parallel.expert_parallel: {ep}` splits the experts over {ep} data-parallel ranks, but this "
                      f"launch has {data_cp // cp}{f' (× context parallel {cp})' if cp > 1 else ''}; launch with: "
                      f"{launch_command(processes, recipe_path, backend=parallel.backend)}")


def _check_train_batch(recipe, data_parallel: int, model_parallel: int, recipe_path: str | None) -> None:
    t = recipe.train
    disagreement = train_batch_disagreement(t, data_parallel)
    if disagreement is None:
        return
    replicas = data_parallel_for_train_batch(t)  # ≥ 1: recipe validation refused a train_batch_size none reaches
    command = launch_command(replicas * model_parallel, recipe_path, backend=recipe.parallel.backend)
    fixes = [f"launch {replicas} data-parallel processes ({command})"]
    accumulation = accumulation_for_train_batch(t, data_parallel)
    if accumulation is not None:
        fixes.append(f"pass --train.gradient_accumulation_steps {accumulation}")
    raise LaunchError(f"{disagreement}: {', or '.join(fixes)}")


def launch_command(num_processes: int, recipe_path: str | None = None, *, backend: str = "deepspeed") -> str:
    args = shlex.join(sys.argv[1:]) if recipe_path is None else recipe_path  # pastable: `[{path: x}]` stays one word
    if backend == "fsdp2":
        return f"torchrun --standalone --nproc_per_node {num_processes} run_clm_neox.py {args}".rstrip()
    return f"accelerate launch --use_deepspeed --num_processes {num_processes} run_clm_neox.py {args}".rstrip()


def build_layout(parallel) -> Layout:
    """This rank's layout; collective when distributed (every rank creates every group, in the same order)."""
    pp, tp = parallel.pipeline_parallel, parallel.tensor_parallel
    cp = getattr(parallel, "context_parallel", 1)
    need = pp * tp * cp
    sizes = f"pipeline {pp} × tensor parallel {tp}" + (f" × context parallel {cp}" if cp > 1 else "")
    if not dist.is_initialized():
        if need > 1:
            raise LaunchError(f"{sizes} needs a process group; launch with: {launch_command(need)}")
        return Layout()
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % need:
        raise LaunchError(f"{world} processes are not a multiple of {sizes}; launch with: {launch_command(need)}")
    dp = world // need
    pp_rank, rest = divmod(rank, dp * cp * tp)
    dp_rank, rest = divmod(rest, cp * tp)
    cp_rank, tp_rank = divmod(rest, tp)
    tp_group = _group_containing(rank, tp_group_ranks(pp, dp, tp, cp))
    dp_group = _group_containing(rank, dp_group_ranks(pp, dp, tp, cp))
    pp_group = _group_containing(rank, pp_group_ranks(pp, dp, tp, cp))
    # Only with context parallelism: the groups of a layout without it stay exactly as they were.
    cp_group = _group_containing(rank, cp_group_ranks(pp, dp, tp, cp)) if cp > 1 else None
    dp_cp_group = _group_containing(rank, dp_cp_group_ranks(pp, dp, tp, cp)) if cp > 1 else dp_group
    layout = Layout(pp=pp, tp=tp, dp=dp, pp_rank=pp_rank, tp_rank=tp_rank, dp_rank=dp_rank,
                    tp_group=tp_group if tp > 1 else None, dp_group=dp_group, pp_group=pp_group if pp > 1 else None,
                    cp=cp, cp_rank=cp_rank, cp_group=cp_group, dp_cp_group=dp_cp_group, tp_self_group=tp_group)
    return _with_expert_groups(layout, getattr(parallel, "expert_parallel", 1),
                               getattr(parallel, "experts_over", "data"))


def ep_group_ranks(pp: int, dp: int, tp: int, cp: int, ep: int) -> list[list[int]]:
    """Experts over data: the groups of `ep` ranks that split the experts and exchange tokens, consecutive along
    each dp × cp group (DeepSpeed's `_create_expert_and_data_parallel` order)."""
    return [ranks[i:i + ep] for ranks in dp_cp_group_ranks(pp, dp, tp, cp) for i in range(0, len(ranks), ep)]


def edp_group_ranks(pp: int, dp: int, tp: int, cp: int, ep: int) -> list[list[int]]:
    """Experts over data: the ranks of each dp × cp group that hold the same experts (strided by `ep`)."""
    return [ranks[i::ep] for ranks in dp_cp_group_ranks(pp, dp, tp, cp) for i in range(ep)]


def _with_expert_groups(layout: Layout, ep: int, experts_over: str) -> Layout:
    """`layout` with its expert groups (collective: every rank creates every group, in the same order)."""
    from dataclasses import replace

    if ep == 1:
        return replace(layout, edp_group=layout.dp_cp_group)
    if experts_over == "tensor":
        return replace(layout, ep=ep, ep_rank=layout.tp_rank, ep_group=layout.tp_group, experts_over="tensor",
                       edp_group=layout.dp_cp_group)
    if layout.dp_cp % ep:
        raise LaunchError(f"`parallel.expert_parallel: {ep}` must divide the {layout.dp_cp} data-parallel ranks "
                          f"(× context parallel) that read different tokens; launch a multiple of {ep} of them")
    shape = (layout.pp, layout.dp, layout.tp, layout.cp)
    rank = layout.rank
    ep_group = _group_containing(rank, ep_group_ranks(*shape, ep))
    edp_group = _group_containing(rank, edp_group_ranks(*shape, ep))
    return replace(layout, ep=ep, ep_rank=layout.dp_cp_rank % ep, ep_group=ep_group, experts_over="data",
                   edp_group=edp_group)


def _group_containing(rank: int, all_ranks: list[list[int]]):
    # new_group is collective over the whole world, so every rank creates every group, in the same order.
    mine = None
    for ranks in all_ranks:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine
