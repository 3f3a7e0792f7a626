"""mode="peer" on real GPUs (>= 2 CUDA GPUs in this process; skipped otherwise).

Covers what the CPU tests cannot: the publish kernel (wait for empty, then store) and the
consumer cubin running the protocol across GPUs through the FFI handler (allocation, peer
access, the single mailbox per device, the record stage inside XLA command buffers), the bits,
the bounded waits (a rank that never publishes, a peer that never re-arms), and back-to-back
steps under jit (a command buffer with graph updates, a scan and an unrolled chain) with fresh
random data each step. The command-buffer and re-arm tests come first.

Bits: the prefix of mode="peer" must equal mode="oneshot"'s (backend cute, and the reference
backend) with the same `groups`, bit for bit, on every rank; the output is identical across
ranks and within the output tolerance of oneshot's.
"""

import functools
import json
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import gpus_or_skip

from oproj_jax import configs, testing
from oproj_jax.cute import peer
from oproj_jax.sharded import tp_consumer, tp_oproj_consumer

R = 2


@pytest.fixture(scope="module")
def mesh():
    gpus = gpus_or_skip(R)
    reason = peer.unavailable_reason(gpus[0].platform)
    if reason:
        pytest.fail(f"GPUs present but mode='peer' cannot run: {reason}")
    return Mesh(np.array(gpus[:R]), ("tp",))


def _args(x):
    return x["mailbox"], x["prefix"], x["blocks"], x["norm"], x["query"], x["out_norm"]


def _replicas(array) -> np.ndarray:
    """The bits every rank holds (asserting they agree)."""
    shards = array.addressable_shards
    first = testing.bits(shards[0].data)
    for shard in shards[1:]:
        np.testing.assert_array_equal(testing.bits(shard.data), first, err_msg=f"{shard.device} differs")
    return first


# ---- inside XLA command buffers (CUDA graphs): the record stage ----------------------------------

_COMMAND_BUFFER_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from oproj_jax import configs
    from oproj_jax.cute import peer
    from oproj_jax.sharded import tp_consumer
    R, STEPS = 2, 6
    mesh = Mesh(np.array(jax.devices()[:R]), ("tp",))
    cfg = configs.Config(R, 8, 8, groups=4)  # has_delta: the prefix threads through the steps
    def make(mode, backend):
        def chain(partials, prefix, blocks, norm, query, out_norm):
            prefixes, outputs, statuses = [], [], []
            for p in partials:
                res = tp_consumer(p, prefix, blocks, norm, query, out_norm, mesh=mesh, mode=mode, backend=backend,
                                  **cfg.options())
                prefix = res.prefix
                prefixes.append(res.prefix)
                outputs.append(res.output)
                statuses.append(res.status if mode == "peer" else jax.numpy.zeros((R,), np.int32))
            return prefixes, outputs, jax.numpy.stack(statuses)
        chain.__name__ = chain.__qualname__ = f"{mode}_chain"
        return jax.jit(chain)
    shard, rep = NamedSharding(mesh, P("tp")), NamedSharding(mesh, P())
    names = ("prefix", "blocks", "norm", "query", "out_norm")
    def inputs(seed):  # fresh partials per step; every execution gets its own buffers
        xs = [configs.make_inputs(cfg, seed + k) for k in range(STEPS)]
        return ([jax.device_put(x["mailbox"], shard) for x in xs], *(jax.device_put(xs[0][k], rep) for k in names))
    sets = [inputs(100), inputs(200)]
    peer_chain, oneshot_chain = make("peer", "cute"), make("oneshot", "cute")
    bits = lambda a: np.asarray(a).view(np.uint16)
    def replicas(a):  # every rank's bits (must agree)
        shards = [bits(s.data) for s in a.addressable_shards]
        return shards[0], all(np.array_equal(s, shards[0]) for s in shards)
    want = [jax.tree.map(bits, oneshot_chain(*x)[:2]) for x in sets]
    report = dict(executions=0, exact=True, replicated=True, status=0)
    for i in range(6):  # alternate the two input sets: new addresses every execution (graph updates)
        prefixes, outputs, status = peer_chain(*sets[i % 2])
        report["status"] = max(report["status"], int(np.asarray(status).max()))
        for k in range(STEPS):
            got_p, same_p = replicas(prefixes[k])
            got_o, same_o = replicas(outputs[k])
            report["replicated"] &= same_p and same_o
            report["exact"] &= bool(np.array_equal(got_p, want[i % 2][0][k]))
        report["executions"] += 1
    print(json.dumps(report))
