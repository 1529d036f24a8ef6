"""GPT-NeoX's post-training data: conversations tokenised through a chat template into `.bin/.idx` documents, and
those documents read back as the preference pairs / KTO examples of `neox_hf.data.preference`.

The files are what GPT-NeoX's `tools/datasets/preprocess_data_with_chat_template.py` writes (its `build_chat`, read
at EleutherAI/gpt-neox ea7aefd8), one item per conversation, int32, for each `--jsonl-keys` KEY:
  PREFIX_KEY_document         the conversation's tokens (the template's, then EOS)
  PREFIX_KEY_label_document   the same tokens where they are trained and -100 elsewhere: the turns of
                              `--generation-role` (`--only-last`: its last turn only; `--for-rm`: one EOS more and
                              only that final EOS; `--no-mask`: no label file, every token trained)
  PREFIX_KEY_reward_document  `--reward-key`: one reward per conversation (`--binary-reward`: 1 or -1)
GPT-NeoX's configs name them: DPO / RM `pos_/neg_{train,valid,test}_data_paths` (+ `_label_`), KTO
`{train,valid,test}_data_paths` + `_label_data_paths` + `_reward_data_paths`.

Read here as GPT-NeoX's `PairwiseDataset` / `GPT2Dataset` read one unpacked sample: the first seq_length + 1 tokens
of a document (`allow_chopped: false` drops a pair with a longer side, as GPT-NeoX's unpacked index does), a pair or
example whose label document is all -100 in its first seq_length tokens skipped (GPT-NeoX skips it too); token t of
the input predicts label t + 1. Each is one item of `preference.PreferenceLoader`, so batching, order, data-parallel
shards, resume and DPO's precomputed reference are the jsonl path's.

Gap filled: no library reads GPT-NeoX's post-training files; transformers' `apply_chat_template` renders the turns,
the per-turn masking is GPT-NeoX's script's.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from neox_hf.data.indexed import IndexedDataset, index_bytes, indexed_paths
from neox_hf.data.sources import is_held_out
from neox_hf.errors import DataError
from neox_hf.io import atomic_path

IGNORE_INDEX = -100


@dataclass(frozen=True)
class LabelledTokens:
    """A document and its label document: `targets[t]` is what position t − 1 predicts (-100: no loss)."""

    ids: np.ndarray  # int64
    targets: np.ndarray  # int64, same length

    def __len__(self) -> int:
        return len(self.ids)


# ----------------------------------------------------------------------------------------------------------------
# Writing: GPT-NeoX's build_chat
# ----------------------------------------------------------------------------------------------------------------


def _template_ids(tokenizer, chat: list, add_generation_prompt: bool = False) -> list[int]:
    # transformers 5 returns a dict by default; GPT-NeoX's script (transformers 4) gets the list of ids
    return list(tokenizer.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=True,
                                              return_dict=False))


def chat_document(chat: list, tokenizer, *, generation_role: str = "assistant", mask: bool = True,
                  only_last: bool = False, for_rm: bool = False) -> tuple[list[int], list[int]]:
    """(tokens, labels) of one conversation, as GPT-NeoX's `build_chat`: each turn rendered by the chat template on
    the conversation so far (with the generation prompt when the next turn is `generation_role`'s), the new tokens
    appended; labels copy the tokens of `generation_role`'s turns (the last one only with `only_last`), -100
    elsewhere; EOS appended. `for_rm`: the whole template, then EOS twice, only the last labelled. Without `mask`
    the labels are the tokens."""
    if not mask:
        tokens = _template_ids(tokenizer, chat)
        return tokens, list(tokens)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no eos_token: GPT-NeoX's chat documents end with it; set one")
    if for_rm:
        tokens = _template_ids(tokenizer, chat)
        return tokens + [eos, eos], [IGNORE_INDEX] * (len(tokens) + 1) + [eos]
    tokens: list[int] = []
    labels: list[int] = []
    for i, turn in enumerate(chat):
        next_is_generation = i + 1 < len(chat) and chat[i + 1]["role"] == generation_role
        new = _template_ids(tokenizer, chat[: i + 1], next_is_generation)[len(tokens):]
        tokens.extend(new)
        trained = turn["role"] == generation_role and (not only_last or i == len(chat) - 1)
        labels.extend(new if trained else [IGNORE_INDEX] * len(new))
    labels.append(eos if labels and labels[-1] != IGNORE_INDEX else IGNORE_INDEX)
    tokens.append(eos)
    return tokens, labels


def _chat_rows(paths: list[str]) -> Iterator[tuple[int, dict]]:
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{number}: not a JSON line ({err.msg}); GPT-NeoX's script stops there "
                                    "too: fix the line") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{number}: a JSON object is expected, got {type(row).__name__}")
                yield number, row


def _reward_item(value, binary: bool, where: str) -> list:
    """GPT-NeoX's reward item: 1 / -1 with `--binary-reward` (truthiness), else the value cast to int32 as its
    builder does (a float reward 0.7 is stored as 0: GPT-NeoX's files hold int32)."""
    if binary:
        return [1 if value else -1]
    if isinstance(value, bool) or isinstance(value, (int, float)):
        return [value]
    raise DataError(f"{where}: the reward is {type(value).__name__} {value!r}, not a number or boolean; give a "
                    "number, or --binary-reward for truthy / falsy rewards")


def write_chat_documents(inputs: list[str], tokenizer, output_prefix: str, *, keys: list[str],
                         generation_role: str = "assistant", mask: bool = True, only_last: bool = False,
                         for_rm: bool = False, reward_key: Optional[str] = None, binary_reward: bool = False) -> dict:
    """GPT-NeoX's `preprocess_data_with_chat_template.py` for `inputs` (jsonl files of conversations under each of
    `keys`): for each key the files PREFIX_KEY_document (+ `_label_document` unless `mask` is off, + `_reward_document`
    with `reward_key`), int32, byte-identical to the script's with the same tokenizer. Every file is written under a
    temporary name and renamed at the end, so a bad line leaves nothing. Returns {"documents": N, "files": [...]}."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError("the tokenizer has no chat template (tokenizer_config.json `chat_template` or "
                        "chat_template.jinja); give a tokenizer folder that has one")
    streams = {key: [key] + (["label"] if mask else []) + (["reward"] if reward_key is not None else []) for key in keys}
    items: dict[str, list[np.ndarray]] = {f"{key}_{kind}" if kind != key else key: []
                                          for key, kinds in streams.items() for kind in kinds}
    documents = 0
    for number, row in _chat_rows(inputs):
        documents += 1
        for key in keys:
            chat = row.get(key)
            if not isinstance(chat, list) or not all(isinstance(t, dict) and "role" in t for t in chat) or not chat:
                raise DataError(f"line {number}: `{key}` is not a list of {{role, content}} turns; name the "
                                "conversation field with --jsonl-keys")
            tokens, labels = chat_document(chat, tokenizer, generation_role=generation_role, mask=mask,
                                           only_last=only_last, for_rm=for_rm)
            items[key].append(np.asarray(tokens, dtype=np.int32))
            if mask:
                items[f"{key}_label"].append(np.asarray(labels, dtype=np.int32))
            if reward_key is not None:
                if reward_key not in row:
                    raise DataError(f"line {number}: no `{reward_key}` field (--reward-key)")
                items[f"{key}_reward"].append(np.asarray(_reward_item(row[reward_key], binary_reward,
                                                                      f"line {number}"), dtype=np.int32))
    if not documents:
        raise DataError(f"no conversation in {', '.join(inputs)}")
    written = []
    prefix = str(output_prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        tmp = _atomic_files(stack, [f"{prefix}_{name}_document" for name in items])
        for name, rows in items.items():
            bin_tmp, idx_tmp = tmp[f"{prefix}_{name}_document"]
            with open(bin_tmp, "wb") as f:
                for row in rows:
                    f.write(row.tobytes(order="C"))
            with open(idx_tmp, "wb") as f:
                f.write(index_bytes([row.size for row in rows], np.int32))
            written += [str(p) for p in indexed_paths(f"{prefix}_{name}_document")]
    return {"documents": documents, "files": written}


def _atomic_files(stack: ExitStack, prefixes: list[str]) -> dict:
    """Temporary (.bin, .idx) names for every prefix, all renamed in place when `stack` closes without an error."""
    return {prefix: tuple(stack.enter_context(atomic_path(p)) for p in indexed_paths(prefix)) for prefix in prefixes}


# ----------------------------------------------------------------------------------------------------------------
# Reading: pairs (DPO, RM) and rewarded examples (KTO)
# ----------------------------------------------------------------------------------------------------------------


def _open(path: Optional[str], what: str) -> Optional[IndexedDataset]:
    if path is None:
        return None
    try:
        return IndexedDataset(path)
    except DataError as err:
        raise DataError(f"{what}: {err}") from None


def _aligned(data: IndexedDataset, labels: Optional[IndexedDataset], what: str) -> None:
    if labels is not None and not np.array_equal(labels.sizes, data.sizes):
        raise DataError(f"{what}: the label file {labels.idx_path} does not match {data.idx_path} item for item; "
                        "give the _label_document written with it")


def _document(data: IndexedDataset, labels: Optional[IndexedDataset], i: int, length: int) -> LabelledTokens:
    """Item i cut to `length` tokens (GPT-NeoX's sample of seq_length + 1), labels the label item's or the tokens."""
    ids = np.asarray(data.get(i, length=length), dtype=np.int64)
    targets = np.asarray(labels.get(i, length=length), dtype=np.int64) if labels is not None else ids.copy()
    return LabelledTokens(ids, np.where(targets >= 0, targets, IGNORE_INDEX))


def _unlabelled(labels: Optional[IndexedDataset], i: int, seq_length: int) -> bool:
    """GPT-NeoX's unpacked index skips an item whose label item is -100 over its first seq_length tokens."""
    return labels is not None and bool(np.all(labels.get(i, length=seq_length) == IGNORE_INDEX))


def _count(stats: dict, key: str) -> None:
    stats[key] = stats.get(key, 0) + 1


def read_indexed_pairs(source, *, objective: str, max_length: int, allow_chopped: bool, role: str = "all",
                       fraction: float = 0.0, stats: Optional[dict] = None) -> list[tuple]:
    """The pairs of one GPT-NeoX pairwise source (`path` chosen, `rejected_path`, their label paths) as
    `PreferenceLoader` items: dpo ((), chosen LabelledTokens, rejected LabelledTokens); rm ((), chosen ids,
    rejected ids), each cut after its last labelled prediction (GPT-NeoX's reward is the value there: the final EOS
    of `--for-rm` files). A side longer than max_length + 1 drops the pair with `allow_chopped` false (counted in
    `stats["truncated"]`), else is cut; a pair with a side whose labels are all -100 is skipped
    (`stats["skipped_empty"]`). `role` / `fraction`: the hash hold-out of `data.validation_fraction`."""
    stats = stats if stats is not None else {}
    where = f"data source `{source.path}`"
    if not source.rejected_path:
        raise DataError(f"{where}: a GPT-NeoX pairwise source needs `rejected_path` (neg_*_data_paths) beside "
                        "`path` (pos_*_data_paths)")
    chosen, rejected = _open(source.path, where), _open(source.rejected_path, where)
    chosen_labels, rejected_labels = _open(source.label_path, where), _open(source.rejected_label_path, where)
    if (chosen_labels is None) != (rejected_labels is None):
        raise DataError(f"{where}: give label files for both sides (pos_ and neg_ label_data_paths) or neither, "
                        "as GPT-NeoX requires")
    if len(chosen.sizes) != len(rejected.sizes):
        raise DataError(f"{where}: {len(chosen.sizes)} chosen items but {len(rejected.sizes)} rejected in "
                        f"{source.rejected_path}; the two files must hold the same pairs in the same order")
    _aligned(chosen, chosen_labels, where)
    _aligned(rejected, rejected_labels, where)
    pairs = []
    for i in range(len(chosen.sizes)):
        stats["documents_read"] = stats.get("documents_read", 0) + 1
        if not allow_chopped and max(chosen.sizes[i], rejected.sizes[i]) > max_length + 1:
            _count(stats, "truncated")
            continue
        if _unlabelled(chosen_labels, i, max_length) or _unlabelled(rejected_labels, i, max_length):
            _count(stats, "skipped_empty")
            continue
        sides = [_document(chosen, chosen_labels, i, max_length + 1),
                 _document(rejected, rejected_labels, i, max_length + 1)]
        if role != "all" and (role == "validation") != is_held_out(b"".join(s.ids.tobytes() for s in sides),
                                                                  fraction):
            continue
        if objective == "rm":
            cut = [_through_last_prediction(side, max_length) for side in sides]
            if any(c is None for c in cut):
                _count(stats, "skipped_empty")
                continue
            pairs.append(((), *cut))
        else:
            pairs.append(((), *sides))
    return pairs


def _through_last_prediction(side: LabelledTokens, max_length: int) -> Optional[list[int]]:
    """The tokens up to the one that predicts the last labelled token (the reward model scores there), at most
    max_length; None when no labelled token is predicted within them."""
    labelled = np.flatnonzero(side.targets[1: max_length + 1] != IGNORE_INDEX)
    return None if not len(labelled) else side.ids[: int(labelled[-1]) + 1].tolist()


def read_indexed_examples(source, *, max_length: int, allow_chopped: bool, role: str = "all", fraction: float = 0.0,
                          stats: Optional[dict] = None) -> list[tuple]:
    """The examples of one GPT-NeoX KTO source (`path`, `label_path`, `reward_path`) as `PreferenceLoader` items
    (prompt ids, completion LabelledTokens, desirable): the prompt is what precedes the first labelled token (the KL
    sequences pair a prompt with another example's completion, as TRL). Reward > 0 desirable, < 0 undesirable;
    a reward of 0 (GPT-NeoX gives it no loss) is skipped and counted in `stats["reward_zero"]`."""
    stats = stats if stats is not None else {}
    where = f"data source `{source.path}`"
    if not source.reward_path:
        raise DataError(f"{where}: a GPT-NeoX KTO source needs `reward_path` (train_reward_data_paths) beside "
                        "`path`; write it with `neox_hf preprocess --chat-template --reward-key KEY --binary-reward`")
    data, labels, rewards = _open(source.path, where), _open(source.label_path, where), _open(source.reward_path, where)
    _aligned(data, labels, where)
    if len(rewards.sizes) != len(data.sizes) or np.any(rewards.sizes < 1):
        raise DataError(f"{where}: the reward file {rewards.idx_path} must hold one reward per item of "
                        f"{data.idx_path} ({len(data.sizes)} items, {len(rewards.sizes)} rewards)")
    examples = []
    for i in range(len(data.sizes)):
        stats["documents_read"] = stats.get("documents_read", 0) + 1
        if not allow_chopped and data.sizes[i] > max_length + 1:
            _count(stats, "truncated")
            continue
        if _unlabelled(labels, i, max_length):
            _count(stats, "skipped_empty")
            continue
        reward = float(rewards.get(i)[0])
        if reward == 0:
            _count(stats, "reward_zero")
            continue
        doc = _document(data, labels, i, max_length + 1)
        if role != "all" and (role == "validation") != is_held_out(doc.ids.tobytes(), fraction):
            continue
        first = int(np.flatnonzero(doc.targets != IGNORE_INDEX)[0]) if labels is not None else 1
        first = max(first, 1)  # the first token is never predicted
        examples.append((doc.ids[:first].tolist(), LabelledTokens(doc.ids[first:], doc.targets[first:]), reward > 0))
    return examples
