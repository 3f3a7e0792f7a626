"""mode="peer"'s fault handling with R processes sharing ONE GPU (skipped without a CUDA GPU).

Each test starts R workers (`python tests/test_peer_faults_gpu.py worker SCENARIO PROCESS_ID
COUNT PORT`) on the same GPU: each process takes device 0 (`local_device_ids=[0]`), so the
mesh has R devices, one per process, whose ranks reach each other's mailboxes through CUDA IPC
on that one device. Each worker holds what its own rank got against a single-device oracle it
computes itself from the same seeded inputs (api.consumer on the full mailbox, backends cute
and reference): the prefix bit for bit, the output within testing.OUTPUT_REL_L2_TOL, xmoe as
the output with -0.0 written as +0.0. There is no cross-process collective anywhere (only
jax.distributed's barriers and key-value store). A worker prints one line per check
("process I: NAME: ok" or "... FAIL") and exits nonzero when one failed; the test asserts the
exit codes and the lines.

The behaviour held here (oproj_jax/cute/peer.py, docs/spec.md "Mailbox protocol"):
  * status bits: 1 the consumer gave up on an empty slot, 4 the publish gave up, 8 REFUSED (the
    group had failed before the step: it only wrote NaN), 16 the group was closed;
  * fail-stop: a failed step never returns a finite wrong number: each token row of the output
    is correct (its prefix row bit-exact, the row within tolerance) or entirely NaN, each
    8-element prefix fragment bit-exact or NaN; after a rank gives up, its every later step is
    refused (all NaN, status & 8) until peer.reset(), and check_status raises;
  * first calls meet: launch skew far above timeout_us (compiles) is no error;
  * one deadline per call: a dead rank makes a step return in about timeout_us at any T;
  * bounded memory: one mailbox [R, max_tokens, H] per group and process, whatever T;
    T > max_tokens raises; peer.close() frees everything, a step traced later reopens the group,
    and a step compiled before the close is refused (status 8 | 16, NaN), never a fault.

Tests: *_exact (R = 2, 4, 16 ranks: eager steps and jitted chains, every rank exact),
late_publish_fails_stop, first_call_skew_meets, deadline_dead_rank_large_T and
bounded_memory_close (R = 2).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import subprocess
import sys
import time
import traceback

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import REPO, worker_env

from oproj_jax import api, configs, processes, testing
from oproj_jax.cute import peer
from oproj_jax.sharded import tp_consumer

FRAGMENT = 8  # bf16 elements per 16-byte mailbox fragment
REFUSED = 8  # status bit: the group had failed before this step, which only wrote NaN
CONNECT_S = 120  # connect_timeout_s: up to 16 processes start, import and compile at once

BARRIER_S = 120  # every barrier of these workers (peer.reset / close included)
SLOW_RANK = 1  # the rank that sleeps (late publish, launch skew) or never publishes (dead rank)
NAMES = ("prefix", "blocks", "norm", "query", "out_norm")

# ---- the scenarios' plans (used by the workers and by the tests' expected lines) -----------------


def _exact_plan(R: int):
    """(eager configs, chain config, steps per chain, chain executions) of the exact scenario."""
    if R == 2:
        eager = [
            configs.Config(2, 1, 0, groups=1, has_delta=False),
            configs.Config(2, 65, 8, groups=2, xmoe_replicas=1),
        ]
        return eager, configs.Config(2, 8, 8, groups=2), 4, 2
    if R == 4:  # every groups 1..4 at every T in (1, 8, 65), with has_delta, NB and xmoe varied
        eager = [
            configs.Config(4, T, (0, 1, 8, 3)[i % 4], groups=g, has_delta=i % 3 != 1, xmoe_replicas=(0, 1, 0, 2)[i % 4])
            for i, (g, T) in enumerate(itertools.product((1, 2, 3, 4), (1, 8, 65)))
        ]
        return eager, configs.Config(4, 8, 8, groups=4), 4, 2
    if R == 16:
        return [configs.Config(16, 8, 8, groups=4)], configs.Config(16, 8, 8, groups=4), 1, 2
    raise ValueError(f"no exact plan for R = {R}")


def _exact_names(R: int) -> list[str]:
    eager, _, steps, executions = _exact_plan(R)
    return [f"exact: eager {c.name}" for c in eager] + [
        f"exact: jitted chain of {steps} steps, execution {e}" for e in range(executions)
    ]


LATE_STEPS, LATE_SLEEP_S, LATE_TIMEOUT_US = 6, 1.5, 300_000
LATE_NAMES = [
    "late: step 1 exact with status 0",
    "late: no finite wrong value in any step",
    "late: first failed step as expected",
    "late: every step after the first failure refused (all NaN, status & 8)",
    "late: steps 3..6 refused on the punctual rank, 4..6 on the late one",
    "late: check_status raises after the failure",
    "late: step 7 exact after reset",
    "late: step 8 exact after reset",
]

SKEW_SLEEP_S, SKEW_TIMEOUT_US = 2.0, 200_000
# (how the first call is made, config): the group's first call (its mailboxes connect while
# tracing), a new T, a new T compiled ahead (the sleep sits between compile and first launch),
# a new T called eagerly
SKEW_PHASES = (
    ("jit", configs.Config(2, 8, 8, groups=2, xmoe_replicas=1)),
    ("jit", configs.Config(2, 65, 3, groups=1, has_delta=False)),
    ("aot", configs.Config(2, 3, 1, groups=2)),
    ("eager", configs.Config(2, 1, 0, groups=2)),
)
SKEW_NAMES = [
    f"skew: {how} T={c.T} {which} call exact, status 0" for how, c in SKEW_PHASES for which in ("first", "next")
]

DEADLINE_T, DEADLINE_TIMEOUT_US, DEADLINE_SLACK_S = 4096, 200_000, 0.3
DEADLINE_LIMIT_S = 2 * DEADLINE_TIMEOUT_US / 1e6 + DEADLINE_SLACK_S
DEADLINE_NAMES = ["deadline: warm-up step exact"] + [
    name
    for attempt in (1, 2)
    for name in (
        f"deadline: dead-rank step {attempt} returned within {DEADLINE_LIMIT_S:.1f} s",
        f"deadline: dead-rank step {attempt} reported (status or check_status)",
        f"deadline: dead-rank step {attempt} has no finite wrong value",
        f"deadline: exact after reset {attempt}",
    )
]

MEMORY_T = (1, 2, 3, 4, 8, 16, 32, 64, 100, 128, 256, 512)
MEMORY_MAX_TOKENS = 512
MEMORY_NAMES = [f"memory: T={T} exact" for T in MEMORY_T] + [
    "memory: allocation within R * max_tokens * H * 2 plus a control area",
    "memory: one group and the same allocation after every T",
    "memory: T=513 raises ValueError naming max_tokens",
    "memory: the refused T left the group alone",
    "memory: close frees everything",
    "memory: eager step after close exact",
    "memory: the reopened group allocates the same",
    "memory: second close frees everything",
    "memory: jitted step compiled before close refused after it (status 8|16, NaN, check_status names close)",
    "memory: the same step traced again exact",
    "memory: third close frees everything",
]


# ---- the tests -----------------------------------------------------------------------------------

_PROBE = """
import ctypes, json
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as err:
    print(json.dumps({"error": f"no CUDA driver ({err})"}))
    raise SystemExit
