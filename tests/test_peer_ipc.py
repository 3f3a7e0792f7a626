"""mode="peer" across processes, without a GPU: the handle exchange and the connect logic.

Covered here: the exchange of mailbox handles (rank order, a missing rank named within the
timeout) with an in-memory store and through a real two-process jax.distributed key-value store
on CPU; `connect` exporting once, importing every rank's handle in rank order, skipping local
groups; the library's export/import refusing bad rows before any CUDA call. What only a GPU run
covers (tests/test_peer_processes_gpu.py): the CUDA IPC export and mapping, and the peer stores
and polls across processes.
"""

import sys

import numpy as np
import pytest
from conftest import REPO, worker_env

from oproj_jax import processes
from oproj_jax import ffi
from oproj_jax.cute import peer_ipc

SKIP_EXIT = 77


class MemoryStore:
    def __init__(self):
        self.values = {}

    def set(self, key, value):
        if key in self.values:
            raise RuntimeError(f"{key} exists")
        self.values[key] = value

    def get(self, key, timeout_ms):
        if key not in self.values:
            raise TimeoutError(f"{key}: nothing after {timeout_ms} ms")
        return self.values[key]


def handle(rank: int) -> bytes:
    return bytes([rank + 1]) * peer_ipc.HANDLE_BYTES


def test_exchange_returns_every_rank_in_rank_order():
    store = MemoryStore()
    for r in (0, 2):
        store.set(f"{peer_ipc.KEY_PREFIX}/g/{r}", handle(r))
    assert peer_ipc.exchange(store, "g", 1, 3, handle(1), 1.0) == [handle(0), handle(1), handle(2)]


def test_exchange_names_the_rank_that_did_not_answer():
    store = MemoryStore()
    store.set(f"{peer_ipc.KEY_PREFIX}/g/0", handle(0))
    with pytest.raises(RuntimeError, match=r"rank 2 of the group g did not share its mailbox within 0.5 s"):
        peer_ipc.exchange(store, "g", 1, 3, handle(1), 0.5)


def test_exchange_refuses_handles_of_the_wrong_size():
    with pytest.raises(ValueError, match=r"mine: expected 64 bytes, got 3"):
        peer_ipc.exchange(MemoryStore(), "g", 0, 2, b"abc", 1.0)
    store = MemoryStore()
    store.set(f"{peer_ipc.KEY_PREFIX}/g/1", b"short")
    with pytest.raises(RuntimeError, match=r"rank 1 of the group g shared 5 bytes, not 64"):
        peer_ipc.exchange(store, "g", 0, 2, handle(0), 1.0)


class _Device:
    def __init__(self, id, process, ordinal):
        self.id, self.process_index, self.local_hardware_id = id, process, ordinal


class _Mesh:
    axis_names = ("tp",)

    def __init__(self, devices):
        self.devices = np.array(devices, dtype=object)


class RecordingNative:
    def __init__(self):
        self.calls = []

    def export(self, ordinal, row, tokens):
        self.calls.append(("export", ordinal, row, tokens))
        return handle(0)

    def import_(self, ordinal, row, tokens, handles):
        self.calls.append(("import", ordinal, row, tokens, handles))


@pytest.mark.parametrize("ranks, mine", [(3, 0), (8, 5), (16, 15)])
def test_connect_exports_once_and_imports_every_rank_in_order(monkeypatch, ranks, mine):
    monkeypatch.setattr(peer_ipc, "_connected", set())
    mesh = _Mesh([_Device(10 + r, r, 0) for r in range(ranks)])  # one rank per process; this one is `mine`
    row = peer_ipc.encode_row(mesh.devices, mine)
    assert row == tuple(0 if r == mine else -(11 + r) for r in range(ranks))
    tag = "-".join(str(10 + r) for r in range(ranks)) + f"/open{peer_ipc._generation}"
    store, native = MemoryStore(), RecordingNative()
    for r in range(ranks):
        if r != mine:
            store.set(f"{peer_ipc.KEY_PREFIX}/{tag}/{r}", handle(r))
    native.export = lambda ordinal, row_, tokens: native.calls.append(("export", ordinal, row_, tokens)) or handle(mine)
    connect = lambda: peer_ipc.connect(  # noqa: E731
        mesh, "tp", (row,), 4, 1.0, row_bytes=64, store=lambda: store, native=lambda: native
    )
    assert connect() == 1
    assert native.calls == [
        ("export", 0, row, 4),
        ("import", 0, row, 4, [handle(r) for r in range(ranks)]),
    ]
    assert store.values[f"{peer_ipc.KEY_PREFIX}/{tag}/{mine}"] == handle(mine)
    assert connect() == 0 and len(native.calls) == 2  # connected once per group and process (until close)


