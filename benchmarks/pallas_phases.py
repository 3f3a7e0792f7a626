"""Where the Pallas kernel's time goes: Mosaic GPU's in-kernel profiler, phase by phase (H200).

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/pallas_phases.py [--tokens 1 64] [--variant ring=4,split=2]

The kernel body marks its phases with jax.named_scope (issue_copies, rank_sum, prefix_store,
weights, then online_softmax on one CTA per token, or dots_exchange, softmax_mix, exchange_yy
in a cluster; output). With `profile_dir` set, every warpgroup records the global timer at
each phase's start and end (a few ns per event) and the trace is dumped as JSON. For each
phase this prints, over the CTAs of one call (R=16, NB=8, has_delta, groups=4): the median and
max duration, and the median start, counted from the CTA's first event; then the CTA time and
the kernel span (first start to last end over all CTAs). The inputs are touched by a few
plain calls first, and the profiled call is a fresh compile: its first execution is traced.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import tempfile


def phase_table(trace: dict) -> dict:
    """{"phases": {name: {"median_us", "max_us", "start_us"}}, "cta_us": median CTA time,
    "span_us": kernel span} from a Mosaic GPU profiler trace (Chrome trace events "B"/"E"
    with ts in us, one tid per CTA warpgroup)."""
    by_tid: dict[int, list[dict]] = {}
    for event in trace["traceEvents"]:
        by_tid.setdefault(event["tid"], []).append(event)
    durations: dict[str, list[float]] = {}
    starts: dict[str, list[float]] = {}
    cta = []
    for events in by_tid.values():
        t0 = min(e["ts"] for e in events)
        cta.append(max(e["ts"] for e in events) - t0)
        stack = []
        for e in sorted(events, key=lambda e: e["ts"]):
            if e["ph"] == "B":
                stack.append(e)
            else:
                begin = stack.pop()
                durations.setdefault(begin["name"], []).append(e["ts"] - begin["ts"])
                starts.setdefault(begin["name"], []).append(begin["ts"] - t0)
    phases = {
        name: dict(median_us=statistics.median(d), max_us=max(d), start_us=statistics.median(starts[name]))
        for name, d in durations.items()
    }
    stamps = [e["ts"] for e in trace["traceEvents"]]
    return dict(phases=phases, cta_us=statistics.median(cta), span_us=max(stamps) - min(stamps))


def format_table(T: int, variant: dict, table: dict) -> str:
    lines = [f"T={T} {variant}: CTA median {table['cta_us']:.2f} us, kernel span {table['span_us']:.2f} us"]
    for name, p in sorted(table["phases"].items(), key=lambda kv: kv[1]["start_us"]):
        lines.append(
            f"  {name:16s} starts {p['start_us']:6.2f}  takes {p['median_us']:6.2f} (max {p['max_us']:6.2f}) us"
        )
    return "\n".join(lines)


def main():
    import jax

    from benchmarks import pallas_smoke
    from oproj_jax.pallas import consumer as pallas_consumer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--variant", default=None, help="ring=..,split=..,batch=.. (default: choose_split's)")
    ap.add_argument("--out", default=None, help="also write the tables as JSON here")
    args = ap.parse_args()
    results = []
    for T in args.tokens:
        variant = (
            pallas_smoke.parse_variant(args.variant)
            if args.variant
            else pallas_consumer.choose_split(T, 7168, interpret=False)
        )
        p0, mb, bl, (n, q, on) = pallas_smoke.random_inputs(jax.random.key(T), T, 1)
        call = lambda **kw: pallas_consumer.consumer_with(
            mb[0], p0, bl[0], n, q, on, has_delta=True, groups=4, xmoe_replicas=0, **pallas_smoke.EPS, **variant, **kw
        )
        for _ in range(3):
            jax.block_until_ready(call())
        with tempfile.TemporaryDirectory() as tmp:
            jax.block_until_ready(call(profile_dir=tmp))
            jax.effects_barrier()  # the trace is written by a host callback
            paths = glob.glob(os.path.join(tmp, "*-trace.json"))
            if not paths:
                print(f"T={T} {variant}: no trace written in {tmp}")
                continue
            with open(paths[0]) as f:
                table = phase_table(json.load(f))
        print(format_table(T, variant, table), flush=True)
        results.append(dict(T=T, variant=variant, **table))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
