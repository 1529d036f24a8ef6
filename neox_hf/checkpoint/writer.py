"""What wrote a checkpoint (`run_description`, recorded as the trainer state's `writer`: the backend, DeepSpeed or not,
its ZeRO stage, the process / data / tensor / pipeline / context sizes), whether this run is another kind of launch,
and the one line that says so with the command that would resume it."""

from __future__ import annotations

from pathlib import Path

from neox_hf.errors import CheckpointError
from neox_hf.io import load_torch_safely


# What wrote a checkpoint. DeepSpeed's files hold each rank's ZeRO partitions and TP / pipeline slices under names of
# that layout, accelerate's plain files the whole model of one process: only a run of the same description reads them.
_LAYOUT_KEYS = ("backend", "deepspeed", "zero_stage", "processes", "data_parallel", "tensor_parallel",
                "pipeline_parallel", "context_parallel")


def layout_free_only(engine) -> bool:
    return engine is not None and not engine.reads_accelerate_checkpoint


def run_description(accelerator, engine=None) -> dict:
    """The backend (`parallel.backend`, from the run's engine), DeepSpeed or not, its ZeRO stage, and the process /
    data / tensor / pipeline sizes of a prepared run (what `save_checkpoint` records as the trainer state's
    `writer`); None where unknown."""
    backend = {"backend": engine.backend} if engine is not None else {}
    layout = getattr(engine, "layout", None)
    if engine is not None and engine.backend == "fsdp2":  # not DeepSpeed: the sizes are the layout's
        return {**backend, "deepspeed": False, "zero_stage": None, "processes": accelerator.num_processes,
                "data_parallel": layout.dp, "tensor_parallel": layout.tp, "pipeline_parallel": layout.pp,
                "context_parallel": layout.cp}
    return {**backend, **_launch_description(accelerator, getattr(layout, "cp", 1))}


def _launch_description(accelerator, context_parallel: int = 1) -> dict:
    processes = accelerator.num_processes
    if not uses_deepspeed(accelerator):  # plain Accelerate: one process (several always run through DeepSpeed)
        return {"deepspeed": False, "zero_stage": None, "processes": processes, "data_parallel": processes,
                "tensor_parallel": 1, "pipeline_parallel": 1, "context_parallel": 1}
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    engine = getattr(wrapped, "engine", None)
    if engine is None:  # not prepared yet: what the plugin says
        return {"deepspeed": True, "zero_stage": accelerator.state.deepspeed_plugin.zero_stage, "processes": processes,
                "data_parallel": None, "tensor_parallel": None, "pipeline_parallel": None, "context_parallel": None}
    # DeepSpeed's "model parallel" size counts pipeline stages too, and its data-parallel group holds the
    # context-parallel ranks too; processes = data × context × tensor × pipeline.
    dp_cp, pp = int(engine.dp_world_size), int(getattr(engine, "num_stages", 1))  # only a PipelineEngine has stages
    return {"deepspeed": True, "zero_stage": int(engine.zero_optimization_stage()), "processes": processes,
            "data_parallel": dp_cp // context_parallel, "tensor_parallel": processes // (dp_cp * pp),
            "pipeline_parallel": pp, "context_parallel": context_parallel}


def checkpoint_writer(folder: Path) -> dict | None:
    """What wrote `folder` (`run_description` of that run); for a checkpoint written before it was recorded, what its
    files show (DeepSpeed or not, the number of processes). None when rank 0's trainer state is unreadable
    (`load_checkpoint` reports that)."""
    try:
        state = load_torch_safely(folder / "trainer_state_rank0.pt")
    except Exception:  # noqa: BLE001 — corrupt or missing: reported by the load, naming the file
        return None
    if isinstance(state, dict) and isinstance(state.get("writer"), dict):
        return state["writer"]
    return {"deepspeed": (folder / "pytorch_model").is_dir(),
            "processes": len(list(folder.glob("trainer_state_rank*.pt")))}


def writer_differs(writer: dict | None, current: dict) -> bool:
    """Whether a checkpoint of `writer` cannot be read by accelerate's per-rank files in the `current` run."""
    return writer is not None and any(writer.get(k) is not None and current.get(k) is not None and
                                      _comparable(k, writer[k]) != _comparable(k, current[k]) for k in _LAYOUT_KEYS)


