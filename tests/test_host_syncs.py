"""A training step reads nothing from the device outside log, eval and checkpoint steps (issue 40): every op that
copies a device value to the host (on a GPU, a wait for every queued kernel) is counted through a dispatch mode
around real runs of the entry point, and a longer run of the same recipe pays exactly as many as a shorter one.
The multi-process layouts (TP2, ZeRO-2) are counted the same way in one launch of tests/workers/host_reads.py."""

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


@pytest.mark.distributed
def test_tp2_and_zero2_steps_read_nothing_more_from_the_device(tmp_path, small_text):
    """The same audit on every rank of a TP2 run and a DeepSpeed ZeRO-2 data-parallel run (one 2-process launch).
    DeepSpeed's ZeRO-1/2 optimizer reads its gradient norm on the host at every step (`is_invalid_grad_norm` in
    `stage_1_and_2.step`, DeepSpeed 0.19.8): those reads are its own, counted apart, and asserted to be all it adds."""
    import json
    import subprocess

    from tests.conftest import accelerate_launch_command, launch_env

    common = [str(REPO / "recipes" / "tiny.yaml"), *TINY, "--data.sources", f"[{{path: {small_text}}}]",
              "--train.fused_cross_entropy", "false", "--parallel.use_deepspeed", "true"]
    layouts = {"tp2": "--parallel.tensor_parallel 2 --train.gradient_accumulation_steps 2",
               "zero2": "--parallel.zero_stage 2 --train.gradient_accumulation_steps 1"}
    launch = subprocess.run(accelerate_launch_command(REPO / "tests/workers/host_reads.py", tmp_path,
                                                      *(f"{k}={v}" for k, v in layouts.items()), "--", *common),
                            cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=900)
    assert launch.returncode == 0, (launch.stdout + launch.stderr)[-5000:]
    for name in layouts:
        for rank in (0, 1):
            counts = json.loads((tmp_path / f"{name}.rank{rank}.json").read_text())
            ours = [{op: n for op, n in counts[steps].items() if not op.startswith("deepspeed:")} for steps in "26"]
            assert ours[1] == ours[0], f"{name} rank {rank}: 4 more steps added host reads: {counts}"
