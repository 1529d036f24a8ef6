"""The train and eval loaders: documents → buffers → batches, infinite over epochs, resumable exactly.

How resume is exact: batches are made buffer by buffer ("chunks" of `buffer_size` documents). The state is
taken at the start of the current chunk: the upstream position (`IterableDataset.state_dict()`, exact
because nothing upstream of us buffers: no `datasets` shuffle buffer is used, shuffling happens in our
chunks with RNGs seeded by (seed, chunk index)), the examples or tokens carried over from the previous
chunk, the stats so far and the number of batches of this chunk already emitted. `load_state_dict` rebuilds
the chunk from that position, which is deterministic, and skips the emitted batches — at most one
buffer of work, independent of how far into the epoch training is. On another number of data-parallel ranks
`load_resized_states` takes every old rank's state and deals the rest of their pass out (`resize`).

Gap filled: `datasets`' state_dict loses shuffle-buffer contents, and torchdata's StatefulDataLoader
restores worker iterators but not a length-bucketing buffer; neither packs.
"""

from __future__ import annotations

import copy
from itertools import islice
from typing import Iterator, Optional

import numpy as np

from neox_hf.data import packing, padding
from neox_hf.data.packing import TokenStream
from neox_hf.data.sources import check_sources, document_stream, resolve_files, rows_naming_damaged_files, \
    source_format
from neox_hf.data.state import STATE_VERSION, changed_data_setting, empty_stats
from neox_hf.errors import DataError
from neox_hf.recipe import DataConfig

PROBE_DOCUMENTS = 1000  # a source whose first this many documents on a rank all fail is refused mid-epoch
TALLY_KEYS = ("rows", "usable", "answered", "no_answer", "empty", "undecodable", "split")


