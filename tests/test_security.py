"""Nothing neox_hf reads runs code. Every load path is fed a file that would run code when read (a pickle whose
`__reduce__` touches a marker file, a YAML tag, a tokenizer's or model's remote code) and must refuse it in one line
naming the file, or load it without running that code; the marker never appears. The files are otherwise genuine
(the payload is added to the real state), so the refusal is about the payload, not about damage.

Paths: resume (trainer state, RNG state, optimizer state; DeepSpeed's engine and ZeRO files), `convert-neox` of
GPT-NeoX checkpoints (both layouts; their numpy RNG state still loads without --trust-pickle), the GPT-NeoX index
caches (.npy), the pipeline checkpoint export, model / adapter / tokenizer folders, recipes and GPT-NeoX configs.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from neox_hf.errors import CheckpointError, DataError, RecipeError
from test_cli_interop import tiny_neox_yaml
from test_fuzz_inputs import run_cli as neox_hf_in_process
from test_neox_checkpoint import random_neox_shards, tiny_config, write_neox_checkpoint
from test_neox_order import data_cfg, random_docs, train_loader, write_corpus
from tests.conftest import REPO, launch_env, reset_accelerate_state
from tests.test_checkpoint_lifecycle import assert_refused, tiny_args


class Touch:
    """Unpickling it calls `pathlib.Path.touch(marker)`: a function no load list allows, from a module torch does not
    block by name (as it blocks `os`), so only an allow-list stops it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


