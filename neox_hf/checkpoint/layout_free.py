"""The layout-free part of a training checkpoint: `step_…/layout_free/`, written and read with
`torch.distributed.checkpoint` (DCP).

What it holds, per parameter under its transformers name and full shape: `model/<name>` (the fp32 master value),
`exp_avg/<name>`, `exp_avg_sq/<name>` (Adam's moments). The Adam step count, the loss scaler, the LR schedule, the
counters and the data position are plain data in the trainer state beside it (`trainer_state_rank{r}.pt`, key
`layout_free`). The engine decides how its rank's tensors map onto the full ones (`Engine.layout_free_state`):
DTensor views of its tensor-parallel shard, split further over the data-parallel ranks, on a (tensor × data) device
mesh of its pipeline stage.

Why DCP and not DeepSpeed's universal checkpoint: the universal format is produced offline by `ds_to_universal.py`
from a finished ZeRO checkpoint (every rank's optimizer files read by one process), does not cover a run without
DeepSpeed (our one-process runs) nor ZeRO-3 into ZeRO-1/2, and knows nothing of our TP plan. DCP writes every rank's
chunks in parallel, deduplicates replicated chunks (each written once), and on load plans reads of only the
chunks overlapping what each rank asks for — the resharding the issue asks for, from the library.

Gap filled: DCP's `FileSystemReader.read_metadata` unpickles `.metadata` with `pickle.load`, which can run code. We
read it with an unpickler that admits only DCP's own metadata classes, `torch.Size`, dtypes and builtins
(`PlainDataReader`); tensor data DCP already reads with `weights_only=True`, and we store no non-tensor items there.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import struct
import warnings
from pathlib import Path

from neox_hf.checkpoint.in_place import read_into
from neox_hf.errors import CheckpointError, first_line

FOLDER = "layout_free"
_ALLOWED_MODULES = ("torch.distributed.checkpoint.",)
_ALLOWED_BUILTINS = {"builtins": {"set", "frozenset", "dict", "list", "tuple", "slice", "int", "float", "str",
                                  "bytes", "bool", "NoneType"},
                     "collections": {"OrderedDict", "defaultdict"}, "torch": {"Size"},
                     "copyreg": {"_reconstructor"}, "enum": {"Enum"},
                     # torch pickles a tensor layout as `_get_layout("torch.strided")` (a lookup in a fixed table;
                     # torch's own weights_only unpickler admits it) and DCP the relative file names as paths.
                     "torch.serialization": {"_get_layout"}, "pathlib": {"PosixPath", "PurePosixPath"}}


class _PlainDataUnpickler(pickle.Unpickler):
    """Refuses any global but DCP's metadata dataclasses and the plain types they hold."""

    def find_class(self, module, name):
        import torch

        if module.startswith(_ALLOWED_MODULES) or name in _ALLOWED_BUILTINS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not plain checkpoint metadata")


def _reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class PlainDataReader(FileSystemReader):
        """DCP's reader with `.metadata` unpickled as plain data only (see the module docstring)."""

        def read_metadata(self, *args, **kwargs):
            if getattr(self, "_metadata", None) is not None and kwargs.get("rank") is None:
                return self._metadata  # read once per load: the caller's shape check, then DCP's plan
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as handle:
                try:
                    metadata = _PlainDataUnpickler(io.BytesIO(handle.read())).load()
                except pickle.UnpicklingError as err:
                    raise CheckpointError(f"{path} was refused: {err}; it could run code when read") from err
                except Exception as err:  # truncated / corrupt
                    raise CheckpointError(f"cannot read {path} ({err}): the file is truncated or corrupt") from err
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            if kwargs.get("rank") is None:
                self._metadata = metadata
            return metadata

        def set_up_storage_reader(self, metadata, *args, **kwargs):
            super().set_up_storage_reader(metadata, *args, **kwargs)
            self._stored = metadata.state_dict_metadata

        def read_data(self, plan, planner):
            """DCP's read, with every request it can serve read straight from the file into its destination
            (`_read_in_place`); the rest as DCP reads them."""
            from torch.futures import Future

            rest = []
            by_file: dict = {}
            for request in plan.items:
                by_file.setdefault(self.storage_data[request.storage_index].relative_path, []).append(request)
            for relative_path, requests in by_file.items():
                with open(Path(self.path) / relative_path, "rb", buffering=0) as stream:
                    requests = sorted(requests, key=lambda r: self.storage_data[r.storage_index].offset)
                    for request in requests:
                        if not _read_in_place(stream, request, self.storage_data[request.storage_index],
                                              self._stored, planner):
                            rest.append(request)
            if rest:
                return super().read_data(type(plan)(items=rest, storage_data=plan.storage_data,
                                                    planner_data=plan.planner_data), planner)
            done = Future()
            done.set_result(None)
            return done

    return PlainDataReader


