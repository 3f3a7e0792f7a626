"""The Triton backend on one GPU: the configuration of each T checked and timed, one JSON file.

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/triton_gpu.py --out $OUT

At R=16 NB=8 groups=4 has_delta and T in 1, 8, 64, 512, 4096, on fresh random inputs, the
configuration oproj_jax/triton/plan.py takes at each T (plan.default_variant):
(a) checks: launched from JAX (backend.launch) and from PyTorch (torch_launch.consumer): the two
    bit for bit (prefix, output), the JAX result against the oracle (testing.check_result on up
    to 64 tokens spread over T);
(b) timings: the PyTorch launch in CUDA graphs (bench/torch_timing.py: the slope of captured
    chains of dependent calls, kernel time from torch.profiler) in a spawned PyTorch process,
    and the JAX launch, the slope of jitted chains (bench/timing.py; jax.profiler's kernel time
    for the package's launch target), through the package's target and through jax_triton
    (backend.launch's `jax_triton`); each T gets an equal share of the time;
(c) one JSON in --out (<date>-<device>-triton.json): a header, then records of kind "check" and
    "timing" (backend "triton" for JAX, with its "launch", "library" or "jax_triton";
    "triton-torch" for PyTorch; T, R, NB, us, us_kernels, device, variant, ...).

Bounded: new steps stop at --budget seconds (what is left is recorded as skipped), and a
watchdog writes the records so far and exits if a step hangs past it. --allow-cpu runs without a
GPU: nothing launches, every step is recorded as skipped with the reason (a smoke test).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import threading
import time

# JAX takes 75 % of GPU memory by default; PyTorch launches in this process and the next.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

TOKENS = (1, 8, 64, 512, 4096)
ORACLE_TOKENS = 64
GRACE_S = 25  # the watchdog's margin past --budget
TORCH_SHARE = 0.6  # of the time left after the checks, for the PyTorch timings (the JAX ones get the rest)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the JSON file")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated T (default %(default)s)")
    parser.add_argument("--reps", type=int, default=10, help="timed executions per chain length (default %(default)s)")
    parser.add_argument(
        "--budget", type=float, default=200.0, help="seconds before new steps stop (default %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=None, help="input seed (default: from the clock)")
    parser.add_argument("--no-profile", action="store_true", help="no kernel times from the profilers")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (every step skipped)")
    parser.add_argument(
        "--buffers",
        default="donated",
        help="JAX chains' forms, comma-separated (bench/timing.py BUFFERS); the first for both launches, "
        "the others for the package's launch target (default %(default)s)",
    )
    args = parser.parse_args(argv)
    from oproj_jax.bench.timing import parse_buffers

    try:
        args.buffers = parse_buffers(args.buffers)
    except ValueError as err:
        parser.error(str(err))
    args.tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    return args


class Budget:
    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def _skip(what: str, reason: str, **fields) -> dict:
    return dict(kind="skipped", backend="triton", what=what, reason=reason, **fields)


def _error(what: str, err, **fields) -> dict:
    from oproj_jax.bench import runner

    text = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
    runner.log(f"ERROR {what}: {text[:300]}")
    return dict(kind="error", backend="triton", what=what, error=text[:3000], **fields)


def default_variant(T: int) -> str:
    """The configuration the launchers take at T (the production H)."""
    from oproj_jax import configs
    from oproj_jax.triton import plan

    return plan.default_variant(T, configs.HIDDEN)


# ---- (a) checks ------------------------------------------------------------------------------


def check(case, device) -> dict:
    """The case's configuration: JAX launch vs PyTorch launch (bits), the JAX result vs the oracle."""
    import jax
    import numpy as np
    import torch

    from oproj_jax import testing, torch_ref
    from oproj_jax.bench import runner
    from oproj_jax.bench.timing import EPS
    from oproj_jax.triton import backend, torch_launch

    config, x = case.config, case.inputs
    names = ("mailbox", "prefix", "blocks", "norm", "query", "out_norm")
    options = dict(eps=EPS, out_eps=EPS, **config.options())
    from_jax = [np.asarray(a) for a in backend.launch(*(jax.device_put(x[k], device) for k in names), **options)[:2]]
    tensors = [torch_ref.from_numpy(x[k]).cuda() for k in names]
    from_torch = [torch_ref.to_numpy(t) for t in torch_launch.consumer(*tensors, **options)[:2]]
    torch.cuda.synchronize()
    record = dict(
        kind="check", backend="triton", variant=default_variant(config.T), T=config.T, R=config.R, NB=config.NB
    )
    record["config"], record["seed"] = config.name, case.seed
    record["jax_vs_torch_mismatch"] = {
        name: int(np.count_nonzero(testing.bits(a) != testing.bits(b)))
        for name, a, b in zip(("prefix", "output"), from_jax, from_torch)
    }
    try:
        subset = testing.spread_tokens(config, x, (*from_jax, None), ORACLE_TOKENS)
        record["out_rel_l2"] = testing.check_result(*subset, eps=EPS, out_eps=EPS, what=config.name)
        record["oracle"] = "ok"
    except AssertionError as err:
        record["oracle"] = str(err)[:2000]
    record["ok"] = record["oracle"] == "ok" and not any(record["jax_vs_torch_mismatch"].values())
    runner.log(
        f"check T={config.T:5d} {record['variant']:24s} jax!=torch {record['jax_vs_torch_mismatch']} "
        f"oracle {record['oracle'][:80]}  {'ok' if record['ok'] else 'FAIL'}"
    )
    return record


