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
    assert model.config._experts_implementation == "grouped_mm"  # transformers' batched kernel, not the expert loop
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
                                     num_experts_per_tok=2, max_position_embeddings=64, **config)
                       ).save_pretrained(folder)
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


def test_lora_on_the_experts_is_refused_by_name_and_on_attention_trains():
    from neox_hf.finetune import wrap_with_peft
    from neox_hf.objectives.lm import LMObjective

    with pytest.raises(RecipeError, match="gate_up_proj"):
        recipe_from_dict({"model": {"family": "mixtral", "moe_num_experts": 4},
                          "peft": {"method": "lora", "target_modules": ["gate_up_proj"]}})
    recipe = recipe_from_dict({"model": {"family": "mixtral", "num_layers": 2, "hidden_size": 32,
                                         "num_attention_heads": 4, "intermediate_size": 48, "moe_num_experts": 4,
                                         "seq_length": 16}, "peft": {"method": "lora"}, "train": {"precision": "fp32"}})
    model = wrap_with_peft(_build(recipe), recipe.peft).train()  # GPT-NeoX's default names → q/k/v/o_proj
    trained = {n.split(".")[-4] for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {"q_proj", "k_proj", "v_proj", "o_proj"}
    ids = torch.randint(0, 500, (2, 16))
    LMObjective().loss(model, {"input_ids": ids, "labels": ids}).loss_sum.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_moe_with_pipeline_stages_is_refused_by_name():
    with pytest.raises(RecipeError, match="pipeline_parallel"):
        recipe_from_dict({"model": {"family": "mixtral", "moe_num_experts": 4}, "parallel": {"pipeline_parallel": 2}})


# ---------------------------------------------------------------------------------------------------------------
# GPT-NeoX's own dropless MoE (`model.family: gpt_neox_moe`)
# ---------------------------------------------------------------------------------------------------------------

DMOE_CONFIG = "neox-moe-configs/125M-dmoe.yml"


def _gpt_neox_dmoe(x, router_weight, w1, w2, *, top_k, router_type, training, act):
    """GPT-NeoX main's ParallelDroplessMoE forward at TP 1 (megatron/model/router.py, moe.py, moe_mlp.py at ea7aefd),
    line by line, with its 2-D expert weights w1, w2 [experts × width, hidden] and MegaBlocks' gather / grouped GEMM
    / scatter written as a sort by expert and a matmul per expert."""
    logits = x.view(-1, x.shape[-1]) @ router_weight.t()

    def activation(z):
        return torch.sigmoid(z) if top_k == 1 else torch.softmax(z, dim=-1, dtype=torch.float32).type_as(z)

    if router_type == "topk":
        weights, indices = torch.topk(logits.softmax(dim=-1), top_k, dim=-1)
    elif training:
        cost = torch.exp(logits.to(torch.float32))
        d0 = torch.ones(cost.size(0), dtype=cost.dtype)
        d1 = 1 / (cost.size(1) * torch.sum(cost, 0))
        d1_old = d1
        for _ in range(3):
            d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + 0.00000001)
            d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + 0.00000001)
            error = torch.mean(torch.abs(d1_old - d1))
            d1_old = d1
            if error < 0.0001:
                break
        _, indices = torch.topk(d1 * cost * d0.unsqueeze(1), k=top_k, dim=1)
        weights = torch.gather(activation(logits), 1, indices)
    else:
        weights, indices = torch.topk(activation(logits), k=top_k, dim=1)
    experts = router_weight.shape[0]
    w1, w2 = w1.view(experts, -1, x.shape[-1]), w2.view(experts, -1, x.shape[-1])
    flat_experts = indices.flatten()
    order = torch.argsort(flat_experts, stable=True)
    tokens = x.view(-1, x.shape[-1])[order // top_k]
    out = torch.empty_like(tokens)
    for e in range(experts):
        rows = flat_experts[order] == e
        out[rows] = act(tokens[rows] @ w1[e].t()) @ w2[e]
    y = torch.zeros_like(x.view(-1, x.shape[-1]))
    y.index_add_(0, order // top_k, out * weights.flatten()[order, None])
    return y.view(x.shape)


@pytest.mark.parametrize("router_type,top_k", [("sinkhorn", 1), ("sinkhorn", 2), ("topk", 2)])
def test_the_dmoe_block_computes_what_gpt_neox_computes(router_type, top_k):
    from transformers.activations import ACT2FN

    from neox_hf.model.modeling_gpt_neox_moe import GPTNeoXMoEBlock, GPTNeoXMoEConfig

    config = GPTNeoXMoEConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, moe_num_experts=4,
                              moe_top_k=top_k, moe_router_type=router_type)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    block = GPTNeoXMoEBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    w1 = block.experts.up_proj.detach().reshape(-1, 32)  # GPT-NeoX's w1 [experts × width, hidden]
    w2 = block.experts.down_proj.detach().transpose(1, 2).reshape(-1, 32)  # its w2, the same shape
    x = torch.randn(3, 10, 32)
    for training in (True, False):
        block.train(training)
        expected = _gpt_neox_dmoe(x, block.gate.weight.detach(), w1, w2, top_k=top_k, router_type=router_type,
                                  training=training, act=ACT2FN["gelu"])
        assert torch.allclose(block(x), expected, atol=1e-5, rtol=0), (router_type, top_k, training)


def test_the_dmoe_config_trains_and_saves_a_folder_transformers_loads_with_remote_code(tmp_path):
    """`125M-dmoe.yml` shrunk by overrides: GPT-NeoX's keys become `gpt_neox_moe`; the model built from it saves a
    folder whose own modeling file (trust_remote_code=True) computes our logits, in training (Sinkhorn) and in
    evaluation (top-k) alike; MoE layers every `moe_expert_interval` layers from layer 0."""
    from transformers import AutoConfig
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    from neox_hf.model.neox_moe import NeoXMoEForCausalLM
    from neox_hf.model.modeling_gpt_neox_moe import GPTNeoXMoEBlock
    from neox_hf.recipe.args import parse_run_args
    from tests.conftest import SHARED_DATA

    path = SHARED_DATA / DMOE_CONFIG
    if not path.is_file():
        pytest.skip(f"{path} not present")
    args = parse_run_args([str(path), "--model.num_layers", "3", "--model.hidden_size", "32",
                           "--model.num_attention_heads", "4", "--model.seq_length", "16",
                           "--model.moe_expert_interval", "2", "--model.moe_top_k", "2",
                           "--train.precision", "fp32", "--parallel.zero_stage", "0"])
    m = args.recipe.model
    assert (m.family, m.moe_num_experts, m.moe_router_type, m.moe_jitter_eps) == ("gpt_neox_moe", 8, "sinkhorn", None)
    assert any("trust_remote_code=True" in note for note in args.notices)
    model = _build(args.recipe)
    assert isinstance(model, NeoXMoEForCausalLM) and model.config._experts_implementation == "grouped_mm"
    assert [isinstance(layer.mlp, GPTNeoXMoEBlock) for layer in model.gpt_neox.layers] == [True, False, True]
    # GPT-NeoX's widths: experts 4 × hidden rounded up to 256 (ParallelGroupedMLP), dense layers 4 × hidden
    assert model.gpt_neox.layers[0].mlp.experts.up_proj.shape == (8, 256, 32)  # experts on dim 0
    assert model.gpt_neox.layers[1].mlp.dense_h_to_4h.out_features == 128
    model.save_pretrained(tmp_path)
    # What AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True) does in a process without neox_hf
    # (here neox_hf registered the model type, so the Auto class would pick our copy): the folder's own file.
    remote_class = get_class_from_dynamic_module(AutoConfig.from_pretrained(tmp_path).auto_map["AutoModelForCausalLM"],
                                                 str(tmp_path))
    loaded = remote_class.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(loaded).__module__.startswith("transformers_modules")  # the folder's own file, not ours
    ids = torch.randint(0, 500, (2, 16))
    for training in (True, False):
        model.train(training), loaded.train(training)
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=0), training


