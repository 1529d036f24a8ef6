"""Expert parallelism: each MoE layer's experts split over the layout's expert group, tokens sent to their experts'
ranks by all-to-all.

The experts are transformers' own experts modules (`@use_experts_implementation` classes: Mixtral, Qwen3-MoE, OLMoE,
…), whose 3-D parameters (`gate_up_proj` / `up_proj`, `down_proj`, their biases) have the expert on dim 0. A rank
keeps the contiguous block of `num_experts / ep` experts of its expert-group rank (torchtitan's and transformers'
`Shard(0)`), and its experts module forwards through transformers' `AllToAllEP` (`distributed/expert_parallel.py`):
the (token, expert) pairs sorted by expert go to their owners by `all_to_all_single_autograd`, run there through the
experts' own kernel (`config._experts_implementation`: `grouped_mm` on CUDA and on CPU, a batched kernel, not a
Python loop per expert), come back by a second all-to-all and are weighted by the router on the sending rank, so the
router's gradient stays local. With `experts_over: tensor` (GPT-NeoX's layout) the expert group is the
tensor-parallel group, whose ranks hold one batch: `AllToAllEP` lets each dispatch a disjoint slice of it and gathers
the results back, so no token is computed twice.

Gap filled: transformers applies this only through `from_pretrained(distributed_config=...)`, with its own device mesh
(tp × fsdp × ep over the whole world), DTensor parameters and its own FSDP; neox_hf's engines (DeepSpeed ZeRO 0–2 over
our layout's groups, FSDP2 over our mesh) hold plain parameters and their own groups. So the split and the dispatch
are installed here, from outside the unmodified model, on the layout's groups, and the gradient arithmetic that
expert parallelism needs on each engine is stated once:

- an expert's gradient, after the backward all-to-all, already sums the tokens of the whole expert group; it is to be
  reduced only over the ranks that hold the same experts (`Layout.edp_group`), never the whole world, and divided by
  every data-parallel rank (DeepSpeed #5618: dividing by the expert-data-parallel size instead scales experts by ep);
- a dense parameter's gradient, with the experts over data-parallel ranks, is averaged over every data-parallel rank
  as before. DeepSpeed averages over the single group its mpu names, here the expert-data-parallel one, so
  `divide_gradients_for_deepspeed` first averages the dense gradients over the expert group and divides the experts'
  by ep (FSDP2 needs neither: its dense mesh is every data-parallel rank, its experts' divide factor is set).
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from neox_hf.errors import RecipeError
from neox_hf.parallel.mappings import gather_along_dim

# the experts' 3-D parameters as transformers names them (`integrations/moe.py`), under a module named `experts`
_EXPERT_PARAMETER = re.compile(r"(^|\.)experts\.(gate_up_proj|up_proj|down_proj)(_bias)?$")


def is_expert_parameter(name: str) -> bool:
    """Whether the state-dict key or parameter name `name` is an experts' tensor (expert on dim 0)."""
    return _EXPERT_PARAMETER.search(name) is not None


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every experts module of `model`: a module holding expert tensors and `num_experts`."""
    found = []
    for name, module in model.named_modules():
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if hasattr(module, "num_experts") and any(is_expert_parameter(f"{name}.{n}") for n in own):
            found.append((name, module))
    return found


def apply_expert_parallel(model: nn.Module, layout) -> nn.Module:
    """`model` with every experts module holding only this rank's block of experts and dispatching its tokens to the
    expert group by all-to-all (in place; a no-op when `layout.ep == 1`)."""
    if layout.ep == 1:
        return model
    experts = expert_modules(model)
    if not experts:
        raise RecipeError(f"`parallel.expert_parallel: {layout.ep}` needs a model with experts (a Mixture-of-Experts "
                          f"family such as mixtral); {type(model).__name__} has none: set expert_parallel: 1")
    ep_mesh, tp_mesh = _meshes(layout)
    _batched_kernel(model)
    for name, module in experts:
        _keep_block(name, module, layout)
        _install_dispatch(module, ep_mesh, tp_mesh)
    return model


def _batched_kernel(model: nn.Module) -> None:
    """transformers' `grouped_mm` experts kernel where the config leaves the default (`eager`: a Python loop over the
    experts): one grouped GEMM per projection on CUDA (`torch._grouped_mm`) and on CPU (torch ≥ 2.10; 4× eager on a
    tiny Mixtral here, where `batched_mm`, which gathers a weight matrix per token, is 25× slower). Same values."""
    config = getattr(model, "config", None)
    grouped = hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")
    if grouped and config is not None and getattr(config, "_experts_implementation", None) in (None, "eager"):
        config._experts_implementation = "grouped_mm"


def _keep_block(name: str, module: nn.Module, layout) -> None:
    total = module.num_experts
    if total % layout.ep:
        raise RecipeError(f"{name} has {total} experts, which `parallel.expert_parallel: {layout.ep}` cannot split "
                          f"evenly; choose an expert_parallel that divides {total}")
    for key, param in list(module.named_parameters(recurse=False)):
        if not is_expert_parameter(f"{name}.{key}"):
            continue
        block = nn.Parameter(param.detach().chunk(layout.ep, dim=0)[layout.ep_rank].clone(),
                             requires_grad=param.requires_grad)
        block.expert_parallel = True
        if layout.experts_over == "tensor":
            # split over the TP group as Megatron's TP layers are: DeepSpeed's clipping sums these over the TP group
            block.tensor_model_parallel, block.partition_dim = True, 0
        else:
            # DeepSpeed's clipping sums `model_parallel` parameters over its mpu's model-parallel group, here the
            # expert group (`neox_hf.parallel.tp_groups.DeepSpeedMPU`), and counts the others once
            block.model_parallel = True
        setattr(module, key, block)
    module.num_experts = total // layout.ep


def _install_dispatch(module: nn.Module, ep_mesh, tp_mesh) -> None:
    from transformers.distributed.expert_parallel import AllToAllEP

    dispatch = AllToAllEP(module, ep_mesh, tp_mesh)  # keeps the experts' own forward, on local expert ids

    def forward(hidden_states, top_k_index, top_k_weights):
        return dispatch(hidden_states, top_k_index, top_k_weights).to(hidden_states.dtype)

    module.forward = forward


def _meshes(layout):
    """(expert-group mesh, mesh of the ranks holding the same batch) as transformers' dispatch takes them."""
    from torch.distributed.device_mesh import DeviceMesh

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ep_mesh = DeviceMesh.from_group(layout.ep_group, device, mesh_dim_names=("ep",))
    if layout.experts_over == "tensor":
        return ep_mesh, ep_mesh
    # with TP (FSDP2 only), each rank of a TP group dispatches a disjoint slice of the batch they share over its own
    # expert group (the ranks of its TP rank): an expert's replicas on the TP ranks see different tokens
    group = layout.tp_group if layout.tp > 1 else layout.tp_self_group
    return ep_mesh, DeviceMesh.from_group(group, device, mesh_dim_names=("tp",))


