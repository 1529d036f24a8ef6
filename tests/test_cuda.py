"""The GPU tier: what the CPU suite cannot show, on one CUDA GPU, in a few minutes (`-m cuda`; benchmarks/gpu_check.sh).

Single-GPU training of recipes/tiny.yaml (bf16, as `auto` decides on a GPU) and of the Pythia-160M recipe in bf16
and in fp16 with DeepSpeed's loss scaler forced to overflow; the fused linear + cross-entropy against the unfused
head (values and peak memory); sdpa (and flash-attention 2 where installed) on packed, isolated documents against
eager attention; DeepSpeed ZeRO-1 on one GPU against the plain run; kill -9 and resume against the uninterrupted
run; `neox_hf export` of a ZeRO-1 checkpoint loaded by stock transformers; FP8 training where the GPU has FP8
tensor cores and Transformer Engine is installed (not yet run on such a GPU). The CPU versions of these checks are in
tests/test_train.py, test_fused_cross_entropy.py, test_data_batching.py, test_zero_equivalence.py, test_resume.py.

Skipped where torch sees no GPU. NEOX_HF_TEST_DEVICE=cpu runs every body on CPU instead (smaller shapes where a
GPU shape would take minutes there), which is how this file is checked on machines without a GPU; what only a GPU
measures (CUDA allocator peaks, bf16 tensor cores, flash-attention) is then replaced or skipped, as each test says.
Only one GPU is needed: multi-rank NCCL collectives are out of reach here (the suite's multi-process tests run on
gloo with the GPU hidden, tests/conftest.py `launch_env`).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import BUNDLED_TOKENIZER, REPO, launch_env, reset_accelerate_state
from tests.test_fused_cross_entropy import LargestAllocation, loss_and_grads, random_case, unfused
from tests.test_resume import kill_process_tree, step_losses
from tests.test_train import SMALL
from tests.test_zero_equivalence import strict_train_log

sys.path.insert(0, str(REPO / "tests" / "workers"))
from data_common import GSM8K_TEMPLATE  # noqa: E402

DEVICE = os.environ.get("NEOX_HF_TEST_DEVICE", "cuda")
ON_GPU = DEVICE == "cuda"
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(ON_GPU and not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (NEOX_HF_TEST_DEVICE=cpu runs these bodies on CPU)"),
]

DATA = REPO / "examples" / "data"
TEXT_SOURCES = f"[{{path: {DATA / 'tinyshakespeare.txt'}}}]"  # bundled: a fresh clone has no ../shared/data
# On CPU the Pythia-160M runs keep its recipe (ZeRO-1, activation checkpointing, precision, schedule) at a shape two
# cores train in seconds.
PYTHIA_SHAPE = [] if ON_GPU else ["--model.num_layers", "2", "--model.hidden_size", "64",
                                  "--model.num_attention_heads", "4", "--model.seq_length", "128"]
# How far the mean loss of the last 5 of 20 steps falls below the first 5's: 160M on 4 × 2048 tokens a step learns
# the unigram statistics within them; the CPU shape (2 × 64, 4 × 128 tokens) measured 0.6.
PYTHIA_LEARNS_BY = 1.0 if ON_GPU else 0.3


@pytest.fixture
def on_device(monkeypatch, fresh_accelerate_state):
    """In-process runs on DEVICE (Accelerate would take a visible GPU even when NEOX_HF_TEST_DEVICE=cpu), the GPU's
    peak-memory statistics started afresh."""
    if ON_GPU:
        torch.cuda.reset_peak_memory_stats()
    else:
        monkeypatch.setenv("ACCELERATE_USE_CPU", "true")


@pytest.fixture
def fp32_matmuls():
    """fp32 comparisons at 1e-5 need full-precision fp32 matmuls (TF32 rounds inputs to 10 mantissa bits)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


def device_env(**extra: str) -> dict[str, str]:
    """The environment of a training process this tier starts: the GPU visible (or, on CPU, hidden)."""
    return launch_env(gpu=ON_GPU, **extra)


