"""GPT-NeoX's vocabulary rules, one home for the builders, tensor parallelism, pipeline stages and interop: the
embedding is padded to a multiple of `make_vocab_size_divisible_by` × TP size, and never smaller than the tokenizer."""

from __future__ import annotations

from neox_hf.errors import CheckpointError


def check_vocab_covers_tokenizer(model_vocab_size: int, tokenizer, where: str = "model") -> None:
    """Refuse a model whose embedding is smaller than the tokenizer: ids ≥ vocab_size would crash mid-run."""
    if model_vocab_size < len(tokenizer):
        raise CheckpointError(
            f"{where} has vocab_size {model_vocab_size} but the tokenizer has {len(tokenizer)} tokens; "
            "use the tokenizer the model was trained with, or resize the embedding (model.resize_token_embeddings)"
        )


def padded_vocab_size(tokenizer_size: int, divisible_by: int, tensor_parallel: int = 1) -> int:
    """GPT-NeoX's rule: pad the vocabulary to a multiple of make_vocab_size_divisible_by × TP size."""
    multiple = divisible_by * tensor_parallel
    return ((tokenizer_size + multiple - 1) // multiple) * multiple
