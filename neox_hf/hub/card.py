"""The model card (README.md) of a trained model: Hub metadata and the facts of the run, built from the recipe.

`huggingface_hub.ModelCard` parses and renders the card; this module decides what a GPT-NeoX run reports (architecture
under GPT-NeoX's names, parameters, tokens trained, the data blend, the final eval loss, the exact recipe).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from neox_hf.errors import HubError
from neox_hf.io import atomic_write_text

CARD_TAGS = ["gpt_neox", "causal-lm", "neox_hf"]


# Keys of a GPTNeoXConfig dict the card reports, with their label.
_ARCHITECTURE_FIELDS = [
    ("num_hidden_layers", "Layers"),
    ("hidden_size", "Hidden size"),
    ("num_attention_heads", "Attention heads"),
    ("max_position_embeddings", "Sequence length"),
    ("rotary_pct", "Rotary fraction (rotary_pct)"),
    ("use_parallel_residual", "Parallel residual"),
    ("vocab_size", "Vocabulary size"),
]


def write_model_card(
    folder: str | os.PathLike,
    *,
    recipe_yaml: str,
    model_config: dict,
    num_parameters: int,
    tokens_trained: int,
    data_sources: list[dict],
    eval_loss: float | None,
    license: str = "apache-2.0",
    datasets: list[str] | None = None,
    extra_markdown: str = "",
) -> Path:
    """Write `folder/README.md`: Hub metadata (library, tags, license, datasets) and the facts of the run.
    `extra_markdown` is appended (the run picture and lm-eval scores, `neox_hf.plot.model_card_section`).

    `model_config` is a GPTNeoXConfig as a dict; `data_sources` are the recipe's blend, each
    {"path": ..., "weight": ...}; `datasets` are Hub dataset ids for the metadata, if any.
    The file is replaced atomically, so a crash never leaves a half-written card next to the weights.
    """
    metadata = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        license=license,
        tags=list(CARD_TAGS),
        datasets=list(datasets) if datasets else None,
    )
    body = model_card_body(
        recipe_yaml=recipe_yaml,
        model_config=model_config,
        num_parameters=num_parameters,
        tokens_trained=tokens_trained,
        data_sources=data_sources,
        eval_loss=eval_loss,
    )
    if extra_markdown:
        body = f"{body.rstrip()}\n\n{extra_markdown.strip()}\n"
    card = ModelCard(f"---\n{metadata.to_yaml()}\n---\n\n{body}")
    return atomic_write_text(Path(folder) / "README.md", str(card))


def model_card_body(
    *,
    recipe_yaml: str,
    model_config: dict,
    num_parameters: int,
    tokens_trained: int,
    data_sources: list[dict],
    eval_loss: float | None,
) -> str:
    """The Markdown body of the model card (everything below the YAML front matter)."""
    sections = [
        "# GPT-NeoX model trained with neox_hf",
        "## Architecture\n\n" + architecture_table(model_config),
        "## Training\n\n"
        f"- Parameters: {num_parameters:,} ({human_count(num_parameters)})\n"
        f"- Tokens trained: {tokens_trained:,} ({human_count(tokens_trained)})",
        "## Data\n\n" + data_table(data_sources),
        "## Evaluation\n\n" + evaluation_lines(eval_loss),
        "## Recipe\n\nThe exact recipe this model was trained with:\n\n" + fenced(recipe_yaml, "yaml"),
    ]
    return "\n\n".join(sections) + "\n"


def with_legacy_rotary_keys(model_config: dict) -> dict:
    """transformers 5 configs keep the rotary fraction and base in `rope_parameters`; the card shows GPT-NeoX's names."""
    rope = model_config.get("rope_parameters") or {}
    legacy = {"rotary_pct": rope.get("partial_rotary_factor"), "rotary_emb_base": rope.get("rope_theta")}
    # whole-head rotary, attention then MLP in sequence
    if model_config.get("model_type") in ("llama", "mistral", "mixtral"):
        legacy.update(rotary_pct=legacy["rotary_pct"] or 1.0, use_parallel_residual=False)
    return {**{k: v for k, v in legacy.items() if v is not None}, **model_config}


def architecture_table(model_config: dict) -> str:
    model_config = with_legacy_rotary_keys(model_config)
    missing = [key for key, _ in _ARCHITECTURE_FIELDS if key not in model_config]
    if missing:
        raise HubError(f"model_config lacks {', '.join(missing)}; pass the GPTNeoXConfig as a dict (config.to_dict())")
    rows = [f"| {label} | {model_config[key]} |" for key, label in _ARCHITECTURE_FIELDS]
    return "| | |\n|---|---|\n" + "\n".join(rows)


def data_table(data_sources: list[dict]) -> str:
    for index, source in enumerate(data_sources):
        if "path" not in source or "weight" not in source:
            raise HubError(f"data_sources[{index}] needs 'path' and 'weight', got keys {sorted(source)}")
    rows = [f"| `{source['path']}` | {source['weight']} |" for source in data_sources]
    return "| Source | Weight |\n|---|---|\n" + "\n".join(rows)


def evaluation_lines(eval_loss: float | None) -> str:
    if eval_loss is None:
        return "- Final eval loss: not measured"
    try:
        perplexity = f"{math.exp(eval_loss):.4f}"
    except OverflowError:
        perplexity = "inf"
    return f"- Final eval loss: {eval_loss:.4f}\n- Perplexity (exp of the loss): {perplexity}"


def human_count(n: int) -> str:
    """1234567 -> "1.23M"."""
    for divisor, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if abs(n) >= divisor:
            return f"{n / divisor:.2f}{suffix}"
    return str(n)


def fenced(text: str, language: str) -> str:
    """`text` in a Markdown code block whose fence is longer than any backtick run inside it."""
    longest, run = 0, 0
    for char in text:
        run = run + 1 if char == "`" else 0
        longest = max(longest, run)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{text.rstrip()}\n{fence}"
