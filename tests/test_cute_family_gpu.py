"""Every prebuilt cubin of the production family, on the GPU, against the oracle.

The family (docs/cubins.md: R in {1, 2, 4, 8, 16} x NB 0..8 x has_delta x groups x
xmoe_replicas 0..3, 1008 cubins) is what a machine without the CuTe DSL runs from. Each cubin
is launched once from PyTorch through the FFI handler's launch (cute/driver_launch.py: grid
(7, T), cluster 7, PDL, ready mode) on fresh random inputs and held to
oproj_jax.testing.check_result (prefix bit-exact to the summation-order model, output vs f64,
xmoe replicas), which covers 1008 variants in seconds where 1008 jitted programs would take
minutes. The public entry point (oproj_jax.consumer(backend="cute")) then runs one option set
per (R, xmoe_replicas) with xmoe_replicas 2 and 3, and groups that name the same order as
another (R=2 with groups=4), on the same oracle.

The CPU check that the manifest holds the whole family is in tests/test_cute_build.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import oproj_jax
from oproj_jax import configs, testing
from oproj_jax.cute import backend, build, driver_launch

T = 2
EPS, OUT_EPS = 1e-3, 1e-2
SEED = 20261130


def _config(key: dict) -> configs.Config:
    return configs.Config(
        key["R"], T, key["NB"], groups=key["groups"], has_delta=key["has_delta"], xmoe_replicas=key["xmoe_replicas"]
    )


@pytest.fixture(scope="module")
def torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    try:
        import cuda.bindings  # noqa: F401
    except ImportError as err:
        pytest.skip(f"cuda-python (cuda.bindings) is not installed: {err}")
    reason = backend.unavailable_reason("gpu")
    if reason:
        pytest.fail(f"backend 'cute' unavailable on this GPU machine: {reason}")
    return torch


def _to_torch(torch, a: np.ndarray):
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16).copy()).cuda().view(torch.bfloat16)


def _to_numpy(torch, t) -> np.ndarray:
    import ml_dtypes

    return t.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)


def test_every_family_cubin_matches_the_oracle(torch_cuda):
    torch = torch_cuda
    keys = build.production_keys()
    assert len(keys) == 1008
    failures = []
    for i, key in enumerate(keys):
        config = _config(key)
        x = configs.make_inputs(config, seed=SEED + i)
        kernel = backend._kernel(key, T, ready=True)
        launch = driver_launch.torch_launcher(kernel)
        mailbox, prefix = _to_torch(torch, x["mailbox"]), _to_torch(torch, x["prefix"])
        blocks = _to_torch(torch, x["blocks"]) if config.NB else prefix  # any valid pointer when NB = 0
        norm, query, out_norm = (_to_torch(torch, x[k]) for k in ("norm", "query", "out_norm"))
        poison = torch.tensor(-1, dtype=torch.int16, device="cuda").view(torch.bfloat16)  # 0xFFFF: NaN
        output = torch.empty((T, config.H), dtype=torch.bfloat16, device="cuda").fill_(poison)
        xmoe = torch.empty((max(config.xmoe_replicas, 1), T, config.H), dtype=torch.bfloat16, device="cuda")
        xmoe.fill_(poison)
        flags = torch.zeros(2, dtype=torch.int32, device="cuda")  # ready mode: counted, never read
        pointers = [mailbox, prefix, blocks, norm, query, out_norm, output, xmoe]
        launch(T, [t.data_ptr() for t in pointers] + [flags.data_ptr() + 4, flags.data_ptr()], EPS, OUT_EPS, -1)
        torch.cuda.synchronize()
        result = (
            _to_numpy(torch, prefix),
            _to_numpy(torch, output),
            _to_numpy(torch, xmoe) if config.xmoe_replicas else None,
        )
        try:
            testing.check_result(config, x, result, eps=EPS, out_eps=OUT_EPS, what=config.name)
        except AssertionError as err:
            failures.append(str(err)[:300])
        launch.launch.close()  # 1008 modules would otherwise stay loaded
    assert not failures, f"{len(failures)} of {len(keys)} family cubins are off; first: {failures[:3]}"


API_CASES = [
    configs.Config(R, T, nb, groups=groups, has_delta=delta, xmoe_replicas=reps)
    for R, nb, groups, delta in ((1, 8, 3, True), (2, 0, 4, False), (4, 5, 3, True), (8, 1, 2, True), (16, 8, 4, True))
    for reps in (2, 3)
]


@pytest.mark.parametrize("config", API_CASES, ids=lambda c: c.name)
def test_public_api_runs_family_options(gpu, config):
    reason = backend.unavailable_reason("gpu")
    if reason:
        pytest.fail(f"backend 'cute' unavailable on this GPU machine: {reason}")
    import jax

    x = configs.make_inputs(config, seed=SEED)
    arrays = [jax.device_put(x[k], gpu) for k in ("mailbox", "prefix", "blocks", "norm", "query", "out_norm")]
    res = oproj_jax.consumer(*arrays, eps=EPS, out_eps=OUT_EPS, backend="cute", **config.options())
    testing.check_result(config, x, res, eps=EPS, out_eps=OUT_EPS, what=config.name)
