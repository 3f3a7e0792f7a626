"""Device time per call, measured as the slope of unrolled chains of dependent calls.

Why not a loop: a jitted `fori_loop` pays ~11 us of host round trip per iteration on the H200
and XLA hoists loop-invariant work out of it (docs/perf.md). Instead one jit holds K calls in
straight-line code: call i reads its own input set (distinct buffers, so XLA can neither CSE
nor hoist anything), takes the previous call's prefix as its prefix (so every call depends on
the one before and none can be dropped or reordered), and every output is returned (kept
live). The wall time of such an execution is overhead + K * per-call time, so

    per-call time = (t(K2) - t(K1)) / (K2 - K1),  t = median wall time of an execution.

Both jits take the same K2 input sets (keep_unused=True), so the per-argument dispatch cost
cancels too. The profiler's device times (kernel durations summed per call) are a cross-check.

Three forms of the chain (BUFFERS):
- "pipelined", a decode loop's form (the bench's default and the record's): every execution
  reads the same input sets and carries its state (the prefix, every output) from one execution
  to the next by donation, so no buffer moves between executions; executions are dispatched
  back to back (PIPELINE per sample, waited for once), as a jitted decode loop that keeps its
  state on the device runs them: the host prepares execution i+1 while the device runs
  execution i. Its record carries the three figures of that loop's chains (below).
- "donated": the same, every execution waited for before the next is dispatched, so the host's
  work before each launch (XLA's stages of every thunk, such as a custom call's prepare and
  initialize) adds to the device's, as in a loop that reads its results every step. Its slopes
  scatter by several us per call between processes at T <= 64 (the host's jitter).
- "rotated": executions cycle through lists of input copies (inputs.DevicePool) and every
  output is a new allocation, so every buffer moves between executions. Inside XLA's command
  buffer (a CUDA graph) each moved buffer is a graph update before the launch, host work per
  call that a loop with donated state does not pay (docs/perf.md).

Every form starts with a pass over a large buffer (_prelude): it evicts L2, so every call
reads its inputs from HBM, and it keeps the device busy until the host is done with the
execution, so the device's time per call is never hidden behind the host's work in the
shorter chain.

What a decode loop pays per call, and which figure says it. A pipelined Timing (and its
record) carries all three beside `us`:
- `us_donated`, the waited form's slope on the same executables: a loop that waits for every
  step (it reads a result on the host, say) pays the host's work and the device's one after
  the other.
- `us_pipelined`, the pipelined slope: the device's time per call, what a loop that keeps its
  state on the device and dispatches its steps back to back pays while its host keeps ahead.
- `us_host`, the host's own dispatch time per call (host_dispatch_us: how long fn() takes to
  return, on the host's clock, the K2 chain less the K1 chain, over K2 - K1): what such a loop
  pays instead where it is the larger, the host then being the bottleneck. The difference of
  two medians can come out negative from the host's jitter: that is an artefact, reported as
  not measured (None), never as a negative time.
- `us` = max(us_pipelined, us_host): what a caller dispatching back to back pays per call,
  the record's figure. Why the max: the prelude (about 1 ms on the H200 before the first call
  of every pipelined execution) gives the host slack to prepare the next execution that a
  decode loop, whose steps follow each other without such a pass, does not have, so the slope
  alone could hide a host slower than the device.
The waited form's Timing has `us` = `us_donated` (its host work is inside the slope already);
the rotated form's `us` is its slope.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import math
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
from jax import lax

from oproj_jax import api, configs
from oproj_jax.bench import inputs as bench_inputs

EPS = 1e-6
BUFFERS = ("donated", "rotated", "pipelined")
RECORD_FORM = "pipelined"  # the bench's default form and the record's
PIPELINE = 8  # executions dispatched back to back per sample of the pipelined form


def parse_buffers(text: str) -> tuple[str, ...]:
    """--buffers "donated,rotated" -> ("donated", "rotated"); a ValueError naming what is known."""
    forms = tuple(b.strip() for b in text.split(",") if b.strip())
    if not forms or set(forms) - set(BUFFERS):
        raise ValueError(f"--buffers: expected some of {','.join(BUFFERS)}, got {text!r}")
    return forms


H200_L2_BYTES = 50 * 2**20  # H200 L2 cache (50 MB)
CPU_CACHE_BYTES = 32 * 2**20  # a generous last-level cache for the CPU runs


@dataclasses.dataclass
class Timing:
    us: float  # what a caller pays per call (module docstring): the slope, or caller_pays(...) for pipelined
    k1: int
    k2: int
    reps: int  # timed executions per chain length
    n_sets: int  # distinct input sets cycled through
    t_k1_us: float  # median wall time of one K1 execution
    t_k2_us: float
    noise_us: float  # (MAD(t(K1)) + MAD(t(K2))) / (K2 - K1)
    us_profiler: float | None = None  # device time per call from the profiler trace (all events)
    profiler_note: str | None = None
    # the same less the memcpy events: in a chain those are XLA's copy of the non-donated
    # prefix argument (aliased by the kernel), once per execution before the first call
    us_profiler_kernels: float | None = None
    # the kernels' busy time (union of their intervals): less than us_profiler_kernels where
    # PDL let a kernel start while its predecessor ran
    us_profiler_busy: float | None = None
    us_profiler_single: float | None = None  # kernel time per call of the one-call executable
    profiler_single_note: str | None = None
    method_text: str | None = None  # set by timers that measure differently (torch: CUDA graphs)
    buffers: str | None = None  # the chain's form (BUFFERS); None: not a chain (method_text says what)
    # pipelined form: the host's time per call to dispatch an execution (host_dispatch_us); None
    # where not measured, or where the difference came out negative (an artefact of the host's jitter)
    us_host: float | None = None
    us_pipelined: float | None = None  # the pipelined slope (pipelined form)
    us_donated: float | None = None  # the waited form's slope (pipelined form: on the same executables)

    @property
    def method(self) -> str:
        if self.method_text:
            return self.method_text
        if self.buffers == "donated":
            sets = f"{self.n_sets} distinct input sets, the state donated from execution to execution"
        elif self.buffers == "pipelined":
            sets = (
                f"{self.n_sets} distinct input sets, the state donated from execution to execution, {PIPELINE} "
                "executions dispatched back to back per sample (the host's work overlaps the device's)"
            )
        else:
            sets = f"{self.n_sets} distinct input sets rotated, new output buffers every execution"
        sets += ", each execution after a prelude pass that evicts L2 (L2-cold)"
        if self.buffers == "pipelined":
            sets += (
                "; us = max(that slope, the host's dispatch time per call us_host); us_donated: the same "
                "executables, each execution waited for"
            )
        return (
            f"slope of unrolled chains of dependent calls in one jit: (t(K2)-t(K1))/(K2-K1), "
            f"K1={self.k1}, K2={self.k2}, median of {self.reps} executions each, {sets}"
        )


def chain_lengths(config: configs.Config, platform: str) -> tuple[int, int]:
    """(K1, K2): the difference of the chains should take >= ~1 ms at a few TB/s (a rough guess
    of 15 us + bytes / 3 TB/s per call), with 8 <= K2 <= 32 (at least 6 calls apart: one slow
    execution moves a slope over fewer calls by tens of us at T = 4096; K2 <= 32 keeps compile
    times bounded)."""
    if platform != "gpu":
        return 1, 3  # CPU smoke runs: kernels are interpreted there, each call is slow
    est_us = 15.0 + configs.min_bytes(config) / 3e6
    k2 = min(32, max(8, math.ceil(1.33 * 1500.0 / est_us)))
    return max(1, k2 // 4), k2


@functools.lru_cache(maxsize=16)
def consumer_step(backend: str, config: configs.Config):
    """One consumer call of `backend` as a jitted function of the six arrays (lowered once,
    reused by every call site of a chain, and by the chains of every form of a backend and T)."""
    return jax.jit(functools.partial(api.consumer, backend=backend, **consumer_options(config)))


def consumer_options(config: configs.Config) -> dict:
    """The consumer's options in every benchmark call of `config`."""
    return dict(eps=EPS, out_eps=EPS, **config.options())


