"""The head loss on CUDA through a library kernel that never writes [tokens, vocab] logits to memory: Liger-Kernel's
Triton fused linear-cross-entropy, or Apple's Cut Cross-Entropy (`pip install -e ".[gpu]"`). Our chunked PyTorch op
(`linear_cross_entropy`) stays the kernel on CPU, for the vocab-parallel head under tensor parallelism (neither
library splits the vocabulary over ranks), for heads it cannot take (a bias, a LoRA-wrapped head) and where neither
library is installed.

`train.loss_kernel` chooses: `auto` takes Liger, then Cut Cross-Entropy, where the run can use them (CUDA, no tensor
parallelism; Cut Cross-Entropy computes no z-loss, so a z-loss run keeps ours), else ours; `neox` always ours; a named
library where it cannot run is refused at start-up in one line. Both libraries are asked for the same sums as ours:
the loss summed over labelled tokens (-100 ignored), z-loss (PaLM's weight × log(Z)², Liger's `lse_square_scale`)
included, accumulated in fp32.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from neox_hf.errors import RecipeError

LIBRARIES = {"liger": "liger_kernel", "cce": "cut_cross_entropy"}
_NAMES = {"liger": "Liger-Kernel's fused linear-cross-entropy (Triton)", "cce": "Cut Cross-Entropy (Triton)",
          "neox": "fused chunked linear + cross-entropy (PyTorch)"}


def installed(kernel: str) -> bool:
    return importlib.util.find_spec(LIBRARIES[kernel]) is not None


def loss_kernel(train, device: torch.device, tensor_parallel: int, *, available=installed) -> str:
    """The head-loss kernel of a run: `unfused`, `neox`, `liger` or `cce` (`available(kernel)` says whether a
    library is installed). Raises RecipeError for a library asked for by name that cannot run here."""
    if not train.fused_cross_entropy:
        return "unfused"
    choice = train.loss_kernel
    if choice == "neox":
        return "neox"
    usable = {kernel: _why_not(kernel, train, device, tensor_parallel, available) for kernel in LIBRARIES}
    if choice == "auto":
        return next((kernel for kernel, why in usable.items() if why is None), "neox")
    if usable[choice] is not None:
        raise RecipeError(f"`train.loss_kernel: {choice}` cannot run here: {usable[choice]}; use "
                          "`train.loss_kernel: auto` (the library where it can run, ours elsewhere) or `neox`")
    return choice


def _why_not(kernel: str, train, device: torch.device, tensor_parallel: int, available) -> str | None:
    if device.type != "cuda":
        return f"{LIBRARIES[kernel]} is a Triton kernel for CUDA GPUs and this run is on {device.type}"
    if tensor_parallel > 1:
        return (f"{LIBRARIES[kernel]} needs the whole vocabulary on one rank, and tensor parallelism {tensor_parallel} "
                "splits the head (ours computes the vocab-parallel loss)")
    if kernel == "cce" and train.z_loss:
        return "Cut Cross-Entropy computes no z-loss, and `train.z_loss` is set"
    if not available(kernel):
        return f"{LIBRARIES[kernel]} is not installed (`pip install -e \".[gpu]\"`)"
    return None


def describe(kernel: str) -> str:
    """The kernel as the start-up report names it."""
    if kernel == "unfused":
        return "full logits, then cross-entropy in fp32"
    return f"{_NAMES[kernel]}: no [tokens, vocab] logits; softmax and sums in fp32"


def takes(head: nn.Module) -> bool:
    """Whether a library kernel can compute `head`'s loss: a bias-free `nn.Linear` (not a LoRA wrapper, not a
    vocab-parallel head)."""
    return type(head) is nn.Linear and head.bias is None


def library_head_loss(kernel: str, head: nn.Linear, hidden: torch.Tensor, labels: torch.Tensor, *,
                      z_loss: float = 0.0, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, labelled-token count) of `head` on `hidden` through `kernel` (`liger` or `cce`)."""
    flat, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    count = (flat_labels != ignore_index).sum()
    if kernel == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        loss = liger_fused_linear_cross_entropy(flat, head.weight, flat_labels, ignore_index=ignore_index,
                                                lse_square_scale=z_loss, reduction="sum", **_liger_fp32_accumulation())
        return (loss[0] if isinstance(loss, tuple) else loss), count
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(flat, head.weight, flat_labels, ignore_index=ignore_index, reduction="sum"), count


def _liger_fp32_accumulation() -> dict:
    """Liger ≥ 0.6 accumulates the weight gradient in `accum_dtype`; fp32 as ours does, where the version takes it."""
    import inspect

    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    parameters = inspect.signature(liger_fused_linear_cross_entropy).parameters
    return {"accum_dtype": torch.float32} if "accum_dtype" in parameters else {}
