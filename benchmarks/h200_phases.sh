#!/bin/bash
# Where the kernels' time goes, phase by phase, on the GPU machine (one device call, ~2 min):
#   1. the Pallas kernel under Mosaic GPU's in-kernel profiler (benchmarks/pallas_phases.py)
#   2. the CuTe trace build's phase timers (benchmarks/cute_phases.py)
# First, on a CPU machine with the DSL: python3 benchmarks/cute_phases.py build TRACE_DIR, and
# carry TRACE_DIR. Usage on the GPU machine: bash benchmarks/h200_phases.sh OUTDIR TRACE_DIR
set -u
out=${1:-${OUT:-/tmp/oproj_out}}
trace_dir=${2:?the directory of the trace cubin (cute_phases.py build)}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 150 python3 benchmarks/pallas_phases.py --tokens 1 64 --out "$out/pallas_phases.json" 2>&1 | tail -n 30
echo "pallas phases: rc=${PIPESTATUS[0]}"
timeout 150 python3 benchmarks/cute_phases.py run "$trace_dir" --tokens 1 64 --out "$out/cute_phases.json" 2>&1 | tail -n 40
echo "cute phases: rc=${PIPESTATUS[0]}"
