#!/usr/bin/env bash
# The GPU check lives in tools/gpu_check/ (it runs the test suite too, not only benchmarks); this
# keeps the command that sessions with a GPU are told to run working: bash benchmarks/gpu_check.sh OUT
exec bash "$(dirname "$0")/../tools/gpu_check/gpu_check.sh" "$@"
