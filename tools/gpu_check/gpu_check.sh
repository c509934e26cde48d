#!/usr/bin/env bash
# One call on a bare, offline GPU machine: the measurements that matter most first, then the test
# suite on CUDA, then wider sweeps while time is left, all returned as two files.
#
#   bash tools/gpu_check/gpu_check.sh OUT        # OUT/summary.md + OUT/results.tar.gz, no more
#   bash tools/gpu_check/gpu_check.sh --dry-run  # the plan and its limits; runs nothing
#
# A device machine gives one command 10 minutes (timeout_s 570 here) and returns at most 8 files
# of at most 16 MiB, so every step writes into a staging folder and after each step gpu_report.py
# (beside this script) rewrites OUT/summary.md and OUT/results.tar.gz: a call cut short still
# returns what was measured. Each step of PLAN runs under a hard limit (the limits sum to BUDGET,
# 540 s): the benchmarks start no new case, and pytest no new test, MARGIN seconds before the
# step's SIGINT, which comes KILL_AFTER seconds before its limit (the benchmarks then write what
# they measured), and SIGKILL at the limit. An elastic step (the sweeps) also gets the time the
# steps before it left unused; a step behind schedule given less than MIN_STEP seconds is skipped.
#
# Needs torch and triton, no network: the wheels in $WHEELS (default wheels/ beside this script:
# einx and frozendict, which fastlm needs, and Liger-Kernel) whose distribution is not installed
# go into a temporary folder on PYTHONPATH (benchmarks/README.md says how to refresh them).
# Environment: PYTHON (default python3), WHEELS, BUDGET, LIMIT_<step> (their sum within BUDGET),
# KILL_AFTER, MARGIN, MIN_STEP; FASTLM_COMMIT is recorded where the tree came without .git.
set -uo pipefail

# name             limit  kind     what
PLAN='
setup               20     fixed    wheels into a temporary folder, env.json, nvidia-smi
train_headline      140    fixed    GPT-2-small step: fastlm compiled vs reference+SDPA compiled
attention_headline  75     fixed    causal bf16 D128 N 4k,16k fwd, fwd+bwd: fastlm (both bwd schedules), SDPA flash/cuDNN
kernels_headline    100    fixed    norms, RoPE, SwiGLU 16k x 4096, CE 16k x 32000; + CUDA graphs
moe_headline        40     fixed    MoE experts layer, Qwen3-30B-A3B sizes, fwd, fwd+bwd: fastlm vs grouped_mm, Liger, SonicMoE, eager
tests               75     fixed    pytest tests/ on CUDA (FASTLM_AUTOTUNE=0)
compile_report      20     fixed    compile_report.py --quick --arch sm_90a: the CI test rows
attention_sweep     15     elastic  attention.py --quick --skip-headline: N 1k, 64k, bwd, others
attention_varlen    12     elastic  attention.py --varlen --quick: packed docs 16k/32k, window 4k
kernels_sweep       12     elastic  kernels.py --quick --skip-headline: fused linear cross-entropy
train_hf            12     elastic  train.py --hf --quick: HF Llama, Llama-3-8B layers, padded/padding-free
train_sweep         9      elastic  train.py --skip-headline --seqs 1024: eager, reference compiled
pack                10     fixed    summary.md + results.tar.gz after every step; this is the last
'
BUDGET=${BUDGET:-540}
KILL_AFTER=${KILL_AFTER:-8}  # seconds between a step's SIGINT and its SIGKILL
MARGIN=${MARGIN:-10}         # no new case or test starts this long before the SIGINT
MIN_STEP=${MIN_STEP:-25}     # a step behind schedule given less than this is not started
REQUIRED=(einx frozendict numpy safetensors tqdm matplotlib pytest hypothesis)  # module names

HERE=$(cd "$(dirname "$0")" && pwd)
SELF=$HERE/$(basename "$0")
ROOT=$(cd "$HERE/../.." && pwd)
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-$HERE/wheels}
REPORT=tools/gpu_check/gpu_report.py

usage() {
    echo "usage: bash tools/gpu_check/gpu_check.sh OUT | --dry-run   (benchmarks/README.md)" >&2
    exit 2
}

# --- The plan ----------------------------------------------------------------------------------
NAMES=() LIMITS=() KINDS=() WHATS=()
while read -r name limit kind what; do
    [ -n "$name" ] || continue
    override="LIMIT_$name"
    NAMES+=("$name") LIMITS+=("${!override:-$limit}") KINDS+=("$kind") WHATS+=("$what")
