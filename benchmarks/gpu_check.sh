#!/usr/bin/env bash
# The GPU check, one command from a fresh clone on a machine with one CUDA GPU (PyPI reachable, nothing else needed):
#
#     bash benchmarks/gpu_check.sh
#
# A GPU machine that reaches no package index takes wheels made where PyPI is reachable (see --download-wheels below):
#     bash benchmarks/gpu_check.sh --download-wheels .whl      # here; then, on the GPU machine, with .whl carried:
#     WHEELS=.whl bash benchmarks/gpu_check.sh
#
# 1. keeps the torch that is installed if it sees the GPU (else says what to install, and stops);
# 2. installs this package with its test extras (`pip install -e ".[test]"`, torch held at the installed version);
# 3. runs the GPU tier, `python -m pytest tests -q -m cuda -n 0`, with the GPU visible (tests/test_cuda.py: tiny and
#    Pythia-160M training in bf16 and fp16 with overflow skips, fused loss vs unfused, sdpa / flash-attention on packed
#    documents vs eager, ZeRO-1 vs plain, kill + resume, export + stock from_pretrained);
# 4. measures training throughput (benchmarks/train_throughput.py) of the Pythia-160M and -410M shapes in bf16, the
#    fused and the unfused loss, and the fused loss with the data read in the training process's thread instead of a
#    worker process (`data.num_workers: 0` against the GPU's `auto`: benchmarks/data_worker.py says why), against stock
#    transformers: tokens/s, MFU against the datasheet dense bf16 peak of the part torch names (or the measured GEMM
#    rate for a part the table lacks), and peak GPU memory;
# 5. profiles one Pythia-160M bf16 step of each (benchmarks/step_profile.py --peer stock): kernel time by category
#    and the GPU's idle time, to say where neox_hf's gap to stock transformers at that shape comes from;
# and prints those tables and the pytest summary. Every part has its own time limit (pip 90 s, tests 180 s, benchmark
# 170 s, profile 60 s): under 8 minutes in all (the whole script took 222 s on an H200 with a 140 s benchmark).
# Outputs (pip log, pytest log, the table, a summary) go to "${OUT:-benchmarks/out}".
#
# What one GPU cannot show: NCCL between ranks. The single-process DeepSpeed runs here (ZeRO-1, the fp16 scaler)
# start a one-rank NCCL process group, so NCCL's library and initialisation are exercised, but no collective ever
# crosses two devices: data-parallel gradient all-reduce, ZeRO partition gathers, tensor-parallel all-reduce /
# all-gather and pipeline send/recv need two GPUs or more. On this machine the suite's multi-process tests run on
# gloo with the GPU hidden from their ranks (tests/conftest.py `launch_env`), exactly as on CPU.
set -uo pipefail
cd "$(dirname "$0")/.."

# Wheels for a machine without PyPI, the GPU seen by torch, the package and its test extras: benchmarks/gpu_setup.sh
# (shared with benchmarks/gpu_profile.sh; sets OUT_DIR, PYTHON, START and, with WHEELS, PYTHONPATH).
# shellcheck source=benchmarks/gpu_setup.sh
source benchmarks/gpu_setup.sh "$@" || exit $?

# SIGINT first: pytest then stops and still prints what ran and its summary line.
echo "[$((SECONDS - START)) s] python -m pytest tests -q -m cuda -n 0"
timeout -s INT -k 10 180 "$PYTHON" -m pytest tests -q -m cuda -n 0 -p no:cacheprovider > "$OUT_DIR/pytest_cuda.log" 2>&1
PYTEST_STATUS=$?
PYTEST_SUMMARY=$(grep -E "^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)|no tests ran|Interrupted" \
    "$OUT_DIR/pytest_cuda.log" | tail -n 1)

echo "[$((SECONDS - START)) s] benchmarks/train_throughput.py --shape 160m,410m --precision bf16 --fused both --workers both"
timeout -s INT -k 5 170 "$PYTHON" benchmarks/train_throughput.py --device cuda --shape 160m,410m --precision bf16 \
    --batch 8 --seq 2048 --fused both --workers both --steps 8 --warmup 2 \
    > "$OUT_DIR/train_throughput.md" 2> "$OUT_DIR/train_throughput.err"
BENCH_STATUS=$?

echo "[$((SECONDS - START)) s] benchmarks/step_profile.py --peer stock --shape 160m --precision bf16"
timeout -s INT -k 5 60 "$PYTHON" benchmarks/step_profile.py --peer stock --device cuda --shape 160m --batch 8 \
    --seq 2048 --precision bf16 --steps 3 --warmup 3 > "$OUT_DIR/step_profile.md" 2> "$OUT_DIR/step_profile.err"
PROFILE_STATUS=$?

{
    echo "## GPU check ($(cat "$OUT_DIR/device.txt"), $((SECONDS - START)) s)"
    echo
    echo "Training throughput, Pythia shapes, 8 × 2048 tokens per step, bf16 (benchmarks/train_throughput.py):"
    echo
    cat "$OUT_DIR/train_throughput.md"
    if [ "$BENCH_STATUS" -ne 0 ]; then
        echo "benchmark exit status $BENCH_STATUS:"
        tail -n 15 "$OUT_DIR/train_throughput.err"
    fi
    echo
    echo "Where a Pythia-160M bf16 step's time goes (benchmarks/step_profile.py --peer stock):"
    echo
    cat "$OUT_DIR/step_profile.md"
    [ "$PROFILE_STATUS" -eq 0 ] || { echo "profile exit status $PROFILE_STATUS:"; tail -n 15 "$OUT_DIR/step_profile.err"; }
    echo
    echo "GPU tier (python -m pytest tests -q -m cuda -n 0): ${PYTEST_SUMMARY:-no summary, see pytest_cuda.log}"
    [ "$PYTEST_STATUS" -eq 0 ] || grep -E "^(FAILED|ERROR) " "$OUT_DIR/pytest_cuda.log" | head -n 20
} | tee "$OUT_DIR/gpu_check.md"
echo "(logs in $OUT_DIR: pip.log, pytest_cuda.log, train_throughput.md/.err, step_profile.md/.err, gpu_check.md)"
[ "$PYTEST_STATUS" -eq 0 ] && [ "$BENCH_STATUS" -eq 0 ]
