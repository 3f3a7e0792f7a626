"""Tensor-parallel layouts around the consumer: shard_map over a mesh axis of R ranks.

Nothing here knows about kernels: every rank calls `api.consumer` on its own view, so every
backend works sharded. This layer plays the producer: it publishes the partials (-0.0 stored
as +0.0, docs/spec.md "Mailbox protocol") and moves them between ranks with XLA collectives, except
in mode "peer", where the CuTe backend's FFI handler moves them itself (oproj_jax/cute/peer.py).

Modes (how the R partials reach each rank's consumer):

  "oneshot"  rank-ordered all-gather of the partials into a mailbox [R, T, H] on every rank,
             then the consumer with the caller's `groups` order. Bit-identical on every rank.
  "twoshot"  reduce-scatter then gather (docs/spec.md "Twoshot"): rank r receives every rank's column
             slice r ([R, T, H/R], all_to_all), sums it in f32 in rank order, rounds to bf16;
             the reduced slices are all-gathered into a one-slot mailbox [1, T, H]. The prefix
             bits equal oneshot's with groups=1. Bit-identical on every rank. Needs H % R == 0.
  "psum"     XLA's all-reduce (f32) of the partials, rounded to bf16 into a one-slot mailbox.
             Its summation order is XLA's, not the original kernel's: the prefix may differ from the
             reference by rounding (and, on GPU, between runs). A baseline, not bit-exact.
  "peer"     no XLA collective: one FFI call per rank publishes its partial by peer writes into
             a slot of every rank's mailbox (memory the handler owns) and runs the CuTe consumer
             on its own mailbox with the Lamport protocol (oproj_jax/cute/peer.py). The prefix
             bits equal oneshot's with the same `groups`, on every rank. Backend "cute" (or
             "auto") on CUDA GPUs; a TP group runs in one process or with one rank per process
             (jax.distributed; CUDA IPC maps the mailboxes); anything else raises. Returns a
             PeerResult: the fields of ConsumerResult plus `status` (one i32 per device), checked
             on eager calls; under jit call oproj_jax.cute.peer.check_status(result.status).

With a one-slot mailbox (twoshot, psum) the consumer runs with groups=1: `groups` only fixes
oneshot's order (it is still validated in every mode).

Checks run eagerly, on the global shapes, before any tracing: the options (oproj_jax.options.
Options, whose defaults they take), contract.check_arguments for the generic ones, then the layout's
(mesh axis, R, H % R, mode). The backend is resolved once,
for one rank's view and the platform of the mesh's devices (which need not be JAX's default
backend); a backend that cannot run there raises, as in api.consumer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from oproj_jax import api, contract
from oproj_jax.cute import peer
from oproj_jax.options import Options, check_bool, takes_options
from oproj_jax.reference import rank_sum, to_bf16, without_negative_zero

MODES = ("oneshot", "twoshot", "psum", "peer")

f32, bf16 = jnp.float32, jnp.bfloat16


def _check_layout(mesh, axis_name, mode, backend, peer_options) -> int:
    """Checks mesh, axis_name, mode, the backend's type and peer_options; returns R, the size of
    the mesh axis."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name: expected one of the mesh's axes {tuple(mesh.axis_names)}, got {axis_name!r}")
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a str, got {type(backend).__name__}")
    if peer_options is not None:
        if mode != "peer":
            raise ValueError(f"peer_options: only mode='peer' takes them, the mode is {mode!r}")
        if not isinstance(peer_options, peer.PeerOptions):
            raise TypeError(
                f"peer_options: expected oproj_jax.cute.peer.PeerOptions, got {type(peer_options).__name__}"
            )
        skip = peer_options.skip_publish_rank
        if skip is not None and skip >= mesh.shape[axis_name]:
            raise ValueError(f"peer_options: skip_publish_rank must be a rank < {mesh.shape[axis_name]}, got {skip}")
    return int(mesh.shape[axis_name])


