"""backend="cute" on the GPU: the CuTe cubins launched through XLA FFI (and from PyTorch).

Needs a CUDA GPU (the `gpu` fixture skips otherwise), the FFI library (built here with g++ if
missing) and the cubins (`python -m oproj_jax.build` on any machine with the cute extra).
Every call that may poll a slot nobody publishes runs with a bounded timeout_us, so a bug
shows up as a status code, not a hung GPU.
"""

import functools
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from oproj_jax import configs, reference, testing
from oproj_jax import ffi
from oproj_jax.cute import backend, driver_launch

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU below

SPIN = 4_000_000  # microseconds before a wait gives up (a hang becomes status != 0)
SENTINEL = 0x80000000  # an empty 32-bit mailbox word: the bf16 pair (+0.0, -0.0)
EPS, OUT_EPS = 1e-6, 1e-5
# + the production shape with an xmoe replica (a benchmark variant, not in the check table)
ONESHOT = [c for c in configs.GPU_CHECKS if not c.twoshot] + [configs.Config(16, 8, 8, xmoe_replicas=1)]
TWOSHOT = [c for c in configs.GPU_CHECKS if c.twoshot]
TORCH = [c for c in configs.PARITY if c.T <= 3]  # cross-framework: every R, NB, flag and twoshot


@functools.cache
def cute_unavailable() -> str | None:
    """Builds the FFI library if needed; then why backend 'cute' cannot run, or None."""
    if ffi.unavailable_reason():
        ffi.build_library()
    return backend.unavailable_reason("gpu")


@pytest.fixture
def cute(gpu):
    """The GPU; fails (does not skip) on a GPU machine where the cubins are missing."""
    reason = cute_unavailable()
    if reason:
        pytest.fail(f"backend 'cute' unavailable on this GPU machine: {reason}")
    return gpu


# ---- inputs and expectations -------------------------------------------------------------


def empty_slots(shape) -> np.ndarray:
    """bf16 array whose every 32-bit word is the sentinel."""
    bits = np.zeros(shape, np.uint16)
    bits[..., 1::2] = 0x8000
    return bits.view(ml_dtypes.bfloat16)


def words(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x)).view(np.uint32)


def published(x: np.ndarray) -> np.ndarray:
    bits = np.asarray(x).view(np.uint16).copy()
    bits[bits == 0x8000] = 0
    return bits.view(ml_dtypes.bfloat16)


@functools.cache
def inputs(config, seed=0):
    return configs.make_inputs(config, seed)


def expected(config, x, mailbox=None):
    """Reference prefix (jnp on the CPU) and the f64 output from it."""
    cpu = jax.devices("cpu")[0]
    args = [
        jax.device_put(x[k] if k != "mailbox" or mailbox is None else mailbox, cpu)
        for k in ("mailbox", "prefix", "blocks", "norm", "query", "out_norm")
    ]
    ref = jax.jit(
        functools.partial(
            reference.consumer,
            eps=EPS,
            out_eps=OUT_EPS,
            has_delta=config.has_delta,
            groups=1 if config.twoshot else config.groups,
            xmoe_replicas=0,
        )
    )(*args)
    prefix = np.asarray(ref.prefix)
    out = testing.output_f64(prefix, x["blocks"], x["norm"], x["query"], x["out_norm"], eps=EPS, out_eps=OUT_EPS)
    return prefix, out


def check_result(config, x, got_prefix, got_output, got_xmoe, mailbox=None, tag=""):
    want_prefix, want_out = expected(config, x, mailbox)
    np.testing.assert_array_equal(testing.bits(got_prefix), testing.bits(want_prefix), err_msg=f"{tag} prefix bits")
    err = testing.rel_l2(np.asarray(got_output, np.float64), want_out)
    assert err < testing.OUTPUT_REL_L2_TOL, f"{tag} output rel L2 {err:.2e} >= {testing.OUTPUT_REL_L2_TOL}"
    if config.xmoe_replicas:
        clean = testing.bits(published(np.asarray(got_output)))  # xmoe = output with -0.0 stored as +0.0
        for k in range(config.xmoe_replicas):
            np.testing.assert_array_equal(testing.bits(got_xmoe[k]), clean, err_msg=f"xmoe replica {k}")
    else:
        assert got_xmoe is None


