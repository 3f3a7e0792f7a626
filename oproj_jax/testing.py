"""Independent checks shared by the tests and the benchmark: the one oracle.

  prefix  -- bit-exact against `model_prefix`, a numpy float32 model of docs/spec.md's
             summation order (written here, sharing no code with any backend);
  output  -- relative L2 below OUTPUT_REL_L2_TOL against `output_f64`, an f64 numpy model of the
             part after the prefix rounding point, computed from the backend's own prefix;
  xmoe    -- every replica is the output with -0.0 written as +0.0.

Non-finite values are part of the contract: a NaN or an infinity in the inputs lands where the
models put it (`check_result` compares the NaN and infinity positions, and the rest as above).
"""

from __future__ import annotations

import functools

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
    with np.errstate(invalid="ignore"):  # non-finite inputs: NaN where the arithmetic puts it
        logits = (src @ w) / np.sqrt((src * src).sum(-1) / H + eps)
        a = np.exp(logits - logits.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        if src.shape[1] == 1:  # one source (NB = 0): weight exactly 1, also for a non-finite logit
            a = np.ones_like(a)
        y = np.einsum("tn,tnh->th", a, src)
        y = y / np.sqrt((y * y).sum(-1, keepdims=True) / H + out_eps)
        return y * np.asarray(out_norm, np.float64)


def rel_l2(got, want) -> float:
    """||got - want|| / ||want||. An all-zero `want` (e.g. the output of an all-zero prefix row at
    NB = 0) is matched only by an all-zero `got`: 0.0 then, else inf (the bound
    ||got - want|| <= tol * ||want|| multiplied out; 0/0 would be NaN, which fails every bound)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    error, scale = np.linalg.norm(got - want), np.linalg.norm(want)
    if scale == 0:
        return 0.0 if error == 0 else float("inf")
    return float(error / scale)


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


def command_buffer_env(dump_dir) -> dict:
    """The environment of a subprocess whose jitted functions XLA puts into command buffers even
    when short (--xla_gpu_graph_min_graph_size=1) and dumps into `dump_dir`, with this package
    importable (its root ahead of the caller's PYTHONPATH) and no preallocated GPU pool."""
    import os
    import pathlib

    root = str(pathlib.Path(__file__).resolve().parents[1])
    return dict(
        os.environ,
        XLA_FLAGS=f"--xla_gpu_graph_min_graph_size=1 --xla_dump_to={dump_dir}",
        XLA_PYTHON_CLIENT_PREALLOCATE="false",
        PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))),
    )


def thunk_sequence(dump_dir, module: str) -> str:
    """The thunk-sequence dump of the jitted function named `module` in an XLA dump directory."""
    import pathlib

    paths = sorted(pathlib.Path(dump_dir).glob(f"*{module}*thunk_sequence_after_thunk_passes.txt"))
    if not paths:
        raise FileNotFoundError(f"no thunk sequence of {module!r} in {dump_dir}")
    return paths[0].read_text()


# ---- the numpy model of the prefix, and the cases the consumer sees


def _bf16(x):  # f32 numpy -> ml_dtypes bf16 (round to nearest even)
    import ml_dtypes

    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)


