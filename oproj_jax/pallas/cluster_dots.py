"""Row dot products summed over a cluster: warp sums, then a push through DSMEM (inline Mosaic GPU).

`jnp.sum` of a warpgroup-strided array reduces over all 128 threads: a shuffle tree, then a
shared-memory round and a warpgroup barrier, one reduction after the other. The cluster path
needs 2 * (NB + 1) such dots, then y.y, each summed over the CTAs of the cluster. Here:

1. every thread forms its partial of every dot, and the K shuffle trees run side by side
   (independent, so they pipeline); warp w's sum of dot k lands at part[base + k * 4 + w];
2. after one warpgroup barrier, thread i < K * split adds the 4 warps' sums of dot k = i //
   split and delivers the CTA's total to CTA peer = i % split, into the peer's recv[me, col + k]:
   st.async completing the peer's mbarrier for this round (to itself: st.shared plus one
   arrival), the verified DSMEM pattern of the CuTe kernel;
3. every thread waits on its own mbarrier; thread k < K adds the CTAs' totals in CTA order into
   part[TOTALS + col + k], and after one more warpgroup barrier all threads read them.

Every CTA adds the same numbers in the same order, so all CTAs of a token use identical scalars.
Nothing is read from a peer's memory, so no cluster barrier sits between the rounds and none is
needed at exit: once a CTA's last round is complete no peer writes into it again. The rounds'
mbarriers live in the last row of `recv`; `init` sets them up, and one cluster barrier (arrive
at init, wait before the first push) makes them visible to the peers.

Mosaic GPU only: interpret mode cannot run inline Mosaic code, and the cluster path that uses
this is GPU-only too.
"""

from __future__ import annotations

from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref, vector

from oproj_jax import dsmem_ptx

WARPS = 4  # warps of the warpgroup that runs the kernel body
COLS = 32  # recv: f32 columns per source CTA (the dots of every round, side by side)
TOTALS = 128  # part: the cluster totals start here (the warp sums of all rounds come before)
PART = 256  # part: f32 slots


def recv_shape(split: int) -> tuple[int, int]:
    """recv: one row per source CTA, then a row holding the rounds' mbarriers (8 bytes each)."""
    return (split + 1, COLS)


def _tree(op, values):  # pairwise: a short dependency chain
    while len(values) > 1:
        values = [op(values[i], values[i + 1]) if i + 1 < len(values) else values[i] for i in range(0, len(values), 2)]
    return values[0]


def _elements(reg):
    [n] = ir.VectorType(reg.type).shape
    return [vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i])) for i in range(n)]


def _i32(value):
    return mgpu_utils.c(value, ir.IntegerType.get_signless(32))


def _smem_address(ref):  # the shared-window address (u32) of a shared-memory memref
    return llvm.ptrtoint(ir.IntegerType.get_signless(32), mgpu_utils.memref_ptr(ref))


def _barrier_address(recv, split: int, round_: int):
    return arith.addi(_smem_address(recv), _i32((split * COLS + 2 * round_) * 4))


def _index(value):
    return arith.index_cast(ir.IndexType.get(), value)


def init(recv, dots_per_round, split: int) -> None:
    """One mbarrier per round in recv's last row, expecting that round's dots from the peers;
    then this CTA arrives on the cluster barrier (`dots` of round 0 waits on it)."""
    if 2 * len(dots_per_round) > COLS:
        raise ValueError(f"dots_per_round: at most {COLS // 2} rounds, got {len(dots_per_round)}")

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def emit(ctx, recv_ref):
        del ctx
        with mgpu_utils.single_thread():
            for r, k in enumerate(dots_per_round):
                bar = _barrier_address(recv_ref, split, r)
                # one arrival for the expected bytes, one per dot this CTA delivers to itself
                mgpu_utils.inline_ptx(f"mbarrier.init.shared::cta.b64 [$0], {1 + k};", bar, has_side_effects=True)
            mgpu_utils.inline_ptx("fence.mbarrier_init.release.cluster;", has_side_effects=True)
            for r, k in enumerate(dots_per_round):
                bar = _barrier_address(recv_ref, split, r)
                mgpu_utils.inline_ptx(
                    "{ .reg .b64 state;"
                    f" mbarrier.arrive.expect_tx.shared::cta.b64 state, [$0], {(split - 1) * k * 4}; }}",
                    bar,
                    has_side_effects=True,
                )
        # relaxed: the fence above orders the initialization (a release arrive would also wait
        # for every memory access this thread has issued)
        mgpu_utils.inline_ptx("barrier.cluster.arrive.relaxed.aligned;", has_side_effects=True, convergent=True)

    emit(recv)


