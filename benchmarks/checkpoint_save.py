"""A training checkpoint against the disk it is written to: bytes, save and load speed, and what a save costs a step.

    python benchmarks/checkpoint_save.py [--layers 6 --hidden 512] [--layouts "1 process,DP2 ZeRO-2,FSDP2"]

First the disk: a 1 GiB file written sequentially and fsynced (`dd conv=fsync`), then read back after the page cache
was dropped where this process may (`/proc/sys/vm/drop_caches`; else read from the cache, and the table says so).
Then each layout is one launch of this file's worker, which builds exactly the run `run_clm_neox.py` trains
(`neox_hf.train.loop.build_run` on `recipes/tiny.yaml` with the model shape and layout given; fp32, Adam) and times,
every rank between barriers (each save after `sync`: the write-back of the one before is done, as between the saves
of a run):

- steps: the median step without a save; the median step that also saves, synchronously (`save_checkpoint` as the
  loop calls it) and in the background (`train.async_checkpoint`: the step waits for the host copy only; and with
  the host copy itself made beside the next step, whose optimizer step waits for it);
- old: the two-format save this replaced, as it was for several processes or DeepSpeed (accelerate's `save_state`:
  DeepSpeed's per-rank engine files, or accelerate's model + optimizer, then the layout-free DCP state beside them):
  the baseline;
- save: the checkpoint the loop writes now (one format: the layout-free state + small per-rank states; one process
  without DeepSpeed: accelerate's model + optimizer files, which are that state already), its bytes against the
  ideal (fp32 masters + Adam's two moments: 12 bytes a parameter in an fp32 run, which keeps no 16-bit weights) and
  its GB/s against the disk's;
- load: `load_checkpoint` of it into the same run, page cache dropped before each where permitted, against the
  disk reading the same files (`read_files`: one reader, one file after the other, 8 MiB reads, cold) just before
  each load: the median of 7 such pairs' ratios. A shared virtual disk drifts by 2-3x within a minute (seen here:
  0.5-1.5 GB/s reading one file), so a load is compared with a read of its own bytes at the same moment, not with
  the 1 GiB read at the start.

Times on a shared CPU machine: compare rows of one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's neox_hf, installed or not

LAYOUTS = {  # name: (processes, zero stage, backend)
    "1 process": (1, 0, "deepspeed"),
    "DP2 ZeRO-2": (2, 2, "deepspeed"),
    "FSDP2": (2, 0, "fsdp2"),
}
STEPS = 5  # timed steps of each kind (medians)
LOADS = 7  # timed loads, each paired with a read of the same files (the disk of a shared machine drifts by 2-3x)
GB = 1e9


# -- the disk ----------------------------------------------------------------------------------------------------


def drop_page_cache() -> bool:
    """Whether the page cache could be dropped (root on the host; a container usually may not)."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def read_files(folder: Path) -> None:
    """Every file under `folder` read once, one after the other, in large sequential reads (what `cat` does): the
    disk reading a checkpoint's bytes, the baseline of its load."""
    block = bytearray(8 << 20)
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with path.open("rb", buffering=0) as handle:
                while handle.readinto(block):
                    pass


def disk_speeds(folder: Path, size: int = 1 << 30) -> tuple[float, float, bool]:
    """(sequential write GB/s, fsynced; sequential read GB/s; whether the read missed the page cache)."""
    path, block = folder / "dd.bin", os.urandom(8 << 20)
    started = time.perf_counter()
    with path.open("wb") as handle:
        for _ in range(size // len(block)):
            handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())
    write = size / (time.perf_counter() - started) / GB
    cold = drop_page_cache()
    started = time.perf_counter()
    with path.open("rb") as handle:
        while handle.read(8 << 20):
            pass
    read = size / (time.perf_counter() - started) / GB
    path.unlink()
    return write, read, cold


