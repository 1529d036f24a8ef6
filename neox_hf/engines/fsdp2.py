"""The FSDP2 engine (`parallel.backend: fsdp2`): torch's `fully_shard` per decoder layer over a DeviceMesh of the
data-parallel ranks, so parameters, gradients and AdamW's states are sharded (ZeRO-3's memory, as DTensors); with
`parallel.dp_replicate` > 1 the mesh is 2-D (replicate × shard) and this is HSDP. With `parallel.tensor_parallel` our
TP layers (Megatron's, `neox_hf.parallel`) split each layer first and FSDP2 shards every rank's TP slices over its
data-parallel ranks (the device mesh is tp × dp_replicate × dp_shard in the layout's rank order). The step, for any
objective, is the replicas' shared one (`neox_hf.engines.replica`): FSDP2's reduce-scatter averages gradients over the
data-parallel ranks as DeepSpeed does, so the token weighting needs nothing new.

Groups: every decoder layer (the model's `_no_split_modules`, as accelerate's transformer_based_wrap picks them), the
decoder itself (embeddings, final norm), the output head on its own (the fused loss runs as the head's forward:
`neox_hf.ops.head_loss`), a reward model's score head on its own, then the whole model for what is left.

Context parallelism (`parallel.context_parallel`): torch's ring attention (`neox_hf.ops.ring_attention`) over each
context-parallel group, every sequence dealt in head-tail chunks; the context-parallel ranks are shards of the same
FSDP2 group, so gradients are reduced over data-parallel × context-parallel ranks, as DeepSpeed's engine does. Mixed precision by
`MixedPrecisionPolicy`: bf16 compute where the recipe trains bf16, fp32 sharded masters and fp32 reductions.
`train.compile` compiles each decoder layer before it is sharded (torchtitan's order). Under gradient accumulation
gradients are reduced in the last micro-batch's backward only (`before_micro_batch`).

Gap filled: accelerate (1.16) has an FSDP2 path (`FullyShardedDataParallelPlugin(fsdp_version=2)`, `_prepare_fsdp2`),
but on CPU its state ignores the plugin (`DistributedType.NO` with a gloo group of several processes), so nothing is
sharded; the engine calls `fully_shard` itself (per layer, as `_prepare_fsdp2`'s transformer-based wrap does, plus
the head for the fused loss and the mesh our TP needs), and keeps Accelerate for accumulation, autocast and the
process group. The optimizer is Accelerate's `AcceleratedOptimizer` (it steps once
per accumulation cycle) without registering it with the Accelerator: its save_state would write rank 0's shards as
if whole; the checkpoint is the layout-free state instead (DCP of the DTensors, `neox_hf.checkpoint.layout_free`),
which a DeepSpeed or one-process run resumes as well.
"""

from __future__ import annotations

import torch

from neox_hf.engines import zero_state
from neox_hf.engines.compile import compile_decoder_layers, compiles
from neox_hf.engines.optimizer import build_optimizer
from neox_hf.engines.replica import ReplicaEngine, enable_activation_checkpointing, tensor_parallel_once
from neox_hf.errors import LaunchError, RecipeError
from neox_hf.ops.context_parallel import HEAD_TAIL
from neox_hf.ops.ring_attention import register_ring_attention
from neox_hf.parallel.expert_parallel import (apply_expert_parallel, describe_experts, expert_modules,
                                              expert_squares_over_group, gather_experts, is_expert_parameter)
from neox_hf.parallel.layout import cp_group_ranks, dp_cp_group_ranks
from neox_hf.parallel.tp_plan import partition_dim


