"""backend="cute" without a GPU: the FFI library builds, calls lower to our custom_call for CUDA,
and the backend says clearly why it cannot run here.

The lowering tests use a fake manifest (any bytes as "cubin", sealed with their sha256 and the
installed sources' fingerprint): lowering only hashes the cubin and passes the manifest entry's
path, entry name, shared memory and block size.

Each path's launch is checked parameter by parameter: the kernel parameters of cute/ABI.md in
order, with their values (docs/launch.md has the table, and the lists the launcher it replaced
computed in C++).
"""

import ctypes
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oproj_jax
from oproj_jax import configs, reference
from conftest import inplace_pairs, launch_attributes
from oproj_jax import ffi, launch
from oproj_jax.contract import Dims
from oproj_jax.cute import backend, cache
from oproj_jax.cute import manifest as cute_manifest
from oproj_jax.launch import NULL, Arg, Kind

H = configs.HIDDEN
ONESHOT_KEY = dict(R=2, NB=1, has_delta=True, groups=2, xmoe_replicas=1, twoshot=False)
TWOSHOT_KEY = dict(R=2, NB=0, has_delta=False, groups=1, xmoe_replicas=0, twoshot=True)
EMPTY_KEY = dict(R=2, NB=0, has_delta=False, groups=1, xmoe_replicas=0, twoshot=False)  # no blocks, no xmoe
OWN_KEY = dict(ONESHOT_KEY, own=True)  # ONESHOT_KEY's own-partial variant
KEYS = (ONESHOT_KEY, TWOSHOT_KEY, EMPTY_KEY, OWN_KEY)
B = launch.buffer


def f32(x):
    return Arg(Kind.F32, int(np.float32(x).view(np.uint32)))


def u32(x):
    return Arg(Kind.U32, x & 0xFFFFFFFF)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """The library, built with g++ into a temporary directory (takes ~20 s)."""
    return ffi.build_library(tmp_path_factory.mktemp("lib"))


