"""Records -> derived figures, a text table, a JSON file and a PNG plot.

Record kinds (one list, written as JSON):
  header  : {"kind": "header", "date", "device", "platform", "versions": {...}, "seed", ...}
  copy    : {"kind": "copy", "us", "gbps", "bytes", "method", "device", "date", ...}
  timing  : {"kind": "timing", "backend", "buffers", "T", "R", "NB", "groups", "has_delta", "us", "device",
             "date", "bytes", "gbps", "pct_roofline", "speedup_vs_reference", "method",
             "us_profiler", "us_kernels" (the kernels' busy time per call from the profiler),
             "us_host" (pipelined form: the host's dispatch time per call), ...}
  check   : {"kind": "check", "backend", "config", "prefix_mismatch", "out_rel_l2", "ok", ...}
  skipped : {"kind": "skipped", "backend", "reason", ...}
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
    copy_gbps = copy["gbps"] if copy else None
    timings = [r for r in records if r.get("kind") == "timing"]
    key = lambda r: (r["T"], r["R"], r["NB"], r["groups"], r.get("buffers"))  # noqa: E731
    reference_us = {key(r): r["us"] for r in timings if r["backend"] == "reference"}
    for r in timings:
        r["gbps"] = r["bytes"] / r["us"] / 1e3 if r["us"] > 0 else None
        r["pct_roofline"] = 100.0 * r["gbps"] / copy_gbps if (copy_gbps and r["gbps"]) else None
        ref = reference_us.get(key(r))
        r["speedup_vs_reference"] = ref / r["us"] if (ref and r["us"] > 0) else None


def _fmt(value, spec: str, missing: str = "-") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return missing
    return format(value, spec)


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
        "us(host)",
        "us(prof)",
        "us(kern)",
        "us(1call)",
        "GB/s",
        "% copy",
        "x ref",
    )
    lines = []
    if copy:
        lines.append(f"copy bandwidth (roofline): {copy['gbps']:.0f} GB/s")
    if rows:
        r0 = rows[0]
        lines.append(
            f"R={r0['R']} NB={r0['NB']} groups={r0['groups']} has_delta={r0.get('has_delta')}; "
            "bytes = configs.min_bytes (mailbox + prefix + blocks read, prefix + output written)"
        )
    table = [head] + [
        (
            r["backend"],
            r.get("buffers") or "-",
            str(r["T"]),
            _fmt(r["us"], ".1f"),
            _fmt(r.get("us_host"), ".1f"),
            _fmt(r.get("us_profiler"), ".1f"),
            _fmt(r.get("us_kernels"), ".1f"),
            _fmt(r.get("us_profiler_single"), ".1f"),
            _fmt(r.get("gbps"), ".0f"),
            _fmt(r.get("pct_roofline"), ".1f"),
            _fmt(r.get("speedup_vs_reference"), ".2f"),
        )
        for r in rows
    ]
    return "\n".join(lines + _render(table))


def _render(table: list[tuple[str, ...]]) -> list[str]:
    """Text rows of a table whose first row is the head: first column left-aligned, the rest right."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = []
    for j, row in enumerate(table):
        lines.append("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def decode_step_table(records: list[dict]) -> str:
    """The decode-step records: step time with and without the consumer, its share per layer."""
    rows = sorted(
        (r for r in records if r.get("kind") == "decode_step"),
        key=lambda r: (r["T"], r.get("mailbox", ""), r["loop"], r["backend"]),
    )
    head = ("backend", "mailbox", "loop", "T", "us/step", "us/step w/o", "us consumer/layer")
    table = [head] + [
        (
            r["backend"],
            r.get("mailbox", "concat"),
            r["loop"],
            str(r["T"]),
            _fmt(r["us_step"], ".1f"),
            _fmt(r["us_step_without_consumer"], ".1f"),
            _fmt(r["us_consumer_per_layer"], ".2f"),
        )
        for r in rows
    ]
    layers = rows[0]["layers"] if rows else "?"
    return "\n".join(
        [f"decode step of {layers} layers (o-proj GEMM, consumer, MoE stand-in), one GPU"] + _render(table)
    )


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
