"""torchrun worker for tests/test_neox_order.py: each data-parallel rank (gloo process group up, so global rank 0
builds GPT-NeoX's index and the other waits at the barrier) reads its micro-batches in GPT-NeoX order and writes
their rows (inputs + last label) to <out>/neox.rank<R>.npy."""

import os
import sys

import numpy as np
import torch.distributed as dist

from neox_hf.data import build_train_loader
from neox_hf.recipe import recipe_from_dict


class Tok:
    eos_token_id = 0


def main(out_dir: str, prefix: str, steps: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = recipe_from_dict({"model": {"seq_length": 16}, "data": {
        "order": "gpt-neox", "split": "969,30,1", "sources": [{"path": prefix}]}}).data
    loader = build_train_loader(cfg, Tok(), seq_length=16, micro_batch_size=2, dp_rank=rank, dp_size=world,
                                seed=cfg.seed, gradient_accumulation_steps=2, train_iters=int(steps))
    rows = []
    for _ in range(int(steps) * 2):
        batch = next(loader)
        rows.append(np.concatenate([batch["input_ids"].numpy(), batch["labels"].numpy()[:, -1:]], axis=1))
    np.save(os.path.join(out_dir, f"neox.rank{rank}.npy"), np.stack(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
