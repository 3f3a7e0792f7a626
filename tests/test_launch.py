"""The launch description (oproj_jax/launch.py) and the checks made before a launch.

The FFI library knows no kernel (ffi/launch.h): Python names the cubin, the launch shape and the
typed parameter list, built by name from oproj_jax/abi.py. The lowering tests
(test_cute_lowering.py, test_peer_lowering.py, test_triton.py) hold each path's list to
cute/ABI.md; this file tests the encoding and, one test per check, that every operand a cubin
cannot take is refused in Python, since the launch target takes untyped buffers and knows
neither shapes nor variants (docs/launch.md, "Checks").
"""

import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from oproj_jax import abi, configs, contract
from oproj_jax.contract import Dims
from oproj_jax import launch
from oproj_jax.cute import backend, peer
from oproj_jax.launch import NULL, Arg, Kind

H = configs.HIDDEN
REPO = Path(__file__).resolve().parent.parent


# ---- the encoding ---------------------------------------------------------------------------------


def test_the_kinds_are_the_headers():
    """launch.Kind and ffi/launch.h's enum Kind name the same values."""
    header = (REPO / "ffi" / "launch.h").read_text()
    enum = re.search(r"enum Kind : int64_t \{(.*?)\};", header, re.S).group(1)
    cxx = {name: int(value) for name, value in re.findall(r"k(\w+) = (\d+)", enum)}
    upper = {re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).upper(): value for name, value in cxx.items()}
    assert upper == {k.name: int(k) for k in Kind}  # kPeerU32UnlessRank: PEER_U32_UNLESS_RANK


def _consumer_values(**overrides):
    b = launch.buffer
    values = dict(
        mailbox=b(0), prefix=b(1), blocks=b(2), norm=b(3), query=b(4), out_norm=b(5), output=b(6), xmoe=b(7),
        hints=b(8), status=b(9), eps=1e-6, out_eps=2e-6, T=3, timeout_us=-1, control=NULL, own=NULL, own_slot=0,
    )  # fmt: skip
    return {**values, **overrides}


def test_params_follow_the_abi_lists_by_name():
    """The order and the PTX types are abi.py's; values are given by name, in any order."""
    values = _consumer_values(own=launch.buffer(10), own_slot=2)
    shuffled = dict(reversed(list(values.items())))
    params = launch.params(abi.CONSUMER_ONESHOT, shuffled)
    assert [p.name for p in abi.CONSUMER_ONESHOT][:2] == ["mailbox", "prefix"]
    assert params[:10] == tuple(launch.buffer(i) for i in range(10))
    assert params[10] == Arg(Kind.F32, int(np.float32(1e-6).view(np.uint32)))
    assert params[11] == Arg(Kind.F32, int(np.float32(2e-6).view(np.uint32)))
    assert params[12:] == (Arg(Kind.U32, 3), Arg(Kind.U32, 0xFFFFFFFF), NULL, launch.buffer(10), Arg(Kind.U32, 2))
    twoshot = launch.params(
        abi.CONSUMER_TWOSHOT,
        {k: v for k, v in values.items() if k not in ("control", "own", "own_slot")}
        | dict(recv=launch.buffer(10), gather=NULL, me=1),
    )
    assert twoshot[14:] == (launch.buffer(10), NULL, Arg(Kind.U32, 1))


def test_params_refuse_what_the_list_does_not_say():
    with pytest.raises(ValueError, match=r"missing \['control'\], unknown \['nope'\]"):
        launch.params(abi.CONSUMER_ONESHOT, {k: v for k, v in _consumer_values(nope=1).items() if k != "control"})
    with pytest.raises(TypeError, match="mailbox is a pointer"):
        launch.params(abi.CONSUMER_ONESHOT, _consumer_values(mailbox=0))
    with pytest.raises(TypeError, match=r"eps is a \.f32 scalar"):
        launch.params(abi.CONSUMER_ONESHOT, _consumer_values(eps=launch.u32(1)))
    with pytest.raises(TypeError, match="T: expected an int|u32: expected an int"):
        launch.params(abi.CONSUMER_ONESHOT, _consumer_values(T=1.5))
    with pytest.raises(ValueError, match="does not fit 32 bits"):
        launch.params(abi.CONSUMER_ONESHOT, _consumer_values(T=2**32))


def test_scalars_are_raw_bits():
    assert launch.u32(-1) == Arg(Kind.U32, 0xFFFFFFFF) and launch.i32(-2) == Arg(Kind.I32, 0xFFFFFFFE)
    assert launch.f32(1.0) == Arg(Kind.F32, 0x3F800000)
    assert launch.u64(2**64 - 1) == Arg(Kind.U64, -1)  # one int64 word
    assert launch.scalar(".u64", 5) == Arg(Kind.U64, 5)
    with pytest.raises(TypeError):
        launch.u32(True)
    with pytest.raises(ValueError):
        launch.scalar(".b16", 1)


