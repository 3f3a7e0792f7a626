"""The shard_map layouts on a 16-device CPU mesh (conftest): tp_consumer and tp_oproj_consumer.

The oracle is the unsharded reference (one device, the whole mailbox) for the prefix bits and
testing.output_f64 for the output. Each replicated result is checked shard by shard: all 16
ranks must hold the same bits (oneshot, twoshot). Most cases use H = 256 (a multiple of 16, so
twoshot's column slices are 16 wide) to keep compiles short; the production H = 7168 runs too.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from oproj_jax import api, configs, reference, testing
from oproj_jax.sharded import tp_consumer, tp_oproj_consumer

TP = 16
SMALL_H = 256
WEIGHTS = ("norm", "query", "out_norm")

# psum's prefix vs the reference's: XLA's f32 order may move bf16(attn) by one rounding (at most
# 2^-8 relative, only near ties) before the prefix rounding; 2^-8 in relative L2 bounds that.
PSUM_PREFIX_REL_L2_TOL = 2.0**-8


@pytest.fixture(scope="module")
def mesh():
    devices = jax.devices("cpu")
    assert len(devices) >= TP, "conftest should have made 16 CPU devices"
    return Mesh(np.array(devices[:TP]), ("tp",))


def _args(x):  # the consumer's positional arguments after the mailbox
    return x["prefix"], x["blocks"], x["norm"], x["query"], x["out_norm"]


def _reference(mailbox, x, cfg, groups):
    return api.consumer(mailbox, *_args(x), backend="reference", **dict(cfg.options(), groups=groups))


def _replica_bits(array, ranks=TP) -> np.ndarray:
    """The bits every rank holds; fails unless all `ranks` shards are complete and identical."""
    shards = array.addressable_shards
    assert len(shards) == ranks
    first = testing.bits(shards[0].data)
    assert first.shape == array.shape, "the output should be replicated, not sharded"
    for shard in shards[1:]:
        np.testing.assert_array_equal(testing.bits(shard.data), first, err_msg=f"rank {shard.device} differs")
    return first


def _check_output(result, x, opts):
    want = testing.output_f64(np.asarray(result.prefix), x["blocks"], *(x[k] for k in WEIGHTS), eps=1e-6, out_eps=1e-6)
    assert not np.isnan(np.asarray(result.output, np.float64)).any()
    assert testing.rel_l2(result.output, want) < testing.OUTPUT_REL_L2_TOL
    if opts["xmoe_replicas"]:
        got = np.asarray(result.xmoe)
        assert got.shape == (opts["xmoe_replicas"], *result.output.shape)
        want = reference.without_negative_zero(result.output)  # every replica: output, -0.0 as +0.0
        for replica in got:
            np.testing.assert_array_equal(testing.bits(replica), testing.bits(want))


def _check_bit_exact(result, want):
    """Replicated and identical on every rank; the prefix has the unsharded reference's bits.

    The output is held to identical bits across ranks, not to the unsharded run's bits: the
    same jnp compiled into a 16-device program may order its f32 row reductions differently
    (seen: a few elements one bf16 ulp apart at H = 7168); _check_output bounds it instead."""
    np.testing.assert_array_equal(_replica_bits(result.prefix), testing.bits(want.prefix))
    _replica_bits(result.output)
    if want.xmoe is not None:
        _replica_bits(result.xmoe)


CASES = [  # (mode, config): oneshot honours `groups`; twoshot sums in rank order (groups=1)
    ("oneshot", configs.Config(TP, 3, 8, groups=4)),
    ("oneshot", configs.Config(TP, 2, 1, groups=3, has_delta=False, xmoe_replicas=2, H=SMALL_H)),
    ("twoshot", configs.Config(TP, 3, 8, groups=1, twoshot=True)),
    ("twoshot", configs.Config(TP, 2, 0, groups=1, has_delta=False, xmoe_replicas=1, twoshot=True, H=SMALL_H)),
]


@pytest.mark.parametrize("mode,cfg", CASES, ids=[f"{m}-{c.name}-H{c.H}" for m, c in CASES])
def test_tp_consumer_bit_exact(mesh, mode, cfg):
    x = configs.make_inputs(cfg, seed=1)
    got = tp_consumer(x["mailbox"], *_args(x), mesh=mesh, mode=mode, backend="reference", **cfg.options())
    _check_bit_exact(got, _reference(x["mailbox"], x, cfg, cfg.groups))
    _check_output(got, x, cfg.options())


@pytest.mark.parametrize("mode", ["oneshot", "twoshot", "psum"])
@pytest.mark.parametrize("fused", [False, True], ids=["partials", "fused"])
def test_tp8_every_mode(mode, fused):
    """TP8 (8 CPU devices, the width of one 8-GPU host): every XLA-collective mode of both
    entry points, against the unsharded reference with the mode's summation order."""
    ranks = 8
    mesh8 = Mesh(np.array(jax.devices("cpu")[:ranks]), ("tp",))
    groups = 4 if mode == "oneshot" else 1
    cfg = configs.Config(ranks, 2, 8, groups=groups, xmoe_replicas=1, H=SMALL_H)
    x = configs.make_inputs(cfg, seed=8)
    opts = cfg.options()
    if fused:  # the rank's heads: attn [T, K] sharded on K, w_o [K, H] on its rows
        K = 2 * ranks
        rng = np.random.default_rng(8)
        attn = rng.standard_normal((cfg.T, K)).astype(jnp.bfloat16)
        w_o = (rng.standard_normal((K, cfg.H)) / 4).astype(jnp.bfloat16)
        got = tp_oproj_consumer(attn, w_o, *_args(x), mesh=mesh8, mode=mode, backend="reference", **opts)
        per_rank = [
            np.asarray(
                jnp.dot(attn[:, r * 2 : r * 2 + 2], w_o[r * 2 : r * 2 + 2], preferred_element_type=jnp.float32).astype(
                    jnp.bfloat16
                )
            )
            for r in range(ranks)
        ]
        mailbox = np.stack(per_rank)
    else:
        mailbox = x["mailbox"]
        got = tp_consumer(mailbox, *_args(x), mesh=mesh8, mode=mode, backend="reference", **opts)
    want = _reference(mailbox, x, cfg, groups)
    if mode == "psum":  # XLA's f32 order: within rounding of the reference
        assert testing.rel_l2(got.prefix, want.prefix) < PSUM_PREFIX_REL_L2_TOL
    else:
        np.testing.assert_array_equal(_replica_bits(got.prefix, ranks), testing.bits(want.prefix))
    _replica_bits(got.output, ranks)
    _check_output(got, x, opts)