def _check_ranks(R: int, ranks: int, mode: str, H: int, what: str) -> None:
    if R != ranks:
        raise ValueError(f"{what}: expected R = {ranks} (the size of the mesh axis), got R = {R}")
    if mode == "twoshot" and H % R:
        raise ValueError(f"{what}: twoshot splits H into R column slices; expected H % R == 0, got H={H}, R={R}")


def _plan(
    mesh, axis_name, mode, backend, opts: Options, dims: contract.Dims, fused: bool, peer_options, stream_capture=False
):
    """Resolves the backend for one rank's view on the mesh's platform (eagerly, so "auto" and
    errors follow the mesh's devices, not JAX's default backend) and returns the jitted layout."""
    if mode == "peer":
        plan = _peer_plan(mesh, axis_name, backend, opts, dims, peer_options or peer.PeerOptions())
        return _sharded(mesh, axis_name, mode, "cute", opts, fused, dims.NB == 0, plan)
    if mode != "oneshot":
        opts = dataclasses.replace(opts, groups=1)  # one slot: nothing to order
    view = dims._replace(R=dims.R if mode == "oneshot" else 1)  # each rank's mailbox
    platform = mesh.devices.flat[0].platform
    name = api.resolve_backend(backend, platform, view, **opts.asdict())
    return _sharded(mesh, axis_name, mode, name, opts, fused, dims.NB == 0, stream_capture=stream_capture)


def _peer_plan(mesh, axis_name, backend, opts: Options, dims: contract.Dims, options):
    """Checks that mode="peer" runs here (backend cute on CUDA GPUs, a supported shape) and
    connects groups that span processes; returns what the jitted layout needs: (the group table, the options)."""
    if backend not in ("auto", "cute"):
        raise ValueError(
            f"backend: mode='peer' needs backend 'cute' on CUDA GPUs (its CuTe consumer polls "
            f"mailboxes that its FFI handler owns), got backend={backend!r}"
        )
    reason = peer.unavailable_reason(mesh.devices.flat[0].platform)
    if reason:
        raise ValueError(f"mode: mode='peer' needs backend 'cute' on CUDA GPUs; it cannot run on this mesh: {reason}")
    reason = peer.unsupported_reason(dims, options.max_tokens, **opts.asdict())
    if reason:
        what = "peer_options" if dims.T > options.max_tokens and dims.R <= peer.MAX_RANKS else "mode"
        raise ValueError(f"{what}: mode='peer' cannot run this call: {reason}")
    table = peer.group_table(mesh, axis_name)
    peer.connect(mesh, axis_name, table, options)  # groups across processes: map their mailboxes
    return table, options


def _fused_partial(attn, w_o, ranks: int) -> jax.ShapeDtypeStruct:
    """Checks the fused producer's inputs; returns the partial [R, T, H] it will publish."""
    T, K = contract.check_array("attn", attn, 2, "[T, heads*head_dim]")
    wK, H = contract.check_array("w_o", w_o, 2, "[heads*head_dim, H]")
    if wK != K:
        raise ValueError(
            f"w_o: expected shape [heads*head_dim, H] with heads*head_dim = {K} (from attn), got {(wK, H)}"
        )
    if K % ranks:
        raise ValueError(f"attn: heads*head_dim is split over {ranks} ranks; expected a multiple of {ranks}, got {K}")
    return jax.ShapeDtypeStruct((ranks, T, H), bf16)