# ---- (b) timings -----------------------------------------------------------------------------


def _timing(name: str, config, t) -> dict:
    from oproj_jax.bench import runner

    record = runner._timing_record(name, config, t)
    record["variant"] = default_variant(config.T)
    if record["us_kernels"] is None:  # torch.profiler: the CUDA kernel events of a graph replay
        record["us_kernels"] = t.us_profiler
    runner._log_timing(f"{name}:{record['variant']}", config, t)
    return record


def time_jax(case, platform: str, reps: int, profile: bool, budget: Budget, buffers=("donated",)) -> list[dict]:
    """The JAX launch through the package's target ("library") and through jax_triton
    ("jax_triton") in the chain form buffers[0]; the package's target also in the other forms
    (bench/timing.py BUFFERS: what XLA's command buffers cost per call shows in the slope)."""
    import jax

    from oproj_jax.bench import inputs as bench_inputs
    from oproj_jax.bench import timing as bench_timing
    from oproj_jax.triton import backend

    config = case.config
    fields = dict(variant=default_variant(config.T), T=config.T)
    runs = [("library", buffers[0]), ("jax_triton", buffers[0]), *(("library", form) for form in buffers[1:])]
    if budget.left() <= 0:
        return [
            _skip(f"jax timing T={config.T} {launch} {form}", "out of time (--budget)", **fields, launch=launch)
            for launch, form in runs
        ]
    k1, k2 = bench_timing.chain_lengths(config, platform)
    pool = bench_inputs.DevicePool(case, k2, l2_bytes=bench_timing.l2_bytes(platform))
    options = dict(eps=bench_timing.EPS, out_eps=bench_timing.EPS, **config.options())
    records = []
    for launch, form in runs:
        what = f"jax timing T={config.T} {launch} {form}"
        if budget.left() <= 0:
            records.append(_skip(what, "out of time (--budget)", **fields, launch=launch))
            continue
        step = jax.jit(functools.partial(backend.launch, **options, jax_triton=launch == "jax_triton"))
        # Profiler traces for the package's target only: a trace costs seconds.
        traced = profile and launch == "library"
        try:
            t = bench_timing.time_backend(
                f"triton_{launch}", pool, config, k1, k2, reps, traced, step=step, profile_single=False, buffers=form
            )
        except Exception as err:
            records.append(_error(what, err, **fields, launch=launch))
            continue
        records.append(dict(_timing("triton", config, t), launch=launch))
    del pool
    return records


def torch_worker(case, k1: int, k2: int, reps: int, l2_bytes: int, profile: bool):
    """In PyTorch's process: the Timing, or the error text."""
    from oproj_jax.bench import torch_timing

    return torch_timing.time_safe("triton-torch", case, k1, k2, reps, l2_bytes=l2_bytes, profile=profile)


def warm_torch() -> None:
    """In PyTorch's process, while the checks run: import and start CUDA ahead of the timings."""
    import torch

    from oproj_jax.bench import torch_timing  # noqa: F401
    from oproj_jax.triton import torch_launch  # noqa: F401

    torch.cuda.init()


def time_torch(pool, cases, platform: str, reps: int, profile: bool, budget: Budget) -> list[dict]:
    """Every T in `pool`'s one PyTorch process (its CUDA graphs and profiler stay out of JAX's);
    a step that outlives the budget is abandoned (the caller terminates the pool)."""
    from oproj_jax.bench import timing as bench_timing

    records = []
    for case in cases:
        config = case.config
        what = f"torch timing T={config.T}"
        fields = dict(variant=default_variant(config.T), T=config.T)
        if budget.left() <= 0:
            records.append(_skip(what, "out of time (--budget)", **fields))
            continue
        k1, k2 = bench_timing.chain_lengths(config, platform)
        job = pool.apply_async(torch_worker, (case, k1, k2, reps, bench_timing.l2_bytes(platform), profile))
        try:
            t = job.get(timeout=max(1.0, budget.left()) + GRACE_S / 2)
        except Exception as err:  # a timeout or a dead process: no more PyTorch timings
            records.append(_error(what, err, **fields))
            break
        records.append(_error(what, t, **fields) if isinstance(t, str) else _timing("triton-torch", config, t))
    return records