class _DocumentReader:
    """This rank's usable documents, epoch after epoch (or one epoch when `cycle` is False), counting skips.

    Also per source (`tallies`): a blended source that gives no usable document is refused by name, at the end of
    an epoch or after its first PROBE_DOCUMENTS rows here, whichever comes first; `interleave_datasets` would
    otherwise fill its share from the others and the blend's weights would silently not be met. Counts are
    cumulative over epochs (a source's files are the same every epoch) and part of the resume position.

    Prompt-masked documents (`prompt_template`) whose text is all prompt have no answer token. With EOD appended
    the EOD is still learned (stop after this prompt), which a dataset may mean for a few rows: kept, counted in
    `stats["no_answer"]` for the run log. Without EOD such a document has no labelled token at all: skipped as
    empty. A source none of whose documents has an answer is refused like an unusable one: training on it learns
    nothing (loss 0 over zero tokens, NaN evaluation) or only to emit EOD, which is always a template mistake."""

    def __init__(self, make_stream, *, epoch: int, upstream: Optional[dict], usable_in_epoch: int, stats: dict,
                 cycle: bool, sources: list, role: str, dp_size: int, append_eod: bool, tallies: Optional[list] = None):
        self._make_stream, self._cycle, self.stats = make_stream, cycle, stats
        self._sources, self._role, self._dp_size, self._eod = sources, role, dp_size, int(append_eod)
        self.epoch, self.usable_in_epoch, self.exhausted = epoch, usable_in_epoch, False
        self.tallies = copy.deepcopy(tallies) if tallies else [dict.fromkeys(TALLY_KEYS, 0) for _ in sources]
        self._open(upstream)

    def _open(self, upstream: Optional[dict]) -> None:
        self._stream = self._make_stream(self.epoch)
        if upstream is not None:
            self._stream.load_state_dict(upstream)
        self._rows = rows_naming_damaged_files(self._stream, self._sources)
        # `IterableDataset.state_dict()` says "start of the epoch" until the first row after `load_state_dict` is
        # pulled: until then the position is the one this stream was opened at
        self._opened_at, self._fresh = copy.deepcopy(upstream), True

    def position(self) -> dict:
        """Where the next document comes from (None upstream = the start of the epoch)."""
        upstream = copy.deepcopy(self._opened_at if self._fresh else self._stream.state_dict())
        return {"epoch": self.epoch, "upstream": upstream, "usable_in_epoch": self.usable_in_epoch,
                "tallies": copy.deepcopy(self.tallies)}

    def take(self, n: int, max_tokens: float = float("inf"),
             cut_at: Optional[int] = None) -> list[tuple[list[int], int]]:
        """Usable (ids, prompt_length) documents, each cut to `cut_at` tokens if given (counted as truncated): n of
        them, or fewer once they hold `max_tokens` tokens, at the end of a pass over the data (a small corpus is not
        read again to fill one buffer), or at the end of a finite stream (then `exhausted`)."""
        docs: list[tuple[list[int], int]] = []
        tokens = 0
        while len(docs) < n and tokens < max_tokens:
            row = next(self._rows, None)
            if row is None:
                if not self._next_epoch():
                    self.exhausted = True
                    break
                if docs:
                    break
                continue
            self._fresh = False
            usable = self._count(row)
            tally = self.tallies[row["source"]]
            if tally["answered"] == 0 and self._counted(tally) >= PROBE_DOCUMENTS:
                self._refuse(row["source"], f"its first {self._counted(tally)} documents")
            if usable:
                ids = row["input_ids"]
                if cut_at is not None and len(ids) > cut_at:
                    self.stats["truncated"] += 1
                    ids = ids[:cut_at]
                docs.append((ids, row["prompt_length"]))
                tokens += len(ids)
        return docs

    def _count(self, row: dict) -> bool:
        """Count the row in `stats` and its source's tally; whether it is a usable document."""
        tally, skip = self.tallies[row["source"]], row["skip"]
        tally["rows"] += 1
        if skip == "" and self._sources[row["source"]].prompt_template is not None and \
                len(row["input_ids"]) - row["prompt_length"] <= self._eod:
            tally["no_answer"] += 1
            if not self._eod:  # not one labelled token
                self.stats["skipped_empty"] += 1
                return False
            self.stats["no_answer"] += 1
        elif skip == "":
            tally["answered"] += 1
        if skip == "":
            self.stats["documents"] += 1
            self.usable_in_epoch += 1
            tally["usable"] += 1
            return True
        if skip in ("empty", "undecodable"):
            self.stats[f"skipped_{skip}"] += 1
            tally[skip] += 1
        else:
            tally["split"] += 1
        return False

    def _next_epoch(self) -> bool:
        self._check_sources_gave_documents()
        if self.usable_in_epoch == 0:
            if not self._cycle:
                return False
            sources = [s.path for s in self._sources]
            raise DataError(f"data sources {sources}: a whole epoch gave this rank no usable document "
                            f"({self.stats['skipped_empty']} empty, {self.stats['skipped_undecodable']} undecodable "
                            "so far); check `text_key` / `template` field names, the paths, and that there are at "
                            "least as many documents as data-parallel ranks")
        if not self._cycle:
            return False
        self.epoch, self.usable_in_epoch = self.epoch + 1, 0
        self._open(None)
        return True

    def _counted(self, tally: dict) -> int:
        """Rows that could have been usable here: for the validation role, documents kept for training do not count."""
        return tally["rows"] - tally["split"] if self._role == "validation" else tally["rows"]

    def _check_sources_gave_documents(self) -> None:
        """At the end of a pass: every source gave this rank a usable document. A source that gave this rank no row
        at all is only known to be empty with one data-parallel rank (with several, its few rows may all have gone
        to other ranks); the validation role expects most rows to be held for training."""
        for index, tally in enumerate(self.tallies):
            alone = self._dp_size == 1 and self._role != "validation"
            if tally["answered"] == 0 and (self._counted(tally) > 0 or alone):
                self._refuse(index, "a whole epoch")

    def _refuse(self, index: int, span: str) -> None:
        t, path = self.tallies[index], self._sources[index].path
        held = f", {t['split']} held out for validation by `validation_fraction`" if t["split"] else ""
        if t["no_answer"]:
            learned = "only EOD would be learned" if self._eod else "not one token would be learned"
            raise DataError(f"data source `{path}` gave no document with answer tokens in {span} ({t['no_answer']} "
                            f"whose text is all prompt, {t['empty']} empty, {t['undecodable']} undecodable{held}): "
                            f"{learned}; check `template` / `prompt_template`: the template must go on past the prompt "
                            "with the answer field, and that field must not be empty")
        raise DataError(f"data source `{path}` gave no usable document in {span} "
                        f"({t['empty']} empty, {t['undecodable']} undecodable{held}); check `text_key` / `template` "
                        "field names and the file, or drop the source (a blend would fill its weight from the others)")


