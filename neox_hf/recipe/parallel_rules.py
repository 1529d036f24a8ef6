"""What each parallel layout runs with: pipeline stages, sequence, context and expert parallelism, and the FSDP2
backend; each refusal names the key and the fix."""

from __future__ import annotations

from neox_hf.recipe.checks import _require
from neox_hf.recipe.keys import Recipe


def _validate_fsdp2(recipe: Recipe) -> None:
    """What `parallel.backend: fsdp2` runs (neox_hf.engines.fsdp2); DeepSpeed's own keys are refused by name."""
    p, t = recipe.parallel, recipe.train
    _require(p.dp_replicate >= 1, f"`parallel.dp_replicate` must be ≥ 1, got {p.dp_replicate}")
    if p.backend != "fsdp2":
        _require(p.dp_replicate == 1, "`parallel.dp_replicate` (HSDP) needs `parallel.backend: fsdp2`; DeepSpeed "
                                      "shards over every data-parallel rank")
        return
    for key, off in (("zero_stage", 0), ("pipeline_parallel", 1), ("offload_optimizer", False),
                     ("offload_params", False), ("deepspeed_config", None), ("use_deepspeed", None)):
        why = {"pipeline_parallel": "pipeline stages run on DeepSpeed's pipeline engine",
               "offload_optimizer": "CPU offload under FSDP2 (CPUOffloadPolicy) is not wired yet",
               "offload_params": "CPU offload under FSDP2 (CPUOffloadPolicy) is not wired yet"
               }.get(key, "it is a DeepSpeed setting; FSDP2 always shards parameters, gradients and optimizer states")
        _require(getattr(p, key) == off or (key == "use_deepspeed" and p.use_deepspeed is False),
                 f"`parallel.{key}: {getattr(p, key)}` with `parallel.backend: fsdp2` is refused: {why}; remove it "
                 "or use `parallel.backend: deepspeed`")
    _require(t.precision not in ("fp16", "fp8"),
             f"`train.precision: {t.precision}` with `parallel.backend: fsdp2` is refused: "
             + ("FSDP2 needs a sharded loss scaler, not wired yet" if t.precision == "fp16" else
                "Transformer Engine's FP8 layers are not combined with fully_shard here yet")
             + "; use bf16 (fp32 masters and reductions)")
    _require(recipe.peft.method is None or p.dp_replicate == 1,
             "`peft.method` with `parallel.dp_replicate > 1` (HSDP) is refused (LoRA under FSDP2 is tested on one "
             "sharded dimension); remove `parallel.dp_replicate` or use `parallel.backend: deepspeed`")



def _validate_pipeline(recipe: Recipe) -> None:
    """What DeepSpeed's pipeline engine (and GPT-NeoX) can run with pipeline stages."""
    m, p = recipe.model, recipe.parallel
    _require(
        p.zero_stage <= 1,
        f"`parallel.zero_stage: {p.zero_stage}` with `parallel.pipeline_parallel > 1` is refused: ZeRO-2/3 partition "
        "gradients (and ZeRO-3 parameters) across data-parallel ranks after every backward, while a pipeline stage "
        "accumulates gradients over all micro-batches in flight before one reduction; DeepSpeed's pipeline engine "
        "refuses it, as GPT-NeoX does. Use zero_stage 1 (optimizer states sharded) or 0",
    )
    method = p.pipe_partition_method
    _require(
        method in ("uniform", "parameters") or (method.startswith("type:") and len(method) > 5),
        f"`parallel.pipe_partition_method` must be `type:transformer` (GPT-NeoX's default), `uniform`, `parameters` "
        f"or `type:<layer class regex>`, got {method!r}",
    )
    _require(
        m.from_pretrained is not None or m.num_layers >= p.pipeline_parallel,
        f"`model.num_layers` ({m.num_layers}) must be ≥ `parallel.pipeline_parallel` ({p.pipeline_parallel}): every "
        "stage needs at least one transformer layer",
    )
    _require(
        not p.sequence_parallel,
        "`parallel.sequence_parallel` with `parallel.pipeline_parallel > 1` is not supported yet: the activations "
        "sent between stages are whole sequences; use sequence_parallel: false with pipeline stages",
    )
    _require(recipe.peft.method is None,
             "`peft.method` with `parallel.pipeline_parallel > 1` is refused: fine-tune adapters with ZeRO data "
             "parallelism (pipeline_parallel: 1)")
    _require(recipe.train.z_loss == 0.0,
             "`train.z_loss` with `parallel.pipeline_parallel > 1` is not supported yet: the last stage's loss is the "
             "cross-entropy alone; set train.z_loss: 0 or pipeline_parallel: 1")


