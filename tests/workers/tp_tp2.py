"""TP=2 worker: forward, backward, 5 AdamW steps, merge + save, shard loading, vocab-parallel
CE, tied embeddings and vocab padding; then, given <sp_out_dir>, tp_sp.py's sequence-parallel checks in the same
ranks (their results under <sp_out_dir>, as a tp_sp.py launch writes them). Usage:
    torchrun --nproc_per_node 2 tests/workers/tp_tp2.py <models_dir> <out_dir> [<sp_out_dir>]
<models_dir> holds stock save_pretrained folders `untied`, `tied`, `vocab251` (and `sequential` for the
sequence-parallel checks) written by pytest.
"""

import os
import sys

import torch
from tests.conftest import end_process_group
from tp_common import tp_causal_lm_loss, tp_logits, batch, gathered_grads, init_gloo, save_rank_result, tp_adamw_losses
from transformers import GPTNeoXForCausalLM

from neox_hf.errors import NeoXHFError
from neox_hf.model.vocab import padded_vocab_size
from neox_hf.parallel.mappings import gather_along_dim
from neox_hf.parallel.tensor_parallel import (
    apply_tensor_parallel,
    build_parallel_groups,
    from_pretrained_tensor_parallel,
    gather_full_state_dict,
    load_tp_shard_state_dict,
    pad_vocab,
    vocab_parallel_cross_entropy,
)


def tp_model(folder, groups):
    return apply_tensor_parallel(GPTNeoXForCausalLM.from_pretrained(folder), groups.tp_group)


def forward_backward(model, groups, input_ids, labels, real_vocab_size=None):
    logits = tp_logits(model, input_ids).detach()
    loss = tp_causal_lm_loss(model, input_ids, labels, real_vocab_size=real_vocab_size)
    loss.backward()
    return {"logits": logits, "loss": loss.detach(), "grads": gathered_grads(model, groups.tp_group)}


def untied_checks(models_dir, out_dir, groups):
    folder = os.path.join(models_dir, "untied")
    model = tp_model(folder, groups)
    shard = load_tp_shard_state_dict(folder, model.config, groups.tp_rank, groups.tp_size)
    own = model.state_dict()
    result = {
        "shard_keys_match": sorted(shard) == sorted(own),
        "shard_max_diff": max((shard[k] - own[k]).abs().max().item() for k in own),
    }
    input_ids, labels = batch()
    result.update(forward_backward(model, groups, input_ids, labels))
    result["hf_forward_loss"] = model(input_ids, labels=labels).loss.detach()
    result["generated"] = model.generate(input_ids[:1, :8], max_new_tokens=5, do_sample=False)

    model.zero_grad()
    result["losses"] = tp_adamw_losses(model, input_ids, labels)
    result["trained_logits"] = tp_logits(model, input_ids).detach()

    merged = gather_full_state_dict(model, groups)
    if groups.tp_rank == 0:
        stock = GPTNeoXForCausalLM(model.config)
        stock.load_state_dict(merged, strict=True)
        stock.save_pretrained(os.path.join(out_dir, "merged"))
    result["merged_shapes"] = {k: tuple(v.shape) for k, v in merged.items()}
    return result


def tied_checks(models_dir, groups):
    model = tp_model(os.path.join(models_dir, "tied"), groups)
    result = {"still_tied": model.lm_head.weight is model.gpt_neox.embed_in.weight}
    input_ids, labels = batch()
    result.update(forward_backward(model, groups, input_ids, labels))
    return result


def padding_checks(models_dir, groups):
    folder = os.path.join(models_dir, "vocab251")
    try:
        tp_model(folder, groups)
        refusal = ""
    except NeoXHFError as error:
        refusal = str(error)
    model = GPTNeoXForCausalLM.from_pretrained(folder)
    model = apply_tensor_parallel(pad_vocab(model, padded_vocab_size(251, 8, groups.tp_size)), groups.tp_group)
    # The slice-by-slice loader pads the same way without materialising the full matrices.
    sliced = from_pretrained_tensor_parallel(GPTNeoXForCausalLM, folder, groups, padded_vocab=256).state_dict()
    sliced_equal = sorted(sliced) == sorted(model.state_dict()) and all(
        torch.equal(sliced[k], v) for k, v in model.state_dict().items())
    input_ids, labels = batch(vocab=251)
    result = forward_backward(model, groups, input_ids, labels, real_vocab_size=251)
    result["refusal"] = refusal
    result["sliced_padded_load_equal"] = sliced_equal
    return result


def cross_entropy_checks(groups):
    g = torch.Generator().manual_seed(7)
    full_logits = torch.randn(3, 5, 256, generator=g) * 4
    labels = torch.randint(0, 256, (3, 5), generator=g)
    labels[1, :2] = -100
    labels[2, 4] = 255  # lives on the last rank
    result = {"full_logits": full_logits, "labels": labels}
    for real_vocab in (None, 200):
        if real_vocab is not None:
            labels = labels.clamp(max=real_vocab - 1).masked_fill(labels == -100, -100)
        shard = full_logits.chunk(groups.tp_size, dim=-1)[groups.tp_rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(shard, labels, groups.tp_group, real_vocab_size=real_vocab)
        loss.backward()
        result[f"loss_{real_vocab}"] = loss.detach()
        result[f"grad_{real_vocab}"] = gather_along_dim(shard.grad, -1, groups.tp_group)
        result[f"labels_{real_vocab}"] = labels
    return result


def main():
    models_dir, out_dir = sys.argv[1], sys.argv[2]
    init_gloo()
    groups = build_parallel_groups(2)
    save_rank_result(out_dir, "untied", untied_checks(models_dir, out_dir, groups))
    save_rank_result(out_dir, "tied", tied_checks(models_dir, groups))
    save_rank_result(out_dir, "padding", padding_checks(models_dir, groups))
    save_rank_result(out_dir, "cross_entropy", cross_entropy_checks(groups))
    if len(sys.argv) > 3:  # the sequence-parallel checks in the same ranks: one launch (and one import) for both
        from tp_sp import sp_checks

        sp_checks(models_dir, sys.argv[3], groups)
    end_process_group()


if __name__ == "__main__":
    main()
