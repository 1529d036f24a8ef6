"""Peak host memory per rank while building a model from scratch under tensor parallelism: the whole model built
then split (the baseline) against neox_hf's meta-device build: `python benchmarks/startup_memory.py [--layers 12
--hidden 1024]`.

Each measurement is a fresh pair of processes (gloo, TP group of 2) that builds the model and reports its peak RSS
(VmHWM) and what the build added over the RSS after imports:

- `TP2 whole then split`: the baseline, what a build without the meta device does: transformers' `_from_config` builds
  and initialises the whole fp32 model on every rank, then `apply_tensor_parallel` splits it;
- `TP2 meta + own shards`: `model_from_seed`: built on the meta device, split there, only this rank's shards
  materialised, each parameter drawn whole from its seeded generator, sliced and freed;
- `PP2 x TP2 stage s`: the pipeline's `StageBuilder` for one stage's rank, the same init.

The table ends with the sizes that bound the new path: one rank's shards plus the largest single tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's neox_hf, installed or not

from bench_common import status_mb  # noqa: E402

PATHS = ("old", "new", "pp-stage0", "pp-stage1")
LABELS = {"old": "TP2 whole then split (baseline)", "new": "TP2 meta + own shards (neox_hf)",
          "pp-stage0": "PP2 x TP2 stage 0 (neox_hf)", "pp-stage1": "PP2 x TP2 stage 1 (neox_hf)"}


def _config(layers: int, hidden: int, vocab: int):
    from neox_hf.model.modeling import NeoXConfig

    return NeoXConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                      intermediate_size=4 * hidden, tie_word_embeddings=False)


def _build(path: str, config, rank: int):
    """The modules this rank holds after start-up, built the way `path` names."""
    import torch
    import torch.distributed as dist

    from neox_hf.model.modeling import NeoXForCausalLM
    from neox_hf.engines.build import model_from_seed
    from neox_hf.parallel.layout import Layout
    from neox_hf.parallel.tensor_parallel import apply_tensor_parallel

    group = dist.group.WORLD
    if path == "old":
        whole = NeoXForCausalLM._from_config(config, dtype=torch.float32)
        return apply_tensor_parallel(whole, group)
    if path == "new":
        return model_from_seed(NeoXForCausalLM, config, 1234, Layout(tp=2, tp_rank=rank, tp_group=group))
    from neox_hf.engines.pipeline import StageBuilder
    from neox_hf.engines.pipeline.partition import partition_stages, pipeline_layer_infos

    stage = int(path[-1])
    builder = StageBuilder(config, Layout(pp=2, pp_rank=stage, tp=2, tp_rank=rank, tp_group=group), seed=1234)
    parts = partition_stages(config, 2)
    return [builder.build(p) for info in pipeline_layer_infos(config)[parts[stage]:parts[stage + 1]] for p in info.paths]


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import neox_hf.model.modeling  # noqa: F401  (imports counted in the baseline, not the build)
    import neox_hf.engines.pipeline  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2)
    config = _config(args.layers, args.hidden, args.vocab)
    before = status_mb("VmRSS")
    built = _build(args.path, config, args.rank)
    dist.barrier()
    print(json.dumps({"rank": args.rank, "peak_mb": status_mb("VmHWM"), "build_mb": status_mb("VmHWM") - before,
                      "held_mb": _held_mb(built)}))
    dist.destroy_process_group()


def _held_mb(built) -> float:
    """Parameter bytes the rank keeps (a tied tensor once)."""
    modules = built if isinstance(built, list) else [built]
    held = {p.data_ptr(): p.numel() * p.element_size() for m in modules for p in m.parameters()}
    return sum(held.values()) / 2**20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(path: str, args) -> list[dict]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, __file__, "--worker", "--path", path, "--port", str(port), "--layers", str(args.layers),
               "--hidden", str(args.hidden), "--vocab", str(args.vocab)]
    procs = [subprocess.Popen([*command, "--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, env=env) for r in range(2)]
    results = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"{path}: a rank failed (exit {proc.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def reference_sizes(args) -> dict[str, float]:
    """Full model, one TP2 rank's shards, and the largest single tensor, in MB (fp32), counted on meta."""
    import torch

    from neox_hf.model.modeling import NeoXForCausalLM
    from neox_hf.parallel.tp_plan import partition_dim

    with torch.device("meta"):
        model = NeoXForCausalLM(_config(args.layers, args.hidden, args.vocab))
    sizes = {name: p.numel() * 4 / 2**20 for name, p in model.named_parameters()}
    shard = sum(size / (2 if partition_dim(name) is not None else 1) for name, size in sizes.items())
    return {"full": sum(sizes.values()), "shard": shard, "largest": max(sizes.values())}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--path", choices=PATHS)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    sizes = reference_sizes(args)
    print(f"model: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, fp32: full {sizes['full']:.0f} MB, "
          f"one TP2 rank's shards {sizes['shard']:.0f} MB, largest tensor {sizes['largest']:.0f} MB")
    print(f"{'path':34} {'rank':>4} {'peak RSS MB':>12} {'build added MB':>15} {'params held MB':>15}")
    for path in args.paths.split(","):
        for result in measure(path, args):
            print(f"{LABELS[path]:34} {result['rank']:>4} {result['peak_mb']:>12.0f} {result['build_mb']:>15.0f} "
                  f"{result['held_mb']:>15.0f}")


if __name__ == "__main__":
    main()
