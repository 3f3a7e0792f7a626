#!/bin/bash
# compute-sanitizer over every kernel path, through the GPU tests that check each path's results:
#   cute, protocol mode   tests/test_cute_gpu.py::test_oneshot_parity (poll, sum, re-arm; xmoe, NB 0/1/8, R 1/2/16)
#   cute, twoshot         tests/test_cute_gpu.py::test_twoshot_parity
#   cute, ready mode      tests/test_cute_gpu.py::test_registry_consumer_ready_mode (the registry path)
#   cute, bounded wait    tests/test_cute_gpu.py::test_bounded_polling_reports_a_slot_never_published
#   pallas                tests/test_pallas.py::test_parity_gpu (default build and the 7-CTA split)
#   peer publish + consumer  tests/test_peer_gpu.py::test_peer_bits_equal_oneshot (2 GPUs or more)
# One process per tool (memcheck, racecheck, synccheck, initcheck), the four in parallel, each
# bounded in time; memcheck, racecheck and synccheck instrument only our kernels (--kernel-name,
# by name substring), so XLA's own kernels neither slow them down nor enter their reports;
# initcheck instruments every kernel (see below). Host API errors are not
# reported (cuda-python probes driver entry points that do not exist, which is not a device
# memory error). A log ends with "ERROR SUMMARY: N errors" (racecheck: "RACECHECK SUMMARY").
# Build first (python -m oproj_jax.build) and carry oproj_jax/_lib and oproj_jax/cute/cubins.
# Usage on the GPU machine: bash benchmarks/sanitize.sh OUTDIR [SECONDS_PER_TOOL]
set -u
out=${1:-${OUT:-/tmp/oproj_sanitize}}
limit=${2:-240}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
gpus=$(nvidia-smi -L | wc -l)
tests=(
  "tests/test_cute_gpu.py::test_oneshot_parity[R16-T3-NB8-G4]"
  "tests/test_cute_gpu.py::test_oneshot_parity[R16-T1-NB1-G2-x2]"
  "tests/test_cute_gpu.py::test_oneshot_parity[R16-T3-NB0-G3-nodelta]"
  "tests/test_cute_gpu.py::test_oneshot_parity[R2-T3-NB1-G3]"
  "tests/test_cute_gpu.py::test_oneshot_parity[R1-T3-NB0-G4-x1]"
  "tests/test_cute_gpu.py::test_twoshot_parity[R16-T3-NB8-G1-twoshot]"
  "tests/test_cute_gpu.py::test_registry_consumer_ready_mode[R16-T3-NB8-G4]"
  "tests/test_cute_gpu.py::test_registry_consumer_ready_mode[R16-T1-NB1-G2-x2]"
  "tests/test_cute_gpu.py::test_registry_consumer_ready_mode[R16-T3-NB0-G3-nodelta]"
  "tests/test_cute_gpu.py::test_bounded_polling_reports_a_slot_never_published"
  "tests/test_pallas.py::test_parity_gpu[R16-T3-NB8-G4-default]"
  "tests/test_pallas.py::test_parity_gpu[R16-T3-NB8-G4-split7]"
  "tests/test_pallas.py::test_parity_gpu[R16-T3-NB0-G3-nodelta-default]"
)
if [ "$gpus" -ge 2 ]; then
  tests+=("tests/test_peer_gpu.py::test_peer_bits_equal_oneshot[R2-T1-NB0-G2-nodelta]"
          "tests/test_peer_gpu.py::test_peer_bits_equal_oneshot[R2-T8-NB0-G4-nodelta-x1]")
fi
# cute consumer and publish kernels: "..._oproj_jaxcutekernelOprojConsumer_..." and
# "..._oproj_jaxcutepublishPublish_..."; the Pallas kernel: pallas/consumer.py KERNEL_NAME
filter="--kernel-name kns=oproj"
for tool in memcheck racecheck synccheck initcheck; do
  extra="--print-limit 20"
  [ "$tool" = memcheck ] && extra="$extra --leak-check no"
  # initcheck tracks which bytes were written; memory our kernels read was written by XLA's
  # kernels (the inputs, zeroed flags), so every kernel is instrumented there, not only ours
  select=$filter
  [ "$tool" = initcheck ] && select=""
  (
    t0=$SECONDS
    timeout "$limit" compute-sanitizer --tool "$tool" $extra --report-api-errors no $select \
      python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short "${tests[@]}" > "$out/sanitize-$tool.txt" 2>&1
    rc=$?
    summary=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$out/sanitize-$tool.txt" | tail -n 1)
    verdict=$(grep -E "[0-9]+ (passed|failed)" "$out/sanitize-$tool.txt" | tail -n 1)
    echo "== $tool: rc=$rc ($((SECONDS - t0)) s) ${summary:-no summary line} | pytest: ${verdict:-no result line}"
  ) &
done
wait