def run_clm(*args, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python run_clm_neox.py ARGS` in one process from the repository root (relative recipe paths resolve)."""
    done = subprocess.run([sys.executable, "run_clm_neox.py", *map(str, args)], cwd=REPO, env=device_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def in_process_run(*args: str, capsys) -> str:
    """`run_clm_neox.py ARGS` in this process (the CUDA context is already up); returns its stdout."""
    from neox_hf.cli import train_main as main

    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-5000:]
    reset_accelerate_state()
    return captured.out


def tiny_run_args(out: Path, *extra: str) -> list[str]:
    """recipes/tiny.yaml at the CPU suite's small shape (tests/test_train.py SMALL), fp32, no evaluation."""
    return [REPO / "recipes" / "tiny.yaml", *SMALL, "--train.eval_iters", "0", "--train.precision", "fp32",
            "--data.sources", TEXT_SOURCES, "--tokenizer.path", BUNDLED_TOKENIZER, "--output.dir", out, *extra]


def assert_losses_match(got: dict[int, float], expected: dict[int, float], steps: list[int], tol: float) -> None:
    assert sorted(got) == sorted(expected) == steps
    for step in steps:
        assert abs(got[step] - expected[step]) <= tol, (step, got[step], expected[step])


# ----------------------------------------------------------------------------------------------------------------
# Training on one GPU
# ----------------------------------------------------------------------------------------------------------------


def test_tiny_recipe_trains_in_bf16_on_one_gpu_and_stock_transformers_generates_there(tmp_path, on_device):
    """recipes/tiny.yaml as the README runs it: `auto` precision is bf16 on a GPU with bf16 tensor cores; it learns as
    the CPU run does (tests/test_train.py, same thresholds) and the saved folder generates on the GPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPTNeoXForCausalLM

    from neox_hf.recipe.args import parse_run_args
    from neox_hf.train.loop import train

    out = tmp_path / "tiny"
    args = parse_run_args([str(REPO / "recipes" / "tiny.yaml"), "--train.train_iters", "30", "--train.eval_interval",
                           "15", "--train.save_interval", "100", "--output.tensorboard", "false",
                           "--data.sources", TEXT_SOURCES, "--tokenizer.path", str(BUNDLED_TOKENIZER),
                           "--output.dir", str(out)])
    result = train(args.recipe)
    if ON_GPU:
        assert args.recipe.train.precision == "bf16"  # what `auto` chose on this GPU
        assert torch.cuda.max_memory_allocated() > 0  # it trained on the GPU
    assert result.steps == 30 and all(math.isfinite(loss) for loss in result.train_losses)
    first_eval, last_eval = result.eval_losses[0][1], result.final_eval_loss
    assert first_eval > math.log(50277) - 1.0 and last_eval < first_eval - 2.0, result.eval_losses
    model = AutoModelForCausalLM.from_pretrained(out).to(DEVICE).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert type(model) is GPTNeoXForCausalLM
    prompt = tokenizer("ROMEO:", return_tensors="pt").to(DEVICE)
    generated = model.generate(**prompt, max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 10


FP8_GPU = (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
           and importlib.util.find_spec("transformer_engine") is not None)


@pytest.mark.skipif(not FP8_GPU, reason="needs a GPU with FP8 tensor cores (compute capability ≥ 8.9) and "
                                        "Transformer Engine; elsewhere tests/test_fp8.py checks the refusal")
def test_tiny_recipe_trains_in_fp8_where_the_gpu_has_fp8(tmp_path, capsys):
    """`train.precision: fp8` runs accelerate's Transformer Engine recipe (the start-up report says so) and learns."""
    out = in_process_run(*tiny_run_args(tmp_path / "fp8", "--train.precision", "fp8"), capsys=capsys)
    assert "FP8 matmuls" in out
    losses = step_losses(tmp_path / "fp8")
    assert all(math.isfinite(v) for v in losses.values()) and losses[max(losses)] < losses[min(losses)], losses


def pythia_160m_args(out: Path, steps: int, *extra: str) -> list:
    """recipes/pythia-160m.yaml (ZeRO-1, activation checkpointing) on the bundled text, `steps` long, its cosine
    schedule fitted to them (the recipe decays over 143,000)."""
    return ["recipes/pythia-160m.yaml", *PYTHIA_SHAPE, "--data.sources", TEXT_SOURCES, "--train.train_iters", steps,
            "--train.lr_decay_iters", steps, "--train.micro_batch_size", "4", "--train.eval_iters", "0",
            "--train.log_interval", "5", "--output.tensorboard", "false", "--output.dir", out, *extra]


def test_pythia_160m_trains_in_bf16_under_zero1_on_one_gpu(tmp_path):
    out = tmp_path / "bf16"
    done = run_clm(*pythia_160m_args(out, 20, "--train.precision", "bf16"))
    assert "ZeRO stage 1" in done.stdout and "precision bf16" in done.stdout, done.stdout[-2000:]
    log = [r for r in strict_train_log(out) if "loss" in r]
    assert [r["step"] for r in log] == list(range(1, 21))
    assert not any(r.get("skipped") for r in log) and all("loss_scale" not in r for r in log)  # no scaler in bf16
    losses = [r["loss"] for r in log]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - PYTHIA_LEARNS_BY, losses  # it learns
    assert (out / "model.safetensors").is_file()


def test_pythia_160m_fp16_skips_overflowing_steps_and_runs_to_the_end(tmp_path):
    """DeepSpeed's dynamic loss scaler started at 2^30: the first steps overflow and are skipped (logged with
    `skipped: true` and the scale), the scale halves until gradients fit fp16, and the run trains to its last step."""
    if not ON_GPU:
        from neox_hf.hardware import deepspeed_runs_fp16

        if not deepspeed_runs_fp16():  # the run would be refused by name, as tests/test_zero_equivalence.py checks
            pytest.skip("DeepSpeed has no fp16 on this CPU (AVX512-FP16/AMX); the skip logic's twins run everywhere: "
                        "tests/test_overflow_skips.py")
    override = tmp_path / "ds.json"
    override.write_text(json.dumps({"fp16": {"initial_scale_power": 30}}))
    out = tmp_path / "fp16"
    steps = 40  # ~15-20 halvings from 2^30 to a scale whose gradients fit fp16 (2^12-2^16), then applied steps
    run_clm(*pythia_160m_args(out, steps, "--train.precision", "fp16", "--parallel.zero_stage", "1",
                              "--parallel.deepspeed_config", override))
    log = [r for r in strict_train_log(out) if "loss" in r]
    assert [r["step"] for r in log] == list(range(1, steps + 1))
    assert all("loss_scale" in r and "skipped" in r for r in log)
    assert log[0]["skipped"] and log[0]["loss_scale"] == 2.0**30  # hysteresis 2: the first overflow keeps the scale
    skipped = [r for r in log if r["skipped"]]
    assert len(skipped) >= 2 and all("grad_norm" not in r for r in skipped)  # infinite norms are left out
    assert not log[-1]["skipped"] and log[-1]["loss_scale"] < 2.0**30
    assert all(math.isfinite(r["loss"]) for r in log if not r["skipped"])
    assert (out / "model.safetensors").is_file()  # the run ended normally and saved its model


# ----------------------------------------------------------------------------------------------------------------
# Kernels: the fused head + loss, and attention over packed documents
# ----------------------------------------------------------------------------------------------------------------


def peak_memory(fn) -> tuple[int, object]:
    """(size, fn's result): on CUDA the allocator's peak bytes above what was allocated before; on CPU, which has no
    allocator statistics, the elements of the largest tensor created (the [tokens, vocab] logits that fusing
    removes), which the CPU suite measures the same way (tests/test_fused_cross_entropy.py)."""
    if not ON_GPU:
        with LargestAllocation() as tracker:
            result = fn()
        return tracker.largest, result
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, result


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_fused_cross_entropy_equals_the_unfused_head_in_less_memory(dtype, tol, fp32_matmuls):
    """Pythia-160M's head (hidden 768, vocabulary 50,304) over 2 × 2,048 tokens, a fifth of them ignored: the chunked
    op's CUDA path (no host-side row selection, the max always subtracted) gives the unfused loss and gradients, and
    its peak memory is under half the unfused one's ([tokens, vocab] logits, their softmax and gradient)."""
    from neox_hf.ops import linear_cross_entropy

    tokens, width = (4096, 768) if ON_GPU else (2048, 128)
    hidden, weight, labels = random_case(0, tokens, width, 50304)
    hidden, weight, labels = hidden.to(DEVICE, dtype), weight.to(DEVICE, dtype), labels.to(DEVICE)
    fused_bytes, fused = peak_memory(lambda: loss_and_grads(linear_cross_entropy, hidden, weight, labels))
    unfused_bytes, reference = peak_memory(lambda: loss_and_grads(unfused, hidden, weight, labels))
    loss, count, d_hidden, d_weight = fused
    assert loss.device.type == d_hidden.device.type == d_weight.device.type == DEVICE
    assert d_hidden.dtype == d_weight.dtype == dtype
    assert count.item() == int((labels != -100).sum())
    assert abs(loss.item() - reference[0].item()) <= tol * abs(reference[0].item())
    for got, want in ((d_hidden, reference[2]), (d_weight, reference[3])):
        assert (got.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item()
    assert fused_bytes < unfused_bytes / 2, (fused_bytes, unfused_bytes)


@pytest.mark.parametrize("kernel", ["liger", "cce"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_library_loss_kernels_equal_the_unfused_head(kernel, dtype, tol, fp32_matmuls):
    """`train.loss_kernel: liger | cce` (what `auto` picks on a GPU where installed): the library's sums equal the
    unfused head's, loss and both gradients, with the z-loss where the library computes it (Liger)."""
    from neox_hf.ops.library_loss import LIBRARIES, installed

    if not ON_GPU:
        pytest.skip("Triton kernels: CUDA only (the choice of kernel is tested everywhere in test_loss_kernel.py)")
    if not installed(kernel):
        pytest.skip(f"{LIBRARIES[kernel]} is not installed (`pip install -e \".[gpu]\"`)")
    z_loss = 1e-4 if kernel == "liger" else 0.0
    hidden, weight, labels = random_case(0, 4096, 768, 50304)
    hidden, weight, labels = hidden.to(DEVICE, dtype), weight.to(DEVICE, dtype), labels.to(DEVICE)

    loss, count, d_hidden, d_weight = loss_and_grads(_library_leaf(kernel), hidden, weight, labels, z_loss=z_loss)
    reference = loss_and_grads(unfused, hidden, weight, labels, z_loss=z_loss)
    assert count.item() == int((labels != -100).sum())
    assert abs(loss.item() - reference[0].item()) <= tol * abs(reference[0].item())
    for got, want in ((d_hidden, reference[2]), (d_weight, reference[3])):
        assert (got.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item()


def _library_leaf(kernel):
    """`library_head_loss` as a function of (hidden, weight, labels), the weight a leaf whose .grad is kept."""
    from neox_hf.ops.library_loss import library_head_loss

    class _Head(torch.nn.Module):  # a bias-free linear whose weight IS the given tensor
        def __init__(self, weight):
            super().__init__()
            self.weight, self.bias = weight, None

    def loss(hidden, weight, labels, z_loss=0.0):
        return library_head_loss(kernel, _Head(weight), hidden, labels, z_loss=z_loss)

    return loss


def test_a_training_step_never_waits_for_the_host(tmp_path, on_device):
    """The host-read audit of test_host_syncs.py on the GPU: under `torch.cuda.set_sync_debug_mode("error")` the
    steps between log steps of a bf16 run of the tiny recipe (fused loss, packed documents kept apart) raise on any
    synchronising call; the start-up, log steps and the final save are outside the guarded window."""
    if not ON_GPU:
        pytest.skip("CUDA's sync debug mode (the CPU audit is test_host_syncs.py)")
    from neox_hf.train import loop

    original = loop._advance_schedule

    def guarded_step(run, state, result):
        torch.cuda.set_sync_debug_mode("error" if state.step % 4 not in (0, 3) else "default")
        return original(run, state, result)

    loop._advance_schedule = guarded_step
    try:
        from neox_hf.cli import train_main

        assert train_main([str(REPO / "recipes" / "tiny.yaml"), "--train.train_iters", "12", "--train.log_interval",
                           "4", "--train.save_interval", "1000", "--train.eval_interval", "1000",
                           "--data.isolate_documents", "true", "--output.dir", str(tmp_path / "out")]) == 0
    finally:
        torch.cuda.set_sync_debug_mode("default")
        loop._advance_schedule = original


@pytest.fixture(scope="module")
def packed_isolated_batch():
    """Two windows of 512 tokens of GSM8K (bundled sample) packed with `isolate_documents`: positions restart at
    each document, no attention mask, the cross-document targets dropped (as tests/test_data_batching.py builds)."""
    from neox_hf.data import build_eval_loader
    from neox_hf.data.tokenizer import load_tokenizer
    from neox_hf.recipe import DataConfig, DataSource

    source = DataSource(path=str(DATA / "gsm8k-sample.jsonl"), template=GSM8K_TEMPLATE)
    config = DataConfig(validation=[source], mode="pack", isolate_documents=True, buffer_size=50)
    batch = build_eval_loader(config, load_tokenizer(str(BUNDLED_TOKENIZER)), seq_length=512, micro_batch_size=2,
                              max_batches=1)[0]
    assert int((batch["position_ids"] == 0).sum()) >= 6  # several documents per window
    return {k: v.to(DEVICE) for k, v in batch.items()}


@pytest.fixture(scope="module")
def attention_model_folder(tmp_path_factory):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=50304, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=1024, max_position_embeddings=1024, rotary_pct=0.25)
    folder = tmp_path_factory.mktemp("attention_model")
    GPTNeoXForCausalLM(config).save_pretrained(folder)
    return folder


