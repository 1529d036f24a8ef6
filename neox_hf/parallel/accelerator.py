"""The Accelerator for a recipe: DeepSpeed ZeRO through Accelerate's plugin, precision, accumulation, gloo on CPU.

Gap filled: Accelerate builds its DeepSpeed plugin from launcher flags or a JSON file; our recipe is the one source
of truth, so we generate the DeepSpeed config from it (a raw JSON may override). And on CPU, accelerate (1.15/1.16)
reports `num_processes == 1` under DeepSpeed unless the Accelerator is given `InitProcessGroupKwargs(backend="gloo")`,
which then also makes DeepSpeed's batch-size checks pass; we handle it here so no script has to.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

from neox_hf.errors import RecipeError
from neox_hf.hardware import deepspeed_runs_fp16
from neox_hf.recipe.launcher import check_recipe_agrees_with_launcher, launcher_environment_reconciled
from neox_hf.recipe import ParallelConfig, Recipe, TrainConfig, merge_dicts

_MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16", "fp8": "fp8"}


def launched_with_deepspeed() -> bool:
    """`accelerate launch --use_deepspeed` (or a DeepSpeed accelerate config) marks the environment."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def wants_deepspeed(parallel: ParallelConfig) -> bool:
    """Every multi-process run goes through DeepSpeed (ZeRO stage 0 is plain data parallelism): it is what reduces
    gradients over our data-parallel group only, and the loss calls the decoder directly, which DDP's gradient
    hooks would not see. `parallel.backend: fsdp2` never does (its engine shards with torch's fully_shard)."""
    if parallel.backend == "fsdp2":
        return False
    if parallel.tensor_parallel > 1 or parallel.pipeline_parallel > 1 or _launched_distributed():
        if parallel.use_deepspeed is False:
            raise RecipeError("`parallel.use_deepspeed: false` with several processes: multi-process training runs "
                              "through DeepSpeed (zero_stage 0 = plain data parallelism); remove the key")
        return True
    if parallel.use_deepspeed is not None:
        return parallel.use_deepspeed
    return parallel.zero_stage > 0 or parallel.deepspeed_config is not None or launched_with_deepspeed()


