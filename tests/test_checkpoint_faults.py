"""Checkpoints meeting the faults of real machines, through the real entry points: DeepSpeed step folders exported
one by one (not only the latest), a checkpoint resumed by another kind of launch (told apart from a damaged one,
whose advice would delete it), a truncated checkpoint exported, a disk that fills during a save, a run killed
between a save's staging and its rename."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from neox_hf.checkpoint import checkpoint_name
from tests.conftest import REPO, accelerate_launch_command, launch_env, reset_accelerate_state
from tests.test_checkpoint_lifecycle import assert_refused, tiny_args

pytestmark = pytest.mark.distributed  # slow tier: every test here runs (or resumes) a whole training, ~1 min in all


@pytest.fixture(scope="module")
def zero2_runs(tmp_path_factory, small_text) -> Path:
    """Real 2-process DeepSpeed ZeRO-2 runs (fp32) with checkpoints at steps 1 and 2 (the latest), their final folders
    holding the step-2 weights: `run` in the one format (the layout-free state), `ds_files` with DeepSpeed's per-rank
    files instead (`train.layout_free_checkpoint: false`, and what checkpoints were before the layout-free state
    existed). One launch (tests/workers/init_layouts.py, ~15 s of start-up on 2 cores) serves every test of this module
    that needs DeepSpeed."""
    root = tmp_path_factory.mktemp("zero2")
    command = accelerate_launch_command(REPO / "tests/workers/init_layouts.py", root, "run=",
                                        "ds_files=--train.layout_free_checkpoint false", "--", *tiny_args(
        root / "unused", small_text, "--parallel.zero_stage", "2", "--train.precision", "fp32", steps=2, save=1),
                                        zero_stage=2)
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=launch_env(), timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return root


@pytest.fixture(scope="module")
def zero2_run(zero2_runs) -> Path:
    return zero2_runs / "run"


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, small_text) -> Path:
    """A 1-process run without DeepSpeed, checkpoints at steps 1 and 2."""
    from neox_hf.cli import train_main as main

    out = tmp_path_factory.mktemp("plain") / "run"
    try:
        assert main(tiny_args(out, small_text, "--train.precision", "fp32", steps=2, save=1)) == 0
    finally:
        reset_accelerate_state()
    return out


def export(checkpoint: Path, out: Path, capsys) -> tuple[int, str]:
    from neox_hf.cli import main

    code = main(["export", str(checkpoint), str(out)])
    return code, capsys.readouterr().err


def assert_every_checkpoint_exports(run: Path, tmp_path: Path, capsys) -> None:
    """`neox_hf export` of each step folder (DeepSpeed writes a `latest` of its own inside each) and of checkpoints/,
    which means the latest: the run's final weights. For tests/test_resume.py's runs too (TP2, ZeRO-2)."""
    folders = sorted((run / "checkpoints").glob("step_*"))
    assert len(folders) >= 2, folders
    exported = {}
    for folder in folders:
        code, err = export(folder, tmp_path / folder.name, capsys)
        assert code == 0, err
        exported[folder.name] = load_file(tmp_path / folder.name / "model.safetensors")
    code, err = export(run / "checkpoints", tmp_path / "latest", capsys)
    assert code == 0, err
    latest, final = load_file(tmp_path / "latest" / "model.safetensors"), load_file(run / "model.safetensors")
    assert set(latest) == set(final) and all(torch.equal(latest[k].to(final[k].dtype), final[k]) for k in final)
    assert all(torch.equal(exported[folders[-1].name][k], latest[k]) for k in latest)
    earlier = exported[folders[0].name]  # an earlier step: other weights, the same names and shapes
    assert {k: v.shape for k, v in earlier.items()} == {k: v.shape for k, v in latest.items()}
    assert any(not torch.equal(earlier[k], latest[k]) for k in latest)


def test_every_zero2_step_folder_exports_not_only_the_latest(zero2_runs, tmp_path, capsys):
    """Both formats: the one format, and DeepSpeed's files (which write a `latest` of their own in each step)."""
    assert (zero2_runs / "ds_files" / "checkpoints" / checkpoint_name(1) / "latest").is_file()  # DeepSpeed's
    (tmp_path / "run").mkdir()
    (tmp_path / "ds_files").mkdir()
    assert_every_checkpoint_exports(zero2_runs / "run", tmp_path / "run", capsys)
    assert_every_checkpoint_exports(zero2_runs / "ds_files", tmp_path / "ds_files", capsys)


