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
    named = list(engine.named_full_parameters())
    fragmented = [(name, param, tp_dim) for name, param, tp_dim in named if _in_flat_partitions(param, tp_dim)]
    tensors = _fragment_rows(engine.optimizer, fragmented, views)
    for name, param, tp_dim in named:
        if any(param is other for _, other, _ in fragmented):
            continue
        for key, value in _master_and_moments(param, base):
            tensors[f"{key}/{name}"] = views.for_save(value, tp_dim)
            del value  # under ZeRO-3 a whole gathered tensor: one alive at a time, not three
    return tensors, {"adam_step": optimizer_step(base), "loss_scaler": _loss_scaler_state(engine)}


def load_layout_free_state(engine, read, plain: dict) -> None:
    """Restore what `layout_free_state` returned, on this rank's layout: `read(targets)` fills the empty
    tensors (this rank's TP shards) in place. Collective."""
    views, base = _shard_views(engine), base_optimizer(engine.optimizer)
    named = list(engine.named_full_parameters())
    device = engine.accelerator.device
    create_adam_state(base, engine.optimizer)  # first: it links the ZeRO-1/2 fragments the targets are read for
    ranged = {id(param) for name, param, tp_dim in named if _holds_a_range(param, tp_dim)}
    flat = {id(param) for name, param, tp_dim in named if _in_flat_partitions(param, tp_dim)}  # ZeRO-1/2's
    whole = bool(flat) and reads_whole_weights(device)
    targets = {f"{key}/{name}": (_fragment_target(param, key, tp_dim, views, device, whole=whole and id(param) in flat)
                                 if id(param) in ranged else views.for_load(_local_shape(param), tp_dim, device))
               for name, param, tp_dim in named for key in ("model", *MOMENTS)}
    read(targets)
    step = float(plain["adam_step"])
    set_optimizer_step(base, step)
    for name, param, _ in named:
        values = {key: targets[f"{key}/{name}"] for key in ("model", *MOMENTS)}
        if id(param) in ranged:
            for chunk in values.values():  # those the reader did not fill as it read (none of its rows, or another
                chunk.fill_done()  # reader: one process's accelerate files)
        else:
            _set_master_and_moments(param, base, {key: _local(value) for key, value in values.items()}, step)
    if flat and not whole:  # the module's weights from the masters: each rank's range, all-gathered
        _flat_partitions_optimizer(engine.optimizer).update_lp_params()
    _copy_zero3_masters_to_module(engine.optimizer)
    _load_loss_scaler_state(engine, plain.get("loss_scaler"))


# -- ZeRO-1/2: each rank reads and writes the rows of its own flat partition (ZeRO-3: reads those of its partition) --
#
# ZeRO-1/2 flatten a parameter group and give each data-parallel rank one contiguous range of it: of a parameter, a
# rank holds elements [start, end) of its flattened TP shard (`param._hp_mapping`), not a box DCP can store. Saving,
# a rank owns the rows whose first element it holds, and completes the last of them with the elements its next ranks
# hold (a few rows' worth, exchanged once for all parameters): every rank writes a box of whole rows, nothing is
# gathered whole. Loading, a rank reads the rows its range overlaps and keeps its range. (DeepSpeed's universal
# checkpoint instead gathers each parameter's fragments offline, `ds_to_universal.py`.)


def _flat_partitions_optimizer(optimizer):
    while optimizer is not None and not hasattr(optimizer, "update_lp_params"):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


def _in_flat_partitions(param, tp_dim) -> bool:
    """A ZeRO-1/2 parameter of a dense (not expert-block) tensor: its state lies in the flat partitions."""
    return hasattr(param, "_hp_mapping") and not hasattr(param, "ds_id") and (tp_dim is None or isinstance(tp_dim, int))


def _holds_a_range(param, tp_dim) -> bool:
    """A dense parameter whose fp32 master and moments this rank holds as one range of its flattened TP shard:
    ZeRO-1/2's flat partitions, or ZeRO-3's partition of the parameter itself."""
    dense = tp_dim is None or isinstance(tp_dim, int)
    return dense and (_in_flat_partitions(param, tp_dim) or (hasattr(param, "ds_id") and hasattr(param, "ds_tensor")))


