"""backend="auto" by device capability, and oproj_jax.explain, on the CPU with stand-in devices.

The devices here are objects with a platform and a compute capability, as JAX's GPU devices
have; whether a real H100/H200 reports "9.0" and the kernels then run is for the GPU tests.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

import oproj_jax
from conftest import fake_ready_cubins
from oproj_jax import api, configs
from oproj_jax.contract import Dims
from oproj_jax.cute import backend as cute_backend
from oproj_jax.cute import cache as cute_cache
from oproj_jax.cute import manifest as M
from oproj_jax.triton import backend as triton_backend

H = configs.HIDDEN
DIMS = Dims(R=2, T=1, NB=1, H=H)
OPTIONS = dict(eps=1e-6, out_eps=1e-6, has_delta=True, groups=2, xmoe_replicas=0)


class FakeGPU:
    platform = "gpu"

    def __init__(self, capability: str, index: int = 0):
        self.compute_capability = capability
        self.id = index

    def __repr__(self):
        return f"FakeGPU({self.id}, cc {self.compute_capability})"


def arrays(R=2, T=1, NB=1, hidden=H):
    """Arrays on the CPU device, on any machine (on a GPU machine JAX's default would be the GPU)."""
    bf16 = jnp.bfloat16
    with jax.default_device(jax.devices("cpu")[0]):
        return (
            jnp.zeros((R, T, hidden), bf16),
            jnp.zeros((T, hidden), bf16),
            jnp.zeros((T, NB, hidden), bf16),
            jnp.ones((hidden,), bf16),
            jnp.zeros((hidden,), bf16),
            jnp.ones((hidden,), bf16),
        )


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(api, "_warned", set())


@pytest.fixture
def cute_here(tmp_path, monkeypatch):
    """The cute backend as it looks on a CUDA machine with the library and the variant built:
    a sealed fake manifest of DIMS's key (folded build), a file for the library, CUDA pretended."""
    (tmp_path / "k.cubin").write_bytes(b"fake")
    fake_ready_cubins(tmp_path, M.make_key(2, 1, True, 2, 0, False), dynamic_smem_bytes=1)
    (tmp_path / "lib.so").write_bytes(b"")
    monkeypatch.setenv(M.ENV_DIR, str(tmp_path))
    monkeypatch.setenv("OPROJ_JAX_FFI_LIBRARY", str(tmp_path / "lib.so"))
    monkeypatch.setenv(cute_cache.ENV_NO_COMPILE, "1")  # prebuilt cubins only
    monkeypatch.setattr(cute_backend, "_is_cuda", lambda platform: True)


@pytest.fixture
def no_triton(monkeypatch):
    """The triton backend as on a GPU machine without triton, jax-triton or the CUDA plugin."""
    monkeypatch.setattr(triton_backend, "unavailable_reason", lambda platform: "stand-in: no Triton here")


@pytest.fixture
def triton_here(monkeypatch):
    """The triton backend as on a CUDA machine with triton, jax-triton and the CUDA plugin."""
    real = triton_backend.unavailable_reason
    monkeypatch.setattr(triton_backend, "unavailable_reason", lambda p: None if p in ("gpu", "cuda") else real(p))


def test_hopper_gpu_auto_takes_the_first_kernel_that_runs(cute_here):
    assert api.resolve_backend("auto", "gpu", DIMS, devices=[FakeGPU("9.0")], **OPTIONS) == "cute"
    # a shape the cubins were not built for (and nothing compiled on first use): the next kernel
    assert api.resolve_backend("auto", "gpu", DIMS._replace(NB=2), devices=[FakeGPU("9.0")], **OPTIONS) == "pallas"


def test_a_variant_that_compiles_on_first_use_is_supported(cute_here, monkeypatch):
    """With the CuTe DSL installed, a key outside the prebuilt set is compiled when a call needs
    it, so choosing and explaining do not call it unsupported (and compile nothing)."""
    pytest.importorskip("cutlass", reason="the CuTe DSL (the cute extra) compiles on first use")
    monkeypatch.delenv(cute_cache.ENV_NO_COMPILE)
    monkeypatch.setattr(cute_cache, "_compile", lambda *a: pytest.fail("choosing a backend compiled a cubin"))
    assert api.resolve_backend("auto", "gpu", DIMS._replace(NB=2), devices=[FakeGPU("9.0")], **OPTIONS) == "cute"
    # what the kernel cannot be built for stays unsupported, with the kernel's reason
    reason = cute_backend.unsupported_reason(DIMS._replace(R=17), **OPTIONS)
    assert "R=17" in reason and "expected 1 <= R <= 16" in reason
    # explain says that the first call compiles (and says nothing of it for a prebuilt variant)
    monkeypatch.setattr(api, "_placement", lambda *a: ("gpu", [FakeGPU("9.0")]))
    text = oproj_jax.explain(*arrays(NB=2), **OPTIONS)
    assert text.startswith("backend='auto' runs 'cute'") and "is not prebuilt: the first call compiles it" in text
    assert "not prebuilt" not in oproj_jax.explain(*arrays(), **OPTIONS)


def test_hopper_gpu_without_cute_takes_pallas(monkeypatch):
    """cute unavailable (on a CPU machine: no CUDA platform; pinned so on any machine), pallas
    runs on the 9.0 device."""
    monkeypatch.setattr(cute_backend, "unavailable_reason", lambda platform: "stand-in: no cute here")
    assert api.resolve_backend("auto", "gpu", DIMS, devices=[FakeGPU("9.0")], **OPTIONS) == "pallas"


@pytest.mark.parametrize("capabilities", [["8.0"], ["10.0"], ["9.0", "8.9"]], ids=str)
def test_other_gpus_get_the_reference_with_a_warning(cute_here, no_triton, fresh_warnings, capabilities):
    devices = [FakeGPU(c, i) for i, c in enumerate(capabilities)]
    with pytest.warns(RuntimeWarning, match="runs the jnp reference on this GPU") as record:
        assert api.resolve_backend("auto", "gpu", DIMS, devices=devices, **OPTIONS) == "reference"
    message = str(record[0].message)
    odd = next(c for c in capabilities if c != "9.0")
    assert f"compute capability {odd}" in message and "cute:" in message and "pallas:" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason: a decode loop is not flooded
        api.resolve_backend("auto", "gpu", DIMS, devices=devices, **OPTIONS)


@pytest.mark.parametrize("name", ["cute", "pallas"])
def test_a_named_kernel_on_another_gpu_raises_naming_the_capability(cute_here, name):
    with pytest.raises(ValueError, match=rf"backend='{name}' cannot run here: .*compute capability 8\.6"):
        api.resolve_backend(name, "gpu", DIMS, devices=[FakeGPU("8.6")], **OPTIONS)


def test_cpu_auto_takes_the_reference_quietly(fresh_warnings):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert api.resolve_backend("auto", "cpu", DIMS, **OPTIONS) == "reference"


def test_available_backends_checks_the_platforms_devices(monkeypatch):
    monkeypatch.setattr(api, "_platform_devices", lambda platform: [FakeGPU("8.0")])
    status = api.available_backends("gpu")
    assert "compute capability 8.0" in status["pallas"] and status["reference"] is None
    monkeypatch.setattr(api, "_platform_devices", lambda platform: [FakeGPU("9.0")])
    assert api.available_backends("gpu")["pallas"] is None


def test_explain_on_the_cpu():
    text = oproj_jax.explain(*arrays(), groups=2)
    first, *rest = text.splitlines()
    assert first.startswith("backend='auto' runs 'reference'") and "platform 'cpu'" in first
    assert any(line.startswith("  cute: not picked: the CuTe kernel runs on NVIDIA CUDA GPUs") for line in rest)
    assert any(line.startswith("  pallas: not picked: auto runs the kernels on CUDA GPUs only") for line in rest)
    assert "interpret mode" in oproj_jax.explain(*arrays(), groups=2, backend="pallas")
    assert oproj_jax.explain(*arrays(), backend="cute").startswith("backend='cute' cannot run this call")


def test_explain_on_stand_in_gpus(cute_here, no_triton, monkeypatch):
    monkeypatch.setattr(api, "_placement", lambda *a: ("gpu", [FakeGPU("9.0")]))
    text = oproj_jax.explain(*arrays(), groups=2)
    assert text.splitlines()[0].startswith("backend='auto' runs 'cute'") and "compute capability 9.0" in text
    assert "  pallas: not picked: 'cute' comes first" in text
    monkeypatch.setattr(api, "_placement", lambda *a: ("gpu", [FakeGPU("8.0")]))
    text = oproj_jax.explain(*arrays(), groups=2)
    assert text.splitlines()[0].startswith("backend='auto' runs 'reference'")
    assert text.count("has compute capability 8.0") == 2  # cute and pallas


def test_explain_checks_its_arguments_like_consumer():
    mailbox, *rest = arrays()
    with pytest.raises(TypeError, match="mailbox: expected dtype bfloat16"):
        oproj_jax.explain(mailbox.astype(jnp.float32), *rest)
    with pytest.raises(ValueError, match="groups"):
        oproj_jax.explain(mailbox, *rest, groups=9)
    with pytest.raises(ValueError, match="backend: expected one of"):
        oproj_jax.explain(mailbox, *rest, backend="tpu")
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays()]  # shapes only: the default device
    on_default = [jax.device_put(x, jax.devices()[0]) for x in arrays()]

    def choice(text):  # the pick and every reason; the device count differs (all of them vs one)
        first, *rest = text.splitlines()
        return first.split(" (")[0], rest

    assert choice(oproj_jax.explain(*specs, groups=2)) == choice(oproj_jax.explain(*on_default, groups=2))