def model_rank_sum(mailbox, groups: int) -> np.ndarray:  # [R, T, H] bf16 -> [T, H] f32
    """The summation order of docs/spec.md in numpy float32: S = ceil(R / groups) slots per
    group, each group left to right, then group 0 adds the other groups' sums in group order.
    Slots are published first (-0.0 arrives as +0.0). Elementwise f32 adds are correctly
    rounded, so this is the f32 result of exactly that order. One slot at a time in f32: the
    benchmark's largest mailboxes are GiBs in f32."""
    ranks = mailbox.shape[0]
    per_group = -(-ranks // groups)

    def published(r):
        slot = np.array(mailbox[r], np.float32)  # a copy: the caller's array is never written
        slot[slot == 0] = 0.0
        return slot

    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf is NaN, as on every backend
        sums = [
            functools.reduce(np.add, map(published, range(first, min(first + per_group, ranks))))
            for first in range(0, ranks, per_group)
        ]
        return functools.reduce(np.add, sums)


def model_prefix(mailbox, prefix, *, has_delta: bool, groups: int) -> np.ndarray:  # -> [T, H] bf16
    attn = _bf16(model_rank_sum(mailbox, groups))  # ROUND: the reduced partials are bf16
    if not has_delta:
        return attn
    with np.errstate(invalid="ignore", over="ignore"):
        return _bf16(np.asarray(prefix, np.float32) + attn.astype(np.float32))  # ROUND: the prefix is bf16


def model_gather_row(mailbox) -> np.ndarray:  # [R, T, H] bf16 -> [1, T, H] bf16
    """Twoshot's gather row (docs/spec.md, "Twoshot"): every rank's slice summed in rank order
    in f32, stored in bf16."""
    return _bf16(model_rank_sum(mailbox, 1))[None]


def consumer_case(config, inputs) -> tuple[dict, dict]:
    """(the arrays the consumer sees, its options but the epsilons) for a configs.Config and its
    make_inputs arrays: twoshot configs get the one-slot gather row and groups=1."""
    if not config.twoshot:
        return inputs, config.options()
    return dict(inputs, mailbox=model_gather_row(inputs["mailbox"])), dict(config.options(), groups=1)


def spread_tokens(config, inputs, result, count: int):
    """(config, inputs, result) cut down to `count` tokens spread evenly over T, the first and
    the last among them (all of them when T <= count), for check_result at large T where the f64
    model of every token takes seconds: each token is computed on its own, so the check of those
    tokens is exact. `result` is (prefix, output, xmoe or None) as numpy arrays."""
    import dataclasses

    T = config.T
    rows = np.unique(np.linspace(0, T - 1, min(T, count)).round().astype(int))
    if len(rows) == T:
        return config, inputs, result
    inputs = dict(
        inputs, mailbox=inputs["mailbox"][:, rows], prefix=inputs["prefix"][rows], blocks=inputs["blocks"][rows]
    )
    prefix, output, xmoe = (None if x is None else np.asarray(x) for x in result)
    result = (prefix[rows], output[rows], None if xmoe is None else xmoe[:, rows])
    return dataclasses.replace(config, T=len(rows)), inputs, result


def published_bits(x) -> np.ndarray:
    """The bf16 bits of `x` with -0.0 written as +0.0: what every xmoe replica holds."""
    raw = bits(x).copy()
    raw[raw == 0x8000] = 0
    return raw


# ---- the check


def assert_same_bits(got, want, what: str) -> None:
    """Raises AssertionError unless the bf16 bit patterns agree (NaN == NaN whatever its bits)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {got.shape}, expected {want.shape}")
    both_nan = np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32))
    wrong = np.flatnonzero((bits(got) != bits(want)) & ~both_nan)
    if wrong.size:
        raise AssertionError(
            f"{what}: {wrong.size} of {got.size} bit patterns differ, first at flat indices "
            f"{wrong[:5]}: {bits(got).flat[wrong[0]]:#06x}, expected {bits(want).flat[wrong[0]]:#06x}"
        )


def check_result(config, inputs, result, *, eps: float, out_eps: float, what: str = "") -> float:
    """Holds one consumer call to the oracle; raises AssertionError saying what is off, else
    returns the output's rel_l2 against the f64 model (over its finite elements).

    config   a configs.Config: its has_delta, groups and xmoe_replicas are the call's options;
    inputs   the arrays the consumer was given (consumer_case's, for twoshot the gather row);
    result   (prefix, output, xmoe): a ConsumerResult, or numpy arrays (xmoe None if no replicas).
    """
    import ml_dtypes

    prefix, output, xmoe = (None if x is None else np.asarray(x) for x in result)
    tag = f"{what}: " if what else ""
    want_prefix = model_prefix(inputs["mailbox"], inputs["prefix"], has_delta=config.has_delta, groups=config.groups)
    assert_same_bits(prefix, want_prefix, f"{tag}prefix vs the numpy f32 ordered-sum model")
    want = output_f64(
        prefix, inputs["blocks"], inputs["norm"], inputs["query"], inputs["out_norm"], eps=eps, out_eps=out_eps
    )
    if output.dtype != ml_dtypes.bfloat16 or output.shape != want.shape:
        raise AssertionError(f"{tag}output: {output.dtype} {output.shape}, expected bfloat16 {want.shape}")
    got = output.astype(np.float64)
    for name, where in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        wrong = np.flatnonzero(where(got) != where(want))
        if wrong.size:
            raise AssertionError(
                f"{tag}output: {wrong.size} elements differ from the f64 model in being {name}, "
                f"first at flat indices {wrong[:5]}"
            )
    finite = np.isfinite(want)
    error = rel_l2(got[finite], want[finite]) if finite.any() else 0.0
    if not error < OUTPUT_REL_L2_TOL:
        raise AssertionError(f"{tag}output: rel_l2 {error:.3g} vs f64 >= {OUTPUT_REL_L2_TOL}")
    if config.xmoe_replicas == 0:
        if xmoe is not None:
            raise AssertionError(f"{tag}xmoe: expected None with xmoe_replicas=0, got {type(xmoe).__name__}")
        return error
    if xmoe is None or xmoe.shape != (config.xmoe_replicas, *output.shape) or xmoe.dtype != output.dtype:
        shape = None if xmoe is None else (xmoe.dtype, xmoe.shape)
        raise AssertionError(f"{tag}xmoe: expected bfloat16 {(config.xmoe_replicas, *output.shape)}, got {shape}")
    clean = published_bits(output)
    for k in range(config.xmoe_replicas):
        wrong = np.flatnonzero(bits(xmoe[k]) != clean)
        if wrong.size:
            raise AssertionError(
                f"{tag}xmoe[{k}]: {wrong.size} elements are not the output with -0.0 as +0.0, "
                f"first at flat indices {wrong[:5]}"
            )
    return error
