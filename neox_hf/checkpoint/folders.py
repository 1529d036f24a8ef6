"""The checkpoint folders under `output.dir/checkpoints/`: their names, the `latest` pointer, which are complete, which
to resume from (a missing or dangling `latest` falls back, with a notice, to the most recently written complete one),
and pruning to the newest `keep_last_n` of the current timeline."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from neox_hf.errors import CheckpointError, print_to_stderr
from neox_hf.io import atomic_write_text


LATEST = "latest"


_STEP_NAME = re.compile(r"step_(\d+)")


# What accelerate.save_state writes for the model: safetensors without DeepSpeed, the engine folder with it; an engine
# whose model Accelerate does not hold (FSDP2) has only the layout-free state (its .metadata is written last).
_MODEL_ENTRIES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model", "pytorch_model.bin",
                  "layout_free/.metadata")


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


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
    if _is_gpt_neox_checkpoint(folder):  # before `latest` is read: its pointer names a global_stepN, never repaired
        raise CheckpointError(f"{folder} is a GPT-NeoX (DeepSpeed) checkpoint, not a neox_hf one: continue that run "
                              f"with `neox_hf continue-neox {folder} --config CONFIG.yml --out RUN`, then "
                              "`--output.dir RUN --resume`")
    if checkpoint_step(folder) is None and ((folder / LATEST).exists() or complete_checkpoints(folder)):
        found = _latest_or_newest(folder, notify)  # a checkpoints/ root was given
        if found is not None:
            return found
    if not is_complete_checkpoint(folder):
        raise CheckpointError(f"{folder} is not a complete neox_hf checkpoint (no trainer_state_rank0.pt or model "
                              "weights); give a checkpoints/step_* folder or the checkpoints/ folder")
    return folder


def _is_gpt_neox_checkpoint(folder: Path) -> bool:
    """A GPT-NeoX `global_stepN/` (DeepSpeed's *model_states.pt files) or the folder whose `latest` names one."""
    named = _pointer_name(folder)
    return any(folder.glob("*model_states.pt")) or bool(named and named.startswith("global_step")
                                                        and (folder / named).is_dir())


def checkpoint_to_read(folder: Path) -> Path:
    """The step folder a reader (`neox_hf export`) means by `folder`: a step folder itself (DeepSpeed writes a `latest`
    of its own inside, naming its engine folder, which is not a checkpoint), or for a checkpoints/ root the one its
    `latest` names, else its most recently written complete one. Reads only: a dangling pointer is left for the
    resume to repair. Anything else is returned as given, for the caller to say what it lacks."""
    if checkpoint_step(folder) is not None or (folder / "trainer_state_rank0.pt").is_file():
        return folder
    named = _pointer_name(folder)
    if named and is_complete_checkpoint(folder / named):
        return folder / named
    newest = _newest_complete(folder)
    if newest is None:
        return folder / named if named else folder
    return newest


def _pointer_name(root: Path) -> str | None:
    """The folder name `latest` holds, or None without one."""
    pointer = root / LATEST
    return pointer.read_text().strip() if pointer.is_file() else None


def _newest_complete(root: Path) -> Path | None:
    """The most recently written complete checkpoint, not the highest step: after a resume from an earlier step,
    higher-step folders of the abandoned run may remain."""
    candidates = complete_checkpoints(root)
    if not candidates:
        return None
    return max(candidates, key=lambda p: ((p / "trainer_state_rank0.pt").stat().st_mtime, checkpoint_step(p)))


def _latest_or_newest(root: Path, notify) -> Path | None:
    pointer = root / LATEST
    named = _pointer_name(root)
    if named and is_complete_checkpoint(root / named):
        return root / named
    newest = _newest_complete(root)
    if newest is None:
        if named:
            pointer.unlink(missing_ok=True)  # never leave it dangling
            notify(f"{pointer} named {named}, which is gone, and no other checkpoint is complete: starting at step 0")
        return None
    why = f"names {named}, which is missing or incomplete" if named else "is missing"
    atomic_write_text(pointer, newest.name)  # repaired (every rank writes the same name; each rename is atomic)
    notify(f"{pointer} {why}: resuming from the most recently written complete checkpoint, {newest.name} "
           "(latest now names it)")
    return newest


def _print_notice(message: str) -> None:
    print_to_stderr(f"note: {message}")


def previous_checkpoint(folder: Path) -> Path | None:
    """The complete checkpoint before `folder` (by step), to name in an error about `folder`."""
    step = checkpoint_step(folder)
    earlier = [p for p in complete_checkpoints(folder.parent) if step is not None and checkpoint_step(p) < step]
    return earlier[-1] if earlier else None


def resume_candidate(resume: str | None, output_dir) -> Path | None:
    """The checkpoint a resume would read, found without repairing `latest` or printing (the resume itself does
    that): for the checks made before the model is built. None where there is none."""
    if resume is None:
        return None
    if resume == "auto":
        root = checkpoint_root(output_dir)
        return checkpoint_to_read(root) if complete_checkpoints(root) else None
    return find_resume_checkpoint(resume, output_dir, notify=lambda message: None)