count, dev, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
rc = cuda.cuInit(0) or cuda.cuDeviceGetCount(ctypes.byref(count))
if rc or count.value < 1:
    print(json.dumps({"error": f"no CUDA GPU (CUDA driver error {rc}, {count.value} devices)"}))
    raise SystemExit
cuda.cuDeviceGet(ctypes.byref(dev), 0)
cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)  # ..._MINOR
print(json.dumps({"count": count.value, "cc": [major.value, minor.value]}))
"""


@functools.cache
def _gpu_reason() -> str | None:
    """Why these tests cannot go ahead here, or None. Asks the CUDA driver in a child process, so
    this process neither starts JAX's GPU backend (whose memory pool would sit on the GPU the
    workers share) nor holds a CUDA context."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60)
        probe = json.loads(done.stdout.strip().splitlines()[-1])
    except Exception as err:  # no output, a hung driver: no usable GPU
        return f"no CUDA GPU on this machine (the driver probe failed: {type(err).__name__}: {err})"
    if "error" in probe:
        return f"no CUDA GPU on this machine: {probe['error']}"
    major, minor = probe["cc"]
    from oproj_jax import ffi
    from oproj_jax.cute import manifest

    arch = manifest.arch_for_capability(f"{major}.{minor}")
    if arch is None:
        return f"the CuTe cubins are built for {', '.join(manifest.ARCHS)}; GPU 0 is sm_{major}{minor}"
    library, cubins = ffi.library_path(), manifest.arch_dir(arch) / manifest.MANIFEST
    if not library.is_file():
        return f"the FFI library is not built ({library} missing): python -m oproj_jax.build"
    if not cubins.is_file():
        return f"no CuTe cubins ({cubins} missing): python -m oproj_jax.build"
    return None


