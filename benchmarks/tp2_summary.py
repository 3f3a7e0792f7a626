"""The last word of benchmarks/tp2_session.sh: the timing table of the TP benchmark, mode="peer"
against its targets, and the GPU tests' verdict. Usage: python3 benchmarks/tp2_summary.py OUTDIR"""

import json
import pathlib
import re
import sys

TARGETS_US = {1: 8.0, 8: 9.0, 64: 16.0}  # peer/cute per step
SPEEDUP = 3.0  # over psum/reference


def main(out: pathlib.Path) -> int:
    tests = out / "test_peer_gpu.txt"
    if tests.is_file():
        verdict = [line for line in tests.read_text().splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
        print("peer GPU tests:", verdict[-1] if verdict else "no pytest summary line (timed out?)")
    path = out / "tp2_bench.json"
    if not path.is_file():
        print("TP benchmark: no JSON written")
        return 1
    records = [r for r in json.loads(path.read_text()) if r.get("record")]
    tokens = sorted({r["T"] for r in records})
    table = {}
    for r in records:
        table.setdefault((r["mode"], r["backend"]), {})[r["T"]] = r
    print(f"{'mode/backend':<20}" + "".join(f"{'T=' + str(t) + ' us':<16}" for t in tokens) + "(kernel us/step)")
    for (mode, backend), by_t in table.items():
        cells = []
        for t in tokens:
            r = by_t.get(t)
            if r is None:
                cells.append("-")
            elif r["kind"] != "timing":
                cells.append("error")
            else:
                k = r.get("us_kernels")
                cells.append(f"{r['us']:.2f}" + (f" ({k:.2f})" if k is not None else ""))
        print(f"{mode + '/' + backend:<20}" + "".join(f"{c:<16}" for c in cells))
    for r in records:
        if r["kind"] == "error":
            print(f"error {r['mode']}/{r['backend']} T={r['T']}: {r['error'][:200]}")
    peer, base = table.get(("peer", "cute"), {}), table.get(("psum", "reference"), {})
    for t, target in TARGETS_US.items():
        p, b = peer.get(t), base.get(t)
        if p is None or p["kind"] != "timing":
            print(f"target T={t}: peer not timed")
            continue
        ok = p["us"] <= target
        line = f"target T={t}: peer {p['us']:.2f} us <= {target} us: {'MET' if ok else 'MISSED'}"
        if b is not None and b["kind"] == "timing":
            x = b["us"] / p["us"]
            line += f"; {x:.1f}x psum/reference (>= {SPEEDUP}x: {'MET' if x >= SPEEDUP else 'MISSED'})"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")))