def poison_allocator(nbytes: int) -> None:
    """Best effort: fill, then free, device memory so fresh XLA output buffers start as NaN bits.

    (The torch test below poisons its outputs explicitly and must give the same bits.)"""
    junk = jnp.full((nbytes // 2,), jnp.nan, jnp.bfloat16)
    junk.block_until_ready()
    junk.delete()


def options(config, **extra):
    return dict(eps=EPS, out_eps=OUT_EPS, has_delta=config.has_delta, xmoe_replicas=config.xmoe_replicas, **extra)


def run_oneshot(config, x, gpu, mailbox=None, **kw):
    args = [
        jax.device_put(x[k] if k != "mailbox" or mailbox is None else mailbox, gpu)
        for k in ("mailbox", "prefix", "blocks", "norm", "query", "out_norm")
    ]
    call = jax.jit(functools.partial(backend.consume, **options(config, groups=config.groups, **kw)))
    return call(*args)


def twoshot_operands(config, x, me):
    """recv = every rank's slice `me`; the gather row holds the other ranks' reduced columns
    (what they would have broadcast) and the sentinel in this rank's own columns."""
    cols = config.H // config.R
    recv = np.ascontiguousarray(x["mailbox"][:, :, me * cols : (me + 1) * cols])
    cpu = jax.devices("cpu")[0]
    gather = np.array(jax.jit(reference.twoshot_gather)(jax.device_put(x["mailbox"], cpu)))
    gather[..., me * cols : (me + 1) * cols] = empty_slots((1, config.T, cols))
    return recv, gather


def run_twoshot(config, x, gpu, me, **kw):
    recv, gather = twoshot_operands(config, x, me)
    args = [
        jax.device_put(a, gpu) for a in (recv, gather, x["prefix"], x["blocks"], x["norm"], x["query"], x["out_norm"])
    ]
    call = jax.jit(functools.partial(backend.consume_twoshot, me=me, **options(config, groups=config.groups, **kw)))
    return call(*args)


# ---- parity over the check table -----------------------------------------------------------


@pytest.mark.parametrize("config", ONESHOT, ids=lambda c: c.name)
def test_oneshot_parity(cute, config):
    x = inputs(config)
    poison_allocator((config.R + 2 + config.xmoe_replicas) * config.T * config.H * 2)
    res = run_oneshot(config, x, cute, timeout_us=SPIN)
    assert int(res.status[0]) == 0, f"status {int(res.status[0])}: polling gave up"
    check_result(config, x, res.prefix, res.output, res.xmoe)
    assert (words(res.mailbox) == SENTINEL).all(), "every consumed slot is re-armed"
    want_hints = 4 * 7 * config.T if config.xmoe_replicas else 0  # one per publishing warp: 4 per CTA
    assert int(res.hints[0]) == want_hints


@pytest.mark.parametrize("config", TWOSHOT, ids=lambda c: c.name)
def test_twoshot_parity(cute, config):
    x = inputs(config)
    me = config.R // 2 - 1  # an inner slice
    res = run_twoshot(config, x, cute, me, timeout_us=SPIN)
    assert int(res.status[0]) == 0, f"status {int(res.status[0])}: polling gave up"
    check_result(config, x, res.prefix, res.output, res.xmoe)  # == oneshot with groups=1
    assert (words(res.recv) == SENTINEL).all(), "every receive slot is re-armed"
    assert (words(res.gather) == SENTINEL).all(), "the gather row is re-armed"


@pytest.mark.parametrize("config", ONESHOT, ids=lambda c: c.name)
def test_registry_consumer_ready_mode(cute, config):
    """oproj_jax.consumer(backend="cute"): the ready kernel (no polling, no re-arm) on data with
    real -0.0 values, including a position where every rank holds -0.0 (the sum must be +0.0);
    the caller's mailbox is left untouched."""
    import oproj_jax

    x = dict(inputs(config))
    mailbox = np.array(x["mailbox"])
    mailbox.view(np.uint16)[:, 0, 5] = 0x8000  # -0.0 in every rank at one position
    x["mailbox"] = mailbox
    poison_allocator((config.R + 2 + config.xmoe_replicas) * config.T * config.H * 2)
    args = [jax.device_put(x[k], cute) for k in ("mailbox", "prefix", "blocks", "norm", "query", "out_norm")]
    call = jax.jit(
        functools.partial(
            oproj_jax.consumer,
            eps=EPS,
            out_eps=OUT_EPS,
            has_delta=config.has_delta,
            groups=config.groups,
            xmoe_replicas=config.xmoe_replicas,
            backend="cute",
        )
    )
    got = call(*args)
    check_result(config, x, got.prefix, got.output, got.xmoe)
    np.testing.assert_array_equal(words(args[0]), words(mailbox), err_msg="the caller's mailbox was modified")


def test_sanitizes_values_that_look_like_the_sentinel(cute):
    """Real (+0.0, -0.0) pairs in XLA-produced data must not read as empty slots."""
    config = configs.Config(16, 3, 1, groups=2)
    x = inputs(config)
    mailbox = x["mailbox"].copy()
    rng = np.random.default_rng(1)
    pairs = mailbox.reshape(config.R, config.T, config.H // 2, 2)
    pick = rng.random(pairs.shape[:3]) < 0.02
    pairs[pick] = empty_slots((2,))  # ~2 % of the words in every slot equal the sentinel
    assert (words(mailbox) == SENTINEL).sum() > 1000
    res = run_oneshot(config, x, cute, mailbox=mailbox, published=False, timeout_us=SPIN)
    assert int(res.status[0]) == 0, "a sanitized word was taken for an empty slot"
    check_result(config, x, res.prefix, res.output, res.xmoe, mailbox=mailbox)


# ---- Lamport protocol: late and missing publication ---------------------------------------


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as err:
        pytest.skip(f"cuda-python (cuda.bindings) is not installed: {err}")
    return driver


def publish_later(ptr: int, data: np.ndarray, delay: float, stamp: dict) -> threading.Thread:
    """Writes `data` to device address `ptr` after `delay` s, on a stream of its own (another thread)."""
    cu = _driver()

    def work():
        driver_launch.check(cu.cuInit(0), "cuInit")
        ctx = driver_launch.check(
            cu.cuDevicePrimaryCtxRetain(driver_launch.check(cu.cuDeviceGet(0), "cuDeviceGet")),
            "cuDevicePrimaryCtxRetain",
        )
        driver_launch.check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        stream = driver_launch.check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        host = np.ascontiguousarray(data)
        time.sleep(delay)
        stamp["write"] = time.perf_counter()
        driver_launch.check(
            cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(ptr), host.ctypes.data, host.nbytes, stream), "cuMemcpyHtoDAsync"
        )
        driver_launch.check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
        driver_launch.check(cu.cuStreamDestroy(stream), "cuStreamDestroy")

    thread = threading.Thread(target=work)
    thread.start()
    return thread


def test_waits_for_a_slot_published_late(cute):
    """The kernel polls a donated mailbox in place; slot 6 is written 0.3 s after the launch."""
    config, late, delay = configs.Config(16, 3, 8), 6, 0.3
    x = inputs(config)
    full = published(x["mailbox"])
    call = jax.jit(
        functools.partial(
            backend.consume, **options(config, groups=config.groups), published=True, timeout_us=10_000_000
        ),
        donate_argnums=0,
    )
    rest = [jax.device_put(x[k], cute) for k in ("prefix", "blocks", "norm", "query", "out_norm")]
    jax.block_until_ready(call(jax.device_put(full, cute), *rest))  # compile; same shapes
    empty = full.copy()
    empty[late] = empty_slots(empty[late].shape)
    mailbox = jax.device_put(empty, cute)
    mailbox.block_until_ready()
    ptr = mailbox.unsafe_buffer_pointer()
    stamp = {}
    writer = publish_later(ptr + late * config.T * config.H * 2, full[late], delay, stamp)
    start = time.perf_counter()
    res = call(mailbox, *rest)
    dispatched = time.perf_counter()
    jax.block_until_ready(res)
    done = time.perf_counter()
    writer.join()
    assert res.mailbox.unsafe_buffer_pointer() == ptr, "the donated mailbox was not polled in place"
    assert dispatched < stamp["write"] < done, (start, dispatched, stamp, done)
    assert int(res.status[0]) == 0
    check_result(config, x, res.prefix, res.output, res.xmoe)
    assert (words(res.mailbox) == SENTINEL).all()
    print(
        f"late slot: launched {1e3 * (dispatched - start):.1f} ms, published at "
        f"{1e3 * (stamp['write'] - start):.1f} ms, finished {1e3 * (done - start):.1f} ms"
    )


def test_bounded_polling_reports_a_slot_never_published(cute):
    config = configs.Config(16, 3, 8)
    x = inputs(config)
    mailbox = published(x["mailbox"])
    mailbox[11, 1] = empty_slots(mailbox[11, 1].shape)  # rank 11, token 1: never written
    start = time.perf_counter()
    res = run_oneshot(config, x, cute, mailbox=mailbox, published=True, timeout_us=1 << 16)
    jax.block_until_ready(res)
    assert time.perf_counter() - start < 60
    assert int(res.status[0]) == 1, "status 1: a mailbox slot was not published"
    with pytest.raises(RuntimeError, match="polling gave up"):
        backend.check_status(res.status)


# ---- inside jitted loops and CUDA graphs ---------------------------------------------------


LOOP_CONFIG, STEPS = configs.Config(16, 1, 1, groups=2, xmoe_replicas=2), 4  # a variant the parity table checks


def loop_inputs(gpu):
    xs = [inputs(LOOP_CONFIG, seed) for seed in range(STEPS)]
    rest = [jax.device_put(xs[0][k], gpu) for k in ("blocks", "norm", "query", "out_norm")]
    return xs, rest, options(LOOP_CONFIG, groups=LOOP_CONFIG.groups, timeout_us=SPIN)


def test_scan_loop(cute):
    """lax.scan over 4 steps: prefix carried, status carried (sticky), hints counting."""
    config, steps = LOOP_CONFIG, STEPS
    xs, rest, opts = loop_inputs(cute)
    x0 = xs[0]
    mailboxes = jax.device_put(np.stack([s["mailbox"] for s in xs]), cute)

    @jax.jit
    def scan(mailboxes, prefix, blocks, norm, query, out_norm):
        def step(carry, mailbox):
            prefix, hints, status = carry
            r = backend.consume(mailbox, prefix, blocks, norm, query, out_norm, hints=hints, status=status, **opts)
            return (r.prefix, r.hints, r.status), (r.prefix, r.output, r.xmoe)

        zeros = (jnp.zeros((1,), jnp.uint32), jnp.zeros((1,), jnp.int32))
        return jax.lax.scan(step, (prefix, *zeros), mailboxes)

    (_, hints, status), (prefixes, outputs, xmoes) = scan(mailboxes, jax.device_put(x0["prefix"], cute), *rest)
    assert int(status[0]) == 0 and int(hints[0]) == steps * 4 * 7 * config.T
    prefix = x0["prefix"]
    for k in range(steps):
        step_inputs = dict(x0, mailbox=xs[k]["mailbox"], prefix=prefix)
        check_result(config, step_inputs, prefixes[k], outputs[k], xmoes[k], tag=f"scan step {k}")
        prefix = np.asarray(prefixes[k])


def test_scan_loop_registry_path(cute):
    """The decode-loop path: oproj_jax.consumer(backend="cute") (ready kernel) in lax.scan over 4
    steps, the prefix carried and donated, every step's bits equal to the reference's."""
    import oproj_jax

    config, steps = LOOP_CONFIG, STEPS
    xs, rest, _ = loop_inputs(cute)
    x0 = xs[0]
    mailboxes = jax.device_put(np.stack([s["mailbox"] for s in xs]), cute)
    consume = functools.partial(
        oproj_jax.consumer,
        eps=EPS,
        out_eps=OUT_EPS,
        groups=config.groups,
        xmoe_replicas=config.xmoe_replicas,
        backend="cute",
    )

    @functools.partial(jax.jit, donate_argnums=(1,))
    def scan(mailboxes, prefix, blocks, norm, query, out_norm):
        def step(prefix, mailbox):
            r = consume(mailbox, prefix, blocks, norm, query, out_norm)
            return r.prefix, (r.prefix, r.output, r.xmoe)

        return jax.lax.scan(step, prefix, mailboxes)

    _, (prefixes, outputs, xmoes) = scan(mailboxes, jax.device_put(x0["prefix"], cute), *rest)
    prefix = x0["prefix"]
    for k in range(steps):
        step_inputs = dict(x0, mailbox=xs[k]["mailbox"], prefix=prefix)
        check_result(config, step_inputs, prefixes[k], outputs[k], xmoes[k], tag=f"scan step {k}")
        prefix = np.asarray(prefixes[k])


def test_back_to_back_calls(cute):
    """Two consumer kernels adjacent in the stream (donated inputs, nothing in between): with
    PDL the second starts early and must still read the prefix the first one wrote."""
    config = LOOP_CONFIG
    xs, rest, opts = loop_inputs(cute)
    x0 = xs[0]

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def back_to_back(mb1, mb2, prefix, blocks, norm, query, out_norm):
        kw = dict(opts, published=True)
        a = backend.consume(mb1, prefix, blocks, norm, query, out_norm, **kw)
        b = backend.consume(mb2, a.prefix, blocks, norm, query, out_norm, status=a.status, **kw)
        return (a.prefix, a.output, a.xmoe), (b.prefix, b.output, b.xmoe), b.status, a.mailbox, b.mailbox

    m1, m2 = published(xs[1]["mailbox"]), published(xs[2]["mailbox"])
    first, second, st, *_ = back_to_back(
        jax.device_put(m1, cute), jax.device_put(m2, cute), jax.device_put(x0["prefix"], cute), *rest
    )
    assert int(st[0]) == 0
    check_result(config, dict(x0, mailbox=m1), *first, tag="first of two")
    check_result(config, dict(x0, mailbox=m2, prefix=np.asarray(first[0])), *second, tag="second of two")


_COMMAND_BUFFER_SCRIPT = textwrap.dedent("""
    import functools, json, sys
    import jax, numpy as np
    from oproj_jax import api, configs
    from oproj_jax.cute import backend
    config = configs.Config(16, 3, 8)
    kw = dict(eps=1e-6, out_eps=1e-5, has_delta=True, groups=4, xmoe_replicas=1)
    @jax.jit
    def two_steps(mailbox, prefix, blocks, norm, query, out_norm):  # the Lamport target, twice
        a = backend.consume(mailbox, prefix, blocks, norm, query, out_norm, timeout_us=1 << 22, **kw)
        b = backend.consume(mailbox * 2, a.prefix, blocks, norm, query, out_norm, status=a.status,
                            timeout_us=1 << 22, **kw)
        return b.prefix, b.output, b.status
    @jax.jit
    def ready_steps(m1, m2, prefix, blocks, norm, query, out_norm):  # the registry's ready target
        a = api.consumer(m1, prefix, blocks, norm, query, out_norm, backend="cute", **kw)
        b = api.consumer(m2, a.prefix, blocks, norm, query, out_norm, backend="cute", **kw)
        return a.prefix, a.output, b.prefix, b.output, b.xmoe
    names = ("mailbox", "prefix", "blocks", "norm", "query", "out_norm")
    sets = [configs.make_inputs(config, seed) for seed in (0, 1)]
    args = [[jax.device_put(x[k]) for k in names] for x in sets]
    runs = [jax.tree.map(np.asarray, two_steps(*args[0])) for _ in range(3)]
    same = all(np.array_equal(r[0].view(np.uint16), runs[0][0].view(np.uint16)) and
               np.array_equal(r[1].view(np.uint16), runs[0][1].view(np.uint16)) for r in runs)
    np.save(sys.argv[1], np.stack([runs[0][0], runs[0][1]]).view(np.uint16))
    # Alternate two input sets (new buffer addresses on every execution: the recorded graph
    # nodes are updated, not re-recorded) and keep every execution's results.
    ready = []
    for i in range(6):
        x, y = args[i % 2], args[(i + 1) % 2]
        ready.append([np.asarray(v).view(np.uint16) for v in ready_steps(x[0], y[0], *x[1:])])
    np.save(sys.argv[2], np.array(ready, dtype=object), allow_pickle=True)
    print(json.dumps({"status": int(runs[0][2][0]), "replays_identical": bool(same)}))
""")


def test_xla_command_buffer(cute, tmp_path):
    """Consumer calls inside XLA command buffers (CUDA graphs), recorded through the targets'
    record stage: replays are exact, graph updates with new buffers stay exact, and XLA's thunk
    sequence shows the calls inside the command buffer."""
    dump = tmp_path / "dump"
    env = testing.command_buffer_env(dump)
    out, ready_out = tmp_path / "out.npy", tmp_path / "ready.npy"
    done = subprocess.run(
        [sys.executable, "-c", _COMMAND_BUFFER_SCRIPT, str(out), str(ready_out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"status": 0, "replays_identical": True}
    config = configs.Config(16, 3, 8)
    x = inputs(config)
    got_prefix, got_output = np.load(out).view(ml_dtypes.bfloat16)
    # The second of two dependent calls, against the reference (prefix bits) and the f64 oracle.
    first_prefix, _ = expected(config, x)
    doubled = np.asarray(jnp.asarray(x["mailbox"]) * 2)
    check_result(
        config,
        dict(x, mailbox=doubled, prefix=first_prefix),
        got_prefix,
        got_output,
        None,
        tag="second call in a command buffer",
    )
    sets = [configs.make_inputs(config, seed) for seed in (0, 1)]
    with_xmoe = configs.Config(16, 3, 8, xmoe_replicas=1)
    for i, run in enumerate(np.load(ready_out, allow_pickle=True)):
        a, b = sets[i % 2], sets[(i + 1) % 2]
        p1, o1, p2, o2, xm = (v.view(ml_dtypes.bfloat16) for v in run)
        check_result(config, a, p1, o1, None, tag=f"ready call 1, execution {i}")
        check_result(
            with_xmoe, dict(a, mailbox=b["mailbox"], prefix=p1), p2, o2, xm, tag=f"ready call 2, execution {i}"
        )
    for module in ("two_steps", "ready_steps"):
        thunks = testing.thunk_sequence(dump, module)
        assert testing.custom_calls_in_command_buffers(thunks) == 2, thunks[:3000]


# ---- the same cubin from PyTorch ---------------------------------------------------------------


def _torch_bf16(a: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16).copy()).cuda().view(torch.bfloat16)


def _np(t) -> np.ndarray:
    return t.view(dtype=__import__("torch").int16).cpu().numpy().view(ml_dtypes.bfloat16)


@pytest.mark.parametrize("config", TORCH, ids=lambda c: c.name)
def test_torch_launch_matches_jax_bits(cute, config):
    torch = pytest.importorskip("torch")
    x = inputs(config)
    me = config.R // 2 - 1
    key = backend.kernel_key(
        config.R,
        config.NB,
        has_delta=config.has_delta,
        groups=config.groups,
        xmoe_replicas=config.xmoe_replicas,
        twoshot=config.twoshot,
    )
    try:
        import cuda.bindings  # noqa: F401
    except ImportError as err:
        pytest.skip(f"cuda-python (cuda.bindings) is not installed: {err}")
    launch = driver_launch.torch_launcher(backend._kernel(key, config.T, ready=False))
    T, H, reps = config.T, config.H, config.xmoe_replicas
    if config.twoshot:
        recv_np, slots_np = twoshot_operands(config, x, me)
        recv_np = published(recv_np)  # as the JAX call sanitizes it
        jax_res = run_twoshot(config, x, cute, me, timeout_us=SPIN)
    else:
        slots_np = published(x["mailbox"])
        jax_res = run_oneshot(config, x, cute, timeout_us=SPIN)
    src = _torch_bf16(slots_np)
    slots, prefix = src.clone(), _torch_bf16(x["prefix"])
    blocks = _torch_bf16(x["blocks"]) if config.NB else prefix
    norm, query, out_norm = (_torch_bf16(x[k]) for k in ("norm", "query", "out_norm"))
    poison = torch.tensor(-1, dtype=torch.int16, device="cuda").view(torch.bfloat16)  # 0xFFFF: NaN
    output = torch.empty((T, H), dtype=torch.bfloat16, device="cuda").fill_(poison)
    xmoe = torch.empty((max(reps, 1), T, H), dtype=torch.bfloat16, device="cuda").fill_(poison)
    flags = torch.zeros(2, dtype=torch.int32, device="cuda")  # [status, hints]
    recv_src = _torch_bf16(recv_np) if config.twoshot else None
    recv = recv_src.clone() if config.twoshot else None
    prefix0 = prefix.clone()

    def launch_once():
        pointers = [
            slots.data_ptr(),
            prefix.data_ptr(),
            blocks.data_ptr(),
            norm.data_ptr(),
            query.data_ptr(),
            out_norm.data_ptr(),
            output.data_ptr(),
            xmoe.data_ptr(),
            flags.data_ptr() + 4,
            flags.data_ptr(),
        ]
        extra = (recv.data_ptr(), slots.data_ptr(), me) if config.twoshot else None
        launch(T, pointers, EPS, OUT_EPS, SPIN, extra)

    def check(tag):
        torch.cuda.synchronize()
        assert int(flags[0]) == 0, f"{tag}: status {int(flags[0])}"
        np.testing.assert_array_equal(testing.bits(_np(prefix)), testing.bits(jax_res.prefix), err_msg=f"{tag} prefix")
        np.testing.assert_array_equal(testing.bits(_np(output)), testing.bits(jax_res.output), err_msg=f"{tag} output")
        if reps:
            np.testing.assert_array_equal(testing.bits(_np(xmoe)), testing.bits(jax_res.xmoe), err_msg=f"{tag} xmoe")
        assert (words(_np(slots)) == SENTINEL).all(), f"{tag}: slots re-armed"
        if config.twoshot:
            assert (words(_np(recv)) == SENTINEL).all(), f"{tag}: recv re-armed"

    launch_once()
    check("eager")
    # CUDA graph: refill the slots (the kernel re-armed them), restore the prefix, re-poison, launch.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        slots.copy_(src)
        if config.twoshot:
            recv.copy_(recv_src)
        prefix.copy_(prefix0)
        output.fill_(poison)
        xmoe.fill_(poison)
        launch_once()
    for replay in range(3):
        flags.zero_()
        graph.replay()
        check(f"graph replay {replay}")
