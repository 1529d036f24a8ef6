"""The plain engine's step: the only place with forward, backward and optimizer step outside DeepSpeed's pipeline
schedule (torchtitan's `train_step` shape), for any objective (`neox_hf.objectives`).

One optimizer step over `gradient_accumulation_steps` micro-batches. The objective's units (labelled tokens, or
pairs) are counted over all micro-batches and all-reduced over the data-parallel group before the first backward;
each micro-batch backpropagates its loss *sum* weighted by `neox_hf.train.weighting` (token: every unit of the step
weighs the same; micro_batch: GPT-NeoX's mean of micro-batch means). The objective's metrics are summed the same way
and divided by the step's units (TRL's per-batch means).

Nothing here calls `.item()`: the step's loss, counts and metrics stay on the device until a log interval reads them.
The pipeline engine's step is `neox_hf.parallel.pipeline.pipeline_train_step`; `neox_hf.train.engine` chooses.
"""

from __future__ import annotations

import torch

from neox_hf.parallel.accelerator import uses_deepspeed
from neox_hf.parallel.layout import StepResult, deepspeed_grad_norm, dp_sum
from neox_hf.train.weighting import backward_scale, step_loss


def train_step_plain(engine, micro_batches: list[dict]) -> StepResult:
    """One optimizer step of the plain engine for the run's objective, over `gradient_accumulation_steps`
    micro-batches (collective over the data-parallel group)."""
    accelerator, model, optimizer, layout = engine.accelerator, engine.model, engine.optimizer, engine.layout
    t, objective = engine.recipe.train, engine.objective
    units = [objective.units(mb) for mb in micro_batches]
    device = accelerator.device
    counts = torch.stack([sum(units), _samples(micro_batches, objective, device), _tokens(micro_batches, objective, device)])
    totals = dp_sum(layout, counts.double())
    weighted = torch.zeros((), dtype=torch.float64, device=device)
    metric_sums = torch.zeros(len(objective.metric_names), dtype=torch.float64, device=device)
    grad_norm = None
    scale_before = loss_scale(accelerator, model)
    for batch, count in zip(micro_batches, units):
        with accelerator.accumulate(model):
            with accelerator.autocast():
                out = objective.loss(model, batch, fused=t.fused_cross_entropy, z_loss=t.z_loss)
            scale = backward_scale(t.loss_normalization, count.double(), totals[0], gas=len(micro_batches),
                                   dp=layout.dp)
            weighted += out.loss_sum.detach().double() * scale
            metric_sums += _metric_vector(out, objective.metric_names, device)
            accelerator.backward(out.loss_sum * scale.to(out.loss_sum.dtype))
            if accelerator.sync_gradients:
                grad_norm = _clip_gradients(accelerator, model, t.clip_grad)
            optimizer.step()
            optimizer.zero_grad()
    reduced = dp_sum(layout, torch.cat([weighted.reshape(1), metric_sums]))
    if uses_deepspeed(accelerator):
        grad_norm = deepspeed_grad_norm(model)
    metrics = dict(zip(objective.metric_names, reduced[1:] / totals[0].clamp(min=1)))
    return StepResult(loss=step_loss(reduced[0], gas=len(micro_batches), dp=layout.dp), tokens=totals[2],
                      samples=totals[1], grad_norm=grad_norm, skipped=step_was_skipped(accelerator, model, scale_before),
                      metrics=metrics)


@torch.no_grad()
def eval_sums_plain(engine, batches: list[dict]) -> torch.Tensor:
    """[Σ loss, units, Σ of each metric] of the objective over this data-parallel group's eval batches, float64, on
    device."""
    objective, t, device = engine.objective, engine.recipe.train, engine.accelerator.device
    total = torch.zeros(2 + len(objective.metric_names), dtype=torch.float64, device=device)
    for batch in batches:
        with engine.accelerator.autocast():
            out = objective.loss(engine.model, batch, fused=t.fused_cross_entropy)
        total += torch.cat([torch.stack([out.loss_sum.double(), out.units.double()]),
                            _metric_vector(out, objective.metric_names, device)])
    return dp_sum(engine.layout, total)


def train_step(run, micro_batches: list[dict]) -> StepResult:
    """One optimizer step of `run` (a TrainingRun, or any object with accelerator, recipe, model, optimizer and
    layout) through its layout's engine."""
    return _engine_of(run).train_step(micro_batches)


