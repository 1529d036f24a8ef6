"""A pipeline stage: stock GPTNeoX modules under their HF paths, this rank's slices only, in DeepSpeed's PipelineModule.

Stages are built from transformers' own modules, unmodified: the embedding (+ embedding dropout) on the first stage,
`GPTNeoXLayer`s, the final layer norm and the head on the last. Each pipeline layer is a thin wrapper that holds the
stock modules under their HF paths (`gpt_neox.layers.3`, `lm_head`), so the tensor-parallel plan, safetensors
slicing and the merged state dict use the same keys as the one-process model. Between stages the activation is the
tuple (hidden, position_ids, attention_mask); each layer computes its causal mask and rotary embeddings from them,
as `GPTNeoXModel.forward` does once. A missing padding mask travels as a 1-D sentinel (packed data must reach
`create_causal_mask` with no mask so that document-isolating position ids are honoured).

Each rank materialises only its stage: the model is described on the meta device, the stage's modules are split
for TP while still on meta, and only this rank's slices of its layers are read from safetensors. From scratch, each
slice is filled with the layout-free init (`init_from_seed_`: drawn from the run's seed and the parameter's HF name),
so a stage holds exactly the values the whole model on one process starts from.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import torch
from torch import nn

from neox_hf.errors import CheckpointError
from neox_hf.model.folder import model_holding
from neox_hf.parallel.layout import Layout
from neox_hf.recipe import TrainConfig
from neox_hf.engines.pipeline.loss import StageLoss
from neox_hf.engines.pipeline.partition import partition_stages
from neox_hf.parallel.tensor_parallel import apply_tensor_parallel_to_part, init_from_seed_
from neox_hf.parallel.tp_checkpoint import load_tp_shard_state_dict
from neox_hf.parallel.tp_layers import VocabParallelEmbedding, VocabParallelLMHead


TIED_KEY = "embed_in"

class _PipeLayer(nn.Module):
    """A pipeline layer holding stock modules; `hf_paths` maps each attribute to its path in GPTNeoXForCausalLM."""

    hf_paths: dict[str, str] = {}

    def __init__(self, builder: "StageBuilder", **paths: str):
        super().__init__()
        self.hf_paths = paths
        for attribute, path in paths.items():
            setattr(self, attribute, builder.build(path))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This layer's tensors keyed as in a stock GPTNeoXForCausalLM state dict (TP slices still split)."""
        return {f"{path}.{key}": tensor for attribute, path in self.hf_paths.items()
                for key, tensor in getattr(self, attribute).state_dict().items()}

def embedding_paths(spec) -> dict[str, str]:
    """EmbeddingPipe's attributes → HF paths (the attribute names are those of DeepSpeed's layer files)."""
    paths = {"embed_in": spec.embedding}
    if spec.family == "gpt_neox":
        paths["emb_dropout"] = "gpt_neox.emb_dropout"  # Llama has no embedding dropout
    return paths


class EmbeddingPipe(_PipeLayer):
    """First stage: token ids → (hidden, position_ids, attention_mask). Also the tied head on the last stage."""

    def __init__(self, builder: "StageBuilder"):
        super().__init__(builder, **embedding_paths(builder.spec))

    def forward(self, inputs):
        input_ids, position_ids, attention_mask = inputs
        hidden = self.embed_in(input_ids)
        if hasattr(self, "emb_dropout"):
            hidden = self.emb_dropout(hidden)
        return hidden, position_ids, attention_mask

class TransformerLayerPipe(_PipeLayer):
    """One unmodified decoder layer (`GPTNeoXLayer`, `LlamaDecoderLayer`, `MistralDecoderLayer`), with the causal mask
    and rotary embeddings its model's forward would give it."""

    def __init__(self, builder: "StageBuilder", index: int):
        super().__init__(builder, layer=builder.spec.layer_path(index))
        self.config = builder.config
        # the family's rotary class; non-persistent inv_freq: not in checkpoints
        self.rotary_emb = type(builder.meta_model.base_model.rotary_emb)(config=builder.config)

    def forward(self, inputs):
        from transformers.masking_utils import create_causal_mask

        hidden, position_ids, attention_mask = inputs
        if getattr(self.config, "sliding_window", None):  # Mistral
            from transformers.masking_utils import create_sliding_window_causal_mask as create_causal_mask
        causal_mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=padding_mask(attention_mask),
                                         cache=None, position_ids=position_ids)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        hidden = self.layer(hidden, attention_mask=causal_mask, position_ids=position_ids,
                            position_embeddings=position_embeddings)
        return hidden, position_ids, attention_mask

class FinalNormPipe(_PipeLayer):
    def __init__(self, builder: "StageBuilder"):
        super().__init__(builder, final_layer_norm=builder.spec.final_norm)

    def forward(self, inputs):
        return self.final_layer_norm(inputs[0])

