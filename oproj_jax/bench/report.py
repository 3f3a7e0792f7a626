"""Records -> derived figures, a text table, a JSON file and a PNG plot.

Record kinds (one list, written as JSON):
  header  : {"kind": "header", "date", "device", "platform", "versions": {...}, "seed", ...}
  copy    : {"kind": "copy", "us", "gbps", "bytes", "method", "device", "date", ...}
  timing  : {"kind": "timing", "backend", "buffers", "T", "R", "NB", "groups", "has_delta", "us", "device",
             "date", "bytes", "gbps", "pct_roofline", "speedup_vs_reference", "method",
             "us_profiler", "us_kernels" (the kernels' busy time per call from the profiler),
             "us_pipelined", "us_host", "us_donated" (pipelined form: the pipelined slope, the
             host's dispatch time per call, the waited-for slope; `us` = max(us_pipelined,
             us_host), what a caller pays per call: bench/timing.py), ...}
  check   : {"kind": "check", "backend", "config", "prefix_mismatch", "out_rel_l2", "ok", ...}
  skipped : {"kind": "skipped", "backend", "reason", ...}
  plumbing: {"kind": "plumbing", "backend", "buffers", "T", ...}: off the GPU, the timing chains
             ran; no time is recorded there (a CPU's times are not performance figures)

Every figure printed is a physical one: a time that is not measured, or a slope below zero
(within the noise), shows as "-"; a bandwidth above the copy bandwidth measured in the same run
is not shown as a percentage of it (a footnote says why).
"""

from __future__ import annotations

import json
import math
import os


def derive(records: list[dict]) -> None:
    """Fills gbps, pct_roofline (of the measured copy bandwidth) and speedup_vs_reference."""
    copy = next((r for r in records if r.get("kind") == "copy"), None)
    for extra in [r for r in records if r.get("kind") == "copy_variant"]:  # e.g. torch's copy_, measured later
        records.remove(extra)
        if copy is None:
            continue
        variant = {k: v for k, v in extra.items() if k not in ("kind", "variant")} | dict(kind=extra.get("variant"))
        copy.setdefault("variants", []).append(variant)
        if variant["gbps"] > copy["gbps"]:
            copy.update(
                us=variant["us"], gbps=variant["gbps"], gbps_profiler=None, method=f"best of: {variant['method']}"
            )
    copy_gbps = copy["gbps"] if copy and _positive(copy["gbps"]) else None  # a slope below zero: no roofline
    timings = [r for r in records if r.get("kind") == "timing"]
    key = lambda r: (r["T"], r["R"], r["NB"], r["groups"], r.get("buffers"))  # noqa: E731
    reference_us = {key(r): r["us"] for r in timings if r["backend"] == "reference" and _positive(r["us"])}
    for r in timings:
        us = r["us"] if _positive(r["us"]) else None
        r["gbps"] = r["bytes"] / us / 1e3 if us else None
        r["pct_roofline"] = 100.0 * r["gbps"] / copy_gbps if (copy_gbps and r["gbps"]) else None
        ref = reference_us.get(key(r))
        r["speedup_vs_reference"] = ref / us if (ref and us) else None


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def time_cell(value, spec: str) -> str:
    """A time (or any quantity that cannot be negative) as text: "-" when it is not measured, not
    finite, or below zero (a difference of two medians within their noise)."""
    if value is None or not math.isfinite(value) or value < 0:
        return "-"
    return format(value, spec)


OVER_COPY = "*"  # marks a bandwidth above the measured copy bandwidth


def _pct_cell(pct) -> str:
    """% of the copy bandwidth; above 100 it is no bandwidth (see timing_table's footnote)."""
    if pct is None or not math.isfinite(pct):
        return "-"
    return f">100{OVER_COPY}" if pct > 100.0 else f"{pct:.1f}"


