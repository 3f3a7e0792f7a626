"""The Triton consumer from PyTorch: the kernels of kernel.py on CUDA bf16 tensors.

    from oproj_jax.triton import torch_launch
    prefix, output, xmoe = torch_launch.consumer(mailbox, prefix, blocks, norm, query, out_norm, groups=4)

`prefix` is updated in place (and returned); output and xmoe are new tensors. One launch on the
current stream (the sync kernel's after zeroing its arrival counters, unless the caller keeps
them: `arrivals`; none at small T on an H100/H200, where a token's programs form one thread block
cluster and meet at its barrier), no host synchronization: the call can be captured in a CUDA
graph. On sm_90
and newer the sync kernel is launched with programmatic dependent launch, so in a CUDA graph of
consecutive calls each launch overlaps the end of the one before. With TRITON_INTERPRET=1 in the
environment before kernel.py is imported, the kernels run in Triton's interpreter on CPU tensors
(slow; for tests).

A decode loop keeps the counters:

    arrivals = torch_launch.arrival_counters(T, device)   # once; zero, and left at zero by each call
    for layer in layers:
        torch_launch.consumer(..., arrivals=arrivals)

One set per stream of calls: two calls that run at the same time must not share one.
"""

from __future__ import annotations

import contextlib

from oproj_jax.options import Options, takes_options
from oproj_jax.contract import TorchResult, check_tensor_partial, check_tensors
from oproj_jax.triton import kernel
from oproj_jax.triton import plan as launch_plan

MIN_CAPABILITY = (8, 0)  # bf16 arithmetic


def interpreted() -> bool:
    """True when kernel.py was imported under TRITON_INTERPRET=1: its kernels run on the CPU."""
    import triton

    return not isinstance(kernel.row_kernel, triton.runtime.JITFunction)


def _check_launchable(torch, named: dict) -> None:
    mailbox = named["mailbox"]
    R, T, H = mailbox.shape
    if min(R, T, H) < 1:
        raise ValueError(f"mailbox: expected R, T, H >= 1 (shape [R, T, H]), got {tuple(mailbox.shape)}")
    reason = launch_plan.unsupported_reason(R)
    if reason:
        raise ValueError(f"mailbox: {reason}")
    for name, x in named.items():
        if not x.is_contiguous():
            raise ValueError(
                f"{name}: expected a contiguous tensor (the kernel indexes rows of H elements), got strides "
                f"{tuple(x.stride())} for shape {tuple(x.shape)}" + ("" if name == "prefix" else "; call .contiguous()")
            )
    device = mailbox.device
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            raise ValueError(
                f"mailbox: device {device} has compute capability {capability[0]}.{capability[1]}; the Triton "
                f"kernel needs {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (bf16)"
            )
    elif not interpreted():
        raise ValueError(
            f"mailbox: expected CUDA tensors (the Triton kernel runs on the GPU; on CPU tensors only in "
            f"Triton's interpreter, TRITON_INTERPRET=1), got device {device}"
        )


def arrival_counters(T: int, device):
    """Arrival counters for calls of up to T tokens on `device`, zero: pass them as `arrivals`
    to every call of a loop (each call leaves them at zero). One set per stream of calls."""
    import torch

    return torch.zeros((T, 2), dtype=torch.int32, device=device)


def _check_arrivals(torch, arrivals, T: int, device) -> None:
    if not isinstance(arrivals, torch.Tensor):
        raise TypeError(f"arrivals: expected None or a torch.Tensor (arrival_counters), got {type(arrivals).__name__}")
    if arrivals.dtype != torch.int32 or arrivals.device != device or not arrivals.is_contiguous():
        raise ValueError(
            f"arrivals: expected a contiguous int32 tensor on {device} (arrival_counters), got "
            f"{arrivals.dtype} on {arrivals.device}" + ("" if arrivals.is_contiguous() else ", not contiguous")
        )
    if arrivals.numel() < 2 * T:
        raise ValueError(
            f"arrivals: expected at least 2 * T = {2 * T} counters (arrival_counters(T, device)), got {arrivals.numel()}"
        )