def packed_logits_and_loss(folder: Path, batch: dict, implementation: str, dtype: torch.dtype):
    import torch.nn.functional as F
    from transformers import GPTNeoXForCausalLM

    model = GPTNeoXForCausalLM.from_pretrained(folder, attn_implementation=implementation, dtype=dtype)
    model = model.to(DEVICE).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    return logits.float(), loss.item(), model


ATTENTION = [("sdpa", torch.float32, 1e-5), ("flash_attention_2", torch.bfloat16, 2e-2)]


@pytest.mark.parametrize("implementation,dtype,tol", ATTENTION, ids=[a[0] for a in ATTENTION])
def test_packed_isolated_documents_attend_as_with_eager_attention(implementation, dtype, tol, packed_isolated_batch,
                                                                  attention_model_folder, fp32_matmuls):
    """Each kernel gets the document boundaries from the restarting position ids alone (sdpa: transformers' packed
    block-diagonal mask; flash-attention 2: variable-length sequences): its logits equal eager attention's, and the
    window's loss is the token-weighted loss of its documents run one by one."""
    if implementation == "flash_attention_2" and not (ON_GPU and importlib.util.find_spec("flash_attn")):
        pytest.skip("flash-attention 2 needs a CUDA GPU and the flash_attn package")
    import torch.nn.functional as F

    batch = packed_isolated_batch
    eager_logits, eager_loss, _ = packed_logits_and_loss(attention_model_folder, batch, "eager", dtype)
    logits, loss, model = packed_logits_and_loss(attention_model_folder, batch, implementation, dtype)
    assert (logits - eager_logits).abs().max().item() <= tol * max(1.0, eager_logits.abs().max().item())
    assert abs(loss - eager_loss) <= tol * eager_loss
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels, positions in zip(batch["input_ids"], batch["labels"], batch["position_ids"]):
            bounds = (positions == 0).nonzero().flatten().tolist() + [len(ids)]
            for start, end in zip(bounds[:-1], bounds[1:]):
                alone = model(input_ids=ids[start:end][None], use_cache=False).logits[0].float()
                total += F.cross_entropy(alone, labels[start:end], ignore_index=-100, reduction="sum").item()
                count += int((labels[start:end] != -100).sum())
    assert abs(loss - total / count) <= tol * loss


