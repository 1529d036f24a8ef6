"""What a preference objective needs around the training loop: its data, DPO's reference log-probabilities, and the
frozen reference DPO (`frozen`) and KTO keep beside the trained model.

The reference of `train.dpo_reference: precompute` (the default) is the starting model itself: every pair's
(chosen, rejected) log-probabilities are computed once, in eval mode, right after the model is parallelized and
before a checkpoint is loaded — so a resumed run recomputes exactly the same table from `model.from_pretrained`
instead of storing it. Each data-parallel rank computes its share of the pairs (the loader's `reference_batches`,
equal counts on every rank for ZeRO-3's collective forwards); the ranks' tables are summed. `frozen` keeps a frozen
copy of the starting model beside the trained one instead (one process or ZeRO-1/2 without tensor parallelism),
as TRL does without `precompute_ref_log_probs`.
Gap filled: TRL computes references only inside its `Trainer`; GPT-NeoX's `precompute_model_name` needs a separate
preprocessing run.
"""

from __future__ import annotations

import copy

import torch

from neox_hf.errors import RecipeError
from neox_hf.train.guards import check_reference_before_build
from neox_hf.parallel.layout import dp_sum


def build_data(recipe, tokenizer, layout, data_args: dict):
    """(train loader, eval batches) of the recipe's objective."""
    from neox_hf.data import build_eval_loader, build_train_loader

    if recipe.train.objective == "lm":
        return (build_train_loader(recipe.data, tokenizer, seed=recipe.data.seed, **data_args),
                build_eval_loader(recipe.data, tokenizer, max_batches=recipe.train.eval_iters, **data_args))
    from neox_hf.data.preference import build_preference_eval_loader, build_preference_train_loader

    objective = recipe.train.objective
    return (build_preference_train_loader(recipe.data, tokenizer, seed=recipe.data.seed, objective=objective,
                                          **data_args),
            build_preference_eval_loader(recipe.data, tokenizer, max_batches=recipe.train.eval_iters,
                                         objective=objective, **data_args))


def frozen_reference(recipe, model, layout, device):
    """The frozen reference of DPO (`train.dpo_reference: frozen`) and of KTO (always: its KL sequences pair examples
    anew in every micro-batch, so no precomputed table holds them): a copy of the starting model, before it is
    wrapped."""
    kto = recipe.train.objective == "kto"
    if not kto and (recipe.train.objective != "dpo" or recipe.train.dpo_reference != "frozen"):
        return None
    check_reference_before_build(recipe)  # refused before the build already; kept for callers that skip it
    reference = copy.deepcopy(model).to(device).eval()
    reference.requires_grad_(False)
    return reference


def with_reference_logps(engine, loader, eval_batches: list[dict]):
    """(loader, eval batches) whose DPO batches carry `ref_logps` from the starting model (a precomputed table), or
    unchanged for other objectives and a frozen reference. Collective over every rank."""
    recipe = engine.recipe
    if recipe.train.objective != "dpo" or recipe.train.dpo_reference != "precompute":
        return loader, eval_batches
    if recipe.train.dpo_reference_model and recipe.train.dpo_reference_model != recipe.model.from_pretrained:
        raise RecipeError("`train.dpo_reference_model` differing from `model.from_pretrained` is not supported yet: "
                          "the reference is the starting model; set `model.from_pretrained` to the reference (SFT) "
                          "folder")
    from neox_hf.objectives.dpo import attach_reference_logps

    batches = loader.reference_batches()
    table = _reference_table(engine, batches, loader.num_pairs)
    eval_table = _eval_reference_table(engine, eval_batches, filler=batches[0])
    eval_batches = [attach_reference_logps(b, eval_table) for b in eval_batches]
    return _WithReference(loader, table), eval_batches


def _reference_table(engine, batches: list[dict], num_pairs: int) -> torch.Tensor:
    from neox_hf.objectives.dpo import reference_logps

    device = engine.accelerator.device
    with engine.accelerator.autocast():
        table = reference_logps(engine.model, engine.local_chunks([_on(b, device) for b in batches]), num_pairs=num_pairs,
                                fused=engine.recipe.train.fused_cross_entropy)
    return dp_sum(engine.layout, torch.nan_to_num(table).to(device)).cpu()


def _eval_reference_table(engine, eval_batches: list[dict], filler: dict) -> torch.Tensor:
    """The eval pairs' table. A rank may hold fewer eval batches than another: it forwards `filler` (a train batch,
    result discarded) as often as needed, so ZeRO-3's collective forwards line up."""
    from neox_hf.objectives.dpo import sequence_logps

    most = _dp_max(engine, len(eval_batches))
    num_pairs = _dp_max(engine, 1 + max((int(b["pair_index"].max()) for b in eval_batches), default=-1))
    table = _reference_table(engine, eval_batches, num_pairs)
    model, device = engine.model, engine.accelerator.device
    with torch.no_grad(), engine.accelerator.autocast():
        model.eval()
        for _ in range(most - len(eval_batches)):
            sequence_logps(model, engine.local_chunks([_on(filler, device)])[0],
                           fused=engine.recipe.train.fused_cross_entropy)
        model.train()
    return table


def _dp_max(engine, value: int) -> int:
    tensor = torch.tensor([value], device=engine.accelerator.device)
    if engine.layout.dp > 1:
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=engine.layout.dp_group)
    return int(tensor)


def _on(batch: dict, device) -> dict:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


class _WithReference:
    """The train loader, each batch with its pairs' `ref_logps`; position, stats and description its own."""

    def __init__(self, loader, table: torch.Tensor):
        self.loader, self.table = loader, table

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        from neox_hf.objectives.dpo import attach_reference_logps

        return attach_reference_logps(next(self.loader), self.table)

    def __getattr__(self, name):
        return getattr(self.loader, name)
