"""Run-level guards: what a training run checks before it builds anything, and at every step, so a mistake costs
seconds instead of a run.

Each function is called from `train()` / the step loop with plain values and raises a `NeoXHFError` subclass (one
line naming the problem and the fix) or returns what the loop needs:

- `claim_output_dir`: a non-empty `output.dir` is refused unless the run resumes (`--resume`) or replaces it
  (`--overwrite`); a lock file stops a second run on the same folder and names the holder.
- `check_before_build`: every setting that can be checked without the model (precision, paths, data sources,
  `from_pretrained`) is, before minutes are spent building it.
- `global_batch_change_note`: a resume under another global batch says what that changes.
- `check_finite(step, loss, grad_norm)`: a non-finite loss or gradient norm stops the run before anything of that
  step is logged or saved.
- `OverflowGuard`: fp16 overflow-skipped steps go on, a loss scale at its floor or too many skips in a row stop.
- `check_skipped_documents`: undecodable documents are reported, and fail the run above
  `data.max_skipped_fraction`.

Gap filled: Accelerate and transformers leave all of this to the script (`Trainer`'s `overwrite_output_dir` only
guards `resume_from_checkpoint`; nothing stops a run on NaN).
"""

from __future__ import annotations

import datetime
import math
import os
import shutil
import socket
from pathlib import Path

from neox_hf.errors import CheckpointError, DataError, LaunchError, NeoXHFError, RecipeError, TrainingDiverged
from neox_hf.io import remove_stale_staging
from neox_hf.recipe import Recipe
from neox_hf.checkpoint.run_log import RUN_STATE

LOCK_NAME = ".neox_hf.lock"
# What a run writes besides the model files (`--overwrite` removes these, nothing else of the folder).


# ----------------------------------------------------------------------------------------------------------------
# The output folder: refusal, overwrite, lock
# ----------------------------------------------------------------------------------------------------------------


def check_output_dir(output_dir, *, resume: bool, overwrite: bool) -> None:
    """Refuse to train into a folder that already holds something, unless resuming or told to overwrite."""
    folder = Path(output_dir)
    if folder.exists() and not folder.is_dir():
        raise RecipeError(f"`output.dir` {folder} is a file, not a folder; choose another `--output.dir`")
    if resume or overwrite or not folder.is_dir():
        return
    contents = sorted(p.name for p in folder.iterdir() if p.name != LOCK_NAME)
    if contents:
        shown = ", ".join(contents[:4]) + (", …" if len(contents) > 4 else "")
        raise RecipeError(
            f"`output.dir` {folder} is not empty ({shown}): continue that run with --resume, replace it with "
            "--overwrite, or choose another `--output.dir`"
        )


def clear_previous_run(output_dir) -> list[str]:
    """`--overwrite`: remove what an earlier run wrote (model files, checkpoints, step copies, logs); other files of
    the folder are left alone. Returns the names removed."""
    from neox_hf.hub.push import model_folder_files

    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    names = [name for name in RUN_STATE if (folder / name).exists()]
    names += sorted({name.split("/")[0] for name in model_folder_files(folder)})  # plots/… → plots
    for name in names:
        path = folder / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return names


