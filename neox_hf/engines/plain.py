"""The plain engine: one model replica per data-parallel rank, under Accelerate alone or with DeepSpeed ZeRO 0–3,
with our tensor (+ sequence) parallelism inside the replica. Its step is the only place with forward, backward and
optimizer step outside DeepSpeed's pipeline schedule (torchtitan's `train_step` shape), for any objective
(`neox_hf.objectives`).

One optimizer step over `gradient_accumulation_steps` micro-batches. The objective's units (labelled tokens, or
pairs) are counted over all micro-batches and all-reduced over the data-parallel group before the first backward;
each micro-batch backpropagates its loss *sum* weighted by `neox_hf.ops.weighting` (token: every unit of the step
weighs the same; micro_batch: GPT-NeoX's mean of micro-batch means). The objective's metrics are summed the same way
and divided by the step's units (TRL's per-batch means).

Nothing here calls `.item()`: the step's loss, counts and metrics stay on the device until a log interval reads them.
"""

from __future__ import annotations

import contextlib

import torch

from neox_hf.engines.base import Engine
from neox_hf.engines.build import build_model_from_recipe
from neox_hf.engines.compile import compile_decoder_layers, compiles
from neox_hf.engines.optimizer import build_optimizer
from neox_hf.engines.scaler import loss_scale, step_was_skipped
from neox_hf.objectives.rm import build_reward_model
from neox_hf.ops.weighting import backward_scale, step_loss
from neox_hf.parallel.accelerator import uses_deepspeed
from neox_hf.parallel.layout import StepResult, deepspeed_grad_norm, dp_sum
from neox_hf.parallel.tensor_parallel import apply_tensor_parallel, gather_full_state_dict
from neox_hf.parallel.tp_groups import DeepSpeedMPU, deepspeed_initialize_with_mpu
from neox_hf.parallel.tp_plan import partition_dim


class PlainEngine(Engine):
    name = "plain"

    @classmethod
    def handles(cls, recipe, layout) -> bool:
        return True  # the default: every layout without pipeline stages

    def describe(self) -> str:
        return "one model replica per data-parallel rank (tensor parallelism inside it)"

    def startup_lines(self) -> list[str]:
        setting = self.recipe.train.compile
        if compiles(self.recipe.train, self.accelerator.device):
            return [f"compile: each decoder layer with torch.compile (`train.compile: {str(setting).lower()}`); masks, "
                    "rotary tables and the loss eager"]
        why = " (auto compiles on CUDA only)" if setting == "auto" else ""
        return [f"compile: off{why}"]

    def build_model(self, tokenizer):
        if self.recipe.train.objective == "rm":  # a scalar head on the decoder (GPTNeoXForSequenceClassification)
            return build_reward_model(self.recipe, tokenizer)
        return build_model_from_recipe(self.recipe, tokenizer, self.layout)

    def parallelize(self, model):
        """Apply TP (+ sequence parallelism) and activation checkpointing, build AdamW, let Accelerate/DeepSpeed wrap
        both; DeepSpeed is handed the layout so ZeRO reduces over the data-parallel group only. (model, optimizer),
        also kept on the engine."""
        layout, recipe, accelerator = self.layout, self.recipe, self.accelerator
        if layout.tp > 1 and not getattr(model.get_output_embeddings(), "loss_sum", None):
            model = apply_tensor_parallel(model, layout.tp_group, sequence_parallel=recipe.parallel.sequence_parallel)
        if recipe.parallel.activation_checkpointing:
            # transformers renamed gradient_checkpointing_enable after 5.17; setup.py admits every 5.x.
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
        if compiles(recipe.train, accelerator.device):
            compile_decoder_layers(model)
        optimizer = build_optimizer(model, recipe.train)
        distributed = layout.world_size > 1
        with deepspeed_initialize_with_mpu(DeepSpeedMPU(layout)) if distributed else contextlib.nullcontext():
            self.model, self.optimizer = accelerator.prepare(model, optimizer)
        return self.model, self.optimizer

    def train_step(self, micro_batches: list[dict]) -> StepResult:
        """One optimizer step for the run's objective, over `gradient_accumulation_steps` micro-batches (collective
        over the data-parallel group)."""
        accelerator, model, optimizer, layout = self.accelerator, self.model, self.optimizer, self.layout
        t, objective = self.recipe.train, self.objective
        units = [objective.units(mb) for mb in micro_batches]
        device = accelerator.device
        counts = torch.stack([sum(units), _samples(micro_batches, objective, device), _tokens(micro_batches, objective, device)])
        totals = dp_sum(layout, counts.double())
        weighted = torch.zeros((), dtype=torch.float64, device=device)
        metric_sums = torch.zeros(len(objective.metric_names), dtype=torch.float64, device=device)
        grad_norm = None
        scale_before = loss_scale(accelerator, model)
        for batch, count in zip(micro_batches, units):
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    out = objective.loss(model, batch, fused=self.head_loss_fused, z_loss=t.z_loss)
                scale = backward_scale(t.loss_normalization, count.double(), totals[0], gas=len(micro_batches),
                                       dp=layout.dp)
                weighted += out.loss_sum.detach().double() * scale
                metric_sums += _metric_vector(out, objective.metric_names, device)
                accelerator.backward(out.loss_sum * scale.to(out.loss_sum.dtype))
                if accelerator.sync_gradients:
                    grad_norm = _clip_gradients(accelerator, model, t.clip_grad)
                optimizer.step()
                optimizer.zero_grad()
        reduced = dp_sum(layout, torch.cat([weighted.reshape(1), metric_sums]))
        if uses_deepspeed(accelerator):
            grad_norm = deepspeed_grad_norm(model)
        metrics = dict(zip(objective.metric_names, reduced[1:] / totals[0].clamp(min=1)))
        return StepResult(loss=step_loss(reduced[0], gas=len(micro_batches), dp=layout.dp), tokens=totals[2],
                          samples=totals[1], grad_norm=grad_norm, skipped=step_was_skipped(accelerator, model, scale_before),
                          metrics=metrics)


    @torch.no_grad()
    def eval_sums(self, batches: list[dict]) -> torch.Tensor:
        """[Σ loss, units, Σ of each metric] of the objective over this data-parallel group's eval batches, float64, on
        device."""
        objective, device = self.objective, self.accelerator.device
        total = torch.zeros(2 + len(objective.metric_names), dtype=torch.float64, device=device)
        for batch in batches:
            with self.accelerator.autocast():
                out = objective.loss(self.model, batch, fused=self.head_loss_fused)
            total += torch.cat([torch.stack([out.loss_sum.double(), out.units.double()]),
                                _metric_vector(out, objective.metric_names, device)])
        return dp_sum(self.layout, total)

    def full_state_dict(self) -> dict | None:
        """The whole model's state dict (TP shards merged, ZeRO-3 partitions gathered). Collective: every rank calls it;
        the result is complete on the main process."""
        if self.layout.tp > 1:
            return gather_full_state_dict(self.accelerator.unwrap_model(self.model), self.layout)
        return self.accelerator.get_state_dict(self.model)

    def named_full_parameters(self):
        module = getattr(self.model, "module", self.model)  # through DDP / DeepSpeed wrappers
        for name, param in module.named_parameters():
            if param.requires_grad:
                yield name, param, partition_dim(name) if self.layout.tp > 1 else None

    def parameter_count(self) -> int:
        """Full-model parameter count (ZeRO-3 partitions, TP shards; replicated norms are counted once per TP rank,
        which is why this is approximate under TP)."""
        model = getattr(self.model, "module", self.model)  # through DDP / DeepSpeed wrappers
        return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()) * self.layout.tp


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
