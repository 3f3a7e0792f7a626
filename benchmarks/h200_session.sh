#!/bin/bash
# One H200 session, in order of value, each step bounded (the device tool allows ~10 min a call):
#   1. benchmarks/run_h200.py: every backend checked on fresh data and timed -> results JSON
#      (reference, pallas, cute through XLA, cute-graph: the same cubin in CUDA graphs, torch)
#   2. the CuTe backend's GPU tests (parity, re-arming, late publish, loops, torch launch parity)
# Build first on a CPU machine (python -m oproj_jax.build) and carry oproj_jax/_lib and
# oproj_jax/cute/cubins. Usage on the GPU machine: bash benchmarks/h200_session.sh OUTDIR [REPS]
set -u
out=${1:-${OUT:-/tmp/oproj_out}}
reps=${2:-10}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$SECONDS
timeout 280 python3 benchmarks/run_h200.py --out-dir "$out" --reps "$reps" > "$out/bench.txt" 2>&1
echo "benchmark: rc=$? ($((SECONDS - t0)) s)"; tail -n 45 "$out/bench.txt"
t0=$SECONDS
timeout 150 python3 -m pytest tests/test_cute_gpu.py -q -rfEsx --tb=short -p no:cacheprovider \
  > "$out/cute_gpu.txt" 2>&1
echo "cute GPU tests: rc=$? ($((SECONDS - t0)) s)"; tail -n 12 "$out/cute_gpu.txt"
