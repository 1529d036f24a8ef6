"""Loading a saved model for inference: a full model folder, or an adapter folder (base + LoRA adapter), with its
tokenizer, so `neox_hf eval`, `neox_hf generate` and `neox_hf merge` accept both.

Gaps filled over transformers / peft: bad folders raise `CheckpointError` naming the folder and the fix instead of a
deep OSError or size-mismatch trace; peft only warns when an adapter's weights do not fit the base (its keys are
skipped), we refuse; and the model's embedding is checked to cover every id the tokenizer can emit.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPTNeoXForCausalLM

from neox_hf.errors import CheckpointError, UsageError, first_line
from neox_hf.model.vocab import check_vocab_covers_tokenizer
from neox_hf.data.tokenizer import load_tokenizer
from neox_hf.io import check_safetensors_file, folder_refusal_message, is_weights_only_refusal
from neox_hf.model.folder import from_pretrained_whole

if TYPE_CHECKING:  # imported where an adapter is loaded: peft costs every process ~1.4 s of start-up
    from peft import PeftModel

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_adapter_folder(path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def check_model_folder(path) -> Path:
    """A local folder with a GPTNeoX config.json, or CheckpointError naming the folder and the fix."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"model folder not found: {folder}")
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"model folder {folder} has no config.json: give a folder written by save_pretrained "
                              "(e.g. a training run's output.dir or `neox_hf merge` output)")
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise CheckpointError(f"{folder}/config.json is not a JSON object ({err}); save the model again") from err
    if model_type not in ("gpt_neox", "llama", "mistral", "mixtral", "gpt_neox_moe"):
        raise CheckpointError(f"{folder}/config.json has model_type {model_type!r}; neox_hf loads 'gpt_neox', "
                              "'llama', 'mistral', 'mixtral' and 'gpt_neox_moe' models")
    return folder


def load_base_model(path) -> GPTNeoXForCausalLM:
    """Stock GPTNeoXForCausalLM in fp32 from a model folder, or CheckpointError naming the folder."""
    folder = check_model_folder(path)
    try:
        # the stock class of the folder's model_type (GPTNeoX, Llama or Mistral; checked above), no remote code
        return from_pretrained_whole(AutoModelForCausalLM, folder, dtype=torch.float32, trust_remote_code=False)
    except CheckpointError:  # weights missing from a folder that loaded: its own line, not wrapped below
        raise
    except Exception as err:  # OSError, ValueError, RuntimeError, or safetensors' own error for a truncated file
        if is_weights_only_refusal(err):  # a pickled weights file naming code: say which, not torch's advice page
            raise CheckpointError(folder_refusal_message(folder, err)) from err
        raise CheckpointError(f"cannot load the model in {folder}: {first_line(err)}; save or download it again") from err


def load_adapter_model(base_path, adapter_path) -> PeftModel:
    """Base folder + adapter folder → PeftModel (inference mode)."""
    adapter = Path(adapter_path)
    if not is_adapter_folder(adapter):
        raise CheckpointError(f"{adapter} has no {ADAPTER_CONFIG}: give the folder a LoRA run (or save_adapter) wrote")
    from peft import PeftModel

    base = load_base_model(base_path)
    check_safetensors_file(adapter / ADAPTER_WEIGHTS)  # a damaged file names itself, not safetensors' bare error
    try:
        model = PeftModel.from_pretrained(base, adapter)
    except pickle.UnpicklingError as err:  # peft loads adapter_model.bin with weights_only=True
        raise CheckpointError(folder_refusal_message(adapter, err) if is_weights_only_refusal(err) else
                              f"cannot read the adapter weights in {adapter} ({first_line(err)}): the file is "
                              "truncated or corrupt; save the adapter again") from err
    except (OSError, ValueError, RuntimeError) as err:  # size mismatch when the adapter was trained on another base
        raise CheckpointError(f"adapter {adapter} does not fit base model {base_path}: {err}") from err
    _check_adapter_fits(model, adapter, base_path)
    return model


