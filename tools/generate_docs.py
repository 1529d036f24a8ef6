#!/usr/bin/env python
"""Write the generated reference pages of docs/reference/ from the code: `python tools/generate_docs.py`.

- recipe-keys.md: every recipe key (neox_hf.recipe.reference, from the dataclasses' field metadata);
- cli.md: every `neox_hf` subcommand and its options (from the argparse parsers of neox_hf.cli);
- errors.md: every refusal message the package raises, as written in the code (found by reading its source).

`--check` writes nothing and exits 1 naming the stale pages (tests/test_docs.py runs the same comparison).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
REFERENCE = REPO / "docs" / "reference"

# Calls whose first string argument (the second for `_require`) is a message a user reads after `error:`.
ERROR_CALLS = {"RecipeError", "DataError", "CheckpointError", "HubError", "LaunchError", "TrainingDiverged",
               "UsageError", "NeoXHFError", "EmptyPairs", "_refuse", "_require"}
KINDS = {"RecipeError": "recipe", "_require": "recipe", "_refuse": "GPT-NeoX config", "DataError": "data",
         "EmptyPairs": "data", "CheckpointError": "checkpoint", "HubError": "Hub", "LaunchError": "launch",
         "TrainingDiverged": "training", "UsageError": "command line", "NeoXHFError": "other"}


def render_cli_reference() -> str:
    from neox_hf.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    lines = ["# Command-line reference", "",
             "<!-- Generated from neox_hf/cli.py and the modules it routes to by `python tools/generate_docs.py`; "
             "do not edit. -->", "",
             "Every `neox_hf` subcommand with its arguments. `neox_hf SUBCOMMAND --help` prints the same.",
             "`neox_hf train` takes a recipe and `--section.key VALUE` overrides: [the recipe keys](recipe-keys.md).", ""]
    helps = {choice.dest: choice.help for choice in sub._choices_actions}
    for name, subparser in sub.choices.items():
        lines += [f"## neox_hf {name}", "", f"{helps.get(name, '')[:1].upper()}{helps.get(name, '')[1:]}.", ""]
        if name == "train":
            lines += ["```", f"neox_hf train RECIPE [MORE.yml ...] [--section.key VALUE ...] [--print-config] "
                             "[--resume | --overwrite]", "```", "",
                      "The same as `run_clm_neox.py`; `--help` lists every key. See [the recipe keys](recipe-keys.md).",
                      ""]
            continue
        usage = " ".join(subparser.format_usage().split())[len("usage: "):]
        lines += ["```", usage, "```", "", "| argument | default | meaning |", "|---|---|---|"]
        for action in subparser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            names = ", ".join(action.option_strings) or action.dest.upper()
            default = "" if action.required or not action.option_strings or action.default in (None, False) \
                else f"`{action.default}`"
            text = " ".join((action.help or "").split()).replace("|", "\\|")
            lines.append(f"| `{names}` | {default} | {text} |")
        lines.append("")
    return "\n".join(lines)


def error_messages() -> list[tuple[str, str, str]]:
    """(kind, module, message) for every error the package raises with a literal or f-string message; the f-string's
    values are shown as `…`."""
    found = []
    for path in sorted((REPO / "neox_hf").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", getattr(node.func, "attr", ""))
            if name not in ERROR_CALLS:
                continue
            args = node.args[1:2] if name == "_require" else node.args[:1]
            if name == "_refuse" and len(node.args) == 3:
                text = f"GPT-NeoX option `{_text(node.args[0])}: …` is not supported by neox_hf ({_text(node.args[2])})"
            elif args:
                text = _text(args[0])
            else:
                continue
            text = " ".join(text.split())
            if len(text.replace("…", "").strip()) > 12:
                found.append((KINDS[name], str(path.relative_to(REPO / "neox_hf").with_suffix("")).replace("/", "."),
                              text))
    return sorted(set(found), key=lambda row: (row[0], row[2].lower(), row[2], row[1]))


def _text(node) -> str:
    """A message's text: string parts kept, formatted values as `…`, concatenations and conditionals flattened."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "…" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _text(node.left) + _text(node.right)
    if isinstance(node, ast.IfExp):
        return _text(node.body) or _text(node.orelse)
    return "…"


def render_error_reference() -> str:
    rows = error_messages()
    lines = ["# Refusal messages", "",
             "<!-- Generated from the package's source by `python tools/generate_docs.py`; do not edit. -->", "",
             "Every message the package refuses bad input with, as the code writes it.",
             "Each is printed as one `error:` line, and the command exits with status 2.",
             "`…` stands for a value taken from your input (a key, a path, a number).",
             "Search this page for the words of your error line; [troubleshooting](../troubleshooting.md) explains "
             "the common ones.", ""]
    for kind in dict.fromkeys(k for k, _, _ in rows):
        lines += [f"## {kind[:1].upper()}{kind[1:]}", "", "| message | raised in |", "|---|---|"]
        for k, module, text in rows:
            if k == kind:
                lines.append(f"| {_escape(text)} | `{module}` |")
        lines.append("")
    return "\n".join(lines)


def _escape(text: str) -> str:
    text = text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace("*", "\\*").replace("_", "\\_") if "`" not in text else text.replace("*", "\\*")