# -- worker (one rank of one layout) ------------------------------------------------------------------------------


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def worker(argv: list[str], scratch: Path, result: Path) -> None:
    from neox_hf.checkpoint import checkpoint_root, load_checkpoint, save_checkpoint
    from neox_hf.checkpoint.background import BackgroundWrites
    from neox_hf.checkpoint.layout_free import save_layout_free
    from neox_hf.parallel.accelerator import uses_deepspeed
    from neox_hf.recipe import settled
    from neox_hf.recipe.args import parse_run_args
    from neox_hf.train.loop import _layout_free_engine, build_run
    from neox_hf.train.prefetch import Prefetcher

    recipe = settled(parse_run_args(argv).recipe)
    run, state = build_run(recipe)
    accelerator, engine = run.accelerator, run.engine
    batches = Prefetcher(run.loader)
    run.loader_position = batches
    gas = recipe.train.gradient_accumulation_steps

    def barrier_seconds(work, *, settled: bool = False) -> float:
        if settled:  # the page cache's write-back of the previous save done: saves are minutes apart in a run
            os.sync()
        accelerator.wait_for_everyone()
        started = time.perf_counter()
        work()
        accelerator.wait_for_everyone()
        return time.perf_counter() - started

    def step() -> None:
        engine.train_step([next(batches) for _ in range(gas)])
        state.step += 1

    def save(output_dir: Path, background=None) -> Path:
        return save_checkpoint(accelerator, output_dir=output_dir, state=state, scheduler=run.scheduler,
                               data_loader=batches, keep_last_n=1,
                               model_config=accelerator.unwrap_model(run.model).config, tokenizer=run.tokenizer,
                               precision="fp32", engine=_layout_free_engine(engine, recipe), background=background)

    for _ in range(2):  # warm-up: Adam's moments exist, as at any real checkpoint
        step()
    plain = [barrier_seconds(step) for _ in range(STEPS)]
    sync = [barrier_seconds(lambda: (step(), save(scratch / "sync")), settled=True) for _ in range(STEPS)]
    writes = BackgroundWrites(pinned=accelerator.device.type == "cuda")
    background, between = [], []
    # The step that saves, after the previous write is complete (saves are far apart in a run: one that came before
    # the last write ended would wait for it, which the table would count against the save); then a step beside it.
    for _ in range(STEPS):
        writes.wait()
        background.append(barrier_seconds(lambda: (step(), save(scratch / "async", writes)), settled=True))
        between.append(barrier_seconds(step))  # a step beside the write in flight
    writes.close()
    overlapped = BackgroundWrites(pinned=accelerator.device.type == "cuda", overlap=True)
    beside, after = [], []  # the host copy too made beside the next step, which waits for it before its optimizer step
    for _ in range(STEPS):
        overlapped.wait()
        beside.append(barrier_seconds(lambda: (step(), save(scratch / "overlap", overlapped)), settled=True))
        after.append(barrier_seconds(step))
    overlapped.close()

    def old(folder: Path) -> None:  # the save this replaced: both formats wherever there were several processes
        accelerator.save_state(str(folder))
        if accelerator.num_processes > 1 or uses_deepspeed(accelerator) or engine.backend == "fsdp2":
            tensors, _ = engine.layout_free_state()
            save_layout_free(tensors, folder)

    old_folder = scratch / "old"
    if accelerator.is_main_process:
        old_folder.mkdir(parents=True)
    accelerator.wait_for_everyone()
    old_seconds = barrier_seconds(lambda: old(old_folder), settled=True)
    new_seconds = barrier_seconds(lambda: save(scratch / "new"), settled=True)
    folder = checkpoint_root(scratch / "new") / f"step_{state.step:08d}"
    loads, reads = [], []
    for _ in range(LOADS):  # each load beside the disk reading the same files just before it, both cold
        cold = drop_page_cache() if accelerator.is_main_process else False
        reads.append(barrier_seconds(lambda: read_files(folder) if accelerator.is_main_process else None))
        if accelerator.is_main_process:
            drop_page_cache()
        loads.append(barrier_seconds(lambda: load_checkpoint(accelerator, folder, scheduler=run.scheduler,
                                                             data_loader=batches,
                                                             engine=_layout_free_engine(engine, recipe))))
    batches.close()
    parameters = engine.parameter_count()
    rows = {"plain": plain, "sync": sync, "background": background, "between": between, "overlap": beside, "after_overlap": after,
            "old_seconds": old_seconds,
            "new_seconds": new_seconds, "loads": loads, "reads": reads, "cold_load": cold, "parameters": parameters,
            "old_bytes": _folder_bytes(old_folder) if accelerator.is_main_process else 0,
            "new_bytes": _folder_bytes(folder) if accelerator.is_main_process else 0,
            "new_entries": sorted(p.name for p in folder.iterdir()) if accelerator.is_main_process else []}
    result.with_name(f"{result.name}.rank{accelerator.process_index}").write_text(json.dumps(rows))
    accelerator.end_training()


# -- parent: the disk, one launch per layout, one table ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _recipe_args(args, layout: str, out: Path) -> list[str]:
    processes, zero, backend = LAYOUTS[layout]
    return [str(REPO / "recipes" / "tiny.yaml"), "--model.num_layers", str(args.layers),
            "--model.hidden_size", str(args.hidden), "--model.num_attention_heads", str(args.hidden // 64),
            "--model.seq_length", "128", "--train.micro_batch_size", "1", "--train.train_iters", "1000",
            "--train.gradient_accumulation_steps", "1", "--train.eval_iters", "0", "--train.log_interval", "1000",
            "--train.precision", "fp32", "--output.tensorboard", "false", "--output.dir", str(out),
            *(["--parallel.backend", "fsdp2", "--parallel.use_deepspeed", "false"] if backend == "fsdp2"
              else ["--parallel.zero_stage", str(zero)])]


def measure(args, layout: str, scratch: Path) -> dict:
    """Rank 0's row for `layout` (times are between barriers: every rank's agree)."""
    processes, _, backend = LAYOUTS[layout]
    result = scratch / "result.json"
    worker_args = ["--worker", str(scratch / "saves"), str(result), "--", *_recipe_args(args, layout, scratch / "run")]
    if processes == 1:
        command = [sys.executable, __file__, *worker_args]
    elif backend == "fsdp2":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
                   __file__, *worker_args]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes),
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--use_deepspeed",
                   "--main_process_port", str(_free_port()), __file__, *worker_args]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "") if processes == 1 else "",
           "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{layout}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return json.loads(result.with_name(f"{result.name}.rank0").read_text())


