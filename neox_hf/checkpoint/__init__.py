"""Resumable training checkpoints: one owner for every piece of state.

Layout under `output.dir/checkpoints/`:
    step_00000010/            accelerator.save_state (model, optimizer, loss scaler, RNG of every rank; under
                              DeepSpeed its engine checkpoint, ZeRO partitions included)
        trainer_state_rank{r}.pt   step, consumed samples, LR scheduler, this rank's data position, Adam's step
        layout_free/          the same training state on no layout (torch.distributed.checkpoint; see layout_free.py):
                              what a launch of another layout resumes from
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

from __future__ import annotations

import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from neox_hf.errors import CheckpointError, print_to_stderr
from neox_hf.checkpoint.layout_free import (has_layout_free_state, load_from_accelerate_files, load_layout_free,
                                            save_layout_free, stored_model_shapes, truncated_file)
from neox_hf.io import (TMP_PREFIX, atomic_torch_save, atomic_write_text, folder_refusal_message, give_umask_modes,
                        is_weights_only_refusal, load_torch_safely, weights_only_loads)

LATEST = "latest"
_STEP_NAME = re.compile(r"step_(\d+)")
# What accelerate.save_state writes for the model: safetensors without DeepSpeed, the engine folder with it; an engine
# whose model Accelerate does not hold (FSDP2) has only the layout-free state (its .metadata is written last).
_MODEL_ENTRIES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model", "pytorch_model.bin",
                  "layout_free/.metadata")


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    consumed_samples: int = 0  # over all data-parallel ranks
    consumed_tokens: int = 0  # real (non-padding) tokens over all ranks
    skipped_steps: int = 0  # fp16 overflows: counted as iterations (as GPT-NeoX does), no update, LR held
    global_batch: int | None = None  # samples per step (micro × accumulation × data-parallel); None: not recorded


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


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
            if engine is not None and engine.has_layout_free_state() and not several and not _uses_deepspeed(accelerator):
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
            raise _save_failed(output_dir, staging, err) from err
    step, in_background = state.step, layout_free_tensors is not None  # publish runs later: the values of now
    publish = (lambda: _publish(root, staging, final, keep_last_n, step)) if accelerator.is_main_process else None
    if in_background:  # the host copy is made here; the write and `publish` follow in the background
        tensors, layout_free_tensors = layout_free_tensors, None
        try:
            background.start(tensors, staging, publish,
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
    if _layout_free_only(engine):
        return True
    one_plain_process = not _uses_deepspeed(accelerator) and accelerator.num_processes == 1
    return asked and (background or not one_plain_process)


def _save_rng_state(accelerator, folder: Path) -> None:
    """This rank's RNG states (Python, numpy, torch, the device's) and accelerate's step counter, in accelerate's
    own file (`random_states_{rank}.pkl`): what `save_state` writes beside the model, without the model."""
    from accelerate.checkpointing import save_accelerator_state

    save_accelerator_state(str(folder), [], [], [], [], accelerator.process_index, accelerator.step)


def _load_rng_state(accelerator, folder: Path) -> None:
    """Restore what `_save_rng_state` wrote for this rank, when there (an unreadable file is refused, naming it)."""
    from accelerate.checkpointing import load_accelerator_state

    path = folder / f"random_states_{accelerator.process_index}.pkl"
    if not path.is_file():
        return
    _read_torch_file(path, folder)  # refuses a file that names code, or a damaged one, naming it
    with weights_only_loads(deepspeed=False):
        attributes = load_accelerator_state(str(folder), [], [], [], [], accelerator.process_index)
    if "step" in attributes:
        accelerator.step = attributes["step"]


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
    """Whether a write into `staging` failed because the folder is gone (a rank's write there can only miss it so)."""
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


def load_checkpoint(accelerator, folder: Path, *, scheduler, data_loader, engine=None, notify=None) -> TrainState:
    """Restore everything `save_checkpoint` wrote; return the training position.

    A truncated or corrupt file, or a model whose shape no longer matches the checkpoint, raises CheckpointError
    naming the file and the previous checkpoint to resume from instead. A checkpoint another launch wrote (DeepSpeed
    or not, ZeRO stage, data / tensor / pipeline sizes) is resumed from its layout-free state when it has one (and
    the run's `engine` is given; `notify` says what changed), else refused saying which, before anything is read."""
    current = run_description(accelerator, engine)
    writer = checkpoint_writer(folder)
    if engine is not None and (writer_differs(writer, current) or _layout_free_only(engine)
                               or has_layout_free_state(folder)) and _layout_free_reader(folder, writer):
        return load_layout_free_checkpoint(engine, folder, writer=writer, scheduler=scheduler,
                                           data_loader=data_loader, notify=notify)
    check_same_writer(folder, current)
    state_file = folder / f"trainer_state_rank{accelerator.process_index}.pt"
    if not state_file.is_file():
        raise CheckpointError(f"{state_file} is missing: the checkpoint is incomplete; {_resume_hint(folder)}")
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


def resume_candidate(resume: str | None, output_dir) -> Path | None:
    """The checkpoint a resume would read, found without repairing `latest` or printing (the resume itself does
    that): for the checks made before the model is built. None where there is none."""
    if resume is None:
        return None
    if resume == "auto":
        root = checkpoint_root(output_dir)
        return checkpoint_to_read(root) if complete_checkpoints(root) else None
    return find_resume_checkpoint(resume, output_dir, notify=lambda message: None)


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


# What wrote a checkpoint. DeepSpeed's files hold each rank's ZeRO partitions and TP / pipeline slices under names of
# that layout, accelerate's plain files the whole model of one process: only a run of the same description reads them.
_LAYOUT_KEYS = ("backend", "deepspeed", "zero_stage", "processes", "data_parallel", "tensor_parallel",
                "pipeline_parallel", "context_parallel")


def _layout_free_only(engine) -> bool:
    return engine is not None and not engine.reads_accelerate_checkpoint


def run_description(accelerator, engine=None) -> dict:
    """The backend (`parallel.backend`, from the run's engine), DeepSpeed or not, its ZeRO stage, and the process /
    data / tensor / pipeline sizes of a prepared run (what `save_checkpoint` records as the trainer state's
    `writer`); None where unknown."""
    backend = {"backend": engine.backend} if engine is not None else {}
    layout = getattr(engine, "layout", None)
    if engine is not None and engine.backend == "fsdp2":  # not DeepSpeed: the sizes are the layout's
        return {**backend, "deepspeed": False, "zero_stage": None, "processes": accelerator.num_processes,
                "data_parallel": layout.dp, "tensor_parallel": layout.tp, "pipeline_parallel": layout.pp,
                "context_parallel": layout.cp}
    return {**backend, **_launch_description(accelerator, getattr(layout, "cp", 1))}


def _launch_description(accelerator, context_parallel: int = 1) -> dict:
    processes = accelerator.num_processes
    if not _uses_deepspeed(accelerator):  # plain Accelerate: one process (several always run through DeepSpeed)
        return {"deepspeed": False, "zero_stage": None, "processes": processes, "data_parallel": processes,
                "tensor_parallel": 1, "pipeline_parallel": 1, "context_parallel": 1}
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    engine = getattr(wrapped, "engine", None)
    if engine is None:  # not prepared yet: what the plugin says
        return {"deepspeed": True, "zero_stage": accelerator.state.deepspeed_plugin.zero_stage, "processes": processes,
                "data_parallel": None, "tensor_parallel": None, "pipeline_parallel": None, "context_parallel": None}
    # DeepSpeed's "model parallel" size counts pipeline stages too, and its data-parallel group holds the
    # context-parallel ranks too; processes = data × context × tensor × pipeline.
    dp_cp, pp = int(engine.dp_world_size), int(getattr(engine, "num_stages", 1))  # only a PipelineEngine has stages
    return {"deepspeed": True, "zero_stage": int(engine.zero_optimization_stage()), "processes": processes,
            "data_parallel": dp_cp // context_parallel, "tensor_parallel": processes // (dp_cp * pp),
            "pipeline_parallel": pp, "context_parallel": context_parallel}


def checkpoint_writer(folder: Path) -> dict | None:
    """What wrote `folder` (`run_description` of that run); for a checkpoint written before it was recorded, what its
    files show (DeepSpeed or not, the number of processes). None when rank 0's trainer state is unreadable
    (`load_checkpoint` reports that)."""
    try:
        state = load_torch_safely(folder / "trainer_state_rank0.pt")
    except Exception:  # noqa: BLE001 — corrupt or missing: reported by the load, naming the file
        return None
    if isinstance(state, dict) and isinstance(state.get("writer"), dict):
        return state["writer"]
    return {"deepspeed": (folder / "pytorch_model").is_dir(),
            "processes": len(list(folder.glob("trainer_state_rank*.pt")))}


def writer_differs(writer: dict | None, current: dict) -> bool:
    """Whether a checkpoint of `writer` cannot be read by accelerate's per-rank files in the `current` run."""
    return writer is not None and any(writer.get(k) is not None and current.get(k) is not None and
                                      _comparable(k, writer[k]) != _comparable(k, current[k]) for k in _LAYOUT_KEYS)


def load_layout_free_checkpoint(engine, folder: Path, *, writer: dict, scheduler, data_loader, notify=None
                                ) -> TrainState:
    """Resume from `folder/layout_free` on this run's layout: parameters, Adam's state, loss scaler, LR schedule,
    counters and the data position (each rank reads the trainer state of a writer rank of its data-parallel rank; on
    another data-parallel size a streamed loader reads every writer data-parallel rank's, to deal out the rest of
    their pass; the loader maps it onto this layout or refuses). Collective."""
    current = run_description(engine.accelerator, engine)
    same_layout = not writer_differs(writer, current)
    own = folder / f"trainer_state_rank{engine.accelerator.process_index}.pt"
    state = _read_torch_file(own if same_layout else folder / "trainer_state_rank0.pt", folder)
    resized = _resizes_data_position(writer, engine.layout.dp, data_loader)
    data_state = (state["data"] if same_layout else _writer_data_states(folder, writer) if resized else
                  _writer_rank_data_state(folder, writer, engine.layout.dp_rank))
    if data_state is not None and hasattr(data_loader, "load_state_dict"):
        from neox_hf.errors import DataError

        try:  # first: a position that cannot move refuses the resume before any tensor is read
            if resized:
                data_loader.load_resized_states(data_state)
            else:
                data_loader.load_state_dict(data_state)
        except DataError as err:
            raise CheckpointError(other_launch_message(folder, writer, current, why=str(err))) from err
    notify = notify or engine.accelerator.print
    if not same_layout:
        notify(f"resuming step {state['train_state']['step']} written by {describe_run(writer)} on "
               f"{describe_run(current)}")
        if data_state is not None and hasattr(data_loader, "describe_position"):
            notify(data_loader.describe_position())
    try:
        engine.load_layout_free_state(_layout_free_reader(folder, writer), state["layout_free"])
    except CheckpointError as err:
        if "truncated or corrupt" not in str(err):  # another model: an earlier checkpoint would be refused alike
            raise
        raise CheckpointError(f"{err}; {_resume_hint(folder)}") from err
    scheduler.load_state_dict(state["scheduler"])
    if same_layout:  # dropout and the rest continue as if never stopped; another layout draws its own
        _load_rng_state(engine.accelerator, folder)
    return TrainState(**state["train_state"])


def _layout_free_reader(folder: Path, writer: dict | None):
    """How to fill an engine's layout-free targets from `folder`, or None when it holds no layout-free state."""
    if has_layout_free_state(folder):
        return lambda targets: load_layout_free(targets, folder)
    one_plain_process = writer and not writer.get("deepspeed") and writer.get("processes") == 1
    if one_plain_process and (folder / "optimizer.bin").is_file() and (folder / "model.safetensors").is_file():
        return lambda targets: load_from_accelerate_files(targets, folder)
    return None


def _resizes_data_position(writer: dict, dp_size: int, data_loader) -> bool:
    """Whether this run has another data-parallel size than the writer and a loader that deals the old ranks'
    streamed positions out to its ranks (the gpt-neox order's position is layout-free and needs no dealing)."""
    old = writer.get("data_parallel")
    return bool(old) and old != dp_size and hasattr(data_loader, "load_resized_states")


def _writer_data_states(folder: Path, writer: dict):
    """Every writer data-parallel rank's data position, index = its data-parallel rank (read from its first stage's
    first TP rank: rank = dp_rank × tp), or None when the writer saved none."""
    tp, cp = writer.get("tensor_parallel") or 1, writer.get("context_parallel") or 1
    states = [_read_torch_file(folder / f"trainer_state_rank{dp_rank * cp * tp}.pt", folder)["data"]
              for dp_rank in range(writer["data_parallel"])]
    return None if any(state is None for state in states) else states


def _writer_rank_data_state(folder: Path, writer: dict, dp_rank: int):
    """The data position a rank of data-parallel rank `dp_rank` continues from: that of the writer's rank with the
    same data-parallel rank (first stage, first TP rank), or rank 0's when the writer had fewer (the loader then
    decides whether the position maps onto this layout)."""
    tp, dp, cp = writer.get("tensor_parallel") or 1, writer.get("data_parallel") or 1, writer.get("context_parallel") or 1
    rank = dp_rank * cp * tp if dp_rank < dp else 0
    return _read_torch_file(folder / f"trainer_state_rank{rank}.pt", folder)["data"]


def check_same_writer(folder: Path, current: dict) -> None:
    """Refuse, before loading, a checkpoint written by another kind of launch, naming both: its files are intact but
    this run cannot read them (the loaders then fail on a missing or misshapen file, which looks like damage)."""
    writer = checkpoint_writer(folder)
    if writer is None:
        return
    differ = [k for k in _LAYOUT_KEYS if writer.get(k) is not None and current.get(k) is not None
              and _comparable(k, writer[k]) != _comparable(k, current[k])]
    if not differ:
        return
    raise CheckpointError(other_launch_message(folder, writer, current))


def other_launch_message(folder: Path, writer: dict, current: dict, *, why: str = "") -> str:
    """One line: what wrote `folder`, what this run is, why it cannot continue it, and what to do instead."""
    reason = f" ({why})" if why else ""
    return (f"{folder} was written by {describe_run(writer)}; this run is {describe_run(current)}, which cannot read "
            f"it{reason} (the checkpoint is intact): resume with the launch that wrote it, {launch_command(writer)}, "
            f"or export its weights with `neox_hf export {folder} OUT` and start a new run from them with "
            "`--model.from_pretrained OUT`")


def _comparable(key: str, value):
    # ZeRO-1 and ZeRO-2 write one optimizer-state format (DeepSpeed's stage_1_and_2.py): either resumes the other.
    return "1-2" if key == "zero_stage" and value in (1, 2) else value


def describe_run(run: dict) -> str:
    """E.g. 'DeepSpeed ZeRO-1 on 2 processes', '1 process without DeepSpeed', 'DeepSpeed ZeRO-1 on 4 processes
    (2 data-parallel × tensor parallel 2)', 'FSDP2 on 2 processes (1 data-parallel × context parallel 2)'."""
    count = run.get("processes")
    processes = f"{count} process{'es' if count != 1 else ''}" if count else "an unknown number of processes"
    if run.get("backend") == "gpt-neox":  # a GPT-NeoX run's state, imported by `neox_hf continue-neox`
        return f"GPT-NeoX ({describe_run({**run, 'backend': 'deepspeed'})})"
    if run.get("backend") != "fsdp2" and not run.get("deepspeed"):
        return f"{processes} without DeepSpeed"
    if run.get("backend") == "fsdp2":
        stage = "FSDP2"
    else:
        stage = f"DeepSpeed ZeRO-{run['zero_stage']}" if run.get("zero_stage") is not None else "DeepSpeed"
    tp, pp, cp = run.get("tensor_parallel") or 1, run.get("pipeline_parallel") or 1, run.get("context_parallel") or 1
    if tp == 1 and pp == 1 and cp == 1:
        return f"{stage} on {processes}"
    sizes = [f"{run.get('data_parallel')} data-parallel"] + ([f"context parallel {cp}"] if cp > 1 else []) + (
        [f"tensor parallel {tp}"] if tp > 1 else []) + ([f"{pp} pipeline stages"] if pp > 1 else [])
    return f"{stage} on {processes} ({' × '.join(sizes)})"


def launch_command(run: dict) -> str:
    """The command that resumes a run of this description."""
    if run.get("backend") == "fsdp2":
        return (f"`torchrun --standalone --nproc_per_node {run.get('processes') or 'N'} run_clm_neox.py RECIPE "
                "--parallel.backend fsdp2 --resume`")
    if run.get("backend") == "gpt-neox":
        return "GPT-NeoX's own launcher on the checkpoint continue-neox read (`deepy.py train.py CONFIG`)"
    if not run.get("deepspeed"):
        return "`python run_clm_neox.py RECIPE --parallel.zero_stage 0 --resume`"
    options = "".join(f" --parallel.{key} {run[key]}" for key in ("zero_stage", "tensor_parallel", "pipeline_parallel",
                                                                  "context_parallel")
                      if run.get(key) is not None and (key == "zero_stage" or run[key] > 1))
    count = run.get("processes")
    if count == 1:
        return f"`python run_clm_neox.py RECIPE{options} --resume`"
    return (f"`accelerate launch --use_deepspeed --num_processes {count or 'N'} run_clm_neox.py RECIPE{options} "
            "--resume`")


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
                           f"{_resume_hint(folder)}")


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


def _resume_hint(folder: Path) -> str:
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


def _first_line(err: BaseException) -> str:
    return next(iter(str(err).strip().splitlines()), type(err).__name__)
