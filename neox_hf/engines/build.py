"""The model a plain-engine rank trains, before the engine wraps it: from scratch or pretrained, only this rank's
tensor-parallel slices where the folder allows it (a pipeline rank builds only its stage: `engines/pipeline/stages`)."""

from __future__ import annotations

from pathlib import Path

import torch

from neox_hf.parallel.layout import Layout


def build_model_from_recipe(recipe, tokenizer, layout: Layout):
    """From a pretrained folder, or from scratch with GPT-NeoX init and the padded vocabulary.

    With tensor parallelism a local safetensors folder is loaded slice by slice, already split (and its vocabulary
    zero-padded GPT-NeoX style if TP does not divide it); a pretrained folder otherwise is built whole and split by
    `parallelize`. From scratch the model is layout-free (`model_from_seed`): each parameter drawn from the seed and
    its name, and under TP only this rank's shards ever exist.
    """
    from neox_hf.model.spec import config_class_for_folder, config_from_recipe, model_class_for_config
    from neox_hf.model.folder import from_pretrained_whole
    from neox_hf.model.vocab import check_vocab_covers_tokenizer, padded_vocab_size
    from neox_hf.parallel.tensor_parallel import from_pretrained_tensor_parallel

    m = recipe.model
    # The family comes from the folder's config.json (model_type) or the recipe's `model.family`.
    if m.from_pretrained and layout.tp > 1 and _has_safetensors(m.from_pretrained):
        config_class = config_class_for_folder(m.from_pretrained)
        stored = config_class.from_pretrained(m.from_pretrained)
        stored_vocab = stored.vocab_size
        model = from_pretrained_tensor_parallel(model_class_for_config(stored), m.from_pretrained, layout,
                                                padded_vocab=_tp_vocab_size(stored_vocab, recipe),
                                                sequence_parallel=recipe.parallel.sequence_parallel,
                                                attn_implementation=m.attn_implementation)
        check_vocab_covers_tokenizer(stored_vocab, tokenizer, where=m.from_pretrained)
    elif m.from_pretrained:
        model_class = model_class_for_config(config_class_for_folder(m.from_pretrained).from_pretrained(m.from_pretrained))
        model = from_pretrained_whole(model_class, m.from_pretrained, dtype=torch.float32,
                                      attn_implementation=m.attn_implementation)
        check_vocab_covers_tokenizer(model.config.vocab_size, tokenizer, where=m.from_pretrained)
        model = _pad_vocab_for_tp(model, recipe)
    else:
        vocab = m.vocab_size or padded_vocab_size(len(tokenizer), m.make_vocab_size_divisible_by, recipe.parallel.tensor_parallel)
        check_vocab_covers_tokenizer(vocab, tokenizer, where="`model.vocab_size`")
        config = config_from_recipe(m, vocab_size=vocab, bos_token_id=tokenizer.bos_token_id,
                                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        config._attn_implementation = m.attn_implementation
        model = model_from_seed(model_class_for_config(config), config, recipe.train.seed, layout,
                                sequence_parallel=recipe.parallel.sequence_parallel)
    model.config.use_cache = False
    return model


def model_from_seed(model_class, config, seed: int, layout: Layout | None = None, *, sequence_parallel: bool = False):
    """A model from scratch whose initial weights depend on `seed` and nothing else (not the layout): built on the
    meta device, split for TP there when `layout.tp > 1`, then only this rank's tensors are materialised, each filled
    by `init_from_seed_`. Under ZeRO-3 transformers' `_from_config` builds under `deepspeed.zero.Init` (so a 20B
    never sits whole on one rank) and each parameter is then overwritten, gathered one at a time.
    Gap filled: `_from_config` materialises and initialises the whole model on every rank, with draws that depend on
    the modules built."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    from neox_hf.parallel.tensor_parallel import apply_tensor_parallel, init_from_seed_, materialise

    if is_deepspeed_zero3_enabled():
        return _reinit_zero3_from_seed(model_class._from_config(config, dtype=torch.float32), config, seed)
    with torch.device("meta"):
        model = model_class._from_config(config, dtype=torch.float32)
    tp = layout.tp if layout is not None else 1
    if tp > 1:
        model = apply_tensor_parallel(model, layout.tp_group, sequence_parallel=sequence_parallel)
    return init_from_seed_(materialise(model), config, seed, tp_rank=layout.tp_rank if tp > 1 else 0, tp_size=tp)


def _reinit_zero3_from_seed(model, config, seed: int):
    """`model`'s ZeRO-3 partitions overwritten by the layout-free init: each parameter gathered whole on its own (one
    tensor's memory at a time), written (every rank draws the same values) and re-partitioned from the first rank."""
    import deepspeed

    from neox_hf.model.init import initial_tensor

    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            param.copy_(initial_tensor(config, name, param.shape, seed))
    return model


def _has_safetensors(folder: str) -> bool:
    path = Path(folder)
    return (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()


def _tp_vocab_size(vocab: int, recipe) -> int:
    """GPT-NeoX pads the vocabulary to make_vocab_size_divisible_by × TP; a checkpoint that does not divide gets zero
    rows (real-token logits unchanged) and its config records the new size."""
    from accelerate import PartialState

    from neox_hf.model.vocab import padded_vocab_size

    tp = recipe.parallel.tensor_parallel
    if tp == 1 or vocab % tp == 0:
        return vocab
    padded = padded_vocab_size(vocab, recipe.model.make_vocab_size_divisible_by, tp)
    PartialState().print(f"note: vocabulary {vocab} padded to {padded} rows for tensor parallel {tp} "
                         "(zero rows, real-token logits unchanged)")
    return padded


def _pad_vocab_for_tp(model, recipe):
    """The whole-model path of `_tp_vocab_size` (a .bin folder or a Hub name)."""
    from neox_hf.parallel.tensor_parallel import pad_vocab

    vocab = model.config.vocab_size
    padded = _tp_vocab_size(vocab, recipe)
    if padded == vocab:
        return model
    model = pad_vocab(model, padded)
    model.config.vocab_size = padded
    return model