@pytest.fixture
def fake_cubins(tmp_path, monkeypatch, library):
    kernels = []  # first the grouped build's entries, as an older manifest lists them: never launched
    for i, key in enumerate(KEYS):
        (tmp_path / f"variant{i}.cubin").write_bytes(b"not a cubin: lowering never opens it")
        kernels.append(
            dict(
                key=key,
                cubin=f"variant{i}.cubin",
                entry=f"kernel_entry_{i}",
                dynamic_smem_bytes=40000 + i,
                block=[128 * key["groups"], 1, 1],
                cluster=[7, 1, 1],
                params=[".u64"] * 17,  # as many as abi.CONSUMER_ONESHOT and CONSUMER_TWOSHOT
            )
        )
    # the folded builds (128 threads): the one build every call launches (manifest.FOLDED)
    for i in range(len(KEYS)):
        (tmp_path / f"variant{i}f.cubin").write_bytes(b"not a cubin either")
        kernels.append(
            dict(
                kernels[i],
                fold=True,
                cubin=f"variant{i}f.cubin",
                entry=f"kernel_entry_{i}f",
                dynamic_smem_bytes=30000 + i,
                block=[128, 1, 1],
            )
        )
    manifest = cute_manifest.seal(dict(arch="sm_90a", cutlass_dsl="4.8.1", H=H, kernels=kernels), tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setenv("OPROJ_JAX_CUBIN_DIR", str(tmp_path))
    monkeypatch.setenv("OPROJ_JAX_FFI_LIBRARY", str(library))
    monkeypatch.setenv(cache.ENV_NO_COMPILE, "1")  # prebuilt cubins only
    return tmp_path


def spec(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.bfloat16)


def lower_for_cuda(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def custom_calls(text: str, target: str) -> list[str]:
    return [line for line in text.splitlines() if f"stablehlo.custom_call @{target}(" in line]


def test_library_builds_and_exports_the_handlers(library):
    lib = ctypes.CDLL(str(library))
    assert getattr(lib, ffi.BOOTSTRAP_SYMBOL)
    for stages in ffi.SYMBOLS.values():
        for symbol in stages:
            if symbol is not None:
                assert getattr(lib, symbol)  # AttributeError if not exported


def test_stage_table():
    """What the bootstrap call registers: the five stages of every target (instantiate, prepare,
    initialize, execute, record), each target command-buffer compatible (graph-safe)."""
    symbols, traits = ffi._stage_table()
    assert len(symbols) == 5 * len(ffi.SYMBOLS) and traits == [1] * len(ffi.SYMBOLS)
    for i, stages in enumerate(ffi.SYMBOLS.values()):
        expected = [stages.instantiate, None, stages.initialize, stages.execute, stages.record]
        assert symbols[5 * i : 5 * i + 5] == expected


def test_every_target_has_a_record_stage_but_those_of_many_tokens():
    """Inside XLA command buffers a target without a record stage is re-traced by stream capture
    whenever its buffers move: the per-call host cost the record stage exists to remove. The
    exception is the launch target for many tokens, traced on purpose (ffi.LAUNCH_TRACED_TARGET):
    its initialize stage loads the module outside the capture, and only it has one (XLA would run
    it at every execution of a record-stage target)."""
    traced = (ffi.LAUNCH_TRACED_TARGET,)
    for name, stages in ffi.SYMBOLS.items():
        assert (stages.record is None) == (name in traced), name
        assert (stages.initialize is not None) == (name in traced), name


def test_one_generic_launch_target_and_its_traced_twin():
    """The library's targets: the generic launch (the same handlers twice, with and without the
    record stage) and the peer transport; no target per kernel or mode."""
    assert set(ffi.SYMBOLS) == {ffi.LAUNCH_TARGET, ffi.LAUNCH_TRACED_TARGET, ffi.PEER_TARGET}
    launch_stages, traced_stages = ffi.SYMBOLS[ffi.LAUNCH_TARGET], ffi.SYMBOLS[ffi.LAUNCH_TRACED_TARGET]
    assert launch_stages.execute == traced_stages.execute and traced_stages.record is None


def _launch(text: str, traced: bool = False) -> tuple[str, dict]:
    """The one launch call of `text` (its line) and its launch attributes."""
    (call,) = custom_calls(text, ffi.LAUNCH_TRACED_TARGET if traced else ffi.LAUNCH_TARGET)
    assert not custom_calls(text, ffi.LAUNCH_TARGET if traced else ffi.LAUNCH_TRACED_TARGET)
    return call, launch_attributes(call)


def _consumer_shape(attrs, fake_cubins, variant: int, T: int):
    """The consumer cubin's launch: the folded build of the fake manifest, grid (7, T, 1), one
    cluster of 7 CTAs per token, 128 threads, its shared memory, PDL."""
    assert attrs["cubin"] == str(fake_cubins / f"variant{variant}f.cubin")
    assert attrs["entry"] == f"kernel_entry_{variant}f" and attrs["smem"] == 30000 + variant
    assert attrs["grid"] == (7, T, 1) and attrs["cluster"] == (7, 1, 1) and attrs["block"] == (128, 1, 1)
    assert attrs["pdl"] is True


def test_oneshot_lowers_to_our_custom_call(fake_cubins):
    """The protocol (consume): operands mailbox 0, prefix 1, blocks 2, norm 3, query 4, out_norm
    5, hints 6, status 7; results mailbox 8, prefix 9, output 10, xmoe 11, hints 12, status 13.
    The kernel gets the results of the in-place operands, eps, out_eps, T, timeout_us and a null
    control."""
    fn = functools.partial(
        backend.consume, eps=1e-6, out_eps=1e-5, has_delta=True, groups=2, xmoe_replicas=1, timeout_us=77
    )
    text = lower_for_cuda(fn, spec(2, 3, H), spec(3, H), spec(3, 1, H), spec(H), spec(H), spec(H))
    call, attrs = _launch(text)
    _consumer_shape(attrs, fake_cubins, 0, 3)
    assert attrs["params"] == [
        *(B(8), B(9), B(2), B(3), B(4), B(5), B(10), B(11), B(12), B(13)),
        *(f32(1e-6), f32(1e-5), u32(3), u32(77), NULL, NULL, u32(0)),
    ]
    # mailbox, prefix, hints, status are updated in place: operand -> result aliases, read in place
    aliases = set(re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", call))
    assert aliases == {("0", "0"), ("1", "1"), ("4", "6"), ("5", "7")}
    assert inplace_pairs(call) == [(0, 0), (1, 1), (6, 4), (7, 5)]
    assert (
        "(tensor<2x3x7168xbf16>, tensor<3x7168xbf16>, tensor<3x7168xbf16>, tensor<1x3x7168xbf16>, "
        "tensor<1xui32>, tensor<1xi32>)" in call
    )  # results: mailbox, prefix, output, xmoe, hints, status
    assert "compare  EQ" in text or "compare EQ" in text, "the mailbox is sanitized (-0.0 -> +0.0) first"


def test_oneshot_without_blocks_or_xmoe_passes_valid_pointers(fake_cubins):
    """NB = 0 and reps = 0: the kernel reads neither blocks nor xmoe but wants valid pointers
    (cute/ABI.md): prefix's and output's."""
    fn = functools.partial(backend.consume, has_delta=False, groups=1, xmoe_replicas=0, timeout_us=5)
    text = lower_for_cuda(fn, spec(2, 4, H), spec(4, H), spec(4, 0, H), spec(H), spec(H), spec(H))
    _, attrs = _launch(text)
    _consumer_shape(attrs, fake_cubins, 2, 4)
    eps = f32(backend.DEFAULTS.eps)
    assert attrs["params"] == [
        *(B(8), B(9), B(9), B(3), B(4), B(5), B(10), B(10), B(12), B(13)),
        *(eps, f32(backend.DEFAULTS.out_eps), u32(4), u32(5), NULL, NULL, u32(0)),
    ]


def test_every_wait_is_bounded_in_wall_time(fake_cubins):
    """timeout_us is microseconds of the GPU's clock, an int in [1, 2**31): no "wait forever"."""
    fn = functools.partial(backend.consume, eps=1e-6, out_eps=1e-6, has_delta=True, groups=2, xmoe_replicas=0)
    args = (spec(2, 3, H), spec(3, H), spec(3, 1, H), spec(H), spec(H), spec(H))
    for bad in (0, -1, 2**31):
        with pytest.raises(ValueError, match="timeout_us: expected 1 <= timeout_us < 2[*][*]31 microseconds"):
            lower_for_cuda(functools.partial(fn, timeout_us=bad), *args)
    with pytest.raises(TypeError, match="timeout_us: expected an int"):
        lower_for_cuda(functools.partial(fn, timeout_us=True), *args)


def test_published_mailbox_goes_straight_to_the_kernel(fake_cubins):
    fn = functools.partial(
        backend.consume, eps=1e-6, out_eps=1e-6, has_delta=True, groups=2, xmoe_replicas=1, published=True
    )
    text = lower_for_cuda(fn, spec(2, 3, H), spec(3, H), spec(3, 1, H), spec(H), spec(H), spec(H))
    call, attrs = _launch(text)
    assert "compare" not in text and "select" not in text
    assert f"custom_call @{ffi.LAUNCH_TARGET}(%arg0," in call  # the caller's buffer itself
    assert attrs["params"][13] == u32(backend.DEFAULT_TIMEOUT_US)


def test_registry_consumer_uses_the_ready_kernel(fake_cubins):
    """The registry path reads an XLA-made mailbox once: timeout_us < 0, the mailbox neither
    sanitized nor aliased (so XLA never copies it), only the prefix updated in place. Operands
    mailbox 0 .. out_norm 5; results prefix 6, output 7, xmoe 8, scratch 9 ([2] u32): the kernel
    reads the mailbox operand itself, hints and status are the scratch's two words."""
    fn = functools.partial(backend.consumer, eps=1e-6, out_eps=1e-6, has_delta=True, groups=2, xmoe_replicas=1)
    text = lower_for_cuda(fn, spec(2, 3, H), spec(3, H), spec(3, 1, H), spec(H), spec(H), spec(H))
    call, attrs = _launch(text)
    _consumer_shape(attrs, fake_cubins, 0, 3)
    assert attrs["params"] == [
        *(B(0), B(6), B(2), B(3), B(4), B(5), B(7), B(8), B(9, 0), B(9, 4)),
        *(f32(1e-6), f32(1e-6), u32(3), u32(-1), NULL, NULL, u32(0)),
    ]
    assert f"custom_call @{ffi.LAUNCH_TARGET}(%arg0," in call  # the caller's mailbox itself
    assert "compare" not in text and "select" not in text
    aliases = set(re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", call))
    assert aliases == {("0", "1")} and inplace_pairs(call) == [(1, 0)]
    assert call.rstrip().endswith("tensor<2xui32>)")


def test_registry_consumer_reads_the_own_partial_in_place(fake_cubins):
    """partial= is a seventh operand the key's own variant reads in place of slot `rank` (own,
    own_slot): no update of the mailbox in the program, the results after it (prefix 7, output
    8, xmoe 9, scratch 10), the prefix still the only in-place operand."""
    fn = functools.partial(backend.consumer, eps=1e-6, out_eps=1e-6, has_delta=True, groups=2, xmoe_replicas=1)
    text = lower_for_cuda(
        lambda m, p, b, n, q, o, own: fn(m, p, b, n, q, o, partial=own, rank=1),
        *(spec(2, 3, H), spec(3, H), spec(3, 1, H), spec(H), spec(H), spec(H), spec(3, H)),
    )
    call, attrs = _launch(text)
    _consumer_shape(attrs, fake_cubins, 3, 3)
    assert attrs["params"] == [
        *(B(0), B(7), B(2), B(3), B(4), B(5), B(8), B(9), B(10, 0), B(10, 4)),
        *(f32(1e-6), f32(1e-6), u32(3), u32(-1), NULL, B(6), u32(1)),
    ]
    assert "dynamic_update_slice" not in text and "scatter" not in text
    assert inplace_pairs(call) == [(1, 0)]


def test_registry_consumer_copies_a_partial_no_own_variant_reads(fake_cubins):
    """EMPTY_KEY has no own variant (and none compiles here): the partial is written into a copy
    of the mailbox (slot `rank`), and the plain variant launched on it."""
    fn = functools.partial(backend.consumer, has_delta=False, groups=1, xmoe_replicas=0)
    dims = Dims(2, 2, 0, H)
    assert not backend.partial_in_place(dims, has_delta=False, groups=1, xmoe_replicas=0)
    assert backend.partial_in_place(Dims(2, 3, 1, H), has_delta=True, groups=2, xmoe_replicas=1)
    text = lower_for_cuda(
        lambda m, p, b, n, q, o, own: fn(m, p, b, n, q, o, partial=own, rank=1),
        *(spec(2, 2, H), spec(2, H), spec(2, 0, H), spec(H), spec(H), spec(H), spec(2, H)),
    )
    _, attrs = _launch(text)
    _consumer_shape(attrs, fake_cubins, 2, 2)
    assert attrs["params"][14:] == [NULL, NULL, u32(0)]
    assert "dynamic_update_slice" in text


def test_registry_consumer_without_blocks_or_xmoe(fake_cubins):
    fn = functools.partial(backend.consumer, has_delta=False, groups=1, xmoe_replicas=0)
    text = lower_for_cuda(fn, spec(2, 2, H), spec(2, H), spec(2, 0, H), spec(H), spec(H), spec(H))
    _, attrs = _launch(text)
    _consumer_shape(attrs, fake_cubins, 2, 2)
    assert attrs["params"][:10] == [B(0), B(6), B(6), B(3), B(4), B(5), B(7), B(7), B(9, 0), B(9, 4)]


def test_many_tokens_use_the_traced_ready_target(fake_cubins):
    """Above backend.RECORD_MAX_T tokens the ready call names the target without a record stage,
    with the same launch."""
    fn = functools.partial(backend.consumer, eps=1e-6, out_eps=1e-6, has_delta=True, groups=2, xmoe_replicas=1)
    T = backend.RECORD_MAX_T + 1
    text = lower_for_cuda(fn, spec(2, T, H), spec(T, H), spec(T, 1, H), spec(H), spec(H), spec(H))
    _, attrs = _launch(text, traced=True)
    _consumer_shape(attrs, fake_cubins, 0, T)
    assert attrs["params"][12:14] == [u32(T), u32(-1)]
    T = backend.RECORD_MAX_T
    text = lower_for_cuda(fn, spec(2, T, H), spec(T, H), spec(T, 1, H), spec(H), spec(H), spec(H))
    _launch(text, traced=False)


def test_vmap_of_the_registry_consumer_calls_the_kernel_per_element(fake_cubins):
    """jax.vmap over a batch of 2 mailboxes (and prefixes): the ready target runs once per
    element (vmap_method="sequential": a loop around the one custom call), not an error."""
    fn = functools.partial(backend.consumer, eps=1e-6, out_eps=1e-6, has_delta=True, groups=2, xmoe_replicas=1)
    batched = jax.vmap(fn, in_axes=(0, 0, None, None, None, None))
    text = lower_for_cuda(batched, spec(2, 2, 3, H), spec(2, 3, H), spec(3, 1, H), spec(H), spec(H), spec(H))
    assert len(custom_calls(text, ffi.LAUNCH_TARGET)) == 1 and "stablehlo.while" in text


def test_twoshot_lowers_to_our_custom_call(fake_cubins):
    """Twoshot: operands gather 0, prefix 1, blocks 2, norm 3, query 4, out_norm 5, hints 6,
    status 7, recv 8; results gather 9, prefix 10, output 11, xmoe 12, hints 13, status 14, recv
    15. NB = 0, reps = 0 here: blocks and xmoe take prefix's and output's pointers. recv and the
    gather target (the gather row itself, on one GPU), then me."""
    fn = functools.partial(backend.consume_twoshot, me=1, has_delta=False, groups=1, xmoe_replicas=0)
    text = lower_for_cuda(fn, spec(2, 5, H // 2), spec(1, 5, H), spec(5, H), spec(5, 0, H), spec(H), spec(H), spec(H))
    call, attrs = _launch(text)
    _consumer_shape(attrs, fake_cubins, 1, 5)
    eps, out_eps = f32(backend.DEFAULTS.eps), f32(backend.DEFAULTS.out_eps)
    assert attrs["params"] == [
        *(B(9), B(10), B(10), B(3), B(4), B(5), B(11), B(11), B(13), B(14)),
        *(eps, out_eps, u32(5), u32(backend.DEFAULT_TIMEOUT_US)),
        *(B(15), B(9), u32(1)),
    ]
    aliases = set(re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", call))
    assert aliases == {("0", "0"), ("1", "1"), ("4", "6"), ("5", "7"), ("6", "8")}
    assert inplace_pairs(call) == [(0, 0), (1, 1), (6, 4), (7, 5), (8, 6)]


def test_twoshot_rejects_bad_rank_and_recv(fake_cubins):
    args = [jnp.zeros(s, jnp.bfloat16) for s in ((2, 5, H // 2), (1, 5, H), (5, H), (5, 0, H), (H,), (H,), (H,))]
    with pytest.raises(ValueError, match="me: expected"):
        backend.consume_twoshot(*args, me=2, has_delta=False)
    with pytest.raises(ValueError, match="recv: expected shape"):
        backend.consume_twoshot(jnp.zeros((2, 5, 100), jnp.bfloat16), *args[1:], me=0, has_delta=False)


def test_sanitizing_removes_every_sentinel_word():
    """XLA data may hold (+0.0, -0.0) pairs: the 32-bit word the kernel reads as 'empty'."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 16, size=(4, 3, 512), dtype=np.uint16)
    bits[..., 0::2][rng.random((4, 3, 256)) < 0.3] = 0x0000
    bits[..., 1::2][rng.random((4, 3, 256)) < 0.3] = 0x8000
    words = bits.view(np.uint32)
    assert (words == 0x80000000).sum() > 50
    x = jnp.asarray(bits).view(jnp.bfloat16)
    clean = np.asarray(jax.jit(reference.without_negative_zero)(x)).view(np.uint16)
    assert not (clean.view(np.uint32) == 0x80000000).any()
    changed = bits != clean
    assert (bits[changed] == 0x8000).all() and (clean[changed] == 0).all()  # only -0.0 -> +0.0


def test_unavailable_reasons(monkeypatch, tmp_path):
    assert "CUDA" in backend.unavailable_reason("cpu") and "'cpu'" in backend.unavailable_reason("cpu")
    monkeypatch.setattr(backend, "_is_cuda", lambda platform: True)  # pretend: what else is checked
    monkeypatch.setenv("OPROJ_JAX_FFI_LIBRARY", str(tmp_path / "missing.so"))
    reason = backend.unavailable_reason("gpu")
    assert "not built" in reason and ffi.BUILD_COMMAND in reason
    (tmp_path / "missing.so").write_bytes(b"")
    monkeypatch.setenv("OPROJ_JAX_CUBIN_DIR", str(tmp_path / "no_cubins"))
    monkeypatch.setattr(cache, "_dsl_installed", lambda: False)
    reason = backend.unavailable_reason("gpu")
    assert "manifest" in reason and "python -m oproj_jax.build" in reason
    assert "installing the `cute` extra (pip install 'oproj-jax[cute]') enables compile-on-first-use" in reason
    monkeypatch.setattr(cache, "_dsl_installed", lambda: True)  # every variant compiles on first use
    assert backend.unavailable_reason("gpu") is None
    monkeypatch.setenv(cache.ENV_NO_COMPILE, "1")
    assert "compile-on-first-use is off" in backend.unavailable_reason("gpu")


def test_unsupported_reasons(fake_cubins):
    assert backend.unsupported_reason(
        Dims(2, 3, 1, 4096), **{k: ONESHOT_KEY[k] for k in ("has_delta", "groups", "xmoe_replicas")}
    ).startswith("the CuTe cubins are built for H = 7168")
    assert backend.unsupported_reason(Dims(2, 3, 1, H), has_delta=True, groups=2, xmoe_replicas=1) is None
    reason = backend.unsupported_reason(Dims(16, 3, 8, H), has_delta=True, groups=4, xmoe_replicas=0)
    assert "R=16 NB=8 has_delta=True groups=4 xmoe_replicas=0 twoshot=False" in reason
    assert "python -m oproj_jax.cute.build --key 16,8,1,4,0,0`" in reason
    assert "compile-on-first-use is off" in reason
    # an equivalent `groups` (the same summation order at R = 2) finds the prebuilt cubin
    assert backend.unsupported_reason(Dims(2, 3, 1, H), has_delta=True, groups=4, xmoe_replicas=1) is None


def test_without_the_dsl_a_missing_variant_names_the_build_and_the_cute_extra(fake_cubins, monkeypatch):
    monkeypatch.delenv(cache.ENV_NO_COMPILE)
    monkeypatch.setattr(cache, "_dsl_installed", lambda: False)
    with pytest.raises(ValueError) as err:
        backend._kernel(backend.kernel_key(16, 8, has_delta=True, groups=4, xmoe_replicas=0, twoshot=False), 1, True)
    message = str(err.value)
    assert "R=16 NB=8 has_delta=True groups=4" in message and str(fake_cubins) in message
    assert "python -m oproj_jax.cute.build --key 16,8,1,4,0,0`" in message
    assert "installing the `cute` extra (pip install 'oproj-jax[cute]') enables compile-on-first-use" in message


def test_cute_on_cpu_raises_through_the_public_api():
    """Arrays placed on the CPU (explicitly: on a GPU machine JAX's default device is the GPU)."""
    x = configs.make_inputs(configs.Config(2, 1, 0, groups=1))
    cpu = jax.devices("cpu")[0]
    args = [jax.device_put(x[k], cpu) for k in ("mailbox", "prefix", "blocks", "norm", "query", "out_norm")]
    with pytest.raises(ValueError, match="backend='cute' cannot run here: the CuTe kernel runs on NVIDIA CUDA"):
        oproj_jax.consumer(*args, groups=1, backend="cute")
    with pytest.raises(ValueError, match="backend 'cute' cannot run here"):
        backend.consume(*args, groups=1, has_delta=True)
