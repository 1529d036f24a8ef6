"""`neox_hf batches`: the global batches of a step range in GPT-NeoX's order, as an int64 array (or text).

    neox_hf batches CONFIG [--data-path PREFIX] [--vocab-file TOKENIZER] [--order gpt-neox|preshuffled]
                    --data-parallel N --start-step S --end-step E --output F.npy [--decode]

Row i of the output is sample S × global_batch + i, seq_length + 1 tokens, global_batch = micro batch ×
accumulation × N: the rows of step s are [(s − S) × global_batch, (s − S + 1) × global_batch). Within a step, the
micro-steps follow each other and in each, data-parallel rank r reads its contiguous slice — exactly the rows the
training loader gives rank r (tests/test_neox_order.py checks it). For interpretability / memorisation studies that
index Pythia's or a GPT-NeoX run's data by step.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from neox_hf.errors import DataError


def add_batches_arguments(parser) -> None:
    parser.add_argument("config", nargs="+", help="GPT-NeoX YAML file(s) (merged as GPT-NeoX does) or our recipe")
    parser.add_argument("--data-path", default=None,
                        help="a .bin/.idx prefix replacing the config's data (GPT-NeoX data_path: split by data.split)")
    parser.add_argument("--vocab-file", default=None, help="tokenizer for --decode (default: the config's)")
    parser.add_argument("--order", choices=["gpt-neox", "preshuffled"], default=None,
                        help="gpt-neox (default): GPT-NeoX's index; preshuffled: Pythia's pre-shuffled rows in order")
    parser.add_argument("--data-parallel", type=int, required=True, help="data-parallel size of the run")
    parser.add_argument("--start-step", type=int, required=True, help="first step written")
    parser.add_argument("--end-step", type=int, required=True, help="first step not written")
    parser.add_argument("--output", required=True, help=".npy file: int64 [steps × global batch, seq_length + 1]")
    parser.add_argument("--decode", action="store_true", help="also print every row as text")


def recipe_for_batches(configs: list[str], data_path: str | None, vocab_file: str | None, order: str | None = None):
    """The recipe the configs describe, with --data-path / --vocab-file applied and GPT-NeoX's order selected.

    --data-path and the order go in as command-line overrides (`--data.sources`, `--data.order`), so the config's data
    keys (`split`, the seed, the pack implementation) apply to the path given here exactly as to the data a config
    names, through the one route `run_clm_neox.py CONFIG --data.sources ...` takes too."""
    import json

    from neox_hf.recipe.args import parse_run_args

    files = list(configs)
    chosen = order or parse_run_args(files).recipe.data.order
    chosen = "gpt-neox" if chosen == "stream" else chosen
    overrides = ["--data.order", chosen]
    if data_path is not None:
        overrides += ["--data.sources", json.dumps([{"path": data_path, "format": "indexed"}])]
    if chosen == "preshuffled":
        overrides += ["--data.split", "null"]  # the rows are the order; nothing is split
    if vocab_file is not None:
        overrides += ["--tokenizer.path", json.dumps(vocab_file)]
    recipe = parse_run_args(files + overrides).recipe
    if not recipe.data.sources:
        raise DataError("no data: the config names no data_path / train_data_paths; pass --data-path PREFIX")
    return recipe


def step_batches(recipe, data_parallel: int, start_step: int, end_step: int, out: np.ndarray | None = None
                 ) -> np.ndarray:
    """int64 [(end − start) × global batch, seq_length + 1]: the samples of steps [start, end) in training order,
    written into `out` when given (a memory-mapped .npy: the rows need not fit in memory)."""
    from neox_hf.data.neox_order import BatchLayout, split_samples

    t, m = recipe.train, recipe.model
    _check_step_range(data_parallel, start_step, end_step)
    check_data_parallel_keeps_batch(recipe, data_parallel)
    layout = BatchLayout(t.micro_batch_size, t.gradient_accumulation_steps, data_parallel)
    samples = split_samples(recipe.data, "train", seq_length=m.seq_length, train_iters=t.train_iters, layout=layout,
                            eval_interval=t.eval_interval, eval_iters=t.eval_iters, seed=recipe.data.seed)
    ids = layout.step_sample_ids(start_step, end_step, len(samples))
    if out is None:
        out = np.empty((len(ids), m.seq_length + 1), dtype=np.int64)
    for row, i in enumerate(ids):
        out[row] = samples[int(i)][0]
    return out


def check_data_parallel_keeps_batch(recipe, data_parallel: int) -> None:
    """A config's train_batch_size (GPT-NeoX's) holds for the batches as for the launch: refuse a --data-parallel
    at which micro × accumulation misses it (GPT-NeoX's run never had those steps)."""
    from neox_hf.errors import UsageError
    from neox_hf.recipe import accumulation_for_train_batch, data_parallel_for_train_batch, train_batch_disagreement

    t = recipe.train
    disagreement = train_batch_disagreement(t, data_parallel)
    if disagreement is None:
        return
    fixes = [f"pass --data-parallel {data_parallel_for_train_batch(t)}"]
    accumulation = accumulation_for_train_batch(t, data_parallel)
    if accumulation is not None:
        fixes.append(f"add a recipe file with `train: {{gradient_accumulation_steps: {accumulation}}}` after the "
                     "config (as the run passed --train.gradient_accumulation_steps)")
    raise UsageError(f"--data-parallel {data_parallel}: {disagreement}: {', or '.join(fixes)}")


def _check_step_range(data_parallel: int, start_step: int, end_step: int) -> None:
    if data_parallel < 1 or not 0 <= start_step < end_step:
        raise DataError(f"need --data-parallel ≥ 1 and 0 ≤ --start-step < --end-step, got {data_parallel}, "
                        f"{start_step}, {end_step}")


def output_shape(recipe, data_parallel: int, start_step: int, end_step: int) -> tuple[int, int]:
    """(rows, tokens per row) of the steps' array, from the recipe alone: nothing is read or allocated."""
    t = recipe.train
    global_batch = t.micro_batch_size * t.gradient_accumulation_steps * data_parallel
    return (end_step - start_step) * global_batch, recipe.model.seq_length + 1


def _check_room(shape: tuple[int, int], folder: Path, start_step: int, end_step: int) -> None:
    """The array goes straight to disk (a memory-mapped .npy), so the disk, not memory, must hold it: refuse a range
    that does not fit before any index is built (a far end step was OOM-killed without a word)."""
    import shutil

    need = shape[0] * shape[1] * 8
    free = shutil.disk_usage(folder).free
    if need <= free:
        return
    per_step = need // (end_step - start_step)
    fits = free // per_step
    advice = f"at most {fits} steps fit: --end-step {start_step + fits}" if fits else "free some space"
    raise DataError(f"steps [{start_step}, {end_step}) are {shape[0]:,} samples of {shape[1]} tokens, "
                    f"{need / 2**30:,.1f} GiB as int64, more than the {free / 2**30:,.1f} GiB free in {folder}; "
                    f"write fewer steps per call ({advice})")


def run_batches(args) -> int:
    recipe = recipe_for_batches(args.config, args.data_path, args.vocab_file, args.order)
    _check_step_range(args.data_parallel, args.start_step, args.end_step)
    check_data_parallel_keeps_batch(recipe, args.data_parallel)
    shape = output_shape(recipe, args.data_parallel, args.start_step, args.end_step)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    _check_room(shape, output.parent, args.start_step, args.end_step)
    tmp = output.with_name(output.name + ".tmp")
    try:
        rows = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.int64, shape=shape)
        step_batches(recipe, args.data_parallel, args.start_step, args.end_step, out=rows)
        rows.flush()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, output)
    global_batch = len(rows) // (args.end_step - args.start_step)
    print(f"wrote {output}: steps [{args.start_step}, {args.end_step}), {global_batch} samples per step, "
          f"{rows.shape[1]} tokens per sample")
    if args.decode:
        from neox_hf.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(recipe.tokenizer.path)
        for row, tokens in enumerate(rows):
            step, index = divmod(row, global_batch)
            print(f"--- step {args.start_step + step} sample {index}\n{tokenizer.decode(tokens.tolist())}")
    return 0


