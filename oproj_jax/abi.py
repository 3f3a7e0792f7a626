"""The kernels' parameter lists and status codes, written once.

The CuTe consumer and publish kernels take pointers and scalars only, in this order (PTX .param
order). The CuTe build checks every compiled entry's PTX parameters against `ptx(...)` of these
lists, the backend checks every manifest entry it launches, the peer mode reads the publish
list and the status bits, and the tests compare the three. oproj_jax/cute/ABI.md describes each
parameter; docs/spec.md the mailbox protocol the status bits report on.

This module is part of the device code's import closure (cute/publish.py and cute/kernel.py
import it), so the cubin fingerprint covers it: changing the ABI asks for a rebuild.
"""

from __future__ import annotations

from typing import NamedTuple


class Param(NamedTuple):
    name: str
    ptx: str  # the PTX .param type: .u64 (a device pointer or a 64-bit word), .u32, .f32
    role: str  # "buffer" (a device pointer), "scalar" (a value)


def _buffers(*names: str) -> tuple[Param, ...]:
    return tuple(Param(name, ".u64", "buffer") for name in names)


# The consumer (cute/kernel.py), parameters 0..13 of every variant.
CONSUMER_COMMON = (
    *_buffers("mailbox", "prefix", "blocks", "norm", "query", "out_norm", "output", "xmoe", "hints", "status"),
    Param("eps", ".f32", "scalar"),
    Param("out_eps", ".f32", "scalar"),
    Param("T", ".u32", "scalar"),  # the slots' capacity in tokens (the launch's tokens: grid.y)
    Param("timeout_us", ".u32", "scalar"),  # < 0: ready mode (nothing polled); > 0: protocol mode
)
# One-shot variants: the fail-stop control words (0 outside mode="peer"), and the caller's own
# partial [T, H] read in place of slot `own_slot` (0: none; ready mode only).
CONSUMER_ONESHOT = CONSUMER_COMMON + _buffers("control", "own") + (Param("own_slot", ".u32", "scalar"),)
# Two-shot variants: the received column slices, the gathered row, this rank.
CONSUMER_TWOSHOT = CONSUMER_COMMON + (*_buffers("recv", "gather"), Param("me", ".u32", "scalar"))

# The publish kernel (cute/publish.py): one static variant for every R <= PUBLISH_MAX_RANKS.
PUBLISH_MAX_RANKS = 16
PUBLISH = (
    *_buffers("src", *(f"dest_{i}" for i in range(PUBLISH_MAX_RANKS))),
    Param("n_dest", ".u32", "scalar"),
    *_buffers("flags"),
    Param("fragments", ".u32", "scalar"),
    Param("timeout_us", ".u32", "scalar"),
    *_buffers("control"),
)


def ptx(params: tuple[Param, ...]) -> list[str]:
    """The PTX .param types of `params`, in order (what the build reads from the PTX)."""
    return [p.ptx for p in params]


# Status bits: the consumer stores its code into `status`, the publish kernel into flags[2];
# the peer mode ORs them into one status per call (cute/peer.py).
STATUS_MAILBOX = 1  # consumer: a mailbox slot stayed empty until the deadline
STATUS_RECV = 2  # consumer, two-shot: a received column slice stayed empty until the deadline
STATUS_UNARMED = 4  # publish: a destination slot was never re-armed within timeout_us
STATUS_REFUSED = 8  # both: the group's fail-stop word was set before the call; only NaN written
STATUS_CLOSED = 16  # the group was closed (peer close()); reported with STATUS_REFUSED
