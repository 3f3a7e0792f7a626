"""mode="peer" without a GPU: the jitted shard_map lowers (for CUDA) to our one custom call per
rank and no XLA collective, the library exports the handler and the reset, and every way of
asking for it where it cannot run raises a clear error.

The lowering uses a CPU mesh lowered for CUDA (lowering_platforms=("cuda",)) and a fake
manifest (lowering never opens a cubin). What only the GPU run covers (tests/test_peer_gpu.py):
executing the call (allocation, peer writes, polling, the timeout) and the bits it produces.

The call's two launches are checked parameter by parameter (docs/launch.md has the table).
"""

import ctypes
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from conftest import inplace_pairs, launch_attributes
from oproj_jax import abi, configs, sharded
from oproj_jax import ffi, launch
from oproj_jax.cute import backend, cache, peer
from oproj_jax.cute import manifest as cute_manifest
from oproj_jax.launch import NULL, Arg, Kind

H = configs.HIDDEN
COLLECTIVES = ("all_gather", "all_reduce", "all_to_all", "reduce_scatter", "collective_permute", "psum")
B = launch.buffer


def f32(x):
    return Arg(Kind.F32, int(np.float32(x).view(np.uint32)))


def u32(x):
    return Arg(Kind.U32, x & 0xFFFFFFFF)