def _read_in_place(stream, request, stored_at, stored: dict, planner) -> bool:
    """Read one DCP request's bytes from `stream` straight into its CPU destination, when it asks for whole rows of a
    stored chunk (a contiguous byte range of it) and its destination is contiguous; False (nothing read) otherwise.

    Gap filled: DCP's `FileSystemReader.read_data` unpickles every stored chunk whole into a new tensor, then copies
    the part asked for into the destination: twice the memory traffic, and on another layout the whole chunk read for
    a few rows of it. Each chunk is a `torch.save` zip holding one uncompressed storage record (DCP clones a view
    before saving it, so the record holds exactly the chunk): its raw bytes are read here, the pickle is not."""
    import math

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadItemType

    meta = stored.get(request.storage_index.fqn)
    if (request.type != LoadItemType.TENSOR or not isinstance(meta, TensorStorageMetadata)
            or stored_at.transform_descriptors):
        return False
    chunk = next((c for c in meta.chunks if list(c.offsets) == list(request.storage_index.offset)), None)
    if chunk is None:
        return False
    sizes, starts, lengths = list(chunk.sizes), list(request.storage_offsets), list(request.lengths)
    if any(start != 0 or length != size for start, length, size in zip(starts[1:], lengths[1:], sizes[1:])):
        return False  # not whole rows: not one byte range
    item = meta.properties.dtype.itemsize
    start = _record_start(stream, stored_at.offset, stored_at.length)
    direct = getattr(planner, "direct_part", lambda _: None)(request) if starts else None
    target, first = direct if direct is not None else (planner.resolve_tensor(request).detach(), 0)
    if (start is None or target.device.type != "cpu" or not target.is_contiguous()
            or target.dtype != meta.properties.dtype):
        return False
    row = math.prod(sizes[1:]) * item
    if not read_into(stream, stored_at.offset + start + (starts[0] * row if starts else 0) + first * item, target):
        raise CheckpointError(f"{stream.name} ends before the chunk of {request.storage_index.fqn} it should hold")
    # what the item's central directory says, read after the data (the file read front to back): where it disagrees,
    # DCP's own read fills the target again
    if _storage_record(stream, stored_at.offset, stored_at.length) != (start, math.prod(sizes) * item):
        return False
    planner.commit_tensor(request, None if direct is not None else target)
    return True


_HEAD = 4096  # torch writes the pickle and three tiny records before the storage: its local header lies in this
_LOCAL_SIGNATURE = b"PK\x03\x04"


def _record_start(stream, offset: int, length: int) -> int | None:
    """Where the storage record's bytes start in the `torch.save` zip DCP wrote at `offset`, told by its local
    header in the item's first 4 KB (torch writes the records' sizes after their data, so the headers are found by
    their signature); None where none is found. A guess until `_storage_record` confirms it: it reads the item's
    central directory, at its end, and reading that first sent the disk back and forth on every item (two ranks'
    resume ran at half the disk's speed); this way each file is read front to back and the kernel's readahead
    streams it."""
    stream.seek(offset)
    head = stream.read(min(length, _HEAD))
    at = head.find(_LOCAL_SIGNATURE)
    while 0 <= at <= len(head) - _LOCAL.size:
        _, name_length, extra_length = _LOCAL.unpack_from(head, at)
        if b"/data/" in head[at + _LOCAL.size:at + _LOCAL.size + name_length]:
            return at + _LOCAL.size + name_length + extra_length
        at = head.find(_LOCAL_SIGNATURE, at + 1)
    return None


