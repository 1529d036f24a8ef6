"""MFU's two factors: model FLOPs per token from the shape (equal to counting the model's matmul parameters, as the
benchmarks do) and the device peak (datasheet for known GPUs, else measured)."""

from __future__ import annotations

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from neox_hf.hardware import datasheet_peak, device_peak
from neox_hf.train.mfu import flops_per_token, mfu


@pytest.mark.parametrize("layers,hidden,heads,intermediate", [(2, 64, 4, None), (3, 96, 6, 200)])
def test_flops_per_token_counts_every_matmul_parameter_and_attention(layers, hidden, heads, intermediate):
    config = GPTNeoXConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                           intermediate_size=intermediate or 4 * hidden, vocab_size=512, tie_word_embeddings=False)
    model = GPTNeoXForCausalLM(config)
    matmul = sum(p.numel() for name, p in model.named_parameters() if p.ndim == 2 and "embed_in" not in name)
    assert flops_per_token(config, 128) == 6 * matmul + 12 * layers * hidden * 128


@pytest.mark.parametrize("name,precision,expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12), ("NVIDIA H100 PCIe", "bf16", 756e12), ("NVIDIA H200", "fp16", 989e12),
    ("NVIDIA H200 NVL", "bf16", 835e12), ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
    ("NVIDIA H100 80GB HBM3", "fp32", None),  # fp32 is measured: TF32 or not depends on torch's settings
    ("NVIDIA GeForce RTX 4090", "bf16", None),
])
def test_datasheet_peak_names_the_part(name, precision, expected):
    assert datasheet_peak(name, precision) == expected


def test_a_cpu_peak_is_measured_in_the_runs_precision_and_mfu_is_a_fraction_of_it():
    peak = device_peak(torch.device("cpu"), "fp32")
    assert peak.flops > 1e8 and "fp32 GEMM measured on this CPU" in peak.source
    # A bf16 run's peak is the faster of the bf16 and fp32 GEMM rates: its fp32 matmuls must not exceed "100%". Given
    # rates (one AVX512-BF16 core's): comparing two measurements here would only compare the machine's load.
    rates = {torch.bfloat16: (84e9, 1024), torch.float32: (163e9, 512)}
    bf16_peak = device_peak(torch.device("cpu"), "bf16", measure=lambda dtype, device: rates[dtype])
    assert bf16_peak.flops == 163e9 and "512² fp32 GEMM" in bf16_peak.source
    rates[torch.bfloat16] = (1969e9, 1024)  # an AMX core: bf16 is the peak
    assert device_peak(torch.device("cpu"), "bf16", measure=lambda dtype, device: rates[dtype]).flops == 1969e9
    assert mfu(tokens_per_second=peak.flops / 1000, flops_token=500.0, peak=peak, devices=2) == pytest.approx(0.25)


def test_measuring_the_peak_leaves_the_runs_random_stream_alone():
    """The peak is measured once per process (the first run in it, not the later ones), on as many sizes as the
    machine's speed allows: drawing its matrices from the global generator, seeded by the run, gave two runs of one
    recipe in one process different dropout masks and losses from step 1."""
    from neox_hf import hardware

    torch.manual_seed(0)
    expected = torch.rand(4)
    hardware._measured_gemm_rate.cache_clear()
    torch.manual_seed(0)
    hardware.measured_gemm_rate(torch.float32, torch.device("cpu"))
    assert torch.equal(torch.rand(4), expected)
