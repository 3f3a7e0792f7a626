"""The benchmark of record: the chain slope (what a jitted loop pays per call) of each backend,
measured in several separate processes, the median kept; then the decode step. With --tp N, the
tensor-parallel step instead (python -m oproj_jax.bench.tp: every mode x backend on N GPUs).

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/record.py --out-dir $OUT
  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/record.py --out-dir $OUT --tp 2 --name tp2

Each process is `python -m oproj_jax.bench` (bench/timing.py: slope of unrolled chains of
dependent calls) in the chain's forms, the first the record's `us`: "pipelined" (a decode
loop's: the state donated from one execution to the next, no buffer moves, executions
dispatched back to back, so the host's work per execution overlaps the device's; its `us` is
max(`us_pipelined`, `us_host`), the slope or the host's dispatch time per call where that is
the larger: what a caller dispatching back to back pays; its records carry `us_donated`, the
same executables waited for), "donated" (every execution waited for: the host's work before
each launch adds to the device's; `us_donated`) and, in the first process only, "rotated" (every buffer
new each execution; `us_rotated`). The first process also takes the profiler's kernel time
(`us_kernels`). Slopes move from one process to the next (the waited-for form's by several
microseconds at T <= 64), so the record is the median over the processes, with every process's
value kept (`us_runs`). Writes <out-dir>/<date>-<device>-<name>.json: a header, one record per
backend and T (kind "timing", "record": true), the decode-step records, and the processes' logs.
Until then <out-dir>/<name>-logs.json holds the logs of the processes done so far, so a run
stopped from outside still leaves them for --relog.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time


def bench(args: list[str], timeout: float, module: str = "oproj_jax.bench") -> tuple[list[dict], str]:
    """Runs `python -m MODULE ARGS --json F` in a fresh process; (records, log)."""
    path = f"/tmp/oproj_record_{os.getpid()}_{time.monotonic_ns()}.json"
    try:
        done = subprocess.run(
            [sys.executable, "-m", module, *args, "--json", path],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        log = done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        text = lambda out: out.decode(errors="replace") if isinstance(out, bytes) else (out or "")  # noqa: E731
        log = f"timed out after {timeout} s: {text(err.stdout)}{text(err.stderr)}"
        return records_from_log(log), log
    try:
        with open(path) as f:
            return json.load(f), log
    except (OSError, ValueError):
        return [], log


# bench/runner.py _log_timing's line: "time T=   64 cute       donated        9.5 us/call  (profiler
# 16.3, kernels 16.34, busy 9.42) ..."
LOGGED_TIMING = re.compile(
    r"time T=\s*(?P<T>\d+) (?P<backend>\S+)\s+(?P<buffers>donated|rotated|pipelined)\s+(?P<us>-?[\d.]+) us/call"
    r"(?:\s+\(profiler [-\d.]+, kernels [-\d.]+, busy (?P<busy>-?[\d.]+)\))?"
    r"(?:\s+\(1-call jit profiler [-\d.]+\))?"
    r"(?:\s+\(pipelined (?P<pipelined>[-\d.]+), host (?P<host>[-\d.]+), waited (?P<waited>[-\d.]+)\))?"
)
# bench/decode_step.py's line: "decode step T=   1 carried scan     cute   563.9 us/step, without consumer
# 480.5 -> consumer   5.21 us/layer"
LOGGED_DECODE = re.compile(
    r"decode step T=\s*(?P<T>\d+) (?P<mailbox>\S+)\s+(?P<loop>\S+)\s+(?P<backend>[^\s+]+)(?P<capture>\+capture)?\s+"
    r"(?P<with>[\d.]+) us/step, "
    r"without consumer\s+(?P<without>[\d.]+) -> consumer\s+(?P<share>-?[\d.]+) us/layer"
)


def _logged(value: str | None) -> float | None:
    """A logged figure; "-" (not measured, or below the noise) and absent ones are None."""
    return None if value in (None, "-") else float(value)


def records_from_log(log: str) -> list[dict]:
    """The timings and decode steps a process logged before it was stopped (it writes its JSON
    only at the end), at the precision they were logged, marked recovered_from_log. The shape is
    the bench CLI's default, the only one this script runs."""
    from oproj_jax.bench.__main__ import parse_args

    cli = parse_args([])
    shape = dict(R=cli.ranks, NB=cli.nb, groups=cli.groups, has_delta=not cli.no_delta)
    timings = [
        dict(
            kind="timing",
            backend=m["backend"],
            buffers=m["buffers"],
            T=int(m["T"]),
            **shape,
            us=float(m["us"]),
            **{
                name: value
                for name, group in (("us_pipelined", "pipelined"), ("us_host", "host"), ("us_donated", "waited"))
                if (value := _logged(m[group])) is not None
            },
            us_kernels=_logged(m["busy"]),
            device=None,
            method="recovered from the process's log line (the slope to 0.1 us, its forms to 0.01 us)",
            recovered_from_log=True,
        )
        for m in LOGGED_TIMING.finditer(log)
    ]
    decode = [
        dict(
            kind="decode_step",
            backend=m["backend"],
            loop=m["loop"],
            mailbox=m["mailbox"],
            T=int(m["T"]),
            R=cli.ranks,
            NB=cli.nb,
            layers=16,  # the CLI's default on a GPU, the only one this script runs
            **({"stream_capture": True} if m["capture"] else {}),
            us_step=float(m["with"]),
            us_step_without_consumer=float(m["without"]),
            us_consumer_per_layer=float(m["share"]),
            device=None,
            method="recovered from the process's log line (step times to 0.1 us, the share to 0.01 us)",
            recovered_from_log=True,
        )
        for m in LOGGED_DECODE.finditer(log)
    ]
    return timings + decode


