"""Programmatic dependent launch, with and without, in one process: the chain slope per call.

For each T, interleaved over --rounds rounds (each round times every arm once, so drifts of the
machine fall on all arms alike):
  pallas         backend="pallas" in the donated chain (bench/timing.py), pdl on / off;
  triton         backend="triton" (the package's launch target) in the donated chain, pdl on / off;
  triton-torch   the same kernel launched from PyTorch in CUDA graphs (bench/torch_timing.py):
                 arrival counters kept across the chain or zeroed per call, pdl on / off;
  cute           backend="cute" as it is (PDL always), the yardstick;
  --variants     Triton configurations (plan.VARIANTS names) side by side, each an arm of
                 backend="triton" through the package's launch target (PDL on where it can).
  --traced       cute and triton (the default configuration) beside themselves launched through
                 the traced target at every T (ffi.RECORD_MAX_T = 0 while they are traced).
Every arm's first call is checked against the oracle (JAX arms: bench's check; the PyTorch arms
check themselves against torch_ref). One JSON list of records, written after every round.

    python benchmarks/pdl_ab.py --out benchmarks/results --tokens 1,8,64 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # PyTorch shares the GPU
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tokens", default="1,8,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=30, help="executions per chain length")
    parser.add_argument("--arms", default="pallas,triton,triton-torch,cute")
    parser.add_argument("--variants", default="", help="Triton configurations to time side by side, comma-separated")
    parser.add_argument("--traced", action="store_true", help="cute and triton through the traced target too")
    parser.add_argument("--buffers", default="donated", help="the chain's form (bench/timing.py BUFFERS)")
    parser.add_argument("--budget", type=float, default=400.0, help="seconds; no new round starts past it")
    args = parser.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    return args


@contextlib.contextmanager
def traced(on: bool):
    """While on, every call of the package's launch target traced and lowered names the traced
    target (the arms labelled "traced": checked and timed inside it)."""
    from oproj_jax.cute import backend as cute_backend
    from oproj_jax.triton import library

    saved = cute_backend.RECORD_MAX_T, library.RECORD_MAX_T
    if on:
        cute_backend.RECORD_MAX_T = library.RECORD_MAX_T = 0
    try:
        yield
    finally:
        cute_backend.RECORD_MAX_T, library.RECORD_MAX_T = saved


def jax_arms(names, config, variants=(), with_traced=False):
    """(backend, label, jitted step) for the JAX arms; `variants`' labelled by name."""
    import jax

    from oproj_jax import api
    from oproj_jax.bench import timing
    from oproj_jax.pallas import consumer as pallas_consumer
    from oproj_jax.triton import backend as triton_backend

    options = timing.consumer_options(config)
    tuning = pallas_consumer.choose_split(config.T, config.H, interpret=False, R=config.R, NB=config.NB)
    arms = []
    for pdl in (True, False):
        label = "pdl" if pdl else "no-pdl"
        if "pallas" in names:
            step = functools.partial(pallas_consumer.consumer_with, **options, **tuning, pdl=pdl, interpret=False)
            arms.append(("pallas", label, jax.jit(step)))
        if "triton" in names:
            arms.append(("triton", label, jax.jit(functools.partial(triton_backend.launch, **options, pdl=pdl))))
    for variant in variants:
        arms.append(("triton", variant, jax.jit(functools.partial(triton_backend.launch, **options, variant=variant))))
    if "cute" in names:
        arms.append(("cute", "pdl", timing.consumer_step("cute", config)))
    if with_traced:
        for backend in ("cute", "triton"):
            arms.append((backend, "traced", jax.jit(functools.partial(api.consumer, backend=backend, **options))))
    return arms


def torch_arms(names):
    if "triton-torch" not in names:
        return []
    return [(kept, pdl) for kept in (True, False) for pdl in (True, False)]


