"""lm-evaluation-harness on the in-training model: a task defined from local files (nothing downloaded) scores our
model exactly as a direct computation of the same log-likelihoods does; the card table and task resolution."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from neox_hf.errors import RecipeError
from neox_hf.eval_tasks import eval_tasks_card_section, resolve_tasks, run_eval_tasks, scores_from_results

pytest.importorskip("lm_eval")

SENTENCES = [
    "the king is dead and the prince is king",
    "to be or not to be that is the question",
    "all the world is a stage and all the men and women merely players",
    "now is the winter of our discontent",
]


def local_task(folder: Path, name: str = "local_lambada") -> Path:
    """A lambada-style task (context → last word) over a local jsonl file."""
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in SENTENCES))
    task = folder / f"{name}.yaml"
    task.write_text(
        f"task: {name}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "output_type: loglikelihood\n"
        "test_split: test\n"
        "doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\n"
        "doc_to_target: \"{{' '+text.split(' ')[-1]}}\"\n"
        "metric_list:\n"
        "  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return task


def tiny_model(tokenizer):
    from neox_hf.model import NeoXForCausalLM, config_from_recipe
    from neox_hf.recipe import ModelConfig

    torch.manual_seed(0)
    config = config_from_recipe(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=64),
                                vocab_size=50304, bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return NeoXForCausalLM(config)


def direct_scores(model, tokenizer) -> tuple[float, float]:
    """Perplexity and accuracy of the last word, computed without lm-eval."""
    logliks, greedy = [], []
    for sentence in SENTENCES:
        context, target = sentence.rsplit(" ", 1)
        ctx, tgt = tokenizer(context)["input_ids"], tokenizer(" " + target)["input_ids"]
        ids = torch.tensor([ctx + tgt])
        with torch.no_grad():
            logprobs = F.log_softmax(model(ids).logits[0, len(ctx) - 1:-1].float(), dim=-1)
        target_ids = torch.tensor(tgt)
        logliks.append(float(logprobs.gather(1, target_ids[:, None]).sum()))
        greedy.append(bool((logprobs.argmax(-1) == target_ids).all()))
    return math.exp(-sum(logliks) / len(logliks)), sum(greedy) / len(greedy)


def test_local_task_scores_match_a_direct_computation(tmp_path, tokenizer):
    model = tiny_model(tokenizer).train()
    task = local_task(tmp_path)

    scores = run_eval_tasks(model, tokenizer, [str(task)], batch_size=2)

    assert model.training  # evaluated in eval mode, handed back in training mode
    assert set(scores) == {"local_lambada/perplexity", "local_lambada/acc"}
    perplexity, accuracy = direct_scores(model.eval(), tokenizer)
    assert scores["local_lambada/perplexity"] == pytest.approx(perplexity, rel=1e-4)
    assert scores["local_lambada/acc"] == pytest.approx(accuracy)


def test_task_entries_resolve_yaml_files_and_refuse_bad_ones(tmp_path):
    task = local_task(tmp_path, "mine")
    assert resolve_tasks(["lambada_openai", str(task)]) == (["lambada_openai", "mine"], [str(tmp_path.resolve())])
    with pytest.raises(RecipeError, match="not a file"):
        resolve_tasks([str(tmp_path / "missing.yaml")])
    (tmp_path / "bad.yaml").write_text("dataset_path: json\n")
    with pytest.raises(RecipeError, match="needs a `task:` name"):
        resolve_tasks([str(tmp_path / "bad.yaml")])


def test_scores_and_card_table():
    results = {"lambada_openai": {"alias": "lambada_openai", "acc,none": 0.25, "acc_stderr,none": 0.1,
                                  "perplexity,none": 12.5, "exact_match,strict-match": 1.0}}
    scores = scores_from_results(results)
    assert scores == {"lambada_openai/acc": 0.25, "lambada_openai/perplexity": 12.5,
                      "lambada_openai/exact_match[strict-match]": 1.0}
    card = eval_tasks_card_section([(10, {"x/acc": 0.1}), (20, scores)])
    assert "step 20" in card and "| lambada_openai | acc | 0.2500 |" in card and "x/acc" not in card
    assert eval_tasks_card_section([]) == ""
