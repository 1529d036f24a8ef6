"""`train.objective: kto`: Kahneman-Tversky optimisation (Ethayarajh et al. 2024), as TRL's `KTOTrainer` computes it
(trl 1.16, `loss_type="kto"`; GPT-NeoX's `train_impl: kto`).

Unpaired data: each example is a prompt, one completion and whether it is desirable (`neox_hf.data.preference` batches
P examples as 2P rows: the examples, then their KL sequences — prompt i with completion i − 1 of the same
micro-batch). A sequence's log-probability is the sum over its completion tokens, by the one head loss of neox_hf
(`neox_hf.ops.head_loss`) one row at a time, as DPO's. With π / ref the policy / reference log-probs:
  z    = max(0, mean over the data-parallel ranks of each one's mean over its micro-batch's KL sequences of
         (π − ref)), detached   (TRL's KL estimate: `gather_for_metrics(kl).mean().clamp(min=0)` over its processes)
  r    = π − ref of the example
  loss = λ_D (1 − σ(β (r − z)))   desirable
         λ_U (1 − σ(β (z − r)))   undesirable
and TRL's loss is the mean over the batch's examples: here the sum, over the step's examples (`neox_hf.objectives`).

Metrics (TRL's names): kl (z), rewards/chosen (mean β r of the desirable examples), rewards/rejected (of the
undesirable), rewards/margins (their difference), logps/chosen, logps/rejected (mean π). TRL logs each micro-batch's
value and averages them; `metric_sums` hold each value × the micro-batch's examples, so the step's Σ / examples is
TRL's value for one micro-batch and the example-weighted mean of them for several (the same where micro-batches are
full). A micro-batch without desirable (undesirable) examples adds 0 to rewards/chosen (rejected), where TRL logs no
value. TRL's logits/* and entropy need the whole [tokens, vocab] logits, which the fused head never builds: not logged.

The KL estimate of a training micro-batch is averaged over the data-parallel group (`data_parallel_group`, which the
engine sets; tensor-parallel ranks of a group hold the same value) before the clamp, as TRL averages it over its
processes: a run on D data-parallel ranks takes TRL's step on D processes, and so differs from one process
accumulating the same micro-batches (where TRL, and here, each micro-batch has its own estimate). Every rank of the
group runs the same number of micro-batches per step, so the all-reduce pairs up.

Differences from TRL on purpose: evaluation (no gradient) keeps each rank's own estimate: a rank's eval batches may
outnumber another's, and a collective there would wait forever; the reference is a frozen copy of the starting model,
forwarded with no grad (TRL's default, `precompute_ref_log_probs=False`): the KL sequences pair examples anew in every
micro-batch, so no table of precomputed reference log-probabilities can hold them.
"""

from __future__ import annotations

import torch

from neox_hf.objectives.base import Objective, ObjectiveLoss, reference_logps_for, sequence_logps
from neox_hf.ops.context_parallel import counts_sequences

METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def kto_losses(logratios: torch.Tensor, kl: torch.Tensor, desirable: torch.Tensor, *, beta: float,
               desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> torch.Tensor:
    """Per-example KTO losses [P] from the log-ratios π − ref, the KL estimate z and the labels (TRL's formula)."""
    chosen = desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl)))
    rejected = undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios)))
    return torch.where(desirable, chosen, rejected)


class KTOObjective(Objective):
    name, unit, metric_names = "kto", "example", METRICS
    rows_per_sample = 2

    @classmethod
    def from_train(cls, train_config) -> "KTOObjective":
        return cls(beta=train_config.kto_beta, desirable_weight=train_config.kto_desirable_weight,
                   undesirable_weight=train_config.kto_undesirable_weight)

    def __init__(self, beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
                 reference_model=None):
        for name, value in (("kto_beta", beta), ("kto_desirable_weight", desirable_weight),
                            ("kto_undesirable_weight", undesirable_weight)):
            if value <= 0:
                raise ValueError(f"train.{name} must be > 0, got {value}")
        self.beta, self.reference_model = beta, reference_model
        self.desirable_weight, self.undesirable_weight = desirable_weight, undesirable_weight

    def units(self, batch: dict) -> torch.Tensor:
        """Examples of the batch; 0 on a context-parallel rank other than its group's first (`counts_sequences`)."""
        return torch.tensor(batch["label"].shape[0] * counts_sequences(batch), device=batch["input_ids"].device)

    def loss(self, model, batch: dict, *, fused: bool = True, z_loss: float = 0.0) -> ObjectiveLoss:
        """z_loss is not applied: it would change the log-probabilities KTO compares (TRL has none either)."""
        logps = sequence_logps(model, batch, fused=fused)[0]
        ref = self._reference(batch, fused)
        n = batch["label"].shape[0]
        desirable = batch["label"].to(device=logps.device, dtype=torch.bool)
        ratio = logps[:n] - ref[:n]
        kl = self._mean_over_ranks((logps[n:] - ref[n:]).mean().detach()).clamp(min=0)
        losses = kto_losses(ratio, kl, desirable, beta=self.beta, desirable_weight=self.desirable_weight,
                            undesirable_weight=self.undesirable_weight)
        with torch.no_grad():
            rewards, policy = self.beta * ratio.detach(), logps[:n].detach()
            chosen, rejected = desirable.sum(), (~desirable).sum()
            means = {"kl": kl,
                     "rewards/chosen": _mean(rewards, desirable), "rewards/rejected": _mean(rewards, ~desirable),
                     "logps/chosen": _mean(policy, desirable), "logps/rejected": _mean(policy, ~desirable)}
            both = (chosen > 0) & (rejected > 0)
            means["rewards/margins"] = torch.where(both, means["rewards/chosen"] - means["rewards/rejected"], 0.0)
        counted = float(counts_sequences(batch))  # context parallelism: the group's first rank reports
        return ObjectiveLoss(loss_sum=losses.sum() * counted, units=self.units(batch),
                             metric_sums={k: (v * n * counted).detach() for k, v in means.items()})

    def _mean_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """`value`'s mean over the data-parallel group in a training step (see the module docstring), else itself."""
        group = self.data_parallel_group
        if group is None or not torch.is_grad_enabled():
            return value
        import torch.distributed as dist

        total = value.clone()
        dist.all_reduce(total, group=group)
        return total / dist.get_world_size(group)

    def _reference(self, batch: dict, fused: bool) -> torch.Tensor:
        # [2P]: the examples', then their KL sequences' (precomputed where neox_hf eval gives them)
        return reference_logps_for(batch, self.reference_model, fused=fused, missing=(
            "a KTO batch needs KTOObjective.reference_model (a frozen copy of the starting model) or `ref_logps`"))


def _mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask`, 0 where it selects none."""
    count = mask.sum()
    return torch.where(count > 0, (values * mask).sum() / count.clamp(min=1), 0.0)