def _fragment_range(param) -> tuple[int, int]:
    """[start, end) of this rank's elements of `param` (its flattened TP shard); empty where it holds none. ZeRO-3
    gives rank r of the parameter's group elements [r × n, (r + 1) × n) of it, n its partition's padded size (the
    padding beyond the parameter's end holds nothing)."""
    if hasattr(param, "ds_id"):
        import torch.distributed as dist

        size = param.ds_tensor.numel()  # the partition's size, as DeepSpeed's setters of it check
        start = min(size * dist.get_rank(group=param.ds_process_group), param.ds_numel)
        return start, min(start + size, param.ds_numel)
    mapping = param._hp_mapping
    if mapping is None:
        return 0, 0
    start = mapping.lp_fragment_address.start
    return start, start + mapping.lp_fragment_address.numel


def _fragment(param, key: str):
    mapping = param._hp_mapping
    return mapping.hp_fragment if key == "model" else mapping.get_optim_state_fragment(key)


def _row_length(shape) -> int:
    length = 1
    for size in shape[1:]:
        length *= size
    return length


def _box_offsets(views, local_shape, tp_dim, first_row: int) -> list[int]:
    """Where row `first_row` of this rank's TP shard lies in the full tensor."""
    offsets = [0] * len(local_shape)
    if tp_dim is not None:
        offsets[tp_dim] = views.layout.tp_rank * local_shape[tp_dim]
    offsets[0] += first_row
    return offsets


