"""A pipeline-parallel run on fixed batches (tests/test_pipeline.py compares it with one process).

    accelerate launch --use_deepspeed --num_processes N pipe_train.py MODEL_DIR OUT_DIR --pp P [--tp T] [options]

Writes, from global rank 0: OUT_DIR/train_log.jsonl (step, loss, tokens, samples, grad_norm per step),
OUT_DIR/eval.json (token-weighted eval loss before and after training), OUT_DIR/final/ (the merged HF folder),
OUT_DIR/report.txt (the start-up pipeline report). Options: --mode pack|pad|isolate, --activation-checkpointing,
--kill-at-step K (SIGKILL rank 0 after step K's update, before its checkpoint), --resume (from OUT_DIR's latest checkpoint),
--scratch (initialise from scratch instead of reading MODEL_DIR's weights), --precision fp32|bf16.
"""

import argparse
import json
import os
import signal
from pathlib import Path

import torch

from neox_hf.model import NeoXConfig
from neox_hf.parallel.accelerator import build_accelerator
from neox_hf.parallel.layout import build_layout
from neox_hf.parallel.pipeline import (
    build_pipeline_module,
    partition_stages,
    pipeline_eval_loss,
    pipeline_report,
    pipeline_train_step,
    save_pipeline_hf_folder,
)
from neox_hf.recipe import recipe_from_dict
from neox_hf.train.checkpoint import TrainState, find_resume_checkpoint, load_checkpoint, save_checkpoint
from neox_hf.parallel import build_optimizer
from neox_hf.train.schedule import build_lr_scheduler
from pipe_common import GAS, eval_batches, rank_micro_batches, recipe_dict


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--mode", default="pack")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--kill-at-step", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--scratch", action="store_true")
    parser.add_argument("--precision", default="fp32")
    return parser.parse_args()


def main(args) -> None:
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
    optimizer = build_optimizer(module, recipe.train)
    engine, optimizer = accelerator.prepare(module, optimizer)
    scheduler = build_lr_scheduler(optimizer, recipe.train)
    state = TrainState()
    checkpoint = find_resume_checkpoint("auto", out) if args.resume else None
    if checkpoint is not None:
        state = load_checkpoint(accelerator, checkpoint, scheduler=scheduler, data_loader=None)
    if accelerator.is_main_process:
        parts = partition_stages(config, layout.pp, recipe.parallel.pipe_partition_method)
        (out / "report.txt").write_text("\n".join(pipeline_report(config, parts, GAS, tp=layout.tp)))
    evals = {"before": pipeline_eval_loss(engine, eval_batches(args.mode, layout.dp_rank, dp), layout)}
    while state.step < recipe.train.train_iters:
        step = state.step + 1
        holds_data = layout.is_first_stage or layout.is_last_stage
        batches = rank_micro_batches(step, args.mode, layout.dp_rank, dp) if holds_data else None
        result = pipeline_train_step(engine, batches, layout, recipe)
        scheduler.step()
        state.step = step
        if accelerator.is_main_process:
            with (out / "train_log.jsonl").open("a") as log:
                log.write(json.dumps({"step": step, "loss": result.loss.item(), "tokens": result.tokens.item(),
                                      "samples": int(result.samples), "skipped": result.skipped,
                                      "grad_norm": None if result.grad_norm is None else result.grad_norm.item()}) + "\n")
        if args.kill_at_step == step:
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                os.kill(os.getpid(), signal.SIGKILL)  # dies after the update, before this step's checkpoint
            accelerator.wait_for_everyone()
        save_checkpoint(accelerator, output_dir=out, state=state, scheduler=scheduler, data_loader=None, keep_last_n=2,
                        model_config=config)
    evals["after"] = pipeline_eval_loss(engine, eval_batches(args.mode, layout.dp_rank, dp), layout)
    save_pipeline_hf_folder(engine, layout, config, out / "final")
    if accelerator.is_main_process:
        (out / "eval.json").write_text(json.dumps(evals))
    accelerator.end_training()


if __name__ == "__main__":
    main(parse_args())