""")


def test_xla_command_buffer_chain_stays_exact(mesh, tmp_path):
    """A jitted chain of 6 peer steps inside XLA command buffers (--xla_gpu_graph_min_graph_size=1):
    the thunk sequence shows every peer call inside a command buffer (recorded by its record
    stage), and six executions alternating two input sets (new buffer addresses each time: the
    graph nodes are updated, not re-recorded) give oneshot's prefix bits on both ranks."""
    dump = tmp_path / "dump"
    env = testing.command_buffer_env(dump)
    done = subprocess.run(
        [sys.executable, "-c", _COMMAND_BUFFER_SCRIPT], env=env, capture_output=True, text=True, timeout=150
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"executions": 6, "exact": True, "replicated": True, "status": 0}, report
    thunks = testing.thunk_sequence(dump, "peer_chain")
    assert testing.custom_calls_in_command_buffers(thunks) == 6, thunks[:3000]


def test_a_rank_alone_fails_then_is_refused(mesh):
    """Rank 0 alone (a plain jit on its device, rank 1 never runs): its first step times out on
    rank 1's missing slot (status 1) and sets the fail-stop word; its second step is refused at
    once (status 8 | 1, all NaN, nothing published). reset() recovers the group."""
    cfg = configs.Config(R, 3, 0, groups=1, has_delta=False)
    x = configs.make_inputs(cfg, seed=11)
    table = peer.group_table(mesh, "tp")
    device = mesh.devices.flat[0]
    step = jax.jit(
        functools.partial(
            peer.consume,
            table=table,
            eps=1e-6,
            out_eps=1e-6,
            has_delta=False,
            groups=1,
            xmoe_replicas=0,
            options=peer.PeerOptions(timeout_us=5_000),
        )
    )
    args = [jax.device_put(a, device) for a in (x["mailbox"][0], *_args(x)[1:])]
    start = time.perf_counter()
    first = int(np.asarray(step(*args).status)[0])
    second = int(np.asarray(step(*args).status)[0])
    elapsed = time.perf_counter() - start
    assert first == peer.STATUS_MAILBOX, first  # rank 1 never published
    assert second == peer.STATUS_REFUSED | peer.STATUS_MAILBOX, second
    assert elapsed < 60, f"the errors took {elapsed:.1f} s"
    with pytest.raises(RuntimeError, match=r"status 9 .*refused"):
        peer.check_status(np.array([second, 0], np.int32))
    peer.reset()
    got = tp_consumer(*_args(x), mesh=mesh, mode="peer", **cfg.options())  # the group works again
    want = tp_consumer(*_args(x), mesh=mesh, mode="oneshot", backend="reference", **cfg.options())
    np.testing.assert_array_equal(_replicas(got.prefix), testing.bits(want.prefix))


# ---- bits, eagerly ----------------------------------------------------------------------------

CASES = [
    configs.Config(R, T, 0, groups=g, has_delta=False, xmoe_replicas=x)
    for g in (1, 2, 3, 4)
    for x, T in ((0, 1), (1, 8))
] + [configs.Config(R, 65, 0, groups=4, has_delta=False)]


@pytest.mark.parametrize("cfg", CASES, ids=[c.name for c in CASES])
def test_peer_bits_equal_oneshot(mesh, cfg):
    x = configs.make_inputs(cfg, seed=cfg.T * 10 + cfg.groups)
    got = tp_consumer(*_args(x), mesh=mesh, mode="peer", **cfg.options())  # eager: status checked
    # the reference oracle on a subset (session time; cute oneshot == reference is test_cute_gpu's)
    for name in ("cute", "reference") if cfg.groups in (1, 4) else ("cute",):
        want = tp_consumer(*_args(x), mesh=mesh, mode="oneshot", backend=name, **cfg.options())
        np.testing.assert_array_equal(_replicas(got.prefix), testing.bits(want.prefix), err_msg=name)
    assert testing.rel_l2(got.output, want.output) < testing.OUTPUT_REL_L2_TOL
    _replicas(got.output)
    if cfg.xmoe_replicas:
        np.testing.assert_array_equal(_replicas(got.xmoe)[0], testing.bits(jnp.where(got.output == 0, 0, got.output)))
    assert np.asarray(got.status).tolist() == [0] * R


