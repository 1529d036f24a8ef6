"""The commands of README.md and docs/*.md run as written. Every line of their ```bash blocks is either run here (in
a copy of the repository layout, in reading order: README, then the pages in mkdocs.yml's nav order, with a tiny step
count appended to training commands) or listed in NOT_RUN / CLUSTER with what else it needs, which the page states
next to it. A command shown on several pages runs once. Training and `neox_hf` commands run in-process through their
entry points; the 2-process ZeRO-2 command runs under `accelerate launch`."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import reset_accelerate_state, REPO, free_port, launch_env

README = REPO / "README.md"
DOCS = REPO / "docs"

# Commands README.md or docs/ show that this test does not run, and why (the page says what they need).
NOT_RUN = {
    "pip install torch==2.13.0": "installation",
    'pip install -e ".[test]"': "installation",
    "pip install -e .": "installation",
    "python -m pytest tests -q": "the test suite itself",
    "neox_hf convert-neox global_step143000 --config 14M.yml --tokenizer examples/data/gpt-neox-20b-tokenizer.json OUT":
        "needs a GPT-NeoX checkpoint; test_cli_interop converts one",
    "neox_hf batches CONFIG --data-path PREFIX --data-parallel 8 --start-step 0 --end-step 10 --output b.npy":
        "the command's synopsis (placeholders); the worked example below it runs",
    "neox_hf batches ../shared/data/neox-configs/pythia/160M.yml --data-path pile-deduped-preshuffled/document --order "
    "preshuffled --data-parallel 32 --start-step N --end-step N+1 --output stepN.npy --decode":
        "needs Pythia's pre-shuffled Pile files (hundreds of GB); test_neox_order reads pre-shuffled rows",
    "neox_hf push OUT my-org/my-model [--revision step1000]": "needs a Hub and a token; test_hub pushes through the "
                                                              "CLI to a local fake Hub",
    "torchrun --standalone --nproc_per_node 2 run_clm_neox.py recipes/tiny.yaml --parallel.backend fsdp2":
        "test_fsdp2 launches the same entry point under torchrun (2 and 4 processes, a smaller model)",
    "accelerate launch --config_file examples/launch/cpu_2proc_fsdp2.yaml run_clm_neox.py recipes/tiny.yaml":
        "test_launch_files launches this file as written (its FSDP2 processes need the launcher, not this process)",
    "neox_hf continue-neox CHECKPOINT_DIR --config CFG.yml --out RUN_DIR":
        "needs a GPT-NeoX training checkpoint; test_continue_neox writes one with DeepSpeed and continues it",
    "accelerate launch run_clm_neox.py CFG.yml --output.dir RUN_DIR --resume":
        "continues continue-neox's RUN_DIR (placeholders); test_continue_neox resumes one",
    "accelerate launch run_clm_neox.py recipes/finetune-lora-gsm8k.yaml --model.from_pretrained EleutherAI/pythia-160m "
    "--output.dir outputs/pythia-160m-gsm8k": "downloads Pythia-160M from the Hub; the same recipe on outputs/tiny runs",
    "neox_hf push outputs/pythia-160m-gsm8k/merged my-org/pythia-160m-gsm8k":
        "needs a Hub and a token; test_hub pushes through the CLI to a local fake Hub",
    "torchrun --standalone --nproc_per_node 4 run_clm_neox.py recipes/tiny-mixtral.yaml --parallel.expert_parallel 2":
        "4 processes; test_expert_parallel launches the same entry point under torchrun (EP2, EP4, ZeRO-2, FSDP2)",
    "accelerate launch --use_deepspeed --num_processes 4 run_clm_neox.py recipes/tiny-mixtral.yaml "
    "--parallel.expert_parallel 2": "4 DeepSpeed processes; test_expert_parallel runs EP2 under ZeRO in its 4-process "
                                    "launches",
    "torchrun --standalone --nproc_per_node 4 run_clm_neox.py recipes/tiny-mixtral.yaml --parallel.tensor_parallel 2 "
    "--parallel.expert_parallel 2 --parallel.experts_over tensor":
        "4 processes; test_expert_parallel launches GPT-NeoX's layout (TP2, experts over TP) under torchrun",
    "python run_clm_neox.py llama3-8b-dpo.yml --model.from_pretrained SFT_FOLDER":
        "needs GPT-NeoX's tokenized pair files and an 8B starting model; test_neox_post_training trains the DPO, RM, "
        "KTO and SFT configs on tiny files",
    "neox_hf preprocess --chat-template CHATS.jsonl --tokenizer TOKENIZER_FOLDER --output-prefix data/pairwise/train "
    "--jsonl-keys chosen rejected --only-last": "needs a tokenizer with a chat template (the bundled one has none); "
                                               "test_neox_post_training runs it on one",
}
# GPU-cluster commands: the multi-node launch, the GPU launch configs (test_launch_files loads each with
# Accelerate's own loader) and the SLURM script.
CLUSTER = re.compile(r"^(accelerate launch --num_machines|accelerate launch --config_file examples/launch/(one_gpu|8gpu)"
                     r"|(CONFIG=\S+ )?sbatch (--nodes=\d+ )?examples/launch/"
                     # benchmarks: minutes each on 2 cores, tables printed for people, never asserted in tests
                     r"|(OMP_NUM_THREADS=1 )?python benchmarks/)")

# Appended to every training command: a tiny model, a few steps, a small slice of the text.
TINY_RUN = ["--model.num_layers", "1", "--model.hidden_size", "32", "--train.micro_batch_size", "2",
            "--train.eval_iters", "1", "--train.eval_interval", "2", "--output.tensorboard", "false"]


def documented_files() -> list[Path]:
    """README.md, then docs/ in mkdocs.yml's nav order (a page the nav leaves out last, by name; test_docs refuses
    one): the order a reader meets the commands in, which is the order they depend on each other in."""
    import yaml

    def pages(nav) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        items = nav.values() if isinstance(nav, dict) else nav
        return [page for item in items for page in pages(item)]

    listed = [DOCS / page for page in pages(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])]
    return [README, *dict.fromkeys(listed + sorted(DOCS.rglob("*.md")))]


def readme_commands() -> list[str]:
    """Every command of the bash blocks of README.md and docs/: continuations joined, comments dropped, `a && b`
    split."""
    commands = []
    for path in documented_files():
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#(?![^\"]*\"[^\"]*$).*$", "", line).strip()  # a comment, not a '#' inside quotes
                commands += [" ".join(part.split()) for part in line.split("&&") if part.strip()]
    return list(dict.fromkeys(commands))  # reading order, each once (the tiny run is shown on several pages)


def is_not_run(command: str) -> bool:
    return command in NOT_RUN or bool(CLUSTER.match(command))


def test_every_readme_command_is_run_or_says_what_it_needs():
    commands = readme_commands()
    assert len(commands) >= 15
    unknown = [c for c in commands if not is_not_run(c) and not _runner(c)]
    assert not unknown, f"README / docs commands this test does not know how to run: {unknown}"
    stale = [c for c in NOT_RUN if c not in commands]
    assert not stale, f"NOT_RUN lists commands README and docs/ no longer show: {stale}"


def _runner(command: str) -> str | None:
    if command.startswith(("accelerate launch", "python run_clm_neox.py")) and "run_clm_neox.py" in command:
        return "train"
    if command.startswith("neox_hf "):
        return "cli"
    return None


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """The repository layout (recipes, examples, entry point, ../shared) with a fresh outputs/ to write into."""
    root = tmp_path / "repo"
    root.mkdir()
    for name in ("recipes", "examples", "run_clm_neox.py", "benchmarks"):
        (root / name).symlink_to(REPO / name)
    if (REPO.parent / "shared").exists():
        (tmp_path / "shared").symlink_to(REPO.parent / "shared")
    small = root / "small.txt"
    small.write_text((REPO / "examples" / "data" / "tinyshakespeare.txt").read_text()[:30000])
    (root / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ["ROMEO: hello", "JULIET: hi"]))
    pairs = (REPO / "examples" / "data" / "gsm8k-pairs.jsonl").read_text().splitlines(keepends=True)
    (root / "pairs.jsonl").write_text("".join(pairs[:24]))  # DPO precomputes its reference over every pair
    monkeypatch.chdir(root)
    yield root
    reset_accelerate_state()


def _train_args(command: str, small: Path) -> list[str]:
    tokens = shlex.split(command)
    argv = tokens[tokens.index("run_clm_neox.py") + 1:]
    if "--print-config" in argv:
        return argv
    extra = list(TINY_RUN)
    if "finetune-lora" in " ".join(argv):
        extra += ["--train.train_iters", "2", "--train.save_interval", "2", "--model.seq_length", "128"]
    elif "--train.train_iters" not in argv:  # a command that names its steps (a resume) keeps them
        extra += ["--train.train_iters", "4", "--train.save_interval", "2"]
    if "--data.sources" in argv:
        pass  # the command's own data (small files)
    elif any(name in " ".join(argv) for name in ("dpo-gsm8k", "rm-gsm8k")):  # preference pairs, not text
        extra += ["--data.sources", f"[{{path: {small.parent / 'pairs.jsonl'}}}]"]
    elif "--parallel.zero_stage" not in argv and "--data.sources" not in argv:
        # A slice of the text keeps the one-process runs quick. The 2-process run keeps the whole file: a slice
        # this small can leave one rank without a validation batch, and the loop's eval then waits on the other.
        extra += ["--data.sources", f"[{{path: {small}}}]"]
    return argv + extra


def _run_two_process(argv: list[str], root: Path) -> None:
    """`accelerate launch` of a ZeRO command on CPU: two gloo processes under DeepSpeed."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), "run_clm_neox.py", *argv]
    env = launch_env(PYTHONPATH=str(REPO))
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def _is_multi_process(argv: list[str]) -> bool:
    """ZeRO on CPU needs DeepSpeed's processes: `accelerate launch --use_deepspeed --num_processes 2`."""
    return "--parallel.zero_stage" in argv


