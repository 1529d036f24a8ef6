"""Issue 41, third pass: bad input that trained, evaluated or exported and exited 0, each now refused in one line
(exit 2, no traceback) through the entry points a user calls (`neox_hf.cli.train_main`, `neox_hf.cli.main`):
a reward model's folder loaded as a causal LM, mostly broken or degenerate preference files, and the export of a
reward model's checkpoint (which now writes a folder stock transformers loads).

One reward-model run (2 steps, fp32, a tiny stock GPTNeoX start) is shared by the module; the other runs are
refused before their first step.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_DISABLED", "true")

from tests.conftest import BUNDLED_TOKENIZER, train_in_this_process
from tests.test_fuzz_inputs import assert_one_line_error, run_cli, run_train

WORDS = "apple river stone cloud maple ember violet harbor quartz meadow lantern copper".split()


def _pair(i: int) -> dict:
    return {"prompt": f"Question {i}: name the {WORDS[i % 12]} after {WORDS[(i * 5) % 12]}.\nAnswer: ",
            "chosen": " ".join(WORDS[(i + k) % 12] for k in range(1 + i % 4)),
            "rejected": " ".join(WORDS[(3 * i + k + 1) % 12] for k in range(2 + i % 3))}


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _recipe(path: Path, model: Path, pairs: Path, out: Path, objective: str, *, steps: int = 2, **data) -> list[str]:
    path.write_text(json.dumps({
        "model": {"from_pretrained": str(model), "seq_length": 64, "num_attention_heads": 4},
        "tokenizer": {"path": str(BUNDLED_TOKENIZER)},
        "data": {"sources": [{"path": str(pairs), **data}], "mode": "pad", "seed": 7},
        "train": {"objective": objective, "train_iters": steps, "micro_batch_size": 2, "gradient_accumulation_steps": 1,
                  "lr": 1e-3, "min_lr": 1e-4, "warmup": 0.0, "precision": "fp32", "log_interval": 1,
                  "eval_interval": 100, "eval_iters": 0, "save_interval": steps},
        "parallel": {"use_deepspeed": False},
        "output": {"dir": str(out), "tensorboard": False},
    }))
    return [str(path)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny stock GPTNeoX folder (with the tokenizer), 40 good pairs, and a 2-step reward-model run from them."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from neox_hf.data.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("third")
    torch.manual_seed(0)
    config = GPTNeoXConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
                           vocab_size=50304, max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0)
    GPTNeoXForCausalLM(config).save_pretrained(root / "lm")
    load_tokenizer(str(BUNDLED_TOKENIZER)).save_pretrained(root / "lm")
    pairs = _write_lines(root / "pairs.jsonl", [json.dumps(_pair(i)) for i in range(40)])
    train_in_this_process(_recipe(root / "rm.yaml", root / "lm", pairs, root / "rm", "rm"))
    return root



# ----------------------------------------------------------------------------------------------------------------
# 1. A reward model's folder is not a causal LM: training, evaluating or generating from it is refused (transformers
#    would draw the missing LM head at random and only print a load report)


def test_dpo_from_a_reward_model_folder_is_refused(runs, tmp_path, capsys, fresh_accelerate_state):
    out = tmp_path / "dpo"
    code, err = run_train(_recipe(tmp_path / "dpo.yaml", runs / "rm", runs / "pairs.jsonl", out, "dpo"), capsys)
    assert_one_line_error(code, err, "lm_head.weight")
    assert "GPTNeoXForSequenceClassification" in err and str(runs / "rm") in err
    assert not out.exists() or not any(out.iterdir())  # nothing trained or saved


@pytest.mark.parametrize("command", ["generate", "eval-lm", "eval-dpo"])
def test_generate_and_eval_of_a_reward_model_folder_are_refused(runs, tmp_path, capsys, command):
    rm = str(runs / "rm")
    text = _write_lines(tmp_path / "text.jsonl", [json.dumps({"text": "the river runs past the stone"})] * 4)
    argv = {"generate": ["generate", rm, "--prompt", "Question 1:", "--max-new-tokens", "2"],
            "eval-lm": ["eval", rm, "--data", str(text)],
            "eval-dpo": ["eval", rm, "--objective", "dpo", "--reference", rm, "--data", str(runs / "pairs.jsonl")]}
    code, err = run_cli([*argv[command], "--device", "cpu"], capsys)
    assert_one_line_error(code, err, "lm_head.weight")


# ----------------------------------------------------------------------------------------------------------------
# 2. Preference files that are mostly broken are refused above data.max_skipped_fraction, as documents are


@pytest.mark.parametrize("broken", ["no-rejected", "invalid-json"])
def test_mostly_broken_preference_file_is_refused(runs, tmp_path, capsys, fresh_accelerate_state, broken):
    rows = [_pair(i) for i in range(40)]
    if broken == "no-rejected":  # 39 of 40 rows lack `rejected`: trained on the one pair left
        lines = [json.dumps({k: v for k, v in row.items() if i == 0 or k != "rejected"}) for i, row in enumerate(rows)]
        needle = "39 of 40 rows skipped"
    else:  # every other line cut short: trained on the 20 left
        lines = [json.dumps(row)[: None if i % 2 else -3] for i, row in enumerate(rows)]
        needle = "20 of 40 rows skipped"
    pairs = _write_lines(tmp_path / "pairs.jsonl", lines)
    code, err = run_train(_recipe(tmp_path / "r.yaml", runs / "lm", pairs, tmp_path / "out", "dpo"), capsys)
    assert_one_line_error(code, err, needle)
    assert "data.max_skipped_fraction" in err
    code, err = run_cli(["eval", str(runs / "lm"), "--objective", "rm", "--data", str(pairs)], capsys)
    assert_one_line_error(code, err, needle)  # `neox_hf eval` refuses the same file, before loading a model


def test_a_few_broken_rows_below_the_fraction_still_train(runs, tmp_path, capsys, fresh_accelerate_state):
    lines = [json.dumps(_pair(i)) for i in range(40)] + ["{not json"]
    pairs = _write_lines(tmp_path / "pairs.jsonl", lines)
    recipe = _recipe(tmp_path / "r.yaml", runs / "lm", pairs, tmp_path / "out", "rm", steps=1)
    code, err = run_train([*recipe, "--data.max_skipped_fraction", "0.05"], capsys)
    assert code == 0, err


# ----------------------------------------------------------------------------------------------------------------
# 3. Degenerate pairs (chosen == rejected) teach nothing and hold the DPO loss at ln 2


@pytest.mark.parametrize("case", ["rejected-key-is-chosen", "all-identical", "mostly-identical"])
def test_degenerate_pairs_are_refused(runs, tmp_path, capsys, fresh_accelerate_state, case):
    rows = [_pair(i) for i in range(40)]
    source = {}
    if case == "rejected-key-is-chosen":
        source, needle = {"rejected_key": "chosen"}, "both name `chosen`"
    elif case == "all-identical":
        rows = [{**row, "rejected": row["chosen"]} for row in rows]
        needle = "every one of its 40 pairs"
    else:
        rows = [{**row, "rejected": row["chosen"]} if i % 4 else row for i, row in enumerate(rows)]
        needle = "30 of 40 rows skipped"
    pairs = _write_lines(tmp_path / "pairs.jsonl", [json.dumps(row) for row in rows])
    code, err = run_train(_recipe(tmp_path / "r.yaml", runs / "lm", pairs, tmp_path / "out", "dpo", **source), capsys)
    assert_one_line_error(code, err, needle)


# ----------------------------------------------------------------------------------------------------------------
# 4. A reward model's checkpoint exports to a folder stock AutoModelForSequenceClassification loads


def test_reward_model_checkpoint_exports_to_a_stock_sequence_classifier(runs, tmp_path, capsys):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    step = runs / "rm" / "checkpoints" / "step_00000002"
    code, err = run_cli(["export", str(step), str(tmp_path / "exported")], capsys)
    assert code == 0, err
    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "exported", dtype=torch.float32).eval()
    final = AutoModelForSequenceClassification.from_pretrained(runs / "rm", dtype=torch.float32).eval()
    assert type(exported).__name__ == "GPTNeoXForSequenceClassification" and exported.config.num_labels == 1
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "exported")
    batch = tokenizer([_pair(i)["prompt"] + _pair(i)["chosen"] for i in range(4)], return_tensors="pt", padding=True)
    with torch.no_grad():
        torch.testing.assert_close(exported(**batch).logits, final(**batch).logits, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------------
# Poor cases: one clear line where there was a vague one


def tiny_run(root: Path, *, save_interval: int, **sections) -> Path:
    """A 2-step run from scratch (hidden 32, 2 layers) in ROOT/out, checkpointed every `save_interval` steps, with
    `sections` added to its recipe; the recipe file."""
    text = root / "small.txt"
    text.write_text((Path(__file__).resolve().parents[1] / "examples/data/tinyshakespeare.txt").read_text()[:20000])
    recipe = root / "run.yaml"
    recipe.write_text(json.dumps({
        "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 32},
        "tokenizer": {"path": str(BUNDLED_TOKENIZER)},
        "data": {"sources": [{"path": str(text)}], "mode": "pack"},
        "train": {"train_iters": 2, "micro_batch_size": 2, "precision": "fp32", "log_interval": 1,
                  "eval_interval": 100, "eval_iters": 0, "save_interval": save_interval, "lr": 1e-3, "min_lr": 1e-4},
        "parallel": {"use_deepspeed": False},
        "output": {"dir": str(root / "out"), "tensorboard": False},
        **sections,
    }))
    train_in_this_process([str(recipe)])
    return recipe


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    """A 2-step causal-LM run with a checkpoint at step 2, and its recipe file."""
    return tiny_run(tmp_path_factory.mktemp("third_lm"), save_interval=2)


@pytest.mark.parametrize("change,needle", [
    (["--model.hidden_size", "64"],
     "`gpt_neox.embed_in.weight` is [50304, 32] in the checkpoint, [50304, 64] in the recipe's model"),
    (["--model.num_layers", "3"], "the recipe's model has `gpt_neox.layers.2."),
])
def test_resume_with_another_model_shape_names_the_first_differing_tensor(lm_run, capsys, fresh_accelerate_state,
                                                                          change, needle):
    code, err = run_train([str(lm_run), "--resume", "--train.train_iters", "4", *change], capsys)
    assert_one_line_error(code, err, needle)  # was "(Error(s) in loading state_dict for NeoXForCausalLM:)"


def test_a_resume_under_another_global_batch_says_what_it_changes(lm_run, tmp_path, capsys, fresh_accelerate_state):
    """Issue 49: a resume that changed the global batch was accepted without a word (GPT-NeoX's too)."""
    from neox_hf.cli import train_main

    shutil.copytree(lm_run.parent / "out", tmp_path / "out")  # the module's run stays as it was
    code = train_main([str(lm_run), "--resume", "--output.dir", str(tmp_path / "out"), "--train.train_iters", "3",
                       "--train.gradient_accumulation_steps", "2"])
    printed = capsys.readouterr().out
    assert code == 0, printed[-2000:]
    notes = [line for line in printed.splitlines() if "global batch" in line]
    assert notes == ["note: the global batch changes from the checkpoint's 2 to 4 samples per step (micro 2 × "
                     "accumulation 2 × 1 data-parallel): the LR schedule continues at step 2 of 3 (it counts steps: "
                     "its 1 remaining steps train 4 samples where 2 were planned), and the data continues after the "
                     "4 samples already trained, 4 per step"], printed[-2000:]


def test_a_checkpoint_past_train_iters_is_refused_before_the_model_is_built(lm_run, capsys, fresh_accelerate_state):
    from accelerate.state import PartialState

    code, err = run_train([str(lm_run), "--resume", "--train.train_iters", "1"], capsys)
    assert_one_line_error(code, err, "is at step 2, past `train.train_iters` 1: pass `--train.train_iters 2` or more")
    assert not PartialState._shared_state  # was: after the Accelerator, the model and the data


def test_plan_on_a_billion_gpus_is_quick_and_says_when_nothing_fits(capsys):
    import time

    from tests.conftest import REPO

    tiny = str(REPO / "recipes" / "tiny.yaml")
    start = time.monotonic()
    code, err = run_cli(["plan", tiny, "--gpus", "1000000000"], capsys)
    assert code == 0, err
    assert time.monotonic() - start < 120  # counting divisors to a billion took 242 s
    code, err = run_cli(["plan", tiny, "--gpus", "1000000000", "--gpu-memory", "0.01"], capsys)
    # was a table ending "the 0 fastest:", exit 0
    assert_one_line_error(code, err, "layouts on 1000000000 GPUs fits in 0.01 GiB")  # DeepSpeed's and FSDP2's
    assert "the leanest (pipe 1 × tensor 4" in err


def test_accelerate_dynamo_backend_becomes_train_compile_or_is_refused(monkeypatch, capsys, fresh_accelerate_state):
    from neox_hf.parallel.accelerator import build_accelerator
    from neox_hf.recipe import load_yaml_file, recipe_from_dict
    from neox_hf.cli import train_main as main
    from tests.conftest import REPO

    tiny = str(REPO / "recipes" / "tiny.yaml")
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")  # an accelerate config's `dynamo_backend: INDUCTOR`
    assert main([tiny, "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "\n  compile: true\n" in printed and "`train.compile: true` comes from `accelerate launch`" in printed
    # Accelerate does not compile the model again its own way (in `prepare`, the fused loss included)
    recipe = recipe_from_dict(load_yaml_file(REPO / "recipes" / "tiny.yaml"))
    recipe.train.compile, recipe.train.precision = True, "fp32"
    assert build_accelerator(recipe).state.dynamo_plugin.backend.value == "NO"

    code, err = run_train([tiny, "--print-config", "--train.compile", "false"], capsys)
    assert_one_line_error(code, err, "dynamo_backend: inductor")
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "EAGER")
    assert_one_line_error(*run_train([tiny, "--print-config"], capsys), "dynamo_backend: EAGER")


def test_generate_keeps_to_the_model_context(runs, capsys):
    lm = str(runs / "lm")  # max_position_embeddings 128
    code, err = run_cli(["generate", lm, "--prompt", "Question 1:", "--max-new-tokens", "200", "--device", "cpu"],
                        capsys)
    assert_one_line_error(code, err, "--max-new-tokens 200 leaves no room for a prompt in the model's context of 128")
    long_prompt = " ".join(WORDS * 20)  # 280 tokens, more than the context
    code, err = run_cli(["generate", lm, "--prompt", long_prompt, "--max-new-tokens", "8", "--greedy",
                         "--device", "cpu"], capsys)
    assert code == 0, err
    assert "note: a prompt of 280 tokens keeps its last 120" in err and "context of 128 positions" in err


# ----------------------------------------------------------------------------------------------------------------
# Issue 41's remaining poor cases: each answered in one line naming the setting, both values and the fix


@pytest.mark.parametrize("change,needle", [
    (["--model.seq_length", "16"], "saved with `model.seq_length: 32` and this run has `model.seq_length: 16`: resume "
                                   "with `--model.seq_length 32`"),
    (["--train.micro_batch_size", "4"], "saved with `train.micro_batch_size: 2` and this run has "
                                        "`train.micro_batch_size: 4`: resume with `--train.micro_batch_size 2`"),
])
def test_resume_with_another_data_setting_names_it(lm_run, capsys, fresh_accelerate_state, change, needle):
    code, err = run_train([str(lm_run), "--resume", "--train.train_iters", "4", *change], capsys)
    assert_one_line_error(code, err, needle)  # was both loaders' fingerprints, 10 keys each, to compare by eye
    assert "{" not in err


def test_resume_under_another_objective_names_it_before_the_model_is_built(runs, tmp_path, capsys,
                                                                          fresh_accelerate_state):
    out = tmp_path / "rm"
    shutil.copytree(runs / "rm", out)
    recipe = _recipe(tmp_path / "dpo.yaml", runs / "lm", runs / "pairs.jsonl", out, "dpo", steps=4)
    code, err = run_train([*recipe, "--resume"], capsys)
    assert_one_line_error(code, err, "was trained with `train.objective: rm` and this run has `train.objective: dpo`: "
                                     "resume with `--train.objective rm`")  # was the reward head's tensor, missing


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A 2-step LoRA run (rank 4) with checkpoints at steps 1 and 2, and its recipe file."""
    return tiny_run(tmp_path_factory.mktemp("third_lora"), save_interval=1,
                    peft={"method": "lora", "r": 4, "target_modules": ["query_key_value", "dense"]})


def test_lora_checkpoint_resumed_without_peft_is_named_a_lora_checkpoint(lora_run, tmp_path, capsys,
                                                                        fresh_accelerate_state):
    out = tmp_path / "run"
    shutil.copytree(lora_run.parent / "out", out)
    code, err = run_train([str(lora_run), "--output.dir", str(out), "--peft.method", "null", "--resume",
                           "--train.train_iters", "3"], capsys)
    assert_one_line_error(code, err, "is a LoRA checkpoint (rank-4 adapters on dense, query_key_value) and the recipe "
                                     "has no `peft` section: resume with the same `peft` settings")
    assert "--peft.method lora --peft.r 4" in err  # was "the recipe's model has `gpt_neox.embed_in.weight`"


@pytest.mark.parametrize("damaged_step,resume_from,advice", [
    (1, 1, "no earlier checkpoint is intact: resume from `--train.resume {step2}`, or delete the damaged {step1}"),
    (2, 2, "resume from the previous intact checkpoint with `--train.resume {step1}`, or delete the damaged {step2}"),
])
def test_a_damaged_checkpoint_is_never_answered_with_overwrite_while_another_is_intact(
        lora_run, tmp_path, capsys, fresh_accelerate_state, damaged_step, resume_from, advice):
    from neox_hf.checkpoint import checkpoint_name

    out = tmp_path / "run"
    shutil.copytree(lora_run.parent / "out", out)
    steps = {f"step{s}": out / "checkpoints" / checkpoint_name(s) for s in (1, 2)}
    weights = steps[f"step{damaged_step}"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size - 64])  # a copy cut short
    code, err = run_train([str(lora_run), "--output.dir", str(out), "--train.resume",
                           str(steps[f"step{resume_from}"]), "--train.train_iters", "3"], capsys)
    assert_one_line_error(code, err, advice.format(**steps))
    assert "is truncated or corrupt" in err
    assert "start the run again without --resume (and with --overwrite)" not in err  # deleted the intact one


def test_dpo_eval_against_a_reference_of_another_architecture_says_so_and_another_vocabulary_is_refused(
        runs, tmp_path, capfd):
    from transformers import LlamaConfig, LlamaForCausalLM

    from neox_hf.data.tokenizer import load_tokenizer

    torch.manual_seed(0)
    llama = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                 intermediate_size=64, vocab_size=50304, max_position_embeddings=128)).save_pretrained(llama)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(_pair(i)) + "\n" for i in range(4)))
    code, err = run_cli(["eval", str(runs / "lm"), "--objective", "dpo", "--reference", str(llama), "--data",
                         str(pairs)], capfd)
    assert code == 0, err
    notes = [line for line in err.splitlines() if "note: the reference" in line]
    assert len(notes) == 1 and "is a LlamaForCausalLM (llama), the policy a GPTNeoXForCausalLM (gpt_neox)" in notes[0]

    other = load_tokenizer(str(BUNDLED_TOKENIZER))
    other.add_special_tokens({"additional_special_tokens": ["<|reference-only|>"]})
    other.save_pretrained(llama)
    code, err = run_cli(["eval", str(runs / "lm"), "--objective", "dpo", "--reference", str(llama), "--data",
                         str(pairs)], capfd)
    assert_one_line_error(code, err, "has another vocabulary (50,278 tokens) than the policy's tokenizer (50,277; "
                                     "'<|reference-only|>' is id 50277 in the reference's, absent in the policy's)")