def deepspeed_config(parallel: ParallelConfig, train: TrainConfig) -> dict:
    """DeepSpeed JSON (as a dict) carrying the recipe's ZeRO stage, precision, clipping and accumulation."""
    # DeepSpeed's default buckets are 5e8 elements whatever the model (a 1.9 GB fp32 reduce buffer under ZeRO-3);
    # "auto" lets accelerate size them from the model's hidden size (hidden², as transformers' Trainer does).
    zero: dict = {"stage": parallel.zero_stage, "reduce_bucket_size": "auto"}
    if parallel.zero_stage == 3:
        # Gather full weights for save_pretrained at the end of training (accelerator.get_state_dict).
        zero["stage3_gather_16bit_weights_on_model_save"] = True
        zero["stage3_prefetch_bucket_size"] = "auto"
        zero["stage3_param_persistence_threshold"] = "auto"
    if parallel.offload_optimizer:
        if parallel.zero_stage == 0:
            raise RecipeError("`parallel.offload_optimizer: true` needs `parallel.zero_stage` ≥ 1 (DeepSpeed ZeRO-Offload)")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if parallel.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if torch.cuda.is_available() and parallel.zero_stage in (1, 2):
        # Reduce gradients while backward still runs (NCCL on its own stream; gloo gains nothing), as transformers'
        # DeepSpeed configs do.
        zero["overlap_comm"] = True
    config = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "gradient_clipping": train.clip_grad,
        "zero_optimization": zero,
        "bf16": {"enabled": train.precision == "bf16"},
        # GPT-NeoX's dynamic loss scaling defaults (configs/20B.yml).
        "fp16": {
            "enabled": train.precision == "fp16",
            "loss_scale": 0,
            "loss_scale_window": 1000,
            "initial_scale_power": 12,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        # We hand DeepSpeed a torch AdamW; with offload it would otherwise insist on its compiled CPU Adam.
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    model_parallel = parallel.tensor_parallel * parallel.pipeline_parallel
    # experts over data-parallel ranks: DeepSpeed's data-parallel group is the expert-data-parallel one (tp_groups)
    experts = parallel.expert_parallel if parallel.expert_parallel > 1 and parallel.experts_over == "data" else 1
    if model_parallel * experts > 1:
        # accelerate would fill "auto" with every process; the data-parallel size is world / (TP × PP).
        data_parallel = max(1, int(os.environ.get("WORLD_SIZE", "1")) // model_parallel // experts)
        config["train_batch_size"] = train.micro_batch_size * train.gradient_accumulation_steps * data_parallel
    if parallel.pipeline_parallel > 1:
        # DeepSpeed would send each TP rank 1/TP of an activation and all-gather it on the next stage, caching the
        # shapes of the first micro-batch: wrong once shapes vary (pad mode, token budgets), and gloo has no
        # all_gather_into_tensor. Every TP rank sends its whole (replicated) activation instead.
        config["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    if train.precision == "bf16" and train.gradient_accumulation_steps > 1 and parallel.zero_stage in (1, 2) \
            and parallel.pipeline_parallel == 1:
        # DeepSpeed sums bf16 gradients in bf16 by default: over 32 micro-batches (GPT-NeoX-20B's accumulation) its
        # 8-bit mantissa drops the later ones' low bits. fp32 accumulation, as GPT-NeoX's bf16 runs configure; DeepSpeed
        # supports it for ZeRO-1/2 (ZeRO-0 refuses the mix; the pipeline engine keeps its own).
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    if parallel.deepspeed_config:
        config = merge_dicts(config, _read_json(parallel.deepspeed_config))
    return config


def check_deepspeed_precision(config: dict) -> None:
    """Refuse, naming the fix, an fp16 DeepSpeed config the accelerator here cannot run.

    DeepSpeed's CPU accelerator supports fp16 only where oneDNN has fp16 kernels (AVX512-FP16 / AMX CPUs); elsewhere
    `deepspeed.initialize` fails deep inside the engine with "Type fp16 is not supported on your device", after every
    rank has built its model. Checked on the final config, so a raw `parallel.deepspeed_config` enabling fp16 counts.
    """
    if not config.get("fp16", {}).get("enabled"):
        return
    from deepspeed.accelerator import get_accelerator

    if not deepspeed_runs_fp16():
        raise RecipeError(
            f"fp16 (`train.precision: fp16` or an fp16 `parallel.deepspeed_config`) is not supported by DeepSpeed's "
            f"{get_accelerator().device_name()} accelerator on this machine (CPU fp16 needs AVX512-FP16 or AMX); "
            "use `train.precision: bf16` or `fp32` here, or train fp16 on a GPU"
        )


def _read_json(path: str) -> dict:
    location = Path(path)
    if not location.is_file():
        raise RecipeError(f"`parallel.deepspeed_config` file not found: {location}")
    try:
        return json.loads(location.read_text())
    except json.JSONDecodeError as err:
        raise RecipeError(f"`parallel.deepspeed_config` {location} is not valid JSON: {err}") from err


def _launched_distributed() -> bool:
    """torchrun / accelerate launch set WORLD_SIZE; a plain `python` run has none and needs no process group."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def check_ranks_agree_on_precision(precision: str) -> None:
    """Refuse, on every rank, a launch whose ranks settled `train.precision` differently. `auto` is settled in each
    process before any process group exists, on an AVX512-BF16 CPU without AMX from GEMM rates it measures; ranks
    that disagreed would build engines of different dtypes and hang in their first all-reduce. One all-gather of a
    word at start-up; nothing to check in a single process."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    chosen: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(chosen, precision)
    if len(set(chosen)) > 1:
        by_rank = ", ".join(f"rank {rank} {value}" for rank, value in enumerate(chosen))
        raise RecipeError(f"the ranks settled `train.precision` differently ({by_rank}; `auto` measures each "
                          "process's GEMMs on an AVX512-BF16 CPU without AMX): set `train.precision: fp32` or `bf16`")


def allow_tf32(enabled: bool) -> None:
    """`train.tf32`: fp32 matmuls and convolutions on TF32 tensor cores (10-bit mantissa inputs, fp32 accumulation),
    as transformers' `TrainingArguments(tf32=True)` sets it; torch's default keeps full fp32."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def build_accelerator(recipe: Recipe, *, log_with: str | None = None) -> Accelerator:
    """One Accelerator configured from the recipe (single process, DDP, or DeepSpeed ZeRO 0–3). `train.precision:
    auto` was resolved when the recipe was built (`neox_hf.recipe.settled`)."""
    train, parallel = recipe.train, recipe.parallel
    check_recipe_agrees_with_launcher(recipe)
    if train.precision == "auto":  # a programming error: recipes are settled when built (`recipe.settled`)
        raise ValueError("train.precision is still `auto`: build the recipe with recipe_from_dict or settle it with "
                         "neox_hf.recipe.settled before building the Accelerator")
    allow_tf32(train.tf32)
    use_deepspeed = wants_deepspeed(parallel)
    # DeepSpeed and FSDP2 need a process group even in a plain `python` process (a group of one)
    group_of_one = use_deepspeed or parallel.backend == "fsdp2"
    if group_of_one and not _launched_distributed():
        _single_process_environment()
    kwargs_handlers = [process_group_kwargs(parallel, distributed=group_of_one or _launched_distributed())]
    if train.precision == "fp8":
        from accelerate.utils import TERecipeKwargs

        check_fp8_supported()
        kwargs_handlers.append(TERecipeKwargs(**fp8_recipe_arguments(train)))
    ds_config = deepspeed_config(parallel, train) if use_deepspeed else None
    if ds_config is not None:
        check_deepspeed_precision(ds_config)
    project = ProjectConfiguration(project_dir=recipe.output.dir, logging_dir=str(Path(recipe.output.dir) / "runs"))
    with launcher_environment_reconciled(recipe):
        plugin = DeepSpeedPlugin(hf_ds_config=ds_config) if use_deepspeed else None
        return Accelerator(
            mixed_precision=_MIXED_PRECISION[train.precision],
            gradient_accumulation_steps=train.gradient_accumulation_steps,
            deepspeed_plugin=plugin,
            # FSDP2 on CPU: without `cpu` Accelerate calls a torchrun launch of N CPU processes DistributedType.NO,
            # whose wait_for_everyone / gather are no-ops (DeepSpeed's type covers its own runs)
            cpu=parallel.backend == "fsdp2" and not torch.cuda.is_available(),
            kwargs_handlers=kwargs_handlers,
            project_config=project,
            log_with=log_with,
        )


def check_fp8_supported() -> None:
    """Refuse `train.precision: fp8` by name where this machine cannot run it — never silently another precision."""
    from neox_hf.hardware import fp8_unsupported_reason

    why = fp8_unsupported_reason()
    if why is not None:
        raise RecipeError(f"`train.precision: fp8` cannot run here: {why}; use `train.precision: bf16` (or fp32)")


def fp8_recipe_arguments(train: TrainConfig) -> dict:
    """The arguments of accelerate's Transformer Engine FP8 recipe (`TERecipeKwargs`) from `train.fp8`, every field
    given: TERecipeKwargs would otherwise read ACCELERATE_FP8_* environment variables, and settings come from the
    recipe only. (TERecipeKwargs itself can be built only where Transformer Engine is installed.)"""
    fp8 = train.fp8
    return dict(use_autocast_during_eval=False, margin=fp8.margin, interval=1, fp8_format=fp8.format,
                amax_history_len=fp8.amax_history_len, amax_compute_algo=fp8.amax_compute_algo,
                override_linear_precision=(False, False, not fp8.wgrad), use_mxfp8_block_scaling=False)


def process_group_kwargs(parallel: ParallelConfig, *, distributed: bool) -> InitProcessGroupKwargs:
    """The recipe's collective timeout, always passed (without it NCCL waits 10 minutes and DeepSpeed's group 30, less
    than rank-0-only work such as a 20B merge or the GPT-NeoX index build), and gloo for a process group on CPU. A
    plain single process keeps Accelerate's default backend: naming gloo there makes Accelerate expect a group."""
    backend = "gloo" if distributed and not torch.cuda.is_available() else "nccl"
    return InitProcessGroupKwargs(backend=backend, timeout=datetime.timedelta(minutes=parallel.timeout_minutes))


def _single_process_environment() -> None:
    """DeepSpeed in a plain `python` process (ZeRO on one rank: offload, or the same engine as a larger run) needs
    the variables a launcher sets; without them its process-group setup fails with a traceback."""
    import socket

    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)


def uses_deepspeed(accelerator: Accelerator) -> bool:
    return accelerator.state.deepspeed_plugin is not None