@pytest.mark.parametrize("written_by", ["layout-free", "deepspeed-files"])
def test_export_refuses_a_zero_checkpoint_file_that_would_run_code(zero2_runs, tmp_path, capsys, written_by):
    """Export reads the layout-free state (its `.metadata` is a plain pickle), or DeepSpeed's files where the run
    wrote those (`train.layout_free_checkpoint: false`): a file crafted to run code is refused naming it."""
    import pickle

    from tests.test_security import System, with_payload

    out = tmp_path / "run"
    shutil.copytree(zero2_runs / ("run" if written_by == "layout-free" else "ds_files"), out)
    step = out / "checkpoints" / checkpoint_name(2)
    if written_by == "layout-free":
        crafted = step / "layout_free" / ".metadata"
        crafted.write_bytes(pickle.dumps(System(tmp_path / "marker")))
    else:
        (target,) = (step / "pytorch_model").glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt")
        crafted = with_payload(target, tmp_path / "marker")
    code, err = export(out / "checkpoints", tmp_path / "hf", capsys)
    assert not (tmp_path / "marker").exists()
    assert code == 2 and str(crafted) in err


def test_a_zero2_checkpoint_is_written_once(zero2_runs):
    """One format: the layout-free state (fp32 masters and Adam's two moments, each rank writing its own chunks) and
    the small per-rank states, no DeepSpeed engine files; its tensor bytes are ≤ 1.05× the 12 bytes a parameter
    those three fp32 tensors need. DeepSpeed's own files (train.layout_free_checkpoint: false) hold the same state."""
    from neox_hf.checkpoint.layout_free import stored_model_shapes

    step = zero2_runs / "run" / "checkpoints" / checkpoint_name(2)
    assert sorted(p.name for p in step.iterdir()) == [
        "config.json", "layout_free", "random_states_0.pkl", "random_states_1.pkl", "tokenizer.json",
        "tokenizer_config.json", "trainer_state_rank0.pt", "trainer_state_rank1.pt"]
    parameters = sum(torch.Size(shape).numel() for shape in stored_model_shapes(step).values())
    written = sum(p.stat().st_size for p in (step / "layout_free").iterdir())
    assert 12 * parameters <= written <= 1.05 * 12 * parameters, (written, parameters)
    assert len(list((step / "layout_free").glob("*.distcp"))) == 2  # each rank its own chunks
    assert not (zero2_runs / "ds_files" / "checkpoints" / checkpoint_name(2) / "layout_free").exists()


def test_a_zero_checkpoint_resumes_on_one_plain_process_and_one_without_layout_free_state_is_refused(
        zero2_run, zero2_runs, small_text, tmp_path, capsys, fresh_accelerate_state):
    """DP2 ZeRO-2 → one process without DeepSpeed, in process: the layout-free state resumes it (streamed data: the
    rest of both ranks' pass dealt to the one rank). A checkpoint without that state (written before it existed) is
    refused naming both launches: it was once called truncated or corrupt, with advice (start again with
    --overwrite) that deletes a good checkpoint."""
    from neox_hf.cli import train_main as main

    out = tmp_path / "run"
    shutil.copytree(zero2_run, out)
    args = tiny_args(out, small_text, "--parallel.zero_stage", "0", "--train.precision", "fp32",
                     "--train.gradient_accumulation_steps", "2", "--resume", steps=3, save=3)
    assert main(args) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "resuming step 2 written by DeepSpeed ZeRO-2 on 2 processes on 1 process without DeepSpeed" in printed
    assert (out / "checkpoints" / checkpoint_name(3)).is_dir()

    reset_accelerate_state()
    older = tmp_path / "older"
    shutil.copytree(zero2_runs / "ds_files", older)
    before = {p: p.read_bytes() for p in (older / "checkpoints").rglob("*") if p.is_file()}
    code = main(tiny_args(older, small_text, "--parallel.zero_stage", "0", "--train.precision", "fp32", "--resume",
                          steps=3, save=3))
    err = capsys.readouterr().err
    step = older / "checkpoints" / checkpoint_name(2)
    assert_refused(code, err, f"{step} was written by DeepSpeed ZeRO-2 on 2 processes; this run is 1 process without "
                   "DeepSpeed", "--num_processes 2", "--parallel.zero_stage 2", f"neox_hf export {step} OUT")
    assert "corrupt" not in err and "--overwrite" not in err
    assert {p: p.read_bytes() for p in (older / "checkpoints").rglob("*") if p.is_file()} == before


