"""Worker: a LoRA run through the real train loop under `accelerate launch --use_deepspeed` (ZeRO-2 or ZeRO-3).

argv: BASE_FOLDER OUT_DIR ZERO_STAGE. The loop wraps the model (`peft.method: lora`) and saves the adapter with
`save_finetuned`. Just before that final save (the loop ends the process group afterwards), every rank gathers the LoRA parameters
(collective under ZeRO-3) and rank 0 writes them to OUT_DIR/trained_lora.pt, so the test compares the saved
adapter with what was actually trained.
"""

import os
import sys

import torch

from neox_hf import finetune
from neox_hf.train import loop
from peft_common import lora_recipe

captured = {}


def gather_then_save(accelerator, model, tokenizer, recipe):
    captured["lora"] = gathered_lora(accelerator.unwrap_model(model))
    captured["report"] = finetune.trainable_parameters_report(accelerator.unwrap_model(model))
    return finetune.save_finetuned(accelerator, model, tokenizer, recipe)


def gathered_lora(model) -> dict:
    named = [(n, p) for n, p in model.named_parameters() if "lora_" in n]
    params = [p for _, p in named]
    if hasattr(params[0], "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return {n: p.detach().clone() for n, p in named}
    return {n: p.detach().clone() for n, p in named}


def main() -> None:
    torch.set_num_threads(1)
    base, out, stage = sys.argv[1], sys.argv[2], int(sys.argv[3])
    recipe = lora_recipe(base, out, steps=3, zero_stage=stage)
    loop.save_finetuned = gather_then_save
    result = loop.train(recipe)
    if int(os.environ["RANK"]) == 0:
        torch.save({"lora": captured["lora"], "losses": result.train_losses, "report": captured["report"]},
                   f"{out}/trained_lora.pt")


if __name__ == "__main__":
    main()
