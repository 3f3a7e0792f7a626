"""The consumer kernel in CuTe DSL: our port of OprojConsumer, the original CuTe-DSL kernel for
PyTorch/vLLM (the function: docs/spec.md; the launch contract: ABI.md).

One token per cluster of 7 CTAs (grid (7, T)), 128 * groups threads per CTA. Thread i of
group 0 in CTA c owns the 8 contiguous elements h = (c*128 + i)*8 .. +7 of the hidden row.

Timeline of one CTA:
  all      PDL trigger (more than TRIGGER_AFTER_WAIT_MAX_T tokens); up to WARM_L2_MAX_T tokens group 0
           asks L2 for every row (L2 warm-up); PDL wait; PDL trigger (up to TRIGGER_AFTER_WAIT_MAX_T)
  group 0  cp.async its slices of norm, query, out_norm, prefix (has_delta) -> smem (group 1),
           issues the first polling loads of its rank slots, then cp.async the blocks (group 2)
  all      while those loads are in flight: thread 0 inits the exchange mbarrier, then the
           cluster barrier (peers may deliver into it after it)
  group g  polls ranks g*S .. g*S+S-1 (S = ceil(R/G)), sums them in rank order, hands the
           f32 partial sum to group 0 through smem (named barrier 2), re-arms its slots
  group 0  once group 1 landed, splits w = norm * query into two bf16 rows; sums its slots, then adds group 1, 2,
           ... in group order (the prefix bits), rounds, writes prefix, re-arms; then every row
           statistic of its slice (row_stats: the blocks' Gram matrix, b.w, b.p on the tensor
           cores; p.p, p.w as 8-wide dots and a warp butterfly), 4 warps via smem, one exchange
           to the 7 CTAs via st.async (DSMEM); from the totals the block softmax kept
           unnormalized and the original kernel's quadratic form (eps scaled by den^2); mix, output, xmoe
           replicas (-0 -> +0), hints.
  (NB = 0: output = RMSNorm(p); the exchange carries p.p only.)

The original kernel exchanges twice: block statistics before the rank sum, then mix.mix and
mix.p after the softmax. Both of the latter are arithmetic on sums the first exchange can carry
(the Gram matrix and b.p; row_stats), so one exchange after the rank sum replaces the two: no
second round trip on the critical path at small T, while every CTA of a cluster waits for its
slowest sibling's mailbox before the mix (docs/perf.md, "The CuTe kernel").

PDL: `griddepcontrol.launch_dependents` (below); `griddepcontrol.wait` right after the
shared-memory setup and BEFORE the first global read. The original kernel waits at exit, which is only
safe when every input it reads early arrives through the polled mailbox; under XLA the
previous kernel writes prefix, blocks and the mailbox with ordinary stores, and PDL gives no
visibility of those before the wait. The launch latency and setup still overlap the previous
kernel; the later `wait` the original kernel has at exit is then a no-op and is left out.
Where the next grid may launch depends on the launch's tokens (%nctaid.y): up to
TRIGGER_AFTER_WAIT_MAX_T tokens the trigger comes right after the wait, so that one grid at a
time waits (and, up to WARM_L2_MAX_T tokens, warms its rows) while the one ahead runs; with the
trigger on entry grids further down a chain launch while the one ahead still waits and compete
with the grid that runs. Larger launches trigger on entry (docs/perf.md, "When the next grid may
launch").

L2 warm-up: a launch of few tokens is a few clusters waiting on their loads, which PDL starts
while the kernel ahead still runs. Before the wait group 0 asks L2 for the CTA's slice of every
row it reads (prefetch.global.L2, one line a thread a row): a prefetch returns no data, and
L2 is where every store lands, so a line fetched before the kernel ahead stores it still reads
the store after the wait. The mailbox only in ready mode. More tokens fill the GPU, the
prefetches only add requests to a full memory system, and the launch skips them (docs/perf.md).

Bounded polling: with timeout_us > 0 a poll gives up once that many microseconds of
%globaltimer (wall time, the same for every T) have passed since it first found an empty slot,
stores a code into `status` (1: mailbox, 2: twoshot receive slots), and reads NaN (NAN_WORD)
for every fragment it did not receive, re-arming only those it read: a step that gave up
returns NaN where a partial was missing, never a finite wrong number. timeout_us = 0 would
wait forever: the Python entry points refuse it.

Fail-stop (mode="peer", docs/spec.md "Mailbox protocol"): `control` (param 14; 0 elsewhere)
points at the group's control words. The kernel reads the fail-stop word (control + 8) before
its first mailbox load: nonzero refuses the call (status STATUS_REFUSED | the word, no mailbox
access, every fragment NaN). A poll also gives up once the word is set (another CTA of the
call gave up: one deadline per call, whatever T), and a poll that gives up ORs its code in.
`T` is the slots' capacity (the slot stride); the launch's own tokens are the grid's y.

FOLDED (fold=True): 128 threads per CTA whatever `groups` is. The one group loads every slot
and adds the groups' partial sums in group order itself, each partial summed in rank order as
its polling group would: the same f32 operations in the same order, so the prefix bits match
the grouped build. It saves the smem hand-off and barrier between groups and, with a quarter
of the threads, lets more clusters be resident (T=64 fits in one wave on the H200).

Ready mode: timeout_us < 0 says every slot was complete before the launch (XLA produced the
mailbox; PDL's wait makes it visible): each fragment is loaded once, nothing is polled and
nothing is re-armed, so the mailbox is only read and may hold real -0.0 values. The rank sum
adds +0.0 last, which turns an all-(-0.0) sum into +0.0 exactly as summing published data
(-0 -> +0) would, and leaves every other sum unchanged: the prefix bits match either way.
From READY_NC_MIN_T tokens on, those one-shot loads are non-coherent (ld.global.nc: the data
cannot change during the kernel, which is what .nc requires); below that the volatile load
is the faster one (docs/perf.md).

Own partial (`own` variants: one-shot, ready mode): the caller's own partial `own` [T, H] is
read in place of mailbox slot `own_slot` (a kernel argument), so a caller whose partial lies in
its own buffer (the o-proj GEMM's output) need not copy it into the mailbox first. The slot's
address is the only difference: the loads, the rank order and the bits are those of the mailbox
read. A compile-time choice: built into every variant, the address arithmetic changes how
ptxas schedules the first loads and costs 7-12 % at T >= 512 (docs/perf.md); the variants
without it keep their code.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from oproj_jax.abi import STATUS_MAILBOX, STATUS_RECV, STATUS_REFUSED
from oproj_jax.cute import primitives as P
from oproj_jax.cute import row_stats

CTAS = 7  # cluster: the CTAs of one token
THREADS = 128  # per group; one group covers 1/7 of the row
VEC = 8  # bf16 elements per thread (16 bytes)
ROW_BYTES = THREADS * VEC * 2  # one CTA's slice of one [H] row in smem
NAN_WORD = 0x7FC07FC0  # two bf16 quiet NaNs: what a fragment given up on reads as
# trace builds (trace=True, never in the manifest): `status` points at [T, CTAS, TRACE_SLOTS] u64
# timers: slots 0..13 %clock64 at the phase marks of `body`, 14/15 %globaltimer at entry/exit
TRACE_SLOTS = 16
TRACE_MARKS = ("entry", "pdl_wait", "loads_issued", "cluster_sync", "smem_rows", "rank_sum", "prefix_stored",
               "stats_sent", "stats_received", "totals", "mixed", "stored")
TRACE_GLOBAL = {"entry": TRACE_SLOTS - 2, "stored": TRACE_SLOTS - 1}  # marks that also store %globaltimer
TWOSHOT_CHUNK = 8  # recv slots polled at once by a twoshot reducer thread
READY_NC_MIN_T = 64  # ready mode loads the mailbox non-coherently from this many tokens on
WARM_L2_MAX_T = 16  # launches of up to this many tokens warm L2 before the PDL wait (L2 warm-up)
TRIGGER_AFTER_WAIT_MAX_T = 32  # launches of up to this many tokens let the next grid launch after their wait


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Layout:
    """Static shared-memory layout (byte offsets) of one variant."""

    def __init__(self, nb: int, poll_groups: int):
        stride = row_stats.STRIDE
        self.bar = 0  # 2 x u64 mbarriers: the row statistics (NB > 0), p.p (NB = 0)
        self.wpre = 16  # [4 warps, stride] f32
        self.pre = self.wpre + 4 * stride * 4  # [7 CTAs, stride] f32 (written by peers)
        self.blk = self.pre + CTAS * stride * 4  # [stride] f32: the cluster totals
        self.post = self.blk + stride * 4  # [7 CTAs, 4 warps] f32 (NB = 0; written by peers)
        self.total = self.post + CTAS * 4 * 4  # [1] f32
        # norm, query, out_norm, prefix, blocks 0..NB-1. Reused once read (row_stats, NB > 0):
        # norm and query hold w_hi and w_lo, the prefix row (after the rank sum) p
        self.rows = 4 + nb
        self.pf = _ceil_div(self.total + 16, 128) * 128  # [rows, 128 threads, 16 B], swizzled
        self.parts = self.pf + self.rows * ROW_BYTES  # [groups-1, 2 halves, 128, 4] f32
        self.size = self.parts + max(0, poll_groups - 1) * 2 * THREADS * 16


class OprojConsumer:
    """Static variant: R ranks, NB blocks, has_delta, groups, xmoe replicas, twoshot, own; H fixed."""

    def __init__(self, R: int, NB: int, *, has_delta: bool, groups: int, xmoe_replicas: int,
                 twoshot: bool, own: bool = False, H: int = 7168, min_ctas: int = 0, fold: bool = False,
                 trace: bool = False):
        if not 1 <= R <= 16:
            raise ValueError(f"R: expected 1 <= R <= 16, got {R}")
        if not 0 <= NB <= 8:
            raise ValueError(f"NB: expected 0 <= NB <= 8, got {NB}")
        if not 1 <= groups <= 4:
            raise ValueError(f"groups: expected 1 <= groups <= 4, got {groups}")
        if not 0 <= xmoe_replicas <= 8:
            raise ValueError(f"xmoe_replicas: expected 0..8, got {xmoe_replicas}")
        if H != CTAS * THREADS * VEC:
            raise ValueError(f"H: the kernel covers H = {CTAS * THREADS * VEC}, got {H}")
        if twoshot and own:
            raise ValueError("own: an own partial is read by one-shot variants only (twoshot polls a gather row)")
        if twoshot and (H // R) % VEC:
            raise ValueError(f"R: twoshot needs H/R to be a multiple of {VEC}, got R={R}")
        self.R, self.NB, self.has_delta, self.groups = R, NB, has_delta, groups
        self.reps, self.twoshot, self.own, self.H = xmoe_replicas, twoshot, own, H
        if not 0 <= min_ctas <= 2048 // (THREADS if fold else THREADS * groups):
            raise ValueError(f"min_ctas: expected 0 (no bound) .. 2048 / threads per CTA, got {min_ctas}")
        self.min_ctas = min_ctas  # launch bound: resident CTAs per SM ptxas must allow (registers)
        self.fold = fold  # one 128-thread group does every polling group's work (see FOLDED)
        self.trace = trace  # phase timers into `status` (TRACE_MARKS); off: no code at all
        slots = 1 if twoshot else R  # mailbox slots this kernel polls
        self.slots = slots
        self.S = _ceil_div(slots, groups)  # slots per polling group
        self.poll_groups = _ceil_div(slots, self.S)  # groups that own at least one slot
        self.stats = row_stats.Stats(NB) if NB else None  # what the exchange carries (NB > 0)
        self.layout = Layout(NB, 1 if fold else self.poll_groups)
        self.threads = THREADS if fold else THREADS * groups
        self.raw_slots = max(slots if fold else self.S, min(R, TWOSHOT_CHUNK) if twoshot else 1)

    @property
    def smem_bytes(self) -> int:
        return self.layout.size

    # ---- small pieces (plain Python: straight-line PTX, traced inline) -------------------

    def chunk(self, smem, row, t):
        """Shared address of thread t's 16 bytes of smem row `row`. Swizzled: chunk t is stored at
        t ^ (row % 8), so the same chunk of 8 consecutive rows (what one ldmatrix phase reads)
        falls in 8 distinct bank groups, while a warp's 32 chunks still fill its 4 aligned
        128-byte lines (cp.async and the row-wise reads stay conflict-free and aligned)."""
        return smem + self.layout.pf + row * ROW_BYTES + (t ^ (row % 8)) * 16

    def prefetch(self, smem, row, t, slice_start):
        """cp.async 16 bytes of the CTA's slice of a global row into smem row `row`, swizzled as
        self.chunk says. Thread t writes smem chunk t and reads the global chunk that belongs
        there (t ^ (row % 8), in the same 128-byte line): the warp still reads its 4 whole lines
        and its smem destinations stay linear (a permuted destination gains nothing)."""
        P.cp_async16(smem + self.layout.pf + row * ROW_BYTES + t * 16, slice_start + (t ^ (row % 8)) * 16)

    def fragment(self, smem, row, t):  # 8 f32 from one 16-byte smem chunk
        words = P.lds4(self.chunk(smem, row, t))
        out = []
        for w in words:
            out.extend(P.unpack(w))
        return out

    def sum_slots(self, raw, n: int, first: int = 0):  # rank-order f32 sum of n polled fragments
        values = []
        for j in range(4):
            lo, hi = P.unpack(raw[4 * first + j])
            for k in range(first + 1, first + n):
                a, b = P.unpack(raw[4 * k + j])
                lo, hi = P.add_rn(lo, a), P.add_rn(hi, b)
            values.extend((lo, hi))
        return values

    def slot(self, frag, stride, k: int, jump, own_slot):
        """Slot k's fragment; in an `own` variant slot own_slot's is own's (Own partial)."""
        if cutlass.const_expr(not self.own):
            return frag + k * stride
        return frag + (k * stride + Int64(own_slot == k) * jump)  # the bracket: uniform offsets

    def fold_slots(self, total, raw, n: int):  # total + slot 0 + slot 1 + ... (rank order)
        total = list(total)
        for k in range(n):
            for j in range(4):
                lo, hi = P.unpack(raw[4 * k + j])
                total[2 * j] = P.add_rn(total[2 * j], lo)
                total[2 * j + 1] = P.add_rn(total[2 * j + 1], hi)
        return total

    @staticmethod
    def reduce_scatter(values, size: int, lane):
        """Warp-reduce `size` values (a power of two); lane holds the total number `idx`.

        Each butterfly step halves the live values: the lower half of the lanes keeps the
        low values and sends the high ones, the upper half the reverse. Lanes with
        (lane & (32/size - 1)) == 0 end up holding distinct totals.
        """
        values = list(values)
        for shift in range(4, -1, -1):
            live = max(1, size >> (4 - shift))
            half = max(1, live // 2)
            if live == 1:
                values[0] = P.add_rn(values[0], P.shfl_bfly(values[0], 1 << shift))
            else:
                upper = lane & (1 << shift)
                for j in range(half):
                    send = P.select_f32(upper, values[j], values[j + half])
                    keep = P.select_f32(upper, values[j + half], values[j])
                    values[j] = P.add_rn(keep, P.shfl_bfly(send, 1 << shift))
                values = values[:half]
        idx = Int32(0)
        for shift in range(4, -1, -1):
            width = size >> (4 - shift)
            if width > 1:
                idx = idx + ((lane >> shift) & 1) * (width // 2)
        return values[0], idx

    def warm_l2(self, thread, token, cta, mailbox, slot_stride, jump, own_slot, prefix, blocks, norm, query,
                out_norm, timeout_us):
        """Before the PDL wait: ask L2 for the CTA's slice (from element `cta` of a row) of every
        row it will read, so that the loads after the wait find them there (L2 warm-up in the
        module docstring). Row i's 16 lines of 128 bytes are asked for by the 16 threads
        t // 16 == i % 8 of group 0, one line each. The mailbox only in ready mode: a polled slot
        may still be empty, a refused call's mailbox gone."""
        start = Int64(token) * self.H + cta  # the slice in the token's rows of [T, H]
        rows = [norm + cta * 2, query + cta * 2] if self.NB > 0 else []
        rows.append(out_norm + cta * 2)
        if cutlass.const_expr(self.has_delta):
            rows.append(prefix + start * 2)
        rows += [blocks + ((Int64(token) * self.NB + b) * self.H + cta) * 2 for b in range(self.NB)]
        plain = len(rows)
        if cutlass.const_expr(not self.twoshot):
            rows += [self.slot(mailbox + start * 2, slot_stride, k, jump, own_slot) for k in range(self.slots)]
        line = Int64((thread % 16) * 128)
        mine = [Int32((thread // 16) == r) for r in range(8)]  # group 0's threads only: thread < 128
        ready = Int32(timeout_us < 0)
        for i, addr in enumerate(rows):
            P.prefetch_l2_if(mine[i % 8] & ready if i >= plain else mine[i % 8], addr + line)

    def marker(self, status, token, rank, thread):
        """mark(name): in trace builds thread 0 of the CTA stores its timers for the phase mark
        `name` into the CTA's row of the trace buffer; otherwise nothing (no code at all)."""
        if not self.trace:
            return lambda name: None
        row = status + (Int64(token) * CTAS + rank) * (TRACE_SLOTS * 8)

        def mark(name: str):
            if name in TRACE_GLOBAL:
                P.stamp(row + TRACE_GLOBAL[name] * 8, "%globaltimer", thread)
            P.stamp(row + TRACE_MARKS.index(name) * 8, "%clock64", thread)

        return mark

    # ---- polling (dynamic loop) -----------------------------------------------------------

    @cute.jit
    def poll(self, raw, base: Int64, stride: Int64, n: cutlass.Constexpr[int],
             loaded: cutlass.Constexpr[bool], timeout_us: Int32, status: Int64,
             code: cutlass.Constexpr[int], control: Int64, refused: Int32):
        """Poll n slot fragments (base + k*stride) into raw[4k..4k+3] until none is empty, or
        give up (Bounded polling): a refused call (`refused`: the group's fail-stop word as the
        call found it, nonzero) at once, else after timeout_us or once the fail-stop word is
        set. Fragments given up on hold NAN_WORD. Returns the mask of those fragments (bit k:
        fragment k), 0 when complete."""
        if cutlass.const_expr(not loaded):
            for k in cutlass.range_constexpr(n):
                first = P.ld_first4(base + k * stride, Int32(0), refused)
                for j in cutlass.range_constexpr(4):
                    raw[4 * k + j] = first[j]
        pending = Int32(0)
        if timeout_us >= 0:  # ready mode (< 0): XLA wrote the data before this kernel; no check
            for k in cutlass.range_constexpr(n):
                pending = pending | P.pending_bit([raw[4 * k + j] for j in range(4)], 1 << k)
        live = Int32(refused != 0) - 1  # every bit when polling, none when refused: a refused call loads nothing
        missing = Int32(0)
        # the clock is read only once something is still empty: ready and complete slots pay nothing
        start = Int64(0)
        if pending != 0:
            start = P.globaltimer()
        while pending != 0:
            for k in cutlass.range_constexpr(n):
                fresh = P.ld_poll4_if(pending & live & (1 << k), base + k * stride,
                                      [raw[4 * k + j] for j in range(4)])
                for j in cutlass.range_constexpr(4):
                    raw[4 * k + j] = fresh[j]
            left = Int32(0)
            for k in cutlass.range_constexpr(n):
                left = left | P.pending_bit([raw[4 * k + j] for j in range(4)], 1 << k)
            if (left != 0) & ((refused != 0) | P.timed_out(start, timeout_us) | (P.fail_word(control) != 0)):
                if refused != 0:
                    P.store_status(status, refused | Int32(STATUS_REFUSED))
                else:
                    P.store_status(status, Int32(code))
                    P.fail_group(control, Int32(code))
                missing = left
                left = Int32(0)
            pending = left
        if missing != 0:
            for k in cutlass.range_constexpr(n):
                if (missing >> k) & 1:
                    for j in cutlass.range_constexpr(4):
                        raw[4 * k + j] = cutlass.Uint32(NAN_WORD)
        return missing

    @cute.jit
    def rearm_received(self, base: Int64, stride: Int64, n: cutlass.Constexpr[int], missing: Int32):
        """Re-arm the n fragments of a protocol-mode poll that were read (not those given up on:
        a late publish may still land there; docs/spec.md "Mailbox protocol")."""
        for k in cutlass.range_constexpr(n):
            if ((missing >> k) & 1) == 0:
                P.rearm(base + k * stride)

    @cute.jit
    def twoshot_reduce(self, raw, recv: Int64, gather: Int64, me: Int32, T: Int32, token: Int32,
                       h: Int32, timeout_us: Int32, status: Int64):
        """Threads owning columns of slice `me`: sum every rank's partial (rank order), store
        the bf16 sum (-0 -> +0) into the gather row, re-arm the receive slots."""
        cols = self.H // self.R
        if h // cols == me:
            local = Int64(h - me * cols)
            stride = Int64(T) * (cols * 2)
            base = recv + (Int64(token) * cols + local) * 2
            total = []
            for first in cutlass.range_constexpr(0, self.R, TWOSHOT_CHUNK):
                n = min(TWOSHOT_CHUNK, self.R - first)
                self.poll(raw, base + first * stride, stride, n, False, timeout_us, status,
                          STATUS_RECV, Int64(0), Int32(0))
                if cutlass.const_expr(first == 0):
                    total = self.sum_slots(raw, n)
                else:  # fold each slot into the running sum: plain rank order (docs/spec.md, "Twoshot")
                    total = self.fold_slots(total, raw, n)
            words = [P.without_negative_zero(P.pack(total[2 * j], total[2 * j + 1]))
                     for j in range(4)]
            P.st4(gather + (Int64(token) * self.H + h) * 2, words)
            if timeout_us >= 0:  # ready mode leaves the caller's buffers alone
                for r in cutlass.range_constexpr(self.R):
                    P.rearm(base + r * stride)

    # ---- the kernel -----------------------------------------------------------------------

    @cute.jit
    def body(self, mailbox: Int64, prefix: Int64, blocks: Int64, norm: Int64, query: Int64,
             out_norm: Int64, output: Int64, xmoe: Int64, hints: Int64, status: Int64,
             eps: Float32, out_eps: Float32, T: Int32, timeout_us: Int32, recv: Int64,
             gather: Int64, me: Int32, control: Int64, own: Int64, own_slot: Int32):
        L, H, NB = self.layout, self.H, self.NB
        rank, token, _ = cute.arch.block_idx()
        thread, _, _ = cute.arch.thread_idx()
        group, t = thread // THREADS, thread % THREADS
        warp, lane = t // 32, t % 32

        allocator = cutlass.utils.SmemAllocator()
        smem = allocator.allocate(L.size, 128).toint()  # Int32 shared-window address
        bar_pre, bar_post = smem + L.bar, smem + L.bar + 8
        mark = self.marker(status, token, rank, thread)
        mark("entry")
        tokens = P.nctaid_y()  # this launch's tokens (T is the mailbox slots' capacity)
        if tokens > TRIGGER_AFTER_WAIT_MAX_T:
            P.griddep_launch_dependents()

        h = (rank * THREADS + t) * VEC
        row = Int64(token) * H + h  # element offset of this thread's fragment in a [T, H] row
        slot_stride = Int64(T) * (H * 2)  # bytes between mailbox slots (T: the slots' capacity)
        frag = mailbox + row * 2
        jump = Int64(0)  # own variants: the byte distance from slot own_slot to own (Own partial)
        if cutlass.const_expr(self.own):
            jump = (own - mailbox - Int64(own_slot) * slot_stride) * Int64(own != 0)  # no own: 0
        if tokens <= WARM_L2_MAX_T:
            self.warm_l2(thread, token, Int64(rank * THREADS * VEC), mailbox, slot_stride, jump, own_slot, prefix,
                         blocks, norm, query, out_norm, timeout_us)
        P.griddep_wait()  # before the first global read: see the module docstring
        if tokens <= TRIGGER_AFTER_WAIT_MAX_T:
            P.griddep_launch_dependents()
        mark("pdl_wait")
        raw = cute.make_rmem_tensor(cute.make_layout(4 * self.raw_slots), cutlass.Uint32)

        first_slots = self.slots if self.fold else min(self.S, self.slots)  # group 0's slots
        ready_nc = Int32((timeout_us < 0) & (T >= READY_NC_MIN_T))  # see Ready mode
        # Fail-stop (protocol mode with a control block): a group that failed before refuses
        # the call before any mailbox load (the mailbox of a closed group may be gone)
        refused = Int32(0)  # the fail-stop word as the call found it (its bits say why)
        if timeout_us >= 0:
            refused = P.fail_word(control)
        if group == 0:
            # -- prefetch this thread's 16-byte slices into smem --------------------------
            cta = Int64(rank * THREADS * VEC)  # the CTA's first element of a row
            if cutlass.const_expr(NB > 0):
                self.prefetch(smem, 0, t, norm + cta * 2)
                self.prefetch(smem, 1, t, query + cta * 2)
            self.prefetch(smem, 2, t, out_norm + cta * 2)
            if cutlass.const_expr(self.has_delta):
                self.prefetch(smem, 3, t, prefix + (Int64(token) * H + cta) * 2)
            P.cp_async_commit()  # group 1: what the rank sum needs (prefix) and the weights
            if cutlass.const_expr(not self.twoshot):
                for k in cutlass.range_constexpr(first_slots):  # first polling round, early
                    words = P.ld_first4(self.slot(frag, slot_stride, k, jump, own_slot), ready_nc, refused)
                    for j in cutlass.range_constexpr(4):
                        raw[4 * k + j] = words[j]
            # group 2: the blocks, needed only after the rank sum. Waiting for group 1 alone lets
            # the rank sum run while they land (ptxas still issues them before the mailbox
            # loads; the split wait is what gains at T=64 on the H200, docs/perf.md)
            for b in cutlass.range_constexpr(NB):
                self.prefetch(smem, 4 + b, t, blocks + ((Int64(token) * NB + b) * H + cta) * 2)
            P.cp_async_commit()
        elif cutlass.const_expr(not self.fold):
            for g in cutlass.range_constexpr(1, self.poll_groups):
                if group == g:  # first polling round of group g's slots, early
                    for k in cutlass.range_constexpr(min(self.S, self.slots - g * self.S)):
                        words = P.ld_first4(self.slot(frag, slot_stride, g * self.S + k, jump, own_slot),
                                            ready_nc, refused)
                        for j in cutlass.range_constexpr(4):
                            raw[4 * k + j] = words[j]
        mark("loads_issued")
        # the exchange barriers are set up while the loads are in flight (not before them)
        if thread == 0:
            # each exchange: one arrival here, one per value this CTA delivers to itself
            # (st.shared + arrive), and the bytes the 6 peers deliver by st.async
            if cutlass.const_expr(NB > 0):
                P.mbar_init(bar_pre, 1 + self.stats.count)
                P.fence_mbar_init()
                P.mbar_arrive_expect_tx(bar_pre, (CTAS - 1) * self.stats.count * 4)
            else:
                P.mbar_init(bar_post, 1 + 4)
                P.fence_mbar_init()
                P.mbar_arrive_expect_tx(bar_post, (CTAS - 1) * 4 * 4)
        P.cluster_arrive_relaxed()
        # every thread waits on the cluster barrier: ptxas lowers the wait to the cluster
        # barrier plus a CTA-wide bar.sync 0 (peers' mbarriers are initialized after it)
        P.cluster_wait()
        mark("cluster_sync")

        if group == 0:
            # group 1 landed for this thread's own copies only. A thread reads its chunk of row
            # r where lane t ^ (r % 8) copied it (self.chunk), and lane t ^ 3 fetched the global
            # prefix chunk this thread overwrites below: the warp barrier makes every lane's
            # copies visible to the warp and orders all its prefix reads before any store.
            P.cp_async_wait_group(1)
            P.sync_warp()
            mark("smem_rows")
            if cutlass.const_expr(NB > 0):  # w = norm * query, split for the tensor cores
                row_stats.split_weight(self, smem, t)

            # -- rank sum: own slots, then the other groups' partial sums in group order ----
            if cutlass.const_expr(self.twoshot):
                self.twoshot_reduce(raw, recv, gather, me, T, token, h, timeout_us, status)
            missing = self.poll(raw, frag, slot_stride, first_slots, not self.twoshot, timeout_us,
                                status, STATUS_MAILBOX, control, refused)
            attn = self.sum_slots(raw, min(self.S, self.slots))
            if cutlass.const_expr(self.fold):  # each group's partial sum, added in group order
                for g in cutlass.range_constexpr(1, self.poll_groups):
                    part = self.sum_slots(raw, min(self.S, self.slots - g * self.S), g * self.S)
                    attn = [P.add_rn(a, b) for a, b in zip(attn, part)]
            elif cutlass.const_expr(self.poll_groups > 1):
                P.bar_sync(2, THREADS * self.poll_groups)
                for g in cutlass.range_constexpr(1, self.poll_groups):
                    for half in cutlass.range_constexpr(2):
                        part = P.lds4_f32(smem + L.parts + (((g - 1) * 2 + half) * THREADS + t) * 16)
                        for j in cutlass.range_constexpr(4):
                            attn[4 * half + j] = P.add_rn(attn[4 * half + j], part[j])
            # a sum whose terms are all -0.0 is -0.0; published data (-0 -> +0) sums to +0.0
            attn = [P.add_rn(a, Float32(0.0)) for a in attn]
            mark("rank_sum")
            p = []
            if cutlass.const_expr(self.has_delta):
                old = self.fragment(smem, 3, t)
            for j in cutlass.range_constexpr(4):
                lo, hi = P.unpack(P.pack(attn[2 * j], attn[2 * j + 1]))  # ROUND: bf16 partials
                if cutlass.const_expr(self.has_delta):
                    lo, hi = P.unpack(P.pack(P.add_rn(old[2 * j], lo), P.add_rn(old[2 * j + 1], hi)))
                p.extend((lo, hi))
            p_words = [P.pack(p[2 * j], p[2 * j + 1]) for j in range(4)]
            P.st4(prefix + row * 2, p_words)
            mark("prefix_stored")
            if timeout_us >= 0:
                self.rearm_received(frag, slot_stride, first_slots, missing)

            if cutlass.const_expr(NB > 0):
                # -- every row statistic, one cluster exchange (row_stats) -------------------
                P.cp_async_wait_all()  # the blocks; read across lanes (ldmatrix, the swizzle):
                P.sync_warp()  # the warp's copies visible to every lane of it (as above)
                weight = row_stats.read_weight(self, smem, t)
                row_stats.warp_stats(self, smem, p, p_words, weight, t, warp, lane)
                P.bar_sync(1, THREADS)
                count, stride = self.stats.count, row_stats.STRIDE
                if t < count:
                    s = P.lds_f32(smem + L.wpre + t * 4)
                    for w in cutlass.range_constexpr(1, 4):
                        s = P.add_rn(s, P.lds_f32(smem + L.wpre + (w * stride + t) * 4))
                    for peer in cutlass.range_constexpr(CTAS):
                        P.put_f32(smem + L.pre + (rank * stride + t) * 4, s, bar_pre, peer, rank)
                mark("stats_sent")
                P.mbar_wait_phase0(bar_pre)
                mark("stats_received")
                if t < count:
                    sums = [P.lds_f32(smem + L.pre + t * 4), P.lds_f32(smem + L.pre + (stride + t) * 4)]
                    for peer in cutlass.range_constexpr(2, CTAS):
                        sums[peer % 2] = P.add_rn(sums[peer % 2],
                                                  P.lds_f32(smem + L.pre + (peer * stride + t) * 4))
                    P.sts_f32(smem + L.blk + t * 4, P.add_rn(sums[0], sums[1]))
                P.bar_sync(1, THREADS)
                mark("totals")
                # -- AttnRes (streaming form) and the output RMSNorm -------------------------
                exps, ca, cp = row_stats.mix_scales(self, smem, eps, out_eps)
                mix = [Float32(0.0)] * VEC
                for b in cutlass.range_constexpr(NB):
                    v = self.fragment(smem, 4 + b, t)
                    mix = [P.fma_rn(exps[b], v[j], mix[j]) for j in range(VEC)]
                y = [P.fma_rn(ca, mix[j], P.mul_rn(cp, p[j])) for j in range(VEC)]
            else:
                # -- NB = 0: output = RMSNorm(p); p.p through the cluster ---------------------
                value, _ = self.reduce_scatter([P.dot8(p, p)], 1, lane)  # every lane: the total
                if lane < CTAS:
                    P.put_f32(smem + L.post + (rank * 4 + warp) * 4, value, bar_post, lane, rank)
                mark("stats_sent")
                P.mbar_wait_phase0(bar_post)
                mark("stats_received")
                if t == 0:
                    sums = []
                    for w in cutlass.range_constexpr(4):
                        s = P.lds_f32(smem + L.post + w * 4)
                        for peer in cutlass.range_constexpr(1, CTAS):
                            s = P.add_rn(s, P.lds_f32(smem + L.post + (peer * 4 + w) * 4))
                        sums.append(s)
                    P.sts_f32(smem + L.total, P.add_rn(P.add_rn(sums[0], sums[1]), P.add_rn(sums[2], sums[3])))
                P.bar_sync(1, THREADS)
                mark("totals")
                cp = P.rstd(P.lds_f32(smem + L.total), out_eps, H)
                y = [P.mul_rn(cp, p[j]) for j in range(VEC)]
            mark("mixed")
            gamma = self.fragment(smem, 2, t)
            out = [P.mul_rn(y[j], gamma[j]) for j in range(VEC)]
            words = [P.pack(out[2 * j], out[2 * j + 1]) for j in range(4)]
            P.st4(output + row * 2, words)
            mark("stored")
            if cutlass.const_expr(self.reps > 0):
                clean = [P.without_negative_zero(w) for w in words]
                for rep in cutlass.range_constexpr(self.reps):
                    P.st4_relaxed_gpu(xmoe + (Int64(rep) * tokens * H + row) * 2, clean)
                P.sync_warp()
                if lane == 0:
                    P.release_add(hints, 1)
        elif cutlass.const_expr(not self.fold):
            for g in cutlass.range_constexpr(1, self.poll_groups):
                if group == g:
                    n = min(self.S, self.slots - g * self.S)
                    base = frag + (g * self.S) * slot_stride
                    lost = self.poll(raw, base, slot_stride, n, True, timeout_us, status,
                                     STATUS_MAILBOX, control, refused)
                    values = self.sum_slots(raw, n)
                    for half in cutlass.range_constexpr(2):
                        P.sts4_f32(smem + L.parts + (((g - 1) * 2 + half) * THREADS + t) * 16,
                                   values[4 * half: 4 * half + 4])
                    P.bar_arrive(2, THREADS * self.poll_groups)
                    if timeout_us >= 0:
                        self.rearm_received(base, slot_stride, n, lost)

    @cute.kernel
    def kernel_oneshot(self, mailbox: cute.Pointer, prefix: cute.Pointer, blocks: cute.Pointer,
                       norm: cute.Pointer, query: cute.Pointer, out_norm: cute.Pointer,
                       output: cute.Pointer, xmoe: cute.Pointer, hints: cute.Pointer,
                       status: cute.Pointer, eps: Float32, out_eps: Float32, T: Int32,
                       timeout_us: Int32, control: Int64, own: Int64, own_slot: Int32):
        self.body(mailbox.toint(), prefix.toint(), blocks.toint(), norm.toint(), query.toint(),
                  out_norm.toint(), output.toint(), xmoe.toint(), hints.toint(), status.toint(),
                  eps, out_eps, T, timeout_us, Int64(0), Int64(0), Int32(0), control, own, own_slot)

    @cute.kernel
    def kernel_twoshot(self, mailbox: cute.Pointer, prefix: cute.Pointer, blocks: cute.Pointer,
                       norm: cute.Pointer, query: cute.Pointer, out_norm: cute.Pointer,
                       output: cute.Pointer, xmoe: cute.Pointer, hints: cute.Pointer,
                       status: cute.Pointer, eps: Float32, out_eps: Float32, T: Int32,
                       timeout_us: Int32, recv: cute.Pointer, gather: cute.Pointer, me: Int32):
        self.body(mailbox.toint(), prefix.toint(), blocks.toint(), norm.toint(), query.toint(),
                  out_norm.toint(), output.toint(), xmoe.toint(), hints.toint(), status.toint(),
                  eps, out_eps, T, timeout_us, recv.toint(), gather.toint(), me, Int64(0), Int64(0),
                  Int32(0))

    def _launch_config(self, T, stream):
        return dict(grid=[CTAS, T, 1], block=[self.threads, 1, 1], cluster=[CTAS, 1, 1],
                    smem=self.smem_bytes, stream=stream, use_pdl=True,
                    # carveout -1 (no preference; set only so that the DSL does not query a GPU for
                    # min_blocks_per_mp); a max-shared carveout is slower at large T
                    min_blocks_per_mp=self.min_ctas, preferred_smem_carveout=-1)

    @cute.jit
    def launch_oneshot(self, mailbox: cute.Pointer, prefix: cute.Pointer, blocks: cute.Pointer,
                       norm: cute.Pointer, query: cute.Pointer, out_norm: cute.Pointer,
                       output: cute.Pointer, xmoe: cute.Pointer, hints: cute.Pointer,
                       status: cute.Pointer, eps: Float32, out_eps: Float32, T: Int32,
                       timeout_us: Int32, control: Int64, own: Int64, own_slot: Int32, stream):
        self.kernel_oneshot(mailbox, prefix, blocks, norm, query, out_norm, output, xmoe, hints,
                            status, eps, out_eps, T, timeout_us, control, own, own_slot).launch(
            **self._launch_config(T, stream))

    @cute.jit
    def launch_twoshot(self, mailbox: cute.Pointer, prefix: cute.Pointer, blocks: cute.Pointer,
                       norm: cute.Pointer, query: cute.Pointer, out_norm: cute.Pointer,
                       output: cute.Pointer, xmoe: cute.Pointer, hints: cute.Pointer,
                       status: cute.Pointer, eps: Float32, out_eps: Float32, T: Int32,
                       timeout_us: Int32, recv: cute.Pointer, gather: cute.Pointer, me: Int32,
                       stream):
        self.kernel_twoshot(mailbox, prefix, blocks, norm, query, out_norm, output, xmoe, hints,
                            status, eps, out_eps, T, timeout_us, recv, gather, me).launch(
            **self._launch_config(T, stream))
