"""Damaged checkpoints: reading a checkpoint file so that a truncated, corrupt or refused one is named, a load error
said in one line, and what to resume from instead (`resume_hint`: never `--overwrite` while another checkpoint is
intact)."""

from __future__ import annotations

from pathlib import Path

from neox_hf.checkpoint.folders import checkpoint_step, complete_checkpoints
from neox_hf.checkpoint.layout_free import has_layout_free_state, truncated_file
from neox_hf.errors import CheckpointError, first_line
from neox_hf.io import folder_refusal_message, is_weights_only_refusal, load_torch_safely


def read_torch_file(path: Path, folder: Path, *, required: bool = True):
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path} is missing: the checkpoint is incomplete; {resume_hint(folder)}")
        return None
    try:
        return load_torch_safely(path)
    except CheckpointError as err:  # refused: it names objects that could run code, or is no plain-data file
        raise CheckpointError(f"{err}; {resume_hint(folder)}") from err
    except Exception as err:  # a truncated zip, a corrupt pickle: name the file
        raise CheckpointError(f"cannot read {path} ({first_line(err)}): the file is truncated or corrupt; "
                              f"{resume_hint(folder)}") from err


def load_error(folder: Path, err: Exception, *, deepspeed: bool = False) -> CheckpointError:
    if is_weights_only_refusal(err):
        return CheckpointError(f"{folder_refusal_message(folder, err, deepspeed=deepspeed)}; {resume_hint(folder)}")
    text = first_line(err)
    if "size mismatch" in str(err) or "shape" in text.lower() or "Error(s) in loading state_dict" in str(err):
        return CheckpointError(
            f"{folder} holds a model of another shape than the recipe builds ({_first_difference(err) or text}); "
            "resume with the recipe the "
            f"checkpoint was written with ({folder.parent.parent / 'recipe.yaml'} if the run finished), or start a new "
            "run in another output.dir"
        )
    bad = first_unreadable_file(folder)
    if bad is None:  # nothing is damaged: no advice that would delete it
        return CheckpointError(f"cannot load checkpoint {folder} ({text}); its files are intact as far as neox_hf can "
                               f"check: resume with the launch and recipe that wrote it, or export its weights with "
                               f"`neox_hf export {folder} OUT`")
    return CheckpointError(f"cannot load checkpoint {folder}: {bad} is truncated or corrupt ({text}); "
                           f"{resume_hint(folder)}")


def _first_difference(err: Exception) -> str | None:
    """The first tensor torch's `load_state_dict` error names, with its two shapes (or which side lacks it); its first
    line, "Error(s) in loading state_dict for NeoXForCausalLM:", says neither."""
    import re

    text = str(err)
    size = re.search(r"size mismatch for ([^:]+): copying a param with shape (torch\.Size\(\[[^\]]*\]\)) from "
                     r"checkpoint, the shape in current model is (torch\.Size\(\[[^\]]*\]\))", text)
    if size:
        name, stored, built = size.groups()
        return f"`{name}` is {_shape(stored)} in the checkpoint, {_shape(built)} in the recipe's model"
    missing = re.search(r'Missing key\(s\) in state_dict: "([^"]+)"', text)
    if missing:
        return f"the recipe's model has `{missing.group(1)}`, the checkpoint does not"
    unexpected = re.search(r'Unexpected key\(s\) in state_dict: "([^"]+)"', text)
    if unexpected:
        return f"the checkpoint has `{unexpected.group(1)}`, the recipe's model does not"
    return None


def _shape(size: str) -> str:
    """"torch.Size([50304, 64])" → "[50304, 64]"."""
    return size[len("torch.Size("):-1]


def first_unreadable_file(folder: Path) -> Path | None:
    """The first weight / state file whose container is damaged (cheap checks: safetensors header and size,
    torch's zip directory), else None."""
    import zipfile

    for path in sorted(folder.rglob("*")):
        if not path.is_file():
            continue
        if path.suffix == ".safetensors":
            if not _safetensors_intact(path):
                return path
        elif path.suffix in (".bin", ".pt", ".pkl", ".pth"):
            if not zipfile.is_zipfile(path):
                return path
    return None


def _safetensors_intact(path: Path) -> bool:
    import json
    import struct

    try:
        with path.open("rb") as handle:
            header_len = struct.unpack("<Q", handle.read(8))[0]
            header = json.loads(handle.read(header_len))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return path.stat().st_size >= 8 + header_len + end
    except Exception:
        return False


def _looks_intact(folder: Path) -> bool:
    """No damage the cheap checks see: accelerate's and DeepSpeed's files, and the layout-free state's sizes."""
    try:
        return first_unreadable_file(folder) is None and (not has_layout_free_state(folder) or
                                                          truncated_file(folder) is None)
    except Exception:  # noqa: BLE001 — unreadable metadata: not a checkpoint to recommend
        return False


def resume_hint(folder: Path) -> str:
    """What to do about a damaged checkpoint `folder`: never `--overwrite` while another checkpoint is intact (it
    deletes the run's checkpoints, a later intact one included)."""
    intact = [p for p in complete_checkpoints(folder.parent) if p != folder and _looks_intact(p)]
    step = checkpoint_step(folder)
    earlier = [p for p in intact if step is not None and checkpoint_step(p) < step]
    delete = f"delete the damaged {folder}"
    if earlier:
        return (f"resume from the previous intact checkpoint with `--train.resume {earlier[-1]}`, or {delete} "
                "(`--resume` then continues from the newest intact one)")
    if intact:
        return (f"no earlier checkpoint is intact: resume from `--train.resume {intact[-1]}`, or {delete} "
                f"(`--resume` then continues from {intact[-1].name}); --overwrite would delete the intact ones too")
    return (f"no other checkpoint is intact: {delete} and run again (`--resume` then starts at step 0), or replace the "
            "run with --overwrite")