# ---- the run ---------------------------------------------------------------------------------


def _write(records: list[dict], path: str) -> None:
    from oproj_jax.bench import report

    report.write_json(list(records), path)


def _watchdog(records: list[dict], path: str, seconds: float) -> threading.Event:
    """Writes the records so far and ends the process if it runs `seconds` (a hung step); set
    the returned event to stand it down."""
    done = threading.Event()

    def fire():
        if done.wait(seconds):
            return
        records.append(
            dict(kind="error", backend="triton", what="watchdog", error=f"still running after {seconds:.0f} s")
        )
        _write(records, path)
        print(f"triton_gpu.py: a step hung; wrote what was recorded to {path}", file=sys.stderr, flush=True)
        os._exit(3)

    threading.Thread(target=fire, daemon=True).start()
    return done


def main(argv=None) -> int:
    args = parse_args(argv)
    budget = Budget(args.budget)
    import jax

    from oproj_jax.bench import backends as bench_backends
    from oproj_jax.bench import runner

    platform = jax.default_backend()
    if platform != "gpu" and not args.allow_cpu:
        print(f"triton_gpu.py: no GPU (JAX platform {platform!r}); --allow-cpu for a smoke run", file=sys.stderr)
        return 2
    status = bench_backends.backend_status(platform)
    seed = args.seed if args.seed is not None else int(time.time()) % 2**31
    profile = not args.no_profile and platform == "gpu"
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{runner.today()}-{runner.device_slug()}-triton.json")
    records = [
        runner.header(seed, status, script="benchmarks/triton_gpu.py", argv=sys.argv[1:] if argv is None else argv)
    ]
    done = _watchdog(records, path, args.budget + GRACE_S)
    try:
        return _run(args, budget, platform, status, seed, profile, records, path)
    finally:
        done.set()


def _run(args, budget: Budget, platform: str, status: dict, seed: int, profile: bool, records: list, path: str) -> int:
    import jax

    from oproj_jax import configs
    from oproj_jax.bench import backends as bench_backends
    from oproj_jax.bench import inputs as bench_inputs
    from oproj_jax.bench import runner

    bench_configs = [configs.Config(configs.TP, t, 8) for t in sorted(args.tokens)]
    why_not = {name: status.get(name) for name in ("triton", bench_backends.TRITON_TORCH)}
    if any(why_not.values()):
        reason = "; ".join(f"{k}: {r}" for k, r in why_not.items() if r)
        records += [_skip(f"T={c.T}", reason, variant=default_variant(c.T), T=c.T) for c in bench_configs]
        _write(records, path)
        print(f"nothing to run here ({reason}); wrote {path}", file=sys.stderr)
        return 0 if args.allow_cpu else 1

    import multiprocessing

    device = jax.devices("gpu")[0]
    torch_pool = multiprocessing.get_context("spawn").Pool(1)
    torch_pool.apply_async(warm_torch)
    cases = bench_inputs.HostCases(bench_configs, seed, workers=3)  # the large ones built while small T runs
    try:
        runner.log(f"checks: T={args.tokens} (seed {seed})")
        for config in bench_configs:
            what = f"check T={config.T}"
            fields = dict(variant=default_variant(config.T), T=config.T)
            if budget.left() <= 0:
                records.append(_skip(what, "out of time (--budget)", **fields))
                continue
            try:
                records.append(check(cases.get(config), device))
            except Exception as err:
                records.append(_error(what, err, **fields))
        # PyTorch first: its graph slope is the kernels' time, the figure the targets are set in.
        runner.log("timings: PyTorch, CUDA graphs")
        hosts = [cases.get(c) for c in bench_configs]
        share = Budget(budget.left() * TORCH_SHARE)
        records += time_torch(torch_pool, hosts, platform, args.reps, profile, share)
        runner.log("timings: JAX")
        for i, case in enumerate(hosts):
            share = Budget(budget.left() / (len(hosts) - i))  # an equal share of what is left per T
            records += time_jax(case, platform, args.reps, profile, share, args.buffers)
    finally:
        torch_pool.terminate()
        cases.close()
    records[0]["wall_s"] = round(args.budget - budget.left(), 1)
    _write(records, path)
    for r in records:
        if r["kind"] == "timing":
            kernels = "-" if r.get("us_kernels") is None else f"{r['us_kernels']:.2f}"
            label = f"{r['backend']:13s} {r.get('launch', ''):10s} {r.get('buffers') or '':8s}"
            print(f"{label} T={r['T']:5d} {r['variant']:24s} us {r['us']:8.2f}  kernels {kernels}")
    failed = [r for r in records if r["kind"] == "error" or (r["kind"] == "check" and not r["ok"])]
    print(f"wrote {path}; {len(failed)} failed checks or errors, {records[0]['wall_s']} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
