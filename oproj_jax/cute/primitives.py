"""Small PTX-level helpers for the CuTe-DSL consumer kernel (imported only when building).

Every helper is one short inline-PTX sequence emitted while the DSL traces a kernel. Global
addresses are plain `Int64` byte addresses, shared-memory addresses `Int32` offsets in the
CTA's shared window, so the kernel can keep its ABI to pointers and scalars and do all
address arithmetic in integers. All asm is marked side-effecting: LLVM neither merges nor
hoists it (polling loads must be re-issued every round); ptxas still schedules registers.

bf16 pairs: a 32-bit word holds element 2j in its low half and 2j+1 in its high half (little
endian), so `unpack` gives (low, high) and `pack(low, high)` rounds both to nearest even.
"""

from __future__ import annotations

from cutlass import Boolean, Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm

from oproj_jax import dsmem_ptx

SENTINEL = 0x80000000  # an empty mailbox word: the bf16 pair (+0.0, -0.0)

_CONSTRAINT = {Float32: "f", Int32: "r", Uint32: "r", Int64: "l", Boolean: "b"}


def _ir_type(dtype):
    return dtype.mlir_type


def asm(text: str, outs=(), ins=(), tied: bool = False):
    """Emit side-effecting inline PTX. `outs`: result DSL types; `ins`: (dtype, value) pairs.

    With `tied`, the first len(outs) inputs are tied to the outputs (read-modify-write).
    Returns None, one value, or a tuple of values (DSL numerics).
    """
    constraints = ["=" + _CONSTRAINT[t] for t in outs]
    operands = []
    for dtype, value in ins:
        operands.append(dtype(value).ir_value())
        constraints.append(_CONSTRAINT[dtype])
    if tied:
        for k in range(len(outs)):
            constraints[len(outs) + k] = str(k)
    if not outs:
        res = None
    elif len(outs) == 1:
        res = _ir_type(outs[0])
    else:
        res = llvm.StructType.get_literal([_ir_type(t) for t in outs])
    result = llvm.inline_asm(
        res,
        operands,
        text,
        ",".join(constraints),
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    if not outs:
        return None
    if len(outs) == 1:
        return outs[0](result)
    return tuple(
        t(llvm.extractvalue(_ir_type(t), result, [k])) for k, t in enumerate(outs)
    )


# --- f32 arithmetic with explicit rounding (never contracted or reassociated) -------------


def add_rn(a, b):
    return asm("add.rn.f32 $0, $1, $2;", (Float32,), ((Float32, a), (Float32, b)))


def mul_rn(a, b):
    return asm("mul.rn.f32 $0, $1, $2;", (Float32,), ((Float32, a), (Float32, b)))


def fma_rn(a, b, c):  # a * b + c, one rounding
    return asm(
        "fma.rn.f32 $0, $1, $2, $3;", (Float32,), ((Float32, a), (Float32, b), (Float32, c))
    )


def max_f32(a, b):
    return asm("max.f32 $0, $1, $2;", (Float32,), ((Float32, a), (Float32, b)))


def exp_approx(x):  # e^x with ex2.approx (the original kernel's fastmath exp)
    return asm(
        "{ .reg .f32 t; mul.f32 t, $1, 0f3FB8AA3B; ex2.approx.ftz.f32 $0, t; }",
        (Float32,),
        ((Float32, x),),
    )


def rstd(sum_of_squares, eps, hidden: int):
    """1 / sqrt(s / H + eps) (mean-square RMSNorm), rsqrt.approx like the original kernel's fastmath."""
    mean = fma_rn(sum_of_squares, Float32(1.0 / hidden), eps)
    return asm("rsqrt.approx.f32 $0, $1;", (Float32,), ((Float32, mean),))


def sub_rn(a, b):
    return asm("sub.rn.f32 $0, $1, $2;", (Float32,), ((Float32, a), (Float32, b)))


def dot8(a, b):
    """8-wide dot of two register lists/tensors: two interleaved fma chains, then one add."""
    even = mul_rn(a[0], b[0])
    odd = mul_rn(a[1], b[1])
    for j in range(2, 8, 2):
        even = fma_rn(a[j], b[j], even)
        odd = fma_rn(a[j + 1], b[j + 1], odd)
    return add_rn(even, odd)


# --- bf16 pack / unpack / sanitize ---------------------------------------------------------


def unpack(word):
    """u32 bf16 pair -> (f32 low, f32 high), exact."""
    return asm(
        "{ .reg .b32 t; shl.b32 t, $2, 16; mov.b32 $0, t; and.b32 t, $2, 0xffff0000; mov.b32 $1, t; }",
        (Float32, Float32),
        ((Uint32, word),),
    )


def pack(low, high):
    """(f32, f32) -> u32 bf16 pair, both rounded to nearest even."""
    return asm("cvt.rn.bf16x2.f32 $0, $1, $2;", (Uint32,), ((Float32, high), (Float32, low)))


def without_negative_zero(word):
    """u32 bf16 pair with each -0.0 half written as +0.0 (a published word is never the sentinel)."""
    return asm(
        "{ .reg .pred p, q; .reg .b32 t;"
        " and.b32 t, $1, 0x7fff; setp.eq.u32 p, t, 0;"
        " and.b32 t, $1, 0x7fff0000; setp.eq.u32 q, t, 0;"
        " mov.b32 $0, $1;"
        " @p and.b32 $0, $0, 0xffff0000;"
        " @q and.b32 $0, $0, 0x0000ffff; }",
        (Uint32,),
        ((Uint32, word),),
    )


def published4(w0, w1, w2, w3):
    """True when none of the four 32-bit words is the sentinel (bit compare, never float)."""
    s = Uint32(SENTINEL)
    return (w0 != s) & (w1 != s) & (w2 != s) & (w3 != s)


# --- global memory -------------------------------------------------------------------------

_U4 = (Uint32, Uint32, Uint32, Uint32)


def ld_poll4(addr):
    """16-byte polling load: volatile (never cached in L1, never hoisted); 4 x u32."""
    return asm("ld.volatile.global.v4.b32 {$0, $1, $2, $3}, [$4];", _U4, ((Int64, addr),))


def ld_first4(addr, ready, skip):
    """First-round mailbox load. `ready` != 0: the slot is complete before the launch (ready
    mode), so a non-coherent load through the read-only path is safe and issues faster than the
    volatile one (LDG.CONSTANT vs LDG.STRONG.SYS); else the polling load above. `skip` != 0 (a
    refused call): no load at all, the four words are the sentinel."""
    return asm(
        "{ .reg .pred t, nc, vol; setp.ne.s32 t, $5, 0; setp.eq.and.s32 nc, $6, 0, t;"
        " setp.eq.s32 t, $5, 0; setp.eq.and.s32 vol, $6, 0, t;"
        " mov.b32 $0, 0x80000000; mov.b32 $1, 0x80000000; mov.b32 $2, 0x80000000; mov.b32 $3, 0x80000000;"
        " @nc ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$4];"
        " @vol ld.volatile.global.v4.b32 {$0, $1, $2, $3}, [$4]; }",
        _U4,
        ((Int64, addr), (Int32, ready), (Int32, skip)),
    )


def ld_poll4_if(pred, addr, old):
    """Predicated polling load: reload the 4 words when `pred` != 0, else keep `old`."""
    return asm(
        "{ .reg .pred p; setp.ne.u32 p, $8, 0;"  # $4..$7: the old words, tied to $0..$3
        " @p ld.volatile.global.v4.b32 {$0, $1, $2, $3}, [$9]; }",
        _U4,
        tuple((Uint32, w) for w in old) + ((Int32, pred), (Int64, addr)),
        tied=True,
    )


def st4(addr, words):
    """Plain 16-byte global store."""
    asm("st.global.v4.b32 [$0], {$1, $2, $3, $4};", (), ((Int64, addr),) + tuple((Uint32, w) for w in words))


def st4_relaxed_gpu(addr, words):
    """16-byte store other kernels poll (xmoe replicas): relaxed, gpu scope."""
    asm(
        "st.relaxed.gpu.global.v4.b32 [$0], {$1, $2, $3, $4};",
        (),
        ((Int64, addr),) + tuple((Uint32, w) for w in words),
    )


def rearm(addr):
    """Store the sentinel into one 16-byte fragment of a mailbox slot (marks it empty again).
    Relaxed at system scope: the slot's publisher, on another GPU, polls it with
    ld.relaxed.sys, and a pair of accesses from different GPUs is only guaranteed to be
    observed when both are at least relaxed at system scope (PTX memory model)."""
    asm(
        "{ .reg .b32 s; mov.b32 s, 0x80000000; st.relaxed.sys.global.v4.b32 [$0], {s, s, s, s}; }",
        (),
        ((Int64, addr),),
    )


def fail_word(control):
    """The group's fail-stop word (u32 at control + 8, docs/spec.md "Mailbox protocol"): nonzero
    once any call of the group gave up, or the group was closed. Relaxed, gpu scope (only this
    GPU's kernels write it). 0 when `control` is 0 (no control block: nothing to read)."""
    return asm(
        "{ .reg .pred p; setp.ne.u64 p, $1, 0; mov.b32 $0, 0; @p ld.relaxed.gpu.global.b32 $0, [$1 + 8]; }",
        (Int32,),
        ((Int64, control),),
    )


def fail_group(control, code):
    """ORs `code` into the group's fail-stop word (no-op when `control` is 0)."""
    asm(
        "{ .reg .pred p; setp.ne.u64 p, $0, 0; @p red.relaxed.gpu.global.or.b32 [$0 + 8], $1; }",
        (),
        ((Int64, control), (Int32, code)),
    )


def nctaid_y():
    """The grid's y extent: the tokens of this launch."""
    return asm("mov.u32 $0, %nctaid.y;", (Int32,))


def store_status(addr, code):
    asm("st.relaxed.gpu.global.b32 [$0], $1;", (), ((Int64, addr), (Int32, code)))


def release_add(addr, value):
    """The hints counter: red.release.gpu.add (orders this thread's prior stores before it)."""
    asm("red.release.gpu.global.add.u32 [$0], $1;", (), ((Int64, addr), (Uint32, value)))


def stamp(addr, clock: str, thread):
    """Trace builds only: thread 0 stores the 64-bit timer `clock` (%clock64: this SM's cycles;
    %globaltimer: ns, common to all SMs) at [addr]. Predicated in PTX: no branch in the kernel."""
    asm("{ .reg .pred p; .reg .u64 t; setp.eq.u32 p, $1, 0; mov.u64 t, " + clock + "; @p st.global.u64 [$0], t; }",
        (), ((Int64, addr), (Int32, thread)))


def globaltimer():
    """%globaltimer: nanoseconds, one clock for every SM of the GPU (bounded waits use it)."""
    return asm("mov.u64 $0, %globaltimer;", (Int64,))


def timed_out(start, timeout_us):
    """True once `timeout_us` (> 0) microseconds have passed since `start` (a globaltimer value);
    never with timeout_us <= 0."""
    return (timeout_us > 0) & (globaltimer() - start >= Int64(timeout_us) * 1000)


def fence_acq_rel_gpu():
    asm("fence.acq_rel.gpu;")


def griddep_launch_dependents():
    asm("griddepcontrol.launch_dependents;")


def griddep_wait():
    asm("griddepcontrol.wait;")


def prefetch_l2_if(pred, gaddr):
    """Ask L2 for the line holding `gaddr` where pred != 0: no data returned, nothing waited
    for. L2 is where every store lands, so a line fetched before a predecessor's last stores is
    still read correctly afterwards. (prefetch.global.L2, not the bulk prefetch: compute-sanitizer's
    racecheck stops with a segmentation fault on cp.async.bulk.prefetch.L2.)"""
    asm(
        "{ .reg .pred p; setp.ne.s32 p, $0, 0; @p prefetch.global.L2 [$1]; }",
        (),
        ((Int32, pred), (Int64, gaddr)),
    )


# --- shared memory, cp.async ---------------------------------------------------------------


def cp_async16(saddr, gaddr):
    asm("cp.async.cg.shared.global [$0], [$1], 16;", (), ((Int32, saddr), (Int64, gaddr)))


def cp_async_commit():
    asm("cp.async.commit_group;")


def cp_async_wait_group(pending: int):
    """Wait until at most `pending` of this thread's newest cp.async groups are in flight."""
    asm(f"cp.async.wait_group {pending};")


def cp_async_wait_all():
    cp_async_wait_group(0)


def lds4(saddr):
    return asm("ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", _U4, ((Int32, saddr),))


def sts4(saddr, words):
    asm("st.shared.v4.b32 [$0], {$1, $2, $3, $4};", (), ((Int32, saddr),) + tuple((Uint32, w) for w in words))


def lds4_f32(saddr):
    return asm(
        "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];", (Float32,) * 4, ((Int32, saddr),)
    )


def sts4_f32(saddr, values):
    asm(
        "st.shared.v4.f32 [$0], {$1, $2, $3, $4};",
        (),
        ((Int32, saddr),) + tuple((Float32, v) for v in values),
    )


def lds_f32(saddr):
    return asm("ld.shared.f32 $0, [$1];", (Float32,), ((Int32, saddr),))


def sts_f32(saddr, value):
    asm("st.shared.f32 [$0], $1;", (), ((Int32, saddr), (Float32, value)))


def sts_f32_if(flag, saddr, value):
    """st.shared of one f32 when `flag` is true, predicated (no branch)."""
    asm("{ .reg .pred p; setp.ne.u32 p, $2, 0; @p st.shared.f32 [$0], $1; }", (),
        ((Int32, saddr), (Float32, value), (Int32, Int32(flag))))


# --- tensor cores --------------------------------------------------------------------------


def ldmatrix_x4(saddr):
    """Four 8x8 b16 matrices from shared memory: lane i gives the address of row i % 8 of matrix
    i // 8 (16 contiguous bytes); word j of lane l holds row l // 4, columns 2 (l % 4), +1 of
    matrix j: with matrices (A rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
    (rows 8-15, k 8-15) that is the A operand of mma_bf16."""
    return asm("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];", _U4, ((Int32, saddr),))


def mma_bf16(a, b, c):
    """c + A @ B, m16n8k16: A [16, 16] bf16 (4 words, ldmatrix_x4 order), B [16 k, 8 n] bf16
    (2 words: k 2 (l % 4), +1 and +8, +9 of column l // 4), c/result [16, 8] f32 (4 values:
    row l // 4, columns 2 (l % 4), +1, then row l // 4 + 8). bf16 products are exact in f32;
    the tensor core adds them in its own order (f32 accumulation)."""
    return asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7},"
        " {$8, $9}, {$10, $11, $12, $13};",
        (Float32,) * 4,
        tuple((Uint32, w) for w in a) + tuple((Uint32, w) for w in b) + tuple((Float32, v) for v in c),
    )


