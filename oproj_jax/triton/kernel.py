"""The consumer as Triton kernels (docs/spec.md, "Arithmetic"); no JAX and no PyTorch here.

torch_launch.py and backend.py launch them from the same plan.Plan. Pointers come first, inputs
then outputs (jax_triton passes output buffers after the inputs); everything static is a
constexpr. Offsets are int64 (R * T * H overflows int32 at large T).

  row_kernel         grid (T,): a token's whole row in one program's registers, one pass over
                     memory; the AttnRes softmax is folded in online (running max, denominator
                     and mix, docs/spec.md "Streaming form").
  tile_kernel        grid (T,): one program per token, two passes over column tiles: the rank
                     sum, the new prefix and the dot products s_i.w and Gram matrix s_i.s_j of
                     the NB + 1 sources (blocks, then the new prefix p), then the output from
                     the softmax weights alpha and y.y = alpha^T G alpha.
  sync_kernel        grid (C, T): C programs per token in one launch, meeting at two barriers
                     in global memory (arrival counters, zero at launch and left at zero): after the dot
                     products and squares of their chunks (for the weights), after y.y (for
                     the output scale); each keeps its blocks and prefix in registers. With
                     CLUSTER, launched in thread block clusters of its C programs, they send
                     their records into each other's shared memory and each waits for the
                     bytes it expects instead (no counters, no records in global memory).
                     With THREAD_SUMS (few chunks) every thread adds the records itself after
                     a meeting: no barrier between the threads there.

Which kernel runs, and its launch parameters: plan.py.

Rounding: bf16 <-> f32 conversions are done on the bits (to nearest, ties to even, by hand):
the GPU's cvt.rn.bf16.f32 rounds so too, Triton's interpreter truncates, and the interpreter
tests are to hold the bits the GPU gives. The sync kernel's compiled launch (PHASE 0) rounds its
output, and its prefix where it loads its rows first, with cvt.rn.bf16x2.f32 itself (the same
bits, one instruction for two values).

Arithmetic: no contraction (plan.ENABLE_FP_FUSION), so every f32 add and mul is rounded on its
own and the JAX and PyTorch launches compute the same bits. The sync kernel writes its FMAs: a
thread's dot products over its LANES columns and its mix over its blocks are chains of
fma.rn.f32 (_fma_lanes), the columns a thread holds split out of the tile without moving data.
"""

import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda


