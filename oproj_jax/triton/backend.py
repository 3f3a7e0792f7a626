"""backend="triton": the Triton kernels of kernel.py launched from XLA.

Each launch is one custom call, the prefix aliased input to output (`input_output_aliases`), so
a jitted caller that donates `prefix` has it updated in place; the split variants pass the
chunks' dot products to their second kernel in an f32 scratch output, the sync variants to
themselves, with int32 arrival counters that start at zero in every call (a zeros operand XLA
fills). Through the package's target on sm_90 and newer the sync kernel is launched with
programmatic dependent launch (a PDL edge in XLA's graph).
The same plan.Plan as torch_launch.py: a JAX call and a PyTorch call of one shape compile the
same kernels and give the same bits.

The kernels are compiled for the compute capability of GPU 0 unless told (`launch(...,
compute_capability=90)` lowers for an sm_90 device on a machine without one); there is no CPU
or interpret path, so this backend runs on CUDA GPUs only.

Three lowerings of a launch (`launch(..., lowering=...)`, DEFAULT_LOWERING):
  "library"      (the default) the package's own FFI target (library.py): the kernel compiled
                 to a cubin by Triton, launched by a handler with a record stage, so inside
                 XLA's command buffers it is a graph node updated in place;
  "ffi"          the kernel compiled by jax_triton as triton_call would and its kernel-call
                 proto sent to jaxlib's command-buffer-compatible FFI target (traced by stream
                 capture inside command buffers);
  "triton_call"  jax_triton.triton_call itself (in jax-triton 0.3.1 a legacy custom call, which
                 XLA leaves outside its command buffers).
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp

from oproj_jax.api import ConsumerResult, Dims
from oproj_jax.cute import ffi
from oproj_jax.triton import library
from oproj_jax.triton import plan as launch_plan

INSTALL = "pip install oproj-jax[triton]"


def unavailable_reason(platform: str) -> str | None:
    """None on a CUDA platform with triton and what DEFAULT_LOWERING needs (lowering_reason; the
    compute capability of the devices, >= 8.0, is api.capability_reason's to check)."""
    if platform not in ("gpu", "cuda"):
        return (
            f"the Triton kernel runs on NVIDIA CUDA GPUs, it has no CPU or interpret path; the platform is {platform!r}"
        )
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return f"the Triton backend needs triton ({err}): {INSTALL}"
    return lowering_reason(DEFAULT_LOWERING)


def lowering_reason(lowering: str) -> str | None:
    """None if `lowering` can run here: "library" needs the package's FFI library built, the two
    others jax_triton and the CUDA plugin's Triton kernel call."""
    if lowering == "library":
        reason = ffi.unavailable_reason()
        return reason and f"lowering 'library' launches through the package's FFI library: {reason}"
    from jaxlib import gpu_triton

    if not hasattr(gpu_triton, "TritonKernelCall"):
        return (
            f"lowering {lowering!r}: this jaxlib has no CUDA Triton kernel call (the JAX CUDA plugin brings it): "
            "pip install jax[cuda13]"
        )
    try:
        import jax_triton  # noqa: F401
    except ImportError as err:
        return f"lowering {lowering!r} needs jax-triton ({err}): {INSTALL}"
    finally:
        launch_plan.repair_cache_dir()
    return None


def unsupported_reason(dims: Dims, **options) -> str | None:
    reason = launch_plan.unsupported_reason(dims.R)
    return reason and f"{reason}; backend='pallas' (on a Hopper GPU) or 'reference' takes any R"


def consumer(mailbox, prefix, blocks, norm, query, out_norm, **options) -> ConsumerResult:
    """The registry entry point (api.consumer has checked the arguments): `launch` for GPU 0's
    compute capability, the prefix updated in place (aliased). Takes launch's `variant` too."""
    return launch(mailbox, prefix, blocks, norm, query, out_norm, **options)


def launch(
    mailbox,
    prefix,
    blocks,
    norm,
    query,
    out_norm,
    *,
    variant=None,
    compute_capability=None,
    lowering=None,
    pdl=None,
    **options,
) -> ConsumerResult:
    """`consumer`, compiled for `compute_capability` (e.g. 90; None: GPU 0's), each launch lowered
    as `lowering` (LOWERINGS; None: DEFAULT_LOWERING). `variant`: a name of plan.VARIANTS, None
    for the default rule by T. `pdl`: the sync kernel launched with programmatic dependent
    launch; None: with lowering "library" on sm_90 or newer (jax-triton's launches have no such
    option)."""
    lowering = lowering or DEFAULT_LOWERING
    if lowering not in LOWERINGS:
        raise ValueError(f"lowering: expected one of {sorted(LOWERINGS)}, got {lowering!r}")
    R, T, H = mailbox.shape
    can = lowering == "library" and library.capability(compute_capability) >= launch_plan.PDL_MIN_CAPABILITY
    needs = f"lowering 'library' and compute capability >= {launch_plan.PDL_MIN_CAPABILITY}; got lowering {lowering!r}"
    pdl = launch_plan.use_pdl(pdl, can, needs)
    plan = launch_plan.make(R, T, blocks.shape[1], H, **options, variant=variant, pdl=pdl)
    new_prefix, output, xmoe = _call(plan, compute_capability, lowering)(mailbox, prefix, blocks, norm, query, out_norm)
    return ConsumerResult(new_prefix, output, xmoe if options["xmoe_replicas"] else None)


def _name(launch: launch_plan.Launch) -> str:
    return f"oproj_consumer_triton_{launch.kernel}"


def _jax_triton_options(launch: launch_plan.Launch) -> dict:
    """launch.options() less the register cap: jax-triton 0.3.1 has no maxnreg option, so its
    lowerings compile a capped variant uncapped (the same code and bits; fewer programs per SM)."""
    options = launch.options()
    options.pop("maxnreg", None)
    return options


def _via_triton_call(launch: launch_plan.Launch, arrays, out_shape, aliases, zeroed, compute_capability):
    """jax_triton.triton_call: its custom call "triton_kernel_call" (a legacy custom call)."""
    from jax_triton import triton_call

    from oproj_jax.triton import kernel

    return triton_call(
        *arrays,
        kernel=getattr(kernel, launch.kernel),
        out_shape=out_shape,
        grid=launch.grid,
        name=_name(launch),
        input_output_aliases=aliases,
        zeroed_outputs=zeroed,
        compute_capability=compute_capability,
        **_jax_triton_options(launch),
        **dict(launch.constexprs),
    )


def _via_ffi(launch: launch_plan.Launch, arrays, out_shape, aliases, zeroed, compute_capability):
    """The kernel compiled by jax_triton as triton_call compiles it, the launch the same kernel
    call (the same proto), sent to jaxlib's XLA FFI target FFI_TARGET: XLA records a custom call
    into its command buffers only through an FFI handler that says it may, as this one does
    (newer jax-triton releases lower there; 0.3.1 does not)."""
    from jax_triton import triton_lib
    from jaxlib import gpu_triton

    from oproj_jax.triton import kernel

    types = [triton_lib.get_triton_type(jax.core.ShapedArray(x.shape, x.dtype)) for x in (*arrays, *out_shape)]
    compiled, _ = triton_lib.get_or_create_triton_kernel(
        triton_lib.get_cuda_backend,
        "cuda",
        getattr(kernel, launch.kernel),
        types,
        (),
        num_ctas=1,
        compute_capability=compute_capability or gpu_triton.get_compute_capability(0),
        metaparams=dict(launch.constexprs),
        dump=False,
        **_jax_triton_options(launch),
    )
    # Every buffer 16-byte aligned, as triton_call assumes (the kernel is specialized on it); the
    # kernel call zeroes the `zeroed` outputs (a memset on the stream before the launch).
    sizes = [0] * len(arrays) + [x.size * x.dtype.itemsize if i in zeroed else 0 for i, x in enumerate(out_shape)]
    params = [gpu_triton.create_array_parameter(size, 16) for size in sizes]
    call = gpu_triton.TritonKernelCall(compiled, *(*launch.grid, 1, 1)[:3], params)
    opaque = zlib.compress(call.to_proto(_name(launch), b""))
    return jax.ffi.ffi_call(FFI_TARGET, out_shape, input_output_aliases=aliases)(*arrays, opaque=opaque)


FFI_TARGET = "triton_kernel_call_ffi"
LOWERINGS = {"triton_call": _via_triton_call, "ffi": _via_ffi, "library": library.lower}
# "library" and "ffi": on the H200 (jax 0.11.2) XLA's thunk dump shows their calls inside the
# command buffer, triton_call's legacy custom calls outside it (tests/test_triton_gpu.py::
# test_xla_command_buffer_thunk_dump). "library" records a graph node that XLA updates in place,
# "ffi" is traced by stream capture whenever its buffers move (docs/perf.md has the cost of each).
DEFAULT_LOWERING = "library"


@functools.lru_cache(maxsize=None)
def _call(plan: launch_plan.Plan, compute_capability: int | None, lowering: str):
    """The plan's launches as a function of the six arrays. The kernels have no batch
    dimension: under jax.vmap it runs once per batch element."""
    reason = lowering_reason(lowering)
    if reason:
        raise RuntimeError(reason)
    lower = LOWERINGS[lowering]

    def run(launch: launch_plan.Launch, *arrays, out_shape, aliases=None, zeroed=()):
        return lower(launch, arrays, out_shape, aliases, zeroed, compute_capability)

    def call(mailbox, prefix, blocks, norm, query, out_norm):
        T, H = prefix.shape
        reps = dict(plan.launches[-1].constexprs)["REPS"]
        rows = jax.ShapeDtypeStruct((T, H), jnp.bfloat16)
        # Placeholders for pointers the kernels never touch: an xmoe of one element at
        # xmoe_replicas = 0, norm for the blocks at NB = 0 (an empty operand may have no address).
        xmoe = jax.ShapeDtypeStruct((reps, T, H) if reps else (1,), jnp.bfloat16)
        blocks = blocks if blocks.shape[1] else norm
        args = (mailbox, prefix, blocks, norm, query, out_norm)
        if plan.stats_shape is None:  # one program per token: one kernel
            (single,) = plan.launches
            return run(single, *args, out_shape=(rows, rows, xmoe), aliases={1: 0})
        stats = jax.ShapeDtypeStruct(plan.stats_shape, jnp.float32)
        if plan.arrivals_shape is not None:  # sync: one kernel, its arrival counters zeroed by the launch
            (single,) = plan.launches
            arrivals = jax.ShapeDtypeStruct(plan.arrivals_shape, jnp.int32)
            outs = (rows, rows, xmoe, stats, arrivals)  # the counters last: the one output zeroed
            return run(single, *args, out_shape=outs, aliases={1: 0}, zeroed=(len(outs) - 1,))[:3]
        sums, outs = plan.launches
        new_prefix, stats = run(sums, mailbox, prefix, blocks, norm, query, out_shape=(rows, stats), aliases={1: 0})
        output, xmoe = run(outs, new_prefix, blocks, out_norm, stats, out_shape=(rows, xmoe))
        return new_prefix, output, xmoe

    return jax.custom_batching.sequential_vmap(call)
