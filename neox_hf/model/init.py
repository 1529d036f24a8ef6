"""GPT-NeoX's initialisation for every family: its per-role `init_method` / `output_layer_init_method` (transformers
knows one `initializer_range` for every layer), as a mixin on our model classes and as a layout-free draw per
parameter (`initial_tensor`: seeded by the run's seed and the parameter's name, so a run from scratch starts from the
same weights whole, as pipeline stages or as TP shards). Which layers are output projections is the family's spec."""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn
from transformers import initialization as init

from neox_hf.model.spec import spec_for_config

INIT_METHODS = ("normal", "scaled_normal", "small_init", "wang_init")


def init_std(method: str, *, hidden_size: int, num_layers: int, sigma: float = 0.02) -> float:
    """Standard deviation of GPT-NeoX's init functions (megatron/model/init_functions.py)."""
    if method == "normal":
        return sigma
    if method == "scaled_normal":
        return sigma / math.sqrt(2.0 * num_layers)
    if method == "small_init":  # Nguyen & Salazar (2019): sqrt(2 / (5 d))
        return math.sqrt(2.0 / (5.0 * hidden_size))
    if method == "wang_init":  # Wang (2021), as in GPT-J / GPT-NeoX: 2 / (L sqrt(d))
        return 2.0 / num_layers / math.sqrt(hidden_size)
    raise ValueError(f"unknown init method {method!r}; choose one of {', '.join(INIT_METHODS)}")


def parameter_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded by (run seed, parameter name) through SHA-256: the same stream in every process and
    Python version (Python's `hash` of a string is salted per process)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def initial_tensor(config, name: str, shape, seed: int) -> torch.Tensor:
    """The full-size fp32 initial value of the parameter `name` (its key in the family's CausalLM, e.g.
    `gpt_neox.layers.3.attention.dense.weight`): GPT-NeoX's per-role normal for matrices (Linear and Embedding weights,
    routers, the 3-D expert weights of MoE families), zeros for biases, ones for norm gains — as `_init_weights`
    gives, but independent of which modules a rank builds and in which order."""
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if len(shape) == 1:
        return torch.ones(shape)
    # a Linear's `…mlp.down_proj.weight` names its module; a 3-D experts tensor (`…mlp.experts.down_proj`) is its own
    output_layer = name.removesuffix(".weight").endswith(spec_for_config(config).output_layers)
    method = config.output_layer_init_method if output_layer else config.init_method
    std = init_std(method, hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
                   sigma=config.initializer_range)
    return torch.empty(shape).normal_(0.0, std, generator=parameter_generator(seed, name))


class _NeoXInitMixin:
    """Replaces transformers' single-std init by GPT-NeoX's per-role init.

    Roles are tagged by module path before transformers runs its init, because `_init_weights` only sees the module.
    A family's row-parallel output projections are its spec's `output_layers` (module-path suffixes), as for
    `initial_tensor`.
    """

    def post_init(self):
        output_layers = spec_for_config(self.config).output_layers
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module._neox_output_layer = name.endswith(output_layers)
        super().post_init()

    def _init_weights(self, module):
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            return super()._init_weights(module)
        config = self.config
        method = config.output_layer_init_method if getattr(module, "_neox_output_layer", False) else config.init_method
        std = init_std(
            method,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            sigma=config.initializer_range,
        )
        init.normal_(module.weight, mean=0.0, std=std)
        if getattr(module, "bias", None) is not None:
            init.zeros_(module.bias)
