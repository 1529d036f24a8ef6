"""The pipeline engine: DeepSpeed's PipelineEngine over this rank's stage (`stages`), its 1F1B schedule
(`schedule`), whose last stage computes the `lm` loss (`loss`); the whole model merged from the stages (`merge`)."""

from __future__ import annotations

import torch

from neox_hf.engines.base import Engine
from neox_hf.engines.optimizer import build_optimizer
from neox_hf.engines.pipeline.checkpoint_files import stage_parameter_names
from neox_hf.engines.pipeline.merge import gather_pipeline_state_dict
from neox_hf.engines.pipeline.partition import full_parameter_count, stage_report
from neox_hf.engines.pipeline.schedule import pipeline_eval_loss_sums, pipeline_train_step
from neox_hf.engines.pipeline.stages import build_pipeline_model
from neox_hf.parallel.layout import StepResult
from neox_hf.parallel.tp_plan import partition_dim


class PipelineEngine(Engine):
    name = "pipeline"
    objectives = ("lm",)

    @classmethod
    def handles(cls, recipe, layout) -> bool:
        return layout.pp > 1

    def describe(self) -> str:
        return f"{self.layout.pp} pipeline stages"

    def why_not_objective(self) -> str:
        return ("DeepSpeed's pipeline schedule hands the last stage one micro-batch's hidden states and labels, so a "
                "loss comparing two sequences' log-probabilities (and a frozen reference) has no place there; use "
                "tensor parallelism and ZeRO instead")

    def build_model(self, tokenizer):
        return build_pipeline_model(self.recipe, tokenizer, self.layout)

    def parallelize(self, model):
        """A PipelineModule (TP and activation checkpointing applied when its stage was built) → DeepSpeed's
        PipelineEngine. No mpu wrapper: the module's pipe × data × model grid is DeepSpeed's mpu."""
        self.model, self.optimizer = self.accelerator.prepare(model, build_optimizer(model, self.recipe.train))
        return self.model, self.optimizer

    def startup_lines(self) -> list[str]:
        return stage_report(self.model.module, self.layout, self.recipe.train.gradient_accumulation_steps)

    def train_step(self, micro_batches: list[dict]) -> StepResult:
        return pipeline_train_step(self.model, micro_batches, self.layout, self.recipe)

    def eval_sums(self, batches: list[dict]) -> torch.Tensor:

        return pipeline_eval_loss_sums(self.model, batches, self.layout, self.recipe)

    def full_state_dict(self) -> dict | None:
        return gather_pipeline_state_dict(self.model, self.layout)

    def has_layout_free_state(self) -> bool:
        """Not with tied embeddings: the first and last stages each hold a copy of the tied embedding under
        DeepSpeed's `tied_modules`, which has no single owner to write it and no mapping yet. Such a checkpoint resumes
        on its own layout; another layout refuses it as a checkpoint without a layout-free state."""
        return not self.model.module.config.tie_word_embeddings

    def named_full_parameters(self):
        module = self.model.module
        names = stage_parameter_names(module, module.config)
        for name, param in module.named_parameters():
            if param.requires_grad:
                yield names[name], param, partition_dim(names[name]) if self.layout.tp > 1 else None

    def parameter_count(self) -> int:
        module = getattr(self.model, "module", self.model)
        return full_parameter_count(module.config)  # a rank holds one stage: count from the config
