"""The two references against each other, and the reference's twoshot gather row.

Parity of every backend (the jnp reference and the PyTorch model included) with the one oracle
is in tests/test_contract.py; this file holds what concerns the references themselves.
Expected values never come from the code under test (oproj_jax.testing's numpy models).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import oproj_jax
from oproj_jax import configs, reference, testing
from oproj_jax.configs import Config

ARGS = ("mailbox", "prefix", "blocks", "norm", "query", "out_norm")
SEED = 0
EPS = dict(eps=0.5, out_eps=0.25)  # as in tests/test_contract.py: a swapped epsilon shows
bf16 = ml_dtypes.bfloat16


@functools.cache
def result(backend: str, config: Config):  # numpy (prefix, output, xmoe) of the consumer's case
    arrays, options = testing.consumer_case(config, configs.make_inputs(config, SEED))
    if backend == "torch":
        pytest.importorskip("torch", reason="the torch reference needs PyTorch: pip install oproj-jax[test]")
        from oproj_jax import torch_ref

        got = torch_ref.consumer(*(torch_ref.from_numpy(arrays[k]) for k in ARGS), **EPS, **options)
        return tuple(None if x is None else torch_ref.to_numpy(x) for x in got)
    got = oproj_jax.consumer(*(jnp.asarray(arrays[k]) for k in ARGS), **EPS, **options, backend="reference")
    return tuple(None if x is None else np.asarray(x) for x in got)


@pytest.mark.parametrize("config", configs.PARITY, ids=lambda c: c.name)
def test_torch_matches_jax_reference(config):
    """The two independently written references agree: prefix bit for bit, output to rounding."""
    torch_prefix, torch_output, _ = result("torch", config)
    jax_prefix, jax_output, _ = result("reference", config)
    testing.assert_same_bits(torch_prefix, jax_prefix, "torch prefix vs jnp reference prefix")
    # Both compute in f32 and round once to bf16; they differ by at most an ulp where f32
    # reduction order tips a rounding, far below the f64 tolerance.
    assert testing.rel_l2(torch_output, jax_output) < testing.OUTPUT_REL_L2_TOL


def test_twoshot_gather_row_has_no_negative_zero():
    config = next(c for c in configs.PARITY if c.twoshot)
    mailbox = configs.make_inputs(config, SEED)["mailbox"].copy()
    mailbox[:, 0, 7] = -0.0
    gather = np.asarray(reference.twoshot_gather(jnp.asarray(mailbox)))
    assert gather.shape == (1, *mailbox.shape[1:])
    testing.assert_same_bits(gather, testing.model_gather_row(mailbox), "gather row")
    assert testing.bits(gather)[0, 0, 7] == 0


def test_torch_reference_on_cuda(gpu):
    """torch_ref on CUDA tensors: the same prefix bits as the numpy model, the output in tolerance."""
    torch = pytest.importorskip("torch", reason="pip install oproj-jax[test]")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    from oproj_jax import torch_ref

    config = configs.PARITY[2]  # R16-T64-NB8-G4
    arrays = configs.make_inputs(config, SEED)
    got = torch_ref.consumer(*(torch_ref.from_numpy(arrays[k]).cuda() for k in ARGS), **EPS, **config.options())
    assert got.prefix.is_cuda and got.output.is_cuda
    testing.check_result(config, arrays, tuple(None if x is None else torch_ref.to_numpy(x) for x in got), **EPS)
