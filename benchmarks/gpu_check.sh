#!/usr/bin/env bash
# The one script to run on a CUDA machine: the test suite on the GPU, then every benchmark in
# --quick mode, with the environment and a summary, all under one folder, in under 8 minutes.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]      (default: benchmarks/results/<date>-<gpu>/)
#
# Needs torch and triton; no network. The other packages fastlm and its tests import (einx,
# frozendict, numpy, safetensors, tqdm, matplotlib, pytest, hypothesis) are checked first; when
# some are missing, every wheel in $WHEELS (default benchmarks/wheels/) whose distribution is not
# installed goes into a temporary folder on PYTHONPATH. benchmarks/README.md says how to fetch
# those wheels on a machine with network access.
#
# Each step runs under a hard limit in seconds (TESTS_LIMIT, KERNELS_LIMIT, ATTENTION_LIMIT,
# TRAIN_LIMIT: 380 s in all by default), then gets SIGINT, and KILL_AFTER seconds later SIGKILL.
# The benchmarks stop starting measurements MARGIN seconds before their limit; on SIGINT they
# write the tables of what they measured (their CSV also grows row by row), and pytest prints its
# summary. The tests run with FASTLM_AUTOTUNE=0 (one default configuration per kernel: autotuning
# would compile every candidate for each new shape the tests use); the benchmarks autotune.
# Environment: PYTHON (default python3), WHEELS, the limits above.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-$ROOT/benchmarks/wheels}
TESTS_LIMIT=${TESTS_LIMIT:-120}
KERNELS_LIMIT=${KERNELS_LIMIT:-70}
ATTENTION_LIMIT=${ATTENTION_LIMIT:-115}
TRAIN_LIMIT=${TRAIN_LIMIT:-75}
KILL_AFTER=${KILL_AFTER:-8}
MARGIN=20
REQUIRED="einx frozendict numpy safetensors tqdm matplotlib pytest hypothesis"  # module names
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check.sh: $PY sees no CUDA device (torch.cuda.is_available() is False)." >&2
    echo "Without a GPU, run the scripts directly: they check the kernels through Triton's interpreter." >&2
    exit 2
fi

# --- Missing dependencies, from local wheels -------------------------------------------------
missing() {  # the modules of REQUIRED that cannot be imported
    "$PY" - $REQUIRED <<'PYTHON'
import importlib.util, sys
print(" ".join(name for name in sys.argv[1:] if importlib.util.find_spec(name) is None))
PYTHON
}
uninstalled_wheels() {  # the distributions with a wheel in WHEELS that are not installed
    "$PY" - "$WHEELS"/*.whl <<'PYTHON'
import importlib.metadata, pathlib, sys

def installed(name):
    try:
        importlib.metadata.distribution(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False

names = {pathlib.Path(wheel).name.split("-")[0] for wheel in sys.argv[1:]}
print(" ".join(sorted(name for name in names if not installed(name))))
PYTHON
}

MISSING=$(missing)
if [ -n "$MISSING" ]; then
    echo "missing Python packages: $MISSING"
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        SITE=$(mktemp -d "${TMPDIR:-/tmp}/fastlm-wheels.XXXXXX")
        NAMES=$(uninstalled_wheels)
        echo "installing from $WHEELS into $SITE: $NAMES"
        PIP=("$PY" -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" --target "$SITE")
        # pip refuses the whole list when one wheel does not fit this Python: then one at a time.
        if [ -n "$NAMES" ] && ! "${PIP[@]}" $NAMES; then
            for name in $NAMES; do
                "${PIP[@]}" "$name" || echo "gpu_check.sh: could not install $name from $WHEELS" >&2
            done
        fi
        export PYTHONPATH="$PYTHONPATH:$SITE"
        MISSING=$(missing)
    fi
    if [ -n "$MISSING" ]; then
        echo "gpu_check.sh: still missing: $MISSING. Put their wheels, and their dependencies'," \
             "in $WHEELS (benchmarks/README.md says how); what imports them fails meanwhile." >&2
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
    timeout -s INT --kill-after="$KILL_AFTER" "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]} status=ok
    if [ "$rc" -eq 124 ]; then
        status="timed out (interrupted at the limit)"
    elif [ "$rc" -eq 137 ]; then
        status="timed out (killed)"
    elif [ "$rc" -ne 0 ]; then
        status="failed (exit $rc)"
    fi
    NAMES+=("$name")
    STATUSES+=("$status")
    TIMES+=("$((SECONDS - start))")
}

# -v prints each test's result as it ends, so a log cut by the limit still shows what ran; a test
# file that fails to import is reported and the other files still run.
step tests "$TESTS_LIMIT" env FASTLM_AUTOTUNE=0 "$PY" -m pytest tests/ -v --tb=short \
    -p no:cacheprovider --continue-on-collection-errors --durations=10
step kernels "$KERNELS_LIMIT" "$PY" benchmarks/kernels.py --quick --out "$OUT" \
    --time-limit "$((KERNELS_LIMIT - MARGIN))"
step attention "$ATTENTION_LIMIT" "$PY" benchmarks/attention.py --quick --out "$OUT" \
    --time-limit "$((ATTENTION_LIMIT - MARGIN))"
step train "$TRAIN_LIMIT" "$PY" benchmarks/train.py --quick --out "$OUT" \
    --time-limit "$((TRAIN_LIMIT - MARGIN))"

# --- Summary ---------------------------------------------------------------------------------
{
    echo "# gpu_check $(date -Iseconds)"
    "$PY" -c 'import json, sys; e = json.load(open(sys.argv[1])); print(", ".join(f"{k} {e[k]}" for k in ("gpu", "torch", "triton", "cuda", "commit")))' "$OUT/env.json" 2>/dev/null
    [ -n "$MISSING" ] && echo "missing Python packages: $MISSING"
    echo
    echo "| step | status | seconds | log |"
    echo "|---|---|---|---|"
    for i in "${!NAMES[@]}"; do
        echo "| ${NAMES[$i]} | ${STATUSES[$i]} | ${TIMES[$i]} | ${NAMES[$i]}.log |"
    done
    echo
    tail -n 3 "$OUT/tests.log" 2>/dev/null | grep -E "passed|failed|error" \
        || echo "tests: no pytest summary line (killed by the limit?); see tests.log"
    for name in kernels attention train; do
        [ -f "$OUT/${name}_summary.md" ] && { echo; cat "$OUT/${name}_summary.md"; }
    done
    echo
    echo "total: ${SECONDS} s; everything is in $OUT"
} | tee "$OUT/summary.md"

for status in "${STATUSES[@]}"; do
    [ "$status" = ok ] || exit 1
done
