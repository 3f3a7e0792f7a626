"""Test-wide setup: 16 CPU devices (a simulated TP16 mesh) and the GPU skip rule."""

import importlib.util
import json
import os
from pathlib import Path

import jax
import pytest

# Must happen before any backend starts: the sharded tests need a 16-device mesh on one CPU.
jax.config.update("jax_num_cpu_devices", 16)


@pytest.fixture(autouse=True, scope="session")
def _private_cubin_cache(tmp_path_factory):
    """Cubins compiled on first use go to a directory of this test session, never the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OPROJ_JAX_CACHE_DIR", str(tmp_path_factory.mktemp("cubin_cache")))
        yield


def benchmark_script(name: str):
    """benchmarks/<name>.py imported as a module (the scripts are not a package)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dsl_missing_reason() -> str | None:
    """None when the CuTe DSL imports (cubins can be compiled here), else why not."""
    try:
        import cutlass.cute  # noqa: F401
    except Exception as err:  # the DSL raises more than ImportError when its libs are absent
        return f"CuTe DSL not importable ({type(err).__name__}: {err}); pip install oproj-jax[cute]"
    return None


def gpu_platform_reason() -> str | None:
    """None when a CUDA GPU is present, else why GPU tests are skipped."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError as err:
        return f"no CUDA GPU on this machine ({err})"
    return None if devices else "no CUDA GPU on this machine"


@pytest.fixture
def gpu():
    reason = gpu_platform_reason()
    if reason:
        pytest.skip(reason)
    return jax.devices("gpu")[0]


def fake_ready_cubins(directory, key, *, entry="k", dynamic_smem_bytes=1000, arch="sm_90a") -> dict:
    """A sealed manifest of `arch` in the cubin directory `directory` (manifest.arch_dir: sm_90a's
    in it, sm_100a's in its subdirectory) with one folded build (what the registry's ready mode
    takes) of `key`, whose cubin is a stand-in file: enough for the cute backend to choose and
    lower a call on a machine without a GPU (lowering never opens a cubin). Returns the entry.
    Tests of a prebuilt set set $OPROJ_JAX_NO_COMPILE too, or a variant outside it would be
    compiled on first use where the DSL is installed."""
    from oproj_jax import abi, configs
    from oproj_jax.cute import manifest

    directory = manifest.arch_dir(arch, directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "k.cubin").write_bytes(b"a stand-in: never launched")
    kernel = dict(
        key=key,
        min_ctas=0,
        fold=True,
        cubin="k.cubin",
        entry=entry,
        dynamic_smem_bytes=dynamic_smem_bytes,
        block=[128, 1, 1],
        cluster=[7, 1, 1],
        params=abi.ptx(abi.CONSUMER_ONESHOT),
    )
    sealed = manifest.seal(dict(arch=arch, cutlass_dsl="4.8.1", H=configs.HIDDEN, kernels=[kernel]), directory)
    (directory / manifest.MANIFEST).write_text(json.dumps(sealed))
    return kernel


def launch_attributes(call: str, prefix: str = "") -> dict:
    """The launch attributes of a lowered custom call (one line of the StableHLO text) as
    oproj_jax/launch.py writes them: cubin, entry (str), grid, block, cluster (tuples), smem
    (int), pdl (bool), params (launch.Arg per parameter); `prefix`: a target's second launch."""
    import re

    from oproj_jax import launch

    config = re.search(r"mhlo\.backend_config = \{(.*?)\}", call)  # no braces inside
    assert config, call[:400]
    config = config.group(1)

    def value(name):
        pattern = r"(dense<\[?([^\]>]*)\]?> : tensor<(\d+)xi64>|\"([^\"]*)\"|(true|false)|(-?\d+) : i64)"
        found = re.search(rf"(?:^|, ){prefix}{name} = {pattern}", config)
        assert found, f"{prefix}{name} not in {config[:400]}"
        dense, size, text, flag, number = found.group(2, 3, 4, 5, 6)
        if dense is not None:
            values = tuple(int(v) for v in dense.split(",") if v.strip())
            return values * int(size) if len(values) == 1 else values  # a splat: dense<0> : tensor<3xi64>
        if text is not None:
            return text
        if flag is not None:
            return flag == "true"
        return int(number)

    out = {name: value(name) for name in ("cubin", "entry", "grid", "block", "cluster", "smem", "pdl", "params")}
    out["params"] = launch.decode(out["params"])
    return out


def inplace_pairs(call: str) -> list[tuple[int, int]]:
    """The `inplace` attribute of a lowered launch call, as (operand, result) pairs."""
    import re

    dense, size = re.search(r"inplace = dense<\[?([^\]>]*)\]?> : tensor<(\d+)xi64>", call).group(1, 2)
    words = [int(v) for v in dense.split(",") if v.strip()]
    words = words * int(size) if len(words) == 1 else words  # a splat
    return list(zip(words[0::2], words[1::2]))


def gpus_or_skip(count: int) -> list:
    """This process's CUDA GPUs when there are at least `count`, else the test is skipped."""
    reason = gpu_platform_reason()
    if reason:
        pytest.skip(reason)
    gpus = jax.devices("gpu")
    if len(gpus) < count:
        pytest.skip(f"needs {count} GPUs, found {len(gpus)}")
    return gpus


REPO = Path(__file__).resolve().parent.parent


def worker_env(drop=("XLA_FLAGS", "JAX_NUM_CPU_DEVICES"), **values) -> dict:
    """The environment of a test's worker processes: this one's without `drop` (the test
    session's own device setup), the checkout first on PYTHONPATH, and `values`."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.update(values)
    return env


def pallas_lowered_for_h200(fn, config) -> str:
    """The StableHLO text of jit(fn) lowered for CUDA on this machine, for an abstract H200:
    fn takes (mailbox, prefix, blocks, norm, query, out_norm) of `config`'s shapes (bf16), and
    the Pallas backend lowers its kernel (not the interpreter) as it would on the GPU."""
    import unittest.mock

    import jax.numpy as jnp

    from oproj_jax.pallas import consumer as pallas_consumer

    shapes = (
        (config.R, config.T, config.H),
        (config.T, config.H),
        (config.T, config.NB, config.H),
        (config.H,),
        (config.H,),
        (config.H,),
    )
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in shapes]
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=device)
    with (
        unittest.mock.patch.object(pallas_consumer, "_interpret", lambda *arrays: False),
        jax.sharding.use_abstract_mesh(mesh),
    ):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
