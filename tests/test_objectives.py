"""Objectives (issue 26): DPO and the reward model equal TRL's own code on the same model, reference and pairs (fp32,
1e-5, loss and every parameter gradient); pairs tokenise as TRL tokenises them; batches keep a pair together with
dynamic padding; `neox_hf eval --objective dpo | rm`; a saved reward model loads in stock transformers."""

from __future__ import annotations

import copy
import io
import json
import math
import os
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_DISABLED", "true")

from neox_hf.data.preference import (build_preference_eval_loader, build_preference_train_loader, read_pairs,
                                     tokenize_pairs)
from neox_hf.objectives import ObjectiveLoss, build_objective
from neox_hf.objectives.dpo import DPOObjective, attach_reference_logps, reference_logps
from neox_hf.objectives.rm import build_reward_model, sequence_rewards
from neox_hf.recipe import DataConfig, DataSource, Recipe, TrainConfig
from tests.conftest import reset_accelerate_state

REPO = Path(__file__).resolve().parents[1]
PAIRS_FILE = REPO / "examples" / "data" / "gsm8k-pairs.jsonl"
MAX_LENGTH = 72  # dpo: cuts some gsm8k sequences and drops pairs whose prompt fills it, as TRL does
RM_MAX_LENGTH = 180  # rm: drops the pairs with a longer sequence, as TRL does, and keeps 7 of 12
TOL = dict(rtol=1e-5, atol=1e-5)

EDGE_PAIRS = [  # a completion already ending with EOS, a prompt whose last token merges into the completion
    {"prompt": "Hi there", "chosen": " hello<|endoftext|>", "rejected": " go away now please"},
    {"prompt": "Question: 2+2?\nAnswer: ", "chosen": "4", "rejected": "five, I think"},
]


def _pairs(count: int = 10) -> list[dict]:
    rows = [json.loads(line) for line in PAIRS_FILE.read_text().splitlines()[:count]]
    return EDGE_PAIRS + rows


def _tiny_config(**extra):
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(vocab_size=50304, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=256, rotary_pct=0.25, pad_token_id=1,
                         hidden_dropout=0.0, attention_dropout=0.0, **extra)


def _policy_and_reference():
    """A tiny GPTNeoX (the reference) and a policy a small seeded step away from it (so the loss is not ln 2)."""
    from transformers import GPTNeoXForCausalLM

    torch.manual_seed(0)
    reference = GPTNeoXForCausalLM(_tiny_config())
    policy = copy.deepcopy(reference)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return policy, reference


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_equal(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys() and ours
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], **TOL, msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------------------------------------------
# TRL's trainers, built once (importing TRL and preparing its datasets is most of this module's time)
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trl_dpo(tokenizer, tmp_path_factory):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    policy, reference = _policy_and_reference()
    args = DPOConfig(output_dir=str(tmp_path_factory.mktemp("dpo")), beta=0.1, max_length=MAX_LENGTH, report_to=[],
                     use_cpu=True, bf16=False, per_device_train_batch_size=4, dataloader_num_workers=0)
    trainer = DPOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference), args=args,
                         train_dataset=Dataset.from_list(_pairs()), processing_class=tokenizer)
    yield trainer, policy, reference
    reset_accelerate_state()  # TRL's Accelerator (fp32) would refuse a later in-process bf16 run on this worker


@pytest.fixture(scope="module")
def trl_rm(tokenizer, tmp_path_factory):
    from datasets import Dataset
    from transformers import GPTNeoXForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    torch.manual_seed(1)
    model = GPTNeoXForSequenceClassification(_tiny_config(num_labels=1))
    args = RewardConfig(output_dir=str(tmp_path_factory.mktemp("rm")), max_length=RM_MAX_LENGTH, report_to=[],
                        use_cpu=True, bf16=False, per_device_train_batch_size=4, dataloader_num_workers=0)
    ours = copy.deepcopy(model)
    trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(_pairs()),
                            processing_class=tokenizer)
    yield trainer, ours
    reset_accelerate_state()


