"""neox_hf.hub against the real huggingface_hub client and a local fake Hub (tests/hub_server.py).

Nothing here mocks huggingface_hub: every push and download goes over HTTP to 127.0.0.1.
"""

import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from huggingface_hub import constants, hf_hub_download, snapshot_download
from huggingface_hub import ModelCard
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).parent))  # tests/ is not a package
from conftest import launch_env, reset_accelerate_state  # noqa: E402
from hub_server import FakeHub  # noqa: E402

from neox_hf.errors import HubError  # noqa: E402
from neox_hf.hub import (  # noqa: E402
    HubPusher,
    push_folder,
    write_model_card,
)

GOOD_TOKEN = "hf_test_write_token"
BAD_TOKEN = "hf_bad_secret_0123456789"
REPO = "neox-org/tiny-neox"
FAST = dict(token=GOOD_TOKEN, backoff_s=0.01)  # retries in milliseconds, not seconds


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A running fake Hub that huggingface_hub (and transformers through it) talks to by default."""
    server = FakeHub(tmp_path / "hub", tokens={GOOD_TOKEN: "tester"}).start()
    # huggingface_hub reads HF_ENDPOINT once, at import, into constants.ENDPOINT (HfApi's default) and
    # constants.HUGGINGFACE_CO_URL_TEMPLATE (what hf_hub_url formats): setting the variable now is too
    # late for this process, so patch both; they are read at call time, also by transformers.
    monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )
    # Same import-time capture for offline mode: a suite-wide HF_HUB_OFFLINE=1 must not block 127.0.0.1.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    # The environment is for subprocesses; HF_TOKEN is read on every request, so it works in-process too.
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_TOKEN", GOOD_TOKEN)
    yield server
    server.stop()


def make_model_folder(folder: Path, *, layers: int, marker: str) -> Path:
    """A tiny model folder: safetensors weights, a GPT-NeoX config.json, a README."""
    from transformers import GPTNeoXConfig

    folder.mkdir(parents=True)
    save_file({"embed_in.weight": np.full((4, 2), layers, dtype=np.float32)}, str(folder / "model.safetensors"))
    GPTNeoXConfig(
        vocab_size=16, hidden_size=8, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=16
    ).save_pretrained(folder)
    (folder / "README.md").write_text(f"# {marker}\n")
    return folder


def without_name(config: dict) -> dict:
    """A config dict minus `_name_or_path`, which records where it was loaded from."""
    return {k: v for k, v in config.items() if k != "_name_or_path"}


def local_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


# ---------------------------------------------------------------------------------------------------------
# Pushing


def test_main_and_step_branches_hold_exactly_the_pushed_files(hub, tmp_path):
    final = make_model_folder(tmp_path / "final", layers=3, marker="final")
    step = make_model_folder(tmp_path / "step5", layers=2, marker="step 5")
    (final / "tokenizer.json").write_text("{}")  # only on main: must not leak into the step branch

    url = push_folder(final, REPO, **FAST)
    push_folder(step, REPO, revision="step5", exact=True, **FAST)

    assert url.startswith(f"{hub.endpoint}/{REPO}/commit/")
    assert hub.branches(REPO) == ["main", "step5"]
    assert hub.files(REPO, "main") == local_files(final)
    # step5 was branched from the populated main; exact=True made it the checkpoint and nothing else.
    assert hub.files(REPO, "step5") == local_files(step)


def test_step_revision_round_trips_through_hf_hub_download_and_from_pretrained(hub, tmp_path):
    from transformers import AutoConfig

    push_folder(make_model_folder(tmp_path / "final", layers=3, marker="final"), REPO, **FAST)
    step = make_model_folder(tmp_path / "step5", layers=2, marker="step 5")
    push_folder(step, REPO, revision="step5", exact=True, **FAST)
    cache = tmp_path / "cache"

    weights = hf_hub_download(REPO, "model.safetensors", revision="step5", cache_dir=cache)
    config = AutoConfig.from_pretrained(REPO, revision="step5", cache_dir=cache)
    snapshot = Path(snapshot_download(REPO, revision="step5", cache_dir=tmp_path / "snapshots"))

    assert Path(weights).read_bytes() == (step / "model.safetensors").read_bytes()
    assert without_name(config.to_dict()) == without_name(AutoConfig.from_pretrained(step).to_dict())
    assert config.num_hidden_layers == 2  # the step checkpoint, not main's 3-layer model
    assert local_files(snapshot) == local_files(step)


# create_repo / create_branch are retried only by neox_hf.hub; the commit POST is also retried by the
# client itself (about 3 s of its own backoff), which this case checks we do not break.
@pytest.mark.parametrize("route, status", [("create_repo", 503), ("create_branch", 429), ("commit", 502)])
def test_transient_errors_are_retried_until_the_push_succeeds(hub, tmp_path, route, status):
    folder = make_model_folder(tmp_path / "m", layers=2, marker="m")
    hub.fail_next(route, times=2, status=status)

    push_folder(folder, REPO, revision="step1", max_retries=3, **FAST)

    assert hub.files(REPO, "step1") == local_files(folder)
    assert hub.count(route) >= 3  # two injected failures, then the request that succeeded


def test_persistent_5xx_gives_up_after_max_retries_with_hub_error(hub, tmp_path):
    folder = make_model_folder(tmp_path / "m", layers=2, marker="m")
    hub.fail_next("create_repo", times=10, status=503)

    with pytest.raises(HubError, match=r"after 3 attempts.*try again later"):
        push_folder(folder, REPO, max_retries=2, **FAST)
    assert hub.count("create_repo") == 3


def test_bad_token_raises_hub_error_with_the_fix_and_without_the_token(hub, tmp_path):
    folder = make_model_folder(tmp_path / "m", layers=2, marker="m")

    with pytest.raises(HubError) as raised:
        push_folder(folder, REPO, token=BAD_TOKEN, backoff_s=0.01)

    message = str(raised.value)
    assert REPO in message and "401" in message
    assert "huggingface-cli login" in message and "HF_TOKEN" in message
    assert BAD_TOKEN not in message and BAD_TOKEN not in str(raised.value.__cause__)
    assert hub.count("create_repo") == 1  # an auth failure is not retried
    assert hub.branches(REPO) == []


@pytest.mark.parametrize("status, fix", [(403, "HF_TOKEN"), (404, "check the repo id")])
def test_forbidden_and_not_found_are_not_retried(hub, tmp_path, status, fix):
    folder = make_model_folder(tmp_path / "m", layers=2, marker="m")
    hub.fail_next("create_branch", times=1, status=status)

    with pytest.raises(HubError, match=rf"'{REPO}' \(revision 'step1'\) \(HTTP {status}\).*{fix}"):
        push_folder(folder, REPO, revision="step1", **FAST)
    assert hub.count("create_branch") == 1


def test_invalid_readme_metadata_is_a_hub_error(hub, tmp_path):
    folder = make_model_folder(tmp_path / "m", layers=2, marker="m")
    (folder / "README.md").write_text("---\nlicense: [unclosed\n---\n# card\n")

    with pytest.raises(HubError, match="Invalid metadata in README.md"):
        push_folder(folder, REPO, **FAST)
    assert hub.commits == []


def test_push_cli_in_a_fresh_process_finds_the_hub_through_hf_endpoint(hub, tmp_path):
    # A new interpreter reads HF_ENDPOINT at import, as a user's `neox_hf push` would: no patching there.
    folder = make_model_folder(tmp_path / "m", layers=2, marker="m")
    script = (
        "import argparse, sys\n"
        "from neox_hf.hub import add_push_arguments, run_push\n"
        "sys.exit(run_push(add_push_arguments(argparse.ArgumentParser()).parse_args(sys.argv[1:])))\n"
    )
    env = launch_env(PYTHONPATH=str(Path(__file__).parents[1]))

    done = subprocess.run(
        [sys.executable, "-c", script, str(folder), REPO, "--revision", "step7"],
        env=env, capture_output=True, text=True, timeout=60,
    )

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(f"{hub.endpoint}/{REPO}/commit/")
    assert hub.files(REPO, "step7") == local_files(folder)


# ---------------------------------------------------------------------------------------------------------
# Background pusher


def test_pusher_uploads_steps_in_order_while_the_caller_continues(hub, tmp_path):
    folders = {s: make_model_folder(tmp_path / f"ckpt{s}", layers=s, marker=f"step {s}") for s in (10, 20, 30)}
    hub.pause("commit")  # the Hub is slow: no commit can finish until we say so
    pusher = HubPusher(REPO, **FAST)

    started = time.monotonic()
    for step, folder in folders.items():
        pusher.push_step(folder, step)
    handed_over_s = time.monotonic() - started
    committed_while_caller_ran = list(hub.commits)
    hub.resume("commit")
    pusher.close()

    assert handed_over_s < 1.0 and committed_while_caller_ran == []
    assert [branch for _, branch, _ in hub.commits] == ["step10", "step20", "step30"]
    for step, folder in folders.items():
        assert hub.files(REPO, f"step{step}") == local_files(folder)
    assert len(pusher.commit_urls) == 3


def test_pusher_final_goes_to_main_after_the_steps(hub, tmp_path):
    step = make_model_folder(tmp_path / "ckpt", layers=2, marker="step")
    final = make_model_folder(tmp_path / "final", layers=3, marker="final")

    with HubPusher(REPO, **FAST) as pusher:
        pusher.push_step(step, 100)
        pusher.push_final(final)

    assert [branch for _, branch, _ in hub.commits] == ["step100", "main"]
    assert hub.files(REPO, "main") == local_files(final)


def test_pusher_reraises_the_first_failure_on_close(hub, tmp_path):
    folder = make_model_folder(tmp_path / "m", layers=2, marker="m")
    pusher = HubPusher(REPO, token=BAD_TOKEN, backoff_s=0.01)
    pusher.push_step(folder, 1)
    pusher.push_step(folder, 2)

    with pytest.raises(HubError, match=r"step1.*401") as raised:
        pusher.close()
    assert BAD_TOKEN not in str(raised.value)
    with pytest.raises(HubError, match="closed"):
        pusher.push_step(folder, 3)


# ---------------------------------------------------------------------------------------------------------
# Model card

RECIPE = """model:
  num_layers: 2
  hidden_size: 8