def dots(pairs, part, recv, layout, *, split: int, round_: int, base: int, col: int) -> None:
    """Cluster-wide dots a_k . b_k for pairs [(a_k, b_k)] of f32 arrays in `layout` (a plgpu
    layout), left in part[TOTALS + col + k]. part: [PART] f32 shared (this CTA only; warp sums
    at base..base + 4K); recv: recv_shape(split) f32 shared, written by the peers (columns
    col..col + K, this round's mbarrier). Round 0 first waits on the cluster barrier of `init`."""
    K = len(pairs)
    if base + WARPS * K > TOTALS:
        raise ValueError(
            f"part: the warp sums of {K} dots from {base} need {base + WARPS * K} slots, {TOTALS} are set aside"
        )
    if col + K > COLS or TOTALS + col + K > PART:
        raise ValueError(f"col: {K} dots from column {col} do not fit {COLS} columns")
    if K * split > WARPS * 32:
        raise ValueError(f"pairs: {K} dots to {split} CTAs need {K * split} threads, have {WARPS * 32}")
    flat = [array for pair in pairs for array in pair]

    @plgpu.inline_mgpu(arg_types=(tuple(layout for _ in flat), plgpu.RefType(), plgpu.RefType()))
    def emit(ctx, arrays, part_ref, recv_ref):
        del ctx
        thread = mgpu_utils.thread_idx()
        warp = arith.remui(mgpu_utils.warp_idx(sync=True), _i32(WARPS))
        sums = []
        for a, b in zip(arrays[::2], arrays[1::2]):
            products = [arith.mulf(x, y) for x, y in zip(a.registers.flat, b.registers.flat)]
            sums.append(_tree(arith.addf, [e for reg in products for e in _elements(reg)]))
        for distance in (16, 8, 4, 2, 1):  # one butterfly step of every dot, then the next
            sums = [arith.addf(s, mgpu_utils.shfl_bfly(s, distance)) for s in sums]
        for k, s in enumerate(sums):  # every lane holds the warp's sum: all store the same word
            memref.store(s, part_ref, [_index(arith.addi(_i32(base + k * WARPS), warp))])
        if round_ == 0:  # the peers' mbarriers are initialized (init) before anything is pushed
            mgpu_utils.inline_ptx("barrier.cluster.wait.acquire.aligned;", has_side_effects=True, convergent=True)
        mgpu_utils.warpgroup_barrier()  # the 4 warps' sums are in part

        me = mgpu_utils.inline_ptx("mov.u32 $0, %cluster_ctarank;", result_types=ir.IntegerType.get_signless(32))
        bar = _barrier_address(recv_ref, split, round_)
        with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.ult, thread, _i32(K * split))):
            k = arith.divui(thread, _i32(split))
            peer = arith.remui(thread, _i32(split))
            first = arith.addi(_i32(base), arith.muli(k, _i32(WARPS)))
            w = [memref.load(part_ref, [_index(arith.addi(first, _i32(j)))]) for j in range(WARPS)]
            total = arith.addf(arith.addf(w[0], w[1]), arith.addf(w[2], w[3]))
            slot = arith.addi(
                _smem_address(recv_ref),
                arith.muli(arith.addi(arith.muli(me, _i32(COLS)), arith.addi(k, _i32(col))), _i32(4)),
            )
            mgpu_utils.inline_ptx(dsmem_ptx.PUT_F32, slot, total, bar, peer, me, has_side_effects=True)
        # every peer's totals of this round have landed in recv
        mgpu_utils.inline_ptx(dsmem_ptx.WAIT_PHASE0, bar, has_side_effects=True)
        with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.ult, thread, _i32(K))):
            column = _index(arith.addi(thread, _i32(col)))
            total = memref.load(recv_ref, [_index(_i32(0)), column])
            for source in range(1, split):
                total = arith.addf(total, memref.load(recv_ref, [_index(_i32(source)), column]))
            memref.store(total, part_ref, [_index(arith.addi(thread, _i32(TOTALS + col)))])
        mgpu_utils.warpgroup_barrier()  # the totals are in part for every thread

    emit(tuple(flat), part, recv)
