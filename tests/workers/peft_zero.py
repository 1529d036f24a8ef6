"""Worker: LoRA runs through the real train loop under `accelerate launch --use_deepspeed`, one per ZeRO stage.

    accelerate launch --use_deepspeed ... peft_zero.py BASE_FOLDER OUT_DIR STAGE [STAGE ...]   (no launcher --zero_stage)

The runs train one after the other in the same processes, into OUT_DIR/zero{STAGE} each, resetting Accelerate between
them: a launch costs ~10 s of CPU start-up per process on 2 cores, a run a few. Each recipe sets its own
`parallel.zero_stage`, so the launch passes no `--zero_stage` (a launcher stage contradicting a recipe's is refused).
ZeRO-3 must come last (transformers keeps treating later models as ZeRO-3 partitioned while its config lives): other
orders are refused.

The loop wraps the model (`peft.method: lora`) and saves the adapter with `save_finetuned`. Just before that final
save, every rank gathers the LoRA parameters (collective under ZeRO-3) and rank 0 writes them to
<run folder>/trained_lora.pt, so the test compares the saved adapter with what was actually trained.
"""

import os
import sys
from pathlib import Path

import torch

from neox_hf import finetune
from neox_hf.train import loop
from peft_common import lora_recipe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the suite-wide conftest helpers
from conftest import reset_accelerate_state, runs_sharing_one_process_group  # noqa: E402

captured = {}


def gather_then_save(accelerator, model, tokenizer, recipe, **saving):
    captured["lora"] = gathered_lora(accelerator.unwrap_model(model))
    captured["report"] = finetune.trainable_parameters_report(accelerator.unwrap_model(model))
    return finetune.save_finetuned(accelerator, model, tokenizer, recipe, **saving)


def gathered_lora(model) -> dict:
    named = [(n, p) for n, p in model.named_parameters() if "lora_" in n]
    params = [p for _, p in named]
    if hasattr(params[0], "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return {n: p.detach().clone() for n, p in named}
    return {n: p.detach().clone() for n, p in named}


def parse_runs(argv: list[str]) -> tuple[str, list[tuple[str, int]]]:
    """BASE_FOLDER and the (out dir, stage) of each run."""
    base, out, *stages = argv
    stages = [int(stage) for stage in stages]
    if not stages or 3 in stages[:-1]:
        sys.exit("usage: peft_zero.py BASE_FOLDER OUT_DIR STAGE [STAGE ...], ZeRO-3 last (transformers keeps its "
                 "ZeRO-3 config for later models)")
    return base, [(os.path.join(out, f"zero{stage}"), stage) for stage in stages]


def train_one(base: str, out: str, stage: int) -> None:
    captured.clear()
    recipe = lora_recipe(base, out, steps=3, zero_stage=stage)
    result = loop.train(recipe)
    if int(os.environ["RANK"]) == 0:
        torch.save({"lora": captured["lora"], "losses": result.train_losses, "report": captured["report"]},
                   f"{out}/trained_lora.pt")


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    base, runs = parse_runs(argv)
    loop.save_finetuned = gather_then_save
    with runs_sharing_one_process_group():
        for out, stage in runs:
            train_one(base, out, stage)
            reset_accelerate_state()


if __name__ == "__main__":
    main(sys.argv[1:])