def test_missing_rank_errors_in_bounded_time(mesh):
    cfg = configs.Config(R, 8, 0, groups=2, has_delta=False)
    x = configs.make_inputs(cfg, seed=5)
    options = peer.PeerOptions(timeout_us=50_000, skip_publish_rank=1)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"mode='peer'.*failed \(status"):
        tp_consumer(*_args(x), mesh=mesh, mode="peer", peer_options=options, **cfg.options())
    elapsed = time.perf_counter() - start
    assert elapsed < 60, f"the error took {elapsed:.1f} s"
    peer.reset()
    got = tp_consumer(*_args(x), mesh=mesh, mode="peer", **cfg.options())  # the group works again
    want = tp_consumer(*_args(x), mesh=mesh, mode="oneshot", backend="reference", **cfg.options())
    np.testing.assert_array_equal(_replicas(got.prefix), testing.bits(want.prefix))


def _fresh_steps(cfg, steps, seed):
    """[steps, R, T, H] partials and one set of weights; the prefix of the first step."""
    xs = [configs.make_inputs(cfg, seed=seed + k) for k in range(steps)]
    partials = np.stack([x["mailbox"] for x in xs])
    return partials, xs[0]


SCAN_CASES = [
    configs.Config(R, 8, 8, groups=4),  # has_delta: the prefix carries through the steps
    configs.Config(R, 8, 0, groups=1, has_delta=False),
]


@pytest.mark.parametrize("cfg", SCAN_CASES, ids=[c.name for c in SCAN_CASES])
def test_scan_of_steps_stays_exact(mesh, cfg):
    steps = 12
    partials, x = _fresh_steps(cfg, steps, seed=100)
    partials = jax.device_put(partials, NamedSharding(mesh, P(None, "tp")))

    def run(mode, backend):
        @jax.jit
        def loop(partials, prefix, blocks, norm, query, out_norm):
            def step(prefix, partial):
                res = tp_consumer(
                    partial,
                    prefix,
                    blocks,
                    norm,
                    query,
                    out_norm,
                    mesh=mesh,
                    mode=mode,
                    backend=backend,
                    **cfg.options(),
                )
                status = getattr(res, "status", jnp.zeros((R,), jnp.int32))
                return res.prefix, (res.prefix, res.output, status)

            return jax.lax.scan(step, prefix, partials)

        return loop(partials, *_args(x)[1:])

    _, (peer_prefixes, peer_outputs, status) = run("peer", "cute")
    peer.check_status(status)
    _, (want_prefixes, _, _) = run("oneshot", "reference")
    np.testing.assert_array_equal(_replicas(peer_prefixes), testing.bits(want_prefixes))
    _replicas(peer_outputs)


def test_unrolled_chain_and_fused_oproj(mesh):
    """The benchmark's shape of use: K dependent calls in one jit, each on its own inputs; and
    the fused o-projection feeding the peer call."""
    cfg = configs.Config(R, 1, 8, groups=4)
    steps = 16
    partials, x = _fresh_steps(cfg, steps, seed=300)
    partials = [jax.device_put(p, NamedSharding(mesh, P("tp"))) for p in partials]

    def chain(mode, backend):
        @jax.jit
        def run(partials, prefix, blocks, norm, query, out_norm):
            prefixes, statuses = [], []
            for p in partials:
                res = tp_consumer(
                    p, prefix, blocks, norm, query, out_norm, mesh=mesh, mode=mode, backend=backend, **cfg.options()
                )
                prefix = res.prefix
                prefixes.append(prefix)
                statuses.append(getattr(res, "status", jnp.zeros((R,), jnp.int32)))
            return prefixes, statuses

        return run(partials, *_args(x)[1:])

    got, status = chain("peer", "cute")
    peer.check_status(jnp.stack(status))
    want, _ = chain("oneshot", "cute")
    for k in range(steps):
        np.testing.assert_array_equal(_replicas(got[k]), testing.bits(want[k]), err_msg=f"step {k}")

    rng = np.random.default_rng(9)
    K = 512
    attn = jnp.asarray(rng.standard_normal((cfg.T, K)) * 0.1, jnp.bfloat16)
    w_o = jnp.asarray(rng.standard_normal((K, cfg.H)) * 0.05, jnp.bfloat16)
    rest = _args(x)[1:]
    got = tp_oproj_consumer(attn, w_o, *rest, mesh=mesh, mode="peer", **cfg.options())
    want = tp_oproj_consumer(attn, w_o, *rest, mesh=mesh, mode="oneshot", backend="cute", **cfg.options())
    np.testing.assert_array_equal(_replicas(got.prefix), testing.bits(want.prefix))
