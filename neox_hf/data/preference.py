"""Preference pairs (`train.objective: dpo | rm`): rows of `prompt`, `chosen`, `rejected` strings → batches of pairs;
and unpaired completions (`train.objective: kto`): rows of `prompt`, `completion` strings and a boolean `label`.

Sources are TRL's standard preference format (other column names per source: `prompt_key`, `chosen_key`,
`rejected_key`) in the files `neox_hf.data.sources` reads: jsonl (plain / .gz / .zst, read by its `file_lines`, an
undecodable line counted, never a crash), json, parquet and Hub datasets (through `datasets.load_dataset`).

Tokenised as TRL 1.x does (trl 1.16 `DPOTrainer._prepare_dataset` / `RewardTrainer._prepare_dataset`, plain-text
rows; the tests compare with TRL's own code):
  dpo  EOS (as text) appended to each completion unless it already ends with it; `prompt`, `prompt + chosen` and
       `prompt + rejected` tokenised; the completion starts where the prompt's tokens and the pair's stop agreeing
       (TRL's `common_prefix_length`: a BPE merge across the seam moves the boundary). A sequence longer than
       `max_length` (data.max_length, default seq_length) keeps its start (TRL `truncation_mode="keep_start"`,
       `max_length` equal), and a pair whose prompt alone fills `max_length` is dropped, as TRL does.
  rm   `prompt + chosen + EOS` and `prompt + rejected + EOS` tokenised whole; a pair with a sequence longer than
       `max_length` is dropped (TRL's RewardTrainer filter).
  kto  as dpo for one completion (trl 1.16 `KTOTrainer._prepare_dataset`): EOS appended unless present, `prompt` and
       `prompt + completion` tokenised, the completion starting where they stop agreeing; an example whose prompt
       alone fills `max_length` is dropped, a longer sequence keeps its start.

GPT-NeoX's post-training files (`format: indexed` sources with `rejected_path` / `label_path` /
`rejected_label_path`, or `label_path` / `reward_path` for kto; `neox_hf.data.neox_post_training`) are read already
tokenised: each pair's sequences and labels are its documents' (GPT-NeoX's sample of seq_length + 1 tokens), and
from there batching, order, shards and resume are the same as for rows.

A preference micro-batch of P pairs is one dict of 2P rows (TRL's concatenated forward): rows 0..P-1 the chosen
sequences, rows P..2P-1 the rejected ones, right-padded with the tokenizer's pad id to the longest row rounded up to
`data.pad_to_multiple_of` (dynamic padding; never past max_length):
  input_ids, attention_mask  [2P, T]  the whole sequence
  labels                     [2P, T]  dpo only: aligned as everywhere in neox_hf (position t predicts labels[t]),
                                      only completion tokens labelled, -100 elsewhere (prompt, padding, last position)
  pair_index                 [P]      each pair's stable index in the data set (its row among the usable pairs of
                                      the sources, in file order): the key of precomputed reference log-probs;
                                      a train and an eval loader number their own pairs (one table each)
A pair is never split: its two sequences are rows i and P + i of one batch.

A KTO micro-batch of P examples is 2P rows too: rows 0..P-1 the examples (prompt_i + completion_i), rows P..2P-1
TRL's mismatched KL sequences (prompt_i + completion_{i-1}, the completions rotated by one within the micro-batch,
so the KL set is the batch's own completions, as TRL builds them per batch), `labels` as dpo, `label` [P] bool
(desirable), `pair_index` [P] each example's stable index.

Gap filled: TRL's collators batch map-style datasets through `Trainer`'s sampler; our loop wants an endless,
per-data-parallel-rank, exactly resumable iterator like `neox_hf.data.loader`'s. Pairs are read and tokenised once
(a preference set is small next to a pretraining corpus; TRL tokenises the whole map-style set up front too), and
every rank tokenises all of them so `pair_index` means the same pair everywhere.
"""

from __future__ import annotations

import copy
import json
from typing import Iterator, Optional

import numpy as np
import torch

from neox_hf.data.loader import validation_sources
from neox_hf.data.neox_post_training import LabelledTokens, read_indexed_examples, read_indexed_pairs
from neox_hf.data.padding import IGNORE_INDEX, padded_length
from neox_hf.data.files import is_unicode_text
from neox_hf.data.sources import file_lines, is_held_out, resolve_files, source_format
from neox_hf.data.state import changed_data_setting
from neox_hf.errors import DataError, print_to_stderr
from neox_hf.recipe import DataConfig, DataSource

