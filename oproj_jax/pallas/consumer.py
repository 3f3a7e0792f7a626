"""The consumer as one Pallas Mosaic GPU kernel (`plgpu.kernel`), interpret mode off the GPU.

One pass over memory per token: the kernel streams the R mailbox rows, the old prefix and the
NB blocks of a token through a ring of shared-memory slots (TMA, a row viewed as [H/256, 256]),
sums the ranks in f32 in the original kernel's group order (docs/spec.md), writes the bf16 prefix (a new buffer: an
aliased mutable Ref was lost inside lax.scan on the GPU), folds the sources
into an online softmax (running max, denominator and mix, all f32), and stores the RMS-normed
output and its -0-free replicas. Grid (T,): one CTA (one warpgroup) per token.

With split > 1 a cluster of `split` CTAs shares a token (each owns H/split columns): all rows
of its slice stay resident in shared memory, and the row reductions (s.w and s.s of the NB + 1
sources, then y.y) are combined across the cluster in two rounds, each CTA pushing its totals
into its peers' shared memory (cluster_dots.py: st.async completing an mbarrier, no cluster
barrier per round); every CTA adds the warps' and CTAs' sums in the same fixed order, so all
CTAs of a token use identical scalars. The mailbox and prefix rows are dead once summed: the
staging rows, out_norm and the local dot sums reuse their memory (a RefUnion), which keeps a
CTA of the 7-split under 56 KiB, so 4 fit an SM and T=64 runs in one wave.
choose_split picks the split by T (7 CTAs up to 64 tokens where the rows fit, then one CTA).
Interpret mode has no cluster memory, so the CPU runs split=1; the cluster path is checked on
the GPU by tests/test_pallas.py and, for T <= SPLIT_MAX_T, by every registry check.
"""

from __future__ import annotations

import functools
import math
import threading

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from oproj_jax.contract import ConsumerResult, Dims
from oproj_jax.options import NAMES, Options
from oproj_jax.pallas import cluster_dots

KERNEL_NAME = "oproj_consumer_pallas"  # the name the lowered module carries (tests look for it)
LANES = 256  # TMA boxes take at most 256 elements per dimension: a row is [H / 256, 256]
RING = 4  # split == 1: shared-memory slots in flight per CTA (each one row of H bf16)
SPLIT = 7  # CTAs (one cluster) per token at small T: 7168 = 7 x 4 x 256
SPLIT_MAX_T = 64  # up to this many tokens (measured: 1.4-3x faster than one CTA per token)
CLUSTER_SPLITS = (2, 4, 7)  # cluster sizes the kernel takes (divide H/256 = 28; at most 8 CTAs)
MAILBOX_BATCH = 16  # split=7: mailbox rows per copy (one copy for R <= 16; 1.2x faster at T <= 32)
RING_MAX_T = 64  # split == 1: ring=RING up to this many tokens, 2 above (two CTAs fit an SM)
PROFILE_RANGES = 32  # in-kernel profiler: named phases (ranges) recorded per warpgroup
SMEM_LIMIT = 227 * 1024  # sm_90: the most dynamic shared memory one CTA may opt in to
SMEM_ALIGN = 1024  # Pallas Mosaic GPU starts every scratch buffer on this boundary
# Mosaic GPU initializes at most this many mbarriers in one plgpu.Barrier group (more raise
# NotImplementedError when the kernel is lowered). The cluster path has one barrier per resident
# row (R + has_delta + NB); the ring path one per ring slot.
MAX_BARRIERS = 32
# On the GPU the kernel is launched with programmatic dependent launch: where Mosaic GPU launches
# it on a stream, its start (barrier and cluster setup) overlaps the end of the kernel ahead of
# it. Inside XLA's command buffer the call is recorded by stream capture into a child graph,
# which no programmatic edge reaches: there the kernels run one after the other (docs/perf.md).
PDL = True

f32, bf16 = jnp.float32, jnp.bfloat16

