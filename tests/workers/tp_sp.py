"""TP=2 with sequence parallelism: forward, backward, 5 AdamW steps, the loop's loss, saved activations. The test
module runs `sp_checks` from tp_tp2.py (one launch for both); standalone:
    torchrun --nproc_per_node 2 tests/workers/tp_sp.py <models_dir> <out_dir>
<models_dir> holds stock save_pretrained folders `untied`, `tied` and `sequential` (no parallel residual) written
by pytest.
"""

import os
import sys

import torch
from tests.conftest import end_process_group
from tp_common import tp_causal_lm_loss, tp_logits, batch, gathered_grads, init_gloo, save_rank_result, tp_adamw_losses
from transformers import GPTNeoXForCausalLM

from neox_hf.errors import NeoXHFError
from neox_hf.parallel.tensor_parallel import (
    apply_tensor_parallel,
    build_parallel_groups,
    from_pretrained_tensor_parallel,
)
from neox_hf.ops.loss import causal_lm_loss


def sp_model(folder, groups, sequence_parallel=True):
    return apply_tensor_parallel(GPTNeoXForCausalLM.from_pretrained(folder), groups.tp_group, sequence_parallel)


def equivalence_checks(folder, groups):
    model = sp_model(folder, groups)
    input_ids, labels = batch()
    result = {"logits": tp_logits(model, input_ids).detach()}
    loss = tp_causal_lm_loss(model, input_ids, labels)  # the head sees seq - 1 positions: the unsplit path
    loss.backward()
    result.update(loss=loss.detach(), grads=gathered_grads(model, groups.tp_group))
    model.zero_grad()
    # The training loop's loss: labels aligned with inputs, so the head keeps only its sequence slice for backward.
    aligned = {"input_ids": input_ids, "labels": torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)}
    loop_sum, loop_count = causal_lm_loss(model, aligned)
    loop_loss = loop_sum / loop_count
    loop_loss.backward()
    result.update(loop_loss=loop_loss.detach(), loop_grads=gathered_grads(model, groups.tp_group))
    model.zero_grad()
    result["losses"] = tp_adamw_losses(model, input_ids, labels)
    return result


def saved_activation_bytes(model, input_ids, labels) -> int:
    """Bytes of the distinct non-parameter tensors autograd keeps for backward after one forward."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = tp_causal_lm_loss(model, input_ids, labels)
    loss.backward()
    return sum(saved.values())


def memory_checks(folder, groups):
    # Long enough that per-position activations dominate what autograd keeps.
    input_ids, labels = batch(batch_size=2, seq=64, ignore_some=False)
    return {f"saved_bytes_sp_{sp}": saved_activation_bytes(sp_model(folder, groups, sp), input_ids, labels)
            for sp in (False, True)}


def refusal_checks(folder, groups):
    model = sp_model(folder, groups)
    try:
        tp_logits(model, batch(seq=15)[0])
        return {"refusal": ""}
    except NeoXHFError as error:
        return {"refusal": str(error)}


def sp_checks(models_dir, out_dir, groups):
    """Every sequence-parallel check; tp_tp2.py runs it after its own checks in the same ranks (one launch)."""
    for name in ("untied", "tied", "sequential"):
        save_rank_result(out_dir, name, equivalence_checks(os.path.join(models_dir, name), groups))
    # Sliced loading onto the mesh builds the same sequence-parallel model.
    loaded = from_pretrained_tensor_parallel(GPTNeoXForCausalLM, os.path.join(models_dir, "untied"), groups,
                                             sequence_parallel=True)
    save_rank_result(out_dir, "loaded", {"logits": tp_logits(loaded, batch()[0]).detach()})
    save_rank_result(out_dir, "memory", memory_checks(os.path.join(models_dir, "untied"), groups))
    save_rank_result(out_dir, "refusal", refusal_checks(os.path.join(models_dir, "untied"), groups))


def main():
    models_dir, out_dir = sys.argv[1], sys.argv[2]
    init_gloo()
    sp_checks(models_dir, out_dir, build_parallel_groups(2))
    end_process_group()


if __name__ == "__main__":
    main()
