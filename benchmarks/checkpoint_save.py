"""Time and peak host memory of one training checkpoint save, per layout, old format vs layout-free (issue 27):

    python benchmarks/checkpoint_save.py [--layers 12 --hidden 768] [--layouts "DP2 ZeRO-2,TP2 (ZeRO-1)"]

Each layout is one `accelerate launch` of this file's worker, which builds exactly the run `run_clm_neox.py` trains
(`neox_hf.train.loop.build_run` on `recipes/tiny.yaml` with the model shape and layout given; fp32), trains one step
(so Adam's moments exist) and then saves three times into fresh folders, every rank timing between barriers:

- old: `accelerator.save_state`, the per-rank format (DeepSpeed's engine files, or accelerate's model + optimizer
  files for one process) that resumes only on the layout that wrote it: the baseline;
- layout-free: `Engine.layout_free_state` + `save_layout_free` (torch.distributed.checkpoint): every rank writes
  its own chunks of each parameter and Adam moment under its full name and shape;
- checkpoint: `save_checkpoint` as the training loop calls it today (both of the above where DeepSpeed runs or there
  are several processes; one process without DeepSpeed writes only the old files, which are layout-free already),
  plus trainer state, config and tokenizer.

"of which state" is the part of the layout-free save spent in `layout_free_state` (under ZeRO-1/2/3, DeepSpeed's
`safe_get_full_*` gathering each parameter and moment whole, one at a time), the rest being DCP's write.
Peak memory is the largest, over ranks, of the peak resident set during that save (VmHWM, reset through
/proc/self/clear_refs before it) minus the resident set just before it: what the save itself needed on top of the
run. Size is the bytes the save left on disk. Times on a shared 2-core CPU: compare rows of one invocation.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's neox_hf, installed or not

from bench_common import status_mb  # noqa: E402

LAYOUTS = {  # name: (processes, zero stage, tensor parallel, pipeline stages)
    "1 process": (1, 0, 1, 1),
    "DP2 ZeRO-1": (2, 1, 1, 1),
    "DP2 ZeRO-2": (2, 2, 1, 1),
    "DP2 ZeRO-3": (2, 3, 1, 1),
    "TP2 (ZeRO-1)": (2, 1, 2, 1),
    "pipeline 2": (2, 1, 1, 2),
    "pipeline 2 × TP2": (4, 1, 2, 2),
}
PHASES = ("old", "layout-free", "checkpoint")


# -- worker (one rank of one layout) ------------------------------------------------------------------------------


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as refs:  # "5": reset VmHWM to the current resident set
        refs.write("5")


def _folder_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20


def _measured(phase: str, save, folder: Path, accelerator) -> dict:
    """Seconds (between barriers), peak MB added over the resident set before, MB written."""
    gc.collect()
    accelerator.wait_for_everyone()
    _reset_peak()
    before = status_mb("VmRSS")
    started = time.perf_counter()
    save(folder)
    accelerator.wait_for_everyone()
    seconds = time.perf_counter() - started
    return {"phase": phase, "seconds": seconds, "peak_added_mb": status_mb("VmHWM") - before,
            "disk_mb": _folder_mb(folder) if accelerator.is_main_process else 0.0}


def _savers(run, state, gather_seconds: list) -> dict:
    from neox_hf.checkpoint import save_checkpoint
    from neox_hf.checkpoint.layout_free import save_layout_free

    def old(folder: Path) -> None:
        run.accelerator.save_state(str(folder))

    def layout_free(folder: Path) -> None:
        started = time.perf_counter()
        tensors, _ = run.engine.layout_free_state()
        gather_seconds.append(time.perf_counter() - started)
        save_layout_free(tensors, folder)

    def checkpoint(folder: Path) -> None:
        save_checkpoint(run.accelerator, output_dir=folder, state=state, scheduler=run.scheduler,
                        data_loader=run.loader_position or run.loader, keep_last_n=2,
                        model_config=run.accelerator.unwrap_model(run.model).config, tokenizer=run.tokenizer,
                        precision="fp32", engine=run.engine)

    return {"old": old, "layout-free": layout_free, "checkpoint": checkpoint}


def worker(argv: list[str], scratch: Path, result: Path) -> None:
    from neox_hf.recipe import settled
    from neox_hf.recipe.args import parse_run_args
    from neox_hf.train.loop import build_run, run_steps

    recipe = settled(parse_run_args(argv).recipe)
    run, state = build_run(recipe)
    run_steps(run, state)  # one step: Adam's moments exist, as at any real checkpoint
    rank = run.accelerator.process_index
    rows, gather_seconds = [], []
    for phase, save in _savers(run, state, gather_seconds).items():
        folder = scratch / phase
        if run.accelerator.is_main_process:
            folder.mkdir(parents=True, exist_ok=True)
        run.accelerator.wait_for_everyone()
        rows.append(_measured(phase, save, folder, run.accelerator))
        rows[-1]["gather_seconds"] = gather_seconds.pop() if gather_seconds else None
    result.with_name(f"{result.name}.rank{rank}").write_text(json.dumps(rows))
    run.accelerator.end_training()


# -- parent: one launch per layout, one table ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _recipe_args(args, layout: str, out: Path) -> list[str]:
    processes, zero, tp, pp = LAYOUTS[layout]
    dp = processes // (tp * pp)
    return [str(REPO / "recipes" / "tiny.yaml"), "--model.num_layers", str(args.layers),
            "--model.hidden_size", str(args.hidden), "--model.num_attention_heads", str(args.hidden // 64),
            "--model.seq_length", "128", "--train.micro_batch_size", "1", "--train.train_iters", "1",
            "--train.gradient_accumulation_steps", str(2 // dp) if dp <= 2 else "1",
            "--train.save_interval", "1000", "--train.eval_iters", "0", "--train.log_interval", "1",
            "--train.precision", "fp32", "--output.tensorboard", "false", "--output.dir", str(out),
            "--parallel.zero_stage", str(zero), "--parallel.tensor_parallel", str(tp),
            "--parallel.pipeline_parallel", str(pp)]


def measure(args, layout: str, scratch: Path) -> list[list[dict]]:
    """Every rank's rows for `layout`."""
    processes = LAYOUTS[layout][0]
    result = scratch / "result.json"
    worker_args = ["--worker", str(scratch / "saves"), str(result), "--",
                   *_recipe_args(args, layout, scratch / "run")]
    if processes == 1:
        command = [sys.executable, __file__, *worker_args]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes),
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--use_deepspeed",
                   "--main_process_port", str(_free_port()), __file__, *worker_args]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{layout}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return [json.loads(result.with_name(f"{result.name}.rank{r}").read_text()) for r in range(processes)]


