"""The TP16 layout in a few lines: tp_consumer (oneshot, twoshot) on a 16-device mesh.

Each of the 16 ranks holds its own partial o-projection output ([1, T, H] of the [16, T, H]
array, sharded on the first axis); everything else is replicated. Both modes must leave the
same bits on every rank, and with groups=1 the same prefix bits as each other.

Run from the repository root (CPU-simulated devices unless 16 GPUs are present):
    PYTHONPATH=. python examples/shard_map_tp16.py
"""

import sys

import jax

RANKS = 16
jax.config.update("jax_num_cpu_devices", RANKS)  # before any backend starts: a simulated TP16 on CPU

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from oproj_jax import configs, testing, tp_consumer  # noqa: E402


def pick_devices():
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    return gpus[:RANKS] if len(gpus) >= RANKS else jax.devices("cpu")[:RANKS]


def main() -> int:
    devices = pick_devices()
    mesh = Mesh(np.array(devices), ("tp",))
    print(f"mesh: {RANKS} x {devices[0].platform} devices, axis 'tp'")

    cfg = configs.Config(RANKS, 4, 8, groups=1)  # T=4 tokens, NB=8 blocks, H=7168
    x = configs.make_inputs(cfg, seed=0)
    partial = jax.device_put(x["mailbox"], NamedSharding(mesh, P("tp")))  # [16, T, H]: rank r holds row r
    rest = [jax.device_put(x[k], NamedSharding(mesh, P())) for k in ("prefix", "blocks", "norm", "query", "out_norm")]
    print(f"partial {partial.shape} sharded: each rank holds {partial.addressable_shards[0].data.shape}")

    prefixes = {}
    for mode in ("oneshot", "twoshot"):
        result = tp_consumer(partial, *rest, mesh=mesh, mode=mode, **cfg.options())
        for name in ("prefix", "output"):
            shards = [testing.bits(s.data) for s in getattr(result, name).addressable_shards]
            if len(shards) != RANKS or any(not np.array_equal(s, shards[0]) for s in shards):
                print(f"{mode}: {name} bits differ between ranks")
                return 1
        prefixes[mode] = testing.bits(result.prefix)
        checksum = float(np.asarray(result.output, np.float64).sum())
        print(f"{mode}: {RANKS} ranks hold identical prefix and output bits; output checksum {checksum:.6f}")

    same = np.array_equal(prefixes["oneshot"], prefixes["twoshot"])
    print(f"oneshot and twoshot prefixes bit-identical (groups=1): {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