def test_oneshot_twoshot_reference_agree_with_groups1(mesh):
    """docs/spec.md, "Twoshot": twoshot and oneshot with groups=1 give the prefix bits of the
    plain rank-order sum."""
    cfg = configs.Config(TP, 4, 2, groups=1)
    x = configs.make_inputs(cfg, seed=2)
    want = testing.bits(_reference(x["mailbox"], x, cfg, 1).prefix)
    gather_row = reference.twoshot_gather(x["mailbox"])  # [1, T, H]: the twoshot gather row
    assert np.array_equal(testing.bits(_reference(gather_row, x, cfg, 1).prefix), want)
    for mode in ("oneshot", "twoshot"):
        got = tp_consumer(x["mailbox"], *_args(x), mesh=mesh, mode=mode, **cfg.options())
        np.testing.assert_array_equal(_replica_bits(got.prefix), want, err_msg=mode)
    # groups changes the order, and the bits: the check above can tell orders apart.
    assert not np.array_equal(testing.bits(_reference(x["mailbox"], x, cfg, 4).prefix), want)


@pytest.mark.parametrize("H", [SMALL_H, configs.HIDDEN])
def test_psum_within_tolerance(mesh, H):
    cfg = configs.Config(TP, 3, 8, groups=1, xmoe_replicas=1, H=H)
    x = configs.make_inputs(cfg, seed=3)
    got = tp_consumer(x["mailbox"], *_args(x), mesh=mesh, mode="psum", **cfg.options())
    want = _reference(x["mailbox"], x, cfg, 1)
    assert testing.rel_l2(got.prefix, want.prefix) < PSUM_PREFIX_REL_L2_TOL
    _check_output(got, x, cfg.options())


