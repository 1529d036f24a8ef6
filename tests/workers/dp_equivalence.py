"""One optimizer run of our training loop on fixed batches; used to compare 1 process vs DP2 ZeRO-1/2/3.

    python tests/workers/dp_equivalence.py MODEL_DIR OUT_DIR ZERO_STAGE [TP] [options]   (1 process: no DeepSpeed)
    accelerate launch --num_processes N --use_deepspeed ... dp_equivalence.py MODEL_DIR OUT_DIR ZERO_STAGE [TP] [options]
    accelerate launch ... dp_equivalence.py MODEL_DIR OUT_DIR --layouts NAME=ZERO_STAGE,TP[,option...] ...

Options (recipe switches): --offload-optimizer, --activation-checkpointing, --sequence-parallel, --precision fp16, --steps N,
--deepspeed-config FILE (raw DeepSpeed JSON merged over the recipe's), --data-workers N (`data.num_workers`: 1 reads
the batches in a worker process forked from each rank).

`--layouts` runs several layouts one after the other in the same processes (OUT_DIR/NAME/train_log.jsonl each),
resetting Accelerate between them: a launch costs ~10 s of start-up on 2 cores, the runs themselves a second or two.
Order ZeRO-3 last: transformers keeps treating later models as ZeRO-3 partitioned while its config lives.

Every run sees the same global batch of 8 sequences per step; data-parallel rank r of D = N / TP takes rows
[r·8/D, (r+1)·8/D), so both ranks of a tensor-parallel group see the same rows. The per-step losses (averaged over
ranks by the loop) land in OUT_DIR/train_log.jsonl.
"""

import argparse
import os
import sys
from pathlib import Path

import torch

from neox_hf.engines import build_engine
from neox_hf.parallel import init_distributed
from neox_hf.recipe import recipe_from_dict
from neox_hf.checkpoint import TrainState
from neox_hf.train.loop import TrainingRun, run_steps
from neox_hf.train.schedule import build_lr_scheduler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the suite-wide conftest helpers
from conftest import end_process_group, reset_accelerate_state  # noqa: E402

GLOBAL_BATCH, SEQ, STEPS, VOCAB = 8, 32, 5, 512


class _SmallTokenizer:
    """build_model only checks the model's vocabulary covers the tokenizer."""

    def __len__(self):
        return VOCAB


TOKENIZER = _SmallTokenizer()


def fixed_batches(rank: int, world: int):
    generator = torch.Generator().manual_seed(0)
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    while True:
        ids = torch.randint(2, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=generator)
        yield {"input_ids": ids[rows, :-1], "labels": ids[rows, 1:]}


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("zero_stage", type=int, nargs="?", default=1)
    parser.add_argument("tensor_parallel", type=int, nargs="?", default=1)
    parser.add_argument("--layouts", nargs="+", default=[])
    parser.add_argument("--offload-optimizer", action="store_true")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--deepspeed-config")
    parser.add_argument("--data-workers", default="auto")
    return parser.parse_args(argv)


def layout_runs(args):
    """The parsed arguments of each run: the command line's one, or one per `--layouts` entry (OUT_DIR/NAME)."""
    if not args.layouts:
        return [args]
    runs = []
    for entry in args.layouts:
        name, spec = entry.split("=", 1)
        stage, tp, *options = spec.split(",")
        runs.append(parse_args([args.model_dir, os.path.join(args.out_dir, name), stage, tp, *options]))
    return runs


def main(args) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data_parallel = world // args.tensor_parallel
    recipe = recipe_from_dict({
        "model": {"num_attention_heads": 4},
        "train": {"train_iters": args.steps, "micro_batch_size": GLOBAL_BATCH // data_parallel, "lr": 1e-3,
                  "min_lr": 1e-4, "warmup": 0.2, "clip_grad": 1.0, "log_interval": 1, "eval_interval": 100,
                  "precision": args.precision},
        "parallel": {"zero_stage": args.zero_stage, "tensor_parallel": args.tensor_parallel,
                     "offload_optimizer": args.offload_optimizer,
                     "activation_checkpointing": args.activation_checkpointing,
                     "sequence_parallel": args.sequence_parallel,
                     "deepspeed_config": args.deepspeed_config},
        "data": {"num_workers": args.data_workers if args.data_workers == "auto" else int(args.data_workers)},
        "output": {"dir": args.out_dir, "tensorboard": False},
    })
    accelerator, layout = init_distributed(recipe)
    # TP layouts load through the loop's sharded path: each rank reads only its slices of the folder.
    settings = recipe.to_dict()
    pretrained = recipe_from_dict({**settings, "model": {**settings["model"], "from_pretrained": args.model_dir}})
    engine = build_engine(recipe, accelerator, layout)
    model, optimizer = engine.parallelize(build_engine(pretrained, None, layout).build_model(TOKENIZER))
    scheduler = build_lr_scheduler(optimizer, recipe.train)
    loader = fixed_batches(layout.dp_rank, layout.dp)
    run_steps(TrainingRun(accelerator, recipe, model, optimizer, scheduler, loader, [], layout=layout, engine=engine),
              TrainState())


if __name__ == "__main__":
    for run in layout_runs(parse_args()):
        main(run)
        reset_accelerate_state()
    end_process_group()