def divide_gradients_for_deepspeed(model: nn.Module, layout) -> None:
    """Hooks that make DeepSpeed's average over the expert-data-parallel group (its mpu's data-parallel group under
    expert parallelism over data) the average over every data-parallel rank: each dense gradient averaged over the
    expert group first (its ranks read different tokens), each expert gradient divided by ep (its all-to-all backward
    already summed the expert group's tokens). Tensor hooks run before the gradient is accumulated, so before
    DeepSpeed's own reduction hooks; they run per micro-batch, which is linear, so accumulation is unchanged."""
    if not layout.experts_over_data:
        return
    group, ep = layout.ep_group, layout.ep

    def expert(grad):
        return grad / ep

    def dense(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad / ep

    for param in model.parameters():
        if param.requires_grad:
            param.register_hook(expert if getattr(param, "expert_parallel", False) else dense)


def gather_experts(state_dict: dict, layout) -> dict:
    """`state_dict` with every expert tensor whole (this rank's block gathered over the expert group along dim 0,
    into CPU memory). Collective over the expert group: every rank calls it with the same keys."""
    if layout.ep == 1:
        return state_dict
    gathered = dict(state_dict)
    for key, tensor in state_dict.items():
        if is_expert_parameter(key):
            local = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            gathered[key] = gather_along_dim(local.detach(), 0, layout.ep_group).cpu()
    return gathered


def expert_squares_over_group(squares: torch.Tensor, layout) -> torch.Tensor:
    """The squared gradient norm of this rank's experts summed over the expert group (each rank holds different
    experts), for an engine that clips itself."""
    if layout.ep > 1:
        squares = squares.clone()
        dist.all_reduce(squares, group=layout.ep_group)
    return squares


def describe_experts(model: nn.Module, layout) -> str:
    """One start-up line: experts per layer and per rank, the dispatch and the kernel."""
    experts = expert_modules(model)
    if not experts or layout.ep == 1:
        return ""
    module = experts[0][1]
    local = module.num_experts
    kernel = getattr(getattr(module, "config", None), "_experts_implementation", None) or "eager"
    over = ("the tensor-parallel group (GPT-NeoX's layout)" if layout.experts_over == "tensor"
            else f"{layout.ep} data-parallel ranks")
    return (f"expert parallel {layout.ep}: {local * layout.ep} experts per MoE layer split over {over}, {local} per "
            f"rank; tokens to their experts by all-to-all (transformers' AllToAllEP), experts kernel {kernel}")
