"""tp_consumer on a real multi-process cluster: 2 processes x 8 CPU devices over loopback.

The test starts two copies of this file as workers (`python tests/test_distributed.py worker
PROCESS_ID COUNT PORT`); they form a jax.distributed cluster with gloo CPU collectives, build one
16-device mesh spanning both, run tp_consumer (oneshot, groups=4) on it, and each checks the
8 shards it holds: the prefix against the unsharded reference's bits (computed locally), the
output for identical bits across its shards and against testing.output_f64. It is skipped only
when the workers' probe (cluster start + one cross-process all-gather, no project code) fails:
then this jax cannot run CPU collectives across processes, and the skip says why.
"""

import sys

import pytest
from conftest import REPO, worker_env

from oproj_jax import processes

PROCESSES, LOCAL_DEVICES = 2, 8
TIMEOUT_S = 240  # both workers, start to finish; a run takes ~20 s on 2 cores
SKIP_EXIT = 77  # a worker's probe failed: no cross-process CPU collectives here


def test_two_process_oneshot_matches_reference():
    env = worker_env(JAX_PLATFORMS="cpu")
    results = processes.run([__file__, "worker"], PROCESSES, env=env, cwd=REPO, timeout_s=TIMEOUT_S)
    report = processes.report(results)
    codes = [r.code for r in results]
    if SKIP_EXIT in codes:
        reasons = [line for r in results for line in r.log.splitlines() if line.startswith("SKIP:")]
        pytest.skip(f"this jax cannot run CPU collectives across processes: {reasons or report}")
    assert codes == [0] * PROCESSES, report
    for i, r in enumerate(results):
        assert f"process {i}: {LOCAL_DEVICES} shards match the reference bits (prefix)" in r.log, report


def _worker(process_id: int, count: int, port: int) -> int:
    import jax

    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")

    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    try:  # the probe: only jax, so a failure here is the platform's, not the project's
        processes.initialize(process_id, count, port)
        mesh = Mesh(np.array(jax.devices()), ("tp",))
        one_each = lambda index: np.ones(1, np.float32)  # noqa: E731
        ones = jax.make_array_from_callback((mesh.size,), NamedSharding(mesh, P("tp")), one_each)
        gather = lambda x: jax.lax.all_gather(x, "tp", tiled=True, to="invarying")  # noqa: E731
        gathered = jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=P("tp"), out_specs=P()))(ones)
        assert float(np.asarray(gathered.addressable_shards[0].data).sum()) == mesh.size
    except Exception as err:  # noqa: BLE001 - reported as the skip reason
        print(f"SKIP: {type(err).__name__}: {err}".splitlines()[0], flush=True)
        return SKIP_EXIT

    from oproj_jax import api, configs, testing
    from oproj_jax.sharded import tp_consumer

    cfg = configs.Config(mesh.size, 3, 2, groups=4)  # H = 7168
    x = configs.make_inputs(cfg, seed=7)  # the same on both processes (seeded)

    def global_array(value, spec):
        return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda index: value[index])

    args = [global_array(x[k], P()) for k in ("prefix", "blocks", "norm", "query", "out_norm")]
    partial = global_array(x["mailbox"], P("tp"))  # [16, T, H]: each process holds its 8 ranks' rows
    got = tp_consumer(partial, *args, mesh=mesh, mode="oneshot", backend="reference", **cfg.options())

    names = ("prefix", "blocks", "norm", "query", "out_norm")
    with jax.default_device(jax.local_devices()[0]):  # the oracle: unsharded, this process only
        want = api.consumer(x["mailbox"], *(x[k] for k in names), backend="reference", **cfg.options())
    want_prefix = testing.bits(want.prefix)
    output_bits = testing.bits(got.output.addressable_shards[0].data)
    want_output = testing.output_f64(
        want.prefix, x["blocks"], x["norm"], x["query"], x["out_norm"], eps=1e-6, out_eps=1e-6
    )  # from the prefix, checked bit-exact below
    error = testing.rel_l2(output_bits.view(want.output.dtype), want_output)
    for p_shard, o_shard in zip(got.prefix.addressable_shards, got.output.addressable_shards):
        if not np.array_equal(testing.bits(p_shard.data), want_prefix):
            print(f"process {process_id}: prefix on {p_shard.device} differs from the reference bits", flush=True)
            return 1
        if not np.array_equal(testing.bits(o_shard.data), output_bits):
            print(f"process {process_id}: output on {o_shard.device} differs from its first shard", flush=True)
            return 1
    if not error < testing.OUTPUT_REL_L2_TOL:
        print(f"process {process_id}: output rel L2 {error:.2e} vs f64 >= {testing.OUTPUT_REL_L2_TOL}", flush=True)
        return 1
    shards = len(got.prefix.addressable_shards)
    print(
        f"process {process_id}: {shards} shards match the reference bits (prefix) and each other (output, "
        f"rel L2 {error:.1e} vs f64); {len(jax.devices())} devices in {jax.process_count()} processes",
        flush=True,
    )
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    sys.exit(_worker(*map(int, sys.argv[2:5])))
