"""DPO and reward-model runs on every layout equal one process (fp32): the step's pair weighting over micro-batches
and data-parallel ranks, ZeRO's partitions and tensor parallelism do not change the losses, through the real entry
point `run_clm_neox.py` calls (`neox_hf.cli.train_main`).

Layouts: DPO on DP2 ZeRO-1 (reading the pairs as GPT-NeoX pairwise .bin/.idx files), DP2 ZeRO-3 and TP2; RM on DP2 ZeRO-0, DP2 ZeRO-2 and TP2 — every ZeRO stage and TP for
each step path the objectives share (the plain engine's step is the same code for both; one objective per stage) —
and DPO, RM and KTO on FSDP2 DP2 (`parallel.backend: fsdp2`: the same step over sharded DTensors, DPO's reference
log-probabilities precomputed through the sharded model, KTO's frozen reference a whole copy per rank). One
process runs micro-batches of 2 pairs × 2 accumulation steps; DP2 runs 2 pairs per rank × 1 step: the preference
loader hands both the same 4 pairs per step (global windows of dp × P pairs).

What runs where: the layouts run one after the other in ONE 2-process torchrun launch of
tests/workers/init_layouts.py (torchrun, not `accelerate launch --use_deepspeed`, whose environment an FSDP2 recipe
refuses; the DeepSpeed recipes set `use_deepspeed`; each its own recipe file, `neox_hf.cli.train_main` per run, the ZeRO-3 one last): on 2
cores a launch's start-up (importing torch, transformers and DeepSpeed in a launcher and two ranks) costs far more
than a tiny run, so six launches cost ~six times one. The one-process references run `neox_hf.cli.train_main` in the test
process itself (no DeepSpeed there: their recipes set `use_deepspeed: false`), sparing a process start each.
"""

from __future__ import annotations

import json
import shlex

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from tests.conftest import (BUNDLED_TOKENIZER, finish_launch, reset_accelerate_state, start_torchrun_layouts,
                            train_in_this_process)

