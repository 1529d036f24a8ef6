"""GPT-NeoX's optimizers (issue 44): each `optimizer.type` with its params, translated into `train.optimizer` and
built by `neox_hf.engines.optimizer`, takes the same two steps on a tiny model as the library's own optimizer built
as GPT-NeoX's get_optimizer builds it (its two parameter groups, `weight_decay`, `**optimizer.params`); fp32,
same weights (1e-5: torch's fused kernels round apart from its loops). Lion also equals GPT-NeoX's own Lion
(megatron/optimizers.py, written out below from its description). SM3 is pytorch-optimizer's, which computes what
GPT-NeoX's own SM3 copy computes (checked when it was wired: equal to 1e-8 over two steps, momentum and beta on).
Types that cannot run here are refused by name."""

from __future__ import annotations

import copy

import pytest
import torch

from neox_hf.engines.optimizer import build_optimizer, parameter_groups
from neox_hf.errors import RecipeError
from neox_hf.neox_yaml import translate_neox_args
from neox_hf.recipe import recipe_from_dict


def tiny_model():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=64, max_position_embeddings=64, hidden_dropout=0.0,
                                            attention_dropout=0.0))


def two_steps(model, optimizer) -> dict:
    """The weights after two optimizer steps on fixed batches."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(0, 128, (2, 16), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def recipe_train(neox: dict):
    return recipe_from_dict(translate_neox_args(neox).recipe).train


def gpt_neox_groups(model, weight_decay: float) -> list[dict]:
    """GPT-NeoX's get_params_for_weight_decay_optimization: biases and norm weights (every 1-d parameter of GPTNeoX)
    without weight decay."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if p.ndim >= 2]},
            {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0}]


def gpt_neox_lion(groups: list[dict], lr: float, betas, weight_decay: float):
    """GPT-NeoX's own Lion (used without ZeRO): decoupled decay, sign of the interpolated momentum, then the
    momentum update."""

    class Lion(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                beta1, beta2 = group["betas"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    state = self.state[p]
                    if not state:
                        state["exp_avg"] = torch.zeros_like(p)
                    update = state["exp_avg"] * beta1 + p.grad * (1 - beta1)
                    p.add_(torch.sign(update), alpha=-group["lr"])
                    state["exp_avg"].mul_(beta2).add_(p.grad, alpha=1 - beta2)

    return Lion(groups)


def assert_same_weights(ours: dict, theirs: dict, **tol) -> None:
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], **(tol or dict(rtol=1e-5, atol=1e-6)),
                                   msg=lambda m: f"{name}: {m}")


def library_optimizer(kind: str, groups, params: dict, weight_decay: float):
    """The class GPT-NeoX's get_optimizer builds for `kind`, as it builds it (CPU: torch's AdamW stands for
    FusedAdam / DeepSpeedCPUAdam in their default AdamW mode)."""
    if kind == "Adam":
        return torch.optim.AdamW(groups, weight_decay=weight_decay, **params)
    if kind == "cpu_torch_adam":
        return torch.optim.Adam(groups, weight_decay=weight_decay, **params)
    if kind == "SGD":
        return torch.optim.SGD(groups, weight_decay=weight_decay, **params)
    if kind == "sm3":  # GPT-NeoX passes SM3 no weight_decay
        from pytorch_optimizer import SM3

        return SM3(groups, **params)
    if kind == "Lion":
        from lion_pytorch import Lion

        return Lion(groups, weight_decay=weight_decay, **params)
    raise AssertionError(kind)


CASES = {
    "Adam": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-6},
    "cpu_torch_adam": {"lr": 2e-3, "betas": [0.8, 0.99], "eps": 1e-7},
    "SGD": {"lr": 0.05, "momentum": 0.9, "nesterov": True},
    "Lion": {"lr": 1e-4, "betas": [0.9, 0.99]},
    "sm3": {"lr": 0.05, "momentum": 0.9, "beta": 0.5, "eps": 1e-20},
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_each_gpt_neox_optimizer_takes_the_library_s_two_steps(kind):
    params, weight_decay = CASES[kind], 0.1
    train = recipe_train({"optimizer": {"type": kind, "params": params}, "weight_decay": weight_decay})
    assert train.optimizer == {"Adam": "adamw", "cpu_torch_adam": "adam", "SGD": "sgd", "Lion": "lion",
                               "sm3": "sm3"}[kind]
    model = tiny_model()
    reference = copy.deepcopy(model)
    ours = build_optimizer(model, train)
    theirs = library_optimizer(kind, gpt_neox_groups(reference, weight_decay), params, weight_decay)
    assert type(ours) is type(theirs)
    stepped = two_steps(model, ours)
    assert_same_weights(stepped, two_steps(reference, theirs))
    if kind == "Lion":  # lion-pytorch computes GPT-NeoX's own Lion
        neox = tiny_model()
        lion = gpt_neox_lion(gpt_neox_groups(neox, weight_decay), params["lr"], params["betas"], weight_decay)
        assert_same_weights(stepped, two_steps(neox, lion))


def test_params_the_config_omits_are_the_library_defaults():
    lion = recipe_train({"optimizer": {"type": "Lion", "params": {"lr": 1e-4}}})
    adam = recipe_train({"optimizer": {"type": "Adam", "params": {"lr": 1e-4}}})
    assert (lion.adam_beta1, lion.adam_beta2) == (0.9, 0.99)  # GPT-NeoX's / DeepSpeed's Lion default
    assert (adam.adam_beta1, adam.adam_beta2, adam.adam_eps) == (0.9, 0.999, 1e-8)  # FusedAdam's
    sm3 = recipe_train({"optimizer": {"type": "sm3", "params": {"lr": 0.1}}})
    assert (sm3.adam_eps, sm3.sm3_beta, sm3.momentum) == (1e-30, 0.0, 0.0)  # SM3's


def test_parameter_groups_are_gpt_neox_s():
    model = tiny_model()
    groups = parameter_groups(model, 0.1)
    theirs = gpt_neox_groups(model, 0.1)
    assert [len(g["params"]) for g in groups] == [len(g["params"]) for g in theirs]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]


@pytest.mark.parametrize("neox,words", [
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-4}}}, "OneBitAdam"),
    ({"optimizer": {"type": "madgrad_wd", "params": {"lr": 1e-4}}}, "madgrad_wd"),
    ({"optimizer": {"type": "Adagrad", "params": {"lr": 1e-4}}}, "Adagrad"),
    ({"optimizer": {"type": "Lion", "params": {"lr": 1e-4, "eps": 1e-8}}}, "optimizer.params.eps"),
    ({"optimizer": {"type": "Lion", "params": {"lr": 1e-4}}, "use_bnb_optimizer": True}, "use_bnb_optimizer"),
])
def test_optimizers_that_cannot_run_here_are_refused_by_name(neox, words):
    with pytest.raises(RecipeError, match=words):
        translate_neox_args(neox)


def test_bnb_8bit_adam_is_translated_and_refused_on_cpu_by_name():
    train = recipe_train({"optimizer": {"type": "Adam", "params": {"lr": 1e-4}}, "use_bnb_optimizer": True})
    assert train.optimizer == "adam8bit"
    with pytest.raises(RecipeError, match="adam8bit.*CUDA GPUs only.*train.optimizer: adamw"):
        build_optimizer(tiny_model(), train)


def test_sgd_nesterov_needs_momentum():
    with pytest.raises(RecipeError, match="nesterov"):
        recipe_train({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "nesterov": True}}})
