"""A pipeline-parallel run on fixed batches (tests/test_pipeline.py compares it with one process).

    accelerate launch --use_deepspeed --num_processes N pipe_train.py MODEL_DIR OUT_DIR --pp P [--tp T] [options]

The steps are the training loop's own (`neox_hf.train.loop.run_steps` through the pipeline engine), on a loader of
fixed batches. Writes, from global rank 0: OUT_DIR/train_log.jsonl (the loop's per-step log),
OUT_DIR/eval.json (token-weighted eval loss before and after training), OUT_DIR/final/ (the merged HF folder),
OUT_DIR/report.txt (the start-up pipeline report). Options: --mode pack|pad|isolate, --activation-checkpointing,
--scratch (initialise from scratch instead of reading MODEL_DIR's weights), --precision fp32|bf16,
--launcher-precision no|bf16 (the `accelerate launch --mixed_precision` this run stands for: ACCELERATE_MIXED_PRECISION
while it runs, so runs of different launcher precisions can share one launch).

    accelerate launch ... pipe_train.py MODEL_DIR OUT_DIR --runs NAME="OPTIONS" [NAME="OPTIONS" ...]

trains several runs one after the other in the same processes, each into OUT_DIR/NAME (exactly the files a single
run writes), resetting Accelerate between them; OPTIONS are the options above (shell-quoted, split with shlex), plus
`--model-dir DIR` for a run on another model than MODEL_DIR. A launch of 2 processes costs ~20 s of start-up on
2 cores, of 4 ~40 s; the runs themselves a few seconds. Each run builds its own process groups (the layout's and the
pipeline engine's), reseeds from its recipe and keeps the world's process group (only the last run ends it), so it
gives what it gives launched alone. Each run prints `pipe_train run NAME: start` / `done`, and `FAILED` before the
exception of a run that fails, so a failing launch names its run.

    --runs ... NAME="--entry RUN_ARGS..."

as the LAST run: `run_clm_neox.py RUN_ARGS` through the entry point's function (`neox_hf.cli.train_main`, the real
loop, which ends the process group as a launch of the entry point does), in the launch's processes: what it prints
to stdout is also written to OUT_DIR/NAME.stdout (every rank's, appended), its exit status to OUT_DIR/NAME.status.
"""

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

import torch

from neox_hf.model import NeoXConfig
from neox_hf.parallel.accelerator import build_accelerator
from neox_hf.parallel.layout import build_layout
from neox_hf.engines.pipeline import build_pipeline_module
from neox_hf.recipe import recipe_from_dict
from neox_hf.checkpoint import TrainState
from neox_hf.engines import build_engine
from neox_hf.train.loop import TrainingRun, evaluate, run_steps, save_final_model
from neox_hf.train.schedule import build_lr_scheduler
from pipe_common import FixedBatches, eval_batches, recipe_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the suite-wide conftest helpers
from conftest import reset_accelerate_state  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--mode", default="pack")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--scratch", action="store_true")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--launcher-precision")
    parser.add_argument("--model-dir", dest="model_dir_override")
    parser.add_argument("--runs", nargs="+", default=[])
    args = parser.parse_args(argv)
    if args.model_dir_override:
        args.model_dir = args.model_dir_override
    return args


def runs(args) -> list[tuple[str | None, argparse.Namespace]]:
    """(name, parsed arguments) of each run: the command line's own, or one per `--runs NAME=OPTIONS` entry."""
    if not args.runs:
        return [(None, args)]
    parsed = []
    for index, entry in enumerate(args.runs):
        name, sep, options = entry.partition("=")
        if not sep or not name:
            raise SystemExit(f"--runs {entry!r}: expected NAME=OPTIONS")
        if shlex.split(options)[:1] == ["--entry"]:
            if index != len(args.runs) - 1:
                raise SystemExit(f"--runs {entry!r}: an --entry run ends the process group: it must be the last")
            parsed.append((name, argparse.Namespace(entry=shlex.split(options)[1:], out_dir=args.out_dir,
                                                    launcher_precision=None)))
            continue
        run = parse_args([args.model_dir, os.path.join(args.out_dir, name), *shlex.split(options)])
        if run.runs:
            raise SystemExit(f"--runs {entry!r}: a run cannot hold --runs")
        parsed.append((name, run))
    if len({name for name, _ in parsed}) != len(parsed):
        raise SystemExit("--runs: names must differ")
    return parsed


