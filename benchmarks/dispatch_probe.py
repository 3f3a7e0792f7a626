"""Where a jitted chain of consumer calls spends its time between kernels (GPU diagnostic).

  PYTHONPATH=. python3 benchmarks/dispatch_probe.py --label default --out $OUT/probe-default.json
  XLA_FLAGS=--xla_gpu_enable_command_buffer= ... --label no-cmdbuf

One process per XLA flag set (XLA reads its flags once). For each backend and T it measures
the chain slope (bench/timing.py: what a jitted loop pays per call) with rotated input sets
(new buffer addresses every execution) and with one reused set, and from one profiled
execution of the longest chain: the kernel time, the device gap between consecutive consumer
kernels (start of i+1 minus end of i), the span of the chain on the device, and the host
events that took the most time (command-buffer updates, thunk execution, FFI handlers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root


def timeline(fn, args, kernel_substr: str) -> dict:
    """One traced execution of fn(*args): device gaps between the consumer kernels, and the
    host events by total time."""
    import jax

    from oproj_jax.bench import timing

    jax.block_until_ready(fn(*args))
    kernels, host = timing.traced_events(lambda: fn(*args))
    mine = [k for k in kernels if kernel_substr in k[2]]
    gaps = [(b[0] - a[1]) / 1e3 for a, b in zip(mine, mine[1:])]
    durations = [(k[1] - k[0]) / 1e3 for k in mine]
    top_host = host[:25]
    return dict(
        consumer_kernels=len(mine),
        all_device_events=len(kernels),
        other_events=sorted({k[2][:80] for k in kernels if kernel_substr not in k[2]})[:12],
        kernel_us_median=statistics.median(durations) if durations else None,
        gap_us_median=statistics.median(gaps) if gaps else None,
        gap_us_min=min(gaps) if gaps else None,
        gap_us_max=max(gaps) if gaps else None,
        device_span_us=(mine[-1][1] - mine[0][0]) / 1e3 if mine else None,
        host_top=[dict(name=name[:120], n=n, us=round(us, 1)) for name, n, us in top_host],
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--backends", default="cute,reference,pallas")
    parser.add_argument("--tokens", default="1,8,64")
    parser.add_argument("--warm-tokens", default="1")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument(
        "--registration",
        default="record",
        choices=("record", "traced", "direct"),
        help="how the cute targets meet XLA's command buffers (oproj_jax.cute.ffi.REGISTRATION)",
    )
    args = parser.parse_args(argv)

    from oproj_jax.cute import ffi

    ffi.REGISTRATION = args.registration

    from oproj_jax import configs
    from oproj_jax.bench import inputs as bench_inputs
    from oproj_jax.bench import timing

    kernel_names = {"cute": "kernel_oneshot", "pallas": "oproj_consumer_pallas", "reference": ""}
    records = []
    env = {k: os.environ.get(k) for k in ("XLA_FLAGS", "OPROJ_JAX_FFI_LIBRARY")}
    env["registration"] = ffi.REGISTRATION
    tokens = [int(t) for t in args.tokens.split(",")]
    warm_tokens = {int(t) for t in args.warm_tokens.split(",") if t}
    cases = bench_inputs.HostCases([configs.Config(configs.TP, t, 8) for t in tokens], seed=1234)
    backends = args.backends.split(",")
    for T in tokens:
        config = configs.Config(configs.TP, T, 8)
        k1, k2 = timing.chain_lengths(config, "gpu")
        for warm in (False, True) if T in warm_tokens else (False,):
            pool = bench_inputs.DevicePool(cases.get(config), k2, l2_bytes=timing.l2_bytes("gpu"), warm=warm)
            for backend in backends if T in (1, 64) else [b for b in backends if b == "cute"]:
                try:
                    step = timing.consumer_step(backend, config)
                    fn1, fn2 = (
                        timing.rotated_loop(timing.consumer_chain(step, k, f"chain_{backend}_{T}_{k}"), "gpu")
                        for k in (k1, k2)
                    )
                    slopes, piped = [], []
                    for _ in range(3):
                        slopes.append(timing.slope(fn1, fn2, pool.args, k1, k2, args.reps)[0])
                        piped.append(timing.slope(fn1, fn2, pool.args, k1, k2, args.reps, pipelined=8)[0])
                    record = dict(
                        label=args.label,
                        env=env,
                        backend=backend,
                        T=T,
                        warm=warm,
                        k1=k1,
                        k2=k2,
                        slopes_us=slopes,
                        us=statistics.median(slopes),
                        pipelined_slopes_us=piped,
                        us_pipelined=statistics.median(piped),
                    )
                    if not warm:
                        record["timeline"] = timeline(fn2, pool.args(3), kernel_names[backend])
                except Exception as err:  # a diagnostic: record and go on
                    record = dict(
                        label=args.label, backend=backend, T=T, warm=warm, error=f"{type(err).__name__}: {err}"[:1500]
                    )
                records.append(record)
                t = record.get("timeline", {})
                print(
                    f"{args.label:14s} {backend:9s} T={T:4d} {'warm' if warm else 'cold'} "
                    f"slope {record.get('us', float('nan')):7.2f} us  pipelined {record.get('us_pipelined', float('nan')):7.2f}  "
                    f"kernel {t.get('kernel_us_median') or float('nan'):6.2f}  "
                    f"gap {t.get('gap_us_median') or float('nan'):6.2f}  "
                    f"span/call {(t.get('device_span_us') or float('nan')) / k2:6.2f}"
                    + (f"  ERROR {record['error'][:200]}" if "error" in record else ""),
                    flush=True,
                )
            del pool
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