class DataLoader:
    """Iterator of batches (dicts of int64 tensors) with `state_dict()` / `load_state_dict()` and `stats`.

    mode "pad": examples whole, bucketed by length inside each chunk (see `padding`), a fixed micro batch or
    a token budget. mode "pack": GPT-NeoX windows (see `packing`). A chunk is `buffer_size` documents, fewer at
    the end of a pass over the data, and in pack mode fewer once they hold `buffer_size` windows of seq_length + 1
    tokens; pad mode cuts each document to max_length + 1 tokens as it is read. Without those bounds a corpus of
    huge documents was read over and over to fill one chunk and held whole (a 1 MB document: 1,000 times, minutes
    and gigabytes before the first batch).
    """

    def __init__(self, data_cfg: DataConfig, tokenizer, *, seq_length: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, seed: int, role: str, cycle: bool, sources=None):
        self.cfg, self.tokenizer, self.seq_length, self.batch_size = data_cfg, tokenizer, seq_length, micro_batch_size
        self.dp_rank, self.dp_size, self.seed, self.role, self.cycle = dp_rank, dp_size, seed, role, cycle
        self.sources = list(data_cfg.sources if sources is None else sources)
        self.max_length = data_cfg.max_length or seq_length
        self._chunk_limits = ({"max_tokens": data_cfg.buffer_size * (seq_length + 1)} if data_cfg.mode == "pack" else
                              {"cut_at": self.max_length + 1})
        self.shuffle = data_cfg.shuffle and cycle  # eval batches are the stream in order
        _check_batching(data_cfg, tokenizer, self.max_length, micro_batch_size, seq_length)
        self._position = {"epoch": 0, "upstream": None, "usable_in_epoch": 0, "chunk_index": 0,
                          "carry": None, "stats": empty_stats()}
        self._emitted = 0
        self.stats = empty_stats()
        self._batches: Optional[Iterator[dict]] = None

    # -- public -----------------------------------------------------------------------------------------------

    def __iter__(self) -> "DataLoader":
        return self

    def __next__(self) -> dict:
        if self._batches is None:
            self._batches = self._generate(self._position, skip=self._emitted)
        return next(self._batches)

    def state_dict(self) -> dict:
        """Plain, picklable position: the current chunk's start, how many of its batches were emitted.

        Taken after every batch (the prefetcher pairs each batch with it), so what is never written once made is
        shared, not copied: the chunk's carry (up to a batch of tokens as lists; deep-copying it cost 12 ms of
        GIL-held CPU per 8 × 2,048 batch, against 0.6 ms now) and a dealt position's leftovers."""
        shared = [self._position["carry"]] if self._position.get("carry") is not None else []
        if "dealt" in self._position:
            from neox_hf.data.resize import unchanging_tensors

            shared += unchanging_tensors(self._position)
        return copy.deepcopy({"version": STATE_VERSION, "fingerprint": self._fingerprint(),
                              "position": self._position, "emitted": self._emitted}, {id(o): o for o in shared})

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise DataError(f"data loader state version {state.get('version')} is not {STATE_VERSION}; "
                            "this checkpoint's data position cannot be resumed by this version of neox_hf")
        saved = state["fingerprint"]
        if saved.get("dp_size") != self.dp_size:
            # Each data-parallel rank streams its own share of the documents from its own position: on another
            # number of ranks no position of the new shares is known to neither repeat nor skip a document.
            raise DataError(f"the streamed data position was saved by {saved.get('dp_size')} data-parallel rank(s) "
                            f"and this run has {self.dp_size}: give every old rank's state to `load_resized_states` "
                            f"(a resume from a checkpoint's layout-free state does), or resume with "
                            f"{saved.get('dp_size')} data-parallel rank(s)")
        changed = changed_data_setting(saved, self._fingerprint())
        if changed:
            raise DataError(changed)
        self._position, self._emitted = copy.deepcopy(state["position"]), state["emitted"]
        self.stats = {**empty_stats(), **self._position["stats"]}
        self._batches = None

    def load_resized_states(self, states: list[dict]) -> None:
        """Continue from the states of ALL the data-parallel ranks of a run on another number of them (index = old
        data-parallel rank): the rest of their current pass is dealt out to this run's ranks, then every rank reads
        the next pass on its own split (see `resize`). micro_batch_size may differ; other data settings may not."""
        from neox_hf.data.resize import resized_position

        self._position, self._emitted = resized_position(self, states), 0
        self.stats = {**empty_stats(), **self._position["stats"]}
        self._batches = None

    def describe_position(self) -> str:
        """One line for the resume log: what the loaded position means."""
        position = self._position
        if "dealt" in position:
            from neox_hf.data.resize import describe_dealt

            return describe_dealt(position["dealt"], self.cfg.mode, self.dp_size)
        return (f"data position: pass {position['epoch'] + 1} of this rank's streamed share on {self.dp_size} "
                f"data-parallel rank(s), chunk {position['chunk_index']} with {self._emitted} of its batches trained")

    # -- internals --------------------------------------------------------------------------------------------

    def _old_rank_loader(self, fingerprint: dict) -> "DataLoader":
        """A loader of the same data as this one on the rank and layout a saved position names."""
        return DataLoader(self.cfg, self.tokenizer, seq_length=self.seq_length,
                          micro_batch_size=fingerprint["micro_batch_size"], dp_rank=fingerprint["dp_rank"],
                          dp_size=fingerprint["dp_size"], seed=self.seed, role=self.role, cycle=self.cycle,
                          sources=self.sources)

    def _fingerprint(self) -> dict:
        c = self.cfg
        return {"mode": c.mode, "isolate_documents": c.isolate_documents, "seq_length": self.seq_length,
                "micro_batch_size": self.batch_size, "max_tokens_per_batch": c.max_tokens_per_batch,
                "buffer_size": c.buffer_size, "dp_rank": self.dp_rank, "dp_size": self.dp_size, "seed": self.seed,
                "sources": [s.path for s in self.sources]}

    def _make_stream(self, epoch: int):
        return document_stream(self.sources, self.tokenizer, epoch=epoch, seed=self.seed, dp_rank=self.dp_rank,
                               dp_size=self.dp_size, shuffle=self.shuffle, streaming=self.cfg.streaming,
                               append_eod=self.cfg.append_eod, role=self.role, fraction=self.cfg.validation_fraction)

    def _generate(self, start: dict, skip: int) -> Iterator[dict]:
        self.stats = {**empty_stats(), **start["stats"]}
        source = self._open_source(start)
        chunk_index, carry = start["chunk_index"], start["carry"]
        while True:
            self._position = {**source.position(), "chunk_index": chunk_index, "carry": carry,
                              "stats": dict(self.stats)}
            self._emitted = 0
            items = self._take(source, self.cfg.buffer_size)
            rng = np.random.default_rng([self.seed, chunk_index]) if self.shuffle else None
            last = source.exhausted  # only a finite (eval) stream ends
            makers, carry = self._chunk(items, carry, rng, flush=last, first=chunk_index == 0)
            for i, make in enumerate(makers):
                batch = make()
                self._count(batch)
                self._emitted = i + 1
                if i >= skip:
                    yield batch
            skip, chunk_index = 0, chunk_index + 1
            if last:
                return

    def _reader_at(self, position: dict) -> _DocumentReader:
        return _DocumentReader(self._make_stream, epoch=position["epoch"], upstream=position["upstream"],
                               usable_in_epoch=position["usable_in_epoch"], stats=self.stats, cycle=self.cycle,
                               sources=self.sources, role=self.role, dp_size=self.dp_size,
                               append_eod=self.cfg.append_eod, tallies=position.get("tallies"))

    def _open_source(self, position: dict):
        """Where this rank's items come from: its own split of the documents, or, inside a pass resized onto another
        number of data-parallel ranks, its dealt share of the old ranks' streams first (`resize.ResizedPass`)."""
        if "dealt" in position:
            from neox_hf.data.resize import ResizedPass

            return ResizedPass(self, position)
        return self._reader_at(position)

    def _take(self, source, n: int) -> list:
        """Up to n items (pad: (inputs, labels) examples; pack: TokenStream pieces) for one chunk."""
        if hasattr(source, "take_items"):
            return source.take_items(n, **self._chunk_limits)
        return self._items_of_docs(source.take(n, **self._chunk_limits))

    def _items_of_docs(self, docs) -> list:
        if self.cfg.mode == "pack":
            return packing.document_pieces(docs)
        return [padding.example_from_document(ids, n) for ids, n in self._whole_examples(docs)]

    def _chunk(self, items, carry, rng, flush: bool, first: bool = False):
        """(batch makers for this chunk, carry state for the next); makers are lazy so a resume skips cheaply."""
        makers, carry = self._pack_chunk(items, carry, rng) if self.cfg.mode == "pack" else \
            self._pad_chunk(items, carry, rng, flush, first)
        if self.cfg.eod_mask_loss:
            makers = [lambda make=make: mask_eod_predictions(make(), self.tokenizer.eos_token_id) for make in makers]
        return makers, carry

    def _pad_plan(self, items, carry, rng, flush: bool, first: bool = False):
        """(examples, their batches as index lists in emission order, indices carried to the next chunk)."""
        examples = [(np.asarray(i, np.int64), np.asarray(l, np.int64)) for i, l in (carry or [])] + list(items)
        lengths = [len(inputs) for inputs, _ in examples]
        if self.cfg.max_tokens_per_batch:
            groups, leftover = padding.token_budget_batches(
                lengths, self.cfg.max_tokens_per_batch, self.cfg.pad_to_multiple_of, self.max_length), []
        else:
            groups, leftover = padding.fixed_size_batches(lengths, self.batch_size, rng)
        if flush and leftover:
            groups, leftover = groups + [leftover], []
        if rng is not None:
            groups = [groups[i] for i in rng.permutation(len(groups))]
            if first and groups:
                groups = _longest_first(groups, lengths)
        return examples, groups, leftover

    def _pad_maker(self, examples, group):
        pad = dict(pad_id=self.tokenizer.pad_token_id, multiple=self.cfg.pad_to_multiple_of, max_length=self.max_length)
        return lambda: padding.pad_batch([examples[i] for i in group], **pad)

    def _pad_chunk(self, items, carry, rng, flush: bool, first: bool = False):
        examples, groups, leftover = self._pad_plan(items, carry, rng, flush, first)
        makers = [self._pad_maker(examples, g) for g in groups]
        next_carry = [(examples[i][0].tolist(), examples[i][1].tolist()) for i in leftover]
        return makers, next_carry

    def _whole_examples(self, docs):
        """The documents (already cut to max_length + 1 tokens by the reader: inputs of at most max_length) long
        enough to predict a token; the others count as empty."""
        for ids, prompt_length in docs:
            if len(ids) < 2:
                self.stats["skipped_empty"] += 1
                self.stats["documents"] -= 1
                continue
            yield ids, prompt_length

    def _pack_plan(self, items, carry, rng):
        """(the chunk's token stream: carry + items, its windows in batches, the rest)."""
        if rng is not None:
            items = [items[i] for i in rng.permutation(len(items))]
        start = TokenStream.from_state(carry) if carry else TokenStream.empty()
        parts = [start, *items]
        stream = TokenStream.concat(parts)
        windows, rest = packing.cut_batches(stream, self.seq_length, self.batch_size)
        return stream, windows, rest

    def _pack_chunk(self, items, carry, rng):
        stream, windows, rest = self._pack_plan(items, carry, rng)
        isolate = self.cfg.isolate_documents
        makers = [lambda w=w: packing.pack_batch(w, isolate_documents=isolate) for w in windows]
        rest_state = rest.to_state()
        # whether the rest's first token was already a target (the last window's final token, shared with the next)
        rest_state["overlap"] = bool(windows) or _overlaps(carry, self.stats)
        return makers, rest_state

    def _rest_of_chunk(self) -> tuple[list, object]:
        """(the items of the loaded position's chunk read but not trained, the source right after that chunk),
        the stats counted as the uninterrupted loader had them after its `emitted` batches. Pad: the examples of the
        groups not emitted, then the leftover carried on; pack: the chunk's tokens after the emitted windows, as one
        piece per document (the first one from its first token not yet a target: windows share their last token with
        the next), so that the rest is dealt to the new ranks document by document."""
        start, emitted = self._position, self._emitted
        self.stats = {**empty_stats(), **start["stats"]}
        source = self._open_source(start)
        items = self._take(source, self.cfg.buffer_size)
        rng = np.random.default_rng([self.seed, start["chunk_index"]]) if self.shuffle else None
        if self.cfg.mode == "pack":
            stream, windows, _ = self._pack_plan(items, start["carry"], rng)
            for window in windows[:emitted]:
                self._count(packing.pack_batch(window, isolate_documents=False))
            cut = emitted * self.batch_size * self.seq_length
            cut += 1 if emitted or _overlaps(start["carry"], start["stats"]) else 0
            return _document_pieces(stream[cut:]), source
        examples, groups, leftover = self._pad_plan(items, start["carry"], rng, flush=source.exhausted,
                                                    first=start["chunk_index"] == 0)
        for group in groups[:emitted]:
            self._count(self._pad_maker(examples, group)())
        return [examples[i] for group in groups[emitted:] for i in group] + [examples[i] for i in leftover], source

    def _count(self, batch: dict) -> None:
        total = batch["input_ids"].numel()
        real = int(batch["attention_mask"].sum()) if "attention_mask" in batch else total
        self.stats["real_tokens"] += real
        self.stats["padded_tokens"] += total - real


