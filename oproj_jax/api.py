"""The public entry point: argument checks (in this one place), the backend registry, "auto".

Every backend module exposes the same three names:

  consumer(mailbox, prefix, blocks, norm, query, out_norm, *,
           eps, out_eps, has_delta, groups, xmoe_replicas) -> ConsumerResult
  unavailable_reason(platform: str) -> str | None    # None: it runs on that platform
  unsupported_reason(dims: Dims, **options) -> str | None  # None: it handles that shape

`consumer` here checks the arguments once, then calls the chosen backend with arrays that
are known to be well formed. Naming a backend that cannot run raises; nothing falls back.
"""

from __future__ import annotations

import importlib
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MAX_BLOCKS = 8
MAX_GROUPS = 4

# Name -> module. Order matters for "auto": the first kernel that runs and handles the shape.
_BACKENDS = {
    "cute": "oproj_jax.cute.backend",
    "pallas": "oproj_jax.pallas.consumer",
    "reference": "oproj_jax.reference",
}
_KERNELS = ("cute", "pallas")


class ConsumerResult(NamedTuple):
    prefix: jax.Array  # [T, H] bf16: the updated partial-block residual (written back)
    output: jax.Array  # [T, H] bf16: the normalized input of the next sub-layer
    xmoe: jax.Array | None  # [reps, T, H] bf16, -0.0 written as +0.0; None when reps == 0


class Dims(NamedTuple):
    R: int  # ranks (mailbox slots)
    T: int  # tokens
    NB: int  # completed blocks
    H: int  # hidden size


def check_array(name: str, x: Any, ndim: int, layout: str) -> tuple[int, ...]:
    if type(x).__module__.split(".")[0] == "torch":
        raise TypeError(f"{name}: expected a JAX (or numpy) bf16 array of shape {layout}, got a torch.Tensor; convert "
                        f"it with jax.dlpack.from_dlpack(tensor) (zero-copy on the same device), or use "
                        f"oproj_jax.torch_ref for PyTorch")
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected a bf16 array of shape {layout}, got {type(x).__name__}")
    try:
        dtype = jnp.dtype(x.dtype)
    except TypeError:
        dtype = None
    if dtype != jnp.bfloat16:
        raise TypeError(f"{name}: expected dtype bfloat16 (shape {layout}), got {x.dtype}")
    if len(x.shape) != ndim:
        raise ValueError(f"{name}: expected rank {ndim} ({layout}), got shape {tuple(x.shape)}")
    return tuple(int(d) for d in x.shape)


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < lo or (hi is not None and value > hi):
        span = f"{lo} <= {name} <= {hi}" if hi is not None else f"{name} >= {lo}"
        raise ValueError(f"{name}: expected {span}, got {value}")
    return int(value)


def _check_eps(name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a Python float (a static epsilon), got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}: expected a finite epsilon >= 0, got {value}")
    return float(value)


def check_arguments(
    mailbox, prefix, blocks, norm, query, out_norm, *, eps, out_eps, has_delta, groups, xmoe_replicas
) -> Dims:
    """Checks dtypes, ranks, shapes and options; returns the dimensions. Raises TypeError/ValueError."""
    R, T, H = check_array("mailbox", mailbox, 3, "[R, T, H]")
    if R < 1 or T < 1 or H < 1:
        raise ValueError(f"mailbox: expected R, T, H >= 1, got shape {(R, T, H)}")
    prefix_shape = check_array("prefix", prefix, 2, "[T, H]")
    if prefix_shape != (T, H):
        raise ValueError(f"prefix: expected shape [T, H] = {(T, H)} (from mailbox), got {prefix_shape}")
    bT, NB, bH = check_array("blocks", blocks, 3, "[T, NB, H]")
    if (bT, bH) != (T, H):
        raise ValueError(f"blocks: expected shape [T, NB, H] with T={T}, H={H}, got {(bT, NB, bH)}")
    if NB > MAX_BLOCKS:
        raise ValueError(f"blocks: expected at most {MAX_BLOCKS} completed blocks (NB), got NB={NB}")
    for name, w in (("norm", norm), ("query", query), ("out_norm", out_norm)):
        (wH,) = check_array(name, w, 1, "[H]")
        if wH != H:
            raise ValueError(f"{name}: expected shape [H] = ({H},) (from mailbox), got ({wH},)")
    _check_eps("eps", eps)
    _check_eps("out_eps", out_eps)
    if not isinstance(has_delta, (bool, np.bool_)):
        raise TypeError(f"has_delta: expected a bool, got {type(has_delta).__name__}")
    _check_int("groups", groups, 1, MAX_GROUPS)
    _check_int("xmoe_replicas", xmoe_replicas, 0)
    return Dims(R, T, NB, H)


def _module(name: str):
    if name not in _BACKENDS:
        raise ValueError(f"backend: expected one of {sorted(_BACKENDS) + ['auto']}, got {name!r}")
    return importlib.import_module(_BACKENDS[name])


def _unavailable(name: str, platform: str) -> str | None:
    """None if backend `name` runs on `platform`, else why not (a failed import included)."""
    try:
        module = _module(name)
    except ImportError as err:
        return f"cannot import {_BACKENDS[name]}: {err}"
    return module.unavailable_reason(platform)


