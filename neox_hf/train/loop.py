"""The training loop: recipe → tokenizer, model, data, Accelerator → steps → resumable checkpoints → HF folder.

Read top to bottom: `train(recipe)` is the whole run; each helper below does one thing.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import PartialState
from tqdm.auto import tqdm

from neox_hf.finetune import check_peft_recipe, save_finetuned, trainable_parameters_report, wrap_with_peft
from neox_hf.data import build_eval_loader, build_train_loader, gpt_neox_num_epochs, tokens_per_epoch
from neox_hf.interop.hf_folder import save_hf_folder
from neox_hf.interop.tokenizer import check_vocab_covers_tokenizer, load_tokenizer, padded_vocab_size
from neox_hf.model import NeoXConfig, NeoXForCausalLM, config_from_recipe
from neox_hf.parallel.accelerator import build_accelerator, uses_deepspeed
from neox_hf.parallel.tensor_parallel import (
    DeepSpeedMPU,
    VocabParallelLMHead,
    apply_tensor_parallel,
    build_parallel_groups,
    from_pretrained_tensor_parallel,
    pad_vocab,
    deepspeed_initialize_with_mpu,
    gather_full_state_dict,
    vocab_parallel_cross_entropy,
)
from neox_hf.recipe import Recipe
from neox_hf.train.checkpoint import TrainState, find_resume_checkpoint, load_checkpoint, save_checkpoint
from neox_hf.train.guards import (
    check_before_build,
    check_finite,
    check_skipped_documents,
    claim_output_dir,
    step_log_line,
    truncate_train_log,
)
from neox_hf.train.schedule import build_lr_scheduler


@dataclass
class RunResult:
    output_dir: Path
    steps: int
    train_losses: list[float]  # mean loss of every optimizer step (averaged over ranks)
    eval_losses: list[tuple[int, float]]  # (step, loss)
    final_eval_loss: float | None


def train(recipe: Recipe, *, notices: list[str] | None = None, overwrite: bool = False) -> RunResult:
    """Run the recipe end to end; return where the model went and the losses seen.

    Before anything is built: the settings checkable without a model, and `output.dir` (refused when it holds an
    earlier run, unless resuming or `overwrite`; locked for the run)."""
    check_before_build(recipe)
    lock = claim_output_dir(recipe, overwrite=overwrite)
    try:
        return _train(recipe, notices)
    finally:
        if lock is not None:
            lock.release()


def _train(recipe: Recipe, notices: list[str] | None) -> RunResult:
    accelerator = build_accelerator(recipe, log_with="tensorboard" if recipe.output.tensorboard else None)
    _set_seed(recipe.train.seed)
    check_peft_recipe(recipe)
    tokenizer = load_tokenizer(recipe.tokenizer.path, eos_token=recipe.tokenizer.eos_token, pad_token=recipe.tokenizer.pad_token)
    groups = build_parallel_groups(recipe.parallel.tensor_parallel) if recipe.parallel.tensor_parallel > 1 else None
    model = build_model(recipe, tokenizer, groups)
    if recipe.peft.method is not None:
        model = wrap_with_peft(model, recipe.peft)  # before prepare: only adapter weights reach the optimizer
        accelerator.print(trainable_parameters_report(model))
    model, optimizer = prepare_model_and_optimizer(accelerator, recipe, model, groups)
    # Every rank of a tensor-parallel group must see the same batch, so data is split over data-parallel ranks only.
    dp_rank, dp_size = (groups.dp_rank, groups.dp_size) if groups else (accelerator.process_index, accelerator.num_processes)
    loader = build_train_loader(
        recipe.data, tokenizer, seq_length=recipe.model.seq_length, micro_batch_size=recipe.train.micro_batch_size,
        dp_rank=dp_rank, dp_size=dp_size, seed=recipe.data.seed,
    )
    eval_batches = build_eval_loader(
        recipe.data, tokenizer, seq_length=recipe.model.seq_length, micro_batch_size=recipe.train.micro_batch_size,
        max_batches=recipe.train.eval_iters, dp_rank=dp_rank, dp_size=dp_size,
    )
    scheduler = build_lr_scheduler(optimizer, recipe.train)
    state = TrainState()
    resume_from = find_resume_checkpoint(recipe.train.resume, recipe.output.dir,
                                         notify=lambda message: accelerator.print(f"note: {message}"))
    if resume_from is not None:
        state = load_checkpoint(accelerator, resume_from, scheduler=scheduler, data_loader=loader)
        accelerator.print(f"resumed from {resume_from} at step {state.step}")
    if recipe.train.resume is not None and accelerator.is_main_process:
        truncate_train_log(recipe.output.dir, state.step)  # steps after the resume point are redone
    if accelerator.is_main_process:
        _print_startup_report(accelerator, recipe, model, tokenizer, notices or [], dp_size)
    if recipe.output.tensorboard:
        accelerator.init_trackers("neox_hf")
    initial_eval = evaluate(accelerator, model, eval_batches) if eval_batches and state.step == 0 else None
    if initial_eval is not None:
        accelerator.print(f"step 0: eval loss {initial_eval:.4f}")
    pusher = _hub_pusher(recipe) if accelerator.is_main_process else None
    run = TrainingRun(accelerator, recipe, model, optimizer, scheduler, loader, eval_batches, tokenizer, groups, pusher)
    result = run_steps(run, state)
    if initial_eval is not None:
        result.eval_losses.insert(0, (0, initial_eval))
    final_eval = evaluate(accelerator, model, eval_batches) if eval_batches else None
    if final_eval is not None:
        result.eval_losses.append((state.step, final_eval))
        accelerator.print(f"final eval loss {final_eval:.4f}  perplexity {math.exp(min(final_eval, 50)):.2f}")
    if recipe.peft.method is not None:
        out = save_finetuned(accelerator, model, tokenizer, recipe)
    else:
        out = save_final_model(accelerator, model, tokenizer, recipe, groups)
    if accelerator.is_main_process:
        _write_card(accelerator, recipe, model, state, final_eval, Path(recipe.output.dir))
        if pusher is not None:
            pusher.push_final(recipe.output.dir)
            pusher.close()  # waits for every queued upload; re-raises the first failure
    accelerator.end_training()
    accelerator.print(f"model saved to {out.resolve()}")
    return RunResult(out, state.step, result.train_losses, result.eval_losses, final_eval)


# ----------------------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------------------


def _set_seed(seed: int) -> None:
    from accelerate.utils import set_seed

    set_seed(seed)


def build_model(recipe: Recipe, tokenizer, groups=None) -> NeoXForCausalLM:
    """From a pretrained folder, or from scratch with GPT-NeoX init and the padded vocabulary.

    With tensor parallelism (`groups`), a local safetensors folder is loaded slice by slice, already split (and its
    vocabulary zero-padded GPT-NeoX style if TP does not divide it); otherwise the model is built whole and split by
    `prepare_model_and_optimizer`.
    """
    m = recipe.model
    if m.from_pretrained and groups is not None and _has_safetensors(m.from_pretrained):
        stored_vocab = NeoXConfig.from_pretrained(m.from_pretrained).vocab_size
        padded = _tp_vocab_size(stored_vocab, recipe)
        model = from_pretrained_tensor_parallel(NeoXForCausalLM, m.from_pretrained, groups, padded_vocab=padded,
                                                sequence_parallel=recipe.parallel.sequence_parallel,
                                                attn_implementation=m.attn_implementation)
        check_vocab_covers_tokenizer(stored_vocab, tokenizer, where=m.from_pretrained)
    elif m.from_pretrained:
        model = NeoXForCausalLM.from_pretrained(m.from_pretrained, dtype=torch.float32, attn_implementation=m.attn_implementation)
        check_vocab_covers_tokenizer(model.config.vocab_size, tokenizer, where=m.from_pretrained)
        model = _pad_vocab_for_tp(model, recipe)
    else:
        vocab = m.vocab_size or padded_vocab_size(len(tokenizer), m.make_vocab_size_divisible_by, recipe.parallel.tensor_parallel)
        check_vocab_covers_tokenizer(vocab, tokenizer, where="`model.vocab_size`")
        config = config_from_recipe(
            m, vocab_size=vocab, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        config._attn_implementation = m.attn_implementation
        # _from_config builds under deepspeed.zero.Init when ZeRO-3 is active, so a 20B never sits whole on one rank.
        model = NeoXForCausalLM._from_config(config, dtype=torch.float32)
    if recipe.parallel.activation_checkpointing:
        model.activation_checkpointing_enable()
    model.config.use_cache = False
    return model


def _has_safetensors(folder: str) -> bool:
    """A local safetensors folder can be read rank slice by rank slice."""
    path = Path(folder)
    return (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()


def _tp_vocab_size(vocab: int, recipe: Recipe) -> int:
    """GPT-NeoX pads the vocabulary to make_vocab_size_divisible_by × TP; a checkpoint that does not divide gets zero
    rows (real-token logits unchanged) and its config records the new size."""
    tp = recipe.parallel.tensor_parallel
    if tp == 1 or vocab % tp == 0:
        return vocab
    padded = padded_vocab_size(vocab, recipe.model.make_vocab_size_divisible_by, tp)
    PartialState().print(f"note: vocabulary {vocab} padded to {padded} rows for tensor parallel {tp} "
                         "(zero rows, real-token logits unchanged)")
    return padded


def _pad_vocab_for_tp(model, recipe: Recipe):
    """The whole-model path of `_tp_vocab_size` (a .bin folder or a Hub name)."""
    vocab = model.config.vocab_size
    padded = _tp_vocab_size(vocab, recipe)
    if padded == vocab:
        return model
    model = pad_vocab(model, padded)
    model.config.vocab_size = padded
    return model


def prepare_model_and_optimizer(accelerator, recipe: Recipe, model, groups=None):
    """Apply tensor parallelism (if `groups` and not done at load), build AdamW, let Accelerate/DeepSpeed wrap both."""
    if groups is not None and not isinstance(model.get_output_embeddings(), VocabParallelLMHead):
        model = apply_tensor_parallel(model, groups.tp_group, sequence_parallel=recipe.parallel.sequence_parallel)
    optimizer = build_optimizer(model, recipe)
    # With TP, DeepSpeed must be handed our groups so ZeRO reduces gradients over the data-parallel group only.
    with deepspeed_initialize_with_mpu(DeepSpeedMPU(groups)) if groups else contextlib.nullcontext():
        model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer


def build_optimizer(model, recipe: Recipe) -> torch.optim.Optimizer:
    """AdamW; as GPT-NeoX, biases and norm weights get no weight decay."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 else decay).append(param)
    t = recipe.train
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)


