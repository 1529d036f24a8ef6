"""Where a training step's time goes, neox_hf against its peer in the same run: a torch.profiler table by category.

    python benchmarks/step_profile.py                          # GSM8K peer: Trainer + group_by_length vs neox_hf pad
    python benchmarks/step_profile.py --precision bf16         # the AMX question of issue 25
    python benchmarks/step_profile.py --precision bf16 --top 15   # and the 15 costliest ops of each run
    python benchmarks/step_profile.py --peer stock --shape 160m --batch 8 --seq 2048   # GPU: stock loop vs neox_hf

The peers are the other benchmarks' own runs, unchanged: `--peer trainer` is benchmarks/padding.py's baseline
(transformers `Trainer`, pad to longest, `group_by_length`, Pythia-14M shape, GSM8K) against its neox_hf pad row;
`--peer stock` is benchmarks/train_throughput.py's stock `GPTNeoXForCausalLM` + PyTorch loop against `train(recipe)`.
torch.profiler is stepped by the same global optimizer-step hook that times them (bench_common.StepClock), so the
first --warmup steps (set-up included) are left out and --steps steps are recorded.

Each op's *self* time (CPU time on a CPU; on a GPU the kernel time of the ops that launched it, plus a CPU column)
goes to one category, the first that applies: under `Optimizer.step` / `zero_grad` → optimizer; under the Trainer's
DataLoader → data (neox_hf's batches come from its prefetch thread, which torch.profiler does not record: the time
the step waited for them is in "host, outside ops", and in `data_wait_s` of train_log.jsonl); then by op name (matmul, attention, loss, embedding,
grad-norm clip, dtype casts, other ops). "host, outside ops" is the self time of the profiler's step record: the
step's time in no op (Python, the framework, waiting for data or the device); on a GPU its first column is the
step's wall time less its kernel time: the GPU idle, waiting for the host. On a CPU the table says what is left once matmuls are fast (AMX bf16); on a GPU,
whether the gap to the peer is kernels or host time. The last rows count the aten ops the Python code called per
step (each costs host time to dispatch; on a GPU each launches kernels) and, on a GPU, the kernel launches. Nothing
here is asserted by the tests.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_common import StepClock, device_name  # noqa: E402

HOST_SYNCS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "cudaStreamSynchronize",
              "cudaDeviceSynchronize", "cudaEventSynchronize"}
SDPA_BACKENDS = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"}

# Op names (aten:: stripped) by category. The fused loss's own matmuls count as matmul, its exp/logsumexp as loss.
CATEGORY_OPS = {
    "matmul": {"mm", "addmm", "addmm_", "bmm", "baddbmm", "matmul", "linear", "_addmm_activation", "addbmm", "dot", "mv"},
    "attention": {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_cudnn_attention",
                  "_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
                  "_efficient_attention_backward", "_scaled_dot_product_flash_attention_backward",
                  "_scaled_dot_product_efficient_attention_backward", "_softmax", "_softmax_backward_data"},
    "loss": {"log_softmax", "_log_softmax", "_log_softmax_backward_data", "nll_loss", "nll_loss_forward",
             "nll_loss_backward", "nll_loss_nd", "cross_entropy_loss", "logsumexp", "exp", "exp_", "gather",
             "scatter_add_", "scatter_add", "amax", "max"},
    "embedding": {"embedding", "embedding_backward", "embedding_dense_backward", "index_select", "index_add_",
                  "_embedding_bag", "embedding_dense_backward_cpu"},
    "grad-norm clip": {"_foreach_norm", "linalg_vector_norm", "_foreach_mul_", "clip_grad_norm_", "norm"},
    "dtype casts / copies": {"_to_copy", "copy_", "to", "clone", "contiguous", "_copy_from_and_resize",
                             "_copy_from"},
}
OPTIMIZER_MARKS = ("Optimizer.step", "Optimizer.zero_grad")
DATA_MARKS = ("enumerate(DataLoader)",)
ORDER = ["matmul", "attention", "loss", "embedding", "optimizer", "grad-norm clip", "dtype casts / copies",
         "other ops", "data", "host, outside ops"]


def _names_up(event) -> list[str]:
    """The names of `event` and of every record above it, innermost first."""
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names


def _under_op(event) -> bool:
    """Whether an aten op was called by another aten op (counted once, as the op the Python code called)."""
    return any(name.startswith("aten::") for name in _names_up(event.cpu_parent))


def category(event) -> str:
    names = _names_up(event)
    if any(n.startswith(OPTIMIZER_MARKS) for n in names):
        return "optimizer"
    if any(n.startswith(DATA_MARKS) for n in names):
        return "data"
    if event.name.startswith("ProfilerStep"):
        return "host, outside ops"  # the profiler's own step record: its self time is what no op accounts for
    op = event.name.split("::", 1)[-1]
    return next((c for c, ops in CATEGORY_OPS.items() if op in ops), "other ops")


class ProfiledSteps(StepClock):
    """StepClock that also steps a torch.profiler: steps `warmup`.. `warmup+steps-1` are recorded."""

    def __init__(self, warmup: int, steps: int, cuda: bool):
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        self.profiler = torch.profiler.profile(
            activities=activities, schedule=torch.profiler.schedule(wait=warmup - 1, warmup=1, active=steps, repeat=1))
        self.warmup, self.steps = warmup, steps

    def __enter__(self):
        self.profiler.__enter__()
        return super().__enter__()

    def _tick(self, optimizer, *args):
        before = len(self.times)
        super()._tick(optimizer, *args)
        if len(self.times) > before and len(self.times) <= self.warmup + self.steps + 1:
            self.profiler.step()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.profiler.__exit__(*exc)

    def table(self) -> dict[str, tuple[float, float]]:
        """{category: (ms per step of device or CPU time, ms per step of CPU time)}."""
        events = self.profiler.events()
        device, cpu = defaultdict(float), defaultdict(float)
        ops = sum(1 for e in events if e.name.startswith("aten::") and not _under_op(e))
        launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
        # A host read of a device value (`.item()`, `int(t)`, `nonzero`) or an explicit wait: on a GPU each stalls
        # the host until every queued kernel has run.
        syncs = sum(1 for e in events if e.name in HOST_SYNCS)
        for event in events:
            where = category(event)
            cpu[where] += event.self_cpu_time_total
            device[where] += event.self_device_time_total
        wall = (self.times[self.warmup + self.steps] - self.times[self.warmup]) * 1e6
        measure = device if any(device.values()) else cpu
        if measure is device:  # the GPU's idle time: the host launching, syncing or waiting for data
            device["host, outside ops"] = max(wall - sum(device.values()), 0.0)
        return {c: (measure[c] / self.steps / 1e3, cpu[c] / self.steps / 1e3) for c in ORDER} | {
            "wall": (wall / self.steps / 1e3, wall / self.steps / 1e3),
            "aten ops called": (ops / self.steps, ops / self.steps),
            "kernel launches": (launches / self.steps, launches / self.steps),
            "host syncs": (syncs / self.steps, syncs / self.steps)}

    def attention_ops(self) -> str:
        """The SDPA backends that ran (flash, memory-efficient, cuDNN, CPU flash, or none: the math path)."""
        seen = sorted({e.name.removeprefix("aten::") for e in self.profiler.events()
                       if e.name.removeprefix("aten::") in SDPA_BACKENDS})
        return ", ".join(seen) or "math path (no fused SDPA kernel)"

    def top_ops(self, n: int) -> list[tuple[str, str, float, float]]:
        """The n ops with the most self time: (name, category, ms per step, calls per step), costliest first."""
        events = self.profiler.events()
        timed = any(e.self_device_time_total for e in events)
        by_category, calls = defaultdict(lambda: defaultdict(float)), defaultdict(int)
        for event in events:
            if event.name.startswith("ProfilerStep"):
                continue
            time = event.self_device_time_total if timed else event.self_cpu_time_total
            by_category[event.name][category(event)] += time
            calls[event.name] += 1
        totals = {name: sum(split.values()) for name, split in by_category.items()}
        ranked = sorted(totals, key=totals.get, reverse=True)[:n]
        # An op can fall in several categories (a copy under the DataLoader is data): name the one with most time
        return [(name, max(by_category[name], key=by_category[name].get), totals[name] / self.steps / 1e3,
                 calls[name] / self.steps) for name in ranked]


@contextlib.contextmanager
def profiled_run(clock):
    """Run a peer's loop under `clock` instead of its own StepClock (the peers open one each)."""
    import bench_common

    original = bench_common.StepClock
    for module in _peer_modules():
        module.StepClock = lambda: clock
    try:
        yield
    finally:
        for module in _peer_modules():
            module.StepClock = original


