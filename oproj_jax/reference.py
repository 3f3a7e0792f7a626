"""The op in plain jnp: docs/spec.md ("Arithmetic") in code. Every other backend is held to this function.

f32 throughout after one upcast (products and sums written out elementwise, so no backend's
matmul precision, e.g. TF32 on GPUs, enters); the only rounding points are the ones the
original kernel has, each marked `# ROUND`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from oproj_jax.contract import ConsumerResult, Dims

f32, bf16 = jnp.float32, jnp.bfloat16


def to_bf16(x):
    """f32 -> bf16, to nearest even: a rounding point. The reduce-precision comes first because
    XLA on a GPU (with its default excess precision) drops an f32 -> bf16 -> f32 pair of
    converts that lands in one fusion, e.g. one call's prefix and the next call's read of it in
    a jitted loop; it never drops a reduce-precision."""
    return lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7).astype(bf16)


def unavailable_reason(platform: str) -> str | None:
    return None  # plain jnp: runs wherever JAX runs


def unsupported_reason(dims: Dims, **options) -> str | None:
    return None


def published(mailbox):  # [R, T, H] bf16 -> same
    """What a producer publishes: every -0.0 stored as +0.0 (docs/spec.md, "Mailbox protocol").

    A published slot can never look like the sentinel; summing published values also fixes
    the sign of an exact-zero sum, so every backend agrees on the prefix bits.
    """
    return jnp.where(mailbox == 0, jnp.zeros_like(mailbox), mailbox)


def rank_sum(partials, groups: int):  # [R, T, H] f32 -> [T, H] f32
    """The summation order (docs/spec.md, "Summation order"): group g sums ranks g*S .. g*S+S-1
    left to right (S = ceil(R/G)), then group 0 adds the other groups' sums in group order.
    groups=1: plain rank order."""
    ranks = partials.shape[0]
    per_group = -(-ranks // groups)
    group_sums = []
    for first in range(0, ranks, per_group):
        total = partials[first]
        for r in range(first + 1, min(first + per_group, ranks)):
            total = total + partials[r]
        group_sums.append(total)
    total = group_sums[0]
    for other in group_sums[1:]:
        total = total + other
    return total


def rstd(sum_of_squares, eps, hidden: int):
    return jax.lax.rsqrt(sum_of_squares / hidden + eps)


def without_negative_zero(x):  # any bf16 -> same, -0.0 written as +0.0
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16)
    return jax.lax.bitcast_convert_type(jnp.where(bits == 0x8000, jnp.uint16(0), bits), bf16)


def consumer(
    mailbox,  # [R, T, H] bf16
    prefix,  # [T, H] bf16
    blocks,  # [T, NB, H] bf16
    norm,  # [H] bf16
    query,  # [H] bf16
    out_norm,  # [H] bf16
    *,
    eps: float,
    out_eps: float,
    has_delta: bool,
    groups: int,
    xmoe_replicas: int,
) -> ConsumerResult:
    hidden = mailbox.shape[-1]
    attn = rank_sum(published(mailbox).astype(f32), groups)  # [T, H]
    attn = to_bf16(attn).astype(f32)  # ROUND: the reduced partials are bf16
    if has_delta:
        attn = prefix.astype(f32) + attn
    new_prefix = to_bf16(attn)  # ROUND: the prefix is stored in bf16
    p = new_prefix.astype(f32)

    w = norm.astype(f32) * query.astype(f32)  # [H]: key norm folded into the pseudo-query
    sources = jnp.concatenate([blocks.astype(f32), p[:, None, :]], axis=1)  # [T, NB+1, H]
    logits = jnp.sum(sources * w, axis=-1) * rstd(jnp.sum(sources * sources, axis=-1), eps, hidden)  # [T, NB+1]
    # With one source (NB = 0) its weight is exactly 1 (docs/spec.md), also where its logit is
    # not finite (a softmax of a lone inf/NaN logit would be NaN).
    weights = jax.nn.softmax(logits, axis=-1) if blocks.shape[1] else jnp.ones_like(logits)
    y = jnp.sum(weights[..., None] * sources, axis=1)  # f32, never rounded
    y = y * rstd(jnp.sum(y * y, axis=-1, keepdims=True), out_eps, hidden)
    output = to_bf16(y * out_norm.astype(f32))  # ROUND: the output is bf16

    xmoe = None
    if xmoe_replicas:
        xmoe = jnp.broadcast_to(without_negative_zero(output), (xmoe_replicas, *output.shape))
    return ConsumerResult(new_prefix, output, xmoe)


def with_partial(mailbox, partial, rank: int):  # [R, T, H], [T, H] -> [R, T, H]
    """The mailbox a call with an own partial reads: slot `rank` replaced by `partial`."""
    return lax.dynamic_update_index_in_dim(mailbox, partial, rank, 0)


def twoshot_gather(mailbox):  # [R, T, H] bf16 -> [1, T, H] bf16
    """Twoshot's gather row: the rank-order sum (groups=1), rounded to bf16 as it is stored."""
    return to_bf16(rank_sum(published(mailbox).astype(f32), 1))[None]
