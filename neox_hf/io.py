"""Atomic writes: the one place neox_hf puts a file or a folder on disk so a crash never leaves half of it.

Gap filled: `Path.write_text`, `torch.save` and `save_pretrained` write in place, so a crash (or a full disk) leaves a
truncated file under the final name that looks complete. Here everything is written under a temporary name in the
same folder (same filesystem, so the rename is atomic), flushed to disk, then renamed onto the final name. Files
get the permissions a plain `open()` would give (0666 minus the umask), not the 0600 `tempfile.mkstemp` uses.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

TMP_PREFIX = ".tmp-"


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
        os.chmod(tmp, 0o666 & ~_umask())
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