# GPT-NeoX keys translated by a rule of their own (neox_yaml's _translate_* functions), with what they become.
NEOX_RULES = {
    "train_batch_size": "checked against micro batch × accumulation × data-parallel size (`train.train_batch_size`)",
    "global_num_gpus": "with `train_batch_size`, fixes the data-parallel size of GPT-NeoX's batch rule",
    "num_gpus": "with `num_nodes`, fixes the data-parallel size of GPT-NeoX's batch rule",
    "num_nodes": "with `num_gpus`, fixes the data-parallel size of GPT-NeoX's batch rule",
    "load": "a notice: continue the run with `neox_hf continue-neox`, or import its weights with `neox_hf convert-neox`",
    "test_data_paths": "a notice: not used in training (evaluate afterwards with `neox_hf eval`)",
    "expansion_factor": "`model.intermediate_size` = expansion_factor × hidden_size",
    "mlp_multiple_of": "rounds `model.intermediate_size` up, as GPT-NeoX's MLP builds it",
    "tokenizer_type": "HFTokenizer: `vocab_file` is read; SPMTokenizer: give the HF tokenizer as `--tokenizer.path`",
    "attention_config": "global / flash everywhere: the dense causal attention; other kinds are refused",
    "optimizer": "`train.optimizer` and its settings (Adam, cpu_adam, cpu_torch_adam, Lion, SGD, SM3; OneBitAdam and "
                 "madgrad_wd refused)",
    "dpo_reference_free": "refused: DPO here always compares with a reference model",
    "precompute_model_name": "refused: reference log-probabilities are computed at start-up "
                             "(`train.dpo_reference: precompute`)",
    "dpo_fp32": "no effect: DPO log-probabilities are fp32 here",
    "kto_fp32": "no effect: KTO log-probabilities are fp32 here",
    "te_fp8_mha": "refused: FP8 attention is not part of accelerate's Transformer Engine recipe",
    "pipe_partition_method": "`parallel.pipe_partition_method`",
    "curriculum_seqlen": "no effect (the curriculum block decides)",
    "rms_norm_epsilon": "`model.layer_norm_eps` of the Llama family (norm: rmsnorm)",
    "sliding_window_width": "`model.sliding_window` (the Llama family)",
}


def render_neox_key_reference() -> str:
    """Every key GPT-NeoX accepts and what `run_clm_neox.py` does with it, from neox_hf.neox_yaml's tables and the
    recipe fields' `neox` metadata."""
    from neox_hf import neox_yaml as ny
    from neox_hf.recipe.reference import recipe_keys

    becomes: dict[str, list[str]] = {}
    for key in recipe_keys():
        for name in filter(None, (n.strip().split(".")[0] for n in key.neox.split(","))):
            becomes.setdefault(name, []).append(key.name)
    pair_prefixes = ("pos_", "neg_")
    # The keys the translation reads none of: its own notice for a config holding every key (values unset).
    notices = ny.translate_neox_args({k: None for k in ny._KNOWN_KEYS}).notices
    untranslated = {k.strip() for n in notices if n.startswith("GPT-NeoX options not translated")
                    for k in n.split(":", 1)[1].split(",")}
    lines = ["# GPT-NeoX keys", "",
             "<!-- Generated from neox_hf/neox_yaml.py and the recipe fields by `python tools/generate_docs.py`; do not "
             "edit. -->", "",
             "Every key a GPT-NeoX config may hold, and what `run_clm_neox.py CONFIG.yml` does with it.",
             "A key GPT-NeoX does not know is refused, naming the closest known one.",
             "Keys that have no effect or are not translated are listed in the start-up notes, so nothing is dropped "
             "silently.", "",
             "| GPT-NeoX key | here |", "|---|---|"]
    for name in sorted(ny._KNOWN_KEYS):
        if name in ny._DIRECT:
            fate = f"`{ny._DIRECT[name][0]}`"
        elif name in NEOX_RULES:
            fate = NEOX_RULES[name]
        elif name in becomes:
            fate = ", ".join(f"`{k}`" for k in becomes[name])
        elif name in ny._NO_EFFECT:
            fate = "no effect here (a kernel, logging or launcher setting)"
        elif name in ny._MUST_BE_FALSY:
            fate = f"refused unless off: {ny._MUST_BE_FALSY[name]}"
        elif name in ny._SUPPORTED_VALUES:
            allowed, why = ny._SUPPORTED_VALUES[name]
            fate = f"accepted values: {', '.join(sorted(allowed))} ({why}); others refused"
        elif name.startswith(pair_prefixes) or name.endswith("_reward_data_paths"):
            fate = "refused: give preference data as jsonl / parquet / Hub sources"
        elif name.startswith(("kto_", "kl_", "reinforce", "fp32_reinforce")):
            fate = "KTO's settings with `train_impl: kto`; REINFORCE's are not translated"
        elif name in untranslated:
            fate = "not translated: named in the start-up notes"
        else:
            fate = "read by the translation (its start-up notes say how)"
        lines.append(f"| `{name}` | {fate} |")
    return "\n".join(lines) + "\n"


def generated_pages() -> dict[Path, str]:
    from neox_hf.recipe.reference import render_recipe_reference

    return {REFERENCE / "recipe-keys.md": render_recipe_reference(),
            REFERENCE / "cli.md": render_cli_reference(),
            REFERENCE / "errors.md": render_error_reference(),
            REFERENCE / "neox-keys.md": render_neox_key_reference()}


def stale_pages() -> list[Path]:
    return [path for path, text in generated_pages().items() if not path.is_file() or path.read_text() != text]


def main(argv: list[str]) -> int:
    if "--check" in argv:
        stale = stale_pages()
        for path in stale:
            print(f"stale: {path.relative_to(REPO)} (run python tools/generate_docs.py)")
        return 1 if stale else 0
    REFERENCE.mkdir(parents=True, exist_ok=True)
    for path, text in generated_pages().items():
        path.write_text(text)
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
