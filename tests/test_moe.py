"""Mixture of experts, the model side: the Mixtral family is transformers' own MixtralForCausalLM (saved folders load
in the stock class with equal logits, stock folders continue in the family), its router loss is transformers'
`load_balancing_loss_func` on the same tokens, weighed per micro-batch as the LM loss; the routing statistics are
dropless; the MoE keys are refused by name where the family cannot express them."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from neox_hf.errors import RecipeError
from neox_hf.recipe import recipe_from_dict


class _Tokenizer:
    bos_token_id = eos_token_id = 0
    pad_token_id = 1

    def __len__(self):
        return 500


def _tiny_mixtral_recipe(**model):
    return recipe_from_dict({"model": {"family": "mixtral", "num_layers": 2, "hidden_size": 64,
                                       "num_attention_heads": 4, "num_kv_heads": 2, "intermediate_size": 32,
                                       "moe_num_experts": 8, "moe_top_k": 2, "seq_length": 32, **model},
                             "train": {"precision": "fp32"}})


def _build(recipe):
    from neox_hf.engines.build import build_model_from_recipe
    from neox_hf.parallel.layout import Layout

    return build_model_from_recipe(recipe, _Tokenizer(), Layout())


def test_mixtral_from_a_recipe_is_stock_mixtral_with_gpt_neox_init(tmp_path):
    model = _build(_tiny_mixtral_recipe()).eval()
    assert isinstance(model, MixtralForCausalLM) and model.config.vocab_size == 512
    c = model.config
    assert (c.num_local_experts, c.num_experts_per_tok, c.router_aux_loss_coef, c.output_router_logits) == (8, 2, 0.02,
                                                                                                         True)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (8, 64, 64) and experts.down_proj.shape == (8, 64, 32)  # 3-D, experts dim 0
    # GPT-NeoX init: small_init sqrt(2 / 5d) for the experts' input, wang_init 2 / (L sqrt(d)) for their output
    assert abs(experts.gate_up_proj.std().item() - math.sqrt(2 / (5 * 64))) < 0.01
    assert abs(experts.down_proj.std().item() - 2 / 2 / math.sqrt(64)) < 0.01
    model.save_pretrained(tmp_path)
    stock = MixtralForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(stock) is MixtralForCausalLM and stock.config.architectures == ["MixtralForCausalLM"]
    ids = torch.randint(0, 500, (2, 24))
    assert torch.allclose(stock(ids).logits, model(ids).logits, atol=1e-5, rtol=0)


def save_tiny_stock_mixtral(folder, seed: int = 0, **config):
    torch.manual_seed(seed)
    MixtralForCausalLM(MixtralConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=32, num_local_experts=8,
                                     num_experts_per_tok=2, max_position_embeddings=64, **config)).save_pretrained(folder)
    return folder


def test_a_stock_mixtral_folder_continues_in_its_family_with_any_recipe(tmp_path):
    from neox_hf.model.mixtral import NeoXMixtralForCausalLM

    folder = save_tiny_stock_mixtral(tmp_path / "stock")
    stock = MixtralForCausalLM.from_pretrained(folder).eval()
    # a GPT-NeoX recipe's architecture keys give way to the folder's config, as for a Llama folder
    recipe = recipe_from_dict({"model": {"from_pretrained": str(folder), "num_layers": 6, "rotary_pct": 0.25}})
    model = _build(recipe).eval()
    assert isinstance(model, NeoXMixtralForCausalLM) and model.config.num_hidden_layers == 2
    ids = torch.randint(0, 500, (2, 24))
    assert torch.equal(model(ids).logits, stock(ids).logits)


@pytest.mark.parametrize("padded", [False, True])
def test_the_router_loss_is_transformers_on_the_same_tokens_weighed_as_the_lm_loss(tmp_path, padded):
    """Our LM objective's loss per token = stock MixtralForCausalLM's loss with `labels` (mean cross-entropy +
    router_aux_loss_coef × load_balancing_loss_func over the micro-batch), in fp32; the step's logged router loss is
    the token-weighted mean of the micro-batches' `load_balancing_loss_func`."""
    from neox_hf.model.moe import routing_metrics, step_sums
    from neox_hf.objectives.lm import LMObjective

    folder = save_tiny_stock_mixtral(tmp_path / "stock", output_router_logits=True, router_aux_loss_coef=0.3)
    ours = _build(recipe_from_dict({"model": {"from_pretrained": str(folder)}})).train()
    stock = MixtralForCausalLM.from_pretrained(folder).train()
    torch.manual_seed(1)
    batches = []
    for rows in (2, 3):  # two micro-batches of different sizes
        ids = torch.randint(2, 500, (rows, 16))
        mask = torch.ones_like(ids)
        if padded:
            mask[0, 11:] = 0
        labels = torch.where(mask.bool(), ids, -100)
        batches.append({"input_ids": ids, "labels": labels, **({"attention_mask": mask} if padded else {})})
    expected_aux, units = [], []
    for batch in batches:
        shifted = torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], -100)], dim=1)
        reference = stock(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                          labels=batch["labels"], output_router_logits=True)
        # stock shifts labels itself: ours are aligned (position t predicts labels[t])
        ours_batch = {**batch, "labels": shifted}
        out = LMObjective().loss(ours, ours_batch, fused=True)
        assert abs(out.loss_sum.item() / out.units.item() - reference.loss.item()) < 1e-5
        expected_aux.append(load_balancing_loss_func(reference.router_logits, 8, 2, batch.get("attention_mask")))
        units.append(out.units)
        assert abs(expected_aux[-1].item() - reference.aux_loss.item()) < 1e-6
    sums = step_sums(ours)
    metrics = routing_metrics(sums, num_experts=8, top_k=2)
    weighted = sum(a * u for a, u in zip(expected_aux, units)) / sum(units)
    assert abs(metrics["moe_aux_loss"].item() - weighted.item()) < 1e-5
    assert metrics["moe_assignments_per_token"].item() == 2.0  # dropless: every token reached its top-2 experts
    assert 0 <= metrics["moe_expert_share_min"] <= 1 / 8 <= metrics["moe_expert_share_max"] <= 1
    assert 0 < metrics["moe_router_entropy"] <= math.log(8) + 1e-6
    ours.eval()
    with torch.no_grad():
        evaluated = LMObjective().loss(ours, ours_batch, fused=True)  # evaluation: the cross-entropy alone
    assert step_sums(ours) is None and evaluated.loss_sum.item() < out.loss_sum.item()


@pytest.mark.parametrize("model,key", [
    ({"family": "llama", "moe_num_experts": 8}, "moe_num_experts"),
    ({"family": "gpt_neox", "moe_top_k": 2}, "moe_top_k"),
    ({"family": "mixtral", "moe_num_experts": 1}, "moe_num_experts"),
    ({"family": "mixtral", "moe_num_experts": 8, "moe_expert_interval": 2}, "moe_expert_interval"),
    ({"family": "mixtral", "moe_num_experts": 8, "moe_router_type": "sinkhorn"}, "moe_router_type"),
    ({"family": "mixtral", "moe_num_experts": 8, "moe_top_k": 9}, "moe_top_k"),
    ({"family": "mixtral", "moe_num_experts": 8, "attention_bias": True}, "attention_bias"),
])
def test_moe_keys_a_family_cannot_express_are_refused_by_name(model, key):
    with pytest.raises(RecipeError, match=key):
        recipe_from_dict({"model": {"num_layers": 2, **model}})


def test_moe_with_pipeline_stages_is_refused_by_name():
    with pytest.raises(RecipeError, match="pipeline_parallel"):
        recipe_from_dict({"model": {"family": "mixtral", "moe_num_experts": 4}, "parallel": {"pipeline_parallel": 2}})
