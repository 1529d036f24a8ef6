"""PEFT fine-tuning: only adapters train, prompts never reach the loss, adapters survive ZeRO-3 and merge exactly.

Equivalence tests: merged vs base+adapter logits, saved adapter vs the trained parameters (ZeRO-3, 2 processes),
resumed LoRA run vs uninterrupted, masked-prompt loss vs the same loss with the prompt's logits perturbed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import GPTNeoXForCausalLM

from neox_hf import finetune
from neox_hf.data import build_train_loader
from neox_hf.errors import CheckpointError, RecipeError
from neox_hf.recipe import PeftConfig
from neox_hf.train import loop
from neox_hf.ops.loss import causal_lm_loss
from tests.conftest import accelerate_launch_command, launch_env

WORKERS = Path(__file__).parent / "workers"
sys.path.insert(0, str(WORKERS))
from peft_common import lora_recipe, make_tiny_folder, tiny_config  # noqa: E402


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_tiny_folder(tmp_path_factory.mktemp("peft") / "base")


def _peft_cfg(**overrides) -> PeftConfig:
    return PeftConfig(method="lora", **{"r": 4, "alpha": 8, "dropout": 0.0, **overrides})


def _batch(seed: int = 0, vocab: int = 512):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (2, 12), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


# ----------------------------------------------------------------------------------------------------------------
# Wrapping
# ----------------------------------------------------------------------------------------------------------------


def test_lora_wraps_exactly_the_four_gpt_neox_linears():
    model = finetune.wrap_with_peft(GPTNeoXForCausalLM(tiny_config(vocab_size=512)), _peft_cfg())
    wrapped = {n.split(".lora_A")[0].split("layers.0.")[-1] for n, _ in model.named_parameters()
               if "layers.0." in n and "lora_A" in n}
    # "dense" is matched as a dotted suffix: attention.dense only, not mlp.dense_h_to_4h.
    assert wrapped == {"attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert finetune.wrap_with_peft(model, _peft_cfg()) is model  # idempotent


def test_trainable_report_counts_only_adapters():
    model = finetune.wrap_with_peft(GPTNeoXForCausalLM(tiny_config(vocab_size=512)), _peft_cfg())
    # per layer: qkv 4·(64+192), dense 4·(64+64), h_to_4h 4·(64+256), 4h_to_h 4·(256+64)
    per_layer = 4 * (64 + 192) + 4 * (64 + 64) + 4 * (64 + 256) + 4 * (256 + 64)
    total = sum(p.numel() for p in model.parameters())
    assert finetune.trainable_parameters_report(model) == (
        f"peft: trainable {2 * per_layer:,} / total {total:,} parameters ({100 * 2 * per_layer / total:.4f}%)")


def test_misspelled_target_module_is_refused():
    with pytest.raises(RecipeError, match=r"peft.target_modules.*\['dense_4h_to_hh'\].*dense_h_to_4h"):
        finetune.wrap_with_peft(GPTNeoXForCausalLM(tiny_config(vocab_size=512)),
                                _peft_cfg(target_modules=["query_key_value", "dense_4h_to_hh"]))


def test_only_adapter_weights_change_bit_for_bit():
    torch.manual_seed(0)
    model = finetune.wrap_with_peft(GPTNeoXForCausalLM(tiny_config(vocab_size=512)), _peft_cfg())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(3):
        loss, _ = causal_lm_loss(model, _batch(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, param in model.named_parameters():
        if "lora_" in name:
            continue
        assert torch.equal(param, before[name]), f"base weight {name} changed"
        assert param.grad is None, f"base weight {name} got a gradient"
    changed = [n for n, p in model.named_parameters() if "lora_B" in n and not torch.equal(p, before[n])]
    assert len(changed) == 8  # every lora_B of 4 modules × 2 layers moved off zero


# ----------------------------------------------------------------------------------------------------------------
# Prompt masking (SFT)
# ----------------------------------------------------------------------------------------------------------------


def test_prompt_tokens_are_masked_and_never_reach_the_loss(base, tokenizer, tmp_path):
    recipe = lora_recipe(base, tmp_path / "run")
    loader = build_train_loader(recipe.data, tokenizer, seq_length=128, micro_batch_size=2, dp_rank=0, dp_size=1,
                                seed=0)
    # A batch narrower than seq_length holds whole examples (the run's first batch is the widest, maybe truncated).
    batch = next(b for b in loader if b["input_ids"].shape[1] < 128)
    answers = {json.loads(line)["answer"] for line in open(recipe.data.sources[0].path)}
    for labels, ids in zip(batch["labels"], batch["input_ids"]):
        first = int((labels != -100).nonzero()[0])
        # Everything before the first target is the prompt; every target is the answer and the EOD.
        assert tokenizer.decode(ids[: first + 1]).startswith("Question: ")
        assert tokenizer.decode(ids[: first + 1]).rstrip().endswith("\nAnswer:")
        assert tokenizer.decode(labels[first:][labels[first:] != -100], skip_special_tokens=True).strip() in answers
        last = int((labels != -100).nonzero()[-1])
        assert (labels[first: last + 1] != -100).all()  # the answer is contiguous; only padding follows

    model = finetune.wrap_with_peft(GPTNeoXForCausalLM.from_pretrained(base), _peft_cfg())
    masked = batch["labels"] == -100
    loss, tokens = causal_lm_loss(model, batch)
    assert tokens == int((~masked).sum())
    # The logits at masked positions get no gradient: nothing of the prompt's targets enters the loss.
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits.retain_grad()
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100).backward()
    assert logits.grad[masked].abs().max() == 0
    assert logits.grad[~masked].abs().max() > 0


# ----------------------------------------------------------------------------------------------------------------
# Saving, resuming, merging
# ----------------------------------------------------------------------------------------------------------------


def _lora_weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / finetune.ADAPTER_WEIGHTS)


def test_lora_run_resumes_exactly_and_merges(base, tmp_path, fresh_accelerate_state):
    schedule = {"train_iters": 4, "lr_decay_iters": 4}
    straight = loop.train(lora_recipe(base, tmp_path / "straight", train=schedule,
                                      peft={"merge": True}))
    assert straight.output_dir == tmp_path / "straight" / finetune.MERGED_SUBDIR

    first = lora_recipe(base, tmp_path / "resumed", train={**schedule, "train_iters": 2, "save_interval": 2})
    loop.train(first)
    resumed = loop.train(lora_recipe(base, tmp_path / "resumed", train={**schedule, "resume": "auto"}))
    assert resumed.train_losses == straight.train_losses[2:]
    a, b = _lora_weights(tmp_path / "straight"), _lora_weights(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # The merged folder is a stock GPTNeoX folder whose logits equal base + adapter.
    merged_dir = straight.output_dir
    assert json.loads((merged_dir / "config.json").read_text())["architectures"] == ["GPTNeoXForCausalLM"]
    assert (merged_dir / "tokenizer.json").is_file()
    adapted = PeftModel.from_pretrained(GPTNeoXForCausalLM.from_pretrained(base), tmp_path / "straight").eval()
    merged = GPTNeoXForCausalLM.from_pretrained(merged_dir).eval()
    ids = _batch(vocab=50277)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, atol=1e-5, rtol=0)


def test_merge_command_equals_base_plus_adapter(base, tmp_path):
    torch.manual_seed(1)
    model = finetune.wrap_with_peft(GPTNeoXForCausalLM.from_pretrained(base), _peft_cfg())
    with torch.no_grad():  # lora_B starts at zero; give it values so the merge has something to add
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    model.save_pretrained(tmp_path / "adapter", save_embedding_layers=False)

    import argparse

    parser = argparse.ArgumentParser()
    finetune.add_merge_arguments(parser)
    assert finetune.run_merge(parser.parse_args([str(base), str(tmp_path / "adapter"), str(tmp_path / "merged")])) == 0
    merged = GPTNeoXForCausalLM.from_pretrained(tmp_path / "merged").eval()
    plain = GPTNeoXForCausalLM.from_pretrained(base).eval()
    ids = _batch(vocab=50277)["input_ids"]
    with torch.no_grad():
        reference = model.eval()(ids).logits
        torch.testing.assert_close(merged(ids).logits, reference, atol=1e-5, rtol=0)
        assert (plain(ids).logits - reference).abs().max() > 1e-3  # the adapter did change the model
    assert (tmp_path / "merged" / "tokenizer.json").is_file()  # copied from the base folder


def test_merge_refuses_bad_folders(base, tmp_path):
    wide = finetune.wrap_with_peft(GPTNeoXForCausalLM(tiny_config(hidden_size=128)), _peft_cfg())
    wide.save_pretrained(tmp_path / "wide-adapter", save_embedding_layers=False)
    with pytest.raises(CheckpointError, match="not found"):
        finetune.merge_adapter(tmp_path / "missing", tmp_path / "wide-adapter", tmp_path / "out")
    with pytest.raises(CheckpointError, match="no adapter_config.json"):
        finetune.merge_adapter(base, base, tmp_path / "out")
    with pytest.raises(CheckpointError, match="does not fit base model"):
        finetune.merge_adapter(base, tmp_path / "wide-adapter", tmp_path / "out")


def _adapter_on(base_folder, out, recorded="keep") -> Path:
    """A LoRA adapter (non-zero update) of `base_folder` saved in `out`; `recorded` rewrites the base its
    adapter_config.json names (None: removed)."""
    torch.manual_seed(2)
    model = finetune.wrap_with_peft(GPTNeoXForCausalLM.from_pretrained(base_folder), _peft_cfg())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    model.save_pretrained(out, save_embedding_layers=False)
    if recorded != "keep":
        config = json.loads((out / finetune.ADAPTER_CONFIG).read_text())
        config["base_model_name_or_path"] = recorded
        (out / finetune.ADAPTER_CONFIG).write_text(json.dumps(config))
    return out


def _merged_logits(folder) -> torch.Tensor:
    with torch.no_grad():
        return GPTNeoXForCausalLM.from_pretrained(folder).eval()(_batch(vocab=50277)["input_ids"]).logits


def test_merge_refuses_an_adapter_of_another_base_unless_forced(base, tmp_path, capsys):
    from neox_hf.cli import main

    other = make_tiny_folder(tmp_path / "other", seed=1)  # same shapes, other weights: peft would merge silently
    adapter = _adapter_on(base, tmp_path / "adapter")
    capsys.readouterr()
    assert main(["merge", str(other), str(adapter), str(tmp_path / "wrong")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(base) in err and str(other) in err and "--force" in err, err
    assert not (tmp_path / "wrong").exists()
    assert main(["merge", str(other), str(adapter), str(tmp_path / "forced"), "--force"]) == 0
    # the base the adapter records, spelled another way (relative, through `..`): the same folder, merged
    respelled = os.path.relpath(base.parent / ".." / base.parent.name / base.name)
    assert main(["merge", respelled, str(adapter), str(tmp_path / "right")]) == 0
    assert (_merged_logits(tmp_path / "right") - _merged_logits(tmp_path / "forced")).abs().max() > 1e-3


def test_merge_compares_a_recorded_hub_id_by_name_and_proceeds_without_one(base, tmp_path, capsys):
    from neox_hf.cli import main

    named = make_tiny_folder(tmp_path / "pythia-14m")
    hub = _adapter_on(named, tmp_path / "hub-adapter", recorded="EleutherAI/pythia-14m")
    assert main(["merge", str(named), str(hub), str(tmp_path / "merged-hub")]) == 0  # a download of that repo
    assert main(["merge", str(base), str(hub), str(tmp_path / "not-hub")]) == 2
    assert "EleutherAI/pythia-14m" in capsys.readouterr().err
    anonymous = _adapter_on(base, tmp_path / "anonymous", recorded=None)
    assert main(["merge", str(base), str(anonymous), str(tmp_path / "merged-anonymous")]) == 0
    assert "records no base model" in capsys.readouterr().out


def _stock_peft_adapter(base_folder, out) -> tuple[Path, torch.Tensor]:
    """A LoRA adapter trained with stock peft (get_peft_model, a few AdamW steps) on `base_folder`, saved in `out`
    (adapter_config.json records `base_folder`), and its base + adapter logits on the test batch."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    model = get_peft_model(GPTNeoXForCausalLM.from_pretrained(base_folder),
                           LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["query_key_value", "dense"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = _batch(vocab=50277)
    for _ in range(3):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out)
    with torch.no_grad():
        return out, model.eval()(batch["input_ids"]).logits


