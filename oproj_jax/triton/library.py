"""The lowering of a Triton launch through the package's own FFI launch target (ffi/launch.cc).

jaxlib's Triton kernel call enters XLA's command buffers by stream capture, traced again each
time XLA hands the call new buffers; this target has a record stage (a kernel node whose
arguments XLA rewrites in place), as the CuTe targets do. The kernel is compiled here, at trace
time, by Triton itself into a cubin (ptxas, as the PyTorch launch compiles it), stored
content-addressed under cache_dir() and named in the call with its entry, shared memory and
launch shape; the C++ side loads it once per CUDA context.

The launch's parameters (oproj_jax/launch.py) are the kernel's pointers in Triton's order: the
operands, then the results (the kernels of kernel.py have no runtime scalars), then the caller's
own partial where the launch reads one in place (plan.make's `own`), then the null pointers Triton
appends for its global and profile scratch (refused here if a kernel needs
either); thread block clusters where the plan's launch has them (sync-*-cluster). A result
the kernel reads as passed in (the sync kernels' arrival counters, which must start at zero)
is given as an extra zeros operand aliased to it: XLA zeroes it inside its graph, and the
handler copies it over when XLA did not alias the two.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from oproj_jax import disk_cache
from oproj_jax import ffi, launch as ffi_launch
from oproj_jax.triton import plan as launch_plan

TARGET = ffi.LAUNCH_TARGET  # record stage: a graph node, updated in place
TRACED_TARGET = ffi.LAUNCH_TRACED_TARGET  # no record stage: traced by stream capture
RECORD_MAX_T = ffi.RECORD_MAX_T  # above it the launch names TRACED_TARGET (ffi.py says why)
CACHE_ENV = disk_cache.ENV_CACHE_DIR  # "OPROJ_JAX_CACHE_DIR"
POINTER_TYPES = {np.dtype(jnp.bfloat16): "*bf16", np.dtype(np.float32): "*fp32", np.dtype(np.int32): "*i32"}


def cache_dir() -> pathlib.Path:
    """Where compiled cubins are kept: $OPROJ_JAX_CACHE_DIR/triton, else
    platformdirs.user_cache_dir("oproj_jax")/triton ($XDG_CACHE_HOME/oproj_jax/triton, else
    ~/.cache/oproj_jax/triton on Linux)."""
    env = os.environ.get(CACHE_ENV)
    return (pathlib.Path(env) if env else disk_cache.user_cache_root()) / "triton"


class Image(NamedTuple):
    path: str  # the cubin, named by its sha256
    entry: str
    smem: int
    block: int  # threads per program
    extra_params: int  # Triton's null scratch pointers after the kernel's own


@functools.lru_cache(maxsize=None)
def compile_launch(launch: launch_plan.Launch, pointer_types: tuple[str, ...], compute_capability: int) -> Image:
    """`launch`'s kernel compiled for sm_`compute_capability` with these pointer types (every
    pointer 16-byte aligned, as XLA's buffers are), stored under cache_dir()."""
    import triton
    from triton.backends.compiler import GPUTarget

    from oproj_jax.triton import kernel

    fn = getattr(kernel, launch.kernel)
    constexprs = dict(launch.constexprs)
    pointers = [name for name in fn.arg_names if name not in constexprs]
    if len(pointers) != len(pointer_types):
        raise ValueError(f"{launch.kernel}: {len(pointers)} pointer parameters, {len(pointer_types)} arrays given")
    types = dict(zip(pointers, pointer_types))
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in pointers}
    source = triton.compiler.ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    launch_plan.repair_cache_dir()
    compiled = triton.compile(source, target=GPUTarget("cuda", compute_capability, 32), options=launch.options())
    meta = compiled.metadata
    for scratch in ("global_scratch_size", "profile_scratch_size"):
        if getattr(meta, scratch, 0):
            raise NotImplementedError(f"{launch.kernel}: the kernel needs Triton {scratch} = {getattr(meta, scratch)}")
    entry = re.search(r"\.entry\s+(\w+)\s*\(([^)]*)\)", compiled.asm["ptx"])
    extra = entry.group(2).count(".param") - len(pointers)
    if entry.group(1) != meta.name or extra < 0:
        raise RuntimeError(f"{launch.kernel}: unexpected PTX entry {entry.group(1)!r} with {extra} extra parameters")
    image = compiled.asm["cubin"]
    path = cache_dir() / f"{meta.name}-{hashlib.sha256(image).hexdigest()[:24]}.cubin"
    if not path.is_file():
        # No lock: the name is the content's hash, so processes storing it at once write the same
        # bytes, and each write is atomic (a reader never sees half a file).
        path.parent.mkdir(parents=True, exist_ok=True)
        disk_cache.write_atomically(path, image)
    return Image(str(path), meta.name, int(meta.shared), 32 * meta.num_warps, extra)


def capability(given: int | None) -> int:
    """`given` (e.g. 90), else the compute capability of GPU 0."""
    if given:
        return int(given)
    major, minor = jax.devices("cuda")[0].compute_capability.split(".")
    return 10 * int(major) + int(minor)


def check_block(kernel: str, block: int) -> None:
    """A Triton program's threads: whole warps, at most 1024 (ValueError otherwise)."""
    if block % 32 or not 32 <= block <= 1024:
        raise ValueError(f"{kernel}: expected whole warps, 32..1024 threads per program, got {block}")


def lower(
    launch: launch_plan.Launch, arrays, out_shape, aliases, zeroed, compute_capability, after=(), stream_capture=False
):
    """One launch of `launch` as a call of TARGET (TRACED_TARGET above RECORD_MAX_T tokens, or at
    every T with `stream_capture`): the results `out_shape` (the first is [T, H] in every launch
    of plan.py), `aliases` {operand: result}; the results in `zeroed` start at zero. The kernel's
    pointers are `arrays`, the results, then `after` (operands the kernel takes after its
    results: the own partial)."""
    cc = capability(compute_capability)
    types = tuple(POINTER_TYPES[np.dtype(x.dtype)] for x in (*arrays, *out_shape, *after))
    image = compile_launch(launch, types, cc)
    check_block(launch.kernel, image.block)
    zeros = [jnp.zeros(out_shape[i].shape, out_shape[i].dtype) for i in zeroed]
    operands = (*arrays, *after, *zeros)
    first_result = len(operands)
    pointers = [*range(len(arrays)), *(first_result + i for i in range(len(out_shape)))]
    pointers += range(len(arrays), len(arrays) + len(after))
    params = [*map(ffi_launch.buffer, pointers), *[ffi_launch.NULL] * image.extra_params]
    inplace = [(len(arrays) + len(after) + n, i) for n, i in enumerate(zeroed)]
    aliases = {**(aliases or {}), **dict(inplace)}
    kernel_launch = ffi_launch.Launch(
        image.path,
        image.entry,
        grid=(*launch.grid, 1, 1)[:3],
        block=(image.block, 1, 1),
        cluster=(launch.cluster, 1, 1) if launch.cluster else ffi_launch.NO_CLUSTER,
        smem=launch.dynamic_smem(image.smem),
        pdl=bool(launch.pdl),
        params=tuple(params),
    )
    tokens = out_shape[0].shape[0]
    return ffi_launch.call(
        kernel_launch,
        operands,
        out_shape,
        aliases=aliases,
        inplace=inplace,
        traced=stream_capture or tokens > RECORD_MAX_T,
    )