def gpu_or_skip() -> str:
    """CUDA_VISIBLE_DEVICES for the workers (this process's first GPU) when one Hopper GPU, the
    FFI library and the cubins are present; else the test is skipped."""
    reason = _gpu_reason()
    if reason:
        pytest.skip(reason)
    return os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip() or "0"


def _launch(scenario: str, R: int, timeout_s: float, names: list[str]) -> None:
    """Starts `scenario` in R processes on one GPU; asserts every exit code and every check line."""
    visible = gpu_or_skip()
    env = worker_env(
        drop=("JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES"),
        CUDA_VISIBLE_DEVICES=visible,
        XLA_PYTHON_CLIENT_PREALLOCATE="false",  # R processes share the GPU
        XLA_PYTHON_CLIENT_MEM_FRACTION=f"{min(0.45, 0.9 / R):.3f}",
        NCCL_NVLS_ENABLE="0",
        NVSHMEM_DISABLE_NVLS="1",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
    )
    start = time.monotonic()
    results = processes.run([__file__, "worker", scenario], R, env=env, cwd=REPO, timeout_s=timeout_s)
    print(f"{scenario}: {R} processes finished in {time.monotonic() - start:.1f} s", flush=True)
    report = processes.report(results)
    assert [r.code for r in results] == [0] * R, report
    for i, r in enumerate(results):
        for name in names:
            line = f"process {i}: {name}: ok"
            assert line in r.log, f"missing {line!r}\n{report}"


def test_peer_two_ranks_exact():
    _launch("exact", 2, 300, _exact_names(2))


def test_peer_four_ranks_exact():
    """4 processes: eager steps over groups 1..4 x T in (1, 8, 65) (has_delta, NB, xmoe varied)
    and a jitted chain of 4 dependent steps executed twice with fresh inputs: every rank exact
    with status 0."""
    _launch("exact", 4, 420, _exact_names(4))


@pytest.mark.slow
def test_peer_sixteen_ranks_exact():
    """16 processes on one GPU: an eager step and a jitted step (executed twice), exact."""
    _launch("exact", 16, 540, _exact_names(16))


def test_peer_late_publish_fails_stop():
    """R=2, timeout 300 ms, a jitted step with fresh inputs each step; rank 1 publishes step 2
    1.5 s late. No step on any rank returns a finite wrong value; from its first failed step on,
    every later step of a rank is refused (NaN, status & 8), rank 0 from step 3; check_status
    raises; after peer.reset() the steps are exact again."""
    _launch("late", 2, 300, LATE_NAMES)


def test_peer_first_call_skew_meets():
    """R=2, timeout 200 ms; rank 1 starts each first call (jitted, a new T jitted, a new T
    compiled ahead, a new T eager) 2 s after rank 0: the first calls meet, every step exact."""
    _launch("skew", 2, 300, SKEW_NAMES)


def test_peer_deadline_dead_rank_large_T():
    """R=2, T=4096, timeout 200 ms, rank 1 never publishes: after a warm-up (compile and a
    normal step) the failing step returns within 2 timeouts + 0.3 s in each process, reports the
    failure, holds no finite wrong value; reset() makes the group exact again (twice)."""
    _launch("deadline", 2, 360, DEADLINE_NAMES)


