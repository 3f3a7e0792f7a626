"""mode="peer": the TP all-reduce by peer writes into mailboxes, polled by the CuTe consumer.

The other modes of oproj_jax.sharded move the partials with XLA collectives and hand the
consumer a complete mailbox. Here each rank's partial goes straight from its GPU into a slot
of every rank's mailbox, and each rank's consumer polls its own mailbox (the kernel's Lamport
protocol, docs/spec.md "Mailbox protocol"): no XLA collective, one FFI call per rank and step.

Design (C++: oproj_jax/cute/csrc/peer_ffi.cc, which has the exact safety, progress and
deadlock-freedom arguments):
  * The mailboxes belong to the FFI handler, not to XLA: a rank's partial must land in another
    GPU's buffer that the other rank's XLA program does not know about. Per group of devices
    (CUDA ordinals in rank order), T and R, ONE mailbox [R, T, H] per device (plus a small
    control block), allocated on first use in each device's primary context, peer access
    enabled between every pair, armed with the sentinel once; in one process driving every GPU
    of the group (JAX's single-host layout), or one rank per process (see "Processes" below).
  * One FFI target per step, `oproj_cute_peer`: (1) the publish kernel (cute/publish.py) takes
    this rank's partial (-0.0 -> +0.0) and, fragment by fragment, WAITS until its slot in each
    rank's mailbox is empty again (all four 32-bit words of the fragment are the sentinel: the
    owner consumed the previous step and re-armed it), then stores it there; (2) the consumer
    cubin in protocol mode (timeout_us >= 0, manifest.build_for(T, ready=False)) polls, sums in
    the `groups` order, re-arms each fragment after reading it. The prefix is updated in place
    (aliased) as in the other targets.
  * No step counter anywhere: the mailbox's contents say who may write what, so the target is
    graph-safe. Inside an XLA command buffer (CUDA graph) its record stage adds the two kernels
    as graph nodes (publish, then the consumer with cluster (7, 1, 1), PDL edges) and only
    rewrites their arguments when XLA's buffers move: a jitted chain of steps pays the kernels,
    not XLA's per-thunk host dispatch.
  * Ordering: a rank's peer calls for one (group, T, R) must run in the same order on every
    rank and one after the other on each device, which XLA's thunk sequence and its default
    command-buffer scheduling give (not --xla_gpu_command_buffer_scheduling_mode=CONCURRENT).
  * Bounded waits: a slot still empty after `timeout_us` microseconds makes the consumer
    report status 1 (it then finishes on whatever it read); a slot its owner never re-armed
    within `timeout_us` microseconds makes the publish report status 4 (and store nothing there).
    `tp_consumer(..., mode="peer")` returns the status per rank (the OR of both); eager calls
    check it, jitted callers call check_status. After such an error the mailboxes may hold a
    late publish nobody will consume: call reset().

Bits: every rank sums the same R slots in the same rank/group order as mode="oneshot" with
the same `groups` (the grouped build sums exactly as the folded build ready mode uses), so the
prefix is bit-identical to oneshot's on every rank, and the output too (same kernel arithmetic).

Processes: a group runs either in one process driving all its GPUs, or with one rank per
process (jax.distributed, one process per GPU): then each process allocates its own rank's
mailbox and maps the others' through CUDA IPC handles exchanged in jax.distributed's key-value
store when the step is traced (peer_ipc.py). A group with several ranks in one process and
others elsewhere is refused.

Limits: R <= 16 (the publish kernel's destinations); CUDA GPUs with peer access between every
pair of the group (NVLink or PCIe peer-to-peer), and for groups across processes CUDA IPC
between them.

What only a GPU run covers: the publish kernel, the FFI handler (allocation, peer access, the
record stage inside XLA command buffers), the cross-GPU ordering and the timeouts
(tests/test_peer_gpu.py). The CPU tests cover a numpy model of the protocol, the publish
kernel's PTX, the lowering and the error paths (tests/test_peer_*.py).
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from oproj_jax import processes
from oproj_jax.api import Dims
from oproj_jax.cute import backend, ffi, peer_ipc
from oproj_jax.cute import manifest as cute_manifest
from oproj_jax.options import Options

MAX_RANKS = 16  # cute/publish.py MAX_RANKS: one publish launch writes every rank's slot
RESET_SYMBOL = "OprojPeerReset"
GROUP_COUNT_SYMBOL = "OprojPeerGroupCount"
# Status bits (PeerResult.status is the OR of the consumer's word and the publish kernel's word)
STATUS_EMPTY_SLOT = 1  # the consumer: a slot stayed empty (kernel.STATUS_MAILBOX)
STATUS_UNARMED = 4  # the publish kernel: a peer never re-armed its slot (publish.STATUS_UNARMED)
_STATUS = {
    STATUS_EMPTY_SLOT: "a mailbox slot stayed empty: a rank did not publish its partial in time",
    STATUS_UNARMED: "a peer never re-armed its slot: its consumer of the previous step did not run in time, so "
    "this rank's partial was not stored there",
}
# cute/publish.py PUBLISH_PARAMS: src, dest_0..15, n_dest, flags, fragments, timeout_us, control
PUBLISH_PARAMS = [".u64"] * (1 + MAX_RANKS) + [".u32", ".u64", ".u32", ".u32", ".u64"]


@dataclasses.dataclass(frozen=True)
class PeerOptions:
    """Options of mode="peer" (static: part of the compiled program).

    timeout_us: microseconds of wall time (the GPU's %globaltimer) before a consumer gives up
        on an empty slot, or the publish kernel on a slot its owner has not re-armed, and
        reports it; an int in [1, 2**31), no "forever". The default (one second) is far above
        the skew between ranks' launches, even on a first call that allocates the mailboxes.
    connect_timeout_s: seconds each process waits, when it traces a step of a group spanning
        processes, for the other processes' mailbox handles (they trace the same step); > 0.
    skip_publish_rank: TESTS ONLY. That rank publishes nothing, so every rank's consumer times
        out: how the GPU tests check that a missing rank becomes an error in bounded time.
    """

    timeout_us: int = backend.DEFAULT_TIMEOUT_US
    connect_timeout_s: float = 300.0
    skip_publish_rank: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "timeout_us", backend.check_timeout_us(self.timeout_us))
        wait = self.connect_timeout_s
        if isinstance(wait, bool) or not isinstance(wait, (int, float, np.integer, np.floating)) or not wait > 0:
            raise ValueError(f"connect_timeout_s: expected seconds > 0, got {wait!r}")
        skip = self.skip_publish_rank
        if skip is not None and (isinstance(skip, bool) or not isinstance(skip, (int, np.integer)) or skip < 0):
            raise ValueError(f"skip_publish_rank: expected None or a rank >= 0, got {skip!r}")


class PeerResult(NamedTuple):
    """ConsumerResult's fields plus the per-rank status (read it with check_status)."""

    prefix: jax.Array  # [T, H] bf16, updated (the same bits on every rank)
    output: jax.Array  # [T, H] bf16
    xmoe: jax.Array | None  # [reps, T, H] bf16, None when reps == 0
    status: jax.Array  # i32, one word per device in mesh order (rank order on a 1-D mesh): 0 = ok, else
    # the OR of STATUS_EMPTY_SLOT (1) and STATUS_UNARMED (4)


# ---- what the mode needs ----------------------------------------------------------------------


def _publish_kernel() -> tuple[str, str]:
    """(cubin path, entry) of the publish kernel, or a ValueError naming the build command."""
    parsed, where = backend._manifest()
    if parsed is None:
        raise ValueError(f"no CuTe cubins/manifest found ({where})")
    manifest = parsed[0]
    entry = cute_manifest.find_publish(manifest)
    if entry is None or entry.get("params") != PUBLISH_PARAMS:
        raise ValueError(
            f"the manifest in {where} has no (current) publish kernel for mode='peer'; rebuild the "
            f"cubins with `{backend.BUILD_COMMAND}`"
        )
    stale = cute_manifest.stale_reason(manifest)
    if stale:
        raise ValueError(stale)
    return str(cute_manifest.verified_cubin_path(manifest, entry, backend.BUILD_COMMAND)), entry["entry"]


def unavailable_reason(platform: str) -> str | None:
    """Why mode="peer" cannot run on `platform`, or None."""
    reason = backend.unavailable_reason(platform)
    if reason:
        return reason
    try:
        _publish_kernel()
    except ValueError as err:
        return str(err)
    return None


def unsupported_reason(dims: Dims, **options) -> str | None:
    """Why mode="peer" cannot serve one rank's view `dims` (R = the group's size) with the
    consumer's `options`, or None."""
    if dims.R > MAX_RANKS:
        return f"mode='peer' serves groups of up to {MAX_RANKS} ranks, got R = {dims.R}"
    return backend.unsupported_reason(dims, ready=False, **options)


def group_table(mesh, axis_name: str) -> tuple[tuple[int, ...], ...]:
    """The TP groups of `mesh` along `axis_name` as the FFI handler sees them from this process:
    one row per group (every combination of the other mesh axes), rank order along the row. A
    group of this process's devices holds their CUDA ordinals (the handler maps its memory by
    ordinal); a group spanning processes (one rank per process) holds this process's device's
    CUDA ordinal and -(1 + device id) for the others (peer_ipc.connect maps their mailboxes)."""
    return tuple(peer_ipc.encode_row(row, jax.process_index()) for row in peer_ipc.group_rows(mesh, axis_name))


def connect(mesh, axis_name: str, table, tokens: int, options: PeerOptions) -> None:
    """Maps the mailboxes of every group of `table` that spans processes (once per group, T and
    process; a no-op for groups of one process). Every process of such a group must call it."""
    peer_ipc.connect(mesh, axis_name, table, tokens, options.connect_timeout_s)


# ---- the call ---------------------------------------------------------------------------------


def consume(
    partial,  # [T, H] bf16: this rank's partial o-projection (XLA's; -0.0 allowed, published as +0.0)
    prefix,  # [T, H] bf16, updated in place
    blocks,
    norm,
    query,
    out_norm,
    *,
    table: tuple[tuple[int, ...], ...],  # group_table(mesh, axis)
    options: PeerOptions = PeerOptions(),
    **consumer_options,
) -> PeerResult:
    """One rank's step inside the shard_map (the caller has checked arguments and support):
    publish `partial` to every rank of this device's group, then consume this device's mailbox.
    `consumer_options` are the consumer's (Options.from_kwargs). Returns the status as a [1] i32
    array (the OR of the consumer's and the publish's words)."""
    opts = Options.from_kwargs(consumer_options)
    T, H = prefix.shape
    R = len(table[0])
    kernel = backend._kernel(backend.kernel_key(R, blocks.shape[1], twoshot=False, **opts.asdict()), T, False)
    publish_cubin, publish_entry = _publish_kernel()
    ffi.register_targets()
    out_types = [
        jax.ShapeDtypeStruct((T, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((T, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((opts.xmoe_replicas, T, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((3,), jnp.int32),
    ]
    # has_side_effect: the call writes other devices' mailboxes (and every rank waits for every
    # other's call), so XLA must neither drop it (unused results) nor merge two identical calls.
    call = jax.ffi.ffi_call(ffi.PEER_TARGET, out_types, input_output_aliases={1: 0}, has_side_effect=True)
    skip = -1 if options.skip_publish_rank is None else int(options.skip_publish_rank)
    new_prefix, output, xmoe, flags = call(
        partial,
        prefix,
        blocks,
        norm,
        query,
        out_norm,
        **backend._attributes(kernel, opts.eps, opts.out_eps, options.timeout_us, True),
        publish_cubin=publish_cubin,
        publish_entry=publish_entry,
        group=np.asarray(table, np.int64).reshape(-1),
        ranks=np.int64(R),
        skip_rank=np.int32(skip),
    )
    # flags: [0] the consumer's status, [1] its hints counter (scratch), [2] the publish status
    return PeerResult(new_prefix, output, xmoe if opts.xmoe_replicas else None, flags[0:1] | flags[2:3])


def describe_status(code: int) -> str:
    """What a nonzero status word means (its bits: STATUS_EMPTY_SLOT, STATUS_UNARMED)."""
    parts = [f"{bit}: {text}" for bit, text in _STATUS.items() if code & bit]
    unknown = code & ~sum(_STATUS)
    if unknown:
        parts.append(f"{unknown}: unknown code")
    return f"status {code} (" + "; ".join(parts) + ")"


def check_status(status) -> None:
    """Raises RuntimeError if any device's status word (PeerResult.status: one i32 per device of
    the mesh, in mesh order; on a 1-D mesh the rank) is nonzero: a slot stayed empty for
    timeout_us microseconds (a rank did not publish in time), or a peer's slot was not
    re-armed within timeout_us microseconds (its previous consumer did not run in time), so the
    outputs of that step are not valid. Reading it waits for the step to finish. With several
    processes each checks the words of its own devices (a missing rank stalls every rank)."""
    words = dict(_status_words(status))
    failed = sorted(r for r, word in words.items() if word)
    if failed:
        what = ", ".join(describe_status(c) for c in sorted({words[r] for r in failed}))
        raise RuntimeError(
            f"mode='peer': the step on mesh device(s) {failed} gave up polling ({what}); the outputs of that step are "
            f"not valid. Call oproj_jax.cute.peer.reset() (with no call in flight) before the next peer step"
        )


def _status_words(status):
    """(mesh position, word) of every status word this process holds."""
    if isinstance(status, jax.Array) and not status.is_fully_addressable:
        for shard in status.addressable_shards:
            start = shard.index[0].start or 0
            for i, word in enumerate(np.asarray(shard.data).reshape(-1)):
                yield start + i, int(word)
        return
    yield from enumerate(int(w) for w in np.asarray(status).reshape(-1))


_resets = 0  # reset() calls in this process: names its barriers (the same count in every process)


def reset(timeout_s: float = 300.0) -> None:
    """Re-arms the mailboxes this process owns (and zeroes their control blocks). Needed after a
    step that reported a nonzero status: a late rank may have written a slot nobody will
    consume, which the next step would read as its own. Call only with no peer call in flight
    on any device (jax.block_until_ready on everything first). With several processes
    (jax.distributed) call it in every process: it waits (at most `timeout_s` seconds) for all
    of them before re-arming, so no step is in flight anywhere, and after, so no rank publishes
    into a slot that is still to be re-armed. Without any group allocated: a no-op here."""
    global _resets
    _resets += 1
    processes.barrier(f"oproj_jax/peer/reset/{_resets}/before", timeout_s)
    library = ffi.load_library()
    message = ctypes.create_string_buffer(1024)
    fn = getattr(library, RESET_SYMBOL)
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_char_p, ctypes.c_size_t]
    if fn(message, len(message)) != 0:
        raise RuntimeError(f"oproj_jax.cute.peer.reset: {message.value.decode(errors='replace')}")
    processes.barrier(f"oproj_jax/peer/reset/{_resets}/after", timeout_s)


def group_count() -> int:
    """How many (group, T, R) mailbox sets the handler has allocated in this process."""
    fn = getattr(ffi.load_library(), GROUP_COUNT_SYMBOL)
    fn.restype, fn.argtypes = ctypes.c_int64, []
    return int(fn())