def merge(runs: list[list[dict]], primary: str | None = None) -> list[dict]:
    """One record per (mode, backend, T[, process_index]): the median slope over the runs that
    timed it (mode: the TP layout of a --tp run, None for a single-GPU run; process_index: the
    view of one process of a mesh spanning several, None when one process drives the mesh).
    Where the chain ran in several forms (bench/timing.py BUFFERS), `us` is the `primary` form's
    median (default: the first form met) and `us_<form>` (with `us_<form>_runs`) each other
    form's; `us_pipelined`, `us_host` and `us_donated` are the medians of the primary records'
    own fields where they carry them (bench/timing.py's pipelined records and bench.tp's), a
    separately timed form of the same name taking precedence."""
    by_key: dict[tuple, list[dict]] = {}
    others: dict[tuple, list[float]] = {}  # (form, *key): slopes
    for records in runs:
        for r in records:
            if r.get("kind") != "timing":
                continue
            form = r.get("buffers")
            primary = primary or form
            view = r["process_index"] if r.get("processes", 1) > 1 else -1
            key = (r.get("mode") or "", r["backend"], r["T"], view)
            if form == primary:
                by_key.setdefault(key, []).append(r)
            else:
                others.setdefault((form, *key), []).append(r["us"])
    merged = []
    for (mode, backend, T, view), rs in sorted(by_key.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1], kv[0][3])):
        kernels = [r["us_kernels"] for r in rs if r.get("us_kernels") is not None]
        forms = {f"us_{form}" for (form, *key) in others if tuple(key) == (mode, backend, T, view)}
        own = {
            name: values
            for name in ("us_pipelined", "us_host", "us_donated")
            if name not in forms and (values := [r[name] for r in rs if r.get(name) is not None])
        }
        first = next((r for r in rs if not r.get("recovered_from_log")), rs[0])
        tp = dict(mode=mode, gpus=first.get("gpus")) if mode else {}
        if view >= 0:
            tp.update(processes=first["processes"], process_index=view)
        merged.append(
            dict(
                kind="timing",
                record=True,
                backend=backend,
                **tp,
                T=T,
                R=first["R"],
                NB=first["NB"],
                groups=first.get("groups"),
                has_delta=first.get("has_delta"),
                buffers=first.get("buffers"),
                us=statistics.median(r["us"] for r in rs),
                us_runs=[r["us"] for r in rs],
                **(
                    dict(us_runs_from_log=[i for i, r in enumerate(rs) if r.get("recovered_from_log")])
                    if any(r.get("recovered_from_log") for r in rs)
                    else {}
                ),
                **{
                    field: value
                    for name, values in own.items()
                    for field, value in ((name, statistics.median(values)), (f"{name}_runs", values))
                },
                **{
                    name: value
                    for (form, *key), slopes in sorted(others.items())
                    if tuple(key) == (mode, backend, T, view)
                    for name, value in ((f"us_{form}", statistics.median(slopes)), (f"us_{form}_runs", slopes))
                },
                us_kernels=statistics.median(kernels) if kernels else None,
                noise_us=[r.get("noise_us") for r in rs],
                device=first["device"],
                date=first.get("date"),
                bytes=first.get("bytes"),
                method=f"median over {len(rs)} runs of: {first['method']}; us_kernels: the profiler's kernel time "
                "per call in the chain",
            )
        )
    return merged


