"""The AttnRes row statistics of the CuTe kernel: what one cluster exchange carries (NB > 0).

Every row dot the op needs is a sum over the whole hidden row, so each CTA computes its slice's
part and the 7 CTAs of a token add them (one DSMEM exchange). With the prefix source p known,
one exchange carries all of them:

  G[i][j] = b_i . b_j (i <= j)   the blocks' Gram matrix: |b|^2 for the keys, and mix . mix
  b.w, b.p, p.p, p.w             w = norm * query (the folded key weight)

The original kernel's second exchange (mix.mix and mix.p, after the softmax) is then arithmetic on these
sums: mix = sum_b e_b b_b gives mix.mix = e^T G e and mix.p = sum_b e_b (b.p), the same values
in exact arithmetic; in f32 they differ by rounding only (docs/spec.md, "Arithmetic").

Per warp, G, b.w and b.p come from tensor-core mma (m16n8k16, bf16 in, f32 accumulate) over the
warp's 256 elements: A = [b_0..b_7; w_hi; w_lo; p; p ...] (16 rows), B = [b_0..b_7] (8 columns).
w = f32(norm) * f32(query) is exact in f32 (16 significant bits at most) and splits exactly into
two bf16, w_hi = bf16(w) and w_lo = w - w_hi, so every product is exact and only the f32 sums
round, in the tensor core's order. p is bf16 by definition (the rounded prefix).
"""

from __future__ import annotations

from cutlass import Float32

from oproj_jax.cute import primitives as P

STRIDE = 64  # f32 slots per warp / per CTA in the exchange arrays (54 used at NB = 8)
CHAINS = 4  # independent mma chains per warp: 4 were faster than 2 and 8 on the H200 (docs/perf.md)
STEPS = 16  # mma k-steps per warp: 256 elements, 16 each


class Stats:
    """Index of each statistic in the exchanged vector (NB > 0)."""

    def __init__(self, nb: int):
        self.nb = nb
        self.bw = nb * (nb + 1) // 2  # G's upper triangle first, row by row
        self.bp = self.bw + nb
        self.pp = self.bp + nb
        self.pw = self.pp + 1
        self.count = self.pw + 1  # 54 at NB = 8: fits STRIDE

    def gram(self, i: int, j: int) -> int:  # i <= j
        return i * self.nb - i * (i - 1) // 2 + (j - i)


W_HI, W_LO, P_ROW = 0, 1, 3  # smem rows reused: norm, query (read once), prefix (dead after the rank sum)


def split_weight(kernel, smem, t):
    """w = norm * query from rows 0 and 1, stored back over them as w_hi = bf16(w) and
    w_lo = bf16(w - w_hi) (both exact). Each thread rewrites only the chunks it read."""
    weight = [P.mul_rn(a, b) for a, b in zip(kernel.fragment(smem, 0, t), kernel.fragment(smem, 1, t))]
    high = [P.pack(weight[2 * j], weight[2 * j + 1]) for j in range(4)]
    low = []
    for j in range(4):
        a, b = P.unpack(high[j])
        low.append(P.pack(P.sub_rn(weight[2 * j], a), P.sub_rn(weight[2 * j + 1], b)))
    P.sts4(kernel.chunk(smem, W_HI, t), high)
    P.sts4(kernel.chunk(smem, W_LO, t), low)


def read_weight(kernel, smem, t):
    """w (8 f32) back from its split rows: w_hi + w_lo is exact."""
    high, low = kernel.fragment(smem, W_HI, t), kernel.fragment(smem, W_LO, t)
    return [P.add_rn(a, b) for a, b in zip(high, low)]


