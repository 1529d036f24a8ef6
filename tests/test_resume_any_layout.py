"""Resume on another layout through `run_clm_neox.py`: a run of 6 steps on layout A saves at step 3 (and is the
uninterrupted reference); layout B resumes from that checkpoint's layout-free state and trains to 6: steps 4–6 match
A's losses within 1e-4 and the final weights within 1e-3 (fp32, dropout 0). Every source runs once for the module,
shared by the pairs that start from it. The FSDP2 pairs (either way with ZeRO-2/3, and onto TP and pipeline stages)
are held tighter, to the new layout's uninterrupted run within 1e-5.

Pack mode reads GPT-NeoX's order (`data.order: gpt-neox`, whose position is layout-free) and so may change the
data-parallel size at an equal global batch with the same batches; pad mode reads the streamed sources, whose position
is kept per data-parallel rank: the pairs compared with the source run keep the data-parallel size, and one resume on
another data-parallel size (the rest of the pass dealt to the new ranks: other batches, so not compared) only has to
go on to step 6 with finite losses.

Every run goes through the entry point `run_clm_neox.py` calls (`neox_hf.cli.train_main`). To keep the module's CPU
down (start-up, ~10 s of imports per process on 2 cores, is most of a tiny run), the runs of one process count share
a launch (tests/workers/init_layouts.py: the 2-process sources in one launch, the 2-process resumes in another) and
the one-process runs run in the test process. The launches are torchrun's (an FSDP2 recipe refuses `accelerate launch
--use_deepspeed`'s environment; the DeepSpeed runs take DeepSpeed from their recipes)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO, finish_launch, shared, start_torchrun_layouts, train_in_this_process
from tests.test_resume import step_losses

TINY = ["--model.hidden_size", "64", "--model.num_layers", "2", "--model.seq_length", "64",
        "--model.vocab_size", "50432",  # one padded vocabulary for TP 1, 2 and 4 (50,277 tokens)
        "--train.micro_batch_size", "2", "--train.train_iters", "6", "--train.save_interval", "3",
        "--train.eval_iters", "0", "--train.log_interval", "1", "--output.tensorboard", "false",
        "--train.precision", "fp32", "--model.hidden_dropout", "0", "--model.attention_dropout", "0"]
GLOBAL_BATCH = 4


def layout_args(processes: int, *, zero: int = 0, tp: int = 1, pp: int = 1, sp: bool = False,
                fsdp2: bool = False) -> list[str]:
    """Recipe options of a layout at the global batch of every run here."""
    dp = processes // (tp * pp)
    backend = ["--parallel.backend", "fsdp2"] if fsdp2 else []
    return [*backend, "--parallel.zero_stage", str(zero), "--parallel.tensor_parallel", str(tp),
            "--parallel.pipeline_parallel", str(pp), "--parallel.sequence_parallel", str(sp).lower(),
            "--train.gradient_accumulation_steps", str(GLOBAL_BATCH // (2 * dp))]


@dataclass
class Run:
    """One run of the module: its process count, data ('pack' or 'pad'), layout, and the source it resumes (a name)."""

    processes: int
    data: str
    layout: dict
    resumes: str | None = None


# Sources: 6 uninterrupted steps with a checkpoint at step 3 (the reference and the checkpoint the pairs resume).
SOURCES = {
    "one_process_pack": Run(1, "pack", {}),
    "dp2_zero2_pack": Run(2, "pack", {"zero": 2}),
    "tp2_sp_pad": Run(2, "pad", {"zero": 1, "tp": 2, "sp": True}),
    "dp2_fsdp2_pack": Run(2, "pack", {"fsdp2": True}),
    "dp2_zero3_pad": Run(2, "pad", {"zero": 3}),  # last of its launch: transformers keeps a ZeRO-3 config alive
    "pp2_tp2_pack": Run(4, "pack", {"zero": 1, "tp": 2, "pp": 2}),
}
# Resumes from step 3 of a source, to step 6 on another layout.
RESUMES = {
    "one_process_to_dp2_zero2": Run(2, "pack", {"zero": 2}, "one_process_pack"),
    "dp2_zero2_to_tp2": Run(2, "pack", {"zero": 1, "tp": 2}, "dp2_zero2_pack"),
    "dp2_zero3_to_dp2_zero1": Run(2, "pad", {"zero": 1}, "dp2_zero3_pad"),
    "tp2_sp_to_dp2": Run(2, "pad", {"zero": 1}, "tp2_sp_pad"),
    "tp2_to_pipeline2": Run(2, "pad", {"pp": 2}, "tp2_sp_pad"),
    "tp2_sp_to_one_process": Run(1, "pad", {}, "tp2_sp_pad"),
    "pp2_tp2_to_one_process": Run(1, "pack", {}, "pp2_tp2_pack"),
    # FSDP2 (`parallel.backend: fsdp2`, the layout-free DTensors) ↔ DeepSpeed ZeRO-2/3, TP and pipeline stages
    "dp2_fsdp2_to_dp2_zero2": Run(2, "pack", {"zero": 2}, "dp2_fsdp2_pack"),
    "dp2_fsdp2_to_tp2": Run(2, "pack", {"zero": 1, "tp": 2}, "dp2_fsdp2_pack"),
    "dp2_fsdp2_to_pipeline2": Run(2, "pack", {"pp": 2}, "dp2_fsdp2_pack"),
    "dp2_zero2_to_dp2_fsdp2": Run(2, "pack", {"fsdp2": True}, "dp2_zero2_pack"),
    "one_process_to_dp2_fsdp2": Run(2, "pack", {"fsdp2": True}, "one_process_pack"),
    "dp2_zero3_to_dp2_fsdp2": Run(2, "pad", {"fsdp2": True}, "dp2_zero3_pad"),
    "dp2_fsdp2_to_dp2_zero3": Run(2, "pack", {"zero": 3}, "dp2_fsdp2_pack"),  # last of its launch (ZeRO-3)
}
# The uninterrupted run a resume onto the new layout is held to within 1e-5 (steps 4-6): the new layout's own where
# this module runs it; else, in pack mode, one process (GPT-NeoX's order gives every layout the same global batches,
# and each trains them as one process within 1e-5: tests/test_zero_equivalence.py, test_tensor_parallel.py,
# test_pipeline.py, test_fsdp2.py); a pad resume keeps the data-parallel size, and FSDP2 DP2 trains the streamed
# batches as DeepSpeed DP2 (test_fsdp2.py).
NEW_LAYOUT_REFERENCE = {
    "dp2_fsdp2_to_dp2_zero2": "dp2_zero2_pack", "dp2_fsdp2_to_tp2": "one_process_pack",
    "dp2_fsdp2_to_pipeline2": "one_process_pack", "dp2_zero2_to_dp2_fsdp2": "dp2_fsdp2_pack",
    "dp2_zero3_to_dp2_fsdp2": "dp2_zero3_pad", "dp2_fsdp2_to_dp2_zero3": "one_process_pack",
    "one_process_to_dp2_fsdp2": "dp2_fsdp2_pack",
}


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


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pack_data, pad_data) -> dict[str, tuple[Path, str]]:
    """name → (output folder, what rank 0 printed) of every source and resume above, run on first use: the sources'
    launches (2 and 4 processes) beside the one-process source in this process, then the 2-process resumes' launch
    beside the one-process resumes."""
    root = tmp_path_factory.mktemp("runs")
    data = {"pack": pack_data, "pad": pad_data}

    def arguments(name: str, run: Run) -> list[str]:
        resume = ["--train.resume", str(root / run.resumes / "checkpoints" / "step_00000003")] if run.resumes else []
        return [str(REPO / "recipes" / "tiny.yaml"), *TINY, *data[run.data], *layout_args(run.processes, **run.layout),
                *resume, "--output.dir", str(root / name)]

    done: dict[str, tuple[Path, str]] = {}
    for phase in (SOURCES, RESUMES):
        launches = {}
        for processes in sorted({run.processes for run in phase.values()} - {1}):
            launches[processes] = start_torchrun_layouts(
                root, {name: shlex.join(arguments(name, run)) for name, run in phase.items()
                       if run.processes == processes}, num_processes=processes)
        for name, run in phase.items():
            if run.processes == 1:
                done[name] = (root / name, train_in_this_process(arguments(name, run)))
        for processes, launch in launches.items():
            finish_launch(launch, f"the {processes}-process runs")
        done.update({name: (root / name, (root / f"{name}.stdout").read_text())
                     for name, run in phase.items() if run.processes > 1})
    return done


def assert_continues(source: Path, resumed: Path) -> None:
    reference, after = step_losses(source), step_losses(resumed)
    for step in (4, 5, 6):
        assert abs(after[step] - reference[step]) <= 1e-4, (step, after[step], reference[step])
    from safetensors.torch import load_file

    want, got = load_file(source / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert want.keys() == got.keys()
    worst = max((want[k] - got[k]).abs().max().item() for k in want)
    assert worst <= 1e-3, worst


def resumed(runs, name: str) -> str:
    """The resume `name` continued its source's steps 4-6 and weights; what it printed."""
    folder, printed = runs[name]
    assert_continues(runs[RESUMES[name].resumes][0], folder)
    return printed


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(NEW_LAYOUT_REFERENCE))
def test_fsdp2_and_deepspeed_tp_pipeline_resume_each_others_checkpoints(runs, name):
    """An FSDP2 step folder continues on ZeRO-2, ZeRO-3, TP2 and 2 pipeline stages, and ZeRO-2's, ZeRO-3's and one
    process's on FSDP2: steps 4-6 within 1e-5 of the new layout's uninterrupted run, the final weights within 1e-3 of the source's
    (the module's bound: Adam's ±lr steps on the near-zero-gradient key bias, see test_fsdp2.py)."""
    printed = resumed(runs, name)
    reference, after = step_losses(runs[NEW_LAYOUT_REFERENCE[name]][0]), step_losses(runs[name][0])
    worst = max(abs(after[step] - reference[step]) for step in (4, 5, 6))
    assert worst <= 1e-5, (name, reference, after)
    written_by = {"dp2_fsdp2_pack": "FSDP2 on 2 processes", "dp2_zero2_pack": "DeepSpeed ZeRO-2 on 2 processes",
                  "dp2_zero3_pad": "DeepSpeed ZeRO-3 on 2 processes",
                  "one_process_pack": "1 process without DeepSpeed"}[RESUMES[name].resumes]
    on = "FSDP2 on 2 processes" if RESUMES[name].layout.get("fsdp2") else ""
    assert f"resuming step 3 written by {written_by} on {on}" in printed, printed[-2000:]


