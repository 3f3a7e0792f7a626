"""The one shape table: tests and benchmarks draw their configurations from here."""

from __future__ import annotations

import dataclasses

import numpy as np

from oproj_jax.contract import HIDDEN

TP = 16  # production tensor parallelism


@dataclasses.dataclass(frozen=True)
class Config:
    R: int  # ranks (mailbox slots)
    T: int  # tokens
    NB: int  # completed blocks, 0..8
    groups: int = 4
    has_delta: bool = True
    xmoe_replicas: int = 0
    twoshot: bool = False  # reduce-scatter + gather: the consumer then sees one slot
    H: int = HIDDEN

    @property
    def name(self) -> str:
        flags = ("" if self.has_delta else "-nodelta") + ("-twoshot" if self.twoshot else "")
        flags += f"-x{self.xmoe_replicas}" if self.xmoe_replicas else ""
        return f"R{self.R}-T{self.T}-NB{self.NB}-G{self.groups}{flags}"

    def options(self) -> dict:
        return dict(has_delta=self.has_delta, groups=self.groups, xmoe_replicas=self.xmoe_replicas)


# Parity: covers R in {1, 2, 16}, T in {1, 3, 64}, NB in {0, 1, 8}, groups 1..4, has_delta both,
# twoshot and xmoe, each value several times and the production shape (R16, NB8, G4) at every T.
PARITY = (
    Config(16, 1, 8),
    Config(16, 3, 8),
    Config(16, 64, 8),
    Config(16, 3, 8, groups=1),
    Config(16, 3, 8, groups=2),
    Config(16, 3, 8, groups=3),
    Config(16, 3, 0, groups=3, has_delta=False),
    Config(16, 1, 1, groups=2, xmoe_replicas=2),
    Config(16, 64, 0, groups=1, xmoe_replicas=1),
    Config(16, 3, 1, has_delta=False, xmoe_replicas=3),
    Config(16, 3, 8, groups=1, twoshot=True),
    Config(16, 64, 1, groups=1, has_delta=False, twoshot=True),
    Config(2, 1, 0, groups=1),
    Config(2, 3, 1, groups=3),
    Config(2, 64, 8, groups=4, has_delta=False),
    Config(2, 3, 8, groups=1, twoshot=True),
    Config(1, 1, 8, groups=1),
    Config(1, 3, 0, groups=4, xmoe_replicas=1),
    Config(1, 64, 1, groups=2, has_delta=False),
)

# A cheap subset for slow paths (Pallas interpret mode on the CPU).
PARITY_SMALL = tuple(c for c in PARITY if c.T <= 3 and not c.twoshot)[:8]

# The GPU check sweep adds more token counts at the production shape: 16 and 32 are the CuTe
# kernel's last launches with the L2 warm-up and with the PDL trigger after its wait.
CHECK_T = (1, 3, 8, 16, 32, 64, 512, 4096)
# Every NB strictly between 1 and 8 once (the CuTe kernel's exchanged statistics and its
# tensor-core operand rows depend on NB), at R=16 so that no extra cubin is needed.
MID_NB = (
    Config(16, 1, 2),
    Config(16, 3, 3, groups=2),
    Config(16, 3, 4, has_delta=False),
    Config(16, 8, 5, groups=3, xmoe_replicas=1),
    Config(16, 3, 6, groups=1),
    Config(16, 64, 7),
)
GPU_CHECKS = PARITY + tuple(Config(TP, t, 8) for t in CHECK_T if t not in (1, 3, 64)) + MID_NB

# Timed configuration (the benchmark of record, docs/perf.md): R=16, NB=8, has_delta, groups=4.
BENCH_T = (1, 8, 64, 512, 4096)
BENCH = tuple(Config(TP, t, 8) for t in BENCH_T)


def min_bytes(config: Config) -> int:
    """Bytes the op must move at least: read mailbox, prefix, blocks; write prefix, output."""
    return (config.R + config.NB + 3) * config.T * config.H * 2


def make_inputs(config: Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Random, non-zero bf16 inputs (numpy, ml_dtypes bf16) for one config.

    The partials span a wide dynamic range (2^-8 .. 2^8 per element) and, at a quarter of the
    positions, two ranks hold +X and -X (|X| ~ 2^12) that cancel, the rest (and the prefix) scaled to ~2^-12: the small partials lose bits
    against X in an order-dependent way, so the summation order changes the bf16 prefix bits.
    Real -0.0 values are planted (about 1 %), so a backend that treats -0.0 as the sentinel or
    sums it carelessly shows up.
    """
    import ml_dtypes

    rng = np.random.default_rng(seed)
    R, T, NB, H = config.R, config.T, config.NB, config.H
    scale = np.exp2(rng.uniform(-8, 8, size=(R, T, H)))
    mailbox = rng.standard_normal((R, T, H)) * scale
    prefix = rng.standard_normal((T, H)) * 4
    if R >= 2:  # cancelling pairs: +X on one rank, -X on another, so the f32 order shows in bf16
        pair = rng.random((T, H)) < 0.25
        mailbox[:, pair] *= 2.0**-12  # small residue: its bf16 ulp is below X's f32 ulp
        prefix[pair] *= 2.0**-12
        first, second = rng.choice(R, size=2, replace=False)
        big = np.asarray(rng.standard_normal((T, H)) * 2.0**12, np.float32).astype(ml_dtypes.bfloat16)
        mailbox[first][pair] = big[pair]
        mailbox[second][pair] = -big[pair]
    mailbox[rng.random((R, T, H)) < 0.01] = -0.0
    bf = lambda x: np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)
    block_scale = np.exp2(rng.uniform(-2, 3, size=(1, NB, 1)))
    return dict(
        mailbox=bf(mailbox),
        prefix=bf(prefix),
        blocks=bf(rng.standard_normal((T, NB, H)) * block_scale),
        norm=bf(1 + 0.2 * rng.standard_normal(H)),
        query=bf(rng.standard_normal(H) * 0.05),
        out_norm=bf(1 + 0.2 * rng.standard_normal(H)),
    )