def table(measured: dict[str, list[list[dict]]]) -> str:
    head = (f"{'layout':<18} {'save':<12} {'seconds':>8} {'of which state':>15} {'peak added MB (max rank)':>25} "
            f"{'on disk MB':>11} {'time vs old':>12}")
    lines = [head, "-" * len(head)]
    for layout, ranks in measured.items():
        old_seconds = ranks[0][0]["seconds"]
        for i, phase in enumerate(PHASES):
            seconds = ranks[0][i]["seconds"]
            peak = max(rank[i]["peak_added_mb"] for rank in ranks)
            disk = sum(rank[i]["disk_mb"] for rank in ranks)
            gather = ranks[0][i].get("gather_seconds")
            gather = f"{gather:>15.2f}" if gather is not None else f"{'':>15}"
            lines.append(f"{layout if i == 0 else '':<18} {phase:<12} {seconds:>8.2f} {gather} {peak:>25.0f} "
                         f"{disk:>11.0f} {seconds / old_seconds:>11.2f}×")
    return "\n".join(lines)


def main() -> None:
    if "--worker" in sys.argv:
        i = sys.argv.index("--worker")
        worker(sys.argv[sys.argv.index("--") + 1:], Path(sys.argv[i + 1]), Path(sys.argv[i + 2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names from: " + ", ".join(LAYOUTS))
    args = parser.parse_args()
    layouts = [name.strip() for name in args.layouts.split(",")]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        print(f"error: unknown layout {unknown[0]!r}; choose from {', '.join(LAYOUTS)}", file=sys.stderr)
        raise SystemExit(2)
    measured = {}
    for layout in layouts:
        scratch = Path(tempfile.mkdtemp(prefix="neox_hf_save_bench_"))
        try:
            started = time.time()
            measured[layout] = measure(args, layout, scratch)
            print(f"{layout}: {time.time() - started:.0f} s", file=sys.stderr)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    params = "model: {} layers × {} hidden, fp32, Adam".format(args.layers, args.hidden)
    print(params)
    print(table(measured))


if __name__ == "__main__":
    main()
