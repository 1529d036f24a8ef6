"""`train.compile`: torch.compile of each decoder layer, in place (`nn.Module.compile` keeps the state-dict keys),
as torchtitan compiles each transformer block. The mask building, the rotary tables and the loss stay eager: under
tracing transformers hands SDPA a dense mask, which drops it off the flash kernel (transformers #48925), and the fused
loss is a custom autograd function with its own chunking. Every layer has the same code and shapes, so dynamo traces
one graph and reuses it for the others and for every later step of the same shape. Both replica engines call it before
wrapping: the plain one before Accelerate / DeepSpeed, FSDP2 before `fully_shard`, whose hooks then run eagerly around
each compiled layer (they are `torch._dynamo.disable`d in torch's fully_shard: dynamo breaks the graph around them
and compiles the layer's body between)."""

from __future__ import annotations

import torch

from neox_hf.model.spec import spec_for_config


def compiles(train, device: torch.device) -> bool:
    """Whether `train.compile` compiles on `device`: `auto` on CUDA only."""
    if train.compile == "auto":
        return device.type == "cuda"
    return bool(train.compile)


def compile_decoder_layers(model) -> int:
    """Compile each decoder layer of `model` (through a PEFT wrapper) in place; return how many."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = lm.get_submodule(spec_for_config(lm.config).layers)
    for layer in layers:
        layer.compile()
    return len(layers)
