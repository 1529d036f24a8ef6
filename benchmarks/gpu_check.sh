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

# `bash benchmarks/gpu_check.sh --download-wheels DIR`, run where PyPI is reachable, fills DIR with wheels for a GPU
# machine that reaches no index (this workplace's device machines: Python 3.12, torch, transformers 5.17, no
# DeepSpeed, no datasets), at the versions installed here, so the GPU run uses what the CPU suite ran:
# `WHEELS=DIR bash benchmarks/gpu_check.sh` there. DeepSpeed publishes no wheel: one is built here (pure Python; its
# ops compile on first use, and none is used). torch, numpy, pyarrow, pandas and the like stay the machine's own.
if [ "${1:-}" = "--download-wheels" ]; then
    DEST="${2:?usage: bash benchmarks/gpu_check.sh --download-wheels DIR}"
    TARGET_PYTHON="${WHEELS_PYTHON_VERSION:-3.12}"
    HERE="${PYTHON:-$(command -v python3 || command -v python)}"
    mkdir -p "$DEST"
    PACKAGES="transformers huggingface_hub tokenizers safetensors accelerate peft datasets dill multiprocess evaluate
              hjson pydantic pydantic_core annotated_types typing_inspection typing_extensions zstandard kernels
              tomlkit httpx2 httpcore2 truststore h11 hf_xet click idna anyio fsspec"
    PINS=$("$HERE" -c "import importlib.metadata as m, sys
print(' '.join(f'{p}=={m.version(p)}' for p in sys.argv[1:]))" $PACKAGES) || exit 2
    PLATFORMS=""
    for n in 17 24 27 28 31 34 35; do PLATFORMS="$PLATFORMS --platform manylinux_2_${n}_x86_64"; done
    # shellcheck disable=SC2086
    "$HERE" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET_PYTHON" --implementation cp \
        $PLATFORMS --platform manylinux2014_x86_64 -d "$DEST" $PINS || exit 2
    DEEPSPEED=$("$HERE" -c "import importlib.metadata as m; print(m.version('deepspeed'))") || exit 2
    "$HERE" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "deepspeed==$DEEPSPEED" || exit 2
    ls "$DEST"
    du -sh "$DEST"
    exit 0
fi
OUT_DIR="${OUT:-benchmarks/out}"
mkdir -p "$OUT_DIR"
# The Python that holds torch: `python3` on machines whose `python` is another one.
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
# Nothing here needs the Hub: fail fast instead of waiting on a network the machine may not have.
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
START=$SECONDS

# What to do when torch does not see the GPU depends on why: no torch, a CPU-only build, or a CUDA build that finds
# no device (driver, CUDA_VISIBLE_DEVICES).
TORCH_ADVICE='
import sys
try:
    import torch
except ImportError:
    sys.exit(f"no torch: {sys.argv[1]} -m pip install \"torch>=2.4\" (PyPI Linux x86_64 wheels are CUDA builds)")
if torch.cuda.is_available():
    sys.exit(0)
version = torch.__version__.split("+")[0]
if torch.version.cuda is None:
    sys.exit(f"torch {torch.__version__} is a CPU-only build: {sys.argv[1]} -m pip install --force-reinstall "
             f"--no-deps \"torch=={version}\" (the PyPI wheel is the CUDA build) or a wheel of your CUDA version")
sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: check nvidia-smi (a driver for CUDA "
         f"{torch.version.cuda} or newer) and CUDA_VISIBLE_DEVICES")
'
if ! ADVICE=$("$PYTHON" -c "$TORCH_ADVICE" "$PYTHON" 2>&1); then
    echo "gpu_check: no GPU for torch here, nothing run. $ADVICE; then rerun this script." \
        | tee "$OUT_DIR/gpu_check.md" >&2
    exit 2
fi
"$PYTHON" -c "import torch; print(torch.cuda.get_device_name() + ', torch ' + torch.__version__ + ', CUDA ' \
    + str(torch.version.cuda))" | tee "$OUT_DIR/device.txt"

# Hold torch where it is: the test extras must not replace the CUDA build with another one.
WORK="$(mktemp -d)"  # what need not come back: $OUT_DIR holds the logs and the table only
CONSTRAINTS="$WORK/constraints.txt"
"$PYTHON" -c "import torch; print('torch==' + torch.__version__)" > "$CONSTRAINTS"
DEPENDENCIES="import transformers, accelerate, deepspeed, datasets, evaluate, peft, safetensors, psutil, pytest, xdist"
if [ -n "${WHEELS:-}" ]; then
    # A machine that reaches no package index (as this workplace's device machines): WHEELS names a folder of wheels
    # for what its Python lacks, installed without an index into a folder of their own put first on PYTHONPATH; the
    # package runs from the checkout (tests and benchmarks start at the repository root).
    SITE="$WORK/site"
    echo "[$((SECONDS - START)) s] wheels from $WHEELS into $SITE"
    if ! timeout 90 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "$WHEELS"/*.whl > "$OUT_DIR/pip.log" 2>&1; then
        echo "gpu_check: installing the wheels in $WHEELS failed ($OUT_DIR/pip.log):" >&2
        tail -n 20 "$OUT_DIR/pip.log" >&2
        exit 2
    fi
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    if ! "$PYTHON" -c "$DEPENDENCIES" > "$WORK/imports.log" 2>&1; then
        echo "gpu_check: still missing with the wheels of $WHEELS: $(tail -n 1 "$WORK/imports.log")" >&2
        exit 2
    fi
else
    echo "[$((SECONDS - START)) s] pip install -e .[test]"
    if ! timeout 90 "$PYTHON" -m pip install -q --progress-bar off --retries 1 --timeout 15 -c "$CONSTRAINTS" \
            -e ".[test]" > "$OUT_DIR/pip.log" 2>&1; then
        # Without PyPI the checkout still runs where the dependencies are installed (from the repository root).
        if "$PYTHON" -c "$DEPENDENCIES" 2>/dev/null; then
            echo "gpu_check: pip install -e .[test] failed (no PyPI?); the dependencies are installed: running from" \
                "the checkout ($OUT_DIR/pip.log)"
        else
            echo "gpu_check: pip install -e .[test] failed or ran over 90 s ($OUT_DIR/pip.log); without PyPI, give" \
                "WHEELS=folder of wheels for the missing packages:" >&2
            tail -n 20 "$OUT_DIR/pip.log" >&2
            exit 2
        fi
    fi
fi

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
