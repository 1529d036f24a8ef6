"""`neox_hf continue-neox`: a GPT-NeoX run's training checkpoint → a neox_hf step folder that resumes on any layout.

GPT-NeoX (DeepSpeed ZeRO-1) writes, in `global_stepN/`, the module weights per tensor-parallel rank (sequential
layout: `mp_rank_XX_model_states.pt`; pipeline layout: `layer_*-model_XX-model_states.pt`, read as `convert-neox`
reads them) and each data-parallel rank's partition of the optimizer (`zero_pp_rank_D_mp_rank_XX_optim_states.pt`:
its slice of every parameter group's fp32 master and Adam moments, flattened). This module joins the partitions into
each parameter's fp32 master and moments, merges the tensor-parallel shards under transformers' names with the
rules `convert-neox` uses, and writes what a neox_hf checkpoint's layout-free state holds (see
`neox_hf.checkpoint.layout_free`): step = GPT-NeoX's `iteration`, the LR schedule at that step, Adam's step, and the
data position in GPT-NeoX's order (iteration × global batch samples).

Gap filled: DeepSpeed's `ds_to_universal.py` does the joining offline, but loads every file with full unpickling
(`weights_only=False`), runs a pool of worker processes writing one folder per parameter, and its output (the
universal checkpoint) is read only by a DeepSpeed engine of Megatron's parameter names. Here each file is read with
`weights_only=True` (DeepSpeed's own bookkeeping classes admitted, `neox_hf.io.allowed_globals`; full unpickling
only with `trust_pickle`), and the join uses DeepSpeed's own map of each partition (`param_slice_mappings`: name →
offset and length in this rank's flat slice), the map `ds_to_universal` reads.

What the step after continuing does differently from GPT-NeoX's: with parallel (GPT-J) residuals and tensor
parallelism > 1, GPT-NeoX's effective row-parallel bias (`attention.dense.bias`, `mlp.linear2.bias`) is the sum of
the ranks' copies, each stepped by Adam, so it moves TP times Adam's step; transformers' model has one bias, stepped
once. Every other tensor continues exactly (tests/test_continue_neox.py).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from neox_hf.errors import CheckpointError
from neox_hf.interop.convert import neox_hf_config, neox_recipe_and_tokenizer
from neox_hf.interop.neox_checkpoint import (LEGACY_LAYER_NAMES, check_hf_state_dict, load_neox_state_dict,
                                             merge_tp_shards, neox_param_tables)
from neox_hf.interop.neox_files import detect_checkpoint_files, load_torch_file
from neox_hf.parallel.tp_plan import REPLICATED, ROW_BIAS

OPTIMIZER_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# A parameter's name in DeepSpeed's module: sequential layout `sequential.{idx}.{param}`, pipeline layout
# (PipelineModule) `{idx}.{param}`, a tied embedding `tied_modules.embed.{param}` (at idx 0 and on the last stage).
_PARAM_NAME = re.compile(r"^(?:sequential\.)?(\d+)\.(.+)$")
_TIED_NAME = re.compile(r"^tied_modules\.embed\.(.+)$")
KINDS = ("model", "exp_avg", "exp_avg_sq")


def continue_neox_checkpoint(checkpoint_dir, neox_config_paths: list[str], out_dir, *,
                             tokenizer_path: str | None = None, trust_pickle: bool = False,
                             notices: list[str] | None = None) -> Path:
    """Write `out_dir/checkpoints/step_{iteration}` (+ `latest`) from a GPT-NeoX `global_stepN/` (or the folder whose
    `latest` names it), trained with the GPT-NeoX config files `neox_config_paths`; return the step folder. Refused
    before anything is written: an `out_dir` that is not empty, a folder that is no GPT-NeoX checkpoint, missing or
    unreadable optimizer partitions, and a config whose shapes or batch differ from the checkpoint's."""
    from neox_hf.checkpoint.imported import check_empty_run_folder, write_imported_checkpoint

    notices = notices if notices is not None else []
    check_empty_run_folder(out_dir)
    files = detect_checkpoint_files(checkpoint_dir)
    recipe, tokenizer = neox_recipe_and_tokenizer(neox_config_paths, tokenizer_path)
    if recipe.parallel.tensor_parallel != files.tp_size:
        raise CheckpointError(f"{files.step_dir} has {files.tp_size} tensor-parallel rank(s); the config says "
                              f"model_parallel_size {recipe.parallel.tensor_parallel}: pass the config the run was "
                              "trained with (it decides the vocabulary padding)")
    model_states = _model_states(files, trust_pickle)
    iteration = _iteration(model_states, files)
    partitions = optimizer_partitions(files.step_dir, files.tp_size, trust_pickle=trust_pickle)
    dp, pp = len(partitions[0]), len(partitions) // files.tp_size
    global_batch = _check_global_batch(recipe, model_states, dp, files)
    data = _data_position(recipe, tokenizer, dp, iteration, files)  # before the tensors: it checks the data is here
    config = neox_hf_config(recipe, tokenizer, vocab_size=None if tokenizer else _embedding_rows(files, trust_pickle))
    per_rank = [_join_partitions(parts, _param_shapes(files, mp_rank, trust_pickle), files.step_dir, mp_rank)
                for mp_rank, parts in enumerate(partitions)]
    tensors = hf_layout_free_tensors(_by_tp_rank(per_rank, files.tp_size), config, where=str(files.step_dir))
    check_masters_are_the_weights(tensors, load_neox_state_dict(files.step_dir, config, trust_pickle=trust_pickle),
                                  files.step_dir)
    if config.use_parallel_residual and files.tp_size > 1:
        notices.append(f"the checkpoint has tensor parallelism {files.tp_size} and parallel residuals: GPT-NeoX steps "
                       "each rank's copy of the row-parallel biases (attention.dense.bias, mlp.linear2.bias, summed in "
                       "its forward), so they moved TP times Adam's step there; here they are one bias each, stepped "
                       "once (every other tensor continues exactly)")
    writer = {"backend": "gpt-neox", "deepspeed": True, "zero_stage": _zero_stage(partitions),
              "processes": dp * files.tp_size * pp, "data_parallel": dp, "tensor_parallel": files.tp_size,
              "pipeline_parallel": pp}
    trainer_state = {
        "layout_free": {"adam_step": _adam_step(partitions, files.step_dir), "loss_scaler": _loss_scaler(partitions)},
        "train_state": {"step": iteration, "consumed_samples": iteration * global_batch,
                        "consumed_tokens": iteration * global_batch * recipe.model.seq_length,
                        "skipped_steps": int(model_states.get("skipped_steps") or 0)},
        "scheduler": {"step_count": iteration},
        "data": data,
        "precision": recipe.train.precision,
        "writer": writer,
    }
    ranks = [d * files.tp_size for d in range(dp)]  # the ranks whose trainer state a resume reads (see checkpoint)
    return write_imported_checkpoint(out_dir, iteration, tensors, trainer_state, ranks=ranks, model_config=config,
                                     tokenizer=tokenizer)