data:
  sources:
    - {path: data/pile.bin, weight: 0.7}
    - {path: data/code.bin, weight: 0.3}
"""
CONFIG = dict(
    num_hidden_layers=2, hidden_size=8, num_attention_heads=2, max_position_embeddings=2048,
    rotary_pct=0.25, use_parallel_residual=True, vocab_size=50304,
)
SOURCES = [{"path": "data/pile.bin", "weight": 0.7}, {"path": "data/code.bin", "weight": 0.3}]


def front_matter_and_body(text: str) -> tuple[dict, str]:
    assert text.startswith("---\n")
    metadata, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(metadata), body


def test_model_card_has_hub_metadata_and_the_facts_of_the_run(tmp_path):
    path = write_model_card(
        tmp_path, recipe_yaml=RECIPE, model_config=CONFIG, num_parameters=1_234_567,
        tokens_trained=3_000_000_000, data_sources=SOURCES, eval_loss=2.5, datasets=["EleutherAI/pile"],
    )

    metadata, body = front_matter_and_body(path.read_text())
    assert path == tmp_path / "README.md"
    assert metadata["library_name"] == "transformers"
    assert metadata["license"] == "apache-2.0"
    assert {"gpt_neox", "causal-lm", "neox_hf"} <= set(metadata["tags"])
    assert metadata["datasets"] == ["EleutherAI/pile"]
    assert ModelCard.load(path).data.to_dict() == metadata  # huggingface_hub reads what we wrote
    for row in ["| Layers | 2 |", "| Hidden size | 8 |", "| Attention heads | 2 |", "| Sequence length | 2048 |",
                "| Rotary fraction (rotary_pct) | 0.25 |", "| Parallel residual | True |",
                "| Vocabulary size | 50304 |"]:
        assert row in body
    assert "1,234,567" in body and "3,000,000,000" in body
    assert "| `data/pile.bin` | 0.7 |" in body and "| `data/code.bin` | 0.3 |" in body
    assert "2.5000" in body and f"{math.exp(2.5):.4f}" in body
    assert f"```yaml\n{RECIPE}```" in body
    assert [p.name for p in tmp_path.iterdir()] == ["README.md"]  # no temp file left behind


def test_model_card_without_eval_or_datasets_and_with_backticks_in_recipe(tmp_path):
    recipe = "notes: |\n  ```python\n  x = 1\n  ```\n"
    path = write_model_card(
        tmp_path, recipe_yaml=recipe, model_config=CONFIG, num_parameters=10, tokens_trained=0,
        data_sources=SOURCES, eval_loss=None, license="mit",
    )

    metadata, body = front_matter_and_body(path.read_text())
    assert metadata["license"] == "mit" and "datasets" not in metadata
    assert "not measured" in body
    assert f"````yaml\n{recipe}````" in body  # a longer fence keeps the recipe's own fence inside


def test_model_card_names_the_missing_config_key(tmp_path):
    config = {k: v for k, v in CONFIG.items() if k != "rotary_pct"}
    with pytest.raises(HubError, match="rotary_pct"):
        write_model_card(
            tmp_path, recipe_yaml=RECIPE, model_config=config, num_parameters=1, tokens_trained=1,
            data_sources=SOURCES, eval_loss=None,
        )


def test_model_card_reads_the_rotary_fraction_of_a_transformers_5_config(tmp_path):
    from transformers import GPTNeoXConfig

    config = GPTNeoXConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=256,
                           vocab_size=512, rotary_pct=0.5).to_dict()
    assert "rotary_pct" not in config  # transformers 5 moved it into rope_parameters
    card = write_model_card(tmp_path, recipe_yaml="model: {}\n", model_config=config, num_parameters=10,
                            tokens_trained=20, data_sources=[{"path": "a.jsonl", "weight": 1.0}], eval_loss=None)
    assert "| Rotary fraction (rotary_pct) | 0.5 |" in card.read_text()



def test_training_run_pushes_pythia_step_branches_and_final_main(hub, tmp_path):
    """`train.push_to_hub` end to end: step checkpoints land on branches step{N}, the final model and card on main,
    and `from_pretrained(repo, revision="step2")` returns the step-2 weights. On the first 20,000 characters of Tiny
    Shakespeare (the start-up report and the held-out split tokenize the whole file: ~3.5 s for the 1 MB one)."""
    from transformers import GPTNeoXForCausalLM

    from neox_hf.recipe.args import parse_run_args
    from neox_hf.train.loop import train

    repo_root = Path(__file__).resolve().parents[1]
    text = tmp_path / "tinyshakespeare.txt"  # conftest's small_text, under the name the card must show
    text.write_text((repo_root / "examples" / "data" / "tinyshakespeare.txt").read_text()[:20000])
    out = tmp_path / "run"
    args = parse_run_args([
        str(repo_root / "recipes" / "tiny.yaml"), "--model.hidden_size", "32", "--model.seq_length", "32",
        "--train.train_iters", "4", "--train.save_interval", "2", "--train.eval_iters", "2",
        "--train.micro_batch_size", "2", "--output.dir", str(out), "--output.tensorboard", "false",
        "--data.sources", f"[{{path: {text}}}]",
        "--train.push_to_hub", "{repo_id: " + REPO + ", revision_per_step: true}",
    ])
    try:
        train(args.recipe)
    finally:
        reset_accelerate_state()
    assert {"step2", "step4"} <= set(hub.branches(REPO))
    main_files = hub.files(REPO, "main")
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "recipe.yaml"} <= set(main_files)
    # Only the model's own files: no optimizer states, RNG pickles, step copies, logs or lock.
    assert not [name for name in main_files if name.startswith(("checkpoints/", "hub_steps/", "runs/"))
                or name in ("train_log.jsonl", ".neox_hf.lock")], sorted(main_files)
    card = main_files["README.md"].decode()
    assert "library_name: transformers" in card and "Tokens trained" in card and "tinyshakespeare" in card
    cache = tmp_path / "hf-cache"  # the repo name recurs across tests: never read another test's download
    step2 = GPTNeoXForCausalLM.from_pretrained(REPO, revision="step2", cache_dir=cache)
    # Each step copy is deleted once pushed; the step-2 training checkpoint holds the same weights.
    assert not (out / "hub_steps" / "step2").exists() and not (out / "hub_steps" / "step4").exists()
    from neox_hf.interop.convert import export_training_checkpoint

    local2 = GPTNeoXForCausalLM.from_pretrained(
        export_training_checkpoint(out / "checkpoints" / "step_00000002", tmp_path / "local2"))
    final = GPTNeoXForCausalLM.from_pretrained(REPO, cache_dir=cache)
    assert all(torch.equal(a, b) for a, b in zip(step2.state_dict().values(), local2.state_dict().values()))
    assert not torch.equal(step2.gpt_neox.embed_in.weight, final.gpt_neox.embed_in.weight)  # step 2 ≠ step 4


def test_failed_step_push_keeps_the_folder_and_names_the_retry_command(hub, tmp_path):
    folder = make_model_folder(tmp_path / "hub_steps" / "step3", layers=1, marker="step 3")
    pusher = HubPusher(REPO, token=BAD_TOKEN, backoff_s=0.01, delete_after=True)
    pusher.push_step(folder, 3)
    with pytest.raises(HubError) as failure:
        pusher.close()
    assert f"retry with `neox_hf push {folder} {REPO} --revision step3`" in str(failure.value)
    assert BAD_TOKEN not in str(failure.value)
    assert folder.is_dir()  # kept for the retry

    ok = HubPusher(REPO, delete_after=True, **FAST)
    ok.push_step(folder, 3)
    ok.close()
    assert not folder.exists() and hub.files(REPO, "step3")


def test_push_cli_of_a_run_folder_uploads_only_the_model_files(hub, tmp_path, capsys):
    from neox_hf.cli import main

    run = make_model_folder(tmp_path / "run", layers=1, marker="run")
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "checkpoints" / "step_00000002" / "optimizer.bin").write_bytes(b"adam state")
    (run / "train_log.jsonl").write_text('{"step": 1}\n')
    assert main(["push", str(run), REPO]) == 0
    assert set(hub.files(REPO, "main")) == {"config.json", "model.safetensors", "README.md"}
