"""How the Triton consumer is launched: its variants, the rule that picks one by T (the one
place it is decided), and the launch parameters.

torch_launch.py and backend.py both launch from a `Plan`, so a PyTorch call and a JAX call of
the same shape compile the same kernel with the same constexprs and options, and give the same
bits. No JAX, no PyTorch here.

Variants (kernel.py has the kernels), named kind-columns-warps:
  row-w{8,16,32}  row_kernel: one program per token holds the whole row (next power of two >= H
                  lanes) in registers, one pass over memory. At R=16 NB=8 ptxas
                  gives row-w8 255 registers a thread (and spills), row-w16 110, row-w32 64: one
                  program per SM each, with 8, 16 or 32 warps in flight.
  tile-*          tile_kernel: one program per token, two passes over `sub`-column tiles (the
                  second re-reads the blocks and the new prefix, from L2 while the programs in
                  flight fit there); few registers, so several programs share an SM.
  split-*         split_sum_kernel then split_out_kernel, grid (T, C): C programs per token,
                  each owning `block` columns; the chunks' dot products meet in a scratch
                  buffer. For small T, where one program per token would leave most SMs idle.
  sync-*          sync_kernel, grid (C, T): C programs per token in one launch, meeting at two
                  barriers (int32 arrival counters that the launch zeroes); each program
                  keeps its blocks ([pow2(NB), block]) and prefix in registers throughout, and
                  no Gram matrix: the weights from the chunks' dots and squares, then y.y from
                  their y. C <= SYNC_MAX_CHUNKS, so a token's programs fit on the GPU at once;
                  T <= SYNC_MAX_TOKENS (the grid's second axis); the default rule takes a row
                  variant past either bound.
                  Triton's interpreter runs it as three launches, the stretches between the
                  barriers.
  sync-*-reload   the same, but the blocks are read again after the first barrier (from L1 or
                  L2, where the first read left them) instead of held in registers across it:
                  fewer registers a thread, more programs per SM.
  *-r64           compiled with a cap of 64 registers a thread (ptxas .maxnreg), for occupancy.

The sync kernel leaves its arrival counters at zero (the last arrival resets them), so a caller
may keep one set from call to call instead of zeroing it before each launch. On sm_90 and newer
the launchers start it with programmatic dependent launch (`pdl`): its launch overlaps the end of
the kernel ahead of it, whose writes it waits for before reading anything.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

SOURCES = 16  # rows of the tile and split kernels' source tiles: NB + 1 <= 9, padded (tl.dot takes >= 16)
ROW_MAX_H = 16384  # row: a whole row lives in registers; above this the tile and split variants run
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
NUM_STAGES = 1  # no software-pipelined loops in these kernels
# No FMA contraction anywhere: the prefix path is adds only, and with contraction off the PTX
# carries .rn on every f32 mul/add, so the CUDA driver's JIT (JAX) and ptxas (PyTorch) emit the
# same arithmetic and the two launches give the same output bits too.
ENABLE_FP_FUSION = False
PDL_MIN_CAPABILITY = 90  # griddepcontrol (programmatic dependent launch) is sm_90 PTX


@dataclasses.dataclass(frozen=True)
class Variant:
    kind: str  # "row", "tile", "split" or "sync"
    block: int  # split, sync: columns per program; otherwise 0 (the whole row)
    sub: int  # tile, split: columns per [SOURCES, sub] tile; sync: unused (= block); row: 0
    num_warps: int
    reload: bool = False  # sync: the blocks read again after the first barrier, not held in registers
    max_registers: int | None = None  # a thread's register cap (ptxas .maxnreg): more programs per SM

    @property
    def name(self) -> str:
        parts = [self.kind, *(str(n) for n in (self.block or self.sub,) if n), f"w{self.num_warps}"]
        parts += ["reload"] if self.reload else []
        return "-".join(parts + ([f"r{self.max_registers}"] if self.max_registers else []))


VARIANTS = {
    v.name: v
    for v in (
        Variant("row", 0, 0, 8),
        Variant("row", 0, 0, 16),
        Variant("row", 0, 0, 32),  # 64 registers a thread (ptxas) instead of 110: 32 warps per SM, not 16
        Variant("tile", 0, 256, 4),
        Variant("tile", 0, 512, 8),
        Variant("split", 128, 128, 4),
        Variant("split", 256, 256, 4),
        Variant("split", 512, 256, 4),
        Variant("split", 1024, 256, 4),
        Variant("split", 2048, 512, 8),
        Variant("sync", 256, 256, 1),
        Variant("sync", 256, 256, 2),
        Variant("sync", 512, 512, 1),
        Variant("sync", 512, 512, 2),
        Variant("sync", 256, 256, 4),
        Variant("sync", 512, 512, 4),
        Variant("sync", 512, 512, 8),
        Variant("sync", 1024, 1024, 4),
        Variant("sync", 1024, 1024, 8),
        Variant("sync", 2048, 2048, 8),
        Variant("sync", 2048, 2048, 16),
        Variant("sync", 512, 512, 2, reload=True),
        Variant("sync", 512, 512, 4, reload=True),
        Variant("sync", 1024, 1024, 2, reload=True),
        Variant("sync", 1024, 1024, 4, reload=True),
        Variant("sync", 2048, 2048, 4, reload=True),
        Variant("sync", 2048, 2048, 8, reload=True),
        # ptxas fits these in 64 registers without spilling (72 and 74 uncapped): 8 programs of 4
        # warps, or 4 of 8, per SM instead of 7 or 3
        Variant("sync", 512, 512, 2, reload=True, max_registers=64),
        Variant("sync", 1024, 1024, 4, reload=True, max_registers=64),
        Variant("sync", 2048, 2048, 8, reload=True, max_registers=64),
    )
}

# The default rule: the first (largest T, variant) whose bound holds. Chosen by kernel time on
# the H200 (benchmarks/triton_gpu.py, every variant at each T; docs/perf.md): a token's row split
# over programs that meet at barriers (sync): up to 8 tokens 28 one-warp programs, up to 64 4
# programs of 8 warps, above that 7 programs of 4 warps that read the blocks again after the
# first barrier, in 64 registers a thread (8 programs per SM: the occupancy that many tokens need).
RULE = ((8, "sync-256-w1"), (64, "sync-2048-w8"), (math.inf, "sync-1024-w4-reload-r64"))
WIDE_ROW = "tile-512-w8"  # in place of a row variant where H > ROW_MAX_H
# in place of RULE's sync variant past its bounds (_sync_limit): a wider one where H has too many
# chunks for it, else (too many tokens) a row variant
SYNC_WIDER = ("sync-512-w4", "sync-1024-w4", "sync-2048-w8")
SYNC_FALLBACK = "row-w16"


def default_variant(T: int, H: int) -> str:
    """The variant the launchers take for T tokens of hidden size H when none is named: RULE's;
    past a sync variant's bounds the first of SYNC_WIDER that fits, else SYNC_FALLBACK; where H
    is too wide for a row in registers, one program per token over tiles (WIDE_ROW)."""
    name = next(name for bound, name in RULE if T <= bound)
    chosen = VARIANTS[name]
    if chosen.kind == "sync" and _sync_limit(chosen, T, H):
        fits = [n for n in SYNC_WIDER if VARIANTS[n].block > chosen.block and not _sync_limit(VARIANTS[n], T, H)]
        name = fits[0] if fits else SYNC_FALLBACK
        chosen = VARIANTS[name]
    return WIDE_ROW if H > ROW_MAX_H and chosen.kind == "row" else name


def _sync_limit(chosen: Variant, T: int, H: int) -> str | None:
    """Why the sync variant `chosen` cannot run T tokens of H, or None."""
    if -(-H // chosen.block) > SYNC_MAX_CHUNKS:
        return (
            f"runs H / {chosen.block} programs per token that wait for each other, at most {SYNC_MAX_CHUNKS}: "
            f"H <= {SYNC_MAX_CHUNKS * chosen.block}; got H={H} (take a wider sync or a split one)"
        )
    if T > SYNC_MAX_TOKENS:
        return f"puts the tokens on the grid's second axis, T <= {SYNC_MAX_TOKENS} (CUDA's bound); got T={T}"
    return None


def choose(variant: str | None, T: int, H: int) -> Variant:
    """The named variant (None: the default rule), or a ValueError naming `variant`."""
    name = default_variant(T, H) if variant is None else variant
    if name not in VARIANTS:
        raise ValueError(f"variant: expected None or one of {sorted(VARIANTS)}, got {variant!r}")
    chosen = VARIANTS[name]
    if chosen.kind == "row" and H > ROW_MAX_H:
        raise ValueError(
            f"variant: {name!r} holds a row in registers, H <= {ROW_MAX_H}; got H={H} (take a tile or split one)"
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

    def options(self) -> dict:
        """The compile options both launchers pass (their defaults differ otherwise)."""
        options = dict(num_warps=self.num_warps, num_stages=NUM_STAGES, enable_fp_fusion=ENABLE_FP_FUSION)
        options |= {"maxnreg": self.max_registers} if self.max_registers else {}
        return options | ({"launch_pdl": True} if self.pdl else {})


@dataclasses.dataclass(frozen=True)
class Plan:
    variant: Variant
    launches: tuple[Launch, ...]  # in order; split: the sum kernel, then the output kernel
    stats_shape: tuple[int, ...] | None  # split, sync: the f32 scratch [T, C, record] between the halves
    arrivals_shape: tuple[int, ...] | None = None  # sync: its barriers' int32 counters [T, 2], zero at launch

    def stages(self) -> tuple[Launch, ...]:
        """sync: its launch as the stretches between its barriers, one launch each (PHASE 1, 2,
        3), for Triton's interpreter (no PDL there); otherwise the launches."""
        if self.arrivals_shape is None:
            return self.launches
        (whole,) = self.launches
        constexprs = dict(whole.constexprs, PDL=False)
        return tuple(
            dataclasses.replace(whole, constexprs=tuple(sorted({**constexprs, "PHASE": phase}.items())), pdl=False)
            for phase in (1, 2, 3)
        )


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
) -> Plan:
    """The launches of one call (arguments already checked, api.check_arguments). `pdl`: launch
    the sync kernel with programmatic dependent launch (only for a GPU of PDL_MIN_CAPABILITY or
    newer; the other kernels are launched without)."""
    chosen = choose(variant, T, H)
    shared = dict(NB=NB, H=H)
    sums = dict(shared, R=R, GROUPS=groups, HAS_DELTA=bool(has_delta))
    outs = dict(shared, REPS=xmoe_replicas, EPS=float(eps), OUT_EPS=float(out_eps))
    launch = lambda kernel, grid, constexprs, pdl=False: Launch(  # noqa: E731
        kernel, grid, tuple(sorted(constexprs.items())), chosen.num_warps, chosen.max_registers, pdl
    )
    if chosen.kind == "row":
        return Plan(chosen, (launch("row_kernel", (T,), dict(sums, **outs, BLOCK=max(16, _pow2(H)))),), None)
    tiles = dict(SUB=chosen.sub, SOURCES=SOURCES)
    if chosen.kind == "tile":
        return Plan(chosen, (launch("tile_kernel", (T,), dict(sums, **outs, **tiles)),), None)
    chunks = -(-H // chosen.block)
    if chosen.kind == "sync":
        # the blocks' tile, >= 2 rows (the weights read p.w and p.p as lanes 0 and 1 of a [C, rows]
        # tile); kernel.sync_kernel's record has 2 * rows + 3 lanes
        rows = max(2, _pow2(NB))
        span = dict(BLOCK=chosen.block, ROWS=rows, CHUNKS=chunks, SPAN=_pow2(chunks))
        whole = dict(sums, **outs, **span, POLLS=SYNC_POLLS, PHASE=0, RELOAD=chosen.reload, PDL=bool(pdl))
        scratch = dict(stats_shape=(T, chunks, 2 * rows + 3), arrivals_shape=(T, 2))
        return Plan(chosen, (launch("sync_kernel", (chunks, T), whole, bool(pdl)),), **scratch)
    tiles["BLOCK"] = chosen.block
    first = launch("split_sum_kernel", (T, chunks), dict(sums, **tiles))
    second = launch("split_out_kernel", (T, chunks), dict(outs, **tiles, CHUNKS=chunks))
    return Plan(chosen, (first, second), (T, chunks, SOURCES + SOURCES * SOURCES))


def repair_cache_dir() -> None:
    """jax_triton (0.3.1) sets TRITON_CACHE_DIR="" on import; Triton's JIT (the PyTorch launches)
    then refuses to compile ("Could not create or locate cache dir"). An empty value is dropped,
    so Triton takes its default again; jax_triton compiles without the cache either way."""
    if os.environ.get("TRITON_CACHE_DIR") == "":
        del os.environ["TRITON_CACHE_DIR"]