STATE_VERSION = 1
OBJECTIVES = ("dpo", "rm", "kto")
STAT_KEYS = ("documents", "skipped_empty", "skipped_undecodable", "truncated", "no_answer", "real_tokens",
             "padded_tokens")  # the pad loader's keys (documents = pairs here), so its run-log notes read both


class EmptyPairs(DataError):
    """No usable pair in the sources (for the role asked)."""


# ----------------------------------------------------------------------------------------------------------------
# Reading: raw (prompt, chosen, rejected) strings
# ----------------------------------------------------------------------------------------------------------------


def _raw_rows(source: DataSource, unpaired: bool = False) -> Iterator[Optional[dict]]:
    """The rows of one source as dicts (None for an undecodable jsonl line)."""
    fmt = source_format(source)
    if fmt in ("text", "indexed"):
        what = "KTO examples need rows" if unpaired else "preference pairs need rows"
        raise DataError(f"data source `{source.path}`: {what} with {_columns(source, unpaired)} fields; give a "
                        ".jsonl/.json/.parquet file or a Hub dataset (not .txt), or GPT-NeoX's .bin/.idx files "
                        "(`neox_hf preprocess --chat-template`)")
    if fmt == "jsonl":
        for path in resolve_files(source):
            for line in file_lines(path):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError):
                    yield None
        return
    import datasets

    if fmt == "hub":
        yield from datasets.load_dataset(source.path, split=source.split)
    else:
        builder = "parquet" if fmt == "parquet" else "json"
        files = resolve_files(source)
        try:
            rows = datasets.load_dataset(builder, data_files=files, split="train")
        except (datasets.exceptions.DatasetGenerationError, OSError, ValueError) as exc:
            # pyarrow's ArrowInvalid is a ValueError; a damaged parquet footer surfaces as either, wrapped by datasets
            raise DataError(f"{source.path}: not a readable {builder} file ({type(exc).__name__}); check the file "
                            "(re-export it) or give data.sources[].format") from None
        yield from rows


def pair_texts(source: DataSource, row) -> Optional[tuple[str, str, str]]:
    """(prompt, chosen, rejected) of one row, or None when a field is missing, not a string, or not Unicode text (a
    JSON `\\ud800` escape decodes to a lone surrogate, which the tokenizer cannot take)."""
    if not isinstance(row, dict):
        return None
    texts = tuple(row.get(key) for key in (source.prompt_key, source.chosen_key, source.rejected_key))
    return texts if all(isinstance(text, str) and is_unicode_text(text) for text in texts) else None


def example_texts(source: DataSource, row) -> Optional[tuple[str, str, bool]]:
    """(prompt, completion, label) of one unpaired row (TRL's format), or None when a field is missing, a text is not
    a string or the label is not a boolean (`label_problem` says which)."""
    if not isinstance(row, dict):
        return None
    prompt, completion, label = (row.get(key) for key in (source.prompt_key, source.completion_key, source.label_key))
    ok = isinstance(prompt, str) and isinstance(completion, str) and isinstance(label, bool)
    return (prompt, completion, label) if ok else None


def label_problem(source: DataSource, row) -> Optional[str]:
    """Why an unpaired row with its texts in place is not an example: its `label` missing or not a boolean (TRL's
    KTO format); None when the label is fine."""
    if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in (source.prompt_key,
                                                                                  source.completion_key)):
        return None
    label = row.get(source.label_key)
    if isinstance(label, bool):
        return None
    if source.label_key not in row:
        return f"no `{source.label_key}` field"
    return f"`{source.label_key}` is {type(label).__name__} {label!r}, not true / false"


def _columns(source: DataSource, unpaired: bool) -> str:
    keys = ((source.prompt_key, source.completion_key, source.label_key) if unpaired
            else (source.prompt_key, source.chosen_key, source.rejected_key))
    return f"`{keys[0]}`, `{keys[1]}` and `{keys[2]}`"