_END = struct.Struct("<4s4xHHII2x")  # end of central directory: signature, entries, entries, size, offset
_ENTRY = struct.Struct("<4s6xH4xIIIHHH8xI")  # central directory entry, from its signature to the local header offset
_LOCAL = struct.Struct("<4s22xHH")  # local file header: signature, name and extra lengths
_END64 = struct.Struct("<4s8x2x2x4x4x8xQQQ")  # zip64 end of central directory: signature, entries, size, offset
_LOCATOR_SIZE = 20  # the zip64 end's locator, between it and the end of central directory


def _storage_record(stream, offset: int, length: int) -> tuple[int, int] | None:
    """(start within the item, size) of the one uncompressed storage record of the `torch.save` zip DCP wrote at
    `offset`, or None where the item is no such zip (then DCP's own read handles it).

    Two small reads: the zip's central directory (at the item's end, before torch's zip64 end records; torch writes
    no archive comment) and the record's local header. `zipfile` takes five and builds an archive object per item,
    a tenth of a second of a resume's CPU time at a few hundred items. A record of 4 GB or more (its sizes in a zip64
    extra field) goes to DCP's read."""
    tail = min(length, 4096)
    stream.seek(offset + length - tail)
    end = stream.read(tail)
    if len(end) < _END.size:
        return None
    signature, _, count, size, start = _END.unpack_from(end, len(end) - _END.size)
    directory_end = len(end) - _END.size
    if end[directory_end - _LOCATOR_SIZE:directory_end - _LOCATOR_SIZE + 4] == b"PK\x06\x07":  # torch's zip64 end
        directory_end -= _LOCATOR_SIZE + _END64.size
        if directory_end < 0:
            return None
        signature64, count, size, start = _END64.unpack_from(end, directory_end)
        if signature64 != b"PK\x06\x06":
            return None
    at = directory_end - size  # the central directory's place in `end`
    if signature != b"PK\x05\x06" or at < 0 or start + size != length - (len(end) - directory_end):
        return None
    records = []
    for _ in range(count):
        if at + _ENTRY.size > len(end):
            return None
        sig, method, _crc, packed, unpacked, name_length, extra_length, comment_length, local = _ENTRY.unpack_from(
            end, at)
        name = end[at + _ENTRY.size:at + _ENTRY.size + name_length]
        if sig != b"PK\x01\x02":
            return None
        if b"/data/" in name:
            records.append((method, packed, unpacked, local))
        at += _ENTRY.size + name_length + extra_length + comment_length
    if len(records) != 1 or records[0][0] != 0 or 0xFFFFFFFF in records[0][1:]:
        return None
    _, size, _, local = records[0]
    stream.seek(offset + local)
    header = stream.read(_LOCAL.size)
    if len(header) != _LOCAL.size:
        return None
    signature, name_length, extra_length = _LOCAL.unpack(header)
    if signature != _LOCAL_SIGNATURE:
        return None
    return local + _LOCAL.size + name_length + extra_length, size