def one_process_batch_line(recipe) -> str:
    """`--print-config`'s line on the batch a launch of one data-parallel rank trains (one process where the layout
    is one process): micro batch × accumulation, and where the recipe's train_batch_size (GPT-NeoX's) needs another
    data-parallel size, GPT-NeoX's refusal and the size it runs on. The printed recipe is the same at any launch; its
    data-parallel size is the launch's, so this says which launch the numbers describe."""
    from neox_hf.recipe import data_parallel_for_train_batch, train_batch_disagreement

    t, p = recipe.train, recipe.parallel
    need = p.pipeline_parallel * p.tensor_parallel * getattr(p, "context_parallel", 1)
    launch = "a one-process launch" if need == 1 else f"the smallest launch of this layout ({need} processes)"
    line = (f"batch on {launch}: micro batch {t.micro_batch_size} × gradient_accumulation_steps "
            f"{t.gradient_accumulation_steps} × 1 data-parallel rank = {t.micro_batch_size * t.gradient_accumulation_steps}"
            " samples per step")
    disagreement = train_batch_disagreement(t, 1)
    if disagreement is not None:
        replicas = data_parallel_for_train_batch(t)
        line += f"; {disagreement} there (it runs on {replicas} data-parallel ranks: {replicas * need} processes)"
    return line
