"""Builds the GPU artifacts on any machine with the `cute` extra and g++ (no GPU needed):

python -m oproj_jax.build                # the XLA FFI library, then the cubins + manifests (every arch)
python -m oproj_jax.build --arch sm_90a  # the cubins of one arch only (repeatable)
python -m oproj_jax.build --ffi-only     # only the FFI library (no CuTe DSL needed)

Each step says what it does before it starts: the cubin build takes a few minutes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _say(message: str) -> None:
    print(f"oproj_jax.build: {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    from oproj_jax.cute import manifest  # light: no DSL, no JAX

    parser = argparse.ArgumentParser(prog="python -m oproj_jax.build", description=__doc__.splitlines()[0])
    parser.add_argument("--ffi-only", action="store_true", help="skip the CuTe-DSL cubins")
    parser.add_argument(
        "--arch",
        action="append",
        choices=list(manifest.ARCHS),
        help="build the cubins of this arch only (repeatable; default: every arch)",
    )
    args = parser.parse_args(argv)
    from oproj_jax import ffi

    _say("building the XLA FFI library (g++ against the jaxlib headers, about 20 s)")
    t0 = time.time()
    _say(f"FFI library -> {ffi.build_library()} ({time.time() - t0:.0f} s)")
    if args.ffi_only:
        return 0
    from oproj_jax.cute import build

    if build.dsl_version() == "unknown":
        _say("the CuTe DSL is not installed: pip install '.[cute]' (or --ffi-only for the library alone)")
        return 1
    count, jobs = len(build.default_set()), os.cpu_count() or 1
    archs = tuple(dict.fromkeys(args.arch)) if args.arch else build.BUILD_ARCHS
    _say(
        f"building {count} cubins for each of {', '.join(archs)} (CuTe DSL {build.dsl_version()}) in {jobs} "
        f"process(es), this takes a few minutes per arch"
    )
    for arch, built in build.build_all(log=_say, archs=archs).items():
        where = manifest.arch_dir(arch) / manifest.MANIFEST
        _say(f"{len(built['kernels'])} cubins ({arch}) + {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
