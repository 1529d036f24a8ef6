"""Whole-folder conversions behind the CLI: GPT-NeoX checkpoint → HF folder, HF folder → GPT-NeoX checkpoint,
resumable training checkpoint → consolidated HF folder.

Each reads one format, builds our model, and writes through `save_hf_folder` (atomic, stock-loadable).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import torch

from neox_hf.errors import CheckpointError, first_line
from neox_hf.model.folder import save_hf_folder
from neox_hf.interop.neox_checkpoint import export_neox_checkpoint, neox_to_hf_model
from neox_hf.interop.neox_files import detect_checkpoint_files, embedding_rows
from neox_hf.model.vocab import check_vocab_covers_tokenizer, padded_vocab_size
from neox_hf.data.tokenizer import load_tokenizer
from neox_hf.io import folder_refusal_message, is_weights_only_refusal, weights_only_loads
from neox_hf.model.spec import config_class_for_folder, config_from_recipe, model_class_for_config
from neox_hf.model.folder import from_pretrained_whole


def neox_recipe_and_tokenizer(neox_config_paths: list[str], tokenizer_path: str | None = None):
    """(recipe, tokenizer or None) of GPT-NeoX YAML files: the tokenizer is `tokenizer_path`, else the config's
    vocab_file; a config that names none gets None (not our recipe's default GPT-NeoX-20B tokenizer, which would
    impose its 50,304 rows on a checkpoint of another vocabulary)."""
    from neox_hf.neox_yaml import load_neox_recipe_dict
    from neox_hf.recipe import recipe_from_dict

    translated = load_neox_recipe_dict(neox_config_paths).recipe
    recipe = recipe_from_dict(translated, source=", ".join(map(str, neox_config_paths)))
    path = tokenizer_path or _named_vocab_file(translated.get("tokenizer", {}).get("path"))
    return recipe, (load_tokenizer(path) if path else None)


def _named_vocab_file(vocab_file: str | None) -> str | None:
    # A vocab_file that is named but absent (a machine without the training data) is refused, not replaced by the
    # checkpoint's vocabulary: the folder would silently lose the tokenizer the config asked for.
    if vocab_file is not None and not Path(vocab_file).exists():
        raise CheckpointError(f"the GPT-NeoX config's vocab_file {vocab_file} is not here; pass --tokenizer PATH "
                              "(the tokenizers JSON the model was trained with)")
    return vocab_file


def neox_hf_config(recipe, tokenizer=None, *, vocab_size: int | None = None):
    """HF config of a translated GPT-NeoX recipe: the vocabulary padded from the tokenizer as GPT-NeoX did, or without
    a tokenizer `vocab_size` (the checkpoint's embedding rows) and no special token ids."""
    if tokenizer is None:
        # GPT-NeoX's own tokenizers put <|endoftext|> at 0; without the tokenizer no id is claimed.
        return config_from_recipe(recipe.model, vocab_size=vocab_size, bos_token_id=None, eos_token_id=None)
    vocab = padded_vocab_size(len(tokenizer), recipe.model.make_vocab_size_divisible_by, recipe.parallel.tensor_parallel)
    return config_from_recipe(recipe.model, vocab_size=vocab, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def convert_neox_checkpoint(checkpoint_dir, neox_config_paths: list[str], out_dir, *, tokenizer_path: str | None = None,
                            trust_pickle: bool = False, notices: list[str] | None = None) -> Path:
    """GPT-NeoX `global_stepN/` (pipeline or sequential layout, any TP) → an HF folder, with its tokenizer when one is
    given (`tokenizer_path`) or named by the config's vocab_file; otherwise weights and config only, the vocabulary
    size read from the checkpoint's embedding (a line saying so is appended to `notices`)."""
    recipe, tokenizer = neox_recipe_and_tokenizer(neox_config_paths, tokenizer_path)
    rows = None if tokenizer else embedding_rows(detect_checkpoint_files(checkpoint_dir), trust_pickle=trust_pickle)
    config = neox_hf_config(recipe, tokenizer, vocab_size=rows)
    model = neox_to_hf_model(checkpoint_dir, config, model_class=model_class_for_config(config), trust_pickle=trust_pickle)
    if tokenizer is None:
        if notices is not None:
            notices.append(f"no tokenizer (no --tokenizer, and the config names no vocab_file): vocabulary size {rows} "
                           "read from the checkpoint's embedding; no tokenizer files written, no special token ids "
                           "in config.json. Pass --tokenizer PATH to include them")
        return save_hf_folder(model, out_dir)
    check_vocab_covers_tokenizer(model.config.vocab_size, tokenizer, where=str(checkpoint_dir))
    return save_hf_folder(model, out_dir, tokenizer=tokenizer)


def export_hf_to_neox(hf_folder, out_dir, *, tp_size: int = 1, step: int = 0) -> str:
    """HF GPTNeoX or Llama-family folder → GPT-NeoX sequential-layout checkpoint for `tp_size` ranks."""
    from neox_hf.inference import check_model_folder

    if tp_size < 1:
        raise CheckpointError(f"--tp must be ≥ 1, got {tp_size}")
    if not _is_llama_folder(hf_folder):
        check_model_folder(hf_folder)
    try:
        model_class = model_class_for_config(config_class_for_folder(str(hf_folder)).from_pretrained(hf_folder))
        model = from_pretrained_whole(model_class, hf_folder, dtype="auto")
    except CheckpointError:
        raise
    except (OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"cannot load the model in {hf_folder}: {err}") from err
    return export_neox_checkpoint(model, model.config, out_dir, tp_size=tp_size, step=step)


def _is_llama_folder(folder) -> bool:
    import json

    config = Path(folder) / "config.json"
    try:
        return json.loads(config.read_text()).get("model_type") in ("llama", "mistral")
    except (OSError, ValueError, AttributeError):
        return False


def training_checkpoint_state_dict(checkpoint_dir: Path, config=None) -> dict[str, torch.Tensor]:
    """Full weights from a training checkpoint: its layout-free state where it has one (fp32 masters under their
    transformers names, whatever layout wrote them), else the accelerate/DeepSpeed files (ZeRO partitions gathered on
    CPU; pipeline stages' layer files and their tensor-parallel shards merged, which needs the checkpoint's
    `config`)."""
    from neox_hf.checkpoint.layout_free import has_layout_free_state, read_model_weights

    if has_layout_free_state(checkpoint_dir):
        return read_model_weights(checkpoint_dir)
    deepspeed_tag = checkpoint_dir / "pytorch_model"
    if deepspeed_tag.is_dir():
        from neox_hf.engines.pipeline import is_pipeline_checkpoint, pipeline_checkpoint_state_dict

        if is_pipeline_checkpoint(deepspeed_tag):
            # The module weights of every stage (in the training dtype; the fp32 masters are ZeRO optimizer state).
            return pipeline_checkpoint_state_dict(deepspeed_tag, config or
                                                  config_class_for_folder(str(checkpoint_dir)).from_pretrained(checkpoint_dir))
        try:
            with weights_only_loads(deepspeed=True):  # zero_to_fp32 loads its files with weights_only=False
                return zero_checkpoint_state_dict(deepspeed_tag)
        except Exception as err:
            if is_weights_only_refusal(err):
                raise CheckpointError(folder_refusal_message(checkpoint_dir, err, deepspeed=True)) from err
            raise
    weights = checkpoint_dir / "model.safetensors"
    if weights.is_file():
        from safetensors.torch import load_file

        return load_file(weights)
    raise CheckpointError(f"{checkpoint_dir} holds neither a DeepSpeed checkpoint (pytorch_model/) nor model.safetensors; "
                          "give a checkpoints/step_* folder written by neox_hf")


_MP_RANK = re.compile(r"mp_rank_(\d+)_")


def zero_checkpoint_state_dict(engine_dir: Path) -> dict[str, torch.Tensor]:
    """Weights of a DeepSpeed engine folder (not a pipeline), each tensor-parallel rank's shards concatenated along
    the TP plan's dimensions: the fp32 masters DeepSpeed's zero_to_fp32 gathers from the ZeRO partitions, or under
    ZeRO stage 0 (no partitions) the module weights of the model-states files, in the training dtype.

    Gaps filled: zero_to_fp32 reads one model-parallel rank (given a TP checkpoint it counts every rank's optimizer
    files as data-parallel partitions and refuses) and no stage-0 checkpoint. It reads a folder, so each TP rank is
    shown a folder of links holding only that rank's files, under rank 0's names. Call inside `weights_only_loads`."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ranks = sorted({int(m[1]) for p in engine_dir.glob("*model_states.pt") if (m := _MP_RANK.search(p.name))})
    if not any(engine_dir.glob("*optim_states.pt")):
        return _merge_tp_shards([torch.load(engine_dir / f"mp_rank_{rank:02d}_model_states.pt", map_location="cpu",
                                            weights_only=True)["module"] for rank in ranks])
    if len(ranks) <= 1:
        return get_fp32_state_dict_from_zero_checkpoint(str(engine_dir.parent), tag=engine_dir.name)
    shards = []
    for rank in ranks:
        with tempfile.TemporaryDirectory() as view:
            (Path(view) / engine_dir.name).mkdir()
            for path in engine_dir.glob(f"*mp_rank_{rank:02d}_*"):
                (Path(view) / engine_dir.name / path.name.replace(f"mp_rank_{rank:02d}_", "mp_rank_00_")).symlink_to(
                    path.resolve())
            shards.append(get_fp32_state_dict_from_zero_checkpoint(view, tag=engine_dir.name))
    return _merge_tp_shards(shards)


def _merge_tp_shards(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    from neox_hf.parallel.tp_plan import partition_dim

    if len(shards) == 1:
        return shards[0]
    return {key: value if (dim := partition_dim(key)) is None else torch.cat([s[key] for s in shards], dim=dim)
            for key, value in shards[0].items()}


def export_training_checkpoint(checkpoint_dir, out_dir) -> Path:
    """`neox_hf export`: a resumable checkpoint (any ZeRO stage) → consolidated HF folder with tokenizer."""
    from neox_hf.checkpoint import checkpoint_to_read, first_unreadable_file, previous_checkpoint

    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"checkpoint folder not found: {checkpoint_dir}; give a checkpoints/step_* folder or "
                              "the checkpoints/ folder of a run")
    if (checkpoint_dir / "checkpoints").is_dir():
        raise CheckpointError(f"{checkpoint_dir} is a run's output folder (already a Hugging Face model folder when the "
                              f"run finished); to export a checkpoint give `neox_hf export {checkpoint_dir / 'checkpoints'} OUT`")
    checkpoint_dir = checkpoint_to_read(checkpoint_dir)
    if (checkpoint_dir / "config.json").is_file() and not list(checkpoint_dir.glob("trainer_state_rank*.pt")):
        raise CheckpointError(f"{checkpoint_dir} is a Hugging Face model folder, not a training checkpoint: load it "
                              "with from_pretrained as it is (nothing to export)")
    if not (checkpoint_dir / "config.json").is_file():
        raise CheckpointError(f"{checkpoint_dir / 'config.json'} is missing: not a neox_hf training checkpoint")
    config = config_class_for_folder(str(checkpoint_dir)).from_pretrained(checkpoint_dir)
    _refuse_truncated_layout_free_state(checkpoint_dir)
    try:
        state = training_checkpoint_state_dict(checkpoint_dir, config)
    except CheckpointError:
        raise
    except Exception as err:  # safetensors, torch's zip reader, zero_to_fp32: their own types, no file named
        damaged = first_unreadable_file(checkpoint_dir)
        if damaged is None:
            raise
        previous = previous_checkpoint(checkpoint_dir)
        raise CheckpointError(f"cannot export {checkpoint_dir}: {damaged} is truncated or corrupt "
                              f"({_first_sentence(err)})" + (f"; export the previous checkpoint, {previous}" if previous
                                                         else "")) from err
    model = _model_for_weights(checkpoint_dir, config, state)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise CheckpointError(f"{checkpoint_dir}: weights do not match its config (missing {missing[:5]}, unexpected {unexpected[:5]})")
    tokenizer = load_tokenizer(str(checkpoint_dir)) if (checkpoint_dir / "tokenizer.json").is_file() else None
    return save_hf_folder(model, out_dir, tokenizer=tokenizer)


def _model_for_weights(checkpoint_dir: Path, config, state: dict):
    """The empty model `state` fills: a reward model's weights (`score.weight`, no LM head) go into stock
    AutoModelForSequenceClassification, as an rm run saves its final folder (the checkpoint's config.json may still
    name the causal LM the run started from); others into our CausalLM for `config`."""
    if "score.weight" in state and not {"lm_head.weight", "embed_out.weight"} & state.keys():
        from transformers import AutoConfig, AutoModelForSequenceClassification

        stock = AutoConfig.from_pretrained(checkpoint_dir, num_labels=state["score.weight"].shape[0])
        return AutoModelForSequenceClassification.from_config(stock, dtype=torch.float32)
    return model_class_for_config(config)(config)


def _refuse_truncated_layout_free_state(checkpoint_dir: Path) -> None:
    from neox_hf.checkpoint import previous_checkpoint
    from neox_hf.checkpoint.layout_free import has_layout_free_state, truncated_file

    damaged = truncated_file(checkpoint_dir) if has_layout_free_state(checkpoint_dir) else None
    if damaged is not None:
        previous = previous_checkpoint(checkpoint_dir)
        raise CheckpointError(f"cannot export {checkpoint_dir}: {damaged} is truncated or corrupt"
                              + (f"; export the previous checkpoint, {previous}" if previous else ""))


def _first_sentence(err: BaseException) -> str:
    """The first sentence of the first line (torch's zip reader appends a paragraph of advice)."""
    return first_line(err).split(". ")[0].rstrip(".")
