"""What a checkpoint holds, read without loading it: the training position (`TrainState`), and the LoRA adapters,
objective and precision it was written with (for the checks made before the model is built)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from neox_hf.checkpoint.layout_free import has_layout_free_state, stored_model_shapes
from neox_hf.io import load_torch_safely


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    consumed_samples: int = 0  # over all data-parallel ranks
    consumed_tokens: int = 0  # real (non-padding) tokens over all ranks
    skipped_steps: int = 0  # fp16 overflows: counted as iterations (as GPT-NeoX does), no update, LR held
    global_batch: int | None = None  # samples per step (micro × accumulation × data-parallel); None: not recorded


def checkpoint_lora(folder: Path) -> dict | None:
    """The LoRA adapters a checkpoint's model holds, from its weights' names and shapes (the safetensors header or
    the layout-free metadata; no tensor is read): {"r": rank, "target_modules": [...]}, or None without any (or
    where neither index is there to list them)."""
    import json
    import struct

    shapes: dict = {}
    weights = folder / "model.safetensors"
    try:
        if weights.is_file():
            with weights.open("rb") as handle:
                header = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
            shapes = {k: v.get("shape") for k, v in header.items() if k != "__metadata__"}
        elif has_layout_free_state(folder):
            shapes = stored_model_shapes(folder)
    except Exception:  # noqa: BLE001 — a damaged index: the load names the file and the fix
        return None
    lora = {name: shape for name, shape in shapes.items() if ".lora_A." in name}
    if not lora:
        return None
    ranks = sorted({shape[0] for shape in lora.values() if shape})
    targets = sorted({name.split(".lora_A.")[0].rsplit(".", 1)[-1] for name in lora})
    return {"r": ranks[0] if len(ranks) == 1 else ranks, "target_modules": targets}


def checkpoint_objective(folder: Path) -> str | None:
    """The train.objective a checkpoint's data position was saved for (a streamed or GPT-NeoX-order loader: lm), or
    None where it saved none or cannot be read (the load reports that)."""
    try:
        state = load_torch_safely(folder / "trainer_state_rank0.pt")
    except Exception:  # noqa: BLE001
        return None
    data = state.get("data") if isinstance(state, dict) else None
    if not isinstance(data, dict) or not isinstance(data.get("fingerprint"), dict):
        return None
    return data["fingerprint"].get("objective", "lm")


def checkpoint_precision(folder: Path) -> str | None:
    """The precision a checkpoint was trained in (None for checkpoints written before it was recorded, or unreadable
    ones: `load_checkpoint` reports those)."""
    try:
        state = load_torch_safely(folder / "trainer_state_rank0.pt")
    except Exception:  # noqa: BLE001 — corrupt or missing: load_checkpoint names the file and the fix
        return None
    return state.get("precision") if isinstance(state, dict) else None
