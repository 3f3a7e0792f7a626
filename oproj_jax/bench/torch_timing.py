"""Timings in PyTorch's process, through CUDA graphs: chains of K dependent calls (the prefix
threaded through, each call on its own input set), captured once per input list into a CUDA
graph (no host launch cost), replayed and timed with CUDA events; per-call time = slope over
K1, K2. Cross-check: torch.profiler's CUDA kernel durations of one K2 replay. Imported lazily.

  "torch":      the PyTorch baseline, oproj_jax.torch_ref (rank-order adds + AttnRes in torch ops)
  "cute-graph": the CuTe cubin itself, launched by cuda-python (cute/driver_launch.py) as a
                CUDA-graph decode loop (vLLM's way) would run it: no XLA launch in between
  "triton-torch": the Triton kernels of backend="triton", launched from PyTorch
                (oproj_jax/triton/torch_launch.py), the same way"""

from __future__ import annotations

import math
import statistics

import numpy as np

from oproj_jax.bench import inputs as bench_inputs
from oproj_jax.bench.timing import EPS, Timing, consumer_options, mad


def _to_cuda(torch, x):  # numpy bf16 -> torch bf16 on the GPU
    raw = np.ascontiguousarray(x).view(np.int16)
    return torch.from_numpy(raw).to("cuda").view(torch.bfloat16)


def _n_lists(config, k2: int, l2_bytes: int) -> int:
    """Input lists to rotate through so that a buffer is re-read only after >= 4x L2 of others."""
    return min(64, max(2, math.ceil(4 * l2_bytes / (k2 * bench_inputs.stream_bytes(config))) + 1))


def graph_timing(torch, chain, lists, k1: int, k2: int, reps: int, profile: bool, what: str) -> Timing:
    """Per-call device time of `chain(k, *list)` (k dependent calls on one input list), each
    (k, list) captured once into a CUDA graph, replays timed with CUDA events; slope over K1, K2."""
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager warm-up before capture (library handles, allocator)
        chain(1, *lists[0])
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs = {}
    for k in (k1, k2):
        for j, lst in enumerate(lists):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
                chain(k, *lst)
            graphs[k, j] = g
    # A graph's first replay uploads it to the device and takes longer; at small T there are
    # more input lists than timed replays, so without this most timed replays would be first ones.
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    n_lists = len(lists)

    def replay_us(k, j) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs[k, j % n_lists].replay()  # noqa: F821 (deleted after its last use)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    i = 0
    for _ in range(2):
        replay_us(k1, i), replay_us(k2, i + 1)
        i += 2
    t1, t2 = [], []
    for _ in range(reps):
        t1.append(replay_us(k1, i))
        t2.append(replay_us(k2, i + 1))
        i += 2
    m1, m2 = statistics.median(t1), statistics.median(t2)
    noise = (mad(t1) + mad(t2)) / (k2 - k1)
    timing = Timing((m2 - m1) / (k2 - k1), k1, k2, reps, n_lists * k2, m1, m2, noise)
    timing.method_text = (
        f"CUDA graph of an unrolled chain of dependent {what}, replay timed with CUDA events: "
        f"(t(K2)-t(K1))/(K2-K1), K1={k1}, K2={k2}, median of {reps}, {n_lists * k2} distinct input sets "
        f"rotated (L2-cold)"
    )
    if profile:
        timing.us_profiler, timing.profiler_note = _profiled(torch, graphs[k2, 0], k2)
    del graphs
    torch.cuda.synchronize()
    return timing


def _device_base(torch, case):
    """(the case's inputs on the GPU by name, the three weight tensors)."""
    base = {name: _to_cuda(torch, case.inputs[name]) for name in ("mailbox", "blocks", "prefix", *bench_inputs.WEIGHTS)}
    return base, [base[name] for name in bench_inputs.WEIGHTS]


def _device_lists(torch, case, k2: int, l2_bytes: int):
    base, weights = _device_base(torch, case)
    lists = [
        (
            [base["mailbox"].clone() for _ in range(k2)],
            [base["blocks"].clone() for _ in range(k2)],
            base["prefix"].clone(),
        )
        for _ in range(_n_lists(case.config, k2, l2_bytes))
    ]
    return base, weights, lists


def time_torch(case: bench_inputs.HostCase, k1: int, k2: int, reps: int, *, l2_bytes: int, profile: bool) -> Timing:
    import torch

    from oproj_jax import torch_ref

    return _time_entry(torch, torch_ref.consumer, case, k1, k2, reps, l2_bytes=l2_bytes, profile=profile, what="calls")


