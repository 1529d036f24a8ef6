"""Writing a checkpoint: into a `.tmp-step_…` staging folder, renamed into place only after every rank finished, then
`latest` moved and old checkpoints pruned; synchronously or, with `train.async_checkpoint`, in the background
(background.py). A failed save removes its staging folder and says which checkpoint is intact."""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict
from pathlib import Path

from neox_hf.checkpoint.contents import TrainState
from neox_hf.checkpoint.folders import LATEST, checkpoint_name, checkpoint_root, is_complete_checkpoint, prune_checkpoints
from neox_hf.checkpoint.layout_free import save_layout_free
from neox_hf.checkpoint.writer import layout_free_only, run_description, uses_deepspeed
from neox_hf.errors import CheckpointError
from neox_hf.io import TMP_PREFIX, atomic_torch_save, atomic_write_text, give_umask_modes


def save_checkpoint(accelerator, *, output_dir, state: TrainState, scheduler, data_loader, keep_last_n: int,
                    model_config=None, tokenizer=None, precision: str | None = None, engine=None,
                    write_layout_free: bool = True, background=None) -> Path:
    """Write a complete checkpoint atomically; return its folder. Collective: every rank must call it. `precision`
    (what ran) is recorded so that a resumed `train.precision: auto` run keeps it (see `checkpoint_precision`).

    One format (`writes_layout_free`): with the run's `engine`, its layout-free state (`layout_free/`, which any
    layout resumes, the same one exactly) plus each rank's trainer state and RNG; accelerate's / DeepSpeed's per-rank
    files only where that state cannot describe the run (no `engine`: PEFT under DeepSpeed, optimizers other than
    Adam; a pipeline with tied embeddings), where `write_layout_free` is False (`train.layout_free_checkpoint`), and
    for one process without DeepSpeed, whose accelerate files are the layout-free state already. With `background`
    (a `BackgroundWrites`, `train.async_checkpoint`) the tensors are only copied to host memory here: the folder is
    renamed into place and `latest` moved once every rank's write is complete."""
    root = checkpoint_root(output_dir)
    final = root / checkpoint_name(state.step)
    staging = root / f"{TMP_PREFIX}{final.name}"
    several = accelerator.num_processes > 1
    if background is not None:
        background.wait()  # the write in flight is published first (or its failure reported, as a save's)
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    layout_free_tensors = None
    try:
        layout_free = None
        if writes_layout_free(accelerator, engine, write_layout_free, background=background is not None):
            layout_free_tensors, layout_free = engine.layout_free_state()
            _save_rng_state(accelerator, staging)
            if background is None:
                save_layout_free(layout_free_tensors, staging)
                layout_free_tensors = None
        else:
            accelerator.save_state(str(staging))
            if engine is not None and engine.has_layout_free_state() and not several and not uses_deepspeed(accelerator):
                layout_free = engine.layout_free_state()[1]  # Adam's step and the scaler, beside accelerate's files
        trainer_state = {
            "layout_free": layout_free,
            "train_state": asdict(state),
            "scheduler": scheduler.state_dict(),
            "data": data_loader.state_dict() if hasattr(data_loader, "state_dict") else None,
            "precision": precision,
            "writer": run_description(accelerator, engine),
        }
        atomic_torch_save(trainer_state, staging / f"trainer_state_rank{accelerator.process_index}.pt")
    except Exception as err:
        raise _save_failed(output_dir, staging, err, several=several) from err
    if accelerator.is_main_process:
        try:  # config + tokenizer make the checkpoint self-describing for `neox_hf export`. Here, not in the background
            # (a fast tokenizer used by the data thread meanwhile may refuse a second borrower): ~2 MB
            if model_config is not None:
                model_config.save_pretrained(staging)
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)
        except Exception as err:
            raise _save_failed(output_dir, staging, err, several=several) from err
    step, in_background = state.step, layout_free_tensors is not None  # publish runs later: the values of now
    publish = (lambda: _publish(root, staging, final, keep_last_n, step)) if accelerator.is_main_process else None
    if in_background:  # the host copy is made here; the write and `publish` follow in the background
        tensors, layout_free_tensors = layout_free_tensors, None
        try:
            background.start(tensors, staging, publish, optimizer=engine.optimizer,
                             failed=lambda err: _save_failed(output_dir, staging, err, several=several))
        except Exception as err:
            raise _save_failed(output_dir, staging, err, several=several) from err
        return final
    accelerator.wait_for_everyone()
    if publish is not None:
        publish()
    accelerator.wait_for_everyone()
    return final