def test_connect_leaves_groups_of_one_process_to_the_handler(monkeypatch):
    monkeypatch.setattr(peer_ipc, "_connected", set())
    mesh = _Mesh([_Device(0, 0, 0), _Device(1, 0, 1)])
    native = RecordingNative()
    table = (peer_ipc.encode_row(mesh.devices, 0),)
    assert table == ((0, 1),)
    assert peer_ipc.connect(mesh, "tp", table, 4, 1.0, row_bytes=64, store=MemoryStore, native=lambda: native) == 0
    assert native.calls == []


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return ffi.build_library(tmp_path_factory.mktemp("ipc_lib"))


@pytest.mark.parametrize(
    "ordinal, row, tokens, row_bytes, message",
    [
        (0, (), 4, 64, r"ranks: expected R >= 1, got 0"),
        (0, (0, -2), 0, 64, r"max_tokens, row_bytes: expected >= 1, got 0, 64"),
        (0, (0, -2), 4, 0, r"max_tokens, row_bytes: expected >= 1, got 4, 0"),
        (1, (0, -2), 4, 64, r"row: expected CUDA ordinal 1 exactly once"),
    ],
)
def test_the_library_refuses_bad_rows(library, ordinal, row, tokens, row_bytes, message):
    """What the transport itself needs to open a group: at least one rank, slots of at least one
    row of at least one byte, this device in the row once. Limits of the kernels (R <= 16,
    max_tokens <= 65535) are Python's: peer.unsupported_reason, PeerOptions."""
    import ctypes

    native = peer_ipc.LibraryNative(ctypes.CDLL(str(library)), row_bytes)
    with pytest.raises(RuntimeError, match=r"mode='peer' \(exporting this rank's mailbox\): " + message):
        native.export(ordinal, row, tokens)
    with pytest.raises(RuntimeError, match=r"mode='peer' \(mapping the other ranks' mailboxes\): " + message):
        native.import_(ordinal, row, tokens, [handle(0), handle(1)])


def test_the_library_maps_nothing_before_this_rank_exported(library):
    import ctypes

    native = peer_ipc.LibraryNative(ctypes.CDLL(str(library)), 64)
    with pytest.raises(RuntimeError, match=r"not exported \(OprojPeerExport\) first|CUDA driver is unavailable"):
        native.import_(0, (0, -99), 4, [handle(0), handle(1)])


def test_two_processes_exchange_through_the_distributed_store():
    """Two CPU processes of one jax.distributed cluster: each connects the group of both
    devices (a recording native side), and each imports the other's handle; a third rank that
    never answers is named within its timeout."""
    env = worker_env(JAX_PLATFORMS="cpu")
    results = processes.run([__file__, "worker"], 2, env=env, cwd=REPO, timeout_s=180)
    report = processes.report(results)
    if any(r.code == SKIP_EXIT for r in results):
        pytest.skip(f"jax.distributed did not start on loopback here: {report}")
    assert [r.code for r in results] == [0, 0], report
    for i, r in enumerate(results):
        assert f"process {i}: imported [{1}, {2}]" in r.log, report
        assert f"process {i}: mode='peer': rank 2 of the group absent did not share" in r.log, report


def _worker(process_id: int, count: int, port: int) -> int:
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    try:
        processes.initialize(process_id, count, port)
    except Exception as err:  # noqa: BLE001 - the platform's failure, reported as the skip reason
        print(f"SKIP: {type(err).__name__}: {err}", flush=True)
        return SKIP_EXIT
    from jax.sharding import Mesh

    class Native:
        def export(self, ordinal, row, tokens):
            return bytes([process_id + 1]) * peer_ipc.HANDLE_BYTES

        def import_(self, ordinal, row, tokens, handles):
            print(f"process {process_id}: imported {[h[0] for h in handles]}", flush=True)

    mesh = Mesh(np.array(jax.devices()), ("tp",))
    table = tuple(peer_ipc.encode_row(row, process_id) for row in [mesh.devices])
    assert all(min(row) < 0 <= max(row) for row in table), table
    peer_ipc.connect(mesh, "tp", table, 8, 60.0, row_bytes=64, native=Native)
    try:  # a third rank that is not there: named after the timeout
        peer_ipc.exchange(peer_ipc.DistributedStore(), "absent", process_id, 3, bytes(64), 1.0)
    except RuntimeError as err:
        print(f"process {process_id}: {err}".splitlines()[0], flush=True)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    sys.exit(_worker(*map(int, sys.argv[2:5])))
