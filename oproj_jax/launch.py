"""The kernel launches of the FFI library, described in Python: what ffi/launch.h reads.

The C++ side knows no kernel. Every call names, in its attributes, the cubin and its entry, the
launch shape (grid, block, cluster, dynamic shared memory, PDL) and the kernel's parameters in
order, each one of:

    buffer(i, offset)   the call's buffer i (its operands, then its results) plus `offset` bytes
    NULL                a null pointer
    a typed scalar      u32 / i32 / f32 / u64, passed as its raw bits
    the peer kinds      what only the peer transport (ffi/cute_peer.cc) has: this rank's
                        mailbox, its slot in rank r's mailbox, its control words, and a u32
                        that is 0 on one rank

The CuTe kernels' lists are built by name from oproj_jax/abi.py (`params(abi.CONSUMER_ONESHOT,
values)`: the order, the PTX types and which parameters are pointers are read there, never
written again here); the Triton kernels' from Triton's signature (oproj_jax/triton/library.py).
A kernel's new scalar is then a new entry of its abi list and of the values passed, nothing in
C++.

Encoding (the `params` attribute, ffi/launch.h): three int64 words per parameter,
(kind, value, extra).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np


class Kind(enum.IntEnum):
    """A parameter's kind: ffi/launch.h's enum Kind, value for value."""

    NULL = 0
    BUFFER = 1  # value: the buffer's index (operands, then results); extra: a byte offset
    U32 = 2  # value: the raw bits
    I32 = 3
    F32 = 4
    U64 = 5
    PEER_MAILBOX = 16  # extra: a byte offset
    PEER_SLOT = 17  # value: the rank whose mailbox holds this rank's slot
    PEER_CONTROL = 18  # extra: a byte offset
    PEER_U32_UNLESS_RANK = 19  # value: the raw bits; extra: the rank where it is 0 (-1: none)


POINTERS = frozenset({Kind.NULL, Kind.BUFFER, Kind.PEER_MAILBOX, Kind.PEER_SLOT, Kind.PEER_CONTROL})
# the kinds a PTX scalar parameter of each type takes (.u32 holds the kernels' i32 values too)
SCALARS = {
    ".u32": frozenset({Kind.U32, Kind.I32, Kind.PEER_U32_UNLESS_RANK}),
    ".s32": frozenset({Kind.U32, Kind.I32, Kind.PEER_U32_UNLESS_RANK}),
    ".f32": frozenset({Kind.F32}),
    ".u64": frozenset({Kind.U64}),
    ".s64": frozenset({Kind.U64}),
}
NO_CLUSTER = (0, 0, 0)  # the `cluster` of a launch without thread block clusters


class Arg(NamedTuple):
    """One kernel parameter as the launch target reads it."""

    kind: Kind
    value: int = 0
    extra: int = 0


NULL = Arg(Kind.NULL)


def buffer(index: int, offset: int = 0) -> Arg:
    """The call's buffer `index` (its operands, then its results) plus `offset` bytes."""
    if index < 0 or offset < 0:
        raise ValueError(f"buffer: expected index, offset >= 0, got {index}, {offset}")
    return Arg(Kind.BUFFER, int(index), int(offset))


def _int_bits(value: Any, bits: int, what: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what}: expected an int, got {type(value).__name__}")
    value = int(value)
    if not -(1 << (bits - 1)) <= value < (1 << bits):
        raise ValueError(f"{what}: {value} does not fit {bits} bits")
    return value & ((1 << bits) - 1)


def u32(value: int) -> Arg:
    """A 32-bit integer scalar (negative values as two's complement)."""
    return Arg(Kind.U32, _int_bits(value, 32, "u32"))


def i32(value: int) -> Arg:
    return Arg(Kind.I32, _int_bits(value, 32, "i32"))


def f32(value: float) -> Arg:
    """A float32 scalar: the bits of np.float32(value)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"f32: expected a number, got {type(value).__name__}")
    return Arg(Kind.F32, int(np.float32(value).view(np.uint32)))


def u64(value: int) -> Arg:
    bits = _int_bits(value, 64, "u64")
    return Arg(Kind.U64, bits - (1 << 64) if bits >= 1 << 63 else bits)  # an int64 word


def peer_mailbox(offset: int = 0) -> Arg:
    """This rank's mailbox in its group (the peer target only)."""
    return Arg(Kind.PEER_MAILBOX, 0, int(offset))


def peer_slot(rank: int) -> Arg:
    """This rank's slot in rank `rank`'s mailbox; null when the group has no such rank."""
    return Arg(Kind.PEER_SLOT, int(rank))


def peer_control(offset: int = 0) -> Arg:
    """This rank's control words (the peer target only)."""
    return Arg(Kind.PEER_CONTROL, 0, int(offset))


