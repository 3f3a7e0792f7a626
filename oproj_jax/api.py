"""The public entry point: argument checks (in this one place), the backend registry, "auto".

Every backend module exposes the same three names:

  consumer(mailbox, prefix, blocks, norm, query, out_norm, **options) -> ConsumerResult
  unavailable_reason(platform: str) -> str | None    # None: it runs on that platform
  unsupported_reason(dims: Dims, **options) -> str | None  # None: it handles that shape

`options` are the five of oproj_jax.options, every one given, as plain Python scalars. A
backend whose consumer takes a caller's own partial (`partial=`, `rank=`) says so with
READS_PARTIAL = True, and partial_in_place(dims, **options) says whether it reads it in place
(else it writes it into a copy of the mailbox); for the others this module writes the partial
into a copy of the mailbox first (reference.with_partial). A backend whose kernel enters XLA's
CUDA graph as a kernel node says so with GRAPH_NODE = True; its consumer takes
`stream_capture=` (the caller's choice of a captured launch instead; consumer's docstring).
`consumer` here checks the arguments once, then calls the chosen backend with arrays that
are known to be well formed. Naming a backend that cannot run raises; nothing falls back.
"""

from __future__ import annotations

import functools
import importlib
import warnings

import jax

from oproj_jax import ffi
from oproj_jax.contract import ConsumerResult, Dims, check_arguments, check_partial
from oproj_jax.cute import manifest as cute_manifest
from oproj_jax.options import DEFAULTS, Options, check_bool, takes_options

# Name -> module. Order matters for "auto": the first kernel that runs and handles the shape.
_BACKENDS = {
    "cute": "oproj_jax.cute.backend",
    "pallas": "oproj_jax.pallas.consumer",
    "triton": "oproj_jax.triton.backend",
    "reference": "oproj_jax.reference",
}
_KERNELS = ("cute", "pallas", "triton")


def _module(name: str):
    if name not in _BACKENDS:
        raise ValueError(f"backend: expected one of {sorted(_BACKENDS) + ['auto']}, got {name!r}")
    return importlib.import_module(_BACKENDS[name])


# The pallas kernel is Hopper code (Mosaic GPU TMA, wgmma and clusters): on a GPU it runs only on
# devices of this CUDA compute capability. The cute kernel runs where its cubins are built for the
# device's compute capability (cute/manifest.py ARCHS: sm_90a for 9.0, sm_100a for 10.0). The
# Triton kernel is compiled for the device it runs on, from this compute capability on (bf16
# arithmetic).
KERNEL_CAPABILITY = "9.0"
TRITON_MIN_CAPABILITY = (8, 0)
# auto picks cute only on the compute capabilities its cubins have run on: the sm_100a cubins have
# not run on a 10.0 GPU yet, so there auto keeps choosing Triton and backend="cute" runs them (opt-in).
CUTE_AUTO_CAPABILITIES = ("9.0",)


def _is_gpu(platform: str) -> bool:
    return platform in ("gpu", "cuda", "rocm")


def _platform_devices(platform: str) -> list:
    try:
        return list(jax.devices(platform))
    except RuntimeError:
        return []


def _capability(value) -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in str(value).split("."))
    except ValueError:
        return None


def _cute_opt_in(capability) -> bool:
    """Whether cute runs on this compute capability only when named (CUTE_AUTO_CAPABILITIES)."""
    return cute_manifest.arch_for_capability(capability) is not None and str(capability) not in CUTE_AUTO_CAPABILITIES


