"""One rank of a 2-process gloo group (tests/test_launch_config.py): settles `train.precision` as argv says for each
round (`ROUND=RANK0,RANK1 ...`) and prints what `check_ranks_agree_on_precision` answered, one line per round."""

from __future__ import annotations

import sys

import torch.distributed as dist

from neox_hf.errors import RecipeError
from neox_hf.parallel.accelerator import check_ranks_agree_on_precision

dist.init_process_group("gloo")
for round_ in sys.argv[1:]:
    precision = round_.split(",")[dist.get_rank()]
    try:
        check_ranks_agree_on_precision(precision)
        print("agreed", flush=True)
    except RecipeError as err:
        print(f"error: {err}", flush=True)
dist.destroy_process_group()