def _check_adapter_fits(model: PeftModel, adapter: Path, base_path) -> None:
    """peft only warns when adapter weights find no module of the base (another layer count or module names) and
    leaves those LoRA layers at their initial zero update: refuse, naming both folders."""
    weights = adapter / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"{adapter} has no {ADAPTER_WEIGHTS}: the adapter folder is incomplete; save it again")
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt") as stored_file:
            stored = set(stored_file.keys())
    except Exception as err:  # safetensors raises its own error type for a truncated header
        raise CheckpointError(f"cannot read {weights}: {err}. The file is corrupt; save the adapter again") from err
    expected = {name.replace(".default", "") for name, _ in model.named_parameters() if "lora_" in name}
    unmatched, untouched = stored - expected, expected - stored
    if unmatched or untouched:
        example = sorted(unmatched or untouched)[0]
        raise CheckpointError(
            f"adapter {adapter} does not fit base model {base_path}: {len(unmatched)} adapter weight(s) match no "
            f"module of the base and {len(untouched)} LoRA weight(s) of the base get none (e.g. {example}); "
            "use the base model the adapter was trained on"
        )


def adapter_base_path(adapter_path) -> str:
    """The base model folder an adapter folder records (adapter_config.json `base_model_name_or_path`)."""
    config_file = Path(adapter_path) / ADAPTER_CONFIG
    try:
        base = json.loads(config_file.read_text()).get("base_model_name_or_path")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise CheckpointError(f"{config_file} is not a JSON object ({err}); save the adapter again") from err
    if not base or not (Path(base) / "config.json").is_file():
        raise CheckpointError(f"{adapter_path}/{ADAPTER_CONFIG} names base model {base!r}, which is not a local model "
                              "folder; merge it first (`neox_hf merge BASE ADAPTER OUT`) and use the merged folder")
    return base


def folder_tokenizer(folder):
    """The tokenizer saved in `folder`, None when it has no tokenizer files; never runs code the folder ships."""
    if not (Path(folder) / "tokenizer.json").is_file() and not (Path(folder) / "tokenizer_config.json").is_file():
        return None
    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)  # None would ask on stdin
    except Exception as err:  # OSError, ValueError (custom code refused), or the tokenizers library's own error
        raise CheckpointError(f"cannot load the tokenizer in {folder}: {first_line(err)}; pass --tokenizer PATH "
                              "(a tokenizers JSON or HF folder)") from err


def inference_device(requested: str = "auto") -> torch.device:
    """`auto`: the GPU where torch sees one (eval and generate ran on the CPU whatever the machine), else the CPU."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA GPU here; use --device cpu (or auto)")
    return torch.device(requested)


def load_for_inference(model_path, tokenizer_path: str | None = None, *, device: str = "auto"):
    """(model in eval mode on `device`, tokenizer) from a model folder or an adapter folder; checks the vocab covers
    the tokenizer."""
    target = inference_device(device)
    folder = Path(model_path)
    if not folder.is_dir():
        raise CheckpointError(f"model folder not found: {folder}")
    if is_adapter_folder(folder):
        model = load_adapter_model(adapter_base_path(folder), folder)
    else:
        model = load_base_model(folder)
    tokenizer = _inference_tokenizer(folder, tokenizer_path)
    check_vocab_covers_tokenizer(model.config.vocab_size, tokenizer, where=str(folder))
    model.to(target).eval()
    return model, tokenizer


def _inference_tokenizer(folder: Path, tokenizer_path: str | None):
    if tokenizer_path:
        return load_tokenizer(tokenizer_path)
    if folder_tokenizer(folder) is None:
        raise CheckpointError(f"{folder} has no tokenizer files; pass --tokenizer PATH (a tokenizers JSON or HF folder)")
    return load_tokenizer(str(folder))

