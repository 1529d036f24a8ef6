"""GPT-NeoX's own training checkpoints, written by DeepSpeed itself, and the step GPT-NeoX takes after them: the
reference of tests/test_continue_neox.py. Usage (4 processes):
    torchrun --nproc_per_node 4 tests/workers/neox_ds_checkpoint.py OUT_DIR BATCHES NAME=CONFIG:TP[:pipeline] ...
        [kto=JSONL]

For each NAME (one after the other, in the same 4 ranks), a module whose parameters carry GPT-NeoX's names and
layer indices (`sequential.{idx}.{param}`, what GPT-NeoX's sequential layout saves as `mp_rank_XX_model_states.pt`)
trains under DeepSpeed ZeRO-1 on 2 data-parallel ranks × TP tensor-parallel ranks (an `mpu` makes DeepSpeed write
each TP rank's shard as mp_rank_00/01 and each data-parallel rank's optimizer partition as zero_pp_rank_*), with
GPT-NeoX's parameter groups (weight decay on matrices), the LR of GPT-NeoX's schedule at each step and the batches of
BATCHES (`{step: [dp rank 0's batch, dp rank 1's]}`, GPT-NeoX's order). It saves `global_step{K}` after K steps as
GPT-NeoX does (client state `iteration`), takes step K + 1 and saves `global_step{K+1}`; OUT_DIR/NAME/losses.json
holds every step's loss. `:pipeline` writes GPT-NeoX's pipeline layout instead (DeepSpeed's PipelineModule, one
stage, the layers at GPT-NeoX's indices: `layer_XX-model_YY-model_states.pt`; TP 2 only).
With TP 1 the four ranks are two replicas of the same data-parallel pair (ranks 2-3 save
into OUT_DIR/NAME-replica), so every rank takes part in DeepSpeed's collectives. `kto=JSONL` runs
tests/workers/kto_ranks.py's check of KTO's KL estimate across ranks in the same ranks.

The forward is tests/neox_reference.py's (GPT-NeoX's equations rank by rank, not transformers'): every rank holds
its own shards and sees the other TP ranks' values as constants, so a sharded tensor's gradient is this rank's part
of the full gradient, and a replicated one (or a bias added once after the reduce) gets the whole gradient, as
Megatron's copy/reduce mappings give them.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from neox_reference import layer_norm, neox_reference_logits, transformer_layer, vocab_parallel_embedding  # noqa: E402

from neox_hf.interop.convert import neox_hf_config, neox_recipe_and_tokenizer  # noqa: E402
from neox_hf.interop.neox_checkpoint import neox_param_tables, neox_rank_modules  # noqa: E402
from neox_hf.parallel.tp_plan import COLUMN, ROW, ROW_BIAS  # noqa: E402
from neox_hf.train.schedule import lr_at  # noqa: E402

STEPS_BEFORE = 2  # the checkpoint is global_step2; the reference then takes step 3


class Mpu:
    """DeepSpeed's model-parallel unit: TP groups of consecutive ranks, data-parallel groups across them."""

    def __init__(self, tp: int, replica_size: int):
        rank, world = dist.get_rank(), dist.get_world_size()
        self.tp, self.tp_rank = tp, rank % tp
        self.dp = replica_size // tp
        self.dp_rank = (rank % replica_size) // tp
        self.tp_group = self.dp_group = None
        for start in range(0, world, replica_size):
            for first in range(start, start + replica_size, tp):  # every rank creates every group, in one order
                group = dist.new_group(list(range(first, first + tp)))
                if rank in range(first, first + tp):
                    self.tp_group = group
            for offset in range(tp):
                ranks = list(range(start + offset, start + replica_size, tp))
                group = dist.new_group(ranks)
                if rank in ranks:
                    self.dp_group = group

    def get_model_parallel_rank(self):
        return self.tp_rank

    def get_model_parallel_world_size(self):
        return self.tp

    def get_model_parallel_group(self):
        return self.tp_group

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_data_parallel_world_size(self):
        return self.dp

    def get_data_parallel_group(self):
        return self.dp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group


class NeoXLayer(torch.nn.Module):
    """One GPT-NeoX layer's parameters (this TP rank's shards) under their GPT-NeoX names, e.g.
    `attention.query_key_value.weight`; `views()` is what each TP rank holds, as the reference forward takes it."""

    def __init__(self, idx: int, params: dict, config, mpu: Mpu):
        super().__init__()
        self.idx, self.config, self.mpu = idx, config, mpu
        self.rules = {neox: rule for neox, (_, rule) in neox_param_tables(config)[idx].items()}
        for name, tensor in params.items():
            module = self
            for part in name.split(".")[:-1]:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(name.split(".")[-1], torch.nn.Parameter(tensor.clone()))

    def views(self) -> list[dict]:
        tp, own = self.mpu.tp, self.mpu.tp_rank
        ranks = [{} for _ in range(tp)]
        for name, param in self.named_parameters():
            rule = self.rules[name]
            sharded = rule in (COLUMN, ROW) or (rule == ROW_BIAS and self.config.use_parallel_residual)
            if sharded and tp > 1:
                values = [torch.empty_like(param) for _ in range(tp)]
                dist.all_gather(values, param.detach().contiguous(), group=self.mpu.tp_group)
                values[own] = param
            else:
                values = [param] * tp
            for rank, value in zip(ranks, values):
                rank[name] = value
        return ranks


