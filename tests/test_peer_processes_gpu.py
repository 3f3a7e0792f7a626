"""mode="peer" with one process per GPU (jax.distributed on this host, 2 GPUs; skipped otherwise).

Two workers (`python tests/test_peer_processes_gpu.py worker PROCESS_ID COUNT PORT`) each drive
one GPU (`local_device_ids`) of one 2-device mesh. Each process allocates its rank's mailbox,
exports it as a CUDA IPC handle and maps the other's (oproj_jax/cute/peer_ipc.py) when it
traces its first step; then the steps run the same publish and consumer kernels as in one
process. Each worker checks what it holds against an oracle it computes on its own GPU from
the same seeded inputs, with no cross-process collective anywhere:
  * eager steps over groups 1-4, xmoe and has_delta: prefix bits equal to the single-device
    consumer with the full mailbox (cute and the reference backend), output within tolerance;
  * a jitted chain of dependent steps inside XLA's command buffers, executed repeatedly with
    fresh inputs: every step's prefix exact;
  * a rank that never publishes: both processes raise within a bounded time; after
    peer.reset() (which waits for both processes) the group is exact again.
"""

import sys
import time

import numpy as np

from conftest import REPO, gpus_or_skip, worker_env

from oproj_jax import processes

R = 2
TIMEOUT_S = 300  # both workers, start to finish (compiles included); each wait inside is shorter
CHAIN_STEPS, CHAIN_EXECUTIONS = 4, 3


def test_peer_mode_with_one_process_per_gpu():
    gpus_or_skip(R)
    env = worker_env(drop=("JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES"), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    results = processes.run([__file__, "worker"], R, env=env, cwd=REPO, timeout_s=TIMEOUT_S)
    report = processes.report(results)
    assert [r.code for r in results] == [0] * R, report
    for i, r in enumerate(results):
        for line in (f"process {i}: eager cases exact", f"process {i}: chain exact", f"process {i}: missing rank"):
            assert line in r.log, report


def _worker(process_id: int, count: int, port: int) -> int:
    processes.initialize(process_id, count, port, local_device_ids=[process_id])
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from oproj_jax import api, configs, testing
    from oproj_jax.cute import peer
    from oproj_jax.sharded import tp_consumer

    mesh = Mesh(np.array(jax.devices()), ("tp",))
    me = jax.local_devices()[0]
    connect = peer.PeerOptions(connect_timeout_s=60)  # a process that fails early must not stall the other long
    print(f"process {process_id}: {me} of {jax.devices()}", flush=True)
    assert len(jax.devices()) == R and jax.process_count() == count, (jax.devices(), jax.process_count())
    names = ("prefix", "blocks", "norm", "query", "out_norm")

    def global_args(x):
        shard, rep = NamedSharding(mesh, P("tp")), NamedSharding(mesh, P())
        put = lambda value, s: jax.make_array_from_callback(value.shape, s, lambda index: value[index])  # noqa: E731
        return [put(x["mailbox"], shard)] + [put(x[k], rep) for k in names]

    def oracle(x, cfg, backend):  # this process's GPU, the full mailbox: mode="oneshot"'s bits
        with jax.default_device(me):
            return api.consumer(x["mailbox"], *(x[k] for k in names), backend=backend, **cfg.options())

    def mine(array) -> np.ndarray:
        return testing.bits(array.addressable_shards[0].data)

    cases = [
        configs.Config(R, T, nb, groups=g, has_delta=d, xmoe_replicas=xm)
        for g, T, nb, d, xm in ((1, 1, 0, False, 0), (2, 8, 8, True, 1), (3, 8, 2, True, 0), (4, 65, 8, True, 2))
    ]
    for cfg in cases:
        x = configs.make_inputs(cfg, seed=31 + cfg.T + cfg.groups)
        got = tp_consumer(*global_args(x), mesh=mesh, mode="peer", peer_options=connect, **cfg.options())  # eager
        for backend in ("cute", "reference"):
            want = oracle(x, cfg, backend)
            if not np.array_equal(mine(got.prefix), testing.bits(want.prefix)):
                print(f"process {process_id}: {cfg.name}: prefix differs from the {backend} oracle", flush=True)
                return 1
        error = testing.rel_l2(got.output.addressable_shards[0].data, want.output)
        if not error < testing.OUTPUT_REL_L2_TOL:
            print(f"process {process_id}: {cfg.name}: output rel L2 {error:.2e}", flush=True)
            return 1
        if cfg.xmoe_replicas:
            out = np.asarray(got.output.addressable_shards[0].data)
            want_x = testing.bits(np.where(out == 0, np.zeros_like(out), out))
            if not all(np.array_equal(r, want_x) for r in mine(got.xmoe)):
                print(f"process {process_id}: {cfg.name}: xmoe differs from the output", flush=True)
                return 1
        print(f"process {process_id}: {cfg.name} exact", flush=True)
    print(f"process {process_id}: eager cases exact ({len(cases)} configs)", flush=True)

    cfg = configs.Config(R, 8, 8, groups=4)
    chain_cfg = cfg.options()

    @jax.jit
    def chain(partials, prefix, blocks, norm, query, out_norm):
        prefixes, statuses = [], []
        for p in partials:
            res = tp_consumer(
                p, prefix, blocks, norm, query, out_norm, mesh=mesh, mode="peer", peer_options=connect, **chain_cfg
            )
            prefix = res.prefix
            prefixes.append(res.prefix)
            statuses.append(res.status)
        return prefixes, jnp.stack(statuses)

    for e in range(CHAIN_EXECUTIONS):
        xs = [configs.make_inputs(cfg, seed=1000 * e + k) for k in range(CHAIN_STEPS)]
        args = [global_args(x) for x in xs]
        prefixes, status = chain([a[0] for a in args], *args[0][1:])
        peer.check_status(status)
        x = dict(xs[0])
        for k in range(CHAIN_STEPS):
            x["mailbox"] = xs[k]["mailbox"]
            want = oracle(x, cfg, "cute")
            if not np.array_equal(mine(prefixes[k]), testing.bits(want.prefix)):
                print(f"process {process_id}: chain execution {e} step {k}: prefix differs", flush=True)
                return 1
            x["prefix"] = np.asarray(want.prefix)
    print(f"process {process_id}: chain exact ({CHAIN_EXECUTIONS} executions of {CHAIN_STEPS} steps)", flush=True)

    x = configs.make_inputs(cases[1], seed=5)
    options = peer.PeerOptions(timeout_us=50_000, connect_timeout_s=60, skip_publish_rank=1)
    start = time.perf_counter()
    try:
        tp_consumer(*global_args(x), mesh=mesh, mode="peer", peer_options=options, **cases[1].options())
        print(f"process {process_id}: the step with a missing rank did not fail", flush=True)
        return 1
    except RuntimeError as err:
        elapsed = time.perf_counter() - start
        if "failed (status" not in str(err) or elapsed > 60:
            print(f"process {process_id}: unexpected error after {elapsed:.1f} s: {err}", flush=True)
            return 1
    peer.reset()
    got = tp_consumer(*global_args(x), mesh=mesh, mode="peer", peer_options=connect, **cases[1].options())
    if not np.array_equal(mine(got.prefix), testing.bits(oracle(x, cases[1], "cute").prefix)):
        print(f"process {process_id}: after reset the prefix differs", flush=True)
        return 1
    print(f"process {process_id}: missing rank raised after {elapsed:.2f} s; exact again after reset", flush=True)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    sys.exit(_worker(*map(int, sys.argv[2:5])))
