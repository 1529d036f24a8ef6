"""fp16 dynamic loss scaling as the engines see it: whether a step was skipped for overflowing gradients, the
current scale and its floor, for DeepSpeed's scaler and torch's GradScaler alike."""

from __future__ import annotations

from neox_hf.parallel.accelerator import uses_deepspeed


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