def _validate_sequence_parallel(recipe: Recipe) -> None:
    """Every batch's sequence length must split evenly over the tensor-parallel ranks."""
    m, p, d = recipe.model, recipe.parallel, recipe.data
    tp = p.tensor_parallel
    _require(tp > 1, "`parallel.sequence_parallel: true` needs `parallel.tensor_parallel` > 1: it splits along the "
                     "sequence what tensor parallelism leaves replicated")
    _require(m.seq_length % tp == 0, f"`parallel.sequence_parallel` needs `model.seq_length` ({m.seq_length}) divisible "
                                     f"by `parallel.tensor_parallel` ({tp})")
    if d.mode == "pad":
        _require(d.pad_to_multiple_of % tp == 0,
                 f"`parallel.sequence_parallel` with `data.mode: pad` needs `data.pad_to_multiple_of` "
                 f"({d.pad_to_multiple_of}) to be a multiple of `parallel.tensor_parallel` ({tp})")
        max_length = d.max_length or m.seq_length
        _require(max_length % tp == 0, f"`parallel.sequence_parallel` needs `data.max_length` ({max_length}) divisible "
                                       f"by `parallel.tensor_parallel` ({tp})")


def _validate_context_parallel(recipe: Recipe) -> None:
    """What `parallel.context_parallel` > 1 runs, each refusal naming the key and the fix: DeepSpeed's Ulysses
    attention on the plain engine (every sequence in contiguous chunks, heads exchanged by all-to-all), or torch's
    ring attention on the FSDP2 engine (head-tail chunks, key/value blocks passed round the ranks)."""
    m, p, t = recipe.model, recipe.parallel, recipe.train
    cp, ring = p.context_parallel, p.backend == "fsdp2"
    _require(p.pipeline_parallel == 1, "`parallel.context_parallel` > 1 with `parallel.pipeline_parallel` > 1 is "
                                       "refused (not wired into the pipeline stages); use pipeline_parallel: 1")
    _require(not p.sequence_parallel, "`parallel.context_parallel` > 1 with `parallel.sequence_parallel: true` is "
                                      "refused (the sequence is already split over the context-parallel ranks); "
                                      "set sequence_parallel: false")
    if ring:
        _validate_ring_attention(recipe)
    else:
        _validate_ulysses(recipe)
    _require(m.attn_implementation == "sdpa",
             f"`model.attn_implementation: {m.attn_implementation}` with `parallel.context_parallel` > 1 is refused: "
             "the context-parallel attention runs SDPA; use attn_implementation: sdpa")
    _require(m.sliding_window is None, "`model.sliding_window` with `parallel.context_parallel` > 1 is refused (the "
                                       "context-parallel attention is causal over the whole sequence); remove it")
    _require(t.objective in ("lm", "dpo", "rm", "kto"), f"`train.objective: {t.objective}` with "
             "`parallel.context_parallel` > 1 is refused (it does not split its sequences); use context_parallel: 1")
    _require(t.objective == "lm" or t.loss_normalization == "token",
             f"`train.objective: {t.objective}` with `parallel.context_parallel` > 1 and `train.loss_normalization: "
             "micro_batch` is refused (the group's first rank counts each pair's loss); use loss_normalization: token")
    _require(recipe.peft.method is None, "`peft.method` with `parallel.context_parallel` > 1 is refused (not tested); "
                                         "use context_parallel: 1")
    chunks = 2 * cp if ring else cp
    _require(m.seq_length % chunks == 0, f"`model.seq_length` ({m.seq_length}) must be divisible by {chunks} "
                                         + ("(2 × `parallel.context_parallel`): every rank trains a head and a tail "
                                            "chunk" if ring else "(`parallel.context_parallel`): every rank trains an "
                                                                 "equal chunk"))


