"""Reading a pipeline training checkpoint: DeepSpeed's per-layer files → a stock GPTNeoX state dict (export)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from neox_hf.errors import CheckpointError
from neox_hf.io import load_torch_safely
from neox_hf.engines.pipeline.partition import pipeline_layer_infos
from neox_hf.parallel.tp_plan import partition_dim


LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt$")

def is_pipeline_checkpoint(deepspeed_dir: Path) -> bool:
    return any(LAYER_FILE.search(p.name) for p in Path(deepspeed_dir).glob("layer_*-model_states.pt"))


def _layer_attributes(config):
    """Per pipeline layer: its module attribute → the transformers path it stands for."""
    from neox_hf.model.spec import spec_for_config
    from neox_hf.engines.pipeline.stages import embedding_paths

    spec = spec_for_config(config)
    attributes_of = {"EmbeddingPipe": lambda info: embedding_paths(spec),
                     "TransformerLayerPipe": lambda info: {"layer": info.paths[0]},
                     "FinalNormPipe": lambda info: {"final_layer_norm": spec.final_norm},
                     "HeadPipe": lambda info: {"lm_head": spec.head}}
    return [attributes_of[info.name](info) for info in pipeline_layer_infos(config)]


def stage_parameter_names(stage_module, config) -> dict[str, str]:
    """A PipelineModule's parameter names (`<layer index>.<attribute>.<rest>`) → transformers names (the
    layout-free checkpoint's keys)."""
    attributes = _layer_attributes(config)
    names = {}
    for name, _ in stage_module.named_parameters():
        index, attribute, rest = name.split(".", 2)
        names[name] = f"{attributes[int(index)][attribute]}.{rest}"
    return names


def pipeline_checkpoint_state_dict(deepspeed_dir: Path, config) -> dict[str, torch.Tensor]:
    """Stock GPTNeoX state dict from DeepSpeed pipeline layer files (`layer_XX-model_YY-model_states.pt`: one per
    pipeline layer and tensor-parallel rank), TP shards concatenated along the plan's dimensions."""
    from neox_hf.model.spec import spec_for_config

    infos, layer_attributes = pipeline_layer_infos(config), _layer_attributes(config)
    shards: dict[int, dict[int, Path]] = {}
    for path in Path(deepspeed_dir).glob("layer_*-model_states.pt"):
        match = LAYER_FILE.search(path.name)
        if match:
            shards.setdefault(int(match[1]), {})[int(match[2])] = path
    full = {}
    for index, info in enumerate(infos):
        if index not in shards:
            if info.name == "EmbeddingPipe" and index == len(infos) - 1:
                continue  # the tied head is saved once, with the first stage's embedding
            raise CheckpointError(f"{deepspeed_dir} lacks layer_{index:02d}-model_*-model_states.pt ({info.name}); "
                                  "the pipeline checkpoint is incomplete or was written for another model config")
        ranks = [load_torch_safely(shards[index][r]) for r in sorted(shards[index])]
        attributes = layer_attributes[index]
        for key in ranks[0]:
            attribute, _, rest = key.partition(".")
            hf_key = f"{attributes[attribute]}.{rest}"
            dim = partition_dim(hf_key)
            full[hf_key] = ranks[0][key] if dim is None else torch.cat([r[key] for r in ranks], dim=dim)
    if config.tie_word_embeddings:
        full["lm_head.weight"] = full[f"{spec_for_config(config).embedding}.weight"]
    return full