def peer_u32_unless_rank(value: int, rank: int | None) -> Arg:
    """A u32 scalar `value`, but 0 on rank `rank` (None: on no rank)."""
    return Arg(Kind.PEER_U32_UNLESS_RANK, _int_bits(value, 32, "u32"), -1 if rank is None else int(rank))


def scalar(ptx: str, value: Any) -> Arg:
    """`value` as a scalar parameter of PTX type `ptx` (.u32, .s32, .f32, .u64, .s64)."""
    if ptx == ".f32":
        return f32(value)
    if ptx in (".u32", ".s32"):
        return (u32 if ptx == ".u32" else i32)(value)
    if ptx in (".u64", ".s64"):
        return u64(value)
    raise ValueError(f"scalar: no encoding for PTX type {ptx!r}")


def params(abi_params, values: Mapping[str, Any]) -> tuple[Arg, ...]:
    """The parameter list of a kernel whose parameters are `abi_params` (an oproj_jax/abi.py
    list), in its order, from `values` by name: an Arg for each buffer parameter (buffer(...),
    NULL or a peer kind), a number or a scalar Arg for each scalar. Every name once, no other."""
    names = [p.name for p in abi_params]
    missing, unknown = set(names) - set(values), set(values) - set(names)
    if missing or unknown:
        raise ValueError(f"params: missing {sorted(missing)}, unknown {sorted(unknown)} (the list: {names})")
    out = []
    for p in abi_params:
        value = values[p.name]
        if p.role == "buffer":
            if not isinstance(value, Arg) or value.kind not in POINTERS:
                raise TypeError(
                    f"params: {p.name} is a pointer: expected buffer(...), NULL or a peer kind, got {value!r}"
                )
        elif isinstance(value, Arg):
            if value.kind not in SCALARS.get(p.ptx, ()):
                raise TypeError(f"params: {p.name} is a {p.ptx} scalar, got {value!r}")
        else:
            value = scalar(p.ptx, value)
        out.append(value)
    return tuple(out)


def encode(args: Iterable[Arg]) -> np.ndarray:
    """The `params` attribute: (kind, value, extra) per parameter, flattened."""
    return np.array([w for a in args for w in (int(a.kind), int(a.value), int(a.extra))], np.int64)


def decode(words) -> list[Arg]:
    """The parameters of a `params` attribute (the inverse of encode)."""
    words = [int(w) for w in words]
    if len(words) % 3:
        raise ValueError(f"params: {len(words)} words is not (kind, value, extra) per parameter")
    return [Arg(Kind(words[i]), words[i + 1], words[i + 2]) for i in range(0, len(words), 3)]


class Launch(NamedTuple):
    """One kernel launch: the attributes of ffi/launch.h's LaunchAttrs."""

    cubin: str  # absolute path of the cubin
    entry: str  # its kernel entry
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    cluster: tuple[int, int, int]  # NO_CLUSTER: a launch without clusters
    smem: int  # dynamic shared memory, bytes
    pdl: bool  # programmatic stream serialization: the kernel waits for the grid before it
    params: tuple[Arg, ...]

    def attributes(self, prefix: str = "") -> dict:
        """The call's attributes for this launch (`prefix`: a target's second launch, e.g. "publish_")."""
        fields = dict(
            cubin=self.cubin,
            entry=self.entry,
            grid=np.array(self.grid, np.int64),
            block=np.array(self.block, np.int64),
            cluster=np.array(self.cluster, np.int64),
            smem=np.int64(self.smem),
            pdl=bool(self.pdl),
            params=encode(self.params),
        )
        return {prefix + name: value for name, value in fields.items()}


def pairs(inplace: Iterable[tuple[int, int]]) -> np.ndarray:
    """The `inplace` attribute: (operand, result) pairs whose result the kernel reads as passed in."""
    return np.array([i for pair in inplace for i in pair], np.int64)


def call(launch: Launch, operands, out_types, *, aliases=None, inplace=(), traced=False, **ffi_call_options):
    """The results of `launch` on `operands` (results `out_types`) through the library's launch
    target: LAUNCH_TRACED_TARGET when `traced` (no record stage, oproj_jax/ffi.py says when), else
    LAUNCH_TARGET. `aliases` {operand: result} reach XLA; `inplace` (operand, result) pairs are
    the aliased ones the kernel reads in place (copied first where XLA did not alias them)."""
    import jax

    from oproj_jax import ffi

    ffi.register_targets()
    target = ffi.LAUNCH_TRACED_TARGET if traced else ffi.LAUNCH_TARGET
    fn = jax.ffi.ffi_call(target, out_types, input_output_aliases=aliases or {}, **ffi_call_options)
    return fn(*operands, **launch.attributes(), inplace=pairs(inplace))
