"""What every mixture-of-experts family shares: the router's records of a training forward, the load-balancing loss
taken from them, the step's routing statistics, GPT-NeoX's initialisation of 3-D expert weights, and the experts
kernel chosen per device.

The router loss, and why per micro-batch: transformers' `load_balancing_loss_func` multiplies each expert's share
of the top-k assignments (not differentiable) by its mean router probability. Both factors are over a set of tokens,
and the first must be known before the backward of any of them; with gradient accumulation a micro-batch's backward
runs before the next micro-batch's forward, so no layout can take the shares over the whole step. We therefore take
the loss exactly as transformers does, over one micro-batch (all MoE layers pooled, padding masked), and weigh each
micro-batch's loss by its labelled tokens, as its LM loss is weighed (`neox_hf.ops.weighting`): the step's router
loss is the token-weighted mean of its micro-batches' losses, the same number on every layout that keeps the
micro-batches (data-parallel ranks, accumulation steps, expert or tensor parallelism).

Gap filled: transformers computes the router loss only inside `MixtralForCausalLM.forward` from its logits; our
objectives run the decoder and the fused head loss themselves (`neox_hf.ops.loss`), so the routers' outputs are
recorded by forward hooks here.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import initialization as init

from neox_hf.model.init import init_std

# The attribute of a CausalLM holding its RouterRecords (set by `attach_router_records`).
RECORDS = "_neox_router_records"


class RouterRecords:
    """Router outputs (logits [tokens, experts], selected experts [tokens, k]) of the trunk's latest training
    forward, one per MoE layer in order; and the step's routing sums, accumulated until `step_sums` takes them."""

    def __init__(self, num_experts: int, top_k: int):
        self.num_experts, self.top_k = num_experts, top_k
        self.logits: list[torch.Tensor] = []
        self.selected: list[torch.Tensor] = []
        self.sums: torch.Tensor | None = None  # [aux × units, units, tokens, entropy sum, layers × experts counts]

    def clear(self) -> None:
        self.logits, self.selected = [], []


def attach_router_records(model: nn.Module, routers, trunk: nn.Module, *, num_experts: int, top_k: int) -> None:
    """Record every router of `routers` (modules returning (logits, weights, selected experts)) in training forwards
    outside backward (activation checkpointing recomputes the forward inside it); each trunk forward starts afresh."""
    records = RouterRecords(num_experts, top_k)
    # Held by the model, its trunk and each router (not submodules, not in the state dict), and read by the hooks
    # from the module they fire on: a deep copy (DPO's frozen reference) records into its own copy, not ours.
    for module in (model, trunk, *routers):
        object.__setattr__(module, RECORDS, records)
    for router in routers:
        router.register_forward_hook(_record)
    trunk.register_forward_pre_hook(_start, with_kwargs=True)


def _record(module, args, output) -> None:
    if module.training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
        records = getattr(module, RECORDS)
        records.logits.append(output[0])
        records.selected.append(output[2])


def _start(module, args, kwargs) -> None:
    if torch._C._current_graph_task_id() == -1:
        getattr(module, RECORDS).clear()


def router_records(model) -> RouterRecords | None:
    return getattr(model, RECORDS, None)


def router_aux_coefficient(config) -> float:
    """The router loss weight the model trains with: transformers' rule (`router_aux_loss_coef` where
    `output_router_logits` is set, else none)."""
    return float(config.router_aux_loss_coef) if getattr(config, "output_router_logits", False) else 0.0