def _peer_modules():
    import padding
    import train_throughput

    return padding, train_throughput


def run_peers(args) -> list[tuple[str, ProfiledSteps]]:
    import padding
    import train_throughput as tt

    cuda = args.device == "cuda"
    runs = []
    if args.peer == "trainer":
        padding_args = argparse.Namespace(batch=args.batch, steps=args.steps, warmup=args.warmup,
                                          precision=args.precision)
        tok = padding.load_tokenizer()
        docs = padding.gsm8k_documents(tok)
        peers = [("Trainer, pad, group_by_length", lambda: padding.trainer_run(tok, docs, "pad", "group_by_length",
                                                                               padding_args)),
                 ("neox_hf pad", lambda: padding.ours_run(tok, padding_args, mode="pad", buffer_size=1000))]
    else:
        config, shape = tt.pythia_config(args.shape), (args.batch, args.seq)
        device = torch.device(args.device)
        peers = [("stock transformers + PyTorch loop",
                  lambda: tt.stock_seconds(config, shape, args.warmup, args.steps, args.precision, device)),
                 ("neox_hf train(recipe)",
                  lambda: tt.ours_seconds(config, shape, args.warmup, args.steps, args.precision, device))]
    for name, run in peers:
        torch.set_num_threads(args.threads)
        clock = ProfiledSteps(args.warmup, args.steps, cuda)
        with profiled_run(clock):
            run()
        runs.append((name, clock))
    return runs