def causal_lm_loss(model, batch: dict) -> tuple[torch.Tensor, int]:
    """Mean cross-entropy over the batch's labelled tokens (labels are already aligned with inputs).

    A tensor-parallel model computes it vocab-parallel: no rank ever holds the full [batch, seq, vocab] logits.
    """
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    labels = batch["labels"]
    tokens = int((labels != -100).sum())
    module = getattr(model, "module", model)  # a DeepSpeed engine wraps the HF model
    if isinstance(module.get_output_embeddings(), VocabParallelLMHead):
        hidden = module.base_model(**inputs, use_cache=False).last_hidden_state
        return loss_from_hidden(module, hidden, labels), tokens
    logits = model(**inputs, use_cache=False).logits
    return _cross_entropy(logits, labels), tokens


def loss_from_hidden(module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The head + cross-entropy part of the loss from the final hidden states (vocab-parallel under TP)."""
    head = module.get_output_embeddings()
    if isinstance(head, VocabParallelLMHead):
        return vocab_parallel_cross_entropy(head.forward_shard(hidden), labels, head.group, head.vocab_start)
    return _cross_entropy(head(hidden), labels)


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # The vocab-parallel function with no group is a fused cross-entropy: one fp32 buffer becomes the softmax and then,
    # in place, the gradient; F.cross_entropy keeps two more logits-sized tensors and was slower on CPU.
    return vocab_parallel_cross_entropy(logits, labels, group=None)


def _to_device(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


@dataclass
class _StepLog:
    train_losses: list[float]
    eval_losses: list[tuple[int, float]]


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
    groups: object = None  # ParallelGroups with tensor parallelism
    pusher: object = None  # HubPusher on the main process when train.push_to_hub is set
    reported_skipped: int = 0  # undecodable documents already reported


def run_steps(run: TrainingRun, state: TrainState) -> _StepLog:
    accelerator, recipe, model, optimizer = run.accelerator, run.recipe, run.model, run.optimizer
    scheduler, loader, eval_batches = run.scheduler, run.loader, run.eval_batches
    t = recipe.train
    log = _StepLog([], [])
    progress = tqdm(total=t.train_iters, initial=state.step, disable=not accelerator.is_main_process, desc="train")
    batches = iter(loader)
    window_loss, window_tokens, window_start = 0.0, 0, time.perf_counter()
    model.train()
    while state.step < t.train_iters:
        step_loss, step_tokens, step_samples, grad_norm = 0.0, 0, 0, None
        for _ in range(t.gradient_accumulation_steps):
            batch = _to_device(next(batches), accelerator.device)
            with accelerator.accumulate(model):
                loss, tokens = causal_lm_loss(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients and t.clip_grad > 0 and not uses_deepspeed(accelerator):
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), t.clip_grad)
                optimizer.step()
                optimizer.zero_grad()
            step_loss += loss.detach().float() / t.gradient_accumulation_steps
            step_tokens += tokens
            step_samples += batch["input_ids"].shape[0]
        step_lr = scheduler.get_last_lr()[0]  # the lr this step used
        skipped = _step_was_skipped(accelerator, model)
        if skipped:
            state.skipped_steps += 1
        else:
            scheduler.step()  # GPT-NeoX (through DeepSpeed) holds the LR on an overflow-skipped step
        state.step += 1
        mean_loss = accelerator.reduce(step_loss.reshape(1), reduction="mean").item()
        check_finite(state.step, mean_loss, None if skipped else _grad_norm(accelerator, model, grad_norm),
                     output_dir=recipe.output.dir)  # before anything of this step is logged or saved
        # Summed over every process; the ranks of one tensor-parallel group saw the same batch, so count it once.
        totals = accelerator.reduce(torch.tensor([step_tokens, step_samples], device=accelerator.device), reduction="sum")
        totals = totals // recipe.parallel.tensor_parallel
        state.consumed_tokens += int(totals[0])
        state.consumed_samples += int(totals[1])
        log.train_losses.append(mean_loss)
        if accelerator.is_main_process:
            _append_step_log(recipe.output.dir, state, mean_loss, step_lr, skipped, _loss_scale(accelerator, model))
        window_loss += mean_loss
        window_tokens += int(totals[0])
        progress.update(1)
        if state.step % t.log_interval == 0 or state.step == t.train_iters:
            elapsed = time.perf_counter() - window_start
            n = t.log_interval if state.step % t.log_interval == 0 else state.step % t.log_interval
            metrics = {"train/loss": window_loss / n, "train/lr": step_lr, "train/tokens_per_s": window_tokens / elapsed}
            progress.set_postfix(loss=f"{metrics['train/loss']:.4f}", lr=f"{metrics['train/lr']:.2e}")
            accelerator.log(metrics, step=state.step)
            window_loss, window_tokens, window_start = 0.0, 0, time.perf_counter()
            run.reported_skipped = _report_skipped_documents(accelerator, loader, recipe, run.reported_skipped)
        if eval_batches and state.step % t.eval_interval == 0 and state.step < t.train_iters:
            eval_loss = evaluate(accelerator, model, eval_batches)
            log.eval_losses.append((state.step, eval_loss))
            accelerator.log({"eval/loss": eval_loss, "eval/perplexity": math.exp(min(eval_loss, 50))}, step=state.step)
            accelerator.print(f"step {state.step}: eval loss {eval_loss:.4f}")
        if t.save_interval and state.step % t.save_interval == 0:
            save_checkpoint(accelerator, output_dir=recipe.output.dir, state=state, scheduler=scheduler, data_loader=loader,
                            keep_last_n=t.keep_last_n, model_config=accelerator.unwrap_model(model).config,
                            tokenizer=run.tokenizer)
            if t.push_to_hub is not None and t.push_to_hub.revision_per_step and recipe.peft.method is None:
                _push_step_folder(run, state)
    progress.close()
    return log


def _grad_norm(accelerator, model, clipped_norm) -> float | None:
    """The step's global gradient norm: what clipping measured, or DeepSpeed's (None when neither computed one)."""
    if uses_deepspeed(accelerator):
        norm = model.get_global_grad_norm() if hasattr(model, "get_global_grad_norm") else None
    else:
        norm = clipped_norm
    return None if norm is None else float(norm)


def _report_skipped_documents(accelerator, loader, recipe: Recipe, reported: int) -> int:
    """Print how many documents were undecodable (summed over ranks) when the count grew; fail above
    data.max_skipped_fraction. Returns the count now reported."""
    stats = getattr(loader, "stats", None)
    if stats is None:
        return reported
    local = torch.tensor([stats.get("skipped_undecodable", 0), stats.get("documents", 0)], device=accelerator.device)
    skipped, documents = (int(v) for v in accelerator.reduce(local, reduction="sum"))
    line = check_skipped_documents({"skipped_undecodable": skipped, "documents": documents},
                                   recipe.data.max_skipped_fraction)
    if line is not None and skipped > reported:
        accelerator.print(f"note: {line}")
    return skipped


def _step_was_skipped(accelerator, model) -> bool:
    """fp16 dynamic loss scaling skips the update when gradients overflowed (and lowers the scale)."""
    if uses_deepspeed(accelerator):
        return not model.was_step_applied()
    return accelerator.optimizer_step_was_skipped


def _loss_scale(accelerator, model) -> float | None:
    """The current fp16 loss scale (DeepSpeed's dynamic scaler or torch's GradScaler); None in fp32/bf16."""
    if accelerator.mixed_precision != "fp16":
        return None
    if uses_deepspeed(accelerator):
        return float(model.optimizer.loss_scale)
    # Accelerate builds a GradScaler only where torch AMP scales fp16 (not for fp16 on CPU without DeepSpeed).
    return float(accelerator.scaler.get_scale()) if accelerator.scaler is not None else None


def _append_step_log(output_dir, state: TrainState, loss: float, lr: float, skipped: bool = False,
                     loss_scale: float | None = None) -> None:
    """One JSON line per optimizer step (train_log.jsonl): the exact per-step losses, also across resumes."""
    path = Path(output_dir) / "train_log.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"step": state.step, "loss": loss, "lr": lr, "consumed_samples": state.consumed_samples,
             "consumed_tokens": state.consumed_tokens}
    if loss_scale is not None:
        entry.update(skipped=skipped, loss_scale=loss_scale)
    with path.open("a") as log_file:
        log_file.write(step_log_line(entry) + "\n")


@torch.no_grad()
def evaluate(accelerator, model, eval_batches: list[dict]) -> float:
    """Token-weighted mean loss over every rank's eval batches."""
    model.eval()
    total = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    for batch in eval_batches:
        loss, tokens = causal_lm_loss(model, _to_device(batch, accelerator.device))
        total += torch.tensor([loss.item() * tokens, tokens], device=accelerator.device, dtype=torch.float64)
    model.train()
    total = accelerator.reduce(total, reduction="sum")  # TP ranks repeat their group's sums: the ratio is unchanged
    return float(total[0] / total[1]) if total[1] > 0 else float("nan")


def save_final_model(accelerator, model, tokenizer, recipe: Recipe, groups=None, out_dir=None) -> Path:
    """Consolidated HF folder (ZeRO-3 partitions gathered, TP shards merged) written by the main process, atomically."""
    if groups is not None:
        state_dict = gather_full_state_dict(accelerator.unwrap_model(model), groups)  # collective over TP ranks
    else:
        state_dict = accelerator.get_state_dict(model)  # collective under ZeRO-3: every rank must call it
    out = Path(out_dir or recipe.output.dir)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        save_hf_folder(unwrapped, out, state_dict=state_dict, tokenizer=tokenizer,
                       extra_files={"recipe.yaml": recipe.to_yaml()}, max_shard_size=recipe.output.max_shard_size)
    accelerator.wait_for_everyone()
    return out


def _hub_pusher(recipe: Recipe):
    if recipe.train.push_to_hub is None:
        return None
    from neox_hf.hub import HubPusher

    hub = recipe.train.push_to_hub
    # delete_after: hub_steps/step{N} exists only to be uploaded; a failed push keeps it for the retry command.
    return HubPusher(hub.repo_id, private=hub.private, revision_per_step=hub.revision_per_step, delete_after=True)


def _push_step_folder(run: TrainingRun, state: TrainState) -> None:
    """Pythia convention: an HF folder of step N on branch `step{N}`, uploaded in the background."""
    folder = Path(run.recipe.output.dir) / "hub_steps" / f"step{state.step}"
    save_final_model(run.accelerator, run.model, run.tokenizer, run.recipe, run.groups, out_dir=folder)
    if run.pusher is not None:
        run.pusher.push_step(folder, state.step)


def _write_card(accelerator, recipe: Recipe, model, state: TrainState, eval_loss: float | None, folder: Path) -> None:
    from neox_hf.hub import write_model_card

    unwrapped = accelerator.unwrap_model(model)
    config = unwrapped.get_base_model().config if hasattr(unwrapped, "get_base_model") else unwrapped.config
    write_model_card(
        folder, recipe_yaml=recipe.to_yaml(), model_config=config.to_dict(),
        num_parameters=_parameter_count(accelerator, recipe, unwrapped), tokens_trained=state.consumed_tokens,
        data_sources=[{"path": s.path, "weight": s.weight} for s in recipe.data.sources], eval_loss=eval_loss,
    )


def _parameter_count(accelerator, recipe: Recipe, unwrapped) -> int:
    """Full-model parameter count whatever the layout (ZeRO-3 partitions, TP shards)."""
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in unwrapped.parameters())
    return n_params * recipe.parallel.tensor_parallel  # TP: roughly, the replicated norms are counted TP times


