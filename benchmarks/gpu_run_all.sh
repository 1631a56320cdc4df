#!/usr/bin/env bash
# Everything the GPU backend is checked with on a GPU host; logs and JSON go to OUTDIR.
#   bash benchmarks/gpu_run_all.sh OUTDIR [all|tests|bench]
# `tests` starts the benchmark's transpiles (CPU, minutes; in their own session, so they outlive
# the command) and runs the GPU tests meanwhile; `bench` waits for the transpiles and times.
set -uo pipefail
outdir=${1:?usage: gpu_run_all.sh OUTDIR [all|tests|bench]}
mode=${2:-all}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
if [ "$mode" != bench ]; then
  nvidia-smi -L
  python3 -c "import onnxruntime as o, cupy; from cupy.cuda import nccl; print('ort', o.__version__, o.get_available_providers(), 'cupy', cupy.__version__, 'nccl', nccl.get_version())"
  setsid bash -c "python3 benchmarks/gpu_step_time.py --prepare-only --work /tmp/gpu-bench > /tmp/bench_prepare.log 2>&1; touch /tmp/bench_prepared" &
  GPU_REPORT="$outdir/equivalence.txt" timeout 400 python3 -m pytest -q -s -m gpu -p no:cacheprovider \
    tests/test_gpu_equivalence.py tests/test_gpu_cli.py 2>&1 | tee "$outdir/gpu_tests.log" | tail -40
fi
if [ "$mode" != tests ]; then
  while [ ! -e /tmp/bench_prepared ]; do sleep 2; done
  tail -3 /tmp/bench_prepare.log
  python3 benchmarks/gpu_step_time.py --work /tmp/gpu-bench -o "$outdir/gpu_step_time.json" 2>&1 | tail -20
fi
