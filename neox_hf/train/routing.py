"""The step's routing metrics of a mixture of experts (router loss, busiest / idlest expert's share, router entropy,
assignments per token), summed over the data- and context-parallel ranks once per step and logged with the
objective's metrics (`train_log.jsonl`, the trackers). The sums are kept by the model's router records
(`neox_hf.model.moe`); nothing here reads a value on the host."""

from __future__ import annotations

from neox_hf.model.moe import MOE_METRICS, router_aux_coefficient, router_records, routing_metrics, step_sums
from neox_hf.ops.loss import causal_lm_module
from neox_hf.parallel.layout import StepResult, shard_sum

__all__ = ["MOE_METRICS", "moe_startup_lines", "with_routing_metrics"]


def with_routing_metrics(run, result: StepResult) -> StepResult:
    """`result` with the step's routing metrics added to its metrics (a dense model's result as it is). Collective
    over the data-parallel group when the model has routers (every rank has them)."""
    model = causal_lm_module(run.accelerator.unwrap_model(run.model))
    records = router_records(model)
    if records is None:
        return result
    sums = step_sums(model)
    if sums is None:  # no micro-batch went through the LM objective's router loss (another objective)
        return result
    result.metrics.update(routing_metrics(shard_sum(run.layout, sums), num_experts=records.num_experts,
                                          top_k=records.top_k))
    return result


def moe_startup_lines(run) -> list[str]:
    """The start-up report's lines on a mixture of experts: experts, routing, kernel, router loss; and, where the
    saved folder needs remote code, the one line that says so."""
    model = causal_lm_module(run.accelerator.unwrap_model(run.model))
    records = router_records(model)
    if records is None:
        return []
    config = model.config
    coef = router_aux_coefficient(config)
    loss = (f"router loss {coef} × load_balancing_loss_func per micro-batch, weighed by its tokens" if coef
            else "no router loss")
    lines = [f"moe: {records.num_experts} experts, top-{records.top_k}, dropless; experts kernel "
             f"{config._experts_implementation}; {loss}"]
    note = getattr(model, "startup_note", None)
    return lines + ([note] if note else [])
