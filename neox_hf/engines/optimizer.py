"""The optimizer every engine builds: GPT-NeoX's optimizers (`train.optimizer`) over GPT-NeoX's parameter groups.

As GPT-NeoX, biases and norm weights get no weight decay. Each optimizer is a maintained library's own class, the
one GPT-NeoX builds for its `optimizer.type` where it runs here:
  adamw     torch's AdamW (decoupled decay): GPT-NeoX's `Adam` / `cpu_adam` (apex / DeepSpeed FusedAdam and
            DeepSpeedCPUAdam, all in AdamW mode). torch's fused kernel wherever the parameters' device has one (CPU
            and CUDA do): one pass over each tensor instead of torch's default per-op loop on CPU (measured 83 → 12
            ms per step for Pythia-14M's 14M parameters on 2 cores) — what GPT-NeoX gets from FusedAdam and
            transformers' Trainer from its default `adamw_torch_fused`.
  adam      torch's Adam, weight decay added to the gradient (L2): GPT-NeoX's `cpu_torch_adam` (torch.optim.Adam).
  lion      lion-pytorch's Lion (Chen et al. 2023), the algorithm of GPT-NeoX's own Lion (megatron/optimizers.py,
            what it builds without ZeRO), on every device and under ZeRO too. GPT-NeoX builds DeepSpeed's FusedLion
            under ZeRO instead, whose update for an element with a zero interpolated momentum (an embedding row no
            token used yet) is ±lr where torch's sign gives 0 (DeepSpeedCPULion likewise, by copysign): the two
            GPT-NeoX paths differ there, and neox_hf follows the one without ZeRO everywhere.
  sgd       torch's SGD (momentum, nesterov; L2 decay): GPT-NeoX's `sgd` without apex.
  sm3       pytorch-optimizer's SM3 (Anil et al. 2019), the algorithm of GPT-NeoX's own copy: lr, momentum, beta, eps,
            and no weight decay (GPT-NeoX passes none to SM3).
  adam8bit  bitsandbytes' Adam8bit (GPT-NeoX's `use_bnb_optimizer`): CUDA only, refused on CPU.

Each optimizer's hyperparameters are checked at recipe validation in its library's ranges
(`neox_hf.recipe.checks.OPTIMIZER_RANGES`), and its library and device before the model is built
(`check_optimizer_runs_here`, from `neox_hf.train.guards`).
"""

from __future__ import annotations

import torch

from neox_hf.errors import RecipeError

OPTIMIZERS = ("adamw", "adam", "lion", "sgd", "sm3", "adam8bit")


def parameter_groups(model, weight_decay: float) -> list[dict]:
    """GPT-NeoX's two groups (get_params_for_weight_decay_optimization): matrices decay, biases and norms do not."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model, train) -> torch.optim.Optimizer:
    """`train.optimizer` over the model's parameter groups, with the recipe's lr, betas, eps and momentum."""
    groups = parameter_groups(model, train.weight_decay)
    params = [p for group in groups for p in group["params"]]
    kind = train.optimizer
    betas = (train.adam_beta1, train.adam_beta2)
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=train.lr, betas=betas, eps=train.adam_eps,
                                 fused=_has_fused_kernel(params) or None)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=train.lr, betas=betas, eps=train.adam_eps,
                                fused=_has_fused_kernel(params) or None)
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=train.lr, momentum=train.momentum, nesterov=train.nesterov)
    if kind == "lion":
        return _lion(groups, lr=train.lr, betas=betas)
    if kind == "sm3":
        return _sm3(groups, lr=train.lr, momentum=train.momentum, beta=train.sm3_beta, eps=train.adam_eps)
    if kind == "adam8bit":
        return _adam8bit(groups, params, lr=train.lr, betas=betas, eps=train.adam_eps)
    raise RecipeError(f"`train.optimizer: {kind}` is not one of {', '.join(OPTIMIZERS)}")


# `train.optimizer` → (the module it imports, the sentence naming the package to install)
_LIBRARIES = {
    "lion": ("lion_pytorch", "`train.optimizer: lion` needs lion-pytorch (GPT-NeoX's Lion is its algorithm): "
                             "`pip install lion-pytorch`, or use `train.optimizer: adamw`"),
    "sm3": ("pytorch_optimizer", "`train.optimizer: sm3` needs pytorch-optimizer: `pip install pytorch-optimizer`, "
                                 "or use `train.optimizer: adamw`"),
    "adam8bit": ("bitsandbytes", "`train.optimizer: adam8bit` (GPT-NeoX use_bnb_optimizer) needs bitsandbytes: "
                                 "`pip install bitsandbytes`, or use `train.optimizer: adamw`"),
}
_ADAM8BIT_ON_CPU = ("`train.optimizer: adam8bit` (GPT-NeoX use_bnb_optimizer) is bitsandbytes' 8-bit Adam, which runs "
                    "on CUDA GPUs only; on CPU use `train.optimizer: adamw` (remove use_bnb_optimizer)")


def check_optimizer_runs_here(kind: str, device_type: str) -> None:
    """`train.optimizer` on this machine, before the model is built: its library is installed (looked up, not
    imported) and, for adam8bit, the device is a CUDA GPU. `build_optimizer` says the same if reached."""
    import importlib.util

    if kind == "adam8bit" and device_type != "cuda":
        raise RecipeError(_ADAM8BIT_ON_CPU)
    module, missing = _LIBRARIES.get(kind, (None, ""))
    if module is not None and importlib.util.find_spec(module) is None:
        raise RecipeError(missing)


def _lion(groups, *, lr: float, betas) -> torch.optim.Optimizer:
    try:
        from lion_pytorch import Lion
    except ImportError as err:
        raise RecipeError(_LIBRARIES["lion"][1]) from err
    return Lion(groups, lr=lr, betas=betas)


def _sm3(groups, *, lr: float, momentum: float, beta: float, eps: float) -> torch.optim.Optimizer:
    try:
        from pytorch_optimizer import SM3
    except ImportError as err:
        raise RecipeError(_LIBRARIES["sm3"][1]) from err
    # SM3 reads no weight decay: the groups' `weight_decay` is ignored, as in GPT-NeoX
    return SM3([{"params": g["params"]} for g in groups], lr=lr, momentum=momentum, beta=beta, eps=eps)


def _adam8bit(groups, params, *, lr: float, betas, eps: float) -> torch.optim.Optimizer:
    if not params or any(p.device.type != "cuda" for p in params):
        raise RecipeError(_ADAM8BIT_ON_CPU)
    try:
        import bitsandbytes as bnb
    except ImportError as err:
        raise RecipeError(_LIBRARIES["adam8bit"][1]) from err
    return bnb.optim.Adam8bit(groups, lr=lr, betas=betas, eps=eps)


def _has_fused_kernel(params) -> bool:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    return bool(params) and all(p.device.type in devices and p.is_floating_point() for p in params)
