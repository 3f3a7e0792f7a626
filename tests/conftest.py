"""Test-wide setup: 16 CPU devices (a simulated TP16 mesh) and the GPU skip rule."""

import jax
import pytest

# Must happen before any backend starts: the sharded tests need a 16-device mesh on one CPU.
jax.config.update("jax_num_cpu_devices", 16)


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
