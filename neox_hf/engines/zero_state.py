"""This rank's part of the layout-free checkpoint state under Accelerate and DeepSpeed ZeRO 0–3: each parameter's
fp32 master value and Adam moments as this rank's chunk of the full tensor (`neox_hf.checkpoint.layout_free` owns
the files), and their restoration on another layout; the engines' `layout_free_state` / `load_layout_free_state`
call these.

Gap filled: DeepSpeed's per-parameter accessors (`safe_get_full_fp32_param`, `safe_get_full_optimizer_state` and
their setters) give one rank's tensor-parallel shard of a ZeRO-managed parameter, not its place in the full tensor;
DCP needs that place. `_ShardViews` gives it: the shard's rows over the (tensor × data) mesh of this rank's stage.
"""

from __future__ import annotations

import torch

from neox_hf.parallel.layout import Layout

MOMENTS = ("exp_avg", "exp_avg_sq")
_DS_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def layout_free_state(engine) -> tuple[dict, dict]:
    """This rank's part of the layout-free training state: (tensors keyed `model|exp_avg|exp_avg_sq/<name>`,
    each this rank's chunk of the full tensor; plain data: Adam's step, the loss scaler). Collective."""
    views, base = _shard_views(engine), base_optimizer(engine.optimizer)
    _link_zero_fragments(engine.optimizer)
    tensors = {}
    for name, param, tp_dim in engine.named_full_parameters():
        for key, value in _master_and_moments(param, base):
            tensors[f"{key}/{name}"] = views.for_save(value, tp_dim)
            del value  # under ZeRO a whole gathered tensor: one alive at a time, not three
    return tensors, {"adam_step": optimizer_step(base), "loss_scaler": _loss_scaler_state(engine)}


def load_layout_free_state(engine, read, plain: dict) -> None:
    """Restore what `layout_free_state` returned, on this rank's layout: `read(targets)` fills the empty
    tensors (this rank's TP shards) in place. Collective."""
    views, base = _shard_views(engine), base_optimizer(engine.optimizer)
    named = list(engine.named_full_parameters())
    device = engine.accelerator.device
    targets = {f"{key}/{name}": views.for_load(_local_shape(param), tp_dim, device)
               for name, param, tp_dim in named for key in ("model", *MOMENTS)}
    read(targets)
    step = float(plain["adam_step"])
    create_adam_state(base, engine.optimizer)
    set_optimizer_step(base, step)
    for name, param, _ in named:
        values = {key: _local(targets[f"{key}/{name}"]) for key in ("model", *MOMENTS)}
        _set_master_and_moments(param, base, values, step)
    _copy_zero3_masters_to_module(engine.optimizer)
    _load_loss_scaler_state(engine, plain.get("loss_scaler"))


def _shard_views(engine) -> "_ShardViews":
    if getattr(engine, "_views", None) is None:  # a device mesh creates process groups: once per run
        engine._views = _ShardViews(engine.layout, engine.accelerator.device)
    return engine._views


def _loss_scaler_state(engine) -> dict | None:
    scaler = getattr(engine.accelerator, "scaler", None)  # Accelerate's GradScaler (fp16 without DeepSpeed)
    if scaler is not None:
        return {"grad_scaler": scaler.state_dict()}
    ds_scaler = _deepspeed_loss_scaler(engine.optimizer)
    if ds_scaler is None:
        return None
    return {"deepspeed": {k: getattr(ds_scaler, k) for k in _DS_SCALER_FIELDS if hasattr(ds_scaler, k)}}


def _load_loss_scaler_state(engine, state: dict | None) -> None:
    if not state:
        return
    if "grad_scaler" in state and getattr(engine.accelerator, "scaler", None) is not None:
        engine.accelerator.scaler.load_state_dict(state["grad_scaler"])
    ds_scaler = _deepspeed_loss_scaler(engine.optimizer)
    for key, value in (state.get("deepspeed") or {}).items():
        if ds_scaler is not None:
            setattr(ds_scaler, key, value)