@pytest.mark.distributed
def test_one_process_to_dp2_zero2(runs):
    printed = resumed(runs, "one_process_to_dp2_zero2")
    assert ("resuming step 3 written by 1 process without DeepSpeed on DeepSpeed ZeRO-2 on 2 processes"
            in printed), printed[-2000:]
    assert "data position: sample 12 of GPT-NeoX's order" in printed
    # one process without DeepSpeed: accelerate's model.safetensors + optimizer.bin are the layout-free state
    assert not (runs["one_process_pack"][0] / "checkpoints" / "step_00000003" / "layout_free").exists()


@pytest.mark.distributed
def test_dp2_zero2_to_tp2(runs):
    resumed(runs, "dp2_zero2_to_tp2")


@pytest.mark.distributed
def test_dp2_zero3_to_dp2_zero1(runs):
    resumed(runs, "dp2_zero3_to_dp2_zero1")


@pytest.mark.distributed
def test_tp2_sequence_parallel_to_one_process(runs):
    resumed(runs, "tp2_sp_to_one_process")


@pytest.mark.distributed
def test_streamed_position_resumes_on_another_data_parallel_size(runs):
    """TP2 (1 data-parallel rank) → DP2: the rest of the old rank's pass is dealt to the 2 new ranks (which documents,
    exactly once, is tests/test_data_resize.py's); the run goes on to step 6 with finite losses. Its batches are not
    the source run's, so its losses are not compared."""
    out, printed = runs["tp2_sp_to_dp2"]
    assert "resuming step 3 written by DeepSpeed ZeRO-1 on 2 processes (1 data-parallel × tensor parallel 2)" in \
        printed, printed[-2000:]
    assert ("data position: the rest of pass 1 of 1 data-parallel rank's streamed shares (" in printed and
            "documents read but not yet trained), dealt to 2 ranks; pass 2 on 2 ranks" in printed), printed[-2000:]
    losses = step_losses(out)
    assert set(losses) >= {4, 5, 6} and all(np.isfinite(losses[step]) for step in (4, 5, 6)), losses