def timing_table(records: list[dict]) -> str:
    copy = next((r for r in records if r.get("kind") == "copy"), None)
    rows = sorted(
        (r for r in records if r.get("kind") == "timing"),
        key=lambda r: (r["T"], r.get("buffers") or "", r["backend"]),
    )
    head = (
        "backend",
        "buffers",
        "T",
        "us/call",
        "us(pipe)",
        "us(host)",
        "us(wait)",
        "us(prof)",
        "us(kern)",
        "us(1call)",
        "GB/s",
        "% copy",
        "x ref",
    )
    lines = []
    if copy:
        lines.append(f"copy bandwidth (roofline): {time_cell(copy['gbps'], '.0f')} GB/s")
    if rows:
        r0 = rows[0]
        lines.append(
            f"R={r0['R']} NB={r0['NB']} groups={r0['groups']} has_delta={r0.get('has_delta')}; "
            "bytes = configs.min_bytes (mailbox + prefix + blocks read, prefix + output written)"
        )
        lines.append(
            "us/call: what a caller pays per call = max(us(pipe), us(host)) for the pipelined form (executions "
            "dispatched back to back); us(wait): the same executables, each waited for"
        )
    table = [head] + [
        (
            r["backend"],
            r.get("buffers") or "-",
            str(r["T"]),
            time_cell(r["us"], ".1f"),
            time_cell(r.get("us_pipelined"), ".1f"),
            time_cell(r.get("us_host"), ".1f"),
            time_cell(r.get("us_donated"), ".1f"),
            time_cell(r.get("us_profiler"), ".1f"),
            time_cell(r.get("us_kernels"), ".1f"),
            time_cell(r.get("us_profiler_single"), ".1f"),
            time_cell(r.get("gbps"), ".0f"),
            _pct_cell(r.get("pct_roofline")),
            time_cell(r.get("speedup_vs_reference"), ".2f"),
        )
        for r in rows
    ]
    notes = ['"-": not measured, or a slope below zero (within the noise: raise --reps)']
    if any((r.get("pct_roofline") or 0) > 100.0 for r in rows):
        notes.append(
            f'">100{OVER_COPY}": more bytes per second than the copy measured in the same run moves, so no '
            "bandwidth: the slope is within its noise (noise_us in the JSON) or the inputs were served from cache"
        )
    return "\n".join(lines + _render(table) + notes)