def _tp_call(
    producer: tuple,  # (partial,), or (attn, w_o): the fused producer's inputs
    prefix,
    blocks,
    norm,
    query,
    out_norm,
    *,
    mesh: Mesh,
    axis_name: str = "tp",
    mode: str = "oneshot",
    backend: str = "auto",
    peer_options: peer.PeerOptions | None = None,  # mode="peer" only
    stream_capture: bool = False,  # api.consumer's; not mode="peer"
    **options,
) -> contract.ConsumerResult | peer.PeerResult:
    """tp_consumer and tp_oproj_consumer: the checks, the layout (cached) and the call."""
    fused = len(producer) == 2
    ranks = _check_layout(mesh, axis_name, mode, backend, peer_options)
    stream_capture = check_bool("stream_capture", stream_capture)
    if stream_capture and mode == "peer":
        raise ValueError(
            "stream_capture: mode='peer' runs its own FFI call (publish and consume), which enters XLA's graph as a "
            "kernel node; stream_capture=True applies to modes 'oneshot', 'twoshot' and 'psum'"
        )
    opts = Options.from_kwargs(options)
    partial = _fused_partial(*producer, ranks) if fused else producer[0]
    dims = contract.check_arguments(partial, prefix, blocks, norm, query, out_norm, **opts.asdict())
    _check_ranks(dims.R, ranks, mode, dims.H, "w_o" if fused else "partial")
    fn = _plan(mesh, axis_name, mode, backend, opts, dims, fused, peer_options, stream_capture)
    result = fn(*producer, prefix, norm, query, out_norm, *(() if dims.NB == 0 else (blocks,)))
    return _checked(result, mode, producer[0])


def _with_mesh(name: str, keywords: dict) -> dict:
    """The keywords, or a TypeError naming the public function when `mesh` is missing."""
    if "mesh" not in keywords:
        raise TypeError(f"{name}() missing the keyword argument 'mesh' (a jax.sharding.Mesh with the TP axis)")
    return keywords


@takes_options(passes_on=_tp_call)
def tp_consumer(
    partial,  # [R, T, H] bf16, sharded on R over `axis_name`: rank r holds partial[r] ([1, T, H])
    prefix,  # [T, H] bf16, replicated
    blocks,  # [T, NB, H] bf16, replicated
    norm,  # [H] bf16, replicated
    query,  # [H] bf16, replicated
    out_norm,  # [H] bf16, replicated
    **keywords,
) -> contract.ConsumerResult | peer.PeerResult:
    """The consumer over a TP group: each rank holds its partial o-projection; see MODES above.
    Keywords: the layout (`mesh`, `axis_name`, `mode`, `backend`; `peer_options` for mode="peer"
    only), `stream_capture` (api.consumer's: each rank's consumer call traced into XLA's graph,
    the choice between XLA's kernels in a decode step; not with mode="peer", which raises) and
    the options, as api.consumer.

    Returns a ConsumerResult of replicated arrays (prefix [T, H], output [T, H], xmoe
    [reps, T, H] or None); for "oneshot", "twoshot" and "peer" every rank holds the same bits.
    mode="peer" returns a PeerResult (the same fields plus `status`), checked here when the
    call is eager. Works eagerly and under jit / scan (donate the prefix at the caller's jit).
    """
    return _tp_call((partial,), prefix, blocks, norm, query, out_norm, **_with_mesh("tp_consumer", keywords))


@takes_options(passes_on=_tp_call)
def tp_oproj_consumer(
    attn,  # [T, K] bf16, K = heads*head_dim, sharded on K over `axis_name`: rank r holds its heads [T, K/R]
    w_o,  # [K, H] bf16, sharded on K over `axis_name`: rank r holds the matching rows [K/R, H]
    prefix,
    blocks,
    norm,
    query,
    out_norm,
    **keywords,
) -> contract.ConsumerResult | peer.PeerResult:
    """The fused TP producer + consumer, in one shard_map. The other arrays (replicated) and the
    keywords are tp_consumer's.

    Layout: `attn` [T, heads*head_dim] is split on its last axis and `w_o` [heads*head_dim, H]
    on its first, in R equal contiguous pieces, rank r taking piece r of each (its heads and
    their rows of W_o). Rank r computes its partial o-projection
    `partial_r = bf16(attn_r @ w_o_r)` ([T, H], f32 accumulation, one bf16 rounding), publishes
    it (-0.0 as +0.0) and the partials are reduced and consumed as in `tp_consumer` with the
    same `mode`. Returns the same replicated ConsumerResult (PeerResult for mode="peer").
    """
    return _tp_call((attn, w_o), prefix, blocks, norm, query, out_norm, **_with_mesh("tp_oproj_consumer", keywords))


def _checked(result, mode: str, first_input):
    """mode="peer" called eagerly: raises if any rank's consumer gave up (reads the status, so
    waits for the step). Under tracing the caller checks PeerResult.status."""
    if mode == "peer" and not isinstance(first_input, jax.core.Tracer):
        peer.check_status(result.status)
    return result