class HeadPipe(_PipeLayer):
    """Holds `lm_head`; the head is applied by the loss (fused with the cross-entropy), so forward passes through."""

    def __init__(self, builder: "StageBuilder"):
        super().__init__(builder, lm_head="lm_head")

    def forward(self, hidden):
        return hidden

def _tied_head_passthrough(embedding: EmbeddingPipe, hidden):
    return hidden

def padding_mask(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """The [batch, seq] padding mask, or None where the sentinel says the batch has none."""
    return attention_mask if attention_mask.dim() == 2 else None

NO_PADDING_MASK_SHAPE = (1,)

class StageBuilder:
    """Builds the modules a stage holds at their HF paths: this rank's TP slices, read from a safetensors folder
    (only the stage's tensors) or initialised from `seed` (the run's `train.seed`) with GPT-NeoX's layout-free init.
    The full model exists only on the meta device.
    Gap filled: transformers' `from_pretrained` materialises every layer on every rank."""

    def __init__(self, config, layout: Layout, folder: str | None = None, seed: int = TrainConfig.seed):
        from neox_hf.model.spec import model_class_for_config, spec_for_config

        self.config, self.layout, self.folder, self.seed = config, layout, folder, seed
        self.spec = spec_for_config(config)
        with torch.device("meta"):
            self.meta_model = model_class_for_config(config)(config)

    def build(self, path: str) -> nn.Module:
        # A copy (free on meta): materialising inside the meta model would keep full-size tensors alive there for as
        # long as the PipelineModule's layer specs hold this builder.
        part = copy.deepcopy(self.meta_model.get_submodule(path))
        if self.folder is None:
            return self._initialised(part, path)
        return self._loaded(part, path)

    def _loaded(self, part: nn.Module, path: str) -> nn.Module:
        part = apply_tensor_parallel_to_part(part, path, self.layout.tp_group)
        part = _materialise(part)
        keys = {f"{path}.{key}": key for key in part.state_dict()}
        if keys:
            shard = load_tp_shard_state_dict(self.folder, self.config, self.layout.tp_rank, self.layout.tp, keys=keys)
            part.load_state_dict({keys[k]: v for k, v in shard.items()}, strict=True)
        return part

    def _initialised(self, part: nn.Module, path: str) -> nn.Module:
        part = _materialise(apply_tensor_parallel_to_part(part, path, self.layout.tp_group))
        return init_from_seed_(part, self.config, self.seed, prefix=path, tp_rank=self.layout.tp_rank,
                               tp_size=self.layout.tp)

def _materialise(part: nn.Module) -> nn.Module:
    """`part` moved off the meta device (uninitialised), keeping the TP flags DeepSpeed reads for clipping."""
    flags = {name: {k: v for k, v in vars(p).items() if k != "_is_hf_initialized"} for name, p in part.named_parameters()}
    part.to_empty(device="cpu")
    for name, param in part.named_parameters():
        for key, value in flags[name].items():
            setattr(param, key, value)
    return part

def _pipeline_module_class():
    from deepspeed.pipe import PipelineModule

    class NeoXPipelineModule(PipelineModule):
        """DeepSpeed's PipelineModule with our precomputed stage boundaries.

        DeepSpeed's own `parameters` method builds every layer on every rank to count parameters; ours counts on
        the meta device, so a rank only ever builds its own stage."""

        def __init__(self, layers, parts: list[int], config, **kwargs):
            self._neox_parts = list(parts)
            super().__init__(layers, **kwargs)
            self.config = config  # accelerate sizes DeepSpeed's "auto" buckets from config.hidden_size

        def save_pretrained(self, folder, *, state_dict: dict, **kwargs):
            """`save_pretrained` of the whole model, given the merged state dict (`gather_pipeline_state_dict`):
            what `save_hf_folder` calls, so a pipeline run writes the same stock folder as any other."""
            model_holding(state_dict, self.config).save_pretrained(folder, **kwargs)

        def _partition_layers(self, method="uniform"):
            stage = self._topo.get_coord(self.global_rank).pipe
            self.parts = list(self._neox_parts)
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    return NeoXPipelineModule

def build_pipeline_module(config, layout: Layout, *, folder: str | None = None, seed: int = TrainConfig.seed,
                          partition_method: str = "type:transformer", activation_checkpointing: bool = False,
                          loss_normalization: str = "token", fused_cross_entropy: bool = True):
    """The `PipelineModule` of this rank's stage (collective: every rank calls it, after the Accelerator exists).

    `folder`: a safetensors HF folder to read this stage's slices from (`config.vocab_size` may exceed the stored
    vocabulary: zero rows are added, GPT-NeoX padding); None initialises the stage from scratch, from `seed`.
    Hand the result to `accelerator.prepare(module, optimizer)` (no `deepspeed_initialize_with_mpu`: the module's
    grid is DeepSpeed's mpu) to get a `PipelineEngine`.
    """
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    parts = partition_stages(config, layout.pp, partition_method)
    builder = StageBuilder(config, layout, folder, seed=seed)
    tied = config.tie_word_embeddings
    embedding = (TiedLayerSpec(TIED_KEY, EmbeddingPipe, builder, tied_weight_attr=["embed_in.weight"]) if tied
                 else LayerSpec(EmbeddingPipe, builder))
    head = (TiedLayerSpec(TIED_KEY, EmbeddingPipe, builder, forward_fn=_tied_head_passthrough,
                          tied_weight_attr=["embed_in.weight"]) if tied else LayerSpec(HeadPipe, builder))
    specs = ([embedding] + [LayerSpec(TransformerLayerPipe, builder, i) for i in range(config.num_hidden_layers)]
             + [LayerSpec(FinalNormPipe, builder), head])
    loss = StageLoss(loss_normalization, fused=fused_cross_entropy)
    checkpointing = {}
    if activation_checkpointing:
        # torch's non-reentrant checkpoint of each transformer layer (the embedding must not be checkpointed: its
        # input ids need no grad, and a reentrant checkpoint would then drop the embedding's gradient).
        checkpointing = dict(activation_checkpoint_interval=1, checkpointable_layers=["TransformerLayerPipe"],
                             activation_checkpoint_func=functools.partial(torch.utils.checkpoint.checkpoint,
                                                                          use_reentrant=False))
    topology = PipeModelDataParallelTopology(num_pp=layout.pp, num_mp=layout.tp, num_dp=layout.dp)
    module = _pipeline_module_class()(specs, parts, config, topology=topology, loss_fn=loss, partition_method="uniform",
                                      dynamic_shape=True, **checkpointing)
    if layout.is_last_stage:
        loss.head_provider = _head_provider(module, tied)
    return module

def build_pipeline_model(recipe, tokenizer, layout: Layout):
    """This rank's stage as a PipelineModule, from the recipe: from scratch (GPT-NeoX init, padded vocabulary) or
    reading only the stage's TP slices of a local safetensors `model.from_pretrained` folder (vocabulary zero-padded
    when TP does not divide it). Collective; after the Accelerator exists."""
    from neox_hf.model.vocab import check_vocab_covers_tokenizer, padded_vocab_size
    from neox_hf.model.spec import config_class_for_folder, config_from_recipe

    m, p = recipe.model, recipe.parallel
    folder = m.from_pretrained
    if folder:
        if not _has_safetensors(folder):
            raise CheckpointError(f"`model.from_pretrained: {folder}`: pipeline stages read their layers from a local "
                                  "safetensors folder (model.safetensors or model.safetensors.index.json); download or "
                                  "re-save it with save_pretrained(safe_serialization=True) first")
        config = config_class_for_folder(folder).from_pretrained(folder)
        check_vocab_covers_tokenizer(config.vocab_size, tokenizer, where=folder)
        if config.vocab_size % layout.tp:
            config.vocab_size = padded_vocab_size(config.vocab_size, m.make_vocab_size_divisible_by, layout.tp)
    else:
        vocab = m.vocab_size or padded_vocab_size(len(tokenizer), m.make_vocab_size_divisible_by, layout.tp)
        check_vocab_covers_tokenizer(vocab, tokenizer, where="`model.vocab_size`")
        config = config_from_recipe(m, vocab_size=vocab, bos_token_id=tokenizer.bos_token_id,
                                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config._attn_implementation = m.attn_implementation
    config.use_cache = False
    return build_pipeline_module(config, layout, folder=folder, seed=recipe.train.seed,
                                 partition_method=p.pipe_partition_method,
                                 activation_checkpointing=p.activation_checkpointing,
                                 loss_normalization=recipe.train.loss_normalization,
                                 fused_cross_entropy=recipe.train.fused_cross_entropy)

def _has_safetensors(folder: str) -> bool:
    path = Path(folder)
    return (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()

def is_pipeline_module(module) -> bool:
    return hasattr(module, "_neox_parts")

def _head_provider(module, tied: bool):
    if tied:
        embedding = module.tied_modules[TIED_KEY]
        return lambda: tied_head(embedding.embed_in)
    head_layer = module.forward_funcs[-1]
    return lambda: head_layer.lm_head

def tied_head(embedding: nn.Module) -> nn.Module:
    """A head module sharing the embedding's weight Parameter (not registered anywhere: no duplicate parameter)."""
    if isinstance(embedding, VocabParallelEmbedding):
        head = VocabParallelLMHead(embedding.weight.detach(), embedding.vocab_start, embedding.group)
    else:
        head = nn.Linear(embedding.weight.shape[1], embedding.weight.shape[0], bias=False, device="meta")
    head.weight = embedding.weight
    return head