def micro_batch_router_loss(model, batch: dict, units: torch.Tensor) -> torch.Tensor | None:
    """`coef × load_balancing_loss_func(this micro-batch's router logits) × units` (None for a dense model or outside
    training), to add to the objective's loss sum so that the router loss weighs as the LM loss does; the step's
    routing statistics are accumulated on the side (`step_sums`)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    records = router_records(model)
    if records is None or not records.logits:
        return None
    mask = batch.get("attention_mask")
    aux = load_balancing_loss_func(tuple(records.logits), records.num_experts, records.top_k, mask)
    _accumulate(records, aux.detach(), units.detach(), mask)
    records.clear()
    coef = router_aux_coefficient(model.config)
    return aux * coef * units if coef else None


def _accumulate(records: RouterRecords, aux: torch.Tensor, units: torch.Tensor, mask) -> None:
    """Add this micro-batch's routing sums (no gradient) to the step's."""
    with torch.no_grad():
        keep = None if mask is None else mask.reshape(-1).to(torch.float32)
        counts, entropy = [], torch.zeros((), dtype=torch.float64, device=aux.device)
        for logits, selected in zip(records.logits, records.selected):
            one_hot = torch.nn.functional.one_hot(selected.long(), records.num_experts).sum(1).to(torch.float32)
            probs = torch.softmax(logits.float(), dim=-1)
            token_entropy = -(probs * torch.log(probs.clamp(min=1e-30))).sum(-1)
            if keep is not None:
                one_hot, token_entropy = one_hot * keep[:, None], token_entropy * keep
            counts.append(one_hot.sum(0))
            entropy += token_entropy.sum().double() / len(records.logits)
        tokens = records.logits[0].shape[0] if keep is None else keep.sum()
        head = torch.stack([aux.double() * units.double(), units.double(),
                            torch.as_tensor(tokens, dtype=torch.float64, device=aux.device), entropy])
        sums = torch.cat([head, torch.cat(counts).double()])
        records.sums = sums if records.sums is None else records.sums + sums


def step_sums(model) -> torch.Tensor | None:
    """The step's routing sums on this rank (to be summed over data-parallel ranks), reset for the next step."""
    records = router_records(model)
    if records is None or records.sums is None:
        return None
    sums, records.sums = records.sums, None
    return sums


def routing_metrics(sums: torch.Tensor, *, num_experts: int, top_k: int) -> dict[str, torch.Tensor]:
    """The logged routing metrics from the step's sums over every rank: the router loss (token-weighted mean of the
    micro-batches' `load_balancing_loss_func`), the busiest and idlest expert's share of the top-k assignments (the
    worst layer's; 1 / experts when balanced; dropless, so each layer's assignments are tokens × k), the mean router
    entropy (nats; log(experts) when uniform) and the assignments per token (top-k: nothing dropped)."""
    aux_sum, units, tokens, entropy = sums[:4]
    counts = sums[4:].reshape(-1, num_experts)
    shares = counts / counts.sum(-1, keepdim=True).clamp(min=1)
    return {"moe_aux_loss": aux_sum / units.clamp(min=1), "moe_expert_share_max": shares.max(),
            "moe_expert_share_min": shares.min(), "moe_router_entropy": entropy / tokens.clamp(min=1),
            "moe_assignments_per_token": counts.sum() / (counts.shape[0] * tokens.clamp(min=1))}


MOE_METRICS = ("moe_aux_loss", "moe_expert_share_max", "moe_expert_share_min", "moe_router_entropy",
               "moe_assignments_per_token")


def init_experts_(module: nn.Module, config, *, up: str, down: str) -> None:
    """GPT-NeoX's per-role init on 3-D expert weights: `up` (the input projection, GPT-NeoX's w1) with `init_method`,
    `down` (the output projection, w2) with `output_layer_init_method`, as the dense MLP's linears."""
    for name, method in ((up, config.init_method), (down, config.output_layer_init_method)):
        std = init_std(method, hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
                       sigma=config.initializer_range)
        init.normal_(getattr(module, name), mean=0.0, std=std)


def init_router_(weight: torch.Tensor, config) -> None:
    """The router's [experts, hidden] weight with `init_method`, as GPT-NeoX's routers are initialised (through
    transformers' `initialization`, which leaves weights a checkpoint loaded alone)."""
    std = init_std(config.init_method, hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
                   sigma=config.initializer_range)
    init.normal_(weight, mean=0.0, std=std)


class ExpertsKernels:
    """Mixin for our subclasses of transformers' MoE models: they run transformers' experts kernels (`grouped_mm`
    by default where torch has it, on CUDA and CPU; `batched_mm`, `eager`).
    Gap filled: transformers decides whether a class may use them by searching the source of the class's own module
    for `@use_experts_implementation`; a subclass defined elsewhere silently falls back to `eager`, a Python loop
    over the experts (3 × slower than `grouped_mm` for a tiny Mixtral on a CPU here, and far slower on a GPU)."""

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        return True