@takes_options()
def consumer(
    mailbox,
    prefix,
    blocks,
    norm,
    query,
    out_norm,
    *,
    partial=None,
    rank: int = 0,
    variant: str | None = None,
    arrivals=None,
    pdl: bool | None = None,
    **options,
) -> TorchResult:
    """The arguments and options of oproj_jax.consumer, as bf16 torch.Tensors (see the module
    docstring). Returns TorchResult(prefix (the argument, updated), output, xmoe or None).
    `partial` [T, H] (or None): the caller's own partial, read in place of mailbox slot `rank`
    (that slot is never read), as oproj_jax.consumer's.
    `variant`: a name of plan.VARIANTS in place of plan.default_variant's, for the tests.
    `arrivals`: the sync kernel's barrier counters, kept by the caller (arrival_counters: int32,
    >= 2 T of them, zero; the call leaves them at zero); None: zeroed counters for this call
    (one more launch). Unused by the row and tile kernels and the cluster configurations. `pdl`:
    launch the sync kernel with programmatic dependent launch; None: where the GPU has it (sm_90 or
    newer). Raises
    TypeError / ValueError naming the argument (dtype, shape, device, layout, option) before
    launching."""
    import torch

    named = dict(mailbox=mailbox, prefix=prefix, blocks=blocks, norm=norm, query=query, out_norm=out_norm)
    check_tensors(torch, **named)
    rank = check_tensor_partial(torch, partial, rank, mailbox)
    options = Options.from_kwargs(options)
    R, T, H = mailbox.shape
    NB = blocks.shape[1]
    if arrivals is not None:
        _check_arrivals(torch, arrivals, T, mailbox.device)
    pdl = _use_pdl(torch, mailbox.device, pdl)
    clusters = _has_clusters(torch, mailbox.device)
    own = None if partial is None else rank
    plan = launch_plan.make(R, T, NB, H, **options.asdict(), variant=variant, pdl=pdl, clusters=clusters, own=own)
    _check_launchable(torch, named if partial is None else dict(named, partial=partial))
    output = torch.empty_like(prefix)
    xmoe = (
        torch.empty((options.xmoe_replicas, T, H), dtype=prefix.dtype, device=prefix.device)
        if options.xmoe_replicas
        else None
    )
    # Placeholders for pointers the kernel never touches: no blocks at NB = 0 (an empty tensor
    # may have no address), no xmoe at xmoe_replicas = 0.
    blocks_arg = blocks if NB else norm
    xmoe_arg = output if xmoe is None else xmoe
    with torch.cuda.device(prefix.device) if prefix.device.type == "cuda" else contextlib.nullcontext():
        arrays = (mailbox, prefix, blocks_arg, norm, query, out_norm, prefix, output, xmoe_arg)
        if plan.stats_shape is not None:  # sync: its scratch and arrival counters
            stats = torch.empty(plan.stats_shape, dtype=torch.float32, device=prefix.device)
            if plan.arrivals_shape is None:  # sync-*-cluster: a counter pointer it never reads
                arrivals = torch.empty(1, dtype=torch.int32, device=prefix.device)
            elif arrivals is None:
                arrivals = torch.zeros(plan.arrivals_shape, dtype=torch.int32, device=prefix.device)
            arrays += (stats, arrivals)
        arrays += () if partial is None else (partial,)  # the kernels' last pointer, after the results
        for launch in plan.stages() if interpreted() else (plan.launch,):  # interpreted: one per barrier stretch
            _run(launch, *arrays)
    return TorchResult(prefix, output, xmoe)


def _use_pdl(torch, device, pdl: bool | None) -> bool:
    """Whether to launch with PDL: `pdl`, or (None) whether the device has it."""
    major, minor = divmod(launch_plan.PDL_MIN_CAPABILITY, 10)
    capable = device.type == "cuda" and not interpreted() and torch.cuda.get_device_capability(device) >= (major, minor)
    needs = f"a CUDA GPU of compute capability {major}.{minor} or newer (not interpreted); the tensors are on {device}"
    return launch_plan.use_pdl(pdl, capable, needs)


def _has_clusters(torch, device) -> bool:
    """Whether the launch uses thread block clusters: a CUDA GPU of plan.CLUSTER_CAPABILITIES, or
    Triton's interpreter (which runs the sync kernel's stretches between barriers as launches of
    their own)."""
    if interpreted():
        return True
    if device.type != "cuda":
        return False
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor in launch_plan.CLUSTER_CAPABILITIES


def _run(launch: launch_plan.Launch, *tensors) -> None:
    launch_plan.repair_cache_dir()
    fn = getattr(kernel, launch.kernel)
    if not launch.cluster:
        fn[launch.grid](*tensors, **dict(launch.constexprs), **launch.options())
        return
    _run_clustered(fn, launch, tensors)


def _run_clustered(fn, launch: launch_plan.Launch, tensors) -> None:
    """`launch` in clusters of launch.cluster programs along the grid's first axis, through
    Triton's own launcher: Triton (3.6) sets a launch's cluster shape from the num_ctas of the
    compiled kernel's metadata, which would also make the compiler split each program over that
    many CTAs; so the kernel is compiled as one CTA per program (num_ctas=1) and launched with
    metadata that names the cluster (gridX clusters of launch.cluster CTAs each)."""
    import torch

    constexprs = dict(launch.constexprs)
    compiled = fn.warmup(*tensors, grid=launch.grid, **constexprs, **launch.options())
    num_warps, num_ctas, shared = compiled.packed_metadata
    if num_ctas != 1:
        raise RuntimeError(f"{launch.kernel}: compiled for {num_ctas} CTAs per program, expected 1")
    args = iter(tensors)
    values = [constexprs[name] if name in constexprs else next(args) for name in fn.arg_names]
    gx, gy, gz = (*launch.grid, 1, 1)[:3]
    if gx % launch.cluster:
        raise ValueError(f"{launch.kernel}: grid {launch.grid} is not whole clusters of {launch.cluster}")
    stream = torch.cuda.current_stream().cuda_stream
    launcher = compiled.run  # loads the module: compiled.function is set from here on
    launcher(
        gx // launch.cluster,
        gy,
        gz,
        stream,
        compiled.function,
        (num_warps, launch.cluster, launch.dynamic_smem(shared)),
        None,
        None,
        None,
        *values,
    )