def check_jax(step, case) -> float:
    """One call on the case's inputs against the oracle; returns the output's rel L2."""
    import jax

    from oproj_jax import testing
    from oproj_jax.bench import timing

    args = [jax.device_put(case.inputs[k]) for k in ("mailbox", "prefix", "blocks", "norm", "query", "out_norm")]
    result = step(*args)
    return testing.check_result(case.config, case.inputs, result, eps=timing.EPS, out_eps=timing.EPS, what="pdl_ab")


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    from oproj_jax import configs
    from oproj_jax.bench import inputs as bench_inputs
    from oproj_jax.bench import report, runner, timing, torch_timing

    platform = jax.default_backend()
    if platform != "gpu":
        print(f"pdl_ab.py: needs a GPU (JAX platform {platform!r})", file=sys.stderr)
        return 2
    start = time.time()
    seed = int(time.time()) % 2**31
    path = os.path.join(args.out, f"{runner.today()}-{runner.device_slug()}-pdl-ab.json")
    records = [runner.header(seed, {}, script="benchmarks/pdl_ab.py", argv=sys.argv[1:] if argv is None else argv)]
    device = runner.device_slug()
    cases = {T: bench_inputs.host_case(configs.Config(configs.TP, T, 8), seed) for T in args.tokens}
    # The JAX arms first, then the PyTorch ones: once torch.profiler has run in a process, JAX's
    # profiler cannot subscribe to CUPTI there.
    for T, case in cases.items():
        config = case.config
        k1, k2 = timing.chain_lengths(config, platform)
        pool = bench_inputs.DevicePool(case, k2, l2_bytes=timing.l2_bytes(platform))
        arms = jax_arms(args.arms, config, args.variants, args.traced)
        for backend, label, step in arms:
            with traced(label == "traced"):
                err = check_jax(step, case)
            records.append(dict(kind="check", backend=backend, label=label, T=T, out_rel_l2=err, ok=True))
        for r in range(args.rounds):
            if time.time() - start > args.budget:
                records.append(dict(kind="skipped", T=T, round=r, reason="out of time (--budget)"))
                break
            for backend, label, step in arms:
                with traced(label == "traced"):
                    t = timing.time_backend(
                        f"{backend}_{label}".replace("-", "_"), pool, config, k1, k2, args.reps, r == 0,
                        step=step, profile_single=False, buffers=args.buffers,
                    )  # fmt: skip
                records.append(_record(backend, label, config, t, r, device))
            report.write_json(list(records), path)
        del pool
    for T, case in cases.items():
        config = case.config
        k1, k2 = timing.chain_lengths(config, platform)
        for r in range(args.rounds):
            if time.time() - start > args.budget:
                records.append(dict(kind="skipped", T=T, round=r, reason="out of time (--budget)"))
                break
            for kept, pdl in torch_arms(args.arms):
                label = f"{'kept' if kept else 'zeroed'}{'+pdl' if pdl else ''}"
                t = torch_timing.time_triton_torch(
                    case, k1, k2, args.reps, l2_bytes=timing.l2_bytes(platform), profile=r == 0,
                    kept_arrivals=kept, pdl=pdl,
                )  # fmt: skip
                records.append(_record("triton-torch", label, config, t, r, device))
            report.write_json(list(records), path)
    records += summary(records)
    report.write_json(list(records), path)
    for s in records:
        if s["kind"] == "summary":
            print(f"T={s['T']:5d} {s['backend']:13s} {s['label']:12s} {s['us_median']:8.2f} us  {s['us_each']}")
    print(f"wrote {path} in {time.time() - start:.0f} s")
    return 0


def _record(backend: str, label: str, config, t, r: int, device: str) -> dict:
    from oproj_jax.bench import timing

    # JAX: the kernels' busy time; PyTorch: torch.profiler's kernel time per call of a replay
    kernels = next((v for v in (t.us_profiler_busy, t.us_profiler_kernels, t.us_profiler) if v is not None), None)
    record = dict(kind="timing", backend=backend, label=label, **timing.shape_fields(config), round=r)
    record.update(us=t.us, us_kernels=kernels, noise_us=t.noise_us, device=device, method=t.method)
    print(f"T={config.T:5d} {backend:13s} {label:12s} round {r}: {t.us:8.2f} us (kernels {kernels})", flush=True)
    return record


def summary(records: list[dict]) -> list[dict]:
    timings = [r for r in records if r["kind"] == "timing"]
    out = []
    for key in sorted({(r["T"], r["backend"], r["label"]) for r in timings}):
        us = [r["us"] for r in timings if (r["T"], r["backend"], r["label"]) == key]
        kernels = [r["us_kernels"] for r in timings if (r["T"], r["backend"], r["label"]) == key and r["us_kernels"]]
        T, backend, label = key
        out.append(
            dict(kind="summary", T=T, backend=backend, label=label, us_median=statistics.median(us),
                 us_each=[round(u, 2) for u in us], us_kernels=kernels[0] if kernels else None)
        )  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main())
