"""What a run can decide before it builds its model is refused before: each optimizer's hyperparameters in its
library's own range (at recipe validation), and the settings the engines refused only once the model existed
(FSDP2's tied embeddings and HSDP replicas, adam8bit on CPU, a pretrained folder's family and head counts, a frozen
reference under a sharded layout, the pipeline's partition) — through `run_clm_neox.py`'s entry function in this
process, each one line with exit 2, before the Accelerator exists, in well under 10 s. A resume under another global
batch says so, naming both and what it changes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest
import torch

os.environ.setdefault("WANDB_DISABLED", "true")

from neox_hf.errors import RecipeError
from tests.conftest import BUNDLED_TOKENIZER, REPO
from tests.test_fuzz_inputs import assert_one_line_error, run_train

TINY = str(REPO / "recipes" / "tiny.yaml")
FAST = ["--train.precision", "fp32", "--train.train_iters", "2", "--train.eval_iters", "0"]


# ----------------------------------------------------------------------------------------------------------------
# 1. Optimizer hyperparameters: refused at validation wherever the library would refuse them when built


def _library_accepts(kind: str, train) -> bool:
    """Whether the library's own constructor takes `train`'s hyperparameters, each passed as its argument (the
    constructors check their arguments, not the values of parameter groups)."""
    from lion_pytorch import Lion
    from pytorch_optimizer import SM3

    params = [torch.nn.Parameter(torch.zeros(2, 2))]
    betas, eps, decay = (train.adam_beta1, train.adam_beta2), train.adam_eps, train.weight_decay
    build = {"adamw": lambda: torch.optim.AdamW(params, lr=0.1, betas=betas, eps=eps, weight_decay=decay),
             "adam": lambda: torch.optim.Adam(params, lr=0.1, betas=betas, eps=eps, weight_decay=decay),
             "sgd": lambda: torch.optim.SGD(params, lr=0.1, momentum=train.momentum, weight_decay=decay),
             "lion": lambda: Lion(params, lr=0.1, betas=betas, weight_decay=decay),
             "sm3": lambda: SM3(params, lr=0.1, momentum=train.momentum, beta=train.sm3_beta, eps=eps)}[kind]
    try:
        build()
    except (ValueError, AssertionError):  # torch / pytorch-optimizer raise ValueError, lion-pytorch asserts
        return False
    return True


def _validation_refusal(kind: str, key: str, value: float) -> str | None:
    from neox_hf.recipe import recipe_from_dict

    try:
        recipe_from_dict({"train": {"optimizer": kind, key: value, "lr": 0.1, "min_lr": 0.01}})
    except RecipeError as err:
        return str(err)
    return None


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd", "lion", "sm3"])  # adam8bit: bitsandbytes, CUDA only
def test_each_optimizer_s_keys_are_refused_where_its_library_refuses_them(kind):
    from neox_hf.recipe import TrainConfig
    from neox_hf.recipe.checks import OPTIMIZER_RANGES

    library, ranges = OPTIMIZER_RANGES[kind]
    for key, allowed in ranges.items():
        for value in (-0.5, 0.0, 0.5, 0.999, 1.0, 1.5, 5.0):
            theirs = _library_accepts(kind, dataclasses.replace(TrainConfig(), optimizer=kind, lr=0.1, **{key: value}))
            refusal = _validation_refusal(kind, key, value)
            if not theirs:  # everything the library refuses after the model is built is refused before
                assert refusal is not None, (kind, key, value)
            if refusal is not None and theirs:  # refused beyond the library's range: only with the reason why
                assert allowed.why and allowed.why in refusal, (kind, key, value, refusal)
            if refusal is not None and f"train.{key}`" in refusal:  # the key, the value, the range, the library
                assert f"is {value:g};" in refusal and allowed.describe() in refusal and library in refusal, refusal


def test_sm3_momentum_and_sgd_momentum_are_refused_in_one_line(capsys):
    # was: ValueError from inside pytorch-optimizer after the model was built; SGD momentum 5 trained and diverged
    code, err = run_train([TINY, *FAST, "--train.optimizer", "sm3", "--train.momentum", "1.5"], capsys)
    assert_one_line_error(code, err, "`train.momentum` (GPT-NeoX optimizer.params.momentum) is 1.5; "
                                     "`train.optimizer: sm3` (pytorch_optimizer.SM3) needs it in [0, 1)")
    code, err = run_train([TINY, "--print-config", "--train.optimizer", "sgd", "--train.momentum", "5"], capsys)
    assert_one_line_error(code, err, "`train.momentum` (GPT-NeoX optimizer.params.momentum) is 5; "
                                     "`train.optimizer: sgd` (torch.optim.SGD) needs it in [0, 1)")


def test_a_gpt_neox_optimizer_block_out_of_range_is_refused_naming_both_keys():
    from neox_hf.neox_yaml import translate_neox_args
    from neox_hf.recipe import recipe_from_dict

    raw = translate_neox_args({"optimizer": {"type": "sm3", "params": {"lr": 0.1, "momentum": 1.5}}}).recipe
    with pytest.raises(RecipeError, match=r"`train.momentum` \(GPT-NeoX optimizer.params.momentum\) is 1.5"):
        recipe_from_dict(raw)


# ----------------------------------------------------------------------------------------------------------------
# 2. Decidable before the model is built: refused before the Accelerator exists


def _folder(path, **config):
    """A model folder holding only config.json: enough for what is refused before any weight is read."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _neox_config(**overrides) -> dict:
    return {"model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
            "intermediate_size": 256, "vocab_size": 50304, "max_position_embeddings": 128, **overrides}


