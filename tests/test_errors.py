"""Every public argument check of oproj_jax.consumer: the error type, a message that names the
argument, what was expected and what was given, and the caller's arrays left untouched. Then the
errors that say the next step: a traced static option (how to keep it static), a missing or
broken FFI library (where it was looked for, how to build it), a shape over a backend's limit
(the limit, and a backend that takes the shape).

The rows tests/test_contract.py runs for every backend and the PyTorch model (its BAD table:
mailbox and prefix float32, prefix T, groups 5, xmoe_replicas -1, eps NaN, has_delta 1) are
not repeated here."""

from __future__ import annotations

import importlib
import re

import jax
import ml_dtypes
import numpy as np
import pytest

import oproj_jax
from oproj_jax import api, contract, testing

R, T, NB, H = 2, 3, 1, 16  # small and valid; every case below breaks exactly one thing
bf16 = ml_dtypes.bfloat16


def valid_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shapes = dict(mailbox=(R, T, H), prefix=(T, H), blocks=(T, NB, H), norm=(H,), query=(H,), out_norm=(H,))
    return {k: rng.standard_normal(s).astype(bf16) for k, s in shapes.items()}


VALID_OPTIONS = dict(eps=1e-6, out_eps=1e-6, has_delta=True, groups=2, xmoe_replicas=1, backend="reference")


def call(arrays, **options):
    return oproj_jax.consumer(*arrays.values(), **dict(VALID_OPTIONS, **options))


def reshaped(name, shape):
    return {name: np.zeros(shape, bf16)}


def retyped(name, dtype):
    return {name: valid_arrays()[name].astype(dtype)}


# (id, replaced arrays, replaced options, error, text the message must contain)
CASES = [
    # dtypes
    *(
        (f"{k}-float32", retyped(k, np.float32), {}, TypeError, [f"{k}:", "bfloat16", "float32"])
        for k in ("blocks", "norm", "query", "out_norm")
    ),
    ("prefix-float16", retyped("prefix", np.float16), {}, TypeError, ["prefix:", "bfloat16", "float16"]),
    ("mailbox-list", {"mailbox": [[[0.0] * H]] * R}, {}, TypeError, ["mailbox:", "[R, T, H]", "list"]),
    # ranks
    ("mailbox-rank2", reshaped("mailbox", (T, H)), {}, ValueError, ["mailbox:", "rank 3", f"{(T, H)}"]),
    ("prefix-rank3", reshaped("prefix", (1, T, H)), {}, ValueError, ["prefix:", "rank 2", f"{(1, T, H)}"]),
    ("blocks-rank2", reshaped("blocks", (T, H)), {}, ValueError, ["blocks:", "rank 3", "[T, NB, H]"]),
    ("norm-rank2", reshaped("norm", (1, H)), {}, ValueError, ["norm:", "rank 1", "[H]"]),
    ("query-rank0", reshaped("query", ()), {}, ValueError, ["query:", "rank 1", "()"]),
    ("out_norm-rank2", reshaped("out_norm", (H, 1)), {}, ValueError, ["out_norm:", "rank 1", f"{(H, 1)}"]),
    ("mailbox-no-ranks", reshaped("mailbox", (0, T, H)), {}, ValueError, ["mailbox:", ">= 1", f"{(0, T, H)}"]),
    # T / H agreement with the mailbox
    ("prefix-H", reshaped("prefix", (T, H + 8)), {}, ValueError, ["prefix:", f"{(T, H)}", f"{(T, H + 8)}"]),
    ("blocks-T", reshaped("blocks", (T + 1, NB, H)), {}, ValueError, ["blocks:", f"T={T}", f"{(T + 1, NB, H)}"]),
    ("blocks-H", reshaped("blocks", (T, NB, H - 8)), {}, ValueError, ["blocks:", f"H={H}", f"{(T, NB, H - 8)}"]),
    *(
        (f"{k}-H", reshaped(k, (H * 2,)), {}, ValueError, [f"{k}:", f"({H},)", f"({H * 2},)"])
        for k in ("norm", "query", "out_norm")
    ),
    ("blocks-NB9", reshaped("blocks", (T, 9, H)), {}, ValueError, ["blocks:", "at most 8", "NB=9"]),
    # groups
    ("groups-0", {}, dict(groups=0), ValueError, ["groups:", "1 <= groups <= 4", "got 0"]),
    ("groups-float", {}, dict(groups=2.0), TypeError, ["groups:", "int", "2.0"]),
    ("groups-str", {}, dict(groups="2"), TypeError, ["groups:", "int", "'2'"]),
    ("groups-bool", {}, dict(groups=True), TypeError, ["groups:", "int", "True"]),
    # xmoe_replicas
    ("xmoe-float", {}, dict(xmoe_replicas=1.5), TypeError, ["xmoe_replicas:", "int", "1.5"]),
    # epsilons
    ("eps-negative", {}, dict(eps=-1e-6), ValueError, ["eps:", ">= 0", "-1e-06"]),
    ("eps-inf", {}, dict(eps=float("inf")), ValueError, ["eps:", "finite", "inf"]),
    ("eps-str", {}, dict(eps="1e-6"), TypeError, ["eps:", "float", "str"]),
    ("eps-none", {}, dict(eps=None), TypeError, ["eps:", "float", "NoneType"]),
    ("eps-bool", {}, dict(eps=True), TypeError, ["eps:", "float", "bool"]),
    ("out_eps-negative", {}, dict(out_eps=-0.5), ValueError, ["out_eps:", ">= 0", "-0.5"]),
    ("out_eps-nan", {}, dict(out_eps=float("nan")), ValueError, ["out_eps:", "finite", "nan"]),
    ("out_eps-str", {}, dict(out_eps="x"), TypeError, ["out_eps:", "float", "str"]),
    # the own partial and the slot it stands for
    ("partial-float32", {}, dict(partial=np.zeros((T, H), np.float32)), TypeError, ["partial:", "bfloat16", "float32"]),
    ("partial-T", {}, dict(partial=np.zeros((T + 1, H), bf16)), ValueError, ["partial:", f"{(T, H)}", f"{(T + 1, H)}"]),
    ("rank-R", {}, dict(partial=np.zeros((T, H), bf16), rank=R), ValueError, ["rank:", f"< R = {R}", f"got {R}"]),
    ("rank-bool", {}, dict(partial=np.zeros((T, H), bf16), rank=True), TypeError, ["rank:", "int", "bool"]),
    ("rank-no-partial", {}, dict(rank=1), ValueError, ["rank:", "None", "rank=1"]),
    # backend names
    ("backend-unknown", {}, dict(backend="tpu"), ValueError, ["backend:", "'reference'", "'auto'", "'tpu'"]),
    ("backend-not-str", {}, dict(backend=3), TypeError, ["backend:", "str", "int"]),
]