STEPS, LOSS_TOL = 3, 1e-5
# name: (objective, dp, tp, ZeRO stage or "fsdp2"), in the tests' order; the launch runs them in this order with ZeRO-3
# moved last
LAYOUTS = {
    "dpo-zero1": ("dpo", 2, 1, 1),  # reads the pairs as GPT-NeoX .bin/.idx files (NEOX_FILES) "dpo-zero3": ("dpo", 2, 1, 3), "dpo-tp2": ("dpo", 1, 2, 1),
    "rm-zero0": ("rm", 2, 1, 0), "rm-zero2": ("rm", 2, 1, 2), "rm-tp2": ("rm", 1, 2, 0),
    "kto-zero1": ("kto", 2, 1, 1),
    "dpo-fsdp2": ("dpo", 2, 1, "fsdp2"), "rm-fsdp2": ("rm", 2, 1, "fsdp2"), "kto-fsdp2": ("kto", 2, 1, "fsdp2"),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny stock GPTNeoX folder (the DPO reference and the RM decoder) and a file of short preference pairs."""
    root = tmp_path_factory.mktemp("objective_layouts")
    torch.manual_seed(0)
    config = GPTNeoXConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
                           vocab_size=50304, max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0)
    GPTNeoXForCausalLM(config).save_pretrained(root / "model")
    words = "apple river stone cloud maple ember violet harbor quartz meadow lantern copper".split()
    with (root / "pairs.jsonl").open("w") as f:
        for i in range(24):
            prompt = f"Question {i}: name the {words[i % 12]} after {words[(i * 5) % 12]}.\nAnswer: "
            chosen = " ".join(words[(i + k) % 12] for k in range(1 + i % 4))
            rejected = " ".join(words[(3 * i + k) % 12] for k in range(2 + i % 3))
            f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
    with (root / "unpaired.jsonl").open("w") as f:  # KTO: TRL's unpaired format, half of it desirable
        for line in (root / "pairs.jsonl").read_text().splitlines():
            pair = json.loads(line)
            f.write(json.dumps({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True}) + "\n")
            f.write(json.dumps({"prompt": pair["prompt"], "completion": pair["rejected"], "label": False}) + "\n")
    # the same pairs as GPT-NeoX pairwise files (tests/test_neox_post_training.py: equal micro-batches)
    from neox_hf.data.tokenizer import load_tokenizer
    from tests.test_neox_post_training import write_neox_pairs

    rows = [json.loads(line) for line in (root / "pairs.jsonl").read_text().splitlines()]
    source = write_neox_pairs(rows, load_tokenizer(str(BUNDLED_TOKENIZER)), root / "neox_pairs")
    (root / "neox_pairs.json").write_text(json.dumps(source))
    return root


NEOX_FILES = {"dpo-zero1"}  # the layouts reading GPT-NeoX's pairwise .bin/.idx form of pairs.jsonl


def recipe(base, out, objective: str, *, dp: int, tp: int = 1, zero: int | str = 0) -> list[str]:
    source = ({"path": str(base / ("unpaired.jsonl" if objective == "kto" else "pairs.jsonl"))}
              if out.name not in NEOX_FILES else json.loads((base / "neox_pairs.json").read_text()))
    parallel = ({"backend": "fsdp2"} if zero == "fsdp2" else
                {"tensor_parallel": tp, "zero_stage": zero, "use_deepspeed": dp * tp > 1})
    path = out.parent / f"{out.name}.yaml"
    path.write_text(json.dumps({
        "model": {"from_pretrained": str(base / "model"), "seq_length": 64, "num_attention_heads": 4},
        "tokenizer": {"path": str(BUNDLED_TOKENIZER)},
        "data": {"sources": [source], "mode": "pad", "seed": 7},
        "train": {"objective": objective, "train_iters": STEPS, "micro_batch_size": 2,
                  "gradient_accumulation_steps": 2 // dp, "lr": 1e-3, "min_lr": 1e-4, "warmup": 0.0,
                  "precision": "fp32", "log_interval": 1, "eval_interval": 100, "eval_iters": 0, "clip_grad": 1.0},
        "parallel": parallel,
        "output": {"dir": str(out), "tensorboard": False},
    }))
    return [str(path)]


def steps(out) -> dict[int, dict]:
    lines = (out / "train_log.jsonl").read_text().splitlines()
    return {e["step"]: e for e in map(json.loads, lines) if "lr" in e}


@pytest.fixture(scope="module")
def one_process(base, tmp_path_factory):
    """The reference runs: `neox_hf.cli.train_main` (what `run_clm_neox.py` calls) in this process, per objective;
    `one_process(objective)` runs it the first time a test of the module asks for it, so the fast tier (the TRL
    comparison alone) runs the reward model's only, not DPO's too."""
    runs = {}

    def reference(objective: str) -> dict[int, dict]:
        if objective not in runs:
            out = tmp_path_factory.mktemp(f"{objective}_one") / "run"
            train_in_this_process(recipe(base, out, objective, dp=1))  # use_deepspeed false: no engine here
            runs[objective] = steps(out)
        return runs[objective]

    return reference


@pytest.fixture(scope="module")
def layout_runs(base, tmp_path_factory):
    """The layouts in one 2-process torchrun launch of tests/workers/init_layouts.py, each its own recipe file (no common
    arguments, no launcher ZeRO stage: each recipe sets its own), the ZeRO-3 one last; the folder holding each
    layout's output folder. A failed launch fails every test asking for it with the launch's output."""
    root = tmp_path_factory.mktemp("objective_layouts_launch")
    order = sorted(LAYOUTS, key=lambda name: LAYOUTS[name][3] == 3)  # stable: ZeRO-3 last, the rest as listed
    specs = {}
    for name in order:
        objective, dp, tp, zero = LAYOUTS[name]
        assert dp * tp == 2  # the launch's processes
        (path,) = recipe(base, root / name, objective, dp=dp, tp=tp, zero=zero)
        specs[name] = shlex.quote(path)
    finish_launch(start_torchrun_layouts(root, specs), "the objective layouts", timeout=1800)
    return root


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_objective_on_a_layout_equals_one_process(one_process, layout_runs, layout):
    objective = LAYOUTS[layout][0]
    out = layout_runs / layout
    expected, got = one_process(objective), steps(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    saved = json.loads((out / "config.json").read_text())  # stock classes: the policy, or the scalar-head reward model
    assert saved["architectures"] == ["GPTNeoXForSequenceClassification" if objective == "rm" else "GPTNeoXForCausalLM"]
    if objective == "dpo":
        assert abs(expected[1]["loss"] - 0.6931471805599453) <= 1e-6  # reference = starting model: ln 2
    if objective == "kto":
        assert abs(expected[1]["loss"] - 0.5) <= 1e-6  # reference = starting model: r = z = 0, 1 − σ(0)
    for step in expected:
        assert got[step]["consumed_samples"] == expected[step]["consumed_samples"] == 4 * step  # pairs / examples
        if objective == "kto" and step > 1:
            continue  # TRL averages KTO's KL estimate over its processes (tests/test_continue_neox.py checks that
            # rule): past the first step (z = 0 everywhere) 2 ranks take TRL's 2-process step, not one process's
        assert abs(got[step]["loss"] - expected[step]["loss"]) <= LOSS_TOL, (step, got[step], expected[step])
        for name in ("rewards/margins", "logps/chosen", "accuracy", "margin"):
            if name in expected[step]:
                assert abs(got[step][name] - expected[step][name]) <= 1e-4 * max(1.0, abs(expected[step][name]))


def test_reward_run_first_step_equals_trls_reward_trainer(base, one_process, tmp_path):
    """The first step logged by the one-process run (`run_clm_neox.py`'s entry point, in this process) for
    `train.objective: rm` is TRL's RewardTrainer loss on the same four pairs (the loader's first step, rebuilt here)
    for the same starting model (fp32, 1e-5). DPO's first step is ln 2 in both (the policy is the reference), asserted
    above."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    from neox_hf.data.preference import build_preference_train_loader
    from neox_hf.data.tokenizer import load_tokenizer
    from neox_hf.objectives.rm import build_reward_model
    from neox_hf.recipe.args import parse_run_args

    recipe_ = parse_run_args(recipe(base, tmp_path / "rebuilt", "rm", dp=1)).recipe
    tokenizer = load_tokenizer(recipe_.tokenizer.path, eos_token=recipe_.tokenizer.eos_token,
                               pad_token=recipe_.tokenizer.pad_token)
    loader = build_preference_train_loader(recipe_.data, tokenizer, seq_length=recipe_.model.seq_length,
                                           micro_batch_size=2, seed=recipe_.data.seed, objective="rm")
    first_step = [int(i) for _ in range(2) for i in next(loader)["pair_index"]]
    rows = [json.loads(line) for line in (base / "pairs.jsonl").read_text().splitlines()]
    assert loader.num_pairs == len(rows)  # pair_index numbers the file's rows (none dropped at this length)
    model = build_reward_model(recipe_, tokenizer)  # the run's starting model: same folder, same seeded score head
    args = RewardConfig(output_dir=str(tmp_path / "trl"), max_length=recipe_.model.seq_length, report_to=[],
                        use_cpu=True, bf16=False, per_device_train_batch_size=4, dataloader_num_workers=0)
    trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list([rows[i] for i in first_step]),
                            processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    with torch.no_grad():
        trl_loss = float(trainer.compute_loss(trainer.model.train(), batch))
    reset_accelerate_state()  # TRL's Accelerator (fp32) would refuse a later in-process bf16 run on this worker
    first = one_process("rm")[1]["loss"]
    assert abs(first - trl_loss) <= LOSS_TOL, (first, trl_loss)


def test_kto_trains_through_the_entry_point_in_one_process(one_process):
    """`train.objective: kto` through `run_clm_neox.py`'s entry point: the first step is 1 − σ(0) = 0.5 (the policy
    is its own reference), KTO's metrics are logged under TRL's names, and the samples count examples, not the rows
    of their KL sequences."""
    logged = one_process("kto")
    assert sorted(logged) == list(range(1, STEPS + 1))
    assert abs(logged[1]["loss"] - 0.5) <= 1e-6
    assert {"kl", "rewards/chosen", "rewards/rejected", "logps/chosen"} <= set(logged[1])
    assert [logged[step]["consumed_samples"] for step in logged] == [4, 8, 12]
