"""The publish kernel of mode="peer" (oproj_jax/cute/peer.py): one rank's partial into a slot of
every rank's mailbox, in CuTe DSL (built to a cubin by oproj_jax/cute/build.py; no GPU needed).

Thread i of the grid owns 16-byte fragment i of the partial [T, H] (bf16, T*H/8 fragments):
it loads it once and turns every bf16 -0.0 into +0.0, so no published 32-bit word can be the
sentinel 0x80000000 (docs/spec.md, "Mailbox protocol"). Then, for each destination (each rank's slot
`me`, given as byte addresses), it WAITS FOR EMPTY: it polls that destination fragment
(ld.relaxed.sys.v4) until all four words are the sentinel, i.e. the slot's owner consumed the
previous step's fragment and re-armed it, and only then stores its data (st.relaxed.sys.v4).
Each round issues one load per destination still pending (all in flight together) and stores
into every destination found empty, so a round costs one remote load latency, not R.

One mailbox per group and device, no epochs, nothing the host counts: the mailbox's state alone
says whether a slot may be written, which is what lets the handler put the call into a CUDA graph
(ffi/cute_peer.cc has the safety, progress and deadlock-freedom arguments).

Bounded wait, fail-stop: every thread first reads the group's fail-stop word (control + 8,
docs/spec.md "Mailbox protocol"); nonzero refuses the launch (nothing is published; status
STATUS_REFUSED | the word). Once `timeout_us` microseconds of %globaltimer (wall time; 0 would
wait forever and is refused by the Python side) have passed with a destination still not
re-armed, or the fail-stop word was set meanwhile, the thread gives up on it, does NOT store
there, and ORs STATUS_UNARMED into the fail-stop word. A launch reports exactly once: each CTA
reduces its threads' outcomes with barrier reductions, thread 0 ORs the CTA's code into the
accumulator at control + 12 and counts the CTA in the 64-bit counter at control (acq_rel), and
the CTA whose count completes the launch (the last one) stores the accumulated status into
flags[2] and zeroes both words for the next launch. No racing stores into XLA's buffer: the
flags buffer is XLA's, fresh (garbage) each call, and only that one CTA writes flags[2]; thread
0 of the grid zeroes flags[0], the consumer's status word, which only the consumer (launched
after this grid completes) may set.

Ordering (why `griddepcontrol.wait` comes before every load and store):
  * the partial comes from an XLA kernel with ordinary stores, visible only after the wait;
    flags may be memory the previous kernel on the stream still uses;
  * this rank's previous step must be over (ffi/cute_peer.cc): its consumer has read and
    re-armed this rank's own mailbox, and its publish has landed in every destination, so
    a destination fragment holds either our previous data (not yet consumed: wait) or its
    owner's re-arm (free). Without the wait, two steps' publishes of one rank could overlap.
`griddepcontrol.launch_dependents` first lets the consumer that follows be scheduled early; it
waits for this grid's completion (the local slot, flags[0] and flags[2]) before its first
global read.

Stores are st.relaxed.sys: the data goes to other GPUs' memory, polled there by volatile
(relaxed, system-scope) loads; each 32-bit word is written once per step, so a poller sees
either the sentinel or the final value of a word, never a torn one. The mailbox memory is
ours (peer.py), never XLA's, so no XLA buffer is written behind XLA's back.

Parameters (PTX .param order; abi.PUBLISH): src u64, dest_0 .. dest_15 u64, n_dest i32,
flags u64, fragments i32, timeout_us i32, control u64. Launch: grid (ceil(fragments / 128),
1, 1), block (128, 1, 1), no cluster, PDL on.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from oproj_jax import abi
from oproj_jax.abi import STATUS_REFUSED, STATUS_UNARMED
from oproj_jax.cute import primitives as P

MAX_RANKS = abi.PUBLISH_MAX_RANKS  # destinations per launch: the mailbox slots of a TP group
THREADS = 128
ENTRY_HINT = "publish"  # the kernel entry's name contains this (checked by build.py)
_U4 = (Uint32, Uint32, Uint32, Uint32)


def _ld_nc4(addr):
    """16 bytes of the partial, once, through the read-only path: it cannot change during the
    kernel (XLA wrote it before the previous grid completed)."""
    return P.asm("ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$4];", _U4, ((Int64, addr),))


def _pending_mask(n_dest):
    """(1 << n_dest) - 1: bit r set for every destination r < n_dest (n_dest <= 16)."""
    return P.asm("{ .reg .b32 t; shl.b32 t, 1, $1; sub.s32 $0, t, 1; }", (Int32,), ((Int32, n_dest),))


def _poll4_if(pending, bit: int, addr):
    """The destination fragment's four words, loaded (relaxed, system scope: another GPU's
    consumer re-arms it) when `bit` of `pending` is set; else undefined (never looked at)."""
    return P.asm(
        "{ .reg .pred p; .reg .b32 t; and.b32 t, $4, " + f"{bit:#x}" + "; setp.ne.u32 p, t, 0;"
        " @p ld.relaxed.sys.global.v4.b32 {$0, $1, $2, $3}, [$5]; }",
        _U4, ((Int32, pending), (Int64, addr)))


def _store_if_empty(pending, bit: int, addr, seen, words):
    """If `bit` is pending and all four `seen` words are the sentinel (the owner re-armed the
    fragment), store `words` there and clear the bit; returns the new pending mask."""
    return P.asm(
        "{ .reg .pred p; .reg .b32 t; and.b32 t, $1, " + f"{bit:#x}" + "; setp.ne.u32 p, t, 0;"
        " setp.eq.and.u32 p, $3, 0x80000000, p; setp.eq.and.u32 p, $4, 0x80000000, p;"
        " setp.eq.and.u32 p, $5, 0x80000000, p; setp.eq.and.u32 p, $6, 0x80000000, p;"
        " @p st.relaxed.sys.global.v4.b32 [$2], {$7, $8, $9, $10};"
        " mov.b32 $0, $1; @p and.b32 $0, $1, " + f"{~bit & 0xFFFFFFFF:#x}" + "; }",
        (Int32,),
        ((Int32, pending), (Int64, addr)) + tuple((Uint32, w) for w in seen) + tuple((Uint32, w) for w in words))


def _cta_any(flag):
    """1 if `flag` is nonzero in any thread of the CTA (every thread must call it)."""
    return P.asm("{ .reg .pred q, p; setp.ne.u32 q, $1, 0; barrier.red.or.pred p, 0, q; selp.u32 $0, 1, 0, p; }",
                 (Int32,), ((Int32, flag),))


def _report(control, flags, code):
    """Thread 0 of each CTA: OR this CTA's outcome `code` (0, STATUS_UNARMED, STATUS_REFUSED)
    into the word at control + 12, then count the CTA in the 64-bit counter at `control`
    (acq_rel: each CTA's OR is ordered before its count, the last count sees every OR); the
    CTA that completes the count stores the launch's publish status into flags[2] and zeroes
    both words for the next launch."""
    P.asm(
        "{ .reg .pred last, bad; .reg .b64 old; .reg .b32 lo, hi, n, all;"
        " setp.ne.u32 bad, $2, 0; @bad red.relaxed.gpu.global.or.b32 [$0 + 12], $2;"
        " atom.acq_rel.gpu.global.add.u64 old, [$0], 1;"
        " mov.b64 {lo, hi}, old; add.u32 lo, lo, 1;"
        " mov.u32 n, %nctaid.x; setp.eq.u32 last, lo, n;"
        " @last ld.relaxed.gpu.global.b32 all, [$0 + 12];"
        " @last st.relaxed.gpu.global.b32 [$1 + 8], all;"
        " @last st.relaxed.gpu.global.b32 [$0 + 12], 0;"
        " @last st.relaxed.gpu.global.u64 [$0], 0; }",
        (), ((Int64, control), (Int64, flags), (Int32, code)))


def compile_args() -> list:
    """Placeholder arguments of `Publish.launch` in abi.PUBLISH order (before the stream), for
    cute.compile (build.py, tests): only their types reach the kernel."""
    return [Int64(0)] * (1 + MAX_RANKS) + [Int32(0), Int64(0), Int32(1), Int32(0), Int64(0)]


class Publish:
    """The kernel (one static variant: it serves every R <= MAX_RANKS and every T)."""

    @cute.kernel
    def kernel(self, src: Int64, d0: Int64, d1: Int64, d2: Int64, d3: Int64, d4: Int64, d5: Int64,
               d6: Int64, d7: Int64, d8: Int64, d9: Int64, d10: Int64, d11: Int64, d12: Int64, d13: Int64,
               d14: Int64, d15: Int64, n_dest: Int32, flags: Int64, fragments: Int32, timeout_us: Int32,
               control: Int64):
        dests = (d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15)
        block, _, _ = cute.arch.block_idx()
        thread, _, _ = cute.arch.thread_idx()
        i = block * THREADS + thread
        P.griddep_launch_dependents()
        P.griddep_wait()  # before any load or store: see the module docstring
        if i == 0:
            P.store_status(flags, Int32(0))  # the consumer's status word
        refused = P.fail_word(control)  # nonzero: the group failed before (its bits say why): publish nothing
        unarmed = Int32(0)
        if (i < fragments) & (refused == 0):
            offset = Int64(i) * 16
            words = [P.without_negative_zero(w) for w in _ld_nc4(src + offset)]
            pending = _pending_mask(n_dest)
            start = P.globaltimer()
            while pending != 0:
                seen = [_poll4_if(pending, 1 << r, dests[r] + offset) for r in range(MAX_RANKS)]
                left = pending
                for r in cutlass.range_constexpr(MAX_RANKS):
                    left = _store_if_empty(left, 1 << r, dests[r] + offset, seen[r], words)
                if (left != 0) & (P.timed_out(start, timeout_us) | (P.fail_word(control) != 0)):
                    unarmed = Int32(1)  # give up: nothing is stored into a slot not re-armed
                    P.fail_group(control, Int32(STATUS_UNARMED))
                    left = Int32(0)
                pending = left
        code = Int32(0)
        if _cta_any(unarmed) != 0:
            code = Int32(STATUS_UNARMED)
        if _cta_any(refused) != 0:
            code = code | Int32(STATUS_REFUSED) | refused
        if thread == 0:
            _report(control, flags, code)

    @cute.jit
    def launch(self, src: Int64, d0: Int64, d1: Int64, d2: Int64, d3: Int64, d4: Int64, d5: Int64,
               d6: Int64, d7: Int64, d8: Int64, d9: Int64, d10: Int64, d11: Int64, d12: Int64, d13: Int64,
               d14: Int64, d15: Int64, n_dest: Int32, flags: Int64, fragments: Int32, timeout_us: Int32,
               control: Int64, stream):
        self.kernel(src, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15, n_dest, flags,
                    fragments, timeout_us, control).launch(
            grid=[(fragments + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=True)
