"""Where the consumer's share of a decode step goes (GPU diagnostic for `--decode-step`).

  PYTHONPATH=. python3 benchmarks/decode_profile.py --label default --out $OUT/decode-default.json
  XLA_FLAGS=--xla_gpu_enable_command_buffer= ... --label no-cmdbuf

One process per XLA flag set (XLA reads its flags once). For each T, loop form (scan,
unrolled) and consumer (none, then each backend) it builds the step of
oproj_jax/bench/decode_step.py, measures the wall time per step as the bench does (dependent
steps dispatched back to back), and profiles one step: every device event grouped by name
(count and total µs per step), the device busy time (union of the events' intervals), and
the device span (first start to last end). With and without the consumer side by side, the
events that appear or grow show what the consumer's share is made of: the consumer kernel,
copies XLA adds around a custom call (slices of stacked weights, the mailbox concatenation),
or a different GEMM algorithm for a custom call's output.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root


def profile_step(fn, state, weights) -> dict:
    """Device events of one step (after a warm-up step), grouped by name."""
    import jax
    import jax.numpy as jnp

    from oproj_jax.bench.timing import busy_us

    attn, prefix, slots, blocks = state
    carry = jax.block_until_ready(fn(attn, jnp.copy(prefix), jnp.copy(slots), blocks, weights))
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            jax.block_until_ready(fn(*carry, blocks, weights))
        (path,) = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)[:1]
        data = jax.profiler.ProfileData.from_file(path)
        events = []
        for plane in data.planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                if line.name.startswith("Stream") or "Memcpy" in line.name or "Memset" in line.name:
                    events += [(e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events]
    by_name: dict[str, list] = {}
    for start, end, name in events:
        count, total = by_name.get(name, (0, 0.0))
        by_name[name] = (count + 1, total + (end - start) / 1e3)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:20]
    return dict(
        events=len(events),
        kernel_us_sum=sum((e - s) / 1e3 for s, e, _ in events),
        busy_us=busy_us([(s, e) for s, e, _ in events]) if events else 0.0,
        span_us=(max(e for _, e, _ in events) - min(s for s, _, _ in events)) / 1e3 if events else 0.0,
        top=[dict(name=name[:120], count=c, us=round(t, 2)) for name, (c, t) in top],
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True, help="names the XLA flag set of this process")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", default="1,64")
    parser.add_argument("--backends", default="cute,reference")
    parser.add_argument("--loops", default="scan,unrolled")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--mailbox", default="carried", help="decode_step.MAILBOXES: how the mailbox is formed")
    args = parser.parse_args(argv)

    import jax

    from oproj_jax.bench import decode_step as D

    results = dict(
        label=args.label,
        mailbox=args.mailbox,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        device=str(jax.devices()[0]),
        runs=[],
    )
    for T in (int(t) for t in args.tokens.split(",")):
        weights, state = D.make_weights(args.layers, T, args.mailbox), D.make_state(T)
        for loop in args.loops.split(","):
            for backend in [None, *args.backends.split(",")]:
                fn = D.step_fn(backend, loop, args.layers, args.mailbox)
                try:
                    us = sorted(D.time_steps(fn, state, weights, args.reps) for _ in range(3))[1]
                    prof = profile_step(fn, state, weights)
                except Exception as err:  # a diagnostic: report and go on
                    results["runs"].append(dict(T=T, loop=loop, backend=backend, error=f"{type(err).__name__}: {err}"))
                    print(f"T={T} {loop} {backend}: {type(err).__name__}: {err}", flush=True)
                    continue
                results["runs"].append(dict(T=T, loop=loop, backend=backend or "none", us_step=us, **prof))
                print(
                    f"T={T:3d} {loop:8s} {backend or 'none':9s} step {us:8.1f} us  device busy {prof['busy_us']:8.1f}"
                    f"  span {prof['span_us']:8.1f}  events {prof['events']}",
                    flush=True,
                )
                for row in prof["top"][:8]:
                    print(f"      {row['us']:9.2f} us {row['count']:4d}x  {row['name'][:90]}", flush=True)
        del weights, state
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