@contextlib.contextmanager
def one_process_is_meant():
    """DCP warns on every save or load without a process group that it assumes one process: here that is the
    case meant (one process, or `neox_hf export`), not a mistake to report."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


class Chunk:
    """This rank's box of a full tensor, for DCP to write or to fill: `local` holds the part of a tensor of full
    `shape` that starts at `offsets`. An engine hands these where a rank's part is no even split: ZeRO-1/2 give each
    rank a range of the flattened parameter, whose whole rows (`engines/zero_state.py`) are such a box. `local` may
    come later: a box saved from its pieces (`joined`), or loaded straight into the range it is read for
    (`into_flat`), is allocated only where something asks for it.

    Gap filled: a DTensor describes only even splits over a device mesh, and a ShardedTensor checks its shards with a
    collective per tensor (hundreds per save). DCP's planners take any object that lists its chunks
    (`__create_chunk_list__`, `__create_write_items__`, `__get_tensor_shard__`, DTensor's protocol); `_planners`
    look the local tensor up for them."""

    def __init__(self, local, offsets, shape):
        import torch

        self._local, self.offsets, self.shape = local, torch.Size(offsets), torch.Size(shape)
        self._box, self._dtype, self._device = (local.size(), local.dtype, local.device) if local is not None else \
            (None, None, None)
        self.filled = None  # what to do once a load has filled `local` (an engine's copy out of it), called once
        self.into = None  # (flat, skip): a load may put the box's flattened elements [skip, skip + len) into `flat`
        self.direct = False  # the load planner found every read of the box whole rows: `into` is filled, not `local`
        self.pieces = None  # 1-D tensors whose elements, in order, are the box's: joined only where `local` is asked

    @classmethod
    def joined(cls, pieces: list, box, offsets, shape) -> "Chunk":
        """A box whose flattened elements are those of the 1-D tensors `pieces`, in order (views of training state:
        read before the optimizer next steps). A host copy copies the pieces into its buffer; `local` joins them
        into new memory only where it is asked for (a save in the foreground). ZeRO-1/2's rows: a rank's range
        completed by the next ranks' first elements; joining them at the save made the saving step wait for a
        copy into new memory (0.36 s of a 2.9 s step on two ranks here) that the host copy makes anyway."""
        import torch

        chunk = cls(None, offsets, shape)
        chunk._box, chunk._dtype, chunk._device = torch.Size(box), pieces[0].dtype, pieces[0].device
        chunk.pieces = pieces
        return chunk

    @classmethod
    def into_flat(cls, flat, skip: int, box, offsets, shape) -> "Chunk":
        """A box of `box` rows of which a load needs only the flattened elements [skip, skip + flat.numel()), read
        straight into the 1-D tensor `flat` where the reads allow (`direct`); `local` is allocated only where a
        read needs it. ZeRO-1/2's moments and masters: a rank's range is no whole rows, and reading the rows into
        new memory to copy the range out faulted in a quarter of a gigabyte per rank for a 70M-parameter model."""
        import torch

        chunk = cls(None, offsets, shape)
        chunk._box, chunk._dtype, chunk._device = torch.Size(box), flat.dtype, flat.device
        chunk.into = (flat, skip)
        return chunk

    @property
    def local(self):
        if self._local is None:
            import torch

            self._local = torch.cat(self.pieces).view(self._box) if self.pieces is not None else \
                torch.empty(self._box, dtype=self._dtype, device=self._device)
        return self._local

    @property
    def device(self):
        return self._device

    def part_for(self, first_row: int, rows: int):
        """(the part of `into`'s tensor that rows [first_row, first_row + rows) of the box hold, the element of
        those rows where it starts)."""
        import math

        flat, skip = self.into
        row = math.prod(self._box[1:])
        start, end = max(first_row * row, skip), min((first_row + rows) * row, skip + flat.numel())
        return flat[start - skip:max(end, start) - skip], start - first_row * row

    def whole_rows(self, dest_offsets, lengths) -> bool:
        """Whether a read into `dest_offsets` of the box, `lengths` long, covers whole rows of it."""
        return all(offset == 0 for offset in dest_offsets[1:]) and list(lengths[1:]) == list(self._box[1:])

    def fill_done(self) -> None:
        """Run `filled` if it has not run yet."""
        filled, self.filled = self.filled, None
        if filled is not None:
            filled()

    def size(self):
        return self.shape

    @property
    def box(self):
        """The size of this rank's part (`local`'s), known without allocating it."""
        return self._box

    @property
    def dtype(self):
        return self._dtype

    def _storage_chunk(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return ChunkStorageMetadata(offsets=self.offsets, sizes=self._box)

    def __create_chunk_list__(self):
        return [self._storage_chunk()]

    def __create_write_items__(self, fqn, obj):
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, self.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=self._storage_chunk(),
                                                      properties=TensorProperties.create_from_tensor(self.local),
                                                      size=self.shape))]

    def __get_tensor_shard__(self, index):
        return self.local


def save_planner():
    """DCP's default save planner, which also finds a `Chunk`'s rows."""
    return _planners()[0]()


def _planners():
    """DCP's default save and load planners, which also find a `Chunk`'s tensor (they look only into tensors)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

    class SavePlanner(DefaultSavePlanner):
        def lookup_object(self, index):
            found = self.state_dict.get(index.fqn)
            return found.local if isinstance(found, Chunk) else super().lookup_object(index)

    class LoadPlanner(DefaultLoadPlanner):
        """Also runs each `Chunk`'s `filled` once its last request is read, so that an engine's copy out of it runs
        while the kernel reads ahead what follows, not after the whole load."""

        def create_local_plan(self):
            import collections

            plan = super().create_local_plan()
            self._unread = collections.Counter(item.dest_index.fqn for item in plan.items)
            for chunk in self.state_dict.values():
                if isinstance(chunk, Chunk) and chunk.into is not None:
                    chunk.direct = True
            for item in plan.items:
                found = self.state_dict.get(item.dest_index.fqn)
                if isinstance(found, Chunk) and not found.whole_rows(item.dest_offsets, item.lengths):
                    found.direct = False
            return plan

        def direct_part(self, read_item):
            """(part of the flat tensor, element of the read where it starts) that `read_item` fills, for a `Chunk`
            read straight into its flat tensor; None for any other target."""
            found = self.state_dict.get(read_item.dest_index.fqn)
            if not isinstance(found, Chunk) or not found.direct:
                return None
            return found.part_for(read_item.dest_offsets[0], read_item.lengths[0])

        def commit_tensor(self, read_item, tensor):
            """`tensor`: what DCP's own read filled (copied into a direct `Chunk`'s flat tensor here); None from a
            read straight into the target."""
            super().commit_tensor(read_item, tensor)
            fqn = read_item.dest_index.fqn
            part = self.direct_part(read_item) if tensor is not None else None
            if part is not None:
                flat, first = part
                flat.copy_(tensor.reshape(-1)[first:first + flat.numel()])
            self._unread[fqn] -= 1
            found = self.state_dict.get(fqn)
            if self._unread[fqn] == 0 and isinstance(found, Chunk):
                found.fill_done()

        def set_up_planner(self, state_dict, *args, **kwargs):
            # DCP's set-up replaces every value that is no tensor by None (`_init_state_dict`): chunks join after it
            chunks = {key: value for key, value in state_dict.items() if isinstance(value, Chunk)}
            super().set_up_planner({k: v for k, v in state_dict.items() if k not in chunks}, *args, **kwargs)
            self.state_dict.update(chunks)
            self.mappings.update({key: (key,) for key in chunks})

        def lookup_tensor(self, index):
            found = self.state_dict.get(index.fqn)
            return found.local if isinstance(found, Chunk) else super().lookup_tensor(index)

    return SavePlanner, LoadPlanner


