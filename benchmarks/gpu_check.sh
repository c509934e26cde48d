#!/usr/bin/env bash
# The one script to run on a CUDA machine: the test suite on the GPU, then every benchmark in
# --quick mode, with the environment and a summary, all under one folder, in under 8 minutes.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]      (default: benchmarks/results/<date>-<gpu>/)
#
# Needs torch and triton; no network. einx and frozendict (needed by fastlm.reference) are
# installed from wheels in $WHEELS (default benchmarks/wheels/) when they are missing; see
# benchmarks/README.md for how to fetch those wheels on a machine with network access.
# Environment: PYTHON (default python3), WHEELS, and per-step limits in seconds TESTS_LIMIT,
# KERNELS_LIMIT, ATTENTION_LIMIT, TRAIN_LIMIT (each benchmark stops starting new measurements
# some seconds before its limit, so it still writes its tables).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-$ROOT/benchmarks/wheels}
TESTS_LIMIT=${TESTS_LIMIT:-100}
KERNELS_LIMIT=${KERNELS_LIMIT:-95}
ATTENTION_LIMIT=${ATTENTION_LIMIT:-170}
TRAIN_LIMIT=${TRAIN_LIMIT:-95}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check.sh: $PY sees no CUDA device (torch.cuda.is_available() is False)." >&2
    echo "Without a GPU, run the scripts directly: they check the kernels through Triton's interpreter." >&2
    exit 2
fi

# --- Missing pure-Python dependencies, from local wheels -------------------------------------
missing() {
    "$PY" -c 'import importlib.util as u; print(" ".join(m for m in ("einx", "frozendict") if u.find_spec(m) is None))'
}
if [ -n "$(missing)" ]; then
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        SITE=${TMPDIR:-/tmp}/fastlm-wheels
        echo "installing $(missing) from $WHEELS into $SITE"
        "$PY" -m pip install --quiet --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl \
            || echo "gpu_check.sh: installing the wheels from $WHEELS failed" >&2
        export PYTHONPATH="$PYTHONPATH:$SITE"
    fi
    if [ -n "$(missing)" ]; then
        echo "gpu_check.sh: missing Python packages: $(missing). Put their wheels in $WHEELS" \
             "(benchmarks/README.md says how); the tests and the reference baselines need them." >&2
    fi
fi

# --- Output folder and environment -----------------------------------------------------------
OUT=${1:-$ROOT/benchmarks/results/$(date +%Y-%m-%d)-$("$PY" benchmarks/_common.py --slug)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
echo "writing to $OUT"
{ "$PY" benchmarks/_common.py --out "$OUT"; nvidia-smi 2>&1; } >"$OUT/env.log" 2>&1
cat "$OUT/env.json" 2>/dev/null

# --- Steps -----------------------------------------------------------------------------------
declare -a NAMES STATUSES TIMES
step() {  # step NAME LIMIT_SECONDS COMMAND...: run with a hard limit, log to OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo
    echo "=== $name (limit ${limit} s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]} status=ok
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        status="timed out"
    elif [ "$rc" -ne 0 ]; then
        status="failed (exit $rc)"
    fi
    NAMES+=("$name")
    STATUSES+=("$status")
    TIMES+=("$((SECONDS - start))")
}

# -v prints each test's result as it ends, so a log cut by the limit still shows what ran.
step tests "$TESTS_LIMIT" "$PY" -m pytest tests/ -v --tb=short -p no:cacheprovider --durations=10
step kernels "$KERNELS_LIMIT" "$PY" benchmarks/kernels.py --quick --out "$OUT" \
    --time-limit "$((KERNELS_LIMIT - 25))"
step attention "$ATTENTION_LIMIT" "$PY" benchmarks/attention.py --quick --out "$OUT" \
    --time-limit "$((ATTENTION_LIMIT - 25))"
step train "$TRAIN_LIMIT" "$PY" benchmarks/train.py --quick --out "$OUT" \
    --time-limit "$((TRAIN_LIMIT - 25))"

# --- Summary ---------------------------------------------------------------------------------
{
    echo "# gpu_check $(date -Iseconds)"
    "$PY" -c 'import json, sys; e = json.load(open(sys.argv[1])); print(", ".join(f"{k} {e[k]}" for k in ("gpu", "torch", "triton", "cuda", "commit")))' "$OUT/env.json" 2>/dev/null
    echo
    echo "| step | status | seconds | log |"
    echo "|---|---|---|---|"
    for i in "${!NAMES[@]}"; do
        echo "| ${NAMES[$i]} | ${STATUSES[$i]} | ${TIMES[$i]} | ${NAMES[$i]}.log |"
    done
    echo
    tail -n 3 "$OUT/tests.log" 2>/dev/null | grep -E "passed|failed|error" \
        || echo "tests: no pytest summary line (cut by the limit?); see tests.log"
    for name in kernels attention train; do
        [ -f "$OUT/${name}_summary.md" ] && { echo; cat "$OUT/${name}_summary.md"; }
    done
    echo
    echo "total: ${SECONDS} s; everything is in $OUT"
} | tee "$OUT/summary.md"

for status in "${STATUSES[@]}"; do
    [ "$status" = ok ] || exit 1
done