def capability_reason(devices, kernel: str = "cute", auto: bool = False) -> str | None:
    """None if every device is a CUDA GPU that backend `kernel` runs on (pallas: compute
    capability KERNEL_CAPABILITY; cute: one its cubins are built for, cute/manifest.py ARCHS, and
    for `auto` one of CUTE_AUTO_CAPABILITIES; triton: TRITON_MIN_CAPABILITY or newer), else why not."""
    if not devices:
        return "no device to run on"
    for device in devices:
        capability = getattr(device, "compute_capability", None)
        if device.platform not in ("gpu", "cuda") or capability is None:
            return f"device {device} ({device.platform}) is not a CUDA GPU with a compute capability"
        if kernel == "triton":
            if (_capability(capability) or (0,)) < TRITON_MIN_CAPABILITY:
                least = ".".join(map(str, TRITON_MIN_CAPABILITY))
                return (
                    f"the Triton kernel computes in bf16, compute capability {least} or newer; device {device} "
                    f"has compute capability {capability}"
                )
        elif kernel == "cute":
            arch = cute_manifest.arch_for_capability(capability)
            if arch is None:
                return cute_manifest.unserved_reason(device, capability)
            if auto and _cute_opt_in(capability):
                return (
                    f"its {arch} cubins have not run on a GPU of compute capability {capability} yet, so auto does not "
                    f"pick them; backend='cute' runs them (opt-in); device {device} has compute capability {capability}"
                )
        elif str(capability) != KERNEL_CAPABILITY:
            return (
                f"the Pallas kernel is Hopper code (sm_90a, compute capability {KERNEL_CAPABILITY}); device {device} "
                f"has compute capability {capability}"
            )
    return None


def _unavailable(name: str, platform: str, devices=None, auto: bool = False) -> str | None:
    """None if backend `name` runs on `platform` (on a GPU: on `devices`, default every device of
    the platform), named or, with `auto`, picked by auto; else why not (a failed import included)."""
    try:
        module = _module(name)
    except ImportError as err:
        return f"cannot import {_BACKENDS[name]}: {err}"
    reason = module.unavailable_reason(platform)
    if reason is None and name in _KERNELS and _is_gpu(platform):
        reason = capability_reason(_platform_devices(platform) if devices is None else list(devices), name, auto)
    return reason


def _placement(*arrays) -> tuple[str, list | None]:
    """(platform, devices) the arrays live on; under tracing, the default backend's (devices None)."""
    for x in arrays:
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            devices = list(x.devices())
            return devices[0].platform, devices
    return jax.default_backend(), None


def _platform(*arrays) -> str:
    """The platform the arrays live on; under tracing, the default backend's."""
    return _placement(*arrays)[0]


def backend_names() -> list[str]:
    """The names `consumer(backend=...)` accepts besides "auto", in "auto" preference order."""
    return list(_BACKENDS)


def unsupported_reason(name: str, dims: Dims, **options) -> str | None:
    """None if backend `name` handles these dimensions and options, else why not."""
    return _module(name).unsupported_reason(dims, **options)


def available_backends(platform: str | None = None) -> dict[str, str | None]:
    """Backend name -> None if it runs on `platform` (default: JAX's default) when named, else why
    not (cute on compute capability 10.0 runs when named: auto does not pick it there)."""
    platform = platform or jax.default_backend()
    return {name: _unavailable(name, platform) for name in _BACKENDS}


def choose_backend(backend: str, platform: str, dims: Dims, *, devices=None, **options) -> tuple[str | None, dict]:
    """(the backend that runs the call, or None if the named `backend` cannot; name -> why it does
    not run this call, None for the one that does). The rule of "auto": on CUDA GPUs (every one
    of `devices`; default every device of `platform`) the first of "cute", "pallas" (compute
    capability 9.0 only) and "triton" (8.0 or newer) that can run there and handles the shape;
    else the reference. cute's sm_100a cubins (10.0) run only when named (CUTE_AUTO_CAPABILITIES).
    Off the GPU "auto" never takes a kernel (Pallas would run in interpret mode: named only)."""
    if backend != "auto":
        module = _module(backend)  # an unknown name raises here
        reason = _unavailable(backend, platform, devices) or module.unsupported_reason(dims, **options)
        return (None if reason else backend), {backend: reason}
    chosen, reasons = None, {}
    for name in _BACKENDS:
        if chosen is not None:
            reasons[name] = f"{chosen!r} comes first in auto's order ({', '.join(_BACKENDS)}) and runs this call"
            continue
        reason = _unavailable(name, platform, devices, auto=True)
        if reason is None and name in _KERNELS and not _is_gpu(platform):
            reason = f"auto runs the kernels on CUDA GPUs only, the platform is {platform!r}" + (
                "; name backend='pallas' for its interpret mode (slow; for tests)" if platform == "cpu" else ""
            )
        reason = reason or _module(name).unsupported_reason(dims, **options)
        reasons[name] = reason
        if reason is None:
            chosen = name
    return chosen, reasons


