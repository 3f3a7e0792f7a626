"""jax.grad through oproj_jax.consumer: the same gradients on every backend (the chosen kernel's
forward, the reference's VJP as the backward).

On the CPU: the reference and the Pallas kernel in interpret mode are differentiated; the cute
backend is lowered for CUDA under jax.grad (its custom call must be the forward). That the GPU
kernels' forward under grad runs and matches is for the GPU tests: the backward never runs a kernel.
Forward mode on a kernel backend raises a TypeError that names backend="reference" as the way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oproj_jax
from conftest import fake_ready_cubins
from oproj_jax import api, configs
from oproj_jax.cute import backend as cute_backend
from oproj_jax import ffi
from oproj_jax.cute import manifest as M

NAMES = ("mailbox", "prefix", "blocks", "norm", "query", "out_norm")


def inputs(R=2, T=2, NB=2, H=512, seed=0):
    k = jax.random.split(jax.random.key(seed), 6)
    bf16 = jnp.bfloat16
    return (
        jax.random.normal(k[0], (R, T, H), bf16),
        jax.random.normal(k[1], (T, H), bf16),
        jax.random.normal(k[2], (T, NB, H), bf16),
        1 + 0.1 * jax.random.normal(k[3], (H,), bf16),
        0.05 * jax.random.normal(k[4], (H,), bf16),
        1 + 0.1 * jax.random.normal(k[5], (H,), bf16),
    )


def loss(*arrays, backend, **options):
    res = oproj_jax.consumer(*arrays, backend=backend, **options)
    total = jnp.sum(res.output.astype(jnp.float32) * jnp.arange(res.output.size).reshape(res.output.shape) / 1e3)
    total = total + 0.5 * jnp.sum(res.prefix.astype(jnp.float32) ** 2)
    if res.xmoe is not None:
        total = total + jnp.sum(res.xmoe.astype(jnp.float32))
    return total


@pytest.mark.parametrize(
    "options",
    [dict(groups=2), dict(has_delta=False, groups=1, xmoe_replicas=1)],
    ids=["delta-groups2", "nodelta-xmoe1"],
)
def test_pallas_grad_equals_the_reference_grad(options):
    x = inputs()
    ref_val, ref_grads = jax.value_and_grad(
        functools.partial(loss, backend="reference", **options), argnums=tuple(range(6))
    )(*x)
    pal_val, pal_grads = jax.value_and_grad(
        functools.partial(loss, backend="pallas", **options), argnums=tuple(range(6))
    )(*x)
    np.testing.assert_allclose(float(pal_val), float(ref_val), rtol=1e-2)  # the forwards: bf16 outputs
    for name, r, p in zip(NAMES, ref_grads, pal_grads):
        r, p = np.asarray(r, np.float32), np.asarray(p, np.float32)
        assert p.dtype == r.dtype and p.shape == r.shape, name
        assert np.isfinite(p).all(), name
        unread = name == "prefix" and not options.get("has_delta", True)  # has_delta=False: prefix not read
        assert (np.abs(p).max() == 0) if unread else (np.abs(p).max() > 0), name
        np.testing.assert_allclose(p, r, rtol=2e-2, atol=1e-3, err_msg=name)  # in fact equal: one backward


def test_grad_under_jit_and_unused_outputs():
    """Only `output` used: the prefix and xmoe cotangents are zeros; jit around grad."""
    x = inputs(NB=0)
    f = jax.jit(
        jax.grad(
            lambda *a: jnp.sum(oproj_jax.consumer(*a, backend="pallas", groups=1).output.astype(jnp.float32)),
            argnums=(0, 3, 5),
        )
    )
    # the reference under jit as well: XLA's GPU fusions keep bf16 intermediates in f32 where
    # eager op-by-op execution rounds them, so jit and eager gradients differ by more than bf16 ulps
    r = jax.jit(
        jax.grad(
            lambda *a: jnp.sum(oproj_jax.consumer(*a, backend="reference", groups=1).output.astype(jnp.float32)),
            argnums=(0, 3, 5),
        )
    )(*x)
    for got, want in zip(f(*x), r):
        assert np.isfinite(np.asarray(got, np.float32)).all()
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_the_own_partial_gets_its_slots_gradient(backend):
    """partial= stands for slot `rank`: its gradient is the one that slot gets without it, and
    that slot of the mailbox (never read) gets zeros; the other slots' gradients are unchanged."""
    x = inputs(R=3)
    rank, mailbox = 1, x[0]
    want = jax.grad(functools.partial(loss, backend="reference", groups=2))(mailbox, *x[1:])

    def with_partial(mailbox, partial):
        res = oproj_jax.consumer(mailbox, *x[1:], partial=partial, rank=rank, backend=backend, groups=2)
        total = jnp.sum(res.output.astype(jnp.float32) * jnp.arange(res.output.size).reshape(res.output.shape) / 1e3)
        return total + 0.5 * jnp.sum(res.prefix.astype(jnp.float32) ** 2)

    unread = mailbox.at[rank].set(jnp.nan)  # the slot is never read: NaN there changes nothing
    got_mailbox, got_partial = jax.grad(with_partial, argnums=(0, 1))(unread, mailbox[rank])
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    assert np.isfinite(f32(got_partial)).all() and np.abs(f32(got_partial)).max() > 0
    np.testing.assert_allclose(f32(got_partial), f32(want[rank]), rtol=2e-2, atol=1e-3)
    assert np.all(f32(got_mailbox[rank]) == 0)
    others = np.array([r for r in range(3) if r != rank])
    np.testing.assert_allclose(f32(got_mailbox[others]), f32(want[others]), rtol=2e-2, atol=1e-3)


def test_reference_keeps_forward_mode():
    x = inputs()
    tangents = tuple(jnp.ones_like(a) for a in x)
    _, out_tangent = jax.jvp(lambda *a: oproj_jax.consumer(*a, backend="reference", groups=2).output, x, tangents)
    assert np.isfinite(np.asarray(out_tangent, np.float32)).all()


class FakeHopper:
    platform = "gpu"
    compute_capability = "9.0"
    id = 0


@pytest.fixture
def cute_lowerable(tmp_path, monkeypatch, tmp_path_factory):
    """A sealed fake manifest with the registry's key, a built FFI library, CUDA pretended: enough
    to lower backend="cute" for CUDA on this machine."""
    fake_ready_cubins(tmp_path, M.make_key(2, 1, True, 2, 0, False), entry="ready_entry")
    library = ffi.build_library(tmp_path_factory.mktemp("grad_lib"))
    monkeypatch.setenv(M.ENV_DIR, str(tmp_path))
    monkeypatch.setenv("OPROJ_JAX_FFI_LIBRARY", str(library))
    monkeypatch.setattr(cute_backend, "_is_cuda", lambda platform: True)
    monkeypatch.setattr(api, "_placement", lambda *arrays: ("gpu", [FakeHopper()]))


@pytest.mark.slow
def test_cute_forward_under_grad_is_the_custom_call(cute_lowerable):
    H = configs.HIDDEN
    specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((2, 3, H), (3, H), (3, 1, H), (H,), (H,), (H,))]
    grad = jax.grad(functools.partial(loss, backend="cute", groups=2), argnums=tuple(range(6)))
    text = jax.jit(grad).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @oproj_launch(" in line]
    assert len(calls) == 1 and 'entry = "ready_entry"' in calls[0]  # the forward: once, the kernel
    assert "rsqrt" in text  # the backward: the reference's jnp VJP (its RMSNorms)


@pytest.mark.slow
def test_cute_forward_without_grad_keeps_the_in_place_prefix(cute_lowerable):
    """The custom_vjp wrapper is transparent to a plain jitted call: the one custom call, and the
    prefix (operand 1) still aliased to its result, so a donated prefix is updated in place."""
    H = configs.HIDDEN
    specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((2, 3, H), (3, H), (3, 1, H), (H,), (H,), (H,))]
    step = jax.jit(functools.partial(oproj_jax.consumer, backend="cute", groups=2), donate_argnums=1)
    text = step.trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @oproj_launch(" in line]
    assert len(calls) == 1
    assert "output_tuple_indices = [0], operand_index = 1" in calls[0]
    assert "tf.aliasing_output" in text or "jax.buffer_donor" in text  # the donated prefix reaches XLA


@pytest.mark.slow
def test_stream_capture_names_the_traced_target(cute_lowerable):
    """oproj_jax.consumer(stream_capture=True) reaches the kernel: its one call names the
    target without a record stage (traced into XLA's graph), the default names the record
    target; the same kernel either way."""
    H = configs.HIDDEN
    specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((2, 3, H), (3, H), (3, 1, H), (H,), (H,), (H,))]
    for capture, target in ((False, ffi.LAUNCH_TARGET), (True, ffi.LAUNCH_TRACED_TARGET)):
        step = jax.jit(functools.partial(oproj_jax.consumer, backend="cute", groups=2, stream_capture=capture))
        text = step.trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
        calls = [line for line in text.splitlines() if "stablehlo.custom_call @oproj_launch" in line]
        assert len(calls) == 1 and f"custom_call @{target}(" in calls[0] and 'entry = "ready_entry"' in calls[0]
        told = oproj_jax.explain(*specs, backend="cute", groups=2, stream_capture=capture)
        assert ("by stream capture (stream_capture=True)" if capture else "a kernel node of XLA's CUDA graph") in told


@pytest.fixture
def kernels_here(monkeypatch):
    """cute and triton as on a Hopper GPU, their forward stood in by the reference (on the CPU
    nothing launches them): what api.consumer wraps them in is what is tested."""
    from oproj_jax import reference
    from oproj_jax.triton import backend as triton_backend

    for module in (cute_backend, triton_backend):
        monkeypatch.setattr(module, "unavailable_reason", lambda platform: None)
        monkeypatch.setattr(module, "unsupported_reason", lambda dims, **options: None)
        monkeypatch.setattr(module, "consumer", reference.consumer)
    monkeypatch.setattr(api, "_placement", lambda *arrays: ("gpu", [FakeHopper()]))


@pytest.mark.parametrize("name", ["cute", "pallas", "triton"])
@pytest.mark.parametrize("transform", ["jvp", "jacfwd"])
def test_forward_mode_on_a_kernel_says_how_to_differentiate(kernels_here, name, transform):
    x = inputs(H=256)
    f = lambda *a: oproj_jax.consumer(*a, backend=name, groups=2).output  # noqa: E731
    with pytest.raises(TypeError) as info:
        if transform == "jvp":
            jax.jvp(f, x, tuple(jnp.ones_like(a) for a in x))
        else:
            jax.jacfwd(lambda q: f(*x[:4], q, x[5]))(x[4])
    message = str(info.value)
    assert message.startswith(f"backend={name!r}: forward-mode autodiff (jax.jvp, jax.jacfwd, jax.hessian)")
    assert "jax.grad, jax.vjp and jax.jacrev work" in message and "call it with backend='reference'" in message
    # reverse mode on the same call works: the kernel's forward, the reference's backward
    grads = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 4))(*x)
    assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in grads)


def test_forward_mode_under_auto_names_the_backend_it_picked(kernels_here):
    x = inputs(H=7168, R=2, NB=1, T=1)
    with pytest.raises(TypeError, match=r"^backend='cute' \(backend='auto' picked it here\): forward-mode"):
        jax.jvp(lambda *a: oproj_jax.consumer(*a, groups=2).output, x, x)
