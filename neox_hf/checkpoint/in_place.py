"""Reading a one-process checkpoint's `model.safetensors` straight into the model's parameters, and its
`optimizer.bin` into the optimizer's own state tensors.

Gap filled: accelerate's `load_state` loads the model with safetensors' `load_model`, which reads every tensor into
new memory (`load_file`) and then copies it into the model (`load_state_dict`): the weights cross memory twice, and
on a busy host the copy is a quarter of the resume (0.2 s of 0.8 s for a 70M-parameter model here). The file's header
says where each tensor's bytes lie, so they can be read into the parameters' own memory. Accelerate lets a load-state
pre-hook load a model itself and take it off the list it loads (`Accelerator.register_load_state_pre_hook`); where
the file and the model do not match exactly (names, shapes, dtypes, a parameter off the host), the hook leaves the
model to accelerate, whose errors name the difference.
"""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path

from neox_hf.errors import CheckpointError

MODEL_FILE = "model.safetensors"  # accelerate's name for the first model's weights
_HEADER_LIMIT = 100 << 20  # safetensors' own bound on a header


def _dtypes() -> dict:
    import torch

    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
            "BOOL": torch.bool}


def _header(path: Path) -> tuple[dict, int] | None:
    """(the tensors' entries, where their bytes start) of a safetensors file, or None where it is no whole one."""
    try:
        with path.open("rb") as handle:
            length = struct.unpack("<Q", handle.read(8))[0]
            if length > _HEADER_LIMIT:
                return None
            entries = json.loads(handle.read(length))
    except (OSError, struct.error, ValueError):
        return None
    entries.pop("__metadata__", None)
    return entries, 8 + length


def _read_plan(path: Path, state: dict) -> list | None:
    """(start, end, tensor) for every stored tensor, where each lands in a tensor of `state` of its dtype and shape,
    on the host and contiguous, every tensor of `state` it lacks shares the memory of one it holds (tied weights,
    which safetensors stores once), and the file is long enough; else None."""
    found = _header(path)
    if found is None:
        return None
    entries, data_start = found
    if set(entries) - set(state):
        return None
    dtypes, plan, filled = _dtypes(), [], set()
    for name, entry in entries.items():
        tensor = state[name]
        if (dtypes.get(entry.get("dtype")) != tensor.dtype or list(entry.get("shape", ())) != list(tensor.shape)
                or tensor.device.type != "cpu" or not tensor.is_contiguous()):
            return None
        start, end = (data_start + offset for offset in entry["data_offsets"])
        if end - start != tensor.numel() * tensor.element_size():
            return None
        plan.append((start, end, tensor))
        filled.add(tensor.data_ptr())
    if any(tensor.data_ptr() not in filled for name, tensor in state.items() if name not in entries):
        return None
    if max((end for _, end, _ in plan), default=data_start) > path.stat().st_size:
        return None  # truncated: safetensors' own load names it
    return sorted(plan, key=lambda item: item[0])


def read_model_in_place(model, path: Path) -> bool:
    """Fill `model`'s parameters and buffers from safetensors file `path` in place; False (nothing read) where the
    file and the model do not match exactly (see `_read_plan`)."""
    plan = _read_plan(path, model.state_dict())
    if plan is None:
        return False
    _fill(path, plan)
    return True


def _fill(path: Path, plan: list) -> None:
    """Read each (start, end, tensor) of `plan` from `path` into its tensor, in file order."""
    with path.open("rb", buffering=0) as stream:  # queued at the load's start (`readahead`)
        for start, _, tensor in plan:
            if not read_into(stream, start, tensor):
                raise CheckpointError(f"{path} ends before the tensors its header lists: the file is truncated")


class ModelReadBeside:
    """Accelerate's load-state pre-hook that reads the first model from `input_dir`'s `model.safetensors` in place
    (see `read_model_in_place`) on a thread of its own and takes it off the list accelerate goes on to load, where
    it matches; `wait()` then waits for the read and raises what it raised (`join()` only waits).

    Why a thread: accelerate unpickles the optimizer file next, CPU work that left the disk idle for a fifth of a
    one-process resume here; the weights' reads (the GIL released while the kernel copies) go on meanwhile. Nothing
    touches the model's weights until `wait()`: the optimizer's load maps its state onto the parameters by position.
    One model only: accelerate names a second model's file by its position in that list, which taking the first off
    would shift."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def __call__(self, models: list, input_dir: str) -> None:
        path = Path(input_dir) / MODEL_FILE
        plan = _read_plan(path, models[0].state_dict()) if len(models) == 1 and path.is_file() else None
        if plan is None:
            return
        models.pop(0)
        self._thread = threading.Thread(target=self._read, args=(path, plan), name="neox_hf-model-read", daemon=True)
        self._thread.start()

    def _read(self, path: Path, plan: list) -> None:
        try:
            _fill(path, plan)
        except BaseException as err:  # raised again on the caller's thread by `wait`
            self._error = err

    def join(self) -> None:
        """Wait for the read, if one runs; raise nothing (`wait` does)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def wait(self) -> None:
        self.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error


