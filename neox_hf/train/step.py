"""`train_step`: the only place with forward, backward and optimizer step (torchtitan's `train_step` shape).

One optimizer step over `gradient_accumulation_steps` micro-batches. With `train.loss_normalization: token` (the
default) every labelled token of the step weighs the same, whatever micro-batch or data-parallel rank it fell in:
the step's labelled tokens N are counted over all micro-batches and all-reduced over the data-parallel group before
the first backward, and each micro-batch backpropagates its loss *sum* scaled so that, after Accelerate/DeepSpeed
divide by the accumulation steps and DeepSpeed averages over data-parallel ranks, the gradient is that of
Σ token losses / N. `micro_batch` reproduces GPT-NeoX / Megatron: the mean of per-micro-batch means (packed data
without masks gives the same numbers either way).

Nothing here calls `.item()`: the step's loss and token count stay on the device until a log interval reads them.
A pipeline engine replaces this function (`parallel.pipeline.pipeline_train_step`) when the layout has stages.
"""

from __future__ import annotations

import torch

from neox_hf.parallel.accelerator import uses_deepspeed
from neox_hf.parallel.layout import StepResult, deepspeed_grad_norm, dp_sum
from neox_hf.train.loss import causal_lm_loss


def train_step(run, micro_batches: list[dict]) -> StepResult:
    if run.layout.pp > 1:
        from neox_hf.parallel.pipeline import pipeline_train_step

        return pipeline_train_step(run.model, micro_batches, run.layout, run.recipe)
    accelerator, model, optimizer, t = run.accelerator, run.model, run.optimizer, run.recipe.train
    counts = [labelled_tokens(mb) for mb in micro_batches]
    totals = dp_sum(run.layout, torch.stack([sum(counts), _samples(micro_batches, accelerator.device)]).double())
    step_tokens = totals[0].clamp(min=1)
    logged = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    grad_norm = None
    scale_before = loss_scale(accelerator, model)
    for batch, count in zip(micro_batches, counts):
        with accelerator.accumulate(model):
            with accelerator.autocast():
                loss_sum, _ = causal_lm_loss(model, batch, fused=t.fused_cross_entropy, z_loss=t.z_loss)
            if t.loss_normalization == "token":
                # Accelerate/DeepSpeed divide by the accumulation steps and DeepSpeed averages over DP ranks.
                scale = len(micro_batches) * run.layout.dp / step_tokens
                logged += loss_sum.detach().double()
            else:
                scale = 1.0 / count.clamp(min=1)
                logged += loss_sum.detach().double() * scale / len(micro_batches)
            accelerator.backward(loss_sum * scale.to(loss_sum.dtype))
            if accelerator.sync_gradients:
                grad_norm = _clip_gradients(accelerator, model, t.clip_grad)
            optimizer.step()
            optimizer.zero_grad()
    logged = dp_sum(run.layout, logged)
    loss = logged / step_tokens if t.loss_normalization == "token" else logged / run.layout.dp
    if uses_deepspeed(accelerator):
        grad_norm = deepspeed_grad_norm(model)
    return StepResult(loss=loss, tokens=totals[0], samples=totals[1], grad_norm=grad_norm,
                      skipped=step_was_skipped(accelerator, model, scale_before))


@torch.no_grad()
def eval_loss_sums(run, batches: list[dict]) -> torch.Tensor:
    """[Σ token losses, labelled tokens] over this data-parallel group's eval batches, in float64, on device."""
    if run.layout.pp > 1:
        from neox_hf.parallel.pipeline import pipeline_eval_loss_sums

        return pipeline_eval_loss_sums(run.model, batches, run.layout, run.recipe)
    t = run.recipe.train
    total = torch.zeros(2, dtype=torch.float64, device=run.accelerator.device)
    for batch in batches:
        with run.accelerator.autocast():
            loss_sum, count = causal_lm_loss(run.model, batch, fused=t.fused_cross_entropy)
        total += torch.stack([loss_sum.double(), count.double()])
    return dp_sum(run.layout, total)


def labelled_tokens(batch: dict) -> torch.Tensor:
    return (batch["labels"] != -100).sum()


def _samples(micro_batches: list[dict], device) -> torch.Tensor:
    return torch.tensor(sum(mb["input_ids"].shape[0] for mb in micro_batches), device=device)


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
