"""Peak-RSS growth of reading one TP rank's slices, or the whole checkpoint, in a fresh
process (so neither read benefits from the other's page cache mappings or freed heap):
    python tests/workers/tp_memory.py <model_dir> <tp_size> shard|padded|full <out.json>
`padded` reads the last rank's slices of a vocabulary TP does not divide, zero-padded GPT-NeoX
style (make_vocab_size_divisible_by 128 × TP): that rank holds the padding rows. Every loaded
tensor is summed inside the measured window, so lazily mapped pages count.
"""

import json
import os
import sys

import torch
from safetensors.torch import load_file
from transformers import GPTNeoXConfig

from neox_hf.parallel.tensor_parallel import load_tp_shard_state_dict, pad_vocab, padded_vocab_size
from neox_hf.parallel.tp_checkpoint import _expected_keys
from neox_hf.parallel.tp_plan import partition_dim


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def start_peak_measurement() -> float:
    """Current RSS (MB), after resetting the kernel's peak-RSS mark (VmHWM) to it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_mb("VmRSS")


def full_checkpoint(model_dir: str) -> dict:
    tensors = {}
    for name in sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")):
        tensors.update(load_file(os.path.join(model_dir, name)))
    return tensors


def slices_match(shard: dict, full: dict, tp_size: int, vocab_size: int, rank: int) -> bool:
    full["lm_head.weight"] = full.pop("embed_out.weight")
    full = pad_vocab(full, vocab_size)  # no-op unless the vocabulary was padded
    for key, tensor in shard.items():
        dim = partition_dim(key)
        width = full[key].shape[dim] // tp_size if dim is not None else 0
        expected = full[key] if dim is None else full[key].narrow(dim, rank * width, width)
        if not torch.equal(tensor, expected):
            return False
    return True


def main():
    model_dir, tp_size, mode, out_path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    config = GPTNeoXConfig.from_pretrained(model_dir)
    rank = tp_size - 1 if mode == "padded" else 0
    if mode == "padded":
        config.vocab_size = padded_vocab_size(config.vocab_size, 128, tp_size)
    _expected_keys(config)  # warm up transformers' lazy imports outside the measurement

    before = start_peak_measurement()
    anon_before, file_before = _status_mb("RssAnon"), _status_mb("RssFile")
    if mode in ("shard", "padded"):
        loaded = load_tp_shard_state_dict(model_dir, config, tp_rank=rank, tp_size=tp_size)
    else:
        loaded = full_checkpoint(model_dir)
    touched = sum(float(t.sum()) for t in loaded.values())
    growth = _status_mb("VmHWM") - before
    # Split of the growth: private copies vs clean page-cache pages of the mmapped file
    # (reclaimable; column slices of row-parallel weights touch every page of the tensor).
    anon_growth, file_growth = _status_mb("RssAnon") - anon_before, _status_mb("RssFile") - file_before

    result = {
        "mode": mode,
        "loaded_weights_mb": sum(t.numel() * t.element_size() for t in loaded.values()) / 2**20,
        "peak_rss_growth_mb": growth,
        "anon_rss_growth_mb": anon_growth,
        "file_backed_rss_growth_mb": file_growth,
        "checksum_finite": touched == touched,
    }
    if mode != "full":
        result["slices_match"] = slices_match(loaded, full_checkpoint(model_dir), tp_size, config.vocab_size, rank)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