# ---------------------------------------------------------------- reading the files


def _model_states(files, trust_pickle: bool) -> dict:
    """TP rank 0's `mp_rank_00_model_states.pt`: GPT-NeoX's `iteration`, DeepSpeed's counters and config."""
    path = files.rank_file(0)
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: GPT-NeoX writes it beside the weights (iteration, the DeepSpeed "
                              "config); copy the whole global_stepN folder")
    state = load_torch_file(path, trust_pickle=trust_pickle)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a dict of DeepSpeed's model state, found {type(state).__name__}")
    return state


def load_optimizer_file(path: Path, *, trust_pickle: bool = False) -> dict:
    """One `zero_pp_rank_*_optim_states.pt`'s `optimizer_state_dict`, unpickled as tensors and plain data plus
    DeepSpeed's bookkeeping classes (loss scaler, ZeRO stage, fragment addresses) unless `trust_pickle`."""
    import pickle
    import zipfile

    from neox_hf.io import (allowed_globals, damaged_file_errors, damaged_file_message, is_weights_only_refusal,
                            refusal_message)

    mmap = zipfile.is_zipfile(path)  # the partitions stay on disk until joined (a truncated zip fails below)
    try:
        if trust_pickle:
            state = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
        else:
            with torch.serialization.safe_globals(allowed_globals(deepspeed=True)):
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        if is_weights_only_refusal(err):
            raise CheckpointError(refusal_message(path, err) + ". If you trust this file, pass --trust-pickle to "
                                  "load it with full unpickling") from err
        raise CheckpointError(damaged_file_message(path, err)) from err
    except (OSError, *damaged_file_errors()) as err:
        raise CheckpointError(damaged_file_message(path, err)) from err
    optimizer = state.get("optimizer_state_dict") if isinstance(state, dict) else None
    needed = ("single_partition_of_fp32_groups", "base_optimizer_state", "param_slice_mappings")
    if not isinstance(optimizer, dict) or any(key not in optimizer for key in needed):
        raise CheckpointError(f"{path}: not a DeepSpeed ZeRO-1/2 optimizer partition (no {', '.join(needed)}); "
                              "continue-neox reads ZeRO stage 1 or 2 checkpoints of DeepSpeed ≥ 0.7")
    return optimizer


