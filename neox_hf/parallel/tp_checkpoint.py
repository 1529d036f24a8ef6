"""TP checkpoints: merge shards into a stock state dict, read one rank's slices from
safetensors, and pad the vocabulary so it splits evenly.

Fills a gap in transformers: `from_pretrained(tp_plan=...)` only shards with its own
layers, and there is no reader for "this rank's rows of embed_out" that avoids loading
the full tensor. `safe_open(...).get_slice` reads just the requested bytes.
"""

import json
import os
import re
from contextlib import ExitStack

import torch
from safetensors import safe_open
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from neox_hf.errors import CheckpointError, NeoXHFError
from neox_hf.parallel.mappings import gather_along_dim
from neox_hf.parallel.tp_groups import ParallelGroups
from neox_hf.parallel.tp_plan import partition_dim

# transformers saves lm_head.weight under the original GPT-NeoX name and renames it on load.
_STORED_ALIASES = {"lm_head.weight": ("lm_head.weight", "embed_out.weight")}
_VOCAB_KEYS = ("gpt_neox.embed_in.weight", "model.embed_tokens.weight", "lm_head.weight", "embed_out.weight")
_INPUT_EMBEDDING_KEYS = ("gpt_neox.embed_in.weight", "model.embed_tokens.weight")


def gather_full_state_dict(model: GPTNeoXForCausalLM, groups: ParallelGroups | None) -> dict:
    """The full state dict of a TP model, in every TP rank's CPU memory, with exactly the keys (and
    shapes) of a stock `GPTNeoXForCausalLM.state_dict()`. Collective over the TP group.

    Each merged tensor leaves the device as soon as it is gathered: only one full tensor at a
    time is on a GPU, never the whole model (which on a 20B would not fit beside its shards)."""
    tp_group = groups.tp_group if groups is not None else None
    merged = {}
    for key, tensor in model.state_dict().items():
        dim = partition_dim(key)
        full = tensor if dim is None else gather_along_dim(tensor, dim, tp_group)
        merged[key] = full.detach().to("cpu", copy=True)
    return merged


def load_tp_shard_state_dict(folder_or_file: str, config: GPTNeoXConfig, tp_rank: int, tp_size: int,
                             keys=None) -> dict:
    """This rank's slices of a safetensors checkpoint (a `model.safetensors`, a folder with
    one, or a folder with `model.safetensors.index.json`), keyed like the state dict of a
    model after `apply_tensor_parallel`. Only the sliced bytes are read into memory.

    When `config.vocab_size` is larger than the stored vocabulary (GPT-NeoX padding for TP),
    the embedding and lm_head slices are read from the real rows and completed with zero
    rows, as `pad_vocab` would, without reading the whole matrix.

    `keys` (state-dict keys of the full model) limits the read to those tensors: a pipeline stage reads its layers only."""
    key_to_file = _safetensors_key_files(folder_or_file)
    expected = _expected_keys(config)
    if keys is not None:
        wanted = set(keys)
        expected = [k for k in expected if k in wanted]
    shard = {}
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, framework="pt")) for f in set(key_to_file.values())}
        for key in expected:
            stored = next((k for k in _STORED_ALIASES.get(key, (key,)) if k in key_to_file), None)
            if stored is None:
                experts = _stock_mixtral_experts(key, key_to_file, handles)
                if experts is not None:  # whole on every TP rank (expert parallelism splits experts, not TP)
                    shard[key] = experts
                continue  # anything else missing is reported below, after tied weights are resolved
            tensor_slice = handles[key_to_file[stored]].get_slice(stored)
            if key in _VOCAB_KEYS and tensor_slice.get_shape()[0] < config.vocab_size:
                shard[key] = _read_padded_vocab_rows(tensor_slice, config.vocab_size, tp_rank, tp_size, stored)
            else:
                shard[key] = _read_rank_slice(tensor_slice, partition_dim(key), tp_rank, tp_size, stored)
    embedding = next((k for k in _INPUT_EMBEDDING_KEYS if k in shard), None)
    if config.tie_word_embeddings and embedding and "lm_head.weight" in expected:
        shard.setdefault("lm_head.weight", shard[embedding])
    missing = [k for k in expected if k not in shard]
    if missing:
        raise CheckpointError(f"{folder_or_file} lacks {missing[:5]}{'...' if len(missing) > 5 else ''}; "
                              f"is it a {type(config).__name__.replace('NeoX', '') or 'GPTNeoX'} checkpoint saved with "
                              "save_pretrained?")
    return shard


_STOCK_MIXTRAL_MOE = re.compile(r"^(model\.layers\.\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$")


def _stock_mixtral_experts(key: str, key_to_file: dict, handles: dict):
    """A Mixtral MoE tensor in transformers 5's fused layout, read from a stock folder's per-expert keys
    (`block_sparse_moe.experts.N.w1/w3/w2`, `block_sparse_moe.gate`); None where the folder has none. Gap filled:
    transformers converts these keys (conversion_mapping's "mixtral": stack the experts, gate and up concatenated on
    dim 1) only inside its own `from_pretrained`, which a TP rank reading its slices does not go through."""
    match = _STOCK_MIXTRAL_MOE.match(key)
    if match is None:
        return None
    prefix, name = f"{match.group(1)}.block_sparse_moe", match.group(2)

    def stored(k):
        return handles[key_to_file[k]].get_tensor(k) if k in key_to_file else None

    if name == "gate.weight":
        return stored(f"{prefix}.gate.weight")
    experts = []
    while f"{prefix}.experts.{len(experts)}.w2.weight" in key_to_file:
        e = f"{prefix}.experts.{len(experts)}"
        experts.append(torch.cat([stored(f"{e}.w1.weight"), stored(f"{e}.w3.weight")]) if name.endswith("gate_up_proj")
                       else stored(f"{e}.w2.weight"))
    return torch.stack(experts) if experts else None


