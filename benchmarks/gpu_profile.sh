#!/usr/bin/env bash
# The one prepared device run of issue 40: is neox_hf faster than stock transformers on one GPU, and where does a
# step's time go. From a fresh tree on one H100 / H200, with wheels carried where the machine has no package index:
#
#     bash benchmarks/gpu_profile.sh --download-wheels .whl     # here, where PyPI is reachable; then, on the GPU:
#     WHEELS=.whl bash benchmarks/gpu_profile.sh                # (or plain `bash benchmarks/gpu_profile.sh` with PyPI)
#     bash benchmarks/gpu_profile.sh --dry-run                  # on a CPU: every part at a tiny shape (its flags)
#
# Parts, the most decisive first, each with its own time limit, each table appended to $OUT/gpu_profile.md as soon as
# the part ends (a run cut short keeps what it measured; train_throughput.py prints each row as it is measured):
#  1. the Pythia-160M matrix, bf16, 8 × 2048 tokens a step: stock transformers + PyTorch loop (the baseline), neox_hf
#     as a user gets it, stock with per-layer torch.compile, transformers' Trainer (fused AdamW, sdpa), neox_hf with
#     compile off, neox_hf with its own PyTorch loss kernel instead of Liger / Cut Cross-Entropy — tokens/s, median
#     step ms, MFU against the datasheet's dense bf16 peak, peak GiB, data wait per step, ratio to stock (200 s);
#  2. torch.profiler at 160M, stock against neox_hf: kernel time by category, GPU idle time, kernel launches and
#     host syncs per step, the SDPA kernel that ran, the 12 costliest ops (75 s);
#  3. the 410M and 1B rows: stock against neox_hf (110 s);
#  4. the head loss alone at 160M: unfused, ours, Liger, Cut Cross-Entropy (30 s).
# Setup (benchmarks/gpu_setup.sh) takes up to 90 s: under 7 minutes in all. Targets (issue 40): neox_hf ≥ 1.3× stock
# at 160M, ≥ 1.15× at 410M and 1B, ≥ 1.2× the Trainer, ≥ 40% MFU at 1B.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY_RUN=1
    shift
fi
if [ "$DRY_RUN" = 1 ]; then  # a CPU: the parts' flags and scripts at a shape two cores run in seconds
    OUT_DIR="${OUT:-benchmarks/out}"
    mkdir -p "$OUT_DIR"
    PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
    START=$SECONDS
    DEVICE=cpu; SHAPE=14m; BIG=14m; BATCH=2; SEQ=64; STEPS=1; WARMUP=1; PRECISION=fp32; LOSS_SHAPE=14m
    SLOWER=4  # inductor compiles C++ on a CPU: the compile rows alone take minutes on 2 cores
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" TOKENIZERS_PARALLELISM=false
else
    # shellcheck source=benchmarks/gpu_setup.sh
    source benchmarks/gpu_setup.sh "$@" || exit $?
    DEVICE=cuda; SHAPE=160m; BIG=410m,1b; BATCH=8; SEQ=2048; STEPS=8; WARMUP=3; PRECISION=bf16; LOSS_SHAPE=160m
    SLOWER=1
fi
REPORT="$OUT_DIR/gpu_profile.md"
COMMON=(--device "$DEVICE" --precision "$PRECISION" --batch "$BATCH" --seq "$SEQ")
echo "## GPU profile ($("$PYTHON" -c "import sys; sys.path.insert(0, 'benchmarks'); import torch; from bench_common \
import device_name; print(device_name('$DEVICE') + ', torch ' + torch.__version__)"))" > "$REPORT"
STATUS=0

# part NAME SECONDS TITLE -- COMMAND...: run COMMAND under its limit (SIGINT first, so Python prints what it has),
# append its table (or the end of its errors) to the report at once.
part() {
    local name=$1 limit=$(($2 * SLOWER)) title=$3
    shift 4
    echo "[$((SECONDS - START)) s] $name: $*"
    timeout -s INT -k 10 "$limit" "$@" > "$OUT_DIR/$name.md" 2> "$OUT_DIR/$name.err"
    local status=$?
    {
        echo
        echo "### $title"
        echo
        cat "$OUT_DIR/$name.md"
        if [ "$status" -ne 0 ]; then
            echo "($name: exit status $status$([ "$status" -eq 124 ] && echo ", its ${limit} s limit"); the end of $name.err:)"
            tail -n 12 "$OUT_DIR/$name.err"
        fi
    } >> "$REPORT"
    [ "$status" -eq 0 ] || STATUS=1
}

part matrix 200 "1. Pythia-$SHAPE matrix, $PRECISION, $BATCH × $SEQ tokens/step (benchmarks/train_throughput.py)" -- \
    "$PYTHON" benchmarks/train_throughput.py "${COMMON[@]}" --shape "$SHAPE" --steps "$STEPS" --warmup "$WARMUP" \
    --rows stock,neox,stock-compile,trainer,neox-no-compile,neox-own-loss
part profile 75 "2. Where a Pythia-$SHAPE step's time goes (benchmarks/step_profile.py --peer stock --top 12)" -- \
    "$PYTHON" benchmarks/step_profile.py --peer stock "${COMMON[@]}" --shape "$SHAPE" --steps 3 --warmup 3 --top 12
part sizes 110 "3. Pythia-$BIG, stock vs neox_hf (benchmarks/train_throughput.py)" -- \
    "$PYTHON" benchmarks/train_throughput.py "${COMMON[@]}" --shape "$BIG" --steps "$STEPS" --warmup "$WARMUP" \
    --rows stock,neox
part loss 30 "4. The Pythia-$LOSS_SHAPE head loss alone (benchmarks/fused_loss.py)" -- \
    "$PYTHON" benchmarks/fused_loss.py --device "$DEVICE" --shapes "$LOSS_SHAPE" --dtypes "$PRECISION" --repeats 3

echo "[$((SECONDS - START)) s] done: $REPORT"
cat "$REPORT"
exit "$STATUS"