# ----------------------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-1 on one GPU, its checkpoint exported; kill and resume
# ----------------------------------------------------------------------------------------------------------------

ZERO1_STEPS = 6


@pytest.fixture(scope="module")
def zero1_run(tmp_path_factory) -> tuple[Path, str]:
    """recipes/tiny.yaml, fp32, DeepSpeed ZeRO-1 in one plain `python` process, a checkpoint at its last step."""
    out = tmp_path_factory.mktemp("zero1") / "run"
    done = run_clm(*tiny_run_args(out, "--train.train_iters", ZERO1_STEPS, "--train.save_interval", ZERO1_STEPS,
                                  "--parallel.zero_stage", "1"))
    return out, done.stdout


def test_zero1_on_one_gpu_matches_the_run_without_deepspeed(zero1_run, tmp_path, capsys, on_device, fp32_matmuls):
    """One rank's ZeRO-1 shards nothing: its optimizer step over DeepSpeed's flat fp32 partition is the plain AdamW
    step, so every step's loss equals a run without DeepSpeed (tests/test_zero_equivalence.py's 1e-5, fp32)."""
    out, stdout = zero1_run
    assert "ZeRO stage 1" in stdout, stdout[-2000:]
    plain = tmp_path / "plain"
    in_process_run(*tiny_run_args(plain, "--train.train_iters", str(ZERO1_STEPS)), capsys=capsys)
    steps = list(range(1, ZERO1_STEPS + 1))
    assert_losses_match(step_losses(out), step_losses(plain), steps, tol=1e-5)


