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
- peft merges an adapter into any base of the same shapes; we compare the base with the one adapter_config.json
  records (`base_model_name_or_path`), by config and weights where that base is here, and refuse another model unless
  forced.

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


def save_adapter(accelerator, model, out_dir, *, tokenizer=None, extra_files: dict[str, str] | None = None,
                 state_dict: dict | None = None) -> Path:
    """adapter_config.json + adapter_model.safetensors (+ tokenizer) in `out_dir`. Collective: every rank calls it.
    `state_dict`: the whole model's, complete on the main process (the engine's `full_state_dict`: FSDP2's DTensors
    gathered); by default Accelerate's."""
    if state_dict is None:
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


def save_finetuned(accelerator, model, tokenizer, recipe: Recipe, *, state_dict: dict | None = None) -> Path:
    """End of a PEFT run: the adapter in `output.dir`, and with `peft.merge` a merged plain folder in
    `output.dir/merged`. Returns the folder to load for inference. Collective (`state_dict`: as `save_adapter`)."""
    out = save_adapter(accelerator, model, recipe.output.dir, tokenizer=tokenizer,
                       extra_files={RECIPE_NAME: recipe.to_yaml()}, state_dict=state_dict)
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
    """Refuse to merge an adapter into a model other than the one it was trained on (peft merges any base of the same
    shapes, silently giving a model nobody trained), comparing models, not paths.

    The base its adapter_config.json records (`base_model_name_or_path`) is looked for locally: that folder, or that
    Hub id in the Hugging Face cache (never downloaded). Found, it is compared with `base_path` by architecture and
    shapes (config.json) and by a fingerprint of every weight: the same model at another path merges (with a note),
    another one is refused naming the first tensor that differs. Not found, only what the adapter itself shows can be
    checked (its LoRA tensors' shapes against the base's weights): a base of that name merges with a note saying the
    weights went unchecked, another name is refused. `force` merges anyway, with a note. Returns a note, or None when
    the base is the recorded folder itself."""
    adapter, base = Path(adapter_path), Path(base_path)
    adapter_config = _adapter_config(adapter)
    recorded = adapter_config.get("base_model_name_or_path")
    if not recorded:
        return f"{adapter_path}/{ADAPTER_CONFIG} records no base model; merged into {base_path} unchecked"
    trained_on = _local_base(recorded, adapter_config.get("revision"))
    if trained_on is not None:
        if trained_on.resolve() == base.resolve():  # one folder however spelled (relative, `..`, symlinks)
            return None
        difference = model_difference(trained_on, base)
        if difference is None:
            return (f"adapter {adapter_path} was trained on {recorded}; {base_path} is the same model (architecture, "
                    "shapes and every weight compared)")
        if force:
            return f"--force: adapter {adapter_path}, trained on {recorded}, merged into {base_path} ({difference})"
        raise CheckpointError(f"adapter {adapter_path} was trained on {recorded}, and {base_path} is another model: "
                              f"{difference}; merge it into {recorded}, or pass --force to merge it into this one")
    misfit = _adapter_class_misfit(adapter_config, base) or _adapter_shape_misfit(adapter, base)
    if misfit is not None:  # no base of any name takes it; peft would stop on a size mismatch
        raise CheckpointError(f"adapter {adapter_path} does not fit base model {base_path}: {misfit}; use the base "
                              f"model the adapter was trained on ({recorded})")
    unreachable = (f"{recorded}, the base the adapter records, is not here (no such folder, not in the Hugging Face "
                   "cache; nothing is downloaded), so the weights cannot be compared")
    if _same_name(recorded, base):
        return f"{unreachable}: {base_path} has its name and the adapter's shapes, merged on that"
    if force:
        return f"--force: adapter {adapter_path}, trained on {recorded}, merged into {base_path} ({unreachable})"
    raise CheckpointError(f"adapter {adapter_path} was trained on {recorded}, not on {base_path}: {unreachable}; "
                          f"merge it into a copy of {recorded}, or pass --force if both are the same model")