def test_peer_bounded_memory_close():
    """R=2, max_tokens=512: a sweep of T from 1 to 512 keeps one group and one allocation of
    about R * 512 * H * 2 bytes; T=513 raises naming max_tokens; close() frees everything; the
    next eager call reopens the group; a jitted step compiled before a close is refused (status
    8 | 16, NaN, check_status names close) until it is traced again."""
    _launch("memory", 2, 420, MEMORY_NAMES)


# ---- the workers ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Oracle:
    prefix: np.ndarray  # [T, H] bf16: the cute backend's (equal to the reference backend's bits)
    output: np.ndarray  # [T, H] bf16: the cute backend's
    ref_output: np.ndarray  # [T, H] bf16: the reference backend's


@dataclasses.dataclass
class Verdict:
    """One step as one rank saw it."""

    status: int  # this rank's status word
    exact: bool  # prefix bits, every output row, xmoe: all as the oracle's
    clean: bool  # no finite wrong value: every non-exact fragment / row is NaN
    all_nan: bool  # prefix, output and xmoe entirely NaN (a refused step)
    detail: str

    @property
    def ok(self) -> bool:
        return self.exact and self.status == 0

    @property
    def failed(self) -> bool:
        return not self.ok

    @property
    def refused(self) -> bool:
        return self.all_nan and bool(self.status & REFUSED)

    def __str__(self) -> str:
        return f"status {self.status} exact {self.exact} clean {self.clean} all_nan {self.all_nan} ({self.detail})"


def _local(array) -> np.ndarray:
    """This process's copy (its one device) of a replicated or rank-sharded result."""
    return np.asarray(array.addressable_shards[0].data)


def _word(status) -> int:
    """This rank's status word."""
    return int(_local(status).reshape(-1)[0])


def _raises(status) -> str | None:
    """What peer.check_status raised (the live poison word included), or None."""
    try:
        peer.check_status(status)
    except RuntimeError as err:
        return str(err)
    return None


def _nan(x) -> np.ndarray:
    return np.isnan(np.asarray(x, np.float32))