def _mailbox(mine, axis_name: str, mode: str, ranks: int):  # [1, T, H] bf16, published -> [R or 1, T, H]
    """One rank's mailbox from its own published partial, replicated (invariant) over the axis."""
    if mode == "oneshot":
        return jax.lax.all_gather(mine[0], axis_name, axis=0, to="invarying")  # [R, T, H], rank order
    if mode == "twoshot":
        _, T, H = mine.shape
        slices = mine[0].reshape(T, ranks, H // ranks).transpose(1, 0, 2)  # [R, T, H/R]: slice s -> rank s
        recv = jax.lax.all_to_all(slices, axis_name, 0, 0, tiled=True)  # [R, T, H/R]: row s from rank s
        mine_sum = to_bf16(rank_sum(recv.astype(f32), 1))  # ROUND: rank order, f32, stored as bf16
        mine_sum = without_negative_zero(mine_sum)  # published into the gather row
        row = jax.lax.all_gather(mine_sum, axis_name, axis=1, tiled=True, to="invarying")  # [T, H]
        return row[None]
    total = jax.lax.psum(mine[0].astype(f32), axis_name)  # [T, H] f32, XLA's order
    return without_negative_zero(to_bf16(total))[None]  # ROUND: stored as bf16, published


@functools.lru_cache(maxsize=64)
def _sharded(mesh, axis_name, mode, backend, options, fused, no_blocks, peer_plan=None, stream_capture=False):
    """The jitted shard_map for one static layout (cached: eager calls do not retrace);
    `backend` is resolved (a registry name), `options` the consumer's (an Options),
    `peer_plan` (mode="peer") the group table and the PeerOptions, `stream_capture` api.consumer's.

    Arguments: the producer's (partial, or attn and w_o), then prefix, norm, query, out_norm,
    then blocks unless `no_blocks`: with NB = 0 the empty [T, 0, H] blocks are made inside,
    because a zero-size shard_map operand crashes jax 0.11.2 on a multi-device CPU mesh
    (segmentation fault, seen with any shard_map over >= 2 devices)."""
    consume_opts = options.asdict()
    ranks = int(mesh.shape[axis_name])

    def consume(mine, prefix, norm, query, out_norm, *blocks):  # mine: [1, T, H] bf16
        (blocks,) = blocks or (jnp.zeros((prefix.shape[0], 0, prefix.shape[1]), bf16),)
        if peer_plan is not None:  # the FFI call publishes (-0.0 -> +0.0 in its publish kernel)
            table, peer_options = peer_plan
            return peer.consume(
                mine[0], prefix, blocks, norm, query, out_norm, table=table, options=peer_options, **consume_opts
            )
        mailbox = _mailbox(without_negative_zero(mine), axis_name, mode, ranks)  # published, then moved
        return api.consumer(
            mailbox, prefix, blocks, norm, query, out_norm, backend=backend, stream_capture=stream_capture,
            **consume_opts,
        )  # fmt: skip

    replicated = (P(),) * (4 if no_blocks else 5)
    if fused:

        def body(attn, w_o, *rest):  # attn [T, K/R], w_o [K/R, H]: this rank's heads
            partial = to_bf16(jnp.dot(attn, w_o, preferred_element_type=f32))  # ROUND: bf16 partial
            return consume(partial[None], *rest)

        in_specs = (P(None, axis_name), P(axis_name, None), *replicated)
    else:

        def body(partial, *rest):  # partial [1, T, H]: this rank's slot
            return consume(partial, *rest)

        in_specs = (P(axis_name), *replicated)
    if peer_plan is None:
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P()))
    # mode="peer": prefix, output and xmoe hold the same bits on every rank (same slots, same
    # order), but come out of a per-rank FFI call that JAX cannot prove replicated, hence
    # check_vma=False; the status is one word per device, in mesh order.
    out_specs = peer.PeerResult(P(), P(), P(), P(tuple(mesh.axis_names)))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))
