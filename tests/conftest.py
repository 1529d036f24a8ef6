"""Shared test fixtures: the real data beside the repo, the GPT-NeoX tokenizer, tiny model configs."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
BUNDLED_TOKENIZER = REPO / "examples" / "data" / "gpt-neox-20b-tokenizer.json"

# Tests never reach a hub: datasets are local files.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def shared(relative: str) -> Path:
    path = SHARED_DATA / relative
    if not path.exists():
        pytest.skip(f"{path} not found: clone the repo beside shared/ to run tests on the real data")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(*, gpu: bool = False, **extra: str) -> dict[str, str]:
    """The environment of every process a test starts: this one's, one OpenMP thread per process (two pytest workers
    on two cores, and launches of several ranks each), no tokenizer threads, and no visible GPU unless `gpu`. The
    multi-process tests run on gloo with the GPU hidden: on a GPU machine Accelerate would map every rank of a
    one-node launch to cuda:0 and NCCL refuses two ranks on one device; hidden, the CPU tiers run there as on CPU.
    `gpu=True` (the cuda tier's single-process runs) leaves CUDA_VISIBLE_DEVICES as this process has it.
    Without this process's rendezvous variables: an in-process DeepSpeed test sets MASTER_PORT to a port its own
    group may still hold, and a child process inheriting it fails to create its store."""
    rendezvous = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
    env = {key: value for key, value in os.environ.items() if key not in rendezvous}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


def accelerate_launch_command(script, *args, zero_stage: int | None = None, num_processes: int = 2) -> list[str]:
    """`accelerate launch --use_deepspeed` of `script` on gloo, on a free port; `--zero_stage` only where given: the
    run refuses a launcher stage that contradicts its recipe's (a worker whose recipe picks its own stage, or runs
    several, passes none)."""
    stage = ["--zero_stage", str(zero_stage)] if zero_stage is not None else []
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(num_processes), "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--use_deepspeed", *stage,
        "--main_process_port", str(free_port()), str(script), *map(str, args),
    ]


def start_init_layouts(out_dir, layouts: dict[str, str], *common: str, num_processes: int = 2):
    """A launch (`Popen`, stdout and stderr merged) of tests/workers/init_layouts.py: the run of each NAME, with its
    overrides (one shell-quoted string) after `common`, in OUT_DIR/NAME, one after the other."""
    import subprocess

    specs = [f"{name}={overrides}" for name, overrides in layouts.items()]
    return subprocess.Popen(accelerate_launch_command(REPO / "tests/workers/init_layouts.py", out_dir, *specs, "--",
                                                      *common, num_processes=num_processes),
                            cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def start_torchrun_layouts(out_dir, layouts: dict[str, str], *common: str, num_processes: int = 2,
                           probes: tuple[str, ...] = ()):
    """`start_init_layouts` under torchrun, for launches that hold FSDP2 runs (`accelerate launch --use_deepspeed`
    marks the environment as DeepSpeed's, which an FSDP2 recipe refuses; DeepSpeed runs take their plugin from their
    recipes here); with `probes`, tests/workers/fsdp2_layouts.py's flags (`--count NAME`, `--kill-in-save NAME:STEP`)
    and that worker."""
    import subprocess

    specs = [f"{name}={overrides}" for name, overrides in layouts.items()]
    worker = REPO / "tests/workers" / ("fsdp2_layouts.py" if probes else "init_layouts.py")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                             str(num_processes), str(worker), *probes, str(out_dir), *specs, "--", *common],
                            cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish_launch(launch, what: str, timeout: int = 900) -> None:
    """Wait for a `start_init_layouts` launch; fail with the end of its output unless it succeeded."""
    output, _ = launch.communicate(timeout=timeout)
    assert launch.returncode == 0, f"the launch of {what} failed:\n{output[-5000:]}"


def reset_accelerate_state() -> None:
    """In-process training runs leave Accelerate's singletons set up for their layout."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def train_in_this_process(argv: list[str]) -> str:
    """`run_clm_neox.py ARGV` through its entry function in this process, for a module fixture (which cannot take
    capsys or `fresh_accelerate_state`): asserts it exited 0 and returns what it printed. Only for runs without
    DeepSpeed: a DeepSpeed engine is never built in a pytest worker."""
    import io

    from neox_hf.cli import train_main as main

    printed = io.StringIO()
    # A test elsewhere on this worker that left its Accelerator (another precision) would make Accelerate refuse
    # this run: start from a clean state as a fresh process would.
    reset_accelerate_state()
    try:
        with contextlib.redirect_stdout(printed):
            status = main(argv)
    finally:
        reset_accelerate_state()
    assert status == 0, printed.getvalue()[-3000:]
    return printed.getvalue()


