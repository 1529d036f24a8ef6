"""Everything the training loop needs to know about distribution, behind four verbs (torchtitan's shape):

    accelerator, layout = init_distributed(recipe)      launch check, Accelerator (+ DeepSpeed plugin), the Layout
    model = build_model(recipe, tokenizer, layout)      from scratch or pretrained, only this rank's slices under TP
    model, optimizer = parallelize(model, layout, recipe, accelerator)
                                                        TP + sequence parallelism, activation checkpointing, AdamW,
                                                        handed to Accelerate / DeepSpeed with the layout's groups
    state_dict = full_state_dict(model, layout, accelerator)   the whole model (TP shards / ZeRO-3 partitions merged)

The loop never learns what a vocab-parallel head, a TP group or a pipeline stage is.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from neox_hf.parallel.accelerator import build_accelerator
from neox_hf.parallel.layout import Layout, build_layout, check_launch

__all__ = ["Layout", "init_distributed", "build_model", "parallelize", "full_state_dict", "parameter_count"]


def init_distributed(recipe, *, log_with=None):
    """(Accelerator, Layout). Refuses a launch that cannot give the recipe's layout before any process group exists."""
    check_launch(recipe)
    accelerator = build_accelerator(recipe, log_with=log_with)
    return accelerator, build_layout(recipe.parallel)


