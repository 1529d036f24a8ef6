"""Shared by tests/workers/pipe_train.py and tests/test_pipeline.py: the tiny model, the recipe, the fixed batches.

Every layout sees the same global micro-batches: step s has GAS micro-batches of GLOBAL_ROWS rows; data-parallel
rank r of D takes rows [r·GLOBAL_ROWS/D, (r+1)·GLOBAL_ROWS/D) of each. Labels are aligned with the inputs (the loader
shifts them) and a different number of positions is ignored in every micro-batch, so token weighting matters.
"""

import torch
from transformers import GPTNeoXConfig

GAS, GLOBAL_ROWS, SEQ, VOCAB, STEPS = 4, 4, 16, 256, 4


def tiny_config(**overrides) -> GPTNeoXConfig:
    values = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=4, intermediate_size=128, vocab_size=VOCAB,
                  max_position_embeddings=64, attention_dropout=0.0, hidden_dropout=0.0, tie_word_embeddings=False)
    values.update(overrides)
    return GPTNeoXConfig(**values)


def recipe_dict(out_dir, *, pp=1, tp=1, dp=1, zero_stage=1, steps=STEPS, activation_checkpointing=False,
                precision="fp32", normalization="token") -> dict:
    return {
        "model": {"num_attention_heads": 4},
        "train": {"train_iters": steps, "micro_batch_size": GLOBAL_ROWS // dp, "gradient_accumulation_steps": GAS,
                  "lr": 3e-3, "min_lr": 3e-4, "warmup": 0.25, "clip_grad": 1.0, "log_interval": 1,
                  "eval_interval": 100, "precision": precision, "loss_normalization": normalization, "save_interval": 1},
        "parallel": {"pipeline_parallel": pp, "tensor_parallel": tp, "zero_stage": zero_stage, "use_deepspeed": pp * tp * dp > 1,
                     "activation_checkpointing": activation_checkpointing},
        "output": {"dir": str(out_dir), "tensorboard": False},
    }


def global_micro_batch(step: int, index: int, mode: str) -> dict:
    """Micro-batch `index` of optimizer step `step` (1-based), all rows. mode: pack | pad | isolate (pad: the padded
    length changes between micro-batches and every other one has half the rows, as token budgets make them)."""
    g = torch.Generator().manual_seed(1000 * step + index)
    seq = SEQ if mode != "pad" else 8 + 4 * ((step + index) % 3)  # pad: the padded length changes between batches
    ids = torch.randint(2, VOCAB, (GLOBAL_ROWS, seq + 1), generator=g)
    batch = {"input_ids": ids[:, :-1].clone(), "labels": ids[:, 1:].clone()}
    ignored = int(torch.randint(0, seq // 2, (1,), generator=g))
    batch["labels"][0, :ignored] = -100  # a different count of labelled tokens in every micro-batch
    if mode == "pad":
        lengths = torch.randint(seq // 2, seq + 1, (GLOBAL_ROWS,), generator=g)
        mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
        batch["attention_mask"] = mask
        batch["input_ids"] = batch["input_ids"].masked_fill(mask == 0, 1)
        batch["labels"] = batch["labels"].masked_fill(mask == 0, -100)
        if index % 2:  # a token budget's batches: fewer rows when they are long (only with one data-parallel rank)
            batch = {k: v[: GLOBAL_ROWS // 2] for k, v in batch.items()}
    if mode == "isolate":
        starts = (torch.rand(GLOBAL_ROWS, seq, generator=g) < 0.2)
        starts[:, 0] = True
        position = torch.zeros(GLOBAL_ROWS, seq, dtype=torch.long)
        for row in range(GLOBAL_ROWS):
            p = 0
            for t in range(seq):
                p = 0 if starts[row, t] else p + 1
                position[row, t] = p
        batch["position_ids"] = position
        batch["labels"] = batch["labels"].masked_fill(torch.cat([starts[:, 1:], torch.zeros(GLOBAL_ROWS, 1, dtype=torch.bool)], 1), -100)
    return batch


def rank_micro_batches(step: int, mode: str, dp_rank: int, dp: int) -> list[dict]:
    rows = slice(dp_rank * GLOBAL_ROWS // dp, (dp_rank + 1) * GLOBAL_ROWS // dp)
    return [{k: v[rows] for k, v in global_micro_batch(step, i, mode).items()} for i in range(GAS)]


def eval_batches(mode: str, dp_rank: int, dp: int) -> list[dict]:
    return rank_micro_batches(10_000, mode, dp_rank, dp)[:2 + dp_rank]  # ranks hold different counts


class FixedBatches:
    """The training loop's loader for these batches: step s's GAS micro-batches in order (this rank's rows), endless,
    with the position a checkpoint records."""

    def __init__(self, mode: str, dp_rank: int, dp: int):
        self.mode, self.dp_rank, self.dp = mode, dp_rank, dp
        self.position = 0  # micro-batches handed out

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        step, index = divmod(self.position, GAS)
        self.position += 1
        return rank_micro_batches(step + 1, self.mode, self.dp_rank, self.dp)[index]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]