def one_process_equivalence_run(model_dir, out_dir) -> None:
    """tests/workers/dp_equivalence.py's one-process run (`MODEL_DIR OUT_DIR 0`: no DeepSpeed, no process group) in
    this process, on one thread as a launched process runs (`launch_env`): the reference the layouts are held to,
    without a process's start-up (~10 s of imports on 2 cores)."""
    import torch

    workers = str(REPO / "tests" / "workers")
    if workers not in sys.path:
        sys.path.insert(0, workers)
    import dp_equivalence

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    reset_accelerate_state()
    try:
        dp_equivalence.main(dp_equivalence.parse_args([str(model_dir), str(out_dir), "0"]))
    finally:
        torch.set_num_threads(threads)
        reset_accelerate_state()


def end_process_group() -> None:
    """The last call of a worker whose ranks share a process group they never end (no `end_training`): every rank
    waits for the others, then the group is destroyed. Leaving a live gloo group to the interpreter's exit let a rank
    abort now and then under load ("terminate called without an active exception", SIGABRT) while its peer was still
    in the group; twice in one full run on 2 vCPUs."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def layout_runs_argv(argv: list[str]) -> tuple[Path, list[tuple[str, str]], list[str]]:
    """`OUT_DIR NAME=OVERRIDES ... -- RUN_ARGS...` (tests/workers/init_layouts.py, host_reads.py): the output folder
    (created), each layout's (name, overrides as one shell string), the arguments every run shares."""
    split = argv.index("--")
    out_dir = Path(argv[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir, [tuple(layout.partition("=")[::2]) for layout in argv[1:split]], argv[split + 1:]


@contextlib.contextmanager
def runs_sharing_one_process_group():
    """For workers that train several runs one after the other in one launch (its start-up, ~10 s of imports per
    process on 2 cores, costs more than a tiny run): a run ends with `accelerator.end_training()`, which destroys the
    process group, and a second group on torchrun's agent store would hang at its rendezvous (DeepSpeed also keeps the
    first group's subgroups). Inside this, the runs share the first run's group; it is destroyed once, at the end."""
    import torch.distributed as dist
    from accelerate.state import PartialState

    PartialState.destroy_process_group = lambda self, group=None: None
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class HostReads:
    """A dispatch mode counting the ops that copy a device value to the host (`.item()`, `int(t)`, `bool(t)`,
    `nonzero`, `masked_select`: on a GPU each waits for every kernel queued before it). Runs on CPU too: the op is
    dispatched whatever the device, so a CPU run counts the syncs a GPU run would pay."""

    OPS = ("_local_scalar_dense", "nonzero", "is_nonzero", "masked_select", "unique", "repeat_interleave")

    @staticmethod
    def inside_deepspeed() -> bool:
        import traceback

        return any("/deepspeed/runtime/" in frame.filename for frame in traceback.extract_stack())

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        class _Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.counts: dict[str, int] = {}

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.__name__.split(".")[0]
                if name in HostReads.OPS:
                    # DeepSpeed's own reads (its ZeRO optimizer checks the gradient norm on the host every step) are
                    # counted apart: they are DeepSpeed's to remove, not ours
                    key = f"deepspeed:{name}" if HostReads.inside_deepspeed() else name
                    self.counts[key] = self.counts.get(key, 0) + 1
                return func(*args, **(kwargs or {}))

            @property
            def total(self) -> int:
                return sum(self.counts.values())

        return _Mode()


@pytest.fixture
def fresh_accelerate_state():
    yield
    reset_accelerate_state()


@pytest.fixture(scope="session")
def tokenizer():
    from neox_hf.data.tokenizer import load_tokenizer

    return load_tokenizer(str(BUNDLED_TOKENIZER))


# ----------------------------------------------------------------------------------------------------------------
# Tiers: `pytest -m "not distributed"` is the fast tier; `distributed` marks the slow tier: tests that launch processes
# (found automatically below) and the few that run a whole training end to end (marked by hand).
# ----------------------------------------------------------------------------------------------------------------

_LAUNCHES = ("accelerate_launch_command(", "start_init_layouts(", "run_torchrun(", "_launch(", "launch(", "torch.distributed.run")


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed: starts several processes (accelerate launch / torchrun)")


# The modules whose launches take longest on 2 cores (a full run's --durations), run first. pytest-xdist hands each
# worker whole modules (`--dist loadscope`, in this order with `--no-loadscope-reorder`; its own order is by test
# count, which puts the many quick tests first): a two-minute module handed out last leaves the other worker idle.
SLOWEST_MODULES_FIRST = ("test_failure_preemption.py", "test_launch_files.py", "test_resume_any_layout.py",
                         "test_fsdp2.py", "test_train.py", "test_context_parallel.py", "test_pipeline.py",
                         "test_zero_equivalence.py", "test_expert_parallel.py", "test_readme.py", "test_plan.py",
                         "test_eval_generate.py", "test_llama.py", "test_resume.py", "test_security.py",
                         "test_finetune.py", "test_layout.py", "test_tensor_parallel.py", "test_continue_neox.py",
                         "test_fused_cross_entropy.py", "test_host_syncs.py", "test_checkpoint_faults.py",
                         "test_objective_layouts.py", "test_layout_free_init.py")


def pytest_collection_modifyitems(config, items):
    """Mark `distributed` every test that starts processes, itself or through a fixture, so new multi-process tests
    land in the slow tier without anyone remembering a decorator; then the slowest modules first (a stable sort: the
    others and every module's own tests keep their order)."""
    rank = {name: position for position, name in enumerate(SLOWEST_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    for item in items:
        functions = [getattr(item, "function", None)]
        for defs in getattr(item, "_fixtureinfo", None).name2fixturedefs.values() if hasattr(item, "_fixtureinfo") else []:
            functions += [d.func for d in defs]
        if any(_launches(f) for f in functions if f is not None):
            item.add_marker(pytest.mark.distributed)


def _launches(function, depth: int = 2) -> bool:
    """Whether `function`, or a module-level helper it calls (two levels down), starts processes."""
    import inspect

    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    if any(marker in source for marker in _LAUNCHES) and "def accelerate_launch_command" not in source:
        return True
    if depth == 0 or not hasattr(function, "__code__"):
        return False
    helpers = [function.__globals__.get(name) for name in function.__code__.co_names]
    # Test modules are imported as `test_x` (rootdir on sys.path) or `tests.x`: helpers of either kind count.
    return any(_launches(h, depth - 1) for h in helpers
               if inspect.isfunction(h) and h.__module__.split(".")[0] in ("tests", "conftest") or
               inspect.isfunction(h) and h.__module__.startswith("test_"))


def save_tiny_gpt_neox(folder: Path, seed: int = 0) -> Path:
    """A stock 2-layer GPTNeoX (vocab 512, hidden 64) saved with save_pretrained: the model the multi-process
    equivalence workers load."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    config = GPTNeoXConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=256, max_position_embeddings=64)
    GPTNeoXForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def small_text(tmp_path_factory) -> Path:
    """The first 20,000 characters of the bundled Tiny Shakespeare: a corpus tiny runs read in a moment."""
    path = tmp_path_factory.mktemp("data") / "small.txt"
    path.write_text((REPO / "examples" / "data" / "tinyshakespeare.txt").read_text()[:20000])
    return path
