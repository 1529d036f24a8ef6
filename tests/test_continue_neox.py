"""`neox_hf continue-neox`: a GPT-NeoX run continues mid-flight. DeepSpeed itself writes GPT-NeoX's training
checkpoints (ZeRO-1, 2 data-parallel ranks, tensor parallel 1 and 2, GPT-NeoX's parameter names and sequential-layout
files; tests/workers/neox_ds_checkpoint.py, one 4-process launch) and takes the next step; continue-neox turns the
checkpoint into a run folder and neox_hf takes that step on one process: the same loss and weights within 1e-5
(fp32). Bad input is one line and exit 2, with nothing written; no pickle in the checkpoint runs. The same launch
also checks KTO's KL estimate over data-parallel ranks against TRL's rule (tests/workers/kto_ranks.py): a launch's
start-up costs far more than either check."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import BUNDLED_TOKENIZER, REPO, launch_env, train_in_this_process

TP_RESIDUAL = {1: True, 2: False}  # TP 1 with Pythia's parallel residual; TP 2 sequential (see the module docstring
# of neox_hf/interop/continue_neox.py for GPT-NeoX's row-parallel biases under parallel residual and TP > 1)


def write_neox_config(folder: Path, prefix: str, *, tp: int, parallel_residual: bool, hidden: int = 32) -> Path:
    config = {"num_layers": 2, "hidden_size": hidden, "num_attention_heads": 4, "seq_length": 16,
              "max_position_embeddings": 16, "pos_emb": "rotary", "rotary_pct": 0.25, "no_weight_tying": True,
              "gpt_j_residual": parallel_residual, "norm": "layernorm", "layernorm_epsilon": 1e-5, "activation": "gelu",
              "hidden_dropout": 0, "attention_dropout": 0,
              "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.95], "eps": 1e-8}},
              "weight_decay": 0.01, "min_lr": 0.0001, "lr_decay_style": "cosine", "warmup": 0.34, "train_iters": 3,
              "lr_decay_iters": 3, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 1}, "gradient_clipping": 0.0, "model_parallel_size": tp,
              "pipe_parallel_size": 0, "data_path": prefix, "split": "969,30,1", "vocab_file": str(BUNDLED_TOKENIZER),
              "tokenizer_type": "HFTokenizer", "seed": 1234, "eval_iters": 0, "eval_interval": 1000,
              "make_vocab_size_divisible_by": 128}
    path = folder / f"neox_tp{tp}_h{hidden}.yml"
    path.write_text(json.dumps(config))
    return path


def write_corpus(folder: Path) -> str:
    from neox_hf.data.indexed import index_bytes

    rng = np.random.default_rng(3)
    docs = [np.append(rng.integers(1, 50000, size=int(rng.integers(5, 40))), 0) for _ in range(60)]
    prefix = folder / "corpus_text_document"
    np.concatenate(docs).astype(np.uint16).tofile(f"{prefix}.bin")
    Path(f"{prefix}.idx").write_bytes(index_bytes([len(d) for d in docs], np.uint16))
    return str(prefix)


def gpt_neox_batches(config: Path, out: Path) -> Path:
    """Each step's batch of data-parallel ranks 0 and 1 in GPT-NeoX's order (tested against GPT-NeoX's own order in
    tests/test_neox_order.py), for the DeepSpeed reference."""
    from neox_hf.data import build_train_loader
    from neox_hf.interop.convert import neox_recipe_and_tokenizer

    recipe, tokenizer = neox_recipe_and_tokenizer([str(config)])
    t = recipe.train
    loaders = [build_train_loader(recipe.data, tokenizer, seq_length=recipe.model.seq_length,
                                  micro_batch_size=t.micro_batch_size, dp_rank=rank, dp_size=2, seed=recipe.data.seed,
                                  gradient_accumulation_steps=1, train_iters=t.train_iters,
                                  eval_interval=t.eval_interval, eval_iters=t.eval_iters) for rank in range(2)]
    torch.save({step: [next(loader) for loader in loaders] for step in range(t.train_iters)}, out)
    return out


def write_unpaired(path: Path) -> Path:
    """KTO examples in TRL's unpaired format, each micro-batch of 4 with desirable and undesirable ones."""
    words = "apple river stone cloud maple ember violet harbor quartz meadow lantern copper".split()
    with path.open("w") as f:
        for i in range(8):
            prompt = f"Question {i}: name the {words[i % 12]} after {words[(i * 5) % 12]}.\nAnswer: "
            completion = " ".join(words[(i * 7 + k) % 12] for k in range(1 + i % 3))
            f.write(json.dumps({"prompt": prompt, "completion": completion, "label": i % 3 != 1}) + "\n")
    return path