@triton.jit
def _widen(x):
    """bf16 -> f32, exact."""
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _round(x):
    """f32 -> the bits (uint16) of the nearest bf16, ties to even; a NaN stays a quiet NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    nearest = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, nearest).to(tl.uint16)


@triton.jit
def _round_to(x, CVT: tl.constexpr):
    """_round, or (CVT: compiled code, not Triton's interpreter) the GPU's cvt.rn.bf16x2.f32, one
    instruction for two values: the same bits for every number and infinity, a quiet NaN for NaN."""
    if CVT:
        return tl.inline_asm_elementwise(
            "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=tl.bfloat16, is_pure=True, pack=2
        ).to(tl.uint16, bitcast=True)
    return _round(x)


@triton.jit
def _split2(x):
    """[..., 2k] (k >= 2) -> its elements 0, 2, 4, ... and 1, 3, 5, ... along the last axis, two
    [..., k] tiles (where a thread holds the last axis, no data moves)."""
    return tl.split(tl.reshape(x, x.shape[:-1] + (x.shape[-1] // 2, 2)))


@triton.jit
def _fma2(a, b, acc):
    """acc + a0 * b0 + a1 * b1 over the last axis of [..., 2] tiles, two FMAs: [...]."""
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return tl.fma(a1, b1, tl.fma(a0, b0, acc))


@triton.jit
def _fma_lanes(a, b, acc, LANES: tl.constexpr):
    """acc + the sum of a * b over the last axis of [..., LANES] tiles (broadcast against each
    other), one chain of FMAs: [...]. LANES = 2, 4 or 8: elements a thread holds (the dot
    products over its columns, the mix over its blocks), so no data moves."""
    tl.static_assert(LANES == 2 or LANES == 4 or LANES == 8, "_fma_lanes: 2, 4 or 8 lanes")
    if LANES == 2:
        out = _fma2(a, b, acc)
    elif LANES == 4:
        a0, a1 = _split2(a)
        b0, b1 = _split2(b)
        out = _fma2(a1, b1, _fma2(a0, b0, acc))
    else:
        a0, a1 = _split2(a)
        b0, b1 = _split2(b)
        a00, a01 = _split2(a0)
        a10, a11 = _split2(a1)
        b00, b01 = _split2(b0)
        b10, b11 = _split2(b1)
        out = _fma2(a11, b11, _fma2(a10, b10, _fma2(a01, b01, _fma2(a00, b00, acc))))
    return out


@triton.jit
def _as_f32(bits):
    """bf16 bits (uint16) -> f32, exact."""
    return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _as_bf16(bits):
    return bits.to(tl.bfloat16, bitcast=True)


@triton.jit
def _partials(mailbox, own, t, T, offs, mask, R: tl.constexpr, H: tl.constexpr, OWN: tl.constexpr,
              VOLATILE: tl.constexpr = False):  # fmt: skip
    """Token t's R partials at `offs` (bf16), a tuple in rank order: mailbox slot r, or for r ==
    OWN the caller's own partial `own` [T, H], read in place (slot OWN is never read)."""
    parts = ()
    for r in tl.static_range(R):
        if r == OWN:
            row = own + t * H + offs
        else:
            row = mailbox + (r * T + t) * H + offs
        parts = parts + (tl.load(row, mask=mask, other=0.0, volatile=VOLATILE),)
    return parts


@triton.jit
def _prefix_bits(parts, old, R: tl.constexpr, GROUPS: tl.constexpr, HAS_DELTA: tl.constexpr, CVT: tl.constexpr = False):
    """The bits of the new prefix from the partials `parts` (_partials) and the old prefix `old`
    (bf16; unread without HAS_DELTA), rounded by _round_to(CVT). The f32 adds follow
    reference.rank_sum exactly (group g: ranks g*S .. g*S+S-1 left to right, then the groups in
    order): the prefix bits depend on it.
    Only adds on this path, so nothing can contract into an FMA. Producers publish -0.0 as +0.0
    (docs/spec.md, "Mailbox protocol"): the sum adds +0.0 last, which turns the -0.0 of a sum of
    -0.0s into +0.0 and leaves every other sum as it is (a -0.0 addend changes no other sum), so
    an all-zero rank sum is +0.0 on every backend."""
    PER_GROUP: tl.constexpr = (R + GROUPS - 1) // GROUPS
    for first in tl.static_range(0, R, PER_GROUP):
        group = _widen(parts[first])
        for r in tl.static_range(first + 1, first + PER_GROUP):
            if r < R:
                group = group + _widen(parts[r])
        if first == 0:
            total = group
        else:
            total = total + group
    reduced = _round_to(total + 0.0, CVT)  # ROUND 1: the reduced partials are bf16
    if HAS_DELTA:
        return _round_to(_widen(old) + _as_f32(reduced), CVT)  # ROUND 2: the prefix is bf16
    return reduced


@triton.jit
def _old_prefix(prefix_in, t, offs, mask, H: tl.constexpr, HAS_DELTA: tl.constexpr, VOLATILE: tl.constexpr = False):
    """Token t's old prefix at `offs` (bf16); zeros, and nothing read, without HAS_DELTA."""
    if HAS_DELTA:
        return tl.load(prefix_in + t * H + offs, mask=mask, other=0.0, volatile=VOLATILE)
    return tl.zeros(offs.shape, tl.bfloat16)


@triton.jit
def _new_prefix(
    mailbox,
    own,
    prefix_in,
    t,
    T,
    offs,
    mask,
    R: tl.constexpr,
    H: tl.constexpr,
    GROUPS: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    OWN: tl.constexpr,
):
    """The bits of the new prefix at `offs` of token t (_prefix_bits of the rows read here)."""
    parts = _partials(mailbox, own, t, T, offs, mask, R, H, OWN)
    return _prefix_bits(parts, _old_prefix(prefix_in, t, offs, mask, H, HAS_DELTA), R, GROUPS, HAS_DELTA)


@triton.jit
def _store_output(output, xmoe, t, T, offs, mask, y, REPS: tl.constexpr, H: tl.constexpr, CVT: tl.constexpr = False):
    bits = _round_to(y, CVT)  # ROUND 3: the output is bf16
    tl.store(output + t * H + offs, _as_bf16(bits), mask=mask)
    if REPS > 0:
        clean = _as_bf16(tl.where(bits == 0x8000, 0, bits).to(tl.uint16))  # xmoe: -0.0 written as +0.0
        for k in tl.static_range(REPS):
            tl.store(xmoe + (k * T + t) * H + offs, clean, mask=mask)


@triton.jit
def _weights(norm, query, offs, mask):
    """w = norm * query in f32 (exact: two bf16 factors)."""
    return _widen(tl.load(norm + offs, mask=mask, other=0.0)) * _widen(tl.load(query + offs, mask=mask, other=0.0))


# ---- row: one program per token ---------------------------------------------------------------


@triton.jit
def _logit(s, w, EPS: tl.constexpr, H: tl.constexpr):
    """query . RMSNorm(s) over a whole row; both row sums in one reduction (one barrier)."""
    dot, square = tl.split(tl.sum(tl.join(s * w, s * s), axis=0))
    return dot * tl.rsqrt(square / H + EPS)


@triton.jit
def row_kernel(
    mailbox,
    prefix_in,
    blocks,
    norm,
    query,
    out_norm,
    prefix_out,
    output,
    xmoe,
    own,
    R: tl.constexpr,
    NB: tl.constexpr,
    H: tl.constexpr,
    GROUPS: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    REPS: tl.constexpr,
    EPS: tl.constexpr,
    OUT_EPS: tl.constexpr,
    BLOCK: tl.constexpr,
    OWN: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    T = tl.num_programs(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    p_bits = _new_prefix(mailbox, own, prefix_in, t, T, offs, mask, R, H, GROUPS, HAS_DELTA, OWN)
    p = _as_f32(p_bits)
    if NB == 0:
        y = p  # one source: its weight is exactly 1 (docs/spec.md)
    else:
        w = _weights(norm, query, offs, mask)
        # Online softmax over the blocks, then p: top (running max), den and mix (unnormalized).
        # A NaN logit reaches den and mix through exp, so the row ends NaN as in the reference.
        mix = _widen(tl.load(blocks + t * NB * H + offs, mask=mask, other=0.0))
        top = _logit(mix, w, EPS, H)
        den = tl.full((), 1.0, tl.float32)
        for b in tl.static_range(1, NB + 1):
            if b < NB:
                s = _widen(tl.load(blocks + (t * NB + b) * H + offs, mask=mask, other=0.0))
            else:
                s = p
            logit = _logit(s, w, EPS, H)
            new_top = tl.maximum(top, logit)
            old_scale = tl.exp(top - new_top)
            e = tl.exp(logit - new_top)
            mix = mix * old_scale + e * s
            den = den * old_scale + e
            top = new_top
        y = mix / den
    scale = tl.rsqrt(tl.sum(y * y, axis=0) / H + OUT_EPS)
    on = _widen(tl.load(out_norm + offs, mask=mask, other=0.0))
    # The prefix is stored last: no store between the loads, so the compiler may start them all
    # early (it cannot prove that prefix_out aliases none of the inputs).
    tl.store(prefix_out + t * H + offs, _as_bf16(p_bits), mask=mask)
    _store_output(output, xmoe, t, T, offs, mask, (y * scale) * on, REPS, H)


# ---- tile: dot products and a Gram matrix over column tiles -----------------------------------
#
# Sources are rows of a [SOURCES, SUB] tile: block i < NB, the new prefix p at row NB, zero rows
# after. Per token: dots_i = s_i.w and gram_ij = s_i.s_j over all columns; then the softmax
# weights alpha come from the dots and the diagonal, and y.y = alpha^T gram alpha, so the output
# needs no second reduction over the row (docs/spec.md, "Streaming form").


@triton.jit
def _sum_tile(
    mailbox,
    own,
    prefix_in,
    blocks,
    norm,
    query,
    prefix_out,
    t,
    T,
    offs,
    mask,
    dots,
    gram,
    R: tl.constexpr,
    NB: tl.constexpr,
    H: tl.constexpr,
    GROUPS: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    SOURCES: tl.constexpr,
    OWN: tl.constexpr,
):
    """Writes the new prefix at `offs` and returns (dots, gram) with this tile's parts added."""
    p_bits = _new_prefix(mailbox, own, prefix_in, t, T, offs, mask, R, H, GROUPS, HAS_DELTA, OWN)
    tl.store(prefix_out + t * H + offs, _as_bf16(p_bits), mask=mask)
    s = _source_tile(blocks, t, offs, mask, _as_f32(p_bits), NB, H, SOURCES)
    dots += tl.sum(s * _weights(norm, query, offs, mask)[None, :], axis=1)
    # bf16 values are exact in tf32, so the tensor cores' products are exact; the sums are f32.
    return dots, tl.dot(s, tl.trans(s), gram, input_precision="tf32")


@triton.jit
def _source_tile(blocks, t, offs, mask, p, NB: tl.constexpr, H: tl.constexpr, SOURCES: tl.constexpr):
    i = tl.arange(0, SOURCES)
    s = _widen(
        tl.load(blocks + (t * NB + i[:, None]) * H + offs[None, :], mask=(i[:, None] < NB) & mask[None, :], other=0.0)
    )
    return tl.where(i[:, None] == NB, p[None, :], s)


@triton.jit
def _out_scale(quad, H: tl.constexpr, OUT_EPS: tl.constexpr):
    """rstd of the output from y.y; y.y >= 0 in exact arithmetic, but a cancelling mix can round
    below it; a NaN stays NaN."""
    return tl.rsqrt(tl.where(quad < 0.0, 0.0, quad) / H + OUT_EPS)


@triton.jit
def _mix(
    dots, gram, NB: tl.constexpr, H: tl.constexpr, EPS: tl.constexpr, OUT_EPS: tl.constexpr, SOURCES: tl.constexpr
):
    """(alpha [SOURCES], the output scale rstd(y.y)) from a token's dots and Gram matrix."""
    i = tl.arange(0, SOURCES)
    real = i < NB + 1
    if NB == 0:
        alpha = tl.where(i == 0, 1.0, 0.0)  # one source: weight exactly 1 (docs/spec.md)
    else:
        diag = tl.sum(tl.where(i[:, None] == i[None, :], gram, 0.0), axis=1)
        logit = tl.where(real, dots * tl.rsqrt(diag / H + EPS), float("-inf"))
        e = tl.exp(logit - tl.max(logit, axis=0))  # a NaN logit makes every weight NaN
        alpha = e / tl.sum(e, axis=0)
    # Only real pairs: a padding row times an infinite source is 0 * inf = NaN.
    terms = tl.where(real[:, None] & real[None, :], alpha[:, None] * gram * alpha[None, :], 0.0)
    return alpha, _out_scale(tl.sum(tl.sum(terms, axis=1), axis=0), H, OUT_EPS)


@triton.jit
def _out_tile(
    prefix,
    blocks,
    out_norm,
    output,
    xmoe,
    t,
    T,
    offs,
    mask,
    alpha,
    scale,
    NB: tl.constexpr,
    H: tl.constexpr,
    REPS: tl.constexpr,
    SOURCES: tl.constexpr,
):
    p = _widen(tl.load(prefix + t * H + offs, mask=mask, other=0.0))
    y = tl.sum(alpha[:, None] * _source_tile(blocks, t, offs, mask, p, NB, H, SOURCES), axis=0)
    on = _widen(tl.load(out_norm + offs, mask=mask, other=0.0))
    _store_output(output, xmoe, t, T, offs, mask, (y * scale) * on, REPS, H)


@triton.jit
def tile_kernel(
    mailbox,
    prefix_in,
    blocks,
    norm,
    query,
    out_norm,
    prefix_out,
    output,
    xmoe,
    own,
    R: tl.constexpr,
    NB: tl.constexpr,
    H: tl.constexpr,
    GROUPS: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    REPS: tl.constexpr,
    EPS: tl.constexpr,
    OUT_EPS: tl.constexpr,
    SUB: tl.constexpr,
    SOURCES: tl.constexpr,
    OWN: tl.constexpr,
):
    """Grid (T,): one program per token, two passes over its column tiles (the second re-reads
    the blocks and the new prefix), registers bounded by the tile."""
    t = tl.program_id(0).to(tl.int64)
    T = tl.num_programs(0).to(tl.int64)
    dots = tl.zeros([SOURCES], tl.float32)
    gram = tl.zeros([SOURCES, SOURCES], tl.float32)
    for k in range(0, H, SUB):  # a loop, not unrolled: 28 unrolled tiles take minutes to compile
        offs = k + tl.arange(0, SUB)
        dots, gram = _sum_tile(
            mailbox, own, prefix_in, blocks, norm, query, prefix_out, t, T, offs, offs < H, dots, gram,
            R, NB, H, GROUPS, HAS_DELTA, SOURCES, OWN,
        )  # fmt: skip
    # The second pass reads prefix elements other threads of this program stored.
    tl.debug_barrier()
    alpha, scale = _mix(dots, gram, NB, H, EPS, OUT_EPS, SOURCES)
    for k in range(0, H, SUB):
        offs = k + tl.arange(0, SUB)
        _out_tile(prefix_out, blocks, out_norm, output, xmoe, t, T, offs, offs < H, alpha, scale, NB, H, REPS, SOURCES)


# ---- sync: a token's programs in one launch, meeting at barriers ------------------------------
#
# Programs are dispatched in grid order and the chunk is the fastest grid axis, so a token's C
# programs are dispatched together: a program waits only for programs of its own token that are
# already running or next in line, which holds as long as C programs fit on the GPU at once
# (plan.SYNC_MAX_CHUNKS keeps C far below that).
#
# A barrier counts arrivals on an int32 counter per token (and barrier), zero at launch: a kernel
# cannot tell its own launch from an earlier one by anything it can read (%gridid, for one,
# repeats on every replay of a CUDA graph), so a count left by an earlier launch must not survive
# into this one. The last program to arrive sets the counter back to zero, which is also what
# lets the others go: every launch that runs to its end leaves its counters as it found them, so
# a caller may keep them from call to call instead of zeroing them before each (a launch that
# traps ends the CUDA context, and no later launch reads them).


@triton.jit
def _cluster_arrive():
    """The program's arrival at the cluster's barrier (relaxed: it orders nothing but the
    exchange's barriers fenced before it), paired with _cluster_wait before the first send."""
    tl.inline_asm_elementwise(
        "barrier.cluster.arrive.relaxed.aligned;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _cluster_wait():
    """Returns once every program of the cluster has arrived (_cluster_arrive): all of them are
    running, so their shared memory may be written."""
    tl.inline_asm_elementwise(
        "barrier.cluster.wait.aligned;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )


# The cluster's exchange: each program's records live in the last CHUNKS * RECORD f32 of its
# dynamic shared memory, past what Triton allocates (the launchers add plan.Launch.exchange
# bytes), after two transaction barriers (mbarrier, one per meeting), all addressed from the end
# (global_smem + %dynamic_smem_size) so that no offset depends on Triton's own layout. A program
# stages its record in its own slot, sends it into the same slot of every other program of the
# cluster (st.async at the peer's address, mapa), each store counting its bytes at the peer's
# barrier, and reads all of them from its own shared memory once its own barrier has counted
# every byte it expects: no fence and no cluster barrier between the sums (a release at cluster
# scope waits for every store in flight, the prefix's to global memory included). With YY_WARPS
# each warp's y.y is sent from registers instead, by lane k to program k, this one included
# (_send_warp), into lanes of the records that the first meeting's reads never reach.


def _at_end(registers: str, body: str) -> tl.constexpr:
    """Inline PTX whose shared-memory addresses count from the end of the dynamic shared memory:
    `body` finds it in xe (global_smem + %dynamic_smem_size); `registers` declares its own."""
    prologue = "mov.u32 xb, global_smem;\n\tmov.u32 xs, %dynamic_smem_size;\n\tadd.u32 xe, xb, xs;"
    return tl.constexpr(f"{{ .reg .u32 xb, xs, xe; {registers}\n\t{prologue}\n\t{body} }}")


def _get(n: int) -> tl.constexpr:
    """Inline PTX: n = 1, 2 or 4 consecutive f32 ($0 ..) at byte $n from the exchange's end."""
    values = ", ".join(f"${i}" for i in range(n))
    load = f"ld.shared.v{n}.f32 {{{values}}}" if n > 1 else f"ld.shared.f32 {values}"
    return _at_end(".reg .u32 xa;", f"add.u32 xa, xe, ${n}; {load}, [xa];")


_GET1, _GET2, _GET4 = _get(1), _get(2), _get(4)
_GET_MASKED = _at_end(
    ".reg .u32 xa; .reg .pred xp;",
    "add.u32 xa, xe, $1; setp.ne.s32 xp, $2, 0; mov.f32 $0, 0f00000000; @xp ld.shared.f32 $0, [xa];",
)
_INIT = _at_end(
    ".reg .u32 xa, xt; .reg .b64 xz; .reg .pred xp;",
    """add.u32 xa, xe, $1;
        mov.u32 xt, %tid.x;
        setp.eq.u32 xp, xt, 0;
        @xp mbarrier.init.shared::cta.b64 [xa], 1;
        @xp mbarrier.init.shared::cta.b64 [xa+8], 1;
        @xp mbarrier.arrive.expect_tx.shared::cta.b64 xz, [xa], $2;
        @xp mbarrier.arrive.expect_tx.shared::cta.b64 xz, [xa+8], $3;
        @xp fence.mbarrier_init.release.cluster;
        mov.u32 $0, 0;""",
)
_STAGE = _at_end(
    ".reg .u32 xa; .reg .pred xp;",
    "add.u32 xa, xe, $2; setp.ne.s32 xp, $3, 0; @xp st.shared.f32 [xa], $1; mov.u32 $0, 0;",
)
_SEND = _at_end(
    ".reg .u32 xi, xk, xl, xq, xa, xr, xm, xw; .reg .pred xp, xg;",
    """mov.u32 xi, %tid.x;
        add.u32 xi, xi, $1;
        setp.lt.u32 xp, xi, $2;
        div.u32 xk, xi, $3;
        mul.lo.u32 xl, xk, $3;
        sub.u32 xl, xi, xl;
        setp.ge.u32 xg, xk, $4;
        selp.u32 xq, 1, 0, xg;
        add.u32 xq, xk, xq;
        shl.b32 xl, xl, 2;
        add.u32 xa, xe, $5;
        add.u32 xa, xa, xl;
        add.u32 xm, xe, $6;
        @xp ld.shared.b32 xw, [xa];
        @xp mapa.shared::cluster.u32 xr, xa, xq;
        @xp mapa.shared::cluster.u32 xm, xm, xq;
        @xp st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [xr], xw, [xm];
        mov.u32 $0, 0;""",
)
_SEND_WARP = _at_end(
    ".reg .u32 xl, xw, xa, xr, xm; .reg .pred xp;",
    """mov.u32 xl, %laneid;
        mov.u32 xw, %tid.x;
        shr.u32 xw, xw, 5;
        shl.b32 xw, xw, 2;
        setp.lt.u32 xp, xl, $2;
        add.u32 xa, xe, $3;
        add.u32 xa, xa, xw;
        add.u32 xm, xe, $4;
        @xp mapa.shared::cluster.u32 xr, xa, xl;
        @xp mapa.shared::cluster.u32 xm, xm, xl;
        @xp st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [xr], $1, [xm];
        mov.u32 $0, 0;""",
)
_ARRIVED = _at_end(
    ".reg .u32 xa; .reg .pred xp;",
    "add.u32 xa, xe, $1; mbarrier.try_wait.parity.shared::cta.b64 xp, [xa], 0; selp.u32 $0, 1, 0, xp;",
)


@triton.jit
def _exchange_get_masked(offset, ok):
    """The f32 at byte `offset` from the end of this program's exchange, 0.0 where `ok` is zero."""
    return tl.inline_asm_elementwise(_GET_MASKED, "=f,r,r", [offset, ok], dtype=tl.float32, is_pure=False, pack=1)


@triton.jit
def _exchange_get(offset, N: tl.constexpr):
    """The N = 1, 2 or 4 f32 (a tuple) at byte `offset` from the end of this program's exchange,
    one load (offset a multiple of 4 * N)."""
    if N == 4:
        return tl.inline_asm_elementwise(
            _GET4, "=f,=f,=f,=f,r", [offset], (tl.float32, tl.float32, tl.float32, tl.float32), is_pure=False, pack=1
        )
    elif N == 2:
        return tl.inline_asm_elementwise(_GET2, "=f,=f,r", [offset], (tl.float32, tl.float32), is_pure=False, pack=1)
    else:
        return (tl.inline_asm_elementwise(_GET1, "=f,r", [offset], tl.float32, is_pure=False, pack=1),)


@triton.jit
def _put_record(record, c, lanes, values, mask, CLUSTER: tl.constexpr, CHUNKS: tl.constexpr, RECORD: tl.constexpr):
    """Lanes `lanes` of chunk c's record := `values` where `mask` (tiles of one shape): in global
    memory at `record`, or (CLUSTER) staged in this program's exchange (_exchange sends it)."""
    if CLUSTER:
        _stage(values, (c * RECORD + lanes - CHUNKS * RECORD) * 4, mask.to(tl.int32))
    else:
        tl.store(record + lanes, values, mask=mask)


@triton.jit
def _exchange_init(bars, bytes0, bytes1):
    """Thread 0 makes the exchange's two transaction barriers (at byte `bars` from the end, 8
    bytes each), each expecting `bytes0` / `bytes1` bytes of the peers' records, and fences them
    for the cluster: call before the program's first arrival at the cluster's barrier."""
    return tl.inline_asm_elementwise(_INIT, "=r,r,r,r", [bars, bytes0, bytes1], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _stage(values, offset, ok):
    """Stores each of `values` (f32) into this program's exchange at byte `offset` from its end,
    where `ok` is nonzero (a value held by several threads is stored by each, the same bits)."""
    return tl.inline_asm_elementwise(_STAGE, "=r,f,r,r", [values, offset, ok], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _send(first, count, lanes, c, offset, bar):
    """Item `first` + thread index, if below `count`: lane i % `lanes` of this program's staged
    record (at byte `offset` from the end) sent to the same place in the cluster's program k + (k
    >= c), k = i / `lanes`, by st.async, whose bytes complete that program's barrier at `bar`.
    Indexed by thread, so every item is sent exactly once (the barrier counts bytes)."""
    args = [first, count, lanes, c, offset, bar]
    return tl.inline_asm_elementwise(_SEND, "=r,r,r,r,r,r,r", args, dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _send_warp(value, count, offset, bar):
    """`value` (f32, the same in every thread of a warp) sent by lane k < `count` of warp w to byte
    `offset` + 4 w from the end of the cluster's program k (this one included), by st.async, whose 4
    bytes complete that program's barrier at `bar`: a meeting of one value a warp, with nothing
    staged and no barrier first."""
    args = [value, count, offset, bar]
    return tl.inline_asm_elementwise(_SEND_WARP, "=r,f,r,r,r", args, dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _arrived(bar):
    """1 once the transaction barrier at byte `bar` from the end has received its bytes."""
    return tl.inline_asm_elementwise(_ARRIVED, "=r,r", [bar], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _exchange(c, bar, LANE0: tl.constexpr, LANES: tl.constexpr, CHUNKS: tl.constexpr, RECORD: tl.constexpr):
    """Lanes LANE0 .. LANE0 + LANES - 1 of this program's staged record sent to the cluster's
    other programs; returns once theirs have arrived here (the barrier at `bar`)."""
    tl.debug_barrier()  # the record is staged by every thread
    COUNT: tl.constexpr = (CHUNKS - 1) * LANES
    THREADS: tl.constexpr = tl_cuda.num_threads()
    for first in tl.static_range(0, COUNT, THREADS):
        _send(first + 0 * c, COUNT + 0 * c, LANES + 0 * c, c, (c * RECORD + LANE0 - CHUNKS * RECORD) * 4, bar + 0 * c)
    _wait_arrived(bar + 0 * c)


@triton.jit
def _wait_arrived(bar):
    """Returns once the transaction barrier at byte `bar` from the end has received its bytes."""
    done = _arrived(bar)
    while done == 0:
        done = _arrived(bar)


@triton.jit
def _records(stats, t, k, lanes, mask, CLUSTER: tl.constexpr, CHUNKS: tl.constexpr, RECORD: tl.constexpr):
    """Lanes `lanes` of token t's records `k` as a [len(k), len(lanes)] f32 tile, 0.0 where not
    `mask`: from global memory (L2, where the other programs stored them), or (CLUSTER) from this
    program's exchange (the tile form, THREAD_SUMS off)."""
    if CLUSTER:
        offset = (k[:, None] * RECORD + lanes[None, :] - CHUNKS * RECORD) * 4
        return _exchange_get_masked(offset, mask.to(tl.int32))
    else:
        rows = stats + (t * CHUNKS + k)[:, None] * RECORD + lanes[None, :]
        # .cg: from L2, where the other programs' stores are (never a line this SM cached).
        return tl.load(rows, mask=mask, other=0.0, cache_modifier=".cg")


@triton.jit
def _lanes(stats, t, k, lane, N: tl.constexpr, CLUSTER: tl.constexpr, CHUNKS: tl.constexpr, RECORD: tl.constexpr):
    """Lanes `lane` .. `lane` + N - 1 (N = 1, 2 or 4) of token t's record k, a tuple of N f32
    that every thread reads, in one load (a record is a whole number of 16-byte words,
    plan.record_lanes): from global memory (L2, where the other programs stored them), or
    (CLUSTER) from this program's exchange."""
    if CLUSTER:
        return _exchange_get((k * RECORD + lane - CHUNKS * RECORD) * 4, N)
    else:
        # .cg: from L2, where the other programs' stores are (never a line this SM cached).
        values = tl.load(stats + (t * CHUNKS + k) * RECORD + lane + tl.arange(0, N), cache_modifier=".cg")
        if N == 4:
            even, odd = tl.split(tl.reshape(values, (2, 2)))
            v0, v2 = tl.split(even)
            v1, v3 = tl.split(odd)
            return v0, v1, v2, v3
        elif N == 2:
            return tl.split(values)
        else:
            return (tl.sum(values, axis=0),)


@triton.jit
def _lane_sums(stats, t, lane, N: tl.constexpr, CLUSTER: tl.constexpr, CHUNKS: tl.constexpr, RECORD: tl.constexpr):
    """Lanes `lane` .. `lane` + N - 1 of token t's CHUNKS records, each added over the chunks in
    chunk order, in every thread (a tuple of N f32): no reduction across threads, and every
    program of the token (either path) adds the same values in the same order, so all of them get
    the same bits."""
    sums = _lanes(stats, t, 0, lane, N, CLUSTER, CHUNKS, RECORD)
    for k in tl.static_range(1, CHUNKS):
        more = _lanes(stats, t, k, lane, N, CLUSTER, CHUNKS, RECORD)
        added = ()
        for i in tl.static_range(N):
            added = added + (sums[i] + more[i],)
        sums = added
    return sums


_WARP_SUM = tl.constexpr(
    "{ .reg .f32 xt;\n\t"
    + "\n\t".join(
        f"shfl.sync.bfly.b32 xt, {src}, {step}, 0x1f, 0xffffffff; add.rn.f32 $0, {src}, xt;"
        for src, step in (("$1", 16), ("$0", 8), ("$0", 4), ("$0", 2), ("$0", 1))
    )
    + " }"
)


@triton.jit
def _halve(h, WARPS: tl.constexpr, S: tl.constexpr):
    """[WARPS, 2 S] -> [WARPS, S]: h[:, l] + h[:, l + S]."""
    low, high = tl.split(tl.permute(tl.reshape(h, (WARPS, 2, S)), (0, 2, 1)))
    return low + high


@triton.jit
def _warp_totals(y, LANES: tl.constexpr, WARPS: tl.constexpr, INTERPRETED: tl.constexpr):
    """y.y of each warp's columns, in every thread of the warp: [32 * WARPS], thread i's element
    (the [BLOCK] tile puts columns i * LANES .. i * LANES + LANES - 1 in thread i). A thread's
    LANES squares are one chain of FMAs, then the warp's 32 values are added by a butterfly: lane l
    adds lane l ^ 16's value, then l ^ 8's, 4, 2, 1 (shfl.sync.bfly). INTERPRETED (Triton's
    interpreter, no PTX): each warp's values halved five times (value l + value (l + s), s = 16,
    8, 4, 2, 1), the same adds, in the lanes above s with the operands swapped: the same bits."""
    threads = tl.reshape(y, (32 * WARPS, LANES))
    mine = _fma_lanes(threads, threads, 0.0, LANES)
    if INTERPRETED:
        h = _halve(tl.reshape(mine, (WARPS, 32)), WARPS, 16)
        h = _halve(_halve(_halve(_halve(h, WARPS, 8), WARPS, 4), WARPS, 2), WARPS, 1)
        return tl.reshape(tl.broadcast_to(h, (WARPS, 32)), (32 * WARPS,))
    return tl.inline_asm_elementwise(_WARP_SUM, "=f,f", [mine], dtype=tl.float32, is_pure=False, pack=1)


@triton.jit
def _tree_sum(values, N: tl.constexpr, LOG: tl.constexpr):
    """values[0] + .. + values[N - 1] (a tuple, N = 2 ** LOG) as a balanced tree of adds, pairs of
    neighbours first: LOG adds deep."""
    for level in tl.static_range(LOG):
        pairs = ()
        for i in tl.static_range(0, N >> level, 2):
            pairs = pairs + (values[i] + values[i + 1],)
        values = pairs
    return values[0]


@triton.jit
def _chunk_yy(stats, t, k: tl.constexpr, LANE: tl.constexpr, WARPS: tl.constexpr, CLUSTER: tl.constexpr,
              CHUNKS: tl.constexpr, RECORD: tl.constexpr):  # fmt: skip
    """Chunk k's y.y: lanes LANE .. LANE + WARPS - 1 of token t's record k, added as a tree."""
    N: tl.constexpr = 4 if WARPS % 4 == 0 else (2 if WARPS % 2 == 0 else 1)
    lanes = ()
    for g in tl.static_range(0, WARPS, N):
        lanes = lanes + _lanes(stats, t, k, LANE + g, N, CLUSTER, CHUNKS, RECORD)
    return _tree_sum(lanes, WARPS, WARPS.bit_length() - 1)


@triton.jit
def _yy_total(stats, t, LANE: tl.constexpr, WARPS: tl.constexpr, CLUSTER: tl.constexpr, CHUNKS: tl.constexpr,
              RECORD: tl.constexpr):  # fmt: skip
    """y.y of token t from its CHUNKS records' lanes LANE .. LANE + WARPS - 1 (each warp's y.y,
    _warp_totals; WARPS a power of two): each chunk's warps added as a tree, then the chunks in
    chunk order, in every thread. Every program of the token, on either path, adds the same values
    in the same order: the same bits."""
    total = _chunk_yy(stats, t, 0, LANE, WARPS, CLUSTER, CHUNKS, RECORD)
    for k in tl.static_range(1, CHUNKS):
        total = total + _chunk_yy(stats, t, k, LANE, WARPS, CLUSTER, CHUNKS, RECORD)
    return total


@triton.jit
def _prefetch(rows, R: tl.constexpr, T, t, H: tl.constexpr, offs, mask, SKIP: tl.constexpr):
    """Asks L2 for token t's R rows of `rows` ([R, T, H]) at `offs` (prefetch.global.L2, one
    address per 16 bytes where `mask`), row SKIP left out (-1: none): the loads that follow find
    them there or on their way."""
    for r in tl.static_range(R):
        if r != SKIP:
            tl.inline_asm_elementwise(
                "{ .reg .pred xp; setp.ne.s32 xp, $2, 0; @xp prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                "=r,l,r",
                [rows + (r * T + t) * H + offs, mask.to(tl.int32)],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )


@triton.jit
def _arrive_and_wait(counter, CHUNKS: tl.constexpr, POLLS: tl.constexpr):
    """Counts this program in at `counter` and returns once all CHUNKS programs of the token
    have; past POLLS polls, or on a counter that was not zero at launch, the kernel traps (a
    launch error, never silent garbage)."""
    # bar.sync first: the release below then covers every thread's record stores (a barrier
    # orders them before thread 0's atomic; the release is cumulative over them).
    tl.debug_barrier()
    # A scalar atomic runs in one thread of the program, its result broadcast to all.
    before = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if before >= CHUNKS:  # more arrivals than programs: the counter did not start at zero
        tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    last = before == CHUNKS - 1
    if last:
        # The last arrival acquired every earlier one (each add is in the release sequence its
        # acquire reads from); its release of zero passes all of them on to the waiting programs.
        tl.atomic_xchg(counter, 0, sem="release", scope="gpu")
    # A waiting program's own add made the counter >= 1, so 0 is the last arrival's reset; it
    # may also still see CHUNKS, the count before the reset.
    seen = before + 1
    polls = 0
    while (seen != 0) & (seen != CHUNKS) & (polls < POLLS):
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        polls += 1
    if (seen != 0) & (seen != CHUNKS):
        tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    # The other threads read the records only after thread 0's acquire.
    tl.debug_barrier()


@triton.jit
def _token_sum(stats, t, lanes, CLUSTER: tl.constexpr, CHUNKS: tl.constexpr, SPAN: tl.constexpr,
               RECORD: tl.constexpr):  # fmt: skip
    """Lanes `lanes` of token t's CHUNKS records (SPAN: CHUNKS rounded up to a power of two),
    added over the chunks (the tile form): every program of the token runs this same code on the
    same records, so all of them get the same bits."""
    k = tl.arange(0, SPAN)
    return tl.sum(
        _records(stats, t, k, lanes, (k < CHUNKS)[:, None] & (lanes >= 0)[None, :], CLUSTER, CHUNKS, RECORD), axis=0
    )


@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _sync_weights(
    stats, t, NB: tl.constexpr, H: tl.constexpr, EPS: tl.constexpr, ROWS: tl.constexpr,
    CHUNKS: tl.constexpr, SPAN: tl.constexpr, RECORD: tl.constexpr, CLUSTER: tl.constexpr,
    THREAD_SUMS: tl.constexpr,
):  # fmt: skip
    """The softmax weights of token t's blocks ([ROWS]; padding rows 0, which multiply zero rows)
    and of its new prefix p, from its records' dot products and squares (THREAD_SUMS:
    _thread_weights, else _tile_weights, whose padding weights are NaN where every weight is)."""
    if THREAD_SUMS:
        alpha, alpha_p = _thread_weights(stats, t, NB, H, EPS, ROWS, CHUNKS, RECORD, CLUSTER)
    else:
        alpha, alpha_p = _tile_weights(stats, t, NB, H, EPS, ROWS, CHUNKS, SPAN, RECORD, CLUSTER)
    return alpha, alpha_p


@triton.jit
def _tile_weights(
    stats, t, NB: tl.constexpr, H: tl.constexpr, EPS: tl.constexpr, ROWS: tl.constexpr,
    CHUNKS: tl.constexpr, SPAN: tl.constexpr, RECORD: tl.constexpr, CLUSTER: tl.constexpr,
):  # fmt: skip
    """_sync_weights from [SPAN, ROWS] tiles of the records, reduced over the chunks across the
    program's threads: few instructions a thread where a token has many chunks."""
    j = tl.arange(0, ROWS)
    real = j < NB
    # one load of the three tiles ([SPAN, ROWS] each; p.w and p.p in lanes 0 and 1 of the third,
    # so ROWS >= 2) and one reduction of them
    k = tl.arange(0, SPAN)
    chunk = (k < CHUNKS)[:, None]
    dots, squares, mine = tl.reduce(
        (
            _records(stats, t, k, j, chunk & real[None, :], CLUSTER, CHUNKS, RECORD),
            _records(stats, t, k, ROWS + j, chunk & real[None, :], CLUSTER, CHUNKS, RECORD),
            _records(stats, t, k, 2 * ROWS + j, chunk & (j < 2)[None, :], CLUSTER, CHUNKS, RECORD),
        ),
        0,
        _add3,
    )
    p_dot = tl.sum(tl.where(j == 0, mine, 0.0), axis=0)
    p_square = tl.sum(tl.where(j == 1, mine, 0.0), axis=0)
    logits = tl.where(real, dots * tl.rsqrt(squares / H + EPS), float("-inf"))
    logit = p_dot * tl.rsqrt(p_square / H + EPS)
    top = tl.maximum(tl.max(logits, axis=0), logit)
    e = tl.exp(logits - top)
    e_p = tl.exp(logit - top)  # a NaN logit reaches the denominator: every weight is NaN
    den = tl.sum(e, axis=0) + e_p
    return e / den, e_p / den


@triton.jit
def _thread_weights(
    stats, t, NB: tl.constexpr, H: tl.constexpr, EPS: tl.constexpr, ROWS: tl.constexpr,
    CHUNKS: tl.constexpr, RECORD: tl.constexpr, CLUSTER: tl.constexpr,
):  # fmt: skip
    """_sync_weights as scalars in every thread (_lane_sums): no reduction and no exchange
    between threads, no barrier; the tile of weights is put together from them where it is
    used. A thread adds CHUNKS records of 2 * ROWS + 2 lanes itself: for few chunks."""
    sums = ()
    for lane in tl.static_range(0, 2 * ROWS, 4):  # the dots, then the squares, four lanes a load
        sums = sums + _lane_sums(stats, t, lane, 4, CLUSTER, CHUNKS, RECORD)
    # p.w and p.p, two lanes a load: no load reaches y.y's lane, which a peer may be sending already
    p_dot, p_square = _lane_sums(stats, t, 2 * ROWS, 2, CLUSTER, CHUNKS, RECORD)
    logit_p = p_dot * tl.rsqrt(p_square / H + EPS)
    logits = ()
    top = logit_p
    for i in tl.static_range(NB):
        logit = sums[i] * tl.rsqrt(sums[ROWS + i] / H + EPS)
        logits = logits + (logit,)
        top = tl.maximum(top, logit)
    e_p = tl.exp(logit_p - top)  # a NaN logit reaches the denominator: every weight is NaN
    es = ()
    for i in tl.static_range(NB):
        es = es + (tl.exp(logits[i] - top),)
    den = es[0]
    for i in tl.static_range(1, NB):
        den = den + es[i]
    den = den + e_p
    j = tl.arange(0, ROWS)
    alpha = tl.zeros([ROWS], tl.float32)
    for i in tl.static_range(NB):
        alpha = tl.where(j == i, es[i] / den, alpha)
    return alpha, e_p / den


@triton.jit
def _block_tile(blocks, t, j, offs, mask, NB: tl.constexpr, H: tl.constexpr):
    """Token t's blocks over columns `offs` as a [ROWS, BLOCK] f32 tile (rows j >= NB zero)."""
    rows = blocks + (t * NB + j[:, None]) * H + offs[None, :]
    return _widen(tl.load(rows, mask=(j[:, None] < NB) & mask[None, :], other=0.0))


@triton.jit
def _rows(
    mailbox, own, prefix_in, blocks, norm, query, out_norm, t, T, j, offs, mask,
    R: tl.constexpr, NB: tl.constexpr, H: tl.constexpr, HAS_DELTA: tl.constexpr, OWN: tl.constexpr,
):  # fmt: skip
    """Every row a sync program reads (bf16, volatile loads): the partials' tuple, the old
    prefix, norm, query, out_norm, the blocks' [ROWS, BLOCK] tile."""
    parts = _partials(mailbox, own, t, T, offs, mask, R, H, OWN, True)
    old = _old_prefix(prefix_in, t, offs, mask, H, HAS_DELTA, True)
    norm_bits = tl.load(norm + offs, mask=mask, other=0.0, volatile=True)
    query_bits = tl.load(query + offs, mask=mask, other=0.0, volatile=True)
    on = tl.load(out_norm + offs, mask=mask, other=0.0, volatile=True)
    rows = blocks + (t * NB + j[:, None]) * H + offs[None, :]
    b = tl.load(rows, mask=(j[:, None] < NB) & mask[None, :], other=0.0, volatile=True)
    return parts, old, norm_bits, query_bits, on, b


@triton.jit
def _rows_first(
    mailbox, own, prefix_in, blocks, norm, query, out_norm, t, T, j, offs, mask,
    R: tl.constexpr, NB: tl.constexpr, H: tl.constexpr, HAS_DELTA: tl.constexpr, OWN: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    """_rows, all loads in one loop body run once (the grid's z extent is 1). ptxas puts no
    arithmetic among the loads of one body, so all of them are in flight before the first
    result is waited for; in straight-line code it issues a few, then the sums that wait on
    them, then the next few, one memory round trip after another. The loads are volatile, so
    that no compiler moves one out of the loop. INTERPRETED: Triton's interpreter, which takes
    no tensor as a loop bound, reads the rows without the loop."""
    if INTERPRETED:
        return _rows(
            mailbox, own, prefix_in, blocks, norm, query, out_norm, t, T, j, offs, mask, R, NB, H, HAS_DELTA, OWN
        )
    zero = tl.zeros(offs.shape, tl.bfloat16)
    parts = ()
    for r in tl.static_range(R):
        parts = parts + (zero,)
    old, norm_bits, query_bits, on = zero, zero, zero, zero
    b = tl.zeros((j.shape[0], offs.shape[0]), tl.bfloat16)
    for _ in range(tl.num_programs(2)):  # 1, a value no compiler knows
        parts, old, norm_bits, query_bits, on, b = _rows(
            mailbox, own, prefix_in, blocks, norm, query, out_norm, t, T, j, offs, mask, R, NB, H, HAS_DELTA, OWN
        )
    return parts, old, norm_bits, query_bits, on, b


@triton.jit
def sync_kernel(
    mailbox,
    prefix_in,
    blocks,
    norm,
    query,
    out_norm,
    prefix_out,
    output,
    xmoe,
    stats,
    arrivals,
    own,
    R: tl.constexpr,
    NB: tl.constexpr,
    H: tl.constexpr,
    GROUPS: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    REPS: tl.constexpr,
    EPS: tl.constexpr,
    OUT_EPS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNKS: tl.constexpr,
    SPAN: tl.constexpr,
    RECORD: tl.constexpr,
    EXCHANGE: tl.constexpr,
    POLLS: tl.constexpr,
    PHASE: tl.constexpr,
    RELOAD: tl.constexpr,
    PDL: tl.constexpr,
    CLUSTER: tl.constexpr,
    PREFETCH: tl.constexpr,
    LOADS_FIRST: tl.constexpr,
    OWN: tl.constexpr,
    LANES: tl.constexpr,
    THREAD_SUMS: tl.constexpr,
    YY_WARPS: tl.constexpr,
):
    """Grid (C, T): chunk c of token t, its blocks as a [ROWS, BLOCK] tile and its new prefix p
    held in registers throughout (RELOAD: the blocks read again after barrier 1 instead).
    `stats` holds a record of RECORD f32 lanes per chunk (plan.record_lanes): the blocks' dots
    b_j.w (lanes j) and squares b_j.b_j (ROWS + j), p.w and p.p (2 * ROWS, 2 * ROWS + 1), y.y (2 * ROWS + 2;
    YY_WARPS: one lane a warp from lane YYW), over the chunk's columns (THREAD_SUMS: padded to 16-byte
    words); `arrivals` ([T, 2] int32) the two barriers' arrival counters, zero at launch (and at exit).
    The weights need every chunk's dots and squares (barrier 1), the output scale every chunk's y.y
    (barrier 2).

    PHASE 0 runs it all; PHASE 1, 2, 3 are its three stretches between the barriers as three
    launches, for Triton's interpreter (it runs one program after another, so cannot run a
    barrier): 2 and 3 read p back from the stored prefix, 3 recomputes y (the same operations
    on the same values, so the same bits). PDL: launched with programmatic dependent launch
    (sm_90 or newer). CLUSTER: a token's C programs launched as one thread block cluster, which
    send their records into each other's shared memory and wait for the peers' there instead
    (`stats` and `arrivals` unused): the same arithmetic, the same bits; EXCHANGE: the bytes of
    that exchange past the kernel's own shared memory (plan.exchange_bytes). PREFETCH: the
    rows asked of L2 at entry, before the PDL wait (plan.PREFETCH_MAX_T: few tokens only). LOADS_FIRST:
    every row read before any arithmetic (_rows_first; plan.loads_first). OWN >= 0:
    rank OWN's partial read from `own` [T, H] in place of its slot (the row and tile kernels alike);
    OWN = -1 with `own` the constexpr None. LANES: the columns a thread holds (plan.lanes; 4 or 8),
    along which its dots and squares are FMA chains (not RELOAD: under its register cap they spill).
    THREAD_SUMS (plan.thread_sums): after each meeting every thread adds the records' lanes over the
    chunks itself, in chunk order (_lane_sums), and computes the weights as scalars; else the
    records are reduced as tiles across the program's threads. Each is the same code on either
    path (clusters or counters), so the two paths give the same bits. YY_WARPS (plan.yy_warps: THREAD_SUMS
    and not RELOAD; the number of warps, else 0): each warp's y.y a lane of the record (from lane YYW,
    _warp_totals), sent from registers in a cluster (_send_warp) or stored by the warp's lane 0, and
    every thread adds the C * YY_WARPS lanes itself (_yy_total): no reduction across the program's
    warps before the second meeting."""
    if PHASE == 0 and PREFETCH:
        # Few programs in all, each waiting on its loads: every row it reads is asked of L2
        # first, before the PDL wait, so the lines come while the kernel ahead finishes (L2 holds
        # every store: a line asked for before that kernel's last stores still reads them).
        t = tl.program_id(1).to(tl.int64)
        wide = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK // 8) * 8
        inside = wide < H
        _prefetch(mailbox, R, tl.num_programs(1).to(tl.int64), t, H, wide, inside, OWN)  # [R, T, H]
        if OWN >= 0:
            _prefetch(own, 1, 1, t, H, wide, inside, -1)
        _prefetch(blocks, NB, 1, t * NB, H, wide, inside, -1)  # [T, NB, H]: row t * NB + r
        if HAS_DELTA:
            _prefetch(prefix_in, 1, 1, t, H, wide, inside, -1)
        _prefetch(norm, 1, 1, 0, H, wide, inside, -1)
        _prefetch(query, 1, 1, 0, H, wide, inside, -1)
    if PDL:
        # The grid may start before the kernel ahead of it on the stream has finished; every read
        # waits for that kernel's end (its writes then visible), so only the launch overlaps.
        # The next grid may launch once every program of this one has begun; its programs then
        # hold in their own wait, and they cannot take an SM from a program of this grid, which
        # are all on the GPU by then.
        tl_cuda.gdc_wait()
        tl_cuda.gdc_launch_dependents()
    BARS: tl.constexpr = -EXCHANGE  # the exchange's two transaction barriers, at its start
    YY: tl.constexpr = 2 * ROWS + 2  # y.y's lane: the first meeting sends the YY before it
    YYW: tl.constexpr = (YY + 3) // 4 * 4  # YY_WARPS: the first of the warps' y.y lanes (plan.record_lanes)
    c = tl.program_id(0)
    if CLUSTER:
        # the two meetings' bytes: YY lanes from the C - 1 peers, then y.y (YY_WARPS: a lane from every
        # warp of the C programs, this one's included)
        YY_BYTES: tl.constexpr = CHUNKS * YY_WARPS * 4 if YY_WARPS else (CHUNKS - 1) * 4
        _exchange_init(BARS + 0 * c, (CHUNKS - 1) * YY * 4 + 0 * c, YY_BYTES + 0 * c)
        _cluster_arrive()
    t = tl.program_id(1).to(tl.int64)
    T = tl.num_programs(1).to(tl.int64)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    j = tl.arange(0, ROWS)
    record = stats + (t * CHUNKS + c) * RECORD
    if LOADS_FIRST and PHASE <= 1:
        parts, old, norm_bits, query_bits, on_early, b_bits = _rows_first(
            mailbox, own, prefix_in, blocks, norm, query, out_norm, t, T, j, offs, mask, R, NB, H, HAS_DELTA, OWN,
            PHASE != 0,
        )  # fmt: skip
        b = _widen(b_bits)
    else:
        if PHASE == 0 and not RELOAD:
            # read now, not after barrier 2: no load waits at the end (RELOAD keeps its registers)
            on_early = tl.load(out_norm + offs, mask=mask, other=0.0)
        b = _block_tile(blocks, t, j, offs, mask, NB, H)
    if PHASE <= 1:
        # every load before the prefix store: the compiler cannot move a load across a store
        # (prefix_out may alias an input), and a load after it would wait on its own
        if LOADS_FIRST:
            w = _widen(norm_bits) * _widen(query_bits)
            p_bits = _prefix_bits(parts, old, R, GROUPS, HAS_DELTA, PHASE == 0)
        else:
            w = _weights(norm, query, offs, mask)
            p_bits = _new_prefix(mailbox, own, prefix_in, t, T, offs, mask, R, H, GROUPS, HAS_DELTA, OWN)
        tl.store(prefix_out + t * H + offs, _as_bf16(p_bits), mask=mask)
        p = _as_f32(p_bits)
        first = (j == 0)[:, None]
        if RELOAD:
            # one reduction: p's products ride in row 0 of two more [ROWS, BLOCK] tiles (the FMA
            # chains below spill under RELOAD's register cap)
            dots, squares, p_dot, p_square = tl.reduce(
                (b * w[None, :], b * b, tl.where(first, (p * w)[None, :], 0.0), tl.where(first, (p * p)[None, :], 0.0)),
                1,
                _add4,
            )
        else:
            # a thread's LANES columns as the last axis of [ROWS, threads, LANES] tiles: each dot and
            # square one chain of FMAs along it, then one reduction over the threads (p's products in
            # row 0 of two more tiles)
            b3 = tl.reshape(b, (ROWS, BLOCK // LANES, LANES))
            w3 = tl.reshape(w, (1, BLOCK // LANES, LANES))
            p3 = tl.reshape(p, (1, BLOCK // LANES, LANES))
            dots, squares, p_dot, p_square = tl.reduce(
                (
                    _fma_lanes(b3, w3, 0.0, LANES), _fma_lanes(b3, b3, 0.0, LANES),
                    tl.where(first, _fma_lanes(p3, w3, 0.0, LANES), 0.0),
                    tl.where(first, _fma_lanes(p3, p3, 0.0, LANES), 0.0),
                ),
                1,
                _add4,
            )  # fmt: skip
        # the record as one [ROWS, 2, 2] tile (j, u, v): v = 0 the blocks' dots (u = 0) and squares
        # (u = 1) in lanes u * ROWS + j; v = 1 p.w and p.p in lanes 2 * ROWS + u, from row 0
        u = tl.arange(0, 2)[None, :, None]
        v = tl.arange(0, 2)[None, None, :]
        jj = j[:, None, None]
        if CLUSTER:
            _cluster_wait()  # the peers run: their shared memory may be written
        _put_record(
            record, c, tl.where(v == 0, u * ROWS + jj, 2 * ROWS + u),
            tl.join(tl.join(dots, squares), tl.join(p_dot, p_square)), (v == 0) | (jj == 0),
            CLUSTER, CHUNKS, RECORD,
        )  # fmt: skip
    else:
        p = _widen(tl.load(prefix_out + t * H + offs, mask=mask, other=0.0))
    if PHASE == 0:
        if CLUSTER:
            _exchange(c, BARS, 0, YY, CHUNKS, RECORD)
        else:
            _arrive_and_wait(arrivals + 2 * t, CHUNKS, POLLS)
    if PHASE != 1:
        if NB == 0:
            y = p  # one source: its weight is exactly 1 (docs/spec.md)
        else:
            alpha, alpha_p = _sync_weights(stats, t, NB, H, EPS, ROWS, CHUNKS, SPAN, RECORD, CLUSTER, THREAD_SUMS)
            if RELOAD:
                # The same bits again, from L1 or L2 where the first read left them: the tile is not
                # held across the barrier, so a thread needs fewer registers and more programs
                # share an SM (the occupancy a memory-bound launch of many tokens lacks).
                b = _block_tile(blocks, t, j, offs, mask, NB, H)
            if RELOAD:
                y = tl.sum(alpha[:, None] * b, axis=0) + alpha_p * p  # padding rows: 0 times a zero row
            else:
                # a thread holds every block of its columns: one chain of FMAs over them
                y = _fma_lanes(tl.permute(b, (1, 0)), alpha, alpha_p * p, ROWS)
    if YY_WARPS:
        # each warp's y.y a lane of the record: no reduction across the program's warps, and in a
        # cluster sent from registers, nothing staged and no barrier first
        if PHASE == 0 or PHASE == 2:
            warp_yy = _warp_totals(y, LANES, YY_WARPS, PHASE != 0)
            if PHASE == 0 and CLUSTER:
                _send_warp(warp_yy, CHUNKS + 0 * c, (c * RECORD + YYW - CHUNKS * RECORD) * 4 + 0 * c, BARS + 8 + 0 * c)
                _wait_arrived(BARS + 8 + 0 * c)
            else:
                thread = tl.arange(0, 32 * YY_WARPS)
                tl.store(record + YYW + thread // 32, warp_yy, mask=thread % 32 == 0)
                if PHASE == 0:
                    _arrive_and_wait(arrivals + 2 * t + 1, CHUNKS, POLLS)
    elif PHASE == 0 or PHASE == 2:
        lane = tl.full([1, 1, 1], YY, tl.int32)
        yy = tl.full([1, 1, 1], 0.0, tl.float32) + tl.sum(y * y, axis=0)  # y.y >= 0: adding +0.0 keeps its bits
        _put_record(record, c, lane, yy, lane >= 0, CLUSTER, CHUNKS, RECORD)
        if PHASE == 0:
            if CLUSTER:
                _exchange(c, BARS + 8, YY, 1, CHUNKS, RECORD)
            else:
                _arrive_and_wait(arrivals + 2 * t + 1, CHUNKS, POLLS)
    if PHASE == 0 or PHASE == 3:
        if YY_WARPS:
            yy = _yy_total(stats, t, YYW, YY_WARPS, CLUSTER, CHUNKS, RECORD)
        elif THREAD_SUMS:
            (yy,) = _lane_sums(stats, t, YY, 1, CLUSTER, CHUNKS, RECORD)
        else:
            yy = tl.sum(_token_sum(stats, t, YY + tl.arange(0, 1), CLUSTER, CHUNKS, SPAN, RECORD), axis=0)
        if PHASE == 0 and not RELOAD:
            on = _widen(on_early)
        else:
            on = _widen(tl.load(out_norm + offs, mask=mask, other=0.0))
        _store_output(output, xmoe, t, T, offs, mask, (y * _out_scale(yy, H, OUT_EPS)) * on, REPS, H, PHASE == 0)