def merge_decode(runs: list[list[dict]]) -> list[dict]:
    """One decode-step record per (backend, mailbox form, loop, T, stream_capture): the medians over the
    processes of the step time with and without the consumer and of the consumer's share per
    layer, every process's value kept (`*_processes`)."""
    by_key: dict[tuple, list[dict]] = {}
    for records in runs:
        for r in records:
            if r.get("kind") == "decode_step":
                key = (r["backend"], r["mailbox"], r["loop"], r["T"], bool(r.get("stream_capture")))
                by_key.setdefault(key, []).append(r)
    merged = []
    for rs in by_key.values():
        out = {k: v for k, v in rs[0].items() if not k.endswith("_runs")}
        for name in ("us_step", "us_step_without_consumer", "us_consumer_per_layer"):
            out[name] = statistics.median(r[name] for r in rs)
            out[f"{name}_processes"] = [r[name] for r in rs]
        out.update(record=True, method=f"median over {len(rs)} processes of: {rs[0]['method']}")
        merged.append(out)
    return merged


def kept_logs_path(args) -> str:
    """Where the logs of the processes done so far wait for the record (--relog reads it)."""
    return os.path.join(args.out_dir, f"{args.name}-logs.json")


def keep_logs(args, logs: dict) -> None:
    with open(kept_logs_path(args), "w") as f:
        json.dump(dict(logs=logs), f, indent=1)


def measure(args, module: str, common: list[str]) -> tuple[list, list, dict]:
    """The processes: the chains' (`runs`), then the decode step's; their logs' ends kept, and
    written out after each process (kept_logs_path)."""
    runs, logs = [], {}
    for i in range(args.processes):
        if args.tp:
            extra = [] if i == 0 else ["--no-profile"]
        else:  # the later processes leave out the rotated form
            later = ",".join(f for f in args.buffers.split(",") if f != "rotated") or args.buffers
            extra = ["--buffers", args.buffers] if i == 0 else ["--no-profile", "--buffers", later]
        records, log = bench(common + extra, args.timeout, module)
        runs.append(records)
        logs[f"process {i}"] = log[-6000:]
        keep_logs(args, logs)
        print(f"process {i}: {sum(r.get('kind') == 'timing' for r in records)} timings", flush=True)
    decode_runs = []
    for i in range(args.decode_processes if args.decode_tokens else 0):
        decode_args = ["--decode-step", "--backends", args.decode_backends or args.backends]
        decode_args += ["--mailboxes", args.decode_mailboxes, "--tokens", args.decode_tokens, "--reps", "30"]
        decode_args += ["--decode-capture", args.decode_capture]
        records, log = bench(decode_args, args.decode_timeout or args.timeout)
        decode_runs.append(records)
        logs[f"decode step {i}"] = log[-6000:]
        keep_logs(args, logs)
    return runs, decode_runs, logs


