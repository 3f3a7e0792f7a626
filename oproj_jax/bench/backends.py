"""Which backends can run here: the JAX registry (api.py) plus the optional PyTorch baseline.

Every name in the registry is asked, one at a time, so a backend whose module is missing or
broken is reported with its reason instead of hiding the others. Three names are not registry
backends: "torch" times `oproj_jax.torch_ref` on CUDA tensors as a baseline, "cute-graph" the
CuTe cubin launched by cuda-python inside CUDA graphs, and "triton-torch" the Triton kernels of
backend="triton" launched from PyTorch inside CUDA graphs; all run in PyTorch's process.
"""

from __future__ import annotations

from oproj_jax import api, contract

TORCH = "torch"
CUTE_GRAPH = "cute-graph"
TRITON_TORCH = "triton-torch"
# timed in PyTorch's process, through CUDA graphs (not registry names) -> the registry backend whose kernel they launch
TORCH_PROCESS = {TORCH: None, CUTE_GRAPH: "cute", TRITON_TORCH: "triton"}


def registry_names() -> list[str]:
    """The backend names api.consumer accepts (without "auto"), in registry order."""
    return api.backend_names()


def jax_backend_status(platform: str) -> dict[str, str | None]:
    """Registry name -> None when it runs on `platform`, else the reason (a failed import included)."""
    return api.available_backends(platform)


def torch_unavailable_reason() -> str | None:
    """None when the PyTorch baseline can run (torch with a CUDA device and torch_ref), else why not."""
    try:
        import torch
    except ImportError as err:
        return f"PyTorch is not installed ({err})"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device (the torch baseline is timed on the GPU only)"
    try:
        from oproj_jax import torch_ref  # noqa: F401
    except ImportError as err:
        return f"oproj_jax.torch_ref is missing ({err})"
    return None


def cute_graph_unavailable_reason(status: dict[str, str | None]) -> str | None:
    """None when the CuTe cubin can be launched from PyTorch (cute runs, torch, cuda-python)."""
    why = status.get("cute", "not in the registry") or torch_unavailable_reason()
    if why:
        return why
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError as err:
        return f"cuda-python (cuda.bindings) is not installed ({err})"
    return None


def triton_torch_unavailable_reason() -> str | None:
    """None when the Triton kernels can be launched from PyTorch (torch with CUDA, triton). The
    compute capability (8.0 or newer) is the entry's own check, in PyTorch's process."""
    why = torch_unavailable_reason()
    if why:
        return why
    try:
        from oproj_jax.triton import torch_launch  # noqa: F401
    except ImportError as err:
        return f"the Triton kernels need triton ({err}): pip install oproj-jax[triton]"
    return None


def backend_status(platform: str, *, with_torch: bool = True) -> dict[str, str | None]:
    status = jax_backend_status(platform)
    if with_torch:
        status[TORCH] = torch_unavailable_reason()
        status[CUTE_GRAPH] = cute_graph_unavailable_reason(status)
        status[TRITON_TORCH] = triton_torch_unavailable_reason()
    return status


def unsupported_reason(name: str, dims: contract.Dims, options: dict) -> str | None:
    """None when backend `name` handles these dims/options, else why not (the registry's answer)."""
    name = TORCH_PROCESS.get(name, name)
    if name is None:  # the PyTorch baseline handles every call
        return None
    try:
        return api.unsupported_reason(name, dims, **options)
    except Exception as err:
        return f"unsupported_reason failed ({type(err).__name__}: {err})"