class DataNotes:
    """Run-log lines about documents that trained, but not whole: cut to max_length (pad mode), or prompt-masked
    with no answer tokens (only their EOD learned). Fed the loader's `stats` summed over data-parallel ranks at each
    log interval, it says each the first time it is seen and again whenever its count has doubled since."""

    def __init__(self, max_length: int):
        self.max_length = max_length
        self._said: dict[str, int] = {}  # the count each key was last said at

    def lines(self, stats: dict) -> list[str]:
        documents, lines = int(stats.get("documents", 0)), []
        for key in ("truncated", "no_answer"):
            count = int(stats.get(key, 0))
            if count and count >= 2 * self._said.get(key, 0):
                self._said[key] = count
                lines.append(self._line(key, count, documents))
        return lines

    def _line(self, key: str, count: int, documents: int) -> str:
        if key == "truncated":
            return (f"{count:,} of {documents:,} documents were longer than max_length ({self.max_length} tokens) and "
                    "were cut to it; raise `data.max_length` or use `data.mode: pack` to train on their ends")
        return (f"{count:,} of {documents:,} documents have no answer tokens after `prompt_template`: only their EOD "
                "is learned (if that is not meant, check `template` / `prompt_template` and the answer field)")


def mask_eod_predictions(batch: dict, eod_id: int) -> dict:
    """GPT-NeoX's `eod_mask_loss`: no loss on the prediction made from an EOD input position."""
    batch["labels"][batch["input_ids"] == eod_id] = padding.IGNORE_INDEX
    return batch