@pytest.fixture(scope="module")
def neox_runs(tmp_path_factory):
    """{tp: (GPT-NeoX config, the folder DeepSpeed saved global_step2 and global_step3 into)}; "pipeline": the TP 2
    run again in GPT-NeoX's pipeline layout (one stage); "out": the launch's folder, where
    tests/workers/kto_ranks.py's results are too."""
    folder = tmp_path_factory.mktemp("neox_runs")
    prefix = write_corpus(folder)
    configs = {tp: write_neox_config(folder, prefix, tp=tp, parallel_residual=TP_RESIDUAL[tp]) for tp in (1, 2)}
    batches = gpt_neox_batches(configs[1], folder / "batches.pt")  # the batches do not depend on the model
    unpaired = write_unpaired(folder / "unpaired.jsonl")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
               str(REPO / "tests/workers/neox_ds_checkpoint.py"), str(folder / "out"), str(batches),
               *(f"tp{tp}={configs[tp]}:{tp}" for tp in (1, 2)), f"pipe2={configs[2]}:2:pipeline", f"kto={unpaired}"]
    # the worker imports tests.conftest, as tp_tp2.py does: the repository on its path
    done = subprocess.run(command, cwd=REPO, env=launch_env(PYTHONPATH=str(REPO)), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    return {**{tp: (configs[tp], folder / "out" / f"tp{tp}") for tp in (1, 2)}, "out": folder / "out",
            "pipeline": (configs[2], folder / "out" / "pipe2")}


def continue_neox(*args) -> int:
    from neox_hf.cli import main

    return main(["continue-neox", *map(str, args)])


def hf_weights_of(checkpoint: Path, config: Path) -> dict:
    from neox_hf.interop.convert import neox_hf_config, neox_recipe_and_tokenizer
    from neox_hf.interop.neox_checkpoint import load_neox_state_dict

    recipe, tokenizer = neox_recipe_and_tokenizer([str(config)])
    return load_neox_state_dict(checkpoint, neox_hf_config(recipe, tokenizer))


@pytest.mark.parametrize("tp", [1, 2])
def test_the_next_step_after_continue_neox_is_gpt_neoxs(neox_runs, tp, tmp_path, capsys):
    config, saved = neox_runs[tp]
    run = tmp_path / "run"
    assert continue_neox(saved / "global_step2", "--config", config, "--out", run) == 0
    assert f"wrote {run / 'checkpoints' / 'step_00000002'}" in capsys.readouterr().out
    vocab = json.loads((run / "checkpoints" / "step_00000002" / "config.json").read_text())["vocab_size"]
    # One process (DeepSpeed wrote 2 data-parallel × TP ranks), the same global batch: micro 2 × accumulation 2.
    printed = train_in_this_process([str(config), "--output.dir", str(run), "--resume", "--parallel.zero_stage", "0",
                                     "--parallel.tensor_parallel", "1", "--model.vocab_size", str(vocab),
                                     "--train.gradient_accumulation_steps", "2"])
    assert f"resuming step 2 written by GPT-NeoX (DeepSpeed ZeRO-1 on {2 * tp} processes" in printed
    assert "data position: sample 8 of GPT-NeoX's order" in printed  # iteration 2 × global batch 4
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    reference_losses = json.loads((saved / "losses.json").read_text())
    assert [entry["step"] for entry in log] == [3]
    assert log[0]["loss"] == pytest.approx(reference_losses[2], abs=1e-5)
    assert log[0]["consumed_samples"] == 12
    from safetensors.torch import load_file

    ours = load_file(str(run / "model.safetensors"))
    ours["lm_head.weight"] = ours.pop("embed_out.weight", ours.get("lm_head.weight"))
    reference, before = hf_weights_of(saved / "global_step3", config), hf_weights_of(saved / "global_step2", config)
    assert ours.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=1e-5, msg=name)
    moved = max((reference[k] - before[k]).abs().max().item() for k in reference)
    assert moved > 1e-4  # the step is visible at this tolerance


