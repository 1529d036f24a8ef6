"""The plain engine: one model replica per data-parallel rank, under Accelerate alone or with DeepSpeed ZeRO 0–3,
with our tensor (+ sequence) parallelism inside the replica and context parallelism (DeepSpeed's Ulysses attention,
`neox_hf.ops.context_parallel`) across replicas of one data-parallel rank. Its step, for any objective, is the
replicas' shared one (`neox_hf.engines.replica`).
"""

from __future__ import annotations

import contextlib

import torch

from neox_hf.engines import zero_state
from neox_hf.engines.compile import compile_decoder_layers, compiles
from neox_hf.engines.optimizer import build_optimizer
from neox_hf.engines.replica import ReplicaEngine, enable_activation_checkpointing, tensor_parallel_once
from neox_hf.ops.context_parallel import register_context_parallel_attention
from neox_hf.parallel.expert_parallel import (apply_expert_parallel, describe_experts, divide_gradients_for_deepspeed,
                                              gather_experts, is_expert_parameter)
from neox_hf.parallel.tensor_parallel import gather_full_state_dict
from neox_hf.parallel.layout import dp_cp_group_ranks
from neox_hf.parallel.tp_groups import DeepSpeedMPU, deepspeed_initialize_with_mpu
from neox_hf.parallel.tp_plan import partition_dim

EXPERT_BLOCK = "expert block"  # the split "dimension" of an expert tensor over data-parallel ranks (`_ExpertViews`)


class PlainEngine(ReplicaEngine):
    name = "plain"

    @classmethod
    def handles(cls, recipe, layout) -> bool:
        return True  # the default: every layout without pipeline stages

    @property
    def reads_accelerate_checkpoint(self) -> bool:
        """Under expert parallelism DeepSpeed's own files would be read by any run whose DeepSpeed sizes match (EP2 on
        4 processes records tensor × data as TP2 does): its checkpoints resume from the layout-free state only."""
        return self.layout.ep == 1

    def describe(self) -> str:
        return "one model replica per data-parallel rank (tensor parallelism inside it)"

    def startup_lines(self) -> list[str]:
        experts = describe_experts(self.accelerator.unwrap_model(self.model), self.layout)
        return self._context_parallel_lines() + self._compile_lines() + ([experts] if experts else [])

    def _context_parallel_lines(self) -> list[str]:
        layout, m = self.layout, self.recipe.model
        if layout.cp == 1:
            return []
        heads = m.num_attention_heads // layout.tp
        return [f"context parallel {layout.cp}: every sequence of {m.seq_length} tokens split into {layout.cp} chunks, "
                f"{m.seq_length // layout.cp} tokens per rank; attention exchanges them for heads by all-to-all "
                f"(DeepSpeed Ulysses: the whole sequence for {heads // layout.cp} of {heads} heads per rank)"]

    def _compile_lines(self) -> list[str]:
        setting = self.recipe.train.compile
        if compiles(self.recipe.train, self.accelerator.device):
            return [f"compile: each decoder layer with torch.compile (`train.compile: {str(setting).lower()}`); masks, "
                    "rotary tables and the loss eager"]
        why = " (auto compiles on CUDA only)" if setting == "auto" else ""
        return [f"compile: off{why}"]

    def parallelize(self, model):
        """Apply TP (+ sequence parallelism) and activation checkpointing, build AdamW, let Accelerate/DeepSpeed wrap
        both; DeepSpeed is handed the layout so ZeRO reduces over the data-parallel group only. (model, optimizer),
        also kept on the engine."""
        layout, recipe, accelerator = self.layout, self.recipe, self.accelerator
        model = tensor_parallel_once(model, layout, sequence_parallel=recipe.parallel.sequence_parallel)
        # experts split over the expert group; with experts over data, DeepSpeed's data-parallel group is the
        # expert-data-parallel one (`DeepSpeedMPU`) and these hooks make its average every data-parallel rank's
        model = apply_expert_parallel(model, layout)
        divide_gradients_for_deepspeed(model, layout)
        if layout.experts_over_data:
            self._views = _ExpertViews(layout, accelerator.device)  # the layout-free state's map (zero_state)
        if recipe.parallel.activation_checkpointing:
            enable_activation_checkpointing(model)
        if compiles(recipe.train, accelerator.device):
            compile_decoder_layers(model)
        optimizer = build_optimizer(model, recipe.train)
        distributed = layout.world_size > 1
        with deepspeed_initialize_with_mpu(DeepSpeedMPU(layout)) if distributed else contextlib.nullcontext():
            self.model, self.optimizer = accelerator.prepare(model, optimizer)
        if layout.cp > 1:
            self.context_parallel_attention = register_context_parallel_attention(model.config, layout.cp_group,
                                                                                  tensor_parallel=layout.tp)
        return self.model, self.optimizer

    def before_micro_batch(self, last: bool) -> None:
        """What `DeepSpeedEngine.forward` does first, which the objectives skip by calling the decoder inside the
        engine: it tells its ZeRO optimizer a micro-batch begins (`clear_backward_seen_flag`). ZeRO-3 counts the
        micro-batches of an accumulation cycle there, copying the first one's gradient partitions and adding the
        later ones'; without the call every micro-batch was the first and a cycle kept only its last micro-batch's
        gradient (ZeRO-1/2 accumulate in `.grad` and did not notice)."""
        zero_optimizer = getattr(self.model, "optimizer", None)  # a DeepSpeedEngine's; a plain module has none
        if hasattr(zero_optimizer, "clear_backward_seen_flag"):
            zero_optimizer.clear_backward_seen_flag()

    def full_state_dict(self) -> dict | None:
        """The whole model's state dict (TP shards merged, ZeRO-3 partitions gathered). Collective: every rank calls it;
        the result is complete on the main process."""
        if self.layout.tp > 1:
            state = gather_full_state_dict(self.accelerator.unwrap_model(self.model), self.layout)
        else:
            state = self.accelerator.get_state_dict(self.model)
        return gather_experts(state, self.layout)  # every rank holds its experts' block: gathered on every rank

    def named_full_parameters(self):
        module = getattr(self.model, "module", self.model)  # through DDP / DeepSpeed wrappers
        for name, param in module.named_parameters():
            if param.requires_grad:
                yield name, param, _split_dim(name, self.layout)

    def parameter_count(self) -> int:
        """Full-model parameter count (ZeRO-3 partitions, TP shards; replicated norms are counted once per TP rank,
        which is why this is approximate under TP)."""
        model = getattr(self.model, "module", self.model)  # through DDP / DeepSpeed wrappers
        return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()) * self.layout.tp