def has_layout_free_state(folder: Path) -> bool:
    return (Path(folder) / FOLDER / ".metadata").is_file()


def stored_model_shapes(folder: Path) -> dict[str, list[int]]:
    """Every model tensor's name and shape in `folder/layout_free` (its metadata only; no tensor is read)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = _reader_class()(str(Path(folder) / FOLDER)).read_metadata().state_dict_metadata
    return {key.removeprefix("model/"): list(meta.size) for key, meta in stored.items()
            if key.startswith("model/") and isinstance(meta, TensorStorageMetadata)}


def truncated_file(folder: Path) -> Path | None:
    """The first data file of `folder/layout_free` shorter than its metadata says (a write cut short), else None.
    DCP's own read of such a file fails without naming it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    root = Path(folder) / FOLDER
    ends: dict[str, int] = {}
    for info in (_reader_class()(str(root)).read_metadata().storage_data or {}).values():
        if isinstance(info, _StorageInfo):
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name in sorted(ends):
        path = root / name
        if not path.is_file() or path.stat().st_size < ends[name]:
            return path
    return None


def read_model_weights(folder: Path) -> dict:
    """Every parameter's fp32 value under its transformers name, whole, from `folder/layout_free`, in this one
    process (no process group): what `neox_hf export` writes whatever layout saved the checkpoint. Check
    `truncated_file` first to name a damaged file."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = _reader_class()(str(Path(folder) / FOLDER))
    stored = reader.read_metadata().state_dict_metadata
    targets = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in stored.items()
               if key.startswith("model/") and isinstance(meta, TensorStorageMetadata)}
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with one_process_is_meant():
            dcp.load(targets, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        raise CheckpointError(f"cannot read {Path(folder) / FOLDER} ({first_line(err)}): a file of it is truncated "
                              "or corrupt") from err
    return {key.removeprefix("model/"): value for key, value in targets.items()}


def load_from_accelerate_files(targets: dict, folder: Path) -> None:
    """Fill `targets` from what accelerate's save_state wrote for one process without DeepSpeed: its
    `model.safetensors` and `optimizer.bin` already are the layout-free state (transformers names, full shapes, fp32),
    so such a run writes no second copy. Every rank reads the files whole (they fit one process) and keeps its
    chunk of each tensor. Adam's state is keyed by position: `build_optimizer`'s groups (matrices, then vectors) over
    the model's parameters in order, which the checkpoint's config rebuilds on the meta device."""
    from safetensors.torch import load_file

    from neox_hf.io import load_torch_safely

    folder = Path(folder)
    weights = load_file(str(folder / "model.safetensors"))
    optimizer = load_torch_safely(folder / "optimizer.bin")
    name_of = _optimizer_index_names(folder, optimizer)
    full = {f"model/{name}": tensor for name, tensor in weights.items()}
    for index, state in optimizer["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            full[f"{key}/{name_of[index]}"] = state[key]
    check = shape_difference({k: _Shape(v.shape) for k, v in full.items()}, targets, folder)
    if check:
        raise CheckpointError(check)
    for key, target in targets.items():
        _copy_chunk(full[key], target)


class _Shape:
    def __init__(self, size):
        self.size = size


def _optimizer_index_names(folder: Path, optimizer: dict) -> dict[int, str]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    ordered = [n for n, p in params if p.ndim >= 2] + [n for n, p in params if p.ndim < 2]
    indices = [index for group in optimizer["param_groups"] for index in group["params"]]
    if len(indices) != len(ordered):
        raise CheckpointError(f"{folder / 'optimizer.bin'} holds {len(indices)} parameters' state and its config "
                              f"builds {len(ordered)}: it was written by another version of neox_hf; resume it on "
                              "the layout that wrote it")
    return dict(zip(indices, ordered))


def _copy_chunk(full, target) -> None:
    """Copy the part of `full` that `target` (a tensor or a DTensor's local chunk) stands for."""
    import torch

    if isinstance(target, Chunk):
        box = tuple(slice(o, o + n) for o, n in zip(target.offsets, target.local.shape))
        target.local.copy_(full[box])
        return
    if not hasattr(target, "to_local"):
        target.copy_(full)
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, target.device_mesh, target.placements)
    chunk = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
    with torch.no_grad():
        target.to_local().copy_(chunk)


