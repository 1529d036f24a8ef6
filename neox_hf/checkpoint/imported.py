"""A run folder whose one checkpoint was made from another trainer's training state (`neox_hf continue-neox`).

It holds what `save_checkpoint` writes for the layout-free resume and nothing of a layout: `checkpoints/step_N/`
with `layout_free/` (fp32 masters and Adam's moments under transformers names, full shapes, written by DCP in this
one process), `trainer_state_rank{r}.pt` for each rank a resume reads (`load_layout_free_checkpoint`: rank
dp_rank × tp of the writer), the model config and tokenizer; then `checkpoints/latest`. The writer it records
(`backend` of the foreign trainer) differs from every neox_hf launch, so every launch resumes it through the
layout-free state. The whole run folder is staged beside `out_dir` and renamed into place: a failure leaves nothing.
"""

from __future__ import annotations

from pathlib import Path

from neox_hf.checkpoint.folders import LATEST, checkpoint_name, checkpoint_root
from neox_hf.checkpoint.layout_free import save_layout_free
from neox_hf.errors import CheckpointError
from neox_hf.io import atomic_folder, atomic_torch_save, atomic_write_text


def check_empty_run_folder(out_dir) -> None:
    """Refuse an `out_dir` that holds anything: a run folder is made whole or not at all."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} is not an empty folder: give a new --out (the run folder to continue in)")


def write_imported_checkpoint(out_dir, step: int, tensors: dict, trainer_state: dict, *, ranks: list[int],
                              model_config=None, tokenizer=None) -> Path:
    """Write `out_dir/checkpoints/step_{step}` (+ `latest`) from `tensors` (`model|exp_avg|exp_avg_sq/<name>`: full
    tensors) and the plain `trainer_state` (one file per rank in `ranks`); return the step folder."""
    check_empty_run_folder(out_dir)
    out = Path(out_dir)
    if out.is_dir():
        out.rmdir()  # empty: replaced by the staged folder
    with atomic_folder(out, replace=False) as staging:
        folder = checkpoint_root(staging) / checkpoint_name(step)
        folder.mkdir(parents=True)
        save_layout_free(tensors, folder)
        for rank in ranks:
            atomic_torch_save(trainer_state, folder / f"trainer_state_rank{rank}.pt")
        if model_config is not None:
            model_config.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        atomic_write_text(checkpoint_root(staging) / LATEST, folder.name)
    return checkpoint_root(out) / checkpoint_name(step)