def _our_loader(tmp_path, tokenizer, objective, micro_batch_size=4):
    path = _write_jsonl(tmp_path / f"pairs-{objective}.jsonl", _pairs())
    max_length = MAX_LENGTH if objective == "dpo" else RM_MAX_LENGTH
    cfg = DataConfig(validation=[DataSource(path=str(path))], mode="pad", max_length=max_length, pad_to_multiple_of=1)
    return build_preference_eval_loader(cfg, tokenizer, seq_length=max_length, micro_batch_size=micro_batch_size,
                                        max_batches=100, objective=objective)


# ----------------------------------------------------------------------------------------------------------------
# Tokenisation and batches
# ----------------------------------------------------------------------------------------------------------------


def test_dpo_tokenisation_and_batches_equal_trl(trl_dpo, tokenizer, tmp_path):
    trainer = trl_dpo[0]
    texts = [(p["prompt"], p["chosen"], p["rejected"]) for p in _pairs()]
    ours = tokenize_pairs(texts, tokenizer, "dpo", MAX_LENGTH)
    theirs = [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in trainer.train_dataset]
    assert [tuple(map(list, o)) for o in ours] == theirs
    assert len(theirs) < len(texts)  # the length rule dropped pairs whose prompt fills max_length, in both

    batch = _our_loader(tmp_path, tokenizer, "dpo")[0]
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert torch.equal(batch["input_ids"], trl_batch["input_ids"])
    assert torch.equal(batch["attention_mask"], trl_batch["attention_mask"])
    # TRL labels the completion tokens and lets the model shift; ours are aligned: labels[t] = token t + 1
    trl_labels = trl_batch["input_ids"].masked_fill(trl_batch["completion_mask"] == 0, -100)
    assert torch.equal(batch["labels"][:, :-1], trl_labels[:, 1:]) and (batch["labels"][:, -1] == -100).all()


def test_rm_tokenisation_equals_trl(trl_rm, tokenizer, tmp_path):
    trainer = trl_rm[0]
    texts = [(p["prompt"], p["chosen"], p["rejected"]) for p in _pairs()]
    ours = [(list(c), list(r)) for _, c, r in tokenize_pairs(texts, tokenizer, "rm", RM_MAX_LENGTH)]
    theirs = [(r["chosen_ids"], r["rejected_ids"]) for r in trainer.train_dataset]
    assert ours == theirs and len(theirs) < len(texts)
    batch = _our_loader(tmp_path, tokenizer, "rm")[0]
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert torch.equal(batch["input_ids"], trl_batch["input_ids"])
    assert torch.equal(batch["attention_mask"], trl_batch["attention_mask"])