def shape_fields(config: configs.Config) -> dict:
    """The fields of a timing record that name its shape (bench/report.py, "timing")."""
    return dict(T=config.T, R=config.R, NB=config.NB, groups=config.groups, has_delta=config.has_delta)


def _prelude(prefix, buffer):
    """A pass over `buffer` that the first call waits for. It evicts L2, so every call of the
    chain reads its inputs from HBM, and it keeps the device busy past the host's own work for
    the execution (prelude_bytes), so that t(K) = host work before the launch + prelude + the
    device time of the K calls: the slope is then the device's time per call (plus any host work
    per call before the launch, such as graph updates), never hidden behind the host."""
    buffer = buffer + jnp.uint32(1)
    return lax.optimization_barrier((prefix, buffer))


@functools.lru_cache(maxsize=4)
def consumer_chain(step, k: int, name: str):
    """The rotated form: jit of k dependent calls, (mailboxes[K2], blocks[K2], prefix, norm,
    query, out_norm, prelude) -> (final prefix, k outputs, k xmoes, prelude), the prelude buffer
    donated (_prelude). Only the first k sets are read; the rest are kept arguments so the K1 and
    K2 executables take the same arguments."""

    def chain(mailboxes, blocks, prefix, norm, query, out_norm, prelude):
        prefix, prelude = _prelude(prefix, prelude)
        outputs, xmoes = [], []
        for i in range(k):
            prefix, output, xmoe = step(mailboxes[i], prefix, blocks[i], norm, query, out_norm)
            outputs.append(output)
            xmoes.append(xmoe)
        return prefix, outputs, xmoes, prelude

    chain.__name__ = chain.__qualname__ = name
    return jax.jit(chain, keep_unused=True, donate_argnums=(6,))


