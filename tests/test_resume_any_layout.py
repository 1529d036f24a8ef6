"""Resume on another layout through `run_clm_neox.py`: a run of 6 steps on layout A saves at step 3 (and is the
uninterrupted reference); layout B resumes from that checkpoint's layout-free state and trains to 6: steps 4–6 match
A's losses within 1e-4 and the final weights within 1e-3 (fp32, dropout 0). Every source run is a module fixture
shared by the pairs that start from it.

Pack mode reads GPT-NeoX's order (`data.order: gpt-neox`, whose position is layout-free) and so may change the
data-parallel size at an equal global batch with the same batches; pad mode reads the streamed sources, whose position
is kept per data-parallel rank: the pairs compared with the source run keep the data-parallel size, and one resume on
another data-parallel size (the rest of the pass dealt to the new ranks: other batches, so not compared) only has to
go on to step 6 with finite losses."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO, free_port, launch_env, shared
from tests.test_resume import step_losses

TINY = ["--model.hidden_size", "64", "--model.num_layers", "2", "--model.seq_length", "64",
        "--model.vocab_size", "50432",  # one padded vocabulary for TP 1, 2 and 4 (50,277 tokens)
        "--train.micro_batch_size", "2", "--train.train_iters", "6", "--train.save_interval", "3",
        "--train.eval_iters", "0", "--train.log_interval", "1", "--output.tensorboard", "false",
        "--train.precision", "fp32", "--model.hidden_dropout", "0", "--model.attention_dropout", "0"]
GLOBAL_BATCH = 4


def layout_args(processes: int, *, zero: int = 0, tp: int = 1, pp: int = 1, sp: bool = False) -> list[str]:
    """Recipe options of a layout at the global batch of every run here."""
    dp = processes // (tp * pp)
    return ["--parallel.zero_stage", str(zero), "--parallel.tensor_parallel", str(tp),
            "--parallel.pipeline_parallel", str(pp), "--parallel.sequence_parallel", str(sp).lower(),
            "--train.gradient_accumulation_steps", str(GLOBAL_BATCH // (2 * dp))]


def run(out: Path, processes: int, data: list[str], *args: str, **layout) -> subprocess.CompletedProcess:
    recipe = [str(REPO / "recipes" / "tiny.yaml"), *TINY, *data, *layout_args(processes, **layout),
              "--output.dir", str(out), *args]
    if processes == 1:
        command = [sys.executable, str(REPO / "run_clm_neox.py"), *recipe]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes),
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--use_deepspeed",
                   "--main_process_port", str(free_port()), str(REPO / "run_clm_neox.py"), *recipe]
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=launch_env(), timeout=900)
    print(f"{out.name}: {time.time() - started:.1f}s")
    return done


def ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


@pytest.fixture(scope="module")
def pack_data(tmp_path_factory) -> list[str]:
    """A GPT-NeoX .bin/.idx corpus of random documents (ending in the tokenizer's EOD, id 0)."""
    from tests.test_neox_order import write_corpus

    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, 50000, size=int(rng.integers(20, 200))), 0) for _ in range(400)]
    prefix = write_corpus(tmp_path_factory.mktemp("corpus") / "corpus_text_document", docs)
    return ["--data.order", "gpt-neox", "--data.sources", f"[{{path: {prefix}}}]", "--data.split", "969,30,1",
            "--data.mode", "pack"]


@pytest.fixture(scope="module")
def pad_data() -> list[str]:
    return ["--data.sources", f"[{{path: {shared('corpora/tinyshakespeare/input.txt')}}}]", "--data.mode", "pad"]