def test_pairs_stay_together_padding_is_dynamic_and_resume_is_exact(tokenizer):
    cfg = DataConfig(sources=[DataSource(path=str(PAIRS_FILE))], mode="pad", max_length=256, pad_to_multiple_of=8)
    loaders = [build_preference_train_loader(cfg, tokenizer, seq_length=256, micro_batch_size=3, dp_rank=r, dp_size=2,
                                             seed=7, objective="dpo") for r in range(2)]
    pairs = loaders[0].pairs
    seen, widths = [], set()
    epoch_batches = len(pairs) // 6
    for loader in loaders:
        for _ in range(epoch_batches):
            batch = next(loader)
            assert batch["input_ids"].shape[0] == 6 and batch["pair_index"].shape == (3,)
            for row, index in enumerate(batch["pair_index"].tolist()):
                prompt, chosen, rejected = pairs[index]
                for seq_row, completion in ((row, chosen), (row + 3, rejected)):
                    length = min(len(prompt) + len(completion), 256)
                    assert batch["input_ids"][seq_row, :length].tolist() == (list(prompt) + list(completion))[:length]
                    assert batch["attention_mask"][seq_row].sum() == length
            longest = int(batch["attention_mask"].sum(1).max())
            assert batch["input_ids"].shape[1] == min(-(-longest // 8) * 8, 256)
            widths.add(batch["input_ids"].shape[1])
            seen += batch["pair_index"].tolist()
    assert sorted(seen) == list(range(len(pairs)))  # one epoch over both ranks: every pair once, none split
    assert len(widths) > 3

    state = loaders[1].state_dict()
    expected = [next(loaders[1]) for _ in range(3)]
    resumed = build_preference_train_loader(cfg, tokenizer, seq_length=256, micro_batch_size=3, dp_rank=1, dp_size=2,
                                            seed=7, objective="dpo")
    resumed.load_state_dict(state)
    for batch in expected:
        assert all(torch.equal(batch[k], v) for k, v in next(resumed).items())
    assert "300 pairs" in resumed.describe()


def test_bundled_pairs_are_built_from_the_gsm8k_sample():
    """examples/data/gsm8k-pairs.jsonl: the first 300 GSM8K problems; chosen = the answer; rejected = the answer of
    problem 999 - i for even i, the answer with its final number + 1 for odd i."""
    rows = [json.loads(line) for line in (REPO / "examples" / "data" / "gsm8k-sample.jsonl").read_text().splitlines()]
    expected = []
    for i, row in enumerate(rows[:300]):
        head, sep, final = row["answer"].rpartition("#### ")
        number = final.replace(",", "").strip()
        odd_and_numeric = i % 2 and sep and number.lstrip("-").isdigit()
        rejected = f"{head}#### {int(number) + 1}" if odd_and_numeric else rows[len(rows) - 1 - i]["answer"]
        expected.append({"prompt": f"Question: {row['question']}\nAnswer: ", "chosen": row["answer"],
                         "rejected": rejected})
    assert [json.loads(line) for line in PAIRS_FILE.read_text().splitlines()] == expected


def test_columns_named_per_source_and_bad_rows(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"q": "a", "good": "b", "bad": "c"}, {"q": 1, "good": "b", "bad": "c"}])
    stats = {}
    assert read_pairs([DataSource(path=str(path), prompt_key="q", chosen_key="good", rejected_key="bad")],
                      stats=stats) == [("a", "b", "c")]
    assert stats["skipped_undecodable"] == 1
    from neox_hf.errors import DataError

    with pytest.raises(DataError, match="prompt_key"):
        read_pairs([DataSource(path=str(path))])


# ----------------------------------------------------------------------------------------------------------------
# Losses and gradients equal TRL's
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reference_mode, loss_type", [("precompute", "sigmoid"), ("frozen", "sigmoid"),
                                                       ("precompute", "ipo")])
def test_dpo_loss_metrics_and_gradients_equal_trl(trl_dpo, tokenizer, tmp_path, loss_type, reference_mode):
    trainer, policy, reference = trl_dpo
    trainer.loss_types, trainer.loss_weights = [loss_type], [1.0]
    trainer._metrics["train"].clear()
    trainer.model.train()
    trainer.model.zero_grad()
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    trl_loss = trainer.compute_loss(trainer.model, trl_batch)
    trl_loss.backward()

    ours_model = copy.deepcopy(policy).train()
    batches = _our_loader(tmp_path, tokenizer, "dpo")
    if reference_mode == "precompute":
        table = reference_logps(reference, batches[:1], num_pairs=sum(len(b["pair_index"]) for b in batches))
        objective, batch = DPOObjective(beta=0.1, loss_type=loss_type), attach_reference_logps(batches[0], table)
    else:
        objective, batch = DPOObjective(beta=0.1, loss_type=loss_type, reference_model=reference), batches[0]
    out = objective.loss(ours_model, batch)
    assert isinstance(out, ObjectiveLoss) and int(objective.units(batch)) == int(out.units) == 4
    (out.loss_sum / out.units).backward()

    torch.testing.assert_close(out.loss_sum / out.units, trl_loss.detach(), **TOL)
    _assert_grads_equal(_grads(ours_model), _grads(trainer.model))
    for name in objective.metric_names:
        assert math.isclose(float(out.metric_sums[name]) / 4, trainer._metrics["train"][name][-1], rel_tol=1e-5,
                            abs_tol=1e-5), name