def _pairs(tmp_path) -> str:
    from tests.test_reliability_third import _pair

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(_pair(i)) + "\n" for i in range(8)))
    return str(path)


PAD = ["--data.mode", "pad", "--train.micro_batch_size", "2"]

# id → (arguments after recipes/tiny.yaml given tmp_path, the needle of the one error line)
BEFORE_BUILD = {
    "fsdp2-tied-recipe": (lambda tmp: ["--parallel.backend", "fsdp2", "--model.tie_word_embeddings", "true"],
                          "tied input and output embeddings (the recipe"),
    "fsdp2-tied-folder": (lambda tmp: ["--parallel.backend", "fsdp2", "--model.from_pretrained",
                                       _folder(tmp / "tied", **_neox_config(tie_word_embeddings=True))],
                          "config.json: tie_word_embeddings true) with `parallel.backend: fsdp2` are refused"),
    "fsdp2-dp-replicate": (lambda tmp: ["--parallel.backend", "fsdp2", "--parallel.dp_replicate", "2"],
                           "`parallel.dp_replicate: 2` must divide the 1 data-parallel processes of this launch"),
    "adam8bit-on-cpu": (lambda tmp: ["--train.optimizer", "adam8bit"], "runs on CUDA GPUs only"),
    "folder-bert": (lambda tmp: ["--model.from_pretrained", _folder(tmp / "bert", model_type="bert")],
                    "is a 'bert' model (config.json model_type), which neox_hf does not train"),
    "folder-t5": (lambda tmp: ["--model.from_pretrained", _folder(tmp / "t5", model_type="t5")],
                  "is a 't5' model"),
    "folder-heads-vs-tp": (lambda tmp: ["--parallel.tensor_parallel", "2", "--model.from_pretrained",
                                        _folder(tmp / "three", **_neox_config(num_attention_heads=3, hidden_size=48))],
                           "`parallel.tensor_parallel: 2` does not divide"),
    "peft-merge-from-scratch": (lambda tmp: ["--peft.method", "lora", "--peft.merge", "true"],
                                "`peft.merge: true` needs `model.from_pretrained`"),
    "kto-frozen-under-zero3": (lambda tmp: ["--train.objective", "kto", "--parallel.zero_stage", "3", *PAD,
                                            "--model.from_pretrained", _folder(tmp / "lm", **_neox_config()),
                                            "--data.sources", f"[{{path: {_pairs(tmp)}}}]"],
                               "`train.objective: kto` keeps a frozen copy"),
    "dpo-reference-model-not-the-start": (lambda tmp: ["--train.objective", "dpo", *PAD, "--model.from_pretrained",
                                                       _folder(tmp / "start", **_neox_config()),
                                                       "--train.dpo_reference_model", _folder(tmp / "other", **_neox_config()),
                                                       "--data.sources", f"[{{path: {_pairs(tmp)}}}]"],
                                          "`train.dpo_reference_model` differing from `model.from_pretrained`"),
    "pipeline-partition": (lambda tmp: ["--parallel.pipeline_parallel", "2", "--parallel.pipe_partition_method",
                                        "type:nothing"], "matches none of the pipeline layers"),
}


@pytest.mark.parametrize("case", sorted(BEFORE_BUILD))
def test_what_is_decidable_before_the_model_is_refused_before_it(case, tmp_path, capsys, fresh_accelerate_state):
    from accelerate.state import PartialState

    import neox_hf.train.loop  # noqa: F401 — imported before the clock starts: the refusal is timed, not the imports
    from tests.conftest import reset_accelerate_state

    arguments, needle = BEFORE_BUILD[case]
    argv = [TINY, *FAST, "--output.dir", str(tmp_path / "out"), *arguments(tmp_path)]
    reset_accelerate_state()
    start = time.perf_counter()
    code, err = run_train(argv, capsys)
    took = time.perf_counter() - start
    assert_one_line_error(code, err, needle)
    assert not PartialState._shared_state, "the Accelerator was built before the refusal"
    assert not (tmp_path / "out").exists()  # nothing written, not even the run's lock
    assert took < 10, took  # the bound (a tiny model's build took 56 s under a launch); here ~0.1 s


def test_the_unsupported_family_message_lists_the_registered_families():
    from neox_hf.model.spec import SPECS, spec_for_model_type

    with pytest.raises(RecipeError) as refused:
        spec_for_model_type("bert", where="the folder")
    message = str(refused.value)
    assert all(spec.family in message and all(t in message for t in spec.model_types) for spec in SPECS.values())


# ----------------------------------------------------------------------------------------------------------------
# 3. A resume under another global batch says so


def test_global_batch_note_names_both_and_what_changes():
    from neox_hf.checkpoint import TrainState
    from neox_hf.recipe import TrainConfig
    from neox_hf.train.guards import global_batch_change_note

    train = TrainConfig(micro_batch_size=2, gradient_accumulation_steps=1, train_iters=10)
    assert global_batch_change_note(TrainState(step=4, consumed_samples=16, global_batch=2), train, 1) is None
    assert global_batch_change_note(TrainState(step=4, consumed_samples=16), train, 1) is None  # not recorded
    note = global_batch_change_note(TrainState(step=4, consumed_samples=16, global_batch=4), train, 1)
    assert note.startswith("the global batch changes from the checkpoint's 4 to 2 samples per step (micro 2 × "
                           "accumulation 1 × 1 data-parallel)"), note
    assert "LR schedule continues at step 4 of 10" in note and "6 remaining steps train 12 samples where 24" in note
    assert "the data continues after the 16 samples already trained, 2 per step" in note
