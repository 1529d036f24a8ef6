"""A Llama-family pipeline run on pipe_common's fixed batches (tests/test_llama.py compares it with one process).

    accelerate launch --use_deepspeed --num_processes N llama_pipe.py MODEL_DIR OUT_DIR --pp P [--tp T]

tests/workers/pipe_train.py with the model family read from MODEL_DIR's config.json. Writes from global rank 0:
OUT_DIR/train_log.jsonl, OUT_DIR/eval.json (eval loss before/after), OUT_DIR/final/ (the merged HF folder).
"""

import argparse
import json
import os
from pathlib import Path

import torch

from neox_hf.model.spec import config_class_for_folder
from neox_hf.parallel.accelerator import build_accelerator
from neox_hf.parallel.layout import build_layout
from neox_hf.engines.pipeline import build_pipeline_module
from neox_hf.recipe import recipe_from_dict
from neox_hf.checkpoint import TrainState
from neox_hf.engines import build_engine
from neox_hf.train.loop import TrainingRun, evaluate, run_steps, save_final_model
from neox_hf.train.schedule import build_lr_scheduler
from pipe_common import FixedBatches, eval_batches, recipe_dict


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    dp = world // (args.pp * args.tp)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    recipe = recipe_from_dict(recipe_dict(out, pp=args.pp, tp=args.tp, dp=dp))
    accelerator = build_accelerator(recipe)
    torch.manual_seed(recipe.train.seed)
    layout = build_layout(recipe.parallel)
    config = config_class_for_folder(args.model_dir).from_pretrained(args.model_dir)
    module = build_pipeline_module(config, layout, folder=args.model_dir,
                                   partition_method=recipe.parallel.pipe_partition_method,
                                   loss_normalization=recipe.train.loss_normalization)
    engine = build_engine(recipe, accelerator, layout)
    model, optimizer = engine.parallelize(module)
    scheduler = build_lr_scheduler(optimizer, recipe.train)
    run = TrainingRun(accelerator, recipe, model, optimizer, scheduler, FixedBatches("pack", layout.dp_rank, dp),
                      eval_batches("pack", layout.dp_rank, dp), layout=layout, engine=engine)
    evals = {"before": evaluate(run)}
    run_steps(run, TrainState())
    evals["after"] = evaluate(run)
    save_final_model(run, out_dir=out / "final")
    if accelerator.is_main_process:
        (out / "eval.json").write_text(json.dumps(evals))
    accelerator.end_training()


if __name__ == "__main__":
    main()