def test_first_dpo_loss_with_reference_equal_to_policy_is_ln2(tokenizer, tmp_path):
    policy = _policy_and_reference()[0]
    batches = _our_loader(tmp_path, tokenizer, "dpo")[:2]
    table = reference_logps(policy, batches, num_pairs=16)
    assert torch.isnan(table[8:]).all() and not torch.isnan(table[:8]).any()  # the pairs the batches hold
    objective = build_objective(TrainConfig(objective="dpo"))
    for batch in batches:
        out = objective.loss(policy, attach_reference_logps(batch, table))
        assert abs(float(out.loss_sum.detach() / out.units) - math.log(2)) < 1e-6
        assert float(out.metric_sums["rewards/margins"]) == 0.0 and float(out.metric_sums["rewards/accuracies"]) == 0


def test_reward_loss_metrics_and_gradients_equal_trl(trl_rm, tokenizer, tmp_path):
    trainer, ours_model = trl_rm
    trainer.model.train()
    trainer.model.zero_grad()
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    trl_loss = trainer.compute_loss(trainer.model, trl_batch)
    trl_loss.backward()

    ours_model.train()
    batch = _our_loader(tmp_path, tokenizer, "rm")[0]
    objective = build_objective(TrainConfig(objective="rm"))
    out = objective.loss(ours_model, batch)
    (out.loss_sum / out.units).backward()
    torch.testing.assert_close(out.loss_sum / out.units, trl_loss.detach(), **TOL)
    _assert_grads_equal(_grads(ours_model), _grads(trainer.model))
    for name in ("accuracy", "margin", "mean_reward"):
        assert math.isclose(float(out.metric_sums[name]) / 4, trainer._metrics["train"][name][-1], rel_tol=1e-5,
                            abs_tol=1e-5), name


def test_lm_objective_is_the_causal_lm_loss(tokenizer):
    from neox_hf.ops.loss import causal_lm_loss

    policy = _policy_and_reference()[0]
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8], [9, 10, 1, 1]]), "attention_mask": torch.tensor([[1] * 4, [1, 1, 0, 0]]),
             "labels": torch.tensor([[6, 7, 8, -100], [10, -100, -100, -100]])}
    objective = build_objective(TrainConfig())
    out = objective.loss(policy, batch)
    expected = causal_lm_loss(policy, batch)
    assert int(objective.units(batch)) == int(out.units) == 4 and out.metric_sums == {}
    torch.testing.assert_close(out.loss_sum, expected[0])


# ----------------------------------------------------------------------------------------------------------------
# The reward model's folder, and `neox_hf eval`
# ----------------------------------------------------------------------------------------------------------------


def _save_causal_lm(folder: Path, tokenizer) -> Path:
    _policy_and_reference()[1].save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("start", ["from_pretrained", "scratch"])
