"""Peak-RSS growth of reading one TP rank's slices, or the whole checkpoint, each in a fresh process
(so no read benefits from another's page cache mappings or freed heap): this process imports once, then
forks one child per measurement, before loading anything itself.
    python tests/workers/tp_memory.py <tp_size> <out.json> <model_dir> shard|padded|full [<model_dir> <mode> ...]
writes a list of results, one per (model_dir, mode) pair, in order.
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

from neox_hf.model.vocab import padded_vocab_size
from neox_hf.parallel.tensor_parallel import load_tp_shard_state_dict, pad_vocab
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


def measure(model_dir: str, tp_size: int, mode: str) -> dict:
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
    return result


def resident_file_pages() -> list[int]:
    """Addresses of the pages of readable file mappings (library code and data) present in this process's page
    tables. fork() does not copy those page tables, a child refaults them on first use: refaulting them before its
    measurement gives the child a fresh process's state, where imports had already faulted them."""
    page = os.sysconf("SC_PAGE_SIZE")
    addresses = []
    with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb") as pagemap:
        for line in maps:
            fields = line.split()
            if len(fields) < 6 or not fields[5].startswith("/") or not fields[1].startswith("r"):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            pagemap.seek(start // page * 8)
            entries = pagemap.read((end - start) // page * 8)
            for i, entry in enumerate(memoryview(entries).cast("Q")):
                if entry >> 63:
                    addresses.append(start + i * page)
    return addresses


def touch(addresses: list[int]) -> None:
    import ctypes

    for address in addresses:
        ctypes.string_at(address, 1)


def measure_in_child(model_dir: str, tp_size: int, mode: str) -> dict:
    """`measure` in a forked child of this (imported, never-loading) process: a fresh process for each measured load
    (peak RSS, heap and mappings are per process) without paying the imports again."""
    resident = resident_file_pages()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_end)
        code = 1
        try:
            touch(resident)
            with os.fdopen(write_end, "w") as f:
                json.dump(measure(model_dir, tp_size, mode), f)
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"measuring {mode} of {model_dir} failed (exit status {status})")
    return json.loads(text)


def main():
    tp_size, out_path, jobs = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    torch.set_num_threads(1)
    # Before any fork: transformers' lazy imports for config loading and key listing (a child repeats it, as a fresh
    # process would, outside its measurement).
    _expected_keys(GPTNeoXConfig.from_pretrained(jobs[0]))
    results = [measure_in_child(model_dir, tp_size, mode) for model_dir, mode in zip(jobs[::2], jobs[1::2])]
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
