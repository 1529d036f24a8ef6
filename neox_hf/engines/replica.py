"""What every engine with one model replica per data-parallel rank shares (plain: Accelerate / DeepSpeed, fsdp2:
torch's fully_shard): building the model, the optimizer step for any objective (`neox_hf.objectives`) and eval.
It is the only place with forward, backward and optimizer step outside DeepSpeed's pipeline schedule (torchtitan's
`train_step` shape); an engine differs in how it wraps the model (`parallelize`), clips gradients and gathers state.

One optimizer step over `gradient_accumulation_steps` micro-batches. The objective's units (labelled tokens, or
pairs) are counted over all micro-batches and all-reduced over the data-parallel group before the first backward;
each micro-batch backpropagates its loss *sum* weighted by `neox_hf.ops.weighting` (token: every unit of the step
weighs the same; micro_batch: GPT-NeoX's mean of micro-batch means). The objective's metrics are summed the same way
and divided by the step's units (TRL's per-batch means).

Context parallelism: each rank of a context-parallel group reads the same micro-batches and trains its chunk of every
sequence (`neox_hf.ops.context_parallel.sequence_chunk`); units, loss sums and metrics are summed over the data- and
context-parallel ranks (`shard_sum`), and gradients averaged over them (DeepSpeed's data-parallel group is dp × cp),
so the weighting counts dp × cp ranks where it counted dp. With cp = 1 all of this is the data-parallel step.

Nothing here calls `.item()`: the step's loss, counts and metrics stay on the device until a log interval reads them.
"""

from __future__ import annotations

import torch

from neox_hf.engines.base import Engine
from neox_hf.engines.build import build_model_from_recipe
from neox_hf.engines.scaler import loss_scale, step_was_skipped
from neox_hf.objectives.rm import build_reward_model
from neox_hf.ops.context_parallel import sequence_chunk
from neox_hf.ops.weighting import backward_scale, step_loss
from neox_hf.parallel.accelerator import uses_deepspeed
from neox_hf.parallel.layout import StepResult, deepspeed_grad_norm, shard_sum


class ReplicaEngine(Engine):
    """The shared step; subclasses give `parallelize`, the state and `clip_gradients` where Accelerate's differs."""

    context_parallel_attention: str | None = None  # the attention a context-parallel chunk runs with
    context_parallel_order: str = "contiguous"  # how a sequence is dealt over its ranks (`sequence_chunk`'s order)

    def local_chunks(self, batches: list[dict]) -> list[dict]:
        """This rank's chunk of every sequence of `batches` under context parallelism; the batches otherwise."""
        layout = self.layout
        if layout.cp == 1:
            return batches
        return [sequence_chunk(batch, ranks=layout.cp, rank=layout.cp_rank, attention=self.context_parallel_attention,
                               group=layout.cp_group, order=self.context_parallel_order) for batch in batches]

    def build_model(self, tokenizer):
        if self.recipe.train.objective == "rm":  # a scalar head on the decoder (GPTNeoXForSequenceClassification)
            return build_reward_model(self.recipe, tokenizer)
        return build_model_from_recipe(self.recipe, tokenizer, self.layout)

    def clip_gradients(self):
        """The gradient norm before clipping (None where DeepSpeed clips inside its step and reports it)."""
        return _clip_gradients(self.accelerator, self.model, self.recipe.train.clip_grad)

    def before_micro_batch(self, last: bool) -> None:
        """Called before each micro-batch's forward, `last` on the one that ends the accumulation cycle: what a
        wrapper's own forward would have done, since the objectives call the decoder inside it
        (`neox_hf.ops.loss.causal_lm_module`); an engine that reduces gradients itself reduces them on the last only
        (Accelerate's `accumulate` does this for DDP)."""

    def train_step(self, micro_batches: list[dict]) -> StepResult:
        """One optimizer step for the run's objective, over `gradient_accumulation_steps` micro-batches (collective
        over the data-parallel group)."""
        accelerator, model, optimizer, layout = self.accelerator, self.model, self.optimizer, self.layout
        t, objective = self.recipe.train, self.objective
        samples = _samples(micro_batches, objective, accelerator.device) * (layout.cp_rank == 0)  # once per sequence
        micro_batches = self.local_chunks(micro_batches)
        units = [objective.units(mb) for mb in micro_batches]
        device = accelerator.device
        counts = torch.stack([sum(units), samples, _tokens(micro_batches, objective, device)])
        totals = shard_sum(layout, counts.double())
        weighted = torch.zeros((), dtype=torch.float64, device=device)
        metric_sums = torch.zeros(len(objective.metric_names), dtype=torch.float64, device=device)
        grad_norm = None
        scale_before = loss_scale(accelerator, model)
        for batch, count in zip(micro_batches, units):
            with accelerator.accumulate(model):
                self.before_micro_batch(accelerator.sync_gradients)
                with accelerator.autocast():
                    out = objective.loss(model, batch, fused=self.head_loss_fused, z_loss=t.z_loss)
                scale = backward_scale(t.loss_normalization, count.double(), totals[0], gas=len(micro_batches),
                                       dp=layout.dp_cp)
                weighted += out.loss_sum.detach().double() * scale
                metric_sums += _metric_vector(out, objective.metric_names, device)
                accelerator.backward(out.loss_sum * scale.to(out.loss_sum.dtype))
                if accelerator.sync_gradients:
                    grad_norm = self.clip_gradients()
                optimizer.step()
                optimizer.zero_grad()
        reduced = shard_sum(layout, torch.cat([weighted.reshape(1), metric_sums]))
        if uses_deepspeed(accelerator):
            grad_norm = deepspeed_grad_norm(model)
        metrics = dict(zip(objective.metric_names, reduced[1:] / totals[0].clamp(min=1)))
        return StepResult(loss=step_loss(reduced[0], gas=len(micro_batches), dp=layout.dp_cp), tokens=totals[2],
                          samples=totals[1], grad_norm=grad_norm, skipped=step_was_skipped(accelerator, model, scale_before),
                          metrics=metrics)


    @torch.no_grad()
    def eval_sums(self, batches: list[dict]) -> torch.Tensor:
        """[Σ loss, units, Σ of each metric] of the objective over this data-parallel group's eval batches, float64, on
        device."""
        objective, device = self.objective, self.accelerator.device
        total = torch.zeros(2 + len(objective.metric_names), dtype=torch.float64, device=device)
        for batch in self.local_chunks(batches):
            with self.accelerator.autocast():
                out = objective.loss(self.model, batch, fused=self.head_loss_fused)
            total += torch.cat([torch.stack([out.loss_sum.double(), out.units.double()]),
                                _metric_vector(out, objective.metric_names, device)])
        return shard_sum(self.layout, total)


