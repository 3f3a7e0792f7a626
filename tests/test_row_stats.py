"""CPU checks of the arithmetic the CuTe kernel's single exchange relies on (oproj_jax/cute/row_stats.py).

The kernel gets G = b_i . b_j, b.w, b.p, p.p and p.w in one cluster exchange and forms the
original kernel's second-exchange values from them: mix.mix = e^T G e and mix.p = sum_b e_b (b.p).
Its tensor-core dots need w = norm * query as two bf16 values, w = w_hi + w_lo exactly. These tests check those
two facts independently of the kernel (numpy, exact or f64), and the statistic layout's index
arithmetic the kernel evaluates per lane.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

BF16 = ml_dtypes.bfloat16


def _bf16(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(BF16)


@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e3, 1e-30])
def test_weight_splits_exactly_into_two_bf16(scale):
    """w = f32(norm) f32(query) has at most 16 significant bits: bf16(w) + bf16(w - bf16(w)) == w,
    bit for bit, so every tensor-core product with w_hi and w_lo is exact."""
    rng = np.random.default_rng(7)
    norm, query = _bf16(rng, 1 << 16, scale), _bf16(rng, 1 << 16)
    w = norm.astype(np.float32) * query.astype(np.float32)
    w_hi = w.astype(BF16)
    w_lo = (w - w_hi.astype(np.float32)).astype(BF16)
    assert np.array_equal(w_lo.astype(np.float32), w - w_hi.astype(np.float32)), "w - w_hi not a bf16"
    recombined = w_hi.astype(np.float32) + w_lo.astype(np.float32)
    np.testing.assert_array_equal(recombined.view(np.uint32), w.view(np.uint32))


@pytest.mark.parametrize("nb", [1, 3, 8])
def test_gram_form_equals_the_mix_dots(nb):
    """mix = sum_b e_b b_b: mix.mix = e^T G e and mix.p = e . (b.p), in f64 to rounding."""
    rng = np.random.default_rng(nb)
    blocks = _bf16(rng, (nb, 7168)).astype(np.float64)
    p = _bf16(rng, 7168).astype(np.float64)
    e = rng.uniform(0.05, 1.0, nb)
    mix = e @ blocks
    gram = blocks @ blocks.T
    # the kernel's order: sum_i e_i (G_ii e_i + 2 sum_{j > i} G_ij e_j)
    mix_mix = sum(e[i] * (gram[i, i] * e[i] + 2 * sum(gram[i, j] * e[j] for j in range(i + 1, nb))) for i in range(nb))
    np.testing.assert_allclose(mix_mix, mix @ mix, rtol=1e-12)
    np.testing.assert_allclose(e @ (blocks @ p), mix @ p, rtol=1e-12)


def test_stats_layout_indices():
    """Stats: G's upper triangle row by row, then b.w, b.p, p.p, p.w, all distinct and within
    the exchange stride; the kernel's per-lane formula for row i's first index matches."""
    row_stats = pytest.importorskip(
        "oproj_jax.cute.row_stats", reason="CuTe DSL not importable (pip install oproj-jax[cute])"
    )
    for nb in range(1, 9):
        s = row_stats.Stats(nb)
        gram = [s.gram(i, j) for i in range(nb) for j in range(i, nb)]
        assert gram == list(range(nb * (nb + 1) // 2))
        for i in range(nb):  # warp_stats: (quad * (2 NB + 1 - quad)) >> 1
            assert (i * (2 * nb + 1 - i)) >> 1 == s.gram(i, i)
        tail = [*(s.bw + b for b in range(nb)), *(s.bp + b for b in range(nb)), s.pp, s.pw]
        assert tail == list(range(len(gram), s.count))
        assert s.count <= row_stats.STRIDE
