"""The training loop: recipe → tokenizer, model, data, layout → steps → resumable checkpoints → HF folder.

Read top to bottom: `train(recipe)` is the whole run, `run_steps` the loop. Distribution lives behind
`neox_hf.parallel` (layout, parallelize, full state dict); forward/backward/optimizer behind `train_step`; each
thing that happens between steps (logging, eval, checkpoints, Hub pushes) owns its interval and policy below.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from neox_hf.data import DataNotes, gpt_neox_num_epochs, tokens_per_epoch
from neox_hf.finetune import check_peft_recipe, save_finetuned, trainable_parameters_report, wrap_with_peft
from neox_hf.model.folder import save_hf_folder
from neox_hf.data.tokenizer import load_tokenizer
from neox_hf.parallel import init_distributed
from neox_hf.plot import model_card_section, write_run_plot
from neox_hf.recipe import Recipe, settled
from neox_hf.trackers import init_tracker_kwargs, tracker_names
from neox_hf.checkpoint import TrainState, find_resume_checkpoint, load_checkpoint, save_checkpoint
from neox_hf.checkpoint.background import BackgroundWrites, check_host_memory
from neox_hf.train.guards import (
    OverflowGuard,
    check_before_build,
    check_finite,
    check_resume_step,
    check_skipped_documents,
    claim_output_dir,
    global_batch_change_note,
)
from neox_hf.hardware import Peak, device_peak
from neox_hf.train.mfu import flops_per_token, mfu
from neox_hf.train.prefetch import Prefetcher, pinned, workers_for
from neox_hf.checkpoint.run_log import RECIPE_NAME, append_step_entries, record_evaluation, truncate_train_log
from neox_hf.train.preemption import Preempted, StopRequest
from neox_hf.train.routing import MOE_METRICS, moe_startup_lines, with_routing_metrics
from neox_hf.train.schedule import build_lr_scheduler
from neox_hf.engines import build_engine
from neox_hf.ops.library_loss import describe as describe_loss_kernel
from neox_hf.train.preference import build_data, frozen_reference, with_reference_logps
from neox_hf.parallel.layout import StepResult, dp_sum


@dataclass
class RunResult:
    output_dir: Path
    steps: int
    train_losses: list[float]  # the loss of every optimizer step (token-weighted over micro-batches and ranks)
    eval_losses: list[tuple[int, float]]  # (step, loss)
    final_eval_loss: float | None


def train(recipe: Recipe, *, notices: list[str] | None = None, overwrite: bool = False,
          startup_warnings=None) -> RunResult:
    """Run the recipe end to end; return where the model went and the losses seen.

    Before anything is built: the settings checkable without a model, and `output.dir` (refused when it holds an
    earlier run, unless resuming or `overwrite`; locked for the run). `startup_warnings(recipe, layout)`, where
    given, returns lines printed before the model is built (the entry point passes `neox_hf.plan`'s memory check:
    an out-of-memory would come later)."""
    if recipe.train.precision == "auto":  # built in Python, not by recipe_from_dict: settle a copy
        recipe = settled(copy.deepcopy(recipe))
    check_before_build(recipe)
    lock = claim_output_dir(recipe, overwrite=overwrite)
    try:
        return _train(recipe, notices, startup_warnings)
    finally:
        if lock is not None:
            lock.release()


def _train(recipe: Recipe, notices: list[str] | None, startup_warnings=None) -> RunResult:
    notices = [*(notices or []), *getattr(recipe, "settled_notices", [])]
    run, state = build_run(recipe, startup_warnings)
    accelerator, tokenizer, model = run.accelerator, run.tokenizer, run.model
    if accelerator.is_main_process:
        accelerator.print(startup_report(run, notices))
    if tracker_names(recipe):
        accelerator.init_trackers(**init_tracker_kwargs(recipe))  # the resolved recipe, secrets redacted
    history = History()
    if run.has_eval and state.step == 0:
        history.eval_losses.append((0, evaluate(run)))
        accelerator.print(f"step 0: eval loss {history.eval_losses[-1][1]:.4f}")
        record_evaluation(accelerator, recipe.output.dir, 0, history.eval_losses[-1][1], {},
                      perplexity=recipe.train.objective == "lm")
    try:
        run_steps(run, state, history)
    except Preempted:
        for tracker in accelerator.trackers:  # they write what they buffered; the process group stays for main's exit
            tracker.finish()
        raise
    final_eval = evaluate(run) if run.has_eval else None
    if final_eval is not None:
        history.eval_losses.append((state.step, final_eval))
        perplexity = f"  perplexity {math.exp(min(final_eval, 50)):.2f}" if recipe.train.objective == "lm" else ""
        accelerator.print(f"final eval loss {final_eval:.4f}{perplexity}")
    record_evaluation(accelerator, recipe.output.dir, state.step, final_eval, eval_task_scores(run),
                      perplexity=recipe.train.objective == "lm")
    # FSDP2's adapter comes from its gathered DTensors (Accelerate's get_state_dict would hand peft the shards)
    gathered = run.engine.full_state_dict() if recipe.peft.method and not run.engine.reads_accelerate_checkpoint \
        else None
    out = (save_finetuned(accelerator, model, tokenizer, recipe, state_dict=gathered)
           if recipe.peft.method else save_final_model(run))
    if accelerator.is_main_process:
        write_run_plot(recipe.output.dir)
        _write_card(run, state, final_eval, Path(recipe.output.dir))
        if run.pusher is not None:
            run.pusher.push_final(recipe.output.dir)
            run.pusher.close()  # waits for every queued upload; re-raises the first failure
    accelerator.end_training()
    accelerator.print(f"model saved to {out.resolve()}")
    return RunResult(out, state.step, history.train_losses, history.eval_losses, final_eval)


def build_run(recipe: Recipe, startup_warnings=None) -> tuple["TrainingRun", TrainState]:
    """Everything `train` builds before its first step (distributed set-up, model, optimizer, data, the resumed
    state): the run and the state it starts from. Also the entry of `benchmarks/checkpoint_save.py`, which times
    saves of exactly the run a launch trains."""
    accelerator, layout = init_distributed(recipe, log_with=tracker_names(recipe) or None)
    _set_seed(recipe.train.seed)
    check_peft_recipe(recipe)
    tokenizer = load_tokenizer(recipe.tokenizer.path, eos_token=recipe.tokenizer.eos_token, pad_token=recipe.tokenizer.pad_token)
    engine = build_engine(recipe, accelerator, layout)
    for warning in startup_warnings(recipe, layout) if startup_warnings else ():
        accelerator.print(warning)
    model = engine.build_model(tokenizer)
    if recipe.peft.method is not None:
        model = wrap_with_peft(model, recipe.peft)  # before prepare: only adapter weights reach the optimizer
        accelerator.print(trainable_parameters_report(model))
    reference = frozen_reference(recipe, model, layout, accelerator.device)  # DPO's frozen copy, if asked for
    model, optimizer = engine.parallelize(model)
    if reference is not None:
        engine.objective.reference_model = reference
    t = recipe.train
    data_args = dict(seq_length=recipe.model.seq_length, micro_batch_size=t.micro_batch_size, dp_rank=layout.dp_rank,
                     dp_size=layout.dp, gradient_accumulation_steps=t.gradient_accumulation_steps,
                     train_iters=t.train_iters, eval_interval=t.eval_interval, eval_iters=t.eval_iters)
    loader, eval_batches = build_data(recipe, tokenizer, layout, data_args)
    # DPO's reference log-probabilities come from the starting model: before a checkpoint replaces its weights.
    loader, eval_batches = with_reference_logps(engine, loader, eval_batches)
    scheduler = build_lr_scheduler(optimizer, recipe.train)
    state = TrainState()
    resume_from = find_resume_checkpoint(recipe.train.resume, recipe.output.dir,
                                         notify=lambda message: accelerator.print(f"note: {message}"))
    if resume_from is not None:
        state = load_checkpoint(accelerator, resume_from, scheduler=scheduler, data_loader=loader,
                                engine=_layout_free_engine(engine, recipe))
        check_resume_step(state.step, recipe.train.train_iters, resume_from)
        accelerator.print(f"resumed from {resume_from} at step {state.step}")
    batch_note = global_batch_change_note(state, t, layout.dp)  # a resume under another global batch
    if batch_note:
        accelerator.print(f"note: {batch_note}")
    state.global_batch = t.micro_batch_size * t.gradient_accumulation_steps * layout.dp  # for the next resume's note
    if recipe.train.resume is not None and accelerator.is_main_process:
        truncate_train_log(recipe.output.dir, state.step)  # steps after the resume point are redone
    run = TrainingRun(accelerator, recipe, model, optimizer, scheduler, loader, eval_batches, tokenizer, layout,
                      _hub_pusher(recipe) if accelerator.is_main_process else None, engine=engine)
    return run, state


def _set_seed(seed: int) -> None:
    from accelerate.utils import set_seed

    set_seed(seed)


@dataclass
class TrainingRun:
    """Everything the step loop touches, built once by `train` (or by a test harness)."""

    accelerator: object
    recipe: Recipe
    model: object
    optimizer: object
    scheduler: object
    loader: object
    eval_batches: list
    tokenizer: object = None
    layout: object = None  # neox_hf.parallel.Layout; None means one process
    pusher: object = None  # HubPusher on the main process when train.push_to_hub is set
    engine: object = None  # neox_hf.engines.Engine; None: the layout's engine around model and optimizer
    loader_position: object = None  # set by run_steps: the prefetcher, whose state is the last consumed batch's
    checkpoint_writes: object = None  # set by run_steps under train.async_checkpoint: neox_hf.checkpoint.background
    has_eval: bool = field(init=False, default=False)  # any data-parallel rank has eval batches
    flops_per_token: float | None = field(init=False, default=None)  # model FLOPs (None: not a GPTNeoX config)
    peak: Peak | None = field(init=False, default=None)  # the device peak MFU is measured against

    def __post_init__(self):
        if self.layout is None:
            from neox_hf.parallel import Layout

            self.layout = Layout()
        if self.engine is None:
            self.engine = build_engine(self.recipe, self.accelerator, self.layout, model=self.model,
                                       optimizer=self.optimizer)
        # Evaluation is collective: a rank whose share of a small validation set is empty must still take part,
        # so whether to evaluate is decided over every data-parallel rank, not from this rank's batches.
        count = torch.tensor(len(self.eval_batches or []), device=self.accelerator.device)
        self.has_eval = bool(dp_sum(self.layout, count) > 0)
        config = _model_config(self.accelerator, self.model)
        if config is not None and self.recipe.train.precision in ("fp32", "bf16", "fp16"):
            self.flops_per_token = flops_per_token(config, self.recipe.model.seq_length)
            self.peak = device_peak(self.accelerator.device, self.recipe.train.precision)


def _model_config(accelerator, model):
    """The transformers config of the model being trained (through PEFT and engine wrappers), or None."""
    unwrapped = accelerator.unwrap_model(model)
    if hasattr(unwrapped, "get_base_model"):
        unwrapped = unwrapped.get_base_model()
    config = getattr(unwrapped, "config", None)
    return config if hasattr(config, "num_hidden_layers") else None


@dataclass
class History:
    train_losses: list[float] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------------------


def run_steps(run: TrainingRun, state: TrainState, history: History | None = None) -> History:
    history = history if history is not None else History()
    if run.recipe.train.async_checkpoint and run.checkpoint_writes is None:
        check_host_memory(run.engine.parameter_count(), shards=run.layout.world_size)
        run.checkpoint_writes = BackgroundWrites(pinned=run.accelerator.device.type == "cuda", overlap=True)
    with StopRequest() as stop:  # before the prefetcher: a forked data worker starts with these handlers
        try:
            _run_steps(run, state, history, stop)
        except Preempted:
            _end_background_writes(run, abandon=False)  # the stop's checkpoint is whole before the run exits
            raise
        except BaseException:
            _end_background_writes(run, abandon=True)  # a dead peer would hold the write's collectives
            raise
        _end_background_writes(run, abandon=False)  # the last checkpoint is published before the final save
    return history


def _end_background_writes(run: TrainingRun, *, abandon: bool) -> None:
    """Publish (wait for) or abandon the checkpoint write in flight (`train.async_checkpoint`)."""
    writes, run.checkpoint_writes = run.checkpoint_writes, None
    if writes is None:
        return
    if abandon:
        writes.abandon()
    else:
        writes.close()


def _run_steps(run: TrainingRun, state: TrainState, history: History, stop: StopRequest) -> None:
    t = run.recipe.train
    device = run.accelerator.device.type
    batches = Prefetcher(run.loader, prepare=pinned if device == "cuda" else None,
                         workers=workers_for(run.recipe.data.num_workers, device))
    run.loader_position = batches  # what a checkpoint records: the position of the last batch consumed
    step_log = StepLogger(run, state, history)
    overflows = OverflowGuard(t.max_skipped_steps_in_a_row, run.engine.loss_scale_floor(),
                              output_dir=run.recipe.output.dir)
    progress = tqdm(total=t.train_iters, initial=state.step, disable=not run.accelerator.is_main_process, desc="train")
    run.model.train()
    try:
        while state.step < t.train_iters:
            micro_batches = [_to_device(next(batches), run.accelerator.device) for _ in range(t.gradient_accumulation_steps)]
            result = with_routing_metrics(run, run.engine.train_step(micro_batches))  # MoE: router loss, balance
            scale = run.engine.loss_scale()
            lr = _advance_schedule(run, state, result)
            step_log.record(result, lr, scale, data_wait=batches.take_wait(),
                            seq_length=micro_batches[0].get("curriculum_seq_length"))
            overflows.after_step(state.step, result.skipped, scale, flush=step_log.flush)
            progress.update(1)
            if _due(state.step, t.log_interval) or state.step == t.train_iters:
                progress.set_postfix(step_log.flush())
            signal_name = _stop_agreed(run, state, stop)
            if signal_name is not None:  # before an evaluation: the time left is for the checkpoint
                step_log.flush()
                with step_log.paused():
                    save_checkpoint_of(run, state)
                    _end_background_writes(run, abandon=False)
                raise Preempted(state.step, signal_name)
            if _due(state.step, t.eval_interval) and state.step < t.train_iters and (run.has_eval or t.eval_tasks):
                with step_log.paused():  # tokens/s and MFU leave out the evaluation
                    _eval_and_log(run, state, history)
            if t.save_interval and _due(state.step, t.save_interval):
                step_log.flush()  # the checkpoint's counters must include every step before it
                with step_log.paused():
                    _save_checkpoint_and_push(run, state)
    finally:
        batches.close()
        progress.close()


def _stop_agreed(run: TrainingRun, state: TrainState, stop: StopRequest) -> str | None:
    """The stop signal's name when the ranks agree that one of them received it (see neox_hf.train.preemption).
    Several ranks agree at log steps only, where the host has just waited for the logged losses; one process checks
    at every step."""
    t, world_size = run.recipe.train, run.layout.world_size
    if world_size > 1 and not (_due(state.step, t.log_interval) or state.step == t.train_iters):
        return None
    return stop.agreed(run.accelerator.device, world_size)


def _due(step: int, interval: int | None) -> bool:
    return bool(interval) and step % interval == 0


def _to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def _advance_schedule(run: TrainingRun, state: TrainState, result: StepResult) -> float:
    """Count the step; return the LR it used. GPT-NeoX (through DeepSpeed) holds the LR on an overflow-skipped step."""
    lr = run.scheduler.get_last_lr()[0]
    if result.skipped:
        state.skipped_steps += 1
    else:
        run.scheduler.step()
    state.step += 1
    return lr


class StepLogger:
    """Per-step results stay on the device until a log interval; then one host sync writes every buffered step to
    `train_log.jsonl`, updates the token/sample counters and the trackers."""

    def __init__(self, run: TrainingRun, state: TrainState, history: History):
        self.run, self.state, self.history = run, state, history
        self.pending: list[tuple[int, StepResult, float, float | None, float, int | None]] = []
        self.window_start = time.perf_counter()
        self.window_paused = 0.0  # seconds of the window spent evaluating or saving, not training
        self.reported_skipped = 0  # undecodable documents already reported
        self.data_notes = DataNotes(max_length=run.recipe.data.max_length or run.recipe.model.seq_length)

    def record(self, result: StepResult, lr: float, loss_scale: float | None, data_wait: float,
               seq_length: int | None = None) -> None:
        """Buffer step `state.step`'s result; `loss_scale` is the fp16 scale after the step (None in fp32/bf16)."""
        self.pending.append((self.state.step, result, lr, loss_scale, data_wait, seq_length))

    @contextlib.contextmanager
    def paused(self):
        """Time spent in the block (an evaluation, a save) is left out of the window's tokens/s and MFU. Resetting
        the window's start instead would divide the whole window's tokens by the time after the pause."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.window_paused += time.perf_counter() - start

    def flush(self) -> dict:
        if not self.pending:
            return {}
        accelerator = self.run.accelerator
        objective_metrics = _objective_metrics([r for _, r, *_ in self.pending])
        values = torch.stack([torch.stack([r.loss.double(), r.tokens.double(), r.samples.double(),
                                           (r.grad_norm if r.grad_norm is not None else torch.tensor(float("nan"))).double().to(r.loss.device)])
                              for _, r, *_ in self.pending]).tolist()
        entries = []
        for (step, result, lr, scale, wait, seq_length), (loss, tokens, samples, grad_norm) in zip(self.pending, values):
            # Before anything of this step is logged or saved: a diverged run stops here, naming the step. An fp16
            # step skipped for overflow changed nothing: its infinite gradient norm (or loss) is not a divergence.
            if not result.skipped:
                check_finite(step, loss, None if result.grad_norm is None else grad_norm,
                             output_dir=self.run.recipe.output.dir)
            self.state.consumed_tokens += int(tokens)
            self.state.consumed_samples += int(samples)
            self.history.train_losses.append(loss)
            entries.append(step_log_entry(step, loss, lr, grad_norm if result.grad_norm is not None else None,
                                          skipped=result.skipped, loss_scale=scale, data_wait=wait,
                                          seq_length=seq_length, state=self.state))
            entries[-1].update(objective_metrics.pop(0))
        elapsed = time.perf_counter() - self.window_start - self.window_paused
        window_tokens = sum(v[1] for v in values)
        entries[-1]["tokens_per_s"] = window_tokens / elapsed  # the window's throughput, for the run picture
        if self.run.peak is not None:
            entries[-1]["mfu"] = mfu(window_tokens / elapsed, self.run.flops_per_token, self.run.peak,
                                     self.run.layout.world_size)
        finite_losses = [v[0] for v in values if math.isfinite(v[0])] or [float("nan")]
        metrics = {"train/loss": sum(finite_losses) / len(finite_losses), "train/lr": entries[-1]["lr"],
                   "train/tokens_per_s": window_tokens / elapsed,
                   "train/data_wait_s": sum(e["data_wait_s"] for e in entries)}
        if "mfu" in entries[-1]:
            metrics["train/mfu"] = entries[-1]["mfu"]
        for name in (*self.run.engine.objective.metric_names, *MOE_METRICS):  # TRL's names, e.g. train/rewards/margins
            logged = [e[name] for e in entries if name in e]
            if logged:
                metrics[f"train/{name}"] = sum(logged) / len(logged)
        if accelerator.is_main_process:
            append_step_entries(self.run.recipe.output.dir, entries)
        accelerator.log(metrics, step=self.state.step)
        self.pending, self.window_start, self.window_paused = [], time.perf_counter(), 0.0
        self.reported_skipped = _report_skipped_documents(self.run, self.reported_skipped, self.data_notes)
        return {"loss": f"{metrics['train/loss']:.4f}", "lr": f"{metrics['train/lr']:.2e}"}


def _objective_metrics(results: list[StepResult]) -> list[dict]:
    """Each step's objective metrics (TRL's names for dpo / rm) as floats, read in one host sync; finite only."""
    names = sorted({name for r in results for name in r.metrics})
    if not names:
        return [{} for _ in results]
    values = torch.stack([torch.stack([r.metrics[n].double() for n in names]) for r in results]).tolist()
    return [{n: v for n, v in zip(names, row) if math.isfinite(v)} for row in values]


def step_log_entry(step: int, loss: float, lr: float, grad_norm: float | None, *, skipped: bool,
                   loss_scale: float | None, data_wait: float, seq_length: int | None, state: TrainState) -> dict:
    """One step's `train_log.jsonl` record. Strict JSON: a non-finite value can only come from an fp16 step skipped
    for overflow (anything else stopped the run in `check_finite`), whose gradient norm and loss are then left out
    (`loss: null`); `skipped` and `loss_scale` are recorded on every step of an fp16 run."""
    entry = {"step": step, "loss": loss if math.isfinite(loss) else None, "lr": lr,
             "consumed_samples": state.consumed_samples, "consumed_tokens": state.consumed_tokens,
             "data_wait_s": round(data_wait, 6)}
    if grad_norm is not None and math.isfinite(grad_norm):
        entry["grad_norm"] = grad_norm
    if seq_length is not None:
        entry["curriculum_seq_length"] = seq_length  # GPT-NeoX's seqlen curriculum: this step's length
    if loss_scale is not None:
        entry.update(skipped=skipped, loss_scale=loss_scale)
    return entry


def _report_skipped_documents(run: TrainingRun, reported: int, notes: DataNotes) -> int:
    """Print how many documents were undecodable (summed over ranks) when the count grew, and the data layer's notes
    on documents that trained but not whole (cut to max_length, no answer tokens); fail above
    data.max_skipped_fraction. Returns the undecodable count now reported."""
    stats = getattr(run.loader_position or run.loader, "stats", None)  # as of the last batch the step consumed
    if stats is None:
        return reported
    keys = ("skipped_undecodable", "documents", "truncated", "no_answer")
    local = torch.tensor([stats.get(key, 0) for key in keys], device=run.accelerator.device)
    summed = dict(zip(keys, (int(v) for v in dp_sum(run.layout, local))))
    line = check_skipped_documents(summed, run.recipe.data.max_skipped_fraction)
    if line is not None and summed["skipped_undecodable"] > reported:
        run.accelerator.print(f"note: {line}")
    for note in notes.lines(summed):
        run.accelerator.print(f"note: {note}")
    return summed["skipped_undecodable"]


def _eval_and_log(run: TrainingRun, state: TrainState, history: History) -> None:
    eval_loss = evaluate(run) if run.has_eval else None
    if eval_loss is not None:
        history.eval_losses.append((state.step, eval_loss))
        run.accelerator.print(f"step {state.step}: eval loss {eval_loss:.4f}")
    record_evaluation(run.accelerator, run.recipe.output.dir, state.step, eval_loss, eval_task_scores(run),
                      perplexity=run.recipe.train.objective == "lm")


def eval_task_scores(run: TrainingRun) -> dict[str, float]:
    """lm-evaluation-harness scores of the in-training model (GPT-NeoX's eval_tasks); every rank calls it."""
    if not run.recipe.train.eval_tasks:
        return {}
    from neox_hf.eval_tasks import eval_tasks_in_training

    return eval_tasks_in_training(run.accelerator, run.model, run.tokenizer, run.recipe.train.eval_tasks,
                                  engine=run.engine, batch_size=run.recipe.train.micro_batch_size)


def evaluate(run: TrainingRun) -> float:
    """Token-weighted mean loss over every data-parallel rank's eval batches."""
    run.model.eval()
    loss_sum, tokens = run.engine.eval_sums([_to_device(b, run.accelerator.device) for b in run.eval_batches])[:2].tolist()
    run.model.train()
    return loss_sum / tokens if tokens > 0 else float("nan")


def _layout_free_engine(engine, recipe):
    """The engine whose layout-free state a checkpoint holds; None under PEFT where Accelerate's files hold the state
    (its adapters' names are not the model's: the checkpoint resumes on its own layout only) and for optimizers other
    than Adam's (the layout-free state holds Adam's two moments; Lion's one moment, SGD's momentum and 8-bit states
    are not in it): those checkpoints resume on their own layout only."""
    if recipe.train.optimizer not in ("adamw", "adam"):
        return None
    if recipe.peft.method is not None and engine.reads_accelerate_checkpoint:
        return None
    # FSDP2's checkpoint is its layout-free state alone (under LoRA: the adapters and their Adam moments, the frozen
    # base being rebuilt from the recipe), which an FSDP2 run of the same `peft` settings resumes
    return engine


def _save_checkpoint_and_push(run: TrainingRun, state: TrainState) -> None:
    t = run.recipe.train
    save_checkpoint_of(run, state)
    if t.push_to_hub is not None and t.push_to_hub.revision_per_step and run.recipe.peft.method is None:
        # Pythia convention: an HF folder of step N on branch `step{N}`, uploaded in the background.
        folder = Path(run.recipe.output.dir) / "hub_steps" / f"step{state.step}"
        save_final_model(run, out_dir=folder)
        if run.pusher is not None:
            run.pusher.push_step(folder, state.step)


def save_checkpoint_of(run: TrainingRun, state: TrainState) -> Path:
    """The resumable checkpoint of the run at `state` (collective: every rank calls it)."""
    t = run.recipe.train
    return save_checkpoint(run.accelerator, output_dir=run.recipe.output.dir, state=state, scheduler=run.scheduler,
                           data_loader=run.loader_position or run.loader, keep_last_n=t.keep_last_n,
                           model_config=run.accelerator.unwrap_model(run.model).config, tokenizer=run.tokenizer,
                           precision=t.precision, engine=_layout_free_engine(run.engine, run.recipe),
                           write_layout_free=t.layout_free_checkpoint, background=run.checkpoint_writes)


# ----------------------------------------------------------------------------------------------------------------
# The end of a run
# ----------------------------------------------------------------------------------------------------------------


def save_final_model(run: TrainingRun, out_dir=None) -> Path:
    """Consolidated HF folder (ZeRO-3 partitions gathered, TP shards merged) written by the main process, atomically."""
    accelerator, recipe = run.accelerator, run.recipe
    state_dict = run.engine.full_state_dict()  # collective: every rank calls it
    out = Path(out_dir or recipe.output.dir)
    if accelerator.is_main_process:
        save_hf_folder(accelerator.unwrap_model(run.model), out, state_dict=state_dict, tokenizer=run.tokenizer,
                       extra_files={RECIPE_NAME: recipe.to_yaml()}, max_shard_size=recipe.output.max_shard_size)
    accelerator.wait_for_everyone()
    return out


def _hub_pusher(recipe: Recipe):
    if recipe.train.push_to_hub is None:
        return None
    from neox_hf.hub import HubPusher

    hub = recipe.train.push_to_hub
    # delete_after: hub_steps/step{N} exists only to be uploaded; a failed push keeps it for the retry command.
    return HubPusher(hub.repo_id, private=hub.private, revision_per_step=hub.revision_per_step, delete_after=True)


def _write_card(run: TrainingRun, state: TrainState, eval_loss: float | None, folder: Path) -> None:
    from neox_hf.hub import write_model_card

    recipe = run.recipe
    unwrapped = run.accelerator.unwrap_model(run.model)
    config = unwrapped.get_base_model().config if hasattr(unwrapped, "get_base_model") else unwrapped.config
    write_model_card(
        folder, recipe_yaml=recipe.to_yaml(), model_config=config.to_dict(),
        num_parameters=run.engine.parameter_count(), tokens_trained=state.consumed_tokens,
        data_sources=[{"path": s.path, "weight": s.weight} for s in recipe.data.sources], eval_loss=eval_loss,
        extra_markdown=model_card_section(folder),
    )


def startup_report(run: TrainingRun, notices: list[str]) -> str:
    recipe, layout, accelerator = run.recipe, run.layout, run.accelerator
    t, m = recipe.train, recipe.model
    unwrapped = accelerator.unwrap_model(run.model)
    config = unwrapped.get_base_model().config if hasattr(unwrapped, "get_base_model") else unwrapped.config
    global_batch = t.micro_batch_size * t.gradient_accumulation_steps * layout.dp
    lines = [
        f"neox_hf: {config.num_hidden_layers} layers, {run.engine.parameter_count() / 1e6:.2f}M parameters, "
        f"vocab {config.vocab_size} (tokenizer {len(run.tokenizer)})",
        f"layout: {layout.describe()}{' with sequence parallelism' if recipe.parallel.sequence_parallel else ''}, "
        f"{_sharding(recipe, accelerator)}, precision {t.precision}",
        f"batch: micro {t.micro_batch_size} × accumulation {t.gradient_accumulation_steps} × dp {layout.dp} = "
        f"{global_batch} {'pairs' if run.engine.objective.unit == 'pair' else 'samples'}/step, mode {recipe.data.mode}, seq_length {m.seq_length}, {t.train_iters} steps; "
        f"objective {t.objective}, loss weighted per "
        f"{run.engine.objective.unit if t.loss_normalization == 'token' else 'micro-batch (GPT-NeoX)'}",
    ]
    lines.append(f"precision: {_precision_in_effect(t, accelerator)}; loss: {describe_loss_kernel(run.engine.loss_kernel)}")
    if hasattr(run.loader, "describe"):
        lines.append(run.loader.describe())
    elif recipe.data.mode == "pack":
        epoch_tokens = tokens_per_epoch(recipe.data, run.tokenizer)
        num_samples = t.train_iters * global_batch
        if epoch_tokens:
            epochs = gpt_neox_num_epochs(epoch_tokens, m.seq_length, num_samples)
            lines.append(
                f"data: {epoch_tokens:,} tokens per epoch; {num_samples:,} samples of seq_length+1 = {m.seq_length + 1} "
                f"tokens need {epochs} epoch(s) (GPT-NeoX _num_epochs)"
            )
    lines.append(_data_reader_line(recipe.data.num_workers, accelerator.device.type))
    if run.peak is not None:
        lines.append(f"mfu: {run.flops_per_token / 1e9:.3g} GFLOP per token (6 × matmul parameters + 12 × layers × "
                     f"hidden × seq_length {m.seq_length}) against {run.peak.source} per device × {layout.world_size}")
    lines += run.engine.startup_lines() + moe_startup_lines(run)
    lines += [f"note: {n}" for n in notices]
    return "\n".join(lines)


def _data_reader_line(setting, device_type: str) -> str:
    where = ("a worker process (its Python work off the GIL that launches the step's kernels)"
             if workers_for(setting, device_type) else "a thread of the training process")
    return f"data: read ahead in {where} (`data.num_workers: {setting}`)"


def _precision_in_effect(t, accelerator) -> str:
    """What runs in which precision, as the start-up report states it, and whether bf16 is faster on this device."""
    from neox_hf.hardware import bf16_verdict

    verdict = bf16_verdict()
    if t.precision == "fp32":
        tf32 = ", matmuls on TF32 tensor cores (`train.tf32`)" if t.tf32 and torch.cuda.is_available() else ""
        chosen = "bf16" if verdict.faster else "fp32"
        return f"fp32 everywhere{tf32} (`train.precision: auto` would run {chosen} here: {verdict.why})"
    described = _mixed_precision_in_effect(t, accelerator)
    if t.precision == "bf16":
        return f"{described} ({verdict.why})"
    return described


def _mixed_precision_in_effect(t, accelerator) -> str:
    if t.precision == "fp8":
        return (f"FP8 matmuls in Transformer Engine's linear layers ({t.fp8.format}, delayed scaling over "
                f"{t.fp8.amax_history_len} steps), bf16 autocast elsewhere, fp32 weights, gradients and optimizer "
                "states")
    if accelerator.state.deepspeed_plugin is not None:
        return (f"{t.precision} weights, activations and gradients, fp32 master weights and optimizer states "
                f"(DeepSpeed {t.precision})")
    return f"{t.precision} autocast for matmuls, fp32 weights, gradients and optimizer states"


def _sharding(recipe, accelerator) -> str:
    if recipe.parallel.backend == "fsdp2":
        return "FSDP2" + (f" HSDP ({recipe.parallel.dp_replicate} replicas)" if recipe.parallel.dp_replicate > 1 else "")
    return f"ZeRO stage {recipe.parallel.zero_stage if accelerator.state.deepspeed_plugin else 'off'}"