def _metric_vector(out, names: tuple[str, ...], device) -> torch.Tensor:
    return torch.stack([out.metric_sums[n].double() for n in names]) if names else torch.zeros(0, dtype=torch.float64,
                                                                                                 device=device)


def _tokens(micro_batches: list[dict], objective, device) -> torch.Tensor:
    """Tokens the step trained on, for throughput and `consumed_tokens`: for `lm` the labelled tokens (what GPT-NeoX
    and earlier neox_hf runs count); for pair objectives every unpadded token the forward reads (prompt included)."""
    total = torch.zeros((), dtype=torch.long, device=device)
    for mb in micro_batches:
        if "labels" in mb and objective.unit == "token":
            total = total + labelled_tokens(mb)
        elif "attention_mask" in mb:
            total = total + mb["attention_mask"].sum()
        else:
            total = total + mb["input_ids"].numel()
    return total


def labelled_tokens(batch: dict) -> torch.Tensor:
    return (batch["labels"] != -100).sum()


def _samples(micro_batches: list[dict], objective, device) -> torch.Tensor:
    """Samples of the step: sequences, pairs (a micro-batch of P pairs has 2P rows) or KTO examples (P examples and
    their P KL sequences): the objective's `rows_per_sample`."""
    rows = sum(mb["input_ids"].shape[0] for mb in micro_batches)
    return torch.tensor(rows // objective.rows_per_sample, device=device)


def _clip_gradients(accelerator, model, clip_grad: float):
    """DeepSpeed clips inside its step (`gradient_clipping`); elsewhere Accelerate clips and returns the norm."""
    if uses_deepspeed(accelerator) or clip_grad <= 0:
        return None
    return accelerator.clip_grad_norm_(model.parameters(), clip_grad)


def tensor_parallel_once(model, layout, *, sequence_parallel: bool):
    """`model` with our TP layers (+ sequence parallelism) where the layout has TP and the model is not split yet (a
    model from scratch or a safetensors folder is built split: `neox_hf.engines.build`)."""
    from neox_hf.parallel.tensor_parallel import apply_tensor_parallel

    if layout.tp > 1 and not getattr(model.get_output_embeddings(), "loss_sum", None):
        return apply_tensor_parallel(model, layout.tp_group, sequence_parallel=sequence_parallel)
    return model


def enable_activation_checkpointing(model) -> None:
    """transformers' gradient checkpointing of every decoder layer (renamed activation_checkpointing_enable after
    5.17; setup.py admits every 5.x)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
