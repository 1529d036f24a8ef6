"""Reading a checkpoint back: the same launch reads accelerate's / DeepSpeed's files (RNG included) or its layout-free
state, another launch the layout-free state (the data position mapped onto its data-parallel size), and a checkpoint
of another kind of launch without one is refused as such, never called damaged."""

from __future__ import annotations

from pathlib import Path

from neox_hf.checkpoint.contents import TrainState
from neox_hf.checkpoint.damage import load_error, read_torch_file, resume_hint
from neox_hf.checkpoint.in_place import OPTIMIZER_FILE, ModelReadBeside, into_held_memory, optimizer_state_tensors
from neox_hf.checkpoint.readahead import read_ahead_in_background
from neox_hf.checkpoint.layout_free import has_layout_free_state, load_from_accelerate_files, load_layout_free
from neox_hf.checkpoint.writer import (check_same_writer, checkpoint_writer, describe_run, layout_free_only,
                                       other_launch_message, run_description, uses_deepspeed, writer_differs)
from neox_hf.errors import CheckpointError, DataError
from neox_hf.io import weights_only_loads


def _load_rng_state(accelerator, folder: Path) -> None:
    """Restore what `_save_rng_state` wrote for this rank, when there (an unreadable file is refused, naming it)."""
    from accelerate.checkpointing import load_accelerator_state

    path = folder / f"random_states_{accelerator.process_index}.pkl"
    if not path.is_file():
        return
    read_torch_file(path, folder)  # refuses a file that names code, or a damaged one, naming it
    with weights_only_loads(deepspeed=False):
        attributes = load_accelerator_state(str(folder), [], [], [], [], accelerator.process_index)
    if "step" in attributes:
        accelerator.step = attributes["step"]


def load_checkpoint(accelerator, folder: Path, *, scheduler, data_loader, engine=None, notify=None) -> TrainState:
    """Restore everything `save_checkpoint` wrote; return the training position.

    A truncated or corrupt file, or a model whose shape no longer matches the checkpoint, raises CheckpointError
    naming the file and the previous checkpoint to resume from instead. A checkpoint another launch wrote (DeepSpeed
    or not, ZeRO stage, data / tensor / pipeline sizes) is resumed from its layout-free state when it has one (and
    the run's `engine` is given; `notify` says what changed), else refused saying which, before anything is read."""
    read_ahead_in_background(folder, accelerator.process_index)
    current = run_description(accelerator, engine)
    writer = checkpoint_writer(folder)
    if engine is not None and (writer_differs(writer, current) or layout_free_only(engine)
                               or has_layout_free_state(folder)) and _layout_free_reader(folder, writer):
        return load_layout_free_checkpoint(engine, folder, writer=writer, scheduler=scheduler,
                                           data_loader=data_loader, notify=notify)
    check_same_writer(folder, current)
    state_file = folder / f"trainer_state_rank{accelerator.process_index}.pt"
    if not state_file.is_file():
        raise CheckpointError(f"{state_file} is missing: the checkpoint is incomplete; {resume_hint(folder)}")
    trainer_state = read_torch_file(state_file, folder)
    # accelerate skips an unreadable (or refused) RNG file with an info log and resumes with other randomness
    read_torch_file(folder / f"random_states_{accelerator.process_index}.pkl", folder, required=False)
    deepspeed = uses_deepspeed(accelerator)
    model_read = ModelReadBeside()  # the weights read into the model, beside accelerate's optimizer unpickling
    in_place = accelerator.register_load_state_pre_hook(model_read)
    # the optimizer file mapped, not read, by accelerate; its bytes then read into the state tensors held here
    held = optimizer_state_tensors(accelerator._optimizers) if _maps_optimizer_file(accelerator, folder) else None
    try:
        with weights_only_loads(deepspeed=deepspeed):  # DeepSpeed's engine loads its files with weights_only=False
            accelerator.load_state(str(folder), load_kwargs=None if held is None else {"mmap": True})
        model_read.wait()
        if held is not None:
            into_held_memory(accelerator._optimizers, held, folder)
    except Exception as err:  # torch / safetensors / DeepSpeed raise many types for the same user problem
        raise load_error(folder, err, deepspeed=deepspeed) from err
    finally:
        in_place.remove()
        model_read.join()  # no thread left writing into the model, whatever failed first
    scheduler.load_state_dict(trainer_state["scheduler"])
    if trainer_state["data"] is not None and hasattr(data_loader, "load_state_dict"):
        data_loader.load_state_dict(trainer_state["data"])
    return TrainState(**trainer_state["train_state"])


def _maps_optimizer_file(accelerator, folder: Path) -> bool:
    """Whether accelerate's load of `folder` may map the optimizer file (read into the optimizer's own tensors
    after, `in_place.into_held_memory`): one optimizer without DeepSpeed, its file a `torch.save` zip (mmap needs
    one; told by its first bytes, as torch tells it: `zipfile.is_zipfile` reads the end of the file, a cold read of
    its own)."""
    path = folder / OPTIMIZER_FILE
    if uses_deepspeed(accelerator) or len(accelerator._optimizers) != 1 or not path.is_file():
        return False
    with path.open("rb") as handle:
        return handle.read(4) == b"PK\x03\x04"


def load_layout_free_checkpoint(engine, folder: Path, *, writer: dict, scheduler, data_loader, notify=None
                                ) -> TrainState:
    """Resume from `folder/layout_free` on this run's layout: parameters, Adam's state, loss scaler, LR schedule,
    counters and the data position (each rank reads the trainer state of a writer rank of its data-parallel rank; on
    another data-parallel size a streamed loader reads every writer data-parallel rank's, to deal out the rest of
    their pass; the loader maps it onto this layout or refuses). Collective."""
    current = run_description(engine.accelerator, engine)
    same_layout = not writer_differs(writer, current)
    own = folder / f"trainer_state_rank{engine.accelerator.process_index}.pt"
    state = read_torch_file(own if same_layout else folder / "trainer_state_rank0.pt", folder)
    resized = _resizes_data_position(writer, engine.layout.dp, data_loader)
    data_state = (state["data"] if same_layout else _writer_data_states(folder, writer) if resized else
                  _writer_rank_data_state(folder, writer, engine.layout.dp_rank))
    if data_state is not None and hasattr(data_loader, "load_state_dict"):
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
        raise CheckpointError(f"{err}; {resume_hint(folder)}") from err
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
    states = [read_torch_file(folder / f"trainer_state_rank{dp_rank * cp * tp}.pt", folder)["data"]
              for dp_rank in range(writer["data_parallel"])]
    return None if any(state is None for state in states) else states


def _writer_rank_data_state(folder: Path, writer: dict, dp_rank: int):
    """The data position a rank of data-parallel rank `dp_rank` continues from: that of the writer's rank with the
    same data-parallel rank (first stage, first TP rank), or rank 0's when the writer had fewer (the loader then
    decides whether the position maps onto this layout)."""
    tp, dp, cp = writer.get("tensor_parallel") or 1, writer.get("data_parallel") or 1, writer.get("context_parallel") or 1
    rank = dp_rank * cp * tp if dp_rank < dp else 0
    return read_torch_file(folder / f"trainer_state_rank{rank}.pt", folder)["data"]