def _publish(root: Path, staging: Path, final: Path, keep_last_n: int, step: int) -> None:
    """Rank 0, once every rank's part is written: rename the staging folder into place, move `latest`, prune."""
    # Not neox_hf.io.atomic_folder: every rank writes into the staging folder, so its name must be known to all.
    give_umask_modes(staging)  # safetensors writes the weights 0600
    shutil.rmtree(final, ignore_errors=True)  # a checkpoint of the same step from an abandoned timeline
    os.replace(staging, final)
    atomic_write_text(root / LATEST, final.name)
    prune_checkpoints(root, keep_last_n, current_step=step)


def writes_layout_free(accelerator, engine, asked: bool = True, *, background: bool = False) -> bool:
    """Whether a checkpoint of this run is its layout-free state (DCP) plus the small per-rank states, rather than
    accelerate's `save_state` files (see `save_checkpoint`)."""
    if engine is None or not engine.has_layout_free_state():
        return False
    if layout_free_only(engine):
        return True
    one_plain_process = not uses_deepspeed(accelerator) and accelerator.num_processes == 1
    return asked and (background or not one_plain_process)


def _save_rng_state(accelerator, folder: Path) -> None:
    """This rank's RNG states (Python, numpy, torch, the device's) and accelerate's step counter, in accelerate's
    own file (`random_states_{rank}.pkl`): what `save_state` writes beside the model, without the model."""
    from accelerate.checkpointing import save_accelerator_state

    save_accelerator_state(str(folder), [], [], [], [], accelerator.process_index, accelerator.step)


class SaveAbandoned(RuntimeError):
    """This rank's part of a checkpoint failed because another rank's failed save removed the staging folder under it:
    the cause is that rank's error (which it reports), not this one."""


def _save_failed(output_dir, staging: Path, err: Exception, *, several: bool = False) -> Exception:
    """Remove the half-written `staging` (on a full disk it holds the space a retry needs, ~100 MB for a tiny model)
    and return what to raise: for a full disk one line saying so and which checkpoint is intact (safetensors and
    torch.save report it in their own words: `SafetensorError ... os error 28`, `[enforce fail at
    inline_container.cc]`); SaveAbandoned when another rank's failure removed the staging first (`several` ranks
    write into it); anything else as it was. The failed rank then exits at once (`neox_hf.cli.train_main`), and the
    launcher ends the ranks still waiting in the save's collectives."""
    if several and _staging_removed(err, staging):
        return SaveAbandoned(f"another rank's failed save removed {staging} while this rank wrote into it ({err})")
    full = _out_of_space(err, staging.parent)
    shutil.rmtree(staging, ignore_errors=True)
    if not full:
        return err
    root, name = staging.parent, staging.name.removeprefix(TMP_PREFIX)
    pointer = root / LATEST
    previous = pointer.read_text().strip() if pointer.is_file() else None
    kept = (f"the previous checkpoint, {previous}, is intact" if previous and is_complete_checkpoint(root / previous)
            else "no earlier checkpoint was written")
    return CheckpointError(f"no space left on {output_dir} while saving checkpoint {name}: {kept}, and the partial "
                           f"{name} was removed; free space (or lower `train.keep_last_n`), then continue with "
                           "--resume")


def _staging_removed(err: BaseException, staging: Path) -> bool:
    """Whether a write into `staging` failed because the folder is gone (a rank's write there can only miss it so).
    The folder's absence decides where the error does not name it: the tokenizers library reports a missing folder
    as `Exception: No such file or directory (os error 2)`."""
    if not staging.exists():
        return True
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, FileNotFoundError) and str(staging) in str(cause):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def _out_of_space(err: BaseException, folder: Path) -> bool:
    """Whether a failed write ran out of disk: ENOSPC / EDQUOT anywhere in the chain, a library's text for it, or
    (torch's zip writer only says `unexpected pos`) next to no space left on the folder's filesystem."""
    import errno

    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(cause) for text in ("No space left on device", "os error 28", "Disk quota exceeded")):
            return True
        cause = cause.__cause__ or cause.__context__
    try:
        return shutil.disk_usage(folder).free < 16 << 20
    except OSError:
        return False
