"""Memory per rank and step time of each parallel layout, on a ~120M-parameter GPTNeoX, on CPU (gloo).

    python benchmarks/parallel_memory.py [--steps 2] [--layers 6] [--hidden 768] [--device cpu|cuda]

    python benchmarks/parallel_memory.py --layouts "pipeline 2,pipeline 2 × TP2"   (the 1-process baseline always runs)

    python benchmarks/parallel_memory.py --context-parallel [--seq 8192]   (CP1, CP2, CP4 rows; CP1 the baseline)

Runs our training step (neox_hf.parallel: build_model → parallelize; neox_hf.ops.loss: causal_lm_loss) under
`accelerate launch` for: 1 process (no DeepSpeed), DP2 ZeRO-1/2/3, TP2 (ZeRO-1), TP2 with sequence parallelism,
TP2×DP2 (ZeRO-1, 4 processes); under torchrun the FSDP2 rows (`parallel.backend: fsdp2`: DP2, TP2 × FSDP2 DP2, HSDP
2 replicas × 2 shards; no layer/loss peaks: those call the embedding and head outside the model's forward, which
FSDP2 gathers around); and pipeline 2 / pipeline 2 × TP2 (DeepSpeed's pipeline engine through
neox_hf.engines.pipeline, PIPE_MICRO_BATCHES micro-batches of the same shape per step; ZeRO-1 as GPT-NeoX, and
without ZeRO: with one data-parallel rank ZeRO-1 shards nothing and DeepSpeed's ZeRO-1 optimizer keeps an fp32 master
copy and a flat gradient copy besides the parameters and their gradients, 24 bytes per parameter against the 16 of
one process, while without ZeRO fp32 keeps the 16), and prints per rank 0 (pipeline rows: the largest rank, since
stages differ):
- model states: bytes of every tensor alive right after backward, once optimizer states exist (parameters,
  gradients, fp32 masters, Adam moments, DeepSpeed's buckets — whatever the layout keeps; activations are freed
  by then), found by walking the live tensors and their `.grad` (a gradient autograd accumulated has no Python
  object until it is read) and counting each storage once. Measured twice: fp32, and bf16 —
  the mixed precision GPT-NeoX trains in, where the ZeRO accounting (16 bytes per parameter unsharded) applies.
  DeepSpeed keeps an fp32 master copy of the weights even when they are fp32 already, so in fp32 ZeRO-3 on 2 ranks
  holds 5 half-size copies against 4 full ones (floor 0.625×); in bf16 the floor is 8/16 = 0.5×. The bf16 pass
  uses a 1 × 8 batch (model states do not depend on it; this CPU emulates bf16 matmuls);
- parameters: bytes of the parameters this rank holds (ZeRO-3: its partition);
- layers peak: the peak bytes of tensors allocated by one forward and backward of the transformer stack (input
  embeddings → layers → final norm; every weight gradient computed, as in training, so activations are kept for
  them; counted: activations, their gradients, transients, and whatever the layout gathers on the way — ZeRO-3's
  parameters —, not the returned parameter gradients, which are model states); fp32, tracked exactly by a
  TorchDispatchMode. This is what sequence parallelism shrinks;
- loss peak: the same for the head + cross-entropy (from the last hidden state to the loss) — this is where a
  gathered-logits TP would hold [batch, seq, vocab];
- step peak: the peak of live tensor bytes over one more whole step (forward, backward, optimizer; `step_peak_bytes`,
  CPU only), next to `neox_hf plan`'s total for the same recipe (plan total);
- step time (fp32, seconds, mean of the timed steps; 2 cores shared by every rank, so not a speed claim); pipeline
  rows: one pipeline step divided by its micro-batches, so it compares with one micro-batch of the others;
- idle (pipeline rows): each stage's measured idle fraction of a step (1 − its forward and backward compute time /
  the step's time without the optimizer), next to the 1F1B bubble (p−1)/(m+p−1). On shared CPU cores the stages
  also wait for each other's compute, so this is an upper bound of what a GPU per stage would see.
Ratios are against the 1-process run of the same invocation.

`--context-parallel` prints instead the rows of context parallelism (`parallel.context_parallel`, DeepSpeed's Ulysses
attention) at a long sequence (`--seq`, default 8192) on a tiny model (2 layers × hidden 64, 8 heads, a 100-word
vocabulary padded to 128, so the loss's vocabulary-sized buffers do not hide the activations; micro batch 1): CP1 (one
process, the in-run baseline), CP2 and CP4 (2 and 4 processes, ZeRO-0), each the largest rank's
- activations peak: the peak bytes of tensors allocated by one forward and backward of the whole model on the rank's
  chunk of the sequence (embedding → layers, with their all-to-alls → final norm → fused head loss), every weight
  gradient computed but left out (a model state); fp32, tracked by the same TorchDispatchMode;
- step time of a whole training step (the engine's `train_step`), 2 shared cores: not a speed claim.

`--device cpu` (the default) hides any GPU from the ranks (CUDA_VISIBLE_DEVICES=""), so the table is the CPU/gloo
one on every machine. `--device cuda` runs one rank per GPU (NCCL): only the layouts with at most as many processes as
visible GPUs (one GPU: the 1-process row); batches are made on each rank's GPU, timed steps are bracketed by
torch.cuda.synchronize(), and model states count the tensors on the GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = [  # name, processes, zero stage, tensor parallel, sequence parallel, pipeline stages, backend, HSDP replicas
    ("1 process", 1, 0, 1, False, 1, "deepspeed", 1),
    ("DP2 ZeRO-1", 2, 1, 1, False, 1, "deepspeed", 1),
    ("DP2 ZeRO-2", 2, 2, 1, False, 1, "deepspeed", 1),
    ("DP2 ZeRO-3", 2, 3, 1, False, 1, "deepspeed", 1),
    ("DP2 FSDP2", 2, 0, 1, False, 1, "fsdp2", 1),
    ("TP2 (ZeRO-1)", 2, 1, 2, False, 1, "deepspeed", 1),
    ("TP2+SP (ZeRO-1)", 2, 1, 2, True, 1, "deepspeed", 1),
    ("TP2×DP2 ZeRO-1", 4, 1, 2, False, 1, "deepspeed", 1),
    ("TP2×FSDP2 DP2", 4, 0, 2, False, 1, "fsdp2", 1),
    ("HSDP 2×2", 4, 0, 1, False, 1, "fsdp2", 2),
    ("pipeline 2", 2, 1, 1, False, 2, "deepspeed", 1),
    ("pipeline 2 × TP2", 4, 1, 2, False, 2, "deepspeed", 1),
    ("pp2×TP2 no ZeRO", 4, 0, 2, False, 2, "deepspeed", 1),
]
MICRO_BATCH, SEQ = 2, 256
CP_SEQ, CP_LAYOUTS = 8192, (1, 2, 4)
PIPE_MICRO_BATCHES = 4


class PeakTensorBytes(TorchDispatchMode):
    """Peak bytes of tensors created inside the block and still alive (CPU has no allocator statistics).

    Every allocation and release is logged in order, so the peak can be replayed leaving some tensors out (the
    parameter gradients a backward returns: they are model states, counted in their own column)."""

    def __init__(self):
        super().__init__()
        self._events: list[tuple[int, int]] = []  # (allocation id, +bytes or -bytes)
        self._live: dict[int, int] = {}  # storage address → allocation id
        self._next_id = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Views and in-place results share an input's storage: nothing new was allocated. Skipping them also keeps
        # tensors that existed before the block (the head's weight, seen first through its `.t()` view) out of the count.
        inputs = {_address(a) for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and _address(tensor) not in inputs | {None}:
                self._track(tensor)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if key in self._live or nbytes == 0:
            return
        self._next_id += 1
        self._live[key] = self._next_id
        self._events.append((self._next_id, nbytes))
        weakref.finalize(storage, self._release, key, self._next_id, nbytes)

    def _release(self, key: int, allocation: int, nbytes: int) -> None:
        if self._live.get(key) == allocation:
            del self._live[key]
        self._events.append((allocation, -nbytes))

    def peak(self, excluding=()) -> int:
        """The peak of live bytes, leaving out the allocations that hold the (still alive) tensors `excluding`."""
        left_out = {self._live.get(t.untyped_storage().data_ptr()) for t in excluding if t is not None}
        live = peak = 0
        for allocation, delta in self._events:
            if allocation not in left_out:
                live += delta
                peak = max(peak, live)
        return peak


def _address(tensor: torch.Tensor) -> int | None:
    """Its storage's address; None for a storage FSDP2 has freed (an unsharded parameter between uses)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def live_tensor_bytes(device_type: str = "cpu") -> int:
    """Bytes of every tensor (and accumulated `.grad`) alive on devices of `device_type`, each storage once."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
            # Reading `.grad` of a leaf gives the accumulated gradient a Python object, so gc alone would miss it.
            grad = obj.grad if obj.is_leaf and obj.requires_grad else None
            for tensor in (obj, grad):
                tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP2's DTensor: its shard
                if tensor is not None and tensor.device.type == device_type:
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
        except Exception:  # half-built objects, meta tensors
            continue
    return sum(storages.values())


def step_peak_bytes(run_step, device_type: str = "cpu", left_out_bytes: int = 0) -> int:
    """Peak bytes of live tensors over one call of `run_step()` (a whole training step: forward, backward,
    optimizer): what lives before it (less `left_out_bytes`, e.g. the batch) plus the peak of what it allocates.
    This is the number a device's memory must hold, and what `neox_hf plan` predicts as `total`."""
    base = live_tensor_bytes(device_type) - left_out_bytes
    with PeakTensorBytes() as tracker:
        run_step()
    return base + tracker.peak()