def base_optimizer(optimizer):
    """The torch optimizer holding Adam's state, through Accelerate's and DeepSpeed's wrappers."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def _deepspeed_loss_scaler(optimizer):
    while optimizer is not None and not hasattr(optimizer, "loss_scaler"):
        optimizer = getattr(optimizer, "optimizer", None)
    return getattr(optimizer, "loss_scaler", None)


def _copy_zero3_masters_to_module(optimizer) -> None:
    """ZeRO-3: its setters write the fp32 partitions only; the module's partitions follow them as DeepSpeed's own
    universal-checkpoint load does (stage3.py, load_hp_checkpoint_state_from_checkpoint_dir_stage3)."""
    while optimizer is not None and not hasattr(optimizer, "fp32_partitioned_groups_flat"):
        optimizer = getattr(optimizer, "optimizer", None)
    if optimizer is None:
        return
    for group, fp32 in enumerate(optimizer.fp32_partitioned_groups_flat):
        if fp32.numel() > 0:
            optimizer.fp16_partitioned_groups_flat[group].data.copy_(fp32.data)
        flat, params = optimizer.fp16_partitioned_groups_flat[group], optimizer.fp16_partitioned_groups[group]
        for param, value in zip(params, optimizer.unflatten(flat, params)):
            param.data = value.data


class _ShardViews:
    """How this rank's tensors map onto full ones: a DTensor over the stage's (tp, dp) mesh, tensor-parallel shard
    along the plan's dimension, then split over data-parallel ranks along dim 0 for saving (each chunk written by one
    rank, none holds the whole optimizer) and replicated over them for loading (ZeRO's setters take the whole shard).
    Without a process group (one process), plain tensors."""

    def __init__(self, layout: Layout, device):
        self.layout, self.mesh = layout, None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            from torch.distributed.device_mesh import DeviceMesh

            # the "dp" axis is every rank holding the same parameters: data × context parallel (ZeRO's group)
            ranks = torch.arange(layout.world_size).reshape(layout.pp, layout.dp_cp, layout.tp).permute(0, 2, 1)
            full = DeviceMesh(device.type, ranks, mesh_dim_names=("pp", "tp", "dp"))
            self.mesh = full["tp", "dp"]

    def full_shape(self, local_shape, tp_dim):
        shape = list(local_shape)
        if tp_dim is not None:
            shape[tp_dim] *= self.layout.tp
        return torch.Size(shape)

    def _placements(self, full_shape, tp_dim, split_dp: bool):
        from torch.distributed.tensor import Replicate, Shard

        tp = Shard(tp_dim) if tp_dim is not None else Replicate()
        local_rows = full_shape[0] // (self.layout.tp if tp_dim == 0 else 1) if len(full_shape) else 0
        replicas = self.layout.dp_cp
        dp_split = split_dp and replicas > 1 and local_rows >= replicas and local_rows % replicas == 0
        return [tp, Shard(0) if dp_split else Replicate()]

    def for_save(self, shard: torch.Tensor, tp_dim):
        """`shard` (this rank's whole TP shard) → this rank's chunk of the full tensor, to be written once."""
        if self.mesh is None:
            return shard
        from torch.distributed.tensor import DTensor

        full = self.full_shape(shard.shape, tp_dim)
        placements = self._placements(full, tp_dim, split_dp=True)
        from torch.distributed.tensor import Shard

        local = shard
        if isinstance(placements[1], Shard):
            # a copy: a view would keep the whole gathered shard alive until the save ends
            local = shard.chunk(self.layout.dp_cp, dim=0)[self.layout.dp_cp_rank].clone()
        return DTensor.from_local(local.contiguous(), self.mesh, placements, run_check=False, shape=full,
                                  stride=torch.empty(full, device="meta").stride())

    def for_load(self, local_shape, tp_dim, device):
        """An empty target holding this rank's whole TP shard (replicated over data-parallel ranks)."""
        local = torch.empty(local_shape, dtype=torch.float32, device=device)
        if self.mesh is None:
            return local
        from torch.distributed.tensor import DTensor

        full = self.full_shape(local_shape, tp_dim)
        return DTensor.from_local(local, self.mesh, self._placements(full, tp_dim, split_dp=False), run_check=False,
                                  shape=full, stride=torch.empty(full, device="meta").stride())


def _local(value):
    return value.to_local() if hasattr(value, "to_local") else value


def _zero_managed(param) -> bool:
    return hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")


def _local_shape(param):
    return param.ds_shape if hasattr(param, "ds_id") else param.shape  # ZeRO-3 leaves an empty placeholder


def _master_and_moments(param, base_optimizer):
    """(key, value) of the fp32 master value and Adam moments of this rank's TP shard of `param`, one at a time
    (under ZeRO each is gathered whole over the data-parallel group, a collective: the caller keeps only its chunk
    before the next is gathered, so a save holds one whole tensor at a time, not three)."""
    if _zero_managed(param):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        yield "model", safe_get_full_fp32_param(param).detach().float()
        for key in MOMENTS:
            yield key, safe_get_full_optimizer_state(param, key).detach().float()
        return
    state = base_optimizer.state.get(param, {})
    yield "model", param.detach().float()
    for key in MOMENTS:  # (not `state.get(key, zeros)`: that allocated two zero tensors per parameter every save)
        yield key, (state[key] if key in state else torch.zeros_like(param)).detach().float()


def _set_master_and_moments(param, base_optimizer, values: dict[str, torch.Tensor], step: float) -> None:
    if _zero_managed(param):
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        safe_set_full_fp32_param(param, values["model"].to(param.device))
        for key in MOMENTS:
            safe_set_full_optimizer_state(param, values[key].to(param.device), key)
        if not hasattr(param, "ds_id"):  # ZeRO-1/2: the module's weight is whole here; ZeRO-3's is copied per group
            param.data.copy_(values["model"].to(param.device, param.dtype))
        return
    with torch.no_grad():
        param.copy_(values["model"].to(param.device, param.dtype))
    state = base_optimizer.state[param]
    for key in MOMENTS:
        state[key] = values[key].to(param.device, param.dtype).clone()
    state["step"] = _step_tensor(state.get("step"), step, base_optimizer, param)


def _step_tensor(current, step: float, optimizer, param):
    """Adam's step in the form torch's AdamW keeps it (a float32 tensor, on the parameter's device when fused)."""
    if isinstance(current, torch.Tensor):
        return torch.full_like(current, step)
    fused = any(group.get("fused") or group.get("capturable") for group in optimizer.param_groups)
    return torch.tensor(step, dtype=torch.float32, device=param.device if fused else "cpu")


def optimizer_step(base_optimizer) -> float:
    """Adam's step count (every parameter updates at every step, so one number)."""
    steps = [float(state["step"]) for state in base_optimizer.state.values() if "step" in state]
    return max(steps, default=0.0)


def create_adam_state(base_optimizer, wrapper=None) -> None:
    """Adam's state as its first step would create it (torch's AdamW creates it lazily, and DeepSpeed's ZeRO-1/2
    links each parameter's fragment of it only then), so that the loaded moments have somewhere to go. ZeRO-3 hands
    its fp32 partitions to the optimizer only inside its step (and its start-up step leaves their state empty on
    CPU): they are filled too."""
    params = [param for group in base_optimizer.param_groups for param in group["params"]]
    for param in [*params, *_zero3_fp32_partitions(wrapper)]:
        if not base_optimizer.state.get(param):
                base_optimizer.state[param] = {"step": _step_tensor(None, 0.0, base_optimizer, param),
                                               **{key: torch.zeros_like(param) for key in MOMENTS}}
    _link_zero_fragments(wrapper)


def _zero3_fp32_partitions(optimizer) -> list:
    while optimizer is not None and not hasattr(optimizer, "fp32_partitioned_groups_flat"):
        optimizer = getattr(optimizer, "optimizer", None)
    return list(optimizer.fp32_partitioned_groups_flat) if optimizer is not None else []


def _link_zero_fragments(optimizer) -> None:
    """Point each ZeRO-1/2 parameter's fragment at Adam's current state. DeepSpeed links them once, after the first
    parameter group's first step, when the other groups' state is still empty: their moments stay unreachable by
    `safe_get_full_optimizer_state` (ValueError 'exp_avg not found') unless linked again."""
    while optimizer is not None and not hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer = getattr(optimizer, "optimizer", None)
    if optimizer is not None:
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def set_optimizer_step(base_optimizer, step: float) -> None:
    for state in base_optimizer.state.values():
        if "step" in state:
            state["step"] = torch.full_like(state["step"], step) if isinstance(state["step"], torch.Tensor) else step
    for group in base_optimizer.param_groups:  # DeepSpeed's FusedAdam keeps it per group
        if "step" in group:
            group["step"] = int(step)
