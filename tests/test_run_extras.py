"""Around a run: trackers (TensorBoard event files and offline wandb files read back), lm-eval scores during
training in train_log.jsonl / trackers / card section, the run picture, and the recipe keys that drive them."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from neox_hf.errors import RecipeError
from neox_hf.recipe import recipe_from_dict
from neox_hf.trackers import REDACTED, init_tracker_kwargs, run_name, tracker_config, tracker_names
from tests.conftest import BUNDLED_TOKENIZER, REPO, reset_accelerate_state
from tests.test_eval_tasks import local_task

FAKE_TOKEN = "hf_" + "Zq8" * 12  # looks like a Hugging Face token; must never reach a tracker or a file


def tiny_run_recipe(out: Path, text: Path = REPO / "examples/data/tinyshakespeare.txt", **sections) -> dict:
    raw = {
        "model": {"num_layers": 1, "hidden_size": 64, "num_attention_heads": 2, "seq_length": 64, "hidden_dropout": 0.1},
        "tokenizer": {"path": str(BUNDLED_TOKENIZER)},
        "data": {"sources": [{"path": str(text)}], "validation_fraction": 0.05},
        "train": {"train_iters": 6, "micro_batch_size": 2, "lr": 1e-3, "log_interval": 2, "eval_interval": 3,
                  "eval_iters": 2},
        "output": {"dir": str(out)},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return raw


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, dict[int, float]] = {}
    for events in folder.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events.parent))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in accumulator.Scalars(tag)})
    return scalars


def test_run_logs_eval_tasks_to_log_trackers_plot_and_card(tmp_path, small_text, monkeypatch, fresh_accelerate_state):
    """On the first 20,000 characters of Tiny Shakespeare: the start-up report tokenizes the whole training file to
    count an epoch's tokens, ~3 s a run for the whole file, for 6 steps that read 800 tokens of it."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("wandb")
    from neox_hf.plot import model_card_section
    from neox_hf.train.loop import train
    from neox_hf.checkpoint.run_log import read_run_log

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    monkeypatch.setenv("WANDB_API_KEY", FAKE_TOKEN[3:43])
    out = tmp_path / "run"
    task = local_task(tmp_path)
    recipe = recipe_from_dict(tiny_run_recipe(out, small_text, train={"eval_tasks": [str(task)]},
                                              output={"report_to": ["wandb"], "run_name": "tiny-check"}))
    result = train(recipe)
    reset_accelerate_state()
    plain = train(recipe_from_dict(tiny_run_recipe(tmp_path / "plain", small_text, output={"tensorboard": False})))

    # Evaluating (lm-eval included) leaves training untouched: same losses step by step, dropout on.
    assert result.train_losses == plain.train_losses
    # train_log.jsonl: every step, and evaluations at 0 (loss only), the interval 3 and the end (loss + tasks).
    log = read_run_log(out)
    assert [r["step"] for r in log.steps] == [1, 2, 3, 4, 5, 6]
    assert [e["step"] for e in log.evals] == [0, 3, 6]
    assert "local_lambada/acc" not in log.evals[0]
    for entry in log.evals[1:]:
        assert set(entry) >= {"loss", "perplexity", "local_lambada/acc", "local_lambada/perplexity"}
    assert [(e["step"], e["loss"]) for e in log.evals] == result.eval_losses
    # TensorBoard (on by output.tensorboard) holds the same numbers at the same steps.
    scalars = tensorboard_scalars(out / "runs")
    assert scalars["eval/local_lambada/perplexity"] == pytest.approx(
        {e["step"]: e["local_lambada/perplexity"] for e in log.evals[1:]}, rel=1e-6)
    assert scalars["train/loss"][6] == pytest.approx((log.steps[4]["loss"] + log.steps[5]["loss"]) / 2, rel=1e-6)
    # wandb, offline: the run's files are under OUT/wandb, with our run name and the flattened recipe.
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    wandb_bytes = b"".join(p.read_bytes() for p in runs[0].rglob("*") if p.is_file())
    assert b"tiny-check" in wandb_bytes and b"train.eval_tasks" in wandb_bytes and b"local_lambada/acc" in wandb_bytes
    # Secrets from the environment reach no file of the run.
    for path in out.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert FAKE_TOKEN.encode() not in data and FAKE_TOKEN[3:43].encode() not in data, path
    # The picture and the card section that links it with the last scores.
    png = (out / "run.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (800, 1040)  # 4 panels
    section = model_card_section(out)
    assert "![" in section and "(run.png)" in section and "| local_lambada | acc |" in section
    assert "step 6" in section


def test_tensorboard_flag_and_report_to_choose_the_trackers(tmp_path):
    base = tiny_run_recipe(tmp_path / "tiny")
    assert tracker_names(recipe_from_dict(base)) == ["tensorboard"]  # output.tensorboard defaults to true
    off = recipe_from_dict({**base, "output": {"dir": str(tmp_path / "tiny"), "tensorboard": False}})
    assert tracker_names(off) == []
    both = recipe_from_dict({**base, "output": {"dir": str(tmp_path / "tiny"), "report_to": ["wandb"]}})
    assert tracker_names(both) == ["wandb", "tensorboard"]
    explicit = recipe_from_dict({**base, "output": {"dir": str(tmp_path / "tiny"), "tensorboard": False,
                                                    "report_to": ["tensorboard"]}})
    assert tracker_names(explicit) == ["tensorboard"]  # report_to wins over the shorthand
    assert run_name(recipe_from_dict(base)) == "tiny"
    kwargs = init_tracker_kwargs(both)
    assert kwargs["project_name"] == "neox_hf" and kwargs["init_kwargs"]["wandb"]["name"] == "tiny"
    assert kwargs["config"]["train.lr"] == 1e-3 and kwargs["config"]["model.num_layers"] == 1


def test_tracker_config_is_flat_scalars_without_secrets():
    recipe = recipe_from_dict({"data": {"sources": [{"path": f"https://me:{FAKE_TOKEN}@example.com/d.jsonl"},
                                                    {"path": f"hub/{FAKE_TOKEN}"}]}})
    config = tracker_config(recipe)
    assert all(v is None or isinstance(v, (bool, int, float, str)) for v in config.values())
    text = json.dumps(config)
    assert FAKE_TOKEN not in text and "me:" not in text and text.count(REDACTED) == 2
    assert config["tokenizer.eos_token"] == "<|endoftext|>"  # special tokens are not secrets
    assert config["train.push_to_hub"] is None


@pytest.mark.parametrize("output, message", [
    ({"report_to": ["tensorbord"]}, "did you mean tensorboard"),
    ({"report_to": ["aim"]}, "pip install aim"),
    ({"report_to": ["wandb", "wandb"]}, "repeats"),
    ({"run_name": " "}, "output.run_name"),
])
def test_bad_tracker_settings_are_refused_by_name(output, message):
    if output.get("report_to") == ["aim"] and __import__("importlib.util").util.find_spec("aim"):
        pytest.skip("aim is installed here")
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict({"output": output})


def test_plot_command_draws_run_png_and_refuses_a_folder_without_log(tmp_path, capsys):
    from neox_hf.cli import main

    lines = [{"step": s, "loss": 5.0 - s * 0.1, "lr": 1e-3 * s / 10, "consumed_samples": 4 * s,
              "consumed_tokens": 256 * s, "time": 100.0 + 0.5 * s} for s in range(1, 11)]
    lines.insert(3, {"step": 3, "eval": {"loss": 4.9, "perplexity": 134.3}})
    (tmp_path / "train_log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 11, "lo')
    assert main(["plot", str(tmp_path)]) == 0
    png = (tmp_path / "run.png").read_bytes()
    assert png[:4] == b"\x89PNG" and struct.unpack(">II", png[16:24]) == (800, 780)  # 3 panels: no task scores
    assert not list(tmp_path.glob(".tmp*"))
    from neox_hf.plot import tokens_per_second
    from neox_hf.checkpoint.run_log import read_run_log

    # 256 tokens per 0.5 s; step 4's wall time includes the evaluation after step 3, so it is left out.
    assert tokens_per_second(read_run_log(tmp_path)) == [(s, 512.0) for s in range(2, 11) if s != 4]
    # A loop that logs its window throughput on the step lines is plotted from that.
    lines[5]["tokens_per_s"], lines[10]["tokens_per_s"] = 900.0, 1000.0
    (tmp_path / "train_log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert tokens_per_second(read_run_log(tmp_path)) == [(5, 900.0), (10, 1000.0)]
    assert main(["plot", str(tmp_path / "nothing")]) == 2
    assert "train_log.jsonl not found" in capsys.readouterr().err


def test_drawing_the_run_leaves_the_callers_matplotlib_backend_and_figures_alone(tmp_path):
    """`train` from a notebook draws run.png at the end: the notebook's backend and pyplot figures must survive it
    (pyplot's `matplotlib.use("Agg")`, what it did before, switched the whole process to Agg)."""
    (tmp_path / "train_log.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 5.0, "lr": 1e-3, "consumed_samples": s, "consumed_tokens": 64 * s}) + "\n"
        for s in range(1, 4)))
    script = ("import matplotlib; matplotlib.use('svg'); import matplotlib.pyplot as plt; plt.figure()\n"
              f"from neox_hf.plot import write_run_plot; write_run_plot({str(tmp_path)!r})\n"
              "print(matplotlib.get_backend(), plt.get_fignums())")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["svg", "[1]"]
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"


def test_gpt_neox_logging_and_eval_task_keys_translate(tmp_path):
    from neox_hf.neox_yaml import load_neox_recipe_dict

    config = tmp_path / "neox.yml"
    config.write_text('{"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "use-wandb": True,\n'
                      ' "wandb-project": "pythia", "wandb_group": "run-7", "wandb-team": "eleuther",\n'
                      ' "tensorboard-dir": "./tensorboard", "eval-tasks": ["lambada_openai", "piqa"]}\n')
    translation = load_neox_recipe_dict([config])
    recipe = recipe_from_dict(translation.recipe)
    assert recipe.output.report_to == ["wandb"] and recipe.output.project == "pythia"
    assert recipe.output.run_name == "run-7" and recipe.output.tensorboard
    assert tracker_names(recipe) == ["wandb", "tensorboard"]
    assert recipe.train.eval_tasks == ["lambada_openai", "piqa"]
    notices = "\n".join(translation.notices)
    assert "tensorboard_dir: ./tensorboard → TensorBoard on" in notices
    no_effect = next(n for n in translation.notices if n.startswith("no effect"))
    assert "wandb_team" in no_effect and "use_wandb" not in no_effect and "eval_tasks" not in no_effect


# lm-eval on gathered weights under TP2 and ZeRO-3 is checked in the runs that already launch those layouts:
# tests/test_resume.py (TP2 reference run) and tests/test_train.py (ZeRO-3 run).
