"""The contract every backend meets: one test body per property, run for every name of the
registry (api.backend_names()) and for the PyTorch model ("torch").

A backend that cannot run here is skipped with the reason it gives (api.available_backends;
on a CPU "cute" skips, "pallas" runs in Mosaic GPU interpret mode); a call it does not handle
(api.unsupported_reason, e.g. a CuTe variant that is not built) is skipped with that reason.
Nothing falls back: every call names its backend.

One oracle (oproj_jax.testing.check_result): the prefix bit for bit against the numpy f32 model
of the summation order, the output against the f64 model from the backend's own prefix, xmoe
against the output with -0.0 written as +0.0; NaN and infinity positions included.

Backend-specific tests stay in their files: lowering and interpret specifics (test_pallas.py,
test_cute_lowering.py), GPU tests (test_cute_gpu.py), the argument checks' full table
(test_errors.py), the two references against each other (test_parity.py).
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
from oproj_jax import api, configs, contract, testing
from oproj_jax.configs import Config

ARGS = ("mailbox", "prefix", "blocks", "norm", "query", "out_norm")
BACKENDS = (*api.backend_names(), "torch")
JAX_BACKENDS = tuple(api.backend_names())
PLATFORM = jax.default_backend()
INTERPRETED = PLATFORM not in ("gpu", "cuda")  # "pallas" runs in interpret mode here
SEED = 0
# Epsilons large against the sources' mean squares (blocks span 2^-2 .. 2^3 in scale), so that a
# misplaced or swapped epsilon moves the output by more than OUTPUT_REL_L2_TOL; the production
# value 1e-6 is covered by test_production_epsilon.
EPS = dict(eps=0.5, out_eps=0.25)
PRODUCTION = configs.PARITY[1]  # R16-T3-NB8-G4
bf16 = ml_dtypes.bfloat16


def backend_reason(backend: str) -> str | None:
    """None if `backend` runs here, else the reason it gives."""
    if backend == "torch":
        try:
            import torch  # noqa: F401
        except ImportError as err:
            return f"the PyTorch model needs PyTorch ({err}): pip install oproj-jax[test]"
        return None
    return api.available_backends(PLATFORM)[backend]


def need(backend: str, jax_transform: str | None = None) -> None:
    """Skips unless `backend` runs here (and, for `jax_transform`, is a JAX backend)."""
    reason = backend_reason(backend)
    if reason:
        pytest.skip(f"backend={backend!r}: {reason}")
    if jax_transform and backend not in JAX_BACKENDS:
        pytest.skip(f"backend={backend!r} is eager PyTorch: {jax_transform} does not apply")


def need_support(backend: str, arrays: dict, options: dict) -> None:
    """Skips with the backend's reason if it does not handle this call (the torch model handles all)."""
    if backend == "torch":
        return
    R, T, H = arrays["mailbox"].shape
    reason = api.unsupported_reason(backend, contract.Dims(R, T, arrays["blocks"].shape[1], H), **options)
    if reason:
        pytest.skip(f"backend={backend!r} does not handle this call: {reason}")


def call(backend: str, arrays: dict, **options):
    """One eager call of `backend` on numpy arrays; returns numpy (prefix, output, xmoe)."""
    if backend == "torch":
        import torch

        from oproj_jax import torch_ref

        tensors = [torch_ref.from_numpy(x) if x.dtype == bf16 else torch.from_numpy(x) for x in map(arrays.get, ARGS)]
        result = torch_ref.consumer(*tensors, **options)
        return tuple(None if x is None else torch_ref.to_numpy(x) for x in result)
    result = oproj_jax.consumer(*(jnp.asarray(arrays[k]) for k in ARGS), backend=backend, **options)
    return tuple(None if x is None else np.asarray(x) for x in result)


def run(backend: str, arrays: dict, **options):
    """`call`, skipped with the backend's reason if it does not handle the call."""
    need_support(backend, arrays, options)
    return call(backend, arrays, **options)


@functools.cache
def inputs(config: Config):  # numpy bf16 arrays of the full (oneshot) problem; do not mutate
    return configs.make_inputs(config, SEED)


def params(config_list):
    """(backend, config) cases. Interpret mode takes seconds a call at T = 64 on 2 CPU cores:
    those cases of "pallas" are marked slow where it is interpreted."""
    cases = []
    for backend in BACKENDS:
        for config in config_list:
            slow = backend == "pallas" and INTERPRETED and config.T >= 64
            cases.append(
                pytest.param(backend, config, id=f"{backend}-{config.name}", marks=pytest.mark.slow if slow else ())
            )
    return cases