# --- barriers, mbarriers, distributed shared memory ----------------------------------------


def bar_sync(barrier_id: int, threads: int):
    asm(f"bar.sync {barrier_id}, {threads};")


def bar_arrive(barrier_id: int, threads: int):
    asm(f"bar.arrive {barrier_id}, {threads};")


def sync_warp():
    asm("bar.warp.sync -1;")


def mbar_init(saddr, count: int):
    asm(f"mbarrier.init.shared::cta.b64 [$0], {count};", (), ((Int32, saddr),))


def fence_mbar_init():
    asm("fence.mbarrier_init.release.cluster;")


def mbar_arrive_expect_tx(saddr, nbytes: int):
    asm(
        "{ .reg .b64 state;"
        f" mbarrier.arrive.expect_tx.shared::cta.b64 state, [$0], {nbytes}; }}",
        (),
        ((Int32, saddr),),
    )


def mbar_arrive(saddr):
    """One arrival (release, CTA scope): orders this thread's earlier smem stores before it."""
    asm("{ .reg .b64 state; mbarrier.arrive.shared::cta.b64 state, [$0]; }", (), ((Int32, saddr),))


def mbar_wait_phase0(saddr):
    """Spin until phase 0 of the mbarrier completes (all expected bytes arrived)."""
    asm(dsmem_ptx.WAIT_PHASE0, (), ((Int32, saddr),))