def _time_entry(torch, consumer, case, k1: int, k2: int, reps: int, *, l2_bytes: int, profile: bool, what: str):
    """graph_timing of chains of `consumer(mailbox, prefix, blocks, *weights, **options)` calls
    (the prefix threaded through)."""
    options = consumer_options(case.config)
    base, weights, lists = _device_lists(torch, case, k2, l2_bytes)

    def chain(k, mailboxes, blocks, prefix):
        outs = []
        for i in range(k):
            prefix, output, xmoe = consumer(mailboxes[i], prefix, blocks[i], *weights, **options)
            outs.append((output, xmoe))
        return prefix, outs

    timing = graph_timing(torch, chain, lists, k1, k2, reps, profile, what)
    del lists, base
    torch.cuda.empty_cache()
    return timing


def time_triton_torch(
    case: bench_inputs.HostCase,
    k1: int,
    k2: int,
    reps: int,
    *,
    l2_bytes: int,
    profile: bool,
    kept_arrivals: bool = True,
    pdl: bool | None = None,
) -> Timing:
    """The Triton kernels launched from PyTorch (oproj_jax/triton/torch_launch.py) in CUDA graphs:
    the same kernels backend="triton" runs (plan.default_variant's configuration), without XLA in
    between. `kept_arrivals`: one set of arrival counters for the whole chain, as a decode loop
    keeps them (False: zeroed in every call); `pdl`: torch_launch.consumer's. Checked first: one
    launch's prefix must equal torch_ref's bits."""
    import functools

    import torch

    from oproj_jax.triton import plan, torch_launch

    arrivals = torch_launch.arrival_counters(case.config.T, "cuda") if kept_arrivals else None
    consumer = functools.partial(torch_launch.consumer, arrivals=arrivals, pdl=pdl)
    base, weights = _device_base(torch, case)
    prefix = base["prefix"].clone()
    _, output, _ = consumer(base["mailbox"], prefix, base["blocks"], *weights, **consumer_options(case.config))
    err = _check_against_torch_ref(torch, "triton-torch", case.config, base, weights, prefix, output)
    del base, weights, prefix, output
    chosen = plan.default_variant(case.config.T, case.config.H)
    how = f"{chosen}, counters {'kept' if kept_arrivals else 'zeroed per call'}, pdl {pdl}"
    timing = _time_entry(
        torch, consumer, case, k1, k2, reps, l2_bytes=l2_bytes, profile=profile, what=f"Triton launches ({how})"
    )
    timing.method_text += f"; checked first: prefix bits == torch_ref, output rel L2 {err:.1e}"
    return timing


def _check_against_torch_ref(torch, name: str, config, base: dict, weights, prefix, output) -> float:
    """One launch's (prefix, output) on the base inputs against torch_ref: prefix bits equal,
    output within the oracle's relative L2; raises RuntimeError, else returns the rel L2."""
    from oproj_jax import testing, torch_ref

    want_prefix, want_output, _ = torch_ref.consumer(
        base["mailbox"], base["prefix"], base["blocks"], *weights, **dict(consumer_options(config), xmoe_replicas=0)
    )
    torch.cuda.synchronize()
    if not torch.equal(prefix.view(torch.int16), want_prefix.view(torch.int16)):
        raise RuntimeError(f"{name} {config.name}: prefix bits differ from torch_ref")
    err = float((output.double() - want_output.double()).norm() / want_output.double().norm())
    if not err < testing.OUTPUT_REL_L2_TOL:
        raise RuntimeError(f"{name} {config.name}: output rel L2 {err:.2e} vs torch_ref")
    return err


