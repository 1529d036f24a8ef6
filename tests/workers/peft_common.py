"""Shared by tests/test_finetune.py, tests/test_eval_generate.py and the peft_* workers: a tiny saved GPTNeoX
folder with the real GPT-NeoX tokenizer, the GSM8K prompt/answer templates, and a tiny LoRA recipe."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from neox_hf.model.folder import save_hf_folder
from neox_hf.data.tokenizer import load_tokenizer
from neox_hf.recipe import recipe_from_dict

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "examples" / "data" / "gpt-neox-20b-tokenizer.json"
GSM8K_SAMPLE = REPO / "examples" / "data" / "gsm8k-sample.jsonl"
TEMPLATE = "Question: {question}\nAnswer: {answer}"
PROMPT_TEMPLATE = "Question: {question}\nAnswer: "
VOCAB = 50304  # 50,277 tokens padded to a multiple of 128, as Pythia


def tiny_config(**overrides) -> GPTNeoXConfig:
    values = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=256, vocab_size=VOCAB,
                  max_position_embeddings=256, rotary_pct=0.25, hidden_dropout=0.0, attention_dropout=0.0,
                  bos_token_id=0, eos_token_id=0, pad_token_id=1, tie_word_embeddings=False)
    values.update(overrides)
    return GPTNeoXConfig(**values)


def make_tiny_folder(out_dir, *, seed: int = 0, with_tokenizer: bool = True, **overrides) -> Path:
    """A stock GPTNeoX folder (random weights, fixed seed) with the GPT-NeoX tokenizer beside it."""
    torch.manual_seed(seed)
    model = GPTNeoXForCausalLM(tiny_config(**overrides))
    tokenizer = load_tokenizer(str(TOKENIZER)) if with_tokenizer else None
    return save_hf_folder(model, out_dir, tokenizer=tokenizer)


def lora_recipe(base: Path, out_dir: Path, *, steps: int = 4, zero_stage: int = 0, **sections):
    """A GSM8K LoRA recipe over the tiny folder: prompt masked, pad mode, short sequences."""
    raw = {
        "model": {"from_pretrained": str(base), "seq_length": 128},
        "tokenizer": {"path": str(TOKENIZER)},
        "data": {"sources": [{"path": str(GSM8K_SAMPLE), "template": TEMPLATE, "prompt_template": PROMPT_TEMPLATE}],
                 "mode": "pad", "buffer_size": 64, "shuffle": True},
        "train": {"train_iters": steps, "micro_batch_size": 2, "lr": 1e-2, "min_lr": 1e-3, "warmup": 0.0,
                  "log_interval": 1, "eval_interval": 1000, "eval_iters": 0, "weight_decay": 0.0},
        "parallel": {"zero_stage": zero_stage},
        "peft": {"method": "lora", "r": 4, "alpha": 8, "dropout": 0.0},
        "output": {"dir": str(out_dir), "tensorboard": False},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return recipe_from_dict(raw)
