"""Compiles the XLA FFI library (the C++ sources of ffi/ -> liboproj_ffi.so) with g++; the standard library only.

Two callers share this module: `oproj_jax.ffi.build_library` (`python -m oproj_jax.build
--ffi-only`, against the jaxlib in use) and the project's setup.py, which loads this file by
path (nothing of oproj_jax or jax is imported) to build the library into the wheel or the
editable checkout, against the jaxlib of the build environment (pinned in pyproject.toml's
[build-system] requires: the FFI API version the library is built with must not be newer than
the oldest jaxlib that loads it).

What the build needs: g++ (or $CXX), the jaxlib headers (`jaxlib/include`, which
`jax.ffi.include_dir()` also returns) and `cuda.h` for the driver API types (libcuda itself is
opened at run time, so no CUDA library is linked and no GPU is needed to build).

Where the sources are (SOURCE_DIR): the checkout's top-level `ffi/` when this module runs from a
checkout (an editable install, setup.py building a wheel or an sdist), else the copy setup.py
ships inside the installed package (`oproj_jax/_ffi/`, in the wheel only), so that an installed
package can rebuild its library against the jaxlib in use.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess

LIBRARY_NAME = "liboproj_ffi.so"
PACKAGE_DIR = pathlib.Path(__file__).resolve().parent  # oproj_jax/
CHECKOUT_SOURCE_DIR = PACKAGE_DIR.parent / "ffi"  # the checkout's: the CuTe and Triton targets, common.h
PACKAGED_SOURCE_DIR = PACKAGE_DIR / "_ffi"  # the wheel's copy of them (setup.py's build_py)
SOURCE_PATTERNS = ("*.cc", "*.h")  # what the wheel ships


def _source_dir() -> pathlib.Path:
    """CHECKOUT_SOURCE_DIR in a checkout (setup.py next to oproj_jax/), else PACKAGED_SOURCE_DIR."""
    root = PACKAGE_DIR.parent
    if (root / "setup.py").is_file() and (CHECKOUT_SOURCE_DIR / "common.h").is_file():
        return CHECKOUT_SOURCE_DIR
    return PACKAGED_SOURCE_DIR


SOURCE_DIR = _source_dir()
NO_FFI_ENV = "OPROJ_JAX_NO_FFI"  # setup.py: set to 1 to install without building the library


def compiler() -> str | None:
    """The C++ compiler: $CXX if set, else g++; its full path, or None if not on PATH."""
    return shutil.which(os.environ.get("CXX", "g++"))


def jaxlib_include_dir() -> pathlib.Path | None:
    """`jaxlib/include` of the importable jaxlib (found without importing it), or None."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None:
        return None
    roots = list(spec.submodule_search_locations or [])
    if spec.origin and spec.origin not in ("namespace", "built-in"):
        roots.insert(0, os.path.dirname(spec.origin))
    found = [pathlib.Path(r) / "include" for r in roots if (pathlib.Path(r) / "include" / "xla").is_dir()]
    return found[0] if found else None


def cuda_include_dir() -> pathlib.Path | None:
    """A directory holding cuda.h: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, or the nvidia-cuda-runtime
    wheel (nvidia/cu13/include, or nvidia/cuda_runtime/include for the CUDA 12 wheels)."""
    candidates = [pathlib.Path(os.environ[v]) / "include" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    candidates.append(pathlib.Path("/usr/local/cuda/include"))
    spec = importlib.util.find_spec("nvidia")  # the namespace package of the CUDA wheels
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += [pathlib.Path(root) / sub / "include" for sub in ("cu13", "cuda_runtime")]
    return next((d for d in candidates if (d / "cuda.h").is_file()), None)


def sources() -> list[pathlib.Path]:
    """The C++ translation units of the library, in a fixed order."""
    return sorted(SOURCE_DIR.glob("*.cc"))


def shipped_sources() -> list[pathlib.Path]:
    """What setup.py copies into the wheel's oproj_jax/_ffi/: the translation units and headers."""
    return sorted({path for pattern in SOURCE_PATTERNS for path in SOURCE_DIR.glob(pattern)})


def missing(jaxlib: bool = True) -> str | None:
    """None if everything the build needs is here, else what is missing and how to get it.
    `jaxlib=False`: leave out the jaxlib headers (the caller passes its own)."""
    problems = []
    if compiler() is None:
        problems.append(f"no C++ compiler ({os.environ.get('CXX', 'g++')} not on PATH; install g++ or set $CXX)")
    if jaxlib and jaxlib_include_dir() is None:
        problems.append("no jaxlib headers (jaxlib/include): install jaxlib")
    if cuda_include_dir() is None:
        problems.append(
            "cuda.h not found (tried $CUDA_HOME/include, $CUDA_PATH/include, /usr/local/cuda/include "
            "and the nvidia-cuda-runtime wheel): `pip install nvidia-cuda-runtime` or install the CUDA "
            "toolkit headers"
        )
    if not sources():
        problems.append(f"no FFI sources (*.cc) in {SOURCE_DIR}: the package installation is incomplete")
    return "; ".join(problems) or None


def compile_library(target: str | os.PathLike, jaxlib_include: str | os.PathLike | None = None) -> pathlib.Path:
    """Compiles SOURCE_DIR/*.cc into the shared library `target`; returns its path. `jaxlib_include`:
    the jaxlib headers to build against (default: jaxlib_include_dir()). RuntimeError saying
    what is missing, or with the compiler's output when it fails."""
    target = pathlib.Path(target)
    jaxlib_include = jaxlib_include if jaxlib_include is not None else jaxlib_include_dir()
    reason = missing(jaxlib=jaxlib_include is None)
    if reason:
        raise RuntimeError(f"cannot build {target.name}: {reason}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    # No -fvisibility=hidden: the handler symbols must stay exported.
    command = [
        compiler(),
        "-O2",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-Wall",
        f"-I{jaxlib_include}",
        f"-I{cuda_include_dir()}",
        f"-I{SOURCE_DIR}",
        *map(str, sources()),
        "-o",
        str(partial),
        "-ldl",
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"building {target.name} failed ({' '.join(command)}):\n{done.stderr}")
    os.replace(partial, target)  # atomic: a concurrent loader never sees half a file
    return target
