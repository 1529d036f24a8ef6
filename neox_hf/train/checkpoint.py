"""Resumable training checkpoints: one owner for every piece of state.

Layout under `output.dir/checkpoints/`:
    step_00000010/            accelerator.save_state (model, optimizer, loss scaler, RNG of every rank; under
                              DeepSpeed its engine checkpoint, ZeRO partitions included)
        trainer_state_rank{r}.pt   step, consumed samples, LR scheduler, this rank's data position
    latest                    the name of the newest complete checkpoint

A checkpoint is written to a `.tmp-step_…` folder and renamed only after every rank finished, then `latest` is
replaced atomically, so a crash mid-save leaves the previous checkpoint and pointer intact. Gap filled:
`Accelerator.save_state` writes in place and has no `latest` pointer; its `total_limit` pruning counts folders, not
complete checkpoints.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from neox_hf.errors import CheckpointError

LATEST = "latest"


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    consumed_samples: int = 0  # over all data-parallel ranks
    consumed_tokens: int = 0  # real (non-padding) tokens over all ranks
    skipped_steps: int = 0  # fp16 overflows: counted as iterations (as GPT-NeoX does), no update, LR held


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def save_checkpoint(accelerator, *, output_dir, state: TrainState, scheduler, data_loader, keep_last_n: int,
                    model_config=None, tokenizer=None) -> Path:
    """Write a complete checkpoint atomically; return its folder. Collective: every rank must call it."""
    root = checkpoint_root(output_dir)
    final = root / checkpoint_name(state.step)
    staging = root / f".tmp-{final.name}"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))
    trainer_state = {
        "train_state": asdict(state),
        "scheduler": scheduler.state_dict(),
        "data": data_loader.state_dict() if hasattr(data_loader, "state_dict") else None,
    }
    _atomic_torch_save(trainer_state, staging / f"trainer_state_rank{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        # config + tokenizer make the checkpoint self-describing for `neox_hf export`.
        if model_config is not None:
            model_config.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        _atomic_write_text(root / LATEST, final.name)
        _prune(root, keep_last_n)
    accelerator.wait_for_everyone()
    return final


def _atomic_torch_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _prune(root: Path, keep_last_n: int) -> None:
    complete = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in complete[:-keep_last_n]:
        shutil.rmtree(old, ignore_errors=True)


def find_resume_checkpoint(resume: str | None, output_dir) -> Path | None:
    """`auto` → the `latest` checkpoint under output_dir (None when there is none yet); a path → that checkpoint."""
    if resume is None:
        return None
    if resume == "auto":
        pointer = checkpoint_root(output_dir) / LATEST
        if not pointer.is_file():
            return None
        folder = checkpoint_root(output_dir) / pointer.read_text().strip()
    else:
        folder = Path(resume)
        if (folder / LATEST).is_file():  # a checkpoints/ root was given
            folder = folder / (folder / LATEST).read_text().strip()
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint to resume from not found: {folder}. Use `train.resume: auto` or a step_* folder")
    return folder


def load_checkpoint(accelerator, folder: Path, *, scheduler, data_loader) -> TrainState:
    """Restore everything `save_checkpoint` wrote; return the training position."""
    state_file = folder / f"trainer_state_rank{accelerator.process_index}.pt"
    if not state_file.is_file():
        raise CheckpointError(
            f"{state_file} is missing: the checkpoint was written by a different number of processes or is incomplete; "
            "resume with the same launch layout"
        )
    accelerator.load_state(str(folder))
    try:
        trainer_state = torch.load(state_file, weights_only=True)
    except Exception as err:  # a truncated or corrupt file: name it
        raise CheckpointError(f"cannot read {state_file}: {err}. The checkpoint is corrupt; resume from an earlier one") from err
    scheduler.load_state_dict(trainer_state["scheduler"])
    if trainer_state["data"] is not None and hasattr(data_loader, "load_state_dict"):
        data_loader.load_state_dict(trainer_state["data"])
    return TrainState(**trainer_state["train_state"])