def assert_continues(source: Path, resumed: Path) -> None:
    reference, after = step_losses(source), step_losses(resumed)
    for step in (4, 5, 6):
        assert abs(after[step] - reference[step]) <= 1e-4, (step, after[step], reference[step])
    from safetensors.torch import load_file

    want, got = load_file(source / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert want.keys() == got.keys()
    worst = max((want[k] - got[k]).abs().max().item() for k in want)
    assert worst <= 1e-3, worst


def resume(source: Path, out: Path, processes: int, data, **layout) -> subprocess.CompletedProcess:
    done = ok(run(out, processes, data, "--train.resume", str(source / "checkpoints" / "step_00000003"), **layout))
    assert_continues(source, out)
    return done


def source_run(tmp_path_factory, name: str, processes: int, data, **layout) -> Path:
    """Layout A's uninterrupted 6 steps, checkpoint at step 3: the reference and the checkpoint the pairs resume."""
    out = tmp_path_factory.mktemp("src") / name
    ok(run(out, processes, data, **layout))
    return out


@pytest.fixture(scope="module")
def one_process_pack(tmp_path_factory, pack_data) -> Path:
    return source_run(tmp_path_factory, "one_process_pack", 1, pack_data)


@pytest.fixture(scope="module")
def dp2_zero2_pack(tmp_path_factory, pack_data) -> Path:
    return source_run(tmp_path_factory, "dp2_zero2_pack", 2, pack_data, zero=2)


@pytest.mark.distributed
def test_one_process_to_dp2_zero2(one_process_pack, pack_data, tmp_path):
    done = resume(one_process_pack, tmp_path / "b", 2, pack_data, zero=2)
    assert ("resuming step 3 written by 1 process without DeepSpeed on DeepSpeed ZeRO-2 on 2 processes"
            in done.stdout), done.stdout[-2000:]
    assert "data position: sample 12 of GPT-NeoX's order" in done.stdout
    # one process without DeepSpeed: accelerate's model.safetensors + optimizer.bin are the layout-free state
    assert not (one_process_pack / "checkpoints" / "step_00000003" / "layout_free").exists()


@pytest.mark.distributed
def test_dp2_zero2_to_tp2(dp2_zero2_pack, pack_data, tmp_path):
    resume(dp2_zero2_pack, tmp_path / "b", 2, pack_data, zero=1, tp=2)


@pytest.fixture(scope="module")
def dp2_zero3_pad(tmp_path_factory, pad_data) -> Path:
    return source_run(tmp_path_factory, "dp2_zero3_pad", 2, pad_data, zero=3)


@pytest.mark.distributed
def test_dp2_zero3_to_dp2_zero1(dp2_zero3_pad, pad_data, tmp_path):
    resume(dp2_zero3_pad, tmp_path / "b", 2, pad_data, zero=1)


@pytest.fixture(scope="module")
def tp2_sp_pad(tmp_path_factory, pad_data) -> Path:
    return source_run(tmp_path_factory, "tp2_sp_pad", 2, pad_data, zero=1, tp=2, sp=True)


@pytest.mark.distributed
def test_tp2_sequence_parallel_to_one_process(tp2_sp_pad, pad_data, tmp_path):
    resume(tp2_sp_pad, tmp_path / "b", 1, pad_data)


@pytest.mark.distributed
def test_streamed_position_resumes_on_another_data_parallel_size(tp2_sp_pad, pad_data, tmp_path):
    """TP2 (1 data-parallel rank) → DP2: the rest of the old rank's pass is dealt to the 2 new ranks (which documents,
    exactly once, is tests/test_data_resize.py's); the run goes on to step 6 with finite losses. Its batches are not
    the source run's, so its losses are not compared."""
    out = tmp_path / "b"
    done = ok(run(out, 2, pad_data, "--train.resume", str(tp2_sp_pad / "checkpoints" / "step_00000003"), zero=1))
    assert "resuming step 3 written by DeepSpeed ZeRO-1 on 2 processes (1 data-parallel × tensor parallel 2)" in \
        done.stdout, done.stdout[-2000:]
    assert ("data position: the rest of pass 1 of 1 data-parallel rank's streamed shares (" in done.stdout and
            "documents read but not yet trained), dealt to 2 ranks; pass 2 on 2 ranks" in done.stdout), \
        done.stdout[-2000:]
    losses = step_losses(out)
    assert set(losses) >= {4, 5, 6} and all(np.isfinite(losses[step]) for step in (4, 5, 6)), losses


@pytest.mark.distributed
def test_tp2_to_pipeline2(tp2_sp_pad, pad_data, tmp_path):
    """The TP2 source (with sequence parallelism, which changes no parameter) resumed on 2 pipeline stages."""
    resume(tp2_sp_pad, tmp_path / "b", 2, pad_data, pp=2)


@pytest.fixture(scope="module")
def pp2_tp2_pack(tmp_path_factory, pack_data) -> Path:
    return source_run(tmp_path_factory, "pp2_tp2_pack", 4, pack_data, zero=1, tp=2, pp=2)


@pytest.mark.distributed
def test_pipeline2_tp2_to_one_process(pp2_tp2_pack, pack_data, tmp_path):
    resume(pp2_tp2_pack, tmp_path / "b", 1, pack_data)


@pytest.mark.distributed
def test_export_reads_the_layout_free_state_of_pipeline2_tp2(pp2_tp2_pack, tmp_path, capsys):
    """`neox_hf export` of the last checkpoint of 4 processes (2 stages × 2 TP shards) is the run's final folder,
    tensor for tensor, and stock transformers loads it."""
    import torch
    from safetensors.torch import load_file
    from transformers import GPTNeoXForCausalLM

    from neox_hf.cli import main

    step = pp2_tp2_pack / "checkpoints" / "step_00000006"
    assert (step / "layout_free" / ".metadata").is_file()
    assert main(["export", str(step), str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    want, got = load_file(pp2_tp2_pack / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), [k for k in want if not torch.equal(want[k], got[k])]
    assert GPTNeoXForCausalLM.from_pretrained(tmp_path / "hf").config.vocab_size == 50432


def _saved_tiny_state(folder: Path) -> dict:
    import torch

    from neox_hf.train.checkpoint.layout_free import save_layout_free

    state = {"model/w": torch.arange(12.0).reshape(3, 4), "exp_avg/w": torch.ones(3, 4)}
    save_layout_free(state, folder)
    return state


def test_layout_free_metadata_that_could_run_code_is_refused(tmp_path):
    """DCP unpickles `.metadata` with pickle.load; ours admits plain metadata only."""
    import os
    import pickle

    import torch

    from neox_hf.errors import CheckpointError
    from neox_hf.train.checkpoint.layout_free import FOLDER, load_layout_free

    state = _saved_tiny_state(tmp_path)
    targets = {key: torch.zeros_like(value) for key, value in state.items()}
    load_layout_free(targets, tmp_path)  # plain metadata reads
    assert all(torch.equal(targets[k], state[k]) for k in state)

    class Payload:
        def __reduce__(self):
            return os.system, ("touch " + str(tmp_path / "ran"),)

    (tmp_path / FOLDER / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match=r"\.metadata was refused: posix\.system is not plain checkpoint metadata"):
        load_layout_free(targets, tmp_path)
    assert not (tmp_path / "ran").exists()


def test_layout_free_damage_and_another_shape_are_named(tmp_path):
    import torch

    from neox_hf.errors import CheckpointError
    from neox_hf.train.checkpoint.layout_free import FOLDER, load_layout_free

    _saved_tiny_state(tmp_path)
    with pytest.raises(CheckpointError, match=r"holds model/w of shape \[3, 4\]; this run builds \[4, 4\]"):
        load_layout_free({"model/w": torch.zeros(4, 4)}, tmp_path)
    data = next((tmp_path / FOLDER).glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:40])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_layout_free({"model/w": torch.zeros(3, 4), "exp_avg/w": torch.zeros(3, 4)}, tmp_path)
