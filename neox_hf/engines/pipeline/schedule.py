"""Running DeepSpeed's 1F1B schedule for one optimizer step or one evaluation: the pipeline engine's step.

Token weighting: N = labelled tokens of the whole step over all micro-batches and data-parallel ranks, counted on
the last stage before the first backward; each micro-batch's loss is weighted by `neox_hf.ops.weighting` exactly
as the plain engine weighs it, and DeepSpeed divides by gas and averages over data-parallel ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from neox_hf.errors import RecipeError
from neox_hf.parallel.layout import Layout, StepResult, deepspeed_grad_norm, dp_sum, global_rank
from neox_hf.engines.pipeline.loss import IGNORE_INDEX
from neox_hf.engines.pipeline.stages import NO_PADDING_MASK_SHAPE


def pipe_micro_batch(batch: dict) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """A loader batch as DeepSpeed's pipeline reads it: ((input_ids, position_ids, attention_mask), labels)."""
    input_ids = batch["input_ids"]
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0)  # what GPTNeoXModel.forward builds
    attention_mask = batch.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.zeros(NO_PADDING_MASK_SHAPE, dtype=torch.long)
    return (input_ids, position_ids, attention_mask), batch["labels"]

def _token_and_sample_counts(micro_batches, device) -> torch.Tensor:
    """[labelled tokens, samples] of the step's micro-batches, float64 on `device`, counted there: reading each
    micro-batch's count on the host would make it wait for the device once per micro-batch."""
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for mb in micro_batches:
        counts[0] += (mb["labels"].to(device, non_blocking=True) != IGNORE_INDEX).sum()
    counts[1] = float(sum(mb["input_ids"].shape[0] for mb in micro_batches))  # shapes are host values
    return counts

def _last_stage_rank(layout: Layout) -> int:
    return global_rank(layout.pp - 1, layout.dp_rank, layout.tp_rank, dp=layout.dp, tp=layout.tp)

def _from_last_stage(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    dist.broadcast(tensor, src=_last_stage_rank(layout), group=layout.pp_group)
    return tensor

def pipeline_train_step(engine, micro_batches: list[dict] | None, layout: Layout, recipe=None) -> StepResult:
    """One optimizer step of the PipelineEngine over `micro_batches` (gas of them; read on the first and last stage
    only, others may pass None). Collective over every rank. The loss is token-weighted over all micro-batches and
    data-parallel ranks (`train.loss_normalization: token`) or GPT-NeoX's mean of micro-batch means."""
    loss_fn = engine.module.loss_fn
    gas = engine.gradient_accumulation_steps()
    holds_data = layout.is_first_stage or layout.is_last_stage
    if holds_data and len(micro_batches or ()) != gas:
        raise RecipeError(f"the pipeline step needs {gas} micro-batches (train.gradient_accumulation_steps), "
                          f"got {len(micro_batches or ())}")
    counts = _token_and_sample_counts(micro_batches or [], engine.device)
    if layout.is_last_stage:
        counts = dp_sum(layout, counts)  # N before any backward: every micro-batch weighs by it
        loss_fn.step_units, loss_fn.gas, loss_fn.dp = counts[0], gas, layout.dp  # device tensor: no host wait
        loss_fn.records = []
    data = iter([pipe_micro_batch(mb) for mb in micro_batches]) if holds_data else None
    loss = engine.train_batch(data)
    counts = _from_last_stage(counts, layout)
    return StepResult(loss=loss.detach().reshape(()).float(), tokens=counts[0].clone(), samples=counts[1].clone(),
                      grad_norm=deepspeed_grad_norm(engine),
                      skipped=not engine.was_step_applied())

@torch.no_grad()
def pipeline_eval_loss_sums(engine, batches: list[dict] | None, layout: Layout, recipe=None) -> torch.Tensor:
    """[Σ token losses, labelled tokens] (float64, on device) over every data-parallel rank's eval batches, the same
    on every rank. Collective.

    DeepSpeed's eval_batch has a world barrier, so every pipeline evaluates as many micro-batches as the rank with
    most; shorter lists are completed with copies whose labels are all ignored (no loss, no tokens)."""
    batches = list(batches or [])
    count = torch.tensor([len(batches)], dtype=torch.long, device=engine.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    count = int(count)
    totals = torch.zeros(2, dtype=torch.float64, device=engine.device)
    if count == 0:
        return totals
    template = batches[-1] if batches else {"input_ids": torch.zeros(1, 8, dtype=torch.long)}
    filler = {**template, "labels": torch.full_like(template["input_ids"], IGNORE_INDEX)}
    batches += [filler] * (count - len(batches))
    loss_fn = engine.module.loss_fn
    loss_fn.records = []
    holds_data = layout.is_first_stage or layout.is_last_stage
    data = iter([pipe_micro_batch(b) for b in batches]) if holds_data else None
    engine.eval_batch(data, compute_loss=True, reduce_output=None, bcast_loss=False, num_micro_batches=count)
    if layout.is_last_stage:
        totals = dp_sum(layout, torch.stack(loss_fn.records).sum(0).to(engine.device))
    return _from_last_stage(totals, layout)

def pipeline_eval_loss(engine, batches: list[dict] | None, layout: Layout) -> float:
    """Token-weighted mean eval loss over every data-parallel rank's batches (see `pipeline_eval_loss_sums`)."""
    loss_sum, tokens = pipeline_eval_loss_sums(engine, batches, layout).tolist()
    engine.module.train()
    return loss_sum / tokens if tokens > 0 else float("nan")