def read_pairs(sources: list[DataSource], *, role: str = "all", fraction: float = 0.0,
               stats: Optional[dict] = None, max_skipped_fraction: float = 1.0, unpaired: bool = False) -> list[tuple]:
    """Every usable pair of `sources` (unpaired: every (prompt, completion, label) example), in file order (sources
    one after the other).

    role "train" drops the pairs `fraction` holds out (`data.validation_fraction`, the hash rule of
    `sources.is_held_out` over the pair's texts), "validation" keeps only those, "all" keeps all.
    Rows skipped (invalid JSON, a field missing or not a string, chosen == rejected: a pair that teaches nothing and
    holds the loss at ln 2) are counted in `stats`; above `max_skipped_fraction` of the rows, DataError, as the
    document loader refuses (`data.max_skipped_fraction`)."""
    if not sources:
        raise DataError("data.sources is empty: add at least one `- path: ...` with prompt/chosen/rejected rows")
    stats = stats if stats is not None else {}
    pairs = []
    for source in sources:
        if source.weight != 1.0:
            raise DataError(f"data source `{source.path}`: `weight` {source.weight} is not used for preference pairs "
                            "(sources are read one after the other, each pair once per epoch); drop `weight`")
        if not unpaired and source.chosen_key == source.rejected_key:
            raise DataError(f"data source `{source.path}`: `chosen_key` and `rejected_key` both name "
                            f"`{source.chosen_key}`, so every pair would compare a text with itself (loss ln 2, "
                            "nothing learnt); set `prompt_key` / `chosen_key` / `rejected_key` on the source to its "
                            "column names")
        found = identical = 0
        bad_label = None
        for row in _raw_rows(source, unpaired):
            texts = example_texts(source, row) if unpaired else pair_texts(source, row)
            if texts is None:
                stats["skipped_undecodable"] = stats.get("skipped_undecodable", 0) + 1
                bad_label = bad_label or (label_problem(source, row) if unpaired else None)
                continue
            found += 1
            if not unpaired and texts[1] == texts[2]:
                identical += 1
                continue
            held = is_held_out("\x00".join(map(str, texts)).encode("utf-8", "surrogatepass"), fraction)
            if role == "all" or (role == "validation") == held:
                pairs.append(texts)
        if not found and bad_label:
            raise DataError(f"data source `{source.path}`: KTO's `{source.label_key}` says whether a completion is "
                            f"desirable and must be true or false; the rows have {bad_label} (set `label_key` on the "
                            "source to the boolean column)")
        if not found:
            names = "`prompt_key` / `completion_key` / `label_key`" if unpaired else \
                "`prompt_key` / `chosen_key` / `rejected_key`"
            kinds = "string fields and a boolean" if unpaired else "string fields"
            raise DataError(f"data source `{source.path}` has no row with {kinds} {_columns(source, unpaired)}; set "
                            f"{names} on the source to its column names")
        if identical == found:
            raise DataError(f"data source `{source.path}`: every one of its {found} pairs has `{source.chosen_key}` "
                            f"equal to `{source.rejected_key}` (loss ln 2, nothing learnt); give pairs whose chosen "
                            "and rejected texts differ, or set `prompt_key` / `chosen_key` / `rejected_key` on the "
                            "source to its column names")
        stats["documents_read"] = stats.get("documents_read", 0) + found
        stats["skipped_identical"] = stats.get("skipped_identical", 0) + identical
    _check_skipped_rows(sources, stats, max_skipped_fraction, unpaired)
    return pairs


def _check_skipped_rows(sources: list[DataSource], stats: dict, max_fraction: float, unpaired: bool = False) -> None:
    """DataError when the rows skipped (unreadable, or chosen == rejected) are above `max_fraction` of those read."""
    bad, identical = stats.get("skipped_undecodable", 0), stats.get("skipped_identical", 0)
    read = stats.get("documents_read", 0) + bad
    skipped = bad + identical
    if skipped <= max_fraction * read:
        return
    s = sources[0]
    fields = (f"string fields `{s.prompt_key}`, `{s.completion_key}` and a boolean `{s.label_key}`" if unpaired else
              f"string fields `{s.prompt_key}`, `{s.chosen_key}`, `{s.rejected_key}`")
    raise DataError(f"data sources {[s.path for s in sources]}: {skipped} of {read} rows skipped ({bad} invalid JSON "
                    f"or without {fields}; {identical} with chosen == rejected): {skipped / read:.1%} is above "
                    f"`data.max_skipped_fraction` ({max_fraction:g}); fix the data or the source's keys, or raise "
                    "`data.max_skipped_fraction` to accept it")


