"""How many clusters of the CuTe consumer the GPU keeps resident at once (cuda-python).

  python3 benchmarks/cute_occupancy.py [CUBIN_DIR ...] [--key 16,8,1,4,0,0] [--builds m0,m3,f0]

For the chosen variant in each cubin directory (default: $OPROJ_JAX_CUBIN_DIR or the package's
cubins/), one line per build (thread layout and launch bound): registers per thread, dynamic shared memory, CTAs
per SM and active clusters of 7, as the driver computes them for the launch the FFI handler
makes (the cubin loaded by cute/driver_launch.py). A token is one cluster, so
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
from oproj_jax.cute.backend import _Kernel  # noqa: E402
from oproj_jax.cute.driver_launch import DriverLaunch, check  # noqa: E402


def occupancy(directory, key: dict, build: M.Build) -> dict:
    built = M.load_manifest(directory)
    entry = M.find(built, key, build)
    if entry is None:
        raise SystemExit(f"{directory}: no build {build.tag} of {M.describe(key)}")
    threads, smem = entry["block"][0], entry["dynamic_smem_bytes"]
    kernel = DriverLaunch(_Kernel(str(M.cubin_path(built, entry)), entry["entry"], smem, threads))
    attr = cu.CUfunction_attribute
    regs = check(cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_NUM_REGS, kernel.fn), "cuFuncGetAttribute")
    local = check(cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, kernel.fn), "cuFuncGetAttribute")
    per_sm = check(
        cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(kernel.fn, threads, smem),
        "cuOccupancyMaxActiveBlocksPerMultiprocessor",
    )
    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = 7, 4096, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
    config.sharedMemBytes = smem
    cluster = cu.CUlaunchAttribute()
    cluster.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    cluster.value.clusterDim.x, cluster.value.clusterDim.y, cluster.value.clusterDim.z = 7, 1, 1
    config.attrs = [cluster]
    config.numAttrs = 1
    clusters = check(cu.cuOccupancyMaxActiveClusters(kernel.fn, config), "cuOccupancyMaxActiveClusters")
    check(cu.cuModuleUnload(kernel.module), "cuModuleUnload")
    return dict(
        dir=str(directory),
        build=build.tag,
        variant=M.describe(key),
        regs=regs,
        local_bytes=local,
        threads=threads,
        dynamic_smem=smem,
        ctas_per_sm=per_sm,
        active_clusters=clusters,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="*")
    parser.add_argument("--key", default="16,8,1,4,0,0", help="R,NB,has_delta,groups,reps,twoshot")
    parser.add_argument(
        "--builds", default=",".join(b.tag for b in M.BUILDS), help="the builds to report (default: %(default)s)"
    )
    args = parser.parse_args()
    R, NB, delta, groups, reps, twoshot = (int(v) for v in args.key.split(","))
    key = M.make_key(R, NB, bool(delta), groups, reps, bool(twoshot))
    check(cu.cuInit(0), "cuInit")
    context = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(0), "cuDeviceGet")), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    for directory in args.dirs or [M.default_dir()]:
        for build in (M.parse_build(v) for v in args.builds.split(",")):
            print(json.dumps(occupancy(directory, key, build)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
