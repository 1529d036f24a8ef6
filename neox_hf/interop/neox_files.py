"""Finding, reading and writing the files of a GPT-NeoX-native checkpoint.

GPT-NeoX (Megatron + DeepSpeed) writes a checkpoint as a folder ``global_stepN/``
next to a ``latest`` file whose text is ``global_stepN``. Inside it the model
weights come in one of two layouts:

* pipeline layout (``pipe_parallel_size >= 1``, DeepSpeed ``PipelineModule``):
  ``layer_{idx:02d}-model_{tp:02d}-model_states.pt``, one bare state dict per
  pipeline layer and tensor-parallel rank;
* sequential layout (``pipe_parallel_size == 0``, the model turned into an
  ``nn.Sequential``): ``mp_rank_{tp:02d}_model_states.pt`` whose ``"module"``
  maps ``sequential.{idx}.{param}`` to tensors.

Both use the same layer index ``idx``. This module turns either into one shape,
``{idx: [state dict of TP rank 0, rank 1, ...]}``, so the merging code never
looks at file names. It also fills a safety gap: GPT-NeoX's own converter calls
``torch.load`` with full unpickling, which torch >= 2.6 refuses by default and
which runs arbitrary code from the file. We load with ``weights_only=True`` (numpy
RNG state allowed, see ``neox_hf.io.allowed_globals``) and make full unpickling an
explicit, named opt-in (``trust_pickle``).
"""

from __future__ import annotations

import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from neox_hf.errors import CheckpointError
from neox_hf.io import atomic_folder, atomic_write_text, damaged_file_errors, load_torch_safely

PIPELINE_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
SEQUENTIAL_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
SEQUENTIAL_KEY = re.compile(r"^sequential\.(\d+)\.(.+)$")