# ----------------------------------------------------------------------------------------------------------------
# Tokenising as TRL does
# ----------------------------------------------------------------------------------------------------------------


def _with_eos(text: str, eos: str) -> str:
    return text if text.endswith(eos) else text + eos


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_dpo_pairs(pairs: list[tuple[str, str, str]], tokenizer) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt_ids, chosen_ids, rejected_ids) per pair, as trl 1.16 `DPOTrainer._prepare_dataset` (plain text)."""
    eos = tokenizer.eos_token
    prompts = [p for p, _, _ in pairs]
    chosen = [p + _with_eos(c, eos) for p, c, _ in pairs]
    rejected = [p + _with_eos(r, eos) for p, _, r in pairs]
    # One fast-tokenizer call per list; the same ids as TRL's one call per text (`tokenizer(text=...)`).
    ids = [tokenizer(texts)["input_ids"] if texts else [] for texts in (prompts, chosen, rejected)]
    out = []
    for prompt_ids, pc, pr in zip(*ids):
        n = min(_common_prefix_length(prompt_ids, pc), _common_prefix_length(prompt_ids, pr))
        out.append((list(prompt_ids[:n]), list(pc[n:]), list(pr[n:])))
    return out


def tokenize_rm_pairs(pairs: list[tuple[str, str, str]], tokenizer) -> list[tuple[list[int], list[int]]]:
    """(chosen_ids, rejected_ids) per pair, as trl 1.16 `RewardTrainer._prepare_dataset` with an explicit prompt:
    EOS appended to each completion, then prompt + completion tokenised whole."""
    eos = tokenizer.eos_token
    chosen = tokenizer([p + _with_eos(c, eos) for p, c, _ in pairs])["input_ids"] if pairs else []
    rejected = tokenizer([p + _with_eos(r, eos) for p, _, r in pairs])["input_ids"] if pairs else []
    return [(list(c), list(r)) for c, r in zip(chosen, rejected)]


def tokenize_kto_examples(examples: list[tuple[str, str, bool]], tokenizer) -> list[tuple[list[int], list[int], bool]]:
    """(prompt_ids, completion_ids, label) per example, as trl 1.16 `KTOTrainer._prepare_dataset` (plain text)."""
    eos = tokenizer.eos_token
    prompts = tokenizer([p for p, _, _ in examples])["input_ids"] if examples else []
    whole = tokenizer([p + _with_eos(c, eos) for p, c, _ in examples])["input_ids"] if examples else []
    out = []
    for prompt_ids, ids, (_, _, label) in zip(prompts, whole, examples):
        n = _common_prefix_length(prompt_ids, ids)
        out.append((list(prompt_ids[:n]), list(ids[n:]), label))
    return out


def tokenize_pairs(pairs, tokenizer, objective: str, max_length: int, stats: Optional[dict] = None) -> list[tuple]:
    """The pairs that train, tokenised for `objective`, TRL's length rules applied (see the module docstring).
    dpo: (prompt_ids, chosen_ids, rejected_ids); rm: ((), chosen_ids, rejected_ids); kto (`pairs` are unpaired
    examples): (prompt_ids, completion_ids, label)."""
    stats = stats if stats is not None else {}
    if objective == "kto":
        kept = []
        for prompt, completion, label in tokenize_kto_examples(pairs, tokenizer):
            if len(prompt) >= max_length:
                stats["skipped_empty"] = stats.get("skipped_empty", 0) + 1  # TRL drops it: no completion token left
                continue
            kept.append((prompt, completion, label))
        return kept
    if objective == "dpo":
        kept = []
        for prompt, c, r in tokenize_dpo_pairs(pairs, tokenizer):
            if len(prompt) >= max_length:
                stats["skipped_empty"] = stats.get("skipped_empty", 0) + 1  # its completions would be cut off whole
                continue
            kept.append((prompt, c, r))
        return kept
    if objective == "rm":
        kept = []
        for c, r in tokenize_rm_pairs(pairs, tokenizer):
            if len(c) > max_length or len(r) > max_length:
                stats["truncated"] = stats.get("truncated", 0) + 1  # dropped, as TRL's RewardTrainer filters them
                continue
            kept.append(((), c, r))
        return kept
    raise DataError(f"preference pairs are for train.objective dpo, rm or kto, not {objective!r}")


# ----------------------------------------------------------------------------------------------------------------
# Batches of pairs
# ----------------------------------------------------------------------------------------------------------------


def _sequence(prompt, completion, max_length: int, labelled: bool) -> tuple[np.ndarray, np.ndarray]:
    """(ids, labels) of prompt + completion cut to max_length (keep_start); labels[t] = ids[t + 1] where that token is
    part of the completion. A `LabelledTokens` completion (GPT-NeoX's label document) gives its own targets, and a
    sequence cut at max_length keeps the label of token max_length (GPT-NeoX's sample of seq_length + 1)."""
    if isinstance(completion, LabelledTokens):
        return _labelled_sequence(prompt, completion, max_length, labelled)
    ids = np.asarray(list(prompt) + list(completion), dtype=np.int64)[:max_length]
    labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
    if labelled:
        start = max(len(prompt) - 1, 0)  # the position that predicts the completion's first token
        labels[start: len(ids) - 1] = ids[start + 1:]
    return ids, labels


def _labelled_sequence(prompt, completion: LabelledTokens, max_length: int,
                       labelled: bool) -> tuple[np.ndarray, np.ndarray]:
    ids = np.concatenate([np.asarray(prompt, dtype=np.int64), completion.ids])
    targets = np.concatenate([np.full(len(prompt), IGNORE_INDEX, dtype=np.int64), completion.targets])
    n = min(len(ids), max_length)
    labels = np.full(n, IGNORE_INDEX, dtype=np.int64)
    if labelled:
        shifted = targets[1: n + 1]
        labels[: len(shifted)] = shifted
    return ids[:n], labels


def pad_pairs(pairs: list[tuple], pair_index: list[int], *, pad_id: int, multiple: int, max_length: int,
              labelled: bool) -> dict[str, torch.Tensor]:
    """One micro-batch of P tokenised pairs: 2P rows, chosen first, right padding (see the module docstring)."""
    rows = [_sequence(p, c, max_length, labelled) for p, c, _ in pairs]
    rows += [_sequence(p, r, max_length, labelled) for p, _, r in pairs]
    width = padded_length(max(len(ids) for ids, _ in rows), multiple, max_length)
    input_ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
    attention = np.zeros((len(rows), width), dtype=np.int64)
    for i, (ids, targets) in enumerate(rows):
        input_ids[i, : len(ids)], labels[i, : len(ids)], attention[i, : len(ids)] = ids, targets, 1
    batch = {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(attention),
             "pair_index": torch.tensor(pair_index, dtype=torch.int64)}
    if labelled:
        batch["labels"] = torch.from_numpy(labels)
    return batch


def pad_unpaired(examples: list[tuple], example_index: list[int], *, pad_id: int, multiple: int,
                 max_length: int) -> dict[str, torch.Tensor]:
    """One KTO micro-batch of P tokenised examples: the P sequences, then their P KL sequences (prompt i with
    completion i − 1, rotated within the batch as TRL's `add_kl_completion_ids`), plus `label` (see the module
    docstring)."""
    completions = [c for _, c, _ in examples]
    rotated = completions[-1:] + completions[:-1]
    # pad_pairs' (prompt, first, second) rows: the example's sequence first, its KL sequence second
    batch = pad_pairs([(p, c, kl) for (p, c, _), kl in zip(examples, rotated)], example_index, pad_id=pad_id,
                      multiple=multiple, max_length=max_length, labelled=True)
    batch["label"] = torch.tensor([label for _, _, label in examples], dtype=torch.bool)
    return batch


class PreferenceLoader:
    """Endless (train) or one-pass (eval) iterator of preference micro-batches for one data-parallel rank, with the
    pad loader's `state_dict()` / `load_state_dict()` / `stats` / `describe()`.

    Train order: epoch e is a permutation of all pairs seeded by (seed, e); the epochs follow one another as one
    stream, cut into global windows of `dp_size × P` pairs, of which rank r takes the r-th P. Every rank gets the same
    number of micro-batches (equal forward counts for ZeRO-3), no pair is dropped at an epoch's end (a window may span
    two epochs), and the position is one integer (the micro-batches emitted), so resume is exact by construction.
    Eval order: the pairs in file order, the same windows, one pass; the last window's micro-batches may hold fewer
    pairs, and a rank may get one micro-batch fewer than another.
    """

    def __init__(self, data_cfg: DataConfig, tokenizer, sources: list[DataSource], *, objective: str, seq_length: int,
                 micro_batch_size: int, dp_rank: int, dp_size: int, seed: int, role: str, cycle: bool):
        if objective not in OBJECTIVES:
            raise DataError(f"preference pairs are for train.objective dpo, rm or kto, not {objective!r}")
        if micro_batch_size < 1:
            raise DataError(f"micro_batch_size must be ≥ 1 pair, got {micro_batch_size}")
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank {dp_rank} is outside dp_size {dp_size}: pass the data-parallel rank and size")
        if tokenizer.pad_token_id is None or tokenizer.eos_token is None:
            raise DataError("preference pairs need a tokenizer with pad and eos tokens; set tokenizer.pad_token "
                            "('<|padding|>') and tokenizer.eos_token ('<|endoftext|>')")
        self.cfg, self.objective, self.sources = data_cfg, objective, list(sources)
        self.batch_size, self.dp_rank, self.dp_size, self.seed, self.cycle = micro_batch_size, dp_rank, dp_size, seed, cycle
        self.max_length = data_cfg.max_length or seq_length
        self.shuffle = data_cfg.shuffle and cycle
        self.pad_id = tokenizer.pad_token_id
        self.read_stats = dict.fromkeys(STAT_KEYS, 0)
        if _indexed_sources(self.sources):
            texts = self.pairs = _read_indexed(self.sources, objective, self.max_length, data_cfg.allow_chopped, role,
                                               data_cfg.validation_fraction, self.read_stats)
        else:
            texts = read_pairs(self.sources, role=role, fraction=data_cfg.validation_fraction, stats=self.read_stats,
                               max_skipped_fraction=data_cfg.max_skipped_fraction, unpaired=objective == "kto")
            self.pairs = tokenize_pairs(texts, tokenizer, objective, self.max_length, self.read_stats)
        if not self.pairs:
            raise EmptyPairs(f"data sources {[s.path for s in self.sources]}: no usable preference pair "
                            f"({len(texts)} read for {role!r}; {self.read_stats['skipped_undecodable']} undecodable, "
                            f"{self.read_stats['skipped_empty'] + self.read_stats['truncated']} longer than max_length "
                            f"{self.max_length}); raise data.max_length or check the files")
        self._emitted = 0
        self.stats = dict.fromkeys(STAT_KEYS, 0)
        if objective == "kto" and cycle and _first_process():
            _warn_one_sided(self.pairs, self.sources)

    @property
    def num_pairs(self) -> int:
        return len(self.pairs)

    # -- iteration --------------------------------------------------------------------------------------------

    def __iter__(self) -> "PreferenceLoader":
        return self

    def __next__(self) -> dict:
        indices = self._batch_indices(self._emitted)
        if not indices:
            raise StopIteration
        self._emitted += 1
        batch = self.batch_of(indices)
        real = int(batch["attention_mask"].sum())
        self.stats["documents"] += len(indices)
        self.stats["real_tokens"] += real
        self.stats["padded_tokens"] += batch["input_ids"].numel() - real
        return batch

    def batch_of(self, indices: list[int]) -> dict:
        """The micro-batch of the pairs `indices` (their `pair_index` values)."""
        if self.objective == "kto":
            return pad_unpaired([self.pairs[i] for i in indices], indices, pad_id=self.pad_id,
                                multiple=self.cfg.pad_to_multiple_of, max_length=self.max_length)
        return pad_pairs([self.pairs[i] for i in indices], indices, pad_id=self.pad_id,
                         multiple=self.cfg.pad_to_multiple_of, max_length=self.max_length,
                         labelled=self.objective == "dpo")

    def _batch_indices(self, k: int) -> list[int]:
        """The pair indices of this rank's k-th micro-batch."""
        n, p = len(self.pairs), self.batch_size
        start = (k * self.dp_size + self.dp_rank) * p
        if not self.cycle:
            return list(range(min(start, n), min(start + p, n)))
        return [self._pair_at(q, n) for q in range(start, start + p)]

    def _pair_at(self, q: int, n: int) -> int:
        epoch, offset = divmod(q, n)
        if not self.shuffle:
            return offset
        if getattr(self, "_perm_epoch", None) != epoch:
            self._perm, self._perm_epoch = np.random.default_rng([self.seed, epoch]).permutation(n), epoch
        return int(self._perm[offset])

    def reference_batches(self) -> list[dict]:
        """This rank's share of every pair (pairs i ≡ dp_rank mod dp_size, in order), P per micro-batch, for
        precomputing reference log-probabilities: every rank gets the same number of micro-batches of P pairs (a
        rank with fewer pairs repeats its last one), so ZeRO-3's collective forwards line up. The union over ranks
        is every pair; the training stream of a rank draws from all of them (merge the ranks' tables)."""
        mine = list(range(self.dp_rank, len(self.pairs), self.dp_size))
        per_rank = -(-len(self.pairs) // self.dp_size)
        count = -(-per_rank // self.batch_size) * self.batch_size
        mine = (mine or [0]) + [mine[-1] if mine else 0] * (count - len(mine))
        return [self.batch_of(mine[i: i + self.batch_size]) for i in range(0, count, self.batch_size)]

    # -- position ---------------------------------------------------------------------------------------------

    def _fingerprint(self) -> dict:
        return {"objective": self.objective, "micro_batch_size": self.batch_size, "dp_rank": self.dp_rank,
                "dp_size": self.dp_size, "seed": self.seed, "pairs": len(self.pairs), "max_length": self.max_length,
                "sources": [s.path for s in self.sources]}

    def state_dict(self) -> dict:
        return copy.deepcopy({"version": STATE_VERSION, "fingerprint": self._fingerprint(), "emitted": self._emitted,
                              "stats": self.stats})

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION or "emitted" not in state:
            raise DataError(f"preference loader state version {state.get('version')} is not {STATE_VERSION}; this "
                            "checkpoint's data position cannot be resumed by this version of neox_hf")
        changed = changed_data_setting(state.get("fingerprint") or {}, self._fingerprint())
        if changed:
            raise DataError(changed)
        self._emitted = int(state["emitted"])
        self.stats = {**dict.fromkeys(STAT_KEYS, 0), **state.get("stats", {})}

    def describe(self) -> str:
        dropped = self.read_stats["skipped_empty"] + self.read_stats["truncated"]
        note = f", {dropped} dropped as longer than max_length {self.max_length}" if dropped else ""
        if _indexed_sources(self.sources):  # GPT-NeoX's two reasons, apart
            long, empty = self.read_stats["truncated"], self.read_stats["skipped_empty"]
            note = (f", {long} dropped as longer than max_length + 1 = {self.max_length + 1} (allow_chopped: false)"
                    if long else "") + (f", {empty} skipped with no labelled token" if empty else "")
        bad = self.read_stats["skipped_undecodable"]
        note += f", {bad} rows without the pair's string fields skipped" if bad else ""
        same = self.read_stats.get("skipped_identical", 0)
        note += f", {same} pairs with chosen == rejected skipped" if same else ""
        zero = self.read_stats.get("reward_zero", 0)
        note += f", {zero} with reward 0 skipped (GPT-NeoX gives them no loss)" if zero else ""
        order = "shuffled each epoch" if self.shuffle else "in file order"
        if self.objective == "kto":
            desirable = sum(1 for _, _, label in self.pairs if label)
            return (f"unpaired completions (kto): {len(self.pairs):,} examples ({desirable:,} desirable){note}; "
                    f"{self.batch_size} examples (+ their KL sequences) per micro-batch, "
                    f"{'shuffled each epoch' if self.shuffle else 'in file order'}, padded to multiples of "
                    f"{self.cfg.pad_to_multiple_of}")
        return (f"preference pairs ({self.objective}): {len(self.pairs):,} pairs{note}; {self.batch_size} pairs "
                f"({2 * self.batch_size} sequences) per micro-batch, {order}, padded to multiples of "
                f"{self.cfg.pad_to_multiple_of}")


def _indexed_sources(sources: list[DataSource]) -> bool:
    """True when the sources are GPT-NeoX post-training .bin/.idx prefixes; DataError when they mix with rows."""
    kinds = {source_format(s) == "indexed" for s in sources}
    if len(kinds) > 1:
        raise DataError("data sources mix GPT-NeoX .bin/.idx prefixes with jsonl/parquet/Hub rows: preference data "
                        "comes from one kind; tokenize the rows with `neox_hf preprocess --chat-template` or give "
                        "rows only")
    return kinds == {True}


def _read_indexed(sources, objective: str, max_length: int, allow_chopped: bool, role: str, fraction: float,
                  stats: dict) -> list[tuple]:
    items = []
    for source in sources:
        if source.weight != 1.0:
            raise DataError(f"data source `{source.path}`: `weight` {source.weight} is not used for preference pairs "
                            "(sources are read one after the other, each pair once per epoch); drop `weight`")
        if objective == "kto":
            items += read_indexed_examples(source, max_length=max_length, allow_chopped=allow_chopped, role=role,
                                           fraction=fraction, stats=stats)
        else:
            items += read_indexed_pairs(source, objective=objective, max_length=max_length,
                                        allow_chopped=allow_chopped, role=role, fraction=fraction, stats=stats)
    return items


def _first_process() -> bool:
    """The launch's first process (or no launch): where a start-up warning is printed once."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _warn_one_sided(examples: list[tuple], sources: list[DataSource]) -> None:
    """One line when every KTO example is desirable (or every one undesirable): the loss then only pushes one way
    and the other weight (kto_undesirable_weight / kto_desirable_weight) does nothing."""
    labels = {label for _, _, label in examples}
    if len(labels) != 1:
        return
    side, key = ("desirable", "true") if labels == {True} else ("undesirable", "false")
    print_to_stderr(f"warning: every one of the {len(examples):,} KTO examples of "
                    f"{', '.join(s.path for s in sources)} is {side} (`{sources[0].label_key}` / reward all {key}): "
                    "the loss pushes one way only; add examples of the other kind")


# ----------------------------------------------------------------------------------------------------------------
# The contract the train loop uses (argument names of `loader.build_train_loader` / `build_eval_loader`)
# ----------------------------------------------------------------------------------------------------------------


def build_preference_train_loader(data_cfg: DataConfig, tokenizer, *, seq_length: int, micro_batch_size: int,
                                  dp_rank: int = 0, dp_size: int = 1, seed: int = 1234, objective: str = "dpo",
                                  **_unused) -> PreferenceLoader:
    """Endless micro-batches of `micro_batch_size` pairs for this data-parallel rank (see `PreferenceLoader`).
    With tensor parallelism pass the DP rank. Keyword arguments of `build_train_loader` that only concern token
    streams (gradient_accumulation_steps, train_iters, eval_*, start_step) are accepted and unused."""
    if not data_cfg.sources:
        raise DataError("data.sources is empty: add at least one `- path: ...` with prompt/chosen/rejected rows")
    role = "train" if data_cfg.validation_fraction > 0 and not data_cfg.validation else "all"
    return PreferenceLoader(data_cfg, tokenizer, data_cfg.sources, objective=objective, seq_length=seq_length,
                            micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_size=dp_size, seed=seed, role=role,
                            cycle=True)


def build_preference_eval_loader(data_cfg: DataConfig, tokenizer, *, seq_length: int, micro_batch_size: int,
                                 max_batches: int, dp_rank: int = 0, dp_size: int = 1, objective: str = "dpo",
                                 **_unused) -> list[dict]:
    """At most `max_batches` validation micro-batches of pairs in file order: from `data.validation`, else the pairs
    `validation_fraction` holds out of `data.sources`; [] when there are none."""
    held_out = validation_sources(data_cfg)
    if held_out is None:
        return []
    sources, role = held_out
    try:
        loader = PreferenceLoader(data_cfg, tokenizer, sources, objective=objective, seq_length=seq_length,
                                  micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                                  seed=data_cfg.seed, role=role, cycle=False)
    except EmptyPairs:
        if role == "validation":  # a small data set may hold no pair out: no validation, as for documents
            return []
        raise
    batches = []
    for batch in loader:
        if len(batches) >= max_batches:
            break
        batches.append(batch)
    return batches