def run_all(args) -> None:
    planned = runs(args)
    for index, (name, run_args) in enumerate(planned):
        last = index == len(planned) - 1
        saved = os.environ.get("ACCELERATE_MIXED_PRECISION")
        if run_args.launcher_precision is not None:
            os.environ["ACCELERATE_MIXED_PRECISION"] = run_args.launcher_precision
        if name is not None:
            print(f"pipe_train run {name}: start", flush=True)
        try:
            if getattr(run_args, "entry", None) is not None:
                status = entry_point(run_args.entry, Path(run_args.out_dir) / name)
                if status:
                    raise SystemExit(status)
            else:
                main(run_args, end=last)
        except BaseException:
            if name is not None:
                print(f"pipe_train run {name}: FAILED (rank {os.environ.get('RANK')})", file=sys.stderr, flush=True)
            raise
        finally:
            if saved is None:
                os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
            else:
                os.environ["ACCELERATE_MIXED_PRECISION"] = saved
        if name is not None:
            print(f"pipe_train run {name}: done", flush=True)
        if not last:
            reset_accelerate_state()


def entry_point(argv: list[str], record: Path) -> int:
    """`run_clm_neox.py ARGV`'s exit status, what it prints to stdout copied to RECORD.stdout."""
    import contextlib

    from neox_hf.cli import train_main

    stdout = sys.stdout

    class Tee:
        def write(self, text):
            copy.write(text)
            return stdout.write(text)

        def __getattr__(self, name):
            return getattr(stdout, name)

    with open(f"{record}.stdout", "a") as copy, contextlib.redirect_stdout(Tee()):
        status = train_main(argv)
    Path(f"{record}.status").write_text(str(status))
    return status


def main(args, end: bool = True) -> None:
    world = int(os.environ["WORLD_SIZE"])
    dp = world // (args.pp * args.tp)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    recipe = recipe_from_dict(recipe_dict(out, pp=args.pp, tp=args.tp, dp=dp,
                                          activation_checkpointing=args.activation_checkpointing,
                                          precision=args.precision))
    accelerator = build_accelerator(recipe)
    torch.manual_seed(recipe.train.seed)
    layout = build_layout(recipe.parallel)
    config = NeoXConfig.from_pretrained(args.model_dir)
    module = build_pipeline_module(config, layout, folder=None if args.scratch else args.model_dir,
                                   partition_method=recipe.parallel.pipe_partition_method,
                                   activation_checkpointing=recipe.parallel.activation_checkpointing,
                                   loss_normalization=recipe.train.loss_normalization)
    engine = build_engine(recipe, accelerator, layout)
    model, optimizer = engine.parallelize(module)
    scheduler = build_lr_scheduler(optimizer, recipe.train)
    loader = FixedBatches(args.mode, layout.dp_rank, dp)
    state = TrainState()
    run = TrainingRun(accelerator, recipe, model, optimizer, scheduler, loader,
                      eval_batches(args.mode, layout.dp_rank, dp), layout=layout, engine=engine)
    if accelerator.is_main_process:
        (out / "report.txt").write_text("\n".join(engine.startup_lines()))
    evals = {"before": evaluate(run)}
    run_steps(run, state)
    evals["after"] = evaluate(run)
    save_final_model(run, out_dir=out / "final")
    if accelerator.is_main_process:
        (out / "eval.json").write_text(json.dumps(evals))
    if end:
        accelerator.end_training()
    else:  # a next run in this launch keeps the world's process group (it builds its own subgroups)
        accelerator.wait_for_everyone()


if __name__ == "__main__":
    run_all(parse_args())