def save_layout_free(tensors: dict, folder: Path) -> None:
    """Write this rank's chunks of `tensors` (plain tensors or DTensors) under `folder/layout_free`. Collective."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from torch.distributed.checkpoint.api import CheckpointException

    try:
        # sync_files=False: DCP fsyncs every file by default, which made the save 2-3x slower than the per-rank files
        # beside it (1.6 GB: 6.2 s vs 1.3 s here); those (accelerate's, DeepSpeed's) are not fsynced either. A killed
        # process loses nothing (the page cache outlives it); a machine that loses power right after a save can
        # lose this checkpoint as it would the others, and resume from the one before.
        with one_process_is_meant():
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(Path(folder) / FOLDER), sync_files=False),
                     planner=save_planner(), no_dist=not _distributed(dist))
    except CheckpointException as err:  # a BaseException, which `except Exception` (a full disk's report) misses
        raise first_failure(err) from err


def first_failure(err) -> Exception:
    """The exception a rank's failed write or read raised (e.g. OSError ENOSPC), as an ordinary exception (DCP keeps
    each rank's as it was raised or as (exception, traceback))."""
    failure = next(iter(getattr(err, "failures", {}).values()), None)
    failure = failure[0] if isinstance(failure, tuple) and failure else failure
    return failure if isinstance(failure, Exception) else RuntimeError(str(err))


