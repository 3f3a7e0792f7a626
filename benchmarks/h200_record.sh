#!/bin/bash
# The benchmark of record on one GPU (benchmarks/record.py: chain slopes in 3 processes, median;
# the decode step), plus the A/B of the cute targets' registration (oproj_jax.cute.ffi.REGISTRATION)
# in the same session. Usage on the GPU machine: bash benchmarks/h200_record.sh OUTDIR
# Build first (python -m oproj_jax.build) and carry oproj_jax/_lib and oproj_jax/cute/cubins.
set -u
out=${1:-${OUT:-/tmp/oproj_record}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$SECONDS
timeout 250 python3 benchmarks/record.py --out-dir "$out" --backends cute --tokens 1,8,64,512,4096 \
  --decode-tokens 1,64 --timeout 60 > "$out/record.txt" 2>&1
echo "record (cute): rc=$? ($((SECONDS - t0)) s)"; tail -n 10 "$out/record.txt"
t0=$SECONDS
timeout 180 python3 benchmarks/record.py --out-dir "$out" --backends pallas --tokens 1,64,4096 --decode-tokens "" \
  --timeout 58 --name record-pallas > "$out/record-pallas.txt" 2>&1
echo "record (pallas): rc=$? ($((SECONDS - t0)) s)"; tail -n 4 "$out/record-pallas.txt"
for reg in direct; do
  t0=$SECONDS
  timeout 45 python3 -m oproj_jax.bench --backends cute --tokens 1,8,64 --reps 10 --no-profile \
    --registration $reg --json "$out/ab-$reg.json" > "$out/ab-$reg.txt" 2>&1
  echo "chain, registration $reg: rc=$? ($((SECONDS - t0)) s)"; grep -E "^cute" "$out/ab-$reg.txt"
  t0=$SECONDS
  timeout 45 python3 -m oproj_jax.bench --decode-step --backends cute --tokens 1,64 --registration $reg \
    --json "$out/decode-$reg.json" > "$out/decode-$reg.txt" 2>&1
  echo "decode step, registration $reg: rc=$? ($((SECONDS - t0)) s)"; grep -E "^cute" "$out/decode-$reg.txt"
done
