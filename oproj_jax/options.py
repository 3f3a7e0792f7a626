"""The consumer's options, their defaults and their checks: the one place for all three.

    Options(eps=1e-6, out_eps=1e-6, has_delta=True, groups=4, xmoe_replicas=0)

An `Options` is checked when it is made (TypeError or ValueError naming the option) and holds
plain Python scalars (a float eps, a bool has_delta, int groups): static for every backend and
hashable, so it can key a cache of compiled layouts. `DEFAULTS` is the default instance; every
signature that spells the options out takes its defaults from it (docs/spec.md, "Options"):
oproj_jax.consumer writes them out, the other public entry points take `**options` and show
them in their signature through `takes_options`.

No JAX and no torch here: oproj_jax.torch_ref uses it too.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

MAX_GROUPS = 4  # the summation order has at most four groups (docs/spec.md, "Summation order")


def _is_traced(value: Any) -> bool:
    """Whether `value` is a JAX tracer (an argument of a function under jax.jit, grad, vmap...),
    told by its class (jax.core.Tracer) without importing JAX here."""
    return any(c.__name__ == "Tracer" and c.__module__.startswith("jax") for c in type(value).__mro__)


def _refuse_traced(name: str, value: Any, kind: str) -> None:
    """A TypeError for a traced option: the options pick the compiled program, so they must be
    Python values when the call is traced; the message says how to keep one static."""
    if _is_traced(value):
        raise TypeError(
            f"{name}: expected a Python {kind}, got a traced value ({type(value).__name__}): the option is static "
            f"(each value compiles its own program), so it cannot be an argument that jax.jit traces. Mark it "
            f"static: jax.jit(f, static_argnames=({name!r},)), or bind it before jitting: "
            f"jax.jit(functools.partial(f, {name}=...))"
        )


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    _refuse_traced(name, value, "int")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < lo or (hi is not None and value > hi):
        span = f"{lo} <= {name} <= {hi}" if hi is not None else f"{name} >= {lo}"
        raise ValueError(f"{name}: expected {span}, got {value}")
    return int(value)


def _check_eps(name: str, value: Any) -> float:
    _refuse_traced(name, value, "float")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a Python float (a static epsilon), got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}: expected a finite epsilon >= 0, got {value}")
    return float(value)


def check_bool(name: str, value: Any) -> bool:
    """`value` as a bool, or a TypeError naming `name` (a traced value: how to keep it static)."""
    _refuse_traced(name, value, "bool")
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return bool(value)


@dataclasses.dataclass(frozen=True)
class Options:
    """The consumer's static options (see oproj_jax.consumer's docstring for their meaning)."""

    eps: float = 1e-6  # epsilon of the key RMSNorm inside AttnRes, finite >= 0
    out_eps: float = 1e-6  # epsilon of the output RMSNorm, finite >= 0
    has_delta: bool = True  # new prefix = old prefix + rank sum; False: the rank sum replaces it
    groups: int = 4  # 1..MAX_GROUPS: the summation order of the mailbox slots
    xmoe_replicas: int = 0  # >= 0: copies of the output returned in `xmoe`

    def __post_init__(self):
        # Checked in this order (the order of oproj_jax.consumer's keywords); a bool is refused
        # before it could be taken for an int, and the stored values are plain Python scalars.
        checked = dict(
            eps=_check_eps("eps", self.eps),
            out_eps=_check_eps("out_eps", self.out_eps),
            has_delta=check_bool("has_delta", self.has_delta),
            groups=_check_int("groups", self.groups, 1, MAX_GROUPS),
            xmoe_replicas=_check_int("xmoe_replicas", self.xmoe_replicas, 0),
        )
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_kwargs(cls, options: Mapping[str, Any], defaults: Options | None = None) -> Options:
        """Options from keyword arguments, the missing ones taken from `defaults` (None: the
        dataclass defaults); an unknown name raises TypeError."""
        unknown = sorted(set(options) - set(NAMES))
        if unknown:
            raise TypeError(f"unexpected option(s) {unknown}; expected some of {sorted(NAMES)}")
        return dataclasses.replace(defaults, **options) if defaults is not None else cls(**options)

    def asdict(self) -> dict[str, Any]:
        """The options as keyword arguments (of oproj_jax.consumer or any backend's consumer)."""
        return {name: getattr(self, name) for name in NAMES}


NAMES = tuple(field.name for field in dataclasses.fields(Options))
DEFAULTS = Options()


def takes_options(defaults: Options = DEFAULTS, *, passes_on: Callable | None = None):
    """Decorator for a public function that takes the options as `**options`, so that help() and
    inspect.signature show them as keyword-only parameters with `defaults`' values, placed after
    the function's required keyword-only parameters. With `passes_on`, the function hands its
    keywords on to that function: its keyword-only parameters are shown too. The call itself is
    unchanged: what receives the options applies `defaults` (Options.from_kwargs) and so rejects
    an unknown name.
    """

    def decorate(function):
        signature = inspect.signature(function)
        own = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
        if passes_on is not None:
            own += [p for p in inspect.signature(passes_on).parameters.values() if p.kind is p.KEYWORD_ONLY]
        spelled = [
            inspect.Parameter(
                f.name, inspect.Parameter.KEYWORD_ONLY, default=getattr(defaults, f.name), annotation=f.type
            )
            for f in dataclasses.fields(Options)
        ]
        at = next((i for i, p in enumerate(own) if p.kind is p.KEYWORD_ONLY and p.default is not p.empty), len(own))
        function.__signature__ = signature.replace(parameters=[*own[:at], *spelled, *own[at:]])
        return function

    return decorate
