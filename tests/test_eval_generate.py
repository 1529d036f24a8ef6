"""`neox_hf eval` and `neox_hf generate`: perplexity equals exp of an independently computed mean token loss,
generation is reproducible, bad folders fail with CheckpointError; lm-evaluation-harness runs on a saved folder."""

from __future__ import annotations

import argparse
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import GPTNeoXForCausalLM

from neox_hf import evaluation, generation
from neox_hf.errors import CheckpointError, NeoXHFError

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import launch_env  # noqa: E402
from peft_common import PROMPT_TEMPLATE, TEMPLATE, make_tiny_folder  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_tiny_folder(tmp_path_factory.mktemp("evalgen") / "model", seed=3)


@pytest.fixture(scope="module")
def qa_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qa") / "qa.jsonl"
    rows = [{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"},
            {"question": "Tom has 4 apples and eats one. How many are left?", "answer": "4 - 1 = 3\n#### 3"},
            {"question": "Double 21.", "answer": "21 * 2 = 42\n#### 42"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _independent_losses(folder: Path, tokenizer, texts: list[str], prompts: list[str] | None) -> float:
    """Mean token loss computed here, one document at a time, with no data layer: targets are the next tokens
    of text + EOD, minus the targets inside the prompt (a token is prompt if it ends inside the prompt's
    characters: with "Answer: " the space merges into the first answer token, which stays a target)."""
    model = GPTNeoXForCausalLM.from_pretrained(folder).eval()
    total, count = 0.0, 0
    for i, text in enumerate(texts):
        encoded = tokenizer(text, return_offsets_mapping=True)
        ids = encoded["input_ids"] + [tokenizer.eos_token_id]
        prompt_tokens = sum(end <= len(prompts[i]) for _, end in encoded["offset_mapping"]) if prompts else 0
        skip = max(prompt_tokens - 1, 0)
        with torch.no_grad():
            logits = model(torch.tensor([ids[:-1]])).logits[0].double()
        losses = F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")[skip:]
        total += float(losses.sum())
        count += len(losses)
    return total / count


def test_perplexity_is_exp_of_the_mean_token_loss(folder, qa_file, tokenizer):
    result = evaluation.evaluate_model(folder, qa_file, template=TEMPLATE, prompt_template=PROMPT_TEMPLATE,
                                       batch_size=2)
    rows = [json.loads(line) for line in qa_file.read_text().splitlines()]
    texts = [TEMPLATE.format(**r) for r in rows]
    prompts = [PROMPT_TEMPLATE.format(**r) for r in rows]
    full = _independent_losses(folder, tokenizer, texts, None)
    answer = _independent_losses(folder, tokenizer, texts, prompts)
    assert result["loss"] == pytest.approx(full, abs=1e-6)
    assert result["perplexity"] == pytest.approx(math.exp(full), rel=1e-6)
    assert result["answer_loss"] == pytest.approx(answer, abs=1e-6)
    assert result["answer_perplexity"] == pytest.approx(math.exp(answer), rel=1e-6)
    assert result["answer_tokens"] < result["tokens"]


def test_perplexity_metric_accepts_both_input_forms():
    metric = evaluation.load_perplexity_metric()
    per_token = metric.compute(losses=[[0.5, 1.5], [1.0, 3.0, 4.0]])
    summed = metric.compute(losses=[2.0, 8.0], token_counts=[2, 3])
    assert per_token == summed == {"perplexity": pytest.approx(math.exp(2.0)), "mean_loss": 2.0, "tokens": 5}
    with pytest.raises(ValueError, match="token_counts"):
        metric.compute(losses=[2.0])


def test_eval_command_writes_results(folder, qa_file, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    evaluation.add_eval_arguments(parser)
    args = parser.parse_args([str(folder), "--data", str(qa_file), "--template", "Question: {question}\\nAnswer: {answer}",
                              "--prompt-template", "Question: {question}\\nAnswer: ", "--output", str(tmp_path / "r.json")])
    assert evaluation.run_eval(args) == 0
    assert "answer-only loss" in capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text())["answer_tokens"] > 0


def test_generation_is_deterministic_with_a_seed(folder):
    prompts = ["Question: What is 2 + 3?\nAnswer:", ""]
    sample = dict(max_new_tokens=8, temperature=0.9, top_k=50, top_p=0.95, do_sample=True)
    first = generation.generate_text(folder, prompts, seed=7, **sample)
    again = generation.generate_text(folder, prompts, seed=7, **sample)
    other = generation.generate_text(folder, prompts, seed=8, **sample)
    assert first == again and first != other
    assert all(isinstance(t, str) and t for t in first)
    # Prompt i uses seed + i: the second output does not depend on the first prompt being there.
    assert generation.generate_text(folder, [""], seed=8, **sample) == [first[1]]


def test_greedy_generation_equals_argmax_decoding(folder, tokenizer):
    prompt = "The capital of France is"
    text = generation.generate_text(folder, [prompt], max_new_tokens=5, do_sample=False)[0]
    model = GPTNeoXForCausalLM.from_pretrained(folder).eval()
    ids = tokenizer(prompt)["input_ids"]
    for _ in range(5):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    new = ids[len(tokenizer(prompt)["input_ids"]):]
    if tokenizer.eos_token_id in new:
        new = new[: new.index(tokenizer.eos_token_id)]
    assert text == tokenizer.decode(new, skip_special_tokens=True)


def _generate_args(*argv):
    parser = argparse.ArgumentParser()
    generation.add_generate_arguments(parser)
    return parser.parse_args([str(a) for a in argv])


def test_generate_modes_input_file_unconditional_interactive(folder, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\n\nQuestion: 1 + 1?\n")
    out = tmp_path / "out.jsonl"
    assert generation.run_generate(_generate_args(folder, "--input-file", prompts, "--output-file", out,
                                                  "--max-new-tokens", "4"), stdout=io.StringIO()) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["context"] for r in records] == ["Hello there", "Question: 1 + 1?"]
    assert all(set(r) == {"context", "text", "length", "finished"} for r in records)

    unconditional = tmp_path / "uncond.jsonl"
    generation.run_generate(_generate_args(folder, "--unconditional", 3, "--output-file", unconditional,
                                           "--max-new-tokens", "4"), stdout=io.StringIO())
    samples = [json.loads(line) for line in unconditional.read_text().splitlines()]
    assert len(samples) == 3 and all(s["context"] == "" for s in samples)
    assert len({s["text"] for s in samples}) > 1  # seeds seed, seed+1, seed+2

    shown = io.StringIO()
    generation.run_generate(_generate_args(folder, "--interactive", "--max-new-tokens", "3"),
                            stdin=io.StringIO("first\nsecond\n"), stdout=shown)
    lines = shown.getvalue().splitlines()
    assert lines[0].startswith("first") and any(line.startswith("second") for line in lines)


def test_missing_folder_and_vocab_mismatch_are_checkpoint_errors(folder, tmp_path):
    with pytest.raises(CheckpointError, match="model folder not found"):
        generation.generate_text(tmp_path / "nope", ["hi"], max_new_tokens=1)
    small = make_tiny_folder(tmp_path / "small", vocab_size=512, with_tokenizer=False)
    with pytest.raises(CheckpointError, match="no tokenizer files"):
        evaluation.evaluate_model(small, tmp_path / "x.jsonl")
    with pytest.raises(CheckpointError, match="vocab_size 512 but the tokenizer has 50277"):
        evaluation.evaluate_model(small, tmp_path / "x.jsonl", tokenizer_path=str(folder))
    with pytest.raises(NeoXHFError, match="input-file"):
        generation.read_prompt_file(tmp_path / "missing.txt")


_LM_EVAL_TASK = """task: tiny_qa
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: " {{{{answer}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
"""


@pytest.mark.distributed  # slow tier: a whole run in a subprocess or in process
def test_lm_eval_harness_runs_a_local_task_on_a_saved_folder(folder, tmp_path):
    pytest.importorskip("lm_eval")
    data = tmp_path / "tiny_qa.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n"
                            for q, a in [("2 + 3?", "5"), ("4 - 1?", "3"), ("21 * 2?", "42")]))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_qa.yaml").write_text(_LM_EVAL_TASK.format(data=data))
    command = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={folder},dtype=float32",
               "--tasks", "tiny_qa", "--include_path", str(tasks), "--device", "cpu", "--batch_size", "2",
               "--output_path", str(tmp_path / "results")]
    env = launch_env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in (tmp_path / "results").rglob("results*.json")]
    assert results and "tiny_qa" in results[0]["results"]


def test_eval_and_generate_run_where_the_gpu_is_and_refuse_a_missing_one_by_name(folder, tmp_path, qa_file):
    """`--device auto` (the default) takes the GPU where torch sees one: eval and generate always ran on the CPU.
    `--device cuda` without a GPU is refused in one line; `--device cpu` runs anywhere."""
    from neox_hf.errors import UsageError
    from neox_hf.inference import inference_device, load_for_inference

    assert inference_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    model, _ = load_for_inference(folder, device="cpu")
    assert model.device.type == "cpu"
    on_cpu = evaluation.evaluate_model(folder, qa_file, template=TEMPLATE, max_batches=1, device="cpu")
    assert math.isfinite(on_cpu["loss"]) and on_cpu["tokens"] > 0
    if torch.cuda.is_available():
        on_gpu = evaluation.evaluate_model(folder, qa_file, template=TEMPLATE, max_batches=1, device="cuda")
        assert on_gpu["loss"] == pytest.approx(on_cpu["loss"], rel=1e-4)
    else:
        with pytest.raises(UsageError, match=r"--device cuda: torch sees no CUDA GPU here; use --device cpu"):
            load_for_inference(folder, device="cuda")