def _check_batching(cfg: DataConfig, tokenizer, max_length: int, micro_batch_size: int, seq_length: int) -> None:
    if micro_batch_size < 1 or seq_length < 1:
        raise DataError(f"micro_batch_size ({micro_batch_size}) and seq_length ({seq_length}) must be ≥ 1")
    if cfg.mode == "pad" and tokenizer.pad_token_id is None:
        raise DataError("data.mode: pad needs a tokenizer pad token; set tokenizer.pad_token (e.g. '<|padding|>')")
    if cfg.append_eod and tokenizer.eos_token_id is None:
        raise DataError("data.append_eod: true needs a tokenizer eos token; set tokenizer.eos_token '<|endoftext|>'")
    if cfg.mode == "pad" and cfg.max_tokens_per_batch:
        widest = padding.padded_length(max_length, cfg.pad_to_multiple_of, max_length)
        if widest > cfg.max_tokens_per_batch:
            raise DataError(f"data.max_tokens_per_batch ({cfg.max_tokens_per_batch}) is below one example of "
                            f"max_length {max_length}; raise it to ≥ {widest} or lower data.max_length")


# ----------------------------------------------------------------------------------------------------------------
# The contract the train loop uses
# ----------------------------------------------------------------------------------------------------------------


def build_train_loader(data_cfg: DataConfig, tokenizer, *, seq_length: int, micro_batch_size: int, dp_rank: int = 0,
                       dp_size: int = 1, seed: int = 1234, gradient_accumulation_steps: int = 1,
                       train_iters: Optional[int] = None, eval_interval: int = 1000, eval_iters: int = 0,
                       start_step: int = 0):
    """Infinite training batches for this data-parallel rank (reshuffled each epoch with seed + epoch).
    With tensor parallelism pass the DP rank, so every rank of a TP group gets the same batches.

    `data.order: gpt-neox` / `preshuffled` give GPT-NeoX's samples (`neox_order`): they need `train_iters` and
    `gradient_accumulation_steps` (the index holds train_iters × global batch samples) and start at `start_step`.
    Under `data.curriculum` every batch carries `batch["curriculum_seq_length"]` (an int), for the step log."""
    if not data_cfg.sources:
        raise DataError("data.sources is empty: add at least one `- path: ...` under data.sources")
    check_sources(data_cfg.sources)
    curriculum = _curriculum(data_cfg)
    if data_cfg.order != "stream":
        return _neox_order_loader(data_cfg, tokenizer, "train", seq_length=seq_length, micro_batch_size=micro_batch_size,
                                  dp_rank=dp_rank, dp_size=dp_size, seed=seed, accumulation=gradient_accumulation_steps,
                                  train_iters=train_iters, eval_interval=eval_interval, eval_iters=eval_iters,
                                  start_step=start_step, curriculum=curriculum)
    role = "train" if data_cfg.validation_fraction > 0 and not data_cfg.validation else "all"
    loader = DataLoader(data_cfg, tokenizer, seq_length=seq_length, micro_batch_size=micro_batch_size,
                        dp_rank=dp_rank, dp_size=dp_size, seed=seed, role=role, cycle=True)
    if curriculum is None:
        return loader
    from neox_hf.data.curriculum import CurriculumLoader

    return CurriculumLoader(loader, curriculum, gradient_accumulation_steps, start_step)