def load_layout_free(targets: dict, folder: Path) -> None:
    """Fill `targets` (tensors or DTensors of this run's layout) in place from `folder/layout_free`, reading only the
    chunks each rank's targets overlap. A tensor missing there, or of another full shape, is refused on every rank
    (the ranks agree first, so none is left waiting in a collective) before any read, naming the first difference.
    Collective."""
    import torch.distributed.checkpoint as dcp

    reader = _reader_class()(str(Path(folder) / FOLDER))
    stored = reader.read_metadata().state_dict_metadata
    every = _gather([sorted(targets), shape_difference(stored, targets, folder)])
    problems = [problem for _, problem in every if problem] or [
        extra_tensor(stored, set().union(*(keys for keys, _ in every)), folder)]
    if problems[0]:
        raise CheckpointError(problems[0])
    from torch.distributed.checkpoint.api import CheckpointException

    # Each rank plans and reads alone (`no_dist`): DCP's load planning coordinates nothing (its global load plan is
    # the ranks' own plans, `create_default_global_load_plan`), and its collectives, the plans pickled to rank 0 and
    # back, cost a tenth of a second or more of a resume; the ranks then agree on the outcome in one small exchange.
    failure = None
    try:
        with one_process_is_meant():
            dcp.load(targets, storage_reader=reader, planner=_planners()[1](), no_dist=True)
    except (Exception, CheckpointException) as err:  # DCP's exception for a rank's failed read is a BaseException
        failure = err
    mine = None if failure is None else first_line(
        first_failure(failure) if isinstance(failure, CheckpointException) else failure)  # the read's own error
    every = _gather(mine)  # every rank, failed or not: a collective
    failed = mine or next((message for message in every if message), None)
    if failed:
        damaged = truncated_file(folder)
        which = f"{damaged} is truncated or corrupt" if damaged else "a file of it is truncated or corrupt"
        raise CheckpointError(f"cannot read {Path(folder) / FOLDER} ({failed}): {which}") from failure



def shape_difference(stored: dict, targets: dict, folder: Path) -> str | None:
    """The first of this rank's tensors the checkpoint lacks or holds in another full shape, said in one line."""
    for key, target in targets.items():
        if key not in stored:
            return (f"{folder} holds no {key}: it was written for another model (this run builds {key} "
                    f"{list(target.shape)}); resume with the recipe it was written with")
        shape = list(getattr(stored[key], "size", []))
        if shape != list(target.shape):
            return (f"{folder} holds {key} of shape {shape}; this run builds {list(target.shape)}: resume with the "
                    "model settings it was written with (the vocabulary is padded to "
                    "model.make_vocab_size_divisible_by × tensor_parallel; set model.vocab_size to keep it)")
    return None


def extra_tensor(stored: dict, wanted: set, folder: Path) -> str | None:
    """A parameter the checkpoint holds that no rank of this run asks for (a model with fewer layers)."""
    extra = sorted(k for k in stored if k.startswith("model/") and k not in wanted)
    if not extra:
        return None
    return (f"{folder} holds {extra[0]}, which this run's model lacks: it was written for another model; resume "
            "with the recipe it was written with")


def _gather(value) -> list:
    """`value` of every rank (a pipeline stage holds only its layers). Collective when distributed."""
    import torch.distributed as dist

    if not _distributed(dist):
        return [value]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def _distributed(dist) -> bool:
    return dist.is_available() and dist.is_initialized()