def _adapter_config(adapter: Path) -> dict:
    config_file = adapter / ADAPTER_CONFIG
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{config_file} is not a JSON object ({err}); save the adapter again") from err
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file} is not a JSON object; save the adapter again")
    return config


def _local_base(recorded: str, revision: str | None = None) -> Path | None:
    """The recorded base's folder here: the path itself, or the Hub id's snapshot in the Hugging Face cache (looked up,
    never downloaded); None where neither holds a model (a config.json and its weights) to compare."""
    folder = Path(recorded)
    if not (folder / "config.json").is_file():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(recorded, "config.json", revision=revision)
        except ValueError:  # not a Hub id either (e.g. an absolute path of another machine): huggingface_hub refuses it
            return None
        if not isinstance(cached, str):
            return None
        folder = Path(cached).parent
    has_weights = _weight_files(folder, "model.safetensors") or _weight_files(folder, "pytorch_model.bin")
    return folder if has_weights else None


def _same_name(recorded: str, base: Path) -> bool:
    # A Hub id (or a folder of another machine): the base is that name, a Hub cache snapshot of it, or a folder of
    # that name (what `huggingface-cli download ID --local-dir NAME` and copies between machines give).
    return recorded in (str(base), _hub_cache_repo_id(base)) or Path(recorded).name == base.resolve().name


def _hub_cache_repo_id(folder: Path) -> str | None:
    """`EleutherAI/pythia-14m` for a folder in huggingface_hub's cache (`models--EleutherAI--pythia-14m/snapshots/…`)."""
    for part in folder.resolve().parts:
        if part.startswith("models--"):
            return part[len("models--"):].replace("--", "/")
    return None


# config.json keys that make two models' architecture and shapes differ (the weights' fingerprint covers the rest)
ARCHITECTURE_KEYS = ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "intermediate_size", "tie_word_embeddings",
                     "rotary_pct", "use_parallel_residual", "hidden_act")


def model_difference(first: Path, second: Path) -> str | None:
    """None when the two model folders hold the same model: the same architecture and shapes in config.json and the
    same value in every weight (dtypes aside); else what differs first, naming the key or tensor."""
    configs = [_config(folder) for folder in (first, second)]
    for key in ARCHITECTURE_KEYS:
        if configs[0].get(key) != configs[1].get(key):
            return f"config.json {key} is {configs[0].get(key)!r} in {first}, {configs[1].get(key)!r} in {second}"
    fingerprints = [weight_fingerprint(folder) for folder in (first, second)]
    for name in sorted(fingerprints[0].keys() | fingerprints[1].keys()):
        here, there = (f.get(name) for f in fingerprints)
        if here is None or there is None:
            return f"tensor {name} is only in {first if there is None else second}"
        if here[0] != there[0]:
            return f"tensor {name} has shape {list(here[0])} in {first}, {list(there[0])} in {second}"
        if here[1] != there[1]:
            return f"tensor {name} holds other values in {second} than in {first}"
    return None


def _config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {folder}/config.json ({err}); save or download the model again") from err
    if not isinstance(config, dict):
        raise CheckpointError(f"{folder}/config.json is not a JSON object; save or download the model again")
    return config


