"""Three optimizer steps of our real loop on fixed variable-length batches; used to check that every labelled token
weighs the same whatever micro-batch / accumulation / data-parallel / tensor-parallel layout carries it.

    python tests/workers/token_weighting.py MODEL_DIR OUT_DIR --micro M --accumulation A [--tp T] [--sft] [--normalization N]
    accelerate launch --use_deepspeed --num_processes N ... token_weighting.py (same arguments)
    python tests/workers/token_weighting.py MODEL_DIR OUT_DIR --runs NAME=micro=M,acc=A[,tp=T][,sft][,norm=N] ...
    (or the same `--runs` under accelerate launch)

`--runs` trains several configurations one after the other in the same process(es), each into OUT_DIR/NAME (its own
train_log.jsonl and weights.pt, exactly as a single run writes them), resetting Accelerate between them: a process
costs ~10 s of start-up on 2 cores, a launch of two ~20 s, the 3 steps themselves well under a second. Every run
loads the same saved model and the loop seeds each run from the recipe, so each gives what it gives alone.
Spec keys: micro, acc (required), tp (default 1), sft (flag, or sft=0/1), norm (loss_normalization, default token).

Each step's global batch is 8 examples: 4 short ones then 4 long ones (token counts differ about 8×), dynamically
padded per micro-batch as `data.mode: pad` pads. Micro-batch k of data-parallel rank r holds examples
[(k·D + r)·M, (k·D + r + 1)·M) of the step, so with M=4 one micro-batch is all short and the other all long.
With --sft the first half of each example is a prompt (labels -100), as GSM8K fine-tuning masks it.
Writes OUT_DIR/train_log.jsonl (the loop's per-step losses) and OUT_DIR/weights.pt (rank 0, full state dict).
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

VOCAB, STEPS, GLOBAL = 512, 3, 8
SHORT, LONG = 6, 48


class _SmallTokenizer:
    def __len__(self):
        return VOCAB


def step_examples(step: int, sft: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels aligned with them) of the 8 examples of `step`: 4 short, then 4 long."""
    generator = torch.Generator().manual_seed(100 + step)
    examples = []
    for i in range(GLOBAL):
        length = SHORT + i % 2 if i < GLOBAL // 2 else LONG - 3 * (i % 3)
        ids = torch.randint(2, VOCAB, (length + 1,), generator=generator)
        labels = ids[1:].clone()
        if sft:
            labels[: length // 2] = -100
        examples.append((ids[:-1], labels))
    return examples


def pad(examples) -> dict:
    width = max(ids.shape[0] for ids, _ in examples)
    batch = {"input_ids": torch.zeros(len(examples), width, dtype=torch.long),
             "attention_mask": torch.zeros(len(examples), width, dtype=torch.long),
             "labels": torch.full((len(examples), width), -100, dtype=torch.long)}
    for row, (ids, labels) in enumerate(examples):
        batch["input_ids"][row, : ids.shape[0]] = ids
        batch["attention_mask"][row, : ids.shape[0]] = 1
        batch["labels"][row, : labels.shape[0]] = labels
    return batch


def micro_batches(dp_rank: int, dp: int, micro: int, accumulation: int, sft: bool):
    assert micro * accumulation * dp == GLOBAL
    for step in range(STEPS):
        examples = step_examples(step, sft)
        for k in range(accumulation):
            start = (k * dp + dp_rank) * micro
            yield pad(examples[start: start + micro])


def main(args) -> None:
    recipe = recipe_from_dict({
        "model": {"num_attention_heads": 4, "seq_length": 64},
        "train": {"train_iters": STEPS, "micro_batch_size": args.micro, "gradient_accumulation_steps": args.accumulation,
                  "lr": 1e-3, "min_lr": 1e-4, "warmup": 0.0, "clip_grad": 0.0, "log_interval": 1,
                  "eval_interval": 100, "loss_normalization": args.normalization,
                  "precision": "fp32"},  # compared to 1e-5: not bf16, which `auto` picks on some machines
        "parallel": {"tensor_parallel": args.tp},
        "output": {"dir": args.out_dir, "tensorboard": False},
    })
    accelerator, layout = init_distributed(recipe)
    settings = recipe.to_dict()
    pretrained = recipe_from_dict({**settings, "model": {**settings["model"], "from_pretrained": args.model_dir}})
    engine = build_engine(recipe, accelerator, layout)
    model, optimizer = engine.parallelize(build_engine(pretrained, None, layout).build_model(_SmallTokenizer()))
    scheduler = build_lr_scheduler(optimizer, recipe.train)
    loader = micro_batches(layout.dp_rank, layout.dp, args.micro, args.accumulation, args.sft)
    run = TrainingRun(accelerator, recipe, model, optimizer, scheduler, loader, [], layout=layout, engine=engine)
    run_steps(run, TrainState())
    weights = engine.full_state_dict()
    if accelerator.is_main_process:
        torch.save({k: v.detach().float().cpu() for k, v in weights.items()}, f"{args.out_dir}/weights.pt")


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--micro", type=int)
    parser.add_argument("--accumulation", type=int)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--sft", action="store_true")
    parser.add_argument("--normalization", default="token")
    parser.add_argument("--runs", nargs="+", default=[])
    args = parser.parse_args(argv)
    if not args.runs and (args.micro is None or args.accumulation is None):
        parser.error("--micro and --accumulation are required without --runs")
    return args


_SPEC_KEYS = {"micro": "--micro", "acc": "--accumulation", "tp": "--tp", "norm": "--normalization"}


def runs(args) -> list:
    """The parsed arguments of each run: the command line's one, or one per `--runs` entry (OUT_DIR/NAME)."""
    if not args.runs:
        return [args]
    parsed = []
    for entry in args.runs:
        name, spec = entry.split("=", 1)
        argv = [args.model_dir, os.path.join(args.out_dir, name)]
        for item in spec.split(","):
            key, _, value = item.partition("=")
            if key == "sft":
                if value in ("", "1"):
                    argv.append("--sft")
                elif value != "0":
                    raise SystemExit(f"{entry}: sft takes 0 or 1, not {value!r}")
            elif key in _SPEC_KEYS and value:
                argv += [_SPEC_KEYS[key], value]
            else:
                raise SystemExit(f"{entry}: unknown or empty spec item {item!r} (keys: micro, acc, tp, sft, norm)")
        run = parse_args(argv)
        if run.micro is None or run.accumulation is None:
            raise SystemExit(f"{entry}: micro and acc are required")
        parsed.append(run)
    return parsed


if __name__ == "__main__":
    for run_args in runs(parse_args()):
        os.makedirs(run_args.out_dir, exist_ok=True)
        main(run_args)
        reset_accelerate_state()
    end_process_group()