def test_reward_model_folder_loads_in_stock_transformers(tokenizer, tmp_path, start):
    from transformers import AutoModelForSequenceClassification

    recipe = Recipe()
    if start == "from_pretrained":
        recipe.model.from_pretrained = str(_save_causal_lm(tmp_path / "lm", tokenizer))
    else:
        recipe.model.num_layers, recipe.model.hidden_size, recipe.model.num_attention_heads = 2, 32, 4
        recipe.model.seq_length = 128
    model = build_reward_model(recipe, tokenizer)
    assert torch.equal(build_reward_model(recipe, tokenizer).score.weight, model.score.weight)  # seeded
    model.save_pretrained(tmp_path / "rm")
    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert config["architectures"] == ["GPTNeoXForSequenceClassification"] and config["model_type"] == "gpt_neox"
    assert config["pad_token_id"] == tokenizer.pad_token_id and config.get("num_labels", 1) == 1
    stock = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    assert type(stock).__name__ == "GPTNeoXForSequenceClassification"
    batch = _our_loader(tmp_path, tokenizer, "rm")[0]
    with torch.no_grad():
        torch.testing.assert_close(sequence_rewards(model.eval(), batch), sequence_rewards(stock, batch), rtol=0, atol=0)
        logits = stock(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
    torch.testing.assert_close(sequence_rewards(model, batch), logits, rtol=0, atol=0)


def _cli(*argv) -> tuple[int, str, str]:
    from neox_hf.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def test_eval_cli_dpo_and_rm(tokenizer, tmp_path):
    base = _save_causal_lm(tmp_path / "base", tokenizer)
    data = _write_jsonl(tmp_path / "pairs.jsonl", _pairs(2))
    code, out, _ = _cli("eval", base, "--objective", "dpo", "--reference", base, "--data", data, "--device", "cpu")
    assert code == 0 and out.startswith("dpo_loss 0.6931  rewards_accuracy 0.0000"), out
    code, out, _ = _cli("eval", base, "--objective", "dpo", "--reference", base, "--data", data, "--beta", "0.5",
                        "--json", "--device", "cpu")
    result = json.loads(out)
    assert code == 0 and abs(result["dpo_loss"] - math.log(2)) < 1e-6 and result["rewards_accuracy"] == 0
    assert result["pairs"] == 4 and result["beta"] == 0.5

    recipe = Recipe()
    recipe.model.from_pretrained = str(base)
    build_reward_model(recipe, tokenizer).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    code, out, _ = _cli("eval", tmp_path / "rm", "--objective", "rm", "--data", data, "--json", "--device", "cpu")
    result = json.loads(out)
    assert code == 0 and {"rm_loss", "accuracy", "margin", "pairs"} <= result.keys() and result["pairs"] == 4
    code, out, _ = _cli("eval", tmp_path / "rm", "--objective", "rm", "--data", data, "--max-batches", "1",
                        "--device", "cpu")
    assert code == 0 and out.startswith("rm_loss ") and " accuracy " in out

    renamed = _write_jsonl(tmp_path / "other.jsonl", [{"question": "a", "good": "b", "bad": "c"}])
    for argv, words in (
        (("--objective", "dpo", "--data", data), "--reference"),
        (("--objective", "dpo", "--reference", base, "--data", data, "--beta", "0"), "--beta"),
        (("--objective", "dpo", "--reference", base, "--data", renamed), "--prompt-key"),
        (("--objective", "rm", "--data", tmp_path / "missing.jsonl"), "missing.jsonl"),
        (("--objective", "rm", "--data", data), "not a reward model"),
        (("--objective", "sft", "--data", data), "--objective"),
    ):
        code, out, err = _cli("eval", base, *argv, "--device", "cpu")
        assert code == 2 and out == "" and err.count("error:") == 1 and words in err, (argv, err)
        assert "\n" not in err.strip() and err.startswith("error:"), err  # refused before any model is loaded


@pytest.mark.parametrize("name", ["dpo-gsm8k", "rm-gsm8k"])
def test_recipes_batch_the_bundled_pairs(tokenizer, name):
    from neox_hf.recipe import load_yaml_file, recipe_from_dict

    recipe = recipe_from_dict(load_yaml_file(REPO / "recipes" / f"{name}.yaml"))
    assert recipe.train.objective == name[:3].rstrip("-")
    kwargs = dict(seq_length=recipe.model.seq_length, micro_batch_size=recipe.train.micro_batch_size,
                  objective=recipe.train.objective)
    data = recipe.data
    data.sources = [DataSource(path=str(REPO / s.path)) for s in data.sources]
    train = build_preference_train_loader(data, tokenizer, seed=data.seed, **kwargs)
    valid = build_preference_eval_loader(data, tokenizer, max_batches=100, **kwargs)
    assert next(train)["input_ids"].shape[0] == 2 * recipe.train.micro_batch_size
    held = {i for b in valid for i in b["pair_index"].tolist()}
    assert valid and 0 < len(held) < 40 and train.num_pairs + len(held) <= 300  # held-out pairs leave training


# ----------------------------------------------------------------------------------------------------------------
# KTO (issue 44): TRL's unpaired format, tokenisation, KL sequences, loss, KL estimate, metrics and gradients
# ----------------------------------------------------------------------------------------------------------------

KTO_ARGS = dict(beta=0.5, desirable_weight=1.3, undesirable_weight=0.7)


def _unpaired() -> list[dict]:
    """TRL's unpaired format from the pairs: every chosen completion desirable, every other rejected one
    undesirable, so micro-batches hold unequal numbers of each."""
    rows = []
    for k, pair in enumerate(_pairs()):
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True})
        if k % 2 == 0:
            rows.append({"prompt": pair["prompt"], "completion": pair["rejected"], "label": False})
    return rows


