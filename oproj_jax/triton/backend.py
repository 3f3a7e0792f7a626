"""backend="triton": the Triton kernels of kernel.py launched from XLA.

Each launch is one custom call, the prefix aliased input to output (`input_output_aliases`), so
a jitted caller that donates `prefix` has it updated in place; the sync kernel's programs pass
their chunks' dot products to each other in an f32 scratch output, with int32 arrival counters
that start at zero in every call (a zeros operand XLA fills); at small T on the GPUs of
plan.CLUSTER_CAPABILITIES a token's programs form one thread block cluster and meet at its
barrier instead (no counters). Through the package's target on
sm_90 and newer the sync kernel is launched with programmatic dependent launch (a PDL edge in
XLA's graph).
The same plan.Plan as torch_launch.py: a JAX call and a PyTorch call of one shape compile the
same kernels and give the same bits.

The kernels are compiled for the compute capability of GPU 0 unless told (`launch(...,
compute_capability=90)` lowers for an sm_90 device on a machine without one); there is no CPU
or interpret path, so this backend runs on CUDA GPUs only.

Two ways to launch (`launch(..., jax_triton=...)`):
  the package's own FFI target (library.py; the default, and what the registry runs): the
      kernel compiled to a cubin by Triton, launched by a handler with a record stage, so
      inside XLA's command buffers it is a graph node updated in place;
  jax_triton.triton_call (jax_triton=True): the jax-triton path the package offers, which
      needs no FFI library of the package's own, only jax-triton and the JAX CUDA plugin. In
      jax-triton 0.3.1 it is a legacy custom call, which XLA leaves outside its command buffers
      (slower per call: docs/perf.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from oproj_jax.contract import ConsumerResult, Dims
from oproj_jax import ffi, reference
from oproj_jax.triton import library
from oproj_jax.triton import plan as launch_plan

INSTALL = "pip install oproj-jax[triton]"
READS_PARTIAL = True  # consumer takes partial= and rank= (api.py)
GRAPH_NODE = True  # a kernel node up to library.RECORD_MAX_T tokens; consumer takes stream_capture= (api.py)


def unavailable_reason(platform: str) -> str | None:
    """None on a CUDA platform with triton and the package's FFI library (launch_reason; the
    compute capability of the devices, >= 8.0, is api.capability_reason's to check)."""
    if platform not in ("gpu", "cuda"):
        return (
            f"the Triton kernel runs on NVIDIA CUDA GPUs, it has no CPU or interpret path; the platform is {platform!r}"
        )
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return f"the Triton backend needs triton ({err}): {INSTALL}"
    return launch_reason()


def launch_reason(jax_triton: bool = False) -> str | None:
    """None if `launch(..., jax_triton=jax_triton)` can run here: the package's target needs its
    FFI library built, jax_triton=True jax-triton and the CUDA plugin's Triton kernel call."""
    if not jax_triton:
        reason = ffi.unavailable_reason()
        return reason and f"the Triton kernels launch through the package's FFI library: {reason}"
    from jaxlib import gpu_triton

    if not hasattr(gpu_triton, "TritonKernelCall"):
        return (
            "jax_triton=True: this jaxlib has no CUDA Triton kernel call (the JAX CUDA plugin brings it): "
            "pip install jax[cuda13]"
        )
    try:
        from jax_triton import triton_call  # noqa: F401
    except ImportError as err:
        return f"jax_triton=True needs jax-triton ({err}): {INSTALL}"
    finally:
        launch_plan.repair_cache_dir()
    return None


def unsupported_reason(dims: Dims, **options) -> str | None:
    reason = launch_plan.unsupported_reason(dims.R)
    return reason and f"{reason}; backend='pallas' (on a Hopper GPU) or 'reference' takes any R"


def partial_in_place(dims: Dims, **options) -> bool:
    """`consumer(..., partial=...)` reads the partial in place: every kernel takes it (plan.make's
    `own`) through the package's launch target."""
    return True


def consumer(
    mailbox, prefix, blocks, norm, query, out_norm, *, partial=None, rank: int = 0, stream_capture=False, **options
) -> ConsumerResult:
    """The registry entry point (api.consumer has checked the arguments): `launch` for GPU 0's
    compute capability, the prefix updated in place (aliased); `partial` [T, H] (or None) read
    in place of mailbox slot `rank`; `stream_capture`: the traced target at every T."""
    return launch(
        mailbox, prefix, blocks, norm, query, out_norm, partial=partial, rank=rank, stream_capture=stream_capture,
        **options,
    )  # fmt: skip