# has_delta: a non-bool is rejected by check_arguments and by api.consumer, which checks the
# options as given, before it turns them into plain Python scalars (bool(1) would pass).
HAS_DELTA_CASES = [
    ("has_delta-int", 1, TypeError, ["has_delta:", "bool", "int"]),
    ("has_delta-none", None, TypeError, ["has_delta:", "bool", "NoneType"]),
    ("has_delta-str", "yes", TypeError, ["has_delta:", "bool", "str"]),
]


HAS_DELTA_IDS = [c[0] for c in HAS_DELTA_CASES]


def assert_raises_naming(error, texts, fn):
    with pytest.raises(error) as info:
        fn()
    message = str(info.value)
    assert message.startswith(texts[0]), f"message does not start with {texts[0]!r}: {message!r}"
    missing = [t for t in texts[1:] if t not in message]
    assert not missing, f"message lacks {missing}: {message!r}"


def snapshot(arrays):  # the caller's numpy arrays, byte for byte
    return {k: (v.dtype, v.shape, v.tobytes()) for k, v in arrays.items() if isinstance(v, np.ndarray)}


def assert_unchanged(arrays, before):
    assert snapshot(arrays) == before, "the call modified the caller's numpy arrays"


@pytest.mark.parametrize(("arrays", "options", "error", "texts"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_argument_is_named(arrays, options, error, texts):
    arrays = dict(valid_arrays(), **arrays)
    before = snapshot(arrays)
    assert_raises_naming(error, texts, lambda: call(arrays, **options))
    assert_unchanged(arrays, before)


def test_valid_arguments_run():
    """The baseline every case above breaks in one place is itself accepted (else the cases
    would pass for the wrong reason), and a valid call does not modify the caller's arrays."""
    arrays = valid_arrays()
    before = snapshot(arrays)
    result = call(arrays)
    assert result.prefix.shape == (T, H) and result.output.shape == (T, H) and result.xmoe.shape == (1, T, H)
    assert_unchanged(arrays, before)


@pytest.mark.parametrize(("value", "error", "texts"), [c[1:] for c in HAS_DELTA_CASES], ids=HAS_DELTA_IDS)
def test_has_delta_not_bool_check_arguments(value, error, texts):
    options = dict(VALID_OPTIONS, has_delta=value)
    del options["backend"]
    assert_raises_naming(error, texts, lambda: contract.check_arguments(*valid_arrays().values(), **options))


@pytest.mark.parametrize(("value", "error", "texts"), [c[1:] for c in HAS_DELTA_CASES], ids=HAS_DELTA_IDS)
def test_has_delta_not_bool_consumer(value, error, texts):
    arrays = valid_arrays()
    before = snapshot(arrays)
    assert_raises_naming(error, texts, lambda: call(arrays, has_delta=value))
    assert_unchanged(arrays, before)


def kernel_module(name: str):
    """The backend's module, or a skip when its module is missing from this checkout."""
    path = api._BACKENDS[name]
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as err:
        if err.name and path.startswith(err.name):
            pytest.skip(f"{path} does not exist yet")
        raise


@pytest.mark.parametrize("name", ["cute", "pallas", "triton"])
def test_kernel_backend_that_cannot_run_raises(name):
    """Naming a kernel that cannot run here (platform, or this small shape) raises ValueError
    with its reason; it never falls back to another backend."""
    module = kernel_module(name)
    platform = jax.default_backend()
    reason = module.unavailable_reason(platform)
    if name in ("cute", "triton") and platform not in ("gpu", "cuda"):
        assert reason, f"the {name} kernel cannot run off an NVIDIA GPU, yet reports no reason"
    if reason is None:
        options = {k: v for k, v in VALID_OPTIONS.items() if k != "backend"}
        reason = module.unsupported_reason(contract.Dims(R, T, NB, H), **options)
    if reason is None:
        pytest.skip(f"backend={name!r} runs on {platform} at R={R} T={T} NB={NB} H={H}: nothing to refuse")
    arrays = valid_arrays()
    before = snapshot(arrays)
    with pytest.raises(ValueError, match=re.escape(f"backend={name!r} cannot run here: {reason}")):
        call(arrays, backend=name)
    assert_unchanged(arrays, before)


def test_errors_leave_jax_inputs_usable():
    """A rejected call with jax arrays neither deletes nor changes them (no donation on error)."""
    arrays = {k: jax.numpy.asarray(v) for k, v in valid_arrays().items()}
    before = {k: testing.bits(v).copy() for k, v in arrays.items()}
    with pytest.raises(ValueError, match="groups"):
        call(arrays, groups=5)
    for k, v in arrays.items():
        assert not v.is_deleted()
        np.testing.assert_array_equal(testing.bits(v), before[k], err_msg=k)


def test_torch_tensor_is_refused_with_the_conversion():
    torch = pytest.importorskip("torch")
    arrays = valid_arrays()
    arrays["mailbox"] = torch.zeros(arrays["mailbox"].shape, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"mailbox: .*got a torch.Tensor; convert it with jax.dlpack.from_dlpack"):
        oproj_jax.consumer(*arrays.values())


def test_torch_ref_without_torch_names_the_extra(monkeypatch):
    from oproj_jax import torch_ref

    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # `import torch` now fails
    with pytest.raises(ImportError, match=re.escape("pip install oproj-jax[test]")):
        torch_ref.consumer(*valid_arrays().values())


@pytest.mark.parametrize(
    ("name", "value", "error", "text"),
    [
        ("mailbox", np.zeros((R, T, H), np.float32), TypeError, "mailbox: expected a bfloat16 torch.Tensor"),
        ("blocks", np.zeros((T, 9, H), bf16), ValueError, "blocks: expected shape [T, NB, H]"),
    ],
    ids=["dtype", "blocks-NB9"],
)
def test_torch_ref_bad_argument_is_named(name, value, error, text):
    torch = pytest.importorskip("torch", reason="pip install oproj-jax[test]")
    from oproj_jax import torch_ref

    tensors = {k: torch_ref.from_numpy(v) for k, v in valid_arrays().items()}
    tensors[name] = torch.from_numpy(value) if value.dtype == np.float32 else torch_ref.from_numpy(value)
    with pytest.raises(error, match=re.escape(text)):
        torch_ref.consumer(*tensors.values())


# ---- a traced value for a static option


@pytest.mark.parametrize(
    ("name", "value", "kind"),
    [("groups", 2, "int"), ("xmoe_replicas", 1, "int"), ("has_delta", True, "bool"), ("eps", 1e-6, "float")],
)
def test_traced_option_says_to_mark_it_static(name, value, kind):
    """An option passed through jax.jit as an argument arrives traced: the error says the option
    is static and how to keep it so (static_argnames, or functools.partial)."""
    arrays = valid_arrays()

    def step(option, *arrays):
        return oproj_jax.consumer(*arrays, backend="reference", **{name: option})

    with pytest.raises(TypeError) as info:
        jax.jit(step)(value, *arrays.values())
    message = str(info.value)
    assert message.startswith(f"{name}: expected a Python {kind}, got a traced value"), message
    assert f"mark it static: jax.jit(f, static_argnames=({name!r},))" in message.lower()
    assert f"functools.partial(f, {name}=...)" in message
    # the way the message names works
    fixed = jax.jit(step, static_argnums=0)(value, *arrays.values())
    assert fixed.output.shape == (T, H)


# ---- the FFI library: where it is looked for, and the fix


def test_missing_ffi_library_names_the_variable_and_the_fix(monkeypatch, tmp_path):
    from oproj_jax import ffi

    monkeypatch.setattr(ffi, "_library", None)
    monkeypatch.setenv("OPROJ_JAX_FFI_LIBRARY", str(tmp_path / "none.so"))
    for message in (ffi.unavailable_reason(), _raised(ffi.load_library)):
        assert "not built" in message and str(tmp_path / "none.so") in message
        assert "$OPROJ_JAX_FFI_LIBRARY names" in message and "set $OPROJ_JAX_FFI_LIBRARY to a built" in message
        assert "`python -m oproj_jax.build --ffi-only`" in message and "pip install '.[cuda]'" in message
    monkeypatch.delenv("OPROJ_JAX_FFI_LIBRARY")
    monkeypatch.setattr(ffi, "DEFAULT_LIBRARY", tmp_path / "default.so")
    reason = ffi.unavailable_reason()
    assert f"the default {tmp_path / 'default.so'} ($OPROJ_JAX_FFI_LIBRARY unset)" in reason
    # a file that is no library: the loader's error, where it came from, the fix
    (tmp_path / "broken.so").write_bytes(b"not an ELF file")
    monkeypatch.setenv("OPROJ_JAX_FFI_LIBRARY", str(tmp_path / "broken.so"))
    message = _raised(ffi.load_library)
    assert f"the FFI library {tmp_path / 'broken.so'} does not load" in message
    assert "OPROJ_JAX_FFI_LIBRARY" in message and "python -m oproj_jax.build --ffi-only" in message
    assert ffi._library is None


def _raised(fn) -> str:
    with pytest.raises(RuntimeError) as info:
        fn()
    return str(info.value)


# ---- each backend's limits, up front, naming a backend that takes the shape

DIMS_7168 = dict(R=16, T=1, NB=8, H=7168)


@pytest.mark.parametrize(
    ("name", "dims", "texts"),
    [
        ("cute", dict(DIMS_7168, R=17), ["R=17", "at most 16 mailbox slots", "backend='pallas'", "'reference'"]),
        ("cute", dict(DIMS_7168, H=7424), ["H = 7168 only", "backend='pallas'", "'triton'", "'reference'"]),
        ("cute", dict(DIMS_7168, T=70000), ["T = 70000", "65535", "backend='pallas'"]),
        ("triton", dict(DIMS_7168, R=65), ["R <= 64, got R=65", "backend='pallas'", "'reference' takes any R"]),
        ("pallas", dict(DIMS_7168, H=1000), ["H % 256 == 0", "backend='triton'", "'reference'"]),
        ("pallas", dict(DIMS_7168, H=16384), ["H=16384", "288 KiB", "227 KiB", "backend='triton'", "'reference'"]),
    ],
    ids=["cute-R17", "cute-H", "cute-T", "triton-R65", "pallas-H1000", "pallas-H16384"],
)
def test_backend_limit_names_the_limit_and_who_takes_it(name, dims, texts):
    module = kernel_module(name)
    options = {k: v for k, v in VALID_OPTIONS.items() if k != "backend"}
    reason = module.unsupported_reason(contract.Dims(**dims), **options)
    assert reason, f"{name} takes {dims}"
    missing = [t for t in texts if t not in reason]
    assert not missing, f"{missing} not in {reason!r}"


@pytest.mark.parametrize("R", [16, 24, 32, 64, 100])
def test_pallas_takes_any_rank_count(R):
    """The Pallas kernel has no bound on R: where a cluster's resident rows would need more than
    Mosaic GPU's 32 barriers in a group (R + has_delta + NB > 32), one CTA per token with a ring
    of slots takes the shape (tests/test_pallas_limits.py lowers it)."""
    from oproj_jax.pallas import consumer as pallas_consumer

    options = {k: v for k, v in VALID_OPTIONS.items() if k != "backend"}
    assert pallas_consumer.unsupported_reason(contract.Dims(R, 1, 8, 7168), **options) is None
    split = pallas_consumer.choose_split(1, 7168, interpret=False, R=R, NB=8)["split"]
    assert split == (7 if R + 1 + 8 <= pallas_consumer.MAX_BARRIERS else 1)
