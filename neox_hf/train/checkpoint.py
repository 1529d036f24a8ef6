"""Resumable training checkpoints: one owner for every piece of state.

Layout under `output.dir/checkpoints/`:
    step_00000010/            accelerator.save_state (model, optimizer, loss scaler, RNG of every rank; under
                              DeepSpeed its engine checkpoint, ZeRO partitions included)
        trainer_state_rank{r}.pt   step, consumed samples, LR scheduler, this rank's data position
    latest                    the name of the newest complete checkpoint

A checkpoint is written to a `.tmp-step_…` folder and renamed only after every rank finished, then `latest` is
replaced atomically, so a crash mid-save leaves the previous checkpoint and pointer intact. Gap filled:
`Accelerator.save_state` writes in place and has no `latest` pointer; its `total_limit` pruning counts folders, not
complete checkpoints, and by name, so after a resume from an earlier step it deleted the new checkpoints.

Pruning keeps the newest `keep_last_n` checkpoints of the current timeline only (see `prune_checkpoints`); a
missing or dangling `latest` falls back, with a notice, to the most recently written complete checkpoint; damaged
files raise `CheckpointError` naming the file and the previous checkpoint.

Nothing a checkpoint holds runs code when read: the trainer state is plain data, the RNG state tensors and numpy arrays,
and every file is unpickled with `weights_only` (neox_hf.io), DeepSpeed's own engine files included, whose loader
passes `weights_only=False`. A file that names anything else is refused, naming it.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from neox_hf.errors import CheckpointError
from neox_hf.io import (TMP_PREFIX, atomic_torch_save, atomic_write_text, folder_refusal_message, is_weights_only_refusal,
                        load_torch_safely, weights_only_loads)

LATEST = "latest"
_STEP_NAME = re.compile(r"step_(\d+)")
# What accelerate.save_state writes for the model: safetensors without DeepSpeed, the engine folder with it.
_MODEL_ENTRIES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model", "pytorch_model.bin")


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
                    model_config=None, tokenizer=None, precision: str | None = None) -> Path:
    """Write a complete checkpoint atomically; return its folder. Collective: every rank must call it. `precision`
    (what ran) is recorded so that a resumed `train.precision: auto` run keeps it (see `checkpoint_precision`)."""
    root = checkpoint_root(output_dir)
    final = root / checkpoint_name(state.step)
    staging = root / f"{TMP_PREFIX}{final.name}"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))
    trainer_state = {
        "train_state": asdict(state),
        "scheduler": scheduler.state_dict(),
        "data": data_loader.state_dict() if hasattr(data_loader, "state_dict") else None,
        "precision": precision,
    }
    atomic_torch_save(trainer_state, staging / f"trainer_state_rank{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        # config + tokenizer make the checkpoint self-describing for `neox_hf export`.
        if model_config is not None:
            model_config.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        # Not neox_hf.io.atomic_folder: every rank writes into the staging folder, so its name must be known to all.
        shutil.rmtree(final, ignore_errors=True)  # a checkpoint of the same step from an abandoned timeline
        os.replace(staging, final)
        atomic_write_text(root / LATEST, final.name)
        prune_checkpoints(root, keep_last_n, current_step=state.step)
    accelerator.wait_for_everyone()
    return final


def checkpoint_step(folder: Path) -> int | None:
    """The step of a `step_XXXXXXXX` folder name, else None."""
    match = _STEP_NAME.fullmatch(folder.name)
    return int(match.group(1)) if match else None


def is_complete_checkpoint(folder: Path) -> bool:
    """A renamed (not staging) step folder that holds the trainer state and the model of rank 0."""
    if checkpoint_step(folder) is None or not folder.is_dir():
        return False
    has_model = any((folder / name).exists() for name in _MODEL_ENTRIES) or any(folder.glob("model*.safetensors"))
    return (folder / "trainer_state_rank0.pt").is_file() and has_model


def complete_checkpoints(root: Path) -> list[Path]:
    """Every complete checkpoint under `root`, by step."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if is_complete_checkpoint(p)), key=checkpoint_step)


def prune_checkpoints(root: Path, keep_last_n: int, *, current_step: int) -> list[Path]:
    """Delete all but the newest `keep_last_n` checkpoints of the current timeline; return what was deleted.

    The timeline is what led to `current_step`: checkpoints at or below it (those this run wrote, and those at or
    below the step it resumed from). A checkpoint above it belongs to a run that went further before someone
    resumed from an earlier step: the user may still need it, so it stays (and is replaced when this run saves
    that step). The checkpoint `latest` names is never deleted.
    """
    pointer = root / LATEST
    protected = pointer.read_text().strip() if pointer.is_file() else None
    timeline = [p for p in complete_checkpoints(root) if checkpoint_step(p) <= current_step]
    doomed = [p for p in timeline[:-keep_last_n] if p.name != protected]
    for old in doomed:
        shutil.rmtree(old, ignore_errors=True)
    return doomed


def find_resume_checkpoint(resume: str | None, output_dir, notify=None) -> Path | None:
    """`auto` → the checkpoint `latest` names under output_dir; a path → that checkpoint (or the `latest` of a
    checkpoints/ root). When `latest` is missing or names a folder that is gone, the most recently written complete
    checkpoint is used and `notify` (default: print to stderr) says so; None only when there is no checkpoint."""
    notify = notify or _print_notice
    if resume is None:
        return None
    if resume == "auto":
        return _latest_or_newest(checkpoint_root(output_dir), notify)
    folder = Path(resume)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint to resume from not found: {folder}. Use `train.resume: auto` or a step_* folder")
    if checkpoint_step(folder) is None and ((folder / LATEST).exists() or complete_checkpoints(folder)):
        found = _latest_or_newest(folder, notify)  # a checkpoints/ root was given
        if found is not None:
            return found
    if not is_complete_checkpoint(folder):
        raise CheckpointError(f"{folder} is not a complete neox_hf checkpoint (no trainer_state_rank0.pt or model "
                              "weights); give a checkpoints/step_* folder or the checkpoints/ folder")
    return folder


