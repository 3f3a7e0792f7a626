"""mode="peer" across processes: connecting a group whose ranks live in different processes.

With one process per GPU (jax.distributed), a rank's publish kernel must store into mailboxes
that other processes allocated. Those processes' memory reaches this one through legacy CUDA
IPC: each process allocates and arms its own rank's mailbox and exports a 64-byte handle
(OprojPeerExport in ffi/cute_peer.cc), the handles travel through jax.distributed's key-value
store, and each process maps the others' mailboxes into its device's context
(OprojPeerImport). From then on the FFI stages see the group as they see a group of one
process, and the protocol (peer.py, docs/spec.md "Mailbox protocol") is the same.

`connect` runs when tp_consumer(mode="peer") traces a step, once per group and process (again
after peer.close());
every process of the group traces the same step (SPMD), so each waits at most
`timeout_s` for the others' handles and names the rank that did not answer.

Table encoding (peer.group_table): a row of this process's devices holds their CUDA ordinals;
a row spanning processes holds this process's one device's CUDA ordinal and -(1 + device id)
for every other rank. A cross-process row must have each rank in a different process (a
process's CUDA IPC mapping of another process's allocation is made once, in one context).

What only a GPU run covers: the export, the mapping and the stores across processes
(tests/test_peer_processes_gpu.py, tests/test_peer_faults_gpu.py). The CPU tests cover the table
encoding and the exchange through a real two-process jax.distributed key-value store.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Callable, Protocol

import numpy as np

HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE
KEY_PREFIX = "oproj_jax/peer"
EXPORT_SYMBOL, IMPORT_SYMBOL = "OprojPeerExport", "OprojPeerImport"

_lock = threading.Lock()
_connected: set[tuple] = set()  # (row, max_tokens, row_bytes) connected in this process (until close)
_generation = 0  # close() calls in this process: names the exchanges of a reopened group


class Store(Protocol):
    """Where the processes leave their handles (jax.distributed's key-value store)."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str, timeout_ms: int) -> bytes: ...


class DistributedStore:
    """The key-value store of jax.distributed.initialize's coordination service."""

    def __init__(self):
        from oproj_jax import processes

        self._client = processes.client()
        if self._client is None:
            raise ValueError(
                "mesh: mode='peer' across processes exchanges mailbox handles through jax.distributed; call "
                "jax.distributed.initialize() in every process first"
            )

    def set(self, key: str, value: bytes) -> None:
        self._client.key_value_set_bytes(key, value)

    def get(self, key: str, timeout_ms: int) -> bytes:
        return self._client.blocking_key_value_get_bytes(key, timeout_ms)


def group_rows(mesh, axis_name: str) -> np.ndarray:
    """The TP groups of `mesh` along `axis_name`: one row of devices per group (every combination
    of the other mesh axes), rank order along the row."""
    devices = mesh.devices
    axis = mesh.axis_names.index(axis_name)
    return np.moveaxis(devices, axis, -1).reshape(-1, devices.shape[axis])


def encode_row(row, process: int) -> tuple[int, ...]:
    """One TP group's devices (rank order) as the FFI table sees them from `process`."""
    local = [d for d in row if d.process_index == process]
    if len(local) == len(row):
        return tuple(int(d.local_hardware_id) for d in row)
    owners = [d.process_index for d in row]
    if len(set(owners)) != len(owners):
        raise ValueError(
            f"mesh: mode='peer' runs a TP group either in one process or with each rank in its own process; "
            f"this group's devices belong to processes {owners}"
        )
    return tuple(int(d.local_hardware_id) if d.process_index == process else -(1 + int(d.id)) for d in row)


def exchange(store: Store, tag: str, rank: int, ranks: int, mine: bytes, timeout_s: float) -> list[bytes]:
    """Leaves `mine` under `tag` for rank `rank` and returns every rank's value, rank order,
    waiting at most `timeout_s` for each other rank's."""
    if len(mine) != HANDLE_BYTES:
        raise ValueError(f"mine: expected {HANDLE_BYTES} bytes, got {len(mine)}")
    store.set(f"{KEY_PREFIX}/{tag}/{rank}", bytes(mine))
    values = []
    for r in range(ranks):
        if r == rank:
            values.append(bytes(mine))
            continue
        try:
            value = store.get(f"{KEY_PREFIX}/{tag}/{r}", int(timeout_s * 1000))
        except Exception as err:  # the store's timeout (or a lost coordinator): name the rank
            raise RuntimeError(
                f"mode='peer': rank {r} of the group {tag} did not share its mailbox within {timeout_s} s (does "
                f"every process trace the same step?): {err}"
            ) from err
        if len(value) != HANDLE_BYTES:
            raise RuntimeError(
                f"mode='peer': rank {r} of the group {tag} shared {len(value)} bytes, not {HANDLE_BYTES}"
            )
        values.append(bytes(value))
    return values


class Native(Protocol):
    def export(self, ordinal: int, row: tuple[int, ...], max_tokens: int) -> bytes: ...

    def import_(self, ordinal: int, row: tuple[int, ...], max_tokens: int, handles: list[bytes]) -> None: ...


class LibraryNative:
    """OprojPeerExport / OprojPeerImport of the FFI library, for mailbox slots of `row_bytes` per row."""

    def __init__(self, library: ctypes.CDLL, row_bytes: int):
        self._export = getattr(library, EXPORT_SYMBOL)
        self._import = getattr(library, IMPORT_SYMBOL)
        self._row_bytes = int(row_bytes)
        common = [ctypes.c_int32, ctypes.POINTER(ctypes.c_int64), ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
        for fn in (self._export, self._import):
            fn.restype = ctypes.c_int
            fn.argtypes = common + [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]

    def _call(self, fn, ordinal, row, max_tokens, data, what):
        values = (ctypes.c_int64 * len(row))(*row)
        message = ctypes.create_string_buffer(1024)
        if fn(ordinal, values, len(row), max_tokens, self._row_bytes, data, message, len(message)) != 0:
            raise RuntimeError(f"mode='peer' ({what}): {message.value.decode(errors='replace')}")

    def export(self, ordinal, row, max_tokens):
        handle = ctypes.create_string_buffer(HANDLE_BYTES)
        self._call(self._export, ordinal, row, max_tokens, handle, "exporting this rank's mailbox")
        return handle.raw

    def import_(self, ordinal, row, max_tokens, handles):
        self._call(self._import, ordinal, row, max_tokens, b"".join(handles), "mapping the other ranks' mailboxes")


def connect(
    mesh,
    axis_name: str,
    table: tuple[tuple[int, ...], ...],
    max_tokens: int,
    timeout_s: float,
    *,
    row_bytes: int,
    store: Callable[[], Store] = DistributedStore,
    native: Callable[[], Native] | None = None,
) -> int:
    """Connects every cross-process row of `table` (peer.group_table(mesh, axis_name)) that holds
    a device of this process, with mailbox slots of `max_tokens` rows of `row_bytes`; returns how
    many it connected now."""
    done = 0
    for row, encoded in zip(group_rows(mesh, axis_name), table):
        if min(encoded) >= 0 or max(encoded) < 0:  # one process's group, or none of ours
            continue
        key = (encoded, int(max_tokens), int(row_bytes))
        with _lock:
            if key in _connected:
                continue
            rank = next(i for i, v in enumerate(encoded) if v >= 0)
            lib = native() if native else LibraryNative(_library(), row_bytes)
            mine = lib.export(encoded[rank], encoded, int(max_tokens))
            tag = "-".join(str(int(d.id)) for d in row) + f"/open{_generation}"
            handles = exchange(store(), tag, rank, len(encoded), mine, timeout_s)
            lib.import_(encoded[rank], encoded, int(max_tokens), handles)
            _connected.add(key)
            done += 1
    return done


def forget() -> None:
    """After peer.close(): no group is connected any more; the next connect exchanges anew."""
    global _generation
    with _lock:
        _connected.clear()
        _generation += 1


def _library() -> ctypes.CDLL:
    from oproj_jax import ffi

    return ffi.load_library()
