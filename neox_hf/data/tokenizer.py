"""Tokenizers: GPT-NeoX `HFTokenizer` JSON files or HF tokenizer folders, always packaged so AutoTokenizer loads them.

Gap filled: a bare tokenizers JSON (what GPT-NeoX's `vocab_file` points at) has no special-token roles;
`PreTrainedTokenizerFast(tokenizer_file=...)` wraps it but leaves eos/pad unset, and nothing checks that the model's
embedding covers every id the tokenizer can emit.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from neox_hf.errors import RecipeError, first_line


def load_tokenizer(path: str, *, eos_token: str = "<|endoftext|>", pad_token: str = "<|padding|>") -> PreTrainedTokenizerBase:
    """A fast tokenizer from a tokenizers `.json` file or an HF tokenizer folder, with eos/pad set.

    GPT-NeoX's tokenizer uses `<|endoftext|>` as bos, eos and unk and `<|padding|>` as pad.
    """
    location = Path(path)
    if location.suffix == ".json":
        if not location.is_file():
            raise RecipeError(f"tokenizer file not found: {location}. Set `tokenizer.path` to a tokenizers JSON file or an HF folder")
        vocab = _json_tokenizer_vocab(location)
        # PreTrainedTokenizerFast would add a missing special token as a new id (a typo would then end every
        # document and become eos_token_id): the roles must name tokens the file already has.
        for token, role in ((eos_token, "eos_token"), (pad_token, "pad_token")):
            _require_token_in(vocab, token, role, where=str(location))
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_file=str(location), bos_token=eos_token, eos_token=eos_token, unk_token=eos_token, pad_token=pad_token
        )
    else:
        try:
            # False, not the default None: with None transformers asks on stdin whether to run a folder's tokenizer
            # code (and runs it on "y"); a training node or a pipe must never be asked.
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        except Exception as err:  # OSError, ValueError, or the tokenizers library's own error for a corrupt file
            raise RecipeError(f"cannot load tokenizer from {path!r}: {first_line(err)}. Set `tokenizer.path` to a "
                              "tokenizers JSON file or an HF folder") from err
        if tokenizer.eos_token is None:
            tokenizer.eos_token = eos_token
        if tokenizer.pad_token is None:
            tokenizer.pad_token = pad_token if pad_token in tokenizer.get_vocab() else tokenizer.eos_token
    _require_token(tokenizer, tokenizer.eos_token, "eos_token")
    _require_token(tokenizer, tokenizer.pad_token, "pad_token")
    return tokenizer


def _json_tokenizer_vocab(location: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(location)).get_vocab(with_added_tokens=True)
    except Exception as err:  # tokenizers raises a bare Exception for malformed JSON
        raise RecipeError(f"{location} is not a valid tokenizers JSON file ({first_line(err)}); set `tokenizer.path` "
                          "to the tokenizer.json the model uses (e.g. examples/data/gpt-neox-20b-tokenizer.json)") from err


def _require_token_in(vocab: dict, token: str, role: str, where: str) -> None:
    if token not in vocab:
        close = difflib.get_close_matches(token, [t for t in vocab if t.startswith("<") or t.startswith("[")], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise RecipeError(f"`tokenizer.{role}` = {token!r} is not a token of {where}{hint}; set it to a token the "
                          "tokenizer already has, e.g. '<|endoftext|>'")



def _require_token(tokenizer, token: str, role: str) -> None:
    if token not in tokenizer.get_vocab():
        raise RecipeError(f"tokenizer has no token {token!r} for `tokenizer.{role}`; set `tokenizer.{role}` to a token of its vocabulary")