class System:
    """Unpickling it runs a shell command that creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


def with_payload(path: Path, marker: Path, payload=Touch, *, raw_pickle: bool = False) -> Path:
    """Rewrite the torch.save file `path` with its own state plus a payload (a raw pickle with `raw_pickle`)."""
    state = torch.load(path, weights_only=False) if path.is_file() else {}
    state = {**state, "payload": payload(marker)} if isinstance(state, dict) else {"state": state, "payload": payload(marker)}
    if raw_pickle:
        path.write_bytes(pickle.dumps(state, protocol=2))
    else:
        torch.save(state, path)
    return path


def test_the_payloads_do_run_when_unpickled_fully(tmp_path):
    """The check of the checks: loaded as libraries used to (`weights_only=False`), each payload creates its marker."""
    for payload in (Touch, System):
        marker = tmp_path / f"{payload.__name__}.marker"
        torch.load(with_payload(tmp_path / f"{payload.__name__}.pt", marker, payload), weights_only=False)
        assert marker.exists()


# ----------------------------------------------------------------------------------------------------------------
# Resume: one process, plain Accelerate
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory, small_text) -> Path:
    """A 1-process run of 2 steps with a checkpoint at step 2."""
    from neox_hf.cli import train_main as main

    out = tmp_path_factory.mktemp("trained") / "run"
    try:
        assert main(tiny_args(out, small_text, "--train.precision", "fp32", steps=2, save=2)) == 0
    finally:
        reset_accelerate_state()
    return out


@pytest.mark.parametrize("name,payload,raw_pickle", [
    ("random_states_0.pkl", Touch, False), ("random_states_0.pkl", System, True),
    ("trainer_state_rank0.pt", Touch, False), ("optimizer.bin", System, False),
], ids=["rng-state", "rng-state-raw-pickle", "trainer-state", "optimizer-state"])
def test_resume_refuses_a_checkpoint_file_that_would_run_code(trained, small_text, tmp_path, capsys, name, payload,
                                                             raw_pickle, fresh_accelerate_state):
    from neox_hf.cli import train_main as main

    out = tmp_path / "run"
    shutil.copytree(trained, out)
    crafted = with_payload(out / "checkpoints" / "step_00000002" / name, tmp_path / "marker", payload,
                           raw_pickle=raw_pickle)
    code = main(tiny_args(out, small_text, "--train.precision", "fp32", "--resume", steps=3, save=3))
    assert_refused(code, capsys.readouterr().err, str(crafted))
    assert not (tmp_path / "marker").exists()


def test_resume_of_the_untouched_checkpoint_still_works(trained, small_text, tmp_path, capsys, fresh_accelerate_state):
    from neox_hf.cli import train_main as main

    out = tmp_path / "run"
    shutil.copytree(trained, out)
    assert main(tiny_args(out, small_text, "--train.precision", "fp32", "--resume", steps=3, save=3)) == 0
    assert "at step 2" in capsys.readouterr().out


def test_rng_state_written_by_numpy_1_loads(tmp_path):
    """numpy < 2 pickled arrays under `numpy.core.multiarray`: such RNG states (older checkpoints, GPT-NeoX's) still
    load, as data."""
    from neox_hf.io import load_torch_safely

    state = np.random.get_state()
    path = tmp_path / "legacy.pt"
    torch.save({"numpy_random_seed": state, "random_state": random.getstate()}, path,
               _use_new_zipfile_serialization=False)  # one pickle stream: its module names can be rewritten
    data = path.read_bytes()
    assert data.count(b"numpy._core.multiarray") == 1
    path.write_bytes(data.replace(b"numpy._core.multiarray", b"numpy.core.multiarray"))
    loaded = load_torch_safely(path)
    assert loaded["numpy_random_seed"][0] == "MT19937"
    np.testing.assert_array_equal(loaded["numpy_random_seed"][1], state[1])
    assert loaded["random_state"] == random.getstate()


# ----------------------------------------------------------------------------------------------------------------
# Resume under DeepSpeed: its engine loads its own files with weights_only=False
# ----------------------------------------------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "run_clm_neox.py"), *args], capture_output=True, text=True,
                          cwd=REPO, timeout=600)


@pytest.fixture(scope="module")
def trained_zero1(tmp_path_factory, small_text) -> Path:
    out = tmp_path_factory.mktemp("zero1") / "run"
    # DeepSpeed's own engine files (not the default layout-free state): what their loader reads is under test
    done = run_cli(*tiny_args(out, small_text, "--parallel.zero_stage", "1", "--train.precision", "fp32",
                              "--train.layout_free_checkpoint", "false", steps=2, save=2))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


ENGINE_FILES = {"engine-model-states": "mp_rank_00_model_states.pt",
                "zero-optimizer-states": "*zero_pp_rank_0_mp_rank_00_optim_states.pt"}


@pytest.fixture(scope="module")
def deepspeed_resumes(trained_zero1, small_text, tmp_path_factory) -> Path:
    """Resumes of copies of `trained_zero1`: untouched, and with each DeepSpeed engine file crafted to run code, in one
    process (tests/workers/init_layouts.py, the real entry point per run; a process's start-up is most of a tiny
    run). The untouched resume runs first, so no refused one can leave it anything. Returns the folder of the copies,
    each run's exit status, stdout and stderr beside them (NAME.status, NAME.stdout, NAME.stderr)."""
    root = tmp_path_factory.mktemp("deepspeed_resumes")
    for name, pattern in {"untouched": None, **ENGINE_FILES}.items():
        shutil.copytree(trained_zero1, root / name)
        if pattern:
            (target,) = (root / name / "checkpoints" / "step_00000002" / "pytorch_model").glob(pattern)
            with_payload(target, root / f"{name}.marker")
    resume = tiny_args(root / "unused", small_text, "--parallel.zero_stage", "1", "--train.precision", "fp32",
                       "--train.layout_free_checkpoint", "false", "--resume", steps=3, save=3)
    done = subprocess.run([sys.executable, str(REPO / "tests/workers/init_layouts.py"), "--keep-going", str(root),
                           "untouched=", *(f"{name}=" for name in ENGINE_FILES), "--", *resume],
                          capture_output=True, text=True, cwd=REPO, env=launch_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return root


@pytest.mark.distributed  # slow tier: DeepSpeed runs in subprocesses
@pytest.mark.parametrize("name", list(ENGINE_FILES))
def test_deepspeed_resume_refuses_an_engine_file_that_would_run_code(deepspeed_resumes, name):
    (crafted,) = (deepspeed_resumes / name / "checkpoints" / "step_00000002" / "pytorch_model").glob(ENGINE_FILES[name])
    assert_refused(int((deepspeed_resumes / f"{name}.status").read_text()),
                   (deepspeed_resumes / f"{name}.stderr").read_text(), str(crafted))
    assert not (deepspeed_resumes / f"{name}.marker").exists()


@pytest.mark.distributed  # slow tier: DeepSpeed runs in subprocesses
def test_deepspeed_resume_of_the_same_checkpoint_without_a_payload_goes_on(deepspeed_resumes):
    """The other side of the refusals above: the files they crafted, as DeepSpeed wrote them, resume (its own classes
    are allow-listed). One resume reads both the engine's model states and the ZeRO optimizer states."""
    status, stdout = ((deepspeed_resumes / f"untouched.{kind}").read_text() for kind in ("status", "stdout"))
    assert status == "0" and "at step 2" in stdout, (deepspeed_resumes / "untouched.stderr").read_text()[-3000:]


# ----------------------------------------------------------------------------------------------------------------
# GPT-NeoX checkpoints (convert-neox)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["sequential", "pipeline"])
def test_convert_neox_without_trust_pickle_refuses_a_checkpoint_that_would_run_code(tmp_path, capsys, layout):
    from neox_hf.cli import main

    config = tiny_config(parallel_residual=False, tied=True)
    marker = tmp_path / "marker"
    extras = {"args": System(marker)} if layout == "sequential" else None  # GPT-NeoX's client state, crafted
    step_dir = write_neox_checkpoint(random_neox_shards(config, tp=2), tmp_path / "ckpt", layout, rank_extras=extras)
    crafted = (step_dir / "mp_rank_00_model_states.pt" if layout == "sequential"
               else with_payload(step_dir / "layer_00-model_00-model_states.pt", marker))
    out = tmp_path / "hf"
    assert main(["convert-neox", str(tmp_path / "ckpt"), "--config", str(tiny_neox_yaml(tmp_path / "tiny.yml")),
                 str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(crafted) in err and "--trust-pickle" in err, err
    assert not marker.exists() and not out.exists()


def test_gpt_neox_rng_state_and_deepspeed_bookkeeping_load_without_trust_pickle(tmp_path):
    """What GPT-NeoX and DeepSpeed write beside the weights (numpy / Python / torch RNG states, the args dict, shapes,
    the DeepSpeed config) is data: it loads without --trust-pickle, to the same weights as with it."""
    from neox_hf.interop.neox_checkpoint import load_neox_state_dict

    config = tiny_config(parallel_residual=False)
    extras = {
        "iteration": 7, "args": {"num_layers": 2, "hidden_size": 64, "tokenizer_type": "HFTokenizer"},
        "random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.zeros(16, dtype=torch.uint8),
        "rng_tracker_states": {"model-parallel-rng": torch.zeros(16, dtype=torch.uint8)},
        "checkpoint_validation_logits": torch.zeros(2, 3), "buffer_names": [], "optimizer": None,
        "param_shapes": [collections.OrderedDict({"sequential.0.word_embeddings.weight": torch.Size([64, 64])})],
        "sparse_tensor_module_names": set(), "lr_scheduler": {"num_iters": 7, "max_lr": 6e-4},
        "global_steps": 7, "global_samples": 56, "skipped_steps": 0, "dp_world_size": 1, "mp_world_size": 2,
        "ds_config": {"train_batch_size": 8, "zero_optimization": {"stage": 1}}, "ds_version": "0.10.0",
    }
    write_neox_checkpoint(random_neox_shards(config, tp=2), tmp_path, "sequential", rank_extras=extras)
    safe = load_neox_state_dict(tmp_path, config)
    trusted = load_neox_state_dict(tmp_path, config, trust_pickle=True)
    assert safe.keys() == trusted.keys() and all(torch.equal(safe[k], trusted[k]) for k in safe)


def test_convert_neox_argparse_namespace_still_needs_trust_pickle(tmp_path):
    """Older GPT-NeoX saved its args as an argparse.Namespace: not allow-listed (no GPT-NeoX checkpoint needs it for
    its weights), so refused by default, naming the opt-in."""
    from neox_hf.interop.neox_checkpoint import load_neox_state_dict

    config = tiny_config(parallel_residual=False)
    write_neox_checkpoint(random_neox_shards(config, tp=1), tmp_path, "sequential",
                          rank_extras={"args": argparse.Namespace(lr=1e-4)})
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states.pt: refused: it holds argparse.Namespace.*"
                                              r"--trust-pickle"):
        load_neox_state_dict(tmp_path, config)


# ----------------------------------------------------------------------------------------------------------------
# GPT-NeoX index caches (.npy)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("build", [True, False], ids=["rank0-checks-and-reads", "other-ranks-read"])
def test_index_cache_holding_pickled_objects_is_refused(tmp_path, build):
    from neox_hf.data.neox_order import BatchLayout, split_samples

    prefix = write_corpus(tmp_path / "corpus_text_document", random_docs(60, seed=3))
    cfg = data_cfg(prefix)
    next(train_loader(cfg, 0))  # builds the cache and its record
    (doc_idx,) = tmp_path.glob("*_doc_idx.npy")
    marker = tmp_path / "marker"
    np.save(doc_idx, np.array([Touch(marker)], dtype=object), allow_pickle=True)  # record untouched: it "matches"
    with pytest.raises(DataError, match=rf"{doc_idx}: not a plain numeric .npy array"):
        split_samples(cfg, "train", seq_length=16, train_iters=8, layout=BatchLayout(2, 2, 2), eval_interval=1000,
                      eval_iters=0, seed=cfg.seed, build=build)
    assert not marker.exists()


# ----------------------------------------------------------------------------------------------------------------
# Pipeline checkpoint export, model / adapter / tokenizer folders, recipes
# ----------------------------------------------------------------------------------------------------------------


def test_pipeline_checkpoint_export_refuses_a_layer_file_that_would_run_code(tmp_path):
    from neox_hf.model import NeoXConfig
    from neox_hf.engines.pipeline import pipeline_checkpoint_state_dict

    config = NeoXConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                        intermediate_size=64, tie_word_embeddings=False)
    torch.save({"weight": torch.zeros(128, 32)}, tmp_path / "layer_00-model_00-model_states.pt")
    crafted = with_payload(tmp_path / "layer_00-model_00-model_states.pt", tmp_path / "marker")
    with pytest.raises(CheckpointError, match=rf"{crafted}: refused: it holds"):
        pipeline_checkpoint_state_dict(tmp_path, config)
    assert not (tmp_path / "marker").exists()


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    from tests.conftest import save_tiny_gpt_neox

    return save_tiny_gpt_neox(tmp_path_factory.mktemp("base") / "model")


# The refusals of a model's or an adapter's weights run `neox_hf generate` in this process (`neox_hf_in_process`,
# stderr read at the file descriptor): a `generate` process costs ~13 s of imports here, for a refusal a process
# shows the same way.
# `generate` in its own process, stdin included, is test_remote_code_tokenizer_is_refused_without_asking[generate].


def test_model_folder_with_a_pickled_weights_file_is_refused(base_model, tmp_path, capfd):
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(base_model / "config.json", folder / "config.json")
    torch.save({"gpt_neox.embed_in.weight": torch.zeros(512, 64), "payload": Touch(tmp_path / "marker")},
               folder / "pytorch_model.bin")
    code, err = neox_hf_in_process(["generate", str(folder), "--prompt", "hello"], capfd)
    assert_refused(code, err, f"{folder / 'pytorch_model.bin'}: refused: it holds", "pathlib.Path")
    assert "Weights only load failed" not in err  # torch's page of advice is not the user's fix
    assert not (tmp_path / "marker").exists()


def test_model_folder_naming_remote_code_loads_the_stock_class_without_running_it(base_model, tmp_path):
    import json

    from neox_hf.inference import load_base_model

    folder = tmp_path / "model"
    shutil.copytree(base_model, folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_evil.py").write_text(f"import pathlib\npathlib.Path({str(tmp_path / 'marker')!r}).touch()\n")
    assert type(load_base_model(folder)).__name__ == "GPTNeoXForCausalLM"
    assert not (tmp_path / "marker").exists()


def test_adapter_folder_with_a_pickled_weights_file_is_refused(base_model, tmp_path, capfd):
    import json

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model), "r": 2,
        "lora_alpha": 4, "target_modules": ["query_key_value"]}))
    torch.save({"payload": Touch(tmp_path / "marker")}, adapter / "adapter_model.bin")
    # peft's weights_only load refuses it
    code, err = neox_hf_in_process(["generate", str(adapter), "--prompt", "hello"], capfd)
    assert_refused(code, err, f"{adapter / 'adapter_model.bin'}: refused: it holds", "pathlib.Path")
    assert "Weights only load failed" not in err
    assert not (tmp_path / "marker").exists()


