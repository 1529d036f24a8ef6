# Sourced by benchmarks/gpu_check.sh and benchmarks/gpu_profile.sh (not run on its own): wheels for a GPU machine
# without a package index (`--download-wheels DIR`, run where PyPI is reachable), then on the GPU machine: torch must
# see the GPU, and the package with its test extras is installed (or, with WHEELS=DIR, the carried wheels are put on
# PYTHONPATH). Sets OUT_DIR, PYTHON, START; exits the calling script with status 2 when the machine cannot run it.
SCRIPT_NAME=$(basename "$0" .sh)
# `bash benchmarks/gpu_check.sh --download-wheels DIR` (or gpu_profile.sh's), run where PyPI is reachable, fills DIR
# with wheels for a GPU machine that reaches no index (this workplace's device machines: Python 3.12, torch,
# transformers 5.17, no DeepSpeed, no datasets), at the versions installed here, so the GPU run uses what the CPU
# suite ran:
# `WHEELS=DIR bash benchmarks/gpu_check.sh` there. DeepSpeed publishes no wheel: one is built here (pure Python; its
# ops compile on first use, and none is used). torch, numpy, pyarrow, pandas and the like stay the machine's own.
if [ "${1:-}" = "--download-wheels" ]; then
    DEST="${2:?usage: bash benchmarks/$SCRIPT_NAME.sh --download-wheels DIR}"
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
    # The library loss kernels (`train.loss_kernel: auto`, the `gpu` extra): pure Python over the machine's Triton.
    # shellcheck disable=SC2086
    "$HERE" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET_PYTHON" --implementation cp \
        $PLATFORMS --platform manylinux2014_x86_64 -d "$DEST" "liger-kernel>=0.8" cut-cross-entropy \
        || echo "note: no liger-kernel / cut-cross-entropy wheels: the GPU run uses neox_hf's own loss kernel" >&2
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
    echo "${0##*/}: no GPU for torch here, nothing run. $ADVICE; then rerun this script." \
        | tee "$OUT_DIR/$SCRIPT_NAME.md" >&2
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
        echo "${0##*/}: installing the wheels in $WHEELS failed ($OUT_DIR/pip.log):" >&2
        tail -n 20 "$OUT_DIR/pip.log" >&2
        exit 2
    fi
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    if ! "$PYTHON" -c "$DEPENDENCIES" > "$WORK/imports.log" 2>&1; then
        echo "${0##*/}: still missing with the wheels of $WHEELS: $(tail -n 1 "$WORK/imports.log")" >&2
        exit 2
    fi
else
    echo "[$((SECONDS - START)) s] pip install -e .[test]"
    if ! timeout 90 "$PYTHON" -m pip install -q --progress-bar off --retries 1 --timeout 15 -c "$CONSTRAINTS" \
            -e ".[test]" > "$OUT_DIR/pip.log" 2>&1; then
        # Without PyPI the checkout still runs where the dependencies are installed (from the repository root).
        if "$PYTHON" -c "$DEPENDENCIES" 2>/dev/null; then
            echo "${0##*/}: pip install -e .[test] failed (no PyPI?); the dependencies are installed: running from" \
                "the checkout ($OUT_DIR/pip.log)"
        else
            echo "${0##*/}: pip install -e .[test] failed or ran over 90 s ($OUT_DIR/pip.log); without PyPI, give" \
                "WHEELS=folder of wheels for the missing packages:" >&2
            tail -n 20 "$OUT_DIR/pip.log" >&2
            exit 2
        fi
    fi
fi

