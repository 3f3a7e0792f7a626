#!/bin/bash
# GPU work in bounded stages; pick the stages that fit one device call (10 minutes):
#   checks   the whole test suite (-n 8) || the wheel in .whl/ installed with pip and its GPU
#            tests (every prebuilt cubin of the family, the contract, autodiff, backend choice)
#            || with `sanitize` compute-sanitizer (benchmarks/sanitize.sh; after kernel changes), in parallel;
#            then its initcheck alone
#   record   the benchmark of record on GPU 0 (benchmarks/record.py: the chain slopes of
#            $RECORD_BACKENDS (default cute,pallas) in every form in 3 processes, median; the decode
#            step of $DECODE_BACKENDS (default cute) at $DECODE_TOKENS (default 1,64; empty: none)
#            in 3 processes, median)
#   pdl-ab   programmatic dependent launch on and off, one process (benchmarks/pdl_ab.py)
#   tp       the TP step on 2 GPUs (benchmarks/record.py --tp 2: every mode x backend, 3
#            processes, median)
#   tpproc   the TP step on 2 GPUs driven by 2 processes (jax.distributed, one GPU each; mode="peer"
#            through CUDA IPC): python -m oproj_jax.bench.tp --processes 2, peer and psum
#   timeline where a chain's time per call goes, kernel by kernel (benchmarks/chain_timeline.py),
#            XLA's default flags and command buffers off, one process each
#   decode   the decode step with and without the consumer, cute and reference, carried and concat
#            mailboxes, one process (python -m oproj_jax.bench --decode-step)
#   triton   the Triton kernel at each T: checks, torch CUDA-graph and JAX timings
#            (benchmarks/triton_gpu.py)
#   launcher launcher-ab, then launcher-tests (each may also be named alone):
#            launcher-ab: the host time per call at T=1 of this FFI launcher against the one in
#            .dev/old (benchmarks/launch_ab.py; prepare .dev/old on a CPU machine with
#            `python benchmarks/launch_ab.py --prepare-old REV` and carry it; $LAUNCHER_OLD_CUBINS);
#            launcher-tests: the GPU tests of every path through the launch target and the peer
#            transport (cute: ready, protocol, twoshot, the cubin family; peer in one process,
#            across processes and its faults; triton; 2 GPUs for the peer tests)
# Build first (python -m oproj_jax.build; pip wheel . --no-deps -w .whl) and carry
# oproj_jax/_lib, oproj_jax/cute/cubins and .whl (and .dev for the launcher stage).
# Usage on the GPU machine: bash benchmarks/gpu_stages.sh OUTDIR checks,record,...
set -u
out=${1:-${OUT:-/tmp/oproj_gpu}}
stages=${2:-checks}
mkdir -p "$out"
# never NVLS / multicast (banned on these machines); no XLA preallocation: the peer handler
# allocates its mailboxes beside XLA's pool, and several processes share the GPUs
# .dev/site: pure-Python packages the GPU image lacks (jax-triton, platformdirs), copied from .venv/lib/python3.12/site-packages on a CPU machine and carried
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/.dev/site XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
gpus=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
stage() {  # stage NAME SECONDS COMMAND...: bounded, logged, rc reported
  local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "== $name: rc=$? ($((SECONDS - t0)) s)"
}
has() { [[ ",$stages," == *",$1,"* ]]; }

