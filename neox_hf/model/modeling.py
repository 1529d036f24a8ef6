"""NeoXConfig / NeoXForCausalLM: transformers' GPTNeoX, plus GPT-NeoX's initialisation, nothing forked.

What we add over `transformers.GPTNeoXForCausalLM`:
- GPT-NeoX's `init_method` / `output_layer_init_method` (`normal`, `scaled_normal`, `small_init`, `wang_init`) for
  training from scratch; transformers only knows one `initializer_range` for every layer.
- Files we save are stock GPTNeoX files (`model_type: gpt_neox`, `architectures: ["GPTNeoXForCausalLM"]`,
  `embed_out.weight`), so stock transformers loads them without `trust_remote_code`.
- A layout-free init (`initial_tensor`): each parameter drawn from a generator seeded by the run's seed and the
  parameter's name, so a run from scratch starts from the same weights whole, as pipeline stages or as TP shards
  (transformers' init walks modules in order on one global generator, so its draws depend on what a rank builds).
- transformers renames the stored `embed_out.weight` to `lm_head.weight` with a conversion mapping keyed by the
  class name `GPTNeoXForCausalLM`; a subclass of another name would silently get a random `lm_head`, so we register
  the same mapping for our class names.

The model knows nothing of distribution: tensor parallelism and ZeRO are applied from outside (`neox_hf.parallel`).
"""

from __future__ import annotations

import hashlib
import math

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXModel
from transformers import initialization as init
from transformers.conversion_mapping import (
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
)
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXPreTrainedModel

INIT_METHODS = ("normal", "scaled_normal", "small_init", "wang_init")

# Our class name → the stock class name written into config.json `architectures`.
_STOCK_ARCHITECTURES = {"NeoXForCausalLM": "GPTNeoXForCausalLM", "NeoXModel": "GPTNeoXModel"}


@strict
class NeoXConfig(GPTNeoXConfig):
    """GPTNeoXConfig with GPT-NeoX's init options; serialises as a stock `gpt_neox` config.

    The two extra keys are harmless to stock transformers (it keeps unknown keys as attributes).
    """

    init_method: str = "small_init"
    output_layer_init_method: str = "wang_init"

    def to_dict(self) -> dict:
        output = super().to_dict()
        if output.get("architectures"):
            output["architectures"] = [_STOCK_ARCHITECTURES.get(a, a) for a in output["architectures"]]
        return output


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
    the only 2-D parameters of our families), zeros for biases, ones for norm gains — as `_init_weights` gives, but
    independent of which modules a rank builds and in which order."""
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if len(shape) == 1:
        return torch.ones(shape)
    from neox_hf.model.spec import spec_for_config

    output_layer = name.rsplit(".", 1)[0].endswith(spec_for_config(config).output_layers)
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
        from neox_hf.model.spec import spec_for_config

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


class NeoXModel(_NeoXInitMixin, GPTNeoXModel):
    config_class = NeoXConfig


class NeoXForCausalLM(_NeoXInitMixin, GPTNeoXForCausalLM):
    """`GPTNeoXForCausalLM` with GPT-NeoX initialisation; same weights, keys, config and forward."""

    config_class = NeoXConfig

    def __init__(self, config: NeoXConfig):
        # Same three modules as the stock __init__, but the trunk is NeoXModel so that transformers' per-submodel
        # init dispatch reaches our `_init_weights` for every layer.
        GPTNeoXPreTrainedModel.__init__(self, config)
        self.gpt_neox = NeoXModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


def _register_stock_key_renames() -> None:
    """Give our classes the stock `embed_out` ↔ `lm_head` rename (keyed by class name in transformers)."""
    stock = get_checkpoint_conversion_mapping("GPTNeoXForCausalLM")
    if stock is None:  # an older transformers that stores lm_head as embed_out natively
        return
    for name in ("NeoXForCausalLM",):
        register_checkpoint_conversion_mapping(name, stock, overwrite=True)


_register_stock_key_renames()


def config_from_recipe(
    model_cfg, *, vocab_size: int, bos_token_id: int | None = 0, eos_token_id: int | None = 0, pad_token_id: int | None = None
) -> NeoXConfig:
    """NeoXConfig from a recipe's `model` section (a `neox_hf.recipe.ModelConfig`), the padded vocab size and the
    tokenizer's special ids."""
    return NeoXConfig(
        **family_config_kwargs(model_cfg, vocab_size=vocab_size, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                               pad_token_id=pad_token_id),
        intermediate_size=model_cfg.intermediate_size or 4 * model_cfg.hidden_size,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(model_cfg.rotary_emb_base),
            "partial_rotary_factor": float(model_cfg.rotary_pct),
        },
        use_parallel_residual=model_cfg.use_parallel_residual,
        layer_norm_eps=model_cfg.layer_norm_eps,
        hidden_dropout=model_cfg.hidden_dropout,
    )


def family_config_kwargs(model_cfg, *, vocab_size: int, bos_token_id: int | None, eos_token_id: int | None,
                         pad_token_id: int | None) -> dict:
    """The config values every model family takes the same way from a recipe's `model` section (sizes, init,
    dropout, special ids); each family's builder adds its own (norm, MLP width, rotary, attention layout)."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=model_cfg.hidden_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        hidden_act=model_cfg.hidden_act,
        max_position_embeddings=model_cfg.max_position_embeddings or model_cfg.seq_length,
        tie_word_embeddings=model_cfg.tie_word_embeddings,
        attention_dropout=model_cfg.attention_dropout,
        initializer_range=model_cfg.init_method_std,
        init_method=model_cfg.init_method,
        output_layer_init_method=model_cfg.output_layer_init_method,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
