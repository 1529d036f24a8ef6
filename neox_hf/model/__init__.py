"""GPTNeoX-compatible model classes (weights, keys and config of `transformers.GPTNeoXForCausalLM`)."""

from neox_hf.model.modeling import NeoXConfig, NeoXForCausalLM, NeoXModel, config_from_recipe, init_std

__all__ = ["NeoXConfig", "NeoXForCausalLM", "NeoXModel", "config_from_recipe", "init_std"]