# Mosaic GPU's interpreter keeps one shared-memory model per process (module globals of its
# gpu_callbacks), set up when a kernel starts and cleared when it ends: two kernels interpreted
# at once (two Python threads calling the op) clear each other's state and fail inside it. Eager
# interpreted calls take this lock until their results are ready; on a GPU nothing takes it.
_INTERPRET_LOCK = threading.Lock()


def unavailable_reason(platform: str) -> str | None:
    if platform in ("gpu", "cuda"):
        return None
    if platform == "cpu":
        return None  # the same kernel in Mosaic GPU interpret mode
    return f"the Pallas Mosaic GPU kernel runs on CUDA GPUs (or interpreted on CPU), not on {platform!r}"


def unsupported_reason(dims: Dims, **options) -> str | None:
    """Why the kernel cannot take this shape (the layout choose_split gives it on the GPU; the
    interpreter runs the GPU kernel, so the same limits hold there), or None. R, NB, T and
    groups have no bound of their own: a rank count whose rows would need more barriers than a
    cluster of resident rows may have runs on one CTA per token with a ring of slots."""
    if dims.H % LANES:
        return (
            f"the Pallas kernel views a row as [H/{LANES}, {LANES}] for TMA: needs H % {LANES} == 0, got H={dims.H}; "
            f"backend='triton' (any H, on a CUDA GPU) or 'reference' takes it"
        )
    has_delta = Options.from_kwargs(options).has_delta
    tuning = choose_split(dims.T, dims.H, interpret=False, R=dims.R, NB=dims.NB, has_delta=has_delta)
    if tuning["split"] == 1:
        ring = min(tuning["ring"], len(_rows(dims.R, dims.NB, has_delta)))
        smem = ring_smem_bytes(dims.H, ring)
        if smem > SMEM_LIMIT:
            return (
                f"the Pallas kernel stages a token's rows in shared memory: at H={dims.H} its {ring} ring slots, "
                f"weights and staging rows take {smem // 1024} KiB, over the {SMEM_LIMIT // 1024} KiB one CTA may "
                f"have on sm_90; backend='triton' (any H, on a CUDA GPU) or 'reference' takes it"
            )
    return None


def _platform(*arrays) -> str:
    """The platform the kernel runs on: the devices of the first concrete array; under tracing the
    enclosing mesh's (shard_map, jax.sharding.use_mesh / use_abstract_mesh), else JAX's default backend."""
    for x in arrays:
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            return next(iter(x.devices())).platform
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is not None and getattr(device, "platform", None):
        return device.platform
    return jax.default_backend()


def _interpret(*arrays) -> bool:
    """Interpret mode (Mosaic GPU's CPU interpreter) unless the kernel runs on a GPU."""
    return _platform(*arrays) not in ("gpu", "cuda")