def test_export_of_a_zero1_checkpoint_loads_in_stock_transformers_on_the_gpu(zero1_run, tmp_path):
    """`neox_hf export` consolidates the last ZeRO-1 checkpoint into a folder stock `from_pretrained` loads without
    trust_remote_code; its weights are the run's final ones and its logits on the GPU are the final folder's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPTNeoXForCausalLM

    out, _ = zero1_run
    exported = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "neox_hf.cli", "export", str(out / "checkpoints"), str(exported)],
                          cwd=REPO, env=device_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    final, again = load_file(out / "model.safetensors"), load_file(exported / "model.safetensors")
    assert set(again) == set(final) and all(torch.equal(again[k].to(final[k].dtype), final[k]) for k in final)
    model = AutoModelForCausalLM.from_pretrained(exported).to(DEVICE).eval()
    assert type(model) is GPTNeoXForCausalLM
    assert AutoTokenizer.from_pretrained(exported).eos_token == "<|endoftext|>"
    reference = AutoModelForCausalLM.from_pretrained(out).to(DEVICE).eval()
    ids = torch.randint(2, 50000, (2, 64), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


RESUME_STEPS = 60


def test_resume_after_sigkill_on_one_gpu_matches_the_uninterrupted_run(tmp_path, capsys, on_device, fp32_matmuls):
    """60 steps straight vs a run killed (SIGKILL: no flush, no final save) once its first checkpoint is complete and
    resumed with `--resume`: every step's loss matches. 1e-5, not the CPU test's 1e-6: CUDA's index_add_ (the fused
    head's target rows) adds in a nondeterministic order, so two identical GPU runs already differ by ~1e-7 per step;
    a state the resume missed (RNG, data position, optimizer moments) moves the losses by far more."""
    common = ["--train.train_iters", str(RESUME_STEPS), "--train.save_interval", "10", "--train.keep_last_n", "2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    in_process_run(*tiny_run_args(straight, *common), capsys=capsys)

    command = [sys.executable, "run_clm_neox.py", *map(str, tiny_run_args(resumed, *common))]
    errors = tmp_path / "killed.stderr"  # a file, not a pipe: a full pipe would stop the run before its checkpoint
    with errors.open("w") as stderr:
        process = subprocess.Popen(command, cwd=REPO, env=device_env(), stdout=subprocess.DEVNULL, stderr=stderr,
                                   start_new_session=True)
    latest, deadline = resumed / "checkpoints" / "latest", time.time() + 300
    try:
        while not latest.is_file():
            assert process.poll() is None, "the run ended before its first checkpoint: " + errors.read_text()[-3000:]
            assert time.time() < deadline, "no checkpoint within 5 minutes"
            time.sleep(0.02)
        assert process.poll() is None, "the run finished before it could be killed"
    finally:
        kill_process_tree(process)
    assert not (resumed / "config.json").exists()  # the killed run never reached its final save
    killed_at = int(latest.read_text().split("_")[1])
    assert 0 < killed_at < RESUME_STEPS

    stdout = in_process_run(*tiny_run_args(resumed, *common, "--resume"), capsys=capsys)
    assert f"at step {killed_at}" in stdout and "resumed from" in stdout, stdout[-2000:]
    assert_losses_match(step_losses(resumed), step_losses(straight), list(range(1, RESUME_STEPS + 1)), tol=1e-5)