_warned: set = set()


def resolve_backend(backend: str, platform: str, dims: Dims, *, devices=None, **options) -> str:
    """The backend that will run: `backend` itself if it can, else a ValueError saying why.
    "auto" on a GPU that runs the reference warns (once per reason) with the kernels' reasons."""
    name, reasons = choose_backend(backend, platform, dims, devices=devices, **options)
    if name is None:
        raise ValueError(f"backend={backend!r} cannot run here: {reasons[backend]}")
    if backend == "auto" and name == "reference" and _is_gpu(platform):
        why = "; ".join(f"{k}: {reasons[k]}" for k in _KERNELS)
        if why not in _warned:
            _warned.add(why)
            warnings.warn(
                f"oproj_jax: backend='auto' runs the jnp reference on this GPU, not a kernel ({why}); "
                f"oproj_jax.explain(...) shows the choice for given arrays",
                RuntimeWarning,
                stacklevel=3,
            )
    return name


def _checked_call(arrays: tuple, backend, options: dict) -> tuple[Dims, dict, str, list | None]:
    """What consumer and explain check and find before choosing: the dimensions, the options as
    plain Python scalars (static for every backend), and the platform and devices of the arrays."""
    dims = check_arguments(*arrays, **options)
    options = Options.from_kwargs(options).asdict()
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a str, got {type(backend).__name__}")
    return (dims, options, *_placement(*arrays[:3]))


def _graph_entry(T: int, stream_capture: bool) -> str:
    """How a GRAPH_NODE backend's call of T tokens enters XLA's CUDA graph (explain's line)."""
    if stream_capture:
        return "traced into XLA's CUDA graph by stream capture (stream_capture=True)"
    if T > ffi.RECORD_MAX_T:
        return f"traced into XLA's CUDA graph by stream capture (more than {ffi.RECORD_MAX_T} tokens)"
    return "a kernel node of XLA's CUDA graph with programmatic launch edges (stream_capture=True traces it instead)"


def _graph_node(name: str) -> bool:
    return bool(getattr(_module(name), "GRAPH_NODE", False))


def _reads_partial(name: str) -> bool:
    return bool(getattr(_module(name), "READS_PARTIAL", False))


def _partial_in_place(name: str, dims: Dims, options: dict) -> bool:
    return _reads_partial(name) and bool(_module(name).partial_in_place(dims, **options))