def test_named_axis_of_a_2d_mesh():
    """R follows the named axis only; the other mesh axis replicates."""
    devices = np.array(jax.devices("cpu")[:TP]).reshape(2, 8)
    mesh2 = Mesh(devices, ("dp", "model"))
    cfg = configs.Config(8, 2, 1, groups=2, H=SMALL_H)
    x = configs.make_inputs(cfg, seed=4)
    got = tp_consumer(x["mailbox"], *_args(x), mesh=mesh2, axis_name="model", backend="reference", **cfg.options())
    _check_bit_exact(got, _reference(x["mailbox"], x, cfg, 2))


@pytest.mark.parametrize("mode", ["oneshot", "twoshot"])
def test_a_kernel_backend_runs_sharded(mode):
    """The layer is backend-agnostic: the Pallas kernel (Mosaic GPU interpret mode on CPU) runs
    on each rank's view inside the shard_map (replication check on). One rank only: the
    interpreter keeps one global shared-memory model and, after each kernel, asserts that no
    barrier of ANY device is still allocated (jax 0.11.2 `assert_no_barriers_allocated`), so
    kernels interpreted concurrently on several devices fail at random ("Barrier remains
    allocated"); with 16 devices it also did not finish within 300 s here."""
    if jax.default_backend() != "cpu":
        pytest.skip(
            "the Pallas backend picks interpret mode from JAX's default backend, not the mesh's: "
            f"a CPU mesh under default backend {jax.default_backend()!r} would compile for the GPU"
        )
    ranks = 1
    mesh2 = Mesh(np.array(jax.devices("cpu")[:ranks]), ("tp",))
    cfg = configs.Config(ranks, 1, 1, groups=1, H=SMALL_H)
    x = configs.make_inputs(cfg, seed=8)
    got = tp_consumer(x["mailbox"], *_args(x), mesh=mesh2, mode=mode, backend="pallas", **cfg.options())
    want = _reference(x["mailbox"], x, cfg, 1)
    np.testing.assert_array_equal(_replica_bits(got.prefix, ranks), testing.bits(want.prefix))
    _replica_bits(got.output, ranks)
    _check_output(got, x, cfg.options())


def test_stream_capture_reaches_every_ranks_consumer(mesh, monkeypatch):
    """stream_capture=True is handed to api.consumer on each rank's view (the kernels' launch
    choice; the reference has no launch to change): the same bits as the reference."""
    seen, consumer = [], api.consumer
    # the layer passes the keyword on every call (the reference check below calls without it)
    monkeypatch.setattr(api, "consumer", lambda *a, **k: seen.append(k.get("stream_capture")) or consumer(*a, **k))
    cfg = configs.Config(TP, 1, 1, groups=2, H=SMALL_H)
    x = configs.make_inputs(cfg, seed=5)
    got = tp_consumer(x["mailbox"], *_args(x), mesh=mesh, backend="reference", stream_capture=True, **cfg.options())
    assert seen[0] is True and set(seen) <= {True, None}
    _check_bit_exact(got, _reference(x["mailbox"], x, cfg, 2))


# ---- the fused producer + consumer ----------------------------------------------------------

K_PER_RANK = 16  # heads*head_dim / R; small so that every rank's f32 dot is exact (below)


def _exact_oproj_inputs(cfg, seed):
    """attn [T, K] and w_o [K, H] whose per-rank products are exact in f32, so the expected
    partials come from numpy in f64 (independent of XLA's dot order), with one bf16 rounding.

    attn = n * 2^-4 and w_o = m * 2^e with |n|, |m| <= 15 (exact in bf16). e = a rank's exponent
    (-24..8) + a row's (-4..4): within a rank the 16 terms span < 2^24, so its sum is exact in
    f32, while the ranks' partials span ~2^40, so the f32 rank sum rounds. These few elements
    rarely show the rank order in the bf16 prefix (the tp_consumer cases above do, on
    make_inputs' data); here the bits check the producer's layout: which heads, which rows. Rank 0's first
    token is all zero, so it publishes zeros (from -0.0 products where w_o < 0)."""
    rng = np.random.default_rng(seed)
    K = K_PER_RANK * cfg.R
    attn = rng.integers(-15, 16, size=(cfg.T, K)) * 2.0**-4
    attn[0, :K_PER_RANK] = -0.0
    rank_exp = rng.integers(-24, 9, size=(cfg.R, 1, 1))
    row_exp = rank_exp + rng.integers(-4, 5, size=(cfg.R, K_PER_RANK, 1))
    w_o = (rng.integers(-15, 16, size=(cfg.R, K_PER_RANK, cfg.H)) * np.exp2(row_exp)).reshape(K, cfg.H)
    per_rank = np.einsum("trk,rkh->rth", attn.reshape(cfg.T, cfg.R, K_PER_RANK), w_o.reshape(cfg.R, K_PER_RANK, cfg.H))
    mailbox = per_rank.astype(ml_dtypes.bfloat16)  # [R, T, H]: exact sums, one rounding
    bf = lambda a: a.astype(ml_dtypes.bfloat16)
    return bf(attn), bf(w_o), mailbox