def pad_vocab(model_or_state_dict, new_size: int, init: str = "zeros"):
    """Add rows to the embedding and lm_head so the vocabulary has `new_size` entries.

    New rows are zeros (or the mean of the real rows with init="mean"), so logits of real
    tokens do not change. The padded lm_head rows do add logits for fake tokens (0 with
    zeros), which enter the softmax; pass `real_vocab_size` to `tp_causal_lm_loss` /
    `vocab_parallel_cross_entropy` to exclude them, and mask them in generation.
    A state dict comes back as a new dict; a model is padded in place and returned.
    """
    if init not in ("zeros", "mean"):
        raise NeoXHFError(f"pad_vocab init must be 'zeros' or 'mean', got {init!r}")
    if isinstance(model_or_state_dict, dict):
        return {k: _padded_rows(v, new_size, init) if k in _VOCAB_KEYS else v for k, v in model_or_state_dict.items()}
    return _pad_model_vocab(model_or_state_dict, new_size, init)


def _pad_model_vocab(model: GPTNeoXForCausalLM, new_size: int, init: str) -> GPTNeoXForCausalLM:
    old_size = model.get_input_embeddings().weight.shape[0]
    if new_size < old_size:
        raise NeoXHFError(f"pad_vocab cannot shrink the vocabulary from {old_size} to {new_size}")
    # resize_token_embeddings keeps ties and config.vocab_size consistent and copies the real
    # rows; we overwrite its randomly initialised new rows so real-token logits are unchanged.
    model.resize_token_embeddings(new_size, mean_resizing=False)
    with torch.no_grad():
        for module in (model.get_input_embeddings(), model.get_output_embeddings()):
            module.weight.copy_(_padded_rows(module.weight[:old_size], new_size, init))
    return model


def _padded_rows(weight: torch.Tensor, new_size: int, init: str) -> torch.Tensor:
    old_size = weight.shape[0]
    if new_size < old_size:
        raise NeoXHFError(f"pad_vocab cannot shrink the vocabulary from {old_size} to {new_size}")
    fill = weight.mean(dim=0, keepdim=True) if init == "mean" else torch.zeros_like(weight[:1])
    return torch.cat([weight, fill.expand(new_size - old_size, -1)], dim=0)


def _read_rank_slice(tensor_slice, dim: int | None, rank: int, size: int, name: str) -> torch.Tensor:
    if dim is None:
        return tensor_slice[:]
    shape = tensor_slice.get_shape()
    if shape[dim] % size:
        raise CheckpointError(f"{name} has {shape[dim]} entries along dim {dim}, not divisible by tp={size}; "
                              f"pad the vocabulary with pad_vocab(state_dict, padded_vocab_size(...)) first")
    width = shape[dim] // size
    index = [slice(None)] * len(shape)
    index[dim] = slice(rank * width, (rank + 1) * width)
    return tensor_slice[tuple(index)]


def _read_padded_vocab_rows(tensor_slice, padded_rows: int, rank: int, size: int, name: str) -> torch.Tensor:
    """Rows [rank·w, (rank+1)·w) of the vocabulary matrix zero-padded to `padded_rows`, reading only real rows."""
    if padded_rows % size:
        raise CheckpointError(f"{name}: padded vocabulary {padded_rows} is not divisible by tp={size}")
    stored_rows, hidden = tensor_slice.get_shape()
    width = padded_rows // size
    if (rank + 1) * width <= stored_rows:
        return tensor_slice[rank * width:(rank + 1) * width]  # all real rows: nothing to pad, no copy
    # Clamped to the stored rows: a rank past them reads an empty slice (still of the stored dtype).
    real = tensor_slice[min(rank * width, stored_rows):min((rank + 1) * width, stored_rows)]
    rows = real.new_zeros(width, hidden)
    rows[: real.shape[0]] = real
    return rows


def _safetensors_key_files(folder_or_file: str) -> dict:
    """Map from each stored tensor name to the safetensors file holding it."""
    if os.path.isfile(folder_or_file):
        files = [folder_or_file]
    else:
        index = os.path.join(folder_or_file, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            return {k: os.path.join(folder_or_file, v) for k, v in weight_map.items()}
        files = [os.path.join(folder_or_file, "model.safetensors")]
        if not os.path.isfile(files[0]):
            raise CheckpointError(f"{folder_or_file} has neither model.safetensors nor model.safetensors.index.json")
    key_files = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            key_files.update({k: file for k in f.keys()})
    return key_files


def _expected_keys(config: GPTNeoXConfig) -> list[str]:
    # A meta-device model costs no memory and tracks transformers' own naming.
    from neox_hf.model.spec import model_class_for_config

    with torch.device("meta"):
        return list(model_class_for_config(config)(config).state_dict().keys())
