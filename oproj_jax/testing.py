"""Independent checks shared by the tests and the benchmark: an f64 numpy model and the metric."""

from __future__ import annotations

import numpy as np

# Output tolerance, relative L2 against f64. Every output element is a bf16 rounding (8
# significant bits) of a value the backend computed in f32: rounding alone is at most
# 2^-8 = 3.91e-3 relative per element, hence at most 3.91e-3 in relative L2 (1.5e-3 to 2.1e-3
# seen on the config table). f32 reductions over H = 7168 (~sqrt(H) * 2^-24 ~ 5e-6) and fast
# exp/rsqrt (~1e-6 relative) add far less than the gap between that bound and 4e-3.
OUTPUT_REL_L2_TOL = 4e-3


def output_f64(prefix, blocks, norm, query, out_norm, *, eps, out_eps) -> np.ndarray:
    """The output of docs/spec.md in f64 from a given (bf16) prefix: the part after the prefix
    rounding point."""
    p = np.asarray(prefix, np.float64)  # [T, H]
    src = np.concatenate([np.asarray(blocks, np.float64), p[:, None, :]], axis=1)  # [T, NB+1, H]
    H = p.shape[-1]
    w = np.asarray(norm, np.float64) * np.asarray(query, np.float64)
    logits = (src @ w) / np.sqrt((src * src).sum(-1) / H + eps)
    a = np.exp(logits - logits.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    y = np.einsum("tn,tnh->th", a, src)
    y = y / np.sqrt((y * y).sum(-1, keepdims=True) / H + out_eps)
    return y * np.asarray(out_norm, np.float64)


def rel_l2(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def bits(x) -> np.ndarray:
    """The raw bf16 bit patterns, for bit-exact comparisons (-0.0 != +0.0, NaN == NaN)."""
    return np.asarray(x).view(np.uint16)


def custom_calls_in_command_buffers(thunks: str) -> int:
    """kCustomCall thunks nested under a kCommandBuffer thunk in XLA's thunk-sequence dump
    (`--xla_dump_to`, *thunk_sequence_after_thunk_passes.txt): the calls XLA puts into a CUDA
    graph. Command buffers are formed on the thunk sequence, after HLO optimization, so an
    HLO dump never shows them."""
    inside, count, indent = False, 0, 0
    for line in thunks.splitlines():
        depth = len(line) - len(line.lstrip())
        if "kCommandBuffer" in line:
            inside, indent = True, depth
        elif inside and line.strip() and depth <= indent:
            inside = False
        elif inside and "kCustomCall" in line:
            count += 1
    return count


def thunk_sequence(dump_dir, module: str) -> str:
    """The thunk-sequence dump of the jitted function named `module` in an XLA dump directory."""
    import pathlib

    paths = sorted(pathlib.Path(dump_dir).glob(f"*{module}*thunk_sequence_after_thunk_passes.txt"))
    if not paths:
        raise FileNotFoundError(f"no thunk sequence of {module!r} in {dump_dir}")
    return paths[0].read_text()