def optimizer_partitions(step_dir: Path, tp_size: int, *, trust_pickle: bool = False) -> list[list[dict]]:
    """`[model-parallel rank][data-parallel rank]` → that file's optimizer state. Model-parallel rank = pipeline stage
    × TP size + TP rank (DeepSpeed's pipeline grid), the TP rank alone without pipeline stages."""
    found: dict[int, dict[int, Path]] = {}
    for path in step_dir.iterdir():
        match = OPTIMIZER_FILE.match(path.name)
        if match:
            found.setdefault(int(match.group(2)), {})[int(match.group(1))] = path
    if not found:
        raise CheckpointError(f"{step_dir}: no zero_pp_rank_*_mp_rank_*_optim_states.pt files: continue-neox needs "
                              "the ZeRO optimizer partitions (GPT-NeoX saves them unless no_save_optim: true); to "
                              "import the weights alone use `neox_hf convert-neox`")
    mp_ranks = sorted(found)
    if mp_ranks != list(range(len(mp_ranks))) or len(mp_ranks) % tp_size:
        raise CheckpointError(f"{step_dir}: optimizer files for model-parallel ranks {mp_ranks} do not cover "
                              f"{tp_size} tensor-parallel rank(s) per stage; copy every zero_pp_rank_* file")
    dp_ranks = list(range(max(max(ranks) for ranks in found.values()) + 1))
    for mp_rank in mp_ranks:
        missing = sorted(set(dp_ranks) - set(found[mp_rank]))
        if missing:
            raise CheckpointError(f"{step_dir}: zero_pp_rank_{missing[0]}_mp_rank_{mp_rank:02d}_optim_states.pt is "
                                  "missing: every data-parallel rank's optimizer partition is needed; copy the whole "
                                  "global_stepN folder")
    return [[load_optimizer_file(found[m][d], trust_pickle=trust_pickle) for d in dp_ranks] for m in mp_ranks]


def _param_shapes(files, mp_rank: int, trust_pickle: bool) -> dict[str, torch.Size]:
    """Every optimized parameter's shape on model-parallel rank `mp_rank`, from DeepSpeed's `param_shapes`."""
    path = files.rank_file(mp_rank)
    state = load_torch_file(path, trust_pickle=trust_pickle)
    groups = state.get("param_shapes") if isinstance(state, dict) else None
    if not groups:
        raise CheckpointError(f"{path}: no param_shapes (written by DeepSpeed ZeRO, which continue-neox reads); "
                              "this is not a ZeRO-1/2 checkpoint")
    return {name: torch.Size(shape) for group in groups for name, shape in group.items()}


