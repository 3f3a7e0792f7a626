"""GPU smoke check + quick timing of the Pallas Mosaic GPU consumer kernel (H200).

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/pallas_smoke.py [--variants ring=4,split=7 ring=2,split=1 ...] [--tokens 1 64 4096]

1. Parity on fresh random data (configs.make_inputs, seed 1) for GPU_CHECKS-style shapes,
   against the tests' oracle (testing.check_result): prefix bit-exact vs the numpy model,
   output rel_l2 vs testing.output_f64, xmoe == output with -0 -> +0, no NaN. The prefix
   buffer is written in place (aliased), so it is checked too. Output buffers are allocated by
   XLA (nothing to poison); every element is compared, so an unwritten element shows up as a
   mismatch.
2. Timing at R=16, NB=8, has_delta, groups=4: the slope of unrolled chains of K dependent
   calls (call k+1 takes call k's prefix; each call has its own mailbox and blocks; every
   output is returned, so none is dead): (t(K2) - t(K1)) / (K2 - K1), best of several runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp

from oproj_jax import configs, reference, testing
from oproj_jax.bench import timing
from oproj_jax.pallas import consumer as pallas_consumer

EPS = dict(eps=1e-6, out_eps=1e-6)
TARGETS_US = {1: 5.0, 64: 12.0, 4096: 460.0}
NAMES = ("mailbox", "prefix", "blocks", "norm", "query", "out_norm")


def parse_variant(text: str) -> dict:
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}


def check(config: configs.Config, variant: dict) -> str:
    x, opts = testing.consumer_case(config, configs.make_inputs(config, seed=1))  # twoshot: the gather row
    got = pallas_consumer.consumer_with(*(jnp.asarray(x[k]) for k in NAMES), **EPS, **opts, **variant)
    try:
        err = testing.check_result(dataclasses.replace(config, groups=opts["groups"]), x, got, **EPS)
    except AssertionError as failure:
        return f"FAIL {config.name:28s} {failure}"
    return f"OK   {config.name:28s} prefix_exact=True rel_l2={err:.2e} nan=False xmoe_ok=True"


def check_shard_map() -> str:
    """backend="pallas" inside shard_map (sharded.tp_consumer) on a one-device TP mesh."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from oproj_jax import sharded

    config = configs.Config(1, 3, 8, groups=1)
    x = configs.make_inputs(config, seed=2)
    mesh = jax.make_mesh((1,), ("tp",))
    args = [jax.device_put(x[k], NamedSharding(mesh, P("tp") if k == "mailbox" else P())) for k in NAMES]
    got = sharded.tp_consumer(*args, mesh=mesh, backend="pallas", **EPS, **config.options())
    want = reference.consumer(*(jnp.asarray(x[k]) for k in NAMES), **EPS, **config.options())
    prefix_ok = bool((testing.bits(got.prefix) == testing.bits(want.prefix)).all())
    err = testing.rel_l2(got.output, want.output)
    return f"{'OK  ' if prefix_ok and err < testing.OUTPUT_REL_L2_TOL else 'FAIL'} shard_map tp_consumer prefix_exact={prefix_ok} rel_l2_vs_ref={err:.2e}"


def random_inputs(key, T, K, R=16, NB=8, H=configs.HIDDEN):
    ks = jax.random.split(key, 2 * K + 4)
    mb = [(jax.random.normal(ks[2 * k], (R, T, H), jnp.float32) * 4).astype(jnp.bfloat16) for k in range(K)]
    bl = [jax.random.normal(ks[2 * k + 1], (T, NB, H), jnp.bfloat16) for k in range(K)]
    p0 = jax.random.normal(ks[-4], (T, H), jnp.bfloat16)
    w = [(1 + 0.1 * jax.random.normal(ks[-i], (H,), jnp.float32)).astype(jnp.bfloat16) for i in (1, 2, 3)]
    return p0, mb, bl, w


def chain_time(T: int, K: int, variant: dict, reps: int, profile: bool = False) -> tuple[float, float | None]:
    """Best wall time of the K-call chain; with `profile`, also the kernel time per call that
    the profiler reports for it (device time, launch gaps excluded)."""
    p0, mb, bl, (n, q, on) = random_inputs(jax.random.key(T), T, K)

    @jax.jit
    def chain(p, mb, bl, n, q, on):
        outs = []
        for k in range(K):
            r = pallas_consumer.consumer_with(
                mb[k], p, bl[k], n, q, on, has_delta=True, groups=4, xmoe_replicas=0, **EPS, **variant
            )
            p = r.prefix
            outs.append(r.output)
        return p, outs

    jax.block_until_ready(chain(p0, mb, bl, n, q, on))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(chain(p0, mb, bl, n, q, on))
        best = min(best, time.perf_counter() - t0)
    kernel_us = None
    if profile:
        kernel_us, _, _, _ = timing.profiled_us(lambda i: chain(p0, mb, bl, n, q, on), K)  # noqa: F821 (del below)
    del mb, bl
    return best, kernel_us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="+", default=["ring=4,split=7", "ring=4,split=1", "ring=2,split=1"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64, 512, 4096])
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also the profiler's kernel time per call")
    args = ap.parse_args()
    print(jax.devices(), jax.__version__)
    variants = [parse_variant(v) for v in args.variants]
    if not args.no_check:
        full = configs.PARITY + tuple(configs.Config(configs.TP, t, 8) for t in (8, 512))
        short = tuple(c for c in full if c.R == 16 and not c.twoshot)[:6] + full[-1:]
        for variant in variants:  # the cluster path gets the full list; the one-CTA rings a short one
            print("check", variant)
            for config in full if variant.get("split", 1) > 1 else short:
                try:
                    print("  ", check(config, variant), flush=True)
                except Exception as err:  # report and go on: one failing shape must not hide the rest
                    print("   FAIL", config.name, type(err).__name__, str(err)[:2000], flush=True)
        try:
            print("  ", check_shard_map(), flush=True)
        except Exception as err:
            print("   FAIL shard_map", type(err).__name__, str(err)[:2000], flush=True)
    for T in args.tokens:
        nbytes = configs.min_bytes(configs.Config(configs.TP, T, 8))
        k1, k2 = (1, 5) if T >= 2048 else (4, 24)
        reps = 3 if T >= 2048 else 10
        for variant in variants:
            try:
                (t1, _), (t2, kernel_us) = (
                    chain_time(T, k1, variant, reps),
                    chain_time(T, k2, variant, reps, args.profile),
                )
            except Exception as err:
                print(f"T={T:5d} {variant} FAIL {type(err).__name__}: {str(err)[:1500]}", flush=True)
                continue
            us = (t2 - t1) / (k2 - k1) * 1e6
            target = TARGETS_US.get(T)
            judged = us if kernel_us is None else kernel_us  # the targets are device time per call
            verdict = (
                ""
                if target is None
                else (
                    f" target {target:.0f} us ({'kernel' if kernel_us else 'chain slope'}):"
                    f" {'met' if judged <= target else 'MISSED'}"
                )
            )
            kernel = "" if kernel_us is None else f"  kernel {kernel_us:7.1f} us"
            print(
                f"T={T:5d} {variant}: {us:8.1f} us/call{kernel}  {nbytes / us / 1e3:7.0f} GB/s"
                f"  (chains {k1}:{t1 * 1e3:.2f} ms {k2}:{t2 * 1e3:.2f} ms){verdict}",
                flush=True,
            )


if __name__ == "__main__":
    main()