@functools.lru_cache(maxsize=4)  # the donated and pipelined forms time the same executables
def donated_chain(step, k: int, name: str):
    """The donated form, a decode loop's: jit of k dependent calls, (mailboxes[K2], blocks[K2],
    norm, query, out_norm, prefix, outputs[K2], xmoes[K2], prelude) -> (prefix, outputs, xmoes,
    prelude), the last four donated. Calls i < k write outputs[i] and xmoes[i] in place of the
    donated buffers; the rest pass through, so the K1 and K2 executables take and return the same
    arguments."""

    def chain(mailboxes, blocks, norm, query, out_norm, prefix, outputs, xmoes, prelude):
        prefix, prelude = _prelude(prefix, prelude)
        outputs, xmoes = list(outputs), list(xmoes)
        for i in range(k):
            prefix, outputs[i], xmoes[i] = step(mailboxes[i], prefix, blocks[i], norm, query, out_norm)
        return prefix, tuple(outputs), tuple(xmoes), prelude

    chain.__name__ = chain.__qualname__ = name
    return jax.jit(chain, keep_unused=True, donate_argnums=(5, 6, 7, 8))


class Loop:
    """Runs a chain as a loop does: the trailing part of what it returns (`state`, donated) is
    what it is given next, so those buffers stay where they are. loop(*args) = fn(*inputs,
    *args, *state)."""

    def __init__(self, fn, state, inputs=()):
        self.fn, self.state, self.inputs = fn, tuple(jax.block_until_ready(state)), tuple(inputs)

    def __call__(self, *args):
        out = self.fn(*self.inputs, *args, *self.state)
        self.state = tuple(out[len(out) - len(self.state) :])
        return out