def _check_interpretable() -> None:
    """Interpret mode inside a shard_map over several devices is refused: the interpreter keeps
    one shared-memory model per process and checks after every kernel that no barrier of any
    device is still allocated, so kernels interpreted on several devices at once fail at random
    (hundreds of lines of "Barrier remains allocated"). One device, or the GPU, is fine."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = tuple(getattr(mesh, "manual_axes", ()) or ())
    devices = math.prod(mesh.shape[a] for a in manual) if manual else 1
    if devices > 1:
        raise ValueError(
            f"backend: 'pallas' would run in Mosaic GPU interpret mode inside a shard_map over {devices} devices "
            f"(manual mesh axes {manual}), which the interpreter cannot do (one shared-memory model per process: "
            f"kernels interpreted on several devices at once fail); on a CPU mesh use backend='reference' (or "
            f"'auto'), or a mesh of one device"
        )


def _rows(R, NB, has_delta):
    """The rows one token streams, in consumption order: ("mailbox", r), ("prefix",), ("block", b)."""
    return (
        [("mailbox", r) for r in range(R)] + ([("prefix", 0)] if has_delta else []) + [("block", b) for b in range(NB)]
    )


def _row_layout(C):
    """The layout Mosaic GPU gives a [C, 256] bf16 row loaded from shared memory (and the f32
    arrays computed from it): warpgroup-strided, the widest vector of <= 64 bits that tiles it."""
    size, vec = C * LANES, 4
    while size % (vec * 128):
        vec //= 2
    return plgpu.Layout.WG_STRIDED((C, LANES), vec_size=vec)


def _make_kernel(R, NB, H, eps, out_eps, has_delta, groups, reps, ring, split, batch=1, pdl=False):
    """The kernel body and its scratch. `split` CTAs (a cluster) share a token's row of H
    columns; with split > 1 every row of the token stays resident in shared memory and the row
    reductions are combined across the cluster through distributed shared memory. `pdl`: the
    kernel is launched with programmatic dependent launch and waits for the grid ahead of it
    before its first read of global memory."""
    C = H // LANES // split  # [C, 256] columns per CTA
    rows = _rows(R, NB, has_delta)
    ring = len(rows) if split > 1 else min(ring, len(rows))
    per_group = -(-R // groups)
    early = R + has_delta  # the rows the rank sum consumes
    dots_per_round = (2 * (NB + 1), 1)  # cluster exchanges: s.w and s.s of every source, then y.y
    layout = _row_layout(C)

    def body(mailbox, prefix, blocks, norm, query, out_norm, *refs):
        # mailbox [R, T, split, C, 256], prefix [T, split, C, 256] (the old one, read),
        # blocks [T, NB, split, C, 256], norm/query/out_norm [split, C, 256];
        # outputs: new_prefix, output [T, split, C, 256], xmoe [reps, T, split, C, 256]
        new_prefix, output, *refs = refs
        xmoe = refs.pop(0) if reps else None
        if split == 1:
            slots, bars, wts, wbar, pbuf, obuf = refs
            gamma = wts.at[2]
        else:  # the staging rows and totals reuse the slots the rank sum has consumed
            union, block_slots, bars, wts, wbar, recv = refs
            early_slots, (pbuf, obuf, gamma, dot_sums) = union
        t = lax.axis_index("t")
        c = lax.axis_index("c") if split > 1 else 0

        def slot(i):  # the shared-memory row that row i is copied into
            if split == 1:
                return slots.at[i % ring]
            return early_slots.at[i] if i < early else block_slots.at[i - early]

        def source(i):
            kind, k = rows[i]
            if kind == "mailbox":
                return mailbox.at[k, t, c]
            if kind == "prefix":
                return prefix.at[t, c]
            return blocks.at[t, k, c]

        if split > 1:  # before any copy is issued: its fence would wait for them
            cluster_dots.init(recv, dots_per_round, split)
        if pdl:
            # Everything above touches shared memory only, so it overlaps the end of the kernel
            # ahead on the stream; every global read below waits for that kernel's end (its
            # writes then visible). The next kernel may launch once all CTAs here have started.
            plgpu.griddepcontrol_wait()
            plgpu.griddepcontrol_launch_dependents()
        with jax.named_scope("issue_copies"):
            for j, w in enumerate((norm, query, out_norm) if split == 1 else (norm, query)):
                plgpu.copy_gmem_to_smem(w.at[c], wts.at[j], wbar.at[j])
            if batch > 1:  # resident rows: `batch` mailbox rows per copy, all blocks in one
                for g in range(0, R, batch):
                    n = min(batch, R - g)
                    plgpu.copy_gmem_to_smem(mailbox.at[pl.ds(g, n), t, c], early_slots.at[pl.ds(g, n)], bars.at[g])
                if has_delta:
                    plgpu.copy_gmem_to_smem(prefix.at[t, c], slot(R), bars.at[R])
                if NB:
                    plgpu.copy_gmem_to_smem(blocks.at[t, :, c], block_slots.at[pl.ds(0, NB)], bars.at[early])
            else:
                for i in range(ring):
                    plgpu.copy_gmem_to_smem(source(i), slot(i), bars.at[i])

        def arrival(i):  # the barrier that row i's copy completes
            if batch == 1:
                return i % ring
            return i - i % batch if i < R else (R if i == R and has_delta else early)

        waited = set()  # batched copies: a barrier completes once; a second wait would hang

        def wait_for(i):
            if batch > 1 and arrival(i) in waited:
                return
            waited.add(arrival(i))
            plgpu.barrier_wait(bars.at[arrival(i)])

        def take(i):  # [C, 256] f32 of row i; refills its slot with row i + ring
            wait_for(i)
            x = slot(i)[...].astype(f32)
            if i + ring < len(rows):
                # every thread's read of the slot is done (and ordered before the async proxy's
                # write) before the one issuing thread refills it
                plgpu.commit_smem()
                plgpu.copy_gmem_to_smem(source(i + ring), slot(i), bars.at[i % ring])
            return x

        # Rank sum in the original kernel's order; -0.0 counts as +0.0 (the first term of every group is
        # the only place a -0.0 can survive an f32 sum, so it is cleaned there).
        with jax.named_scope("rank_sum"):
            total = None
            i = 0
            for first in range(0, R, per_group):
                x = take(i)
                part = jnp.where(x == 0.0, 0.0, x)
                i += 1
                for _ in range(first + 1, min(first + per_group, R)):
                    part = part + take(i)
                    i += 1
                total = part if total is None else total + part
            attn = total.astype(bf16).astype(f32)  # ROUND: the reduced partials are bf16
            if has_delta:
                attn = take(i) + attn
                i += 1
        with jax.named_scope("prefix_store"):
            if split > 1:
                # every thread has read the early slots before any of them is overwritten (the
                # staging rows and totals alias them); out_norm, needed last, comes in now
                plgpu.commit_smem()
                plgpu.copy_gmem_to_smem(out_norm.at[c], gamma, wbar.at[2])
            p16 = attn.astype(bf16)  # ROUND: the prefix is stored in bf16
            pbuf[...] = p16
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(pbuf, new_prefix.at[t, c])

        with jax.named_scope("weights"):
            for j in range(3 if split == 1 else 2):
                plgpu.barrier_wait(wbar.at[j])
            w = wts[0].astype(f32) * wts[1].astype(f32)
            p = p16.astype(f32)

        if split == 1:  # online softmax over the sources as they stream past
            with jax.named_scope("online_softmax"):

                def logit(s):
                    return jnp.sum(s * w) * lax.rsqrt(jnp.sum(s * s) / H + eps)

                m, den, mix = logit(p), jnp.float32(1.0), p
                for _ in range(NB):
                    b = take(i)
                    i += 1
                    lb = logit(b)
                    m_new = jnp.maximum(m, lb)
                    scale, e = jnp.exp(m - m_new), jnp.exp(lb - m_new)
                    den = den * scale + e
                    mix = mix * scale + b * e
                    m = m_new
                y = mix * (1.0 / den)
                yy = jnp.sum(y * y)
        else:  # all sources resident: one cluster exchange for the logits, one for y.y

            def combine(pairs, round_):  # cluster-wide dots a.b: the same scalars on every CTA
                base = sum(cluster_dots.WARPS * k for k in dots_per_round[:round_])
                col = sum(dots_per_round[:round_])
                cluster_dots.dots(pairs, dot_sums, recv, layout, split=split, round_=round_, base=base, col=col)
                return [dot_sums[cluster_dots.TOTALS + col + k] for k in range(len(pairs))]

            with jax.named_scope("dots_exchange"):
                block_rows = list(range(i, i + NB))
                sources = [lambda: p] + [lambda r=r: slot(r)[...].astype(f32) for r in block_rows]
                for r in block_rows:
                    wait_for(r)
                with jax.named_scope("load_sources"):
                    xs = [s() for s in sources]
                sums = combine([pair for x in xs for pair in ((x, w), (x, x))], 0)
            with jax.named_scope("softmax_mix"):
                if NB:
                    logits = [sums[2 * j] * lax.rsqrt(sums[2 * j + 1] / H + eps) for j in range(NB + 1)]
                    m = functools.reduce(jnp.maximum, logits)
                    e = [jnp.exp(l - m) for l in logits]
                    inv_den = 1.0 / functools.reduce(jnp.add, e)
                    y = functools.reduce(jnp.add, [s() * (ej * inv_den) for s, ej in zip(sources, e)])
                else:  # one source: its weight is exactly 1 (docs/spec.md), also where its logit is not finite
                    y = p
            with jax.named_scope("exchange_yy"):
                (yy,) = combine([(y, y)], 1)
        with jax.named_scope("output"):
            if split > 1:
                plgpu.barrier_wait(wbar.at[2])
            out = y * lax.rsqrt(yy / H + out_eps) * gamma[...].astype(f32)
            o16 = out.astype(bf16)  # ROUND: the output is bf16
            obuf[...] = o16
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(obuf, output.at[t, c])
            if reps:
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the prefix store has read pbuf
                pbuf[...] = jnp.where(o16 == 0.0, jnp.zeros_like(o16), o16)  # -0.0 -> +0.0
                plgpu.commit_smem()
                for k in range(reps):
                    plgpu.copy_smem_to_gmem(pbuf, xmoe.at[k, t, c])
            plgpu.wait_smem_to_gmem(0)

    if split == 1:  # ring slots, norm/query/out_norm, prefix and output staging
        row = plgpu.SMEM((C, LANES), bf16)
        scratch = [
            plgpu.SMEM((ring, C, LANES), bf16),
            plgpu.Barrier(num_barriers=ring),
            plgpu.SMEM((3, C, LANES), bf16),
            plgpu.Barrier(num_barriers=3),
            row,
            row,
        ]
    else:
        scratch = _cluster_scratch(R, NB, has_delta, C, split)
    return body, scratch


def _cluster_scratch(R, NB, has_delta, C, split):
    """The cluster path's scratch. Resident rows; the mailbox and prefix rows are dead once
    summed: the prefix and output staging rows, out_norm and the local dot sums reuse their
    memory. (A 2 KiB-row CTA of the 7-split then takes < 56 KiB: 4 fit an SM, T=64 in one wave.)"""
    row = plgpu.SMEM((C, LANES), bf16)
    return [
        plgpu.RefUnion(
            plgpu.SMEM((R + has_delta, C, LANES), bf16), [row, row, row, plgpu.SMEM((cluster_dots.PART,), f32)]
        ),
        plgpu.SMEM((max(NB, 1), C, LANES), bf16),
        plgpu.Barrier(num_barriers=len(_rows(R, NB, has_delta))),
        plgpu.SMEM((2, C, LANES), bf16),  # norm, query
        plgpu.Barrier(num_barriers=3),  # norm, query, out_norm
        plgpu.SMEM(cluster_dots.recv_shape(split), f32),  # the peers' totals, pushed here; the mbarriers
    ]


def _smem_bytes(scratch) -> int:
    """Dynamic shared memory of a scratch list as Pallas lays it out: every buffer 1 KiB aligned
    (a RefUnion is one buffer of its largest group), barriers 8 bytes each."""
    total = 0
    for item in scratch:
        if isinstance(item, plgpu.Barrier):
            total += 8 * math.prod(item.num_barriers)  # a shape: (n,)
        else:
            total += -(-math.prod(item.shape) * jnp.dtype(item.dtype).itemsize // SMEM_ALIGN) * SMEM_ALIGN
    return total


def cluster_smem_bytes(R: int, NB: int, has_delta: bool, H: int, split: int) -> int:
    """Dynamic shared memory of one CTA of the cluster path (_cluster_scratch)."""
    return _smem_bytes(_cluster_scratch(R, NB, has_delta, H // LANES // split, split))


def ring_smem_bytes(H: int, ring: int) -> int:
    """Dynamic shared memory of one CTA of the ring path (split == 1) with `ring` slots."""
    row = (H // LANES, LANES)
    return _smem_bytes(
        [plgpu.SMEM((ring, *row), bf16), plgpu.Barrier(num_barriers=ring), plgpu.SMEM((3, *row), bf16)]
        + [plgpu.Barrier(num_barriers=3), plgpu.SMEM(row, bf16), plgpu.SMEM(row, bf16)]
    )


def cluster_barriers(R: int, NB: int, has_delta: bool) -> int:
    """The barriers of the cluster path's largest group: one per resident row."""
    return len(_rows(R, NB, has_delta))


