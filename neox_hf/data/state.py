"""What a data loader's saved position holds that both the loader and its resize (`data/resize.py`, continuing
the old data-parallel ranks' positions on a new layout) read: the state's version and the per-run stats counters."""

from __future__ import annotations

STATE_VERSION = 1
STAT_KEYS = ("documents", "skipped_empty", "skipped_undecodable", "truncated", "no_answer", "real_tokens",
             "padded_tokens")


def empty_stats() -> dict:
    return {key: 0 for key in STAT_KEYS}


# The setting behind each key of a loader's fingerprint (what its saved position is valid for), as the user writes it.
_SETTINGS = {
    "objective": "train.objective", "order": "data.order", "mode": "data.mode", "seq_length": "model.seq_length",
    "micro_batch_size": "train.micro_batch_size", "accumulation": "train.gradient_accumulation_steps",
    "isolate_documents": "data.isolate_documents", "max_tokens_per_batch": "data.max_tokens_per_batch",
    "buffer_size": "data.buffer_size", "seed": "data.seed", "split": "data.split", "pack_impl": "data.pack_impl",
    "train_iters": "train.train_iters", "max_length": "data.max_length", "sources": "data.sources",
}
# What a fingerprint without the key means: a streamed (non-pair) loader trains the causal-LM objective.
_IMPLIED = {"objective": "lm", "order": "stream"}
_FIRST = ("objective", "order")  # other loaders' keys follow from these: name the cause, not a symptom


def changed_data_setting(saved: dict, current: dict, skip: tuple[str, ...] = ()) -> str | None:
    """One line naming the first data setting that differs between a checkpoint's data position (`saved`
    fingerprint) and this run's loader (`current`), both values and the fix; None when none differs. Replaces printing
    both fingerprints to be compared by eye."""
    keys = [k for k in _FIRST if k in saved or k in current]
    keys += [k for k in [*saved, *current] if k not in keys and k not in skip]
    for key in dict.fromkeys(keys):
        old, new = saved.get(key, _IMPLIED.get(key)), current.get(key, _IMPLIED.get(key))
        if old == new:
            continue
        setting = _SETTINGS.get(key)
        restart = "or start a new run (another output.dir, or --overwrite to replace this one)"
        if key == "pairs":
            return (f"the checkpoint's data position was saved over {old} preference pairs and data.sources now "
                    f"give {new}: resume with the files it was trained on, {restart}")
        if setting is None:
            return (f"the checkpoint's data position was saved with data setting `{key}: {_shown(old)}` and this run "
                    f"has `{key}: {_shown(new)}`: resume with the settings it was trained with, {restart}")
        fix = ("resume with the data.sources it was trained on" if key == "sources"
               else f"resume with `--{setting} {_shown(old)}`")
        return (f"the checkpoint's data position was saved with `{setting}: {_shown(old)}` and this run has "
                f"`{setting}: {_shown(new)}`: {fix} (the setting it was trained with), {restart}")
    return None


def _shown(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