def launch(
    mailbox,
    prefix,
    blocks,
    norm,
    query,
    out_norm,
    *,
    partial=None,
    rank: int = 0,
    variant=None,
    compute_capability=None,
    jax_triton=False,
    pdl=None,
    stream_capture=False,
    **options,
) -> ConsumerResult:
    """`consumer`, compiled for `compute_capability` (e.g. 90; None: GPU 0's). `jax_triton`:
    launched by jax_triton.triton_call instead of the package's FFI target (the module
    docstring); it takes no own partial, so there `partial` is written into a copy of the
    mailbox first. `variant`: a name of plan.VARIANTS in place of plan.default_variant's, for
    the tests. `pdl`: the sync kernel launched with programmatic dependent launch; None: through
    the package's target on sm_90 or newer (jax-triton's launch has no such option).
    `stream_capture`: through the package's traced target at every T (api.consumer says when;
    jax-triton's launch runs outside XLA's graph either way)."""
    if partial is not None and jax_triton:
        mailbox, partial = reference.with_partial(mailbox, partial, rank), None
    R, T, H = mailbox.shape
    cc = 0 if jax_triton else library.capability(compute_capability)
    needs = f"the package's launch target (not jax_triton) on compute capability >= {launch_plan.PDL_MIN_CAPABILITY}"
    pdl = launch_plan.use_pdl(pdl, cc >= launch_plan.PDL_MIN_CAPABILITY, needs)
    clusters = cc in launch_plan.CLUSTER_CAPABILITIES  # jax-triton's launch sets no clusters
    own = None if partial is None else rank
    plan = launch_plan.make(R, T, blocks.shape[1], H, **options, variant=variant, pdl=pdl, clusters=clusters, own=own)
    new_prefix, output, xmoe = _call(plan, compute_capability, bool(jax_triton), bool(stream_capture))(
        mailbox, prefix, blocks, norm, query, out_norm, *(() if partial is None else (partial,))
    )
    return ConsumerResult(new_prefix, output, xmoe if options["xmoe_replicas"] else None)


def _name(launch: launch_plan.Launch) -> str:
    return f"oproj_consumer_triton_{launch.kernel}"


def _jax_triton_options(launch: launch_plan.Launch) -> dict:
    """launch.options() less the register cap: jax-triton 0.3.1 has no maxnreg option, so it
    compiles a capped configuration uncapped (the same code and bits; fewer programs per SM)."""
    options = launch.options()
    options.pop("maxnreg", None)
    return options


def _via_triton_call(launch: launch_plan.Launch, arrays, out_shape, aliases, zeroed, compute_capability, after=()):
    """jax_triton=True: jax_triton.triton_call, its custom call "triton_kernel_call" (a legacy
    custom call). It is the package's jax-triton launch, for callers without its FFI library.
    triton_call passes its operands before the results, so it takes no `after` (no own partial:
    `launch` writes one into the mailbox first)."""
    if after:
        raise ValueError(f"{launch.kernel}: jax_triton=True takes no operands after the results")
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


@functools.lru_cache(maxsize=None)
def _call(plan: launch_plan.Plan, compute_capability: int | None, jax_triton: bool, stream_capture: bool = False):
    """The plan's launch as a function of the six arrays (seven: the own partial last, where the
    plan reads one). The kernels have no batch dimension: under jax.vmap it runs once per batch
    element."""
    reason = launch_reason(jax_triton)
    if reason:
        raise RuntimeError(reason)
    lower = _via_triton_call if jax_triton else functools.partial(library.lower, stream_capture=stream_capture)

    def call(mailbox, prefix, blocks, norm, query, out_norm, *own):
        T, H = prefix.shape
        reps = dict(plan.launch.constexprs)["REPS"]
        rows = jax.ShapeDtypeStruct((T, H), jnp.bfloat16)
        # Placeholders for pointers the kernels never touch: an xmoe of one element at
        # xmoe_replicas = 0, norm for the blocks at NB = 0 (an empty operand may have no address).
        xmoe = jax.ShapeDtypeStruct((reps, T, H) if reps else (1,), jnp.bfloat16)
        blocks = blocks if blocks.shape[1] else norm
        arrays = (mailbox, prefix, blocks, norm, query, out_norm)
        if plan.stats_shape is None:  # row, tile: one program per token
            return lower(plan.launch, arrays, (rows, rows, xmoe), {1: 0}, (), compute_capability, own)
        stats = jax.ShapeDtypeStruct(plan.stats_shape, jnp.float32)
        if plan.arrivals_shape is None:  # sync-*-cluster: no counters; one int32 for the pointer it never reads
            unused = jax.ShapeDtypeStruct((1,), jnp.int32)
            outs = (rows, rows, xmoe, stats, unused)
            return lower(plan.launch, arrays, outs, {1: 0}, (), compute_capability, own)[:3]
        # sync: its scratch, and its arrival counters zeroed by the launch (last: the one output zeroed)
        arrivals = jax.ShapeDtypeStruct(plan.arrivals_shape, jnp.int32)
        outs = (rows, rows, xmoe, stats, arrivals)
        return lower(plan.launch, arrays, outs, {1: 0}, (len(outs) - 1,), compute_capability, own)[:3]

    return jax.custom_batching.sequential_vmap(call)