def _render(table: list[tuple[str, ...]]) -> list[str]:
    """Text rows of a table whose first row is the head: first column left-aligned, the rest right."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = []
    for j, row in enumerate(table):
        lines.append("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def decode_label(record: dict) -> str:
    """A decode-step record's backend as logged and shown: "<backend>+capture" where the consumer
    ran with stream_capture=True."""
    return record["backend"] + "+capture" * bool(record.get("stream_capture"))


def decode_step_table(records: list[dict], figures: bool = True) -> str:
    """The decode-step records: step time with and without the consumer, its share per layer;
    figures=False (off the GPU): which steps ran, without their times."""
    rows = sorted(
        (r for r in records if r.get("kind") == "decode_step"),
        key=lambda r: (r["T"], r.get("mailbox", ""), r["loop"], r["backend"], bool(r.get("stream_capture"))),
    )
    head = ("backend", "mailbox", "loop", "T")
    if figures:
        head += ("us/step", "us/step w/o", "us consumer/layer")
    table = [head] + [
        (decode_label(r), r.get("mailbox", "concat"), r["loop"], str(r["T"]))
        + (
            (
                time_cell(r["us_step"], ".1f"),
                time_cell(r["us_step_without_consumer"], ".1f"),
                time_cell(r["us_consumer_per_layer"], ".2f"),
            )
            if figures
            else ()
        )
        for r in rows
    ]
    layers = rows[0]["layers"] if rows else "?"
    device = rows[0].get("device") if rows else None
    title = f"decode step of {layers} layers (o-proj GEMM, consumer, MoE stand-in)" + (
        f" on one {device}" if device else ""
    )
    notes = []
    if figures and any(r["us_consumer_per_layer"] is None or r["us_consumer_per_layer"] < 0 for r in rows):
        notes.append('"-" per layer: the step with the consumer did not take longer than without it (within the noise)')
    if not figures:
        notes.append("the steps compiled and ran; no time is shown off the GPU")
    return "\n".join([title] + _render(table) + notes)


def plumbing_table(records: list[dict]) -> str:
    """Off the GPU: which backends passed their checks and whose timing chains ran, no times."""
    checks = {(r["backend"], r["config"]): r for r in records if r.get("kind") == "check"}
    head = ("backend", "buffers", "T", "config", "check", "timing chains")
    table = [head]
    for r in records:
        if r.get("kind") == "plumbing":
            check = checks.get((r["backend"], r["config"]))
            verdict = "-" if check is None else ("ok" if check["ok"] else "FAIL")
            table.append((r["backend"], r["buffers"] or "-", str(r["T"]), r["config"], verdict, "ran"))
    return "\n".join(_render(table)) if len(table) > 1 else ""


def check_table(records: list[dict]) -> str:
    rows = [r for r in records if r.get("kind") == "check"]
    if not rows:
        return ""
    head = ("backend", "config", "prefix!=ref", "prefix!=model", "out rel L2", "nonfinite", "xmoe!=", "poison", "ok")
    table = [head] + [
        (
            r["backend"],
            r["config"],
            str(r["prefix_mismatch"]),
            str(r["prefix_mismatch_model"]),
            f"{r['out_rel_l2']:.2e}",
            str(r["out_nonfinite"]),
            str(r.get("xmoe_mismatch", "-")),
            r["poison_reused"],
            "ok" if r["ok"] else "FAIL",
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def skipped_lines(records: list[dict]) -> str:
    return "\n".join(
        f"skipped {r['backend']}{' ' + r['what'] if r.get('what') else ''}: {r['reason']}"
        for r in records
        if r.get("kind") == "skipped"
    )


def problem_lines(records: list[dict]) -> str:
    """What did not run: skipped backends/configs, then steps that raised."""
    errors = [f"ERROR {r['backend']} {r['what']}: {r['error']}" for r in records if r.get("kind") == "error"]
    return "\n".join(line for line in [skipped_lines(records), *errors] if line)


def write_json(records: list[dict], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(records, f, indent=1, default=str)
        f.write("\n")


def write_plot(records: list[dict], path: str) -> str | None:
    """Time per call vs T, one line per backend, log-log, with the copy roofline
    (configs.min_bytes / measured copy bandwidth). Returns why not when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        return f"matplotlib is not installed ({err}): pip install oproj-jax[bench]"
    timings = [r for r in records if r.get("kind") == "timing"]
    copy = next((r for r in records if r.get("kind") == "copy"), None)
    header = next((r for r in records if r.get("kind") == "header"), {})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for backend, buffers in sorted({(r["backend"], r.get("buffers") or "") for r in timings}):
        rows = sorted(
            (r for r in timings if r["backend"] == backend and (r.get("buffers") or "") == buffers),
            key=lambda r: r["T"],
        )
        rows = [r for r in rows if _positive(r["us"])]  # a log axis: no time below zero
        label = f"{backend} ({buffers})" if buffers else backend
        ax.plot([r["T"] for r in rows], [r["us"] for r in rows], marker="o", label=label)
    if copy and timings:
        by_t = {r["T"]: r["bytes"] for r in timings}
        ts = sorted(by_t)
        ax.plot(ts, [by_t[t] / copy["gbps"] / 1e3 for t in ts], "k--", label=f"copy roofline ({copy['gbps']:.0f} GB/s)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens T")
    ax.set_ylabel("time per call (us)")
    if timings:
        r0 = timings[0]
        ax.set_title(f"oproj consumer, R={r0['R']} NB={r0['NB']} groups={r0['groups']} - {header.get('device', '')}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