def build_model(recipe, tokenizer, layout: Layout):
    """From a pretrained folder, or from scratch with GPT-NeoX init and the padded vocabulary.

    With tensor parallelism a local safetensors folder is loaded slice by slice, already split (and its vocabulary
    zero-padded GPT-NeoX style if TP does not divide it); otherwise the model is built whole and split by
    `parallelize`.
    """
    from neox_hf.interop.tokenizer import check_vocab_covers_tokenizer, padded_vocab_size
    from neox_hf.model import NeoXConfig, NeoXForCausalLM, config_from_recipe
    from neox_hf.parallel.tensor_parallel import from_pretrained_tensor_parallel

    if layout.pp > 1:  # each rank builds only its pipeline stage
        from neox_hf.parallel.pipeline import build_pipeline_model

        return build_pipeline_model(recipe, tokenizer, layout)
    m = recipe.model
    if m.from_pretrained and layout.tp > 1 and _has_safetensors(m.from_pretrained):
        stored_vocab = NeoXConfig.from_pretrained(m.from_pretrained).vocab_size
        model = from_pretrained_tensor_parallel(NeoXForCausalLM, m.from_pretrained, layout,
                                                padded_vocab=_tp_vocab_size(stored_vocab, recipe),
                                                sequence_parallel=recipe.parallel.sequence_parallel,
                                                attn_implementation=m.attn_implementation)
        check_vocab_covers_tokenizer(stored_vocab, tokenizer, where=m.from_pretrained)
    elif m.from_pretrained:
        model = NeoXForCausalLM.from_pretrained(m.from_pretrained, dtype=torch.float32, attn_implementation=m.attn_implementation)
        check_vocab_covers_tokenizer(model.config.vocab_size, tokenizer, where=m.from_pretrained)
        model = _pad_vocab_for_tp(model, recipe)
    else:
        vocab = m.vocab_size or padded_vocab_size(len(tokenizer), m.make_vocab_size_divisible_by, recipe.parallel.tensor_parallel)
        check_vocab_covers_tokenizer(vocab, tokenizer, where="`model.vocab_size`")
        config = config_from_recipe(m, vocab_size=vocab, bos_token_id=tokenizer.bos_token_id,
                                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        config._attn_implementation = m.attn_implementation
        # _from_config builds under deepspeed.zero.Init when ZeRO-3 is active, so a 20B never sits whole on one rank.
        model = NeoXForCausalLM._from_config(config, dtype=torch.float32)
    model.config.use_cache = False
    return model


def parallelize(model, layout: Layout, recipe, accelerator):
    """Apply TP (+ sequence parallelism) and activation checkpointing, build AdamW, let Accelerate/DeepSpeed wrap
    both; DeepSpeed is handed the layout so ZeRO reduces over the data-parallel group only."""
    from neox_hf.parallel.tensor_parallel import apply_tensor_parallel
    from neox_hf.parallel.tp_groups import DeepSpeedMPU, deepspeed_initialize_with_mpu

    if layout.pp > 1:
        return _parallelize_pipeline(model, layout, recipe, accelerator)
    if layout.tp > 1 and not getattr(model.get_output_embeddings(), "loss_sum", None):
        model = apply_tensor_parallel(model, layout.tp_group, sequence_parallel=recipe.parallel.sequence_parallel)
    if recipe.parallel.activation_checkpointing:
        # transformers renamed gradient_checkpointing_enable after 5.17; setup.py admits every 5.x.
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    if recipe.train.compile:
        # Only the decoder, in place (nn.Module.compile keeps the state-dict keys): the fused loss runs eagerly.
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        lm.base_model.compile()
    optimizer = build_optimizer(model, recipe.train)
    distributed = layout.world_size > 1
    with deepspeed_initialize_with_mpu(DeepSpeedMPU(layout)) if distributed else contextlib.nullcontext():
        return accelerator.prepare(model, optimizer)


def _parallelize_pipeline(model, layout: Layout, recipe, accelerator):
    """A PipelineModule (TP and activation checkpointing applied when its stage was built) → DeepSpeed's
    PipelineEngine. No mpu wrapper: the module's pipe × data × model grid is DeepSpeed's mpu."""
    from neox_hf.parallel.pipeline import stage_report

    engine, optimizer = accelerator.prepare(model, build_optimizer(model, recipe.train))
    accelerator.print("\n".join(stage_report(model, layout, recipe.train.gradient_accumulation_steps)))
    return engine, optimizer


def build_optimizer(model, train) -> torch.optim.Optimizer:
    """AdamW; as GPT-NeoX, biases and norm weights get no weight decay. torch's fused kernel wherever the parameters'
    device has one (CPU and CUDA do): one pass over each tensor instead of torch's default per-op loop on CPU
    (measured 83 → 12 ms per step for Pythia-14M's 14M parameters on 2 cores) — what GPT-NeoX gets from DeepSpeed's
    FusedAdam and transformers' Trainer from its default `adamw_torch_fused`."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 else decay).append(param)
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps,
                             fused=_has_fused_adamw(decay + no_decay) or None)


def _has_fused_adamw(params) -> bool:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    return bool(params) and all(p.device.type in devices and p.is_floating_point() for p in params)


def full_state_dict(model, layout: Layout, accelerator) -> dict:
    """The whole model's state dict (TP shards merged, ZeRO-3 partitions gathered). Collective: every rank calls it;
    the result is complete on the main process."""
    from neox_hf.parallel.tensor_parallel import gather_full_state_dict

    if layout.pp > 1:  # stages × TP shards merged on the main process (None elsewhere)
        from neox_hf.parallel.pipeline import gather_pipeline_state_dict

        return gather_pipeline_state_dict(model, layout)
    if layout.tp > 1:
        return gather_full_state_dict(accelerator.unwrap_model(model), layout)
    return accelerator.get_state_dict(model)


def parameter_count(model, layout: Layout) -> int:
    """Full-model parameter count whatever the layout (ZeRO-3 partitions, TP shards; replicated norms are counted
    once per TP rank, which is why this is approximate under TP)."""
    from neox_hf.parallel.pipeline import full_parameter_count, is_pipeline_module

    if is_pipeline_module(model):  # a rank holds one stage: count the whole model from its config
        return full_parameter_count(model.config)
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()) * layout.tp


def _has_safetensors(folder: str) -> bool:
    path = Path(folder)
    return (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()


def _tp_vocab_size(vocab: int, recipe) -> int:
    """GPT-NeoX pads the vocabulary to make_vocab_size_divisible_by × TP; a checkpoint that does not divide gets zero
    rows (real-token logits unchanged) and its config records the new size."""
    from accelerate import PartialState

    from neox_hf.interop.tokenizer import padded_vocab_size

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
