"""Builds the GPU artifacts on any machine with the `cute` extra and g++ (no GPU needed):

python -m oproj_jax.build            # cubins + manifest, then the XLA FFI library
python -m oproj_jax.build --ffi-only # only the FFI library (no CuTe DSL needed)
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oproj_jax.build", description=__doc__.splitlines()[0])
    parser.add_argument("--ffi-only", action="store_true", help="skip the CuTe-DSL cubins")
    args = parser.parse_args(argv)
    from oproj_jax.cute import ffi

    print(f"oproj_jax.build: FFI library -> {ffi.build_library()}", flush=True)
    if not args.ffi_only:
        from oproj_jax.cute import build

        manifest = build.build_cubins()
        print(f"oproj_jax.build: {len(manifest['kernels'])} cubins (sm_90a) + manifest", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