def _split_dim(name: str, layout):
    """The dimension `name` is split along over the tensor-parallel group (experts over it: the expert dim), or
    EXPERT_BLOCK for an expert tensor split over data-parallel ranks."""
    if layout.experts_over_data and is_expert_parameter(name):
        return EXPERT_BLOCK
    if layout.tp == 1:
        return None
    if layout.experts_over == "tensor" and layout.ep > 1 and is_expert_parameter(name):
        return 0
    return partition_dim(name)


class _ExpertViews(zero_state._ShardViews):
    """zero_state's map of this rank's tensors onto full ones, plus expert blocks over data-parallel ranks: an expert
    tensor is Shard(0) over the expert group, and over the ranks holding the same block (expert-data-parallel) it is
    split along dim 0 for saving and replicated for loading, as a dense tensor is over the data-parallel ranks."""

    def __init__(self, layout, device):
        super().__init__(layout, device)
        from torch.distributed.device_mesh import DeviceMesh

        groups = dp_cp_group_ranks(layout.pp, layout.dp, layout.tp, layout.cp)
        ranks = torch.tensor(groups).reshape(len(groups), layout.edp, layout.ep).transpose(1, 2)
        self.expert_mesh = DeviceMesh(device.type, ranks, mesh_dim_names=("replica", "ep", "edp"))["ep", "edp"]
        self.edp_rank = layout.dp_cp_rank // layout.ep

    def _expert_dtensor(self, local, block_shape, split: bool):
        from torch.distributed.tensor import DTensor, Replicate, Shard

        full = torch.Size([block_shape[0] * self.layout.ep, *block_shape[1:]])
        placements = [Shard(0), Shard(0) if split else Replicate()]
        return DTensor.from_local(local.contiguous(), self.expert_mesh, placements, run_check=False, shape=full,
                                  stride=torch.empty(full, device="meta").stride())

    def for_save(self, shard, tp_dim):
        if tp_dim != EXPERT_BLOCK:
            return super().for_save(shard, tp_dim)
        edp = self.layout.edp
        split = edp > 1 and shard.shape[0] % edp == 0
        local = shard.chunk(edp, dim=0)[self.edp_rank].clone() if split else shard
        return self._expert_dtensor(local, shard.shape, split)

    def for_load(self, local_shape, tp_dim, device):
        if tp_dim != EXPERT_BLOCK:
            return super().for_load(local_shape, tp_dim, device)
        return self._expert_dtensor(torch.empty(local_shape, dtype=torch.float32, device=device), local_shape, False)