def relog(paths: list[str]) -> tuple[list, list, dict]:
    """The processes of earlier outputs again, from the logs they kept: for a run whose processes
    were stopped before writing their JSON (records_from_log)."""
    runs, decode_runs, logs = [], [], {}
    for path in paths:
        with open(path) as f:
            kept = json.load(f)["logs"]
        for name, log in kept.items():
            logs[f"{os.path.basename(path)}: {name}"] = log
            (decode_runs if name.startswith("decode step") else runs).append(records_from_log(log))
    return runs, decode_runs, logs


def measured_records(args, module: str, common: list[str]) -> tuple[list[dict], dict]:
    """The records of this run's processes (or of --relog's kept logs), merged; (records, logs)."""
    if args.relog:
        runs, decode_runs, logs = relog(args.relog)
    else:
        runs, decode_runs, logs = measure(args, module, common)
    header = next((r for rs in runs for r in rs if r.get("kind") == "header"), None) or next(
        (r for rs in decode_runs for r in rs if r.get("kind") == "header"), None
    )
    header = header or dict(
        kind="header",
        device=next((r.get("device") for rs in runs for r in rs if r.get("device")), args.device or "gpu"),
    )
    if args.relog:
        header.update(relogged_from=[os.path.basename(p) for p in args.relog])
    records = [
        header,
        *merge(runs, primary=None if args.tp else args.buffers.split(",")[0]),
        *merge_decode(decode_runs),
        *(r for rs in runs for r in rs if r.get("kind") in ("error", "copy")),
    ]
    return records, logs


