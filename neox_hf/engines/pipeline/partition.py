"""The pipeline's layer list and its partition over stages (DeepSpeed's partition functions, GPT-NeoX's
`pipe_partition_method`), and the start-up report of what each stage holds."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from neox_hf.errors import RecipeError
from neox_hf.parallel.layout import Layout


@dataclass(frozen=True)
class PipeLayerInfo:
    """One pipeline layer: its class name (what `type:` partition methods match) and the HF paths it holds."""

    name: str
    paths: tuple[str, ...]

def pipeline_layer_infos(config) -> list[PipeLayerInfo]:
    """Embedding, every transformer layer, final norm, head: the pipeline's layer list, in order (paths from the
    family's spec)."""
    from neox_hf.model.spec import spec_for_config

    spec = spec_for_config(config)
    head = ("EmbeddingPipe", (spec.embedding,)) if config.tie_word_embeddings else ("HeadPipe", (spec.head,))
    return ([PipeLayerInfo("EmbeddingPipe", (spec.embedding,))]
            + [PipeLayerInfo("TransformerLayerPipe", (spec.layer_path(i),)) for i in range(config.num_hidden_layers)]
            + [PipeLayerInfo("FinalNormPipe", (spec.final_norm,)), PipeLayerInfo(*head)])

def layer_parameter_counts(config) -> list[int]:
    """Parameters of each pipeline layer (full model, before TP), counted on the meta device."""
    from neox_hf.model.spec import model_class_for_config

    with torch.device("meta"):
        model = model_class_for_config(config)(config)
    return [sum(p.numel() for path in info.paths for p in model.get_submodule(path).parameters())
            for info in pipeline_layer_infos(config)]

def partition_stages(config, stages: int, method: str = "type:transformer") -> list[int]:
    """Stage boundaries: stage s holds pipeline layers [parts[s], parts[s+1]) (DeepSpeed's partition functions)."""
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    infos = pipeline_layer_infos(config)
    if method == "uniform":
        parts = partition_uniform(len(infos), stages)
    elif method == "parameters":
        parts = partition_balanced(layer_parameter_counts(config), stages)
    elif method.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        weights = [1 if pattern.search(info.name) else 0 for info in infos]
        if not any(weights):
            raise RecipeError(f"`parallel.pipe_partition_method: {method}` matches none of the pipeline layers "
                              f"({', '.join(sorted({i.name for i in infos}))}); use type:transformer")
        parts = partition_balanced(weights, stages)
    else:
        raise RecipeError(f"`parallel.pipe_partition_method` {method!r}: use type:transformer, uniform or parameters")
    parts = [int(p) for p in parts]
    empty = [s for s in range(stages) if parts[s] == parts[s + 1]]
    if empty:
        raise RecipeError(f"pipe_partition_method {method!r} leaves stage(s) {empty} empty ({len(infos)} pipeline "
                          f"layers over {stages} stages); use fewer stages or more layers")
    return parts

def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle fraction of the 1F1B schedule: (p − 1) / (m + p − 1)."""
    return (stages - 1) / (micro_batches + stages - 1)

def pipeline_report(config, parts: list[int], micro_batches: int, tp: int = 1) -> list[str]:
    """Start-up lines: the layers and parameters of each stage, and the schedule's bubble fraction."""
    infos, counts = pipeline_layer_infos(config), layer_parameter_counts(config)
    lines = []
    for stage in range(len(parts) - 1):
        layers = infos[parts[stage]:parts[stage + 1]]
        params = sum(counts[parts[stage]:parts[stage + 1]])
        lines.append(f"pipeline stage {stage}: {_describe_layers(layers, parts[stage])}; {params / 1e6:.2f}M parameters"
                     + (f" ({params / tp / 1e6:.2f}M per tensor-parallel rank)" if tp > 1 else ""))
    p = len(parts) - 1
    lines.append(f"pipeline: {p} stages × {micro_batches} micro-batches in flight, bubble (p−1)/(m+p−1) = "
                 f"{bubble_fraction(p, micro_batches):.3f}")
    return lines

def _describe_layers(layers: list[PipeLayerInfo], first_index: int) -> str:
    """e.g. `embedding + layers 0–1` or `layers 2–3 + final norm + head`."""
    labels, numbers = [], [int(i.paths[0].rsplit(".", 1)[1]) for i in layers if i.name == "TransformerLayerPipe"]
    for offset, info in enumerate(layers):
        if info.name == "TransformerLayerPipe":
            if numbers and f"layers {numbers[0]}–{numbers[-1]}" not in labels:
                labels.append(f"layer {numbers[0]}" if len(numbers) == 1 else f"layers {numbers[0]}–{numbers[-1]}")
        elif info.name == "EmbeddingPipe":
            labels.append("embedding" if first_index + offset == 0 else "head (tied to the embedding)")
        else:
            labels.append({"FinalNormPipe": "final norm", "HeadPipe": "head"}[info.name])
    return " + ".join(dict.fromkeys(labels))

def full_parameter_count(config) -> int:
    """Parameters of the whole model (every stage; a tied embedding once)."""
    counts = layer_parameter_counts(config)
    return sum(counts) - (counts[-1] if config.tie_word_embeddings else 0)

def stage_report(module, layout: Layout, micro_batches: int) -> list[str]:
    """The start-up lines of `pipeline_report` for a built PipelineModule."""
    return pipeline_report(module.config, module._neox_parts, micro_batches, tp=layout.tp)