def _validate_ulysses(recipe: Recipe) -> None:
    m, p = recipe.model, recipe.parallel
    cp, tp = p.context_parallel, p.tensor_parallel
    split = f"`parallel.context_parallel` ({cp})" + (f" × `parallel.tensor_parallel` ({tp})" if tp > 1 else "")
    _require(m.num_attention_heads % (cp * tp) == 0,
             f"`model.num_attention_heads` ({m.num_attention_heads}) must be divisible by {split}: Ulysses gives each "
             "rank whole heads; choose a context_parallel that divides the heads")
    kv_heads = m.num_kv_heads or m.num_attention_heads
    _require(kv_heads % (cp * tp) == 0,
             f"`model.num_kv_heads` ({kv_heads}) must be divisible by {split}: Ulysses gives each rank whole key/value "
             "heads; choose a context_parallel that divides them")


def _validate_ring_attention(recipe: Recipe) -> None:
    """torch's ring attention takes no mask: causal over the whole sequence only."""
    _require(not recipe.data.isolate_documents,
             "`data.isolate_documents: true` with `parallel.context_parallel` > 1 and `parallel.backend: fsdp2` is "
             "refused: torch's ring attention is causal over the whole sequence and cannot keep packed documents "
             "apart; set isolate_documents: false or use `parallel.backend: deepspeed` (Ulysses masks documents)")


def _validate_expert_parallel(recipe: Recipe) -> None:
    """What `parallel.expert_parallel` > 1 runs (`neox_hf.parallel.expert_parallel`), each refusal naming the key and
    the fix. Whether the model has experts, and whether their number divides, is checked when the model is split."""
    p = recipe.parallel
    ep = p.expert_parallel
    _require(ep >= 1, f"`parallel.expert_parallel` must be ≥ 1, got {ep}")
    if ep == 1:
        return
    over_tensor = p.experts_over == "tensor"
    refusals = (
        (p.pipeline_parallel > 1, "`parallel.pipeline_parallel` > 1", "use pipeline_parallel: 1"),
        (p.zero_stage == 3, "`parallel.zero_stage: 3`", "use zero_stage 0-2, or `parallel.backend: fsdp2`"),
        (p.sequence_parallel, "`parallel.sequence_parallel: true`", "set sequence_parallel: false"),
        (p.dp_replicate > 1, "`parallel.dp_replicate` > 1 (HSDP)", "use dp_replicate: 1"),
        (recipe.peft.method is not None, "`peft.method`", "train the full model, or expert_parallel: 1"),
        (not over_tensor and p.tensor_parallel > 1 and p.backend != "fsdp2", "`parallel.tensor_parallel` > 1 and "
         "`parallel.experts_over: data` on DeepSpeed (its one data-parallel group cannot reduce the experts over the "
         "tensor-parallel ranks too)", "set `parallel.experts_over: tensor` (GPT-NeoX's layout: the experts split over "
         "the tensor-parallel group) with expert_parallel = tensor_parallel, or `parallel.backend: fsdp2`"),
        (over_tensor and p.tensor_parallel != ep, f"`parallel.experts_over: tensor` and `parallel.tensor_parallel: "
         f"{p.tensor_parallel}`", f"set tensor_parallel: {ep}, or experts_over: data"),
        (over_tensor and p.context_parallel > 1, "`parallel.experts_over: tensor` and `parallel.context_parallel` > 1",
         "use experts_over: data"),
    )
    for refused, what, fix in refusals:
        _require(not refused, f"`parallel.expert_parallel: {ep}` with {what} is refused (not supported); {fix}")
