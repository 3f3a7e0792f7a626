"""mode="peer": the TP all-reduce by peer writes into mailboxes, polled by the CuTe consumer.

The other modes of oproj_jax.sharded move the partials with XLA collectives and hand the
consumer a complete mailbox. Here each rank's partial goes straight from its GPU into a slot
of every rank's mailbox, and each rank's consumer polls its own mailbox (the kernel's Lamport
protocol, docs/spec.md "Mailbox protocol"): no XLA collective, one FFI call per rank and step.

Design (C++: ffi/cute_peer.cc, which has the exact safety, progress and
deadlock-freedom arguments; docs/spec.md "Peer mode"):
  * The mailboxes belong to the FFI handler, not to XLA: a rank's partial must land in another
    GPU's buffer that the other rank's XLA program does not know about. Per group of devices
    (CUDA ordinals in rank order) ONE mailbox [R, max_tokens, H] per device, allocated when the
    group opens and used by every T <= PeerOptions.max_tokens (rows 0..T-1 of each slot), armed
    with the sentinel; close() frees it. In one process driving every GPU of the group (JAX's
    single-host layout), or one rank per process (see "Processes" below).
  * One FFI target per step, `oproj_cute_peer`: (1) the publish kernel (cute/publish.py) takes
    this rank's partial (-0.0 -> +0.0) and, fragment by fragment, WAITS until its slot in each
    rank's mailbox is empty again, then stores it there; (2) the consumer cubin in protocol
    mode polls, sums in the `groups` order, re-arms each fragment after reading it. The prefix
    is updated in place (aliased) as in the other targets.
  * No step counter anywhere: the mailbox's contents say who may write what, so the target is
    graph-safe (a record stage adds the two kernels as graph nodes inside XLA's command buffers).
  * Ordering: a rank's peer calls for one group must run in the same order on every rank and
    one after the other on each device, which XLA's thunk sequence and its default
    command-buffer scheduling give (not --xla_gpu_command_buffer_scheduling_mode=CONCURRENT).
  * Fail-stop: every wait is bounded by `timeout_us` per call (not per wave). A call that gives
    up returns NaN wherever a partial was missing and sets its rank's fail-stop word; from then
    on every step of that rank is refused (status STATUS_REFUSED, all NaN, no mailbox access)
    until reset(), and the ranks waiting for it fail in turn: a late publish is never consumed
    as a later step's partial, even where nobody reads the status.
  * First calls meet: with one process per rank, the first execution of each compiled step
    waits (on the host, at most connect_timeout_s) for the other ranks' first execution, so
    compile skew never reaches timeout_us.

Bits: every rank sums the same R slots in the same rank/group order as mode="oneshot" with
the same `groups` (the same folded cubin as oneshot's, in protocol mode), so the
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
(tests/test_peer_gpu.py, tests/test_peer_faults_gpu.py: R processes on one GPU). The CPU tests cover a numpy model of the protocol, the publish
kernel's PTX, the lowering and the error paths (tests/test_peer_*.py).
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from oproj_jax import abi, processes
from oproj_jax.abi import STATUS_CLOSED, STATUS_MAILBOX, STATUS_REFUSED, STATUS_UNARMED
from oproj_jax.contract import HIDDEN, Dims
from oproj_jax import ffi, launch
from oproj_jax.cute import backend, peer_ipc
from oproj_jax.cute import manifest as cute_manifest
from oproj_jax.options import Options

MAX_RANKS = 16  # cute/publish.py MAX_RANKS: one publish launch writes every rank's slot
DEFAULT_MAX_TOKENS = 512  # rows per mailbox slot: R * 512 * H * 2 bytes per device (117 MiB at R=16)
ROW_BYTES = HIDDEN * 2  # one bf16 row [H] of a mailbox slot (the handler sizes the mailboxes from it)
FRAGMENT_BYTES = 16  # the publish kernel stores 16-byte fragments, one per thread
RESET_SYMBOL, CLOSE_SYMBOL = "OprojPeerReset", "OprojPeerClose"
GROUP_COUNT_SYMBOL, ALLOCATED_SYMBOL, FAILED_SYMBOL = (
    "OprojPeerGroupCount",
    "OprojPeerAllocatedBytes",
    "OprojPeerFailed",
)
# PeerResult.status is the OR of the consumer's word and the publish kernel's word (abi.STATUS_*)
_STATUS = {
    STATUS_MAILBOX: "a mailbox slot stayed empty: a rank did not publish its partial in time",
    STATUS_UNARMED: "a peer never re-armed its slot: its consumer of the previous step did not run in time, so "
    "this rank's partial was not stored there",
    STATUS_REFUSED: "refused: an earlier step of the group failed, so every later step only writes NaN until "
    "oproj_jax.cute.peer.reset()",
    STATUS_CLOSED: "the group was closed by oproj_jax.cute.peer.close(): trace the step again (a new jax.jit) to "
    "reopen it",
}


@dataclasses.dataclass(frozen=True)
class PeerOptions:
    """Options of mode="peer" (static: part of the compiled program).

    timeout_us: microseconds of wall time (the GPU's %globaltimer) a call waits for its peers
        before it gives up (a slot still empty, or not re-armed by its owner) and reports it:
        one deadline per call, whatever T is (the first to give up sets the group's fail-stop
        word and every other wave of the call stops at its next poll); an int in [1, 2**31), no
        "forever". The default, one second, is about 10^5 times a step's normal skew between
        ranks (microseconds); launch skew from compiling is absorbed by the first-call meeting
        (connect_timeout_s), never by this timeout.
    connect_timeout_s: seconds a process waits for the other processes of a group: for their
        mailbox handles when it traces a step, and at the first execution of each compiled
        step, where the ranks meet before any kernel waits; > 0.
    max_tokens: rows of each mailbox slot: the group's one mailbox holds R * max_tokens * H
        bf16 per device, allocated once and used by every T <= max_tokens; a larger T raises a
        ValueError naming max_tokens. Every call of a group uses the same value (close() first
        to change it).
    skip_publish_rank: TESTS ONLY. That rank publishes nothing, so every rank's consumer times
        out: how the GPU tests check that a missing rank becomes an error in bounded time.
    """

    timeout_us: int = backend.DEFAULT_TIMEOUT_US
    connect_timeout_s: float = 300.0
    max_tokens: int = DEFAULT_MAX_TOKENS
    skip_publish_rank: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "timeout_us", backend.check_timeout_us(self.timeout_us))
        cap = self.max_tokens
        if isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or not 1 <= cap <= 65535:
            raise ValueError(f"max_tokens: expected an int in 1..65535 (rows per mailbox slot), got {cap!r}")
        object.__setattr__(self, "max_tokens", int(cap))
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
    # the OR of STATUS_MAILBOX (1), STATUS_UNARMED (4), STATUS_REFUSED (8), STATUS_CLOSED (16)


# ---- what the mode needs ----------------------------------------------------------------------


class _Publish(NamedTuple):
    cubin: str  # absolute path
    entry: str
    threads: int  # per CTA: one per 16-byte fragment (cute/ABI.md "The publish kernel")


def _publish_kernel() -> _Publish:
    """The publish kernel of the manifest for the devices' arch, or a ValueError naming the build
    command."""
    parsed, where = backend._manifest(backend._device_arch())
    if parsed is None:
        raise ValueError(f"no CuTe cubins/manifest found ({where})")
    manifest = parsed[0]
    entry = cute_manifest.find_publish(manifest)
    if entry is None or entry.get("params") != abi.ptx(abi.PUBLISH):
        raise ValueError(
            f"the manifest in {where} has no (current) publish kernel for mode='peer'; rebuild the "
            f"cubins with `{backend.BUILD_COMMAND}`"
        )
    stale = cute_manifest.stale_reason(manifest)
    if stale:
        raise ValueError(stale)
    path = cute_manifest.verified_cubin_path(manifest, entry, backend.BUILD_COMMAND)
    return _Publish(str(path), entry["entry"], int(entry["block"][0]))


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


def unsupported_reason(dims: Dims, max_tokens: int = DEFAULT_MAX_TOKENS, **options) -> str | None:
    """Why mode="peer" cannot serve one rank's view `dims` (R = the group's size) with the
    consumer's `options` and mailboxes of `max_tokens` rows, or None."""
    if dims.R > MAX_RANKS:
        return f"mode='peer' serves groups of up to {MAX_RANKS} ranks, got R = {dims.R}"
    if dims.T > max_tokens:
        return (
            f"T = {dims.T} tokens exceeds the mailboxes' max_tokens = {max_tokens}: raise "
            f"PeerOptions(max_tokens=...) (R * max_tokens * H * 2 bytes per device)"
        )
    return backend.unsupported_reason(dims, ready=False, **options)