@pytest.fixture(scope="module")
def trl_kto(tokenizer, tmp_path_factory):
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    policy, reference = _policy_and_reference()
    args = KTOConfig(output_dir=str(tmp_path_factory.mktemp("kto")), max_length=MAX_LENGTH, report_to=[],
                     use_cpu=True, bf16=False, per_device_train_batch_size=4, dataloader_num_workers=0, **KTO_ARGS)
    trainer = KTOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference), args=args,
                         train_dataset=Dataset.from_list(_unpaired()), processing_class=tokenizer)
    yield trainer, policy, reference
    reset_accelerate_state()


def _kto_loader(tmp_path, tokenizer, micro_batch_size=4):
    path = _write_jsonl(tmp_path / "unpaired.jsonl", _unpaired())
    cfg = DataConfig(validation=[DataSource(path=str(path))], mode="pad", max_length=MAX_LENGTH, pad_to_multiple_of=1)
    return build_preference_eval_loader(cfg, tokenizer, seq_length=MAX_LENGTH, micro_batch_size=micro_batch_size,
                                        max_batches=100, objective="kto")


def test_kto_tokenisation_kl_sequences_and_batches_equal_trl(trl_kto, tokenizer, tmp_path):
    trainer = trl_kto[0]
    texts = [(r["prompt"], r["completion"], r["label"]) for r in _unpaired()]
    ours = tokenize_pairs(texts, tokenizer, "kto", MAX_LENGTH)
    theirs = [(r["prompt_ids"], r["completion_ids"], r["label"]) for r in trainer.train_dataset]
    assert [(list(p), list(c), label) for p, c, label in ours] == theirs
    assert len(theirs) < len(texts)  # examples whose prompt fills max_length dropped, in both

    batches = _kto_loader(tmp_path, tokenizer)
    assert sum(len(b["label"]) for b in batches) == len(theirs)
    for k, batch in enumerate(batches):
        trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4 * k, min(4 * k + 4, len(theirs)))])
        n = len(trl_batch["label"])
        assert torch.equal(batch["label"], trl_batch["label"].bool())
        for ours_rows, prefix in ((slice(0, n), ""), (slice(n, 2 * n), "KL_")):
            ids, mask = trl_batch[f"{prefix}input_ids"], trl_batch[f"{prefix}attention_mask"]
            width = ids.shape[1]
            assert torch.equal(batch["input_ids"][ours_rows][:, :width] * batch["attention_mask"][ours_rows][:, :width],
                               ids * mask)
            assert torch.equal(batch["attention_mask"][ours_rows].sum(1), mask.sum(1))
            trl_labels = ids.masked_fill(trl_batch[f"{prefix}completion_mask"] == 0, -100)
            assert torch.equal(batch["labels"][ours_rows][:, : width - 1], trl_labels[:, 1:])