def table(measured: dict[str, dict], write: float, read: float, cold: bool) -> list[str]:
    median = statistics.median
    head = (f"{'layout':<11} {'save':<9} {'GB':>6} {'×ideal':>7} {'s':>6} {'GB/s':>6} {'×disk':>6} │ "
            f"{'step s':>7} {'+sync':>7} {'+async':>7} {'async×':>7} {'beside':>7} {'+ovlp':>7} {'ovlp×':>7} {'next':>7} │ "
            f"{'load s':>7} {'read s':>7} {'GB/s':>6} {'×read':>6}")
    lines = [head, "─" * len(head)]
    for layout, m in measured.items():
        ideal = 12 * m["parameters"]
        step = median(m["plain"])
        for name, seconds, size in (("old (2×)", m["old_seconds"], m["old_bytes"]),
                                    ("one", m["new_seconds"], m["new_bytes"])):
            speed = size / seconds / GB
            steps = (f"{step:>7.3f} {median(m['sync']):>7.3f} {median(m['background']):>7.3f} "
                     f"{median(m['background']) / step:>6.2f}× {median(m['between']):>7.3f} "
                     f"{median(m['overlap']):>7.3f} {median(m['overlap']) / step:>6.2f}× "
                     f"{median(m['after_overlap']):>7.3f}" if name == "one" else " ".join([f"{'':>7}"] * 8))
            load = (f"{median(m['loads']):>7.2f} {median(m['reads']):>7.2f} {size / median(m['loads']) / GB:>6.2f} "
                    f"{median(r / t for r, t in zip(m['reads'], m['loads'])):>5.2f}×" if name == "one"
                    else f"{'':>7} {'':>7} {'':>6} {'':>6}")
            lines.append(f"{layout if name.startswith('old') else '':<11} {name:<9} {size / GB:>6.2f} "
                         f"{size / ideal:>6.2f}× {seconds:>6.2f} {speed:>6.2f} {speed / write:>5.2f}× │ {steps} │ {load}")
    lines.append(f"disk: sequential write {write:.2f} GB/s (1 GiB, fsynced), read {read:.2f} GB/s "
                 f"({'page cache dropped' if cold else 'page cache NOT dropped: not permitted here'})")
    lines.append(f"load: the median of {LOADS} cold loads; read s: the disk reading the same files just before each "
                 "(one reader, 8 MiB reads, cold); ×read: the median of the pairs' read s / load s")
    lines.append("+async: the step that saves with `train.async_checkpoint` (it waits for the host copy), the previous "
                 "write complete; beside: the step after it, the write going on; +ovlp / next: the same with the host "
                 "copy made beside the next step, whose optimizer step waits for it")
    return lines


def main() -> None:
    if "--worker" in sys.argv:
        i = sys.argv.index("--worker")
        worker(sys.argv[sys.argv.index("--") + 1:], Path(sys.argv[i + 1]), Path(sys.argv[i + 2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names from: " + ", ".join(LAYOUTS))
    parser.add_argument("--scratch", default=None, help="a folder on the disk to measure (default: the temp folder)")
    args = parser.parse_args()
    layouts = [name.strip() for name in args.layouts.split(",")]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        print(f"error: unknown layout {unknown[0]!r}; choose from {', '.join(LAYOUTS)}", file=sys.stderr)
        raise SystemExit(2)
    base = Path(tempfile.mkdtemp(prefix="neox_hf_save_bench_", dir=args.scratch))
    try:
        write, read, cold = disk_speeds(base)
        measured = {}
        for layout in layouts:
            scratch = base / layout.replace(" ", "_")
            scratch.mkdir()
            started = time.time()
            measured[layout] = measure(args, layout, scratch)
            print(f"{layout}: {time.time() - started:.0f} s", file=sys.stderr)
            shutil.rmtree(scratch, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    params = next(iter(measured.values()))["parameters"]
    print(f"model: {args.layers} layers × {args.hidden} hidden, {params / 1e6:.1f}M parameters ({4 * params / GB:.2f} GB "
          f"fp32), Adam, fp32; {STEPS} steps of each kind (medians); ×ideal: bytes / (12 bytes a parameter)")
    print("\n".join(table(measured, write, read, cold)))


if __name__ == "__main__":
    main()