FUSED = [
    ("oneshot", configs.Config(TP, 2, 8, groups=4, xmoe_replicas=1, H=SMALL_H)),
    ("twoshot", configs.Config(TP, 2, 8, groups=1, H=SMALL_H)),
    ("oneshot", configs.Config(TP, 1, 2, groups=1, has_delta=False)),
]


@pytest.mark.parametrize("mode,cfg", FUSED, ids=[f"{m}-{c.name}-H{c.H}" for m, c in FUSED])
def test_tp_oproj_consumer_bit_exact(mesh, mode, cfg):
    x = configs.make_inputs(cfg, seed=5)
    attn, w_o, mailbox = _exact_oproj_inputs(cfg, seed=5)
    got = tp_oproj_consumer(attn, w_o, *_args(x), mesh=mesh, mode=mode, backend="reference", **cfg.options())
    _check_bit_exact(got, _reference(mailbox, x, cfg, cfg.groups))
    _check_output(got, x, cfg.options())


def test_tp_oproj_consumer_psum(mesh):
    cfg = configs.Config(TP, 2, 8, groups=1, H=SMALL_H)
    x = configs.make_inputs(cfg, seed=6)
    attn, w_o, mailbox = _exact_oproj_inputs(cfg, seed=6)
    got = tp_oproj_consumer(attn, w_o, *_args(x), mesh=mesh, mode="psum", **cfg.options())
    assert testing.rel_l2(got.prefix, _reference(mailbox, x, cfg, 1).prefix) < PSUM_PREFIX_REL_L2_TOL
    _check_output(got, x, cfg.options())


# ---- under jit, in loops, with the prefix donated --------------------------------------------

STEPS = 3


def test_tp_consumer_in_scan_with_donated_prefix(mesh):
    cfg = configs.Config(TP, 2, 2, groups=4, H=SMALL_H)
    steps = [configs.make_inputs(cfg, seed=10 + s) for s in range(STEPS)]
    x = steps[0]
    partials = np.stack([s["mailbox"] for s in steps])  # [S, R, T, H]
    weights = tuple(jnp.asarray(x[k]) for k in ("blocks", *WEIGHTS))

    @functools.partial(jax.jit, donate_argnums=0)
    def run(prefix, partials):  # [T, H] replicated, [S, R, T, H] sharded on R
        def step(prefix, partial):
            result = tp_consumer(partial, prefix, *weights, mesh=mesh, mode="oneshot", **cfg.options())
            return result.prefix, result.output

        return jax.lax.scan(step, prefix, partials)

    want_prefix, want_outputs = x["prefix"], []
    for s in range(STEPS):
        want_prefix = _reference(steps[s]["mailbox"], dict(x, prefix=want_prefix), cfg, cfg.groups).prefix
        want_outputs.append(
            testing.output_f64(want_prefix, x["blocks"], *(x[k] for k in WEIGHTS), eps=1e-6, out_eps=1e-6)
        )

    prefix = jax.device_put(x["prefix"], NamedSharding(mesh, P()))
    sharded_partials = jax.device_put(partials, NamedSharding(mesh, P(None, "tp")))
    final, outputs = run(prefix, sharded_partials)
    assert prefix.is_deleted(), "the prefix buffer should have been donated"
    np.testing.assert_array_equal(_replica_bits(final), testing.bits(want_prefix))
    for got, want in zip(np.asarray(outputs), want_outputs):
        assert testing.rel_l2(got, want) < testing.OUTPUT_REL_L2_TOL


