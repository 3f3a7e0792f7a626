"""The XLA FFI library that launches the package's cubins: build it, load it once, register its targets.

The C++ sources in the checkout's top-level `ffi/` (in an installed wheel: `oproj_jax/_ffi/`) are
built with g++ alone into one library, against the headers of the jaxlib in use
(`jax.ffi.include_dir()`: build with the oldest jaxlib you run, the FFI API version is checked)
and `cuda.h` for types; libcuda is opened at run time.
Build it with

    python -m oproj_jax.build --ffi-only     (or: python -m oproj_jax.ffi [--out DIR])

(default oproj_jax/_lib/liboproj_ffi.so, git-ignored). `pip install .` builds it too (setup.py,
against the build environment's pinned jaxlib), when g++ and cuda.h are found; the compile step
itself is oproj_jax/_ffi_build.py. The targets are registered lazily, the first time a call is
traced (`register_targets()`).

Targets. The library knows no kernel: one generic launch target (ffi/launch.cc) runs whatever
launch a call describes in its attributes (oproj_jax/launch.py builds them: the CuTe consumer
in every mode, the Triton kernels), and the peer transport (ffi/cute_peer.cc) runs two such
launches, a publish and a consume, over the mailboxes it owns.

Registration. Each target has an execute stage (a launch on XLA's stream) and a record stage:
inside an XLA command buffer (a CUDA graph) the record stage adds the kernel as a graph node and
later only updates its arguments, where a handler without one is re-traced by stream capture
whenever its buffers move (several microseconds per call on the host, more than the kernel at
decode sizes). `jax.ffi.register_ffi_target` does not pass a record stage to the CUDA plugin,
so the library registers its targets itself: one bootstrap custom call
(`OprojRegisterTargets`, ffi/common.h), run once per process on a CUDA device, hands the
library's target table to the XLA runtime that runs it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pathlib
import sys
import threading
from typing import NamedTuple

import jax
import numpy as np

from oproj_jax import _ffi_build as ffi_build

# Every kernel but the peer mode's: one launch described by the call (ffi/launch.h), with a record stage.
LAUNCH_TARGET = "oproj_launch"
# The same handlers without a record stage (an initialize stage loads the module ahead): traced by
# stream capture inside command buffers, so the call launches our own module (RECORD_MAX_T says why).
LAUNCH_TRACED_TARGET = "oproj_launch_traced"
PEER_TARGET = "oproj_cute_peer"  # mode="peer": publish into the group's mailboxes, then consume (ffi/cute_peer.cc)
# Up to this many tokens a call of the ready consumer or a Triton kernel names LAUNCH_TARGET (a
# graph node updated in place); above, LAUNCH_TRACED_TARGET, traced by stream capture: the grid is
# then several waves and memory-bound, and for a record-stage launch XLA loads its own module and
# sets CU_FUNC_CACHE_PREFER_SHARED on it (the smallest L1), which cost the CuTe kernels 18 % at
# T = 4096 (421 against 357 us on the H200, docs/perf.md), more than the host work the record
# stage saves.
RECORD_MAX_T = 64
BOOTSTRAP_TARGET = "oproj_cute_register_targets"
BOOTSTRAP_SYMBOL = "OprojRegisterTargets"


class Stages(NamedTuple):
    """A target's exported handler symbols per execution stage (None: the stage is not used).
    Every target is graph-safe: XLA may put its calls into a command buffer (a CUDA graph)."""

    execute: str  # outside command buffers: a launch on XLA's stream
    # inside command buffers: graph nodes with PDL edges, updated in place when XLA hands new
    # buffers; None for the target of many tokens (RECORD_MAX_T), which XLA traces by stream capture
    record: str | None
    # a traced target's module load, ahead of the capture; a target with a record stage has none:
    # XLA would run it at every execution of every call site (host time per call), and its record
    # stage hands XLA the cubin (or loads the module before it asks XLA to capture execute
    # instead), while execute outside command buffers loads it on first use
    initialize: str | None = None
    instantiate: str | None = None  # makes the per-call-site state the other stages read


# The library's targets: the one table both registration paths (bootstrap, lowering only) read.
SYMBOLS = {
    LAUNCH_TARGET: Stages("OprojLaunchExecute", "OprojLaunchRecord", instantiate="OprojLaunchInstantiate"),
    LAUNCH_TRACED_TARGET: Stages("OprojLaunchExecute", None, "OprojLaunchInitialize", "OprojLaunchInstantiate"),
    PEER_TARGET: Stages("OprojPeerExecute", "OprojPeerRecord", instantiate="OprojPeerInstantiate"),
}
COMMAND_BUFFER_COMPATIBLE = 1  # XLA_FFI_Handler_Traits: every target's traits

SOURCE_DIR = ffi_build.SOURCE_DIR  # the C++ sources: ffi/ of the checkout, or the package's _ffi/
DEFAULT_LIBRARY = pathlib.Path(__file__).resolve().parent / "_lib" / ffi_build.LIBRARY_NAME  # oproj_jax/_lib/
BUILD_COMMAND = "python -m oproj_jax.build --ffi-only"
LIBRARY_ENV = "OPROJ_JAX_FFI_LIBRARY"  # a built library to load instead of DEFAULT_LIBRARY

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_registered = False


def build_library(out_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Compiles the C++ sources (SOURCE_DIR) into `out_dir`/liboproj_ffi.so (default oproj_jax/_lib/)
    against the jaxlib in use (`jax.ffi.include_dir()`); returns its path. RuntimeError naming what is missing."""
    target = DEFAULT_LIBRARY if out_dir is None else pathlib.Path(out_dir) / DEFAULT_LIBRARY.name
    return ffi_build.compile_library(target, jaxlib_include=jax.ffi.include_dir())