def _judge(res, want: Oracle, cfg: configs.Config) -> Verdict:
    """Holds one step's result (a PeerResult) on this rank against the oracle, fragment by
    fragment (prefix) and row by row (output, xmoe)."""
    T, H = cfg.T, cfg.H
    prefix, output = _local(res.prefix), _local(res.output)
    frag = lambda a: a.reshape(T, H // FRAGMENT, FRAGMENT).all(-1)  # noqa: E731
    p_exact = frag(testing.bits(prefix) == testing.bits(want.prefix))  # [T, H/8]
    p_nan = frag(_nan(prefix))
    out, ref = np.asarray(output, np.float64), np.asarray(want.output, np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        row_err = np.linalg.norm(out - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    row_ok = p_exact.all(-1) & (row_err < testing.OUTPUT_REL_L2_TOL)  # NaN error: not ok
    row_nan = _nan(output).all(-1)
    x_ok = x_nan = np.ones((0, T), bool)
    if cfg.xmoe_replicas:
        xmoe = _local(res.xmoe)  # [reps, T, H]
        x_ok = (testing.bits(xmoe) == testing.published_bits(output)[None]).all(-1) & row_ok[None]
        x_nan = _nan(xmoe).all(-1)
    wrong = dict(
        prefix_fragments=int((~p_exact & ~p_nan).sum()),
        output_rows=int((~row_ok & ~row_nan).sum()),
        xmoe_rows=int((~x_ok & ~x_nan).sum()),
    )
    exact = bool(p_exact.all() and row_ok.all() and x_ok.all())
    if exact:  # also within tolerance of the reference backend's output, as a whole
        error = testing.rel_l2(output, want.ref_output)
        exact = error < testing.OUTPUT_REL_L2_TOL
        wrong["rel_l2_vs_reference"] = float(f"{error:.2e}")
    detail = (
        f"finite wrong: {wrong}; NaN: prefix fragments {int(p_nan.sum())}/{p_nan.size}, "
        f"output rows {int(row_nan.sum())}/{T}, xmoe rows {int(x_nan.sum())}/{x_nan.size}"
    )
    return Verdict(
        status=_word(res.status),
        exact=exact,
        clean=not any(v for k, v in wrong.items() if k != "rel_l2_vs_reference"),
        all_nan=bool(p_nan.all() and row_nan.all() and x_nan.all()),
        detail=detail,
    )


class Worker:
    """One process: its rank of the R-device mesh, the inputs, the oracle and the check lines."""

    def __init__(self, process_id: int, count: int):
        self.pid, self.R = process_id, count
        self.mesh = Mesh(np.array(jax.devices()), ("tp",))
        self.me = jax.local_devices()[0]
        self.rank = [d.id for d in self.mesh.devices.flat].index(self.me.id)
        self.failures = 0
        self._shard, self._rep = NamedSharding(self.mesh, P("tp")), NamedSharding(self.mesh, P())

    def say(self, text: str) -> None:
        print(f"process {self.pid}: {text}", flush=True)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.failures += not ok
        self.say(f"{name}: {'ok' if ok else 'FAIL'}" + (f" ({detail})" if detail else ""))
        return ok

    def args(self, x: dict) -> list:
        """The global arrays of one step: the partials sharded over the ranks, the rest replicated."""
        put = lambda value, s: jax.make_array_from_callback(value.shape, s, lambda index: value[index])  # noqa: E731
        return [put(x["mailbox"], self._shard)] + [put(x[k], self._rep) for k in NAMES]

    def oracle(self, x: dict, cfg: configs.Config) -> Oracle:
        """This rank's device, the full mailbox, ready mode: what every rank must hold."""
        with jax.default_device(self.me):
            cute, ref = (
                api.consumer(x["mailbox"], *(x[k] for k in NAMES), backend=b, **cfg.options())
                for b in ("cute", "reference")
            )
            got = Oracle(np.asarray(cute.prefix), np.asarray(cute.output), np.asarray(ref.output))
        if not np.array_equal(testing.bits(got.prefix), testing.bits(ref.prefix)):
            raise AssertionError(f"{cfg.name}: the oracle's cute and reference prefixes differ")
        return got

    def eager(self, cfg: configs.Config, opts: peer.PeerOptions):
        options = cfg.options()
        return lambda *a: tp_consumer(*a, mesh=self.mesh, mode="peer", peer_options=opts, **options)

    def jitted(self, cfg: configs.Config, opts: peer.PeerOptions, tag: str = ""):
        options, mesh = cfg.options(), self.mesh

        def step(partial, prefix, blocks, norm, query, out_norm):
            return tp_consumer(
                partial, prefix, blocks, norm, query, out_norm, mesh=mesh, mode="peer", peer_options=opts, **options
            )

        step.__name__ = step.__qualname__ = f"peer_step{tag}_T{cfg.T}"
        return jax.jit(step)

    def inputs(self, cfg: configs.Config, seeds) -> tuple[list, list, list]:
        """(inputs, global arrays, oracles) of one step per seed, all made before the first step."""
        xs = [configs.make_inputs(cfg, seed=s) for s in seeds]
        return xs, [self.args(x) for x in xs], [self.oracle(x, cfg) for x in xs]

    def step_exact(self, name: str, res, want: Oracle, cfg: configs.Config) -> bool:
        """The check that one step is exact on this rank with status 0 and check_status silent."""
        jax.block_until_ready(res)
        verdict, raised = _judge(res, want, cfg), _raises(res.status)
        detail = str(verdict) + (f"; check_status raised: {raised}" if raised else "")
        return self.check(name, verdict.ok and raised is None, detail)

    def sleep_if_slow(self, seconds: float, why: str) -> None:
        if self.rank == SLOW_RANK:
            self.say(f"rank {self.rank} sleeps {seconds} s {why}")
            time.sleep(seconds)


def _scenario_exact(w: Worker) -> None:
    eager, chain_cfg, steps, executions = _exact_plan(w.R)
    opts = peer.PeerOptions(connect_timeout_s=CONNECT_S, timeout_us=5_000_000 if w.R > 4 else 1_000_000)
    for i, cfg in enumerate(eager):
        _, (args,), (want,) = w.inputs(cfg, [31 + 7 * i + cfg.T])
        w.say(f"eager {cfg.name}")
        w.step_exact(f"exact: eager {cfg.name}", w.eager(cfg, opts)(*args), want, cfg)

    options = chain_cfg.options()

    @jax.jit
    def chain(partials, prefix, blocks, norm, query, out_norm):  # dependent steps: the prefix threads through
        results = []
        for p in partials:
            res = tp_consumer(
                p, prefix, blocks, norm, query, out_norm, mesh=w.mesh, mode="peer", peer_options=opts, **options
            )
            prefix = res.prefix
            results.append(res)
        return results

    for e in range(executions):
        xs = [configs.make_inputs(chain_cfg, seed=1000 * (e + 1) + k) for k in range(steps)]
        args = [w.args(x) for x in xs]
        x, wants = dict(xs[0]), []
        for k in range(steps):  # each step's oracle from its own partials and the previous exact prefix
            x["mailbox"] = xs[k]["mailbox"]
            wants.append(w.oracle(x, chain_cfg))
            x["prefix"] = wants[-1].prefix
        w.say(f"jitted chain execution {e}")
        results = chain([a[0] for a in args], *args[0][1:])
        jax.block_until_ready(results)
        verdicts = [_judge(r, want, chain_cfg) for r, want in zip(results, wants)]
        raised = [_raises(r.status) for r in results]
        for k, v in enumerate(verdicts):
            w.say(f"chain execution {e} step {k}: {v}")
        ok = all(v.ok for v in verdicts) and not any(raised)
        w.check(f"exact: jitted chain of {steps} steps, execution {e}", ok, f"check_status: {raised}")


def _scenario_late(w: Worker) -> None:
    cfg = configs.Config(2, 8, 8, groups=2, xmoe_replicas=1)
    opts = peer.PeerOptions(timeout_us=LATE_TIMEOUT_US, connect_timeout_s=CONNECT_S)
    steps = range(1, LATE_STEPS + 3)  # 1..6, then 7 and 8 after the reset
    _, args, wants = w.inputs(cfg, [7000 + k for k in steps])
    args, wants = dict(zip(steps, args)), dict(zip(steps, wants))
    step = w.jitted(cfg, opts)

    results = {1: step(*args[1])}
    jax.block_until_ready(results[1])
    processes.barrier("faults/late/step-1", BARRIER_S)  # step 2 then starts together, but for the sleep
    for k in range(2, LATE_STEPS + 1):  # dispatched back to back; nothing read in between
        if k == 2:
            w.sleep_if_slow(LATE_SLEEP_S, "before step 2")
        results[k] = step(*args[k])
    jax.block_until_ready(results)
    w.say("steps 1..6 done")

    verdicts = {k: _judge(results[k], wants[k], cfg) for k in results}
    for k, v in verdicts.items():
        w.say(f"late step {k}: {v}")
    w.check(LATE_NAMES[0], verdicts[1].ok, str(verdicts[1]))
    dirty = [k for k, v in verdicts.items() if not v.clean]
    w.check(LATE_NAMES[1], not dirty, f"steps with finite wrong values: {dirty}")
    first = next((k for k, v in verdicts.items() if v.failed), None)
    expected = (2, 3) if w.rank == SLOW_RANK else (2,)
    w.check(LATE_NAMES[2], first in expected, f"rank {w.rank}: first failed step {first}, expected one of {expected}")
    later = [k for k in verdicts if first is not None and k > first]
    not_refused = [k for k in later if not verdicts[k].refused]
    w.check(LATE_NAMES[3], first is not None and not not_refused, f"after step {first}, not refused: {not_refused}")
    must = range(4 if w.rank == SLOW_RANK else 3, LATE_STEPS + 1)
    w.check(LATE_NAMES[4], all(verdicts[k].refused for k in must), f"rank {w.rank}: steps {list(must)}")
    raised = _raises(results[2].status)
    w.check(LATE_NAMES[5], raised is not None, f"check_status: {raised}")

    peer.reset(timeout_s=BARRIER_S)
    w.say("reset")
    for k in (7, 8):
        w.step_exact(f"late: step {k} exact after reset", step(*args[k]), wants[k], cfg)


def _scenario_skew(w: Worker) -> None:
    opts = peer.PeerOptions(timeout_us=SKEW_TIMEOUT_US, connect_timeout_s=CONNECT_S)
    for i, (how, cfg) in enumerate(SKEW_PHASES):
        _, args, wants = w.inputs(cfg, [500 + 10 * i, 501 + 10 * i])
        call = w.eager(cfg, opts) if how == "eager" else w.jitted(cfg, opts, tag=how)
        if how == "aot":
            call = call.lower(*args[0]).compile()
        processes.barrier(f"faults/skew/{i}", BARRIER_S)
        w.sleep_if_slow(SKEW_SLEEP_S, f"before the first {how} call with T={cfg.T}")
        for which, a, want in zip(("first", "next"), args, wants):
            name = f"skew: {how} T={cfg.T} {which} call exact, status 0"
            try:
                w.step_exact(name, call(*a), want, cfg)
            except Exception as err:  # the eager call raises on a nonzero status
                w.check(name, False, f"{type(err).__name__}: {err}")


def _scenario_deadline(w: Worker) -> None:
    cfg = configs.Config(2, DEADLINE_T, 8, groups=2)
    ok_opts = peer.PeerOptions(timeout_us=DEADLINE_TIMEOUT_US, connect_timeout_s=CONNECT_S, max_tokens=DEADLINE_T)
    dead_opts = dataclasses.replace(ok_opts, skip_publish_rank=SLOW_RANK)
    # three input sets (T=4096 costs seconds of numpy each), cycled so that no two consecutive
    # steps see the same partials
    _, args, wants = w.inputs(cfg, [9100, 9101, 9102])
    step = w.jitted(cfg, ok_opts)
    w.step_exact(DEADLINE_NAMES[0], step(*args[0]), wants[0], cfg)  # compile, first-call meet
    dead = w.jitted(cfg, dead_opts, tag="_dead").lower(*args[1]).compile()  # no compile in the timed call
    for attempt in (1, 2):
        processes.barrier(f"faults/deadline/{attempt}", BARRIER_S)
        start = time.perf_counter()
        res = dead(*args[1])
        jax.block_until_ready(res)
        elapsed = time.perf_counter() - start
        w.say(f"dead-rank step {attempt}: returned after {elapsed:.3f} s (limit {DEADLINE_LIMIT_S:.2f} s)")
        verdict, raised = _judge(res, wants[1], cfg), _raises(res.status)
        w.say(f"dead-rank step {attempt}: {verdict}; check_status: {raised}")
        w.check(
            f"deadline: dead-rank step {attempt} returned within {DEADLINE_LIMIT_S:.1f} s",
            elapsed <= DEADLINE_LIMIT_S,
            f"{elapsed:.3f} s",
        )
        w.check(f"deadline: dead-rank step {attempt} reported (status or check_status)", bool(verdict.status or raised))
        w.check(f"deadline: dead-rank step {attempt} has no finite wrong value", verdict.clean, verdict.detail)
        peer.reset(timeout_s=BARRIER_S)
        w.step_exact(f"deadline: exact after reset {attempt}", step(*args[2]), wants[2], cfg)


def _scenario_memory(w: Worker) -> None:
    opts = peer.PeerOptions(connect_timeout_s=CONNECT_S, max_tokens=MEMORY_MAX_TOKENS)
    mailbox_bytes = w.R * MEMORY_MAX_TOKENS * configs.HIDDEN * 2
    counts = []
    first_bytes = None
    for T in MEMORY_T:
        cfg = configs.Config(2, T, 2, groups=2)
        _, (args,), (want,) = w.inputs(cfg, [300 + T])
        w.step_exact(f"memory: T={T} exact", w.eager(cfg, opts)(*args), want, cfg)
        counts.append((T, peer.group_count(), peer.allocated_bytes()))
        w.say(f"after T={T}: group_count {counts[-1][1]}, allocated_bytes {counts[-1][2]}")
        if first_bytes is None:
            first_bytes = counts[-1][2]
            limit = mailbox_bytes * 1.01 + 2**20
            name = "memory: allocation within R * max_tokens * H * 2 plus a control area"
            w.check(
                name,
                mailbox_bytes <= first_bytes < limit,
                f"{first_bytes} bytes; mailbox {mailbox_bytes}, limit {limit:.0f}",
            )
    same = all(g == 1 and b == first_bytes for _, g, b in counts)
    w.check(
        "memory: one group and the same allocation after every T", same, f"(T, group_count, allocated_bytes): {counts}"
    )

    cfg = configs.Config(2, MEMORY_MAX_TOKENS + 1, 2, groups=2)
    args = w.args(configs.make_inputs(cfg, seed=1))
    try:
        w.eager(cfg, opts)(*args)
        err = None
    except Exception as raised:
        err = raised
    ok = isinstance(err, ValueError) and "max_tokens" in str(err)
    w.check("memory: T=513 raises ValueError naming max_tokens", ok, f"{type(err).__name__}: {err}")
    after = (peer.group_count(), peer.allocated_bytes())
    w.check("memory: the refused T left the group alone", after == (1, first_bytes), f"{after}")

    jcfg = configs.Config(2, 16, 2, groups=2)
    _, jargs, jwants = w.inputs(jcfg, [400, 401])
    jstep = w.jitted(jcfg, opts)
    jax.block_until_ready(jstep(*jargs[0]))  # compiled and executed before the close

    def close(name: str) -> None:
        peer.close()
        state = (peer.group_count(), peer.allocated_bytes())
        w.check(name, state == (0, 0), f"group_count, allocated_bytes after close: {state}")

    close("memory: close frees everything")
    cfg = configs.Config(2, 8, 2, groups=2)  # a T compiled before the close
    _, (args,), (want,) = w.inputs(cfg, [308])
    w.step_exact("memory: eager step after close exact", w.eager(cfg, opts)(*args), want, cfg)
    state = (peer.group_count(), peer.allocated_bytes())
    w.check("memory: the reopened group allocates the same", state == (1, first_bytes), f"{state}")
    close("memory: second close frees everything")
    res = jstep(*jargs[1])  # its group is closed and nothing traced since reopened it
    jax.block_until_ready(res)
    verdict, raised = _judge(res, jwants[1], jcfg), _raises(res.status)
    ok = verdict.all_nan and verdict.status == (REFUSED | peer.STATUS_CLOSED) and "close()" in (raised or "")
    w.check(MEMORY_NAMES[-3], ok, f"{verdict}; check_status: {raised}")
    w.step_exact(MEMORY_NAMES[-2], w.jitted(jcfg, opts, tag="_again")(*jargs[1]), jwants[1], jcfg)
    close(MEMORY_NAMES[-1])


SCENARIOS = dict(
    exact=_scenario_exact,
    late=_scenario_late,
    skew=_scenario_skew,
    deadline=_scenario_deadline,
    memory=_scenario_memory,
)


def _worker(scenario: str, process_id: int, count: int, port: int) -> int:
    processes.initialize(process_id, count, port, local_device_ids=[0])
    w = Worker(process_id, count)
    w.say(f"rank {w.rank} of {w.R}: {w.me} (mesh {[d.id for d in w.mesh.devices.flat]}); scenario {scenario}")
    if len(jax.devices()) != count or jax.process_count() != count:
        w.say(f"FAIL: expected {count} devices and processes, got {jax.devices()}, {jax.process_count()}")
        return 1
    reason = peer.unavailable_reason(w.me.platform)
    if reason:
        w.say(f"FAIL: a GPU is present but mode='peer' is unavailable: {reason}")
        return 1
    start = time.monotonic()
    try:
        SCENARIOS[scenario](w)
    except Exception:
        w.say(f"FAIL: unexpected exception\n{traceback.format_exc()}")
        return 1
    w.say(f"{scenario} done in {time.monotonic() - start:.1f} s, {w.failures} failed checks")
    if w.failures:
        return 1
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    code = _worker(sys.argv[2], *map(int, sys.argv[3:6]))
    sys.stdout.flush()
    # a failed process leaves at once: jax.distributed's exit handler would wait for the others
    if code:
        os._exit(code)
    sys.exit(code)
