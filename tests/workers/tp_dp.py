"""TP=2 x DP=2 worker (4 ranks): 5 AdamW steps on a global batch of 4 sequences, each DP
rank taking 2. Runs three times: plain torch with the DP gradient mean done here;
DeepSpeed ZeRO-1 given our mpu so it reduces over the DP group only (and clips at norm
1.0); the same through accelerate's Accelerator + DeepSpeedPlugin. Usage:
    torchrun --nproc_per_node 4 tests/workers/tp_dp.py <model_dir> <out_dir>
"""

import sys

import torch
import torch.distributed as dist
from tp_common import LR, STEPS, batch, init_gloo, save_rank_result
from transformers import GPTNeoXForCausalLM

from neox_hf.errors import NeoXHFError
from neox_hf.parallel.tensor_parallel import (
    DeepSpeedMPU,
    apply_tensor_parallel,
    build_parallel_groups,
    deepspeed_initialize_with_mpu,
    tp_causal_lm_loss,
)


def local_batch(groups):
    input_ids, labels = batch(batch_size=4, ignore_some=False)
    rows = slice(2 * groups.dp_rank, 2 * groups.dp_rank + 2)
    return input_ids[rows], labels[rows]


def global_loss(loss, groups) -> float:
    # Equal token counts per DP rank, so the mean of DP means is the global mean.
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=groups.dp_group)
    return loss.item() / groups.dp_size


def plain_torch_losses(model_dir, groups):
    model = apply_tensor_parallel(GPTNeoXForCausalLM.from_pretrained(model_dir), groups.tp_group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    input_ids, labels = local_batch(groups)
    losses = []
    for _ in range(STEPS):
        loss = tp_causal_lm_loss(model, input_ids, labels)
        loss.backward()
        for param in model.parameters():  # what DDP / ZeRO would do, over the DP group only
            dist.all_reduce(param.grad, group=groups.dp_group)
            param.grad /= groups.dp_size
        optimizer.step()
        optimizer.zero_grad()
        losses.append(global_loss(loss, groups))
    return losses


DEEPSPEED_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    # Explicit: accelerate fills "auto" as micro * accumulation * num_processes (4), but
    # with TP=2 the data-parallel size is 2.
    "train_batch_size": 4,
    "zero_optimization": {"stage": 1},
    "zero_allow_untested_optimizer": True,
    # Clipping makes the test check that DeepSpeed's global grad norm, given our mpu and
    # the tensor_model_parallel flags, counts each TP shard once (the reference clips too).
    "gradient_clipping": 1.0,
}


def deepspeed_losses(model_dir, groups):
    import deepspeed

    model = apply_tensor_parallel(GPTNeoXForCausalLM.from_pretrained(model_dir), groups.tp_group)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
        config=dict(DEEPSPEED_CONFIG),
        mpu=DeepSpeedMPU(groups),
    )
    losses = train(engine.module, engine.backward, engine.step, lambda: None, groups)
    return {"losses": losses, "dp_world_size": engine.dp_world_size, "mp_world_size": engine.mp_world_size}


def accelerate_losses(model_dir, groups):
    from accelerate import Accelerator, DeepSpeedPlugin

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(DEEPSPEED_CONFIG)))
    model = apply_tensor_parallel(GPTNeoXForCausalLM.from_pretrained(model_dir), groups.tp_group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    # accelerate calls deepspeed.initialize without an mpu; this supplies ours.
    with deepspeed_initialize_with_mpu(DeepSpeedMPU(groups)):
        engine, optimizer = accelerator.prepare(model, optimizer)
    # No accelerate-prepared DataLoader: it would shard over all 4 processes, while the two
    # TP ranks of a DP replica must see the same batch.
    losses = train(engine.module, accelerator.backward, optimizer.step, optimizer.zero_grad, groups)
    return {"losses": losses, "dp_world_size": engine.dp_world_size, "mp_world_size": engine.mp_world_size}


def train(model, backward, step, zero_grad, groups) -> list[float]:
    input_ids, labels = local_batch(groups)
    losses = []
    for _ in range(STEPS):
        loss = tp_causal_lm_loss(model, input_ids, labels)
        backward(loss)
        step()
        zero_grad()
        losses.append(global_loss(loss, groups))
    return losses


def main():
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    init_gloo()
    try:
        build_parallel_groups(3)
        refusal = ""
    except NeoXHFError as error:
        refusal = str(error)
    groups = build_parallel_groups(2)
    result = {"refusal": refusal, "tp_rank": groups.tp_rank, "dp_rank": groups.dp_rank}
    result["plain_losses"] = plain_torch_losses(model_dir, groups)
    result["deepspeed"] = deepspeed_losses(model_dir, groups)
    result["accelerate"] = accelerate_losses(model_dir, groups)
    save_rank_result(out_dir, "tp_dp", result)


if __name__ == "__main__":
    main()
