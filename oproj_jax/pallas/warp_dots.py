"""Many row dot products at once, reduced only within each warp (inline Mosaic GPU).

`jnp.sum` of a warpgroup-strided array reduces over all 128 threads: a shuffle tree, then a
shared-memory round and a warpgroup barrier, one reduction after the other. The cluster path
needs 2 * (NB + 1) such dots before its first exchange, and that chain of barriers cost more
than the exchange itself. Here every thread forms its partial of every dot, the K shuffle
trees run side by side (independent, so they pipeline), and lane results go straight to
shared memory: dot k of warp w lands at out[k * WARPS + w]. The warps' and CTAs' partials are
then added by the cluster exchange, which reads shared memory anyway (consumer.py).

Mosaic GPU only: interpret mode cannot run inline Mosaic code, and the cluster path that uses
this is GPU-only too.
"""

from __future__ import annotations

from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref, vector

WARPS = 4  # warps of the warpgroup that runs the kernel body


def _tree(op, values):  # pairwise: a short dependency chain
    while len(values) > 1:
        values = [op(values[i], values[i + 1]) if i + 1 < len(values) else values[i]
                  for i in range(0, len(values), 2)]
    return values[0]


def _elements(reg):
    [n] = ir.VectorType(reg.type).shape
    return [vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))
            for i in range(n)]


def warp_dots(pairs, out, layout) -> None:
    """out[k * WARPS + w] = sum over warp w's elements of a_k * b_k, for pairs [(a_k, b_k)] of
    f32 arrays in `layout` (a plgpu layout); out: a [>= WARPS * len(pairs)] f32 shared ref."""
    if WARPS * len(pairs) > out.shape[0]:
        raise ValueError(f"out: needs {WARPS * len(pairs)} f32 slots for {len(pairs)} dots, has {out.shape[0]}")
    flat = [array for pair in pairs for array in pair]

    @plgpu.inline_mgpu(arg_types=(tuple(layout for _ in flat), plgpu.RefType()))
    def emit(ctx, arrays, ref):
        del ctx
        index = ir.IndexType.get()
        i32 = ir.IntegerType.get_signless(32)
        warp = mgpu_utils.warp_idx(sync=True)
        warp = arith.remui(warp, mgpu_utils.c(WARPS, i32))
        sums = []
        for a, b in zip(arrays[::2], arrays[1::2]):
            products = [arith.mulf(x, y) for x, y in zip(a.registers.flat, b.registers.flat)]
            sums.append(_tree(arith.addf, [e for reg in products for e in _elements(reg)]))
        for distance in (16, 8, 4, 2, 1):  # one butterfly step of every dot, then the next
            sums = [arith.addf(s, mgpu_utils.shfl_bfly(s, distance)) for s in sums]
        for k, s in enumerate(sums):  # every lane holds the warp's sum: all store the same word
            slot = arith.addi(mgpu_utils.c(k * WARPS, i32), warp)
            memref.store(s, ref, [arith.index_cast(index, slot)])

    emit(tuple(flat), out)