class RunLock:
    """An exclusive lock on `output.dir` for the life of a run (an OS file lock: released even when the process is
    killed). A second run on the folder is refused with the holder's host, process id and start time."""

    def __init__(self, output_dir):
        self.path = Path(output_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        import fcntl

        folder = self.path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as err:
            raise RecipeError(f"`output.dir` {folder} cannot be written ({err.strerror}); choose a folder you can "
                              "write with --output.dir") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.read(fd, 1024).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RecipeError(f"`output.dir` {folder} is in use by another run ({holder}); wait for it to finish, or "
                              "choose another --output.dir") from err
        os.ftruncate(fd, 0)
        stamp = datetime.datetime.now().isoformat(timespec="seconds")
        os.write(fd, f"host {socket.gethostname()}, pid {os.getpid()}, started {stamp}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        import fcntl

        self.path.unlink(missing_ok=True)  # while still holding it, so no other run's lock file is removed
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def claim_output_dir(recipe: Recipe, *, overwrite: bool = False, is_main_process: bool | None = None) -> RunLock | None:
    """Check `output.dir` (every rank, so all refuse together), then on the main process lock it and, with
    `overwrite`, clear the previous run. Returns the lock to release at the end (None on other ranks).

    Called before the Accelerator exists, so the main process is read from the launcher's RANK (creating accelerate's
    PartialState here would set up the process group before the recipe's backend is chosen)."""
    check_output_dir(recipe.output.dir, resume=recipe.train.resume is not None, overwrite=overwrite)
    if is_main_process is None:
        is_main_process = int(os.environ.get("RANK", "0")) == 0
    if not is_main_process:
        return None
    lock = RunLock(recipe.output.dir).acquire()
    try:
        if overwrite:
            clear_previous_run(recipe.output.dir)
        remove_stale_staging(recipe.output.dir)  # what a run killed mid-save left; nothing else writes here now
    except BaseException:
        lock.release()
        raise
    return lock


# ----------------------------------------------------------------------------------------------------------------
# Settings checked before the model is built
# ----------------------------------------------------------------------------------------------------------------


def check_before_build(recipe: Recipe) -> None:
    """Everything checkable without the model: precision on this machine, the pretrained folder, data sources."""
    check_precision(recipe)
    check_from_pretrained(recipe.model.from_pretrained)
    check_resume_matches_recipe(recipe)  # before the data: a resume under another objective names that, not the data
    check_data_sources(recipe)
    check_hub_token(recipe)
    check_resume_path(recipe)
    check_resume_step_before_build(recipe)
    check_loss_kernel(recipe)
    check_layout_before_build(recipe)


def check_layout_before_build(recipe: Recipe, *, world_size: int | None = None, device_type: str | None = None) -> None:
    """What the engines would refuse only once the model is built (minutes for a real one), decided here from the
    recipe, the pretrained folder's config.json, the launch's process count and this machine's device: the
    optimizer's library and device, the folder's model family, FSDP2's tied embeddings and HSDP replicas, a frozen
    reference under a sharded layout, the pipeline's partition. The engines keep their own checks (a run built
    another way still meets them); these say the same thing first."""
    import torch

    from neox_hf.engines.optimizer import check_optimizer_runs_here
    from neox_hf.finetune import check_peft_recipe
    from neox_hf.parallel.layout import launch_world_size, required_model_parallel

    world = launch_world_size() if world_size is None else world_size
    device = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    check_optimizer_runs_here(recipe.train.optimizer, device)
    check_peft_recipe(recipe)
    config = model_config_before_build(recipe)
    check_tensor_parallel_before_build(recipe, config)
    check_fsdp2_before_build(recipe, config, world // required_model_parallel(recipe.parallel) or 1)
    check_reference_before_build(recipe)
    check_pipeline_before_build(recipe, config)


def model_config_before_build(recipe: Recipe):
    """The transformers config the run will build: the local `model.from_pretrained` folder's, or the recipe's
    (its vocabulary a placeholder: the tokenizer sets it); None for a Hub id or an unreadable config.json (the
    load reads and reports those)."""
    if recipe.model.from_pretrained:
        return pretrained_config(recipe.model.from_pretrained)
    from neox_hf.model.spec import config_from_recipe

    m = recipe.model
    try:
        return config_from_recipe(m, vocab_size=m.vocab_size or m.make_vocab_size_divisible_by, bos_token_id=None,
                                  eos_token_id=None, pad_token_id=None)
    except NeoXHFError:
        raise
    except Exception:  # noqa: BLE001 — what a pre-check cannot decide, the build reports as it did
        return None


def check_tensor_parallel_before_build(recipe: Recipe, config) -> None:
    """`parallel.tensor_parallel` must divide the attention heads, key/value heads and MLP width of the model to be
    built (a pretrained folder's are not the recipe's), as `check_tp_divisibility` says once it is built."""
    tp = recipe.parallel.tensor_parallel
    if tp == 1 or config is None:
        return
    where = f"{Path(recipe.model.from_pretrained) / 'config.json'}" if recipe.model.from_pretrained else "the model"
    heads = config.num_attention_heads
    sizes = {"num_attention_heads": heads,
             "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
             "intermediate_size": config.intermediate_size}
    for name, size in sizes.items():
        if size % tp:
            choices = [k for k in range(1, size + 1) if size % k == 0]
            raise RecipeError(f"`parallel.tensor_parallel: {tp}` does not divide {name} {size} of {where}: each rank "
                              f"holds whole heads and an equal MLP slice; choose tensor_parallel from {choices}")


def pretrained_config(path: str | None):
    """The transformers config of a local `model.from_pretrained` folder, by its registered family (a model_type
    neox_hf does not train is refused here, naming the families it does); None from scratch or for a Hub id (read
    when the model is), or where config.json cannot be read (the load says why)."""
    import json

    if not path or not (Path(path).expanduser() / "config.json").is_file():
        return None
    folder = Path(path).expanduser()
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        return None
    from neox_hf.model.spec import config_class_for_folder, spec_for_model_type

    spec_for_model_type(raw["model_type"], where=f"`model.from_pretrained` {folder}")
    try:
        return config_class_for_folder(str(folder)).from_pretrained(str(folder))  # the class the build reads it with
    except Exception:  # noqa: BLE001 — a config transformers cannot read: the load reports it, as before
        return None


def check_fsdp2_before_build(recipe: Recipe, config, data_parallel: int) -> None:
    """`parallel.backend: fsdp2`: tied input and output embeddings (the recipe's, or the folder's config.json), and
    `dp_replicate` HSDP replicas that do not divide this launch's data-parallel processes."""
    from neox_hf.parallel.layout import required_model_parallel

    p = recipe.parallel
    if p.backend != "fsdp2":
        return
    tied = config is not None and config.tie_word_embeddings
    if tied and recipe.train.objective != "rm":  # a reward model's score head is not the embedding
        where = f"{recipe.model.from_pretrained}'s config.json" if recipe.model.from_pretrained else "the recipe"
        raise RecipeError(f"tied input and output embeddings ({where}: tie_word_embeddings true) with "
                          "`parallel.backend: fsdp2` are refused: the head is sharded as its own group for the fused "
                          "loss; set `model.tie_word_embeddings: false` or use `parallel.backend: deepspeed`")
    if data_parallel % p.dp_replicate:
        raise LaunchError(f"`parallel.dp_replicate: {p.dp_replicate}` must divide the {data_parallel} data-parallel "
                          f"processes of this launch (HSDP: replicas × shards); launch a multiple of "
                          f"{p.dp_replicate * required_model_parallel(p)} processes, or lower `parallel.dp_replicate`")


def check_reference_before_build(recipe: Recipe) -> None:
    """DPO's frozen reference and KTO's keep a whole copy of the model on every rank: refused under tensor
    parallelism, pipelines and ZeRO-3 (`train.preference.frozen_reference` calls it again once the model exists); a
    precomputed DPO reference is the starting model (`with_reference_logps` refuses another after the build)."""
    t, p = recipe.train, recipe.parallel
    kto = t.objective == "kto"
    if t.objective == "dpo" and t.dpo_reference == "precompute" and t.dpo_reference_model \
            and t.dpo_reference_model != recipe.model.from_pretrained:  # `with_reference_logps` refuses it after
        raise RecipeError("`train.dpo_reference_model` differing from `model.from_pretrained` is not supported yet: "
                          "the reference is the starting model; set `model.from_pretrained` to the reference (SFT) "
                          "folder")
    if not kto and (t.objective != "dpo" or t.dpo_reference != "frozen"):
        return
    if p.tensor_parallel > 1 or p.pipeline_parallel > 1 or p.zero_stage == 3:
        if kto:
            raise RecipeError("`train.objective: kto` keeps a frozen copy of the starting model on every rank as its "
                              "reference, which tensor parallelism and ZeRO-3 do not shard; use ZeRO-1/2 or one "
                              "process")
        raise RecipeError("`train.dpo_reference: frozen` keeps a whole copy of the model on every rank; with tensor "
                          "parallelism or ZeRO-3 use `train.dpo_reference: precompute` (the default)")
    if t.dpo_reference_model and not kto:
        raise RecipeError("`train.dpo_reference_model` is read by `train.dpo_reference: precompute`; a frozen "
                          "reference is the starting model (model.from_pretrained)")


def check_pipeline_before_build(recipe: Recipe, config) -> None:
    """Pipeline stages: a pretrained folder they can read layer by layer (safetensors), and a
    `pipe_partition_method` that gives every stage a layer, from the model's config (no weights)."""
    p, m = recipe.parallel, recipe.model
    if p.pipeline_parallel == 1:
        return
    if m.from_pretrained and Path(m.from_pretrained).expanduser().is_dir() and not any(
            (Path(m.from_pretrained).expanduser() / name).is_file()
            for name in ("model.safetensors", "model.safetensors.index.json")):
        raise CheckpointError(f"`model.from_pretrained: {m.from_pretrained}`: pipeline stages read their layers from a "
                              "local safetensors folder (model.safetensors or model.safetensors.index.json); download "
                              "or re-save it with save_pretrained(safe_serialization=True) first")
    if config is None:
        return
    from neox_hf.engines.pipeline.partition import partition_stages

    try:
        partition_stages(config, p.pipeline_parallel, p.pipe_partition_method)
    except NeoXHFError:
        raise
    except Exception:  # noqa: BLE001 — what a pre-check cannot decide, the pipeline engine reports as it did
        return


def check_loss_kernel(recipe: Recipe) -> None:
    """A library loss kernel named by `train.loss_kernel` that cannot run on this machine's device or layout."""
    import torch

    from neox_hf.ops.library_loss import loss_kernel

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loss_kernel(recipe.train, device, recipe.parallel.tensor_parallel)


def _first_sentence(err: Exception) -> str:
    return " ".join(str(err).split()).split(". ")[0].rstrip(".")


def check_resume_step(step: int, train_iters: int, checkpoint) -> None:
    """A checkpoint already past `train.train_iters` would train nothing and save its longer model under a recipe
    that says the shorter run."""
    if step > train_iters:
        raise RecipeError(f"the checkpoint {checkpoint} is at step {step}, past `train.train_iters` {train_iters}: "
                          f"pass `--train.train_iters {step}` or more to continue it, or start a new run in another "
                          "--output.dir")


def check_resume_step_before_build(recipe: Recipe) -> None:
    """`check_resume_step` from the checkpoint's recorded step (rank 0's trainer state, no tensor of the model), so a
    checkpoint past `train.train_iters` is refused before the model is built; an unreadable state is left to the
    resume, which names the file."""
    from neox_hf.checkpoint import resume_candidate
    from neox_hf.io import load_torch_safely

    folder = resume_candidate(recipe.train.resume, recipe.output.dir)
    if folder is None:
        return
    try:
        step = load_torch_safely(folder / "trainer_state_rank0.pt")["train_state"]["step"]
    except Exception:  # noqa: BLE001 — missing or damaged: `load_checkpoint` reports it, naming the file
        return
    if isinstance(step, int):
        check_resume_step(step, recipe.train.train_iters, folder)


def check_resume_path(recipe: Recipe) -> None:
    """An explicit `train.resume` path must be a checkpoint now (`auto` may find none: the run starts at step 0)."""
    from neox_hf.checkpoint import find_resume_checkpoint

    if recipe.train.resume not in (None, "auto"):
        find_resume_checkpoint(recipe.train.resume, recipe.output.dir, notify=lambda message: None)


def check_resume_matches_recipe(recipe: Recipe) -> None:
    """A checkpoint resumed under a recipe that builds another kind of model is refused saying which setting: a
    LoRA checkpoint without the `peft` section (its weights are the adapter-wrapped model's, so the load named a
    missing `gpt_neox.embed_in.weight`), or another `train.objective` (the data position and the model's head are
    that objective's)."""
    from neox_hf.checkpoint import checkpoint_lora, checkpoint_objective, resume_candidate

    folder = resume_candidate(recipe.train.resume, recipe.output.dir)
    if folder is None:
        return
    restart = "or start a new run in another output.dir"
    lora = checkpoint_lora(folder)
    if lora is not None and recipe.peft.method is None:
        targets = ", ".join(lora["target_modules"])
        raise RecipeError(f"{folder} is a LoRA checkpoint (rank-{lora['r']} adapters on {targets}) and the recipe has "
                          f"no `peft` section: resume with the same `peft` settings it was trained with (`--peft.method "
                          f"lora --peft.r {lora['r']} --peft.target_modules [{targets}]`, its alpha and dropout too; "
                          f"{Path(recipe.output.dir) / 'recipe.yaml'} holds them if the run finished), {restart}")
    objective = checkpoint_objective(folder)
    if objective is not None and objective != recipe.train.objective:
        raise RecipeError(f"{folder} was trained with `train.objective: {objective}` and this run has "
                          f"`train.objective: {recipe.train.objective}`: resume with `--train.objective {objective}` "
                          f"(and the data it was trained on), {restart} (export this checkpoint with `neox_hf export` "
                          "and start from it with `model.from_pretrained`)")


def global_batch_change_note(state, train, data_parallel: int) -> str | None:
    """The note for a resume whose global batch (samples per optimizer step: micro × accumulation × data-parallel)
    is not the checkpoint's, naming both and what the change does; None when it is the same or the checkpoint
    recorded none. The LR schedule counts steps, so it continues at the checkpoint's step and its remaining steps see
    another number of samples; the data continues after the samples already trained. Gap filled: GPT-NeoX
    (iteration-based schedule, consumed-samples data position) and accelerate accept the change without a word."""
    saved = state.global_batch
    now = train.micro_batch_size * train.gradient_accumulation_steps * data_parallel
    if saved is None or saved == now or state.step == 0:
        return None
    left = max(train.train_iters - state.step, 0)
    return (f"the global batch changes from the checkpoint's {saved} to {now} samples per step (micro "
            f"{train.micro_batch_size} × accumulation {train.gradient_accumulation_steps} × {data_parallel} "
            f"data-parallel): the LR schedule continues at step {state.step} of {train.train_iters} (it counts steps: "
            f"its {left} remaining steps train {left * now} samples where {left * saved} were planned), and the data "
            f"continues after the {state.consumed_samples} samples already trained, {now} per step")


def check_hub_token(recipe: Recipe) -> None:
    """`train.push_to_hub` with a malformed repo id or without a token would train, then fail every push: say so
    now (the id is checked with huggingface_hub's own rule)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    from neox_hf.hub.push import LOGIN_FIX, has_token

    if recipe.train.push_to_hub is None:
        return
    repo_id = recipe.train.push_to_hub.repo_id
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise RecipeError(f"`train.push_to_hub.repo_id` {repo_id!r} is not a Hub repository id ({_first_sentence(err)}); "
                          "write it as owner/name, e.g. my-org/pythia-tiny") from err
    if not has_token():
        raise RecipeError(f"`train.push_to_hub` is set but no Hugging Face token is configured; {LOGIN_FIX}, or "
                          "drop `train.push_to_hub`")


def check_precision(recipe: Recipe, *, cuda_available: bool | None = None) -> None:
    """Without DeepSpeed, fp16 needs torch's CUDA autocast and GradScaler; on CPU Accelerate would silently train
    fp32 while the run reports fp16."""
    import torch

    from neox_hf.parallel.accelerator import wants_deepspeed

    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if recipe.train.precision == "fp16" and not cuda and not wants_deepspeed(recipe.parallel):
        raise RecipeError(
            "`train.precision: fp16` without DeepSpeed needs a GPU (on CPU it would train in fp32); use "
            "`--train.precision bf16` or `fp32` here, or launch with DeepSpeed (`--parallel.zero_stage 1`)"
        )


def check_from_pretrained(path: str | None) -> None:
    """A local `model.from_pretrained` folder must exist and hold a config; a Hub id (`org/name`) is left to the Hub."""
    if not path:
        return
    folder = Path(path).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise RecipeError(f"`model.from_pretrained` {folder} has no config.json: give a folder save_pretrained "
                              "wrote (a finished run's output.dir) or a Hub model id")
        return
    looks_like_hub_id = path.count("/") == 1 and not path.startswith((".", "/", "~")) and not folder.exists()
    if not looks_like_hub_id:
        raise RecipeError(f"`model.from_pretrained` {path} not found: give an existing model folder or a Hub model "
                          "id such as EleutherAI/pythia-70m")
    if _hub_offline():
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(path, "config.json"), str):
            raise RecipeError(f"`model.from_pretrained` {path} is not in the local Hub cache and HF_HUB_OFFLINE is set; "
                              "download it first (`hf download` with network) or give a local folder")


def _hub_offline() -> bool:
    return any(os.environ.get(name, "").lower() in ("1", "true", "yes") for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def check_data_sources(recipe: Recipe) -> None:
    """Every local source resolves to files (or a .bin/.idx pair) now, not after the model is built; compressed files
    are whole and line-based sources hold a line (`check_sources`)."""
    from neox_hf.data.sources import check_sources, resolve_files, source_format

    if not recipe.data.sources:
        raise DataError("`data.sources` is empty: give at least one source, e.g. "
                        "`--data.sources '[{path: examples/data/tinyshakespeare.txt}]'`")
    for source in recipe.data.sources + recipe.data.validation:
        fmt = source_format(source)
        if fmt not in ("hub", "indexed"):
            files = resolve_files(source)
            if fmt == "parquet":
                _check_parquet_files(files)
    check_sources(recipe.data.sources + recipe.data.validation)


def _check_parquet_files(files) -> None:
    """A Parquet file starts and ends with the magic bytes PAR1; pyarrow's own error for one that does not (a JSONL
    file given `format: parquet`, a truncated download) is a traceback from inside `datasets`."""
    for path in files:
        with open(path, "rb") as f:
            head = f.read(4)
            f.seek(max(os.path.getsize(path) - 4, 0))
            tail = f.read(4)
        if head != b"PAR1" or tail != b"PAR1":
            where = "start" if head != b"PAR1" else "end: truncated?"
            raise DataError(f"{path} is not a Parquet file (no PAR1 magic bytes at its {where}); give its real "
                            "`format` (jsonl, json, text) or a complete Parquet file")


# ----------------------------------------------------------------------------------------------------------------
# Every step
# ----------------------------------------------------------------------------------------------------------------


def check_finite(step: int, loss: float, grad_norm: float | None = None, *, output_dir=None) -> None:
    """Stop the run when the loss or the gradient norm of `step` is NaN or infinite (the weights are no longer
    usable): raise before the step is logged or saved, naming the step and the last good checkpoint."""
    bad = [f"{name} {value}" for name, value in (("loss", loss), ("gradient norm", grad_norm))
           if value is not None and not math.isfinite(float(value))]
    if not bad:
        return
    where = _last_checkpoint_text(output_dir)
    raise TrainingDiverged(
        f"training diverged at step {step} ({', '.join(bad)}); nothing of this step was saved{where}. Lower "
        "`train.lr` (or raise `train.warmup` / set `train.clip_grad`) and start again, or --resume from the checkpoint"
    )


class OverflowGuard:
    """fp16 dynamic loss scaling: an overflow-skipped step is normal (no update, LR held, as in GPT-NeoX), a run that
    keeps skipping is not. Stops, naming the step, when a skip leaves the loss scale at its floor (the gradients
    overflow however small the scale: DeepSpeed would raise a bare "Current loss scale already at minimum" at the
    next overflow) or when more than `max_in_a_row` steps in a row were skipped. Every pending step is written to
    `train_log.jsonl` first (`flush`), so the log shows what led there."""

    def __init__(self, max_in_a_row: int, floor: float | None, *, output_dir=None):
        self.max_in_a_row, self.floor, self.output_dir = max_in_a_row, floor, output_dir
        self.in_a_row = 0

    def after_step(self, step: int, skipped: bool, loss_scale: float | None, flush=lambda: None) -> None:
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        at_floor = self.floor is not None and loss_scale is not None and loss_scale <= self.floor
        if not at_floor and self.in_a_row <= self.max_in_a_row:
            return
        flush()
        if at_floor:
            why = f"the fp16 loss scale fell to its floor ({self.floor:g}) at step {step}"
        else:
            why = (f"step {step} was the {self.in_a_row}th fp16 overflow-skipped step in a row (more than "
                   f"`train.max_skipped_steps_in_a_row` {self.max_in_a_row})")
        raise TrainingDiverged(
            f"{why}: the gradients overflow fp16 at every loss scale, so the model no longer trains; nothing was "
            f"updated on those steps{_last_checkpoint_text(self.output_dir)}. Train in bf16 (`--train.precision "
            "bf16`), or lower `train.lr` and --resume from the checkpoint"
        )


def _last_checkpoint_text(output_dir) -> str:
    if output_dir is None:
        return ""
    pointer = Path(output_dir) / "checkpoints" / "latest"
    if pointer.is_file():
        return f"; the last good checkpoint is {pointer.parent / pointer.read_text().strip()}"
    return "; there is no checkpoint yet"


def check_skipped_documents(stats: dict, max_fraction: float) -> str | None:
    """A line reporting undecodable documents (invalid JSON, a missing or non-string text field) seen so far, or
    None when there are none; raises DataError when they exceed `max_fraction` of the documents read."""
    skipped = int(stats.get("skipped_undecodable", 0))
    if not skipped:
        return None
    read = skipped + int(stats.get("documents", 0))
    fraction = skipped / max(read, 1)
    line = (f"{skipped} of {read} documents skipped as undecodable (invalid JSON, or the text field missing or not a "
            "string)")
    if fraction > max_fraction:
        raise DataError(f"{line}: {fraction:.1%} is above `data.max_skipped_fraction` ({max_fraction:g}); fix the "
                        "data or `text_key` / `template`, or raise `data.max_skipped_fraction` to accept it")
    return line