OPTIMIZER_FILE = "optimizer.bin"  # accelerate's name for the first optimizer's state


def optimizer_state_tensors(optimizers: list) -> dict:
    """Every state tensor of `optimizers` (accelerate's wrappers unwrapped), keyed (optimizer, parameter, key) by
    identity: held across `load_state` so that the loaded values go into this memory (`into_held_memory`)."""
    return {(number, id(param), key): value for number, optimizer in enumerate(_unwrapped(optimizers))
            for param, state in optimizer.state.items() for key, value in state.items() if _is_tensor(value)}


def into_held_memory(optimizers: list, held: dict, folder: Path) -> None:
    """After accelerate's `load_state` mapped the optimizer file (`load_kwargs={"mmap": True}`: nothing read yet),
    read each host state tensor's bytes from the file into the tensor `optimizer_state_tensors` held for it where
    shape and dtype agree (else into new memory), in file order, and put that in the state: no state stays backed by
    the checkpoint's file, and its mapped pages are never touched.

    Gap filled: accelerate's load reads every optimizer tensor into new memory, each page faulted in on first touch,
    and `Optimizer.load_state_dict` then drops the tensors the optimizer held: 0.55 s of a 0.85 GB one-process
    resume's 0.7 s of CPU time here. Where a tensor's place in the file cannot be told (see `_file_offsets`), it is
    copied from the mapping instead."""
    import torch

    loaded = [(number, param, state, key, value) for number, optimizer in enumerate(_unwrapped(optimizers[:1]))
              for param, state in optimizer.state.items() for key, value in state.items()
              if _is_tensor(value) and value.device.type == "cpu"]
    path = Path(folder) / OPTIMIZER_FILE
    offsets = _file_offsets(path, [value for *_, value in loaded])
    loaded.sort(key=lambda item: offsets.get(id(item[4]), 0))
    with torch.no_grad(), path.open("rb", buffering=0) as stream:
        for number, param, state, key, value in loaded:
            home = held.get((number, id(param), key))
            if home is None or home.shape != value.shape or home.dtype != value.dtype or home.device != value.device:
                home = torch.empty_like(value, memory_format=torch.contiguous_format)
            at = offsets.get(id(value))
            if at is not None and value.is_contiguous() and home.is_contiguous():
                if not read_into(stream, at, home):
                    raise CheckpointError(f"{path} ends before the optimizer state it lists: the file is truncated")
            else:
                home.copy_(value)
            state[key] = home


def _file_offsets(path: Path, tensors: list) -> dict:
    """id(tensor) → where its bytes start in the `torch.save` zip `path`, for tensors `torch.load(mmap=True)` mapped
    from it; {} where that cannot be told. torch maps the whole file once and points each storage at its record, so
    a storage's address less the mapping's start is its record's offset (from torch's own zip reader): the start is
    taken from the lowest address and record and kept only if every storage then lands on a record."""
    import torch

    try:
        reader = torch._C.PyTorchFileReader(str(path))
        records = sorted(reader.get_record_offset(name) for name in reader.get_all_records()
                         if name.rpartition("/")[0].endswith("data"))
    except (AttributeError, RuntimeError, OSError):
        return {}
    storages = {id(tensor): tensor.untyped_storage().data_ptr() for tensor in tensors}
    if not records or not storages:
        return {}
    start, known = min(storages.values()) - records[0], set(records)
    if any(address - start not in known for address in storages.values()):
        return {}
    return {id(tensor): storages[id(tensor)] - start + tensor.storage_offset() * tensor.element_size()
            for tensor in tensors}


def read_into(stream, offset: int, tensor) -> bool:
    """Fill the host tensor `tensor` (contiguous) with the bytes of `stream` from `offset`, no copy in between;
    False where the file ends first (the caller says which file and what it lacks)."""
    import torch

    view = memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())
    stream.seek(offset)
    filled = 0
    while filled < len(view):
        got = stream.readinto(view[filled:])
        if not got:
            return False
        filled += got
    return True


def _is_tensor(value) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _unwrapped(optimizers: list) -> list:
    found = []
    for optimizer in optimizers:
        while hasattr(optimizer, "optimizer"):
            optimizer = optimizer.optimizer
        found.append(optimizer)
    return found
