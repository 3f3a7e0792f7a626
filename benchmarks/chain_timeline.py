"""Where a donated chain's time per call goes on the device, kernel by kernel (GPU diagnostic).

  PYTHONPATH=. python3 benchmarks/chain_timeline.py --out $OUT/timeline.json --tokens 1,64
  XLA_FLAGS=--xla_gpu_enable_command_buffer= ... --label no-cmdbuf

For each T and arm (cute; pallas with and without programmatic dependent launch), the chain in
a decode loop's form (bench/timing.py, "donated": no buffer moves between executions):
- the slope per call (median of --rounds slopes, each the median of --reps executions), with
  every execution waited for, and pipelined (8 executions dispatched back to back per sample,
  as a decode loop that does not read its results runs them); the host's dispatch time per
  call (how long an execution takes to be enqueued, per call);
- one profiled execution of the K-call chain: every device event in order, and for the
  consumer kernels the start of call i+1 less the end of call i (the gap; negative where PDL
  let call i+1 start early), their durations, the device's idle time between the first
  consumer's start and the last one's end, and the host events that took the most time;
- with --dump, XLA's thunk sequence of the chain (which thunks a command buffer holds).
One process per XLA flag set (XLA reads its flags once).
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

KERNEL_SUBSTR = {"cute": "kernel_oneshot", "pallas": "oproj_consumer_pallas", "reference": ""}


def analyse(device, kernel_substr: str) -> dict:
    """Gaps, durations and idle time of the consumer kernels among the device events."""
    from oproj_jax.bench import timing

    mine = [e for e in device if kernel_substr in e[2]]
    if not mine:
        return dict(error=f"no device event named like {kernel_substr!r}", names=sorted({e[2][:60] for e in device}))
    first, last = mine[0][0], mine[-1][1]
    inside = [e for e in device if e[0] >= first and e[1] <= last]
    busy = timing.busy_us([(e[0], e[1]) for e in inside])
    gaps = [(b[0] - a[1]) / 1e3 for a, b in zip(mine, mine[1:])]
    durations = [(e[1] - e[0]) / 1e3 for e in mine]
    span = (last - first) / 1e3
    return dict(
        calls=len(mine),
        kernel_us=[round(d, 3) for d in durations],
        gap_us=[round(g, 3) for g in gaps],
        kernel_us_median=statistics.median(durations),
        gap_us_median=statistics.median(gaps) if gaps else None,
        span_us_per_call=span / len(mine),
        busy_us_per_call=busy / len(mine),
        idle_us_per_call=(span - busy) / len(mine),
        others_inside=sorted({e[2][:80] for e in inside if kernel_substr not in e[2]}),
        events=[(round((e[0] - first) / 1e3, 3), round((e[1] - e[0]) / 1e3, 3), e[2][:48]) for e in device][:80],
    )


def arms(names, config):
    """(label, backend for the kernel name, jitted step)."""
    import jax

    from oproj_jax.bench import timing
    from oproj_jax.pallas import consumer as pallas_consumer

    options = timing.consumer_options(config)
    tuning = pallas_consumer.choose_split(config.T, config.H, interpret=False, R=config.R, NB=config.NB)
    out = []
    for name in names:
        if name in ("cute", "reference"):  # reference: every device event counts as the consumer's
            out.append((name, name, timing.consumer_step(name, config)))
        elif name in ("pallas", "pallas-nopdl"):
            pdl = name == "pallas"
            step = functools.partial(pallas_consumer.consumer_with, **options, **tuning, pdl=pdl, interpret=False)
            out.append((name, "pallas", jax.jit(step)))
        else:
            raise ValueError(f"--arms: unknown arm {name!r}")
    return out


def thunk_sequence(dump_dir: str, chain_name: str) -> list[str]:
    """The chain's thunk sequence after XLA's thunk passes (first 60 lines), from --xla_dump_to."""
    paths = sorted(glob.glob(f"{dump_dir}/*{chain_name}*thunk_sequence_after_thunk_passes*"))
    if not paths:
        return [f"no thunk sequence for {chain_name} in {dump_dir}"]
    with open(paths[-1]) as f:
        return [line.rstrip()[:160] for line in f][:60]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--label", default="default")
    parser.add_argument("--tokens", default="1,64")
    parser.add_argument("--arms", default="cute,pallas,pallas-nopdl")
    parser.add_argument(
        "--k", type=int, default=32, help="calls in the longer chain (the profiled one); the shorter has k/4"
    )
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dump", default="", help="a directory for --xla_dump_to (set before JAX starts)")
    args = parser.parse_args(argv)
    if args.dump:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={args.dump} --xla_dump_hlo_module_re=timeline_"
        ).strip()

    import jax

    from oproj_jax import configs
    from oproj_jax.bench import inputs as bench_inputs
    from oproj_jax.bench import timing

    platform = jax.default_backend()
    records = []
    for T in [int(t) for t in args.tokens.split(",")]:
        config = configs.Config(configs.TP, T, 8)
        case = bench_inputs.host_case(config, seed=1234)
        k1, k2 = max(1, args.k // 4), args.k
        pool = bench_inputs.DevicePool(case, k2, l2_bytes=timing.l2_bytes(platform))
        for label, backend, step in arms([a for a in args.arms.split(",") if a], config):
            name = f"timeline_{label.replace('-', '_')}_T{T}_K"
            fn1, fn2 = (
                timing.donated_loop(timing.donated_chain(step, k, f"{name}{k}"), step, pool, k2, platform)
                for k in (k1, k2)
            )
            slopes, piped, dispatch = [], [], []
            for _ in range(args.rounds):  # interleaved: a drift of the machine falls on every form alike
                slopes.append(timing.slope(fn1, fn2, lambda i: (), k1, k2, args.reps)[0])
                piped.append(timing.slope(fn1, fn2, lambda i: (), k1, k2, args.reps, pipelined=8)[0])
                dispatch.append(timing.dispatch_slope(fn1, fn2, k1, k2, args.reps))
            device, host = timing.traced_events(fn2)
            host = host[:20]
            record = dict(
                label=args.label,
                xla_flags=os.environ.get("XLA_FLAGS", ""),
                arm=label,
                T=T,
                k1=k1,
                k2=k2,
                slopes_us=[round(s, 3) for s in slopes],
                us=statistics.median(slopes),
                pipelined_slopes_us=[round(s, 3) for s in piped],
                us_pipelined=statistics.median(piped),
                host_dispatch_us=[round(s, 3) for s in dispatch],
                timeline=analyse(device, KERNEL_SUBSTR[backend]),
                host_top=[dict(name=n[:100], n=c, us=round(u, 1)) for n, c, u in host],
            )
            if args.dump:
                record["thunks"] = thunk_sequence(args.dump, f"{name}{k2}")
            records.append(record)
            t = record["timeline"]
            print(
                f"{args.label} T={T:3d} {label:13s} slope {record['us']:6.2f} us "
                f"({' / '.join(f'{s:.2f}' for s in slopes)})  pipelined {record['us_pipelined']:6.2f}  "
                f"host {statistics.median(dispatch):5.2f}  kernel {t.get('kernel_us_median', float('nan')):6.2f}  "
                f"gap {t.get('gap_us_median') or float('nan'):6.2f}  span/call {t.get('span_us_per_call', float('nan')):6.2f}  "
                f"busy/call {t.get('busy_us_per_call', float('nan')):6.2f}  idle/call {t.get('idle_us_per_call', float('nan')):5.2f}",
                flush=True,
            )
            with open(args.out, "w") as f:
                json.dump(records, f, indent=1)
        del pool
    return 0


if __name__ == "__main__":
    sys.exit(main())
