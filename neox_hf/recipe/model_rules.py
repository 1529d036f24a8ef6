"""What each model family's transformers class can express: the keys of another family, and the MoE keys on a dense
family, are refused by name."""

from __future__ import annotations

from neox_hf.recipe.checks import _require
from neox_hf.recipe.keys import Recipe


# transformers' ACT2FN names (tests/test_reliability.py checks the list against transformers.activations).
HIDDEN_ACTIVATIONS = (
    "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_accurate", "gelu_python", "gelu_10", "quick_gelu",
    "relu", "relu2", "relu6", "leaky_relu", "silu", "swish", "mish", "tanh", "sigmoid", "linear", "hardswish",
)


def _validate_family(recipe: Recipe) -> None:
    """What each family's transformers model can express (the keys of the other family are refused by name)."""
    m, tp = recipe.model, recipe.parallel.tensor_parallel
    if m.from_pretrained is not None:
        return  # the folder's config.json decides the architecture
    _validate_moe(recipe)
    if m.family in ("gpt_neox", "gpt_neox_moe"):
        for name in ("num_kv_heads", "sliding_window"):
            _require(getattr(m, name) is None, f"`model.{name}` is a Llama-family option; set `model.family: llama` "
                                               "(GPTNeoX has neither grouped-query nor sliding-window attention)")
        for name in ("attention_bias", "mlp_bias"):
            _require(getattr(m, name) in (None, True), f"`model.{name}: false` is not expressible in GPTNeoX, whose "
                                                       "linears always have biases; use `model.family: llama`")
        return
    _require(m.rotary_pct == 1.0, f"`model.rotary_pct` must be 1 with `model.family: llama` (Llama rotates every "
                                  f"head dimension), got {m.rotary_pct}")
    _require(not m.use_parallel_residual, "`model.use_parallel_residual: true` is not expressible in Llama (sequential "
                                          "attention then MLP, GPT-NeoX gpt_j_residual: false); set it false")
    _require(m.hidden_dropout == 0.0, f"`model.hidden_dropout` ({m.hidden_dropout}) is not expressible in Llama (no "
                                      "dropout on the residual stream); set it 0")
    kv = m.num_kv_heads or m.num_attention_heads
    _require(kv > 0 and m.num_attention_heads % kv == 0,
             f"`model.num_kv_heads` ({kv}) must divide `model.num_attention_heads` ({m.num_attention_heads}): each "
             "key/value head serves a whole group of query heads")
    _require(kv % tp == 0,
             f"`parallel.tensor_parallel` ({tp}) must divide `model.num_kv_heads` ({kv}): each rank holds whole "
             f"key/value heads (GPT-NeoX does not replicate them either); choose a TP size ≤ {kv} that divides it")
    if m.sliding_window is not None:
        _require(m.sliding_window > 0, f"`model.sliding_window` must be > 0, got {m.sliding_window}")
        _require(not m.attention_bias and not m.mlp_bias,
                 "`model.sliding_window` with `model.attention_bias` / `model.mlp_bias` is not expressible: the "
                 "sliding window builds MistralForCausalLM, whose linears have no biases")



_MOE_FAMILIES = {"mixtral": "llama", "gpt_neox_moe": "gpt_neox"}  # MoE family → its dense family


