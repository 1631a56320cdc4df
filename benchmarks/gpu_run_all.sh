#!/usr/bin/env bash
# Everything the GPU backend is checked with on a GPU host; logs and JSON go to OUTDIR.
#   bash benchmarks/gpu_run_all.sh OUTDIR [all|tests|bench] [VARIANTS]
# VARIANTS (comma-separated, default basic,pytorch,flat): the benchmark's models, each timed into
# OUTDIR/gpu_step_time-<variant>.json: `basic` benchmarks/gpu_gpt.py, `pytorch` models/gpt.py's
# GPT-2-small exported from PyTorch, `flat` the basic model transpiled with --flat-update.
# `tests` starts the benchmark's transpiles (CPU, minutes; in their own session, so they outlive
# the command) and runs the GPU tests meanwhile; `bench` waits for them (or transpiles itself) and times.
set -uo pipefail
outdir=${1:?usage: gpu_run_all.sh OUTDIR [all|tests|bench] [VARIANTS]}
mode=${2:-all}
variants=${3:-basic,pytorch,flat}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
flags() {
  case $1 in
    basic) echo "--model basic" ;;
    pytorch) echo "--model pytorch" ;;
    flat) echo "--model basic --flat-update" ;;
    *) echo "unknown benchmark variant '$1' (basic, pytorch, flat)" >&2; exit 2 ;;
  esac
}
for v in ${variants//,/ }; do flags "$v" >/dev/null || exit 2; done
if [ "$mode" != bench ]; then
  nvidia-smi -L
  python3 -c "import onnxruntime as o, cupy; from cupy.cuda import nccl; print('ort', o.__version__, o.get_available_providers(), 'cupy', cupy.__version__, 'nccl', nccl.get_version())"
  for v in ${variants//,/ }; do
    # shellcheck disable=SC2046
    touch "/tmp/bench_preparing-$v"
    setsid bash -c "python3 benchmarks/gpu_step_time.py $(flags "$v") --prepare-only --work /tmp/gpu-bench-$v \
      > /tmp/bench_prepare-$v.log 2>&1; touch /tmp/bench_prepared-$v" &
  done
  timeout 400 python3 -m pytest -q -s -m gpu -p no:cacheprovider \
    tests/test_gpu_equivalence.py tests/test_gpu_cli.py 2>&1 | tee "$outdir/gpu_tests.log" | tail -40
fi
if [ "$mode" != tests ]; then
  for v in ${variants//,/ }; do
    # On a machine where `tests` did not start the transpiles, --work is prepared by the timing run.
    if [ -e "/tmp/bench_preparing-$v" ]; then
      while [ ! -e "/tmp/bench_prepared-$v" ]; do sleep 2; done
      tail -3 "/tmp/bench_prepare-$v.log"
    fi
    # shellcheck disable=SC2046
    python3 benchmarks/gpu_step_time.py $(flags "$v") --work "/tmp/gpu-bench-$v" \
      -o "$outdir/gpu_step_time-$v.json" 2>&1 | tail -20
  done
fi