def expected_launches(R, T, NB, reps, *, timeout_us, skip=-1, max_tokens=peer.DEFAULT_MAX_TOKENS, eps=None):
    """The parameters of the publish and the consumer launch: operands partial 0, prefix 1,
    blocks 2, norm 3, query 4, out_norm 5; results prefix 6, output 7, xmoe 8, flags 9 ([3] i32:
    status, hints, publish status)."""
    eps = backend.DEFAULTS.eps if eps is None else eps
    publish = [
        B(0),  # src: the partial
        *(launch.peer_slot(r) for r in range(16)),  # dests: slot `me` of every rank's mailbox (0 past R)
        Arg(Kind.PEER_U32_UNLESS_RANK, R, skip),  # n_dest: R, 0 on the skipped rank
        B(9),  # flags
        u32(T * H // 8),  # fragments: 16 bytes each
        u32(timeout_us),
        launch.peer_control(),
    ]
    consumer = [
        launch.peer_mailbox(),  # this rank's mailbox
        B(6),  # prefix (the result, in place)
        B(2) if NB else B(6),  # blocks, or a valid pointer
        *(B(3), B(4), B(5), B(7)),
        B(8) if reps else B(7),  # xmoe, or a valid pointer
        B(9, 4),  # hints: flags[1]
        B(9, 0),  # status: flags[0]
        f32(eps),
        f32(backend.DEFAULTS.out_eps),
        u32(max_tokens),  # T: the slots' capacity; the grid has the call's tokens
        u32(timeout_us),
        launch.peer_control(),
        NULL,  # own: the partial reaches this rank's slot through the publish
        u32(0),
    ]
    return publish, consumer


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """The library, built with g++ into a temporary directory (~20 s)."""
    return ffi.build_library(tmp_path_factory.mktemp("peer_lib"))


def _entry(R, NB, has_delta, groups, reps):
    key = cute_manifest.make_key(R, NB, has_delta, groups, reps, False)
    tag = f"R{R}_NB{NB}_{int(has_delta)}_G{groups}_x{reps}"
    return dict(
        key=key,
        min_ctas=0,
        fold=True,
        cubin=f"{tag}.cubin",
        entry=f"entry_{tag}",
        dynamic_smem_bytes=20000 + groups,
        block=[128, 1, 1],
        cluster=[7, 1, 1],
        params=abi.ptx(abi.CONSUMER_ONESHOT),
    )


@pytest.fixture
def gpu_mesh_here(tmp_path, monkeypatch, library):
    """A fake manifest (R = 2, 4, 8 and 16, folded builds, and the publish kernel), the library,
    and the CPU platform taken for CUDA: what mode="peer" checks before it lowers."""
    kernels = [
        _entry(R, NB, d, g, x)
        for R in (2, 4, 8, 16)
        for NB, d in ((0, False), (8, True))
        for g in sorted({cute_manifest.effective_groups(R, g) for g in (1, 2, 4)})  # one entry per key
        for x in (0, 1)
    ]
    for e in kernels:
        (tmp_path / e["cubin"]).write_bytes(b"never opened by lowering")
    publish = dict(
        cubin=cute_manifest.PUBLISH_CUBIN, entry="publish_entry", block=[128, 1, 1], params=abi.ptx(abi.PUBLISH)
    )
    (tmp_path / publish["cubin"]).write_bytes(b"nor this")
    manifest = dict(arch="sm_90a", cutlass_dsl="4.8.1", H=H, kernels=kernels, publish=publish)
    cute_manifest.seal(manifest, tmp_path)  # fingerprint of the installed sources, the fakes' sha256
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setenv("OPROJ_JAX_CUBIN_DIR", str(tmp_path))
    monkeypatch.setenv("OPROJ_JAX_FFI_LIBRARY", str(library))
    monkeypatch.setenv(cache.ENV_NO_COMPILE, "1")  # prebuilt cubins only
    monkeypatch.setattr(backend, "_is_cuda", lambda platform: True)
    sharded._sharded.cache_clear()
    yield tmp_path
    sharded._sharded.cache_clear()


def _mesh(shape, names):
    devices = jax.devices("cpu")[: int(np.prod(shape))]
    return Mesh(np.array(devices).reshape(shape), names)


def spec(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.bfloat16)


def _lower(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _peer_calls(text):
    return [line for line in text.splitlines() if f"stablehlo.custom_call @{ffi.PEER_TARGET}(" in line]


def _assert_no_collective(text):
    lowered = text.lower()
    for name in COLLECTIVES:
        assert name not in lowered, f"mode='peer' must not use an XLA collective, found {name}"


def _consumer_args(R, T, NB):
    return spec(R, T, H), spec(T, H), spec(T, NB, H), spec(H), spec(H), spec(H)


@pytest.mark.parametrize("R,groups,reps", [(2, 1, 0), (2, 4, 1), (4, 2, 0), (8, 4, 0), (16, 4, 1)])
def test_tp_consumer_lowers_to_one_peer_call_and_no_collective(gpu_mesh_here, R, groups, reps):
    mesh = _mesh((R,), ("tp",))
    T = 3

    def fn(*args):
        return sharded.tp_consumer(
            *args, mesh=mesh, mode="peer", backend="cute", groups=groups, has_delta=False, xmoe_replicas=reps
        )

    text = _lower(fn, *_consumer_args(R, T, 0))
    (call,) = _peer_calls(text)
    _assert_no_collective(text)
    ordinals = ", ".join(str(d.local_hardware_id) for d in mesh.devices.flat)
    for attribute in (
        f"group = dense<[{ordinals}]> : tensor<{R}xi64>",
        f"ranks = {R} : i64",
        f"max_tokens = {peer.DEFAULT_MAX_TOKENS} : i64",
        f"row_bytes = {H * 2} : i64",
        "has_side_effect = true",
    ):
        assert attribute in call, attribute
    consumer, publish = launch_attributes(call), launch_attributes(call, "publish_")
    want_publish, want_consumer = expected_launches(R, T, 0, reps, timeout_us=backend.DEFAULT_TIMEOUT_US)
    groups = cute_manifest.effective_groups(R, groups)
    assert consumer["entry"] == f"entry_R{R}_NB0_0_G{groups}_x{reps}" and consumer["smem"] == 20000 + groups
    assert consumer["cubin"] == str(gpu_mesh_here / f"R{R}_NB0_0_G{groups}_x{reps}.cubin")
    # the folded build (manifest.FOLDED), as every call: grid (7, T), clusters of 7, 128 threads
    assert (consumer["grid"], consumer["block"], consumer["cluster"]) == ((7, T, 1), (128, 1, 1), (7, 1, 1))
    assert consumer["pdl"] is True and consumer["params"] == want_consumer
    assert publish["entry"] == "publish_entry" and publish["cubin"] == str(gpu_mesh_here / cute_manifest.PUBLISH_CUBIN)
    # one thread per 16-byte fragment of the partial, no cluster, no shared memory
    fragments = T * H // 8
    assert (publish["grid"], publish["block"]) == (((fragments + 127) // 128, 1, 1), (128, 1, 1))
    assert (publish["cluster"], publish["smem"], publish["pdl"]) == ((0, 0, 0), 0, True)
    assert publish["params"] == want_publish
    assert inplace_pairs(call) == [(1, 0)]  # the prefix, read and written in place
    # the partial goes to the call as XLA made it: the publish kernel sanitizes, not XLA
    assert "compare" not in text and "select" not in text
    aliases = set(re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", call))
    assert aliases == {("0", "1")}  # only the prefix, in place
    assert call.rstrip().endswith("tensor<3xi32>)"), "flags: consumer status, hints, publish status"
    assert "stablehlo.or" in text, "status: the OR of the consumer's and the publish's words"
    assert f"tensor<{R}xi32>" in text.split("func.func private")[0], "status: one word per rank"


def test_the_options_reach_the_call(gpu_mesh_here):
    mesh = _mesh((2,), ("tp",))
    options = peer.PeerOptions(timeout_us=1234, skip_publish_rank=1)

    def fn(*args):
        return sharded.tp_consumer(*args, mesh=mesh, mode="peer", groups=4, peer_options=options)  # backend auto

    (call,) = _peer_calls(_lower(fn, *_consumer_args(2, 65, 8)))
    consumer, publish = launch_attributes(call), launch_attributes(call, "publish_")
    assert consumer["entry"] == "entry_R2_NB8_1_G2_x0" and consumer["block"] == (128, 1, 1)  # groups 4 sums as 2 at R=2
    assert consumer["grid"] == (7, 65, 1) and publish["grid"] == ((65 * H // 8 + 127) // 128, 1, 1)
    want_publish, want_consumer = expected_launches(2, 65, 8, 0, timeout_us=1234, skip=1)
    assert publish["params"] == want_publish and consumer["params"] == want_consumer


def test_fused_oproj_lowers_to_dot_then_peer_call(gpu_mesh_here):
    mesh = _mesh((2,), ("tp",))
    K = 256

    def fn(attn, w_o, *rest):
        return sharded.tp_oproj_consumer(attn, w_o, *rest, mesh=mesh, mode="peer", groups=1)

    text = _lower(fn, spec(3, K), spec(K, H), spec(3, H), spec(3, 8, H), spec(H), spec(H), spec(H))
    (call,) = _peer_calls(text)
    assert "dot_general" in text
    _assert_no_collective(text)


def test_2d_mesh_passes_every_tp_group(gpu_mesh_here):
    """dp x tp: one table row per TP group; each device finds its own row at execute."""
    mesh = _mesh((2, 2), ("dp", "tp"))

    def fn(*args):
        return sharded.tp_consumer(*args, mesh=mesh, axis_name="tp", mode="peer", groups=1)

    text = _lower(fn, *_consumer_args(2, 1, 8))
    (call,) = _peer_calls(text)
    rows = [[int(d.local_hardware_id) for d in row] for row in mesh.devices]  # tp is the last axis
    flat = ", ".join(str(ordinal) for row in rows for ordinal in row)
    assert f"group = dense<[{flat}]> : tensor<4xi64>" in call
    assert peer.group_table(mesh, "dp") == tuple(zip(*rows))  # along dp: the columns
    _assert_no_collective(text)


def test_lowering_in_a_scan_keeps_one_call_per_step(gpu_mesh_here):
    """Back-to-back steps: the call sits in the loop body once, with its side effect."""
    mesh = _mesh((2,), ("tp",))

    def loop(partials, prefix, blocks, norm, query, out_norm):
        def step(prefix, partial):
            res = sharded.tp_consumer(partial, prefix, blocks, norm, query, out_norm, mesh=mesh, mode="peer")
            return res.prefix, (res.output, res.status)

        return jax.lax.scan(step, prefix, partials)

    text = _lower(loop, spec(5, 2, 1, H), spec(1, H), spec(1, 8, H), spec(H), spec(H), spec(H))
    assert len(_peer_calls(text)) == 1 and "stablehlo.while" in text
    _assert_no_collective(text)


# ---- errors -------------------------------------------------------------------------------------


def _inputs(R=2, T=1, NB=0):
    x = configs.make_inputs(configs.Config(R, T, NB, groups=1, has_delta=False))
    return [x[k] for k in ("mailbox", "prefix", "blocks", "norm", "query", "out_norm")]


def test_peer_on_cpu_raises_naming_the_mode():
    mesh = _mesh((2,), ("tp",))
    with pytest.raises(ValueError, match=r"mode: mode='peer' needs backend 'cute' on CUDA GPUs.*'cpu'"):
        sharded.tp_consumer(*_inputs(), mesh=mesh, mode="peer", groups=1, has_delta=False)


@pytest.mark.parametrize("name", ["pallas", "reference"])
def test_peer_with_another_backend_raises_naming_the_backend(name):
    mesh = _mesh((2,), ("tp",))
    with pytest.raises(ValueError, match=rf"backend: mode='peer' needs backend 'cute'.*got backend='{name}'"):
        sharded.tp_consumer(*_inputs(), mesh=mesh, mode="peer", backend=name, groups=1, has_delta=False)


def test_peer_options_are_checked():
    mesh = _mesh((2,), ("tp",))
    with pytest.raises(ValueError, match="peer_options: only mode='peer'"):
        sharded.tp_consumer(*_inputs(), mesh=mesh, mode="oneshot", peer_options=peer.PeerOptions(), groups=1)
    with pytest.raises(ValueError, match="skip_publish_rank must be a rank < 2"):
        sharded.tp_consumer(*_inputs(), mesh=mesh, mode="peer", peer_options=peer.PeerOptions(skip_publish_rank=2))
    with pytest.raises(TypeError, match="peer_options: expected oproj_jax.cute.peer.PeerOptions"):
        sharded.tp_consumer(*_inputs(), mesh=mesh, mode="peer", peer_options={"timeout_us": 5})
    for bad in (-1, 0, 2**31):  # no "wait forever": every wait is bounded
        with pytest.raises(ValueError, match="timeout_us: expected 1 <= timeout_us"):
            peer.PeerOptions(timeout_us=bad)
    with pytest.raises(TypeError, match="timeout_us: expected an int"):
        peer.PeerOptions(timeout_us=1.5)
    with pytest.raises(ValueError, match="skip_publish_rank"):
        peer.PeerOptions(skip_publish_rank=True)


def test_unsupported_shapes_raise(gpu_mesh_here):
    mesh = _mesh((2,), ("tp",))
    with pytest.raises(ValueError, match=r"mode: mode='peer' cannot run this call: no prebuilt CuTe cubin .*NB=1"):
        sharded.tp_consumer(*_inputs(NB=1), mesh=mesh, mode="peer", groups=1, has_delta=False)
    assert "up to 16 ranks" in peer.unsupported_reason(configs_dims(17), has_delta=True, groups=4, xmoe_replicas=0)


def configs_dims(R):
    from oproj_jax.contract import Dims

    return Dims(R, 1, 8, H)


def test_a_manifest_without_the_publish_kernel_names_the_build(gpu_mesh_here):
    path = gpu_mesh_here / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["publish"]
    path.write_text(json.dumps(manifest))
    reason = peer.unavailable_reason("cuda")
    assert "no (current) publish kernel" in reason and backend.BUILD_COMMAND in reason


class _Device:
    def __init__(self, id, process, ordinal):
        self.id, self.process_index, self.local_hardware_id = id, process, ordinal


class _FakeMesh:
    axis_names = ("tp",)

    def __init__(self, *devices):
        self.devices = np.array(devices, dtype=object)


def test_the_table_holds_ordinals_for_local_groups_and_device_ids_for_other_processes():
    local = _FakeMesh(_Device(0, 0, 3), _Device(1, 0, 5))
    assert peer.group_table(local, "tp") == ((3, 5),)
    one_each = _FakeMesh(_Device(0, 0, 0), _Device(1, 1, 0), _Device(2, 2, 0))
    assert peer.group_table(one_each, "tp") == ((0, -2, -3),)  # this process is 0 (jax.process_index())


def test_a_group_with_several_ranks_in_one_of_several_processes_is_refused():
    mixed = _FakeMesh(_Device(0, 0, 0), _Device(1, 0, 1), _Device(2, 1, 0))
    with pytest.raises(ValueError, match=r"mesh: mode='peer' runs a TP group either in one process or with each rank"):
        peer.group_table(mixed, "tp")


def test_check_status():
    peer.check_status(np.zeros(4, np.int32))
    with pytest.raises(RuntimeError, match=r"mesh device\(s\) \[1, 3\] failed.*peer.reset\(\)"):
        peer.check_status(np.array([0, 1, 0, 1], np.int32))


def test_the_peer_target_is_graph_safe_with_a_record_stage():
    """No host step counter: XLA may put the call into a command buffer, through its record stage
    (graph nodes updated in place); no initialize stage (the record stage loads the modules
    itself before it asks XLA to stream-capture execute)."""
    assert ffi.SYMBOLS[ffi.PEER_TARGET] == ffi.Stages(
        "OprojPeerExecute", "OprojPeerRecord", instantiate="OprojPeerInstantiate"
    )
    i = list(ffi.SYMBOLS).index(ffi.PEER_TARGET)
    symbols, traits = ffi._stage_table()
    # instantiate: the per-call-site state (whether its first execution met the other processes)
    assert symbols[5 * i : 5 * i + 5] == ["OprojPeerInstantiate", None, None, "OprojPeerExecute", "OprojPeerRecord"]
    assert traits[i] == 1


def test_check_status_names_each_code():
    with pytest.raises(RuntimeError, match=r"status 4 \(4: a peer never re-armed its slot"):
        peer.check_status(np.array([4, 0], np.int32))
    with pytest.raises(RuntimeError, match=r"status 5 \(1: a mailbox slot stayed empty.*; 4: a peer never re-armed"):
        peer.check_status(np.array([0, 5], np.int32))
    assert "refused" in peer.describe_status(8) and "close()" in peer.describe_status(24)
    assert "unknown" in peer.describe_status(32)


def test_library_exports_reset_and_it_is_a_no_op_without_groups(library, monkeypatch):
    lib = ctypes.CDLL(str(library))
    assert lib.OprojPeerExecute and lib.OprojPeerInstantiate and lib.OprojPeerRecord and lib.OprojPeerReset
    monkeypatch.setenv("OPROJ_JAX_FFI_LIBRARY", str(library))
    monkeypatch.setattr(ffi, "_library", None)  # load the temporary build
    assert peer.group_count() == 0
    peer.reset()  # no group allocated: touches no GPU
