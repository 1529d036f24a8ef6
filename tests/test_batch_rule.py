"""GPT-NeoX's batch rule as GPT-NeoX computes it: `NeoXArgs.calculate_batch_parameters` then
`check_batch_parameters` (megatron/neox_arguments/arguments.py), on the data-parallel size GPT-NeoX derives from the
config's GPU count: global_num_gpus / pipe_parallel_size / (model_parallel_size × context_parallel_size), the
context-parallel branch's arithmetic (expert-parallel ranks are data-parallel ranks there). The copy below is written
from that source, branch by branch, and the translation must agree with it for every case at DP 1, 2 and 4."""

from __future__ import annotations

import json

import pytest

from neox_hf.errors import RecipeError
from neox_hf.neox_yaml import translate_neox_args
from neox_hf.recipe import recipe_from_dict

ABSENT = object()  # not in the config: NeoXArgs' default applies (gradient_accumulation_steps 1, the others None)


def neox_calculate_batch_parameters(dp_world_size, train_batch=None, micro_batch=None, grad_acc=None):
    """GPT-NeoX's six branches, in its order (the assert of the last: neither batch key given)."""
    if train_batch is not None and micro_batch is not None and grad_acc is not None:
        return train_batch, micro_batch, grad_acc
    elif train_batch is not None and micro_batch is not None:
        grad_acc = train_batch // micro_batch
        grad_acc //= dp_world_size
    elif train_batch is not None and grad_acc is not None:
        micro_batch = train_batch // dp_world_size
        micro_batch //= grad_acc
    elif micro_batch is not None and grad_acc is not None:
        train_batch = micro_batch * grad_acc
        train_batch *= dp_world_size
    elif train_batch is not None:
        grad_acc = 1
        micro_batch = train_batch // dp_world_size
    elif micro_batch is not None:
        train_batch = micro_batch * dp_world_size
        grad_acc = 1
    else:
        raise AssertionError("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")
    return int(train_batch), int(micro_batch), int(grad_acc)


def neox_check_batch_parameters(dp_world_size, train_batch, micro_batch, grad_acc):
    assert train_batch > 0
    assert micro_batch > 0
    assert grad_acc > 0
    assert train_batch == micro_batch * grad_acc * dp_world_size


def gpt_neox(dp: int, train_batch, micro, accumulation):
    """(micro, accumulation) GPT-NeoX trains with, or None where it refuses (its AssertionError or ZeroDivisionError)."""
    values = [None if v is ABSENT else v for v in (train_batch, micro)]
    grad_acc = 1 if accumulation is ABSENT else accumulation  # the dataclass default
    try:
        tb, mb, gas = neox_calculate_batch_parameters(dp, values[0], values[1], grad_acc)
        neox_check_batch_parameters(dp, tb, mb, gas)
    except (AssertionError, ZeroDivisionError):
        return None
    return mb, gas


# Every given / absent / null pattern of the three keys: the four cases where one is derived (accumulation,
# micro batch, train_batch_size, or micro batch with accumulation 1) and the all-given case
CASES = [(tb, mb, gas) for tb in (ABSENT, 16, 24, 32, 64) for mb in (ABSENT, None, 2, 8)
         for gas in (ABSENT, None, 1, 2) if not (tb is ABSENT and mb in (ABSENT, None))]
# (data-parallel size, layout keys): pipeline, tensor and context parallel ranks counted out as GPT-NeoX counts them
LAYOUTS = [(1, {"global_num_gpus": 1}), (1, {"global_num_gpus": 4, "model_parallel_size": 2, "context_parallel_size": 2}),
           (2, {"global_num_gpus": 2}), (2, {"global_num_gpus": 8, "pipe_parallel_size": 2, "model_parallel_size": 2}),
           (2, {"global_num_gpus": 4, "context_parallel_size": 2, "pipe_parallel_size": 0}),
           (4, {"global_num_gpus": 4}), (4, {"global_num_gpus": 16, "model_parallel_size": 2, "context_parallel_size": 2}),
           (4, {"num_gpus": 4, "num_nodes": 2, "pipe_parallel_size": 2})]


