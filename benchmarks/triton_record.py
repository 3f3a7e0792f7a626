"""The Triton benchmark of record: several runs of benchmarks/triton_gpu.py (separate processes
or device calls) merged into one JSON, the median per T and launch.

  python3 benchmarks/triton_record.py --out FILE RUN.json RUN.json RUN.json

For each T, the timings of its configuration (plan.default_variant; the JAX launch through the
package's target and through jax_triton, per chain form; the PyTorch launch) become one record
each with "record": true: us = the median slope over the runs, us_kernels = the median profiler
kernel time where a run has one, the per-run values beside. Every run's records follow
unchanged ("run": its index).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root


def merge(runs: list[list[dict]]) -> list[dict]:
    from oproj_jax import configs
    from oproj_jax.triton import plan

    groups: dict[tuple, list[dict]] = {}
    for records in runs:
        for r in records:
            if r.get("kind") == "timing" and r["variant"] == plan.default_variant(r["T"], configs.HIDDEN):
                key = (r["T"], r["backend"], r.get("launch") or "", r.get("buffers") or "")
                groups.setdefault(key, []).append(r)
    merged = []
    for (T, backend, launch, buffers), rs in sorted(groups.items()):
        kernels = [r["us_kernels"] for r in rs if r.get("us_kernels") is not None]
        first = rs[0]
        how = (
            "PyTorch launch: slope of CUDA-graph chains"
            if backend == "triton-torch"
            else f"JAX launch ({launch}): slope of unrolled jitted chains"
        )
        merged.append(
            dict(
                {
                    k: first[k]
                    for k in ("kind", "backend", "T", "R", "NB", "groups", "has_delta", "variant")
                    if k in first
                },
                **({"launch": launch} if launch else {}),
                **({"buffers": buffers} if buffers else {}),
                us=statistics.median(r["us"] for r in rs),
                us_runs=[r["us"] for r in rs],
                us_kernels=statistics.median(kernels) if kernels else None,
                us_kernels_runs=kernels,
                device=first.get("device"),
                date=first.get("date"),
                record=True,
                method=f"{how}; us_kernels from the profiler where the run traced it; median over {len(rs)} runs",
            )
        )
    return merged


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("runs", nargs="+", help="JSON files of benchmarks/triton_gpu.py")
    args = parser.parse_args(argv)
    runs = [json.loads(Path(p).read_text()) for p in args.runs]
    history = [dict(r, run=i) for i, records in enumerate(runs) for r in records if r.get("kind") != "header"]
    header = next((r for r in runs[0] if r.get("kind") == "header"), {"kind": "header"})
    merged = merge(runs)
    Path(args.out).write_text(json.dumps([header, *merged, *history], indent=1) + "\n")
    for r in merged:
        kernels = "-" if r["us_kernels"] is None else f"{r['us_kernels']:.2f}"
        print(
            f"{r['backend']:12s} {r.get('launch', ''):10s} {r.get('buffers', ''):8s} T={r['T']:5d} {r['variant']:24s} "
            f"us {r['us']:8.2f}  kernels {kernels}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
