"""The sweeps shared by the CLI (`python -m oproj_jax.bench`) and benchmarks/record.py."""

from __future__ import annotations

import datetime
import gc
import platform as _platform
import subprocess
import sys
import time

import jax

from oproj_jax import configs, contract
from oproj_jax.bench import backends as bench_backends
from oproj_jax.bench import inputs as bench_inputs
from oproj_jax.bench import report
from oproj_jax.bench import timing as bench_timing
from oproj_jax.bench.checks import Checker

_START = time.perf_counter()


def log(message: str) -> None:
    print(f"[bench {time.perf_counter() - _START:7.1f}s] {message}", file=sys.stderr, flush=True)


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def device_name() -> str:
    device = jax.devices()[0]
    return getattr(device, "device_kind", device.platform) or device.platform


def device_slug() -> str:
    return "".join(c if c.isalnum() else "-" for c in device_name().lower()).strip("-")


def _version(module: str) -> str | None:
    try:
        return getattr(__import__(module), "__version__", "?")
    except Exception:
        return None


def _driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def _cubin_build() -> dict | None:
    """Where the CuTe cubins came from (None: no manifest)."""
    from oproj_jax.cute import manifest

    try:
        built = manifest.load_manifest()
    except (OSError, ValueError):
        return None
    return dict(
        dir=str(manifest.default_dir()),
        cutlass_dsl=built.get("cutlass_dsl"),
        kernels=len(built.get("kernels", [])),
    )


def header(seed: int, status: dict[str, str | None], **extra) -> dict:
    import jaxlib

    return dict(
        kind="header",
        date=today(),
        time_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=device_name(),
        platform=jax.default_backend(),
        device_count=jax.device_count(),
        versions=dict(
            python=_platform.python_version(),
            jax=jax.__version__,
            jaxlib=jaxlib.__version__,
            torch=_version("torch"),
            triton=_version("triton"),
            numpy=_version("numpy"),
            driver=_driver(),
        ),
        seed=seed,
        backends={name: reason or "available" for name, reason in status.items()},
        cute_cubins=_cubin_build(),
        **extra,
    )


def _dims(config: configs.Config) -> contract.Dims:
    return contract.Dims(1 if config.twoshot else config.R, config.T, config.NB, config.H)


def _skip(backend: str, what: str, reason: str) -> dict:
    return dict(kind="skipped", backend=backend, what=what, reason=reason)


def _error(backend: str, what: str, err: BaseException) -> dict:
    log(f"ERROR {backend} {what}: {type(err).__name__}: {err}")
    return dict(kind="error", backend=backend, what=what, error=f"{type(err).__name__}: {err}"[:2000])


def run_checks(backends: list[str], config_list, cases: bench_inputs.HostCases) -> list[dict]:
    """The reference first on every config, then each other backend against it."""
    records = []
    checker = Checker()
    names = ["reference"] + [b for b in backends if b not in ("reference", *bench_backends.TORCH_PROCESS)]
    for n, config in enumerate(config_list):
        case = cases.get(config)
        reference_prefix = None
        for name in names:
            reason = bench_backends.unsupported_reason(name, _dims(config), bench_timing.consumer_options(config))
            if reason:
                records.append(_skip(name, config.name, reason))
                continue
            try:
                record, prefix = checker.check(name, case, reference_prefix)
            except Exception as err:
                records.append(_error(name, f"check {config.name}", err))
                continue
            if name == "reference":
                reference_prefix = prefix
            records.append(record)
            log(
                f"check {n + 1}/{len(config_list)} {config.name:24s} {name:10s} "
                f"prefix!=ref {record['prefix_mismatch']} "
                f"!=model {record['prefix_mismatch_model']}  rel_l2 {record['out_rel_l2']:.2e}  "
                f"nonfinite {record['out_nonfinite']}  {'ok' if record['ok'] else 'FAIL'}"
            )
        gc.collect()
    return records