class FSDP2Engine(ReplicaEngine):
    name = "fsdp2"
    backend = "fsdp2"
    reads_accelerate_checkpoint = False

    @classmethod
    def handles(cls, recipe, layout) -> bool:
        return recipe.parallel.backend == "fsdp2"

    context_parallel_order = HEAD_TAIL  # torch's load balancing, which its ring attention assumes

    def describe(self) -> str:
        replicate, cp = self.recipe.parallel.dp_replicate, self.layout.cp
        tp = f" × tensor parallel {self.layout.tp}" if self.layout.tp > 1 else ""
        shards = self.layout.dp // replicate * cp  # context-parallel ranks hold shards of the same parameters
        over = f": {self.layout.dp // replicate} data-parallel × context parallel {cp}" if cp > 1 else ""
        if replicate > 1:
            return f"FSDP2 HSDP ({replicate} replicas × {shards} shards{over}){tp}"
        return f"FSDP2 ({shards} shards{over}){tp}"

    def startup_lines(self) -> list[str]:
        compiled = ", each decoder layer compiled" if compiles(self.recipe.train, self.accelerator.device) else ""
        return [f"engine: {self.describe()}, per decoder layer, mixed precision {self.recipe.train.precision}"
                f"{compiled}", *self._context_parallel_lines(), *self._expert_lines()]

    def _expert_lines(self) -> list[str]:
        line = describe_experts(self.model, self.layout)
        if line and self.layout.experts_over_data:
            line += f"; FSDP2 shards each expert block over the {self.layout.edp * self.layout.tp} rank(s) holding it"
        return [line] if line else []

    def _context_parallel_lines(self) -> list[str]:
        cp, length = self.layout.cp, self.recipe.model.seq_length
        if cp == 1:
            return []
        kernel = "CUDA's SDPA kernels" if self.accelerator.device.type == "cuda" else "CPU's flash SDPA kernel"
        return [f"context parallel {cp}: every sequence of {length} tokens split into {2 * cp} chunks of "
                f"{length // (2 * cp)}, {length // cp} tokens per rank (a head and a tail chunk: equal causal work); "
                f"torch's ring attention passes key/value blocks round the {cp} ranks ({kernel})"]

    def device_mesh(self):
        """The (tp, dp_replicate, dp_shard) mesh in the layout's rank order (rank = (dp_rank × cp + cp_rank) × tp +
        tp_rank); FSDP2 shards over its data-parallel dims (1-D, or 2-D for HSDP), the layout-free state is laid out
        over all three. The context-parallel ranks of a data-parallel rank are shards too (`dp_shard` is
        data-parallel shards × cp, DeepSpeed's sequence-data-parallel group): they hold the same parameters and
        their gradients, computed on different tokens, are reduced together. Collective."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        if not dist.is_initialized():  # build_accelerator starts a group of one for a plain `python` run
            raise LaunchError("`parallel.backend: fsdp2` needs a process group; launch with: torchrun --standalone "
                              "--nproc_per_node N run_clm_neox.py RECIPE --parallel.backend fsdp2")
        replicate, dp, cp = self.recipe.parallel.dp_replicate, self.layout.dp, self.layout.cp
        if dp % replicate:
            raise LaunchError(f"`parallel.dp_replicate: {replicate}` must divide the {dp} data-parallel processes "
                              f"(HSDP: replicas × shards); launch a multiple of {replicate} processes")
        ranks = torch.arange(self.layout.world_size).reshape(replicate, dp // replicate * cp, self.layout.tp)
        return DeviceMesh(self.accelerator.device.type, ranks.permute(2, 0, 1),
                          mesh_dim_names=("tp", "dp_replicate", "dp_shard"))

    def context_parallel_mesh(self):
        """The 1-D mesh of this rank's context-parallel group (the layout's group), which the ring runs over."""
        from torch.distributed.device_mesh import DeviceMesh

        layout = self.layout
        ranks = next(group for group in cp_group_ranks(layout.pp, layout.dp, layout.tp, layout.cp)
                     if layout.rank in group)
        return DeviceMesh.from_group(layout.cp_group, self.accelerator.device.type, mesh=ranks,
                                     mesh_dim_names=("cp",))

    def _data_parallel_mesh(self):
        dims = ("dp_replicate", "dp_shard") if self.recipe.parallel.dp_replicate > 1 else ("dp_shard",)
        return self.mesh[dims]

    def parallelize(self, model):
        """Activation checkpointing, then `fully_shard` per decoder layer, decoder, head and model; AdamW over the
        sharded parameters. (model, optimizer), also kept on the engine."""
        from accelerate.optimizer import AcceleratedOptimizer
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        recipe = self.recipe
        if getattr(model.config, "tie_word_embeddings", False) and model.get_output_embeddings() is not None:
            raise RecipeError("tied input and output embeddings with `parallel.backend: fsdp2` are refused: the head "
                              "is sharded as its own group for the fused loss; set `model.tie_word_embeddings: false` "
                              "or use `parallel.backend: deepspeed`")
        model = tensor_parallel_once(model, self.layout, sequence_parallel=recipe.parallel.sequence_parallel)
        model = apply_expert_parallel(model, self.layout)
        if recipe.parallel.activation_checkpointing:
            enable_activation_checkpointing(model)
        if compiles(recipe.train, self.accelerator.device):
            # before fully_shard, as torchtitan: each layer's forward is one graph; FSDP2's hooks, registered after,
            # run eagerly around it (torch marks them dynamo-disabled)
            compile_decoder_layers(model)
        self.mesh = self.device_mesh()
        mesh = self._data_parallel_mesh()
        bf16 = recipe.train.precision == "bf16"
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
        # Under LoRA the groups are the wrapped model's (its layers hold the adapters, applied before this): FSDP2
        # shards every parameter on its own, frozen or not, and reduces gradients only for those that require grad;
        # the PeftModel around it holds no parameter of its own and stays unsharded (peft saves through it).
        core = model.get_base_model() if hasattr(model, "get_base_model") else model
        self._shard_experts(core, policy)
        layer_classes = set(getattr(core, "_no_split_modules", None) or ())
        for module in [m for m in core.modules() if type(m).__name__ in layer_classes]:
            fully_shard(module, mesh=mesh, mp_policy=policy)
        head = core.get_output_embeddings() if hasattr(core, "get_output_embeddings") else None
        # a reward model's score head its own group too: under context parallelism the objective runs it on the
        # decoder's chunk outside the model's forward (`neox_hf.objectives.rm`), which unshards only its own groups
        for module in (core.base_model, head, getattr(core, "score", None)):
            if module is not None and module is not core:
                fully_shard(module, mesh=mesh, mp_policy=policy)
        fully_shard(core, mesh=mesh, mp_policy=policy)
        _keep_checkpoint_key_renames(core)
        self.model, self._root = model, core
        self.optimizer = AcceleratedOptimizer(build_optimizer(model, recipe.train), device_placement=False)
        if self.layout.cp > 1:
            self.context_parallel_attention = register_ring_attention(self.context_parallel_mesh())
        return self.model, self.optimizer

    def _shard_experts(self, core, policy) -> None:
        """With experts over data-parallel ranks, each experts module its own group over the ranks holding the same
        experts (the expert-data-parallel mesh), before the layers take the dense parameters over every data-parallel
        rank. Its gradient, which the backward all-to-all already summed over the expert group, is summed over that
        mesh and divided by every data-parallel rank (not by the mesh's size: DeepSpeed #5618's scaling bug), so an
        expert steps as on one process. (With experts over the TP group they are TP shards: nothing here.)"""
        from torch.distributed.fsdp import fully_shard

        if not self.layout.experts_over_data:
            return
        self.expert_mesh = self._expert_meshes()
        self.expert_shard_mesh = self.expert_mesh["efsdp"]
        for _, experts in expert_modules(core):
            fully_shard(experts, mesh=self.expert_shard_mesh, mp_policy=policy)
            experts.set_gradient_divide_factor(float(self.layout.dp_cp))
            # a divide factor is NCCL's PreMulSum otherwise (not in gloo); over one rank FSDP2 divides once already
            experts.set_force_sum_reduction_for_comms(self.layout.edp * self.layout.tp > 1)

    def _expert_meshes(self):
        """The (ep, efsdp) mesh of the experts: an expert block is Shard(0) over the expert group and held by every
        rank of the same expert-group rank (the expert-data-parallel ranks × the TP ranks, whose token slices
        differ), which FSDP2 shards it over (Shard(0) of the block: the layout-free state's view). Collective."""
        from torch.distributed.device_mesh import DeviceMesh

        layout = self.layout
        ranks = torch.tensor([[[((pp * layout.dp_cp + edp * layout.ep + ep) * layout.tp + tp)
                                for edp in range(layout.edp) for tp in range(layout.tp)]
                               for ep in range(layout.ep)] for pp in range(layout.pp)])
        return DeviceMesh(self.accelerator.device.type, ranks, mesh_dim_names=("pp", "ep", "efsdp"))["ep", "efsdp"]

    def before_micro_batch(self, last: bool) -> None:
        """Reduce-scatter (and under HSDP all-reduce) the gradients in the last micro-batch's backward only: the
        others accumulate unsharded gradients locally (FSDP1's `no_sync`; what accelerate's `no_sync` does for an
        FSDP2 model it prepared, which this engine's model is not), so an accumulation cycle of N micro-batches
        reduces once instead of N times. Not on the last backward FSDP2 also skips waiting for pending reductions.
        The reduce-scatter averages the summed gradient over the data-parallel ranks as before: the step is the
        same, only the communication goes."""
        self._root.set_requires_gradient_sync(last)
        self._root.set_is_last_backward(last)

    def clip_gradients(self):
        """The whole model's gradient norm (its shards' norms reduced over the mesh), clipped to `train.clip_grad`
        (0: only measured). torchtitan's clip: `get_total_norm` of the DTensor gradients, made whole, then
        `clip_grads_with_norm_`; under TP the squares of TP-split gradients are summed over the TP group and the
        replicated ones (norms, row-parallel biases) counted once."""
        import torch.distributed as dist

        named = [(name, p) for name, p in self.model.named_parameters() if p.grad is not None]
        on_expert_mesh = [p for name, p in named if self.layout.experts_over_data and is_expert_parameter(name)]
        named = [(name, p) for name, p in named if not (self.layout.experts_over_data and is_expert_parameter(name))]
        params = [p for _, p in named]
        experts = [p.grad for p in on_expert_mesh]
        split = [p.grad for name, p in named if _split_dim(name, self.layout) is not None]
        whole = [p.grad for name, p in named if _split_dim(name, self.layout) is None]
        device = self.accelerator.device
        squares = _norm(whole, device) ** 2
        if experts:  # on their own mesh; each rank of the expert group holds other experts
            squares = squares + expert_squares_over_group(_norm(experts, device) ** 2, self.layout)
        if split:
            split_squares = _norm(split, device) ** 2
            dist.all_reduce(split_squares, group=self.layout.tp_group)
            squares = squares + split_squares
        norm = squares.sqrt()
        if self.recipe.train.clip_grad > 0:
            for group in (params, on_expert_mesh):  # one mesh at a time
                if group:
                    torch.nn.utils.clip_grads_with_norm_(group, self.recipe.train.clip_grad, norm)
        return norm

    def full_state_dict(self) -> dict | None:
        """The whole model's state dict on the main process (DCP's get_model_state_dict gathers each DTensor; under
        TP each tensor is then gathered over the TP group, one at a time, into CPU memory). Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from neox_hf.parallel.mappings import gather_along_dim

        self._reshard()
        if self.layout.tp == 1 and self.layout.ep == 1:
            return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        merged = {}
        for key, tensor in self.model.state_dict().items():
            local = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            dim = None if is_expert_parameter(key) else _split_dim(key, self.layout)
            merged[key] = (local if dim is None else gather_along_dim(local, dim, self.layout.tp_group)).detach().cpu()
        return gather_experts(merged, self.layout)  # each rank's expert block, whole over the expert group

    def named_full_parameters(self):
        """(name, the sharded parameter, its TP dimension) of every trained parameter; resharded first."""
        self._reshard()
        for name, param in self.model.named_parameters():
            if param.requires_grad:
                yield name, param, _split_dim(name, self.layout)

    def _reshard(self) -> None:
        """Every group's parameters back to their shards (DTensors). The objectives call the decoder, not the model
        (`neox_hf.ops.loss`), so FSDP2 takes the first group a forward reaches for its root, and a root keeps its
        parameters gathered after a forward for the backward that follows; after an eval forward no backward
        follows, and a checkpoint taken then (eval and save on the same step) saw the gathered plain tensors, which
        under TP broke the layout-free state."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def parameter_count(self) -> int:
        """A DTensor's numel is its data-parallel whole (this rank's TP slice); × TP counts replicated norms once per
        TP rank, as the plain engine does."""
        return sum(p.numel() for p in self.model.parameters()) * self.layout.tp

    def loss_scale(self) -> float | None:
        return None  # fp16 is refused with this backend (recipe)

    def loss_scale_floor(self) -> float | None:
        return None

    # -- the layout-free checkpoint: the DTensors themselves are layout-free ------------------------------

    def layout_free_state(self) -> tuple[dict, dict]:
        """Every parameter and Adam moment as the DTensor it is (full shape, this rank's shard; DCP writes each
        chunk once, replicas deduplicated)."""
        base = zero_state.base_optimizer(self.optimizer)
        tensors = {}
        for name, param, tp_dim in self.named_full_parameters():
            state = base.state.get(param, {})
            tensors[f"model/{name}"] = self._full_view(param.detach(), tp_dim)
            for key in zero_state.MOMENTS:
                value = state[key] if key in state else torch.zeros_like(param.detach())
                tensors[f"{key}/{name}"] = self._full_view(value, tp_dim)
        return tensors, {"adam_step": zero_state.optimizer_step(base), "loss_scaler": None}

    def load_layout_free_state(self, read, plain: dict) -> None:
        """Read each parameter's shard and its Adam moments straight into the tensors training uses where they are
        fp32 (as `layout_free_state` writes them from), else into fp32 targets copied over after."""
        base = zero_state.base_optimizer(self.optimizer)
        named = list(self.named_full_parameters())
        zero_state.create_adam_state(base)  # first: the moments exist to be read into
        homes = {f"{key}/{name}": (param.detach() if key == "model" else base.state[param][key])
                 for name, param, _ in named for key in ("model", *zero_state.MOMENTS)}
        targets = {f"{key}/{name}": self._full_view(_fp32_target(homes[f"{key}/{name}"]), tp_dim)
                   for name, param, tp_dim in named for key in ("model", *zero_state.MOMENTS)}
        read(targets)
        step = float(plain["adam_step"])
        with torch.no_grad():
            for fqn, home in homes.items():
                if _local(targets[fqn]).data_ptr() != _local(home).data_ptr():
                    _local(home).copy_(_local(targets[fqn]))
        zero_state.set_optimizer_step(base, step)

    def _full_view(self, value, tp_dim):
        """`value` (a DTensor over the data-parallel mesh, whose whole is this rank's TP slice) as a DTensor of the
        full tensor over the whole mesh: TP split (or replicated) first, then FSDP2's sharding of the slice. An expert
        block over data-parallel ranks: Shard(0) over the expert group, then FSDP2's Shard(0) of the block."""
        if self.layout.experts_over_data and getattr(value, "device_mesh", None) == self.expert_shard_mesh:
            return _expert_view(value, self.expert_mesh, self.layout.ep)
        if self.layout.tp == 1:
            return value
        from torch.distributed.tensor import DTensor, Replicate, Shard

        shape = list(value.shape)
        if tp_dim is not None:
            shape[tp_dim] *= self.layout.tp
        full = torch.Size(shape)
        replicas = [] if self.recipe.parallel.dp_replicate > 1 else [Replicate()]  # the mesh's dp_replicate dim of 1
        placements = [Shard(tp_dim) if tp_dim is not None else Replicate(), *replicas, *value.placements]
        return DTensor.from_local(value.to_local(), self.mesh, placements, run_check=False, shape=full,
                                  stride=torch.empty(full, device="meta").stride())


def _split_dim(name: str, layout) -> int | None:
    """The dimension `name` is split along over the tensor-parallel group (experts over it: the expert dim)."""
    if layout.tp == 1:
        return None
    if layout.experts_over == "tensor" and layout.ep > 1 and is_expert_parameter(name):
        return 0
    return partition_dim(name)


def _expert_view(value, mesh, ep: int):
    """`value` (a DTensor of this rank's expert block over the expert-data-parallel mesh) as a DTensor of the whole
    tensor over the (ep, edp) mesh."""
    from torch.distributed.tensor import DTensor, Shard

    shape = list(value.shape)
    shape[0] *= ep
    full = torch.Size(shape)
    return DTensor.from_local(value.to_local(), mesh, [Shard(0), *value.placements], run_check=False, shape=full,
                              stride=torch.empty(full, device="meta").stride())


def _keep_checkpoint_key_renames(model) -> None:
    """fully_shard turns the model's class `C` into `FSDPC`, and transformers looks up the renames it applies when
    saving (GPTNeoX's stored `embed_out.weight` ↔ our `lm_head.weight`) by class name: the sharded class gets the
    original's, so the final folder is stock GPTNeoX as on every other backend."""
    from transformers.conversion_mapping import (get_checkpoint_conversion_mapping,
                                                 register_checkpoint_conversion_mapping)

    sharded, original = type(model), type(model).__bases__[-1]
    mapping = get_checkpoint_conversion_mapping(original.__name__)
    if mapping is not None and sharded is not original:
        register_checkpoint_conversion_mapping(sharded.__name__, mapping, overwrite=True)


def _local(value):
    return value.to_local() if hasattr(value, "to_local") else value


def _fp32_target(home):
    """`home` itself where it is fp32 (read in place), else an empty fp32 tensor of its shape and placements."""
    return home if home.dtype == torch.float32 else torch.empty_like(home, dtype=torch.float32)


def _norm(grads, device) -> torch.Tensor:
    """The 2-norm of `grads` (DTensors over the data-parallel mesh) as a plain tensor, whole over that mesh."""
    if not grads:
        return torch.zeros((), device=device)
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