def library_path() -> pathlib.Path:
    """Where the library is loaded from: $OPROJ_JAX_FFI_LIBRARY, else the default build output."""
    return pathlib.Path(os.environ.get(LIBRARY_ENV, DEFAULT_LIBRARY))


def _where() -> str:
    """Where the library is looked for, and why there."""
    if os.environ.get(LIBRARY_ENV):
        return f"${LIBRARY_ENV} names {library_path()}"
    return f"the default {DEFAULT_LIBRARY} (${LIBRARY_ENV} unset)"


def _fixes() -> str:
    return (
        f"build it with `{BUILD_COMMAND}` (g++ and cuda.h, no GPU needed), or install the package with g++ on PATH "
        f"(`pip install '.[cuda]'` from the checkout builds it into the wheel), or set ${LIBRARY_ENV} to a built "
        f"{DEFAULT_LIBRARY.name}"
    )


def unavailable_reason() -> str | None:
    """None if the library is built, else where it was looked for and what to run."""
    path = library_path()
    if not path.is_file():
        needs = ffi_build.missing(jaxlib=False)
        needs = f"; this machine cannot build it yet: {needs}" if needs else ""
        return f"the FFI library is not built ({path} missing; {_where()}): {_fixes()}{needs}"
    return None


def library_loaded() -> bool:
    """Whether this process has loaded the FFI library (nothing of it can be open before)."""
    return _library is not None


def load_library() -> ctypes.CDLL:
    """The built library, loaded once per process. RuntimeError naming where it was looked for
    and the fix when it is missing or does not load (another jaxlib's build, a truncated file)."""
    global _library
    with _lock:
        if _library is None:
            reason = unavailable_reason()
            if reason:
                raise RuntimeError(reason)
            try:
                _library = ctypes.CDLL(str(library_path()))
            except OSError as err:
                raise RuntimeError(
                    f"the FFI library {library_path()} does not load ({_where()}): {err}; rebuild it against this "
                    f"jaxlib: {_fixes()}"
                ) from err
        return _library


def _cuda_devices() -> list:
    try:
        return jax.local_devices(backend="cuda")  # the bootstrap runs here: an addressable device
    except RuntimeError:
        return []


def _address(library: ctypes.CDLL, symbol: str | None) -> int:
    return 0 if symbol is None else ctypes.cast(getattr(library, symbol), ctypes.c_void_p).value


def _stage_table() -> tuple[list[str | None], list[int]]:
    """The five stage symbols (instantiate, prepare, initialize, execute, record) per target,
    flattened, and the traits per target: what the bootstrap call registers."""
    handlers = []
    for stages in SYMBOLS.values():
        handlers += [stages.instantiate, None, stages.initialize, stages.execute, stages.record]
    return handlers, [COMMAND_BUFFER_COMPATIBLE] * len(SYMBOLS)


def _bootstrap(library: ctypes.CDLL, device) -> None:
    """Runs the bootstrap call once on `device`: the library registers SYMBOLS with the CUDA
    plugin's XLA runtime (ffi/common.h)."""
    capsule = jax.ffi.pycapsule(getattr(library, BOOTSTRAP_SYMBOL))
    jax.ffi.register_ffi_target(BOOTSTRAP_TARGET, capsule, platform="CUDA")
    symbols, traits = _stage_table()
    attributes = dict(
        names=",".join(SYMBOLS),
        handlers=np.array([_address(library, s) for s in symbols], np.int64),
        traits=np.array(traits, np.int64),
    )
    # An empty result (a word the handler never writes would be read uninitialized by a later
    # host copy: compute-sanitizer's initcheck), kept by XLA as a call with a side effect.
    call = jax.ffi.ffi_call(BOOTSTRAP_TARGET, jax.ShapeDtypeStruct((0,), np.uint32), has_side_effect=True)
    # Executed now, also when the first cute call is being traced inside a user's jit (a nested
    # jit would be staged into that program instead of run): the targets must exist before XLA
    # compiles the program that names them.
    with jax.ensure_compile_time_eval(), jax.default_device(device):
        compiled = jax.jit(lambda: call(**attributes)).lower().compile()
        jax.block_until_ready(compiled())  # raises what the registration reported


def register_targets() -> None:
    """Registers every FFI target for the CUDA platform, once per process (see Registration)."""
    global _registered
    library = load_library()
    with _lock:
        if _registered:
            return
        devices = _cuda_devices()
        if devices:
            _bootstrap(library, devices[0])
        else:  # lowering only (no device to run the bootstrap on): the record stage is never needed
            for name, stages in SYMBOLS.items():
                handlers = {"execute": jax.ffi.pycapsule(getattr(library, stages.execute))}
                for stage in ("initialize", "instantiate"):
                    if getattr(stages, stage):
                        handlers[stage] = jax.ffi.pycapsule(getattr(library, getattr(stages, stage)))
                jax.ffi.register_ffi_target(name, handlers, platform="CUDA", traits=COMMAND_BUFFER_COMPATIBLE)
        _registered = True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Build the oproj_jax XLA FFI library (g++).")
    parser.add_argument("--out", help=f"output directory (default {DEFAULT_LIBRARY.parent})")
    path = build_library(parser.parse_args(argv).out)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
