"""Parallelism primitives: the layout (`layout`: tp × pp × dp ranks and their groups), process groups for DeepSpeed
(`tp_groups`), tensor-parallel layers and their communication (`tp_layers`, `mappings`, `tensor_parallel`,
`tp_plan`, `tp_checkpoint`), and the Accelerator / DeepSpeed configuration generated from a recipe (`accelerator`).
What runs a model over them is an engine (`neox_hf.engines`).

    accelerator, layout = init_distributed(recipe)      launch check, Accelerator (+ DeepSpeed plugin), the Layout
"""

from __future__ import annotations

from neox_hf.parallel.accelerator import build_accelerator, check_ranks_agree_on_precision
from neox_hf.parallel.layout import Layout, build_layout, check_launch

__all__ = ["Layout", "init_distributed"]


def init_distributed(recipe, *, log_with=None):
    """(Accelerator, Layout). Refuses a launch that cannot give the recipe's layout before any process group exists."""
    check_launch(recipe)
    accelerator = build_accelerator(recipe, log_with=log_with)
    check_ranks_agree_on_precision(recipe.train.precision)
    return accelerator, build_layout(recipe.parallel)