def test_kto_loss_kl_metrics_and_gradients_equal_trl(trl_kto, tokenizer, tmp_path):
    trainer, policy, reference = trl_kto
    trainer._metrics["train"].clear()
    trainer.model.train()
    trainer.model.zero_grad()
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    trl_loss = trainer.compute_loss(trainer.model, trl_batch)
    trl_loss.backward()

    ours_model = copy.deepcopy(policy).train()
    batch = _kto_loader(tmp_path, tokenizer)[0]
    objective = build_objective(TrainConfig(objective="kto", kto_beta=KTO_ARGS["beta"],
                                            kto_desirable_weight=KTO_ARGS["desirable_weight"],
                                            kto_undesirable_weight=KTO_ARGS["undesirable_weight"]))
    objective.reference_model = reference
    out = objective.loss(ours_model, batch)
    assert int(out.units) == 4 and 0 < int(batch["label"].sum()) < 4
    (out.loss_sum / out.units).backward()

    torch.testing.assert_close(out.loss_sum / out.units, trl_loss.detach(), **TOL)
    _assert_grads_equal(_grads(ours_model), _grads(trainer.model))
    logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    assert logged["kl"] > 0  # the KL estimate is exercised, not clamped to 0
    for name in objective.metric_names:
        assert math.isclose(float(out.metric_sums[name]) / 4, logged[name], rel_tol=1e-5, abs_tol=1e-5), name


@pytest.mark.parametrize("train,words", [
    ({"micro_batch_size": 1}, "micro_batch_size` ≥ 2"),
    ({"kto_beta": 0}, "kto_beta"),
    ({"kto_undesirable_weight": -1}, "kto_undesirable_weight"),
])
def test_kto_recipe_refuses_what_trl_refuses(train, words):
    from neox_hf.errors import RecipeError
    from neox_hf.recipe import recipe_from_dict

    raw = {"model": {"from_pretrained": "base"}, "data": {"mode": "pad", "sources": [{"path": "x.jsonl"}]},
           "train": {"objective": "kto", "micro_batch_size": 4, **train}}
    with pytest.raises(RecipeError, match=words):
        recipe_from_dict(raw)
    assert recipe_from_dict({**raw, "train": {"objective": "kto", "micro_batch_size": 4}}).train.objective == "kto"


def test_eval_cli_kto(tokenizer, tmp_path):
    base = _save_causal_lm(tmp_path / "base", tokenizer)
    data = _write_jsonl(tmp_path / "unpaired.jsonl", _unpaired()[:6])
    code, out, _ = _cli("eval", base, "--objective", "kto", "--reference", base, "--data", data, "--batch-size", "3",
                        "--json", "--device", "cpu")
    result = json.loads(out)
    # the policy is its reference: every log-ratio and the KL estimate are 0, every loss 1 − σ(0) = 0.5
    assert code == 0 and abs(result["kto_loss"] - 0.5) < 1e-6 and result["kl"] == 0 and result["examples"] == 6
    code, out, _ = _cli("eval", base, "--objective", "kto", "--reference", base, "--data", data, "--device", "cpu")
    assert code == 0 and out.startswith("kto_loss 0.5000  kl 0.0000"), out

    renamed = _write_jsonl(tmp_path / "renamed.jsonl", [{"prompt": "a", "answer": "b", "good": True}])
    for argv, words in (
        (("--data", data), "--reference"),
        (("--reference", base, "--data", data, "--batch-size", "1"), "--batch-size"),
        (("--reference", base, "--data", data, "--undesirable-weight", "0"), "--undesirable-weight"),
        (("--reference", base, "--data", renamed), "--completion-key"),
    ):
        code, out, err = _cli("eval", base, "--objective", "kto", *argv, "--device", "cpu")
        assert code == 2 and out == "" and err.count("error:") == 1 and words in err, (argv, err)
