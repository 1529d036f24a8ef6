"""`neox_hf` subcommands → library calls. Each subcommand's module owns its arguments; this file only routes.

    neox_hf train RECIPE [overrides]                 same as run_clm_neox.py
    neox_hf convert-neox CKPT --config YML OUT       GPT-NeoX checkpoint → HF folder
    neox_hf export-neox HF_FOLDER OUT [--tp N]       HF folder → GPT-NeoX sequential checkpoint
    neox_hf continue-neox CKPT --config YML --out RUN  GPT-NeoX training checkpoint → a run folder to --resume
    neox_hf export CHECKPOINT OUT                    resumable training checkpoint → HF folder
    neox_hf preprocess JSONL... --tokenizer T OUT    jsonl → GPT-NeoX .bin/.idx
    neox_hf push OUT REPO_ID [--revision R]          upload a folder to the Hub
    neox_hf merge BASE ADAPTER OUT                   LoRA adapter merged into a plain GPTNeoX folder
    neox_hf eval MODEL --data FILE                   loss / perplexity
    neox_hf generate MODEL --prompt ...              text generation
    neox_hf plot OUT                                 OUT/run.png from OUT/train_log.jsonl
    neox_hf plan RECIPE [--gpus N] [--gpu-memory GB] memory and step time per rank, every layout on N GPUs
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from pathlib import Path

from neox_hf.errors import NeoXHFError, print_to_stderr

# subcommand → (module, add-arguments function, run function, help)
_COMMANDS = {
    "convert-neox": ("neox_hf.cli", "_add_convert_neox", "_run_convert_neox", "import a GPT-NeoX-native checkpoint"),
    "continue-neox": ("neox_hf.cli", "_add_continue_neox", "_run_continue_neox",
                      "continue a GPT-NeoX run: its training checkpoint (weights, Adam, LR, data position) → a run "
                      "folder"),
    "export-neox": ("neox_hf.cli", "_add_export_neox", "_run_export_neox", "write an HF folder as a GPT-NeoX checkpoint"),
    "export": ("neox_hf.cli", "_add_export", "_run_export", "consolidate a training checkpoint into an HF folder"),
    "preprocess": ("neox_hf.cli", "_add_preprocess", "_run_preprocess", "tokenize jsonl into GPT-NeoX .bin/.idx"),
    "push": ("neox_hf.hub", "add_push_arguments", "run_push", "upload a folder to the Hugging Face Hub"),
    "merge": ("neox_hf.finetune", "add_merge_arguments", "run_merge", "merge a LoRA adapter into its base model"),
    "eval": ("neox_hf.evaluation", "add_eval_arguments", "run_eval", "loss and perplexity of a model on a file"),
    "generate": ("neox_hf.generation", "add_generate_arguments", "run_generate", "generate text with a model"),
    "batches": ("neox_hf.batches", "add_batches_arguments", "run_batches", "the batches of steps S..E in GPT-NeoX's order"),
    "plot": ("neox_hf.plot", "add_plot_arguments", "run_plot", "draw OUT/run.png: losses, LR, tokens/s, lm-eval scores"),
    "plan": ("neox_hf.plan", "add_plan_arguments", "run_plan", "memory and step time per rank of a recipe's layouts, before launch"),
}


def _add_convert_neox(parser):
    parser.add_argument("checkpoint", help="GPT-NeoX checkpoint: global_stepN/ or the folder with `latest`")
    parser.add_argument("--config", action="append", required=True,
                        help="a GPT-NeoX YAML file it was trained with (repeat --config for several, merged as GPT-NeoX does)")
    parser.add_argument("out", help="output HF folder")
    parser.add_argument("--tokenizer", default=None, help="tokenizers JSON / HF folder (default: the config's vocab_file, which must "
                             "then exist; without either, the vocabulary size comes from the checkpoint and no tokenizer "
                             "files are written)")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="allow full unpickling (RNG state, args) for checkpoint files you trust")


def _run_convert_neox(args) -> int:
    from neox_hf.interop.convert import convert_neox_checkpoint

    notices: list[str] = []
    out = convert_neox_checkpoint(args.checkpoint, args.config, args.out, tokenizer_path=args.tokenizer,
                                  trust_pickle=args.trust_pickle, notices=notices)
    for notice in notices:
        print(f"note: {notice}")
    print(f"converted {args.checkpoint} → {out}")
    return 0


def _add_continue_neox(parser):
    parser.description = (
        "Turn a GPT-NeoX training checkpoint (DeepSpeed ZeRO-1/2: global_stepN/ with its "
        "zero_pp_rank_*_optim_states.pt; sequential or pipeline layout, any tensor-parallel size) into a neox_hf run "
        "folder whose one checkpoint holds the fp32 weights, Adam's moments and step, the LR schedule at step = "
        "iteration and GPT-NeoX's data position (iteration × global batch). Continue it on any layout with "
        "`run_clm_neox.py CONFIG --output.dir RUN --resume` (docs/recipes-and-neox-configs.md).")
    parser.add_argument("checkpoint", help="GPT-NeoX checkpoint: global_stepN/ or the folder with `latest`")
    parser.add_argument("--config", action="append", required=True,
                        help="a GPT-NeoX YAML file the run was trained with (repeat for several, merged as GPT-NeoX "
                             "does); it must name the run's data")
    parser.add_argument("--out", required=True, help="the run folder to write (new or empty)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizers JSON / HF folder (default: the config's vocab_file)")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="allow full unpickling for checkpoint files you trust (default: tensors and plain data "
                             "only)")


def _run_continue_neox(args) -> int:
    from neox_hf.interop.continue_neox import continue_neox_checkpoint

    notices: list[str] = []
    folder = continue_neox_checkpoint(args.checkpoint, args.config, args.out, tokenizer_path=args.tokenizer,
                                      trust_pickle=args.trust_pickle, notices=notices)
    for notice in notices:
        print(f"note: {notice}")
    configs = " ".join(args.config)
    print(f"wrote {folder}: continue with `accelerate launch run_clm_neox.py {configs} --output.dir {args.out} "
          "--resume` (any layout: another tensor-parallel size needs --model.vocab_size as padded here, "
          "see config.json there)")
    return 0


def _add_export_neox(parser):
    parser.add_argument("hf_folder", help="the HF model folder to export (a GPTNeoX model)")
    parser.add_argument("out", help="the GPT-NeoX checkpoint folder to write")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the GPT-NeoX run that will load it")
    parser.add_argument("--step", type=int, default=0, help="the iteration the checkpoint records (global_stepN)")


def _run_export_neox(args) -> int:
    from neox_hf.interop.convert import export_hf_to_neox

    print(f"wrote {export_hf_to_neox(args.hf_folder, args.out, tp_size=args.tp, step=args.step)}")
    return 0


def _add_export(parser):
    parser.add_argument("checkpoint", help="a checkpoints/step_* folder (or checkpoints/ itself for the latest)")
    parser.add_argument("out", help="the HF model folder to write")


def _run_export(args) -> int:
    from neox_hf.interop.convert import export_training_checkpoint

    print(f"exported {args.checkpoint} → {export_training_checkpoint(args.checkpoint, args.out)}")
    return 0


def _add_preprocess(parser):
    parser.add_argument("inputs", nargs="+", help=".jsonl / .jsonl.gz / .jsonl.zst files")
    parser.add_argument("--tokenizer", required=True, help="tokenizers JSON file or HF tokenizer folder")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--text-key", default="text", help="the JSON field holding each document's text")
    parser.add_argument("--append-eod", action="store_true",
                        help="end each document with the tokenizer's eos token (as GPT-NeoX's --append-eod)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (order is kept)")
    chat = parser.add_argument_group("chat template (GPT-NeoX's preprocess_data_with_chat_template.py)")
    chat.add_argument("--chat-template", action="store_true",
                      help="render each conversation with the tokenizer's chat template and write PREFIX_KEY_document "
                           "(+ _label_document, + _reward_document) per --jsonl-keys KEY, as GPT-NeoX's script does")
    chat.add_argument("--jsonl-keys", nargs="+", default=["conversation"],
                      help="fields holding a list of {role, content} turns (default: conversation)")
    chat.add_argument("--generation-role", default="assistant", help="the role whose turns are trained")
    chat.add_argument("--only-last", action="store_true", help="train on the last turn only")
    chat.add_argument("--for-rm", action="store_true", help="label only a final EOS (reward-model data)")
    chat.add_argument("--no-mask", action="store_true", help="no label file: every token trained")
    chat.add_argument("--reward-key", default=None, help="field with a reward per conversation (KTO data)")
    chat.add_argument("--binary-reward", action="store_true", help="the reward as 1 (truthy) or -1 (falsy)")


def _run_preprocess(args) -> int:
    from neox_hf.data import write_indexed_dataset
    from neox_hf.errors import UsageError
    from neox_hf.data.tokenizer import load_tokenizer

    if args.chat_template:
        return _run_preprocess_chat(args)
    if args.workers < 1:
        raise UsageError(f"--workers must be ≥ 1, got {args.workers}")
    missing = [path for path in args.inputs if not Path(path).is_file()]
    if missing:
        raise UsageError(f"input file not found: {missing[0]}; give .jsonl / .jsonl.gz / .jsonl.zst files")
    counts: dict = {}
    bin_path, idx_path = write_indexed_dataset(args.inputs, load_tokenizer(args.tokenizer), args.output_prefix,
                                               text_key=args.text_key, append_eod=args.append_eod, workers=args.workers,
                                               counts=counts)
    print(f"wrote {bin_path} and {idx_path}: {counts.get('documents', 0)} documents"
          + (f", {counts['skipped']} skipped (no string {args.text_key!r} field)" if counts.get("skipped") else ""))
    return 0


def _run_preprocess_chat(args) -> int:
    from neox_hf.data.neox_post_training import write_chat_documents
    from neox_hf.data.tokenizer import load_tokenizer
    from neox_hf.errors import UsageError

    missing = [path for path in args.inputs if not Path(path).is_file()]
    if missing:
        raise UsageError(f"input file not found: {missing[0]}; give .jsonl files of conversations")
    written = write_chat_documents(args.inputs, load_tokenizer(args.tokenizer), args.output_prefix,
                                   keys=args.jsonl_keys, generation_role=args.generation_role,
                                   mask=not args.no_mask, only_last=args.only_last, for_rm=args.for_rm,
                                   reward_key=args.reward_key, binary_reward=args.binary_reward)
    print(f"wrote {len(written['files'])} files for {written['documents']} conversations: "
          + ", ".join(Path(f).name for f in written["files"] if f.endswith(".bin")))
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse prints the usage and then the error; the project's rule is one line naming the problem and the fix."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message}; see `{self.prog} --help`\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `neox_hf` parser. With `command`, only that subcommand's module is imported to add its arguments (the
    others are listed with their help line only): the modules import torch, transformers, peft, matplotlib, and a
    command importing all of them to build its parser paid ~16 s before `preprocess` (~8 s of imports) or `generate`
    (~13 s) started. Without it, every subcommand's arguments are added."""
    parser = _Parser(prog="neox_hf", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="train from a recipe (same as run_clm_neox.py)", add_help=False)
    for name, (module, add, _, help_text) in _COMMANDS.items():
        subparser = sub.add_parser(name, help=help_text)
        if command is None or name == command:
            getattr(importlib.import_module(module), add)(subparser)
    return parser