def weight_fingerprint(folder: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """tensor name → (shape, digest of its fp32 values) of a model folder's weights, streamed one tensor at a time
    (safetensors, sharded or not; a pytorch_model.bin memory-mapped). fp32 values: a bf16 copy saved as fp32 is the
    same model."""
    import hashlib

    def digest(tensor: torch.Tensor) -> tuple[tuple[int, ...], str]:
        data = tensor.detach().to(torch.float32).contiguous().numpy().tobytes()
        return tuple(tensor.shape), hashlib.blake2b(data, digest_size=16).hexdigest()

    fingerprint = {}
    safetensors_files = _weight_files(folder, "model.safetensors")
    if safetensors_files:
        from safetensors import safe_open

        for path in safetensors_files:
            try:
                with safe_open(str(path), framework="pt") as stored:
                    for name in stored.keys():
                        fingerprint[name] = digest(stored.get_tensor(name))
            except Exception as err:  # safetensors raises its own error type for a truncated file
                raise CheckpointError(f"cannot read {path}: {err}; save or download the model again") from err
        return fingerprint
    for path in _weight_files(folder, "pytorch_model.bin"):
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as err:  # a pickle naming code, or a truncated file
            raise CheckpointError(f"cannot read {path} ({type(err).__name__}); save the model as safetensors") from err
        fingerprint.update((name, digest(tensor)) for name, tensor in state.items())
    if not fingerprint:
        raise CheckpointError(f"model folder {folder} has no weights (model.safetensors or pytorch_model.bin); save "
                              "or download the model again")
    return fingerprint


def _weight_files(folder: Path, name: str) -> list[Path]:
    """`name` in `folder`, or the shards its `name`.index.json lists (save_pretrained's sharded form)."""
    index = folder / f"{name}.index.json"
    if index.is_file():
        return [folder / shard for shard in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [folder / name] if (folder / name).is_file() else []


def _adapter_class_misfit(adapter_config: dict, base: Path) -> str | None:
    """The model class peft recorded for the adapter's base (`auto_mapping.base_model_class`) where the base's
    config.json names other architectures; None when they agree or either is silent."""
    trained = (adapter_config.get("auto_mapping") or {}).get("base_model_class")
    architectures = _config(base).get("architectures") or []
    if trained and architectures and trained not in architectures:
        return f"it was trained on a {trained}, the base is a {' / '.join(map(str, architectures))}"
    return None


def _adapter_shape_misfit(adapter: Path, base: Path) -> str | None:
    """The first LoRA tensor of the adapter that no weight of the base takes (lora_A is [r, in], lora_B [out, r] of
    the base's [out, in] weight), None when every one fits; from the files' headers, nothing is loaded."""
    from safetensors import safe_open

    weights = adapter / ADAPTER_WEIGHTS
    shapes = _base_weight_shapes(base)
    if not weights.is_file() or shapes is None:  # loading reports a missing file, or checks a .bin base
        return None
    with safe_open(str(weights), framework="pt") as stored:
        for name in sorted(stored.keys()):
            module, _, kind = name.removeprefix("base_model.model.").rpartition(".lora_")
            if not module:
                continue
            target = shapes.get(f"{module}.weight")
            shape = stored.get_slice(name).get_shape()
            if target is None:
                return f"its {name} finds no weight {module}.weight in the base"
            if (kind.startswith("A") and shape[1] != target[1]) or (kind.startswith("B") and shape[0] != target[0]):
                return f"its {name} has shape {list(shape)}, the base's {module}.weight {list(target)}"
    return None


def _base_weight_shapes(folder: Path) -> dict[str, list[int]] | None:
    from safetensors import safe_open

    files = _weight_files(folder, "model.safetensors")
    if not files:
        return None
    shapes = {}
    for path in files:
        with safe_open(str(path), framework="pt") as stored:
            shapes.update((name, stored.get_slice(name).get_shape()) for name in stored.keys())
    return shapes


# ----------------------------------------------------------------------------------------------------------------
# `neox_hf merge BASE ADAPTER OUT`
# ----------------------------------------------------------------------------------------------------------------


def add_merge_arguments(parser) -> None:
    parser.add_argument("base", help="base model folder the adapter was trained on")
    parser.add_argument("adapter", help="adapter folder (adapter_config.json + adapter_model.safetensors)")
    parser.add_argument("out", help="output folder for the merged GPTNeoX model")
    parser.add_argument("--force", action="store_true",
                        help="merge even into another model than the base the adapter's adapter_config.json "
                             "records, or when that base is not here to compare")


def run_merge(args) -> int:
    notices: list[str] = []
    out = merge_adapter(args.base, args.adapter, args.out, force=args.force, notices=notices)
    for notice in notices:
        print(f"note: {notice}")
    print(f"merged model written to {out}")
    return 0
