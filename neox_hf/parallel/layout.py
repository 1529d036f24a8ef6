"""The layout of a run: sizes, ranks and process groups of pipeline × data × tensor parallelism.

One object, always present (all sizes 1 in a single process), built once from the recipe and the launch — the role
of torchtitan's `ParallelDims`. Everything else asks it instead of computing "world = tp × dp" or testing
`groups is None`: which data-parallel slice of the batches this rank reads, which ranks hold the loss, which group a
reduction runs over. A new parallel dimension is a new field here.

Rank order is Megatron's and DeepSpeed's `PipeModelDataParallelTopology` (axes pipe, data, model; model fastest):
    rank = pp_rank × (dp × tp) + dp_rank × tp + tp_rank
so the ranks of a tensor-parallel group are consecutive (they exchange activations every layer and should share a
node), and with pp = 1 this is the layout the TP code has always used.

`check_launch(recipe)` runs before any Accelerator or process group exists, so a launch that cannot give the layout
is refused with the exact command to use, not with a process-group traceback.
"""

from __future__ import annotations

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

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def rank(self) -> int:
        return global_rank(self.pp_rank, self.dp_rank, self.tp_rank, dp=self.dp, tp=self.tp)

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
        if self.tp > 1:
            parts.append(f"tensor parallel {self.tp}")
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
    """Sum over the data-parallel group (tensor-parallel ranks of one group hold the same values: counted once)."""
    if layout.dp > 1:
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=layout.dp_group)
    return tensor


def global_rank(pp_rank: int, dp_rank: int, tp_rank: int, *, dp: int, tp: int) -> int:
    return pp_rank * dp * tp + dp_rank * tp + tp_rank


def tp_group_ranks(pp: int, dp: int, tp: int) -> list[list[int]]:
    return [[global_rank(p, d, t, dp=dp, tp=tp) for t in range(tp)] for p in range(pp) for d in range(dp)]


def dp_group_ranks(pp: int, dp: int, tp: int) -> list[list[int]]:
    return [[global_rank(p, d, t, dp=dp, tp=tp) for d in range(dp)] for p in range(pp) for t in range(tp)]


def pp_group_ranks(pp: int, dp: int, tp: int) -> list[list[int]]:
    return [[global_rank(p, d, t, dp=dp, tp=tp) for p in range(pp)] for d in range(dp) for t in range(tp)]


def launch_world_size() -> int:
    """Processes the launcher started (torchrun / accelerate launch set WORLD_SIZE; plain python: 1)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def required_model_parallel(parallel) -> int:
    """Processes one model replica needs: pipeline stages × tensor-parallel ranks."""
    return parallel.pipeline_parallel * parallel.tensor_parallel


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
        _check_train_batch(recipe, world // need, need, recipe_path)
        return
    what = " × ".join(f"{name} {size}" for name, size in (("pipeline", p.pipeline_parallel), ("tensor parallel", p.tensor_parallel)) if size > 1)
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
    if not dist.is_initialized():
        if pp * tp > 1:
            raise LaunchError(f"pipeline {pp} × tensor parallel {tp} needs a process group; "
                              f"launch with: {launch_command(pp * tp)}")
        return Layout()
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % (pp * tp):
        raise LaunchError(f"{world} processes are not a multiple of pipeline {pp} × tensor parallel {tp}; "
                          f"launch with: {launch_command(pp * tp)}")
    dp = world // (pp * tp)
    pp_rank, rest = divmod(rank, dp * tp)
    dp_rank, tp_rank = divmod(rest, tp)
    tp_group = _group_containing(rank, tp_group_ranks(pp, dp, tp))
    dp_group = _group_containing(rank, dp_group_ranks(pp, dp, tp))
    pp_group = _group_containing(rank, pp_group_ranks(pp, dp, tp))
    return Layout(pp=pp, tp=tp, dp=dp, pp_rank=pp_rank, tp_rank=tp_rank, dp_rank=dp_rank,
                  tp_group=tp_group if tp > 1 else None, dp_group=dp_group, pp_group=pp_group if pp > 1 else None)


def _group_containing(rank: int, all_ranks: list[list[int]]):
    # new_group is collective over the whole world, so every rank creates every group, in the same order.
    mine = None
    for ranks in all_ranks:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine
