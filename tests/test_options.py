"""oproj_jax.options: the one options type, its defaults (those of every signature that spells
the options out) and its checks."""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oproj_jax
from oproj_jax import options, torch_ref
from oproj_jax.cute import backend as cute_backend
from oproj_jax.options import DEFAULTS, Options

# docs/spec.md, "Options"
DEFAULT_VALUES = dict(eps=1e-6, out_eps=1e-6, has_delta=True, groups=4, xmoe_replicas=0)


def test_defaults():
    assert DEFAULTS.asdict() == DEFAULT_VALUES
    assert list(DEFAULTS.asdict()) == list(oproj_jax.consumer.__kwdefaults__)[:5]  # the consumer's keyword order


PUBLIC = {
    "api": oproj_jax.consumer,
    "explain": oproj_jax.explain,
    "torch_ref": torch_ref.consumer,
    "cute.consume": cute_backend.consume,
    "tp_consumer": oproj_jax.tp_consumer,
    "tp_oproj_consumer": oproj_jax.tp_oproj_consumer,
}


@pytest.mark.parametrize("fn", PUBLIC.values(), ids=PUBLIC.keys())
def test_signatures_take_the_defaults(fn):
    params = inspect.signature(fn).parameters
    assert {name: params[name].default for name in DEFAULT_VALUES} == DEFAULT_VALUES
    assert all(params[name].kind is inspect.Parameter.KEYWORD_ONLY for name in DEFAULT_VALUES)


def test_twoshot_signature_orders_one_slot():
    """consume_twoshot's gather row is one slot: its `groups` defaults to 1, the rest to DEFAULTS."""
    params = inspect.signature(cute_backend.consume_twoshot).parameters
    assert {name: params[name].default for name in DEFAULT_VALUES} == dict(DEFAULT_VALUES, groups=1)
    assert list(params)[7:9] == ["me", "eps"]  # the required keyword first


def test_unknown_option_is_refused_by_name():
    arrays = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((2, 1, 16), (1, 16), (1, 0, 16), (16,), (16,), (16,))]
    with pytest.raises(TypeError, match=r"unexpected option\(s\) \['group'\]"):
        oproj_jax.explain(*arrays, group=1)


def test_plain_scalars_and_hashable():
    """Numpy scalars and an int epsilon become Python scalars, so equal options are one cache key."""
    given = Options(
        eps=1, out_eps=np.float32(0.5), has_delta=np.bool_(False), groups=np.int64(2), xmoe_replicas=np.int32(1)
    )
    assert given == Options(eps=1.0, out_eps=0.5, has_delta=False, groups=2, xmoe_replicas=1)
    assert hash(given) == hash(Options(eps=1.0, out_eps=0.5, has_delta=False, groups=2, xmoe_replicas=1))
    assert [type(v) for v in given.asdict().values()] == [float, float, bool, int, int]
    with pytest.raises(dataclasses.FrozenInstanceError):
        given.groups = 3


@pytest.mark.parametrize(
    ("change", "error", "text"),
    [
        (dict(eps=-1.0), ValueError, "eps: expected a finite epsilon >= 0, got -1.0"),
        (dict(out_eps="x"), TypeError, "out_eps: expected a Python float (a static epsilon), got str"),
        (dict(has_delta=1), TypeError, "has_delta: expected a bool, got int"),
        (dict(groups=0), ValueError, "groups: expected 1 <= groups <= 4, got 0"),
        (dict(groups=True), TypeError, "groups: expected an int, got bool True"),
        (dict(xmoe_replicas=-2), ValueError, "xmoe_replicas: expected xmoe_replicas >= 0, got -2"),
    ],
    ids=["eps", "out_eps", "has_delta", "groups-range", "groups-bool", "xmoe_replicas"],
)
def test_checked_when_made(change, error, text):
    with pytest.raises(error) as info:
        Options(**change)
    assert str(info.value) == text
    with pytest.raises(error) as info:
        Options.from_kwargs(change)
    assert str(info.value) == text


def test_from_kwargs():
    assert Options.from_kwargs({}) == DEFAULTS
    assert Options.from_kwargs(dict(groups=1)) == dataclasses.replace(DEFAULTS, groups=1)
    with pytest.raises(TypeError, match=r"unexpected option\(s\) \['group', 'twoshot'\]; expected some of \['eps'"):
        Options.from_kwargs(dict(twoshot=True, group=1))
    assert options.NAMES == tuple(DEFAULT_VALUES)