def time_cute_graph(
    case: bench_inputs.HostCase, k1: int, k2: int, reps: int, *, l2_bytes: int, profile: bool
) -> Timing:
    """The CuTe cubin (ready mode, as backend="cute" runs it) launched through the driver API
    (cute/driver_launch.py) into CUDA graphs: the kernel's device time without XLA's host
    launch per call. Checked first: one launch's prefix must equal torch_ref's bits."""
    import torch

    from oproj_jax.cute import backend, driver_launch

    config = case.config
    if config.twoshot:
        raise ValueError("cute-graph times the oneshot kernel only")
    key = backend.kernel_key(config.R, config.NB, twoshot=False, **config.options())
    T, H, reps_x = config.T, config.H, config.xmoe_replicas
    launch = driver_launch.torch_launcher(backend._kernel(key, T, ready=True))
    base, weights, lists = _device_lists(torch, case, k2, l2_bytes)
    flags = torch.zeros(2, dtype=torch.int32, device="cuda")  # [status, hints]

    def call(mailbox, prefix, blocks):  # prefix updated in place; returns (output, xmoe)
        output = torch.empty((T, H), dtype=torch.bfloat16, device="cuda")
        xmoe = torch.empty((max(reps_x, 1), T, H), dtype=torch.bfloat16, device="cuda")
        pointers = [
            mailbox.data_ptr(),
            prefix.data_ptr(),
            blocks.data_ptr(),
            *(w.data_ptr() for w in weights),
            output.data_ptr(),
            xmoe.data_ptr(),
            flags.data_ptr() + 4,
            flags.data_ptr(),
        ]
        launch(T, pointers, EPS, EPS, backend.READY_TIMEOUT_US)
        return output, xmoe

    prefix = base["prefix"].clone()
    output, _ = call(base["mailbox"], prefix, base["blocks"])
    err = _check_against_torch_ref(torch, "cute-graph", config, base, weights, prefix, output)

    def chain(k, mailboxes, blocks, prefix):
        return [call(mailboxes[i], prefix, blocks[i]) for i in range(k)]

    timing = graph_timing(torch, chain, lists, k1, k2, reps, profile, "kernel launches (cuda-python, PDL)")
    timing.method_text += f"; checked first: prefix bits == torch_ref, output rel L2 {err:.1e}"
    if timing.profiler_note:  # PDL: each launch starts early and waits in griddepcontrol.wait
        timing.profiler_note += (
            "; the kernels of a PDL chain overlap, so their summed durations exceed the "
            "chain's wall time: use the slope"
        )
    del lists, base
    torch.cuda.empty_cache()
    return timing


def copy_bandwidth(reps: int, size: int = 512 * 2**20, k1: int = 2, k2: int = 8) -> dict:
    """torch's device-to-device copy (`dst.copy_(src)`, 512 MiB buffers, two lists of k2
    distinct pairs), k copies between two CUDA events, per-copy time = slope over k1, k2."""
    import torch

    n = size // 4
    srcs = [[torch.full((n,), 7 + i + j * k2, dtype=torch.int32, device="cuda") for i in range(k2)] for j in range(2)]
    dsts = [[torch.empty_like(x) for x in lst] for lst in srcs]

    def run_us(k, j) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(k):
            dsts[j % 2][i].copy_(srcs[j % 2][i])  # noqa: F821 (deleted after their last use)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    for j in range(2):
        run_us(k1, j), run_us(k2, j + 1)
    t1, t2 = [], []
    for j in range(reps):
        t1.append(run_us(k1, 2 * j))
        t2.append(run_us(k2, 2 * j + 1))
    m1, m2 = statistics.median(t1), statistics.median(t2)
    us = (m2 - m1) / (k2 - k1)
    del srcs, dsts
    torch.cuda.empty_cache()
    return dict(
        kind="torch",
        us=us,
        gbps=2 * size / us / 1e3,
        noise_us=(mad(t1) + mad(t2)) / (k2 - k1),
        method=f"torch dst.copy_(src) of {size // 2**20} MiB buffers between CUDA events (bytes counted: "
        f"read + write), slope K1={k1}, K2={k2}, median of {reps}",
    )


def copy_bandwidth_safe(reps: int) -> dict | str:
    try:
        return copy_bandwidth(reps)
    except Exception as err:
        return f"{type(err).__name__}: {err}"


def time_safe(name: str, *args, **kwargs) -> Timing | str:
    """TIMERS[name](...), or the error as a string (runs in a worker process; keeps it alive)."""
    try:
        return TIMERS[name](*args, **kwargs)
    except Exception as err:
        import traceback

        return f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=3)}"[:3000]


def _profiled(torch, graph, k: int) -> tuple[float | None, str]:
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        if not kernels:
            return None, "torch.profiler saw no CUDA kernel events in a graph replay"
        total = sum(e.time_range.elapsed_us() for e in kernels)
        return total / k, f"{len(kernels)} CUDA kernel events in one K2 graph replay (torch.profiler)"
    except Exception as err:
        return None, f"torch.profiler failed: {type(err).__name__}: {err}"


# bench/backends.py: TORCH, CUTE_GRAPH, TRITON_TORCH
TIMERS = {"torch": time_torch, "cute-graph": time_cute_graph, "triton-torch": time_triton_torch}