def _curriculum(data_cfg: DataConfig):
    if data_cfg.curriculum is None:
        return None
    from neox_hf.data.curriculum import SeqlenCurriculum

    return SeqlenCurriculum(data_cfg.curriculum)


def _neox_order_loader(data_cfg: DataConfig, tokenizer, role: str, *, seq_length: int, micro_batch_size: int,
                       dp_rank: int, dp_size: int, seed: int, accumulation: int, train_iters: Optional[int],
                       eval_interval: int, eval_iters: int, start_step: int = 0, curriculum=None):
    from neox_hf.data.neox_order import BatchLayout, NeoXOrderLoader, build_split_samples

    if train_iters is None:
        raise DataError(f"data.order: {data_cfg.order} needs train_iters (GPT-NeoX builds train_iters × global batch "
                        "samples): pass train_iters= to build_train_loader")
    layout = BatchLayout(micro_batch_size, accumulation, dp_size)
    samples = build_split_samples(data_cfg, role, seq_length=seq_length, train_iters=train_iters, layout=layout,
                                  eval_interval=eval_interval, eval_iters=eval_iters, seed=seed)
    if samples is None:
        return None
    fingerprint = {"order": data_cfg.order, "split": data_cfg.split, "pack_impl": data_cfg.pack_impl,
                   "seq_length": seq_length, "micro_batch_size": micro_batch_size, "accumulation": accumulation,
                   "dp_rank": dp_rank, "dp_size": dp_size, "seed": seed, "train_iters": train_iters,
                   "sources": [s.path for s in data_cfg.sources]}
    return NeoXOrderLoader(samples, layout, dp_rank, eod_id=tokenizer.eos_token_id if tokenizer is not None else None,
                           eod_mask_loss=data_cfg.eod_mask_loss, fingerprint=fingerprint, curriculum=curriculum,
                           start_step=start_step)