def _validate_moe(recipe: Recipe) -> None:
    """The `moe_*` keys against the family that builds them; what the MoE model cannot run with is refused by name."""
    m, p = recipe.model, recipe.parallel
    moe_of = {dense: moe for moe, dense in _MOE_FAMILIES.items()}
    if m.family not in _MOE_FAMILIES:
        _require(m.moe_num_experts == 1, f"`model.moe_num_experts: {m.moe_num_experts}` needs an MoE family: set "
                                         f"`model.family: {moe_of[m.family]}` ({m.family}'s layers with experts)")
        set_keys = [k for k in ("moe_top_k", "moe_router_type", "moe_jitter_eps", "moe_aux_loss_coef")
                    if getattr(m, k) is not None] + (["moe_expert_interval"] if m.moe_expert_interval != 1 else [])
        _require(not set_keys, f"`model.{set_keys[0] if set_keys else ''}` is an MoE option; set `model.family: "
                               f"{moe_of[m.family]}` and `model.moe_num_experts` > 1, or remove it")
        return
    _require(m.moe_num_experts > 1, f"`model.family: {m.family}` needs `model.moe_num_experts` > 1, got "
                                    f"{m.moe_num_experts} (for a dense model use `model.family: {_MOE_FAMILIES[m.family]}`)")
    top_k = m.moe_top_k or (2 if m.family == "mixtral" else 1)
    _require(1 <= top_k <= m.moe_num_experts, f"`model.moe_top_k` ({top_k}) must be in [1, model.moe_num_experts = "
                                              f"{m.moe_num_experts}]")
    _require(m.moe_jitter_eps is None or 0 <= m.moe_jitter_eps < 1,
             f"`model.moe_jitter_eps` must be in [0, 1), got {m.moe_jitter_eps}")
    _require(m.moe_aux_loss_coef is None or m.moe_aux_loss_coef >= 0,
             f"`model.moe_aux_loss_coef` must be ≥ 0, got {m.moe_aux_loss_coef}")
    if m.family == "mixtral":
        _require(m.moe_expert_interval == 1, "`model.moe_expert_interval` > 1 is not expressible in "
                 "MixtralForCausalLM, which has experts in every layer; set it 1 (or use `model.family: gpt_neox_moe`)")
        _require(m.moe_router_type is None, f"`model.moe_router_type: {m.moe_router_type}` is GPT-NeoX's routing, on "
                 "`model.family: gpt_neox_moe`; mixtral routes as MixtralForCausalLM (softmax top-k, renormalised): "
                 "remove it")
        _require(not m.attention_bias and not m.mlp_bias, "`model.attention_bias` / `model.mlp_bias` are not "
                 "expressible in MixtralForCausalLM, whose linears have no biases; remove them")
    else:
        _require(m.moe_expert_interval >= 1, f"`model.moe_expert_interval` must be ≥ 1, got {m.moe_expert_interval}")
        _require(not m.moe_aux_loss_coef, "`model.moe_aux_loss_coef` with `model.family: gpt_neox_moe` is refused: "
                 "GPT-NeoX's dropless MoE has no load-balancing loss (Sinkhorn balances); remove it or use mixtral")
        _require(not m.use_parallel_residual, "`model.use_parallel_residual: true` with `model.family: gpt_neox_moe` "
                 "is refused: GPT-NeoX's MoE layers under gpt_j_residual add the experts' output alone (the attention "
                 "output is lost); set it false (GPT-NeoX gpt_j_residual: false, as 125M-dmoe.yml)")
    experts = {"gate_up_proj", "up_proj", "down_proj", "gate_proj", "experts", "w1", "w2", "w3", "gate"}
    named = sorted(experts & set(recipe.peft.target_modules)) if recipe.peft.method else []
    _require(not named, f"`peft.target_modules` names {', '.join(named)}: the experts of `model.family: {m.family}` "
             "are 3-D parameters, not linear layers, and LoRA on them is not wired here; LoRA trains the attention "
             "(query_key_value / dense, or q_proj / k_proj / v_proj / o_proj): remove them")
    for refused, what in ((p.pipeline_parallel > 1, "`parallel.pipeline_parallel` > 1"),
                          (p.sequence_parallel, "`parallel.sequence_parallel: true`"),
                          (p.context_parallel > 1, "`parallel.context_parallel` > 1"),
                          (p.zero_stage == 3, "`parallel.zero_stage: 3`")):
        _require(not refused, f"{what} with `model.family: {m.family}` is refused (the experts and the router "
                              "loss are not wired into it); use tensor, expert or data parallelism with ZeRO 0–2")
