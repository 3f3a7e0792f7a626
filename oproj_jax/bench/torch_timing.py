"""The PyTorch baseline: oproj_jax.torch_ref (explicit rank-order adds + AttnRes in torch ops)
on CUDA tensors, timed like the JAX backends: chains of K dependent calls (the prefix threaded
through, each call on its own input set), captured once per input list into a CUDA graph (no
host launch cost), replayed and timed with CUDA events; per-call time = slope over K1, K2.
Cross-check: torch.profiler's CUDA kernel durations of one K2 replay. Imported lazily."""

from __future__ import annotations

import math
import statistics

import numpy as np

from oproj_jax.bench import inputs as bench_inputs
from oproj_jax.bench.timing import EPS, Timing, mad


def _to_cuda(torch, x):  # numpy bf16 -> torch bf16 on the GPU
    raw = np.ascontiguousarray(x).view(np.int16)
    return torch.from_numpy(raw).to("cuda").view(torch.bfloat16)


def time_torch(case: bench_inputs.HostCase, k1: int, k2: int, reps: int, *, l2_bytes: int, profile: bool) -> Timing:
    import torch

    from oproj_jax import torch_ref

    config = case.config
    options = dict(eps=EPS, out_eps=EPS, has_delta=config.has_delta, groups=config.groups, xmoe_replicas=config.xmoe_replicas)
    list_bytes = k2 * bench_inputs.stream_bytes(config)
    n_lists = min(64, max(2, math.ceil(4 * l2_bytes / list_bytes) + 1))
    base = {name: _to_cuda(torch, case.inputs[name]) for name in ("mailbox", "blocks", "prefix", *bench_inputs.WEIGHTS)}
    weights = [base[name] for name in bench_inputs.WEIGHTS]
    lists = [([base["mailbox"].clone() for _ in range(k2)], [base["blocks"].clone() for _ in range(k2)], base["prefix"].clone())
             for _ in range(n_lists)]

    def chain(k, mailboxes, blocks, prefix):
        outs = []
        for i in range(k):
            prefix, output, xmoe = torch_ref.consumer(mailboxes[i], prefix, blocks[i], *weights, **options)
            outs.append((output, xmoe))
        return prefix, outs

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
    torch.cuda.synchronize()

    def replay_us(k, j) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs[k, j % n_lists].replay()
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
        f"CUDA graph of an unrolled chain of dependent calls, replay timed with CUDA events: (t(K2)-t(K1))/(K2-K1), "
        f"K1={k1}, K2={k2}, median of {reps}, {n_lists * k2} distinct input sets rotated (L2-cold)"
    )
    if profile:
        timing.us_profiler, timing.profiler_note = _profiled(torch, graphs[k2, 0], k2)
    del graphs, lists, base
    torch.cuda.synchronize()
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
            dsts[j % 2][i].copy_(srcs[j % 2][i])
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
    return dict(kind="torch", us=us, gbps=2 * size / us / 1e3, noise_us=(mad(t1) + mad(t2)) / (k2 - k1),
                method=f"torch dst.copy_(src) of {size // 2**20} MiB buffers between CUDA events (bytes counted: "
                       f"read + write), slope K1={k1}, K2={k2}, median of {reps}")


def copy_bandwidth_safe(reps: int) -> dict | str:
    try:
        return copy_bandwidth(reps)
    except Exception as err:
        return f"{type(err).__name__}: {err}"


def time_torch_safe(*args, **kwargs) -> Timing | str:
    """time_torch, or the error as a string (runs in a worker process; keeps it alive)."""
    try:
        return time_torch(*args, **kwargs)
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