# ---- the Triton kernel: compute capability 8.0 and newer


@pytest.mark.parametrize("capabilities", [["8.0"], ["8.9"], ["10.0"], ["9.0", "8.6"]], ids=str)
def test_gpus_the_hopper_kernels_refuse_take_triton_quietly(cute_here, triton_here, fresh_warnings, capabilities):
    devices = [FakeGPU(c, i) for i, c in enumerate(capabilities)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a kernel runs: nothing to warn about
        assert api.resolve_backend("auto", "gpu", DIMS, devices=devices, **OPTIONS) == "triton"


def test_hopper_gpu_prefers_cute_and_pallas_to_triton(cute_here, triton_here):
    assert api.resolve_backend("auto", "gpu", DIMS, devices=[FakeGPU("9.0")], **OPTIONS) == "cute"
    assert api.resolve_backend("auto", "gpu", DIMS._replace(NB=2), devices=[FakeGPU("9.0")], **OPTIONS) == "pallas"
    # a hidden size the Pallas kernel's TMA view refuses: the Triton kernel takes any H
    odd = DIMS._replace(H=1000)
    assert api.resolve_backend("auto", "gpu", odd, devices=[FakeGPU("9.0")], **OPTIONS) == "triton"


def test_gpus_older_than_ampere_get_the_reference_with_triton_reason(triton_here, fresh_warnings):
    with pytest.warns(RuntimeWarning, match="runs the jnp reference on this GPU") as record:
        assert api.resolve_backend("auto", "gpu", DIMS, devices=[FakeGPU("7.5")], **OPTIONS) == "reference"
    message = str(record[0].message)
    assert "triton: the Triton kernel computes in bf16, compute capability 8.0 or newer" in message
    with pytest.raises(ValueError, match=r"backend='triton' cannot run here: .*compute capability 7\.5"):
        api.resolve_backend("triton", "gpu", DIMS, devices=[FakeGPU("7.5")], **OPTIONS)


def test_explain_reports_triton_in_place_of_the_hopper_kernels(cute_here, triton_here, monkeypatch):
    monkeypatch.setattr(api, "_placement", lambda *a: ("gpu", [FakeGPU("8.0")]))
    first, *rest = oproj_jax.explain(*arrays(), groups=2).splitlines()
    assert first.startswith("backend='auto' runs 'triton'") and "compute capability 8.0" in first
    assert "  triton: the portable kernel, taken because the Hopper kernels (cute, pallas) cannot run this call" in rest
    for name in ("cute", "pallas"):
        assert any(line.startswith(f"  {name}: not picked:") and "has compute capability 8.0" in line for line in rest)
    assert any(line.startswith("  reference: not picked: 'triton' comes first") for line in rest)


def test_triton_is_unavailable_off_cuda():
    assert "runs on NVIDIA CUDA GPUs, it has no CPU or interpret path" in api.available_backends("cpu")["triton"]


# ---- "auto" never picks a backend that cannot take the shape


@pytest.mark.parametrize(
    ("dims", "picked"),
    [
        (DIMS, "cute"),
        (Dims(R=32, T=1, NB=8, H=H), "pallas"),  # over cute's 16 slots; pallas takes it on its ring
        (Dims(R=100, T=1, NB=8, H=H), "pallas"),  # over triton's 64 too
        (Dims(R=2, T=1, NB=1, H=16384), "triton"),  # cute: H = 7168 only; pallas: over its shared memory
        (Dims(R=65, T=1, NB=1, H=16384), "reference"),  # no kernel takes it
    ],
    ids=["R2", "R32", "R100", "H16384", "R65-H16384"],
)
def test_auto_picks_the_first_backend_that_takes_the_shape(cute_here, triton_here, fresh_warnings, dims, picked):
    devices = [FakeGPU("9.0")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference on a GPU warns; that is tested above
        name, reasons = api.choose_backend("auto", "gpu", dims, devices=devices, **OPTIONS)
    assert name == picked
    assert api.unsupported_reason(name, dims, **OPTIONS) is None
    order = api.backend_names()
    for skipped in order[: order.index(name)]:  # every backend before it says why, with its limit
        assert reasons[skipped] and api.unsupported_reason(skipped, dims, **OPTIONS) == reasons[skipped]


def test_explain_names_the_limits_that_pass_a_kernel_over(cute_here, triton_here, monkeypatch):
    monkeypatch.setattr(api, "_placement", lambda *a: ("gpu", [FakeGPU("9.0")]))
    with jax.default_device(jax.devices("cpu")[0]):
        mailbox = jnp.zeros((32, 1, H), jnp.bfloat16)
    text = oproj_jax.explain(mailbox, *arrays(NB=1)[1:], **OPTIONS)
    assert text.splitlines()[0].startswith("backend='auto' runs 'pallas'")
    assert "  cute: not picked: R=32: the CuTe kernel sums at most 16 mailbox slots" in text


# ---- cute's archs: sm_90a on compute capability 9.0, sm_100a (opt-in) on 10.0


@pytest.fixture
def cute_archs(tmp_path, monkeypatch):
    """The cute backend as on a CUDA machine whose cubin directory has both archs built (a fake
    manifest of DIMS's key for each, sm_100a's in the subdirectory sm_100a/); the process's CUDA
    devices are set by the test (`devices(...)`), as device_arch reads them."""
    key = M.make_key(2, 1, True, 2, 0, False)
    for arch in ("sm_90a", "sm_100a"):
        fake_ready_cubins(tmp_path, key, entry=f"k_{arch}", dynamic_smem_bytes=1, arch=arch)
    (tmp_path / "lib.so").write_bytes(b"")
    monkeypatch.setenv(M.ENV_DIR, str(tmp_path))
    monkeypatch.setenv("OPROJ_JAX_FFI_LIBRARY", str(tmp_path / "lib.so"))
    monkeypatch.setenv(cute_cache.ENV_NO_COMPILE, "1")  # prebuilt cubins only
    monkeypatch.setattr(cute_backend, "_is_cuda", lambda platform: True)

    def devices(*capabilities):
        gpus = [FakeGPU(c, i) for i, c in enumerate(capabilities)]
        monkeypatch.setattr(cute_backend, "_cuda_devices", lambda: gpus)
        monkeypatch.setattr(api, "_placement", lambda *a: ("gpu", gpus))
        monkeypatch.setattr(api, "_platform_devices", lambda platform: gpus)
        return gpus

    return tmp_path, devices


def _cute_kernel():
    return cute_backend._kernel(M.make_key(2, 1, True, 2, 0, False), 1, True)


@pytest.mark.parametrize(("capability", "arch"), [("9.0", "sm_90a"), ("10.0", "sm_100a")])
def test_cute_takes_the_cubins_of_the_devices_arch(cute_archs, capability, arch):
    root, devices = cute_archs
    gpus = devices(capability)
    assert cute_backend.device_arch() == (arch, "")
    kernel = _cute_kernel()
    assert kernel.cubin == str(M.arch_dir(arch, root) / "k.cubin") and kernel.entry == f"k_{arch}"
    assert api.resolve_backend("cute", "gpu", DIMS, devices=gpus, **OPTIONS) == "cute"
    assert api.available_backends("gpu")["cute"] is None  # it runs when named


def test_auto_keeps_triton_on_10_0_and_says_why(cute_archs, triton_here, fresh_warnings):
    """sm_100a is opt-in: auto picks triton on a 10.0 device although the cubins are there;
    backend="cute" runs them; explain says both."""
    _, devices = cute_archs
    gpus = devices("10.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a kernel runs: nothing to warn about
        name, reasons = api.choose_backend("auto", "gpu", DIMS, devices=gpus, **OPTIONS)
    assert name == "triton"
    assert "sm_100a cubins have not run on a GPU of compute capability 10.0 yet" in reasons["cute"]
    assert "backend='cute' runs them (opt-in)" in reasons["cute"]
    text = oproj_jax.explain(*arrays(), **OPTIONS)
    assert text.splitlines()[0].startswith("backend='auto' runs 'triton'")
    assert "  cute: not picked: its sm_100a cubins have not run on a GPU of compute capability 10.0 yet" in text
    assert "  triton: the portable kernel, taken because cute runs here only when named (opt-in)" in text
    named = oproj_jax.explain(*arrays(), backend="cute", **OPTIONS)
    assert named.splitlines()[0].startswith("backend='cute' runs 'cute'")
    assert "  cute: opt-in on compute capability 10.0: its cubins there have not run on such a GPU yet" in named
    # a Hopper GPU: cute, as before, and no opt-in line
    devices("9.0")
    text = oproj_jax.explain(*arrays(), **OPTIONS)
    assert text.splitlines()[0].startswith("backend='auto' runs 'cute'") and "opt-in" not in text


def test_a_10_0_device_without_sm100a_cubins_names_its_arch_the_built_ones_and_the_build(cute_archs):
    root, devices = cute_archs
    gpus = devices("10.0")
    (root / "sm_100a" / M.MANIFEST).unlink()  # only sm_90a built
    with pytest.raises(ValueError) as err:
        api.resolve_backend("cute", "gpu", DIMS, devices=gpus, **OPTIONS)
    message = str(err.value)
    assert "no CuTe cubins for sm_100a (compute capability 10.0)" in message
    assert "archs built there: sm_90a" in message and M.REBUILD_COMMAND in message
    with pytest.raises(ValueError, match="python -m oproj_jax.cute.build --key 2,1,1,2,0,0 --arch sm_100a`"):
        _cute_kernel()


@pytest.mark.parametrize("capability", ["8.6", "10.3", "12.0"])
def test_a_device_no_cute_arch_serves_names_its_arch_and_the_built_ones(cute_archs, capability):
    _, devices = cute_archs
    gpus = devices(capability)
    sm = M.device_arch_name(capability)
    with pytest.raises(
        ValueError, match=rf"backend='cute' cannot run here: .* has compute capability {capability} \({sm}\)"
    ):
        api.resolve_backend("cute", "gpu", DIMS, devices=gpus, **OPTIONS)
    # the backend itself (consume, driver launches: no api in between) refuses it as well
    reason = cute_backend.unavailable_reason("gpu")
    assert f"has compute capability {capability} ({sm}): no CuTe cubin runs there" in reason
    assert "built for sm_90a (compute capability 9.0), sm_100a (compute capability 10.0) only" in reason
    with pytest.raises(ValueError, match=rf"\({sm}\): no CuTe cubin runs there"):
        _cute_kernel()


def test_devices_of_two_archs_in_one_process_are_refused(cute_archs):
    _, devices = cute_archs
    devices("9.0", "10.0")
    arch, why = cute_backend.device_arch()
    assert arch is None and "several archs" in why and "sm_90a" in why and "sm_100a" in why
    with pytest.raises(ValueError, match="several archs"):
        _cute_kernel()


def test_lowering_without_a_cuda_device_takes_the_primary_arch(cute_archs, monkeypatch):
    """A CPU machine lowering for CUDA (no CUDA device in the process): the primary arch's cubins."""
    root, _ = cute_archs
    monkeypatch.setattr(cute_backend, "_cuda_devices", lambda: [])
    assert cute_backend.device_arch() == (M.PRIMARY_ARCH, "")
    assert _cute_kernel().cubin == str(root / "k.cubin")
