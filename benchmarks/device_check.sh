#!/usr/bin/env bash
# One command for a GPU machine: run the CUDA suite and the GPU benchmark from this working tree,
# print a short summary. Budgeted to finish in under 6 minutes; exits non-zero if anything failed.
#
#   bash benchmarks/device_check.sh
#
# Offline first: the device machines reach no package index, so nothing is installed and nothing
# waits on pip. The project runs from this tree (PYTHONPATH=src) with what the machine has: torch
# with CUDA, pytest, pytest-timeout, lightning-utilities, tqdm, tensorboard.
#
# Steps (each with its own time limit, taken from one overall deadline):
#   1. a GPU at all? (nvidia-smi or /dev/nvidia*): without one it stops at once, status 2;
#   2. torch with CUDA (status 2 with what to install if torch is missing or cannot use the GPU);
#   3. the modules the suite needs (status 1 naming the missing ones);
#   4. `pytest tests/cuda` in a process group of its own: whatever it leaves behind (a timed-out
#      test's ranks) is killed, and the GPU is checked to be free of it before the benchmark;
#   5. `python benchmarks/gpu.py`, then the summary in the last lines: GPU, torch, test counts
#      (and failures by name), the benchmark table.
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
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # this tree's ember, whatever is installed
# Single-machine collectives: NCCL's bootstrap and gloo on the loopback interface (a bare container
# may have no other), unless the caller chose; NCCL says only what went wrong.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

say() { echo "[device_check $(($(date +%s) - START))s] $*"; }
stop() {  # stop STATUS MESSAGE: a clear reason, and a non-zero status
    echo "device_check: $2" >&2
    exit "$1"
}
left() {  # seconds left before the deadline, less a reserve kept for the steps after this one
    local n=$((DEADLINE - $(date +%s) - $1))
    echo $((n > 10 ? n : 10))
}
run_group() {  # run_group SECONDS LOG CMD...: CMD in a process group of its own, all of it killed at the end
    local limit=$1 log=$2 pid rc waited=0
    shift 2
    setsid "$@" >"$log" 2>&1 &
    pid=$!
    while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "$limit" ]; do sleep 1; waited=$((waited + 1)); done
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM -- "-$pid" 2>/dev/null; sleep 3; kill -KILL -- "-$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
        rc=124
    else
        wait "$pid"; rc=$?
    fi
    kill -KILL -- "-$pid" 2>/dev/null  # children that outlived a finished run (orphaned ranks)
    return "$rc"
}

# 1. Is there a GPU at all?
if [ "${EMBER_DEVICE_CHECK_SKIP_PROBE:-0}" != 1 ]; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    if [ "${gpus:-0}" = 0 ] && ! ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
        stop 2 "no NVIDIA GPU on this machine (nvidia-smi lists none and there is no /dev/nvidia0). \
This check runs the CUDA suite and benchmark: run it on a machine with a CUDA GPU and its driver. \
On CPU, run the ordinary test command from README.md instead."
    fi
fi

# 2. torch, and CUDA through it (one interpreter start: importing torch takes seconds).
TORCH=$("$PY" -c "
import torch
print('ok' if torch.cuda.is_available() else f'torch {torch.__version__} (built for CUDA {torch.version.cuda})')" 2>/dev/null)
if [ -z "$TORCH" ]; then
    stop 2 "torch cannot be imported by $PY: install a CUDA build of torch (pip install torch from PyPI) first."
fi
if [ "$TORCH" != ok ]; then
    stop 2 "$TORCH cannot use a GPU here: torch.cuda.is_available() is False. With a CPU-only torch build \
(version ending in +cpu, or CUDA None), install a CUDA build (pip install torch from PyPI); \
with a CUDA build, check the driver (nvidia-smi)."
fi

# 3. What the suite imports.
MISSING=$("$PY" -c "
import importlib.util
names = ['ember', 'pytest', 'pytest_timeout', 'tqdm', 'tensorboard', 'lightning_utilities']
print(' '.join(n for n in names if importlib.util.find_spec(n) is None))" 2>/dev/null)
case " $MISSING " in
    *" ember "*|*" pytest "*|*" lightning_utilities "*)
        stop 1 "cannot import $MISSING with PYTHONPATH=src: install them (pip install -e . pytest pytest-timeout) \
where a package index is reachable, then run this again." ;;
esac
[ -n "$MISSING" ] && say "WARNING: not installed: $MISSING (tests that need them fail; pytest-timeout only guards hangs)"
GPU_LINE=$("$PY" -c "
import torch
p = torch.cuda.get_device_properties(0)
print(f'{torch.cuda.device_count()} x {p.name} ({p.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, CUDA {torch.version.cuda}')")
say "$GPU_LINE"

# 4a. The CUDA suite.
say "pytest tests/cuda (log: $LOG_DIR/tests.log)"
run_group "$(left 110)" "$LOG_DIR/tests.log" "$PY" -m pytest tests/cuda -p no:cacheprovider -o addopts="" -q -rfE
TESTS_RC=$?
# Nothing of the suite may hold the GPU while the benchmark measures: wait until nvidia-smi lists
# no compute process (the killed group's CUDA contexts are torn down by the driver).
HOLDERS=""
for _ in 1 2 3 4 5 6 7 8 9 10; do
    HOLDERS=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ' | tr '\n' ' ')
    [ -z "${HOLDERS// /}" ] && HOLDERS="" && break
    sleep 1
done
[ -n "$HOLDERS" ] && say "WARNING: processes still hold the GPU before the benchmark: $HOLDERS"
TESTS_LINE=$(grep -E '(passed|failed|error|skipped)' "$LOG_DIR/tests.log" | tail -1)
[ "$TESTS_RC" = 124 ] && TESTS_LINE="TIMED OUT after its share of the 6 minutes; ${TESTS_LINE}"
FAILURES=$(grep -E '^(FAILED|ERROR) ' "$LOG_DIR/tests.log" | cut -c1-220)

# 4b. The benchmark (shortened when the tests left little time).
BENCH_ARGS=()
[ "$(left 0)" -lt 100 ] && BENCH_ARGS=(--quick)
say "python benchmarks/gpu.py ${BENCH_ARGS[*]:-} (log: $LOG_DIR/gpu_benchmark.log)"
run_group "$(left 5)" "$LOG_DIR/gpu_benchmark.log" "$PY" benchmarks/gpu.py ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"}
BENCH_RC=$?

# 5. Summary.
echo
echo "=== ember device check: $(($(date +%s) - START)) s ==="
echo "GPU: $GPU_LINE"
echo "tests/cuda: ${TESTS_LINE:-no result (see $LOG_DIR/tests.log)}"
[ -n "$HOLDERS" ] && echo "GPU still held by pids $HOLDERS while the benchmark ran (its figures may be skewed)"
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