def train_main(argv: list[str] | None = None) -> int:
    """`run_clm_neox.py` and `neox_hf train`: parse → (print config | train). Bad input exits 2 with the message; a run
    stopped by SIGTERM / SIGUSR1 exits 75 after its checkpoint (neox_hf.train.preemption). A rank of a multi-process
    run that fails says so in one line naming itself and exits at once (docs/reliability.md)."""
    from neox_hf.recipe.args import parse_run_args

    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        from neox_hf.recipe.reference import render_train_help

        print(render_train_help(), end="")
        return 0
    try:
        args = parse_run_args(argv)
    except NeoXHFError as err:
        print_to_stderr(f"error: {err}")
        return 2
    if args.print_config:
        print(args.recipe.to_yaml(), end="")
        for notice in [*args.notices, *getattr(args.recipe, "settled_notices", [])]:
            print(f"# note: {notice}")
        print(f"# {_batch_line(args.recipe)}")
        print(f"# {_plan_line(args.recipe)}")
        return 0
    from neox_hf.plan import gpu_memory_warnings
    from neox_hf.train.loop import train
    from neox_hf.train.preemption import (PREEMPTED_EXIT_STATUS, Preempted, end_rank, lost_a_peer, rank_prefix,
                                          several_ranks)

    try:
        train(args.recipe, notices=args.notices, overwrite=args.overwrite, startup_warnings=gpu_memory_warnings)
    except Preempted as stopped:
        print_to_stderr(f"\n{rank_prefix()}{stopped}")
        return end_rank(PREEMPTED_EXIT_STATUS)
    except NeoXHFError as err:
        # A failure mid-run leaves the progress bar's line open (it ends in \r): start the error on a line of its own.
        print_to_stderr(f"\nerror: {rank_prefix()}{err}")
        return end_rank(2)
    except Exception as err:
        if not several_ranks():
            raise  # one process: the traceback, as Python ends it
        if lost_a_peer(err):  # not this rank's failure: the rank that ended has said why
            print_to_stderr(f"\n{rank_prefix()}stopped: another rank ended (its own line says why): "
                            f"{str(err).splitlines()[0][:200]}")
        else:
            traceback.print_exc()
            print_to_stderr(f"error: {rank_prefix()}{type(err).__name__}: {err}")
        return end_rank(1)
    return 0


def _batch_line(recipe) -> str:
    from neox_hf.batches import one_process_batch_line

    return one_process_batch_line(recipe)


def _plan_line(recipe) -> str:
    """`neox_hf plan`'s one line for the recipe's own layout (memory per rank), for `--print-config`."""
    from neox_hf.plan import plan_summary_line

    try:
        return plan_summary_line(recipe)
    except NeoXHFError as err:  # the config printed is still right; say why there is no plan
        return f"plan: not available for this recipe ({err})"


def main(argv: list[str] | None = None) -> int:
    """`neox_hf SUBCOMMAND ...`."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:
        return train_main(argv[1:])
    args = build_parser(argv[0] if argv and argv[0] in _COMMANDS else "").parse_args(argv)
    module, _, run, _ = _COMMANDS[args.command]
    try:
        return getattr(importlib.import_module(module), run)(args)
    except NeoXHFError as err:
        print_to_stderr(f"error: {err}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