def choose_split(T: int, H: int, interpret: bool, R: int = 16, NB: int = 8, has_delta: bool = True) -> dict:
    """The work split per token for T tokens, chosen by measurement on the H200 (the timings of
    every split: docs/perf.md, "Pallas: the work split").

    Up to SPLIT_MAX_T tokens a cluster of SPLIT = 7 CTAs shares each token (the row's columns
    divided among them, all its rows resident in shared memory, MAILBOX_BATCH mailbox rows per
    TMA copy): the fastest layout measured there, well ahead of one CTA per token, and ahead of
    clusters of 2 or 4. Above that, one CTA per token streaming its rows through a ring of RING
    shared-memory slots, 2 slots above RING_MAX_T tokens (two CTAs then fit an SM). A cluster
    split is taken only where the token's columns divide among 7 CTAs and the resident rows fit
    in shared memory and in MAX_BARRIERS barriers (one per row: R + has_delta + NB <= 32; R = 32
    takes the ring). Interpret mode has no cluster shared memory: one CTA per token there.
    """
    fits = (
        (H // LANES) % SPLIT == 0
        and cluster_barriers(R, NB, has_delta) <= MAX_BARRIERS
        and cluster_smem_bytes(R, NB, has_delta, H, SPLIT) <= SMEM_LIMIT
    )
    if not interpret and T <= SPLIT_MAX_T and fits:
        return dict(ring=RING, split=SPLIT, batch=MAILBOX_BATCH)
    return dict(ring=RING if T <= RING_MAX_T else 2, split=1)


def consumer(mailbox, prefix, blocks, norm, query, out_norm, **options) -> ConsumerResult:
    """The backend entry (api.consumer has checked the arguments): the kernel, tuned per shape;
    interpreted unless the arrays (or, traced, the enclosing mesh) are on a GPU. An eager
    interpreted call runs under _INTERPRET_LOCK, one at a time in the process, and returns its
    results ready. A traced one runs when the caller's program does, which no lock here can
    cover: callers that run such programs from several threads at once serialize them."""
    arrays = (mailbox, prefix, blocks, norm, query, out_norm)
    R, T, H = mailbox.shape
    interpret = _interpret(mailbox, prefix, blocks)
    tuning = choose_split(T, H, interpret, R=R, NB=blocks.shape[1], has_delta=options["has_delta"])
    pdl = PDL and not interpret
    call = functools.partial(consumer_with, **options, interpret=interpret, pdl=pdl, **tuning)
    if interpret and not any(isinstance(x, jax.core.Tracer) for x in arrays):
        with _INTERPRET_LOCK:
            return jax.block_until_ready(call(*arrays))
    return call(*arrays)


@functools.partial(jax.jit, static_argnames=(*NAMES, "ring", "split", "batch", "pdl", "profile_dir", "interpret"))
def consumer_with(
    mailbox,
    prefix,
    blocks,
    norm,
    query,
    out_norm,
    *,
    ring: int,
    split: int,
    batch: int = 1,
    pdl: bool = False,
    profile_dir: str | None = None,
    interpret: bool | None = None,
    **options,
) -> ConsumerResult:
    """The kernel with explicit tuning knobs: `split` CTAs per token (a cluster sharing the
    row), `ring` shared-memory row slots per CTA (split == 1; with split > 1 rows are resident),
    `batch` mailbox rows per TMA copy (split > 1; blocks then come in one copy too), `pdl`
    programmatic dependent launch (GPU only). `profile_dir`: Mosaic GPU's in-kernel profiler
    writes a trace of the kernel's named phases there (GPU only). `interpret`: Mosaic GPU interpret
    mode; None: unless the enclosing mesh (or JAX's default backend) is a GPU (consumer() decides
    from its arrays' devices). Interpret mode inside a shard_map over several devices raises.
    `options`: the consumer's (Options.from_kwargs: the missing ones at their defaults)."""
    opts = Options.from_kwargs(options)
    R, T, H = mailbox.shape
    NB = blocks.shape[1]
    if (split != 1 and split not in CLUSTER_SPLITS) or (H // LANES) % split:
        raise ValueError(
            f"split: expected 1 or a cluster of {CLUSTER_SPLITS} CTAs dividing H/{LANES} = {H // LANES}, got {split}"
        )
    if batch < 1 or (batch > 1 and split == 1):
        raise ValueError(
            f"batch: expected 1, or > 1 with a cluster split (rows resident), got {batch} with split={split}"
        )
    if split > 1 and cluster_barriers(R, NB, opts.has_delta) > MAX_BARRIERS:
        raise ValueError(
            f"split: a cluster keeps every row of a token resident, one barrier per row: R + has_delta + NB = "
            f"{cluster_barriers(R, NB, opts.has_delta)} rows at R={R}, NB={NB}, over the {MAX_BARRIERS} barriers "
            f"Mosaic GPU allows in one group; expected split=1 (a ring of slots, any R), which consumer() takes for "
            f"this shape"
        )
    if not 1 <= ring <= MAX_BARRIERS:
        raise ValueError(f"ring: expected 1 <= ring <= {MAX_BARRIERS} (one barrier per slot), got {ring}")
    C = H // LANES // split
    interpret = _interpret() if interpret is None else bool(interpret)
    if interpret:
        _check_interpretable()
    if pdl and interpret:
        raise ValueError("pdl: programmatic dependent launch is for the GPU; interpret mode has none")
    if profile_dir and interpret:
        raise ValueError("profile_dir: Mosaic GPU's in-kernel profiler runs on the GPU only, not in interpret mode")
    if split > 1 and interpret:
        raise ValueError(
            f"split: Mosaic GPU interpret mode has no cluster shared memory; expected split=1, got {split}"
        )
    body, scratch = _make_kernel(
        R, NB, H, opts.eps, opts.out_eps, opts.has_delta, opts.groups, opts.xmoe_replicas, ring, split, batch, pdl
    )
    xmoe_replicas = opts.xmoe_replicas
    row = (split, C, LANES)  # one row of H, as the CTAs of a token see it
    # The new prefix is an output of its own, not the old prefix updated through a mutable Ref:
    # a Ref aliased into the Mosaic call inside a lax.scan body came back unwritten (zeros) on
    # the H200 with jax 0.11.2. Same bytes moved; XLA may still reuse a donated prefix's buffer.
    out_type = [jax.ShapeDtypeStruct((T, *row), bf16), jax.ShapeDtypeStruct((T, *row), bf16)]
    if xmoe_replicas:
        out_type.append(jax.ShapeDtypeStruct((xmoe_replicas, T, *row), bf16))
    cluster = dict(cluster=(split,), cluster_names=("c",)) if split > 1 else {}
    kernel = plgpu.kernel(
        body,
        out_type=tuple(out_type),
        scratch_types=scratch,
        grid=(T,),
        grid_names=("t",),
        kernel_name=KERNEL_NAME,
        compiler_params=plgpu.CompilerParams(profile_space=PROFILE_RANGES, profile_dir=profile_dir)
        if profile_dir
        else None,
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None,  # poisoned outputs
        **cluster,
    )
    outs = kernel(
        mailbox.reshape(R, T, *row),
        prefix.reshape(T, *row),
        blocks.reshape(T, NB, *row),
        norm.reshape(row),
        query.reshape(row),
        out_norm.reshape(row),
    )
    new_prefix = outs[0].reshape(T, H)
    output = outs[1].reshape(T, H)
    xmoe = outs[2].reshape(xmoe_replicas, T, H) if xmoe_replicas else None
    return ConsumerResult(new_prefix, output, xmoe)
