"""Builds the GPU artifacts on any machine with the `cute` extra and g++ (no GPU needed):

python -m oproj_jax.build            # the XLA FFI library, then the cubins + manifest
python -m oproj_jax.build --ffi-only # only the FFI library (no CuTe DSL needed)

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
    parser = argparse.ArgumentParser(prog="python -m oproj_jax.build", description=__doc__.splitlines()[0])
    parser.add_argument("--ffi-only", action="store_true", help="skip the CuTe-DSL cubins")
    args = parser.parse_args(argv)
    from oproj_jax.cute import ffi

    _say("building the XLA FFI library (g++ against the jaxlib headers, about 20 s)")
    t0 = time.time()
    _say(f"FFI library -> {ffi.build_library()} ({time.time() - t0:.0f} s)")
    if args.ffi_only:
        return 0
    from oproj_jax.cute import build, manifest

    if build.dsl_version() == "unknown":
        _say("the CuTe DSL is not installed: pip install '.[cute]' (or --ffi-only for the library alone)")
        return 1
    count, jobs = len(build.default_set()), os.cpu_count() or 1
    _say(
        f"building {count} cubins (sm_90a, CuTe DSL {build.dsl_version()}) in {jobs} process(es), "
        f"this takes a few minutes"
    )
    built = build.build_cubins(log=_say)
    _say(f"{len(built['kernels'])} cubins (sm_90a) + {manifest.MANIFEST} in {manifest.default_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
