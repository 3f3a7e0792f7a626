"""The one benchmark run on the GPU machine: checks, copy roofline, timings, one JSON file.

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/run_h200.py --out-dir $OUT

(a) every GPU backend the registry can run, against the reference, on fresh random data
    (configs.make_inputs, a new seed) over configs.GPU_CHECKS, outputs poisoned (bench/checks.py);
(b) median device time per call over configs.BENCH for "reference", every GPU backend and the
    torch baseline (bench/timing.py: slope of unrolled dependent chains, L2-cold inputs,
    profiler cross-check);
(c) device copy bandwidth, timed the same way: the roofline for % of copy over configs.min_bytes.
Writes benchmarks/results/<date>-<device>.json (or --out) and a PNG beside it. See
benchmarks/README.md for the fields. Exit status 1 if a check failed or a step raised.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# JAX takes 75 % of GPU memory by default; leave the torch baseline room on the same GPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON path (default benchmarks/results/<date>-<device>.json)")
    parser.add_argument("--out-dir", help="write <out-dir>/<date>-<device>.json instead (e.g. $OUT on the GPU machine)")
    parser.add_argument("--seed", type=int, default=None, help="input seed (default: new, from the clock)")
    parser.add_argument("--backends", default=None, help="comma-separated subset (default: every one available)")
    parser.add_argument("--reps", type=int, default=20, help="timed executions per chain length")
    parser.add_argument("--no-checks", action="store_true")
    parser.add_argument("--no-timings", action="store_true")
    parser.add_argument(
        "--no-reference-timing",
        action="store_true",
        help="time the kernels only (variant sweeps; speedups are then left out)",
    )
    parser.add_argument("--no-profile", action="store_true", help="skip the profiler cross-check")
    parser.add_argument("--check-max-t", type=int, default=None, help="only checks with T <= this (partial runs)")
    parser.add_argument("--tokens", default=None, help="comma-separated subset of the BENCH token counts")
    parser.add_argument("--workers", type=int, default=4, help="processes building host inputs")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (smoke test only)")
    args = parser.parse_args(argv)

    import jax

    from oproj_jax import configs
    from oproj_jax.bench import backends as bench_backends
    from oproj_jax.bench import inputs as bench_inputs
    from oproj_jax.bench import report, runner

    start = time.perf_counter()
    platform = jax.default_backend()
    if platform != "gpu" and not args.allow_cpu:
        print(f"run_h200.py: no GPU (JAX platform {platform!r}); pass --allow-cpu for a smoke run", file=sys.stderr)
        return 2
    status = bench_backends.backend_status(platform)
    for name, reason in status.items():
        runner.log(f"backend {name}: {reason or 'available'}")
    chosen = [b.strip() for b in args.backends.split(",")] if args.backends else list(status)
    unknown = [b for b in chosen if b not in status]
    if unknown:
        print(f"run_h200.py: --backends: unknown {unknown}; known {sorted(status)}", file=sys.stderr)
        return 2
    runnable = [b for b in chosen if status[b] is None]
    kernels = [b for b in runnable if b not in ("reference", *bench_backends.TORCH_PROCESS)]
    timed = (
        ([] if args.no_reference_timing else ["reference"])
        + kernels
        + [b for b in bench_backends.TORCH_PROCESS if b in runnable]
    )

    check_configs = [c for c in configs.GPU_CHECKS if args.check_max_t is None or c.T <= args.check_max_t]
    tokens = {int(t) for t in args.tokens.split(",")} if args.tokens else set(configs.BENCH_T)
    bench_configs = [c for c in configs.BENCH if c.T in tokens]
    seed = args.seed if args.seed is not None else int(time.time()) % 2**31
    profile = not args.no_profile and platform == "gpu"

    records = [
        runner.header(
            seed,
            status,
            script="benchmarks/run_h200.py",
            argv=sys.argv[1:] if argv is None else argv,
            xla_mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
        )
    ]
    wanted_cases = ([] if args.no_checks else check_configs) + ([] if args.no_timings else bench_configs)
    cases = bench_inputs.HostCases(wanted_cases, seed, workers=args.workers)
    try:
        if not args.no_checks:
            runner.log(f"checks: {len(check_configs)} configs x {['reference'] + kernels} (seed {seed})")
            records += runner.run_checks(["reference"] + kernels, check_configs, cases)
        records.append(runner.run_copy(platform, args.reps, profile))
        if not args.no_timings:
            runner.log(f"timings: T={sorted(tokens)} x {timed}")
            records += runner.run_timings(timed, bench_configs, cases, platform, args.reps, profile)
    finally:
        cases.close()
    report.derive(records)
    records[0]["wall_s"] = round(time.perf_counter() - start, 1)

    name = f"{runner.today()}-{runner.device_slug()}.json"
    out = args.out or os.path.join(args.out_dir or RESULTS, name)
    report.write_json(records, out)
    plot = os.path.splitext(out)[0] + ".png"
    why_not = report.write_plot(records, plot)

    print()
    print(report.check_table(records))
    print()
    print(report.timing_table(records))
    problems = report.problem_lines(records)
    if problems:
        print(problems)
    errors = [r for r in records if r.get("kind") == "error"]
    failed = [r for r in records if r.get("kind") == "check" and not r["ok"]]
    print(f"\nwrote {out}" + (f" and {plot}" if not why_not else f" (no plot: {why_not})"))
    print(f"{len(failed)} failed checks, {len(errors)} errors, {records[0]['wall_s']} s in all")
    return 1 if (failed or errors) else 0


if __name__ == "__main__":
    sys.exit(main())
