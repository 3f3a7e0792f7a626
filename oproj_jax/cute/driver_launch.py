"""The same cubin launched without XLA: cuda-python's driver API on a given CUDA stream.

Used by the cross-framework parity test (PyTorch tensors, eager and CUDA-graph capture) and by
the benchmark's CUDA-graph timing of the kernel. The launch is the FFI handler's: grid (7, T),
cluster 7, programmatic stream serialization (PDL), the parameters of oproj_jax/abi.py.
"""

from __future__ import annotations

import ctypes

from oproj_jax import abi

_CTYPES = {".u64": ctypes.c_uint64, ".u32": ctypes.c_uint32, ".f32": ctypes.c_float}  # a PTX .param's host type


def _driver():
    from cuda.bindings import driver  # imported here: CPU machines need not have cuda-python

    return driver


def check(result, what: str):
    """The value of a cuda-python call, or a RuntimeError naming the call and the CUDA error."""
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise RuntimeError(f"oproj cute driver launch: {what}: CUDA error {err}")
    return result[1] if isinstance(result, tuple) and len(result) == 2 else None


class DriverLaunch:
    """One cubin variant (backend._kernel(key, T)) loaded into the current context."""

    def __init__(self, kernel):
        cu = _driver()
        self.cu, self.kernel = cu, kernel
        with open(kernel.cubin, "rb") as f:
            self.image = f.read()
        self.module = check(cu.cuModuleLoadData(self.image), "cuModuleLoadData")
        self.fn = check(cu.cuModuleGetFunction(self.module, kernel.entry.encode()), "cuModuleGetFunction")
        attr = cu.CUfunction_attribute
        check(
            cu.cuFuncSetAttribute(self.fn, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, kernel.smem),
            "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
        )
        check(
            cu.cuFuncSetAttribute(self.fn, attr.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
            "cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED)",
        )
        self._keep = ()  # the last launch's parameter values

    def close(self) -> None:
        """Unloads the module (after the launches using it have finished)."""
        if self.module is not None:
            check(self.cu.cuModuleUnload(self.module), "cuModuleUnload")
            self.module = self.fn = None

    def __call__(
        self, stream: int, T: int, pointers, eps: float, out_eps: float, timeout_us: int, twoshot=None
    ) -> None:
        """Launch on `stream` (a CUstream handle as an int). `pointers`: the 10 device
        addresses of cute/ABI.md; `twoshot`: (recv, gather, me) or None."""
        cu = self.cu
        named = dict(zip((p.name for p in abi.CONSUMER_COMMON[:10]), pointers))
        named.update(eps=eps, out_eps=out_eps, T=T, timeout_us=timeout_us)
        if twoshot is not None:
            named.update(zip(("recv", "gather", "me"), twoshot))
        else:
            named.update(control=0, own=0, own_slot=0)  # no fail-stop word, no own partial
        layout = abi.CONSUMER_TWOSHOT if twoshot is not None else abi.CONSUMER_ONESHOT
        values = [_CTYPES[p.ptx](named[p.name]) for p in layout]
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        cluster = cu.CUlaunchAttribute()
        cluster.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        cluster.value.clusterDim.x, cluster.value.clusterDim.y, cluster.value.clusterDim.z = 7, 1, 1
        pdl = cu.CUlaunchAttribute()
        pdl.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        pdl.value.programmaticStreamSerializationAllowed = 1
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = 7, T, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = self.kernel.block, 1, 1
        config.sharedMemBytes = self.kernel.smem
        config.hStream = cu.CUstream(stream)
        config.attrs, config.numAttrs = [cluster, pdl], 2
        check(cu.cuLaunchKernelEx(config, self.fn, ctypes.addressof(params), 0), "cuLaunchKernelEx")
        self._keep = (values, params)  # alive until the launch has copied them


def torch_launcher(kernel):
    """A DriverLaunch in torch's (primary) context; call it as f(T, pointers, ...) to launch on
    torch's current stream (eager or under torch.cuda.graph capture)."""
    import torch

    torch.zeros(1, device="cuda")  # make torch's primary context current
    launch = DriverLaunch(kernel)

    def on_current_stream(T, pointers, eps, out_eps, timeout_us, twoshot=None):
        launch(torch.cuda.current_stream().cuda_stream, T, pointers, eps, out_eps, timeout_us, twoshot)

    on_current_stream.launch = launch
    return on_current_stream