def test_encode_and_attributes():
    args = (launch.buffer(3, 8), NULL, launch.f32(0.5), launch.peer_slot(2), launch.peer_u32_unless_rank(4, None))
    words = launch.encode(args)
    assert words.dtype == np.int64 and list(words[:6]) == [1, 3, 8, 0, 0, 0]
    assert launch.decode(words) == list(args)
    spec = launch.Launch("/c.cubin", "e", (7, 2, 1), (128, 1, 1), (7, 1, 1), 100, True, args)
    attributes = spec.attributes("publish_")
    assert sorted(attributes) == sorted(
        f"publish_{n}" for n in ("cubin", "entry", "grid", "block", "cluster", "smem", "pdl", "params")
    )
    assert list(attributes["publish_grid"]) == [7, 2, 1] and attributes["publish_pdl"] is True
    assert list(launch.pairs([(1, 0), (6, 4)])) == [1, 0, 6, 4]


# ---- the checks before a launch (docs/launch.md, "Checks") ----------------------------------------

KERNEL = backend._Kernel("/k.cubin", "k", 1000, 128, (16, 8, 0))


def _launch(**overrides):
    options = dict(tokens=3, variant=(16, 8, 0), ready=True, twoshot=False, pdl=True)
    values = _consumer_values()
    for key, value in overrides.items():
        (options if key in options else values)[key] = value
    return backend.consumer_launch(KERNEL, **options, **values)


def test_consumer_launch_is_the_old_handler_launch():
    spec = _launch()
    assert (spec.grid, spec.block, spec.cluster, spec.smem, spec.pdl) == ((7, 3, 1), (128, 1, 1), (7, 1, 1), 1000, True)
    nothing = backend._Kernel("/k.cubin", "k", 1000, 128, (16, 0, 0))
    empty = backend.consumer_launch(
        nothing, tokens=3, variant=(16, 0, 0), ready=True, twoshot=False, pdl=True, **_consumer_values()
    )
    assert empty.params[2] == empty.params[1] and empty.params[7] == empty.params[6]  # OrValid


@pytest.mark.parametrize(
    "variant, message",
    [
        ((2, 8, 0), r"built for slots \(R\) = 16, the operands have 2"),
        ((16, 1, 0), r"built for completed blocks \(NB\) = 8, the operands have 1"),
        ((16, 8, 1), r"built for xmoe replicas = 0, the operands have 1"),
    ],
)
def test_operands_of_another_variant_are_refused(variant, message):
    """R, NB and reps are compiled into the cubin: operands of another variant are refused."""
    with pytest.raises(ValueError, match=message):
        _launch(variant=variant)


def test_more_tokens_than_the_slots_hold_are_refused():
    """The consumer's T is the slots' capacity: a launch of more tokens is refused (mode="peer":
    T <= max_tokens)."""
    with pytest.raises(ValueError, match=r"4 tokens, the slots hold T = 3"):
        _launch(tokens=4)
    _launch(tokens=2)  # fewer: mode="peer"'s grid of T rows in slots of max_tokens


def test_an_own_partial_needs_an_own_variant_in_ready_mode():
    """`own` is read only by the variants built for it (kernel.py, "Own partial"), and only in
    ready mode: any other pairing is refused before a launch."""
    own = backend._Kernel("/k.cubin", "k", 1000, 128, (16, 8, 0), own=True)
    options = dict(tokens=3, variant=(16, 8, 0), twoshot=False, pdl=True)
    spec = backend.consumer_launch(own, ready=True, **options, **_consumer_values(own=launch.buffer(10), own_slot=5))
    assert spec.params[-2:] == (launch.buffer(10), Arg(Kind.U32, 5))
    with pytest.raises(ValueError, match="is no own variant, the call passes an own partial"):
        _launch(own=launch.buffer(10))
    with pytest.raises(ValueError, match="is an own variant, the call passes no own partial"):
        backend.consumer_launch(own, ready=True, **options, **_consumer_values())
    with pytest.raises(ValueError, match="an own partial is read in ready mode only"):
        backend.consumer_launch(own, ready=False, **options, **_consumer_values(timeout_us=5, own=launch.buffer(10)))


def test_the_timeout_says_the_mode():
    """Ready mode is timeout_us < 0, the protocol (and mode="peer") needs timeout_us > 0."""
    with pytest.raises(ValueError, match="ready mode needs timeout_us < 0, got 5"):
        _launch(timeout_us=5)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="the protocol needs timeout_us > 0"):
            _launch(ready=False, timeout_us=bad)
    with pytest.raises(ValueError, match="timeout_us: expected 1 <= timeout_us"):
        peer.PeerOptions(timeout_us=0)


def _arrays(R=2, T=3, NB=1, Hd=H):
    z = lambda *shape: jnp.zeros(shape, jnp.bfloat16)
    return [z(R, T, Hd), z(T, Hd), z(T, NB, Hd), z(Hd), z(Hd), z(Hd)]


def test_the_hidden_size_and_token_limits():
    """The cubins take prefix [T, 7168] with 1 <= T <= 65535 (the grid's y)."""
    assert backend._launch_reason(Dims(2, 3, 1, 4096)).startswith("the CuTe cubins are built for H = 7168")
    assert "grid's y limit 65535" in backend._launch_reason(Dims(2, 65536, 1, H))
    with pytest.raises(ValueError, match="expected T >= 1"):
        contract.check_arguments(*_arrays(T=0))


@pytest.mark.parametrize(
    "index, shape, message",
    [
        (1, (4, H), r"prefix: expected shape \[T, H\]"),  # the mailbox's T, H
        (2, (3, 1, 64), r"blocks: expected shape \[T, NB, H\]"),
        (3, (64,), r"norm: expected shape \[H\]"),
        (4, (64,), r"query: expected shape \[H\]"),
        (5, (64,), r"out_norm: expected shape \[H\]"),
    ],
)
def test_operand_shapes(index, shape, message):
    """Every operand's shape follows the mailbox's T and H: contract.check_arguments."""
    arrays = _arrays()
    arrays[index] = jnp.zeros(shape, jnp.bfloat16)
    with pytest.raises(ValueError, match=message):
        contract.check_arguments(*arrays)


def test_operand_dtypes():
    """bf16 operands, u32 hints, i32 status, bf16 recv: the launch target takes untyped buffers."""
    arrays = _arrays()
    arrays[0] = arrays[0].astype(jnp.float32)
    with pytest.raises(TypeError, match="mailbox: expected dtype bfloat16"):
        contract.check_arguments(*arrays)
    with pytest.raises(TypeError, match=r"hints: expected a \[1\] uint32 array"):
        backend._flags(jnp.zeros((1,), jnp.int32), None)
    with pytest.raises(TypeError, match=r"status: expected a \[1\] int32 array"):
        backend._flags(None, jnp.zeros((2,), jnp.int32))
    with pytest.raises(TypeError, match="recv: expected a bf16 array"):
        backend._twoshot_dims(jnp.zeros((2, 3, H // 2), jnp.float32), 0, _arrays(R=1)[0], Dims(1, 3, 1, H))


def test_twoshot_shapes():
    """Twoshot: gather [1, T, H], recv [R, T, H/R], 0 <= me < R."""
    gather, dims = _arrays(R=1)[0], Dims(1, 3, 1, H)
    recv = jnp.zeros((2, 3, H // 2), jnp.bfloat16)
    assert backend._twoshot_dims(recv, 1, gather, dims) == Dims(2, 3, 1, H)
    with pytest.raises(ValueError, match=r"gather: expected the one-slot gather row"):
        backend._twoshot_dims(recv, 0, _arrays(R=2)[0], Dims(2, 3, 1, H))
    with pytest.raises(ValueError, match=r"recv: expected shape \[R, T, H/R\]"):
        backend._twoshot_dims(jnp.zeros((2, 4, H // 2), jnp.bfloat16), 0, gather, dims)
    with pytest.raises(ValueError, match="me: expected a static int with 0 <= me < R = 2"):
        backend._twoshot_dims(recv, 2, gather, dims)


def test_peer_partial_tokens_and_ranks():
    """mode="peer": partial [T, H] of prefix, T <= max_tokens, R <= 16 (the publish kernel's
    destinations), max_tokens <= 65535; the transport itself only needs R, max_tokens >= 1."""
    partial, prefix, blocks, norm, query, out_norm = [a[0] if i == 0 else a for i, a in enumerate(_arrays())]
    with pytest.raises(ValueError, match=r"partial: expected shape \[T, H\]"):
        peer.consume(partial[:2], prefix, blocks, norm, query, out_norm, table=((0, 1),))
    with pytest.raises(ValueError, match="max_tokens: T = 3 tokens exceeds the mailboxes' max_tokens = 2"):
        peer.consume(
            partial, prefix, blocks, norm, query, out_norm, table=((0, 1),), options=peer.PeerOptions(max_tokens=2)
        )
    assert "up to 16 ranks" in peer.unsupported_reason(Dims(17, 1, 8, H))
    assert "R=17: the CuTe kernel sums at most 16" in backend._launch_reason(Dims(17, 1, 8, H))
    for bad in (0, 65536):
        with pytest.raises(ValueError, match="max_tokens: expected an int in 1..65535"):
            peer.PeerOptions(max_tokens=bad)


def test_triton_programs_are_whole_warps():
    """A Triton program is whole warps, 32..1024 threads (launch.cc checks 1..1024 threads)."""
    from oproj_jax.triton import library

    library.check_block("k", 256)
    for bad in (16, 100, 2048):
        with pytest.raises(ValueError, match="whole warps"):
            library.check_block("k", bad)
