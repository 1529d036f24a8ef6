"""The engine interface: what the training loop asks of an execution path (`neox_hf.engines` lists them).

Each gives the loop what it needs: build the model, parallelize it (optimizer included), one optimizer step for the
run's objective, evaluation sums, the full state dict, the parameter count, the fp16 loss scale, and this rank's
part of the layout-free checkpoint state (`layout_free_state` / `load_layout_free_state`: each parameter under its
transformers name and full shape, so `neox_hf.checkpoint` never learns the layout). The loop never
learns what a stage, a TP group or a ZeRO partition is (torchtitan's `ModelSpec`/`train_step` split, one level up).
"""

from __future__ import annotations

import torch

from neox_hf.engines import zero_state
from neox_hf.engines.scaler import loss_scale, loss_scale_floor
from neox_hf.errors import RecipeError
from neox_hf.objectives import build_objective
from neox_hf.ops.library_loss import loss_kernel
from neox_hf.parallel.layout import Layout, StepResult


class Engine:
    name: str = ""  # its key in `neox_hf.engines.ENGINES`
    backend: str = "deepspeed"  # `parallel.backend` (Accelerate alone counts as deepspeed's); checkpoints record it
    # Whether a checkpoint of the same layout resumes from accelerate's save_state files; False: always from the
    # layout-free state (an engine whose model and optimizer Accelerate does not hold)
    reads_accelerate_checkpoint: bool = True
    objectives: tuple[str, ...] = ("lm", "dpo", "rm", "kto")

    def __init__(self, recipe, accelerator, layout: Layout, *, model=None, optimizer=None):
        if recipe.train.objective not in self.objectives:
            raise RecipeError(f"`train.objective: {recipe.train.objective}` cannot run on {self.describe()}: "
                              f"{self.why_not_objective()}")
        self.recipe, self.accelerator, self.layout = recipe, accelerator, layout
        self.model, self.optimizer = model, optimizer
        self._objective = None
        self._loss_kernel = None

    @property
    def loss_kernel(self) -> str:
        """The head-loss kernel this run computes with (`neox_hf.ops.library_loss.loss_kernel`): `unfused`, `neox`,
        `liger` or `cce`; what the step and evaluation hand the objective as `fused`."""
        if self._loss_kernel is None:
            device = self.accelerator.device if self.accelerator is not None else torch.device("cpu")
            self._loss_kernel = loss_kernel(self.recipe.train, device, self.layout.tp)
        return self._loss_kernel

    @property
    def head_loss_fused(self) -> bool | str:
        """`fused` as `neox_hf.ops.head_loss` takes it."""
        return {"unfused": False, "neox": True}.get(self.loss_kernel, self.loss_kernel)

    @property
    def objective(self):
        if self._objective is None:
            self._objective = build_objective(self.recipe.train)
            self._objective.data_parallel_group = self.layout.dp_group if self.layout.dp > 1 else None
        return self._objective

    @classmethod
    def handles(cls, recipe, layout: Layout) -> bool:
        """Whether this engine runs `recipe` on `layout` (`neox_hf.engines.build_engine` asks in registry order)."""
        raise NotImplementedError

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
        return loss_scale(self.accelerator, self.model)

    def loss_scale_floor(self) -> float | None:
        return loss_scale_floor(self.accelerator, self.model)

    # -- the layout-free checkpoint (files: neox_hf.checkpoint.layout_free) -------------------------------

    def named_full_parameters(self):
        """(transformers name, this rank's parameter, its tensor-parallel split dim or None) of every trained
        parameter this rank holds."""
        raise NotImplementedError

    def has_layout_free_state(self) -> bool:
        """Whether `layout_free_state` can describe this rank's model (see PipelineEngine's exception)."""
        return True

    def layout_free_state(self) -> tuple[dict, dict]:
        """This rank's part of the layout-free training state: (tensors keyed `model|exp_avg|exp_avg_sq/<name>`,
        each this rank's chunk of the full tensor; plain data: Adam's step, the loss scaler). Collective."""
        return zero_state.layout_free_state(self)

    def load_layout_free_state(self, read, plain: dict) -> None:
        """Restore what `layout_free_state` returned, on this rank's layout: `read(targets)` fills the empty
        tensors (this rank's TP shards) in place. Collective."""
        zero_state.load_layout_free_state(self, read, plain)