def layers_peak(module, batch: dict) -> int:
    """Peak bytes allocated by forward + backward of the transformer stack, from the input embeddings to the final
    norm's output, every weight gradient computed as in training (but not kept: they are model states)."""
    with torch.no_grad():
        embeds = module.get_input_embeddings()(batch["input_ids"])
    embeds.requires_grad_(True)
    upstream = torch.ones_like(embeds)  # the final hidden state's shape; made outside the measured block
    weights = _trainable(module.base_model)
    with PeakTensorBytes() as tracker:
        hidden = module.base_model(inputs_embeds=embeds, use_cache=False).last_hidden_state
        grads = torch.autograd.grad(hidden, [embeds, *weights], grad_outputs=upstream, allow_unused=True)
        return tracker.peak(excluding=grads[1:])


def loss_computation_peak(module, batch: dict) -> int:
    """Peak bytes of the head + cross-entropy, forward and backward to the hidden states and the head's weight (not
    kept: a model state)."""
    from neox_hf.ops.loss import head_loss

    with torch.no_grad():
        hidden = module.base_model(input_ids=batch["input_ids"], use_cache=False).last_hidden_state
    hidden.requires_grad_(True)
    weights = _trainable(module.get_output_embeddings())
    with PeakTensorBytes() as tracker:
        loss_sum, _ = head_loss(module.get_output_embeddings(), hidden, batch["labels"])
        grads = torch.autograd.grad(loss_sum, [hidden, *weights])
        return tracker.peak(excluding=grads[1:])