def group_table(mesh, axis_name: str) -> tuple[tuple[int, ...], ...]:
    """The TP groups of `mesh` along `axis_name` as the FFI handler sees them from this process:
    one row per group (every combination of the other mesh axes), rank order along the row. A
    group of this process's devices holds their CUDA ordinals (the handler maps its memory by
    ordinal); a group spanning processes (one rank per process) holds this process's device's
    CUDA ordinal and -(1 + device id) for the others (peer_ipc.connect maps their mailboxes)."""
    return tuple(peer_ipc.encode_row(row, jax.process_index()) for row in peer_ipc.group_rows(mesh, axis_name))


def connect(mesh, axis_name: str, table, options: PeerOptions) -> None:
    """Maps the mailboxes of every group of `table` that spans processes (once per group and
    process until close(); a no-op for groups of one process). Every process of such a group
    must call it."""
    peer_ipc.connect(mesh, axis_name, table, options.max_tokens, options.connect_timeout_s, row_bytes=ROW_BYTES)


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
    R, NB = len(table[0]), blocks.shape[1]
    if tuple(partial.shape) != (T, H) or H * 2 != ROW_BYTES:
        raise ValueError(f"partial: expected shape [T, H] = {(T, H)} with H = {HIDDEN}, got {tuple(partial.shape)}")
    if T > options.max_tokens:
        raise ValueError(f"max_tokens: {unsupported_reason(Dims(R, T, NB, H), options.max_tokens)}")
    kernel = backend._kernel(backend.kernel_key(R, NB, twoshot=False, **opts.asdict()), T, False)
    out_types = [
        jax.ShapeDtypeStruct((T, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((T, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((opts.xmoe_replicas, T, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((3,), jnp.int32),
    ]
    publish, consumer = _launches(kernel, _publish_kernel(), T, H, R, NB, opts, options)
    ffi.register_targets()
    # has_side_effect: the call writes other devices' mailboxes (and every rank waits for every
    # other's call), so XLA must neither drop it (unused results) nor merge two identical calls.
    call = jax.ffi.ffi_call(ffi.PEER_TARGET, out_types, input_output_aliases={1: 0}, has_side_effect=True)
    new_prefix, output, xmoe, flags = call(
        partial,
        prefix,
        blocks,
        norm,
        query,
        out_norm,
        **consumer.attributes(),
        **publish.attributes("publish_"),
        inplace=launch.pairs([(1, 0)]),  # the prefix, updated in place
        group=np.asarray(table, np.int64).reshape(-1),
        ranks=np.int64(R),
        max_tokens=np.int64(options.max_tokens),
        row_bytes=np.int64(ROW_BYTES),
        connect_timeout_s=np.float32(options.connect_timeout_s),
    )
    # flags: [0] the consumer's status, [1] its hints counter (scratch), [2] the publish status
    return PeerResult(new_prefix, output, xmoe if opts.xmoe_replicas else None, flags[0:1] | flags[2:3])


def _launches(kernel, publish: _Publish, T, H, R, NB, opts: Options, options: PeerOptions):
    """(the publish launch, the consumer launch) of one peer call. The call's buffers: operands
    partial 0, prefix 1, blocks 2, norm 3, query 4, out_norm 5; results prefix 6, output 7, xmoe 8,
    flags 9 ([3] i32: the consumer's status, its hints counter, the publish status). The
    mailboxes, slots and control words are the transport's (launch.peer_*): the consumer polls
    this rank's mailbox, whose slots hold max_tokens rows (its T, the slot stride; the grid has
    the call's T)."""
    b = launch.buffer
    fragments = T * H * 2 // FRAGMENT_BYTES
    dests = {f"dest_{r}": launch.peer_slot(r) for r in range(abi.PUBLISH_MAX_RANKS)}  # null past R
    publish_launch = launch.Launch(
        publish.cubin,
        publish.entry,
        grid=(-(-fragments // publish.threads), 1, 1),
        block=(publish.threads, 1, 1),
        cluster=launch.NO_CLUSTER,
        smem=0,
        pdl=True,
        params=launch.params(
            abi.PUBLISH,
            dict(
                src=b(0),
                **dests,
                # the test option's rank publishes nothing (no destination)
                n_dest=launch.peer_u32_unless_rank(R, options.skip_publish_rank),
                flags=b(9, 0),  # thread 0 zeroes the consumer's status; the publish status goes to flags[2]
                fragments=fragments,
                timeout_us=options.timeout_us,
                control=launch.peer_control(),
            ),
        ),
    )
    consumer_launch = backend.consumer_launch(
        kernel, tokens=T, variant=(R, NB, opts.xmoe_replicas), ready=False, twoshot=False, pdl=True,
        mailbox=launch.peer_mailbox(), prefix=b(6), blocks=b(2), norm=b(3), query=b(4), out_norm=b(5), output=b(7),
        xmoe=b(8), hints=b(9, 4), status=b(9, 0), eps=opts.eps, out_eps=opts.out_eps, T=options.max_tokens,
        timeout_us=options.timeout_us, control=launch.peer_control(), own=launch.NULL, own_slot=0,
    )  # fmt: skip
    return publish_launch, consumer_launch


def describe_status(code: int) -> str:
    """What a nonzero status word means (its bits: STATUS_MAILBOX, STATUS_UNARMED)."""
    parts = [f"{bit}: {text}" for bit, text in _STATUS.items() if code & bit]
    unknown = code & ~sum(_STATUS)
    if unknown:
        parts.append(f"{unknown}: unknown code")
    return f"status {code} (" + "; ".join(parts) + ")"


def check_status(status) -> None:
    """Raises RuntimeError if any device's status word (PeerResult.status: one i32 per device of
    the mesh, in mesh order; on a 1-D mesh the rank) is nonzero, or if a group of this process
    has failed since (its fail-stop word, read from the GPU: a later step, or another rank's
    failure that this rank's step did not see yet). A nonzero word means the outputs of that
    step are not valid (they are NaN where a partial was missing, docs/spec.md); see
    describe_status for the bits. Reading it waits for the step to finish. With several
    processes each checks the words of its own devices (a missing rank stalls every rank)."""
    words = dict(_status_words(status))
    failed = sorted(r for r, word in words.items() if word)
    live = failed_word()
    if failed or live:
        codes = sorted({words[r] for r in failed} | ({live} if live else set()))
        what = ", ".join(describe_status(c) for c in codes)
        where = f"the step on mesh device(s) {failed}" if failed else "a later step of a group of this process"
        fix = (
            "trace the step again to reopen the group"
            if all(c & STATUS_CLOSED for c in codes)
            else "call oproj_jax.cute.peer.reset() in every process (with no call in flight) before the next peer step"
        )
        raise RuntimeError(f"mode='peer': {where} failed ({what}); the outputs of that step are not valid. Then {fix}")


def _status_words(status):
    """(mesh position, word) of every status word this process holds."""
    if isinstance(status, jax.Array) and not status.is_fully_addressable:
        for shard in status.addressable_shards:
            start = shard.index[0].start or 0
            for i, word in enumerate(np.asarray(shard.data).reshape(-1)):
                yield start + i, int(word)
        return
    yield from enumerate(int(w) for w in np.asarray(status).reshape(-1))


def _native(symbol: str, restype, argtypes=()):
    fn = getattr(ffi.load_library(), symbol)
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


def _call_with_message(symbol: str, what: str) -> int:
    message = ctypes.create_string_buffer(1024)
    value = _native(symbol, ctypes.c_int64, [ctypes.c_char_p, ctypes.c_size_t])(message, len(message))
    if value < 0:
        raise RuntimeError(f"oproj_jax.cute.peer.{what}: {message.value.decode(errors='replace')}")
    return int(value)


def failed_word() -> int:
    """The OR of the fail-stop words of every group open in this process (0: none has failed;
    else the status bits of the failure). No group open: 0, without touching a GPU."""
    if not ffi.library_loaded() or group_count() == 0:
        return 0
    return _call_with_message(FAILED_SYMBOL, "failed_word")


_barriers = 0  # reset()/close() calls in this process: names their barriers (the same count everywhere)


def _everywhere(name: str, timeout_s: float, action) -> None:
    """Runs `action` between two barriers of every process (jax.distributed; a no-op barrier
    with one process): before it no step is in flight anywhere, after it every process is done."""
    global _barriers
    _barriers += 1
    processes.barrier(f"oproj_jax/peer/{name}/{_barriers}/before", timeout_s)
    action()
    processes.barrier(f"oproj_jax/peer/{name}/{_barriers}/after", timeout_s)


def reset(timeout_s: float = 300.0) -> None:
    """Re-arms the mailboxes this process owns and clears their fail-stop words: after a step
    that failed (nonzero status), every later step of the group is refused until then. Call only
    with no peer call in flight on any device (jax.block_until_ready on everything first), in
    every process of the group (jax.distributed): it waits at most `timeout_s` seconds for all of
    them before re-arming, so no step is in flight anywhere, and after, so no rank publishes into
    a slot that is still to be re-armed. Without any group open: a no-op here."""
    _everywhere("reset", timeout_s, lambda: _call_with_message(RESET_SYMBOL, "reset"))


def close(timeout_s: float = 300.0) -> None:
    """Frees every group's mailboxes in this process and closes its mappings of other processes'
    mailboxes (allocated_bytes() and group_count() return 0 after). A step traced afterwards
    opens its group again; an executable compiled before still refers to the closed group: its
    steps are refused with STATUS_CLOSED and NaN results (never a fault) until it is traced
    again, except for groups of one process, which its next execution reopens (unless XLA
    recorded it into a command buffer). Call with no peer call in flight, in every process of
    the group (waits at most `timeout_s` for all of them before and after). Also runs at
    interpreter exit."""

    def action():
        if ffi.library_loaded():
            _call_with_message(CLOSE_SYMBOL, "close")
        peer_ipc.forget()

    _everywhere("close", timeout_s, action)


def group_count() -> int:
    """How many groups have mailboxes open in this process (one per group, whatever T)."""
    if not ffi.library_loaded():
        return 0
    return int(_native(GROUP_COUNT_SYMBOL, ctypes.c_int64)())


def allocated_bytes() -> int:
    """Bytes of mailbox memory this process holds: R * max_tokens * H * 2 plus 256 per open group
    and device of this process (the control words, 64 KiB per device once, are not counted)."""
    if not ffi.library_loaded():
        return 0
    return int(_native(ALLOCATED_SYMBOL, ctypes.c_int64)())


def _close_at_exit() -> None:
    """Interpreter exit: frees this process's mailboxes (without barriers: other processes may be
    gone already; the driver would release them with the context anyway)."""
    try:
        if ffi.library_loaded() and group_count():
            _call_with_message(CLOSE_SYMBOL, "close")
    except Exception:  # exit: nothing left to report to
        pass


atexit.register(_close_at_exit)