def run_copy(platform: str, reps: int, profile: bool) -> dict:
    """The copy roofline: the faster of a device-to-device copy and an elementwise read+write
    kernel (both listed in the record)."""
    log("copy bandwidth ...")
    results = bench_timing.copy_bandwidth(platform, reps, profile)
    variants = []
    for r in results:
        gbps_profiler = r.bytes_per_copy / r.us_profiler / 1e3 if r.us_profiler else None
        log(
            f"copy {r.kind}: {report.time_cell(r.gbps, '.0f')} GB/s ({report.time_cell(r.us, '.1f')} us per "
            f"{r.bytes_per_copy / 2**20:.0f} MiB moved, "
            f"noise ~{r.noise_us:.1f} us)" + (f"; profiler {gbps_profiler:.0f} GB/s" if gbps_profiler else "")
        )
        variants.append(
            dict(
                kind=r.kind,
                us=r.us,
                gbps=r.gbps,
                noise_us=r.noise_us,
                us_profiler=r.us_profiler,
                gbps_profiler=gbps_profiler,
                profiler_note=r.profiler_note,
                method=r.method,
            )
        )
    best = max(variants, key=lambda v: v["gbps"])
    return dict(
        kind="copy",
        device=device_name(),
        date=today(),
        bytes=results[0].bytes_per_copy,
        us=best["us"],
        gbps=best["gbps"],
        gbps_profiler=best["gbps_profiler"],
        method=f"best of: {best['method']}",
        variants=variants,
    )


def _timing_record(name: str, config: configs.Config, t) -> dict:
    return dict(
        kind="timing",
        backend=name,
        buffers=t.buffers,
        **bench_timing.shape_fields(config),
        config=config.name,
        us=t.us,  # what a caller pays per call (bench/timing.py); the figures it is taken from beside it
        us_pipelined=t.us_pipelined,
        us_host=t.us_host,
        us_donated=t.us_donated,
        device=device_name(),
        date=today(),
        bytes=configs.min_bytes(config),
        method=t.method,
        k1=t.k1,
        k2=t.k2,
        reps=t.reps,
        n_sets=t.n_sets,
        t_k1_us=t.t_k1_us,
        t_k2_us=t.t_k2_us,
        noise_us=t.noise_us,
        us_profiler=t.us_profiler,
        # the kernels' busy time: with PDL a kernel starts while its predecessor runs and waits
        # (griddepcontrol.wait), so summed durations count the wait as kernel time
        us_kernels=t.us_profiler_busy if t.us_profiler_busy is not None else t.us_profiler_kernels,
        us_kernels_summed=t.us_profiler_kernels,
        profiler_note=t.profiler_note,
        us_profiler_single=t.us_profiler_single,
        profiler_single_note=t.profiler_single_note,
    )


def _log_timing(name: str, config: configs.Config, t) -> None:
    """One line per timing (benchmarks/record.py reads it back from a stopped process's log).
    A time that is not measured, or a slope below zero (within the noise), shows as "-"."""
    us = report.time_cell
    profiler = ""
    if t.us_profiler is not None:
        kernels = f", kernels {us(t.us_profiler_kernels, '.2f')}" if t.us_profiler_kernels is not None else ""
        kernels += f", busy {us(t.us_profiler_busy, '.2f')}" if t.us_profiler_busy is not None else ""
        profiler = f"  (profiler {us(t.us_profiler, '.1f')}{kernels})"
    forms = ""
    if t.buffers == "pipelined":
        forms = (
            f"  (pipelined {us(t.us_pipelined, '.2f')}, host {us(t.us_host, '.2f')}, waited {us(t.us_donated, '.2f')})"
        )
    quiet = t.us is None or t.us <= 2 * t.noise_us
    log(
        f"time T={config.T:5d} {name:10s} {t.buffers or '':8s} {us(t.us, '9.1f'):>9s} us/call"
        + profiler
        + (f"  (1-call jit profiler {us(t.us_profiler_single, '.1f')})" if t.us_profiler_single is not None else "")
        + forms
        + f"  [t(K1)={t.t_k1_us:.0f} t(K2)={t.t_k2_us:.0f} us, noise ~{t.noise_us:.1f} us/call]"
        + ("  WARNING: not above the noise, raise --reps" if quiet else "")
    )


def _plumbing_record(name: str, config: configs.Config, t) -> dict:
    """A timing run off the GPU: that the chains compiled and ran, without their times (a CPU's
    times are not performance figures)."""
    return dict(
        kind="plumbing",
        backend=name,
        buffers=t.buffers,
        **bench_timing.shape_fields(config),
        config=config.name,
        k1=t.k1,
        k2=t.k2,
        reps=t.reps,
        device=device_name(),
        platform=jax.default_backend(),
        date=today(),
        note="the timing chains compiled and ran; no time is recorded off the GPU",
    )


