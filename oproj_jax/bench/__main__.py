"""python -m oproj_jax.bench: time the consumer's backends (and the torch baseline) over T.

  python -m oproj_jax.bench                                  # every available backend, BENCH T
  python -m oproj_jax.bench --backends reference,pallas --tokens 1,64 --json out.json --plot out.png
  python -m oproj_jax.bench --check                          # also check each backend first
  python -m oproj_jax.bench --decode-step --tokens 1,64      # a jitted decode step of 16 layers
  python -m oproj_jax.bench --tp 2                           # TP modes over 2 GPUs, per decode step
  python -m oproj_jax.bench --tp 2 --processes 2             # the same, one process per GPU

Prints a table: what a caller pays per call (bench/timing.py: the larger of the pipelined
slope and the host's dispatch time per call, the waited-for slope beside them), effective
bandwidth (configs.min_bytes / time), % of the copy bandwidth measured in the same run, speedup
over the reference. Progress goes to stderr.

Off a GPU (jax.default_backend() != "gpu") nothing is timed: times taken there are not
performance figures (the kernels do not run there, or run in Mosaic GPU's interpreter, and a
CPU's copy bandwidth is no roofline). The command says so, lists what it would time on a GPU
and exits 0; --cpu-anyway runs a plumbing pass instead (each backend checked against the
reference, its timing chains compiled and run, no time printed or recorded). The Pallas kernel
is interpreted there: it runs only when named (--backends pallas).
"""

from __future__ import annotations

import argparse
import sys
import time


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv):
    from oproj_jax import configs
    from oproj_jax.bench import decode_step

    parser = argparse.ArgumentParser(
        prog="python -m oproj_jax.bench",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 1)[1],
    )
    parser.add_argument(
        "--backends",
        default="all",
        help="comma-separated backend names from the registry, plus 'torch', 'cute-graph' and 'triton-torch' (PyTorch "
        "launches in CUDA graphs); 'all' (default) = every one that can run here (off a GPU: not pallas, which "
        "would run interpreted)",
    )
    parser.add_argument(
        "--cpu-anyway",
        action="store_true",
        help="off a GPU: a plumbing pass instead of nothing (each backend checked against the reference, its timing "
        "chains compiled and run once); no time is printed or recorded, as none would be a performance figure",
    )
    parser.add_argument(
        "--tokens",
        type=_int_list,
        default=None,
        help=f"token counts T (default {','.join(map(str, configs.BENCH_T))} on GPU, 1 for --cpu-anyway)",
    )
    parser.add_argument("--ranks", type=int, default=configs.TP, help="R, mailbox slots (default %(default)s)")
    parser.add_argument("--nb", type=int, default=8, help="completed blocks NB, 0..8 (default %(default)s)")
    parser.add_argument("--groups", type=int, default=4, help="rank-sum groups, 1..4 (default %(default)s)")
    parser.add_argument("--no-delta", action="store_true", help="has_delta=False (default: True)")
    parser.add_argument(
        "--reps", type=int, default=None, help="timed executions per chain length (default 20 GPU, 1 CPU)"
    )
    parser.add_argument("--seed", type=int, default=None, help="input seed (default: from the clock)")
    parser.add_argument("--check", action="store_true", help="check each backend against the reference first")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiler cross-check (GPU)")
    parser.add_argument(
        "--buffers",
        default="pipelined",  # bench.timing.RECORD_FORM (jax, which timing imports, starts after parsing)
        help="the chain's forms, comma-separated (bench/timing.py BUFFERS): 'pipelined' (default: a decode loop's, "
        "the state donated from one execution to the next, no buffer moves, executions dispatched back to back), "
        "'donated' (the same, each execution waited for: the host's work before each launch adds to the "
        "device's) and/or 'rotated' (new buffers every execution, so XLA updates its CUDA graph before each "
        "launch); the profiler's kernel time is taken with the first",
    )
    parser.add_argument(
        "--l2-warm",
        action="store_true",
        help="diagnostic: every call reads the same input set (L2-warm when it fits); not a benchmark",
    )
    parser.add_argument(
        "--decode-step",
        action="store_true",
        help="time a jitted decode step of --layers layers (o-proj GEMM, consumer, MoE stand-in) "
        "with and without the consumer (bench/decode_step.py)",
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="layers per decode step (default 16; 2 for --cpu-anyway)"
    )
    parser.add_argument(
        "--moe-width",
        type=int,
        default=decode_step.F,
        metavar="F",
        help="with --decode-step: the MoE stand-in's width (default %(default)s: ~36 MB of weights streamed "
        "per layer; 64 streams ~7 MB)",
    )
    parser.add_argument(
        "--decode-profile",
        action="store_true",
        help="with --decode-step on a GPU: also where each step's device time goes, kernel by kernel "
        "(a jax.profiler trace of a few steps with and without the consumer)",
    )
    parser.add_argument(
        "--decode-loops",
        default="scan,unrolled",
        help="with --decode-step: the layer loops, comma-separated (scan, unrolled; default %(default)s)",
    )
    parser.add_argument(
        "--decode-capture",
        choices=("off", "on", "both"),
        default="off",
        help="with --decode-step: the consumer with stream_capture=True (on), as a graph node (off, the default), "
        "or both, each timed against the same step without the consumer (bench/decode_step.py)",
    )
    parser.add_argument(
        "--mailboxes",
        default="carried,partial,concat",
        help="with --decode-step: how each layer's mailbox is formed, comma-separated "
        "(bench/decode_step.py MAILBOXES; default %(default)s)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="N",
        help="time the TP layer over N local GPUs: every mode x backend, per decode step (bench/tp.py)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="P",
        help="with --tp: run the mesh as P jax.distributed processes on this host, one GPU each (bench/tp.py)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the records as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG: time vs T per backend, log-log, copy roofline")
    args = parser.parse_args(argv)
    for name, value, lo, hi in (
        ("--ranks", args.ranks, 1, None),
        ("--nb", args.nb, 0, 8),
        ("--groups", args.groups, 1, 4),
        ("--moe-width", args.moe_width, 1, None),
    ):
        if value < lo or (hi is not None and value > hi):
            parser.error(f"{name}: expected {lo}..{hi if hi is not None else 'inf'}, got {value}")
    unknown = set(args.mailboxes.split(",")) - set(decode_step.MAILBOXES)
    if unknown:
        parser.error(f"--mailboxes: expected some of {','.join(decode_step.MAILBOXES)}, got {args.mailboxes!r}")
    from oproj_jax.bench.timing import parse_buffers

    try:
        args.buffers = parse_buffers(args.buffers)
    except ValueError as err:
        parser.error(str(err))
    if args.reps is not None and args.reps < 1:
        parser.error(f"--reps: expected >= 1, got {args.reps}")
    return args


