"""tests/workers/init_layouts.py (several runs of the real entry point in one launch) for tests/test_expert_parallel.py,
with every run's gradients of its first optimizer step written by rank 0 to OUT_DIR/NAME.grads.pt: each parameter
whole under its transformers name (an expert tensor gathered over the expert group), as the optimizer steps on it —
after DeepSpeed's reduction (read by `safe_get_full_grad` at the start of `DeepSpeedEngine.step`) or FSDP2's (its
DTensors made whole at the clip), or one process's own.

    torchrun --standalone --nproc_per_node N tests/workers/expert_parallel_layouts.py OUT_DIR NAME="..." ... -- RUN_ARGS
"""

import contextlib
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import init_layouts  # noqa: E402


def main(argv: list[str]) -> int:
    out_dir = Path(argv[0])
    current = {}

    @contextlib.contextmanager
    def around(name: str):
        current["path"] = out_dir / f"{name}.grads.pt"
        yield

    _record_first_gradients(lambda: current["path"])
    return init_layouts.main(argv, around=around)


def _record_first_gradients(path) -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import safe_get_full_grad

    import neox_hf.engines.fsdp2 as fsdp2
    import neox_hf.engines.replica as replica
    from neox_hf.parallel.accelerator import uses_deepspeed

    for engine_class in (fsdp2.FSDP2Engine, replica.ReplicaEngine):
        def clip_gradients(self, _clip=engine_class.clip_gradients):
            if not getattr(self, "_recorded", False) and not uses_deepspeed(self.accelerator):
                self._recorded = True
                _write(self.model.named_parameters(), self.layout, path(), lambda p: p.grad)
            return _clip(self)
        engine_class.clip_gradients = clip_gradients

    step = DeepSpeedEngine.step

    def deepspeed_step(self, *args, **kwargs):
        if not getattr(self, "_recorded", False) and self.is_gradient_accumulation_boundary():
            self._recorded = True
            _write(self.module.named_parameters(), self.mpu.groups, path(), safe_get_full_grad)
        return step(self, *args, **kwargs)

    DeepSpeedEngine.step = deepspeed_step


def _write(named, layout, path, gradient_of) -> None:
    """Collective: every rank gathers, rank 0 writes."""
    from neox_hf.parallel.expert_parallel import is_expert_parameter
    from neox_hf.parallel.mappings import gather_along_dim
    from neox_hf.parallel.tp_plan import partition_dim

    grads = {}
    for name, param in named:
        grad = gradient_of(param)
        if grad is None:
            continue
        grad = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().contiguous()
        if layout.ep > 1 and is_expert_parameter(name):
            grad = gather_along_dim(grad, 0, layout.ep_group)
        elif layout.tp > 1 and partition_dim(name) is not None:
            grad = gather_along_dim(grad, partition_dim(name), layout.tp_group)
        grads[name.removeprefix("module.")] = grad.cpu().clone()
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(grads, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
