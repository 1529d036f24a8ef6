"""A training step reads nothing from the device outside log, eval and checkpoint steps (issue 40): every op that
copies a device value to the host (on a GPU, a wait for every queued kernel) is counted through a dispatch mode
around real runs of the entry point, and a longer run of the same recipe pays exactly as many as a shorter one.
The multi-process layouts (TP2, ZeRO-2) are counted in test_host_syncs_layouts.py's launch."""

from __future__ import annotations

import pytest

from tests.conftest import BUNDLED_TOKENIZER, REPO, HostReads, reset_accelerate_state

TINY = ["--model.num_layers", "1", "--model.hidden_size", "32", "--model.seq_length", "32",
        "--train.micro_batch_size", "2", "--train.gradient_accumulation_steps", "2", "--train.precision", "fp32",
        "--train.eval_interval", "1000", "--train.eval_iters", "1", "--train.save_interval", "1000",
        "--output.tensorboard", "false", "--tokenizer.path", str(BUNDLED_TOKENIZER)]


def host_reads(tmp_path, data, steps: int, *extra: str) -> dict[str, int]:
    """Host reads of a whole run of `steps` optimizer steps logged once, at its end."""
    from neox_hf.cli import train_main

    reset_accelerate_state()
    mode = HostReads()
    try:
        with mode:
            status = train_main([str(REPO / "recipes" / "tiny.yaml"), *TINY, "--data.sources", f"[{{path: {data}}}]",
                                 "--train.train_iters", str(steps), "--train.log_interval", str(steps),
                                 "--output.dir", str(tmp_path / f"run{steps}"), *extra])
    finally:
        reset_accelerate_state()
    assert status == 0
    return mode.counts


# The fused loss reads two values per chunk on CPU only, by design (`_kept_rows`, `_exp_was_safe`, both gated on
# `device.type == "cpu"`: a CPU has no queue to wait for); its CUDA path is counted by test_cuda.py under
# `torch.cuda.set_sync_debug_mode`. Here the unfused head, whose code is the same on every device.
@pytest.mark.parametrize("data_mode", [
    ["--data.mode", "pack"],
    ["--data.mode", "pack", "--data.isolate_documents", "true"],
    ["--data.mode", "pad"],
], ids=["pack", "pack-isolated", "pad"])
def test_steps_between_log_steps_read_nothing_from_the_device(tmp_path, small_text, data_mode):
    unfused = ["--train.fused_cross_entropy", "false"]
    short = host_reads(tmp_path, small_text, 2, *data_mode, *unfused)
    long = host_reads(tmp_path, small_text, 6, *data_mode, *unfused)
    assert long == short, f"4 more steps (8 micro-batches) added host reads: {short} → {long}"
