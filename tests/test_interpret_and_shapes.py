"""Where Pallas interpret mode comes from, where it is refused, and T = 0.

Interpret mode follows the devices of the arrays (or, traced, the enclosing mesh), not JAX's
default backend; inside a shard_map over several devices it is refused with one clear error
(the interpreter's one shared-memory model per process fails kernels interpreted concurrently).
That the GPU path is taken for arrays on an H100/H200 is for the GPU tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import oproj_jax
from oproj_jax.pallas import consumer as pallas_consumer

H = 512


def arrays(R=2, T=1, NB=1, hidden=H, seed=0):
    k = jax.random.split(jax.random.key(seed), 6)
    bf16 = jnp.bfloat16
    return (
        jax.random.normal(k[0], (R, T, hidden), bf16),
        jax.random.normal(k[1], (T, hidden), bf16),
        jax.random.normal(k[2], (T, NB, hidden), bf16),
        jnp.ones((hidden,), bf16),
        0.05 * jax.random.normal(k[4], (hidden,), bf16),
        jnp.ones((hidden,), bf16),
    )


def abstract_mesh(platform: str, axes=()):
    device = jax.sharding.AbstractDevice(device_kind=platform, platform=platform, num_cores=None)
    return jax.sharding.AbstractMesh(
        tuple(size for _, size in axes), tuple(name for name, _ in axes), abstract_device=device
    )


def test_interpret_mode_follows_the_arrays_and_the_mesh_not_the_default_backend(monkeypatch):
    cpu_array = jax.device_put(jnp.zeros((2, 2), jnp.bfloat16), jax.devices("cpu")[0])
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # a GPU machine, as JAX's default sees it
    assert pallas_consumer._interpret(cpu_array)  # arrays on the CPU: interpreted
    assert not pallas_consumer._interpret()  # nothing concrete, no mesh: the default backend
    with jax.sharding.use_abstract_mesh(abstract_mesh("cpu")):
        assert pallas_consumer._interpret()  # traced under a CPU mesh
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    with jax.sharding.use_abstract_mesh(abstract_mesh("gpu")):
        assert not pallas_consumer._interpret()  # traced under a GPU mesh on a CPU-default process


def test_cpu_arrays_run_interpreted_under_a_gpu_default(monkeypatch):
    x = arrays()
    want = oproj_jax.consumer(*x, groups=2, backend="reference")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    got = oproj_jax.consumer(*x, groups=2, backend="pallas")
    np.testing.assert_array_equal(np.asarray(got.prefix, np.float32), np.asarray(want.prefix, np.float32))


def test_interpret_mode_inside_a_multi_device_shard_map_is_one_clear_error(capfd):
    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("tp",))
    mailbox, prefix, blocks, norm, query, out_norm = arrays(R=2)

    def step(part, prefix, blocks):
        full = jax.lax.all_gather(part, "tp", tiled=True)
        return oproj_jax.consumer(full, prefix, blocks, norm, query, out_norm, groups=1, backend="pallas").output

    sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=P(), check_vma=False))
    with pytest.raises(
        ValueError,
        match=r"backend: 'pallas' would run in Mosaic GPU interpret mode inside a "
        r"shard_map over 2 devices .*backend='reference'",
    ):
        sharded(jax.device_put(mailbox, NamedSharding(mesh, P("tp"))), prefix, blocks)
    assert "Barrier remains allocated" not in capfd.readouterr().err


def test_tp_consumer_with_interpreted_pallas_on_a_cpu_mesh_is_refused():
    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("tp",))
    x = arrays(R=2)
    with pytest.raises(ValueError, match="interpret mode inside a shard_map over 2 devices"):
        oproj_jax.tp_consumer(*x, mesh=mesh, axis_name="tp", mode="oneshot", groups=1, backend="pallas")


def test_zero_tokens_are_rejected_naming_T():
    mailbox, prefix, blocks, norm, query, out_norm = arrays()
    empty = (mailbox[:, :0], prefix[:0], blocks[:0])
    for backend in ("auto", "reference", "pallas"):
        with pytest.raises(ValueError, match=r"mailbox: expected T >= 1 tokens .*got T = 0.*skip the call"):
            oproj_jax.consumer(*empty, norm, query, out_norm, backend=backend)
    with pytest.raises(ValueError, match="got T = 0"):
        oproj_jax.explain(*empty, norm, query, out_norm)
    with pytest.raises(ValueError, match=r"mailbox: expected R >= 1 and H >= 1"):
        oproj_jax.consumer(mailbox[:0], prefix, blocks, norm, query, out_norm)