def prelude_buffer(platform: str):
    return jnp.zeros((prelude_bytes(platform) // 4,), jnp.uint32)


def rotated_loop(fn, platform: str) -> Loop:
    """consumer_chain's executable with its prelude buffer: called with pool.args(i)."""
    return Loop(fn, (prelude_buffer(platform),))


def donated_loop(fn, step, pool: bench_inputs.DevicePool, k2: int, platform: str) -> Loop:
    """donated_chain's executable on the pool's first list, with its initial state: called with
    no arguments."""
    mailboxes, blocks, prefix = pool.lists[0]
    shapes = jax.eval_shape(step, mailboxes[0], prefix, blocks[0], *pool.weights)
    zeros = lambda s: None if s is None else jnp.zeros(s.shape, s.dtype)  # noqa: E731
    state = (
        jnp.copy(prefix),
        tuple(zeros(shapes.output) for _ in range(k2)),
        tuple(zeros(shapes.xmoe) for _ in range(k2)),
        prelude_buffer(platform),
    )
    return Loop(fn, state, (mailboxes, blocks, *pool.weights))


def _run_once(fn, args) -> float:
    start = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    elapsed = time.perf_counter() - start
    del out
    return elapsed * 1e6


def _run_pipelined(fn, args_of, first: int, n: int) -> float:
    """Mean wall time in us of n executions dispatched back to back (JAX dispatches
    asynchronously: the host prepares execution i+1 while the device runs execution i), each on
    its own argument set, waited for once at the end: on the last one's results (the executions
    run in order on the device's stream; a donated loop's earlier results are consumed)."""
    start = time.perf_counter()
    outs = [fn(*args_of(first + i)) for i in range(n)]
    jax.block_until_ready(outs[-1])
    elapsed = time.perf_counter() - start
    del outs
    return elapsed * 1e6 / n


def dispatch_us(fn, args=(), reps: int = 10) -> float:
    """Median host time in us for fn(*args) to return, each execution waited for afterwards. JAX
    dispatches asynchronously: this is the host's work to enqueue an execution (XLA's stages of
    every thunk, the command buffer's launch), not the device's."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        out = fn(*args)
        times.append((time.perf_counter() - start) * 1e6)
        jax.block_until_ready(out)
        del out
    return statistics.median(times)


def dispatch_slope(fn1, fn2, k1: int, k2: int, reps: int, args_of=lambda i: ()) -> float:
    """The difference behind the host's dispatch time per call of the chains: (dispatch(K2) -
    dispatch(K1)) / (K2 - K1), dispatch_us of each (on args_of(0)), as measured: the jitter of
    two medians can make it negative. Records take host_dispatch_us."""
    return (dispatch_us(fn2, args_of(0), reps=reps) - dispatch_us(fn1, args_of(0), reps=reps)) / (k2 - k1)


def host_dispatch_us(fn1, fn2, k1: int, k2: int, reps: int, args_of=lambda i: ()) -> float | None:
    """The host's dispatch time per call (`us_host`): dispatch_slope, or None where that comes
    out negative: the host cannot take less time to dispatch more calls, so a negative
    difference is an artefact of its jitter, not a measurement."""
    per_call = dispatch_slope(fn1, fn2, k1, k2, reps, args_of)
    return per_call if per_call >= 0 else None


def caller_pays(us_pipelined: float | None, us_host: float | None) -> float | None:
    """What a caller that dispatches its calls back to back pays per call: the larger of the
    pipelined slope (the device's time) and the host's dispatch time per call, either of them
    where the other is not measured (module docstring)."""
    known = [us for us in (us_pipelined, us_host) if us is not None]
    return max(known) if known else None


def mad(values) -> float:
    m = statistics.median(values)
    return statistics.median(abs(v - m) for v in values)


def slope(
    fn1, fn2, args_of, k1: int, k2: int, reps: int, warmup: int = 2, pipelined: int = 0
) -> tuple[float, float, float, float]:
    """(per-call us, median t(K1) us, median t(K2) us, noise us); K1 and K2 executions
    interleaved, each on the next argument set of args_of(i). noise = (MAD(t1) + MAD(t2)) /
    (K2 - K1): a rough per-call uncertainty of the slope.

    pipelined=0: every execution is waited for before the next is dispatched (host and device
    times add up per execution). pipelined=n: each sample is the mean of n executions
    dispatched back to back (_run_pipelined), as a decode loop that never reads its results on
    the host runs them: the host's work for one execution overlaps the device's for the last."""
    i = 0
    for _ in range(warmup):  # compile, first touch, allocator warm-up
        for fn in (fn1, fn2):
            _run_once(fn, args_of(i))
            i += 1
    t1, t2 = [], []
    for _ in range(reps):
        if pipelined:
            t1.append(_run_pipelined(fn1, args_of, i, pipelined))
            t2.append(_run_pipelined(fn2, args_of, i + pipelined, pipelined))
            i += 2 * pipelined
            continue
        t1.append(_run_once(fn1, args_of(i)))
        t2.append(_run_once(fn2, args_of(i + 1)))
        i += 2
    m1, m2 = statistics.median(t1), statistics.median(t2)
    return (m2 - m1) / (k2 - k1), m1, m2, (mad(t1) + mad(t2)) / (k2 - k1)


def time_backend(
    backend: str,
    pool: bench_inputs.DevicePool,
    config: configs.Config,
    k1: int,
    k2: int,
    reps: int,
    profile: bool,
    *,
    step=None,
    profile_single: bool = True,
    buffers: str = RECORD_FORM,
) -> Timing:
    """`step`: the jitted call to chain (default consumer_step(backend, config); a variant of a
    backend's kernel, say); `backend` then only names the chains. `buffers`: the chain's form
    (BUFFERS)."""
    if buffers not in BUFFERS:
        raise ValueError(f"buffers: expected one of {BUFFERS}, got {buffers!r}")
    step = step or consumer_step(backend, config)
    name = f"chain_{backend}_T{config.T}_{'rotated' if buffers == 'rotated' else 'donated'}_K"
    platform = jax.default_backend()
    if buffers in ("donated", "pipelined"):
        fn1, fn2 = (donated_loop(donated_chain(step, k, f"{name}{k}"), step, pool, k2, platform) for k in (k1, k2))
        args_of, n_sets = (lambda i: ()), k2
    else:
        fn1, fn2 = (rotated_loop(consumer_chain(step, k, f"{name}{k}"), platform) for k in (k1, k2))
        args_of, n_sets = pool.args, pool.n_sets
    pipelined = PIPELINE if buffers == "pipelined" else 0
    us, m1, m2, noise = slope(fn1, fn2, args_of, k1, k2, reps, pipelined=pipelined)
    timing = Timing(us, k1, k2, reps, n_sets, m1, m2, noise, buffers=buffers)
    if buffers == "donated":
        timing.us_donated = us
    elif pipelined:  # the three figures of a decode loop's chains, and what a caller pays
        timing.us_pipelined = us
        timing.us_donated = slope(fn1, fn2, args_of, k1, k2, reps, warmup=0)[0]
        timing.us_host = host_dispatch_us(fn1, fn2, k1, k2, reps)
        timing.us = caller_pays(timing.us_pipelined, timing.us_host)
    if profile:
        profiled = profiled_slope(fn1, fn2, args_of, k1, k2)
        timing.us_profiler, timing.profiler_note, timing.us_profiler_kernels, timing.us_profiler_busy = profiled
        if profile_single:
            timing.us_profiler_single, timing.profiler_single_note, _, _ = profiled_single_us(step, pool)
    return timing


# --- profiler cross-check ---------------------------------------------------------------------


def busy_us(intervals) -> float:
    """Length in us of the union of (start_ns, end_ns) intervals: device time during which at
    least one of them ran. Kernels launched with PDL start before their predecessor ends and
    wait (griddepcontrol.wait); summing durations counts that overlap twice, the union does not."""
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total / 1e3


def traced_events(run) -> tuple[list[tuple[int, int, str]], list[tuple[str, int, float]]]:
    """One traced call of run() (waited for): its device events (start_ns, end_ns, name) on the
    GPU stream lines, sorted by start, and its host events as (name, count, summed us), the
    largest total first."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            jax.block_until_ready(run())
        (path,) = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)[:1]
        data = jax.profiler.ProfileData.from_file(path)
        device, host = [], {}
        for plane in data.planes:
            for line in plane.lines:
                for event in line.events:
                    if plane.name.startswith("/device:GPU") and line.name.startswith("Stream"):
                        device.append((event.start_ns, event.start_ns + event.duration_ns, event.name))
                    elif plane.name.startswith("/host"):
                        n, total = host.get(event.name, (0, 0.0))
                        host[event.name] = (n + 1, total + event.duration_ns / 1e3)
    device.sort()
    return device, sorted(((name, n, us) for name, (n, us) in host.items()), key=lambda x: -x[2])


def _device_event_summary(xplane_path: str) -> tuple[dict[str, tuple[int, float]], dict[str, float], float]:
    """GPU plane line name -> (events, summed duration in us); over the stream lines, kernel
    name -> summed duration in us (where the time goes: the kernel, copies, fusions); and the
    busy time (busy_us) of the stream events other than memcpys."""
    data = jax.profiler.ProfileData.from_file(xplane_path)
    summary, kernels, intervals = {}, {}, []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            n, total = 0, 0.0
            for event in line.events:
                n += 1
                total += event.duration_ns / 1e3
                if line.name.startswith("Stream"):
                    kernels[event.name] = kernels.get(event.name, 0.0) + event.duration_ns / 1e3
                    if not event.name.lower().startswith("memcpy"):
                        intervals.append((event.start_ns, event.start_ns + event.duration_ns))
            key = f"{plane.name}|{line.name}"
            summary[key] = (n, total)
    return summary, kernels, busy_us(intervals)


Profile = tuple[float | None, str, float | None, float | None]


def profiled_us(run, calls_per_run: int, runs: int = 3) -> Profile:
    """Summed device time per call from a jax.profiler trace of `runs` calls of run(i) (each
    doing `calls_per_run` consumer calls; run(0) runs untraced first), read from the GPU
    'Stream' lines of the xplane; a note naming the lines used; the time per call of the
    events other than memcpys (the kernels); and their busy time per call (busy_us)."""
    if jax.default_backend() != "gpu":
        return None, "profiler cross-check runs on the GPU only", None, None
    try:
        jax.block_until_ready(run(0))
        with tempfile.TemporaryDirectory() as tmp:
            with jax.profiler.trace(tmp):
                for i in range(runs):
                    jax.block_until_ready(run(i + 1))
            paths = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
            if not paths:
                return None, "no xplane.pb written", None, None
            summary, kernels, busy = _device_event_summary(paths[0])
    except Exception as err:  # the cross-check must not abort a benchmark run
        return None, f"profiler failed: {type(err).__name__}: {err}", None, None
    streams = {key: v for key, v in summary.items() if key.split("|", 1)[1].startswith("Stream")}
    if not streams:
        return None, f"no GPU stream lines in the trace (lines: {sorted(summary)})", None, None
    total = sum(v[1] for v in streams.values())
    events = sum(v[0] for v in streams.values())
    note = f"{events} device events on {len(streams)} stream line(s): " + ", ".join(
        f"{key.split('|', 1)[1]} ({v[0]} ev)" for key, v in sorted(streams.items())
    )
    calls = runs * calls_per_run
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:4]
    note += "; per call: " + ", ".join(f"{name[:60]} {us / calls:.2f} us" for name, us in top)
    copies = sum(us for name, us in kernels.items() if name.lower().startswith("memcpy"))
    return total / calls, note, (total - copies) / calls, busy / calls


def profiled_us_per_call(fn, args_of, k: int, executions: int = 3) -> Profile:
    """Kernel time per call of a k-call chain executable."""
    return profiled_us(lambda i: fn(*args_of(i)), k, executions)


def profiled_slope(fn1, fn2, args_of, k1: int, k2: int, executions: int = 3) -> Profile:
    """Device time per call as the difference of two chains' profiles over (K2 - K1): what runs
    once per execution (the prelude, a copy of an argument) cancels, as in the wall-time slope."""
    total1, note1, kernels1, busy1 = profiled_us(lambda i: fn1(*args_of(i)), 1, executions)
    total2, note2, kernels2, busy2 = profiled_us(lambda i: fn2(*args_of(i)), 1, executions)
    if total1 is None or total2 is None:
        return None, note1 if total1 is None else note2, None, None
    per_call = lambda a, b: None if a is None or b is None else (b - a) / (k2 - k1)  # noqa: E731
    note = f"difference of the K{k2} and K{k1} chains' profiles over {k2 - k1}; K{k2}: {note2}"
    return per_call(total1, total2), note, per_call(kernels1, kernels2), per_call(busy1, busy2)


def profiled_single_us(step, pool: bench_inputs.DevicePool, calls: int = 8) -> Profile:
    """Kernel time per call of the one-call executable (`step` jitted alone), `calls` calls per
    run on distinct input sets, outputs kept until the run ends: shows whether compiling the
    call inside a chain changed XLA's choices."""

    def run(i):
        outs = []
        for c in range(calls):
            n = i * calls + c
            mailboxes, blocks, prefix, *weights = pool.args(n // pool.k)
            outs.append(step(mailboxes[n % pool.k], prefix, blocks[n % pool.k], *weights))
        return outs

    return profiled_us(run, calls)


# --- copy bandwidth ----------------------------------------------------------------------------


def copy_chain(k: int, kind: str):
    """k dependent passes, each over its own source buffer, all results kept live; the scalar s
    of the previous result is tied in behind an optimization barrier (no fusion across it).
    kind "d2d": y_i = copy(src_i) (XLA copy of a buffer: a device-to-device copy);
    kind "xor": y_i = src_i ^ s (an elementwise read+write kernel)."""

    def chain(sources):
        outs = []
        s = jnp.uint32(0)
        for i in range(k):
            if kind == "d2d":
                x, _ = lax.optimization_barrier((sources[i], s))
                y = jnp.copy(x)
            else:
                y = sources[i] ^ s
            outs.append(y)
            s = lax.optimization_barrier(y[0])
        return outs

    chain.__name__ = chain.__qualname__ = f"copy_{kind}_chain_K{k}"
    return jax.jit(chain, keep_unused=True)


@dataclasses.dataclass
class CopyBandwidth:
    kind: str
    bytes_per_copy: int  # read + write
    us: float
    k1: int
    k2: int
    reps: int
    noise_us: float
    us_profiler: float | None = None
    profiler_note: str | None = None

    @property
    def gbps(self) -> float:
        return self.bytes_per_copy / self.us / 1e3

    @property
    def method(self) -> str:
        what = "device-to-device copy (XLA copy)" if self.kind == "d2d" else "elementwise read+write kernel (x ^ s)"
        return (
            f"{what} of {self.bytes_per_copy // 2 // 2**20} MiB buffers (bytes counted: read + write), "
            f"slope of unrolled dependent chains K1={self.k1}, K2={self.k2}, median of {self.reps}"
        )


def copy_bandwidth(platform: str, reps: int, profile: bool, kinds=("d2d", "xor")) -> list[CopyBandwidth]:
    size = (512 if platform == "gpu" else 32) * 2**20  # bytes per buffer; >> L2
    k1, k2 = (2, 8) if platform == "gpu" else (1, 3)
    n_lists = 2
    make = jax.jit(lambda i: jnp.full((size // 4,), i, jnp.uint32) * jnp.arange(size // 4, dtype=jnp.uint32))
    lists = [tuple(make(jnp.uint32(7 + j * k2 + i)) for i in range(k2)) for j in range(n_lists)]
    jax.block_until_ready(lists)
    args_of = lambda i: (lists[i % n_lists],)  # noqa: F821 (lists is deleted after its last use)
    results = []
    for kind in kinds:
        fn1, fn2 = copy_chain(k1, kind), copy_chain(k2, kind)
        us, _, _, noise = slope(fn1, fn2, args_of, k1, k2, reps)
        result = CopyBandwidth(kind, 2 * size, us, k1, k2, reps, noise)
        if profile:
            result.us_profiler, result.profiler_note, _, _ = profiled_us_per_call(fn2, args_of, k2)
        results.append(result)
    del lists
    return results


def l2_bytes(platform: str) -> int:
    return H200_L2_BYTES if platform == "gpu" else CPU_CACHE_BYTES


def prelude_bytes(platform: str) -> int:
    """The chains' prelude buffer (_prelude): twice the L2 and, on a GPU, >= 2 GiB, a pass of
    ~1 ms on the H200, longer than the host's work after it launches an execution (~0.5 ms for
    the chains here)."""
    return max(2 * l2_bytes(platform), 2 * 2**30 if platform == "gpu" else 0)