def translated(config: dict):
    try:
        translation = translate_neox_args(config)
    except RecipeError:
        return None
    train = recipe_from_dict(translation.recipe).train
    return train.micro_batch_size, train.gradient_accumulation_steps


@pytest.mark.parametrize("dp,layout", LAYOUTS, ids=[f"dp{dp}-" + "-".join(f"{k}{v}" for k, v in lay.items())
                                                    for dp, lay in LAYOUTS])
def test_every_case_matches_gpt_neox_arithmetic_at_dp_1_2_and_4(dp, layout):
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    disagreements = []
    for case in CASES:
        config = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, **layout,
                  **{k: v for k, v in zip(keys, case) if v is not ABSENT}}
        want = gpt_neox(dp, *case)
        if translated(config) != want:
            disagreements.append((case, translated(config), want))
    assert not disagreements, disagreements
    accepted = sum(gpt_neox(dp, *case) is not None for case in CASES)
    assert 0 < accepted < len(CASES)  # both outcomes are walked at every size


# (data-parallel size, the launch's processes, layout keys without a GPU count): GPT-NeoX then counts the GPUs it runs
# on; here torchrun / accelerate launch say it in WORLD_SIZE (unset: one process, as a plain python run)
LAUNCHES = [(1, None, {}), (2, 2, {}), (2, 8, {"pipe_parallel_size": 2, "model_parallel_size": 2}),
            (4, 4, {}), (4, 16, {"model_parallel_size": 2, "context_parallel_size": 2})]


@pytest.mark.parametrize("dp,processes,layout", LAUNCHES, ids=[f"dp{dp}-world{w}" for dp, w, _ in LAUNCHES])
def test_every_case_matches_gpt_neox_arithmetic_on_the_launchs_processes(dp, processes, layout, monkeypatch):
    """A case that derives a value from the size is derived on the launch's size, as GPT-NeoX does; one that
    derives nothing is translated as given and the launch's check (`train_batch_disagreement`, what
    `parallel.layout.check_launch` refuses with) agrees with GPT-NeoX's check at that size."""
    from neox_hf.recipe import train_batch_disagreement

    if processes is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", str(processes))
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    disagreements = []
    for case in CASES:
        config = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, **layout,
                  **{k: v for k, v in zip(keys, case) if v is not ABSENT}}
        want = gpt_neox(dp, *case)
        try:
            train = recipe_from_dict(translate_neox_args(config).recipe).train
        except RecipeError:
            got = None
        else:
            got = None if train_batch_disagreement(train, dp) else (train.micro_batch_size,
                                                                    train.gradient_accumulation_steps)
        if got != want:
            disagreements.append((case, got, want))
    assert not disagreements, disagreements


def test_print_config_says_what_a_one_process_launch_trains(tmp_path):
    # the line `--print-config` prints (neox_hf.cli._batch_line), on the recipe it parses (the plan line beside it
    # measures this machine: seconds, so it is left out here)
    from neox_hf.batches import one_process_batch_line
    from neox_hf.recipe.args import parse_run_args

    config = tmp_path / "neox.yml"
    config.write_text(json.dumps({"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 32,
                                  "max-position-embeddings": 32, "train_batch_size": 32,
                                  "train_micro_batch_size_per_gpu": 8}))
    line = one_process_batch_line(parse_run_args([str(config), "--print-config"]).recipe)
    assert line == ("batch on a one-process launch: micro batch 8 × gradient_accumulation_steps 1 × 1 data-parallel "
                    "rank = 8 samples per step; train_batch_size 32 is not micro batch 8 × gradient_accumulation_steps"
                    " 1 × 1 data-parallel process(es) (= 8); GPT-NeoX refuses it there (it runs on 4 data-parallel "
                    "ranks: 4 processes)"), line
    recipe = parse_run_args([str(config), "--print-config", "--train.gradient_accumulation_steps", "4"]).recipe
    assert one_process_batch_line(recipe) == ("batch on a one-process launch: micro batch 8 × "
                                              "gradient_accumulation_steps 4 × 1 data-parallel rank = 32 samples per "
                                              "step")
