"""The Pallas backend's limits and its interpreter, on the CPU.

Barriers: Mosaic GPU initializes at most 32 mbarriers in one group, and the cluster layout has
one per resident row (R + has_delta + NB); a shape over that takes the ring layout, which
lowers for CUDA here (lowering is where Mosaic refuses more barriers). Interpreter: it keeps one
shared-memory model per process, so eager interpreted calls from several threads take turns.
"""

from __future__ import annotations

import threading

import jax.numpy as jnp
import numpy as np
import pytest

import oproj_jax
from oproj_jax import configs, testing
from oproj_jax.pallas import consumer as pallas_consumer
from conftest import pallas_lowered_for_h200

ARGS = ("mailbox", "prefix", "blocks", "norm", "query", "out_norm")


def test_r32_lowers_for_cuda_on_the_ring():
    """R = 32, NB = 8, T = 1: 41 resident rows would need 41 barriers in the cluster layout
    (Mosaic: "Only up to 32 barriers per group supported"); the default call takes one CTA per
    token with a ring of slots, whose module lowers."""
    config = configs.Config(32, 1, 8)
    assert pallas_consumer.cluster_barriers(32, 8, True) == 41 > pallas_consumer.MAX_BARRIERS
    text = pallas_lowered_for_h200(lambda *a: oproj_jax.consumer(*a, backend="pallas"), config)
    assert pallas_consumer.KERNEL_NAME in text and "1x28x256xbf16" in text  # split=1: a row of [1, 28, 256]
    # the largest rank count the cluster layout takes at NB = 8 still lowers as a cluster
    text = pallas_lowered_for_h200(lambda *a: oproj_jax.consumer(*a, backend="pallas"), configs.Config(23, 1, 8))
    assert "7x4x256xbf16" in text


def test_a_cluster_over_the_barrier_limit_is_refused_up_front():
    config = configs.Config(32, 1, 8)

    def fn(*args):
        return pallas_consumer.consumer_with(*args, **config.options(), ring=4, split=7, batch=16)

    with pytest.raises(ValueError) as info:
        pallas_lowered_for_h200(fn, config)
    message = str(info.value)
    assert message.startswith("split: a cluster keeps every row of a token resident, one barrier per row")
    assert "R + has_delta + NB = 41 rows" in message and "32 barriers" in message and "split=1" in message
    with pytest.raises(ValueError, match=r"ring: expected 1 <= ring <= 32"):
        pallas_lowered_for_h200(lambda *a: pallas_consumer.consumer_with(*a, ring=33, split=1), configs.Config(2, 1, 1))


def test_interpreted_calls_from_threads_take_turns():
    """Three threads calling the interpreted kernel at once: each result is, bit for bit, what the
    kernel gives alone, and its prefix the reference's (without the lock the interpreter's shared
    state fails the calls inside it)."""
    config = configs.Config(2, 2, 1, groups=2, xmoe_replicas=1, H=256)
    x = configs.make_inputs(config, 3)
    arrays = [jnp.asarray(x[k]) for k in ARGS]
    reference = oproj_jax.consumer(*arrays, backend="reference", **config.options())
    alone = oproj_jax.consumer(*arrays, backend="pallas", **config.options())
    np.testing.assert_array_equal(testing.bits(alone.prefix), testing.bits(reference.prefix))
    results, errors = [None] * 3, []
    start = threading.Barrier(3)

    def work(i):
        try:
            start.wait()
            for _ in range(2):
                results[i] = oproj_jax.consumer(*arrays, backend="pallas", **config.options())
        except Exception as err:  # reported below, with the thread
            errors.append(f"thread {i}: {type(err).__name__}: {str(err)[:300]}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for got in results:
        for field in ("prefix", "output", "xmoe"):
            np.testing.assert_array_equal(testing.bits(getattr(got, field)), testing.bits(getattr(alone, field)))
