#!/usr/bin/env bash
# One command for a GPU machine: install what is missing, run the CUDA suite and the GPU benchmark,
# print a short summary. Budgeted to finish in under 6 minutes; exits non-zero if anything failed.
#
#   bash benchmarks/device_check.sh
#
# Steps (each with its own time limit, taken from one overall deadline):
#   1. a GPU at all? (nvidia-smi or /dev/nvidia*), checked before installing anything: without one
#      it stops at once with a message and status 2;
#   2. torch: kept if importable, else `pip install torch==2.13.0` (PyPI's Linux wheels are CUDA
#      builds); then torch.cuda.is_available() must hold (status 2 if not, e.g. a CPU-only wheel);
#   3. the project from this working tree plus pytest and pytest-timeout (`pip install -e .`), unless
#      `import ember` already finds this tree; offline, it falls back to PYTHONPATH=src;
#   4. `pytest tests/cuda`, then `python benchmarks/gpu.py`;
#   5. the summary: GPU, torch, test counts (and failures by name), the benchmark table.
#
# Logs go to $OUT/device_check when OUT is set (a device session brings that folder back), else to a
# fresh temporary directory; the summary names it. PYTHON picks the interpreter (default python3).
# EMBER_DEVICE_CHECK_SKIP_PROBE=1 skips step 1's hardware probe (for testing the torch check).
set -u -o pipefail

cd "$(dirname "$0")/.."
START=$(date +%s)
DEADLINE=$((START + 345))  # 5 min 45 s: the whole check stays under 6 minutes
PY=${PYTHON:-python3}
LOG_DIR=${OUT:+$OUT/device_check}
LOG_DIR=${LOG_DIR:-$(mktemp -d)}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1 PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Single-machine collectives: NCCL's bootstrap and gloo on the loopback interface (a bare container
# may have no other), unless the caller chose.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}

say() { echo "[device_check $(($(date +%s) - START))s] $*"; }
stop() {  # stop STATUS MESSAGE: a clear reason, and a non-zero status
    echo "device_check: $2" >&2
    exit "$1"
}
left() {  # seconds left before the deadline, less a reserve kept for the steps after this one
    local n=$((DEADLINE - $(date +%s) - $1))
    echo $((n > 10 ? n : 10))
}

# 1. Is there a GPU at all? Checked before any install: torch's CUDA wheels take minutes to fetch.
if [ "${EMBER_DEVICE_CHECK_SKIP_PROBE:-0}" != 1 ]; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    if [ "${gpus:-0}" = 0 ] && ! ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
        stop 2 "no NVIDIA GPU on this machine (nvidia-smi lists none and there is no /dev/nvidia0). \
This check runs the CUDA suite and benchmark: run it on a machine with a CUDA GPU and its driver. \
On CPU, run the ordinary test command from README.md instead."
    fi
fi

# 2. torch, and CUDA through it.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    say "torch is missing: pip install torch==2.13.0"
    timeout "$(left 200)" "$PY" -m pip install -q --progress-bar off torch==2.13.0 >"$LOG_DIR/pip_torch.log" 2>&1 \
        || stop 1 "could not install torch==2.13.0 (see $LOG_DIR/pip_torch.log); install a CUDA build of torch first."
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    info=$("$PY" -c "import torch; print(f'torch {torch.__version__} (built for CUDA {torch.version.cuda})')" 2>&1)
    stop 2 "$info cannot use a GPU here: torch.cuda.is_available() is False. With a CPU-only torch build \
(version ending in +cpu, or CUDA None), install a CUDA build (pip install torch==2.13.0 from PyPI); \
with a CUDA build, check the driver (nvidia-smi)."
fi

