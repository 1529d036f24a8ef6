"""PEFT fine-tuning: LoRA wrapping from the recipe, adapter saves that survive ZeRO-3, merging.

Gaps filled over peft:
- `get_peft_model` silently accepts a `target_modules` name that matches nothing as long as another name matches,
  so a typo trains fewer layers than asked; we refuse a name that wraps no module, naming `peft.target_modules`.
- `PeftModel.save_pretrained` on a DeepSpeed ZeRO-3 engine's module saves the local partitions (empty tensors);
  `save_adapter` gathers first (`accelerator.get_state_dict`, collective) and writes from the main process,
  atomically (adapter_config.json last, so a folder with a config always has its weights).
- `save_embedding_layers="auto"` asks the Hub whether the base model's vocabulary changed; we never train the
  embedding, so we pass False and stay offline.
- merging writes a stock GPTNeoX folder (`architectures: ["GPTNeoXForCausalLM"]`) with the tokenizer, via
  `save_hf_folder`, and bad folders raise `CheckpointError` instead of a deep OSError / size-mismatch trace.
- peft merges an adapter into any base of the same shapes; we refuse a base other than the one adapter_config.json
  records (`base_model_name_or_path`) unless forced.

Loading a folder for inference (full model or base + adapter) lives in `neox_hf.inference`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from neox_hf.errors import CheckpointError, RecipeError
from neox_hf.inference import (  # noqa: F401  (re-exported: callers loaded models through finetune before)
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    check_model_folder,
    folder_tokenizer,
    is_adapter_folder,
    load_adapter_model,
    load_base_model,
    load_for_inference,
)
from neox_hf.model.folder import save_hf_folder
from neox_hf.io import move_files_into, staging_folder
from neox_hf.recipe import PeftConfig, Recipe
from neox_hf.checkpoint.run_log import RECIPE_NAME

if TYPE_CHECKING:  # peft is imported where a LoRA run or an adapter needs it: ~1.4 s of every process's start-up
    from peft import LoraConfig, PeftModel

MERGED_SUBDIR = "merged"


# ----------------------------------------------------------------------------------------------------------------
# Wrapping
# ----------------------------------------------------------------------------------------------------------------


def lora_config(peft_cfg: PeftConfig, target_modules: list[str] | None = None) -> LoraConfig:
    """peft's LoraConfig from the recipe's `peft` section (`target_modules`: the model family's names for them)."""
    from peft import LoraConfig, TaskType

    if peft_cfg.method != "lora":
        raise RecipeError(f"`peft.method` = {peft_cfg.method!r}: only 'lora' is supported")
    return LoraConfig(task_type=TaskType.CAUSAL_LM, r=peft_cfg.r, lora_alpha=peft_cfg.alpha,
                      lora_dropout=peft_cfg.dropout, target_modules=list(target_modules or peft_cfg.target_modules))


def lora_targets(model, peft_cfg: PeftConfig) -> list[str]:
    """`peft.target_modules` in the model family's names: GPTNeoX's (the default) become Llama's q/k/v_proj, o_proj,
    gate/up_proj and down_proj on a Llama-family model; other names stand."""
    from neox_hf.model.spec import family_module_names

    try:
        return family_module_names(model, peft_cfg.target_modules)
    except (ValueError, AttributeError):  # a model of no known family: the names as written
        return list(peft_cfg.target_modules)


def wrap_with_peft(model, peft_cfg: PeftConfig) -> PeftModel:
    """The model with LoRA adapters on `peft.target_modules`; only adapter weights require grad.

    Call before `accelerator.prepare`, so the optimizer and DeepSpeed see only the adapter as trainable.
    Idempotent: an already wrapped model is returned as is (the loop and a caller may both wrap).
    """
    from peft import PeftModel, get_peft_model

    if isinstance(model, PeftModel):
        return model
    targets = lora_targets(model, peft_cfg)
    _check_targets_exist(model, targets)
    return get_peft_model(model, lora_config(peft_cfg, targets))


def _check_targets_exist(model, targets: list[str]) -> None:
    """peft matches a name exactly or as a dotted suffix ("dense" wraps `attention.dense`, not `dense_h_to_4h`)."""
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise RecipeError(f"`peft.target_modules` {missing} match no module of the model; "
                          f"the model's linear layers are {leaves}")


def trainable_parameters_report(model) -> str:
    """'trainable N / total M parameters (p%)': the start-up line that shows the base is frozen.

    Under ZeRO-3 a parameter's local tensor is a partition; `ds_numel` is its full size.
    """
    trainable = total = 0
    for param in model.parameters():
        n = getattr(param, "ds_numel", param.numel())
        total += n
        trainable += n if param.requires_grad else 0
    return f"peft: trainable {trainable:,} / total {total:,} parameters ({100.0 * trainable / max(total, 1):.4f}%)"


# ----------------------------------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------------------------------


def save_adapter(accelerator, model, out_dir, *, tokenizer=None, extra_files: dict[str, str] | None = None) -> Path:
    """adapter_config.json + adapter_model.safetensors (+ tokenizer) in `out_dir`. Collective: every rank calls it."""
    state_dict = accelerator.get_state_dict(model)  # gathers ZeRO-3 partitions; every rank must take part
    out = Path(out_dir)
    if accelerator.is_main_process:
        peft_model = accelerator.unwrap_model(model)
        _save_adapter_atomically(peft_model, out, state_dict, tokenizer, extra_files or {})
    accelerator.wait_for_everyone()
    return out


def _save_adapter_atomically(peft_model: PeftModel, out: Path, state_dict, tokenizer, extra_files: dict) -> None:
    with staging_folder(out) as staging:
        _record_absolute_base_path(peft_model)
        # state_dict holds base weights too; peft keeps only the adapter's keys.
        peft_model.save_pretrained(staging, state_dict=state_dict, safe_serialization=True, save_embedding_layers=False)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        for name, text in extra_files.items():
            (staging / name).write_text(text)
        if (out / ADAPTER_CONFIG).exists():
            os.remove(out / ADAPTER_CONFIG)  # not loadable until the new weights are in
        move_files_into(staging, out, last=ADAPTER_CONFIG)


def _record_absolute_base_path(peft_model: PeftModel) -> None:
    """A relative `model.from_pretrained` would make the adapter loadable only from the training directory."""
    for config in peft_model.peft_config.values():
        base = config.base_model_name_or_path
        if base and Path(base).is_dir():
            config.base_model_name_or_path = str(Path(base).resolve())


def save_finetuned(accelerator, model, tokenizer, recipe: Recipe) -> Path:
    """End of a PEFT run: the adapter in `output.dir`, and with `peft.merge` a merged plain folder in
    `output.dir/merged`. Returns the folder to load for inference. Collective."""
    out = save_adapter(accelerator, model, recipe.output.dir, tokenizer=tokenizer,
                       extra_files={RECIPE_NAME: recipe.to_yaml()})
    if not recipe.peft.merge:
        return out
    merged = out / MERGED_SUBDIR
    if accelerator.is_main_process:
        merge_adapter(_base_model_path(recipe), out, merged)
    accelerator.wait_for_everyone()
    return merged


def _base_model_path(recipe: Recipe) -> str:
    if not recipe.model.from_pretrained:
        raise RecipeError("`peft.merge: true` needs `model.from_pretrained` (the base folder the adapter is merged into)")
    return recipe.model.from_pretrained


def check_peft_recipe(recipe: Recipe) -> None:
    """Refuse before training what would only fail at the end: a merge without a base folder."""
    if recipe.peft.method is not None and recipe.peft.merge:
        _base_model_path(recipe)


# ----------------------------------------------------------------------------------------------------------------
# Merging
# ----------------------------------------------------------------------------------------------------------------


def merge_adapter(base_path, adapter_path, out_dir, *, force: bool = False, notices: list[str] | None = None) -> Path:
    """base + adapter merged into plain weights (`merge_and_unload`), saved as a stock GPTNeoX folder with the
    tokenizer of the adapter folder, else of the base folder, when one is there. An adapter whose
    adapter_config.json records another base is refused unless `force` (see `check_adapter_base`)."""
    if is_adapter_folder(adapter_path):  # else load_adapter_model says what the folder lacks
        check_model_folder(base_path)  # a missing base is "not found", not "another base"
        note = check_adapter_base(base_path, adapter_path, force=force)
        if note and notices is not None:
            notices.append(note)
    merged = load_adapter_model(base_path, adapter_path).merge_and_unload()
    tokenizer = folder_tokenizer(adapter_path) or folder_tokenizer(base_path)
    return save_hf_folder(merged, out_dir, tokenizer=tokenizer)


def check_adapter_base(base_path, adapter_path, *, force: bool = False) -> str | None:
    """Refuse to merge an adapter into a base other than the one its adapter_config.json records (peft merges any
    base of the same shapes, silently giving a model nobody trained). Returns a note when nothing can be compared
    (no base recorded) or when `force` overrides a mismatch; None when the bases agree."""
    recorded = _recorded_base(Path(adapter_path))
    if not recorded:
        return f"{adapter_path}/{ADAPTER_CONFIG} records no base model; merged into {base_path} unchecked"
    if _same_base(recorded, Path(base_path)):
        return None
    if force:
        return f"--force: adapter {adapter_path}, trained on {recorded}, merged into {base_path}"
    raise CheckpointError(f"adapter {adapter_path} was trained on {recorded} (its {ADAPTER_CONFIG} "
                          f"base_model_name_or_path), not on {base_path}; merge it into that base, or pass --force if "
                          "both are the same model")


def _recorded_base(adapter: Path) -> str | None:
    config_file = adapter / ADAPTER_CONFIG
    try:
        return json.loads(config_file.read_text()).get("base_model_name_or_path")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise CheckpointError(f"{config_file} is not a JSON object ({err}); save the adapter again") from err


def _same_base(recorded: str, base: Path) -> bool:
    if Path(recorded).exists():
        return Path(recorded).resolve() == base.resolve()  # one folder however spelled (relative, `..`, symlinks)
    # A Hub id (or a folder of another machine): the base is that name, a Hub cache snapshot of it, or a folder of
    # that name (what `huggingface-cli download ID --local-dir NAME` and copies between machines give).
    return recorded in (str(base), _hub_cache_repo_id(base)) or Path(recorded).name == base.resolve().name


def _hub_cache_repo_id(folder: Path) -> str | None:
    """`EleutherAI/pythia-14m` for a folder in huggingface_hub's cache (`models--EleutherAI--pythia-14m/snapshots/…`)."""
    for part in folder.resolve().parts:
        if part.startswith("models--"):
            return part[len("models--"):].replace("--", "/")
    return None


# ----------------------------------------------------------------------------------------------------------------
# `neox_hf merge BASE ADAPTER OUT`
# ----------------------------------------------------------------------------------------------------------------


def add_merge_arguments(parser) -> None:
    parser.add_argument("base", help="base model folder the adapter was trained on")
    parser.add_argument("adapter", help="adapter folder (adapter_config.json + adapter_model.safetensors)")
    parser.add_argument("out", help="output folder for the merged GPTNeoX model")
    parser.add_argument("--force", action="store_true",
                        help="merge even when the adapter's adapter_config.json records another base model")


def run_merge(args) -> int:
    notices: list[str] = []
    out = merge_adapter(args.base, args.adapter, args.out, force=args.force, notices=notices)
    for notice in notices:
        print(f"note: {notice}")
    print(f"merged model written to {out}")
    return 0
