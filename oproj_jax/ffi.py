"""The XLA FFI library that launches the CuTe cubins: build it, load it once, register its targets.

`ffi/consumer_ffi.cc` is built with g++ alone against the headers of the jaxlib in use
(`jax.ffi.include_dir()`: build with the oldest jaxlib you run, the FFI API version is
checked) and `cuda.h` for types; libcuda is opened at run time. Build it with

    python -m oproj_jax.build --ffi-only     (or: python -m oproj_jax.ffi [--out DIR])

(default oproj_jax/_lib/liboproj_ffi.so, git-ignored). The targets are registered with JAX
lazily, the first time a cute call is traced (`register_targets()`).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pathlib
import shutil
import subprocess
import sys
import threading

import jax

ONESHOT_TARGET = "oproj_cute_consumer"
TWOSHOT_TARGET = "oproj_cute_consumer_twoshot"
READY_TARGET = "oproj_cute_consumer_ready"  # XLA-produced mailbox: read once, no polling, no re-arm
# Exported handler symbols: (initialize, execute) per target.
SYMBOLS = {
    ONESHOT_TARGET: ("OprojOneshotInitialize", "OprojOneshotExecute"),
    TWOSHOT_TARGET: ("OprojTwoshotInitialize", "OprojTwoshotExecute"),
    READY_TARGET: ("OprojOneshotInitialize", "OprojReadyExecute"),
}

_PACKAGE = pathlib.Path(__file__).resolve().parent
SOURCE = _PACKAGE.parent / "ffi" / "consumer_ffi.cc"
DEFAULT_LIBRARY = _PACKAGE / "_lib" / "liboproj_ffi.so"
BUILD_COMMAND = "python -m oproj_jax.build --ffi-only"

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_registered = False


def cuda_include_dir() -> pathlib.Path | None:
    """A directory holding cuda.h: $CUDA_HOME, /usr/local/cuda, or the nvidia-cuda-runtime wheel."""
    candidates = [pathlib.Path(os.environ[v]) / "include" for v in ("CUDA_HOME", "CUDA_PATH") if v in os.environ]
    candidates.append(pathlib.Path("/usr/local/cuda/include"))
    try:
        import nvidia  # namespace package of the CUDA wheels

        for root in nvidia.__path__:
            candidates += [pathlib.Path(root) / sub / "include" for sub in ("cu13", "cuda_runtime")]
    except ImportError:
        pass
    return next((d for d in candidates if (d / "cuda.h").is_file()), None)


def build_library(out_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Compiles ffi/consumer_ffi.cc into `out_dir`/liboproj_ffi.so (default oproj_jax/_lib/); returns its path."""
    target = DEFAULT_LIBRARY if out_dir is None else pathlib.Path(out_dir) / DEFAULT_LIBRARY.name
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise RuntimeError("building the FFI library needs g++ (or $CXX) on PATH; none was found")
    if not SOURCE.is_file():
        raise RuntimeError(f"FFI source not found at {SOURCE} (a source checkout of oproj_jax is needed to build)")
    cuda_include = cuda_include_dir()
    if cuda_include is None:
        raise RuntimeError(
            "cuda.h not found (tried $CUDA_HOME/include, /usr/local/cuda/include and the nvidia-cuda-runtime "
            "wheel): install the CUDA toolkit headers or `pip install nvidia-cuda-runtime`"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    # No -fvisibility=hidden: the handler symbols must stay exported.
    command = [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", "-Wall",
               f"-I{jax.ffi.include_dir()}", f"-I{cuda_include}", str(SOURCE), "-o", str(partial), "-ldl"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"building {target.name} failed ({' '.join(command)}):\n{done.stderr}")
    os.replace(partial, target)  # atomic: a concurrent loader never sees half a file
    return target


def library_path() -> pathlib.Path:
    """Where the library is loaded from: $OPROJ_JAX_FFI_LIBRARY, else the default build output."""
    return pathlib.Path(os.environ.get("OPROJ_JAX_FFI_LIBRARY", DEFAULT_LIBRARY))


def unavailable_reason() -> str | None:
    """None if the library is built, else what to run."""
    path = library_path()
    if not path.is_file():
        return f"the FFI library is not built ({path} missing): run `{BUILD_COMMAND}`"
    return None


def load_library() -> ctypes.CDLL:
    """The built library, loaded once per process."""
    global _library
    with _lock:
        if _library is None:
            reason = unavailable_reason()
            if reason:
                raise RuntimeError(reason)
            _library = ctypes.CDLL(str(library_path()))
        return _library


def register_targets() -> None:
    """Registers every FFI target (oneshot, ready, twoshot) for the CUDA platform, once per process."""
    global _registered
    library = load_library()
    with _lock:
        if _registered:
            return
        for name, (initialize, execute) in SYMBOLS.items():
            handlers = {"initialize": jax.ffi.pycapsule(getattr(library, initialize)),
                        "execute": jax.ffi.pycapsule(getattr(library, execute))}
            jax.ffi.register_ffi_target(name, handlers, platform="CUDA")
        _registered = True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Build the oproj_jax XLA FFI library (g++).")
    parser.add_argument("--out", help=f"output directory (default {DEFAULT_LIBRARY.parent})")
    path = build_library(parser.parse_args(argv).out)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
