"""How many clusters of the CuTe consumer the GPU keeps resident at once (cuda-python, no JAX).

  python3 benchmarks/cute_occupancy.py [CUBIN_DIR ...] [--key 16,8,1,4,0,0]

For the chosen variant in each cubin directory (default: $OPROJ_JAX_CUBIN_DIR or the package's
cubins/): registers per thread, dynamic shared memory, CTAs per SM and active clusters of 7,
as the driver computes them for the launch the FFI handler makes. A token is one cluster, so
`active clusters` is the number of tokens in flight; the rest wait for a free slot.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root

from cuda.bindings import driver as cu  # noqa: E402

from oproj_jax.cute import manifest as M  # noqa: E402


def check(result):
    err, *values = result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA error {err}")
    return values[0] if len(values) == 1 else values


def occupancy(directory, key: dict) -> dict:
    built = M.load_manifest(directory)
    entry = M.find(built, key)
    if entry is None:
        raise SystemExit(f"{directory}: no variant {M.describe(key)}")
    module = check(cu.cuModuleLoadData(M.cubin_path(built, entry).read_bytes()))
    fn = check(cu.cuModuleGetFunction(module, entry["entry"].encode()))
    smem = entry["dynamic_smem_bytes"]
    attr = cu.CUfunction_attribute
    check(cu.cuFuncSetAttribute(fn, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
    check(cu.cuFuncSetAttribute(fn, attr.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))
    regs = check(cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_NUM_REGS, fn))
    local = check(cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, fn))
    threads = entry["block"][0]
    per_sm = check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, threads, smem))
    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = 7, 4096, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
    config.sharedMemBytes = smem
    cluster = cu.CUlaunchAttribute()
    cluster.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    cluster.value.clusterDim.x, cluster.value.clusterDim.y, cluster.value.clusterDim.z = 7, 1, 1
    config.attrs = [cluster]
    config.numAttrs = 1
    clusters = check(cu.cuOccupancyMaxActiveClusters(fn, config))
    check(cu.cuModuleUnload(module))
    return dict(dir=str(directory), min_ctas=built.get("min_ctas", 0), variant=M.describe(key),
                regs=regs, local_bytes=local, threads=threads, dynamic_smem=smem,
                ctas_per_sm=per_sm, active_clusters=clusters)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="*")
    parser.add_argument("--key", default="16,8,1,4,0,0", help="R,NB,has_delta,groups,reps,twoshot")
    args = parser.parse_args()
    R, NB, delta, groups, reps, twoshot = (int(v) for v in args.key.split(","))
    key = M.make_key(R, NB, bool(delta), groups, reps, bool(twoshot))
    check(cu.cuInit(0))
    device = check(cu.cuDeviceGet(0))
    context = check(cu.cuDevicePrimaryCtxRetain(device))
    check(cu.cuCtxSetCurrent(context))
    for directory in args.dirs or [M.default_dir()]:
        print(json.dumps(occupancy(directory, key)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