def join(paths: list[str]) -> tuple[list[dict], dict]:
    """One record of complete outputs of separate runs of this script on one device (the chains
    in one, the decode step in another: each fits a bounded call where both together may not):
    the first output's header, marked joined_from, then every output's records and logs."""
    outputs = []
    for path in paths:
        with open(path) as f:
            outputs.append((os.path.basename(path), json.load(f)))
    devices = {r.get("device") for _, out in outputs for r in out["records"] if r.get("kind") == "header"}
    if len(devices) != 1:
        raise SystemExit(
            f"--join: the outputs come from different devices ({sorted(map(str, devices))}); join one device's"
        )
    header = dict(next(r for r in outputs[0][1]["records"] if r.get("kind") == "header"))
    header.update(joined_from=[name for name, _ in outputs])
    records = [header, *(r for _, out in outputs for r in out["records"] if r.get("kind") != "header")]
    logs = {f"{name}: {key}": log for name, out in outputs for key, log in out.get("logs", {}).items()}
    return records, logs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--backends", default="cute,pallas,reference")
    parser.add_argument("--tokens", default="1,8,64,512,4096")
    parser.add_argument("--reps", type=int, default=60, help="executions per chain length and process")
    parser.add_argument(
        "--buffers",
        default="pipelined,donated,rotated",
        help="the chain's forms (bench/timing.py BUFFERS; default %(default)s), the first the record's `us`: every "
        "form in the first process, all but rotated in the others",
    )
    parser.add_argument("--decode-tokens", default="1,64")
    parser.add_argument("--decode-backends", default=None, help="the decode step's backends (default: --backends)")
    parser.add_argument("--decode-processes", type=int, default=3, help="processes timing the decode step")
    parser.add_argument(
        "--decode-mailboxes", default="carried,partial", help="the decode step's mailbox forms (bench --mailboxes)"
    )
    capture = "the decode step's consumer as a graph node (off), with stream_capture=True (on) or both (bench)"
    parser.add_argument("--decode-capture", choices=("off", "on", "both"), default="both", help=capture)
    parser.add_argument(
        "--decode-timeout", type=float, default=None, help="seconds per decode process (default --timeout)"
    )
    parser.add_argument("--timeout", type=float, default=200.0, help="seconds per process")
    parser.add_argument("--name", default="record", help="file name suffix: <date>-<device>-<name>.json")
    parser.add_argument("--tp", type=int, default=0, help="time the TP step on this many GPUs instead")
    parser.add_argument("--modes", default=None, help="with --tp: only these modes, comma-separated")
    parser.add_argument("--chain", default=None, help="with --tp: chain lengths K1,K2 (bench.tp --chain)")
    parser.add_argument(
        "--tp-processes",
        type=int,
        default=1,
        help="with --tp: the mesh as this many jax.distributed processes, one GPU each (bench.tp --processes); "
        "each process's view is kept apart (process_index)",
    )
    parser.add_argument(
        "--relog",
        nargs="+",
        default=None,
        metavar="JSON",
        help="measure nothing: merge again the logs kept in these earlier outputs (processes stopped before "
        "writing their JSON), with --device naming the GPU they ran on",
    )
    parser.add_argument("--device", default=None, help="the device's name where the records do not carry it")
    parser.add_argument(
        "--join",
        nargs="+",
        default=None,
        metavar="JSON",
        help="measure nothing: one record of these complete outputs of one device (e.g. a run with "
        "--decode-tokens '' and one with --processes 0), under --name",
    )
    args = parser.parse_args(argv)

    if args.tp:
        module, common = "oproj_jax.bench.tp", ["--tp", str(args.tp), "--tokens", args.tokens, "--reps", str(args.reps)]
        common += ["--modes", args.modes] if args.modes else []
        common += ["--chain", args.chain] if args.chain else []
        common += ["--processes", str(args.tp_processes)] if args.tp_processes > 1 else []
        args.decode_tokens = ""
    else:
        module, common = (
            "oproj_jax.bench",
            ["--backends", args.backends, "--tokens", args.tokens, "--reps", str(args.reps)],
        )
    if args.join:
        records, logs = join(args.join)
        header = records[0]
    else:
        records, logs = measured_records(args, module, common)
        header = records[0]
    for r in records:
        if r.get("kind") in ("timing", "decode_step") and not r.get("device"):
            r["device"] = header["device"]
    device = "".join(c if c.isalnum() else "-" for c in str(header.get("device", "gpu")).lower()).strip("-")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    path = os.path.join(args.out_dir, f"{date}-{device}-{args.name}.json")
    with open(path, "w") as f:
        json.dump(dict(records=records, logs=logs), f, indent=1)
    if not (args.relog or args.join) and os.path.exists(kept_logs_path(args)):
        os.remove(kept_logs_path(args))  # the record holds them now
    print(f"wrote {path}")
    print(
        f"{'backend':16s} {'T':>5s} {'us (median)':>12s}  {'runs':24s} {'us_kernels':>10s} {'us_host':>8s} "
        f"{'us_donated':>10s} {'us_rotated':>10s} {'us_pipelined':>12s}"
    )
    for r in records:
        if r.get("kind") == "timing":
            runs_text = "/".join(f"{u:.2f}" for u in r["us_runs"])
            view = f" p{r['process_index']}" if "process_index" in r else ""
            print(
                f"{(r.get('mode', '') + '/' + r['backend']).strip('/') + view:16s} {r['T']:5d} {r['us']:12.2f}  {runs_text:24s} "
                f"{r['us_kernels'] if r['us_kernels'] is None else round(r['us_kernels'], 2)!s:>10s} "
                + " ".join(
                    f"{round(r[name], 2) if name in r else '-'!s:>{width}s}"
                    for name, width in (("us_host", 8), ("us_donated", 10), ("us_rotated", 10), ("us_pipelined", 12))
                )
            )
        elif r.get("kind") == "decode_step":
            print(
                f"decode {r['backend'] + '+capture' * bool(r.get('stream_capture')):14s} {r['mailbox']:7s} "
                f"{r['loop']:8s} T={r['T']:4d} {r['us_step']:9.1f} us/step, "
                f"consumer {r['us_consumer_per_layer']:6.2f} us/layer"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