def test_a_runs_files_get_the_umasks_mode(small_text, tmp_path, capsys, fresh_accelerate_state):
    """neox_hf.io promises what a plain open() gives (0666 minus the umask): safetensors and tempfile write 0600, so the
    model, the checkpoint's weights and run.png were unreadable to the group that shares the run."""
    import os
    import stat

    from neox_hf.cli import train_main as main

    out = tmp_path / "run"
    umask = os.umask(0o022)
    try:
        assert main(tiny_args(out, small_text, "--train.precision", "fp32", steps=1, save=1)) == 0
    finally:
        os.umask(umask)
    written = [out / "model.safetensors", out / "run.png", out / "config.json",
               out / "checkpoints" / checkpoint_name(1) / "model.safetensors",
               out / "checkpoints" / checkpoint_name(1) / "trainer_state_rank0.pt"]
    modes = {path.relative_to(out).as_posix(): oct(stat.S_IMODE(path.stat().st_mode)) for path in written}
    assert set(modes.values()) == {"0o644"}, modes


@pytest.mark.parametrize("kind", ["plain", "zero2", "zero2-deepspeed-files"])
def test_export_of_a_truncated_checkpoint_names_the_file(kind, request, tmp_path, capsys):
    """Export reads one process's accelerate files, a DeepSpeed run's layout-free state, or (a checkpoint written
    with train.layout_free_checkpoint: false, or before there was one) DeepSpeed's files: a truncated file is named,
    with the previous checkpoint to use."""
    run = (request.getfixturevalue("plain_run") if kind == "plain" else request.getfixturevalue("zero2_runs") /
           ("run" if kind == "zero2" else "ds_files"))
    out = tmp_path / "run"
    shutil.copytree(run, out)
    step = out / "checkpoints" / checkpoint_name(2)
    if kind == "plain":
        (damaged,) = step.glob("model.safetensors")
    elif kind == "zero2":
        damaged = sorted((step / "layout_free").glob("*.distcp"))[-1]
    else:
        (damaged,) = (step / "pytorch_model").glob("zero_pp_rank_1_*optim_states.pt")
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    code, err = export(out / "checkpoints", tmp_path / "hf", capsys)
    assert_refused(code, err, f"{damaged} is truncated or corrupt", checkpoint_name(1))
    assert not (tmp_path / "hf").exists()


