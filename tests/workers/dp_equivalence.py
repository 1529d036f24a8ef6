"""One optimizer run of our training loop on fixed batches; used to compare 1 process vs DP2 ZeRO-1/2/3.

    python tests/workers/dp_equivalence.py MODEL_DIR OUT_DIR ZERO_STAGE          (1 process, no DeepSpeed when 0)
    accelerate launch --num_processes 2 --use_deepspeed ... dp_equivalence.py MODEL_DIR OUT_DIR ZERO_STAGE

Every run sees the same global batch of 8 sequences per step; rank r of W takes rows [r·8/W, (r+1)·8/W). The
per-step losses (averaged over ranks by the loop) land in OUT_DIR/train_log.jsonl.
"""

import sys

import torch

from neox_hf.model import NeoXForCausalLM
from neox_hf.parallel.accelerator import build_accelerator
from neox_hf.recipe import recipe_from_dict
from neox_hf.train.checkpoint import TrainState
from neox_hf.train.loop import build_optimizer, run_steps
from neox_hf.train.schedule import build_lr_scheduler

GLOBAL_BATCH, SEQ, STEPS, VOCAB = 8, 32, 5, 512


def fixed_batches(rank: int, world: int):
    generator = torch.Generator().manual_seed(0)
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    while True:
        ids = torch.randint(2, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=generator)
        yield {"input_ids": ids[rows, :-1], "labels": ids[rows, 1:]}


def main(model_dir: str, out_dir: str, zero_stage: int) -> None:
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    recipe = recipe_from_dict({
        "train": {"train_iters": STEPS, "micro_batch_size": GLOBAL_BATCH // world, "lr": 1e-3, "min_lr": 1e-4,
                  "warmup": 0.2, "clip_grad": 1.0, "log_interval": 1, "eval_interval": 100},
        "parallel": {"zero_stage": zero_stage, "use_deepspeed": world > 1},
        "output": {"dir": out_dir, "tensorboard": False},
    })
    accelerator = build_accelerator(recipe)
    model = NeoXForCausalLM.from_pretrained(model_dir)
    optimizer = build_optimizer(model, recipe)
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = build_lr_scheduler(optimizer, recipe.train)
    loader = fixed_batches(accelerator.process_index, accelerator.num_processes)
    run_steps(accelerator, recipe, model, optimizer, scheduler, loader, [], TrainState(), tokenizer=None)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
