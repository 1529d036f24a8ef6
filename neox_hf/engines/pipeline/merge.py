"""Merged weights: stages × TP shards → one stock GPTNeoX state dict on global rank 0's CPU, and the HF folder."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from neox_hf.model.folder import model_holding, save_hf_folder
from neox_hf.parallel.layout import Layout, global_rank
from neox_hf.parallel.mappings import gather_along_dim
from neox_hf.engines.pipeline.stages import _PipeLayer
from neox_hf.parallel.tp_plan import partition_dim


def stage_hf_state_dict(module, layout: Layout) -> dict[str, torch.Tensor]:
    """This stage's tensors, TP shards merged, keyed as a stock GPTNeoXForCausalLM (collective over the TP group).
    The tied embedding counts once, on the first stage."""
    local = {}
    for layer in module.forward_funcs:  # the last stage's tied head is a partial, not a layer: skipped
        if isinstance(layer, _PipeLayer):
            local.update(layer.hf_state_dict())
    merged = {}
    for key in sorted(local):
        dim = partition_dim(key)
        tensor = local[key].detach()
        merged[key] = (tensor.clone() if dim is None else gather_along_dim(tensor.contiguous(), dim, layout.tp_group)).cpu()
    return merged

def gather_pipeline_state_dict(engine_or_module, layout: Layout) -> dict[str, torch.Tensor] | None:
    """The full stock state dict in global rank 0's CPU memory (None elsewhere). Collective over every rank; only the
    ranks of data-parallel index 0 contribute, each stage's tensor-parallel rank 0 sends its merged stage.

    Tensor by tensor, not `gather_object`: over NCCL that stages every stage's pickled bytes on rank 0's GPU at once
    (about 50 GB extra for a 20B model at the end of a run). Here each tensor crosses the device once, alone, and
    lands in CPU memory."""
    module = getattr(engine_or_module, "module", engine_or_module)
    stage = stage_hf_state_dict(module, layout) if layout.dp_rank == 0 else None
    if layout.dp_rank != 0 or layout.tp_rank != 0:
        return None
    full = _gather_stages_to_rank0(stage, layout)
    if full is not None and module.config.tie_word_embeddings:
        from neox_hf.model.spec import spec_for_config

        full["lm_head.weight"] = full[f"{spec_for_config(module.config).embedding}.weight"]
    return full

def _gather_stages_to_rank0(stage: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor] | None:
    """Every stage's tensors on global rank 0 (CPU), over the pipeline group of data-parallel and TP index 0: the
    (small) key, shape and dtype lists first, then one send/recv per tensor through the group's device."""
    shapes = [(key, tuple(t.shape), t.dtype) for key, t in stage.items()]
    listed = [None] * layout.pp if dist.get_rank() == 0 else None
    dist.gather_object(shapes, listed, dst=0, group=layout.pp_group)
    device = _communication_device(layout.pp_group)
    if dist.get_rank() != 0:
        for key, _, _ in shapes:
            dist.send(stage[key].to(device), dst=0, group=layout.pp_group)
        return None
    full = dict(stage)
    for pp_rank in range(1, layout.pp):
        sender = global_rank(pp_rank, 0, 0, dp=layout.dp, tp=layout.tp)
        for key, shape, dtype in listed[pp_rank]:
            buffer = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buffer, src=sender, group=layout.pp_group)
            full[key] = buffer.cpu()
    return full

def _communication_device(group) -> torch.device:
    """Where tensors must be for collectives of `group`: the current GPU for NCCL, the CPU for gloo."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

def save_pipeline_hf_folder(engine, layout: Layout, config, out_dir, *, tokenizer=None,
                            extra_files: dict[str, str] | None = None, max_shard_size: str = "5GB") -> Path:
    """The merged, stock-loadable HF folder, written atomically by global rank 0. Collective."""
    full = gather_pipeline_state_dict(engine, layout)
    out = Path(out_dir)
    if full is not None:
        save_hf_folder(model_holding(full, config), out, tokenizer=tokenizer, extra_files=extra_files,
                       max_shard_size=max_shard_size)
    dist.barrier()
    return out
