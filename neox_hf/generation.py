"""`neox_hf generate`: GPT-NeoX's generate.py modes (unconditional, input-file, interactive) over `model.generate`.

Gap filled: transformers gives `generate` but no command around it; GPT-NeoX users expect its three text-gen
modes and its jsonl records (`context`, `text`, `length`, `finished`). Sampling is reproducible per prompt:
prompt i is sampled with seed `seed + i`, so an output does not depend on how many prompts ran before it, and the
N unconditional samples differ from one another. An empty prompt starts from the end-of-document token, as
GPT-NeoX's unconditional mode does. A temperature of 0 means greedy decoding (GPT-NeoX's convention).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, TextIO

import torch
from transformers import set_seed

from neox_hf.errors import DataError, UsageError, print_to_stderr
from neox_hf.inference import load_for_inference
from neox_hf.io import atomic_path


@dataclass
class Sampling:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int = 1234
    do_sample: bool = True


@dataclass
class Completion:
    context: str
    text: str  # the continuation only, special tokens removed
    length: int  # generated tokens
    finished: bool  # ended with the end-of-document token

    def to_json(self) -> str:
        return json.dumps({"context": self.context, "text": self.text, "length": self.length, "finished": self.finished})


def generate_text(model_path, prompts: list[str], *, max_new_tokens: int = 64, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, seed: int = 1234, do_sample: bool = True,
                  tokenizer_path: str | None = None, device: str = "auto") -> list[str]:
    """The continuation of every prompt (an empty prompt samples unconditionally)."""
    model, tokenizer = load_for_inference(model_path, tokenizer_path, device=device)
    sampling = Sampling(max_new_tokens, temperature, top_k, top_p, seed, do_sample)
    return [c.text for c in complete_all(model, tokenizer, prompts, sampling)]


def complete_all(model, tokenizer, prompts: Iterable[str], sampling: Sampling) -> Iterator[Completion]:
    """Completions one prompt at a time (lazy, so interactive mode answers each line as it comes); refused at once
    when --max-new-tokens leaves no room for a prompt in the model's context."""
    context = model.config.max_position_embeddings
    if sampling.max_new_tokens >= context:  # generation would run past the positions the model was trained on
        raise UsageError(f"--max-new-tokens {sampling.max_new_tokens} leaves no room for a prompt in the model's "
                         f"context of {context} positions (max_position_embeddings); give at most {context - 1}")
    return (complete(model, tokenizer, prompt, sampling, seed=sampling.seed + index)
            for index, prompt in enumerate(prompts))


@torch.no_grad()
def complete(model, tokenizer, prompt: str, sampling: Sampling, *, seed: int) -> Completion:
    context = _context_ids(model, tokenizer, prompt, sampling.max_new_tokens)
    set_seed(seed)
    output = model.generate(
        input_ids=context, attention_mask=torch.ones_like(context), max_new_tokens=sampling.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **_decoding_kwargs(sampling),
    )
    new = output[0, context.shape[1]:].tolist()
    finished = tokenizer.eos_token_id in new
    if finished:
        new = new[: new.index(tokenizer.eos_token_id)]
    return Completion(prompt, tokenizer.decode(new, skip_special_tokens=True), len(new), finished)