def _platform(*arrays) -> str:
    """The platform the arrays live on; under tracing, the default backend's."""
    for x in arrays:
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            return next(iter(x.devices())).platform
    return jax.default_backend()


def backend_names() -> list[str]:
    """The names `consumer(backend=...)` accepts besides "auto", in "auto" preference order."""
    return list(_BACKENDS)


def unsupported_reason(name: str, dims: Dims, **options) -> str | None:
    """None if backend `name` handles these dimensions and options, else why not."""
    return _module(name).unsupported_reason(dims, **options)


def available_backends(platform: str | None = None) -> dict[str, str | None]:
    """Backend name -> None if it runs on `platform` (default: JAX's default), else why not."""
    platform = platform or jax.default_backend()
    return {name: _unavailable(name, platform) for name in _BACKENDS}


def resolve_backend(backend: str, platform: str, dims: Dims, **options) -> str:
    """The backend that will run: `backend` itself if it can, else a ValueError saying why."""
    if backend == "auto":
        if platform in ("gpu", "cuda"):
            for name in _KERNELS:
                if _unavailable(name, platform) is None and _module(name).unsupported_reason(dims, **options) is None:
                    return name
        return "reference"  # CPU, or no kernel handles this shape
    _module(backend)  # an unknown name raises here
    reason = _unavailable(backend, platform)
    if reason is None:
        reason = _module(backend).unsupported_reason(dims, **options)
    if reason is not None:
        raise ValueError(f"backend={backend!r} cannot run here: {reason}")
    return backend


def consumer(
    mailbox,  # [R, T, H] bf16: slot r holds rank r's partial o-projection
    prefix,  # [T, H] bf16: the running partial-block residual
    blocks,  # [T, NB, H] bf16: completed block representations, 0 <= NB <= 8
    norm,  # [H] bf16: AttnRes key RMSNorm weight
    query,  # [H] bf16: AttnRes pseudo-query
    out_norm,  # [H] bf16: RMSNorm weight of the next sub-layer's input
    *,
    eps: float = 1e-6,
    out_eps: float = 1e-6,
    has_delta: bool = True,
    groups: int = 4,
    xmoe_replicas: int = 0,
    backend: str = "auto",
) -> ConsumerResult:
    """The O-projection all-reduce consumer: rank sum, prefix update, AttnRes, RMSNorm.

    One rank's step after a tensor-parallel attention: sums the R partial o-projections in
    `mailbox` in a fixed f32 order, adds the result into the block residual `prefix` (bf16),
    mixes the completed `blocks` and the new prefix with Block Attention Residuals (a softmax
    over depth) and applies the next sub-layer's RMSNorm. The function, its rounding points and
    the numerics every backend meets are defined in docs/spec.md.

    Arrays (all bfloat16; T tokens, H hidden, R ranks, NB completed blocks):
      mailbox   [R, T, H]   slot r holds rank r's partial o-projection (R >= 1).
      prefix    [T, H]      the running residual of the current block (read only if has_delta).
      blocks    [T, NB, H]  the completed block representations, 0 <= NB <= 8 (NB = 0: none).
      norm      [H]         AttnRes key RMSNorm weight.
      query     [H]         AttnRes pseudo-query.
      out_norm  [H]         RMSNorm weight of the next sub-layer's input.

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
      backend        "auto" (default), "reference", "pallas" or "cute":
                       "reference"  the jnp definition; runs wherever JAX runs.
                       "pallas"     the Pallas Mosaic GPU kernel on a Hopper GPU; on a CPU it
                                    runs in interpret mode (slow; for tests). Needs H % 256 == 0.
                       "cute"       the CuTe kernel through XLA FFI on an sm_90a GPU, with the
                                    built FFI library and cubins (python -m oproj_jax.build);
                                    H = 7168 only, and only the built variants.
                       "auto"       on a GPU the first of "cute", "pallas" that can run and
                                    handles the shape; on a CPU (or when no kernel can) the
                                    reference. It never picks interpret mode.
                     Naming a backend that cannot run raises ValueError with the reason
                     (nothing falls back silently); see available_backends().

    Returns a ConsumerResult (a NamedTuple):
      prefix  [T, H] bf16: the updated residual. GPU kernels alias it to the `prefix` argument:
              donate `prefix` in a jitted caller to update it in place.
      output  [T, H] bf16: the normalized input of the next sub-layer.
      xmoe    [xmoe_replicas, T, H] bf16, or None when xmoe_replicas == 0.

    Raises TypeError (wrong dtype or type) or ValueError (shape, range, backend) naming the
    argument, before anything is traced or launched. Works eagerly and under jax.jit.
    """
    options = dict(eps=eps, out_eps=out_eps, has_delta=has_delta, groups=groups, xmoe_replicas=xmoe_replicas)
    dims = check_arguments(mailbox, prefix, blocks, norm, query, out_norm, **options)
    options = dict(eps=float(eps), out_eps=float(out_eps), has_delta=bool(has_delta), groups=int(groups),
                   xmoe_replicas=int(xmoe_replicas))  # plain Python scalars: static for every backend
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a str, got {type(backend).__name__}")
    name = resolve_backend(backend, _platform(mailbox, prefix, blocks), dims, **options)
    return _module(name).consumer(mailbox, prefix, blocks, norm, query, out_norm, **options)