def _print_startup_report(accelerator, recipe: Recipe, model, tokenizer, notices: list[str], dp: int) -> None:
    t, m = recipe.train, recipe.model
    unwrapped = accelerator.unwrap_model(model)
    n_params = _parameter_count(accelerator, recipe, unwrapped)
    global_batch = t.micro_batch_size * t.gradient_accumulation_steps * dp
    lines = [
        f"neox_hf: {m.num_layers if not m.from_pretrained else unwrapped.config.num_hidden_layers} layers, "
        f"{n_params / 1e6:.2f}M parameters, vocab {unwrapped.config.vocab_size} (tokenizer {len(tokenizer)})",
        f"layout: {dp} data-parallel rank(s), tensor parallel {recipe.parallel.tensor_parallel}"
        f"{' with sequence parallelism' if recipe.parallel.sequence_parallel else ''}, "
        f"ZeRO stage {recipe.parallel.zero_stage if uses_deepspeed(accelerator) else 'off'}, precision {t.precision}",
        f"batch: micro {t.micro_batch_size} × accumulation {t.gradient_accumulation_steps} × dp {dp} = {global_batch} "
        f"samples/step, mode {recipe.data.mode}, seq_length {m.seq_length}, {t.train_iters} steps",
    ]
    if recipe.data.mode == "pack":
        epoch_tokens = tokens_per_epoch(recipe.data, tokenizer)
        num_samples = t.train_iters * global_batch
        if epoch_tokens:
            epochs = gpt_neox_num_epochs(epoch_tokens, m.seq_length, num_samples)
            lines.append(
                f"data: {epoch_tokens:,} tokens per epoch; {num_samples:,} samples of seq_length+1 = {m.seq_length + 1} "
                f"tokens need {epochs} epoch(s) (GPT-NeoX _num_epochs)"
            )
    lines += [f"note: {n}" for n in notices]
    accelerator.print("\n".join(lines))
