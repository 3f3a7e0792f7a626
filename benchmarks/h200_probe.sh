#!/bin/bash
# Per-call dispatch diagnostics on one GPU (benchmarks/dispatch_probe.py), one process per XLA
# flag set or FFI library variant, then the thunk sequence XLA compiled for a cute chain.
# Usage on the GPU machine: bash benchmarks/h200_probe.sh OUTDIR [variant ...]
# Variants: default, nocmdbuf (no command buffers), nocustom (command buffers without custom
# calls), traced / direct (oproj_jax.cute.ffi.REGISTRATION), notrait (FFI library at .dev/nocmd built without the command-buffer trait).
set -u
out=${1:-${OUT:-/tmp/oproj_out}}; shift || true
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
probe() {
  local label=$1; shift
  local t0=$SECONDS
  env "$@" timeout 240 python3 benchmarks/dispatch_probe.py --label "$label" --out "$out/probe-$label.json" \
    ${PROBE_ARGS:-} > "$out/probe-$label.txt" 2>&1
  echo "== $label rc=$? ($((SECONDS - t0)) s)"; grep -E "slope|Error|error" "$out/probe-$label.txt" | tail -n 14
}
for v in "${@:-default nocmdbuf nocustom notrait}"; do
  for variant in $v; do
    case $variant in
      default) probe default ;;
      traced) PROBE_ARGS="${PROBE_ARGS:-} --registration traced" probe traced ;;
      direct) PROBE_ARGS="${PROBE_ARGS:-} --registration direct" probe direct ;;
      nocmdbuf) probe nocmdbuf XLA_FLAGS=--xla_gpu_enable_command_buffer= ;;
      nocustom) probe nocustom XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN ;;
      notrait) probe notrait OPROJ_JAX_FFI_LIBRARY=$PWD/.dev/nocmd/liboproj_ffi.so ;;
      *) echo "unknown variant $variant" ;;
    esac
  done
done