def _join_partitions(parts: list[dict], shapes: dict, step_dir: Path,
                     mp_rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """`{DeepSpeed parameter name: {"model"|"exp_avg"|"exp_avg_sq": full tensor}}` of one model-parallel rank, its
    data-parallel partitions joined in rank order."""
    pieces: dict[str, dict[str, list]] = {}
    for dp_rank, optimizer in enumerate(parts):
        for group, mapping in enumerate(optimizer["param_slice_mappings"]):
            flat = {"model": optimizer["single_partition_of_fp32_groups"][group],
                    **_group_moments(optimizer, group, step_dir, dp_rank, mp_rank)}
            for name, address in mapping.items():
                start, numel = int(address.start), int(address.numel)
                for kind in KINDS:
                    pieces.setdefault(name, {k: [] for k in KINDS})[kind].append(flat[kind][start:start + numel])
    joined = {}
    for name, kinds in pieces.items():
        if name not in shapes:
            raise CheckpointError(f"{step_dir}: the optimizer partitions of model-parallel rank {mp_rank} hold "
                                  f"{name}, which its model states' param_shapes do not list; the files come from "
                                  "different runs")
        shape = shapes[name]
        joined[name] = {}
        for kind, chunks in kinds.items():
            full = torch.cat(chunks).float()
            if full.numel() != math.prod(shape):
                raise CheckpointError(f"{step_dir}: the optimizer partitions of model-parallel rank {mp_rank} hold "
                                      f"{full.numel()} values of {name}, whose shape is {list(shape)}; a partition "
                                      "is missing or from another run")
            joined[name][kind] = full.view(shape).clone()
    missing = sorted(set(shapes) - set(joined))
    if missing:
        raise CheckpointError(f"{step_dir}: no optimizer state for {missing[0]} (model-parallel rank {mp_rank}); a "
                              "partition is missing or from another run")
    return joined


def _group_moments(optimizer: dict, group: int, step_dir: Path, dp_rank: int, mp_rank: int) -> dict:
    """Adam's two moments of one parameter group's flat partition (DeepSpeed's elastic format is a list of group
    states, the default one torch's optimizer state dict with one flat parameter per group)."""
    base = optimizer["base_optimizer_state"]
    if isinstance(base, list):
        state = base[group]
    else:
        state = base["state"].get(base["param_groups"][group]["params"][0], {})
    if "exp_avg" not in state or "exp_avg_sq" not in state:
        raise CheckpointError(f"{step_dir}: the optimizer partition of data-parallel rank {dp_rank}, model-parallel "
                              f"rank {mp_rank} has no Adam moments (exp_avg, exp_avg_sq) for group {group}: "
                              "continue-neox carries Adam's state only (GPT-NeoX optimizer type Adam / AdamW)")
    return {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}


def _adam_step(partitions: list[list[dict]], step_dir: Path) -> float:
    """Adam's step count: DeepSpeed's FusedAdam keeps it per parameter group, torch's Adam per parameter."""
    steps = set()
    for optimizer in (o for parts in partitions for o in parts):
        base = optimizer["base_optimizer_state"]
        groups = base if isinstance(base, list) else list(base["state"].values())
        steps |= {float(state["step"]) for state in groups if "step" in state}
        if isinstance(base, dict):
            steps |= {float(group["step"]) for group in base["param_groups"] if "step" in group}
        if "base_optimizer_state_step" in optimizer:
            steps.add(float(optimizer["base_optimizer_state_step"]))
    if len(steps) != 1:
        raise CheckpointError(f"{step_dir}: the optimizer partitions disagree on Adam's step ({sorted(steps)}) or hold "
                              "none; the files come from different runs")
    return steps.pop()


def _zero_stage(partitions: list[list[dict]]) -> int:
    stage = partitions[0][0].get("zero_stage")  # DeepSpeed's ZeroStageEnum (an int enum), absent in old versions
    return int(stage) if stage is not None else 1


def _loss_scaler(partitions: list[list[dict]]) -> dict | None:
    """fp16's dynamic loss scale where the run had one, in the form the layout-free state carries DeepSpeed's
    (neox_hf.engines.zero_state): a resumed fp16 run starts from GPT-NeoX's scale, not the initial one."""
    scaler = partitions[0][0].get("loss_scaler")
    if scaler is None or not partitions[0][0].get("dynamic_loss_scale"):
        return None
    fields = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
    return {"deepspeed": {key: getattr(scaler, key) for key in fields if hasattr(scaler, key)}}


def _iteration(model_states: dict, files) -> int:
    for key in ("iteration", "global_steps"):
        if isinstance(model_states.get(key), int):
            return model_states[key]
    raise CheckpointError(f"{files.rank_file(0)}: no iteration (GPT-NeoX's client state) or global_steps; not a "
                          "GPT-NeoX training checkpoint")


def _embedding_rows(files, trust_pickle: bool) -> int:
    """The padded vocabulary (rows of the word embedding over TP ranks), when no tokenizer says it."""
    from neox_hf.interop.neox_files import embedding_rows

    return embedding_rows(files, trust_pickle=trust_pickle)


def _check_global_batch(recipe, model_states: dict, dp: int, files) -> int:
    """The global batch of the config on the checkpoint's data-parallel size, refused where DeepSpeed's saved config
    says the run had another one (its data position would then mean other samples)."""
    t = recipe.train
    ours = t.micro_batch_size * t.gradient_accumulation_steps * dp
    saved = model_states.get("ds_config") or {}
    theirs = saved.get("train_batch_size") or (
        saved.get("train_micro_batch_size_per_gpu", t.micro_batch_size)
        * saved.get("gradient_accumulation_steps", t.gradient_accumulation_steps) * dp)
    if theirs != ours:
        raise CheckpointError(f"{files.step_dir}: the checkpoint's run had a global batch of {theirs} samples on {dp} "
                              f"data-parallel ranks; the config gives {ours} (train_micro_batch_size_per_gpu "
                              f"{t.micro_batch_size} × gradient_accumulation_steps {t.gradient_accumulation_steps} × "
                              f"{dp}): pass the config the run was trained with")
    return ours


def _data_position(recipe, tokenizer, dp: int, iteration: int, files) -> dict:
    """GPT-NeoX's data position after `iteration` steps, as the training loader saves it (built by that loader)."""
    from neox_hf.data import build_train_loader

    if recipe.data.order == "stream" or not recipe.data.sources:
        raise CheckpointError(f"{files.step_dir}: the config names no GPT-NeoX data (data_path, train_data_paths): "
                              "continue-neox continues GPT-NeoX's sample order, which the data files decide; pass the "
                              "config with the run's data")
    t = recipe.train
    loader = build_train_loader(recipe.data, tokenizer, seq_length=recipe.model.seq_length,
                                micro_batch_size=t.micro_batch_size, dp_rank=0, dp_size=dp, seed=recipe.data.seed,
                                gradient_accumulation_steps=t.gradient_accumulation_steps, train_iters=t.train_iters,
                                eval_interval=t.eval_interval, eval_iters=t.eval_iters, start_step=iteration)
    return loader.state_dict()


def check_masters_are_the_weights(tensors: dict, weights: dict, step_dir: Path) -> None:
    """Refuse optimizer partitions whose fp32 masters are not the module files' weights (rounded to their dtype, as
    DeepSpeed copies them after each step): partitions copied in from another step or run."""
    for key, weight in weights.items():
        master = tensors.get(f"model/{key}")
        if master is None:  # a tied lm_head: the embedding's
            continue
        rounded = master.to(weight.dtype)
        if not torch.equal(rounded, weight):
            difference = (rounded.float() - weight.float()).abs().max().item()
            raise CheckpointError(f"{step_dir}: the optimizer partitions' fp32 master of {key} is not the weight its "
                                  f"module files hold (largest difference {difference:.3g}): the zero_pp_rank_* files "
                                  "come from another step or run; copy the global_stepN folder whole")


# ---------------------------------------------------------------- GPT-NeoX names → transformers names


def _by_tp_rank(per_rank: list[dict], tp_size: int) -> list[dict[int, dict[str, dict[str, torch.Tensor]]]]:
    """`[tp rank]{layer idx: {GPT-NeoX param: {kind: tensor}}}`, the pipeline stages of a TP rank merged."""
    layers: list[dict] = [{} for _ in range(tp_size)]
    for mp_rank, params in enumerate(per_rank):
        for name, kinds in params.items():
            tied = _TIED_NAME.match(name)
            match = _PARAM_NAME.match(name)
            if tied:
                idx, param = 0, tied.group(1)
            elif match:
                idx, param = int(match.group(1)), match.group(2)
            else:
                raise CheckpointError(f"optimizer parameter {name!r} is not a GPT-NeoX layer parameter "
                                      "(sequential.<idx>.<name> or <idx>.<name>)")
            layers[mp_rank % tp_size].setdefault(idx, {}).setdefault(LEGACY_LAYER_NAMES.get(param, param), kinds)
    return layers


def hf_layout_free_tensors(ranks: list[dict], config, *, where: str) -> dict[str, torch.Tensor]:
    """`{"model|exp_avg|exp_avg_sq/<transformers name>": full fp32 tensor}`: the masters merged over TP ranks as
    `convert-neox` merges weights, the moments likewise except that a replicated tensor's (and a row-parallel bias's)
    are rank 0's: every rank computed the same gradient for it."""
    masters: dict[str, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    for idx, table in neox_param_tables(config).items():
        stored = [rank.get(idx, {}) for rank in ranks]
        unexpected = sorted(set(stored[0]) - set(table) - {"attention.rotary_emb.inv_freq"})
        if unexpected:
            raise CheckpointError(f"{where}: layer {idx} has parameters {unexpected} that the config's model lacks "
                                  f"(it expects {sorted(table)}); pass the config the run was trained with")
        for neox_name, (hf_key, rule) in table.items():
            if not all(neox_name in rank for rank in stored):
                if any(neox_name in rank for rank in stored) or not hf_key.endswith("bias"):
                    raise CheckpointError(f"{where}: no optimizer state for layer {idx} {neox_name} on every TP rank; "
                                          "the config does not match the checkpoint (num_layers, no_weight_tying) or "
                                          "a partition is missing")
                continue
            label = f"{where} layer {idx} '{neox_name}'"
            for kind in KINDS:
                shards = [rank[neox_name][kind] for rank in stored]
                if kind != "model" and rule in (REPLICATED, ROW_BIAS):
                    value = shards[0]
                else:
                    value = merge_tp_shards(shards, rule, parallel_residual=config.use_parallel_residual, where=label)
                tensors[f"{kind}/{hf_key}"] = value
            masters[hf_key] = tensors[f"model/{hf_key}"]
    if config.tie_word_embeddings:
        masters["lm_head.weight"] = masters.get("gpt_neox.embed_in.weight")
    check_hf_state_dict(masters, config, where=where)
    return tensors