def cluster_arrive_relaxed():
    asm("barrier.cluster.arrive.relaxed.aligned;")


def cluster_wait():
    asm("barrier.cluster.wait.aligned;")


def push_f32(saddr, value, mbar_saddr, peer):
    """st.async one f32 into CTA `peer`'s copy of `saddr`, completing its mbarrier `mbar_saddr`."""
    asm(
        "{ .reg .b32 d, m; mapa.shared::cluster.u32 d, $0, $3; mapa.shared::cluster.u32 m, $2, $3;"
        " st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [d], $1, [m]; }",
        (),
        ((Int32, saddr), (Float32, value), (Int32, mbar_saddr), (Int32, peer)),
    )


def put_f32(saddr, value, mbar_saddr, peer, rank):
    """Deliver one f32 to CTA `peer`'s copy of `saddr` and account for it on its mbarrier:
    st.async (complete_tx) to another CTA; to this CTA a plain st.shared plus one mbarrier
    arrival (st.async is only used across CTAs, as in the verified cluster example)."""
    asm(dsmem_ptx.PUT_F32, (),
        ((Int32, saddr), (Float32, value), (Int32, mbar_saddr), (Int32, peer), (Int32, rank)))


def shfl_bfly(value, mask: int):
    return asm(
        f"shfl.sync.bfly.b32 $0, $1, {mask}, 31, -1;", (Float32,), ((Float32, value),)
    )


def min_i32(a, b):
    return asm("min.s32 $0, $1, $2;", (Int32,), ((Int32, a), (Int32, b)))


def select_f32(flag, if_set, if_clear):
    """flag (Int32) != 0 ? if_set : if_clear, without a branch."""
    return asm(
        "{ .reg .pred p; setp.ne.u32 p, $3, 0; selp.f32 $0, $1, $2, p; }",
        (Float32,),
        ((Float32, if_set), (Float32, if_clear), (Int32, flag)),
    )


def pending_bit(words, bit: int):
    """`bit` when any of the 4 words is the sentinel (slot fragment still empty), else 0."""
    return asm(
        "{ .reg .pred p; setp.eq.u32 p, $1, 0x80000000; setp.eq.or.u32 p, $2, 0x80000000, p;"
        " setp.eq.or.u32 p, $3, 0x80000000, p; setp.eq.or.u32 p, $4, 0x80000000, p;"
        f" selp.b32 $0, {bit}, 0, p; }}",
        (Int32,),
        tuple((Uint32, w) for w in words),
    )


def bits(value):  # f32 -> u32, same bits
    return asm("mov.b32 $0, $1;", (Uint32,), ((Float32, value),))