@takes_options()
def explain(
    mailbox,
    prefix,
    blocks,
    norm,
    query,
    out_norm,
    *,
    partial=None,
    rank: int = 0,
    backend: str = "auto",
    stream_capture: bool = False,
    **options,
) -> str:
    """Which backend `consumer(...)` with these arguments runs, and why each other one does not,
    and how its call enters XLA's graph: a few lines of text, nothing traced or run. Takes what
    consumer takes (arrays, or jax.ShapeDtypeStruct for the default device); raises what
    consumer raises for bad arguments, but reports (does not raise) a named backend that cannot
    run."""
    dims, options, platform, devices = _checked_call((mailbox, prefix, blocks, norm, query, out_norm), backend, options)
    rank = check_partial(partial, rank, dims)
    stream_capture = check_bool("stream_capture", stream_capture)
    shown = devices if devices is not None else _platform_devices(platform)
    name, reasons = choose_backend(backend, platform, dims, devices=devices, **options)
    capabilities = sorted({str(getattr(d, "compute_capability", "-")) for d in shown})
    where = f"platform {platform!r}, {len(shown)} device(s)" + (
        f", compute capability {', '.join(capabilities)}" if _is_gpu(platform) else ""
    )
    shape = f"R={dims.R} T={dims.T} NB={dims.NB} H={dims.H}"
    if name is None:
        lines = [f"backend={backend!r} cannot run this call ({shape}; {where}): {reasons[backend]}"]
    else:
        lines = [f"backend={backend!r} runs {name!r} for this call ({shape}; {where})"]
        if name == "pallas" and platform == "cpu":
            lines.append("  pallas runs in Mosaic GPU interpret mode here (slow; for tests)")
        note = getattr(_module(name), "explain_note", lambda *a, **k: None)(dims, **options)
        if note:
            lines.append(f"  {name}: {note}")
        if partial is not None:
            in_place = _partial_in_place(name, dims, options)
            how = "read in place" if in_place else "written into a copy of the mailbox first"
            lines.append(f"  partial: stands for mailbox slot {rank}, {how}")
        if _graph_node(name):
            lines.append(f"  launch under jax.jit: {_graph_entry(dims.T, stream_capture)}")
        opt_in = sorted({str(c) for c in capabilities if _cute_opt_in(c)}) if _is_gpu(platform) else []
        if name == "cute" and opt_in:
            lines.append(
                f"  cute: opt-in on compute capability {', '.join(opt_in)}: its cubins there have not run on such a "
                f"GPU yet (auto picks triton)"
            )
        if name == "triton" and backend == "auto":
            lines.append(
                "  triton: the portable kernel, taken because the Hopper kernels (cute, pallas) cannot run this call"
                if not opt_in
                else "  triton: the portable kernel, taken because cute runs here only when named (opt-in) and "
                "pallas cannot run this call"
            )
        lines += [f"  {other}: not picked: {why}" for other, why in reasons.items() if other != name]
    return "\n".join(lines)


