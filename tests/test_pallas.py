"""The Pallas backend (oproj_jax/pallas): Mosaic GPU kernel `oproj_consumer_pallas`.

On the CPU the kernel runs in Mosaic GPU interpret mode (outputs start as NaN there, so an
element the kernel never writes shows up); the CUDA lowering is checked against an abstract
H200. What every backend meets (parity on configs.PARITY, -0.0, bad input, jit, scan,
donation, NaN/Inf, vmap) is in tests/test_contract.py; here are the kernel's own paths
(consumer_with's variants, shard_map, lowering, the profiler, the GPU sweep). Expected values
never come from the kernel: oproj_jax.testing.check_result (the numpy prefix model, the f64
output model).
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import oproj_jax
from oproj_jax import configs, reference, testing
from oproj_jax.pallas import consumer as pallas_consumer
from conftest import gpu_platform_reason, pallas_lowered_for_h200

ARGS = ("mailbox", "prefix", "blocks", "norm", "query", "out_norm")
EPS = dict(eps=0.5, out_eps=0.25)  # large against the sources' mean squares: a swapped eps shows


def _arrays(config, seed=0):
    return {k: jnp.asarray(v) for k, v in configs.make_inputs(config, seed).items()}


def _check(config, got, x):
    # an output element the kernel never writes stays NaN (interpret mode poisons outputs), where
    # the f64 model has none
    testing.check_result(config, {k: np.asarray(v) for k, v in x.items()}, got, **EPS)


def test_inside_shard_map():
    # sharded.tp_consumer runs the backend per rank inside shard_map (oneshot). One rank only:
    # jax 0.11.2's GPU interpreter keeps one shared-memory table for all devices and, at the end
    # of each device's kernel, asserts that no barrier of ANY device is still allocated, so
    # several CPU devices interpreting at once fail at random ("Barrier remains allocated").
    from jax.sharding import NamedSharding, PartitionSpec as P

    from oproj_jax import sharded

    config = configs.Config(1, 2, 2, groups=1)
    x = configs.make_inputs(config, seed=4)
    mesh = jax.make_mesh((1,), ("tp",), devices=jax.devices()[:1])
    args = [jax.device_put(x[k], NamedSharding(mesh, P("tp") if k == "mailbox" else P())) for k in ARGS]
    got = sharded.tp_consumer(*args, mesh=mesh, backend="pallas", **EPS, **config.options())
    _check(config, got, {k: jnp.asarray(v) for k, v in x.items()})


@pytest.mark.parametrize("ring", [1, 2])
def test_parity_interpret_small_ring(ring):
    # The default uses ring=2 at T >= 64 (measured); the slot-reuse logic is the same at any T.
    config = configs.Config(16, 1, 8, xmoe_replicas=1)
    x = _arrays(config, seed=5)
    got = pallas_consumer.consumer_with(*(x[k] for k in ARGS), **EPS, **config.options(), ring=ring, split=1)
    _check(config, got, x)


def test_unsupported_hidden_size():
    config = configs.Config(2, 1, 1, H=7168 - 128)
    x = _arrays(config)
    with pytest.raises(ValueError, match=r"backend='pallas'.*H % 256 == 0, got H=7040"):
        oproj_jax.consumer(*(x[k] for k in ARGS), backend="pallas", **config.options())


def test_cluster_split_needs_a_gpu():
    """Interpret mode (no GPU) cannot run the cluster split: it says so instead of failing later."""
    if gpu_platform_reason() is None:
        pytest.skip("a GPU is present: the split runs there (GPU tests below)")
    config = configs.Config(2, 1, 1)
    x = _arrays(config)
    with pytest.raises(ValueError, match="split: Mosaic GPU interpret mode has no cluster"):
        pallas_consumer.consumer_with(*(x[k] for k in ARGS), **EPS, **config.options(), ring=4, split=7)


def test_batched_copies_need_resident_rows():
    # batch > 1 copies several mailbox rows into consecutive slots: only the cluster path keeps
    # every row resident; the one-CTA ring refills its slots row by row
    config = configs.Config(2, 1, 1)
    x = _arrays(config)
    for split, batch in ((1, 4), (7, 0)):
        with pytest.raises(ValueError, match=f"batch: expected 1, or > 1 with a cluster split.*got {batch}"):
            pallas_consumer.consumer_with(
                *(x[k] for k in ARGS), **EPS, **config.options(), ring=4, split=split, batch=batch
            )


def test_split_must_be_a_cluster_the_kernel_takes():
    # a cluster has at most 8 CTAs (14 and 28 divide H/256 = 28 but are refused), and a split
    # must divide the row's 28 tiles of 256 columns (3 does not)
    config = configs.Config(2, 1, 1)
    x = _arrays(config)
    for split in (3, 14, 28):
        with pytest.raises(ValueError, match=rf"split: expected 1 or a cluster of \(2, 4, 7\) CTAs .*got {split}"):
            pallas_consumer.consumer_with(*(x[k] for k in ARGS), **EPS, **config.options(), ring=4, split=split)


# ---- CUDA lowering on this CPU machine (abstract H200): the named kernel, and the in-place prefix.


@pytest.mark.parametrize("split", [1, 7])
def test_lowers_for_cuda_with_the_named_kernel_and_the_prefix_as_an_output(split):
    config = configs.Config(16, 3, 8, xmoe_replicas=1)

    def fn(*args):
        return pallas_consumer.consumer_with(*args, eps=1e-6, out_eps=1e-6, **config.options(), ring=4, split=split)

    text = pallas_lowered_for_h200(fn, config)
    calls = re.findall(r"stablehlo.custom_call @mosaic_gpu\w*\(", text)
    assert len(calls) == 1, calls
    assert pallas_consumer.KERNEL_NAME in text
    # The new prefix is the call's first output, not the operand updated through an alias (see
    # consumer_with): three outputs (prefix, output, xmoe), no operand aliased.
    assert "output_operand_alias" not in text
    row = f"{split}x{28 // split}x256xbf16"
    assert f"-> (tensor<3x{row}>, tensor<3x{row}>, tensor<1x3x{row}>)" in text


@pytest.mark.parametrize("pdl", [False, True])
def test_pdl_reaches_the_lowered_module(pdl):
    """pdl=True: the kernel's module asks for a programmatic dependent launch (Mosaic GPU's
    uses_pdl) and waits for the grid ahead (griddepcontrol); the default call on a GPU takes PDL."""
    config = configs.Config(16, 3, 8, xmoe_replicas=1)

    def fn(*args):
        options = dict(eps=1e-6, out_eps=1e-6, **config.options())
        return pallas_consumer.consumer_with(*args, **options, ring=4, split=7, batch=16, pdl=pdl)

    text = pallas_lowered_for_h200(fn, config)
    assert ("mosaic_gpu.uses_pdl" in text) == pdl and ("griddepcontrol.wait" in text) == pdl
    assert pallas_consumer.PDL
    default = pallas_lowered_for_h200(lambda *args: oproj_jax.consumer(*args, backend="pallas"), config)
    assert "mosaic_gpu.uses_pdl" in default


def test_pdl_is_refused_in_interpret_mode():
    config = configs.Config(4, 2, 2)
    arrays = configs.make_inputs(config, 0)
    with pytest.raises(ValueError, match="pdl: programmatic dependent launch is for the GPU"):
        pallas_consumer.consumer_with(*(arrays[k] for k in ARGS), ring=2, split=1, pdl=True, interpret=True)


def test_default_choice_lowers_for_cuda():
    # Off the interpreter the measured choice: the 7-CTA cluster up to T=64, then one CTA per
    # token with a 2-slot ring; the interpreter has no cluster memory.
    choice = {T: pallas_consumer.choose_split(T, 7168, interpret=False) for T in (1, 32, 64, 65, 4096)}
    cluster = dict(ring=4, split=7, batch=16)
    assert choice == {1: cluster, 32: cluster, 64: cluster, 65: dict(ring=2, split=1), 4096: dict(ring=2, split=1)}
    assert pallas_consumer.choose_split(1, 7168, interpret=True)["split"] == 1
    # the cluster split needs the row's 256-column tiles to divide among 7 CTAs (7424 = 29 x 256)
    # and every row of its slice resident: at H = 8 x 7168 the 17 mailbox and prefix rows of a
    # CTA alone take 17 x 16 KiB > 227 KiB
    assert pallas_consumer.choose_split(1, 7424, interpret=False) == dict(ring=4, split=1)
    assert pallas_consumer.choose_split(1, 8 * 7168, interpret=False) == dict(ring=4, split=1)
    assert pallas_consumer.choose_split(1, 8 * 7168, interpret=False, R=4, NB=2)["split"] == 7
    config = configs.Config(16, 1, 8)

    def fn(*args):
        return oproj_jax.consumer(*args, backend="pallas")

    text = pallas_lowered_for_h200(fn, config)
    assert pallas_consumer.KERNEL_NAME in text


# ---- on the GPU


@pytest.mark.parametrize("variant", [None, dict(ring=4, split=7)], ids=["default", "split7"])
@pytest.mark.parametrize("config", configs.GPU_CHECKS, ids=lambda c: c.name)
def test_parity_gpu(gpu, config, variant):
    # "default": oproj_jax.consumer(backend="pallas") with the tuned choice; "split7": the cluster path.
    x = {k: jax.device_put(v, gpu) for k, v in _arrays(config, seed=3).items()}
    if config.twoshot:
        x["mailbox"] = reference.twoshot_gather(x["mailbox"])
    args = [x[k] for k in ARGS]
    if variant is None:
        got = oproj_jax.consumer(*args, **EPS, backend="pallas", **config.options())
    else:
        got = pallas_consumer.consumer_with(*args, **EPS, **config.options(), **variant)
    _check(config, got, x)


def test_cluster_dots_refuses_what_its_buffers_cannot_hold():
    # the warp sums take 4 slots per dot below part[128]; the pushes take one thread per (dot, CTA)
    from oproj_jax.pallas import cluster_dots

    def dots(k, **where):
        cluster_dots.dots([(None, None)] * k, None, None, None, split=7, round_=0, **where)

    with pytest.raises(ValueError, match="part: the warp sums of 40 dots from 0 need 160 slots, 128 are set aside"):
        dots(40, base=0, col=0)
    with pytest.raises(ValueError, match="part: the warp sums of 15 dots from 72 need 132 slots"):
        dots(15, base=72, col=18)
    with pytest.raises(ValueError, match="col: 2 dots from column 31 do not fit 32 columns"):
        dots(2, base=0, col=31)
    with pytest.raises(ValueError, match="pairs: 19 dots to 7 CTAs need 133 threads, have 128"):
        dots(19, base=0, col=0)


def test_cluster_split_fits_four_ctas_per_sm():
    # R=16, NB=8, has_delta at H=7168, one CTA of the 7-split, every buffer 1 KiB aligned: the 17
    # mailbox and prefix rows of 2 KiB (the staging rows and dot sums reuse them), the 8 block
    # rows, norm and query, 1 KiB of pushed totals and mbarriers, and 28 barriers of 8 bytes.
    # With the 1 KiB the SM reserves per CTA, 4 CTAs fit the H200's 228 KiB: T=64 in one wave.
    need = (17 + 8 + 2) * 2048 + 1024 + 28 * 8
    assert pallas_consumer.cluster_smem_bytes(16, 8, True, 7168, 7) == need
    assert 4 * (need + 1024) <= 228 * 1024


@pytest.mark.parametrize("C", [1, 2, 4, 7, 14, 28])
def test_row_layout_is_the_one_mosaic_loads(C):
    # cluster_dots declares the layout of the rows it gets; Mosaic GPU's own rule for a [C, 256]
    # bf16 array decides what they have (a mismatch fails to compile on the GPU)
    from jax.experimental.mosaic import gpu as mgpu
    from jaxlib.mlir import ir

    with ir.Context(), ir.Location.unknown():
        mosaic = mgpu.WGStridedFragLayout.from_shaped_type(ir.VectorType.get((C, 256), ir.BF16Type.get()))
    assert pallas_consumer._row_layout(C).to_mgpu() == mosaic


# ---- the in-kernel profiler (the trace itself comes from a GPU)


def test_profiler_runs_on_the_gpu_and_is_refused_in_interpret_mode(tmp_path):
    # on a GPU the in-kernel profiler writes a trace of the named phases; interpret mode refuses it
    config = configs.Config(2, 1, 1)
    x = _arrays(config)

    def call():
        return pallas_consumer.consumer_with(
            *(x[k] for k in ARGS), **EPS, **config.options(), ring=4, split=1, profile_dir=str(tmp_path)
        )

    if gpu_platform_reason() is not None:
        with pytest.raises(ValueError, match="profile_dir: Mosaic GPU's in-kernel profiler runs on the GPU only"):
            call()
        return
    jax.block_until_ready(call())
    [trace] = tmp_path.glob("*trace.json")
    names = {event["name"] for event in json.loads(trace.read_text())["traceEvents"]}
    assert {"rank_sum", "online_softmax", "output"} <= names, names


_PALLAS_CHAIN = """
import sys, jax, numpy as np
from oproj_jax import api, configs
config = configs.Config(16, 3, 8)
x = configs.make_inputs(config, 0)
kw = dict(eps=1e-6, out_eps=1e-6, has_delta=True, groups=4, xmoe_replicas=0)
@jax.jit
def pallas_steps(mailbox, prefix, blocks, norm, query, out_norm):
    a = api.consumer(mailbox, prefix, blocks, norm, query, out_norm, backend="pallas", **kw)
    b = api.consumer(mailbox, a.prefix, blocks, norm, query, out_norm, backend="pallas", **kw)
    return a.prefix, b.prefix, b.output
args = [jax.device_put(x[k]) for k in ("mailbox", "prefix", "blocks", "norm", "query", "out_norm")]
np.save(sys.argv[1], np.stack([np.asarray(v) for v in pallas_steps(*args)]).view(np.uint16))
"""


_CHAIN_OPTIONS = dict(eps=1e-6, out_eps=1e-6, has_delta=True, groups=4, xmoe_replicas=0)


def test_xla_command_buffer(gpu, tmp_path):
    """Two Pallas calls inside an XLA command buffer (the thunk sequence shows them there), with
    the same results as the reference."""
    import subprocess
    import sys

    dump, out = tmp_path / "dump", tmp_path / "out.npy"
    env = testing.command_buffer_env(dump)
    done = subprocess.run(
        [sys.executable, "-c", _PALLAS_CHAIN, str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    first, second, output = np.load(out).view(ml_dtypes.bfloat16)
    config = configs.Config(16, 3, 8)
    x = {k: jax.device_put(v, jax.devices("cpu")[0]) for k, v in configs.make_inputs(config, 0).items()}
    ref = reference.consumer(
        *(jnp.asarray(x[k]) for k in ("mailbox", "prefix", "blocks", "norm", "query", "out_norm")), **_CHAIN_OPTIONS
    )
    np.testing.assert_array_equal(testing.bits(first), testing.bits(ref.prefix))
    ref2 = reference.consumer(
        jnp.asarray(x["mailbox"]),
        ref.prefix,
        *(jnp.asarray(x[k]) for k in ("blocks", "norm", "query", "out_norm")),
        **_CHAIN_OPTIONS,
    )
    np.testing.assert_array_equal(testing.bits(second), testing.bits(ref2.prefix))
    err = testing.rel_l2(
        np.asarray(output, np.float64),
        testing.output_f64(
            np.asarray(ref2.prefix), x["blocks"], x["norm"], x["query"], x["out_norm"], eps=1e-6, out_eps=1e-6
        ),
    )
    assert err < testing.OUTPUT_REL_L2_TOL
    thunks = testing.thunk_sequence(dump, "pallas_steps")
    assert testing.custom_calls_in_command_buffers(thunks) == 2, thunks[:3000]