@pytest.mark.distributed  # slow tier: a whole run through the entry point, in this process
def test_the_shrunk_dmoe_config_trains_and_its_saved_folder_is_what_trained(tmp_path):
    """`run_clm_neox.py 125M-dmoe.yml` shrunk by overrides trains (the loss falls on real text) and saves a folder
    whose own modeling file (trust_remote_code=True) gives the logits our class gives for the same weights."""
    from transformers import AutoConfig
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    from neox_hf.model.neox_moe import NeoXMoEForCausalLM
    from tests.conftest import REPO, SHARED_DATA, train_in_this_process
    from tests.test_resume import step_losses

    path = SHARED_DATA / DMOE_CONFIG
    if not path.is_file():
        pytest.skip(f"{path} not present")
    out = tmp_path / "run"
    printed = train_in_this_process([
        str(path), "--model.num_layers", "3", "--model.hidden_size", "32", "--model.num_attention_heads", "4",
        "--model.seq_length", "32", "--model.moe_expert_interval", "2", "--model.moe_top_k", "2",
        "--train.precision", "fp32", "--parallel.zero_stage", "0", "--parallel.pipeline_parallel", "1",
        "--parallel.tensor_parallel", "1", "--train.train_iters", "8", "--train.micro_batch_size", "4",
        "--train.gradient_accumulation_steps", "1", "--train.eval_iters", "0", "--train.log_interval", "1",
        "--train.lr", "0.003", "--train.warmup", "0", "--output.tensorboard", "false",
        "--tokenizer.path", str(REPO / "examples" / "data" / "gpt-neox-20b-tokenizer.json"),
        "--data.sources", f"[{{path: {REPO / 'examples' / 'data' / 'tinyshakespeare.txt'}}}]", "--output.dir", str(out)])
    assert "trust_remote_code=True" in printed
    losses = step_losses(out)
    assert sorted(losses) == list(range(1, 9)) and losses[8] < losses[1] - 0.3, losses
    remote_class = get_class_from_dynamic_module(AutoConfig.from_pretrained(out).auto_map["AutoModelForCausalLM"],
                                                 str(out))
    loaded = remote_class.from_pretrained(out, dtype=torch.float32).eval()
    ours = NeoXMoEForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 50000, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, ours(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("extra,key", [
    ({"moe_type": "deepspeed"}, "moe_type"),
    ({"moe_token_dropping": True}, "moe_token_dropping"),
    ({"moe_glu": True}, "moe_glu"),
    ({"moe_loss_coeff": 0.1}, "moe_loss_coeff"),
    ({"norm": "rmsnorm", "activation": "swiglu", "moe_expert_interval": 2}, "moe_expert_interval"),
    ({"norm": "rmsnorm", "activation": "swiglu", "use_bias_in_mlp": True}, "use_bias_in_mlp"),
])
def test_gpt_neox_moe_keys_not_reproduced_are_refused_by_name(tmp_path, extra, key):
    import json

    from neox_hf.recipe.args import parse_run_args

    config = tmp_path / "moe.yml"
    config.write_text(json.dumps({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                                  "moe_num_experts": 4, **extra}))
    with pytest.raises(RecipeError, match=key):
        parse_run_args([str(config)])


def test_a_llama_style_gpt_neox_moe_config_is_mixtral(tmp_path):
    import json

    from neox_hf.recipe.args import parse_run_args

    config = tmp_path / "moe.yml"
    config.write_text(json.dumps({"num_layers": 2, "hidden_size": 96, "num_attention_heads": 4, "seq_length": 32,
                                  "norm": "rmsnorm", "activation": "swiglu", "moe_num_experts": 4, "moe_top_k": 2,
                                  "moe_loss_coeff": 0.01, "moe_jitter_eps": 0.1}))
    args = parse_run_args([str(config)])
    m = args.recipe.model
    assert (m.family, m.moe_num_experts, m.moe_top_k, m.moe_aux_loss_coef, m.moe_jitter_eps) == ("mixtral", 4, 2,
                                                                                               0.01, 0.1)
    assert m.intermediate_size == 256 and not m.attention_bias and not m.mlp_bias  # int(8/3 × 96) up to 256
    assert any("MixtralForCausalLM" in note and "ParallelGroupedLLaMAMLP" in note for note in args.notices)
    model = _build(args.recipe)
    assert isinstance(model, MixtralForCausalLM) and model.config.router_jitter_noise == 0.1


@pytest.mark.parametrize("family", ["mixtral", "gpt_neox_moe"])
def test_eval_and_generate_load_the_saved_folder_as_trained(tmp_path, family):
    """`neox_hf eval` / `generate` load a saved MoE folder (`neox_hf.inference.load_base_model`, no remote code) to
    the logits of the model that was saved, routing included (fp32)."""
    from neox_hf.inference import load_base_model
    from neox_hf.model.folder import save_hf_folder

    extra = {"use_parallel_residual": False, "moe_top_k": 2} if family == "gpt_neox_moe" else {}
    model = _build(recipe_from_dict({"model": {"family": family, "num_layers": 2, "hidden_size": 32,
                                               "num_attention_heads": 4, "intermediate_size": 48,
                                               "moe_num_experts": 4, "seq_length": 16, **extra},
                                     "train": {"precision": "fp32"}})).eval()
    save_hf_folder(model, tmp_path)
    loaded = load_base_model(tmp_path)
    ids = torch.randint(0, 500, (2, 16))
    assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    assert loaded.generate(ids[:1, :4], max_new_tokens=3, do_sample=False).shape == (1, 7)


def test_dpo_on_a_mixtral_adds_the_router_loss_as_trl_does(tmp_path):
    """DPO's loss per pair on a Mixtral = the DPO loss + router_aux_loss_coef × load_balancing_loss_func over the
    micro-batch's rows (TRL's DPOTrainer where `output_router_logits`); the frozen reference (a deep copy) routes
    into its own records, not the policy's."""
    import copy

    from neox_hf.objectives.dpo import DPOObjective

    folder = save_tiny_stock_mixtral(tmp_path / "stock", output_router_logits=True, router_aux_loss_coef=0.3)
    policy = _build(recipe_from_dict({"model": {"from_pretrained": str(folder)}})).train()
    reference = copy.deepcopy(policy).eval()
    torch.manual_seed(2)
    ids = torch.randint(2, 500, (4, 12))  # 2 pairs: chosen rows, then rejected rows
    labels = ids.clone()
    labels[:, :5] = -100  # the prompt
    batch = {"input_ids": ids, "labels": labels}
    with_router = DPOObjective(beta=0.1, reference_model=reference).loss(policy, batch)
    policy.config.output_router_logits = False  # transformers' switch: no router loss
    without = DPOObjective(beta=0.1, reference_model=reference).loss(policy, batch)
    with torch.no_grad():
        aux = load_balancing_loss_func(policy(ids, output_router_logits=True).router_logits, 8, 2)
    assert abs((with_router.loss_sum - without.loss_sum).item() / 2 - 0.3 * aux.item()) < 1e-6