def consumer(
    mailbox,  # [R, T, H] bf16: slot r holds rank r's partial o-projection
    prefix,  # [T, H] bf16: the running partial-block residual
    blocks,  # [T, NB, H] bf16: completed block representations, 0 <= NB <= 8
    norm,  # [H] bf16: AttnRes key RMSNorm weight
    query,  # [H] bf16: AttnRes pseudo-query
    out_norm,  # [H] bf16: RMSNorm weight of the next sub-layer's input
    *,
    eps: float = DEFAULTS.eps,
    out_eps: float = DEFAULTS.out_eps,
    has_delta: bool = DEFAULTS.has_delta,
    groups: int = DEFAULTS.groups,
    xmoe_replicas: int = DEFAULTS.xmoe_replicas,
    partial=None,  # [T, H] bf16 or None: this rank's own partial, read in place of mailbox[rank]
    rank: int = 0,  # the mailbox slot `partial` stands for
    backend: str = "auto",
    stream_capture: bool = False,
) -> ConsumerResult:
    """The O-projection all-reduce consumer: rank sum, prefix update, AttnRes, RMSNorm.

    One rank's step after a tensor-parallel attention: sums the R partial o-projections in
    `mailbox` in a fixed f32 order, adds the result into the block residual `prefix` (bf16),
    mixes the completed `blocks` and the new prefix with Block Attention Residuals (a softmax
    over depth) and applies the next sub-layer's RMSNorm. The function, its rounding points and
    the numerics every backend meets are defined in docs/spec.md.

    Arrays (all bfloat16; T tokens, H hidden, R ranks, NB completed blocks):
      mailbox   [R, T, H]   slot r holds rank r's partial o-projection (R >= 1, T >= 1).
      prefix    [T, H]      the running residual of the current block (read only if has_delta).
      blocks    [T, NB, H]  the completed block representations, 0 <= NB <= 8 (NB = 0: none).
      norm      [H]         AttnRes key RMSNorm weight.
      query     [H]         AttnRes pseudo-query.
      out_norm  [H]         RMSNorm weight of the next sub-layer's input.
      partial   [T, H]      optional (keyword): the calling rank's own partial o-projection,
                            read in place of mailbox slot `rank` (a Python int, default 0;
                            that slot's contents are ignored). The result is that of the
                            mailbox with slot `rank` replaced; a caller whose partial lies in
                            its own buffer (the o-proj GEMM's output) passes it here instead of
                            writing it into the mailbox. cute reads it in place (its own
                            variants: prebuilt for R = 16, compiled on first use for another
                            R where the CuTe DSL is installed), triton too; otherwise the
                            partial is written into a copy of the mailbox first. explain()
                            says which.

    Options (keyword-only, static: each value compiles its own program):
      eps            float >= 0, default 1e-6: epsilon of the key RMSNorm inside AttnRes.
      out_eps        float >= 0, default 1e-6: epsilon of the output RMSNorm.
      has_delta      bool, default True: new prefix = old prefix + rank sum; False: the rank sum
                     replaces the prefix (the first layer of a new block).
      groups         int 1..4, default 4: the summation order of the R slots (S = ceil(R/groups)
                     slots per group, each group left to right, then the group sums in group
                     order). It fixes the prefix bits; every backend follows it.
      xmoe_replicas  int >= 0, default 0: copies of the output to return in `xmoe` (-0.0
                     written as +0.0, for MoE consumers that poll them); 0 returns None.
      backend        "auto" (default), "reference", "pallas", "cute" or "triton":
                       "reference"  the jnp definition; runs wherever JAX runs.
                       "pallas"     the Pallas Mosaic GPU kernel on a Hopper GPU; on a CPU it
                                    runs in interpret mode (slow; for tests). Needs H % 256 == 0.
                       "cute"       the CuTe kernel through XLA FFI on an sm_90a GPU (H100,
                                    H200), or on an sm_100a GPU (compute capability 10.0: B200)
                                    when named (opt-in: not yet run there), with the built FFI
                                    library and cubins (python -m oproj_jax.build);
                                    H = 7168 only, and only the built variants.
                       "triton"     the Triton kernels through the package's FFI library (the
                                    triton extra and the JAX CUDA plugin) on a CUDA GPU of
                                    compute capability 8.0 or newer; any H.
                       "auto"       on CUDA GPUs the first of "cute", "pallas" (compute
                                    capability 9.0: H100, H200) and "triton" (8.0 or newer)
                                    that can run and handles the shape; everywhere else (a CPU,
                                    an older GPU, a shape no kernel handles) the reference, with
                                    a RuntimeWarning (once per reason) when that happens on a
                                    GPU. It never picks interpret mode. explain(...) says what
                                    it picks and why.
                     Naming a backend that cannot run raises ValueError with the reason
                     (nothing falls back silently); see available_backends(). pallas also
                     refuses GPUs other than compute capability 9.0, cute those other than 9.0
                     and 10.0, triton those below 8.0.
      stream_capture bool, default False: how a cute or triton call of up to 64 tokens enters
                     XLA's CUDA graph under jax.jit. False: as a kernel node with programmatic
                     dependent launch edges to its neighbours, so consecutive consumer calls
                     overlap (the fastest chain of calls). True: recorded by stream capture,
                     with no such edges, as every call of more than 64 tokens is; the choice
                     for a consumer that sits between XLA's own kernels, as in a decode step
                     (o-proj GEMM, consumer, MoE): there the kernel node's edges slow down the
                     kernel after it, and a captured call takes the consumer's share per layer
                     from 5.5 to 5.1 µs (mailbox written) and 4.7 to 4.3 µs (partial=) at one
                     token on an H100 (docs/perf.md, "The consumer's node"). The same bits either way;
                     pallas (always captured) and the reference ignore it.

    Returns a ConsumerResult (a NamedTuple):
      prefix  [T, H] bf16: the updated residual. GPU kernels alias it to the `prefix` argument:
              donate `prefix` in a jitted caller to update it in place.
      output  [T, H] bf16: the normalized input of the next sub-layer.
      xmoe    [xmoe_replicas, T, H] bf16, or None when xmoe_replicas == 0.

    Raises TypeError (wrong dtype or type) or ValueError (shape, range, backend) naming the
    argument, before anything is traced or launched. Works eagerly and under jax.jit. T = 0
    (no tokens) is rejected with a ValueError naming T: skip the call for an empty batch.

    The options are static: under jax.jit pass them as Python values (static_argnames, or
    functools.partial); a traced option raises a TypeError that says so.

    Autodiff: jax.grad / jax.vjp work on every backend and give the same gradients: the chosen
    backend computes the forward, the backward is always the reference's VJP (a custom_vjp;
    the op is smooth jnp math). Forward-mode (jax.jvp, jacfwd) works on the reference only; on a
    kernel it raises a TypeError naming backend="reference" as the way to take it.
    """
    arrays = (mailbox, prefix, blocks, norm, query, out_norm)
    options = dict(eps=eps, out_eps=out_eps, has_delta=has_delta, groups=groups, xmoe_replicas=xmoe_replicas)
    dims, options, platform, devices = _checked_call(arrays, backend, options)
    rank = check_partial(partial, rank, dims)
    stream_capture = check_bool("stream_capture", stream_capture)
    name = resolve_backend(backend, platform, dims, devices=devices, **options)
    own = None if partial is None else rank
    captured = stream_capture and _graph_node(name)
    try:
        return _differentiable(name, tuple(options.items()), own, captured)(
            *arrays, *(() if partial is None else (partial,))
        )
    except TypeError as err:
        if name == "reference" or "forward-mode autodiff" not in str(err):
            raise
        picked = f" (backend={backend!r} picked it here)" if backend != name else ""
        raise TypeError(
            f"backend={name!r}{picked}: forward-mode autodiff (jax.jvp, jax.jacfwd, jax.hessian) is not defined on "
            f"the kernels. oproj_jax.consumer differentiates them in reverse mode: a jax.custom_vjp whose backward is "
            f"the reference's VJP, so jax.grad, jax.vjp and jax.jacrev work and give the same gradients on every "
            f"backend. For forward mode call it with backend='reference': the same function (docs/spec.md) in plain "
            f"jnp, differentiable in every mode"
        ) from err