def print_table(runs: list[tuple[str, ProfiledSteps]], cuda: bool) -> None:
    tables = [(name, clock.table()) for name, clock in runs]
    unit = "GPU ms/step (CPU ms)" if cuda else "CPU ms/step"
    header = " | ".join(f"{name} {unit} | share" for name, _ in tables)
    print(f"| category | {header} |")
    print("|---|" + "---:|---:|" * len(tables))
    for c in [*ORDER, "wall"]:
        cells = []
        for _, table in tables:
            ms, cpu_ms = table[c]
            share = ms / table["wall"][0] if c != "wall" else 1.0
            cells.append(f"{ms:9.1f}" + (f" ({cpu_ms:.1f})" if cuda and c != "wall" else "") + f" | {share:6.1%}")
        print(f"| {c} | " + " | ".join(cells) + " |")
    for c in ("aten ops called", "kernel launches", "host syncs") if cuda else ("aten ops called", "host syncs"):
        print(f"| {c} per step | " + " | ".join(f"{table[c][0]:9.1f} |" for _, table in tables) + " |")
    print("| attention kernel | " + " | ".join(f"{clock.attention_ops()} |" for _, clock in runs) + " |")


def print_top_ops(runs: list[tuple[str, ProfiledSteps]], n: int) -> None:
    for name, clock in runs:
        print(f"\n{name}: the {n} ops with the most self time")
        print("| op | category | ms/step | calls/step |\n|---|---|---:|---:|")
        for op, where, ms, calls in clock.top_ops(n):
            print(f"| {op} | {where} | {ms:.1f} | {calls:.0f} |")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", choices=["trainer", "stock"], default="trainer")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out (at least 2: set-up, then the "
                                                               "profiler's own warm-up step)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--shape", default="70m", help="--peer stock: a Pythia shape of train_throughput.py")
    parser.add_argument("--seq", type=int, default=512, help="--peer stock: tokens per row")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=0, help="also list each run's N ops with the most self time")
    args = parser.parse_args()
    args.warmup = max(args.warmup, 2)
    if args.peer == "trainer" and args.device == "cuda":
        parser.error("--peer trainer is the CPU peer of issue 25 (benchmarks/padding.py); on a GPU use --peer stock")
    if args.device == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "true"
    return args


def main() -> int:
    args = parse_args()
    print(f"{device_name(args.device)}, torch {torch.__version__}, {args.threads} threads, {args.precision}, "
          f"{args.steps} profiled steps after {args.warmup}")
    runs = run_peers(args)
    print_table(runs, args.device == "cuda")
    if args.top:
        print_top_ops(runs, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
