"""Pipeline parallelism: the GPTNeoX model's layers split over stages (GPT-NeoX `pipe_parallel_size`).

Engine: DeepSpeed's `PipelineEngine` (its 1F1B `TrainSchedule`), reached through `accelerator.prepare` of a
`deepspeed.pipe.PipelineModule`, as GPT-NeoX itself trains. Chosen over `torch.distributed.pipelining` (1F1B,
interleaved, zero-bubble schedules) because the DeepSpeed engine is the one shown to compose with everything else
here: ZeRO-1 over each stage's data-parallel group, our injected tensor-parallel layers (its pipe × data × model grid
is the layout's rank order and serves as DeepSpeed's mpu), gradient clipping over the whole model (the grid's
model-parallel group spans pipe × model), bf16/fp16 with loss scaling, tied weights across stages, per-stage
checkpoints through `accelerator.save_state`. torch's pipelining would need FSDP/DTensor for the ZeRO part and its
own optimizer-state sharding and clipping across stages; we have not shown it composes with ZeRO-1 and our TP.

Stages are built from transformers' own modules, unmodified: the embedding (+ embedding dropout) on the first stage,
`GPTNeoXLayer`s, the final layer norm and the head on the last. Each pipeline layer is a thin wrapper that holds the
stock modules under their HF paths (`gpt_neox.layers.3`, `lm_head`), so the tensor-parallel plan, safetensors
slicing and the merged state dict use the same keys as the one-process model. Between stages the activation is the
tuple (hidden, position_ids, attention_mask); each layer computes its causal mask and rotary embeddings from them,
as `GPTNeoXModel.forward` does once. A missing padding mask travels as a 1-D sentinel (packed data must reach
`create_causal_mask` with no mask so that document-isolating position ids are honoured).

The head is applied inside the last stage's loss function (fused with the cross-entropy, vocab-parallel under TP),
so no stage returns [batch, seq, vocab] logits. Token weighting: each micro-batch's loss is its sum of token losses
× gas × dp / N, N = labelled tokens of the whole step over all micro-batches and data-parallel ranks, counted before
the first backward; DeepSpeed divides by gas and averages over data-parallel ranks, so gradients and the loss it
reports are those of the step's token mean.

Each rank materialises only its stage: the model is described on the meta device, the stage's modules are split
for TP while still on meta, and only this rank's slices of its layers are read from safetensors. From scratch, a
stage's layers are initialised GPT-NeoX style at full size (one stage, not the model) and then split.
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from neox_hf.errors import CheckpointError, RecipeError
from neox_hf.io import load_torch_safely
from neox_hf.parallel.layout import Layout, StepResult, deepspeed_grad_norm, dp_sum, global_rank
from neox_hf.parallel.mappings import gather_along_dim
from neox_hf.parallel.tensor_parallel import apply_tensor_parallel_to_part
from neox_hf.parallel.tp_checkpoint import load_tp_shard_state_dict
from neox_hf.parallel.tp_layers import VocabParallelEmbedding, VocabParallelLMHead
from neox_hf.parallel.tp_plan import partition_dim

IGNORE_INDEX = -100
TIED_KEY = "embed_in"


# ----------------------------------------------------------------------------------------------------------------
# The pipeline layers: stock GPTNeoX modules under their HF paths
# ----------------------------------------------------------------------------------------------------------------


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


class EmbeddingPipe(_PipeLayer):
    """First stage: token ids → (hidden, position_ids, attention_mask). Also the tied head on the last stage."""

    def __init__(self, builder: "StageBuilder"):
        super().__init__(builder, embed_in="gpt_neox.embed_in", emb_dropout="gpt_neox.emb_dropout")

    def forward(self, inputs):
        input_ids, position_ids, attention_mask = inputs
        return self.emb_dropout(self.embed_in(input_ids)), position_ids, attention_mask


class TransformerLayerPipe(_PipeLayer):
    """One unmodified `GPTNeoXLayer`, with the causal mask and rotary embeddings `GPTNeoXModel.forward` would give it."""

    def __init__(self, builder: "StageBuilder", index: int):
        super().__init__(builder, layer=f"gpt_neox.layers.{index}")
        from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

        self.config = builder.config
        self.rotary_emb = GPTNeoXRotaryEmbedding(config=builder.config)  # non-persistent inv_freq: not in checkpoints

    def forward(self, inputs):
        from transformers.masking_utils import create_causal_mask

        hidden, position_ids, attention_mask = inputs
        causal_mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=padding_mask(attention_mask),
                                         cache=None, position_ids=position_ids)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        hidden = self.layer(hidden, attention_mask=causal_mask, position_ids=position_ids,
                            position_embeddings=position_embeddings)
        return hidden, position_ids, attention_mask


class FinalNormPipe(_PipeLayer):
    def __init__(self, builder: "StageBuilder"):
        super().__init__(builder, final_layer_norm="gpt_neox.final_layer_norm")

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


# ----------------------------------------------------------------------------------------------------------------
# Materialising one stage
# ----------------------------------------------------------------------------------------------------------------


class StageBuilder:
    """Builds the modules a stage holds at their HF paths: this rank's TP slices, read from a safetensors folder
    (only the stage's tensors) or initialised with GPT-NeoX's init. The full model exists only on the meta device.
    Gap filled: transformers' `from_pretrained` materialises every layer on every rank."""

    def __init__(self, config, layout: Layout, folder: str | None = None):
        from neox_hf.model import NeoXForCausalLM

        self.config, self.layout, self.folder = config, layout, folder
        with torch.device("meta"):
            self.meta_model = NeoXForCausalLM(config)

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
        part = _materialise(part)
        with torch.no_grad():
            for module in part.modules():
                self.meta_model._init_weights(module)  # GPT-NeoX's per-role std (the roles were tagged on meta)
        return apply_tensor_parallel_to_part(part, path, self.layout.tp_group)


def _materialise(part: nn.Module) -> nn.Module:
    """`part` moved off the meta device (uninitialised), keeping the TP flags DeepSpeed reads for clipping."""
    flags = {name: {k: v for k, v in vars(p).items() if k != "_is_hf_initialized"} for name, p in part.named_parameters()}
    part.to_empty(device="cpu")
    for name, param in part.named_parameters():
        for key, value in flags[name].items():
            setattr(param, key, value)
    return part


# ----------------------------------------------------------------------------------------------------------------
# Layer list and partition
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipeLayerInfo:
    """One pipeline layer: its class name (what `type:` partition methods match) and the HF paths it holds."""

    name: str
    paths: tuple[str, ...]


def pipeline_layer_infos(config) -> list[PipeLayerInfo]:
    """Embedding, every transformer layer, final norm, head: the pipeline's layer list, in order."""
    head = ("EmbeddingPipe", ("gpt_neox.embed_in",)) if config.tie_word_embeddings else ("HeadPipe", ("lm_head",))
    return ([PipeLayerInfo("EmbeddingPipe", ("gpt_neox.embed_in",))]
            + [PipeLayerInfo("TransformerLayerPipe", (f"gpt_neox.layers.{i}",)) for i in range(config.num_hidden_layers)]
            + [PipeLayerInfo("FinalNormPipe", ("gpt_neox.final_layer_norm",)), PipeLayerInfo(*head)])


def layer_parameter_counts(config) -> list[int]:
    """Parameters of each pipeline layer (full model, before TP), counted on the meta device."""
    from neox_hf.model import NeoXForCausalLM

    with torch.device("meta"):
        model = NeoXForCausalLM(config)
    return [sum(p.numel() for path in info.paths for p in model.get_submodule(path).parameters())
            for info in pipeline_layer_infos(config)]


def partition_stages(config, stages: int, method: str = "type:transformer") -> list[int]:
    """Stage boundaries: stage s holds pipeline layers [parts[s], parts[s+1]) (DeepSpeed's partition functions)."""
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    infos = pipeline_layer_infos(config)
    if method == "uniform":
        parts = partition_uniform(len(infos), stages)
    elif method == "parameters":
        parts = partition_balanced(layer_parameter_counts(config), stages)
    elif method.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        weights = [1 if pattern.search(info.name) else 0 for info in infos]
        if not any(weights):
            raise RecipeError(f"`parallel.pipe_partition_method: {method}` matches none of the pipeline layers "
                              f"({', '.join(sorted({i.name for i in infos}))}); use type:transformer")
        parts = partition_balanced(weights, stages)
    else:
        raise RecipeError(f"`parallel.pipe_partition_method` {method!r}: use type:transformer, uniform or parameters")
    parts = [int(p) for p in parts]
    empty = [s for s in range(stages) if parts[s] == parts[s + 1]]
    if empty:
        raise RecipeError(f"pipe_partition_method {method!r} leaves stage(s) {empty} empty ({len(infos)} pipeline "
                          f"layers over {stages} stages); use fewer stages or more layers")
    return parts


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle fraction of the 1F1B schedule: (p − 1) / (m + p − 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def pipeline_report(config, parts: list[int], micro_batches: int, tp: int = 1) -> list[str]:
    """Start-up lines: the layers and parameters of each stage, and the schedule's bubble fraction."""
    infos, counts = pipeline_layer_infos(config), layer_parameter_counts(config)
    lines = []
    for stage in range(len(parts) - 1):
        layers = infos[parts[stage]:parts[stage + 1]]
        params = sum(counts[parts[stage]:parts[stage + 1]])
        lines.append(f"pipeline stage {stage}: {_describe_layers(layers, parts[stage])}; {params / 1e6:.2f}M parameters"
                     + (f" ({params / tp / 1e6:.2f}M per tensor-parallel rank)" if tp > 1 else ""))
    p = len(parts) - 1
    lines.append(f"pipeline: {p} stages × {micro_batches} micro-batches in flight, bubble (p−1)/(m+p−1) = "
                 f"{bubble_fraction(p, micro_batches):.3f}")
    return lines


def _describe_layers(layers: list[PipeLayerInfo], first_index: int) -> str:
    """e.g. `embedding + layers 0–1` or `layers 2–3 + final norm + head`."""
    labels, numbers = [], [int(i.paths[0].rsplit(".", 1)[1]) for i in layers if i.name == "TransformerLayerPipe"]
    for offset, info in enumerate(layers):
        if info.name == "TransformerLayerPipe":
            if numbers and f"layers {numbers[0]}–{numbers[-1]}" not in labels:
                labels.append(f"layer {numbers[0]}" if len(numbers) == 1 else f"layers {numbers[0]}–{numbers[-1]}")
        elif info.name == "EmbeddingPipe":
            labels.append("embedding" if first_index + offset == 0 else "head (tied to the embedding)")
        else:
            labels.append({"FinalNormPipe": "final norm", "HeadPipe": "head"}[info.name])
    return " + ".join(dict.fromkeys(labels))


# ----------------------------------------------------------------------------------------------------------------
# The PipelineModule
# ----------------------------------------------------------------------------------------------------------------


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


def build_pipeline_module(config, layout: Layout, *, folder: str | None = None,
                          partition_method: str = "type:transformer", activation_checkpointing: bool = False,
                          loss_normalization: str = "token", fused_cross_entropy: bool = True):
    """The `PipelineModule` of this rank's stage (collective: every rank calls it, after the Accelerator exists).

    `folder`: a safetensors HF folder to read this stage's slices from (`config.vocab_size` may exceed the stored
    vocabulary: zero rows are added, GPT-NeoX padding); None initialises the stage from scratch.
    Hand the result to `accelerator.prepare(module, optimizer)` (no `deepspeed_initialize_with_mpu`: the module's
    grid is DeepSpeed's mpu) to get a `PipelineEngine`.
    """
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    parts = partition_stages(config, layout.pp, partition_method)
    builder = StageBuilder(config, layout, folder)
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
    from neox_hf.interop.tokenizer import check_vocab_covers_tokenizer, padded_vocab_size
    from neox_hf.model import NeoXConfig, config_from_recipe

    m, p = recipe.model, recipe.parallel
    folder = m.from_pretrained
    if folder:
        if not _has_safetensors(folder):
            raise CheckpointError(f"`model.from_pretrained: {folder}`: pipeline stages read their layers from a local "
                                  "safetensors folder (model.safetensors or model.safetensors.index.json); download or "
                                  "re-save it with save_pretrained(safe_serialization=True) first")
        config = NeoXConfig.from_pretrained(folder)
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
    return build_pipeline_module(config, layout, folder=folder, partition_method=p.pipe_partition_method,
                                 activation_checkpointing=p.activation_checkpointing,
                                 loss_normalization=recipe.train.loss_normalization,
                                 fused_cross_entropy=recipe.train.fused_cross_entropy)


def _has_safetensors(folder: str) -> bool:
    path = Path(folder)
    return (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()


def is_pipeline_module(module) -> bool:
    return hasattr(module, "_neox_parts")


def full_parameter_count(config) -> int:
    """Parameters of the whole model (every stage; a tied embedding once)."""
    counts = layer_parameter_counts(config)
    return sum(counts) - (counts[-1] if config.tie_word_embeddings else 0)


def stage_report(module, layout: Layout, micro_batches: int) -> list[str]:
    """The start-up lines of `pipeline_report` for a built PipelineModule."""
    return pipeline_report(module.config, module._neox_parts, micro_batches, tp=layout.tp)


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


# ----------------------------------------------------------------------------------------------------------------
# Loss of the last stage
# ----------------------------------------------------------------------------------------------------------------


def head_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, *, fused: bool = True,
              z_loss: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ token cross-entropies, labelled tokens) of the last stage: the one head loss of `neox_hf.ops`, as training
    without stages computes it (fused chunked cross-entropy by default, vocab-parallel under TP)."""
    from neox_hf.ops import head_loss as shared_head_loss  # ops imports parallel's TP layers: import at call time

    return shared_head_loss(head, hidden, labels, fused=fused, z_loss=z_loss)


class StageLoss:
    """`loss_fn(outputs, labels)` of the PipelineModule, run on the last stage for every micro-batch.

    token: loss_sum × `scale` (set per step to gas × dp / N); micro_batch: the micro-batch's mean (GPT-NeoX).
    Every call records (loss_sum, tokens) for the step's and eval's token-weighted totals."""

    def __init__(self, normalization: str = "token", fused: bool = True):
        self.normalization, self.fused = normalization, fused
        self.scale = 1.0
        self.head_provider = None
        self.records: list[torch.Tensor] = []

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss_sum, tokens = head_loss(self.head_provider(), hidden, labels, fused=self.fused)
        self.records.append(torch.stack([loss_sum.detach().double(), tokens.double()]))
        if self.normalization == "micro_batch":
            return loss_sum / tokens.clamp(min=1)
        scale = self.scale.to(loss_sum.dtype) if torch.is_tensor(self.scale) else self.scale
        return loss_sum * scale


# ----------------------------------------------------------------------------------------------------------------
# Steps: train and eval
# ----------------------------------------------------------------------------------------------------------------


def pipe_micro_batch(batch: dict) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """A loader batch as DeepSpeed's pipeline reads it: ((input_ids, position_ids, attention_mask), labels)."""
    input_ids = batch["input_ids"]
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0)  # what GPTNeoXModel.forward builds
    attention_mask = batch.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.zeros(NO_PADDING_MASK_SHAPE, dtype=torch.long)
    return (input_ids, position_ids, attention_mask), batch["labels"]


def _token_and_sample_counts(micro_batches, device) -> torch.Tensor:
    """[labelled tokens, samples] of the step's micro-batches, float64 on `device`, counted there: reading each
    micro-batch's count on the host would make it wait for the device once per micro-batch."""
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for mb in micro_batches:
        counts[0] += (mb["labels"].to(device, non_blocking=True) != IGNORE_INDEX).sum()
    counts[1] = float(sum(mb["input_ids"].shape[0] for mb in micro_batches))  # shapes are host values
    return counts


def _last_stage_rank(layout: Layout) -> int:
    return global_rank(layout.pp - 1, layout.dp_rank, layout.tp_rank, dp=layout.dp, tp=layout.tp)


def _from_last_stage(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    dist.broadcast(tensor, src=_last_stage_rank(layout), group=layout.pp_group)
    return tensor


def pipeline_train_step(engine, micro_batches: list[dict] | None, layout: Layout, recipe=None) -> StepResult:
    """One optimizer step of the PipelineEngine over `micro_batches` (gas of them; read on the first and last stage
    only, others may pass None). Collective over every rank. The loss is token-weighted over all micro-batches and
    data-parallel ranks (`train.loss_normalization: token`) or GPT-NeoX's mean of micro-batch means."""
    loss_fn = engine.module.loss_fn
    gas = engine.gradient_accumulation_steps()
    holds_data = layout.is_first_stage or layout.is_last_stage
    if holds_data and len(micro_batches or ()) != gas:
        raise RecipeError(f"the pipeline step needs {gas} micro-batches (train.gradient_accumulation_steps), "
                          f"got {len(micro_batches or ())}")
    counts = _token_and_sample_counts(micro_batches or [], engine.device)
    if layout.is_last_stage:
        counts = dp_sum(layout, counts)  # N before any backward: every micro-batch weighs by it
        loss_fn.scale = gas * layout.dp / counts[0].clamp(min=1.0)  # a device tensor: no wait for the host
        loss_fn.records = []
    data = iter([pipe_micro_batch(mb) for mb in micro_batches]) if holds_data else None
    loss = engine.train_batch(data)
    counts = _from_last_stage(counts, layout)
    return StepResult(loss=loss.detach().reshape(()).float(), tokens=counts[0].clone(), samples=counts[1].clone(),
                      grad_norm=deepspeed_grad_norm(engine),
                      skipped=not engine.was_step_applied())


@torch.no_grad()
def pipeline_eval_loss_sums(engine, batches: list[dict] | None, layout: Layout, recipe=None) -> torch.Tensor:
    """[Σ token losses, labelled tokens] (float64, on device) over every data-parallel rank's eval batches, the same
    on every rank. Collective.

    DeepSpeed's eval_batch has a world barrier, so every pipeline evaluates as many micro-batches as the rank with
    most; shorter lists are completed with copies whose labels are all ignored (no loss, no tokens)."""
    batches = list(batches or [])
    count = torch.tensor([len(batches)], dtype=torch.long, device=engine.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    count = int(count)
    totals = torch.zeros(2, dtype=torch.float64, device=engine.device)
    if count == 0:
        return totals
    template = batches[-1] if batches else {"input_ids": torch.zeros(1, 8, dtype=torch.long)}
    filler = {**template, "labels": torch.full_like(template["input_ids"], IGNORE_INDEX)}
    batches += [filler] * (count - len(batches))
    loss_fn = engine.module.loss_fn
    loss_fn.records = []
    holds_data = layout.is_first_stage or layout.is_last_stage
    data = iter([pipe_micro_batch(b) for b in batches]) if holds_data else None
    engine.eval_batch(data, compute_loss=True, reduce_output=None, bcast_loss=False, num_micro_batches=count)
    if layout.is_last_stage:
        totals = dp_sum(layout, torch.stack(loss_fn.records).sum(0).to(engine.device))
    return _from_last_stage(totals, layout)


def pipeline_eval_loss(engine, batches: list[dict] | None, layout: Layout) -> float:
    """Token-weighted mean eval loss over every data-parallel rank's batches (see `pipeline_eval_loss_sums`)."""
    loss_sum, tokens = pipeline_eval_loss_sums(engine, batches, layout).tolist()
    engine.module.train()
    return loss_sum / tokens if tokens > 0 else float("nan")


# ----------------------------------------------------------------------------------------------------------------
# Merged weights: stages × TP shards → one stock GPTNeoX state dict
# ----------------------------------------------------------------------------------------------------------------


def stage_hf_state_dict(module, layout: Layout) -> dict[str, torch.Tensor]:
    """This stage's tensors, TP shards merged, keyed as a stock GPTNeoXForCausalLM (collective over the TP group).
    The tied embedding counts once, on the first stage."""
    local = {}
    for layer in module.forward_funcs:  # the last stage's tied head is a partial, not a layer: skipped
        if isinstance(layer, _PipeLayer):
            local.update(layer.hf_state_dict())
    merged = {}
    for key in sorted(local):
        dim = partition_dim(key)
        tensor = local[key].detach()
        merged[key] = (tensor.clone() if dim is None else gather_along_dim(tensor.contiguous(), dim, layout.tp_group)).cpu()
    return merged


def gather_pipeline_state_dict(engine_or_module, layout: Layout) -> dict[str, torch.Tensor] | None:
    """The full stock state dict in global rank 0's CPU memory (None elsewhere). Collective over every rank; only the
    ranks of data-parallel index 0 contribute, each stage's tensor-parallel rank 0 sends its merged stage.

    Tensor by tensor, not `gather_object`: over NCCL that stages every stage's pickled bytes on rank 0's GPU at once
    (about 50 GB extra for a 20B model at the end of a run). Here each tensor crosses the device once, alone, and
    lands in CPU memory."""
    module = getattr(engine_or_module, "module", engine_or_module)
    stage = stage_hf_state_dict(module, layout) if layout.dp_rank == 0 else None
    if layout.dp_rank != 0 or layout.tp_rank != 0:
        return None
    full = _gather_stages_to_rank0(stage, layout)
    if full is not None and module.config.tie_word_embeddings:
        full["lm_head.weight"] = full["gpt_neox.embed_in.weight"]
    return full


def _gather_stages_to_rank0(stage: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor] | None:
    """Every stage's tensors on global rank 0 (CPU), over the pipeline group of data-parallel and TP index 0: the
    (small) key, shape and dtype lists first, then one send/recv per tensor through the group's device."""
    shapes = [(key, tuple(t.shape), t.dtype) for key, t in stage.items()]
    listed = [None] * layout.pp if dist.get_rank() == 0 else None
    dist.gather_object(shapes, listed, dst=0, group=layout.pp_group)
    device = _communication_device(layout.pp_group)
    if dist.get_rank() != 0:
        for key, _, _ in shapes:
            dist.send(stage[key].to(device), dst=0, group=layout.pp_group)
        return None
    full = dict(stage)
    for pp_rank in range(1, layout.pp):
        sender = global_rank(pp_rank, 0, 0, dp=layout.dp, tp=layout.tp)
        for key, shape, dtype in listed[pp_rank]:
            buffer = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buffer, src=sender, group=layout.pp_group)
            full[key] = buffer.cpu()
    return full


def _communication_device(group) -> torch.device:
    """Where tensors must be for collectives of `group`: the current GPU for NCCL, the CPU for gloo."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def save_pipeline_hf_folder(engine, layout: Layout, config, out_dir, *, tokenizer=None,
                            extra_files: dict[str, str] | None = None, max_shard_size: str = "5GB") -> Path:
    """The merged, stock-loadable HF folder, written atomically by global rank 0. Collective."""
    from neox_hf.interop.hf_folder import save_hf_folder

    full = gather_pipeline_state_dict(engine, layout)
    out = Path(out_dir)
    if full is not None:
        save_hf_folder(model_holding(full, config), out, tokenizer=tokenizer, extra_files=extra_files,
                       max_shard_size=max_shard_size)
    dist.barrier()
    return out


def model_holding(state_dict: dict[str, torch.Tensor], config):
    """A NeoXForCausalLM whose parameters ARE `state_dict`'s tensors (built on meta, no copy)."""
    from neox_hf.model import NeoXForCausalLM

    with torch.device("meta"):
        model = NeoXForCausalLM(config)
    model.load_state_dict(state_dict, strict=True, assign=True)
    rotary = model.gpt_neox.rotary_emb
    model.gpt_neox.rotary_emb = type(rotary)(config=config)  # non-persistent buffer, still on meta
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


# ----------------------------------------------------------------------------------------------------------------
# Exporting a pipeline training checkpoint (DeepSpeed's per-layer files)
# ----------------------------------------------------------------------------------------------------------------


LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt$")


def is_pipeline_checkpoint(deepspeed_dir: Path) -> bool:
    return any(LAYER_FILE.search(p.name) for p in Path(deepspeed_dir).glob("layer_*-model_states.pt"))


def pipeline_checkpoint_state_dict(deepspeed_dir: Path, config) -> dict[str, torch.Tensor]:
    """Stock GPTNeoX state dict from DeepSpeed pipeline layer files (`layer_XX-model_YY-model_states.pt`: one per
    pipeline layer and tensor-parallel rank), TP shards concatenated along the plan's dimensions."""
    infos = pipeline_layer_infos(config)
    shards: dict[int, dict[int, Path]] = {}
    for path in Path(deepspeed_dir).glob("layer_*-model_states.pt"):
        match = LAYER_FILE.search(path.name)
        if match:
            shards.setdefault(int(match[1]), {})[int(match[2])] = path
    full = {}
    for index, info in enumerate(infos):
        if index not in shards:
            if info.name == "EmbeddingPipe" and index == len(infos) - 1:
                continue  # the tied head is saved once, with the first stage's embedding
            raise CheckpointError(f"{deepspeed_dir} lacks layer_{index:02d}-model_*-model_states.pt ({info.name}); "
                                  "the pipeline checkpoint is incomplete or was written for another model config")
        ranks = [load_torch_safely(shards[index][r]) for r in sorted(shards[index])]
        attributes = _LAYER_ATTRIBUTES[info.name](info)
        for key in ranks[0]:
            attribute, _, rest = key.partition(".")
            hf_key = f"{attributes[attribute]}.{rest}"
            dim = partition_dim(hf_key)
            full[hf_key] = ranks[0][key] if dim is None else torch.cat([r[key] for r in ranks], dim=dim)
    if config.tie_word_embeddings:
        full["lm_head.weight"] = full["gpt_neox.embed_in.weight"]
    return full


_LAYER_ATTRIBUTES = {
    "EmbeddingPipe": lambda info: {"embed_in": "gpt_neox.embed_in", "emb_dropout": "gpt_neox.emb_dropout"},
    "TransformerLayerPipe": lambda info: {"layer": info.paths[0]},
    "FinalNormPipe": lambda info: {"final_layer_norm": "gpt_neox.final_layer_norm"},
    "HeadPipe": lambda info: {"lm_head": "lm_head"},
}