def check_same_writer(folder: Path, current: dict) -> None:
    """Refuse, before loading, a checkpoint written by another kind of launch, naming both: its files are intact but
    this run cannot read them (the loaders then fail on a missing or misshapen file, which looks like damage)."""
    writer = checkpoint_writer(folder)
    if writer is None:
        return
    differ = [k for k in _LAYOUT_KEYS if writer.get(k) is not None and current.get(k) is not None
              and _comparable(k, writer[k]) != _comparable(k, current[k])]
    if not differ:
        return
    raise CheckpointError(other_launch_message(folder, writer, current))


def other_launch_message(folder: Path, writer: dict, current: dict, *, why: str = "") -> str:
    """One line: what wrote `folder`, what this run is, why it cannot continue it, and what to do instead."""
    reason = f" ({why})" if why else ""
    return (f"{folder} was written by {describe_run(writer)}; this run is {describe_run(current)}, which cannot read "
            f"it{reason} (the checkpoint is intact): resume with the launch that wrote it, {launch_command(writer)}, "
            f"or export its weights with `neox_hf export {folder} OUT` and start a new run from them with "
            "`--model.from_pretrained OUT`")


def _comparable(key: str, value):
    # ZeRO-1 and ZeRO-2 write one optimizer-state format (DeepSpeed's stage_1_and_2.py): either resumes the other.
    return "1-2" if key == "zero_stage" and value in (1, 2) else value


def describe_run(run: dict) -> str:
    """E.g. 'DeepSpeed ZeRO-1 on 2 processes', '1 process without DeepSpeed', 'DeepSpeed ZeRO-1 on 4 processes
    (2 data-parallel × tensor parallel 2)', 'FSDP2 on 2 processes (1 data-parallel × context parallel 2)'."""
    count = run.get("processes")
    processes = f"{count} process{'es' if count != 1 else ''}" if count else "an unknown number of processes"
    if run.get("backend") == "gpt-neox":  # a GPT-NeoX run's state, imported by `neox_hf continue-neox`
        return f"GPT-NeoX ({describe_run({**run, 'backend': 'deepspeed'})})"
    if run.get("backend") != "fsdp2" and not run.get("deepspeed"):
        return f"{processes} without DeepSpeed"
    if run.get("backend") == "fsdp2":
        stage = "FSDP2"
    else:
        stage = f"DeepSpeed ZeRO-{run['zero_stage']}" if run.get("zero_stage") is not None else "DeepSpeed"
    tp, pp, cp = run.get("tensor_parallel") or 1, run.get("pipeline_parallel") or 1, run.get("context_parallel") or 1
    if tp == 1 and pp == 1 and cp == 1:
        return f"{stage} on {processes}"
    sizes = [f"{run.get('data_parallel')} data-parallel"] + ([f"context parallel {cp}"] if cp > 1 else []) + (
        [f"tensor parallel {tp}"] if tp > 1 else []) + ([f"{pp} pipeline stages"] if pp > 1 else [])
    return f"{stage} on {processes} ({' × '.join(sizes)})"


def launch_command(run: dict) -> str:
    """The command that resumes a run of this description."""
    if run.get("backend") == "fsdp2":
        return (f"`torchrun --standalone --nproc_per_node {run.get('processes') or 'N'} run_clm_neox.py RECIPE "
                "--parallel.backend fsdp2 --resume`")
    if run.get("backend") == "gpt-neox":
        return "GPT-NeoX's own launcher on the checkpoint continue-neox read (`deepy.py train.py CONFIG`)"
    if not run.get("deepspeed"):
        return "`python run_clm_neox.py RECIPE --parallel.zero_stage 0 --resume`"
    options = "".join(f" --parallel.{key} {run[key]}" for key in ("zero_stage", "tensor_parallel", "pipeline_parallel",
                                                                  "context_parallel")
                      if run.get(key) is not None and (key == "zero_stage" or run[key] > 1))
    count = run.get("processes")
    if count == 1:
        return f"`python run_clm_neox.py RECIPE{options} --resume`"
    return (f"`accelerate launch --use_deepspeed --num_processes {count or 'N'} run_clm_neox.py RECIPE{options} "
            "--resume`")


def uses_deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED
