"""backend="triton" on the GPU: the JAX launch (through the package's FFI target) and the PyTorch
launch of the same kernels against each other (bit for bit: prefix, output, xmoe) and against the
oracle, for every configuration of plan.VARIANTS; the JAX launch through jax_triton alike; a
donated prefix updated in place; the PyTorch launch inside a CUDA graph; a jitted chain inside
XLA's command buffers (checked on XLA's thunk dump).

Needs a CUDA GPU (the `gpu` fixture skips without one, with the reason) of compute capability
8.0 or newer, triton, jax-triton, the JAX CUDA plugin and PyTorch with CUDA; on a GPU machine a
missing piece fails with its reason. The inputs are fresh each run (configs.make_inputs with a
seed from the clock, named in every failure).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import textwrap
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # PyTorch shares the GPU below

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from oproj_jax import api, configs, testing  # noqa: E402
from oproj_jax.configs import Config  # noqa: E402
from oproj_jax.triton import backend, plan  # noqa: E402

ARGS = ("mailbox", "prefix", "blocks", "norm", "query", "out_norm")
SEED = int(time.time()) % 2**31
EPS = dict(eps=1e-6, out_eps=1e-5)
SWEEP = tuple(Config(configs.TP, t, 8) for t in (1, 8, 64, 512, 4096))  # the production shape over T
# Both launches: every option set with the default configuration (sync at these T), every
# configuration at the production shape. The one-program-per-token kernels over every option set: PyTorch only
# (the JAX launch of the same kernel is the sweep's), which halves the compiles.
CASES = [(c, None) for c in configs.PARITY] + [(c, v) for c in SWEEP for v in plan.VARIANTS]
CASES += [(Config(configs.TP, plan.PREFETCH_MAX_T, 8), None)]  # the most tokens the L2 warm-up serves
ONE_PROGRAM_PER_TOKEN = [(c, v) for c in configs.PARITY for v in ("row-w16", "tile-512-w8")]
ORACLE_TOKENS = 64  # at larger T the oracle checks this many tokens, spread over T


@pytest.fixture
def triton_gpu(gpu):
    reason = api.available_backends("gpu")["triton"]
    if reason and "compute capability" in reason:
        pytest.skip(f"backend 'triton': {reason}")
    if reason:
        pytest.fail(f"backend 'triton' unavailable on this GPU machine: {reason}")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.fail("PyTorch sees no CUDA device on this GPU machine")
    return gpu


@functools.cache
def inputs(config: Config) -> tuple[dict, dict]:
    """(the arrays the consumer sees, its options): twoshot configs get the gather row, groups=1."""
    return testing.consumer_case(config, configs.make_inputs(config, SEED))


def run_jax(arrays, options, variant, device):
    args = [jax.device_put(arrays[k], device) for k in ARGS]
    result = backend.launch(*args, **EPS, **options, variant=variant)
    return tuple(None if x is None else np.asarray(x) for x in result)


def run_torch(arrays, options, variant):
    import torch

    from oproj_jax import torch_ref
    from oproj_jax.triton import torch_launch

    tensors = [torch_ref.from_numpy(arrays[k]).cuda() for k in ARGS]
    result = torch_launch.consumer(*tensors, **EPS, **options, variant=variant)
    torch.cuda.synchronize()
    return tuple(None if x is None else torch_ref.to_numpy(x) for x in result)


def check_oracle(config: Config, arrays: dict, result, what: str) -> None:
    testing.check_result(*testing.spread_tokens(config, arrays, result, ORACLE_TOKENS), **EPS, what=what)


@pytest.mark.parametrize(("config", "variant"), CASES, ids=[f"{c.name}-{v or 'default'}" for c, v in CASES])
def test_jax_and_torch_launches_agree_with_each_other_and_the_oracle(triton_gpu, config, variant):
    arrays, options = inputs(config)
    what = f"{config.name} variant={variant} seed={SEED}"
    from_jax = run_jax(arrays, options, variant, triton_gpu)
    from_torch = run_torch(arrays, options, variant)
    for name, a, b in zip(("prefix", "output", "xmoe"), from_jax, from_torch):
        assert (a is None) == (b is None), f"{what}: {name}"
        if a is not None:
            testing.assert_same_bits(a, b, f"{what}: {name}, JAX launch vs PyTorch launch")
    check_oracle(dataclasses.replace(config, groups=options["groups"]), arrays, from_jax, what)


@pytest.mark.parametrize(
    ("config", "variant"), ONE_PROGRAM_PER_TOKEN, ids=[f"{c.name}-{v}" for c, v in ONE_PROGRAM_PER_TOKEN]
)
def test_torch_launch_of_the_row_and_tile_kernels_matches_the_oracle(triton_gpu, config, variant):
    arrays, options = inputs(config)
    what = f"{config.name} variant={variant} seed={SEED}"
    check_oracle(
        dataclasses.replace(config, groups=options["groups"]), arrays, run_torch(arrays, options, variant), what
    )


# "library": the package's record-stage target, and the traced one above library.RECORD_MAX_T tokens
DONATED = [(None, 1, "library"), ("tile-512-w8", 3, "library"), ("sync-2048-w8", 64, "library")]
DONATED += [("row-w16", 65, "library"), ("sync-1024-w4", 80, "library"), (None, 80, "library")]
DONATED += [(None, 1, "jax_triton"), ("row-w16", 64, "jax_triton"), ("tile-512-w8", 8, "jax_triton")]
# jax-triton has no register cap: it compiles a capped configuration uncapped (same bits)
DONATED += [("sync-1024-w4-reload-r64", 80, "jax_triton")]


@pytest.mark.parametrize(("variant", "T", "launch"), DONATED)
def test_donated_prefix_is_updated_in_place(triton_gpu, variant, T, launch):
    """Two jitted steps with the prefix donated: the result lives in the donated buffer (the
    kernel's prefix output is aliased to its input), each step against the oracle."""
    config = Config(configs.TP, T, 8, xmoe_replicas=1)
    arrays, options = inputs(config)
    mailboxes = [arrays["mailbox"], configs.make_inputs(config, SEED + 1)["mailbox"]]
    consume = functools.partial(backend.launch, **EPS, **options, variant=variant, jax_triton=launch == "jax_triton")
    step = jax.jit(consume, donate_argnums=1)
    _, prefix, *rest = (jax.device_put(arrays[k], triton_gpu) for k in ARGS)
    before = np.asarray(prefix)
    for k, mailbox in enumerate(mailboxes):
        pointer = prefix.unsafe_buffer_pointer()
        got = step(jax.device_put(mailbox, triton_gpu), prefix, *rest)
        assert prefix.is_deleted(), "the prefix was not donated"
        assert got.prefix.unsafe_buffer_pointer() == pointer, "the new prefix is not in the donated buffer"
        result = tuple(None if x is None else np.asarray(x) for x in got)
        check_oracle(config, dict(arrays, mailbox=mailbox, prefix=before), result, f"step {k} seed={SEED}")
        before, prefix = result[0], got.prefix


@pytest.mark.parametrize(
    ("config", "variant"), [(Config(configs.TP, 3, 8), "sync-256-w1"), (Config(2, 64, 1, groups=3), "row-w16")]
)
def test_jax_triton_launch_gives_the_bits_of_the_library_launch(triton_gpu, config, variant):
    """Both JAX launches of one configuration run the same kernel (jax_triton's PTX, or Triton's
    cubin of it): the same bits. (Their defaults differ at small T on an H200: the library launches
    a cluster configuration, jax-triton, which sets no clusters, its rule without them.)"""
    arrays, options = inputs(config)
    args = [jax.device_put(arrays[k], triton_gpu) for k in ARGS]
    library, jax_triton = (
        backend.launch(*args, **EPS, **options, variant=variant, jax_triton=flag) for flag in (False, True)
    )
    for name, a, b in zip(("prefix", "output"), library, jax_triton):
        testing.assert_same_bits(np.asarray(a), np.asarray(b), f"{config.name} {name}: library vs jax_triton")


@pytest.mark.parametrize("variant", [v.name for _, v in plan.CLUSTERED])
@pytest.mark.parametrize("T", [1, 64])
def test_cluster_configuration_gives_the_bits_of_its_counterpart(triton_gpu, variant, T):
    """A sync configuration launched in thread block clusters (its programs meet at the cluster's
    barrier) gives the bits of the same configuration meeting at arrival counters, from JAX and
    from PyTorch (each launch twice: nothing is left behind between calls)."""
    config = Config(configs.TP, T, 8, xmoe_replicas=1)
    arrays, options = inputs(config)
    counterpart = variant.replace("-cluster", "")
    assert counterpart in plan.VARIANTS and not plan.VARIANTS[counterpart].cluster
    want = run_jax(arrays, options, counterpart, triton_gpu)
    for launch in (run_jax, run_jax, run_torch, run_torch):
        args = (triton_gpu,) if launch is run_jax else ()
        got = launch(arrays, options, variant, *args)
        for name, a, b in zip(("prefix", "output", "xmoe"), got, want):
            testing.assert_same_bits(a, b, f"T={T} seed={SEED} {launch.__name__} {variant} {name} vs {counterpart}")


# partial=: the default configuration over T (clusters, with prefetch at T <= plan.PREFETCH_MAX_T; reload at 512), the
# other kernels
OWN = [
    (1, None),
    (8, None),
    (plan.PREFETCH_MAX_T, None),
    (64, None),
    (512, None),
    (8, "row-w16"),
    (8, "tile-512-w8"),
    (3, "sync-256-w1"),
]


@pytest.mark.parametrize(("T", "variant"), OWN)
def test_own_partial_gives_the_bits_of_its_slot(triton_gpu, T, variant):
    """partial= read in place of slot 9, which holds NaN (never read): the JAX launch (jitted,
    the package's target) and the PyTorch launch give the bits of the launch that reads the slot;
    the caller's mailbox is untouched."""
    import torch

    from oproj_jax import torch_ref
    from oproj_jax.triton import torch_launch

    config = Config(configs.TP, T, 8, xmoe_replicas=1)
    arrays, options = inputs(config)
    want = run_jax(arrays, options, variant, triton_gpu)
    poisoned = arrays["mailbox"].copy()
    poisoned[9] = np.nan
    given = dict(arrays, mailbox=poisoned)
    args = [jax.device_put(given[k], triton_gpu) for k in ARGS]
    partial = jax.device_put(arrays["mailbox"][9], triton_gpu)
    consume = functools.partial(backend.launch, **EPS, **options, variant=variant, rank=9)
    from_jax = jax.jit(lambda *a: consume(*a[:6], partial=a[6]))(*args, partial)
    testing.assert_same_bits(np.asarray(args[0]), poisoned, "the caller's mailbox")
    tensors = [torch_ref.from_numpy(given[k]).cuda() for k in ARGS]
    own = torch_ref.from_numpy(arrays["mailbox"][9]).cuda()
    from_torch = torch_launch.consumer(*tensors, partial=own, rank=9, **EPS, **options, variant=variant)
    torch.cuda.synchronize()
    from_torch = [None if x is None else torch_ref.to_numpy(x) for x in from_torch]
    for name, a, b, c in zip(("prefix", "output", "xmoe"), want, from_jax, from_torch):
        what = f"T={T} variant={variant} seed={SEED} {name}"
        testing.assert_same_bits(np.asarray(b), a, f"{what}: JAX with partial= vs the slot")
        testing.assert_same_bits(c, a, f"{what}: PyTorch with partial= vs the slot")


def test_registry_call_under_jit(triton_gpu):
    config = Config(configs.TP, 3, 8)
    arrays, options = inputs(config)
    step = jax.jit(functools.partial(api.consumer, backend="triton", **EPS, **options))
    result = step(*(jax.device_put(arrays[k], triton_gpu) for k in ARGS))
    testing.check_result(config, arrays, result, **EPS, what=f"seed={SEED}")


@pytest.mark.parametrize("variant", [None, "row-w16", "tile-512-w8", "sync-1024-w4-cluster"])
def test_torch_launch_replays_in_a_cuda_graph(triton_gpu, variant):
    """Captured once, replayed on new inputs copied into the captured buffers: the same bits as
    an eager launch on those inputs (sync: its counters' zeroing is captured with it)."""
    import torch

    from oproj_jax import torch_ref
    from oproj_jax.triton import torch_launch

    config = Config(configs.TP, 8, 8, xmoe_replicas=1)
    arrays, options = inputs(config)
    fresh = configs.make_inputs(config, SEED + 2)
    tensors = [torch_ref.from_numpy(arrays[k]).cuda() for k in ARGS]
    call = functools.partial(torch_launch.consumer, **EPS, **options, variant=variant)
    call(*[t.clone() for t in tensors])  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call(*tensors)
    for k in ("mailbox", "prefix"):
        tensors[ARGS.index(k)].copy_(torch_ref.from_numpy(fresh[k]).cuda())
    graph.replay()
    torch.cuda.synchronize()
    eager = call(
        *[torch_ref.from_numpy(dict(arrays, mailbox=fresh["mailbox"], prefix=fresh["prefix"])[k]).cuda() for k in ARGS]
    )
    for name, a, b in zip(("prefix", "output", "xmoe"), captured, eager):
        testing.assert_same_bits(torch_ref.to_numpy(a), torch_ref.to_numpy(b), f"{name}: graph replay vs eager")


@pytest.mark.parametrize("T", [8, 64, 80])  # the three configurations of the rule without clusters
def test_kept_counters_and_pdl_give_the_bits_of_zeroed_counters(triton_gpu, T):
    """Three dependent calls (the prefix threaded through) with one set of arrival counters kept
    across them and PDL launches, eager and replayed twice from a CUDA graph, give the bits of
    calls with freshly zeroed counters and no PDL; the counters end at zero."""
    import torch

    from oproj_jax import torch_ref
    from oproj_jax.triton import torch_launch

    config = Config(configs.TP, T, 8, xmoe_replicas=1)
    arrays, options = inputs(config)
    mailboxes = [torch_ref.from_numpy(configs.make_inputs(config, SEED + k)["mailbox"]).cuda() for k in range(3)]
    weights = [torch_ref.from_numpy(arrays[k]).cuda() for k in ARGS[2:]]
    first = torch_ref.from_numpy(arrays["prefix"]).cuda()

    variant = plan.default_variant(T, configs.HIDDEN)  # clusters=False: arrival counters

    def steps(prefix, **how):
        outs = []
        for mailbox in mailboxes:
            prefix, output, xmoe = torch_launch.consumer(
                mailbox, prefix, *weights, **EPS, **options, variant=variant, **how
            )
            outs += [prefix.clone(), output, xmoe]
        return outs

    expected = steps(first.clone(), arrivals=None, pdl=False)
    kept = torch_launch.arrival_counters(T, "cuda")
    eager = steps(first.clone(), arrivals=kept, pdl=None)
    prefix = first.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = steps(prefix, arrivals=kept, pdl=None)
    replays = []
    for _ in range(2):
        prefix.copy_(first)
        graph.replay()
        replays.append([x.clone() for x in captured])
    torch.cuda.synchronize()
    for what, got in [("eager", eager), ("replay 1", replays[0]), ("replay 2", replays[1])]:
        for k, (a, b) in enumerate(zip(expected, got)):
            name = f"T={T} seed={SEED} {what}: call {k // 3} {('prefix', 'output', 'xmoe')[k % 3]}"
            testing.assert_same_bits(torch_ref.to_numpy(b), torch_ref.to_numpy(a), name)
    assert not kept.any(), f"the counters were left at {kept.cpu().tolist()}"


_COMMAND_BUFFER_SCRIPT = textwrap.dedent("""
    import functools, sys
    import jax, numpy as np
    from oproj_jax import configs
    from oproj_jax.triton import backend
    out, seed, jax_triton = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "jax_triton"
    config = configs.Config(16, 3, 8, xmoe_replicas=1)
    kw = dict(eps=1e-6, out_eps=1e-5, has_delta=True, groups=4, xmoe_replicas=1)
    def chain(variant, name):
        consume = functools.partial(backend.launch, variant=variant, jax_triton=jax_triton, **kw)
        def steps(m1, m2, prefix, blocks, norm, query, out_norm):
            a = consume(m1, prefix, blocks, norm, query, out_norm)
            b = consume(m2, a.prefix, blocks, norm, query, out_norm)
            return a.prefix, a.output, b.prefix, b.output, b.xmoe
        steps.__name__ = steps.__qualname__ = name  # the module name in the dump
        return steps
    names = ("mailbox", "prefix", "blocks", "norm", "query", "out_norm")
    sets = [configs.make_inputs(config, seed + k) for k in (0, 1)]
    args = [[jax.device_put(x[k]) for k in names] for x in sets]
    runs = {}
    chains = [chain("tile-512-w8", "tile_steps"), chain("row-w16", "row_steps"), chain(None, "sync_steps")]
    chains += [] if jax_triton else [chain("sync-2048-w8-cluster", "cluster_steps")]  # jax-triton sets no clusters
    for fn in chains:
        jitted = jax.jit(fn)
        # Alternating input sets: new buffer addresses each execution (graph updates, not re-records).
        runs[fn.__name__] = [[np.asarray(v).view(np.uint16) for v in jitted(x[0], y[0], *x[1:])]
                             for x, y in [(args[i % 2], args[(i + 1) % 2]) for i in range(4)]]
    np.save(out, np.array(runs, dtype=object), allow_pickle=True)
""")


@pytest.mark.parametrize("launch", ["library", "jax_triton"])
def test_xla_command_buffer_thunk_dump(triton_gpu, tmp_path, launch):
    """Checks XLA's thunk dump: two chained consumer calls under jax.jit run inside a command
    buffer (CUDA graph), every kernel launch a custom call nested in it (1 per call); executions
    alternating two input sets are exact (sync: its arrival counters zeroed in each call of each
    replay; a cluster configuration, through the package's target only: launched in clusters
    from the graph too).

    XLA records a custom call into a command buffer only if its FFI handler says it may: the
    package's target does; jax-triton 0.3.1's triton_call lowers to the legacy
    "triton_kernel_call", which has no FFI handler, so there the count is expected to be 0 (each
    launch then goes from the host): xfail, with the count, rather than a failure."""
    dump = tmp_path / "dump"
    env = testing.command_buffer_env(dump)
    out = tmp_path / "runs.npy"
    done = subprocess.run(
        [sys.executable, "-c", _COMMAND_BUFFER_SCRIPT, str(out), str(SEED), launch],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    config = Config(configs.TP, 3, 8, xmoe_replicas=1)
    sets = [configs.make_inputs(config, SEED + k) for k in (0, 1)]
    runs = np.load(out, allow_pickle=True).item()
    for name, executions in runs.items():
        for i, run in enumerate(executions):
            a, b = sets[i % 2], sets[(i + 1) % 2]
            p1, o1, p2, o2, xm = (v.view(ml_dtypes.bfloat16) for v in run)
            first = dataclasses.replace(config, xmoe_replicas=0)
            testing.check_result(first, a, (p1, o1, None), **EPS, what=f"{name} call 1, execution {i}")
            second = dict(a, mailbox=b["mailbox"], prefix=p1)
            testing.check_result(config, second, (p2, o2, xm), **EPS, what=f"{name} call 2, execution {i}")
            if i >= 2:  # the same inputs as execution i - 2: the same bits
                for got, want in zip(run, executions[i - 2]):
                    np.testing.assert_array_equal(got, want, err_msg=f"{name}: replay {i} vs {i - 2}")
    counts = {m: testing.custom_calls_in_command_buffers(testing.thunk_sequence(dump, m)) for m in runs}
    if launch == "jax_triton" and not any(counts.values()):
        pytest.xfail(f"the legacy triton_kernel_call custom calls run outside XLA's command buffers: {counts}")
    expected = {"tile_steps": 2, "row_steps": 2, "sync_steps": 2} | (
        {"cluster_steps": 2} if launch == "library" else {}
    )
    assert counts == expected, testing.thunk_sequence(dump, "tile_steps")[:3000]