def layers_of(shards: dict) -> dict[int, dict]:
    """`sequential.{idx}.{param}` → {idx: {param: tensor}}."""
    layers: dict[int, dict] = {}
    for key, tensor in shards.items():
        _, idx, name = key.split(".", 2)
        layers.setdefault(int(idx), {})[name] = tensor
    return layers


class NeoXSequential(torch.nn.Module):
    """GPT-NeoX's sequential layout: this TP rank's shards as `sequential.{idx}.{param}`."""

    def __init__(self, shards: dict, config, mpu: Mpu):
        super().__init__()
        self.config = config
        self.sequential = torch.nn.Module()
        for idx, params in layers_of(shards).items():
            self.sequential.add_module(str(idx), NeoXLayer(idx, params, config, mpu))

    def forward(self, input_ids, labels):
        views = {int(idx): layer.views() for idx, layer in self.sequential.named_children()}
        ranks = [{idx: layer[r] for idx, layer in views.items()} for r in range(len(views[0]))]
        logits = neox_reference_logits(ranks, self.config, input_ids)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class Embedding(NeoXLayer):
    def forward(self, input_ids):
        return vocab_parallel_embedding([{0: view} for view in self.views()], input_ids)


class Transformer(NeoXLayer):
    def forward(self, x):
        return transformer_layer(self.views(), x, self.config)


class FinalNorm(NeoXLayer):
    def forward(self, x):
        return layer_norm(x, self.views()[0], "norm", self.config.layer_norm_eps)


class FinalLinear(NeoXLayer):
    def forward(self, x):
        return torch.cat([F.linear(x, view["final_linear.weight"]) for view in self.views()], dim=-1)


def pipeline_module(shards: dict, config, mpu: Mpu, topology):
    """GPT-NeoX's pipeline layout (one stage): layers at its indices, the parameter-free blocks at 1 and L + 2, as
    GPT-NeoX's `_pre_transformer_block` / `_post_transformer_block` functions occupy them."""
    from deepspeed.pipe import PipelineModule

    layers, n = layers_of(shards), config.num_hidden_layers
    specs = [Embedding(0, layers[0], config, mpu), lambda x: x,
             *(Transformer(i + 2, layers[i + 2], config, mpu) for i in range(n)), lambda x: x,
             FinalNorm(n + 3, layers[n + 3], config, mpu), FinalLinear(n + 4, layers[n + 4], config, mpu)]

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    return PipelineModule(specs, loss_fn=loss_fn, topology=topology, partition_method="uniform")


def full_state(config, seed: int) -> dict:
    from transformers import GPTNeoXForCausalLM

    torch.manual_seed(seed)
    return {k: v.detach().float() for k, v in GPTNeoXForCausalLM(config).state_dict().items()}


def train(name: str, config_path: str, tp: int, out_dir: Path, batches: dict, *, pipeline: bool = False) -> None:
    import deepspeed

    recipe, tokenizer = neox_recipe_and_tokenizer([config_path])
    config = neox_hf_config(recipe, tokenizer)
    replica = 2 * tp
    mpu = Mpu(tp, replica)
    shards = neox_rank_modules(full_state(config, seed=7), config, tp)[mpu.tp_rank]
    if pipeline:  # one stage × 2 data-parallel × TP: every rank in one replica
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        assert replica == dist.get_world_size()
        model = pipeline_module(shards, config, mpu, PipeModelDataParallelTopology(num_pp=1, num_mp=tp, num_dp=2))
    else:
        model = NeoXSequential(shards, config, mpu)
    t = recipe.train
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": t.weight_decay},
                                   {"params": vectors, "weight_decay": 0.0}],
                                  lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    ds_config = {"train_micro_batch_size_per_gpu": t.micro_batch_size, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
                 "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                           mpu=None if pipeline else mpu)
    first_replica = dist.get_rank() < replica
    save_dir = out_dir / (name if first_replica else f"{name}-replica")
    losses = []
    for step in range(STEPS_BEFORE + 1):
        if step == STEPS_BEFORE:
            engine.save_checkpoint(str(save_dir), tag=f"global_step{step}", client_state={"iteration": step})
        for group in engine.optimizer.param_groups:
            group["lr"] = lr_at(step, t)
        batch = batches[step][mpu.dp_rank]
        if pipeline:  # the engine's own step: forward, backward and optimizer step; the loss averaged over dp
            losses.append(engine.train_batch(data_iter=iter([(batch["input_ids"], batch["labels"])])).item())
            continue
        loss = engine(batch["input_ids"], batch["labels"])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mpu.dp_group)
        losses.append(mean.item() / mpu.dp)
    engine.save_checkpoint(str(save_dir), tag=f"global_step{STEPS_BEFORE + 1}",
                           client_state={"iteration": STEPS_BEFORE + 1})
    if dist.get_rank() == 0:
        (save_dir / "losses.json").write_text(json.dumps(losses))
    dist.barrier()


def main() -> None:
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    out_dir, batches = Path(sys.argv[1]), torch.load(sys.argv[2], weights_only=True)
    from tests.conftest import BUNDLED_TOKENIZER, end_process_group

    for spec in sys.argv[3:]:
        name, _, rest = spec.partition("=")
        if name == "kto":  # tests/workers/kto_ranks.py, in these ranks
            from kto_ranks import kto_check

            kto_check(out_dir, rest, str(BUNDLED_TOKENIZER))
            continue
        config_path, tp, *layout = rest.rsplit(":", 2) if rest.endswith(":pipeline") else rest.rsplit(":", 1)
        train(name, config_path, int(tp), out_dir, batches, pipeline=layout == ["pipeline"])

    end_process_group()


if __name__ == "__main__":
    main()
