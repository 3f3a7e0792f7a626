#!/bin/bash
# compute-sanitizer over every kernel path, through the GPU tests that check each path's results:
#   cute, protocol mode   tests/test_cute_gpu.py::test_oneshot_parity (poll, sum, re-arm; xmoe, NB 0/1/8, R 1/2/16; T 1/3/32)
#   cute, twoshot         tests/test_cute_gpu.py::test_twoshot_parity
#   cute, ready mode      tests/test_cute_gpu.py::test_registry_consumer_ready_mode (the registry path),
#                         tests/test_contract.py::test_own_partial_stands_for_its_slot (partial= in place)
#   cute, bounded wait    tests/test_cute_gpu.py::test_bounded_polling_reports_a_slot_never_published
#   pallas                tests/test_pallas.py::test_parity_gpu (default build and the 7-CTA split)
#   peer publish + consumer  tests/test_peer_gpu.py::test_peer_bits_equal_oneshot (2 GPUs or more)
#   triton sync           tests/test_triton_gpu.py, the sync kernel's launches from JAX and PyTorch
#                         (its barriers: counters, polls, records; the cluster's barrier in
#                         thread block clusters), a CUDA graph replay, a
#                         jitted call through the package's launch target (graph node), PDL
#                         launches on counters kept from call to call, partial= read in place;
#                         the L2 warm-up at its most tokens (plan.PREFETCH_MAX_T = 16)
# One process per tool (memcheck, racecheck, synccheck, initcheck) and per group (the cute and
# Pallas kernels; the Triton sync kernel), in parallel but initcheck (alone, below), each
# bounded in time; memcheck, racecheck and synccheck instrument only our kernels (--kernel-name,
# by name substring), so XLA's own kernels neither slow them down nor enter their reports;
# initcheck instruments every kernel (see below). Host API errors are not
# reported (cuda-python probes driver entry points that do not exist, which is not a device
# memory error). A log ends with "ERROR SUMMARY: N errors" (racecheck: "RACECHECK SUMMARY").
# Build first (python -m oproj_jax.build) and carry oproj_jax/_lib and oproj_jax/cute/cubins.
# Usage on the GPU machine: bash benchmarks/sanitize.sh OUTDIR [SECONDS_PER_TOOL] [TOOLS] [GROUPS]
# (TOOLS: a space-separated subset of "memcheck racecheck synccheck initcheck", default all four;
# GROUPS: of "ours triton pallas", default "ours triton"; pallas: the Pallas tests of "ours" alone)
set -u
out=${1:-${OUT:-/tmp/oproj_sanitize}}
limit=${2:-240}
tools=${3:-memcheck racecheck synccheck initcheck}
groups=${4:-ours triton}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
gpus=$(nvidia-smi -L | wc -l)
# the Pallas kernel (group "pallas" alone; in "ours" after the cute tests)
pallas_tests=(
  "tests/test_pallas.py::test_parity_gpu[R16-T3-NB8-G4-default]"
  "tests/test_pallas.py::test_parity_gpu[R16-T3-NB8-G4-split7]"
  "tests/test_pallas.py::test_parity_gpu[R16-T3-NB0-G3-nodelta-default]"
)
tests=(
  "tests/test_cute_gpu.py::test_oneshot_parity[R16-T3-NB8-G4]"
  "tests/test_cute_gpu.py::test_oneshot_parity[R16-T1-NB1-G2-x2]"
  "tests/test_cute_gpu.py::test_oneshot_parity[R16-T3-NB0-G3-nodelta]"
  "tests/test_cute_gpu.py::test_oneshot_parity[R2-T3-NB1-G3]"
  "tests/test_cute_gpu.py::test_oneshot_parity[R1-T3-NB0-G4-x1]"
  "tests/test_cute_gpu.py::test_oneshot_parity[R16-T32-NB8-G4]"
  "tests/test_cute_gpu.py::test_twoshot_parity[R16-T3-NB8-G1-twoshot]"
  "tests/test_cute_gpu.py::test_registry_consumer_ready_mode[R16-T3-NB8-G4]"
  "tests/test_cute_gpu.py::test_registry_consumer_ready_mode[R16-T1-NB1-G2-x2]"
  "tests/test_cute_gpu.py::test_registry_consumer_ready_mode[R16-T3-NB0-G3-nodelta]"
  "tests/test_cute_gpu.py::test_bounded_polling_reports_a_slot_never_published"
  "tests/test_contract.py::test_own_partial_stands_for_its_slot[cute-9]"
  "${pallas_tests[@]}"
)
if [ "$gpus" -ge 2 ]; then
  tests+=("tests/test_peer_gpu.py::test_peer_bits_equal_oneshot[R2-T1-NB0-G2-nodelta]"
          "tests/test_peer_gpu.py::test_peer_bits_equal_oneshot[R2-T8-NB0-G4-nodelta-x1]")