def build_eval_loader(data_cfg: DataConfig, tokenizer, *, seq_length: int, micro_batch_size: int, max_batches: int,
                      dp_rank: int = 0, dp_size: int = 1, gradient_accumulation_steps: int = 1,
                      train_iters: Optional[int] = None, eval_interval: int = 1000, eval_iters: int = 0) -> list[dict]:
    """At most `max_batches` deterministic validation batches (stream order, no shuffling): from
    `data.validation` sources, else the documents `validation_fraction` holds out of `data.sources`.
    With `data.order: gpt-neox`: the first `max_batches` micro-batches of GPT-NeoX's valid samples for this rank
    (the `split` range, or `data.validation` blended)."""
    if data_cfg.order != "stream":
        if max_batches <= 0 or (data_cfg.split is None and not data_cfg.validation):
            return []
        loader = _neox_order_loader(data_cfg, tokenizer, "valid", seq_length=seq_length,
                                    micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                                    seed=data_cfg.seed, accumulation=gradient_accumulation_steps,
                                    train_iters=train_iters, eval_interval=eval_interval,
                                    eval_iters=max(eval_iters, 1))
        return [] if loader is None else list(islice(loader, max_batches))
    held_out = validation_sources(data_cfg)
    if held_out is None:
        return []
    sources, role = held_out
    check_sources(sources)
    loader = DataLoader(data_cfg, tokenizer, seq_length=seq_length, micro_batch_size=micro_batch_size,
                        dp_rank=dp_rank, dp_size=dp_size, seed=data_cfg.seed, role=role, cycle=False, sources=sources)
    return list(islice(loader, max_batches))


