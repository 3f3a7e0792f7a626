"""The op in PyTorch, written from docs/spec.md independently of `oproj_jax.reference` (no shared code).

A second opinion for the tests and the benchmark: it runs on CPU and CUDA tensors, uses no JAX,
and computes the AttnRes mix in the original kernel's *streaming* form (unnormalized block softmax,
then one quadratic form for the output RMSNorm with the epsilon scaled by den^2), where the jnp
reference uses the direct softmax form. The prefix is bit-exact (same rounding points, same
summation order, explicit left-to-right adds); the output agrees with the reference to f32
rounding. Inputs are never modified: the updated prefix is returned, not written back.

    from oproj_jax import torch_ref
    result = torch_ref.consumer(*map(torch_ref.from_numpy, arrays), groups=4)
"""

from __future__ import annotations


import numpy as np

from oproj_jax.contract import TorchResult, check_tensors
from oproj_jax.options import Options, takes_options


def _torch():
    try:
        import torch
    except ImportError as err:
        raise ImportError(
            "oproj_jax.torch_ref needs PyTorch, which is not installed: pip install oproj-jax[test]"
        ) from err
    return torch


def from_numpy(x):  # numpy (ml_dtypes bf16) or jax [...] -> bf16 torch.Tensor [...] on the CPU, a copy
    torch = _torch()
    x = np.asarray(x)
    if str(x.dtype) != "bfloat16":
        raise TypeError(f"from_numpy: expected a bfloat16 numpy array, got {x.dtype}")
    raw = x.copy().view("int16")  # same 16 bits, a dtype torch can import
    return torch.from_numpy(raw).view(torch.bfloat16)


def to_numpy(x):  # bf16 torch.Tensor [...] (any device) -> numpy ml_dtypes bf16 [...]
    import ml_dtypes

    torch = _torch()
    if x.dtype != torch.bfloat16:
        raise TypeError(f"to_numpy: expected a bfloat16 tensor, got {x.dtype}")
    return x.detach().cpu().contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)


def _ordered_rank_sum(slots, groups: int):  # R x [T, H] f32 -> [T, H] f32
    """The summation order of docs/spec.md: S = ceil(R / groups) slots per group, each group
    left to right, then group 0 adds group 1, 2, ... in order. Plain tensor adds, so nothing is
    reassociated."""
    per_group = (len(slots) + groups - 1) // groups
    group_totals = []
    for g in range(groups):
        mine = slots[g * per_group : (g + 1) * per_group]
        if not mine:
            continue  # the original kernel adds an all-zero sum here; x + 0.0 == x for non -0.0 x
        total = mine[0]
        for slot in mine[1:]:
            total = total + slot
        group_totals.append(total)
    result = group_totals[0]
    for total in group_totals[1:]:
        result = result + total
    return result


@takes_options()
def consumer(mailbox, prefix, blocks, norm, query, out_norm, **options) -> TorchResult:
    """The arguments and options of oproj_jax.consumer, as bf16 torch.Tensors on one device."""
    torch = _torch()
    check_tensors(torch, mailbox, prefix, blocks, norm, query, out_norm)
    # The options' checks and their messages are oproj_jax.consumer's (oproj_jax.options).
    opts = Options.from_kwargs(options)
    f32, bf16 = torch.float32, torch.bfloat16
    H = mailbox.shape[-1]

    def rstd(sum_of_squares, epsilon):
        return torch.rsqrt(sum_of_squares / H + epsilon)

    # Producers publish -0.0 as +0.0; a float compare catches both zeros.
    slots = [torch.where(s == 0, torch.zeros_like(s), s).to(f32) for s in mailbox.unbind(0)]
    reduced = _ordered_rank_sum(slots, opts.groups).to(bf16)  # ROUND: the reduced partials are bf16
    if opts.has_delta:
        reduced = (prefix.to(f32) + reduced.to(f32)).to(bf16)  # ROUND: the prefix is bf16
    new_prefix = reduced  # [T, H] bf16
    p = new_prefix.to(f32)

    # Dot products are elementwise products and sums, never matmuls: on CUDA a f32 matmul may
    # run in TF32, which would cost the output about three decimal digits.
    w = norm.to(f32) * query.to(f32)  # [H]
    p_sq = (p * p).sum(-1)  # [T]
    nb = blocks.shape[1]
    if nb == 0:
        scaled = p * rstd(p_sq, opts.out_eps)[:, None]
    else:
        # Streaming form (the original kernel's): unnormalized softmax over the blocks, then fold in p.
        b = blocks.to(f32)  # [T, NB, H]
        block_logit = (b * w).sum(-1) * rstd((b * b).sum(-1), opts.eps)  # [T, NB]
        block_max = block_logit.max(dim=-1).values  # [T]
        e = torch.exp(block_logit - block_max[:, None])  # [T, NB]
        mix = (e[:, :, None] * b).sum(1)  # [T, H]: sum_b e_b * block_b, unnormalized
        p_logit = (p * w).sum(-1) * rstd(p_sq, opts.eps)  # [T]
        top = torch.maximum(block_max, p_logit)
        alpha, ep = torch.exp(block_max - top), torch.exp(p_logit - top)  # [T]
        den = alpha * e.sum(-1) + ep  # softmax denominator
        quad = alpha * alpha * (mix * mix).sum(-1) + 2 * alpha * ep * (mix * p).sum(-1) + ep * ep * p_sq
        scale = rstd(quad, opts.out_eps * den * den)  # ||y||-normalization; 1/den cancels
        scaled = (alpha * scale)[:, None] * mix + (ep * scale)[:, None] * p
    output = (scaled * out_norm.to(f32)).to(bf16)  # ROUND: the output is bf16

    xmoe = None
    if opts.xmoe_replicas:
        clean = torch.where(output == 0, torch.zeros_like(output), output)  # -0.0 -> +0.0
        xmoe = clean.unsqueeze(0).expand(opts.xmoe_replicas, *output.shape).contiguous()
    return TorchResult(new_prefix, output, xmoe)