def eval_loss_sums(run, batches: list[dict]) -> torch.Tensor:
    """[Σ loss, units] over every data-parallel rank's eval batches, through the run's engine."""
    return _engine_of(run).eval_sums(batches)[:2]


def _engine_of(run):
    engine = getattr(run, "engine", None)
    if engine is None:
        from neox_hf.train.engine import build_engine

        engine = build_engine(run.recipe, run.accelerator, run.layout, model=run.model, optimizer=run.optimizer)
    return engine


def _metric_vector(out, names: tuple[str, ...], device) -> torch.Tensor:
    return torch.stack([out.metric_sums[n].double() for n in names]) if names else torch.zeros(0, dtype=torch.float64,
                                                                                                 device=device)


def _tokens(micro_batches: list[dict], objective, device) -> torch.Tensor:
    """Tokens the step trained on, for throughput and `consumed_tokens`: for `lm` the labelled tokens (what GPT-NeoX
    and earlier neox_hf runs count); for pair objectives every unpadded token the forward reads (prompt included)."""
    total = torch.zeros((), dtype=torch.long, device=device)
    for mb in micro_batches:
        if "labels" in mb and objective.unit == "token":
            total = total + labelled_tokens(mb)
        elif "attention_mask" in mb:
            total = total + mb["attention_mask"].sum()
        else:
            total = total + mb["input_ids"].numel()
    return total


def labelled_tokens(batch: dict) -> torch.Tensor:
    return (batch["labels"] != -100).sum()


def _samples(micro_batches: list[dict], objective, device) -> torch.Tensor:
    """Samples of the step: sequences, or pairs for a pair objective (a micro-batch of P pairs has 2P rows)."""
    rows = sum(mb["input_ids"].shape[0] for mb in micro_batches)
    return torch.tensor(rows // 2 if objective.unit == "pair" else rows, device=device)


def _clip_gradients(accelerator, model, clip_grad: float):
    """DeepSpeed clips inside its step (`gradient_clipping`); elsewhere Accelerate clips and returns the norm."""
    if uses_deepspeed(accelerator) or clip_grad <= 0:
        return None
    return accelerator.clip_grad_norm_(model.parameters(), clip_grad)


def step_was_skipped(accelerator, model, scale_before: float | None = None) -> bool:
    """fp16 dynamic loss scaling skips the update when gradients overflowed (and lowers the scale)."""
    if accelerator.mixed_precision != "fp16":
        return False
    if uses_deepspeed(accelerator):
        return not model.was_step_applied()
    if accelerator.scaler is None or scale_before is None:
        return accelerator.optimizer_step_was_skipped
    return scaler_backed_off(accelerator.scaler, scale_before)


def scaler_backed_off(scaler, scale_before: float) -> bool:
    """Whether torch's GradScaler found an overflow at the last step: it lowers its scale then, and only then.

    Accelerate's `optimizer_step_was_skipped` cannot tell with a fused optimizer: GradScaler then always calls
    `optimizer.step()` and the fused kernel itself skips the update (huggingface/accelerate#4242), so the flag stays
    False and the schedule would advance over skipped steps."""
    return float(scaler.get_scale()) < scale_before


def loss_scale(accelerator, model) -> float | None:
    """The current fp16 loss scale (DeepSpeed's dynamic scaler or torch's GradScaler); None in fp32/bf16."""
    if accelerator.mixed_precision != "fp16":
        return None
    if uses_deepspeed(accelerator):
        return float(model.optimizer.loss_scale)
    # Accelerate builds a GradScaler only where torch AMP scales fp16 (not for fp16 on CPU without DeepSpeed).
    return float(accelerator.scaler.get_scale()) if accelerator.scaler is not None else None



def loss_scale_floor(accelerator, model) -> float | None:
    """The lowest loss scale DeepSpeed's dynamic scaler may reach (fp16 `min_loss_scale`); None where there is none
    (fp32/bf16, torch's GradScaler)."""
    if accelerator.mixed_precision != "fp16" or not uses_deepspeed(accelerator):
        return None
    scaler = getattr(model.optimizer, "loss_scaler", None)
    floor = getattr(scaler, "min_scale", None)
    return float(floor) if floor is not None else None
