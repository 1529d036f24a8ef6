"""Checkpoint lifecycle, end to end through the real entry point: runs interleaved with resumes from older
checkpoints, deleted and dangling `latest` pointers, truncated and corrupt files, a changed model, a second run on
the same folder. After each: `latest` names a complete checkpoint, no checkpoint the user could still need is gone,
`train_log.jsonl` holds each step once, and every refusal is one line with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from neox_hf.cli import train_main as main
from neox_hf.checkpoint import checkpoint_name, is_complete_checkpoint
from tests.conftest import BUNDLED_TOKENIZER, REPO, launch_env, reset_accelerate_state


def tiny_args(out: Path, data: Path, *extra: str, steps: int = 6, save: int = 2, keep: int = 2) -> list[str]:
    return [
        str(REPO / "recipes" / "tiny.yaml"), "--model.num_layers", "1", "--model.hidden_size", "32",
        "--model.seq_length", "32", "--train.micro_batch_size", "2", "--train.eval_iters", "0",
        "--output.tensorboard", "false", "--tokenizer.path", str(BUNDLED_TOKENIZER),
        "--data.sources", f"[{{path: {data}}}]", "--output.dir", str(out), "--train.train_iters", str(steps),
        "--train.save_interval", str(save), "--train.keep_last_n", str(keep), *extra,
    ]


def run(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def checkpoints(out: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*"))


def latest(out: Path) -> Path:
    folder = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    assert is_complete_checkpoint(folder), folder
    return folder


def logged_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]


def assert_refused(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]  # its own line, after any progress bar
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_resume_from_older_checkpoint_prunes_only_the_current_timeline(tmp_path, small_text, capsys,
                                                                       fresh_accelerate_state):
    out = tmp_path / "run"
    code, outp, err = run(tiny_args(out, small_text, steps=10, save=5), capsys)
    assert code == 0, err
    assert "`train.precision: auto` chose" in outp  # tiny.yaml leaves the precision to the device
    assert checkpoints(out) == [5, 10] and latest(out).name == checkpoint_name(10)

    # Resume from step 5 with a finer save interval and keep_last_n 1: the old pruning kept the highest names
    # (step 10), deleted the new checkpoints and left `latest` dangling.
    code, outp, err = run(tiny_args(out, small_text, "--train.resume", str(out / "checkpoints" / "step_00000005"),
                                    steps=8, save=1, keep=1), capsys)
    assert code == 0, err
    assert "resumed from" in outp and "at step 5" in outp
    assert latest(out).name == checkpoint_name(8)
    assert checkpoints(out) == [8, 10]  # the longer run's step 10 is another timeline: kept
    assert logged_steps(out) == list(range(1, 9))  # steps 6..10 of the first run were dropped, none repeats

    # `latest` deleted: --resume continues from the most recently written checkpoint (8), not the highest (10).
    (out / "checkpoints" / "latest").unlink()
    code, outp, err = run(tiny_args(out, small_text, "--resume", steps=9, save=1, keep=1), capsys)
    assert code == 0, err
    assert "most recently written complete checkpoint, step_00000008" in outp and "at step 8" in outp
    assert latest(out).name == checkpoint_name(9) and checkpoints(out) == [9, 10]

    # `latest` dangling (names a folder that is gone): the same fallback, with a notice.
    (out / "checkpoints" / "latest").write_text("step_00000042")
    code, outp, err = run(tiny_args(out, small_text, "--resume", steps=9, save=1, keep=1), capsys)
    assert code == 0, err
    assert "names step_00000042" in outp and "at step 9" in outp
    assert latest(out).name == checkpoint_name(9)
    assert logged_steps(out) == list(range(1, 10))


def test_damaged_checkpoints_are_refused_naming_the_file_and_the_previous_one(tmp_path, small_text, capsys,
                                                                              fresh_accelerate_state):
    out = tmp_path / "run"
    code, _, err = run(tiny_args(out, small_text, steps=4, save=2), capsys)
    assert code == 0, err
    step4 = latest(out)
    before = sorted(p.name for p in (out / "checkpoints").iterdir())

    # A changed model shape on resume.
    code, _, err = run(tiny_args(out, small_text, "--resume", "--model.hidden_size", "64", steps=6), capsys)
    assert_refused(code, err, "another shape", str(step4))

    # A truncated weight file.
    weights = step4 / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[: len(original) // 2])
    code, _, err = run(tiny_args(out, small_text, "--resume", steps=6), capsys)
    assert_refused(code, err, str(weights), "step_00000002")
    weights.write_bytes(original)

    # A corrupt RNG pickle (accelerate alone would skip it with an info log and resume with other randomness).
    rng = step4 / "random_states_0.pkl"
    rng.write_bytes(b"not a pickle")
    code, _, err = run(tiny_args(out, small_text, "--resume", steps=6), capsys)
    assert_refused(code, err, str(rng), "--train.resume", "step_00000002")

    # A truncated trainer state.
    rng.unlink()
    state = step4 / "trainer_state_rank0.pt"
    state.write_bytes(state.read_bytes()[:100])
    code, _, err = run(tiny_args(out, small_text, "--resume", steps=6), capsys)
    assert_refused(code, err, str(state))

    # Nothing was deleted or repointed by the refusals.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    assert (out / "checkpoints" / "latest").read_text() == step4.name


def test_reused_folder_is_refused_overwritten_only_when_asked_and_locked_while_running(tmp_path, small_text, capsys,
                                                                                      fresh_accelerate_state):
    out = tmp_path / "run"
    code, _, err = run(tiny_args(out, small_text, steps=4, save=2), capsys)
    assert code == 0, err
    model_bytes = (out / "model.safetensors").read_bytes()

    code, _, err = run(tiny_args(out, small_text, steps=2, save=2), capsys)
    assert_refused(code, err, "not empty", "--resume", "--overwrite")
    assert (out / "model.safetensors").read_bytes() == model_bytes and checkpoints(out) == [2, 4]

    code, _, err = run(tiny_args(out, small_text, "--resume", "--overwrite"), capsys)
    assert_refused(code, err, "--resume", "--overwrite")

    # A second run while one holds the folder (a real other process holding the lock).
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom neox_hf.train.guards import RunLock\n"
         "lock = RunLock(sys.argv[1]).acquire()\nprint('locked', flush=True)\ntime.sleep(60)\n", str(out)],
        stdout=subprocess.PIPE, text=True, env=launch_env(PYTHONPATH=str(REPO)),
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, _, err = run(tiny_args(out, small_text, "--resume", steps=6), capsys)
        assert_refused(code, err, "in use by another run", f"pid {holder.pid}")
    finally:
        holder.kill()
        holder.wait()
    assert latest(out).name == checkpoint_name(4)

    # --overwrite: the earlier run's checkpoints, log and model go; the new run owns the folder.
    code, _, err = run(tiny_args(out, small_text, "--overwrite", steps=2, save=2), capsys)
    assert code == 0, err
    assert checkpoints(out) == [2] and latest(out).name == checkpoint_name(2)
    assert logged_steps(out) == [1, 2]
    assert not (out / ".neox_hf.lock").exists()


def test_diverging_run_stops_naming_the_step_and_saves_nothing_non_finite(tmp_path, small_text, capsys,
                                                                         fresh_accelerate_state):
    out = tmp_path / "run"
    code, _, err = run(tiny_args(out, small_text, "--train.lr", "1e6", "--train.min_lr", "0", "--train.warmup", "0",
                                 "--train.clip_grad", "0", steps=12, save=1, keep=3), capsys)
    assert_refused(code, err, "diverged at step", "train.lr")
    assert not (out / "model.safetensors").exists()  # no final save
    text = (out / "train_log.jsonl").read_text() if (out / "train_log.jsonl").exists() else ""
    assert "NaN" not in text and "Infinity" not in text
    for line in text.splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-finite {c} in train_log.jsonl"))
    if (out / "checkpoints" / "latest").exists():  # the last good checkpoint is named and complete
        assert latest(out).name in err


def test_undecodable_documents_are_reported_and_fail_above_the_threshold(tmp_path, capsys, fresh_accelerate_state):
    text = (REPO / "examples" / "data" / "tinyshakespeare.txt").read_text()[:40000].split("\n\n")
    data = tmp_path / "mixed.jsonl"
    # Every third line is broken JSON or has a non-string text: a third of the documents are undecodable.
    lines = [json.dumps({"text": t}) if i % 3 else ("{broken" if i % 2 else json.dumps({"text": 7}))
             for i, t in enumerate(text)]
    data.write_text("\n".join(lines) + "\n")
    code, _, err = run(tiny_args(tmp_path / "strict", data, steps=4, save=4), capsys)
    assert_refused(code, err, "skipped as undecodable", "data.max_skipped_fraction")
    code, outp, err = run(tiny_args(tmp_path / "lenient", data, "--data.max_skipped_fraction", "0.5", steps=4, save=4),
                          capsys)
    assert code == 0, err
    assert "documents skipped as undecodable" in outp


@pytest.mark.parametrize("trained_in", ["fp32", "bf16"])  # one of the two differs from what `auto` picks here
def test_auto_precision_resumes_in_the_precision_the_checkpoint_was_trained_in(trained_in, tmp_path, small_text,
                                                                               capsys, fresh_accelerate_state):
    out = tmp_path / "run"
    code, _, err = run(tiny_args(out, small_text, "--train.precision", trained_in, steps=2, save=2), capsys)
    assert code == 0, err
    reset_accelerate_state()  # the second run's Accelerator may take another precision
    code, outp, err = run(tiny_args(out, small_text, "--resume", "--train.precision", "auto", steps=3, save=3), capsys)
    assert code == 0, err
    assert f"`train.precision: auto` resumes in {trained_in}, the precision step_00000002 was trained in" in outp
    assert f"precision: {trained_in}" in (out / "recipe.yaml").read_text()


# ----------------------------------------------------------------------------------------------------------------
# train.async_checkpoint: the write in the background (the kill during it: tests/test_failure_preemption.py's matrix)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.distributed  # slow tier: three tiny trainings in this process, ~15 s
def test_a_background_checkpoint_resumes_exactly_and_a_failed_write_leaves_latest_on_the_previous_one(
        tmp_path, small_text, capsys, fresh_accelerate_state, monkeypatch):
    """One process, `train.async_checkpoint: true`: its checkpoints are the layout-free state (the one format), and
    a resume from one gives the uninterrupted run's losses exactly. A background write that fails (the disk fills:
    ENOSPC inside DCP's writer, in its thread) is reported at the next save as one line naming the intact
    checkpoint, `latest` never having moved to the failed one, nothing staged left behind."""
    import errno
    import shutil

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from tests.test_failure_preemption import step_losses

    background = ("--train.async_checkpoint", "true", "--train.precision", "fp32", "--train.log_interval", "1")
    straight = tmp_path / "straight"
    code, out, err = run(tiny_args(straight, small_text, *background, steps=6, save=2, keep=3), capsys)
    assert code == 0, err
    step4 = latest(straight).parent / checkpoint_name(4)
    assert sorted(p.name for p in step4.iterdir()) == ["config.json", "layout_free", "random_states_0.pkl",
                                                       "tokenizer.json", "tokenizer_config.json",
                                                       "trainer_state_rank0.pt"]
    reset_accelerate_state()
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(step4, resumed / "checkpoints" / step4.name)
    (resumed / "checkpoints" / "latest").write_text(step4.name)
    code, out, err = run(tiny_args(resumed, small_text, *background, "--resume", steps=6, save=2, keep=3), capsys)
    assert code == 0, err
    want, got = step_losses(straight), step_losses(resumed)
    assert sorted(got) == [5, 6] and all(got[s] == want[s] for s in got), (got, want)

    reset_accelerate_state()
    write_data = FileSystemWriter.write_data

    def full_disk_at_step_4(self, plan, planner):
        if "step_00000004" in str(self.path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_data(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk_at_step_4)
    failed = tmp_path / "failed"
    code, out, err = run(tiny_args(failed, small_text, *background, steps=6, save=2, keep=3), capsys)
    assert_refused(code, err, "no space left on", "checkpoint step_00000004", "step_00000002, is intact")
    assert (failed / "checkpoints" / "latest").read_text() == checkpoint_name(2) and checkpoints(failed) == [2]
    assert not [p for p in (failed / "checkpoints").iterdir() if p.name.startswith(".tmp")]


def test_a_background_checkpoint_that_would_not_fit_in_host_memory_is_refused_in_one_line():
    from neox_hf.checkpoint.background import check_host_memory, host_copy_bytes
    from neox_hf.errors import RecipeError

    assert host_copy_bytes(10**9, shards=8) == 1.5e9  # fp32 master + two moments of an eighth of 1B parameters
    check_host_memory(10**9, shards=8, local_ranks=8, available=13 * 10**9)
    with pytest.raises(RecipeError) as refused:
        check_host_memory(10**9, shards=8, local_ranks=8, available=11 * 10**9)
    assert str(refused.value) == ("`train.async_checkpoint: true` copies the checkpoint to host memory: 11.2 GiB for "
                                  "this node's 8 rank(s), 10.2 GiB available; set `train.async_checkpoint: false` "
                                  "(the step then waits for the write), or use more nodes")


def test_plan_counts_the_host_copy_of_a_background_checkpoint():
    from neox_hf.plan import plan_for_recipe, plan_table, read_recipe

    args = [str(REPO / "recipes" / "tiny.yaml"), "--model.num_layers", "2", "--model.hidden_size", "64",
            "--train.precision", "fp32"]
    assert plan_for_recipe(read_recipe(args)).host_checkpoint_bytes is None
    plan = plan_for_recipe(read_recipe([*args, "--train.async_checkpoint", "true"]))
    params = 2 * 50304 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64  # embedding, head, layers, final norm
    assert plan.host_checkpoint_bytes == 12 * params
    assert any(line.startswith("async checkpoint: ") for line in plan_table(plan))


def test_a_save_whose_staging_another_ranks_failure_removed_is_abandoned_not_reported_as_its_own_error(tmp_path):
    """Rank 0 writing the config and tokenizer into a staging folder that a failed rank has just removed: the
    tokenizers library says only `No such file or directory (os error 2)`, naming no path. The save is abandoned
    (the launcher ends the rank; the failed rank's line is the one error shown), not raised as a second error; with
    one process, or with the folder still there, the error is the save's own."""
    from neox_hf.checkpoint.save import SaveAbandoned, _save_failed
    from neox_hf.train.preemption import lost_a_peer

    staging, error = tmp_path / ".tmp-step_00000006", Exception("No such file or directory (os error 2)")
    abandoned = _save_failed(tmp_path, staging, error, several=True)
    assert isinstance(abandoned, SaveAbandoned) and lost_a_peer(abandoned)
    staging.mkdir()
    assert _save_failed(tmp_path, staging, error, several=True) is error
    staging.mkdir()
    assert _save_failed(tmp_path, staging, error, several=False) is error