def _copy_of(base_folder, out) -> Path:
    """The same weights saved at another path (what a copy between machines or a re-save gives)."""
    GPTNeoXForCausalLM.from_pretrained(base_folder).save_pretrained(out)
    return out


def test_merge_compares_the_base_by_its_weights_not_its_path(base, tmp_path, capsys):
    from neox_hf.cli import main

    adapter, reference = _stock_peft_adapter(base, tmp_path / "adapter")
    copy = _copy_of(base, tmp_path / "elsewhere" / "copy")
    assert json.loads((adapter / finetune.ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == str(base)
    capsys.readouterr()
    assert main(["merge", str(copy), str(adapter), str(tmp_path / "merged")]) == 0
    assert "is the same model" in capsys.readouterr().out
    torch.testing.assert_close(_merged_logits(tmp_path / "merged"), reference, atol=1e-5, rtol=0)
    # another model of the same shapes: refused in one line naming the first tensor that differs
    other = make_tiny_folder(tmp_path / "other", seed=1)
    capsys.readouterr()
    assert main(["merge", str(other), str(adapter), str(tmp_path / "wrong")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "tensor embed_out.weight holds other values" in err and str(other) in err, err  # first in name order
    assert not (tmp_path / "wrong").exists()


def test_merge_finds_a_recorded_hub_id_in_the_hub_cache_and_compares_weights(base, tmp_path, capsys, monkeypatch):
    """An adapter trained on `EleutherAI/pythia-14m` from the Hugging Face cache: a folder of the same weights merges
    whatever its name, a folder named like it with other weights is refused (a name is not a model)."""
    import huggingface_hub.constants
    from neox_hf.cli import main

    cache = tmp_path / "hub"
    snapshot = cache / "models--EleutherAI--pythia-14m" / "snapshots" / ("0" * 40)
    _copy_of(base, snapshot)
    (cache / "models--EleutherAI--pythia-14m" / "refs").mkdir()
    (cache / "models--EleutherAI--pythia-14m" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    adapter = _adapter_on(base, tmp_path / "adapter", recorded="EleutherAI/pythia-14m")
    capsys.readouterr()
    assert main(["merge", str(base), str(adapter), str(tmp_path / "merged")]) == 0
    assert "is the same model" in capsys.readouterr().out
    impostor = make_tiny_folder(tmp_path / "pythia-14m", seed=1)
    capsys.readouterr()
    assert main(["merge", str(impostor), str(adapter), str(tmp_path / "impostor")]) == 2
    assert "holds other values" in capsys.readouterr().err


def test_merge_checks_shapes_alone_when_the_recorded_base_is_not_here(tmp_path, capsys):
    from neox_hf.cli import main

    named = make_tiny_folder(tmp_path / "pythia-14m")  # the name the adapter records, whose weights nobody can check
    adapter = _adapter_on(named, tmp_path / "adapter", recorded="EleutherAI/pythia-14m")
    capsys.readouterr()
    assert main(["merge", str(named), str(adapter), str(tmp_path / "merged")]) == 0
    assert "weights cannot be compared" in capsys.readouterr().out
    wide = _adapter_on(make_tiny_folder(tmp_path / "wide", hidden_size=128), tmp_path / "wide-adapter",
                       recorded="EleutherAI/pythia-14m")
    capsys.readouterr()
    assert main(["merge", str(named), str(wide), str(tmp_path / "wide-merged"), "--force"]) == 2  # no base takes it
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lora_A.weight has shape [4, 128]" in err, err
    # the model class peft records for the base (adapter_config.json auto_mapping) is the base's config too
    config = json.loads((adapter / finetune.ADAPTER_CONFIG).read_text())
    config["auto_mapping"] = {"base_model_class": "LlamaForCausalLM", "parent_library": "transformers"}
    (adapter / finetune.ADAPTER_CONFIG).write_text(json.dumps(config))
    assert main(["merge", str(named), str(adapter), str(tmp_path / "llama-merged")]) == 2
    assert "trained on a LlamaForCausalLM, the base is a GPTNeoXForCausalLM" in capsys.readouterr().err


def test_merge_without_base_folder_is_refused_before_training(tmp_path):
    recipe = lora_recipe(tmp_path, tmp_path / "run", model={"from_pretrained": None}, peft={"merge": True})
    with pytest.raises(RecipeError, match="model.from_pretrained"):
        finetune.check_peft_recipe(recipe)


def test_recipe_file_parses_and_points_at_bundled_data():
    from neox_hf.recipe import load_yaml_file, recipe_from_dict

    path = Path(__file__).parents[1] / "recipes" / "finetune-lora-gsm8k.yaml"
    recipe = recipe_from_dict(load_yaml_file(path), source=str(path))
    assert recipe.peft.method == "lora" and recipe.data.mode == "pad"
    source = recipe.data.sources[0]
    assert source.prompt_template and source.template.startswith(source.prompt_template.split("{question}")[0])


# ----------------------------------------------------------------------------------------------------------------
# DeepSpeed, 2 processes on CPU (gloo)
# ----------------------------------------------------------------------------------------------------------------


def _launch(worker: str, *args, zero_stage: int | None, timeout: int = 360) -> None:
    command = accelerate_launch_command(WORKERS / worker, *args, zero_stage=zero_stage)
    env = launch_env(PYTHONPATH=os.pathsep.join([str(WORKERS), str(WORKERS.parents[1])]))
    done = subprocess.run(command, env=env, timeout=timeout, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


@pytest.fixture(scope="module")
def zero_runs(base, tmp_path_factory) -> Path:
    """Both stages' LoRA runs in one 2-process launch (start-up is most of a tiny run on 2 cores), ZeRO-3 last; each
    recipe sets its own stage, so the launcher passes none. The folder holding zero2/ and zero3/."""
    out = tmp_path_factory.mktemp("zero_adapter")
    _launch("peft_zero.py", base, out, 2, 3, zero_stage=None)
    return out


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_zero_adapter_save_round_trips_into_stock_gpt_neox(base, zero_runs, zero_stage):
    out = zero_runs / f"zero{zero_stage}"
    trained = torch.load(out / "trained_lora.pt")
    assert trained["report"].startswith("peft: trainable 8,192 / total 6,547,200")
    loaded = PeftModel.from_pretrained(GPTNeoXForCausalLM.from_pretrained(base), out)
    params = dict(loaded.named_parameters())
    assert len(trained["lora"]) == 16
    for name, value in trained["lora"].items():
        assert value.numel() > 0 and torch.equal(params[name].detach(), value), name
    assert max(v.abs().max() for n, v in trained["lora"].items() if "lora_B" in n) > 0  # trained off zero
    # The adapter folder holds only adapter tensors; the base the test loads is the untouched folder.
    assert set(_lora_weights(out)) == {n.replace(".default", "") for n in trained["lora"]}