@pytest.fixture
def small_disk(tmp_path):
    """`mount(size_bytes)` → a folder on a tmpfs of that size (root only: skipped where mounting is not permitted)."""
    mounted = []

    def mount(size_bytes: int) -> Path:
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip()}): needs root")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.mark.parametrize("room", ["weights", "optimizer"])
def test_a_disk_that_fills_during_a_checkpoint_save_keeps_the_previous_one_and_no_staging(
        room, plain_run, small_text, small_disk, capsys, fresh_accelerate_state):
    """Room for the step-1 checkpoint and part of step 2's: the save fails in safetensors' writer (`weights`) or in
    torch.save's zip writer (`optimizer`), which raised SafetensorError / `RuntimeError: [enforce fail at
    inline_container.cc]` and left the staging folder filling the disk. A real full disk: a tmpfs."""
    from neox_hf.cli import train_main as main

    step1 = plain_run / "checkpoints" / checkpoint_name(1)
    sizes = {p.name: p.stat().st_size for p in step1.iterdir()}
    extra = {"weights": sizes["model.safetensors"] // 2,
             "optimizer": sizes["model.safetensors"] + sizes["optimizer.bin"] // 2}[room]
    out = small_disk(sum(sizes.values()) + extra + (1 << 20)) / "run"
    code = main(tiny_args(out, small_text, "--train.precision", "fp32", steps=2, save=1))
    assert_refused(code, capsys.readouterr().err, f"no space left on {out}", "step_00000002",
                   f"the previous checkpoint, {checkpoint_name(1)}, is intact")
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", checkpoint_name(1)]  # no staging left
    assert (checkpoints / "latest").read_text() == checkpoint_name(1)
    assert sorted(p.name for p in (checkpoints / checkpoint_name(1)).iterdir()) == sorted(sizes)


def test_a_run_killed_after_its_final_evaluation_resumes_without_a_second_eval_line(small_text, tmp_path, capsys,
                                                                                   fresh_accelerate_state):
    """Killed between the final evaluation (logged after the last checkpoint) and the end of the final save: the
    resume from that checkpoint evaluates again, and train_log.jsonl held two evaluation lines of the last step."""
    import json

    from neox_hf.cli import train_main as main

    out = tmp_path / "run"
    args = tiny_args(out, small_text, "--train.precision", "fp32", "--train.eval_iters", "1", steps=2, save=2)
    assert main(args) == 0
    for name in ("config.json", "model.safetensors"):  # what a kill before the final save leaves
        (out / name).unlink()
    reset_accelerate_state()
    assert main([*args, "--resume"]) == 0
    assert "at step 2" in capsys.readouterr().out
    lines = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [(e["step"], "eval" in e) for e in lines] == [(0, True), (1, False), (2, False), (2, True)]


def test_a_resume_removes_the_staging_a_killed_run_left_and_nothing_else(plain_run, small_text, tmp_path, capsys,
                                                                         fresh_accelerate_state):
    """A kill mid-save leaves `.tmp-*` staging (a checkpoint's, the final folder's, a file's) holding the space of a
    checkpoint; the next run that holds the folder's lock removes what matches the writers' names, and only that."""
    from neox_hf.cli import train_main as main

    out = tmp_path / "run"
    shutil.copytree(plain_run, out)
    stale = [out / "checkpoints" / ".tmp-step_00000003", out / ".tmp-k2j4h5g6", out / "hub_steps" / "step2" /
             ".tmp-zz99yy88"]
    for folder in stale:
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"half")
    stale.append(out / ".tmp-run.png.ab12cd34")
    stale[-1].write_bytes(b"half a png")
    kept = [out / ".tmp-notes.txt", out / "checkpoints" / checkpoint_name(2) / ".tmp-mine"]  # not names neox_hf uses
    for path in kept:
        path.write_text("the user's")
    assert main(tiny_args(out, small_text, "--train.precision", "fp32", "--resume", steps=3, save=3)) == 0
    assert "at step 2" in capsys.readouterr().out
    assert [path for path in stale if path.exists()] == []
    assert all(path.read_text() == "the user's" for path in kept)


def test_each_rank_reads_the_layout_free_state_alone_and_every_rank_reports_a_damaged_file(tmp_path):
    """The ranks plan and read the layout-free state each on its own (no DCP collectives) and agree on the outcome
    after: written by two ranks and read back equal; then with rank 1's file cut in half only rank 1 meets the
    damage, and both ranks refuse naming that file (tests/workers/layout_free_ranks.py, torch only: ~10 s)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(REPO / "tests" / "workers" / "layout_free_ranks.py"), str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=launch_env(), timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    damaged = tmp_path / "layout_free" / "__1_0.distcp"
    for rank in (0, 1):
        said = (tmp_path / f"rank{rank}.txt").read_text().splitlines()
        assert said[0] == "equal True", said
        assert said[1].startswith(f"refused cannot read {tmp_path / 'layout_free'} ("), said
        assert said[1].endswith(f"{damaged} is truncated or corrupt"), said