# ---- parity


@pytest.mark.parametrize(("backend", "config"), params(configs.PARITY))
def test_parity(backend, config):
    """Every configs.PARITY config against the oracle. A twoshot config is called with the
    one-slot gather row (R = 1, groups = 1); its prefix must also be the oneshot groups=1
    prefix of the full mailbox."""
    need(backend)
    arrays, options = testing.consumer_case(config, inputs(config))
    result = run(backend, arrays, **EPS, **options)
    testing.check_result(dataclasses.replace(config, groups=options["groups"]), arrays, result, **EPS)
    if config.twoshot:
        full = inputs(config)
        oneshot = testing.model_prefix(full["mailbox"], full["prefix"], has_delta=config.has_delta, groups=1)
        testing.assert_same_bits(result[0], oneshot, "twoshot prefix vs the oneshot groups=1 model")


@pytest.mark.parametrize("backend", BACKENDS)
def test_production_epsilon(backend):
    need(backend)
    arrays = inputs(PRODUCTION)
    result = run(backend, arrays, eps=1e-6, out_eps=1e-6, **PRODUCTION.options())
    testing.check_result(PRODUCTION, arrays, result, eps=1e-6, out_eps=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_summation_order_changes_prefix_bits(backend):
    """On the wide-range data at R = 16, groups=1 and groups=4 give different prefix bits, so
    matching the model bit for bit really checks the order (a backend ignoring `groups` fails)."""
    need(backend)
    config = Config(16, 3, 0, groups=1, has_delta=False)
    arrays = inputs(config)
    model = {g: testing.model_prefix(arrays["mailbox"], arrays["prefix"], has_delta=False, groups=g) for g in (1, 4)}
    assert (testing.bits(model[1]) != testing.bits(model[4])).any(), "the inputs do not exercise the order"
    for g in (1, 4):
        result = run(backend, arrays, **EPS, **dict(config.options(), groups=g))
        testing.check_result(dataclasses.replace(config, groups=g), arrays, result, **EPS, what=f"groups={g}")


@pytest.mark.parametrize("groups", (1, 3))
@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_zero_in_every_rank_sums_to_positive_zero(backend, groups):
    """-0.0 in every slot over two 256-column tiles of one token (and one lone element of
    another): published data carries +0.0, so the prefix is +0.0 there."""
    config = Config(16, 3, 0, groups=groups, has_delta=False)
    need(backend)
    arrays = dict(inputs(config))
    mailbox = arrays["mailbox"].copy()
    mailbox[:, 1, :512] = -0.0
    mailbox[:, 2, 5] = -0.0
    arrays["mailbox"] = mailbox
    result = run(backend, arrays, **EPS, **config.options())
    prefix = testing.bits(result[0])
    assert (prefix[1, :512] == 0).all() and prefix[2, 5] == 0, "a sum of -0.0 slots is not +0.0"
    testing.check_result(config, arrays, result, **EPS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_xmoe_sanitizes_negative_zero_output(backend):
    """An output that is -0.0 (p = +0.0 times a negative out_norm) appears as +0.0 in xmoe."""
    config = Config(2, 3, 0, groups=1, has_delta=False, xmoe_replicas=2)
    need(backend)
    arrays = dict(inputs(config))
    arrays["mailbox"], arrays["out_norm"] = arrays["mailbox"].copy(), arrays["out_norm"].copy()
    arrays["mailbox"][:, 1, 9] = 0.0  # so p[1, 9] = +0.0
    arrays["out_norm"][9] = -1.0
    result = run(backend, arrays, **EPS, **config.options())
    assert testing.bits(result[1])[1, 9] == 0x8000, "docs/spec.md arithmetic: +0.0 * rstd * -1 is -0.0"
    testing.check_result(config, arrays, result, **EPS)


# ---- non-finite inputs


NONFINITE = (
    pytest.param(Config(16, 4, 8), id="R16-T4-NB8"),
    pytest.param(Config(16, 3, 0, groups=3, has_delta=False), id="R16-T3-NB0-nodelta"),
)


@pytest.mark.parametrize("config", NONFINITE)
@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_inputs_propagate(backend, config):
    """NaN and infinities land where the models put them. Token 0: a NaN slot, so a NaN prefix
    element and a NaN output row. Token 1: an infinite slot, so an infinite prefix element and,
    with blocks, a NaN row (its AttnRes logit is inf * rstd(inf) = inf * 0); without blocks, +inf
    and -inf slots, so a NaN prefix element. Token 2 (with blocks): an infinite block, so a NaN
    row. The last token is clean and stays finite. (An infinite prefix element with NB = 0:
    test_infinite_prefix_without_blocks.)"""
    need(backend)
    arrays = {k: v.copy() for k, v in inputs(config).items()}
    arrays["mailbox"][3, 0, 5] = np.nan
    arrays["mailbox"][7, 1, 9] = np.inf
    if config.NB:
        arrays["blocks"][2, 0, 3] = -np.inf
    else:
        arrays["mailbox"][2, 1, 9] = -np.inf
    result = run(backend, arrays, **EPS, **config.options())
    prefix, output = (np.asarray(x, np.float32) for x in result[:2])
    assert np.isnan(prefix[0, 5]), "a NaN slot did not make its prefix element NaN"
    assert prefix[1, 9] == np.inf if config.NB else np.isnan(prefix[1, 9]), "the infinite slots, prefix[1, 9]"
    assert np.isnan(output[:-1]).all() and np.isfinite(output[-1]).all(), "NaN rows but the last token's"
    testing.check_result(config, arrays, result, **EPS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_infinite_prefix_without_blocks(backend):
    """NB = 0: the prefix is the only source, with weight exactly 1 (docs/spec.md), so an
    infinite prefix element makes output = p * rstd(p.p) = p * 0: NaN at that element (inf * 0),
    zero elsewhere in its row; the other tokens are untouched."""
    need(backend)
    config = Config(2, 2, 0, groups=1)
    arrays = {k: v.copy() for k, v in inputs(config).items()}
    arrays["mailbox"][0, 0, 9] = np.inf
    result = run(backend, arrays, **EPS, **config.options())
    prefix, output = (np.asarray(x, np.float32) for x in result[:2])
    assert prefix[0, 9] == np.inf
    assert np.isnan(output[0, 9]) and (np.delete(output[0], 9) == 0).all(), "row 0: NaN at 9, zeros elsewhere"
    assert np.isfinite(output[1]).all()


# ---- bad input


# (id, replaced arrays, replaced options, error, text the message must contain; the first starts it)
BAD = [
    ("mailbox-float32", dict(mailbox=np.float32), {}, TypeError, ["mailbox: expected", "bfloat16", "float32"]),
    ("prefix-float32", dict(prefix=np.float32), {}, TypeError, ["prefix: expected", "bfloat16", "float32"]),
    (
        "prefix-T",
        dict(prefix=(4, configs.HIDDEN)),
        {},
        ValueError,
        ["prefix: expected shape", "(3, 7168)", "(4, 7168)"],
    ),
    ("blocks-NB9", dict(blocks=(3, 9, configs.HIDDEN)), {}, ValueError, ["blocks: expected", "NB", "8", "9"]),
    ("groups-5", {}, dict(groups=5), ValueError, ["groups: expected 1 <= groups <= 4, got 5"]),
    ("xmoe-negative", {}, dict(xmoe_replicas=-1), ValueError, ["xmoe_replicas: expected xmoe_replicas >= 0, got -1"]),
    ("has_delta-int", {}, dict(has_delta=1), TypeError, ["has_delta: expected a bool, got int"]),
    ("eps-nan", {}, dict(eps=float("nan")), ValueError, ["eps: expected a finite epsilon >= 0, got nan"]),
    ("stream_capture-str", {}, dict(stream_capture="yes"), TypeError, ["stream_capture: expected a bool, got str"]),
]


@pytest.mark.parametrize(("change", "options", "error", "texts"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_raises_the_named_error(backend, change, options, error, texts):
    """One broken argument: the error names it (the message starts with it), says what was
    expected and what was given, before anything runs; the caller's arrays are unchanged."""
    need(backend)
    if backend == "torch" and "stream_capture" in options:
        pytest.skip("stream_capture: how a JAX call enters XLA's graph; the PyTorch model has no such option")
    arrays = {k: v.copy() for k, v in inputs(PRODUCTION).items()}
    for name, how in change.items():
        arrays[name] = arrays[name].astype(how) if not isinstance(how, tuple) else np.zeros(how, bf16)
    before = {k: (v.dtype, v.tobytes()) for k, v in arrays.items()}
    with pytest.raises(error) as info:
        call(backend, arrays, **{**EPS, **PRODUCTION.options(), **options})
    message = str(info.value)
    assert message.startswith(texts[0]), f"message does not start with {texts[0]!r}: {message!r}"
    missing = [t for t in texts[1:] if t not in message]
    assert not missing, f"message lacks {missing}: {message!r}"
    assert {k: (v.dtype, v.tobytes()) for k, v in arrays.items()} == before, "the call modified the caller's arrays"


# ---- JAX transformations: jit, lax.scan, donation, vmap


def device_args(arrays):
    return [jnp.asarray(arrays[k]) for k in ARGS]


def jax_consumer(backend: str, config: Config):
    return functools.partial(oproj_jax.consumer, backend=backend, **EPS, **config.options())


def step_inputs(config: Config, steps: int) -> list[dict]:
    """`steps` decode steps of one config: fresh mailboxes, the rest of step 0's inputs."""
    return [dict(inputs(config), mailbox=configs.make_inputs(config, SEED + k)["mailbox"]) for k in range(steps)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_jit(backend):
    need(backend, "jax.jit")
    arrays = inputs(PRODUCTION)
    need_support(backend, arrays, PRODUCTION.options())
    result = jax.jit(jax_consumer(backend, PRODUCTION))(*device_args(arrays))
    testing.check_result(PRODUCTION, arrays, result, **EPS)


@pytest.mark.parametrize("rank", (0, 9))
@pytest.mark.parametrize("backend", JAX_BACKENDS)
def test_own_partial_stands_for_its_slot(backend, rank):
    """partial= read in place of slot `rank`, under jax.jit: that slot of the mailbox holds NaN
    (never read), the partial holds what the oracle's mailbox has there; prefix bit for bit,
    output by the oracle, the caller's arrays untouched."""
    need(backend, "jax.jit")
    arrays = inputs(PRODUCTION)
    need_support(backend, arrays, PRODUCTION.options())
    poisoned = arrays["mailbox"].copy()
    poisoned[rank] = np.nan
    mailbox, *rest = device_args(dict(arrays, mailbox=poisoned))
    partial = jnp.asarray(arrays["mailbox"][rank])
    consume = jax_consumer(backend, PRODUCTION)
    result = jax.jit(lambda m, p, *rest: consume(m, *rest, partial=p, rank=rank))(mailbox, partial, *rest)
    testing.check_result(PRODUCTION, arrays, result, **EPS)
    testing.assert_same_bits(mailbox, poisoned, "the caller's mailbox")
    told = oproj_jax.explain(mailbox, *rest, partial=partial, rank=rank, backend=backend, **EPS, **PRODUCTION.options())
    how = (
        "read in place" if backend in ("cute", "triton") else "written into a copy of the mailbox first"
    )  # cute: prebuilt
    assert f"partial: stands for mailbox slot {rank}, {how}" in told, told


@pytest.mark.parametrize("backend", JAX_BACKENDS)
def test_stream_capture_computes_the_same_bits(backend):
    """stream_capture=True under jax.jit (a kernel's call traced into XLA's graph instead of a
    kernel node; ignored where there is no node): the oracle's result, and bit for bit the
    default launch's."""
    need(backend, "jax.jit")
    arrays = inputs(PRODUCTION)
    need_support(backend, arrays, PRODUCTION.options())
    consume = jax_consumer(backend, PRODUCTION)
    node, captured = (
        jax.jit(functools.partial(consume, stream_capture=capture))(*device_args(arrays)) for capture in (False, True)
    )
    testing.check_result(PRODUCTION, arrays, captured, **EPS)
    for what, got, want in zip(("prefix", "output", "xmoe"), captured, node):
        if want is not None:
            testing.assert_same_bits(got, want, what)


def three_steps(backend: str, jax_transform: str):
    """Three decode steps of PRODUCTION (fresh mailboxes): (steps, consume, the arrays after the
    mailbox and prefix on the device), skipped where `backend` cannot run them."""
    need(backend, jax_transform)
    steps = step_inputs(PRODUCTION, 3)
    need_support(backend, steps[0], PRODUCTION.options())
    return steps, jax_consumer(backend, PRODUCTION), device_args(steps[0])[2:]


def check_steps(steps: list[dict], results, what: str):
    """Each step's (prefix, output) against the oracle from the previous step's prefix; returns
    the last prefix."""
    prefix = steps[0]["prefix"]
    for k, (arrays, (new_prefix, output)) in enumerate(zip(steps, results)):
        testing.check_result(
            PRODUCTION, dict(arrays, prefix=prefix), (new_prefix, output, None), **EPS, what=f"{what} {k}"
        )
        prefix = np.asarray(new_prefix)
    return prefix


@pytest.mark.parametrize("backend", BACKENDS)
def test_unrolled_calls_in_one_jit_keep_every_rounding_point(backend):
    """Three calls unrolled in one jit, each taking the previous call's prefix: every call
    against the oracle from the previous prefix. XLA may fuse across the calls; a rounding point
    written as an f32 -> bf16 -> f32 pair of converts is then dropped on a GPU (excess
    precision), which moves prefix bits (reference.to_bf16)."""
    steps, consume, rest = three_steps(backend, "jax.jit")

    @jax.jit
    def decode(prefix, mailboxes):
        results = []
        for mailbox in mailboxes:
            out = consume(mailbox, prefix, *rest)
            prefix = out.prefix
            results.append((out.prefix, out.output))
        return results

    check_steps(steps, decode(jnp.asarray(steps[0]["prefix"]), [jnp.asarray(s["mailbox"]) for s in steps]), "call")


@pytest.mark.parametrize("backend", BACKENDS)
def test_lax_scan_carries_the_prefix(backend):
    """Three decode steps in one jitted lax.scan, the prefix carried: every step against the
    oracle, from the backend's own previous prefix."""
    steps, consume, rest = three_steps(backend, "lax.scan")

    @jax.jit
    def decode(prefix, mailboxes):
        def step(prefix, mailbox):
            out = consume(mailbox, prefix, *rest)
            return out.prefix, (out.prefix, out.output)

        return jax.lax.scan(step, prefix, mailboxes)

    mailboxes = jnp.stack([jnp.asarray(s["mailbox"]) for s in steps])
    final, (prefixes, outputs) = decode(jnp.asarray(steps[0]["prefix"]), mailboxes)
    prefix = check_steps(steps, [(prefixes[k], outputs[k]) for k in range(len(steps))], "scan step")
    testing.assert_same_bits(final, prefix, "the carried prefix")


@pytest.mark.parametrize("backend", BACKENDS)
def test_donated_prefix_over_two_steps(backend):
    """Two decode steps under jax.jit, the prefix buffer donated and fed back: each step against
    the oracle, the donated buffer consumed, the caller's numpy untouched."""
    need(backend, "buffer donation")
    config = PRODUCTION
    arrays = inputs(config)
    need_support(backend, arrays, config.options())
    before = {k: testing.bits(v).copy() for k, v in arrays.items()}
    step = jax.jit(jax_consumer(backend, config), donate_argnums=1)
    mailbox, prefix, *rest = device_args(arrays)
    want_inputs = dict(arrays)
    for k in range(2):
        donated = prefix
        got = step(mailbox, donated, *rest)
        assert donated.is_deleted(), "the prefix was not donated"
        # Read a copy: a numpy view of got.prefix would pin its buffer and block the next donation.
        got_prefix = np.asarray(jnp.copy(got.prefix))
        testing.check_result(config, want_inputs, (got_prefix, got.output, got.xmoe), **EPS, what=f"step {k}")
        want_inputs = dict(want_inputs, prefix=got_prefix)
        prefix = got.prefix
    for k, v in arrays.items():
        testing.assert_same_bits(v, before[k].view(bf16), f"caller's {k}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_over_mailbox_and_prefix(backend):
    """jax.vmap over a batch of two (mailbox, prefix) pairs, the weights and blocks shared:
    each element against the oracle."""
    need(backend, "jax.vmap")
    config = PRODUCTION
    batch = [
        dict(s, prefix=configs.make_inputs(config, SEED + 10 + k)["prefix"])
        for k, s in enumerate(step_inputs(config, 2))
    ]
    need_support(backend, batch[0], config.options())
    stacked = [jnp.stack([jnp.asarray(b[k]) for b in batch]) for k in ("mailbox", "prefix")]
    result = jax.vmap(jax_consumer(backend, config), in_axes=(0, 0, None, None, None, None))(
        *stacked, *device_args(batch[0])[2:]
    )
    assert result.prefix.shape == (2, config.T, config.H)
    for k, arrays in enumerate(batch):
        xmoe = None if result.xmoe is None else result.xmoe[k]
        testing.check_result(config, arrays, (result.prefix[k], result.output[k], xmoe), **EPS, what=f"element {k}")