@pytest.mark.distributed
def test_readme_zero_command_runs_on_two_processes(workspace):
    commands = [c for c in readme_commands()
                if _runner(c) == "train" and _is_multi_process(shlex.split(c)) and not is_not_run(c)]
    assert commands
    for command in commands:
        _run_two_process(_train_args(command, workspace / "small.txt"), workspace)
        out = shlex.split(command)[shlex.split(command).index("--output.dir") + 1]
        assert (workspace / out / "config.json").is_file() and (workspace / out / "checkpoints" / "latest").is_file()


def _python_snippets() -> list[str]:
    return [snippet for path in documented_files()
            for snippet in re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)]


@pytest.mark.distributed  # slow tier: a whole run in a subprocess or in process
def test_readme_commands_run_as_written(workspace, capsys):
    from neox_hf.cli import main as cli_main
    from neox_hf.cli import train_main as train_main

    small = workspace / "small.txt"
    placeholders = {"BASE": "outputs/tiny", "ADAPTER": "outputs/finetune-lora-gsm8k"}
    ran = []
    # `merge BASE ADAPTER` needs the LoRA run, which docs/post-training.md shows after it.
    ordered = sorted(readme_commands(), key=lambda c: c.startswith("neox_hf merge"))
    for command in ordered:
        if is_not_run(command):
            continue
        if _runner(command) == "train":
            argv = _train_args(command, small)
            if _is_multi_process(argv):
                continue  # test_readme_zero_command_runs_on_two_processes
            code = train_main(argv)
            assert code == 0, (command, capsys.readouterr().err[-3000:])
            if command.endswith("recipes/tiny.yaml"):
                exec(compile(_python_snippets()[0], "README.md", "exec"), {})  # the README's from_pretrained snippet
        else:
            argv = [placeholders.get(a, a) for a in shlex.split(command)[1:]]
            if argv[0] == "merge":
                argv[-1] = "merged-out"  # OUT already holds the exported model
            if argv[0] == "eval":
                argv += ["--max-batches", "2"]  # the eval's tiny step count
            code = cli_main(argv)
            assert code == 0, (command, capsys.readouterr().err[-3000:])
        ran.append(command)
    assert (workspace / "outputs" / "tiny" / "config.json").is_file()
    assert (workspace / "OUT" / "model.safetensors").is_file() and (workspace / "neox_ckpt" / "latest").is_file()
    assert (workspace / "data" / "corpus.bin").is_file() and (workspace / "merged-out" / "config.json").is_file()
    assert len(ran) >= 10, ran
