"""KTO's KL estimate across data-parallel ranks, run inside the launch of tests/workers/neox_ds_checkpoint.py (its
4 ranks as two data-parallel pairs, {0, 1} and {2, 3}; a launch's start-up costs far more than this check).

Each rank of a pair takes its own micro-batch of unpaired examples (the preference loader's batch `dp_rank`), a tiny
GPTNeoX policy a seeded step away from its reference, and `KTOObjective` with the pair as its `data_parallel_group`
(what the engine sets). It writes OUT_DIR/kto_rank{r}.pt: the objective's loss sum and `kl` metric in a training
forward (grad enabled) and in an evaluation one (no grad), and, computed apart, its own raw KL estimate (the mean of
π − ref over its KL sequences), its examples' log-ratios and labels, from which tests/test_continue_neox.py rebuilds
TRL's loss: z = max(0, mean over the processes of their raw estimates).
"""

import copy
from pathlib import Path

import torch
import torch.distributed as dist

BETA, DESIRABLE_WEIGHT, UNDESIRABLE_WEIGHT = 0.5, 1.3, 0.7


def kto_check(out_dir: Path, unpaired_file: str, tokenizer_path: str) -> None:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from neox_hf.data.preference import build_preference_eval_loader
    from neox_hf.data.tokenizer import load_tokenizer
    from neox_hf.objectives.base import sequence_logps
    from neox_hf.objectives.kto import KTOObjective
    from neox_hf.recipe import DataConfig, DataSource

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both, in one order
    group, dp_rank = pairs[rank // 2], rank % 2
    tokenizer = load_tokenizer(tokenizer_path)
    cfg = DataConfig(validation=[DataSource(path=unpaired_file)], mode="pad", max_length=64, pad_to_multiple_of=1)
    batch = build_preference_eval_loader(cfg, tokenizer, seq_length=64, micro_batch_size=4, max_batches=4,
                                         objective="kto")[dp_rank]
    torch.manual_seed(0)
    reference = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=50304, hidden_size=32, num_hidden_layers=2,
                                                 num_attention_heads=4, intermediate_size=64,
                                                 max_position_embeddings=256, hidden_dropout=0.0,
                                                 attention_dropout=0.0)).eval()
    policy = copy.deepcopy(reference)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(0.05 * torch.randn_like(param))
    objective = KTOObjective(beta=BETA, desirable_weight=DESIRABLE_WEIGHT, undesirable_weight=UNDESIRABLE_WEIGHT,
                             reference_model=reference)
    objective.data_parallel_group = group
    n = batch["label"].shape[0]
    trained = objective.loss(policy.train(), batch)
    with torch.no_grad():
        evaluated = objective.loss(policy.eval(), batch)
        logps, ref = sequence_logps(policy, batch)[0], sequence_logps(reference, batch)[0]
    torch.save({"loss_sum": trained.loss_sum.detach(), "kl": trained.metric_sums["kl"] / n,
                "eval_kl": evaluated.metric_sums["kl"] / n, "raw_kl": (logps[n:] - ref[n:]).mean(),
                "logratios": logps[:n] - ref[:n], "label": batch["label"].bool()},
               out_dir / f"kto_rank{rank}.pt")