done <<<"$PLAN"
TOTAL=0
for limit in "${LIMITS[@]}"; do TOTAL=$((TOTAL + limit)); done

print_plan() {
    echo "gpu_check.sh plan (--dry-run: nothing is run)"
    echo "call: bash tools/gpu_check/gpu_check.sh OUT"
    echo "device machine: bash tools/gpu_check/gpu_check.sh \$OUT, timeout_s 570"
    echo "output: OUT/summary.md and OUT/results.tar.gz, nothing else at OUT's top level"
    echo "budget: ${BUDGET} s; at its limit a step gets SIGINT, then SIGKILL ${KILL_AFTER} s later;"
    echo "an elastic step also gets the time the steps before it left unused"
    echo
    echo "| step | limit s | kind | what |"
    echo "|---|---|---|---|"
    for i in "${!NAMES[@]}"; do
        echo "| ${NAMES[$i]} | ${LIMITS[$i]} | ${KINDS[$i]} | ${WHATS[$i]} |"
    done
    echo
    echo "total of limits: ${TOTAL} s (budget ${BUDGET} s)"
}

# --- One step's command (run as `gpu_check.sh --step NAME SECONDS` under timeout) --------------
step_command() {  # NAME SECONDS: SECONDS is the benchmark's own time limit
    local name=$1 soft=$2
    local bench=(--out "$STAGE" --time-limit "$soft")
    cd "$ROOT" || exit 2
    case $name in
    setup)
        local wheels=()
        for wheel in "$WHEELS"/*.whl; do
            [ -f "$wheel" ] && ! installed "$wheel" && wheels+=("$wheel")
        done
        if [ "${#wheels[@]}" -gt 0 ]; then
            echo "installing into $SITE: ${wheels[*]##*/}"
            # pip refuses the whole list when one wheel does not fit this Python: then one by one.
            pip_install "${wheels[@]}" || for wheel in "${wheels[@]}"; do
                pip_install "$wheel" || echo "gpu_check.sh: could not install ${wheel##*/}" >&2
            done
        fi
        nvidia-smi >"$STAGE/nvidia-smi.log" 2>&1 || echo "nvidia-smi failed" >&2
        exec "$PY" benchmarks/_common.py env --out "$STAGE" --require "${REQUIRED[@]}" --need-cuda ;;
    train_headline) exec "$PY" benchmarks/train.py --headline "${bench[@]}" ;;
    attention_headline) exec "$PY" benchmarks/attention.py --headline "${bench[@]}" ;;
    kernels_headline) exec "$PY" benchmarks/kernels.py --headline "${bench[@]}" ;;
    moe_headline) exec "$PY" benchmarks/moe.py --headline "${bench[@]}" ;;
    tests)
        # No new test after SECONDS (gpu_report.py says why SIGINT cannot stop the suite); -v
        # prints each test's result as it ends, so a log cut at the hard limit shows what ran.
        export FASTLM_AUTOTUNE=0
        exec "$PY" "$REPORT" pytest "$soft" tests/ -v --tb=short -rfE \
            -p no:cacheprovider --continue-on-collection-errors --durations=15 \
            --junitxml="$STAGE/tests.xml" ;;
    compile_report)
        exec "$PY" benchmarks/compile_report.py --quick --arch sm_90a --json "$STAGE/compile_report.json" ;;
    attention_sweep) exec "$PY" benchmarks/attention.py --quick --skip-headline "${bench[@]}" ;;
    attention_varlen) exec "$PY" benchmarks/attention.py --varlen --quick "${bench[@]}" ;;
    kernels_sweep) exec "$PY" benchmarks/kernels.py --quick --skip-headline "${bench[@]}" ;;
    train_hf) exec "$PY" benchmarks/train.py --hf --quick "${bench[@]}" ;;
    train_sweep) exec "$PY" benchmarks/train.py --skip-headline --seqs 1024 "${bench[@]}" ;;
    *) echo "gpu_check.sh: no step $name" >&2; exit 2 ;;
    esac
}

installed() {  # WHEEL: is the wheel's distribution installed already?
    "$PY" - "$1" <<'PYTHON'
import importlib.metadata, pathlib, sys
try:
    importlib.metadata.distribution(pathlib.Path(sys.argv[1]).name.split("-")[0])
except importlib.metadata.PackageNotFoundError:
    sys.exit(1)
PYTHON
}

