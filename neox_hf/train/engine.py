"""Engines: one per execution path, chosen once from the layout by `build_engine` — the only place that asks
whether the layout has pipeline stages.

- `PlainEngine`: Accelerate alone or with DeepSpeed (ZeRO 0–3), with or without tensor / sequence parallelism; its
  step is `neox_hf.train.step` and runs any objective.
- `PipelineEngine`: DeepSpeed's PipelineEngine over stages (`neox_hf.parallel.pipeline`); its step is the 1F1B
  schedule, whose last stage computes the `lm` loss (`objectives` says what it runs).

Each gives the loop what it needs: build the model, parallelize it (optimizer included), one optimizer step for the
run's objective, evaluation sums, the full state dict, the parameter count, the fp16 loss scale. The loop never
learns what a stage, a TP group or a ZeRO partition is (torchtitan's `ModelSpec`/`train_step` split, one level up).
"""

from __future__ import annotations

import torch

from neox_hf.errors import RecipeError
from neox_hf.parallel.layout import Layout, StepResult


class Engine:
    objectives: tuple[str, ...] = ("lm", "dpo", "rm")

    def __init__(self, recipe, accelerator, layout: Layout, *, model=None, optimizer=None):
        if recipe.train.objective not in self.objectives:
            raise RecipeError(f"`train.objective: {recipe.train.objective}` cannot run on {self.describe()}: "
                              f"{self.why_not_objective()}")
        self.recipe, self.accelerator, self.layout = recipe, accelerator, layout
        self.model, self.optimizer = model, optimizer
        self._objective = None

    @property
    def objective(self):
        if self._objective is None:
            from neox_hf.objectives import build_objective

            self._objective = build_objective(self.recipe.train)
        return self._objective

    def describe(self) -> str:
        return type(self).__name__

    def why_not_objective(self) -> str:
        return ""

    # -- what the loop calls ---------------------------------------------------------------------------------

    def build_model(self, tokenizer):
        raise NotImplementedError

    def parallelize(self, model):
        """(model, optimizer) wrapped by Accelerate / DeepSpeed; also kept on the engine."""
        raise NotImplementedError

    def train_step(self, micro_batches: list[dict]) -> StepResult:
        raise NotImplementedError

    def eval_sums(self, batches: list[dict]) -> torch.Tensor:
        """[Σ loss, units] (float64, on device) over every data-parallel rank's eval batches. Collective."""
        raise NotImplementedError

    def full_state_dict(self) -> dict | None:
        """The whole model's state dict, complete on the main process. Collective."""
        raise NotImplementedError

    def parameter_count(self) -> int:
        raise NotImplementedError

    def startup_lines(self) -> list[str]:
        return []

    def loss_scale(self) -> float | None:
        from neox_hf.train.step import loss_scale

        return loss_scale(self.accelerator, self.model)

    def loss_scale_floor(self) -> float | None:
        from neox_hf.train.step import loss_scale_floor

        return loss_scale_floor(self.accelerator, self.model)


class PlainEngine(Engine):
    def describe(self) -> str:
        return "one model replica per data-parallel rank (tensor parallelism inside it)"

    def build_model(self, tokenizer):
        from neox_hf.parallel.build import build_model_plain

        if self.recipe.train.objective == "rm":  # a scalar head on the decoder (GPTNeoXForSequenceClassification)
            from neox_hf.objectives.rm import build_reward_model

            return build_reward_model(self.recipe, tokenizer)
        return build_model_plain(self.recipe, tokenizer, self.layout)

    def parallelize(self, model):
        from neox_hf.parallel import parallelize_plain

        self.model, self.optimizer = parallelize_plain(model, self.layout, self.recipe, self.accelerator)
        return self.model, self.optimizer

    def train_step(self, micro_batches: list[dict]) -> StepResult:
        from neox_hf.train.step import train_step_plain

        return train_step_plain(self, micro_batches)

    def eval_sums(self, batches: list[dict]) -> torch.Tensor:
        from neox_hf.train.step import eval_sums_plain

        return eval_sums_plain(self, batches)

    def full_state_dict(self) -> dict | None:
        from neox_hf.parallel import full_state_dict_plain

        return full_state_dict_plain(self.model, self.layout, self.accelerator)

    def parameter_count(self) -> int:
        """Full-model parameter count (ZeRO-3 partitions, TP shards; replicated norms are counted once per TP rank,
        which is why this is approximate under TP)."""
        model = getattr(self.model, "module", self.model)  # through DDP / DeepSpeed wrappers
        return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()) * self.layout.tp


class PipelineEngine(Engine):
    objectives = ("lm",)

    def describe(self) -> str:
        return f"{self.layout.pp} pipeline stages"

    def why_not_objective(self) -> str:
        return ("DeepSpeed's pipeline schedule hands the last stage one micro-batch's hidden states and labels, so a "
                "loss comparing two sequences' log-probabilities (and a frozen reference) has no place there; use "
                "tensor parallelism and ZeRO instead")

    def build_model(self, tokenizer):
        from neox_hf.parallel.pipeline import build_pipeline_model

        return build_pipeline_model(self.recipe, tokenizer, self.layout)

    def parallelize(self, model):
        """A PipelineModule (TP and activation checkpointing applied when its stage was built) → DeepSpeed's
        PipelineEngine. No mpu wrapper: the module's pipe × data × model grid is DeepSpeed's mpu."""
        from neox_hf.parallel import build_optimizer

        self.model, self.optimizer = self.accelerator.prepare(model, build_optimizer(model, self.recipe.train))
        return self.model, self.optimizer

    def startup_lines(self) -> list[str]:
        from neox_hf.parallel.pipeline import stage_report

        return stage_report(self.model.module, self.layout, self.recipe.train.gradient_accumulation_steps)

    def train_step(self, micro_batches: list[dict]) -> StepResult:
        from neox_hf.parallel.pipeline import pipeline_train_step

        return pipeline_train_step(self.model, micro_batches, self.layout, self.recipe)

    def eval_sums(self, batches: list[dict]) -> torch.Tensor:
        from neox_hf.parallel.pipeline import pipeline_eval_loss_sums

        return pipeline_eval_loss_sums(self.model, batches, self.layout, self.recipe)

    def full_state_dict(self) -> dict | None:
        from neox_hf.parallel.pipeline import gather_pipeline_state_dict

        return gather_pipeline_state_dict(self.model, self.layout)

    def parameter_count(self) -> int:
        from neox_hf.parallel.pipeline import full_parameter_count

        module = getattr(self.model, "module", self.model)
        return full_parameter_count(module.config)  # a rank holds one stage: count from the config


def build_engine(recipe, accelerator, layout: Layout, *, model=None, optimizer=None) -> Engine:
    """The engine of this layout: the pipeline engine when it has stages, the plain one otherwise."""
    engine_class = PipelineEngine if layout.pp > 1 else PlainEngine
    return engine_class(recipe, accelerator, layout, model=model, optimizer=optimizer)