def _latest_or_newest(root: Path, notify) -> Path | None:
    pointer = root / LATEST
    named = pointer.read_text().strip() if pointer.is_file() else None
    if named and is_complete_checkpoint(root / named):
        return root / named
    candidates = complete_checkpoints(root)
    if not candidates:
        if named:
            pointer.unlink(missing_ok=True)  # never leave it dangling
            notify(f"{pointer} named {named}, which is gone, and no other checkpoint is complete: starting at step 0")
        return None
    # The most recently written, not the highest step: after a resume from an earlier step, higher-step folders of
    # the abandoned run may remain.
    newest = max(candidates, key=lambda p: ((p / "trainer_state_rank0.pt").stat().st_mtime, checkpoint_step(p)))
    why = f"names {named}, which is missing or incomplete" if named else "is missing"
    atomic_write_text(pointer, newest.name)  # repaired (every rank writes the same name; each rename is atomic)
    notify(f"{pointer} {why}: resuming from the most recently written complete checkpoint, {newest.name} "
           "(latest now names it)")
    return newest


def _print_notice(message: str) -> None:
    print(f"note: {message}", file=sys.stderr)


def previous_checkpoint(folder: Path) -> Path | None:
    """The complete checkpoint before `folder` (by step), to name in an error about `folder`."""
    step = checkpoint_step(folder)
    earlier = [p for p in complete_checkpoints(folder.parent) if step is not None and checkpoint_step(p) < step]
    return earlier[-1] if earlier else None


def load_checkpoint(accelerator, folder: Path, *, scheduler, data_loader) -> TrainState:
    """Restore everything `save_checkpoint` wrote; return the training position.

    A truncated or corrupt file, or a model whose shape no longer matches the checkpoint, raises CheckpointError
    naming the file and the previous checkpoint to resume from instead."""
    state_file = folder / f"trainer_state_rank{accelerator.process_index}.pt"
    if not state_file.is_file():
        raise CheckpointError(
            f"{state_file} is missing: the checkpoint was written by a different number of processes or is incomplete; "
            "resume with the same launch layout"
        )
    trainer_state = _read_torch_file(state_file, folder)
    # accelerate skips an unreadable (or refused) RNG file with an info log and resumes with other randomness
    _read_torch_file(folder / f"random_states_{accelerator.process_index}.pkl", folder, required=False)
    deepspeed = _uses_deepspeed(accelerator)
    try:
        with weights_only_loads(deepspeed=deepspeed):  # DeepSpeed's engine loads its files with weights_only=False
            accelerator.load_state(str(folder))
    except Exception as err:  # torch / safetensors / DeepSpeed raise many types for the same user problem
        raise _load_error(folder, err, deepspeed=deepspeed) from err
    scheduler.load_state_dict(trainer_state["scheduler"])
    if trainer_state["data"] is not None and hasattr(data_loader, "load_state_dict"):
        data_loader.load_state_dict(trainer_state["data"])
    return TrainState(**trainer_state["train_state"])


def checkpoint_precision(folder: Path) -> str | None:
    """The precision a checkpoint was trained in (None for checkpoints written before it was recorded, or unreadable
    ones: `load_checkpoint` reports those)."""
    try:
        state = load_torch_safely(folder / "trainer_state_rank0.pt")
    except Exception:  # noqa: BLE001 — corrupt or missing: load_checkpoint names the file and the fix
        return None
    return state.get("precision") if isinstance(state, dict) else None


def _uses_deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def _read_torch_file(path: Path, folder: Path, *, required: bool = True):
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path} is missing: the checkpoint is incomplete; {_resume_hint(folder)}")
        return None
    try:
        return load_torch_safely(path)
    except CheckpointError as err:  # refused: it names objects that could run code, or is no plain-data file
        raise CheckpointError(f"{err}; {_resume_hint(folder)}") from err
    except Exception as err:  # a truncated zip, a corrupt pickle: name the file
        raise CheckpointError(f"cannot read {path} ({_first_line(err)}): the file is truncated or corrupt; "
                              f"{_resume_hint(folder)}") from err


def _load_error(folder: Path, err: Exception, *, deepspeed: bool = False) -> CheckpointError:
    if is_weights_only_refusal(err):
        return CheckpointError(f"{folder_refusal_message(folder, err, deepspeed=deepspeed)}; {_resume_hint(folder)}")
    text = _first_line(err)
    if "size mismatch" in str(err) or "shape" in text.lower():
        return CheckpointError(
            f"{folder} holds a model of another shape than the recipe builds ({text}); resume with the recipe the "
            f"checkpoint was written with ({folder.parent.parent / 'recipe.yaml'} if the run finished), or start a new "
            "run in another output.dir"
        )
    bad = _first_unreadable_file(folder)
    where = f"{bad} is truncated or corrupt" if bad else f"a file of {folder} is truncated or corrupt"
    return CheckpointError(f"cannot load checkpoint {folder}: {where} ({text}); {_resume_hint(folder)}")


def _first_unreadable_file(folder: Path) -> Path | None:
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


def _resume_hint(folder: Path) -> str:
    previous = previous_checkpoint(folder)
    if previous is None:
        return "no earlier checkpoint is complete: start the run again without --resume (and with --overwrite)"
    return f"resume from the previous checkpoint with `--train.resume {previous}`"


def _first_line(err: BaseException) -> str:
    return next(iter(str(err).strip().splitlines()), type(err).__name__)