def warp_stats(kernel, smem, p, p_words, weight, t, warp, lane):
    """This warp's part of every statistic into wpre[warp, 0..count). p: 8 f32 (exact bf16),
    p_words: the same as 4 packed words, weight: 8 f32 (w)."""
    L, NB, S = kernel.layout, kernel.NB, kernel.stats
    P.sts4(kernel.chunk(smem, P_ROW, t), p_words)  # over the old prefix (each thread its own chunk)
    P.sync_warp()  # a warp's ldmatrix reads only the 256 elements its own lanes wrote
    # lane i addresses row i % 8 of matrix i // 8: matrices 0 and 2 are A rows 0-7 (block i % NB;
    # rows past NB repeat a block and are never read back), 1 and 3 rows 8-15 (w_hi, w_lo, then p);
    # matrices 2 and 3 hold the upper 8 of a step's 16 elements
    matrix, r = lane // 8, lane % 8
    odd = matrix & 1
    upper = P.min_i32(r, 2) + P.min_i32(r >> 1, 1)  # A rows 8-15: W_HI, W_LO, then P_ROW (= 3)
    row = odd * upper + (1 - odd) * (4 + r % NB)
    # the swizzle (kernel.chunk) permutes 16-byte chunks within a 128-byte line only: 4 lane
    # addresses serve all 16 steps (+128 bytes per line)
    addrs = [kernel.chunk(smem, row, warp * 32 + 2 * j + matrix // 2) for j in range(4)]
    words = [P.ldmatrix_x4(addrs[k % 4] + (k // 4) * 128) for k in range(STEPS)]
    acc = [[Float32(0.0)] * 4 for _ in range(CHAINS)]  # independent mma chains
    for k in range(STEPS):
        a = words[k]
        acc[k % CHAINS] = list(P.mma_bf16(a, (a[0], a[2]), acc[k % CHAINS]))
    while len(acc) > 1:  # pairwise
        acc = [[P.add_rn(x, y) for x, y in zip(acc[i], acc[i + 1])] for i in range(0, len(acc), 2)]
    c = acc[0]  # C[quad][2 pair + k], C[quad + 8][2 pair + k]
    quad, pair = lane // 4, lane % 4
    out = smem + L.wpre + warp * STRIDE * 4
    gram_row = (quad * (2 * NB + 1 - quad)) >> 1  # S.gram(quad, quad), quad dynamic
    for k in range(2):
        col = 2 * pair + k
        P.sts_f32_if((quad < NB) & (col >= quad) & (col < NB), out + (gram_row + col - quad) * 4, c[k])
        # b.w = C[8][col] (w_hi, lanes 0-3) + C[9][col] (w_lo, lanes 4-7)
        dw = P.add_rn(c[2 + k], P.shfl_bfly(c[2 + k], 4))
        P.sts_f32_if((quad == 0) & (col < NB), out + (S.bw + col) * 4, dw)
        P.sts_f32_if((quad == 2) & (col < NB), out + (S.bp + col) * 4, c[2 + k])  # C[10][col]
    value, idx = kernel.reduce_scatter([P.dot8(p, p), P.dot8(p, weight)], 2, lane)
    P.sts_f32_if((lane & 15) == 0, out + (S.pp + idx) * 4, value)


def mix_scales(kernel, smem, eps, out_eps):
    """From the cluster totals in blk: the block softmax kept unnormalized (exps, the original
    kernel's streaming form) and the two scales of y = ca * mix + cp * p, output RMSNorm folded
    in."""
    L, NB, S, H = kernel.layout, kernel.NB, kernel.stats, kernel.H

    def total(k):
        return P.lds_f32(smem + L.blk + k * 4)

    gram = {(i, j): total(S.gram(i, j)) for i in range(NB) for j in range(i, NB)}
    bw = [total(S.bw + b) for b in range(NB)]
    bp = [total(S.bp + b) for b in range(NB)]
    pp, pw = total(S.pp), total(S.pw)
    logits = [P.mul_rn(bw[b], P.rstd(gram[b, b], eps, H)) for b in range(NB)]
    maximum = logits[0]
    for b in range(1, NB):
        maximum = P.max_f32(maximum, logits[b])
    exps = [P.exp_approx(P.add_rn(x, -maximum)) for x in logits]
    exp_sum = exps[0]
    for b in range(1, NB):
        exp_sum = P.add_rn(exp_sum, exps[b])
    # mix.mix = sum_i e_i (G_ii e_i + 2 sum_{j>i} G_ij e_j), mix.p = sum_b e_b (b.p)
    mix_mix = Float32(0.0)
    for i in range(NB):
        off = Float32(0.0)
        for j in range(i + 1, NB):
            off = P.fma_rn(gram[i, j], exps[j], off)
        mix_mix = P.fma_rn(exps[i], P.fma_rn(2.0, off, P.mul_rn(gram[i, i], exps[i])), mix_mix)
    mix_p = Float32(0.0)
    for b in range(NB):
        mix_p = P.fma_rn(exps[b], bp[b], mix_p)
    lp = P.mul_rn(pw, P.rstd(pp, eps, H))  # the prefix source's logit
    mx = P.max_f32(maximum, lp)
    alpha = P.exp_approx(P.add_rn(maximum, -mx))
    ep = P.exp_approx(P.add_rn(lp, -mx))
    den = P.fma_rn(alpha, exp_sum, ep)
    # ||alpha mix + ep p||^2 as the original kernel's quadratic form; >= 0 in exact arithmetic, clamped so
    # that rounding in a cancelling mix can never make it negative (rstd of < 0 is NaN)
    quad = P.fma_rn(P.mul_rn(alpha, alpha), mix_mix,
                    P.fma_rn(P.mul_rn(P.mul_rn(2.0, alpha), ep), mix_p, P.mul_rn(P.mul_rn(ep, ep), pp)))
    quad = P.max_f32(quad, Float32(0.0))
    scale = P.rstd(quad, P.mul_rn(P.mul_rn(out_eps, den), den), H)
    return exps, P.mul_rn(alpha, scale), P.mul_rn(ep, scale)
