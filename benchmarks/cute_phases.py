"""Where the CuTe kernel's time goes: a trace build with phase timers (kernel.TRACE_MARKS).

  # on a machine with the DSL (no GPU needed): compile the trace cubin
  PYTHONPATH=. python3 benchmarks/cute_phases.py build DIR
  # on the GPU machine (torch + cuda-python): launch it, print the phases
  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/cute_phases.py run DIR [--tokens 1 64]

The trace build is the ready-mode (folded) kernel of R=16, NB=8, has_delta, groups=4 with
thread 0 of every CTA storing %clock64 at each mark and %globaltimer at entry and exit into
the buffer passed as `status` ([T, 7, 16] u64). The launch is the FFI handler's (cluster 7,
PDL) through cuda-python on torch's stream, on fresh random data, input sets rotated so that
L2 is cold as in the benchmark; the last of several launches is read. Per mark: the median
and max over CTAs of the cycles since the CTA's entry (and ns at the device's maximum SM
clock), and the kernel span from %globaltimer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

KEY = dict(R=16, NB=8, has_delta=True, groups=4, xmoe_replicas=0, twoshot=False)


def build(directory: str) -> None:
    from oproj_jax.cute import build as cute_build, kernel as K, manifest as M

    os.makedirs(directory, exist_ok=True)
    info = cute_build.compile_variant(KEY, M.FOLDED, trace=True)
    with open(os.path.join(directory, "trace.cubin"), "wb") as f:
        f.write(info["cubin_bytes"])
    # the trace layout travels with the cubin: the GPU machine has no DSL to import kernel.py
    meta = dict(
        entry=info["entry"],
        smem=info["dynamic_smem_bytes"],
        block=info["block"][0],
        key=KEY,
        ctas=K.CTAS,
        slots=K.TRACE_SLOTS,
        marks=list(K.TRACE_MARKS),
    )
    with open(os.path.join(directory, "trace.json"), "w") as f:
        json.dump(meta, f)
    print(f"trace cubin -> {directory}/trace.cubin ({len(info['cubin_bytes'])} bytes)")


def phase_table(stamps, marks, slots: int) -> dict:
    """stamps: [T * 7][slots] ints (a CTA's row: %clock64 at marks 0.., %globaltimer at entry and
    exit in the last two). Returns {"marks": {name: (median, max) cycles since the CTA's entry},
    "cta_cycles": median entry -> last mark, "span_ns": first entry to last exit, %globaltimer}."""
    since = {name: [row[k] - row[0] for row in stamps] for k, name in enumerate(marks)}
    table = {name: (statistics.median(v), max(v)) for name, v in since.items()}
    span = max(r[slots - 1] for r in stamps) - min(r[slots - 2] for r in stamps)
    return dict(marks=table, cta_cycles=statistics.median(since[marks[-1]]), span_ns=span)


def sm_clock_ghz() -> float:
    from cuda.bindings import driver as cu

    from oproj_jax.cute.driver_launch import check

    check(cu.cuInit(0), "cuInit")
    device = check(cu.cuDeviceGet(0), "cuDeviceGet")
    khz = check(
        cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CLOCK_RATE, device),
        "cuDeviceGetAttribute(CLOCK_RATE)",
    )
    return khz / 1e6


def run(directory: str, tokens, launches: int) -> list[dict]:
    import torch

    from oproj_jax.cute import backend, driver_launch

    with open(os.path.join(directory, "trace.json")) as f:
        meta = json.load(f)
    ctas, slots, marks = meta["ctas"], meta["slots"], meta["marks"]
    kernel = backend._Kernel(os.path.join(directory, "trace.cubin"), meta["entry"], meta["smem"], meta["block"])
    launch = driver_launch.torch_launcher(kernel)
    ghz = sm_clock_ghz()  # the maximum SM clock: cycles -> ns (the timers count cycles)
    results = []
    for T in tokens:
        R, NB, H = KEY["R"], KEY["NB"], 7168
        per_set = (R + NB + 1) * T * H * 2
        n_sets = max(2, min(launches, -(-64 * 2**20 // per_set)))  # > the 50 MB L2 in all
        sets = [
            (
                torch.randn(R, T, H, device="cuda").to(torch.bfloat16),
                torch.randn(T, NB, H, device="cuda").to(torch.bfloat16),
            )
            for _ in range(n_sets)
        ]
        prefix = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        weights = [(1 + 0.1 * torch.randn(H, device="cuda")).to(torch.bfloat16) for _ in range(3)]
        output = torch.empty(T, H, device="cuda", dtype=torch.bfloat16)
        xmoe = torch.empty(1, T, H, device="cuda", dtype=torch.bfloat16)
        hints = torch.zeros(4, device="cuda", dtype=torch.int32)
        trace = torch.zeros(T * ctas * slots, device="cuda", dtype=torch.int64)
        for i in range(launches):
            mailbox, blocks = sets[i % n_sets]
            pointers = [
                mailbox.data_ptr(),
                prefix.data_ptr(),
                blocks.data_ptr(),
                *(w.data_ptr() for w in weights),
                output.data_ptr(),
                xmoe.data_ptr(),
                hints.data_ptr(),
                trace.data_ptr(),
            ]
            launch(T, pointers, 1e-6, 1e-6, -1)  # timeout_us < 0: ready mode, as through XLA
        torch.cuda.synchronize()
        stamps = trace.view(T * ctas, slots).cpu().tolist()
        table = phase_table(stamps, marks, slots)
        print(
            f"T={T}: CTA entry->stored median {table['cta_cycles']} cycles ({table['cta_cycles'] / ghz:.0f} ns at "
            f"{ghz:.2f} GHz), kernel span {table['span_ns']} ns (%globaltimer; last of {launches} launches, "
            f"{n_sets} input sets)"
        )
        for name, (median, worst) in table["marks"].items():
            print(f"  {name:15s} {median:7.0f} cycles {median / ghz:7.0f} ns  (max {worst / ghz:7.0f} ns)")
        results.append(dict(T=T, sm_clock_ghz=ghz, **table))
        del sets
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=("build", "run"))
    ap.add_argument("directory")
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--out", default=None, help="run: also write the tables as JSON here")
    args = ap.parse_args()
    if args.step == "build":
        build(args.directory)
        return
    results = run(args.directory, args.tokens, args.launches)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
