"""How the Triton consumer is launched: the kernel configuration for each T and H (the one
place it is decided) and the launch parameters.

torch_launch.py and backend.py both launch from a `Plan`, so a PyTorch call and a JAX call of
the same shape compile the same kernel with the same constexprs and options, and give the same
bits. No JAX, no PyTorch here.

Configurations (kernel.py has the kernels), named kind-columns-warps:
  sync-*          sync_kernel, grid (C, T): C programs per token in one launch, meeting at two
                  barriers (int32 arrival counters that the launch zeroes); each program
                  keeps its blocks ([pow2(NB), block]) and prefix in registers throughout, and
                  no Gram matrix: the weights from the chunks' dots and squares, then y.y from
                  their y. C <= SYNC_MAX_CHUNKS, so a token's programs fit on the GPU at once;
                  T <= SYNC_MAX_TOKENS (the grid's second axis).
                  Triton's interpreter runs it as three launches, the stretches between the
                  barriers.
  sync-*-cluster  the same, a token's programs launched as one thread block cluster (on
                  CLUSTER_CAPABILITIES, C <= CLUSTER_MAX), sending their records into each
                  other's shared memory, each waiting for the bytes it expects: no arrival
                  counters, nothing in global memory, the same bits as its counterpart without
                  clusters; the default there (CLUSTERED).
  sync-*-reload   the same, but the blocks are read again after the first barrier (from L1 or
                  L2, where the first read left them) instead of held in registers across it:
                  fewer registers a thread, more programs per SM.
  *-r64           compiled with a cap of 64 registers a thread (ptxas .maxnreg), for occupancy.
  row-w16         row_kernel: one program per token holds the whole row (next power of two >= H
                  lanes) in registers, one pass over memory; for more tokens than a sync grid
                  takes.
  tile-512-w8     tile_kernel: one program per token, two passes over 512-column tiles (the
                  second re-reads the blocks and the new prefix); for rows too wide for
                  registers.

The sync kernel leaves its arrival counters at zero (the last arrival resets them), so a caller
may keep one set from call to call instead of zeroing it before each launch. On sm_90 and newer
the launchers start it with programmatic dependent launch (`pdl`): its launch overlaps the end of
the kernel ahead of it, whose writes it waits for before reading anything. Up to LOADS_FIRST_MAX_T
tokens a sync program whose rows fit in registers loads all of them before any arithmetic
(loads_first).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

SOURCES = 16  # rows of the tile kernel's source tiles: NB + 1 <= 9, padded (tl.dot takes >= 16)
ROW_MAX_H = 16384  # row: a whole row lives in registers; above this the tile kernel runs
MAX_RANKS = 64  # the rank sum is unrolled at compile time, one load per rank
# sync: a token's programs wait for each other, so all of them must fit on the GPU at once. Two
# programs of up to 16 warps fit on any SM of sm_80 or newer; 32 fit on a GPU of 16 SMs.
SYNC_MAX_CHUNKS = 32
# sync: polls of the arrival counter before the kernel traps (a launch error): seconds, where a
# token's programs meet within microseconds.
SYNC_POLLS = 1 << 24
# sync: the tokens are the grid's second axis (the chunks the first, so that a token's programs
# are dispatched together), which CUDA bounds at 65535.
SYNC_MAX_TOKENS = 65535
# sync-*-cluster: a token's programs form one thread block cluster; 8 is the portable bound (more needs the
# non-portable attribute on the kernel, which XLA does not set on the module it loads for a command buffer's node:
# CUDA_ERROR_INVALID_CLUSTER_SIZE there)
CLUSTER_MAX = 8
# Where the launchers use the cluster configurations (thread block clusters, st.async and mbarrier
# transactions are sm_90 PTX): the compute capabilities they are measured on; other GPUs keep the arrival counters
# until the cluster configurations have run there.
CLUSTER_CAPABILITIES = frozenset({90})
NUM_STAGES = 1  # no software-pipelined loops in these kernels
# No FMA contraction anywhere: the prefix path is adds only, and with contraction off the PTX
# carries .rn on every f32 mul/add, so the CUDA driver's JIT (JAX) and ptxas (PyTorch) emit the
# same arithmetic and the two launches give the same output bits too. The FMAs the sync kernel
# writes itself (fma.rn.f32, kernel.py "Arithmetic") are rounded once in either.
ENABLE_FP_FUSION = False
PDL_MIN_CAPABILITY = 90  # griddepcontrol (programmatic dependent launch) is sm_90 PTX
# sync, up to this many tokens: every row a program reads asked of L2 at entry, before the PDL wait (kernel.py
# PREFETCH), where few programs each wait on their loads: kernel 3.85 / 4.0 us at T = 1 / 8 against 4.2 / 4.85 asked
# after the wait, 5.20 / 5.80 never asked (sync-1024-w4-cluster on the H200); 4.45 / 5.31 us at T = 12 / 16 against
# 5.09 / 6.07 never asked (H100); from 24 tokens on it costs (docs/perf.md, "The Triton kernel").
PREFETCH_MAX_T = 16
# sync, up to this many tokens: a program loads every row it reads before any arithmetic (kernel.py _rows_first,
# LOADS_FIRST) where they fit in LOADS_FIRST_REGISTERS registers a thread (bf16 pairs: 112 at R = 16, NB = 8 and 8
# columns a thread). Pipelined on the H200 (docs/perf.md): sync-256-w1 4.65-4.76 / 5.29-5.34 us at T = 1 / 8 against
# 4.90-4.92 / 5.67-5.78 loading among the sums, sync-1024-w4-cluster 3.38-3.57 / 3.77-3.85 against 3.53-3.59 /
# 3.85-3.93; at T = 64 (448 programs, 165 registers a thread) it cost 40-50 %.
LOADS_FIRST_MAX_T = 8
LOADS_FIRST_REGISTERS = 128
# sync, a token of at most this many chunks: after each meeting every thread adds the chunks' records itself (2 * ROWS
# + 2 lanes each, chunk order) and computes the weights as scalars, where the tile form reduces them across the
# program's threads (2 barriers and a layout change through shared memory). sync-1024-w4-cluster, pipelined, on an
# H100 (docs/perf.md, "Thread sums"): 3.17-3.20 / 3.58-3.59 us at T = 1 / 8 against 3.42-3.45 / 3.86, 11.71
# against 11.59 at T = 64. The cluster configurations have at most CLUSTER_MAX chunks; sync-256-w1 (28 chunks at
# H = 7168, one warp: no barrier to save) would add 28 records a thread.
THREAD_SUMS_MAX_CHUNKS = 8


@dataclasses.dataclass(frozen=True)
class Variant:
    kind: str  # "sync", "row" or "tile"
    block: int  # sync: columns per program; otherwise 0 (the whole row)
    sub: int  # tile: columns per [SOURCES, sub] tile; otherwise 0
    num_warps: int
    reload: bool = False  # sync: the blocks read again after the first barrier, not held in registers
    max_registers: int | None = None  # a thread's register cap (ptxas .maxnreg): more programs per SM
    cluster: bool = False  # sync: a token's programs in one thread block cluster, its barrier theirs

    @property
    def name(self) -> str:
        parts = [self.kind, *(str(n) for n in (self.block or self.sub,) if n), f"w{self.num_warps}"]
        parts += ["reload"] if self.reload else []
        parts += ["cluster"] if self.cluster else []
        return "-".join(parts + ([f"r{self.max_registers}"] if self.max_registers else []))


# The configuration by T: the first (largest T, variant) whose bound holds. Chosen by kernel time at
# the production shape (R = 16, NB = 8, H = 7168) on the H200; docs/perf.md, "The Triton kernel".
BY_TOKENS = (
    # 28 one-warp programs a token: no cross-warp reductions (bar.sync pairs); 6.7 µs at T = 1, sync-512-w4 7.8
    (8, Variant("sync", 256, 0, 1)),
    # 4 programs of 8 warps holding their blocks: 13.0 µs at T = 64, where reading them again costs 14.2-14.7
    (64, Variant("sync", 2048, 0, 8)),
    # 7 programs of 4 warps, the blocks read again after barrier 1, 64 registers: 8 programs per SM; 416 µs at
    # T = 4096, 510 holding the blocks
    (math.inf, Variant("sync", 1024, 0, 4, reload=True, max_registers=64)),
)
# A token's programs must all fit on the GPU: where H is more than SYNC_MAX_CHUNKS chunks of the entry's
# block, the first wider one that fits.
WIDER_SYNC = (
    Variant("sync", 512, 0, 4),  # H <= 16384
    Variant("sync", 1024, 0, 4),  # H <= 32768
    BY_TOKENS[1][1],  # sync-2048-w8, H <= 65536
)
# No sync configuration fits (T > SYNC_MAX_TOKENS, or H too wide): one program per token, as many as fill the GPU.
ROW = Variant("row", 0, 0, 16)  # the row in registers: 16 warps, 110 registers a thread (8 warps: 255, spilling)
WIDE_ROW = Variant("tile", 0, 512, 8)  # ROW's place where H > ROW_MAX_H: two passes over tiles, few registers
# Where the launch can use thread block clusters (CLUSTER_CAPABILITIES): the first of these whose bound on T holds
# and that fits H (at most CLUSTER_MAX programs a token: 7 and 4 at H = 7168), else the rule above. The cluster's
# exchange (kernel.py) replaces the arrival counters and the records in global memory, at the same bits. Measured on
# the H200 (docs/perf.md, "The Triton kernel"; pipelined, one process): four warps 3.25 / 3.85 / 9.87 us at T = 1 / 8 /
# 64; two warps, the earlier choice from 33 to 64 tokens, 10.05 at T = 64 (a thread's 16 columns make its FMA chains
# spill into a layout change through shared memory, 255 registers); eight warps 3.65 / 4.24 / 17.0; from T = 512 on
# the blocks read again after the first barrier and 64 registers (as BY_TOKENS's last entry, 8 programs per SM): 58.8
# / 393 us at T = 512 / 4096.
CLUSTERED = (
    (64, Variant("sync", 1024, 0, 4, cluster=True)),
    (64, Variant("sync", 2048, 0, 8, cluster=True)),
    (math.inf, Variant("sync", 1024, 0, 4, reload=True, max_registers=64, cluster=True)),
)
# Every configuration the rule takes, by name, and each cluster configuration's counterpart without clusters (the
# tests hold the two to the same bits). The launchers' `variant` parameter names one in place of the rule's choice:
# the tests need it to run the row and tile kernels and the other sync configurations.
VARIANTS = {
    v.name: v
    for v in (
        *(v for _, v in BY_TOKENS), *WIDER_SYNC, ROW, WIDE_ROW,
        *(v for _, v in CLUSTERED), *(dataclasses.replace(v, cluster=False) for _, v in CLUSTERED),
    )
}  # fmt: skip


def default_variant(T: int, H: int, clusters: bool = False) -> str:
    """The configuration the launchers take for T tokens of hidden size H: with `clusters` (the
    launch can use them) the first of CLUSTERED whose bound holds and that fits; else
    BY_TOKENS's; past its bounds the first of WIDER_SYNC that fits, else ROW (WIDE_ROW where H is
    too wide for a row in registers)."""
    if clusters:
        fits = [v for bound, v in CLUSTERED if T <= bound and not _sync_limit(v, T, H)]
        if fits:
            return fits[0].name
    chosen = next(variant for bound, variant in BY_TOKENS if T <= bound)
    if _sync_limit(chosen, T, H):
        fits = [v for v in WIDER_SYNC if v.block > chosen.block and not _sync_limit(v, T, H)]
        chosen = fits[0] if fits else WIDE_ROW if H > ROW_MAX_H else ROW
    return chosen.name


def _sync_limit(chosen: Variant, T: int, H: int) -> str | None:
    """Why the sync configuration `chosen` cannot run T tokens of H, or None."""
    if chosen.cluster and -(-H // chosen.block) > CLUSTER_MAX:
        return (
            f"runs H / {chosen.block} programs per token in one cluster, at most {CLUSTER_MAX}: "
            f"H <= {CLUSTER_MAX * chosen.block}; got H={H} (take a wider one)"
        )
    if -(-H // chosen.block) > SYNC_MAX_CHUNKS:
        return (
            f"runs H / {chosen.block} programs per token that wait for each other, at most {SYNC_MAX_CHUNKS}: "
            f"H <= {SYNC_MAX_CHUNKS * chosen.block}; got H={H} (take a wider one)"
        )
    if T > SYNC_MAX_TOKENS:
        return f"puts the tokens on the grid's second axis, T <= {SYNC_MAX_TOKENS} (CUDA's bound); got T={T}"
    return None


def choose(variant: str | None, T: int, H: int, clusters: bool = False) -> Variant:
    """The named configuration (None: default_variant's), or a ValueError naming `variant`.
    `clusters`: whether the launch can use thread block clusters."""
    name = default_variant(T, H, clusters) if variant is None else variant
    if name not in VARIANTS:
        raise ValueError(f"variant: expected None or one of {sorted(VARIANTS)}, got {variant!r}")
    chosen = VARIANTS[name]
    if chosen.kind == "row" and H > ROW_MAX_H:
        raise ValueError(
            f"variant: {name!r} holds a row in registers, H <= {ROW_MAX_H}; got H={H} (take {WIDE_ROW.name!r})"
        )
    if chosen.cluster and not clusters:
        raise ValueError(
            f"variant: {name!r} runs in thread block clusters, which the launchers use on compute capability "
            f"{', '.join(f'{c // 10}.{c % 10}' for c in sorted(CLUSTER_CAPABILITIES))} (the package's launch or "
            "the PyTorch launch, not jax_triton); take the configuration without '-cluster'"
        )
    limit = _sync_limit(chosen, T, H) if chosen.kind == "sync" else None
    if limit:
        raise ValueError(f"variant: {name!r} {limit}")
    return chosen


def use_pdl(requested: bool | None, capable: bool, needs: str) -> bool:
    """Whether a launcher starts the sync kernel with PDL: `requested`, or (None) whether it
    can; a request it cannot meet is a ValueError saying what it `needs`."""
    if requested and not capable:
        raise ValueError(f"pdl: programmatic dependent launch needs {needs}")
    return capable if requested is None else bool(requested)


def unsupported_reason(R: int) -> str | None:
    if R > MAX_RANKS:
        return f"the Triton kernel unrolls the rank sum: R <= {MAX_RANKS}, got R={R}"
    return None


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Launch:
    kernel: str  # a kernel of kernel.py
    grid: tuple[int, ...]
    constexprs: tuple[tuple[str, object], ...]  # sorted (name, value): hashable
    num_warps: int
    max_registers: int | None = None
    pdl: bool = False  # launched with programmatic dependent launch (the kernel waits: its PDL constexpr)
    cluster: int = 0  # programs per thread block cluster along the grid's first axis; 0: no clusters

    @property
    def exchange(self) -> int:
        """Bytes of dynamic shared memory past the compiled kernel's own: the cluster's exchange
        (kernel.py, "The cluster's exchange"; the sync kernel's EXCHANGE constexpr), 0 elsewhere."""
        return dict(self.constexprs).get("EXCHANGE", 0)

    def dynamic_smem(self, shared: int) -> int:
        """The launch's dynamic shared memory where the compiled kernel uses `shared` bytes: those,
        to a 16-byte boundary (the exchange, addressed from the end, has 8-byte barriers and
        records read 16 bytes at a time), then the exchange."""
        return -(-shared // 16) * 16 + self.exchange if self.exchange else shared

    def options(self) -> dict:
        """The compile options both launchers pass (their defaults differ otherwise)."""
        options = dict(num_warps=self.num_warps, num_stages=NUM_STAGES, enable_fp_fusion=ENABLE_FP_FUSION)
        options |= {"maxnreg": self.max_registers} if self.max_registers else {}
        return options | ({"launch_pdl": True} if self.pdl else {})


@dataclasses.dataclass(frozen=True)
class Plan:
    variant: Variant
    launch: Launch  # a call is one launch
    stats_shape: tuple[int, ...] | None = None  # sync: the f32 scratch [T, C, record] its programs meet in
    arrivals_shape: tuple[int, ...] | None = None  # sync: its barriers' int32 counters [T, 2], zero at launch
    # (sync-*-cluster: no arrivals, the kernel's `arrivals` pointer a placeholder it never reads; launched whole it
    # reads no stats either, its programs meet in shared memory, but the interpreter's stages do)

    def stages(self) -> tuple[Launch, ...]:
        """The launch as Triton's interpreter runs it: sync as the stretches between its
        barriers, one launch each (PHASE 1, 2, 3; no PDL there); otherwise the launch itself."""
        if self.launch.kernel != "sync_kernel":
            return (self.launch,)
        constexprs = dict(self.launch.constexprs, PDL=False, CLUSTER=False, EXCHANGE=0, PREFETCH=False)
        return tuple(
            dataclasses.replace(
                self.launch, constexprs=tuple(sorted({**constexprs, "PHASE": phase}.items())), pdl=False, cluster=0
            )
            for phase in (1, 2, 3)
        )


def record_lanes(rows: int, chunks: int, yy_warps: int = 0) -> int:
    """The f32 lanes of a sync program's record (kernel.sync_kernel): the blocks' dots and
    squares (rows each, rows a power of two >= 2), p.w, p.p, then y.y: one lane, or (`yy_warps`,
    the kernel's YY_WARPS) one lane per warp from the next 16-byte word. Where every thread adds
    the records itself (thread_sums) a record is padded to a whole number of 16-byte words (the
    kernel reads its lanes four at a time)."""
    if yy_warps:
        return (2 * rows + 2 + 3) // 4 * 4 + (yy_warps + 3) // 4 * 4
    return 2 * rows + (4 if thread_sums(chunks) else 3)


def exchange_bytes(chunks: int, rows: int, yy_warps: int = 0) -> int:
    """The cluster's exchange (kernel.py): two 8-byte transaction barriers, then the C records,
    from a 16-byte boundary (the kernel addresses them from the end)."""
    return (chunks * record_lanes(rows, chunks, yy_warps) * 4 + 15) // 16 * 16 + 16


def yy_warps(variant: Variant, chunks: int) -> int:
    """The kernel's YY_WARPS: where every thread adds the records itself (thread_sums) and the
    blocks stay in registers (not RELOAD), each warp's y.y is a lane of its own (the number of
    warps), added over the chunks and warps in every thread, so that no reduction across the
    program's warps precedes the second meeting; 0 elsewhere (one y.y lane a program)."""
    return variant.num_warps if thread_sums(chunks) and not variant.reload else 0


def thread_sums(chunks: int) -> bool:
    """Whether every thread of a sync program adds the records over the chunks itself after a
    meeting (kernel.sync_kernel THREAD_SUMS): up to THREAD_SUMS_MAX_CHUNKS chunks."""
    return chunks <= THREAD_SUMS_MAX_CHUNKS


def lanes(variant: Variant) -> int:
    """The columns a sync program's thread holds (the kernel's LANES: its dot products' FMA chains)."""
    return variant.block // (32 * variant.num_warps)


def loads_first(variant: Variant, R: int, T: int, NB: int) -> bool:
    """Whether a sync program loads every row it reads before any arithmetic (kernel.py
    _rows_first): few tokens (LOADS_FIRST_MAX_T), the rows fitting in LOADS_FIRST_REGISTERS
    registers a thread (R + NB + 4 rows of block / (32 * num_warps) bf16 each), the blocks held."""
    fits = (R + NB + 4) * lanes(variant) // 2 <= LOADS_FIRST_REGISTERS
    return variant.kind == "sync" and not variant.reload and T <= LOADS_FIRST_MAX_T and fits


@functools.lru_cache(maxsize=256)  # eager PyTorch calls ask for the same plan again and again
def make(
    R: int,
    T: int,
    NB: int,
    H: int,
    *,
    eps: float,
    out_eps: float,
    has_delta: bool,
    groups: int,
    xmoe_replicas: int,
    variant: str | None = None,
    pdl: bool = False,
    clusters: bool = False,
    own: int | None = None,
) -> Plan:
    """The launch of one call (arguments already checked, api.check_arguments). `variant`: a
    name of VARIANTS in place of default_variant's (for the tests). `pdl`: launch the sync kernel
    with programmatic dependent launch (only for a GPU of PDL_MIN_CAPABILITY or newer; the other
    kernels are launched without). `clusters`: the launch uses thread block clusters (a GPU of
    CLUSTER_CAPABILITIES through the package's launch or the PyTorch launch, or Triton's
    interpreter, which runs the sync kernel's stretches as launches of their own): the default
    takes a cluster configuration at small T, and only then may `variant` name one. `own`: the
    mailbox slot whose partial the launch passes as its last pointer, `own` [T, H], read there
    in place of the slot (the constexpr OWN; None: OWN = -1 and the kernels' `own` parameter the
    constexpr None, so that launch compiles as if the parameter were not there)."""
    chosen = choose(variant, T, H, clusters)
    shared = dict(R=R, NB=NB, H=H, GROUPS=groups, HAS_DELTA=bool(has_delta), OWN=-1 if own is None else int(own))
    shared |= dict(own=None) if own is None else {}
    shared |= dict(REPS=xmoe_replicas, EPS=float(eps), OUT_EPS=float(out_eps))
    launch = lambda kernel, grid, constexprs, pdl=False: Launch(  # noqa: E731
        kernel, grid, tuple(sorted(constexprs.items())), chosen.num_warps, chosen.max_registers, pdl
    )
    if chosen.kind == "row":
        return Plan(chosen, launch("row_kernel", (T,), dict(shared, BLOCK=max(16, _pow2(H)))))
    if chosen.kind == "tile":
        return Plan(chosen, launch("tile_kernel", (T,), dict(shared, SUB=chosen.sub, SOURCES=SOURCES)))
    chunks = -(-H // chosen.block)
    # the blocks' tile, >= 2 rows (the mix is a chain of FMAs over a thread's rows, kernel._fma_lanes)
    rows = max(2, _pow2(NB))
    span = dict(BLOCK=chosen.block, ROWS=rows, CHUNKS=chunks, SPAN=_pow2(chunks), THREAD_SUMS=thread_sums(chunks))
    warps = yy_warps(chosen, chunks)
    record = record_lanes(rows, chunks, warps)
    span |= dict(RECORD=record, YY_WARPS=warps, EXCHANGE=exchange_bytes(chunks, rows, warps) if chosen.cluster else 0)
    whole = dict(shared, **span, POLLS=SYNC_POLLS, PHASE=0, RELOAD=chosen.reload, PDL=bool(pdl), CLUSTER=chosen.cluster)
    whole |= dict(PREFETCH=T <= PREFETCH_MAX_T, LOADS_FIRST=loads_first(chosen, R, T, NB), LANES=lanes(chosen))
    kernel = dataclasses.replace(
        launch("sync_kernel", (chunks, T), whole, bool(pdl)), cluster=chunks if chosen.cluster else 0
    )
    return Plan(chosen, kernel, stats_shape=(T, chunks, record), arrivals_shape=None if chosen.cluster else (T, 2))


def repair_cache_dir() -> None:
    """jax_triton (0.3.1) sets TRITON_CACHE_DIR="" on import; Triton's JIT (the PyTorch launches)
    then refuses to compile ("Could not create or locate cache dir"). An empty value is dropped,
    so Triton takes its default again; jax_triton compiles without the cache either way."""
    if os.environ.get("TRITON_CACHE_DIR") == "":
        del os.environ["TRITON_CACHE_DIR"]