@pytest.mark.distributed
def test_tp2_to_pipeline2(runs):
    """The TP2 source (with sequence parallelism, which changes no parameter) resumed on 2 pipeline stages."""
    resumed(runs, "tp2_to_pipeline2")


@pytest.mark.distributed
def test_pipeline2_tp2_to_one_process(runs):
    resumed(runs, "pp2_tp2_to_one_process")


@pytest.mark.distributed
def test_export_reads_the_layout_free_state_of_pipeline2_tp2(runs, tmp_path, capsys):
    """`neox_hf export` of the last checkpoint of 4 processes (2 stages × 2 TP shards) is the run's final folder,
    tensor for tensor, and stock transformers loads it."""
    import torch
    from safetensors.torch import load_file
    from transformers import GPTNeoXForCausalLM

    from neox_hf.cli import main

    source = runs["pp2_tp2_pack"][0]
    step = source / "checkpoints" / "step_00000006"
    assert (step / "layout_free" / ".metadata").is_file()
    assert main(["export", str(step), str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    want, got = load_file(source / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), [k for k in want if not torch.equal(want[k], got[k])]
    assert GPTNeoXForCausalLM.from_pretrained(tmp_path / "hf").config.vocab_size == 50432


def _saved_tiny_state(folder: Path) -> dict:
    import torch

    from neox_hf.checkpoint.layout_free import save_layout_free

    state = {"model/w": torch.arange(12.0).reshape(3, 4), "exp_avg/w": torch.ones(3, 4)}
    save_layout_free(state, folder)
    return state


def test_layout_free_metadata_that_could_run_code_is_refused(tmp_path):
    """DCP unpickles `.metadata` with pickle.load; ours admits plain metadata only."""
    import os
    import pickle

    import torch

    from neox_hf.errors import CheckpointError
    from neox_hf.checkpoint.layout_free import FOLDER, load_layout_free

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
    from neox_hf.checkpoint.layout_free import FOLDER, load_layout_free

    _saved_tiny_state(tmp_path)
    with pytest.raises(CheckpointError, match=r"holds model/w of shape \[3, 4\]; this run builds \[4, 4\]"):
        load_layout_free({"model/w": torch.zeros(4, 4)}, tmp_path)
    data = next((tmp_path / FOLDER).glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:40])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_layout_free({"model/w": torch.zeros(3, 4), "exp_avg/w": torch.zeros(3, 4)}, tmp_path)