def test_tp_oproj_consumer_in_fori_loop_with_donated_prefix(mesh):
    """twoshot inside fori_loop: the prefix accumulates STEPS times the same reduced partials."""
    cfg = configs.Config(TP, 2, 1, groups=1, H=SMALL_H)
    x = configs.make_inputs(cfg, seed=20)
    attn, w_o, mailbox = _exact_oproj_inputs(cfg, seed=20)
    weights = tuple(jnp.asarray(x[k]) for k in ("blocks", *WEIGHTS))

    def run(prefix, attn, w_o):
        def step(_, carry):
            return tp_oproj_consumer(attn, w_o, carry, *weights, mesh=mesh, mode="twoshot", **cfg.options()).prefix

        return jax.lax.fori_loop(0, STEPS, step, prefix)

    want = x["prefix"]
    for _ in range(STEPS):
        want = _reference(mailbox, dict(x, prefix=want), cfg, 1).prefix
    prefix = jax.device_put(x["prefix"], NamedSharding(mesh, P()))
    final = jax.jit(run, donate_argnums=0)(prefix, attn, w_o)
    assert prefix.is_deleted(), "the prefix buffer should have been donated"
    np.testing.assert_array_equal(_replica_bits(final), testing.bits(want))


# ---- bad input: clear errors, raised before anything runs ------------------------------------


def _small(R=TP, H=SMALL_H):
    return configs.make_inputs(configs.Config(R, 1, 1, H=H), seed=0)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(R=8), r"partial: expected R = 16 \(the size of the mesh axis\), got R = 8"),
        (dict(mode="twoshot", H=200), r"partial: twoshot splits H .*H % R == 0, got H=200, R=16"),
        (dict(mode="allreduce"), r"mode: expected one of \('oneshot', 'twoshot', 'psum', 'peer'\), got 'allreduce'"),
        (dict(axis_name="dp"), r"axis_name: expected one of the mesh's axes \('tp',\), got 'dp'"),
        (dict(groups=5), r"groups: expected 1 <= groups <= 4, got 5"),
        (dict(backend="cuda"), r"backend: expected one of"),
        (dict(backend="cute"), r"backend='cute' cannot run here: .*'cpu'"),
        (dict(mode="peer", stream_capture=True), r"stream_capture: mode='peer' runs its own FFI call"),
    ],
)
def test_tp_consumer_bad_input(mesh, change, match):
    change = dict(change)
    x = _small(R=change.pop("R", TP), H=change.pop("H", SMALL_H))
    with pytest.raises(ValueError, match=match):
        tp_consumer(x["mailbox"], *_args(x), mesh=mesh, **change)


def test_tp_consumer_bad_types(mesh):
    x = _small()
    with pytest.raises(TypeError, match=r"mailbox: expected dtype bfloat16"):
        tp_consumer(x["mailbox"].astype(np.float32), *_args(x), mesh=mesh)
    with pytest.raises(TypeError, match=r"unexpected option\(s\) \['twoshot'\]"):
        tp_consumer(x["mailbox"], *_args(x), mesh=mesh, twoshot=True)
    with pytest.raises(TypeError, match=r"mesh: expected a jax.sharding.Mesh"):
        tp_consumer(x["mailbox"], *_args(x), mesh=jax.devices())
    with pytest.raises(TypeError, match=r"stream_capture: expected a bool, got str"):
        tp_consumer(x["mailbox"], *_args(x), mesh=mesh, stream_capture="yes")


def test_tp_oproj_consumer_bad_input(mesh):
    x = _small()
    attn = np.zeros((1, 8 * TP), ml_dtypes.bfloat16)
    w_o = np.zeros((8 * TP, SMALL_H), ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match=r"w_o: expected shape \[heads\*head_dim, H\] with heads\*head_dim = 128"):
        tp_oproj_consumer(attn, w_o[:64], *_args(x), mesh=mesh)
    with pytest.raises(ValueError, match=r"attn: heads\*head_dim is split over 16 ranks; .* multiple of 16, got 120"):
        tp_oproj_consumer(attn[:, :120], w_o[:120], *_args(x), mesh=mesh)
    with pytest.raises(ValueError, match=r"prefix: expected shape \[T, H\] = \(1, 128\)"):
        tp_oproj_consumer(attn, w_o[:, :128], *_args(x), mesh=mesh)
    with pytest.raises(ValueError, match=r"w_o: twoshot splits H .*got H=200, R=16"):
        y = _small(H=200)
        tp_oproj_consumer(attn, np.zeros((8 * TP, 200), ml_dtypes.bfloat16), *_args(y), mesh=mesh, mode="twoshot")