LayerShards = dict[int, list[dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class NeoXCheckpointFiles:
    """Where a checkpoint's weight files are and how they are laid out."""

    step_dir: Path
    layout: str  # "pipeline" or "sequential"
    tp_size: int

    def layer_file(self, idx: int, tp_rank: int) -> Path:
        return self.step_dir / f"layer_{idx:02d}-model_{tp_rank:02d}-model_states.pt"

    def rank_file(self, tp_rank: int) -> Path:
        return self.step_dir / f"mp_rank_{tp_rank:02d}_model_states.pt"


def resolve_step_dir(checkpoint_dir: str | os.PathLike) -> Path:
    """Return the ``global_stepN`` folder: the argument itself, or what its ``latest`` names."""
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint folder does not exist; pass a global_stepN/ folder or its parent")
    if _has_weight_files(path):
        return path
    latest = path / "latest"
    if not latest.is_file():
        raise CheckpointError(
            f"{path}: no layer_*-model_*-model_states.pt / mp_rank_*_model_states.pt files and no 'latest' file; "
            "pass the global_stepN/ folder itself or the folder GPT-NeoX saved into"
        )
    step_dir = path / latest.read_text().strip()
    if not step_dir.is_dir():
        raise CheckpointError(
            f"{latest} names {step_dir.name!r}, which is not a folder in {path}; fix or delete 'latest'"
        )
    return step_dir


def _has_weight_files(path: Path) -> bool:
    return any(PIPELINE_FILE.match(p.name) or SEQUENTIAL_FILE.match(p.name) for p in path.iterdir())


def detect_checkpoint_files(checkpoint_dir: str | os.PathLike) -> NeoXCheckpointFiles:
    """Return the layout and TP size of the checkpoint, read from its file names."""
    step_dir = resolve_step_dir(checkpoint_dir)
    names = [p.name for p in step_dir.iterdir()]
    # The pipeline layout also writes mp_rank_* files (optimizer / RNG state, module=None),
    # so layer files decide the layout when both are present.
    pipeline_ranks = {int(m.group(2)) for m in map(PIPELINE_FILE.match, names) if m}
    if pipeline_ranks:
        return NeoXCheckpointFiles(step_dir, "pipeline", _contiguous_tp_size(pipeline_ranks, step_dir))
    sequential_ranks = {int(m.group(1)) for m in map(SEQUENTIAL_FILE.match, names) if m}
    if sequential_ranks:
        return NeoXCheckpointFiles(step_dir, "sequential", _contiguous_tp_size(sequential_ranks, step_dir))
    raise CheckpointError(f"{step_dir}: no GPT-NeoX model_states files found")


def _contiguous_tp_size(ranks: set[int], step_dir: Path) -> int:
    missing = sorted(set(range(max(ranks) + 1)) - ranks)
    if missing:
        raise CheckpointError(
            f"{step_dir}: files for tensor-parallel rank(s) {missing} are missing; copy every rank's files"
        )
    return max(ranks) + 1


def load_torch_file(path: Path, *, trust_pickle: bool = False) -> object:
    """Return the object in a ``torch.save`` file, refusing anything but tensors unless ``trust_pickle``."""
    if not path.is_file():
        raise CheckpointError(f"{path}: file is missing; the checkpoint is incomplete (copy it again)")
    # mmap keeps peak memory at one layer, but only the zip format supports it (and a
    # truncated zip has no central directory, so it takes the plain path and fails there).
    mmap = zipfile.is_zipfile(path)
    try:
        if not trust_pickle:  # tensors, plain data and numpy RNG state (GPT-NeoX's np_rng_state) only
            return load_torch_safely(path, mmap=mmap, trust_hint=_TRUST_HINT)
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except CheckpointError:  # refused by weights_only loading: the message names the file and --trust-pickle
        raise
    except (OSError, *damaged_file_errors()) as err:
        raise _corrupt_file_error(path, err) from err


_TRUST_HINT = ". If you trust this file, pass trust_pickle=True (CLI: --trust-pickle) to load it with full unpickling"


def _corrupt_file_error(path: Path, err: Exception) -> CheckpointError:
    detail = " ".join(str(err).split())[:160]  # torch's messages run over several lines
    return CheckpointError(
        f"{path}: cannot be read ({type(err).__name__}: {detail}); it is truncated or corrupt, copy it again"
    )


def load_layer_shards(
    files: NeoXCheckpointFiles, layer_indices: list[int], *, trust_pickle: bool = False
) -> LayerShards:
    """Return ``{idx: [rank 0 state dict, rank 1 ...]}`` for the requested pipeline indices.

    Weights at any other index are an error, not skipped: e.g. an untied checkpoint's
    ``final_linear`` read with a tied config would otherwise vanish without a word.
    """
    if files.layout == "pipeline":
        stored = {int(m.group(1)) for m in map(PIPELINE_FILE.match, (p.name for p in files.step_dir.iterdir())) if m}
        shards = {idx: [_load_pipeline_file(files.layer_file(idx, r), trust_pickle) for r in range(files.tp_size)]
                  for idx in layer_indices}
        _check_no_extra_layers(stored, layer_indices, files.step_dir / "layer_*-model_*-model_states.pt")
        return shards
    per_rank = [_sequential_layers(files.rank_file(r), trust_pickle) for r in range(files.tp_size)]
    for rank, layers in enumerate(per_rank):
        _check_no_extra_layers(set(layers), layer_indices, files.rank_file(rank))
    shards: LayerShards = {}
    for idx in layer_indices:
        for rank, layers in enumerate(per_rank):
            if idx not in layers:
                raise CheckpointError(
                    f"{files.rank_file(rank)}: no 'sequential.{idx}.*' weights; the checkpoint does not match "
                    "the config (check num_hidden_layers and tie_word_embeddings)"
                )
        shards[idx] = [layers[idx] for layers in per_rank]
    return shards


def _check_no_extra_layers(stored: set[int], expected: list[int], where: Path) -> None:
    extra = sorted(stored - set(expected))
    if extra:
        raise CheckpointError(
            f"{where}: holds weights for layer index(es) {extra} that the config does not expect "
            f"(expected {sorted(expected)}); check num_hidden_layers, and tie_word_embeddings=False "
            "if the checkpoint has a final_linear (GPT-NeoX no_weight_tying: true)"
        )


def _load_pipeline_file(path: Path, trust_pickle: bool) -> dict[str, torch.Tensor]:
    state = load_torch_file(path, trust_pickle=trust_pickle)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a state dict, found {type(state).__name__}")
    return state


def _sequential_layers(path: Path, trust_pickle: bool) -> dict[int, dict[str, torch.Tensor]]:
    """Return one rank's ``"module"`` regrouped by layer index: ``{idx: {param: tensor}}``."""
    state = load_torch_file(path, trust_pickle=trust_pickle)
    module = state.get("module") if isinstance(state, dict) else None
    if not isinstance(module, dict):
        raise CheckpointError(
            f"{path}: no 'module' state dict; if this folder also has layer_*-model_*-model_states.pt "
            "files some are missing, otherwise it is not a GPT-NeoX model checkpoint"
        )
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in module.items():
        match = SEQUENTIAL_KEY.match(key)
        if not match:
            raise CheckpointError(f"{path}: unexpected key {key!r} in 'module'; expected 'sequential.<idx>.<param>'")
        layers.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
    return layers


def write_sequential_checkpoint(
    rank_modules: list[dict[str, torch.Tensor]], out_dir: str | os.PathLike, step: int
) -> Path:
    """Write ``global_step{step}/mp_rank_XX_model_states.pt`` + ``latest`` atomically; return the step folder.

    The files are written into a temporary folder beside the target and renamed into
    place, so a crash never leaves a half-written ``global_stepN`` that looks complete.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    step_name = f"global_step{step}"
    final_dir = out / step_name
    if final_dir.exists():
        raise CheckpointError(f"{final_dir}: already exists; choose another out_dir or step, or delete it")
    with atomic_folder(final_dir, replace=False) as tmp_dir:
        for rank, module in enumerate(rank_modules):
            states = _deepspeed_model_states(module, len(rank_modules), step)
            torch.save(states, tmp_dir / f"mp_rank_{rank:02d}_model_states.pt")
    atomic_write_text(out / "latest", step_name)
    return final_dir


def _deepspeed_model_states(module: dict[str, torch.Tensor], tp_size: int, step: int) -> dict:
    # DeepSpeed's load_checkpoint indexes these counters directly, so they must exist;
    # they are plain ints, keeping the file loadable with weights_only=True. There is no
    # optimizer state: GPT-NeoX should load it with `finetune: true` (or no_load_optim).
    return {
        "module": module,
        "iteration": step,
        "global_steps": step,
        "skipped_steps": 0,
        "dp_world_size": 1,
        "mp_world_size": tp_size,
    }


def embedding_rows(files: NeoXCheckpointFiles, *, trust_pickle: bool = False) -> int:
    """The (padded) vocabulary size a checkpoint was trained with: its word embedding's rows over all TP ranks."""
    rows = 0
    for rank in range(files.tp_size):
        if files.layout == "pipeline":
            layer = _load_pipeline_file(files.layer_file(0, rank), trust_pickle)
        else:
            layer = _sequential_layers(files.rank_file(rank), trust_pickle).get(0, {})
        if "word_embeddings.weight" not in layer:
            raise CheckpointError(f"{files.step_dir}: TP rank {rank} has no word_embeddings.weight at layer 0; "
                                  "not a GPT-NeoX language-model checkpoint")
        rows += layer["word_embeddings.weight"].shape[0]
    return rows