# 3. The project from this tree, pytest and pytest-timeout.
here_ember() {  # ember from this tree, pytest, and what the suite uses (tqdm bars, TensorBoard)
    "$PY" - <<'EOF' >/dev/null 2>&1
import os, sys
import ember, pytest, pytest_timeout, tqdm, tensorboard, lightning_utilities  # noqa: F401
sys.exit(0 if os.path.realpath(ember.__file__).startswith(os.path.realpath("src")) else 1)
EOF
}
missing_modules() {  # what of the above cannot be imported (an offline machine may lack some)
    "$PY" - <<'EOF' 2>/dev/null
import importlib.util
names = ["ember", "pytest", "pytest_timeout", "tqdm", "tensorboard", "lightning_utilities"]
print(" ".join(n for n in names if importlib.util.find_spec(n) is None))
EOF
}
if ! here_ember; then
    say "installing the project from this working tree (pip install -e . pytest pytest-timeout)"
    if ! timeout "$(left 200)" "$PY" -m pip install -q --progress-bar off -e . pytest pytest-timeout \
            >"$LOG_DIR/pip_project.log" 2>&1; then
        say "pip install failed (offline?); using PYTHONPATH=src with what is installed (see $LOG_DIR/pip_project.log)"
        export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
    fi
    MISSING=$(missing_modules)
    case " $MISSING " in
        *" ember "*|*" pytest "*|*" lightning_utilities "*)
            stop 1 "cannot import $MISSING (see $LOG_DIR/pip_project.log): install the project's dependencies and \
pytest (pip install -e . pytest pytest-timeout), then run this again." ;;
    esac
    [ -n "$MISSING" ] && say "WARNING: not installed: $MISSING (tests that need them fail; pytest-timeout only guards hangs)"
fi
GPU_LINE=$("$PY" -c "
import torch
p = torch.cuda.get_device_properties(0)
print(f'{torch.cuda.device_count()} x {p.name} ({p.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, CUDA {torch.version.cuda}')")
say "$GPU_LINE"

# 4a. The CUDA suite.
say "pytest tests/cuda (log: $LOG_DIR/tests.log)"
timeout "$(left 110)" "$PY" -m pytest tests/cuda -p no:cacheprovider -o addopts="" -q -rfE \
    >"$LOG_DIR/tests.log" 2>&1
TESTS_RC=$?
TESTS_LINE=$(grep -E '(passed|failed|error|skipped)' "$LOG_DIR/tests.log" | tail -1)
[ "$TESTS_RC" = 124 ] && TESTS_LINE="TIMED OUT after its share of the 6 minutes; ${TESTS_LINE}"
FAILURES=$(grep -E '^(FAILED|ERROR) ' "$LOG_DIR/tests.log" | cut -c1-220)

# 4b. The benchmark (shortened when the tests left little time).
BENCH_ARGS=()
[ "$(left 0)" -lt 100 ] && BENCH_ARGS=(--quick)
say "python benchmarks/gpu.py ${BENCH_ARGS[*]:-} (log: $LOG_DIR/gpu_benchmark.log)"
timeout "$(left 5)" "$PY" benchmarks/gpu.py ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"} >"$LOG_DIR/gpu_benchmark.log" 2>&1
BENCH_RC=$?

# 5. Summary.
echo
echo "=== ember device check: $(($(date +%s) - START)) s ==="
echo "GPU: $GPU_LINE"
echo "tests/cuda: ${TESTS_LINE:-no result (see $LOG_DIR/tests.log)}"
[ -n "${MISSING:-}" ] && echo "not installed: $MISSING"
[ -n "$FAILURES" ] && echo "$FAILURES"
if [ "$BENCH_RC" = 0 ]; then
    echo "benchmarks/gpu.py:"
    grep -v '^GPU:' "$LOG_DIR/gpu_benchmark.log"
else
    echo "benchmarks/gpu.py: FAILED (status $BENCH_RC; 124 means out of time); last lines:"
    tail -5 "$LOG_DIR/gpu_benchmark.log"
fi
echo "logs: $LOG_DIR"
[ "$TESTS_RC" = 0 ] && [ "$BENCH_RC" = 0 ]