def with_remote_code_tokenizer(folder: Path, marker: Path) -> Path:
    """Tokenizer files in `folder` whose config maps AutoTokenizer to a module of the folder that creates `marker`."""
    import json

    from tests.conftest import BUNDLED_TOKENIZER

    folder.mkdir(exist_ok=True)
    shutil.copy(BUNDLED_TOKENIZER, folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}}))
    (folder / "tokenization_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import PreTrainedTokenizerFast\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    return folder


def test_tokenizer_folder_naming_remote_code_is_refused(tmp_path):
    from neox_hf.data.tokenizer import load_tokenizer

    folder = with_remote_code_tokenizer(tmp_path / "tokenizer", tmp_path / "marker")
    with pytest.raises(RecipeError, match="custom code"):
        load_tokenizer(str(folder))
    assert not (tmp_path / "marker").exists()


def lora_adapter(base: Path, folder: Path) -> Path:
    """A LoRA adapter folder of `base` as peft saves it (recording `base` as its base model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPTNeoXForCausalLM

    model = get_peft_model(GPTNeoXForCausalLM.from_pretrained(base), LoraConfig(r=2, lora_alpha=4,
                                                                                target_modules=["query_key_value"]))
    model.save_pretrained(folder)
    return folder


def neox_hf_answering(answer: str, *args: str) -> subprocess.CompletedProcess:
    """`neox_hf ARGS` with `answer` waiting on its stdin, as a user at a terminal who types it at any prompt."""
    from tests.conftest import launch_env

    return subprocess.run([sys.executable, "-m", "neox_hf.cli", *args], input=answer, capture_output=True, text=True,
                          cwd=REPO, env=launch_env(), timeout=120)


@pytest.mark.parametrize("command", ["preprocess", "generate"])
def test_remote_code_tokenizer_is_refused_without_asking(base_model, tmp_path, command):
    """transformers asks on stdin whether to run a folder's tokenizer code (`trust_remote_code` unset) and runs it on
    "y": neox_hf never asks, so a "y" typed (or piped) in is never read and nothing runs."""
    marker = tmp_path / "marker"
    if command == "preprocess":
        folder = with_remote_code_tokenizer(tmp_path / "tokenizer", marker)
        (tmp_path / "docs.jsonl").write_text('{"text": "hello"}\n')
        args = ["preprocess", str(tmp_path / "docs.jsonl"), "--tokenizer", str(folder), "--output-prefix",
                str(tmp_path / "corpus")]
    else:  # an adapter folder: no config.json whose model type would name a stock tokenizer class
        folder = with_remote_code_tokenizer(lora_adapter(base_model, tmp_path / "adapter"), marker)
        args = ["generate", str(folder), "--prompt", "hello", "--max-new-tokens", "1"]
    done = neox_hf_answering("y\n" * 5, *args)
    assert not marker.exists(), "the tokenizer's code ran"
    assert "Do you wish to run the custom code" not in done.stdout + done.stderr
    assert_refused(done.returncode, done.stderr, str(folder), "custom code")


def test_recipe_and_gpt_neox_config_with_python_tags_are_refused(tmp_path):
    from neox_hf.neox_yaml import read_neox_files
    from neox_hf.recipe import load_yaml_file

    tag = f"!!python/object/apply:os.system [\"touch '{tmp_path / 'marker'}'\"]"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"train:\n  lr: {tag}\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_yaml_file(recipe)
    neox = tmp_path / "neox.yml"
    neox.write_text(f"num-layers: {tag}\n")
    with pytest.raises(RecipeError, match="cannot parse"):
        read_neox_files([neox])
    assert not (tmp_path / "marker").exists()
