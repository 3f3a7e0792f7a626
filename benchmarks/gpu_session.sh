#!/bin/bash
# One GPU session, each stage bounded: the benchmark of record on GPU 0 (benchmarks/record.py:
# cute chain slopes in 3 processes, Pallas, the decode step), the TP benchmark when 2 GPUs are
# there (peer vs psum, 3 processes), then the whole test suite.
# Build first (python -m oproj_jax.build) and carry oproj_jax/_lib and oproj_jax/cute/cubins.
# Usage on the GPU machine: bash benchmarks/gpu_session.sh OUTDIR
# The limits add up to more than one 10-minute device call; the whole suite took longer than
# 220 s at -n 4 on a 2xH200 machine: when it is cut, rerun the tests stage alone.
set -u
out=${1:-${OUT:-/tmp/oproj_session}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
gpus=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
stage() {  # stage NAME SECONDS COMMAND...: bounded, logged, rc reported
  local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "== $name: rc=$? ($((SECONDS - t0)) s)"
}
stage record 140 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/record.py --out-dir "$out" --backends cute \
  --tokens 1,8,64,512,4096 --decode-tokens "" --timeout 48
tail -n 6 "$out/record.txt"
stage record-pallas 75 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/record.py --out-dir "$out" --backends pallas \
  --tokens 1,64,4096 --decode-tokens "" --processes 1 --timeout 70 --name record-pallas
tail -n 3 "$out/record-pallas.txt"
stage decode 80 env CUDA_VISIBLE_DEVICES=0 python3 -m oproj_jax.bench --decode-step --backends cute,reference \
  --tokens 1,64 --json "$out/decode-step.json"
grep -E "^(cute|reference) " "$out/decode.txt"
if [ "$gpus" -ge 2 ]; then
  for i in 1 2 3; do
    stage tp-$i 40 python3 -m oproj_jax.bench.tp --tp 2 --tokens 1,8,64 --reps 15 --modes peer,psum --no-profile \
      --json "$out/tp2-$i.json"
  done
fi
stage tests 330 python3 -m pytest -q -p no:cacheprovider -rfEx --tb=short -n 8 --dist loadfile
tail -n 8 "$out/tests.txt"