if has checks; then
  stage tests 400 python3 -m pytest -q -p no:cacheprovider -rfEx --tb=short -n 8 --dist loadfile &
  if has sanitize; then
    mkdir -p "$out/sanitize"
    bash benchmarks/sanitize.sh "$out/sanitize" 330 "memcheck racecheck synccheck" > "$out/sanitize.txt" 2>&1 &
  fi
  [ -d .whl ] && stage wheel 330 env -u OPROJ_JAX_CUBIN_DIR OPROJ_WHEEL_DEPS="$PWD/.dev/site" bash benchmarks/wheel_check.sh &
  wait
  if has sanitize; then
    # initcheck alone on the GPU (sanitize.sh says why)
    bash benchmarks/sanitize.sh "$out/sanitize" 150 initcheck >> "$out/sanitize.txt" 2>&1
    # one file for the four sanitizer logs (the device tool returns a few files per call)
    for f in "$out"/sanitize/sanitize-*.txt; do echo "##### $f"; head -c 20000 "$f"; echo; done >> "$out/sanitize.txt"
    rm -rf "$out/sanitize"
    grep -E "^== " "$out/sanitize.txt"
  fi
  tail -n 12 "$out/tests.txt"
  tail -n 8 "$out/wheel.txt"
fi
if has record; then
  # the first process times both forms with the profiler (~110 s), the others the donated form
  stage record 540 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/record.py --out-dir "$out" \
    --backends "${RECORD_BACKENDS:-cute,pallas}" --tokens 1,8,64,512,4096 --reps 30 \
    --decode-tokens "${DECODE_TOKENS-1,64}" --decode-backends "${DECODE_BACKENDS:-cute}" --timeout 170
  tail -n 30 "$out/record.txt"
fi
if has pdl-ab; then
  stage pdl-ab 420 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/pdl_ab.py --out "$out" --tokens 1,8,64 \
    --rounds 3 --budget 330
  grep -E "^T=.*us  \[" "$out/pdl-ab.txt"
fi
if has tp && [ "$gpus" -ge 2 ]; then
  stage tp 270 python3 benchmarks/record.py --out-dir "$out" --tp 2 --tokens 1,8,64 --reps 15 --name tp2 \
    --modes peer,psum --chain 4,68 --timeout 85
  tail -n 30 "$out/tp.txt"
fi
if has tpproc && [ "$gpus" -ge 2 ]; then
  stage tpproc 240 python3 -m oproj_jax.bench.tp --tp 2 --processes 2 --tokens 1,8,64 --reps 15 \
    --modes peer,psum --chain 4,68 --processes-timeout 220 --json "$out/tpproc.json"
  grep -E "^peer|^psum|^mode|faster|exit|Error" "$out/tpproc.txt" | head -n 40
fi
if has timeline; then
  for cfg in "default:" "no-cmdbuf:--xla_gpu_enable_command_buffer="; do
    label=${cfg%%:*}
    stage timeline-$label 200 env CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="${cfg#*:}" python3 benchmarks/chain_timeline.py \
      --label "$label" --out "$out/timeline-$label.json" --tokens 1,8,64
    tail -n 20 "$out/timeline-$label.txt"
  done
fi
if has decode; then
  stage decode-step 200 env CUDA_VISIBLE_DEVICES=0 python3 -m oproj_jax.bench --decode-step --backends cute,reference \
    --tokens 1,64 --mailboxes carried,concat --json "$out/decode-step.json"
  grep -E "^decode|consumer" "$out/decode-step.txt" | tail -n 12
fi
if has triton; then
  stage triton 240 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/triton_gpu.py --out "$out"
  tail -n 30 "$out/triton.txt"
fi
if has launcher || has launcher-ab; then  # first, on a quiet machine
  # $LAUNCHER_OLD_CUBINS: a cubin set the old checkout accepts, where the kernel sources changed since
  stage launcher-ab 170 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/launch_ab.py --old .dev/old --out "$out" \
    ${LAUNCHER_OLD_CUBINS:+--old-cubins "$LAUNCHER_OLD_CUBINS"} --tokens 1 --rounds 4 --budget 60
  tail -n 12 "$out/launcher-ab.txt"
fi
if has launcher || has launcher-tests; then
  stage launcher-tests 390 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short -n 8 --dist loadfile \
    tests/test_cute_gpu.py tests/test_cute_family_gpu.py tests/test_peer_gpu.py tests/test_peer_faults_gpu.py \
    tests/test_peer_processes_gpu.py tests/test_triton_gpu.py
  tail -n 25 "$out/launcher-tests.txt"
fi