def build_neox_valid_loader(data_cfg: DataConfig, tokenizer, *, seq_length: int, micro_batch_size: int,
                            gradient_accumulation_steps: int, train_iters: int, eval_interval: int, eval_iters: int,
                            dp_rank: int = 0, dp_size: int = 1, iteration: int = 0):
    """GPT-NeoX's validation stream for `data.order: gpt-neox` (None without a valid split): an endless loader of
    this rank's valid micro-batches; GPT-NeoX's evaluation takes `eval_iters × gradient_accumulation_steps` of them
    each time, carrying on where the last one stopped, and a run resumed at `iteration` starts at micro-batch
    `(iteration × accumulation) // eval_interval × eval_iters` (GPT-NeoX's shift_and_wrap_data_loaders)."""
    if data_cfg.order == "stream" or (data_cfg.split is None and not data_cfg.validation):
        return None
    loader = _neox_order_loader(data_cfg, tokenizer, "valid", seq_length=seq_length, micro_batch_size=micro_batch_size,
                                dp_rank=dp_rank, dp_size=dp_size, seed=data_cfg.seed,
                                accumulation=gradient_accumulation_steps, train_iters=train_iters,
                                eval_interval=eval_interval, eval_iters=eval_iters)
    if loader is not None:
        loader.micro_step = (iteration * gradient_accumulation_steps) // eval_interval * eval_iters
    return loader


CHEAP_COUNT_BYTES = 16 * 2**20  # ~4M tokens, ~20 s of tokenizing on 2 cores; above that None, not a guess


def tokens_per_epoch(data_cfg: DataConfig, tokenizer) -> Optional[int]:
    """Training tokens in one epoch (EOD included), for `gpt_neox_num_epochs`.

    Exact from the index for `.bin/.idx` sources without a validation hold-out; counted in one tokenizing
    pass for local files up to 16 MiB on disk; None for Hub datasets, bigger files, and blends of several sources
    (a weighted blend's epoch is set by the sampling, not by the corpus sizes).
    """
    from neox_hf.data.indexed import IndexedDataset

    sources = data_cfg.sources
    if data_cfg.order == "gpt-neox" and data_cfg.split is not None and len(sources) == 1:
        from neox_hf.data.neox_order import split_document_ranges

        sizes = IndexedDataset(sources[0].path).sizes
        first, last = split_document_ranges(data_cfg.split, len(sizes))[:2]
        return int(sizes[first:last].sum(dtype=np.int64))
    if len(sources) != 1:
        return None
    source = sources[0]
    fmt = source_format(source)
    if fmt == "hub":
        return None
    if fmt == "indexed" and (data_cfg.validation_fraction == 0 or data_cfg.validation or data_cfg.order != "stream"):
        return IndexedDataset(source.path).num_tokens
    if fmt != "indexed" and sum(_file_size(f) for f in resolve_files(source)) > CHEAP_COUNT_BYTES:
        return None
    role = "train" if data_cfg.validation_fraction > 0 and not data_cfg.validation else "all"
    stream = document_stream(sources, tokenizer, epoch=0, seed=data_cfg.seed, shuffle=False,
                             streaming=data_cfg.streaming, append_eod=data_cfg.append_eod, role=role,
                             fraction=data_cfg.validation_fraction)
    return sum(len(row["input_ids"]) for row in rows_naming_damaged_files(stream, sources) if row["skip"] == "")


def _file_size(path: str) -> int:
    import os

    return os.path.getsize(path)


def _longest_first(groups: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """The shuffled batches with the one of the most padded positions moved to the front, as transformers'
    `LengthGroupedSampler` does: a run that does not fit in memory fails at its first step, not hours in, and the
    largest activations are allocated once at the start instead of paying their page faults mid-run."""
    widest = max(range(len(groups)), key=lambda g: len(groups[g]) * max(lengths[i] for i in groups[g]))
    return [groups[widest]] + groups[:widest] + groups[widest + 1:]


def validation_sources(data_cfg: DataConfig) -> tuple[list, str] | None:
    """(sources, role) of the validation set: `data.validation` whole, else what `validation_fraction` holds out of
    `data.sources` (role "validation"); None when the recipe has none."""
    if data_cfg.validation:
        return data_cfg.validation, "all"
    if data_cfg.validation_fraction > 0 and data_cfg.sources:
        return data_cfg.sources, "validation"
    return None


def _overlaps(carry, stats: dict) -> bool:
    """Whether a pack-mode carry's first token was already a target: it is then the final token of the last window
    emitted, which the next window shares. Carries saved before this was recorded: whether any window was emitted."""
    if not carry or not carry.get("ids"):
        return False
    return bool(carry["overlap"]) if "overlap" in carry else stats.get("real_tokens", 0) > 0


def _document_pieces(stream: TokenStream) -> list[TokenStream]:
    """A token stream cut where documents start (the first piece may be a document's end)."""
    cuts = [0, *np.flatnonzero(stream.starts[1:]) + 1, len(stream)]
    return [stream[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]
