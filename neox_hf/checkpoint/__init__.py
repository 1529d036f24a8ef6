"""Resumable training checkpoints: one owner for every piece of state. This file is the package's face; the code lives in
folders.py (names, `latest`, completeness, pruning, which checkpoint to resume), save.py (the atomic, collective
write, synchronous or in the background: background.py), load.py (the resume on the same or another layout),
layout_free.py (the DCP state under transformers names), writer.py (what launch wrote a checkpoint), contents.py
(`TrainState` and what a checkpoint holds, read without loading), damage.py (naming damaged files and what to
resume instead), run_log.py and imported.py.

Layout under `output.dir/checkpoints/`:
    step_00000010/
        layout_free/               the training state on no layout (torch.distributed.checkpoint: fp32 masters and Adam
                                   moments under transformers names, each rank writing its own chunks): what a launch of
                                   any layout resumes from, the same one exactly
        trainer_state_rank{r}.pt   step, consumed samples, LR scheduler, this rank's data position, Adam's step, writer
        random_states_{r}.pkl      this rank's RNG states
        config.json, tokenizer     what `neox_hf export` needs
      (accelerate's / DeepSpeed's own files instead of `layout_free/` where that state cannot describe the run, or with
      `train.layout_free_checkpoint: false`; one process without DeepSpeed: accelerate's model.safetensors and
      optimizer.bin, which are that state already)
    latest                    the name of the newest complete checkpoint

A checkpoint is written to a `.tmp-step_…` folder and renamed only after every rank finished, then `latest` is
replaced atomically, so a crash mid-save leaves the previous checkpoint and pointer intact. Gap filled:
`Accelerator.save_state` writes in place and has no `latest` pointer; its `total_limit` pruning counts folders, not
complete checkpoints, and by name, so after a resume from an earlier step it deleted the new checkpoints.

Pruning keeps the newest `keep_last_n` checkpoints of the current timeline only (see `prune_checkpoints`); a
missing or dangling `latest` falls back, with a notice, to the most recently written complete checkpoint; damaged
files raise `CheckpointError` naming the file and the previous checkpoint. The trainer state records what wrote the
checkpoint (`writer`: DeepSpeed or not, ZeRO stage, data / tensor / pipeline sizes), read before loading: the same
launch reads accelerate's files (RNG included), another one the layout-free state, and a checkpoint without one (older,
or PEFT) of another kind of launch is refused as such, never called damaged. A save that fills the disk removes its
staging folder and says which checkpoint is intact.

Nothing a checkpoint holds runs code when read: the trainer state is plain data, the RNG state tensors and numpy arrays,
and every file is unpickled with `weights_only` (neox_hf.io), DeepSpeed's own engine files included, whose loader
passes `weights_only=False`. A file that names anything else is refused, naming it.
"""

from neox_hf.checkpoint.contents import TrainState, checkpoint_lora, checkpoint_objective, checkpoint_precision
from neox_hf.checkpoint.damage import first_unreadable_file
from neox_hf.checkpoint.folders import (LATEST, checkpoint_name, checkpoint_root, checkpoint_step, checkpoint_to_read,
                                        complete_checkpoints, find_resume_checkpoint, is_complete_checkpoint,
                                        previous_checkpoint, prune_checkpoints, resume_candidate)
from neox_hf.checkpoint.load import load_checkpoint
from neox_hf.checkpoint.save import SaveAbandoned, save_checkpoint, writes_layout_free
from neox_hf.checkpoint.writer import checkpoint_writer, describe_run, launch_command, run_description

__all__ = ["LATEST", "SaveAbandoned", "TrainState", "checkpoint_lora", "checkpoint_name", "checkpoint_objective",
           "checkpoint_precision", "checkpoint_root", "checkpoint_step", "checkpoint_to_read", "checkpoint_writer",
           "complete_checkpoints", "describe_run", "find_resume_checkpoint", "first_unreadable_file",
           "is_complete_checkpoint", "launch_command", "load_checkpoint", "previous_checkpoint", "prune_checkpoints",
           "resume_candidate", "run_description", "save_checkpoint", "writes_layout_free"]