def activations_peak(model, batch: dict) -> int:
    """Peak bytes allocated by one forward and backward of the whole model on `batch` (a context-parallel rank's
    chunk: its all-to-alls included), weight gradients computed as in training but left out (model states)."""
    from neox_hf.ops.loss import causal_lm_loss

    weights = _trainable(getattr(model, "module", model))
    with PeakTensorBytes() as tracker:
        loss_sum, _ = causal_lm_loss(model, batch)
        grads = torch.autograd.grad(loss_sum, weights, allow_unused=True)
        return tracker.peak(excluding=grads)


def word_tokenizer(folder: Path) -> Path:
    """A 100-word word-level tokenizer with GPT-NeoX's special tokens at ids 0 and 1 (vocabulary padded to 128)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "<|padding|>": 1, **{f"w{i}": i for i in range(2, 100)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = folder / "words.json"
    tokenizer.save(str(path))
    return path


def context_parallel_recipe(cp: int, seq: int, ring: bool = False) -> dict:
    parallel = ({"backend": "fsdp2", "context_parallel": cp} if ring else
                {"zero_stage": 0, "use_deepspeed": cp > 1, "context_parallel": cp})
    return {
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 8, "seq_length": seq},
        "tokenizer": {"path": str(word_tokenizer(Path(tempfile.mkdtemp())))},
        "parallel": parallel,
        "train": {"micro_batch_size": 1, "precision": "fp32"},
        "output": {"dir": tempfile.mkdtemp(), "tensorboard": False},
    }


def context_parallel_worker(args) -> None:
    """One CP row: the activations peak of this rank's chunk and the step time, the largest over ranks."""
    import torch.distributed as dist

    from neox_hf.data.tokenizer import load_tokenizer
    from neox_hf.engines import build_engine
    from neox_hf.parallel.accelerator import build_accelerator
    from neox_hf.parallel.layout import build_layout
    from neox_hf.recipe import recipe_from_dict

    recipe = recipe_from_dict(context_parallel_recipe(args.cp, args.seq, ring=args.backend == "fsdp2"))
    accelerator = build_accelerator(recipe)
    layout = build_layout(recipe.parallel)
    engine = build_engine(recipe, accelerator, layout)
    model, _ = engine.parallelize(engine.build_model(load_tokenizer(recipe.tokenizer.path)))
    ids = torch.randint(2, 100, (1, args.seq + 1), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    peaks, timings = [], []
    for step in range(args.steps + 1):
        start = time.perf_counter()
        engine.train_step([batch])
        if step > 0:  # the first step allocates optimizer states
            timings.append(time.perf_counter() - start)
        peaks.append(activations_peak(model, engine.local_chunks([batch])[0]))
    mine = {"activations_peak": max(peaks), "step_s": sum(timings) / len(timings),
            "tokens_per_rank": engine.local_chunks([batch])[0]["input_ids"].shape[1]}
    ranks = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    if accelerator.is_main_process:
        Path(args.out).write_text(json.dumps({key: max(r[key] for r in ranks) for key in mine}))
    accelerator.wait_for_everyone()


def run_context_parallel(cp: int, args, ring: bool = False) -> dict:
    """One row: Ulysses on DeepSpeed under accelerate launch, or (`ring`) torch's ring attention on FSDP2 under
    torchrun (FSDP2 needs a process group even for one process)."""
    out = Path(tempfile.mkdtemp()) / "result.json"
    worker_args = ["--worker", "--cp", str(cp), "--seq", str(args.seq), "--steps", str(args.steps), "--out", str(out),
                   "--backend", "fsdp2" if ring else "deepspeed"]
    if ring:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(cp),
                   __file__, *worker_args]
    elif cp == 1:
        command = [sys.executable, __file__, *worker_args]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(cp), "--num_machines",
                   "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--use_deepspeed", "--zero_stage", "0",
                   "--main_process_port", str(free_port()), __file__, *worker_args]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(command, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"context parallel {cp}{' (ring)' if ring else ''} failed:\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def print_context_parallel_table(results: dict, seq: int) -> None:
    base, mib = results[1], 2**20
    print(f"GPTNeoX 2 layers × hidden 64, 8 heads, vocab 128, micro batch 1 × {seq} tokens, fp32, CPU/gloo; "
          "the largest rank, MiB (ratio vs CP1)")
    header = f"| {'layout':14} | {'tokens/rank':>11} | {'activations peak':>22} | {'step s':>6} |"
    print(header)
    print("|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|")
    for name, r in results.items():
        ratio = r["activations_peak"] / base["activations_peak"]
        cell = f"{r['activations_peak'] / mib:12.1f} ({ratio:5.2f})"
        print(f"| {_row_name(name):14} | {r['tokens_per_rank']:>11} | {cell:>22} | {r['step_s']:6.2f} |")
    for name, r in results.items():
        target = {2: 0.6, 4: 0.35}.get(name if isinstance(name, int) else name[1])
        if target is not None:
            ratio = r["activations_peak"] / base["activations_peak"]
            print(f"{_row_name(name)} activations per rank ≤ {target}× CP1: {ratio:.2f} — "
                  f"{'met' if ratio <= target else 'NOT met'}")


def _row_name(name) -> str:
    """CPn: Ulysses on DeepSpeed; ("ring", n): torch's ring attention on FSDP2."""
    return f"CP{name}" if isinstance(name, int) else f"ring CP{name[1]} FSDP2"


def _trainable(module) -> list:
    return [p for p in module.parameters() if p.requires_grad]


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued kernels before reading the clock (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rank_parameter_bytes(model) -> int:
    module = getattr(model, "module", model)

    def held(p):  # ZeRO-3's partition, FSDP2's shard
        return p.ds_tensor if hasattr(p, "ds_tensor") else p.to_local() if hasattr(p, "to_local") else p

    return sum(held(p).numel() * p.element_size() for p in module.parameters())


def layout_recipe(processes: int, zero: int, tp: int, sp: bool, pp: int, layers: int, hidden: int, micro_batch: int,
                  precision: str, backend: str = "deepspeed", replicate: int = 1) -> dict:
    """The recipe a layout row trains (and `neox_hf plan` plans)."""
    sharding = ({"backend": "fsdp2", "dp_replicate": replicate} if backend == "fsdp2" else
                {"zero_stage": zero, "use_deepspeed": processes > 1})
    return {
        "model": {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": 12, "seq_length": SEQ},
        "tokenizer": {"path": str(REPO / "examples/data/gpt-neox-20b-tokenizer.json")},
        "parallel": {**sharding, "tensor_parallel": tp, "sequence_parallel": sp, "pipeline_parallel": pp},
        "train": {"micro_batch_size": micro_batch, "precision": precision,
                  "gradient_accumulation_steps": PIPE_MICRO_BATCHES if pp > 1 else 1},
        "output": {"dir": tempfile.mkdtemp(), "tensorboard": False},
    }


def planned_total(processes: int, zero: int, tp: int, sp: bool, pp: int, args, backend: str = "deepspeed",
                  replicate: int = 1) -> int:
    """`neox_hf plan`'s peak bytes of the largest rank for the fp32 row (tests/test_plan.py holds it to measurement)."""
    from neox_hf.plan import plan_for_recipe
    from neox_hf.recipe import recipe_from_dict

    recipe = recipe_from_dict(layout_recipe(processes, zero, tp, sp, pp, args.layers, args.hidden, MICRO_BATCH, "fp32",
                                            backend, replicate))
    return plan_for_recipe(recipe, gpus=processes).recipe_layout.largest_stage.total


def worker(args) -> None:
    from neox_hf.data.tokenizer import load_tokenizer
    from neox_hf.parallel.accelerator import build_accelerator
    from neox_hf.engines import build_engine
    from neox_hf.parallel.layout import build_layout
    from neox_hf.recipe import recipe_from_dict
    from neox_hf.ops.loss import causal_lm_loss

    recipe = recipe_from_dict(layout_recipe(args.processes, args.zero, args.tp, args.sequence_parallel, args.pp,
                                            args.layers, args.hidden, args.micro_batch, args.precision, args.backend,
                                            args.dp_replicate))
    accelerator = build_accelerator(recipe)
    tokenizer = load_tokenizer(recipe.tokenizer.path)
    if args.pp > 1:
        return pipeline_worker(args, recipe, accelerator, tokenizer)
    layout = build_layout(recipe.parallel)
    engine = build_engine(recipe, accelerator, layout)
    model, optimizer = engine.parallelize(engine.build_model(tokenizer))
    generator = torch.Generator().manual_seed(0)
    module = getattr(model, "module", model)
    device = accelerator.device
    timings, loss_peaks, layer_peaks = [], [], []
    for step in range(args.steps + 1):
        # The same tokens on every device (one seeded CPU generator), moved before the clock starts.
        ids = torch.randint(2, 50000, (args.micro_batch, args.seq + 1), generator=generator).to(device)
        batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
        synchronize(device)
        start = time.perf_counter()
        with accelerator.autocast():
            loss_sum, tokens = causal_lm_loss(model, batch)
            loss = loss_sum / tokens
        accelerator.backward(loss)
        synchronize(device)
        elapsed = time.perf_counter() - start
        del loss, loss_sum
        if step == args.steps:  # optimizer states exist from the first step on; gradients are alive now
            # the batch is not a model state
            model_states = live_tensor_bytes(device.type) - ids.untyped_storage().nbytes()
        start = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        synchronize(device)
        if step > 0:  # the first step allocates optimizer states
            timings.append(elapsed + time.perf_counter() - start)
        if args.peaks:
            loss_peaks.append(loss_computation_peak(module, batch))
            layer_peaks.append(layers_peak(module, batch))

    def one_step():
        with accelerator.autocast():
            loss_sum, tokens = causal_lm_loss(model, batch)
        accelerator.backward(loss_sum / tokens)
        optimizer.step()
        optimizer.zero_grad()

    peak = step_peak_bytes(one_step, device.type, ids.untyped_storage().nbytes()) if device.type == "cpu" else 0
    result = {"model_states": model_states, "parameters": rank_parameter_bytes(model),
              "loss_peak": max(loss_peaks, default=0), "layers_peak": max(layer_peaks, default=0),
              "step_peak": peak, "step_s": sum(timings) / len(timings)}
    if accelerator.is_main_process:
        Path(args.out).write_text(json.dumps(result))
    accelerator.wait_for_everyone()


def pipeline_worker(args, recipe, accelerator, tokenizer) -> None:
    """The pipeline rows: the same model as stages of DeepSpeed's pipeline engine; per-rank results, worst reported."""
    import torch.distributed as dist

    from neox_hf.model.vocab import padded_vocab_size
    from neox_hf.model import config_from_recipe
    from neox_hf.parallel.layout import build_layout
    from neox_hf.engines.pipeline import build_pipeline_module, pipeline_train_step
    from neox_hf.engines.optimizer import build_optimizer

    layout = build_layout(recipe.parallel)
    vocab = padded_vocab_size(len(tokenizer), recipe.model.make_vocab_size_divisible_by, layout.tp)
    config = config_from_recipe(recipe.model, vocab_size=vocab)
    module = build_pipeline_module(config, layout, partition_method=recipe.parallel.pipe_partition_method)
    engine, optimizer = accelerator.prepare(module, build_optimizer(module, recipe.train))
    compute, measured = {"s": 0.0, "optimizer": 0.0}, {}
    from deepspeed.runtime.pipe import schedule

    def before_optimizer_step():
        if "model_states" not in measured and measured.get("measure"):  # gradients alive, states exist
            measured["model_states"] = live_tensor_bytes(engine.device.type) - measured["batch_bytes"]

    # The engine runs its schedule through a class-level instruction → function map: time them on this instance.
    instructions = dict(type(engine)._INSTRUCTION_MAP)
    instructions[schedule.ForwardPass] = _timed(instructions[schedule.ForwardPass], compute, "s")
    instructions[schedule.BackwardPass] = _timed(instructions[schedule.BackwardPass], compute, "s")
    instructions[schedule.OptimizerStep] = _timed(instructions[schedule.OptimizerStep], compute, "optimizer",
                                                  before=before_optimizer_step)
    engine._INSTRUCTION_MAP = instructions
    generator = torch.Generator().manual_seed(0)
    timings, idle = [], []
    for step in range(args.steps + 1):
        ids = torch.randint(2, 50000, (PIPE_MICRO_BATCHES, args.micro_batch, args.seq + 1), generator=generator)
        ids = ids.to(engine.device)
        batches = [{"input_ids": ids[i, :, :-1], "labels": ids[i, :, 1:]} for i in range(PIPE_MICRO_BATCHES)]
        measured.update(measure=step == args.steps, batch_bytes=ids.untyped_storage().nbytes())
        compute.update(s=0.0, optimizer=0.0)
        synchronize(engine.device)
        start = time.perf_counter()
        pipeline_train_step(engine, batches, layout, recipe)
        synchronize(engine.device)
        elapsed = time.perf_counter() - start
        if step > 0:  # the first step allocates optimizer states
            timings.append(elapsed / PIPE_MICRO_BATCHES)
            idle.append(1 - compute["s"] / (elapsed - compute["optimizer"]))
    peak = step_peak_bytes(lambda: pipeline_train_step(engine, batches, layout, recipe), engine.device.type,
                           ids.untyped_storage().nbytes()) if engine.device.type == "cpu" else 0
    mine = {"model_states": measured["model_states"], "parameters": rank_parameter_bytes(engine), "step_peak": peak,
            "step_s": sum(timings) / len(timings), "idle": sum(idle) / len(idle), "stage": layout.pp_rank}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if accelerator.is_main_process:
        stages = {r["stage"]: r["idle"] for r in ranks if r is not None}
        result = {key: max(r[key] for r in ranks) for key in ("model_states", "parameters", "step_peak", "step_s")}
        result.update(idle=[stages[s] for s in sorted(stages)], stages=layout.pp, micro_batches=PIPE_MICRO_BATCHES)
        Path(args.out).write_text(json.dumps(result))
    accelerator.wait_for_everyone()


def _timed(function, totals: dict, key: str, before=None):
    def timed(self, **kwargs):
        if before is not None:
            before()
        synchronize(self.device)
        start = time.perf_counter()
        out = function(self, **kwargs)
        synchronize(self.device)
        totals[key] += time.perf_counter() - start
        return out

    return timed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(processes: int, zero: int, tp: int, sp: bool, pp: int, args, precision: str = "fp32",
               backend: str = "deepspeed", replicate: int = 1) -> dict:
    out = Path(tempfile.mkdtemp()) / "result.json"
    # the layer/loss peaks call the embedding and head on their own: a whole model's (FSDP2 gathers around forwards)
    peaks = ["--peaks"] if pp == 1 and backend != "fsdp2" else []
    shape = ["--micro-batch", str(MICRO_BATCH), "--seq", str(SEQ), *peaks] if precision == "fp32" else \
        ["--micro-batch", "1", "--seq", "8"]
    worker_args = ["--worker", "--processes", str(processes), "--zero", str(zero), "--tp", str(tp), "--out", str(out),
                   "--pp", str(pp),
                   "--steps", str(args.steps if precision == "fp32" else 1), "--layers", str(args.layers),
                   "--hidden", str(args.hidden), "--precision", precision, *shape,
                   *(["--sequence-parallel"] if sp else []), "--device", args.device, "--backend", backend,
                   "--dp-replicate", str(replicate)]
    mixed = {"fp32": "no", "bf16": "bf16"}[precision]
    if processes == 1:
        command = [sys.executable, __file__, *worker_args]
    elif backend == "fsdp2":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
                   __file__, *worker_args]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes), "--num_machines", "1",
                   "--mixed_precision", mixed, "--dynamo_backend", "no", "--use_deepspeed", "--zero_stage", str(zero),
                   "--main_process_port", str(free_port()), __file__, *worker_args]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # else Accelerate maps every rank to cuda:0 and NCCL refuses the duplicates
    done = subprocess.run(command, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"layout processes={processes} zero={zero} tp={tp} sp={sp} pp={pp} {precision} failed:\n"
                         f"{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--zero", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    parser.add_argument("--micro-batch", type=int, default=MICRO_BATCH, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, default=SEQ, help=argparse.SUPPRESS)
    parser.add_argument("--peaks", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sequence-parallel", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="deepspeed", help=argparse.SUPPRESS)
    parser.add_argument("--dp-replicate", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--layouts", default="", help="comma-separated layout names to run (default: all)")
    parser.add_argument("--cp", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--context-parallel", action="store_true",
                        help=f"the CP1 / CP2 / CP4 rows at --seq (default {CP_SEQ}) instead of the layouts")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: every rank on CPU/gloo, GPUs hidden; cuda: one GPU per rank (layouts that fit)")
    args = parser.parse_args()
    if args.worker and args.cp:
        return context_parallel_worker(args)
    if args.worker:
        return worker(args)
    if args.context_parallel:
        seq = args.seq if args.seq != SEQ else CP_SEQ
        args.seq = seq
        rows = {cp: run_context_parallel(cp, args) for cp in CP_LAYOUTS}
        rows.update({("ring", cp): run_context_parallel(cp, args, ring=True) for cp in CP_LAYOUTS if cp > 1})
        return print_context_parallel_table(rows, seq)
    chosen = {n.strip() for n in args.layouts.split(",") if n.strip()}
    unknown = chosen - {layout[0] for layout in LAYOUTS}
    if unknown:
        raise SystemExit(f"unknown layouts {sorted(unknown)}; choose from {[layout[0] for layout in LAYOUTS]}")
    gpus = torch.cuda.device_count() if args.device == "cuda" else None
    if gpus == 0:
        raise SystemExit("--device cuda: torch sees no CUDA GPU here")
    too_large = [name for name, processes, *_ in LAYOUTS if gpus is not None and processes > gpus
                 and (not chosen or name in chosen)]
    if too_large:
        print(f"left out on {gpus} GPU(s), one rank per GPU: {', '.join(too_large)}")
    results = {}
    for name, processes, zero, tp, sp, pp, backend, replicate in LAYOUTS:
        if chosen and name not in chosen and name != "1 process" or name in too_large:
            continue
        sharding = {"backend": backend, "replicate": replicate}
        results[name] = run_layout(processes, zero, tp, sp, pp, args, **sharding)
        results[name]["model_states_bf16"] = run_layout(processes, zero, tp, sp, pp, args, "bf16",
                                                        **sharding)["model_states"]
        results[name]["plan_total"] = planned_total(processes, zero, tp, sp, pp, args, **sharding)
    print_table(results, args)


def print_table(results: dict, args) -> None:
    base = results["1 process"]
    mib = 2**20
    columns = [("model states fp32", "model_states"), ("model states bf16", "model_states_bf16"),
               ("params fp32", "parameters"), ("layers peak fp32", "layers_peak"),
               ("loss peak fp32", "loss_peak"), ("step peak fp32", "step_peak"), ("plan total fp32", "plan_total")]
    where = "CPU/gloo" if args.device == "cpu" else f"{torch.cuda.get_device_name()}/NCCL"
    print(f"GPTNeoX {args.layers} layers × hidden {args.hidden}, vocab 50304, micro batch {MICRO_BATCH} × {SEQ}, AdamW, "
          f"{where}; per rank 0, MiB (ratio vs 1 process)")
    header = f"| {'layout':16} | " + " | ".join(f"{title:>22}" for title, _ in columns) + f" | {'step s':>6} |"
    print(header)
    print("|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|")
    for name, r in results.items():
        cells = [f"{r[key] / mib:12.1f} ({r[key] / base[key]:5.2f})" if r.get(key) else "–" for _, key in columns]
        print(f"| {name:16} | " + " | ".join(f"{c:>22}" for c in cells) + f" | {r['step_s']:6.2f} |")
    for name, r in results.items():
        if "idle" in r:
            bubble = (r["stages"] - 1) / (r["micro_batches"] + r["stages"] - 1)
            print(f"{name}: measured idle fraction per stage " + ", ".join(f"{x:.2f}" for x in r["idle"])
                  + f" vs 1F1B bubble (p−1)/(m+p−1) = {bubble:.2f} (p={r['stages']}, m={r['micro_batches']})")
    checks = []
    if "pipeline 2" in results:
        checks.append(("pipeline 2 parameters per rank ≤ 0.55× one process",
                       results["pipeline 2"]["parameters"] / base["parameters"], 0.55))
    if "pp2×TP2 no ZeRO" in results:
        checks.append(("pipeline 2 × TP2 model states per rank ≤ 0.3× one process (fp32, no ZeRO)",
                       results["pp2×TP2 no ZeRO"]["model_states"] / base["model_states"], 0.3))
    for label, ratio, target in checks + _layout_checks(results, base):
        print(f"{label}: {ratio:.2f} — {'met' if ratio < target else 'NOT met'}")


def _layout_checks(results: dict, base: dict) -> list:
    if not {"DP2 ZeRO-3", "TP2 (ZeRO-1)", "TP2+SP (ZeRO-1)"} <= set(results):
        return []
    zero3, tp2, sp = results["DP2 ZeRO-3"], results["TP2 (ZeRO-1)"], results["TP2+SP (ZeRO-1)"]
    return [
        ("ZeRO-3 DP2 model states ≤ 0.6× one process (bf16)", zero3["model_states_bf16"] / base["model_states_bf16"], 0.6),
        # fp32: DeepSpeed's fp32 master copy beside fp32 weights makes 5 half-size copies against 4 whole ones, so
        # 0.625 is the floor and the target sits just above it
        ("ZeRO-3 DP2 model states ≤ 0.65× one process (fp32; floor 0.625, see docstring)",
         zero3["model_states"] / base["model_states"], 0.65),
        ("TP2 parameters ≤ 0.55× TP1", tp2["parameters"] / base["parameters"], 0.55),
        ("TP2 loss peak ≤ 0.6× TP1", tp2["loss_peak"] / base["loss_peak"], 0.6),
        ("TP2+SP layers peak < TP2 (sequence parallelism)", sp["layers_peak"] / tp2["layers_peak"], 1.0),
    ]


if __name__ == "__main__":
    main()
