"""Hugging Face model folders: written atomically, from a model or from a merged state dict (`model_holding`: what a
pipeline run, whose ranks each hold one stage, saves from), and read whole (`from_pretrained_whole`: never with a
weight drawn at random for one the folder lacks).

Gap filled: `save_pretrained` writes straight into the target folder, so a crash leaves a half-written model that
still looks loadable. We write into a staging folder beside the target and move the files in, `config.json` last,
so a folder with a config always has complete weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from neox_hf.errors import CheckpointError
from neox_hf.io import move_files_into, staging_folder
from neox_hf.model.spec import model_class_for_config


def save_hf_folder(model, out_dir, *, state_dict=None, tokenizer=None, extra_files: dict[str, str] | None = None,
                   max_shard_size: str = "5GB") -> Path:
    """save_pretrained (safetensors, sharded above max_shard_size) + tokenizer + extra text files, atomically."""
    out_dir = Path(out_dir)
    with staging_folder(out_dir) as staging:
        model.save_pretrained(staging, state_dict=state_dict, safe_serialization=True, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text)
        _remove_stale_weights(out_dir, keep={p.name for p in staging.iterdir()})
        move_files_into(staging, out_dir, last="config.json")
    return out_dir


def _remove_stale_weights(out_dir: Path, keep: set[str]) -> None:
    """An earlier save with another shard count must not leave shards the new index does not list."""
    if (out_dir / "config.json").exists():
        os.remove(out_dir / "config.json")  # the folder is not loadable until the new files are all in
    for pattern in ("model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin"):
        for path in out_dir.glob(pattern):
            if path.name not in keep:
                path.unlink()


def model_holding(state_dict: dict[str, torch.Tensor], config):
    """The family's CausalLM whose parameters ARE `state_dict`'s tensors (built on meta, no copy)."""
    with torch.device("meta"):
        model = model_class_for_config(config)(config)
    model.load_state_dict(state_dict, strict=True, assign=True)
    rotary = model.base_model.rotary_emb
    model.base_model.rotary_emb = type(rotary)(config=config)  # non-persistent buffer, still on meta
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def from_pretrained_whole(model_class, folder, *, new_weights: tuple[str, ...] = (), **kwargs):
    """`model_class.from_pretrained(folder, **kwargs)`, or CheckpointError naming the weights the folder lacks, unless
    each starts with one of `new_weights` (a head the recipe adds on purpose: the rm objective's `score`).
    Gap filled: transformers draws missing weights at random and only prints a load report, so a reward model's
    folder loaded as a causal LM would train, evaluate and generate with a random LM head, exit 0."""
    model, info = model_class.from_pretrained(folder, output_loading_info=True, **kwargs)
    missing = sorted(k for k in info["missing_keys"] if not k.startswith(new_weights))
    if missing:
        stored = ", ".join(model.config.architectures or ["an unnamed architecture"])
        named = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        hint = ("a reward model's folder has no LM head: give the causal-LM folder it was trained from (or "
                "`neox_hf eval --objective rm` to score with it)" if stored.endswith("ForSequenceClassification")
                else "give a folder saved from the same kind of model")
        raise CheckpointError(f"{folder} holds {stored} weights without {named}, which {type(model).__name__} needs "
                              f"(they would be drawn at random); {hint}")
    return model