pip_install() {
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile --target "$SITE" "$@"
}

if [ "${1:-}" = --step ]; then  # internal: one step, under gpu_check.sh's timeout
    [ $# -eq 3 ] || usage
    step_command "$2" "$3"
    exit $?
fi

# --- Arguments ---------------------------------------------------------------------------------
[ $# -eq 1 ] || usage
if [ "$TOTAL" -gt "$BUDGET" ]; then
    echo "gpu_check.sh: the step limits sum to ${TOTAL} s, over the budget of ${BUDGET} s" >&2
    exit 2
fi
if [ "$1" = --dry-run ]; then
    print_plan
    exit 0
fi
case $1 in -*) usage ;; esac
OUT=$1
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
for entry in "$OUT"/* "$OUT"/.[!.]*; do
    [ -e "$entry" ] || continue
    case ${entry##*/} in
    summary.md | results.tar.gz | *.partial) ;;  # an earlier run's output: replaced
    *) echo "gpu_check.sh: OUT ($OUT) holds ${entry##*/}; it may hold only summary.md and" \
            "results.tar.gz" >&2
       exit 2 ;;
    esac
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/fastlm-gpu-check.XXXXXX")
export STAGE=$WORK/stage SITE=$WORK/site PY WHEELS ROOT PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$STAGE" "$SITE"
cd "$ROOT" || exit 2
START=$SECONDS

publish() {  # summary.md and results.tar.gz into OUT; plain tar if gpu_report.py fails
    timeout 30 "$PY" "$REPORT" publish "$STAGE" "$OUT" && return
    echo "gpu_check.sh: gpu_report.py failed; packing with tar" >&2
    tar -czf "$OUT/results.tar.gz.partial" -C "$WORK" stage \
        && mv -f "$OUT/results.tar.gz.partial" "$OUT/results.tar.gz"
    printf '# fastlm GPU check\n\ngpu_report.py failed: see results.tar.gz (steps.tsv, logs)\n' \
        >"$OUT/summary.md"
}
trap 'echo "gpu_check.sh: interrupted"; publish; exit 130' INT TERM

record() {  # NAME PLANNED LIMIT SECONDS RC NOTE: one line of steps.tsv
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$STAGE/steps.tsv"
}

# --- The steps ---------------------------------------------------------------------------------
FAILED=0
for i in "${!NAMES[@]}"; do
    name=${NAMES[$i]} planned=${LIMITS[$i]}
    [ "$name" = pack ] && continue
    later=0  # what the steps after this one are planned to take, the last pack included
    for j in "${!NAMES[@]}"; do [ "$j" -gt "$i" ] && later=$((later + LIMITS[j])); done
    left=$((BUDGET - (SECONDS - START) - later))  # >= planned while every step kept its limit
    if [ "${KINDS[$i]}" = elastic ]; then
        limit=$left
    else
        limit=$((planned < left ? planned : left))
    fi
    if [ "$limit" -lt "$((planned < MIN_STEP ? planned : MIN_STEP))" ]; then
        record "$name" "$planned" "$limit" 0 - "only ${limit} s left"
        continue
    fi
    echo
    echo "=== $name (limit ${limit} s, $((SECONDS - START)) s so far)"
    step_start=$SECONDS
    hard=$((limit - KILL_AFTER > 1 ? limit - KILL_AFTER : 1))  # SIGINT then, SIGKILL at limit
    soft=$((hard - MARGIN > 1 ? hard - MARGIN : 1))  # no new case or test after this
    timeout -s INT --kill-after="$KILL_AFTER" "$hard" \
        bash "$SELF" --step "$name" "$soft" 2>&1 | tee "$STAGE/$name.log"
    rc=${PIPESTATUS[0]}
    record "$name" "$planned" "$limit" "$((SECONDS - step_start))" "$rc" ""
    [ "$rc" -eq 0 ] || FAILED=1
    publish
    if [ "$name" = setup ] && [ "$rc" -eq 3 ]; then
        echo "gpu_check.sh: $PY sees no CUDA device; nothing to measure (summary in $OUT)" >&2
        FAILED=2
        break
    fi
done

echo
echo "gpu_check.sh: $((SECONDS - START)) s; $OUT/summary.md and $OUT/results.tar.gz"
rm -rf "$WORK"
exit "$FAILED"