def _fragment_rows(optimizer, fragmented, views) -> dict:
    """`Chunk`s of the rows each rank owns of every ZeRO-1/2 parameter's master value and moments (see above).
    Collective over each data-parallel group (two all-gathers of a few rows per parameter)."""
    from neox_hf.checkpoint.layout_free import Chunk

    if not fragmented:
        return {}
    zero = _flat_partitions_optimizer(optimizer)
    heads, plan = [], []
    for name, param, tp_dim in fragmented:
        start, end = _fragment_range(param)
        row = _row_length(param.shape)
        first_row, end_row = -(-start // row), -(-end // row)  # rows whose first element is in [start, end)
        head_end = min(first_row * row, end)  # elements before them belong to an earlier rank's last row
        for key in ("model", *MOMENTS):
            fragment = _fragment(param, key) if end > start else None
            heads.append(fragment[:head_end - start] if fragment is not None else torch.zeros(0))
            plan.append((f"{key}/{name}", param, tp_dim, fragment, start, end, row, first_row, end_row))
    tails = _tails_from_next_ranks(zero, fragmented, heads, [p[6] * p[8] - p[5] if p[8] > p[7] else 0 for p in plan])
    chunks = {}
    for (fqn, param, tp_dim, fragment, start, end, row, first_row, end_row), tail in zip(plan, tails):
        if end_row <= first_row:
            continue
        chunks[fqn] = Chunk.joined([fragment[first_row * row - start:].float(), tail.to(fragment.device)],
                                   (end_row - first_row, *param.shape[1:]),
                                   _box_offsets(views, list(param.shape), tp_dim, first_row),
                                   views.full_shape(param.shape, tp_dim))
    return chunks


def _tails_from_next_ranks(zero, fragmented, heads: list, needs: list[int]) -> list:
    """For each item, the `needs[i]` elements that follow this rank's range: the heads of the next ranks' ranges, in
    rank order. One all-gather of the heads' lengths and one of the heads, over the data-parallel group ZeRO
    partitions over (every parameter here shares it: experts, which do not, keep the whole-tensor path)."""
    import torch.distributed as dist

    group = zero.real_dp_process_group[0]
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size == 1:
        return [torch.zeros(0) for _ in needs]
    lengths = torch.tensor([len(h) for h in heads], dtype=torch.int64)
    every_length = [torch.empty_like(lengths) for _ in range(size)]
    dist.all_gather(every_length, lengths, group=group)
    longest = max(int(length.sum()) for length in every_length)
    flat = torch.zeros(longest, dtype=torch.float32)
    if heads:
        joined = torch.cat([h.float().reshape(-1) for h in heads])
        flat[:len(joined)] = joined
    every_flat = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(every_flat, flat, group=group)
    starts = [torch.cumsum(length, 0) - length for length in every_length]
    tails = []
    for item, need in enumerate(needs):
        pieces, taken = [], 0
        for other in range(rank + 1, size):
            if taken >= need:
                break
            at, length = int(starts[other][item]), int(every_length[other][item])
            piece = every_flat[other][at:at + min(length, need - taken)]
            pieces.append(piece)
            taken += len(piece)
        tails.append(torch.cat(pieces) if pieces else torch.zeros(0))
    return tails


def reads_whole_weights(device) -> bool:
    """Whether a ZeRO-1/2 rank reads each module weight whole from the checkpoint (its master range and moments
    still only its own rows) instead of all-gathering the weights from every rank's masters after the read, as
    DeepSpeed does after each step (`update_lp_params`).

    On CPU the ranks of a host share one page cache, so the disk reads each byte once for all of them, and gloo's
    all-gather is a copy through the loopback socket, slower than that read (0.28 GB of weights: 0.64 s gathered on
    2 cores, against 0.85 GB of checkpoint read in 0.6 s). On GPUs NCCL's all-gather is faster than any disk, and
    each rank reading the weights whole would multiply the reads by the ranks of a node: they gather."""
    return device.type == "cpu"


def _fragment_target(param, key: str, tp_dim, views, device, *, whole: bool = False):
    """A `Chunk` of the rows of `param`'s TP shard that this rank's range overlaps (zero rows where it holds none):
    all a ZeRO-1/2 rank reads of `param`'s moments, and of its master value unless `whole`; the range itself read
    straight into the optimizer's fragment where the reads allow (`Chunk.into_flat`), else into the rows and copied
    out. With `whole`, the master value's target is the whole TP shard, the module's weight itself where it is an
    fp32 tensor on the host (read in place, nothing to copy after)."""
    from neox_hf.checkpoint.layout_free import Chunk

    start, end = _fragment_range(param)
    shape = list(_local_shape(param))
    row = _row_length(shape)
    if whole and key == "model":
        in_place = param.dtype == torch.float32 and param.device.type == "cpu" and param.data.is_contiguous()
        local = param.data if in_place else torch.empty(param.shape, dtype=torch.float32, device=device)
        chunk = Chunk(local, _box_offsets(views, shape, tp_dim, 0), views.full_shape(shape, tp_dim))
    else:
        first_row, end_row = (start // row, -(-end // row)) if end > start else (0, 0)
        box, offsets = (end_row - first_row, *shape[1:]), _box_offsets(views, shape, tp_dim, first_row)
        if end > start and not hasattr(param, "ds_id"):  # ZeRO-1/2: the range read straight into its fragment
            chunk = Chunk.into_flat(_fragment(param, key), start - first_row * row, box, offsets,
                                    views.full_shape(shape, tp_dim))
        else:
            local = torch.empty(box, dtype=torch.float32, device=device)
            chunk = Chunk(local, offsets, views.full_shape(shape, tp_dim))
    # copied into the fragment as soon as the reader has filled it, beside the kernel's readahead of what follows
    chunk.filled = lambda: _set_fragment(param, key, chunk, whole=whole)
    return chunk


def _set_fragment(param, key: str, chunk, *, whole: bool = False) -> None:
    """This rank's range of `param`'s `key` (master value or a moment) from the rows `_fragment_target` read into
    `chunk`; with `whole`, the module's weight too, from the whole TP shard read (unless it was read in place)."""
    start, end = _fragment_range(param)
    row = _row_length(_local_shape(param))
    first_row = 0 if whole and key == "model" else start // row
    skip = start - first_row * row
    with torch.no_grad():
        if whole and key == "model" and chunk.local.data_ptr() != param.data.data_ptr():
            param.data.copy_(chunk.local)
        if hasattr(param, "ds_id"):
            _set_zero3_partition(param, key, chunk.local.reshape(-1)[skip:skip + end - start])
        elif end > start and not chunk.direct:  # a direct chunk's reads went into the fragment itself
            _fragment(param, key).copy_(chunk.local.reshape(-1)[skip:skip + end - start])


def _set_zero3_partition(param, key: str, value) -> None:
    """ZeRO-3: this rank's partition of the master value or a moment, padded with zeros to the partition's size as
    DeepSpeed pads it, through DeepSpeed's setters of the local partition."""
    from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

    size = param.ds_tensor.numel()
    if value.numel() < size:  # the last rank's partition reaches past the parameter's end
        value = torch.cat([value, value.new_zeros(size - value.numel())])
    if key == "model":
        safe_set_local_fp32_param(param, value)
    else:
        safe_set_local_optimizer_state(param, value, key)


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