def run_timings(
    backends: list[str],
    config_list,
    cases: bench_inputs.HostCases,
    platform: str,
    reps: int,
    profile: bool,
    l2_warm: bool = False,
    buffers=(bench_timing.RECORD_FORM,),
    figures: bool = True,
) -> list[dict]:
    """JAX backends first, T by T; then the torch baseline in its own process (its CUDA graphs
    and profiler must not share a process with JAX: CUPTI takes one subscriber, and a failed
    capture poisons the other library's stream). figures=False (off the GPU): the chains run,
    and each gives a "plumbing" record without times."""
    records = []
    jax_names = [b for b in backends if b not in bench_backends.TORCH_PROCESS]
    for config in config_list if jax_names else ():
        case = cases.get(config)
        k1, k2 = bench_timing.chain_lengths(config, platform)
        try:
            pool = bench_inputs.DevicePool(case, k2, l2_bytes=bench_timing.l2_bytes(platform), warm=l2_warm)
            if not l2_warm and not pool.distinct_buffers():
                raise RuntimeError("DevicePool: input copies share buffers; the timings would be L2-warm")
        except Exception as err:
            records.append(_error(",".join(jax_names), f"inputs {config.name}", err))
            continue
        log(
            f"T={config.T}: K1={k1} K2={k2}, {pool.n_sets} distinct input sets on device"
            + (" (L2-WARM)" if l2_warm else "")
        )
        for name in jax_names:
            reason = bench_backends.unsupported_reason(name, _dims(config), bench_timing.consumer_options(config))
            if reason:
                records.append(_skip(name, f"timing {config.name}", reason))
                continue
            forms = ("rotated",) if l2_warm else buffers
            for form in forms:
                try:  # the profiler's kernel time once per backend and T, with the first form
                    first = form == forms[0]
                    t = bench_timing.time_backend(name, pool, config, k1, k2, reps, profile and first, buffers=form)
                except Exception as err:
                    records.append(_error(name, f"timing {config.name} {form}", err))
                    continue
                if not figures:
                    records.append(_plumbing_record(name, config, t))
                    log(
                        f"plumbing T={config.T} {name} {form}: the timing chains compiled and ran (no time off the GPU)"
                    )
                    continue
                if l2_warm:
                    t.method_text = "L2-WARM (diagnostic: one input set reused by every call): " + t.method
                records.append(_timing_record(name, config, t))
                _log_timing(name, config, t)
        del pool
        gc.collect()
    torch_names = [b for b in backends if b in bench_backends.TORCH_PROCESS]
    if torch_names:
        records += run_torch_timings(torch_names, config_list, cases, platform, reps, profile)
    return records


def run_torch_timings(
    names: list[str], config_list, cases: bench_inputs.HostCases, platform: str, reps: int, profile: bool
) -> list[dict]:
    """`names` (bench_backends.TORCH_PROCESS) timed in one PyTorch process through CUDA graphs."""
    import concurrent.futures
    import multiprocessing

    from oproj_jax.bench import torch_timing

    records = []
    ctx = multiprocessing.get_context("spawn")
    log(f"{', '.join(names)}: starting PyTorch's process")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        if platform == "gpu":
            try:
                variant = pool.submit(torch_timing.copy_bandwidth_safe, reps).result()
            except Exception as err:
                variant = f"{type(err).__name__}: {err}"
            if isinstance(variant, str):
                log(f"torch copy bandwidth not measured: {variant}")
            else:
                log(
                    f"copy torch: {variant['gbps']:.0f} GB/s ({variant['us']:.1f} us, "
                    f"noise ~{variant['noise_us']:.1f} us)"
                )
                records.append({**variant, "kind": "copy_variant", "variant": variant["kind"]})
        for config in config_list:
            k1, k2 = bench_timing.chain_lengths(config, platform)
            for name in names:
                reason = bench_backends.unsupported_reason(name, _dims(config), bench_timing.consumer_options(config))
                if reason:
                    records.append(_skip(name, f"timing {config.name}", reason))
                    continue
                future = pool.submit(
                    torch_timing.time_safe,
                    name,
                    cases.get(config),
                    k1,
                    k2,
                    reps,
                    l2_bytes=bench_timing.l2_bytes(platform),
                    profile=profile,
                )
                try:
                    t = future.result()
                except Exception as err:  # the process died
                    records.append(_error(name, f"timing {config.name}", err))
                    return records
                if isinstance(t, str):
                    records.append(dict(kind="error", backend=name, what=f"timing {config.name}", error=t))
                    log(f"ERROR {name} timing {config.name}: {t}")
                    continue
                records.append(_timing_record(name, config, t))
                _log_timing(name, config, t)
    return records
