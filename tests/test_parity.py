"""Parity: one test body for every backend and every config of configs.PARITY (docs/spec.md, "Numerics").

Expected values never come from the code under test:
  prefix  -- bit-exact against a numpy float32 model of the summation order, written here;
  output  -- rel_l2 against testing.output_f64, computed from the backend's own prefix;
  xmoe    -- every replica is the output with -0.0 written as +0.0.
Twoshot configs call the consumer with the one-slot gather row (R = 1, groups = 1); their prefix
must equal the oneshot groups=1 prefix of the full mailbox.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import oproj_jax
from oproj_jax import configs, reference, testing
from oproj_jax.configs import Config

ARGS = ("mailbox", "prefix", "blocks", "norm", "query", "out_norm")
SEED = 0
# Epsilons large against the sources' mean squares (blocks span 2^-2 .. 2^3 in scale), so that
# a misplaced or swapped epsilon moves the output by more than OUTPUT_REL_L2_TOL; the
# production value 1e-6 is covered by test_production_epsilon.
EPS, OUT_EPS = 0.5, 0.25
bf16 = ml_dtypes.bfloat16


# ---- backends: each takes numpy bf16 arrays and options, returns numpy (prefix, output, xmoe).


def run_reference(arrays, *, eps=EPS, out_eps=OUT_EPS, **options):
    result = oproj_jax.consumer(
        *(jnp.asarray(arrays[k]) for k in ARGS), eps=eps, out_eps=out_eps, backend="reference", **options
    )
    return tuple(None if x is None else np.asarray(x) for x in result)


def run_torch(arrays, *, eps=EPS, out_eps=OUT_EPS, **options):
    pytest.importorskip("torch", reason="the torch reference needs PyTorch: pip install oproj-jax[test]")
    from oproj_jax import torch_ref

    result = torch_ref.consumer(*(torch_ref.from_numpy(arrays[k]) for k in ARGS), eps=eps, out_eps=out_eps, **options)
    return tuple(None if x is None else torch_ref.to_numpy(x) for x in result)


BACKENDS = {"reference": run_reference, "torch": run_torch}


# ---- the independent numpy model of the prefix.


def ordered_sum_f32(mailbox, groups: int):  # [R, T, H] bf16 -> [T, H] f32
    """The summation order of docs/spec.md in numpy float32: S = ceil(R / groups) slots per
    group, each group left to right, group 0 then adds the other groups' sums in group order. Elementwise f32 adds are
    correctly rounded, so this is the f32 result of exactly that order."""
    slots = np.asarray(mailbox, np.float32)
    slots = np.where(slots == 0, np.float32(0), slots)  # published: -0.0 arrives as +0.0
    count = slots.shape[0]
    per_group = -(-count // groups)
    firsts = range(0, count, per_group)
    sums = [functools.reduce(np.add, slots[first : first + per_group]) for first in firsts]
    return functools.reduce(np.add, sums)


def model_prefix(mailbox, prefix, *, has_delta: bool, groups: int):  # -> [T, H] bf16
    attn = ordered_sum_f32(mailbox, groups).astype(bf16)  # the reduced partials are bf16
    if not has_delta:
        return attn
    return (np.asarray(prefix, np.float32) + attn.astype(np.float32)).astype(bf16)


# ---- cases


@functools.cache
def inputs(config: Config):  # -> numpy bf16 arrays of the full (oneshot) problem; do not mutate
    return configs.make_inputs(config, SEED)


def consumer_case(config: Config):
    """What the consumer sees: twoshot configs get the gather row and R = 1, groups = 1."""
    arrays, options = inputs(config), config.options()
    if config.twoshot:
        gather = np.asarray(reference.twoshot_gather(jnp.asarray(arrays["mailbox"])))  # [1, T, H]
        arrays, options = dict(arrays, mailbox=gather), dict(options, groups=1)
    return arrays, options


@functools.cache
def result(backend: str, config: Config):
    arrays, options = consumer_case(config)
    return BACKENDS[backend](arrays, **options)


def expected_prefix(config: Config):
    arrays = inputs(config)
    groups = 1 if config.twoshot else config.groups  # twoshot sums the slice in rank order
    return model_prefix(arrays["mailbox"], arrays["prefix"], has_delta=config.has_delta, groups=groups)


def assert_same_bits(got, want, what: str):
    got, want = testing.bits(got), testing.bits(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    wrong = np.flatnonzero(got != want)
    assert wrong.size == 0, f"{what}: {wrong.size} of {got.size} bit patterns differ, first at flat index {wrong[:5]}"


def check_output(prefix, output, arrays, *, eps=EPS, out_eps=OUT_EPS):
    want = testing.output_f64(
        prefix, arrays["blocks"], arrays["norm"], arrays["query"], arrays["out_norm"], eps=eps, out_eps=out_eps
    )
    assert output.dtype == bf16 and output.shape == want.shape
    assert np.isfinite(np.asarray(output, np.float32)).all(), "output has NaN/inf"
    error = testing.rel_l2(output, want)
    assert error < testing.OUTPUT_REL_L2_TOL, f"output rel_l2 {error:.3g} vs f64 >= {testing.OUTPUT_REL_L2_TOL}"


def check_xmoe(output, xmoe, replicas: int):
    if replicas == 0:
        assert xmoe is None
        return
    assert xmoe.shape == (replicas, *output.shape) and xmoe.dtype == bf16
    sanitized = np.where(testing.bits(output) == 0x8000, np.uint16(0), testing.bits(output))
    for k in range(replicas):
        assert_same_bits(xmoe[k], sanitized.view(bf16), f"xmoe[{k}]")
    assert not (testing.bits(xmoe) == 0x8000).any(), "xmoe holds a -0.0 (looks like the sentinel)"


def name(config: Config) -> str:
    return config.name


TWOSHOT = tuple(c for c in configs.PARITY if c.twoshot)


# ---- the parity body


@pytest.mark.parametrize("config", configs.PARITY, ids=name)
@pytest.mark.parametrize("backend", BACKENDS)
def test_parity(backend, config):
    arrays, _ = consumer_case(config)
    prefix, output, xmoe = result(backend, config)
    assert_same_bits(prefix, expected_prefix(config), "prefix vs the numpy f32 ordered-sum model")
    check_output(prefix, output, arrays)
    check_xmoe(output, xmoe, config.xmoe_replicas)


@pytest.mark.parametrize("config", configs.PARITY, ids=name)
def test_torch_matches_jax_reference(config):
    """The two independently written references agree: prefix bit for bit, output to rounding."""
    torch_prefix, torch_output, _ = result("torch", config)
    jax_prefix, jax_output, _ = result("reference", config)
    assert_same_bits(torch_prefix, jax_prefix, "torch prefix vs jnp reference prefix")
    # Both compute in f32 and round once to bf16; they differ by at most an ulp where f32
    # reduction order tips a rounding, far below the f64 tolerance.
    assert testing.rel_l2(torch_output, jax_output) < testing.OUTPUT_REL_L2_TOL


@pytest.mark.parametrize("config", TWOSHOT, ids=name)
@pytest.mark.parametrize("backend", BACKENDS)
def test_twoshot_prefix_equals_oneshot_groups1(backend, config):
    oneshot = dataclasses.replace(config, twoshot=False, groups=1)
    assert_same_bits(result(backend, config)[0], result(backend, oneshot)[0], "twoshot vs oneshot groups=1 prefix")


# ---- what makes the bit-exact check meaningful


@pytest.mark.parametrize("backend", BACKENDS)
def test_summation_order_changes_prefix_bits(backend):
    """On the wide-range data at R = 16, groups=1 and groups=4 give different prefix bits, so
    matching the model bit for bit really checks the order (a backend ignoring `groups` fails)."""
    config = Config(16, 3, 0, groups=1, has_delta=False)
    arrays = inputs(config)
    model = {g: model_prefix(arrays["mailbox"], arrays["prefix"], has_delta=False, groups=g) for g in (1, 4)}
    assert (testing.bits(model[1]) != testing.bits(model[4])).any(), "the inputs do not exercise the order"
    got = {g: BACKENDS[backend](arrays, **dict(config.options(), groups=g))[0] for g in (1, 4)}
    differ = testing.bits(got[1]) != testing.bits(got[4])
    assert differ.any(), "groups=1 and groups=4 gave identical prefix bits"
    for g in (1, 4):
        assert_same_bits(got[g], model[g], f"groups={g} prefix")


@pytest.mark.parametrize("groups", (1, 3))
@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_zero_in_every_rank_sums_to_positive_zero(backend, groups):
    """-0.0 in every slot at one position: published data carries +0.0, so the prefix is +0.0."""
    config = Config(16, 3, 0, groups=groups, has_delta=False)
    arrays = dict(inputs(config))
    mailbox = arrays["mailbox"].copy()
    mailbox[:, 1, 5] = -0.0
    arrays["mailbox"] = mailbox
    prefix, _, _ = BACKENDS[backend](arrays, **config.options())
    assert testing.bits(prefix)[1, 5] == 0, f"prefix[1, 5] bits {testing.bits(prefix)[1, 5]:#06x}, expected +0.0"
    assert_same_bits(prefix, model_prefix(mailbox, arrays["prefix"], has_delta=False, groups=groups), "prefix")


@pytest.mark.parametrize("backend", BACKENDS)
def test_xmoe_sanitizes_negative_zero_output(backend):
    """An output that is -0.0 (p = +0.0 times a negative out_norm) appears as +0.0 in xmoe."""
    config = Config(2, 3, 0, groups=1, has_delta=False, xmoe_replicas=2)
    arrays = dict(inputs(config))
    arrays["mailbox"], arrays["out_norm"] = arrays["mailbox"].copy(), arrays["out_norm"].copy()
    arrays["mailbox"][:, 1, 9] = 0.0  # so p[1, 9] = +0.0
    arrays["out_norm"][9] = -1.0
    prefix, output, xmoe = BACKENDS[backend](arrays, **config.options())
    assert testing.bits(output)[1, 9] == 0x8000, "docs/spec.md arithmetic: +0.0 * rstd * -1 is -0.0"
    check_output(prefix, output, arrays)
    check_xmoe(output, xmoe, config.xmoe_replicas)


def test_twoshot_gather_row_has_no_negative_zero():
    mailbox = inputs(TWOSHOT[0])["mailbox"].copy()
    mailbox[:, 0, 7] = -0.0
    gather = np.asarray(reference.twoshot_gather(jnp.asarray(mailbox)))
    assert gather.shape == (1, *mailbox.shape[1:])
    assert_same_bits(gather[0], ordered_sum_f32(mailbox, 1).astype(bf16), "gather row")
    assert testing.bits(gather)[0, 0, 7] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_production_epsilon(backend):
    config = configs.PARITY[1]  # R16-T3-NB8-G4: the production shape
    arrays = inputs(config)
    prefix, output, xmoe = BACKENDS[backend](arrays, eps=1e-6, out_eps=1e-6, **config.options())
    assert_same_bits(prefix, expected_prefix(config), "prefix")
    check_output(prefix, output, arrays, eps=1e-6, out_eps=1e-6)


# ---- under jit, with the prefix donated (the decode loop's usage)


def test_jit_with_donated_prefix_over_two_steps():
    """Two decode steps under jax.jit, the prefix buffer donated and fed back: each step's
    prefix is bit-exact to the model, the output in tolerance, the caller's numpy untouched."""
    config = configs.PARITY[1]
    arrays = inputs(config)
    before = {k: testing.bits(v).copy() for k, v in arrays.items()}
    step = jax.jit(
        functools.partial(oproj_jax.consumer, eps=EPS, out_eps=OUT_EPS, backend="reference", **config.options()),
        donate_argnums=1,
    )
    other = [jnp.asarray(arrays[k]) for k in ("blocks", "norm", "query", "out_norm")]
    mailbox = jnp.asarray(arrays["mailbox"])
    prefix = jnp.asarray(arrays["prefix"])  # [T, H] bf16, donated below
    want_prefix = arrays["prefix"]
    for _ in range(2):
        donated = prefix
        got = step(mailbox, donated, *other)
        assert donated.is_deleted(), "the prefix was not donated"
        want_prefix = model_prefix(arrays["mailbox"], want_prefix, has_delta=config.has_delta, groups=config.groups)
        # Read a copy: a numpy view of got.prefix would pin its buffer and block the next donation.
        got_prefix = np.asarray(jnp.copy(got.prefix))
        assert_same_bits(got_prefix, want_prefix, "jit prefix")
        check_output(got_prefix, np.asarray(got.output), arrays)
        prefix = got.prefix
    for k, v in arrays.items():
        assert_same_bits(v, before[k].view(bf16), f"caller's {k}")


def test_torch_reference_on_cuda(gpu):
    """torch_ref on CUDA tensors: the same prefix bits as the numpy model, the output in tolerance."""
    torch = pytest.importorskip("torch", reason="pip install oproj-jax[test]")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    from oproj_jax import torch_ref

    config = configs.PARITY[2]  # R16-T64-NB8-G4
    arrays = inputs(config)
    got = torch_ref.consumer(
        *(torch_ref.from_numpy(arrays[k]).cuda() for k in ARGS), eps=EPS, out_eps=OUT_EPS, **config.options()
    )
    assert got.prefix.is_cuda and got.output.is_cuda
    prefix, output = torch_ref.to_numpy(got.prefix), torch_ref.to_numpy(got.output)
    assert_same_bits(prefix, expected_prefix(config), "CUDA torch prefix")
    check_output(prefix, output, arrays)
