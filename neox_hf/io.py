"""Reading and writing files safely: atomic writes (a crash never leaves half a file) and loads that never run code.

Writes. Gap filled: `Path.write_text`, `torch.save` and `save_pretrained` write in place, so a crash (or a full disk)
leaves a truncated file under the final name that looks complete. Here everything is written under a temporary name in
the same folder (same filesystem, so the rename is atomic), flushed to disk, then renamed onto the final name. Files
get the permissions a plain `open()` would give (0666 minus the umask), not the 0600 `tempfile.mkstemp` uses.

Loads. A `torch.save` file or a `.npy` file is a pickle, and unpickling calls whatever functions the file names, so a
crafted checkpoint, RNG state or index cache would run code. Every such file neox_hf reads goes through
`load_torch_safely` / `load_npy_safely` (tensors, numbers, strings, containers, and the few numpy types of an RNG
state in `allowed_globals`), and library loads that pass `weights_only=False` themselves (DeepSpeed's checkpoint
engine) run inside `weights_only_loads`. A file that needs anything more is refused, naming it; nothing in it runs.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from neox_hf.errors import CheckpointError, DataError

TMP_PREFIX = ".tmp-"
# The names this module's writers (and the checkpoint writer) stage under: TMP_PREFIX + a step folder's name, or +
# [a file's name + "."] + the 8 characters tempfile adds (and run.png's former `.tmp-run-XXXXXXXX.png`).
_STAGING_NAME = re.compile(re.escape(TMP_PREFIX) + r"(step_\d+|(.+\.)?[a-z0-9_]{8}|run-[a-z0-9_]{8}\.png)")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(folder: Path) -> None:
    """Make a rename inside `folder` durable (POSIX; a no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def give_umask_modes(path: Path) -> None:
    """Give `path` (every file under it, for a folder) the mode a plain `open()` would: 0666 minus the umask, and the
    execute bits minus the umask where the owner's is set. `tempfile.mkstemp` and safetensors create files 0600, and a
    run's folder is often shared."""
    mask = _umask()
    for entry in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if entry.is_file() and not entry.is_symlink():
            executable = 0o111 if entry.stat().st_mode & 0o100 else 0
            os.chmod(entry, (0o666 | executable) & ~mask)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write a file to; on success it is fsynced and renamed onto `path`,
    on failure removed. For writers that take a file name (torch.save, numpy, safetensors)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f"{TMP_PREFIX}{path.name}.")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        give_umask_modes(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically; return `path`."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_torch_save(obj, path: str | os.PathLike) -> Path:
    import torch

    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
    return Path(path)


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike, *, replace: bool = True) -> Iterator[Path]:
    """Yield an empty staging folder beside `path`; on success it becomes `path` (an existing `path` is removed
    first when `replace`), on failure it is deleted. For writers that fill a whole folder (save_state, save_pretrained
    into a fresh folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{TMP_PREFIX}{path.name}."))
    os.chmod(staging, 0o777 & ~_umask())
    try:
        yield staging
        give_umask_modes(staging)
        if path.exists():
            if not replace:
                raise FileExistsError(path)
            shutil.rmtree(path)
        os.replace(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _fsync_dir(path.parent)


def move_files_into(staging: Path, out_dir: Path, *, last: str | None = None) -> None:
    """Rename every file of `staging` into `out_dir` (`last` moved last: a reader takes its presence to mean the rest
    is complete), then remove `staging`. For folders that hold more than the written files (a run's output.dir)."""
    give_umask_modes(staging)
    for entry in sorted(staging.iterdir(), key=lambda p: p.name == last):
        target = out_dir / entry.name
        if entry.is_dir() and target.is_dir():
            shutil.rmtree(target)
        os.replace(entry, target)
    staging.rmdir()
    _fsync_dir(out_dir)


@contextlib.contextmanager
def staging_folder(out_dir: str | os.PathLike) -> Iterator[Path]:
    """A temporary folder inside `out_dir` (same filesystem), removed whatever happens."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir, prefix=TMP_PREFIX))
    os.chmod(staging, 0o777 & ~_umask())
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def remove_stale_staging(folder: str | os.PathLike, *, depth: int = 3) -> list[Path]:
    """Remove the staging folders and temporary files that writers killed mid-write left in `folder` and its
    subfolders down to `depth` (a run's folder: its own, checkpoints/, hub_steps/stepN/); return what was removed.
    Only names these writers use (see `_STAGING_NAME`). Call only while no writer can be running there (a run's
    output folder: while holding its lock), or a live save loses its staging."""
    removed: list[Path] = []
    folders = [Path(folder)]
    for _ in range(depth):
        subfolders = []
        for place in folders:
            for entry in sorted(place.iterdir()) if place.is_dir() and not place.is_symlink() else []:
                if _STAGING_NAME.fullmatch(entry.name):
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink(missing_ok=True)
                    removed.append(entry)
                elif entry.is_dir() and not entry.is_symlink():
                    subfolders.append(entry)
        folders = subfolders
    return removed


# ----------------------------------------------------------------------------------------------------------------
# Loads that never run code
# ----------------------------------------------------------------------------------------------------------------

_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
_FORCE_FULL_UNPICKLING = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


def allowed_globals(*, deepspeed: bool = False) -> list:
    """What `weights_only` unpickling may build beyond torch's own list: numpy arrays and dtypes (the state of
    `np.random`, in accelerate's `random_states_*.pkl` and GPT-NeoX's `np_rng_state`) and, with `deepspeed`, the
    bookkeeping classes of a DeepSpeed ZeRO optimizer state. Each only builds data (an array from bytes, an enum
    member, a dataclass of ints, an object whose attributes are set): none calls anything the file names."""
    import numpy as np

    core = np._core if hasattr(np, "_core") else np.core
    found = [np.ndarray, np.dtype, core.multiarray._reconstruct,
             (core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct")]  # the name numpy < 2 pickled
    if hasattr(np, "dtypes"):
        found.append(np.dtypes.UInt32DType)  # the RNG key array's dtype, pickled as its class by some numpy versions
    if deepspeed:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        found += [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
    return found


def damaged_file_errors() -> tuple[type[BaseException], ...]:
    """What `torch.load` raises on a damaged or foreign file, by the nature of its readers. Gap filled: torch names
    no error type for "this is not a readable checkpoint"; its pickle machine fails with whatever its stack, memo or
    opcode reader trips on (a file starting with byte 0x87 underflows the stack: IndexError; a bad memo key:
    KeyError; a cut string: EOFError or UnicodeDecodeError; a huge length: OverflowError or MemoryError), its zip
    reader with RuntimeError, its header parsers with struct.error or ValueError. A missing or unreadable file
    (OSError) is not among them: the caller says which file is missing."""
    import pickle
    import struct
    import zipfile

    return (pickle.UnpicklingError, EOFError, IndexError, KeyError, TypeError, ValueError, AttributeError,
            RuntimeError, struct.error, UnicodeDecodeError, OverflowError, MemoryError, zipfile.BadZipFile,
            NotImplementedError, RecursionError)


def damaged_file_message(path, err: BaseException) -> str:
    """One line for a file `torch.load` could not read at all (see `damaged_file_errors`)."""
    detail = " ".join(str(err).split())[:160]
    return (f"{path}: cannot be read ({type(err).__name__}{': ' + detail if detail else ''}): it is truncated or "
            "corrupt (or not a torch.save file); copy it again")


def check_safetensors_file(path: str | os.PathLike) -> None:
    """Refuse, naming it, a `.safetensors` file whose header does not parse or does not cover the file (truncated,
    random bytes). Gap filled: safetensors raises its own `SafetensorError`, which libraries loading through it
    (peft, transformers) pass on as it is, without the file's name. A missing file passes (the loader says so)."""
    path = Path(path)
    if not path.is_file():
        return
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as stored:
            stored.keys()
    except Exception as err:  # noqa: BLE001 — safetensors' own error type, and OSError from its reader
        raise CheckpointError(damaged_file_message(path, err)) from err


def load_torch_safely(path: str | os.PathLike, *, mmap: bool | None = None, trust_hint: str = ""):
    """The object in a `torch.save` file, unpickled with `weights_only=True` and `allowed_globals`.

    A file that names any other function or class raises `CheckpointError` naming the file and what it holds (plus
    `trust_hint`, e.g. how to opt in to full unpickling); a file that is no torch.save file of plain data at all (a
    truncated zip, a raw pickle, random bytes: whatever `damaged_file_errors` lists) raises `CheckpointError` naming
    the file too. A missing file or an I/O error (OSError) passes through."""
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except OSError:
        raise
    except pickle.UnpicklingError as err:
        if not is_weights_only_refusal(err):
            raise CheckpointError(damaged_file_message(path, err)) from err
        raise CheckpointError(refusal_message(path, err) + trust_hint) from err
    except damaged_file_errors() as err:
        raise CheckpointError(damaged_file_message(path, err)) from err


def is_weights_only_refusal(err: BaseException) -> bool:
    """Whether `err` (or an exception it was raised from) is torch refusing a file under `weights_only`."""
    while err is not None:
        if "Weights only load failed" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def refusal_message(path, err: BaseException) -> str:
    """One line for a file `weights_only` refused: the globals it names, or what torch could not read."""
    text = str(err)
    names = list(dict.fromkeys(re.findall(r"GLOBAL ([\w.]+)", text)))
    if names:
        return unsafe_file_message(path, names)
    found = re.search(r"Unsupported operand \d+|Unsupported class [\w.]+", text)
    detail = found.group(0) if found else "not a torch.save file"
    return (f"{path}: cannot be read as tensors and plain data ({detail}): it is truncated, corrupt, or a pickle of "
            "other objects; refused")


def unsafe_file_message(path, names: list[str]) -> str:
    return (f"{path}: refused: it holds {', '.join(names[:3])}, Python objects whose unpickling can run code; "
            "neox_hf loads only tensors and plain data from it")


def unsafe_globals_in(path: str | os.PathLike, *, deepspeed: bool = False) -> list[str]:
    """The functions / classes a torch.save file names beyond what `allowed_globals` permits, read statically from
    its pickle (nothing is built); [] for a file that is not a torch.save zip."""
    import torch

    try:
        with torch.serialization.safe_globals(allowed_globals(deepspeed=deepspeed)):
            return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # noqa: BLE001 — not a zip, truncated: the load itself reports those
        return []


def folder_refusal_message(folder: str | os.PathLike, err: BaseException, *, deepspeed: bool = False) -> str:
    """One line for a `weights_only` refusal raised while a library loaded files of `folder` (torch's message does not
    say which file): the first file whose pickle names a global that is not allowed, found statically."""
    found = ((p, unsafe_globals_in(p, deepspeed=deepspeed)) for p in sorted(Path(folder).rglob("*")) if p.is_file())
    path, names = next(((p, names) for p, names in found if names), (None, []))
    return unsafe_file_message(path, names) if path else refusal_message(f"a file of {folder}", err)


@contextlib.contextmanager
def weights_only_loads(*, deepspeed: bool = False) -> Iterator[None]:
    """Inside: every `torch.load`, also a library's that passes `weights_only=False` itself, unpickles with
    `weights_only=True` and `allowed_globals`.

    Gap filled: DeepSpeed's checkpoint engine (what `Accelerator.load_state` calls under DeepSpeed) and
    `zero_to_fp32` load with `weights_only=False` and have no option to do otherwise; torch's
    `TORCH_FORCE_WEIGHTS_ONLY_LOAD` is the one switch that overrides an explicit False. It is read at each
    `torch.load`, so it is set for this block only (and a `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD` set outside is lifted for
    it: the two together are an error in torch)."""
    import torch

    saved = {name: os.environ.pop(name, None) for name in (_FORCE_WEIGHTS_ONLY, _FORCE_FULL_UNPICKLING)}
    os.environ[_FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals(allowed_globals(deepspeed=deepspeed)):
            yield
    finally:
        os.environ.pop(_FORCE_WEIGHTS_ONLY, None)
        os.environ.update({name: value for name, value in saved.items() if value is not None})


def load_npy_safely(path: str | os.PathLike, *, mmap_mode: str | None = "r"):
    """A `.npy` array (memory-mapped by default) read with `allow_pickle=False`: an object array, whose items are
    pickles, raises `DataError` naming the file instead of being unpickled."""
    import numpy as np

    try:
        return np.load(path, allow_pickle=False, mmap_mode=mmap_mode)
    except (ValueError, EOFError, SyntaxError, TypeError, OverflowError, MemoryError, UnicodeDecodeError) as err:
        # object arrays, and headers numpy cannot parse (a header is a Python literal: literal_eval's errors too)
        raise DataError(f"{path}: not a plain numeric .npy array ({err}); refused: delete the file (neox_hf rebuilds "
                        "its index caches)") from err