def test_the_pipeline_layout_continues_as_the_sequential_layout(neox_runs, tmp_path):
    """The TP 2 run written in GPT-NeoX's pipeline layout (layer_XX-model_YY files, DeepSpeed's PipelineModule
    parameter names) becomes the same step folder, tensor for tensor, as in the sequential layout (whose next step
    is GPT-NeoX's, above)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    states = []
    for name, (config, saved) in (("sequential", neox_runs[2]), ("pipeline", neox_runs["pipeline"])):
        assert continue_neox(saved / "global_step2", "--config", config, "--out", tmp_path / name) == 0
        step = tmp_path / name / "checkpoints" / "step_00000002"
        dcp_to_torch_save(step / "layout_free", tmp_path / f"{name}.pt")
        states.append((torch.load(tmp_path / f"{name}.pt", weights_only=True),
                       torch.load(step / "trainer_state_rank0.pt", weights_only=True)))
    assert any(p.name.startswith("layer_02-model_01") for p in (neox_runs["pipeline"][1] / "global_step2").iterdir())
    (sequential, sequential_state), (pipeline, pipeline_state) = states
    assert sequential.keys() == pipeline.keys() and len(sequential) == 3 * 28  # masters and moments of 28 tensors
    for key, value in sequential.items():
        torch.testing.assert_close(pipeline[key], value, rtol=0, atol=0, msg=key)
    assert pipeline_state == sequential_state


def test_a_config_that_disagrees_or_a_missing_partition_is_one_line_and_nothing_is_written(neox_runs, tmp_path,
                                                                                           capsys):
    config, saved = neox_runs[2]
    other = write_neox_config(tmp_path, str(Path(json.loads(config.read_text())["data_path"])), tp=2,
                              parallel_residual=False, hidden=64)
    assert continue_neox(saved / "global_step2", "--config", other, "--out", tmp_path / "run") == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "has shape" in error and "fix the config" in error, error
    tp1_config = neox_runs[1][0]
    assert continue_neox(saved / "global_step2", "--config", tp1_config, "--out", tmp_path / "run") == 2
    assert "2 tensor-parallel rank(s); the config says model_parallel_size 1" in capsys.readouterr().err
    partial = tmp_path / "global_step2"
    shutil.copytree(saved / "global_step2", partial)
    (partial / "zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
    assert continue_neox(partial, "--config", config, "--out", tmp_path / "run") == 2
    error = capsys.readouterr().err.strip()
    assert "zero_pp_rank_1_mp_rank_01_optim_states.pt is missing" in error and error.count("\n") == 0
    for later in (saved / "global_step3").glob("zero_pp_rank_*"):  # the next step's partitions beside these weights
        shutil.copy(later, partial / later.name)
    assert continue_neox(partial, "--config", config, "--out", tmp_path / "run") == 2
    error = capsys.readouterr().err.strip()
    assert "come from another step or run" in error and error.count("\n") == 0, error
    assert not (tmp_path / "run").exists()


def test_kto_averages_its_kl_estimate_over_data_parallel_ranks_as_trl(neox_runs):
    """TRL's KTOTrainer: `kl = gather_for_metrics(kl).mean().clamp(min=0)` over its processes, so every process of a
    step uses the mean of their estimates, clamped after averaging. Each rank's training loss equals TRL's formula
    with that z (β 0.5, λ_D 1.3, λ_U 0.7; TRL's formula itself, one process, is tests/test_objectives.py's);
    evaluation keeps the rank's own estimate."""
    ranks = [torch.load(neox_runs["out"] / f"kto_rank{r}.pt", weights_only=True) for r in range(4)]
    for pair in (ranks[:2], ranks[2:]):
        z = torch.stack([rank["raw_kl"] for rank in pair]).mean().clamp(min=0)
        own = [rank["raw_kl"].clamp(min=0) for rank in pair]
        assert max(abs(float(z - estimate)) for estimate in own) > 1e-2  # averaging before the clamp is visible
        for rank, estimate in zip(pair, own):
            r, desirable = rank["logratios"], rank["label"]
            trl = torch.where(desirable, 1.3 * (1 - torch.sigmoid(0.5 * (r - z))),
                              0.7 * (1 - torch.sigmoid(0.5 * (z - r)))).sum()
            torch.testing.assert_close(rank["loss_sum"], trl, rtol=0, atol=1e-5)
            torch.testing.assert_close(rank["kl"], z, rtol=0, atol=1e-6)
            torch.testing.assert_close(rank["eval_kl"], estimate, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- fast tier: no launch


@pytest.fixture()
def weights_only_checkpoint(tmp_path):
    """A GPT-NeoX sequential-layout checkpoint without optimizer files (what export-neox writes), and its config."""
    from neox_hf.interop.convert import neox_hf_config, neox_recipe_and_tokenizer
    from neox_hf.interop.neox_checkpoint import export_neox_checkpoint
    from transformers import GPTNeoXForCausalLM

    config = write_neox_config(tmp_path, str(tmp_path / "no_data"), tp=1, parallel_residual=True)
    recipe, tokenizer = neox_recipe_and_tokenizer([str(config)])
    hf_config = neox_hf_config(recipe, tokenizer)
    step_dir = export_neox_checkpoint(GPTNeoXForCausalLM(hf_config), hf_config, tmp_path / "neox", step=2)
    return Path(step_dir), config


class _Touch:
    """Unpickling it would create `path`: what a malicious optimizer file could do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_bad_input_is_one_line_exit_2_and_no_pickle_runs(weights_only_checkpoint, tmp_path, capsys):
    step_dir, config = weights_only_checkpoint
    out = tmp_path / "run"
    assert continue_neox(step_dir, "--config", config, "--out", out) == 2
    error = capsys.readouterr().err.strip()
    assert "no zero_pp_rank_*_mp_rank_*_optim_states.pt files" in error and "convert-neox" in error, error
    assert error.count("\n") == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    assert continue_neox(empty, "--config", config, "--out", out) == 2
    assert "no layer_*-model_*-model_states.pt" in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    assert continue_neox(step_dir, "--config", config, "--out", busy) == 2
    assert "is not an empty folder" in capsys.readouterr().err
    from neox_hf.checkpoint import find_resume_checkpoint
    from neox_hf.errors import CheckpointError

    for given in (step_dir, step_dir.parent):  # `--train.resume` of a GPT-NeoX folder names the command that reads it
        with pytest.raises(CheckpointError, match="is a GPT-NeoX .* checkpoint.*neox_hf continue-neox"):
            find_resume_checkpoint(str(given), tmp_path / "unused")
    assert (step_dir.parent / "latest").read_text() == step_dir.name  # GPT-NeoX's pointer left as it was
    marker = tmp_path / "ran"
    torch.save({"optimizer_state_dict": {"payload": _Touch(marker)}},
               step_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert continue_neox(step_dir, "--config", config, "--out", out) == 2
    error = capsys.readouterr().err.strip()
    assert "refused" in error and "--trust-pickle" in error and error.count("\n") == 0, error
    assert not marker.exists() and not out.exists()