def _context_ids(model, tokenizer, prompt: str, max_new_tokens: int) -> torch.Tensor:
    """[1, T] prompt ids, or the EOD token for an empty prompt; long prompts keep their last tokens so the
    prompt plus the continuation fit the model's context."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
    if not ids:
        ids = [tokenizer.eos_token_id]
    context = model.config.max_position_embeddings
    room = max(context - max_new_tokens, 1)  # complete_all refuses more new tokens than the context holds
    if len(ids) > room:
        print_to_stderr(f"note: a prompt of {len(ids)} tokens keeps its last {room}: with --max-new-tokens "
                        f"{max_new_tokens} that fills the model's context of {context} positions")
    return torch.tensor([ids[-room:]], dtype=torch.long, device=model.device)


def _decoding_kwargs(sampling: Sampling) -> dict:
    if not sampling.do_sample or sampling.temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}


# ----------------------------------------------------------------------------------------------------------------
# `neox_hf generate MODEL --prompt ... | --input-file F | --interactive | --unconditional N`
# ----------------------------------------------------------------------------------------------------------------


def add_generate_arguments(parser) -> None:
    parser.add_argument("model", help="model folder, or adapter folder of a LoRA run")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    mode.add_argument("--input-file", help="one prompt per line (blank lines skipped); results go to --output-file")
    mode.add_argument("--interactive", action="store_true", help="read prompts from stdin until EOF")
    mode.add_argument("--unconditional", type=int, metavar="N", help="N samples starting from the EOD token")
    parser.add_argument("--output-file", help="jsonl of {context, text, length, finished} "
                                              "(default for --input-file: INPUT.samples.jsonl)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer JSON or folder (default: the model folder's)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    parser.add_argument("--seed", type=int, default=1234, help="prompt i is sampled with seed + i")
    parser.add_argument("--greedy", action="store_true", help="greedy decoding (no sampling)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto (default): the GPU where torch sees one, else the CPU")


def run_generate(args, *, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    check_generate_arguments(args)
    model, tokenizer = load_for_inference(args.model, args.tokenizer, device=args.device)
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, not args.greedy)
    prompts, output_file = _mode_prompts(args, stdin)
    completions = complete_all(model, tokenizer, prompts, sampling)
    echo = stdout if (output_file is None or args.interactive) else None
    if output_file is None:
        for completion in completions:
            _echo(completion, echo)
        return 0
    count = write_completions(completions, output_file, echo=echo)
    print(f"{count} completion(s) written to {output_file}", file=stdout)
    return 0


def check_generate_arguments(args) -> None:
    """Refuse sampling settings transformers would reject deep inside `generate`, before the model is loaded."""
    checks = [
        (args.max_new_tokens >= 1, f"--max-new-tokens must be ≥ 1, got {args.max_new_tokens}"),
        (args.temperature >= 0, f"--temperature must be ≥ 0 (0 = greedy), got {args.temperature}"),
        (0 < args.top_p <= 1, f"--top-p must be in (0, 1] (1 = off), got {args.top_p}"),
        (args.top_k >= 0, f"--top-k must be ≥ 0 (0 = off), got {args.top_k}"),
        (args.unconditional is None or args.unconditional >= 1, f"--unconditional must be ≥ 1, got {args.unconditional}"),
    ]
    for ok, message in checks:
        if not ok:
            raise UsageError(message)


def _echo(completion: Completion, stream: TextIO | None) -> None:
    if stream is not None:
        print(completion.context + completion.text, file=stream, flush=True)


def _mode_prompts(args, stdin: TextIO) -> tuple[Iterable[str], Path | None]:
    """(prompts, jsonl output or None for stdout) for the chosen mode."""
    output = Path(args.output_file) if args.output_file else None
    if args.input_file:
        return read_prompt_file(args.input_file), output or Path(f"{args.input_file}.samples.jsonl")
    if args.interactive:
        return (line.rstrip("\n") for line in stdin), output
    if args.unconditional is not None:
        return [""] * args.unconditional, output
    return args.prompt, output


def read_prompt_file(path) -> list[str]:
    location = Path(path)
    if not location.is_file():
        raise DataError(f"--input-file {location} not found: give a text file with one prompt per line")
    prompts = [line.strip() for line in location.read_text(encoding="utf-8").splitlines()]
    prompts = [p for p in prompts if p]
    if not prompts:
        raise DataError(f"--input-file {location} has no prompts (only blank lines)")
    return prompts


def write_completions(completions: Iterable[Completion], path: Path, *, echo: TextIO | None = None) -> int:
    """Write jsonl to a temporary name and rename, so a crashed run leaves no partial output file;
    `echo` also prints each completion as it comes (interactive mode)."""
    count = 0
    with atomic_path(path) as tmp, tmp.open("w", encoding="utf-8") as f:
        for completion in completions:
            f.write(completion.to_json() + "\n")
            _echo(completion, echo)
            count += 1
    return count
