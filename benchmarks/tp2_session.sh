#!/bin/bash
# One 2-GPU session for mode="peer" (oproj_jax/cute/peer.py), each stage bounded (<= 8 min in all:
# environment 20 + 30 s, tests 190 s, benchmark 220 s, summary 20 s):
#   1. tests/test_peer_gpu.py: first a jitted chain of 6 peer steps inside XLA command buffers
#      (record stage; graph updates with new buffers) == oneshot bits, and a peer that never
#      re-arms -> the publish gives up (status 4) in bounded time, reset(); then peer bits ==
#      oneshot on both ranks (groups 1-4, xmoe, no delta, NB=0), a rank that never publishes ->
#      RuntimeError in bounded time, reset(); jitted scans and unrolled chains stay exact
#   2. python -m oproj_jax.bench.tp --tp 2: oneshot/twoshot/psum/peer x reference/pallas/cute,
#      R=2, NB=8, has_delta, T = 1, 8, 64 (chain slopes; JSON records with "record": true)
#   3. benchmarks/tp2_summary.py: the table, the targets, the test verdicts
# Build first on a CPU machine (python -m oproj_jax.build) and carry oproj_jax/_lib and
# oproj_jax/cute/cubins. Usage on the GPU machine: bash benchmarks/tp2_session.sh [OUTDIR]
set -u
out=${1:-${OUT:-/tmp/oproj_tp2}}
mkdir -p "$out"
# never NVLS / multicast (banned on these machines); no XLA preallocation: the peer handler
# allocates its mailboxes with cuMemAlloc beside XLA's pool
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
{
  timeout 10 nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
  timeout 10 nvidia-smi topo -m
  timeout 30 python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'
  ls -l oproj_jax/_lib oproj_jax/cute/cubins/manifest.json oproj_jax/cute/cubins/oproj_publish.cubin
} > "$out/env.txt" 2>&1
head -n 3 "$out/env.txt"

t0=$SECONDS
timeout 190 python3 -m pytest tests/test_peer_gpu.py -q -rfEsx --tb=short -p no:cacheprovider \
  > "$out/test_peer_gpu.txt" 2>&1
echo "peer GPU tests: rc=$? ($((SECONDS - t0)) s)"; tail -n 15 "$out/test_peer_gpu.txt"

t0=$SECONDS
timeout 220 python3 -m oproj_jax.bench.tp --tp 2 --tokens 1,8,64 --reps 5 --json "$out/tp2_bench.json" \
  > "$out/tp2_bench.txt" 2>&1
echo "TP benchmark: rc=$? ($((SECONDS - t0)) s)"; tail -n 5 "$out/tp2_bench.txt"

timeout 20 python3 benchmarks/tp2_summary.py "$out" | tee "$out/summary.txt"