fi
# the Triton sync kernel (its in-kernel barriers), both launches, under its own filter below
triton_tests=(
  "tests/test_triton_gpu.py::test_jax_and_torch_launches_agree_with_each_other_and_the_oracle[R16-T1-NB8-G4-sync-256-w1]"
  "tests/test_triton_gpu.py::test_jax_and_torch_launches_agree_with_each_other_and_the_oracle[R16-T1-NB8-G4-sync-512-w4]"
  "tests/test_triton_gpu.py::test_jax_and_torch_launches_agree_with_each_other_and_the_oracle[R16-T64-NB8-G4-sync-2048-w8]"
  "tests/test_triton_gpu.py::test_torch_launch_replays_in_a_cuda_graph[None]"
  "tests/test_triton_gpu.py::test_jax_and_torch_launches_agree_with_each_other_and_the_oracle[R16-T64-NB8-G4-sync-1024-w4-reload-r64]"
  "tests/test_triton_gpu.py::test_donated_prefix_is_updated_in_place[sync-2048-w8-64-library]"
  "tests/test_triton_gpu.py::test_donated_prefix_is_updated_in_place[None-80-library]"
  "tests/test_triton_gpu.py::test_kept_counters_and_pdl_give_the_bits_of_zeroed_counters[8]"
  "tests/test_triton_gpu.py::test_cluster_configuration_gives_the_bits_of_its_counterpart[1-sync-1024-w4-cluster]"
  "tests/test_triton_gpu.py::test_torch_launch_replays_in_a_cuda_graph[sync-1024-w4-cluster]"
  "tests/test_triton_gpu.py::test_own_partial_gives_the_bits_of_its_slot[1-None]"
  "tests/test_triton_gpu.py::test_own_partial_gives_the_bits_of_its_slot[64-None]"
  "tests/test_triton_gpu.py::test_jax_and_torch_launches_agree_with_each_other_and_the_oracle[R16-T16-NB8-G4-default]"
  "tests/test_triton_gpu.py::test_own_partial_gives_the_bits_of_its_slot[16-None]"
)
# cute consumer and publish kernels: "..._oproj_jaxcutekernelOprojConsumer_..." and
# "..._oproj_jaxcutepublishPublish_..."; the Pallas kernel: pallas/consumer.py KERNEL_NAME
filter="--kernel-name kns=oproj"
sanitize() {  # sanitize TOOL NAME SELECT TESTS...: one bounded compute-sanitizer run, its verdict echoed
  local tool=$1 name=$2 select=$3; shift 3
  local extra="--print-limit 20" t0=$SECONDS
  [ "$tool" = memcheck ] && extra="$extra --leak-check no"
  timeout "$limit" compute-sanitizer --tool "$tool" $extra --report-api-errors no $select \
    python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short "$@" > "$out/sanitize-$name.txt" 2>&1
  local rc=$?
  local summary verdict
  summary=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$out/sanitize-$name.txt" | tail -n 1)
  verdict=$(grep -E "[0-9]+ (passed|failed)" "$out/sanitize-$name.txt" | tail -n 1)
  echo "== $name: rc=$rc ($((SECONDS - t0)) s) ${summary:-no summary line} | pytest: ${verdict:-no result line}"
}
run_tool() {  # run_tool TOOL: the tool over every group, the groups in parallel
  local tool=$1 ours=$filter triton="--kernel-name kns=sync_kernel"
  # initcheck tracks which bytes were written; memory our kernels read was written by XLA's
  # kernels (the inputs, zeroed flags), so every kernel is instrumented there, not only ours
  [ "$tool" = initcheck ] && ours="" triton=""
  [[ " $groups " == *" ours "* ]] && sanitize "$tool" "$tool" "$ours" "${tests[@]}" &
  [[ " $groups " == *" triton "* ]] && sanitize "$tool" "triton-$tool" "$triton" "${triton_tests[@]}" &
  [[ " $groups " == *" pallas "* ]] && sanitize "$tool" "pallas-$tool" "$ours" "${pallas_tests[@]}" &
  wait
}
for tool in $tools; do
  [ "$tool" != initcheck ] && run_tool "$tool" &
done
wait
# initcheck after the others, its groups one at a time: beside another sanitized process on the
# GPU it can miss the host-to-device copy of one input of a process and then report every read of
# that input as uninitialized (docs/perf.md, "Sanitizer")
if [[ " $tools " == *" initcheck "* ]]; then
  for group in $groups; do groups=$group run_tool initcheck; done
fi
