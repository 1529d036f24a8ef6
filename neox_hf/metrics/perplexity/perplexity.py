"""Perplexity from token losses the caller already computed: an `evaluate` metric that needs no model or Hub.

Gap filled: the Hub's `perplexity` metric downloads a model by id and runs it itself, so it cannot score our own
checkpoints offline, under DeepSpeed, with prompt masking, or reuse the losses the eval loop already has. This
module only aggregates: perplexity = exp(Σ token losses / Σ tokens), token-weighted, so batches of different
sizes (dynamic padding, answer-only masks) combine exactly.

Two input forms, both under the keys `losses` and `token_counts`:
    per-token:  compute(losses=[[0.7, 1.2, ...], [...]])            one list of token losses (nats) per example
    summed:     compute(losses=[31.4, 12.9], token_counts=[20, 9])  summed loss and token count per batch/example

Load it by path, offline: `evaluate.load("neox_hf/metrics/perplexity")`.
"""

import math

import datasets
import evaluate

_DESCRIPTION = "Token-weighted perplexity exp(sum of token losses / number of tokens) from precomputed losses."

_KWARGS_DESCRIPTION = """
Args:
    losses: per example either a list of token cross-entropies (nats), or one summed loss (then give token_counts).
    token_counts: per example the number of tokens its summed loss covers; omit with per-token losses.
Returns:
    perplexity: exp(mean_loss)
    mean_loss: token-weighted mean loss in nats
    tokens: total number of tokens
Examples:
    >>> metric = evaluate.load("neox_hf/metrics/perplexity")
    >>> metric.compute(losses=[3.0, 1.0], token_counts=[2, 2])["mean_loss"]
    1.0
"""

_PER_TOKEN = datasets.Features({"losses": datasets.Sequence(datasets.Value("float64")),
                                "token_counts": datasets.Value("int64")})
_SUMMED = datasets.Features({"losses": datasets.Value("float64"), "token_counts": datasets.Value("int64")})


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Perplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=[_PER_TOKEN, _SUMMED],
        )

    # evaluate needs every feature key in every batch; with per-token losses the counts are the list lengths.
    def add_batch(self, *, losses=None, token_counts=None, **kwargs):
        """Add one batch of losses (see the module docstring for the two forms)."""
        return super().add_batch(losses=losses, token_counts=_counts(losses, token_counts), **kwargs)

    def compute(self, *, losses=None, token_counts=None, **kwargs):
        """Perplexity over everything added so far plus these losses."""
        if losses is None:
            return super().compute(**kwargs)
        return super().compute(losses=losses, token_counts=_counts(losses, token_counts), **kwargs)

    def _compute(self, losses, token_counts):
        total_loss, total_tokens = _totals(losses, token_counts)
        mean_loss = total_loss / total_tokens if total_tokens else float("nan")
        return {"perplexity": _exp(mean_loss), "mean_loss": mean_loss, "tokens": total_tokens}


def _exp(mean_loss: float) -> float:
    """exp that saturates to inf (a diverged model) instead of raising OverflowError; nan stays nan."""
    try:
        return math.exp(mean_loss)
    except OverflowError:
        return float("inf")


def _is_per_token(losses) -> bool:
    return len(losses) > 0 and hasattr(losses[0], "__len__")


def _counts(losses, token_counts):
    if token_counts is not None or losses is None:
        return token_counts
    if not _is_per_token(losses):
        raise ValueError("summed losses need token_counts (one count per loss); or pass lists of per-token losses")
    return [len(row) for row in losses]


def _totals(losses, token_counts) -> tuple[float, int]:
    """(Σ loss, Σ tokens) in float64 over either input form."""
    if _is_per_token(losses):
        if any(len(row) != n for row, n in zip(losses, token_counts)):
            raise ValueError("with per-token losses, token_counts must be the length of each list (or be omitted)")
        return math.fsum(l for row in losses for l in row), int(sum(token_counts))
    return math.fsum(losses), int(sum(token_counts))
