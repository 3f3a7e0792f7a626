"""The own-partial variants as their PTX shows them (CuTe DSL, no GPU): an `own` variant reads
params 15 and 16 (own, own_slot), every other variant never reads them, so its code is that of
the kernel without the feature (kernel.py, "Own partial"). Running them is left to the GPU tests
(tests/test_contract.py::test_own_partial_stands_for_its_slot, backend cute)."""

import re

import pytest

from oproj_jax import abi
from oproj_jax.cute import build
from oproj_jax.cute import manifest as cute_manifest

pytest.importorskip("cutlass", reason="the CuTe DSL (nvidia-cutlass-dsl) builds the kernel")

KEY = dict(R=4, NB=2, has_delta=True, groups=2, xmoe_replicas=1, twoshot=False)
OWN = [i for i, p in enumerate(abi.CONSUMER_ONESHOT) if p.name in ("own", "own_slot")]


def params_read(key: dict) -> set[int]:
    ptx = build.compile_variant(key, cute_manifest.FOLDED, with_ptx=True)["ptx"]
    return {int(n) for n in re.findall(r"ld\.param\.\w+\s+[^,]+,\s*\[\w+_param_(\d+)\]", ptx)}


def test_only_own_variants_read_the_own_params():
    assert OWN == [15, 16]
    plain, own = params_read(KEY), params_read(dict(KEY, own=True))
    assert plain == set(range(15))  # every parameter but own and own_slot
    assert own == set(range(17))


def test_a_twoshot_own_variant_is_refused():
    """A twoshot kernel polls one gathered row: no slot of its own to stand in for."""
    from oproj_jax.cute.kernel import OprojConsumer

    with pytest.raises(ValueError, match="one-shot variants only"):
        cute_manifest.make_key(4, 2, True, 2, 1, True, True)
    with pytest.raises(ValueError, match="one-shot variants only"):
        OprojConsumer(4, 2, has_delta=True, groups=2, xmoe_replicas=1, twoshot=True, own=True)