def _with_partial(arrays: tuple, own: int | None) -> tuple:
    """The six operands of a call whose seventh array (if own is not None) is the partial of slot own."""
    if own is None:
        return arrays
    reference = _module("reference")
    return (reference.with_partial(arrays[0], arrays[6], own), *arrays[1:6])


@functools.lru_cache(maxsize=None)
def _differentiable(name: str, options: tuple, own: int | None = None, stream_capture: bool = False):
    """Backend `name`'s consumer with these (static) options, differentiable: a jax.custom_vjp
    whose forward is the backend's kernel and whose backward is the VJP of the reference (the
    op is smooth jnp math; the kernels compute the same function, so jax.grad gives the same
    gradients on every backend). The reference itself is returned as plain jnp (every
    transformation works on it, forward-mode jvp included; the kernels' wrapper has no jvp).
    `own`: the slot of an own partial, the seventh array (None: six arrays). `stream_capture`:
    passed to a GRAPH_NODE backend (only where True: the others take no such argument)."""
    options = dict(options)
    launch = dict(stream_capture=True) if stream_capture else {}

    def reference(*arrays):
        return _module("reference").consumer(*_with_partial(arrays, own), **options)

    if name == "reference":
        return reference

    def forward(*arrays):  # looked up per call: the cache holds no stale backend function
        if own is not None and _reads_partial(name):
            return _module(name).consumer(*arrays[:6], partial=arrays[6], rank=own, **options, **launch)
        return _module(name).consumer(*_with_partial(arrays, own), **options, **launch)

    @jax.custom_vjp
    def consume(*arrays):
        return forward(*arrays)

    def consume_fwd(*arrays):
        return forward(*arrays), arrays  # residuals: the inputs (the backward re-runs the reference)

    def consume_bwd(arrays, cotangents):
        return jax.vjp(reference, *arrays)[1](cotangents)

    consume.defvjp(consume_fwd, consume_bwd)
    return consume
