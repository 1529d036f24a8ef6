"""Memory per rank of real training steps, for tests/test_plan.py to hold `neox_hf plan` against.

    python tests/workers/plan_measure.py OUT_DIR --layouts NAME=ZERO,TP,PP[,sp][,ac] ...          (1 process)
    accelerate launch --use_deepspeed --num_processes N ... plan_measure.py OUT_DIR --layouts ...   (N processes)

Each layout (run one after the other in the same processes, Accelerate reset between them, as
tests/workers/dp_equivalence.py does: start-up is most of a launch) trains the recipe `recipe_dict` builds through the
library's own verbs (init_distributed → build_engine → build_model → parallelize → train_step), and every rank writes
OUT_DIR/NAME/rank{R}.json with what benchmarks/parallel_memory.py measures:
- model_states: bytes of every live tensor just before the optimizer updates the weights (gradients reduced, optimizer
  states present from the first step), the step's batch left out;
- total: the peak of live tensor bytes over a whole training step (forward, backward, optimizer): the live bytes
  before the step plus the peak of what the step allocates (`step_peak_bytes`; CPU has no allocator statistics).
The second step is measured (the first one creates the optimizer states).
"""

import argparse
import gc
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from parallel_memory import live_tensor_bytes, step_peak_bytes  # noqa: E402

from neox_hf.data.tokenizer import load_tokenizer  # noqa: E402
from neox_hf.engines import build_engine  # noqa: E402
from neox_hf.parallel import init_distributed  # noqa: E402
from neox_hf.recipe import recipe_from_dict  # noqa: E402

TOKENIZER = str(REPO / "examples/data/gpt-neox-20b-tokenizer.json")
LAYERS, HIDDEN, HEADS, SEQ, MICRO_BATCH, PIPE_MICRO_BATCHES = 4, 128, 4, 256, 4, 4


def recipe_dict(out_dir: str, zero: int, tp: int, pp: int, sp: bool = False, ac: bool = False) -> dict:
    """The measured recipe (tests/test_plan.py plans the same dict)."""
    return {
        "model": {"num_layers": LAYERS, "hidden_size": HIDDEN, "num_attention_heads": HEADS, "seq_length": SEQ},
        "tokenizer": {"path": TOKENIZER},
        "parallel": {"zero_stage": zero, "tensor_parallel": tp, "pipeline_parallel": pp, "sequence_parallel": sp,
                     "activation_checkpointing": ac},
        "train": {"micro_batch_size": MICRO_BATCH, "precision": "fp32",
                  "gradient_accumulation_steps": PIPE_MICRO_BATCHES if pp > 1 else 1},
        "output": {"dir": out_dir, "tensorboard": False},
    }


def parse_layout(entry: str) -> tuple[str, dict]:
    name, spec = entry.split("=", 1)
    zero, tp, pp, *flags = spec.split(",")
    return name, {"zero": int(zero), "tp": int(tp), "pp": int(pp), "sp": "sp" in flags, "ac": "ac" in flags}


def batches(recipe, layout) -> list[dict]:
    generator = torch.Generator().manual_seed(layout.dp_rank)
    t = recipe.train
    ids = torch.randint(2, 50000, (t.gradient_accumulation_steps, t.micro_batch_size, recipe.model.seq_length + 1),
                        generator=generator)
    return [{"input_ids": ids[i, :, :-1], "labels": ids[i, :, 1:]} for i in range(len(ids))]


def before_update(run, measure):
    """Call `measure()` right before the weights are updated, whichever engine runs the step."""
    model = run.model
    if run.layout.pp > 1:  # the pipeline engine runs its schedule through a class-level instruction map
        from deepspeed.runtime.pipe import schedule

        instructions = dict(type(model)._INSTRUCTION_MAP)
        optimizer_step = instructions[schedule.OptimizerStep]

        def step_instruction(self, **kwargs):
            measure()
            return optimizer_step(self, **kwargs)

        instructions[schedule.OptimizerStep] = step_instruction
        model._INSTRUCTION_MAP = instructions
    elif hasattr(model, "step") and hasattr(model, "zero_optimization_stage"):  # a DeepSpeed engine
        engine_step = model.step

        def step(*args, **kwargs):
            measure()
            return engine_step(*args, **kwargs)

        model.step = step
    else:
        run.optimizer.optimizer.register_step_pre_hook(lambda *_: measure())


def measure_layout(out_dir: Path, spec: dict) -> None:
    # What earlier layouts of this process left alive (DeepSpeed keeps references to its engines) is not this one's.
    before = live_tensor_bytes()
    recipe = recipe_from_dict(recipe_dict(str(out_dir), **spec))
    accelerator, layout = init_distributed(recipe)
    torch.manual_seed(0)
    engine = build_engine(recipe, accelerator, layout)
    model, optimizer = engine.parallelize(engine.build_model(load_tokenizer(TOKENIZER)))
    run = SimpleNamespace(accelerator=accelerator, model=model, optimizer=optimizer, recipe=recipe, layout=layout)
    found: dict = {}
    batch_bytes = [0]

    def measure():
        if found.get("armed") and "model_states" not in found:
            found["model_states"] = live_tensor_bytes() - batch_bytes[0] - before

    before_update(run, measure)
    for step in range(2):
        micro_batches = batches(recipe, layout)
        batch_bytes[0] = sum(mb["input_ids"].untyped_storage().nbytes() for mb in micro_batches[:1])
        found["armed"] = step == 1
        if step == 1:
            found["total"] = step_peak_bytes(lambda: engine.train_step(micro_batches), "cpu", batch_bytes[0]) - before
        else:
            engine.train_step(micro_batches)
    result = {"model_states": found["model_states"], "total": found["total"],
              "stage": layout.pp_rank, "tp_rank": layout.tp_rank, "dp_rank": layout.dp_rank}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{layout.rank}.json").write_text(json.dumps(result))
    accelerator.wait_for_everyone()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--layouts", nargs="+", required=True)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import end_process_group, reset_accelerate_state

    # Every measurement walks the heap (gc.collect, gc.get_objects) to find live tensors: a third of this worker's
    # CPU with the heap the imports leave. Frozen, those objects are skipped by both; every tensor a layout creates
    # is made later and still found, and import-time tensors drop out of `before` and the measurements alike.
    gc.freeze()
    for entry in args.layouts:
        name, spec = parse_layout(entry)
        measure_layout(Path(args.out_dir) / name, spec)
        reset_accelerate_state()
    end_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
