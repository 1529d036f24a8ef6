"""Engines: one per execution path. Each builds this rank's model, parallelizes it (optimizer included), runs one
optimizer step and evaluation for the run's objective, and gives the full state dict, the parameter count, the fp16
loss scale and its part of the layout-free checkpoint state (`base.Engine`). The loop talks to an engine and never
learns what a stage, a TP group or a ZeRO partition is.

- `plain`: Accelerate alone or with DeepSpeed (ZeRO 0–3), with or without tensor / sequence parallelism; any
  objective.
- `pipeline`: DeepSpeed's PipelineEngine over stages; the `lm` objective.
- `fsdp2`: torch's fully_shard per decoder layer (`parallel.backend: fsdp2`), HSDP; any objective.

Adding an engine is its module plus one line in `ENGINES`: `build_engine` takes the first whose `handles(recipe,
layout)` is true, so a more specific engine is listed before the default.
"""

from __future__ import annotations

from neox_hf.engines.base import Engine
from neox_hf.engines.fsdp2 import FSDP2Engine
from neox_hf.engines.pipeline.engine import PipelineEngine
from neox_hf.engines.plain import PlainEngine
from neox_hf.parallel.layout import Layout

ENGINES: tuple[type[Engine], ...] = (PipelineEngine, FSDP2Engine, PlainEngine)


def build_engine(recipe, accelerator, layout: Layout, *, model=None, optimizer=None) -> Engine:
    """The engine of this recipe and layout (the first of `ENGINES` that handles it)."""
    engine_class = next(engine for engine in ENGINES if engine.handles(recipe, layout))
    return engine_class(recipe, accelerator, layout, model=model, optimizer=optimizer)


__all__ = ["ENGINES", "Engine", "build_engine"]
