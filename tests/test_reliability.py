"""The guards each on its own: checkpoint pruning and resume fallback, the output-folder lock, non-finite steps,
train_log truncation, skipped documents, special tokens, atomic writes and their permissions, the Hub's file
selection, adapter / base mismatch. End-to-end runs are in test_checkpoint_lifecycle.py, bad input in
test_fuzz_inputs.py."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from neox_hf.errors import CheckpointError, DataError, RecipeError, TrainingDiverged
from neox_hf.checkpoint import LATEST, checkpoint_name, find_resume_checkpoint, previous_checkpoint, prune_checkpoints
from neox_hf.train.guards import (
    LOCK_NAME,
    RunLock,
    check_finite,
    check_output_dir,
    check_precision,
    check_skipped_documents,
    clear_previous_run,
)
from neox_hf.checkpoint.run_log import step_log_line, truncate_train_log
from tests.conftest import BUNDLED_TOKENIZER, REPO


def fake_checkpoint(root: Path, step: int, mtime: float | None = None) -> Path:
    folder = root / checkpoint_name(step)
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"x")
    (folder / "trainer_state_rank0.pt").write_bytes(b"x")
    if mtime is not None:
        os.utime(folder / "trainer_state_rank0.pt", (mtime, mtime))
    return folder


def steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in root.glob("step_*"))


# ----------------------------------------------------------------------------------------------------------------
# 1. pruning


def test_pruning_keeps_the_new_timeline_and_the_longer_old_run(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (90, 100):  # an older, longer run
        fake_checkpoint(root, step)
    fake_checkpoint(root, 92)  # this run resumed from 90 and saved 92
    (root / LATEST).write_text(checkpoint_name(92))
    deleted = prune_checkpoints(root, keep_last_n=1, current_step=92)
    assert [p.name for p in deleted] == [checkpoint_name(90)]
    assert steps(root) == [92, 100]  # the old rule (highest names) kept only 100 and left `latest` dangling


def test_pruning_never_deletes_what_latest_names(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        fake_checkpoint(root, step)
    (root / LATEST).write_text(checkpoint_name(2))
    prune_checkpoints(root, keep_last_n=1, current_step=6)
    assert steps(root) == [2, 6]


def test_pruning_ignores_incomplete_and_staging_folders(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4):
        fake_checkpoint(root, step)
    (root / ".tmp-step_00000006").mkdir()
    (root / checkpoint_name(8)).mkdir()  # no trainer state: not complete, never counted
    prune_checkpoints(root, keep_last_n=1, current_step=8)
    assert steps(root) == [4, 8]


# ----------------------------------------------------------------------------------------------------------------
# 2. resume with `latest` missing or dangling


def test_resume_auto_without_latest_uses_the_most_recently_written(tmp_path):
    root = tmp_path / "out" / "checkpoints"
    fake_checkpoint(root, 10, mtime=1000)  # a longer run, abandoned
    fake_checkpoint(root, 6, mtime=2000)  # the newest timeline
    notices = []
    assert find_resume_checkpoint("auto", tmp_path / "out", notify=notices.append).name == checkpoint_name(6)
    assert "is missing" in notices[0] and checkpoint_name(6) in notices[0]

    (root / LATEST).write_text(checkpoint_name(99))
    notices.clear()
    assert find_resume_checkpoint("auto", tmp_path / "out", notify=notices.append).name == checkpoint_name(6)
    assert checkpoint_name(99) in notices[0]


def test_resume_auto_with_no_checkpoint_starts_fresh_and_a_bad_path_is_refused(tmp_path):
    assert find_resume_checkpoint("auto", tmp_path / "out", notify=pytest.fail) is None
    with pytest.raises(CheckpointError, match="not found"):
        find_resume_checkpoint(str(tmp_path / "nowhere"), tmp_path / "out")
    half = tmp_path / "out" / "checkpoints" / checkpoint_name(3)
    half.mkdir(parents=True)
    with pytest.raises(CheckpointError, match="not a complete"):
        find_resume_checkpoint(str(half), tmp_path / "out")


def test_previous_checkpoint_is_the_complete_one_before(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        fake_checkpoint(root, step)
    assert previous_checkpoint(root / checkpoint_name(6)).name == checkpoint_name(4)
    assert previous_checkpoint(root / checkpoint_name(2)) is None


# ----------------------------------------------------------------------------------------------------------------
# 3. output folder: refusal, overwrite, lock


def test_non_empty_output_dir_is_refused_unless_resume_or_overwrite(tmp_path):
    check_output_dir(tmp_path / "new", resume=False, overwrite=False)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK_NAME).write_text("")
    check_output_dir(tmp_path / "run", resume=False, overwrite=False)  # only a lock file: empty
    (tmp_path / "run" / "config.json").write_text("{}")
    with pytest.raises(RecipeError, match="--resume.*--overwrite"):
        check_output_dir(tmp_path / "run", resume=False, overwrite=False)
    check_output_dir(tmp_path / "run", resume=True, overwrite=False)
    check_output_dir(tmp_path / "run", resume=False, overwrite=True)


def test_overwrite_clears_only_what_a_run_wrote(tmp_path):
    for name in ("checkpoints/step_00000002/x", "hub_steps/step2/x", "runs/a", "plots/loss.png"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    for name in ("train_log.jsonl", "config.json", "model.safetensors", "README.md", "recipe.yaml", "notes.txt"):
        (tmp_path / name).write_text("x")
    clear_previous_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_lock_names_the_holder_and_is_released(tmp_path):
    with RunLock(tmp_path):
        holder = (tmp_path / LOCK_NAME).read_text()
        assert f"pid {os.getpid()}" in holder
        with pytest.raises(RecipeError, match=f"in use by another run.*pid {os.getpid()}"):
            RunLock(tmp_path).acquire()  # a second open file description conflicts even in one process
    assert not (tmp_path / LOCK_NAME).exists()
    RunLock(tmp_path).acquire().release()


# ----------------------------------------------------------------------------------------------------------------
# 5. non-finite steps, strict JSON log


@pytest.mark.parametrize("loss,grad_norm", [(float("nan"), 1.0), (float("inf"), None), (2.0, float("inf")),
                                            (2.0, float("nan"))])
def test_non_finite_loss_or_grad_norm_stops_naming_the_step(loss, grad_norm, tmp_path):
    root = tmp_path / "checkpoints"
    fake_checkpoint(root, 4)
    (root / LATEST).write_text(checkpoint_name(4))
    with pytest.raises(TrainingDiverged, match=r"step 5 .*last good checkpoint is .*step_00000004"):
        check_finite(5, loss, grad_norm, output_dir=tmp_path)


def test_finite_values_pass_and_the_log_line_is_strict_json():
    check_finite(3, 2.5, 0.7)
    check_finite(3, 2.5, None)
    assert json.loads(step_log_line({"step": 1, "loss": 2.0})) == {"step": 1, "loss": 2.0}
    with pytest.raises(ValueError):
        step_log_line({"step": 1, "loss": float("nan")})


# ----------------------------------------------------------------------------------------------------------------
# train_log.jsonl after a resume from an earlier checkpoint


def test_train_log_keeps_steps_up_to_the_resume_point_and_drops_a_torn_line(tmp_path):
    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 9)) + '{"step": 9, "lo')
    assert truncate_train_log(tmp_path, 5) == 4
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3, 4, 5]
    assert truncate_train_log(tmp_path, 5) == 0


# ----------------------------------------------------------------------------------------------------------------
# skipped documents


def test_skipped_documents_are_reported_and_fail_above_the_threshold():
    assert check_skipped_documents({"documents": 100, "skipped_undecodable": 0}, 0.01) is None
    line = check_skipped_documents({"documents": 199, "skipped_undecodable": 1}, 0.01)
    assert "1 of 200 documents skipped" in line
    with pytest.raises(DataError, match="max_skipped_fraction"):
        check_skipped_documents({"documents": 90, "skipped_undecodable": 10}, 0.01)
    assert check_skipped_documents({"documents": 90, "skipped_undecodable": 10}, 0.5) is not None


# ----------------------------------------------------------------------------------------------------------------
# 7 / 8: special tokens must exist; fp16 without DeepSpeed on CPU


def test_special_tokens_must_already_be_in_the_vocabulary():
    from neox_hf.data.tokenizer import load_tokenizer

    with pytest.raises(RecipeError, match="did you mean '<\\|endoftext\\|>'"):
        load_tokenizer(str(BUNDLED_TOKENIZER), eos_token="<|endoftxt|>")
    tokenizer = load_tokenizer(str(BUNDLED_TOKENIZER))
    assert len(tokenizer) == 50277 and tokenizer.eos_token_id == 0  # nothing added


def test_default_tokenizer_path_resolves_from_the_repository(monkeypatch):
    from neox_hf.data.tokenizer import load_tokenizer
    from neox_hf.recipe import TokenizerConfig

    monkeypatch.chdir(REPO)
    assert load_tokenizer(TokenizerConfig().path).eos_token == "<|endoftext|>"


def test_fp16_without_deepspeed_is_refused_on_cpu_only():
    from neox_hf.recipe import recipe_from_dict

    recipe = recipe_from_dict({"train": {"precision": "fp16"}})
    with pytest.raises(RecipeError, match="fp16"):
        check_precision(recipe, cuda_available=False)
    check_precision(recipe, cuda_available=True)
    check_precision(recipe_from_dict({"train": {"precision": "fp16"}, "parallel": {"zero_stage": 1}}),
                    cuda_available=False)


def test_recipe_activation_list_is_what_transformers_knows():
    from transformers.activations import ACT2FN

    from neox_hf.recipe import HIDDEN_ACTIVATIONS

    assert set(HIDDEN_ACTIVATIONS) <= set(ACT2FN)


# ----------------------------------------------------------------------------------------------------------------
# atomic writes: nothing half-written, normal permissions


def test_atomic_writes_leave_no_temporary_file_and_use_normal_permissions(tmp_path):
    from neox_hf.hub import write_model_card
    from neox_hf.io import atomic_path, atomic_write_text

    umask = os.umask(0o022)
    try:
        path = atomic_write_text(tmp_path / "a.txt", "hello")
        with pytest.raises(RuntimeError):
            with atomic_path(tmp_path / "b.bin") as tmp:
                tmp.write_bytes(b"half")
                raise RuntimeError("crash mid-write")
        card = write_model_card(tmp_path, recipe_yaml="a: 1\n", model_config={
            "num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "max_position_embeddings": 8,
            "rotary_pct": 0.25, "use_parallel_residual": True, "vocab_size": 16}, num_parameters=1,
            tokens_trained=1, data_sources=[], eval_loss=None)
    finally:
        os.umask(umask)
    assert path.read_text() == "hello" and not (tmp_path / "b.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "a.txt"]
    for written in (path, card):
        assert stat.S_IMODE(written.stat().st_mode) == 0o644, oct(written.stat().st_mode)


# ----------------------------------------------------------------------------------------------------------------
# 4. what of a run's folder goes to the Hub


def test_only_the_model_files_of_a_run_folder_are_pushed(tmp_path):
    from neox_hf.hub import is_run_folder, model_folder_files

    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "README.md", "recipe.yaml", "train_log.jsonl", LOCK_NAME, "plots/loss.png",
                 "checkpoints/step_00000002/optimizer.bin", "checkpoints/step_00000002/random_states_0.pkl",
                 "hub_steps/step2/model.safetensors", "runs/events.out"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    assert is_run_folder(tmp_path)
    assert model_folder_files(tmp_path) == ["README.md", "config.json", "generation_config.json", "model.safetensors",
                                            "recipe.yaml", "tokenizer.json", "tokenizer_config.json", "plots/loss.png"]


# ----------------------------------------------------------------------------------------------------------------
# merge onto a base the adapter does not fit


def _tiny_model_folder(folder: Path, layers: int) -> Path:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(vocab_size=64, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
                           intermediate_size=32, max_position_embeddings=32)
    GPTNeoXForCausalLM(config).save_pretrained(folder)
    return folder


def test_an_adapter_is_refused_on_a_base_it_does_not_fit(tmp_path, capsys):
    """peft only warns when adapter weights find no module of the base (another layer count) and merges the rest:
    `neox_hf merge` refuses. Since merge also refuses a base other than the one the adapter records, the shape check
    is reached by a base folder replaced after training (same path, other model) and by --force onto another base."""
    import shutil

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GPTNeoXForCausalLM

    from neox_hf.cli import main
    from tests.test_checkpoint_lifecycle import assert_refused

    torch.manual_seed(0)
    base3 = _tiny_model_folder(tmp_path / "base3", layers=3)
    base1 = _tiny_model_folder(tmp_path / "base1", layers=1)
    lora = get_peft_model(GPTNeoXForCausalLM.from_pretrained(base3),
                          LoraConfig(r=2, lora_alpha=4, target_modules=["query_key_value"]))
    lora.save_pretrained(tmp_path / "adapter")
    assert main(["merge", str(base3), str(tmp_path / "adapter"), str(tmp_path / "merged")]) == 0  # the right base
    capsys.readouterr()

    assert main(["merge", str(base1), str(tmp_path / "adapter"), str(tmp_path / "other-base"), "--force"]) == 2
    assert_refused(2, capsys.readouterr().err, "does not fit base model", str(base1))

    shutil.rmtree(base3)
    _tiny_model_folder(base3, layers=1)  # the recorded base, replaced by another model
    assert main(["merge", str(base3), str(tmp_path / "adapter"), str(tmp_path / "replaced-base")]) == 2
    assert_refused(2, capsys.readouterr().err, "does not fit base model", str(base3))
    assert not (tmp_path / "other-base").exists() and not (tmp_path / "replaced-base").exists()