def _wanted(args, status: dict[str, str | None], figures: bool) -> list[str]:
    """The backends to run: named ones (known to `status`), or with 'all' every one that can run
    here (off a GPU not pallas, which would run interpreted), each left out with its reason on
    stderr."""
    if args.backends == "all":
        wanted = [name for name, reason in status.items() if reason is None]
        for name, reason in status.items():
            if reason is not None:
                print(f"not timing {name}: {reason}", file=sys.stderr)
        if not figures and "pallas" in wanted:
            wanted.remove("pallas")
            print(
                "not running pallas: off a GPU it runs in Mosaic GPU's interpreter (slow); name it: --backends pallas",
                file=sys.stderr,
            )
        return wanted
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    for name in [b for b in wanted if status[b] is not None]:
        print(f"not timing {name}: {status[name]}", file=sys.stderr)
    return [b for b in wanted if status[b] is None]


def gpu_plan(args, platform: str) -> str:
    """What this command says off a GPU: why it times nothing, what it would time on a GPU."""
    from oproj_jax import configs

    tokens = ",".join(map(str, args.tokens or configs.BENCH_T))
    backends = "every backend that can run there" if args.backends == "all" else f"backends {args.backends}"
    if args.tp is not None:
        what = f"the TP layer over {args.tp} GPUs (bench/tp.py), every mode x backend, per decode step"
    elif args.decode_step:
        what = (
            f"a jitted decode step of {args.layers or 16} layers with and without the consumer ({backends}; "
            f"mailboxes {args.mailboxes})"
        )
    else:
        what = (
            f"{backends} at T = {tokens}, R={args.ranks} NB={args.nb} groups={args.groups} "
            f"has_delta={not args.no_delta}: "
            f"the slope of unrolled chains of dependent calls in the {','.join(args.buffers)} form, "
            f"{args.reps or 20} executions per chain length (bench/timing.py), what a caller pays per call with "
            "the host's dispatch time and the waited-for slope beside it, the copy bandwidth as the roofline"
            + ("" if args.no_profile else ", the profiler's kernel time")
        )
    return "\n".join(
        [
            f"platform {platform!r} has no GPU: times taken here are not performance figures, so nothing is timed.",
            "The kernels do not run on this platform, or run in Mosaic GPU's interpreter, and its copy bandwidth is "
            "no roofline: a time taken here says nothing about the op's speed.",
            f"On a CUDA GPU this command times {what}.",
            "Run it there; or pass --cpu-anyway for a plumbing pass here (each backend checked against the reference, "
            "its timing chains compiled and run, no time printed).",
        ]
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    from oproj_jax import configs
    from oproj_jax.bench import backends as bench_backends
    from oproj_jax.bench import inputs as bench_inputs
    from oproj_jax.bench import report, runner

    platform = jax.default_backend()
    figures = platform == "gpu"  # times are performance figures on a GPU only
    status = bench_backends.backend_status(platform)
    if args.backends != "all":  # a name nothing knows is an error on every platform
        unknown = [b for b in (b.strip() for b in args.backends.split(",")) if b and b not in status]
        if unknown:
            print(f"error: --backends: unknown {unknown}; known: {sorted(status)}", file=sys.stderr)
            return 2
    if not figures and not args.cpu_anyway:
        print(gpu_plan(args, platform))
        return 0
    if args.tp is not None:
        from oproj_jax.bench import tp

        if args.processes > 1:
            tokens = ",".join(map(str, args.tokens or [1, 8, 64]))
            more = ["--json", args.json] if args.json else []
            return tp.main(
                [
                    "--tp",
                    str(args.tp),
                    "--tokens",
                    tokens,
                    "--reps",
                    str(args.reps or 20),
                    "--processes",
                    str(args.processes),
                    *more,
                ]
            )
        tp.run(args.tp, args.tokens or [1, 8, 64], args.reps or 20, args.json)
        return 0
    wanted = _wanted(args, status, figures)
    if not wanted:
        print("error: none of the requested backends can run here", file=sys.stderr)
        return 2
    if not figures:
        print(
            f"platform {platform!r} has no GPU: a plumbing pass, not performance figures: each backend is checked "
            "against the reference and its timing chains compiled and run; no time is printed or recorded"
        )

    tokens = args.tokens or (list(configs.BENCH_T) if figures else [1])
    if not figures and max(tokens) > 64 and "pallas" in wanted:
        print(
            f"note: on {platform}, pallas runs interpreted: large T (max {max(tokens)}) will be slow", file=sys.stderr
        )
    bench_configs = [
        configs.Config(args.ranks, t, args.nb, groups=args.groups, has_delta=not args.no_delta) for t in tokens
    ]
    reps = args.reps or (20 if figures else 1)
    seed = args.seed if args.seed is not None else int(time.time()) % 2**31
    profile = figures and not args.no_profile

    records = [
        runner.header(
            seed,
            status,
            argv=list(sys.argv[1:] if argv is None else argv),
            performance_figures=figures,
        )
    ]
    if args.decode_step:
        from oproj_jax.bench import decode_step

        records += decode_step.run(
            wanted,
            tokens,
            layers=args.layers or (16 if figures else 2),
            reps=args.reps or (30 if figures else 1),
            repeats=5 if figures else 1,
            log=lambda m: print(m, file=sys.stderr, flush=True),
            mailboxes=args.mailboxes.split(","),
            figures=figures,
            profile=args.decode_profile and figures,
            loops=tuple(args.decode_loops.split(",")),
            moe_width=args.moe_width,
            captures={"off": (False,), "on": (True,), "both": (False, True)}[args.decode_capture],
        )
        print(report.decode_step_table(records, figures=figures))
        if args.json:
            report.write_json(records, args.json)
        return 0
    cases = bench_inputs.HostCases(bench_configs, seed)
    try:
        if args.check or not figures:  # the plumbing pass always checks: what it can say off the GPU
            records += runner.run_checks(wanted, bench_configs, cases)
        if figures:
            records.append(runner.run_copy(platform, reps, profile))
        records += runner.run_timings(
            wanted,
            bench_configs,
            cases,
            platform,
            reps,
            profile,
            l2_warm=args.l2_warm,
            buffers=args.buffers,
            figures=figures,
        )
    finally:
        cases.close()
    if figures:
        report.derive(records)
        print(report.timing_table(records))
    else:
        print(report.plumbing_table(records))
    if args.check and figures:
        print()
        print(report.check_table(records))
    problems = report.problem_lines(records)
    if problems:
        print(problems)
    if args.json:
        report.write_json(records, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        why_not = report.write_plot(records, args.plot) if figures else "no performance figures off the GPU"
        print(f"not plotting: {why_not}" if why_not else f"wrote {args.plot}", file=sys.stderr)
    errors = [r for r in records if r.get("kind") == "error"]
    failed = [r for r in records if r.get("kind") == "check" and not r["ok"]]
    return 1 if (errors or failed) else 0


if __name__ == "__main__":
    sys.exit(main())
