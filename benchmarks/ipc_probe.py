"""Does CUDA peer memory shared BETWEEN PROCESSES work on this host? (2 GPUs, cuda-python)

  python benchmarks/ipc_probe.py --out DIR      # writes DIR/ipc_probe.json, prints a summary

Why: a multi-process tensor-parallel run (one process per GPU) needs each process to read and
write buffers that live on the other GPU over NVLink. Within one process that is plain peer
access; across processes one process must export its allocation and the other import and map
it. Libraries do this for you (NCCL's user-buffer registration and ncclGetPeerDevicePointer,
NVSHMEM, CUDA IPC in PyTorch), and when it fails they report something unspecific such as
"unhandled system error". A sandbox (container seccomp filter, Yama ptrace restrictions, a
user-space kernel or GPU driver proxy, missing /dev nodes) can break the exchange although the
GPUs, NVLink and in-process peer access are fine. This script tries each way of sharing device
memory between two processes directly with the CUDA driver API, step by step, and records the
exact CUresult name (or Python exception) of every call, so the JSON says which call fails.

What it runs, each step in its own try/except. CUDA work happens only in child processes
started with the "spawn" method (CUDA is not fork-safe), each with its own context (cuInit,
cuDeviceGet, cuDevicePrimaryCtxRetain, cuCtxSetCurrent); the parent never loads the driver.

  1. host facts (parent, no CUDA): kernel, /proc/sys/kernel/yama/ptrace_scope, the Seccomp,
     NoNewPrivs and capability lines of /proc/self/status, /dev/shm size, /dev/nvidia* nodes,
     namespaces, CUDA/NCCL/NVSHMEM environment variables.
  2. CUDA facts (one child): driver version, device count; per device name, PCI bus id, compute
     mode, VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
     HANDLE_TYPE_FABRIC_SUPPORTED; per ordered device pair cuDeviceCanAccessPeer and the P2P
     attributes.
  3. control, in ONE process (same child, contexts on GPU 0 and GPU 1): legacy peer access
     (cuCtxEnablePeerAccess, cuMemAlloc on GPU 0, written and read from GPU 1) and a VMM
     allocation (cuMemCreate, access granted to both GPUs). If this fails, the problem is peer
     access itself, not sharing between processes.
  4. fd transports between the two GPU processes (no CUDA): an fd (memfd) sent with SCM_RIGHTS
     over a filesystem Unix socket and over an abstract-namespace Unix socket, and fetched with
     pidfd_open + pidfd_getfd (needs ptrace permission over the other process).
  5. route vmm_posix_fd: exporter cuMemCreate (requestedHandleTypes =
     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, size = the allocation granularity),
     cuMemExportToShareableHandle -> fd, sent with SCM_RIGHTS (socket.send_fds/recv_fds);
     importer cuMemImportFromShareableHandle, cuMemAddressReserve, cuMemMap, cuMemSetAccess.
  6. route legacy_ipc: exporter cuMemAlloc + cuIpcGetMemHandle, the 64 handle bytes relayed over
     pipes by the parent; importer cuIpcOpenMemHandle(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS).
  7. route vmm_fabric: as 5 with CU_MEM_HANDLE_TYPE_FABRIC (a 64-byte handle, no fd). It needs
     IMEX channels (/dev/nvidia-caps-imex-channels); failing on a plain single host is normal.

Every route runs in both directions (GPU 0's memory into the GPU 1 process, then GPU 1's into
the GPU 0 process) and moves data both ways: the exporter fills its buffer with a 32-bit
pattern (cuMemsetD32), the importer reads it through its own mapping (cuMemcpyDtoH: peer read),
overwrites it with a second pattern (cuMemsetD32 + cuCtxSynchronize: peer write), and the
exporter reads that back from its own mapping. Each driver call is timed.

NVLink multicast is never used (no cuMulticast* call; NCCL_NVLS_ENABLE=0 and
NVSHMEM_DISABLE_NVLS=1 are set for the children too). Nothing can hang: an answer from a child
is awaited at most 20 s (start-up: spawn, cuInit, contexts) or 10 s (one command of a transport
or route test), no step starts after 48 s (the rest is listed as not run), a child that does
not answer is killed (a fresh pair of GPU processes serves the next route), and the parent
exits without waiting on its children: the probe ends within about 52 s.
With fewer than 2 GPUs, no driver or no cuda-python it records why and exits 0.

Reading the output (DIR/ipc_probe.json; the summary printed on stdout says the same):
  verdict.cross_process_peer_memory  "works" (some route moved data both ways, in both
                                     directions), "one direction only", "fails", or
                                     "not tested" (then verdict.stop_reason says why)
  verdict.working_routes             routes that worked, e.g. "vmm_posix_fd gpu0 -> gpu1"
  verdict.failed_routes              route -> the first failing step, as
                                     "<process> <command>: <driver call> -> <CUresult> (<text>)"
  host, cuda.data                    the facts of 1 and 2 (a failing query reads "error: ...")
  in_process_p2p.data                the control of 3: legacy and vmm, each ok + failed_at
  transports                         4: per transport ok + failed_at (OSError with errno name)
  routes[]                           5-7: ok, peer_read_ok, peer_write_ok, failed_at, and log:
                                     every command sent to a child with its steps, one per
                                     call: {"call", "ok", "result" (CUresult name), "message",
                                     "ms"} or {"exception"}; a command that got no answer has
                                     "timeout": true, one whose child died has its exit code
                                     (a negative code is a signal, e.g. SIGSYS from seccomp).
"""

from __future__ import annotations

import argparse
import array
import ctypes
import datetime
import errno
import importlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import uuid

STEP_TIMEOUT_S = 20.0  # the longest wait for one answer from a child (start-up: spawn, cuInit, contexts)
ROUTE_STEP_TIMEOUT_S = 10.0  # the same for one command of a transport or route test (normally milliseconds)
TOTAL_BUDGET_S = 48.0  # no new step starts after this; closing the children adds at most ~4 s
SOCKET_TIMEOUT_S = 8.0  # socket waits inside a child (shorter than a step, so the child reports them)
MIN_STEP_S = 1.0  # a step that would get less time than this is skipped
SYS_PIDFD_GETFD = 438  # the same number on x86_64 and aarch64
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}

POSIX_FD = "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"
FABRIC = "CU_MEM_HANDLE_TYPE_FABRIC"
ROUTE_HANDLE_TYPES = {"vmm_posix_fd": POSIX_FD, "vmm_fabric": FABRIC}
# (route, exporter GPU, importer GPU), most informative first: the time budget may cut the tail
ROUTES = [
    ("vmm_posix_fd", 0, 1),
    ("legacy_ipc", 0, 1),
    ("vmm_posix_fd", 1, 0),
    ("legacy_ipc", 1, 0),
    ("vmm_fabric", 0, 1),
    ("vmm_fabric", 1, 0),
]
DEVICE_ATTRIBUTES = [
    "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
    "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
    "HANDLE_TYPE_FABRIC_SUPPORTED",
    "UNIFIED_ADDRESSING",
    "COMPUTE_MODE",  # 0 default, 2 prohibited, 3 exclusive-process (only one process per GPU)
    "IPC_EVENT_SUPPORTED",
    "MEMPOOL_SUPPORTED_HANDLE_TYPES",
    "GPU_DIRECT_RDMA_SUPPORTED",
]
P2P_ATTRIBUTES = ["ACCESS_SUPPORTED", "NATIVE_ATOMIC_SUPPORTED", "PERFORMANCE_RANK"]


def _exc(e: BaseException) -> str:
    """An exception as one line; an OSError gets its errno name (EPERM, ENOSYS, ...)."""
    if isinstance(e, OSError) and e.errno is not None:
        return f"{type(e).__name__} [{errno.errorcode.get(e.errno, e.errno)}]: {e.strerror or e}"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _describe_step(step: dict) -> str:
    if "exception" in step:
        return f"{step['call']}: {step['exception']}"
    if "result" in step:
        message = f" ({step['message']})" if step.get("message") else ""
        return f"{step['call']} -> {step['result']}{message}"
    return f"{step['call']}: {step.get('error', 'failed')}"


class _Failed(Exception):
    """A step failed; its record is already the last entry of the step list."""


# ---------------------------------------------------------------------------------------------
# child side: one process per GPU (or the "solo" process for the facts and the control)
# ---------------------------------------------------------------------------------------------


class _Worker:
    def __init__(self, label: str, device: int):
        self.label, self.device = label, device
        self.cu = None
        self.ctx = None
        self.objs: dict[str, dict] = {}  # per tag: what this process holds of a test buffer
        self.steps: list[dict] = []

    # -- recording -----------------------------------------------------------------------------

    def _timed(self, name: str, fn, *args):
        """(fn(*args), ms); an exception is recorded (errno name included) and raised as _Failed."""
        t0 = time.perf_counter()
        try:
            out = fn(*args)
        except Exception as e:
            self.steps.append(
                {"call": name, "ok": False, "exception": _exc(e), "ms": round((time.perf_counter() - t0) * 1e3, 4)}
            )
            raise _Failed(name) from e
        return out, round((time.perf_counter() - t0) * 1e3, 4)

    def _cuda(self, name: str, fn, *args):
        """Call a driver function; record the CUresult name and time; raise _Failed unless success."""
        out, ms = self._timed(name, fn, *args)
        err, rest = out[0], out[1:]
        if err != self.cu.CUresult.CUDA_SUCCESS:
            step = {"call": name, "ok": False, "result": getattr(err, "name", str(err)), "ms": ms}
            try:
                text = self.cu.cuGetErrorString(err)[1]
                step["message"] = text.decode(errors="replace") if isinstance(text, bytes) else str(text)
            except Exception as e:  # the message is a nicety
                step["message"] = f"cuGetErrorString failed: {_exc(e)}"
            self.steps.append(step)
            raise _Failed(name)
        self.steps.append({"call": name, "ok": True, "result": "CUDA_SUCCESS", "ms": ms})
        return rest[0] if len(rest) == 1 else (rest or None)

    def _host(self, name: str, fn, *args):
        """Call a Python/OS function; record the exception (errno name included) and the time."""
        value, ms = self._timed(name, fn, *args)
        self.steps.append({"call": name, "ok": True, "ms": ms})
        return value

    def _value(self, name: str, fn, *args):
        """A queried fact: its value, or "error: ..." (recorded; never raises)."""
        try:
            return self._cuda(name, fn, *args)
        except _Failed:
            return "error: " + _describe_step(self.steps[-1])

    def _fail(self, name: str, error: str):
        self.steps.append({"call": name, "ok": False, "error": error})
        raise _Failed(name)

    def _sub(self, fn) -> dict:
        """Run one part of a command on its own: {"ok", "failed_at"} plus what it returned."""
        try:
            out = fn() or {}
            data_ok = all(v for k, v in out.items() if k.endswith("_ok"))
            return {"ok": data_ok, "failed_at": None if data_ok else "data mismatch (see the compare steps)", **out}
        except _Failed:
            return {"ok": False, "failed_at": _describe_step(self.steps[-1])}
        except Exception as e:
            self.steps.append({"call": "python", "ok": False, "exception": _exc(e)})
            return {"ok": False, "failed_at": f"python: {_exc(e)}", "traceback": traceback.format_exc(limit=4)}

    def handle(self, name: str, kwargs: dict) -> dict:
        self.steps = []
        try:
            data = getattr(self, "cmd_" + name)(**kwargs) or {}
            return {"ok": True, "data": data, "steps": self.steps}
        except _Failed:
            return {"ok": False, "failed": self.steps[-1], "steps": self.steps}
        except Exception as e:
            step = {"call": f"python ({name})", "ok": False, "exception": _exc(e)}
            self.steps.append(step)
            return {"ok": False, "failed": step, "steps": self.steps, "traceback": traceback.format_exc(limit=6)}

    # -- CUDA helpers --------------------------------------------------------------------------

    def _import_driver(self):
        if self.cu is None:
            self.cu = self._host("import cuda.bindings.driver", importlib.import_module, "cuda.bindings.driver")
        return self.cu

    def _prop(self, device: int, handle_type):
        cu = self.cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        prop.requestedHandleTypes = handle_type
        return prop

    def _access(self, devices) -> list:
        cu, descs = self.cu, []
        for device in devices:
            desc = cu.CUmemAccessDesc()
            desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = device
            desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            descs.append(desc)
        return descs

    def _map(self, held: dict, handle, size: int, devices) -> object:
        """Reserve a VA range, map the allocation there, grant `devices` read/write access."""
        cu = self.cu
        va = self._cuda("cuMemAddressReserve", cu.cuMemAddressReserve, size, 0, 0, 0)
        held["va"], held["va_size"] = va, size
        self._cuda("cuMemMap", cu.cuMemMap, va, size, 0, handle, 0)
        held["mapped"] = True
        self._cuda(
            f"cuMemSetAccess(devices {list(devices)})", cu.cuMemSetAccess, va, size, self._access(devices), len(devices)
        )
        return va

    def _fill(self, label: str, ptr, size: int, pattern: int):
        self._cuda(f"cuMemsetD32 0x{pattern:08x} ({label})", self.cu.cuMemsetD32, ptr, pattern, size // 4)
        self._cuda(f"cuCtxSynchronize ({label})", self.cu.cuCtxSynchronize)

    def _compare(self, label: str, ptr, size: int, expect: int) -> bool:
        """Copy the buffer to the host and compare every 32-bit word with `expect`."""
        host = array.array("I", bytes(size))
        self._cuda(f"cuMemcpyDtoH ({label})", self.cu.cuMemcpyDtoH, host.buffer_info()[0], ptr, size)
        bad = len(host) - host.count(expect)
        step = {"call": f"compare ({label})", "ok": bad == 0, "expected": f"0x{expect:08x}", "mismatches": bad}
        if bad:
            index = next(i for i, v in enumerate(host) if v != expect)
            step["first_mismatch"] = {"word": index, "value": f"0x{host[index]:08x}", "of_words": len(host)}
        self.steps.append(step)
        return bad == 0

    # -- commands: facts and control -----------------------------------------------------------

    def cmd_env(self) -> dict:
        cu = self._import_driver()
        self._cuda("cuInit(0)", cu.cuInit, 0)
        facts = {"pid": os.getpid()}
        version = self._value("cuDriverGetVersion", cu.cuDriverGetVersion)
        facts["driver_version"] = version
        if isinstance(version, int):
            facts["driver_version_text"] = f"{version // 1000}.{version % 1000 // 10}"
        count = self._cuda("cuDeviceGetCount", cu.cuDeviceGetCount)
        facts["device_count"] = count
        devices, handles = [], {}
        for i in range(count):
            entry = {"ordinal": i}
            try:
                dev = handles[i] = self._cuda(f"cuDeviceGet({i})", cu.cuDeviceGet, i)
            except _Failed:
                entry["error"] = _describe_step(self.steps[-1])
                devices.append(entry)
                continue
            name = self._value(f"cuDeviceGetName(gpu{i})", cu.cuDeviceGetName, 256, dev)
            entry["name"] = name.split(b"\0")[0].decode(errors="replace") if isinstance(name, bytes) else name
            bus = self._value(f"cuDeviceGetPCIBusId(gpu{i})", cu.cuDeviceGetPCIBusId, 64, dev)
            entry["pci_bus_id"] = bus.split(b"\0")[0].decode(errors="replace") if isinstance(bus, bytes) else bus
            for attr in DEVICE_ATTRIBUTES:
                enum = getattr(cu.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + attr, None)
                entry[attr] = (
                    "error: not in this cuda-python"
                    if enum is None
                    else self._value(f"cuDeviceGetAttribute({attr}, gpu{i})", cu.cuDeviceGetAttribute, enum, dev)
                )
            devices.append(entry)
        facts["devices"] = devices
        pairs = []
        for i in handles:
            for j in handles:
                if i == j:
                    continue
                pair = {"from": i, "to": j}
                pair["can_access_peer"] = self._value(
                    f"cuDeviceCanAccessPeer(gpu{i}, gpu{j})", cu.cuDeviceCanAccessPeer, handles[i], handles[j]
                )
                for attr in P2P_ATTRIBUTES:
                    enum = getattr(cu.CUdevice_P2PAttribute, "CU_DEVICE_P2P_ATTRIBUTE_" + attr, None)
                    if enum is not None:
                        pair[attr] = self._value(
                            f"cuDeviceGetP2PAttribute({attr}, gpu{i}, gpu{j})",
                            cu.cuDeviceGetP2PAttribute,
                            enum,
                            handles[i],
                            handles[j],
                        )
                pairs.append(pair)
        facts["peer_pairs"] = pairs
        return facts

    def cmd_init(self) -> dict:
        cu = self._import_driver()
        self._cuda("cuInit(0)", cu.cuInit, 0)
        dev = self._cuda(f"cuDeviceGet({self.device})", cu.cuDeviceGet, self.device)
        self.ctx = self._cuda(f"cuDevicePrimaryCtxRetain(gpu{self.device})", cu.cuDevicePrimaryCtxRetain, dev)
        self._cuda("cuCtxSetCurrent", cu.cuCtxSetCurrent, self.ctx)
        return {"pid": os.getpid(), "device": self.device}

    def cmd_in_process(self, patterns: list[int]) -> dict:
        """Control: peer access between GPU 0 and GPU 1 inside this one process."""
        cu = self._import_driver()
        self._cuda("cuInit(0)", cu.cuInit, 0)
        ctx = {}
        for i in (0, 1):
            dev = self._cuda(f"cuDeviceGet({i})", cu.cuDeviceGet, i)
            ctx[i] = self._cuda(f"cuDevicePrimaryCtxRetain(gpu{i})", cu.cuDevicePrimaryCtxRetain, dev)
        p0, p1, p2, p3 = patterns

        def round_trip(ptr, size, first, second):  # gpu0's memory: read by gpu1, written by gpu1, read back
            self._fill("gpu0 writes its memory", ptr, size, first)
            self._cuda("cuCtxSetCurrent(gpu1)", cu.cuCtxSetCurrent, ctx[1])
            read_ok = self._compare("gpu1 reads gpu0 memory", ptr, size, first)
            self._fill("gpu1 writes gpu0 memory", ptr, size, second)
            self._cuda("cuCtxSetCurrent(gpu0)", cu.cuCtxSetCurrent, ctx[0])
            return read_ok, self._compare("gpu0 reads back", ptr, size, second)

        def legacy():
            size = 2 << 20
            self._cuda("cuCtxSetCurrent(gpu1)", cu.cuCtxSetCurrent, ctx[1])
            self._cuda("cuCtxEnablePeerAccess(gpu1 -> gpu0)", cu.cuCtxEnablePeerAccess, ctx[0], 0)
            self._cuda("cuCtxSetCurrent(gpu0)", cu.cuCtxSetCurrent, ctx[0])
            ptr = self._cuda("cuMemAlloc on gpu0", cu.cuMemAlloc, size)
            read_ok, write_ok = round_trip(ptr, size, p0, p1)
            self._cuda("cuMemFree", cu.cuMemFree, ptr)
            return {"peer_read_ok": read_ok, "peer_write_ok": write_ok}

        def vmm():
            self._cuda("cuCtxSetCurrent(gpu0)", cu.cuCtxSetCurrent, ctx[0])
            none = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
            prop = self._prop(0, none)
            gran = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            size = self._cuda("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity, prop, gran)
            handle = self._cuda("cuMemCreate on gpu0", cu.cuMemCreate, size, prop, 0)
            held: dict = {}
            va = self._map(held, handle, size, (0, 1))
            read_ok, write_ok = round_trip(va, size, p2, p3)
            self._cuda("cuMemUnmap", cu.cuMemUnmap, va, size)
            self._cuda("cuMemAddressFree", cu.cuMemAddressFree, va, size)
            self._cuda("cuMemRelease", cu.cuMemRelease, handle)
            return {"size": size, "peer_read_ok": read_ok, "peer_write_ok": write_ok}

        return {"legacy": self._sub(legacy), "vmm": self._sub(vmm)}

    # -- commands: moving an fd between the two processes ----------------------------------------

    def cmd_memfd(self, tag: str, payload: bytes) -> dict:
        fd = self._host("os.memfd_create", os.memfd_create, "ipc_probe")
        self.objs[tag] = {"fd": fd}
        self._host("os.write", os.write, fd, payload)
        return {"pid": os.getpid(), "fd": fd}

    def cmd_fd_listen(self, path: str) -> dict:
        listener = self._host("socket(AF_UNIX)", socket.socket, socket.AF_UNIX, socket.SOCK_STREAM)
        self.objs["listener"] = {"socket": listener, "path": path}
        listener.settimeout(SOCKET_TIMEOUT_S)
        self._host("bind" + (" (abstract name)" if path.startswith("\0") else ""), listener.bind, path)
        self._host("listen", listener.listen, 1)
        return {}

    def cmd_fd_send(self, path: str, tag: str) -> dict:
        fd = self.objs[tag]["fd"]
        sock = self._host("socket(AF_UNIX)", socket.socket, socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(SOCKET_TIMEOUT_S)
            self._host("connect", sock.connect, path)
            self._host("sendmsg(SCM_RIGHTS) via socket.send_fds", socket.send_fds, sock, [b"fd"], [fd])
        finally:
            sock.close()
        return {"sent_fd": fd}

    def cmd_fd_accept(self, tag: str) -> dict:
        held = self.objs.pop("listener")
        listener = held["socket"]
        try:
            conn, _ = self._host("accept", listener.accept)
            try:
                conn.settimeout(SOCKET_TIMEOUT_S)
                msg, fds, flags, _ = self._host("recvmsg(SCM_RIGHTS) via socket.recv_fds", socket.recv_fds, conn, 16, 4)
            finally:
                conn.close()
        finally:
            listener.close()
            if not held["path"].startswith("\0"):
                try:
                    os.unlink(held["path"])
                except OSError:
                    pass
        if not fds:
            self._fail("recvmsg(SCM_RIGHTS)", f"no fd arrived (message {msg!r}, flags {flags}; MSG_CTRUNC=8)")
        self.objs.setdefault(tag, {})["fd"] = fds[0]
        for extra in fds[1:]:
            os.close(extra)
        return {"received_fd": fds[0]}

    def cmd_pidfd_getfd(self, tag: str, pid: int, fd: int) -> dict:
        pidfd = self._host(f"os.pidfd_open({pid})", os.pidfd_open, pid)
        try:
            libc = ctypes.CDLL(None, use_errno=True)

            def getfd():
                got = libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
                if got < 0:
                    code = ctypes.get_errno()
                    raise OSError(code, os.strerror(code))
                return got

            newfd = self._host(f"syscall pidfd_getfd(pidfd, {fd})", getfd)
        finally:
            os.close(pidfd)
        self.objs.setdefault(tag, {})["fd"] = newfd
        return {"received_fd": newfd}

    def cmd_fd_read(self, tag: str, expect: bytes) -> dict:
        fd = self.objs[tag]["fd"]
        data = self._host("os.pread", os.pread, fd, len(expect) + 16, 0)
        if data != expect:
            self._fail("compare fd contents", f"read {data!r}, expected {expect!r}")
        return {"content_ok": True}

    # -- commands: the routes ------------------------------------------------------------------

    def cmd_vmm_export(self, tag: str, handle_type: str, pattern: int) -> dict:
        cu = self.cu
        kind = getattr(cu.CUmemAllocationHandleType, handle_type)
        prop = self._prop(self.device, kind)
        gran = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        size = self._cuda("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity, prop, gran)
        handle = self._cuda(f"cuMemCreate({handle_type})", cu.cuMemCreate, size, prop, 0)
        held = self.objs[tag] = {"handle": handle, "size": size}
        shared = self._cuda(
            f"cuMemExportToShareableHandle({handle_type})", cu.cuMemExportToShareableHandle, handle, kind, 0
        )
        out = {"size": size}
        if handle_type == POSIX_FD:
            held["fd"] = out["fd"] = int(shared)
        else:
            out["fabric_handle"] = bytes(shared.data)
        va = self._map(held, handle, size, (self.device,))
        self._fill("exporter writes its memory", va, size, pattern)
        out["local_ok"] = self._compare("exporter reads its memory", va, size, pattern)
        return out

    def cmd_vmm_import(self, tag: str, handle_type: str, size: int, fabric_handle, expect: int, write: int) -> dict:
        cu = self.cu
        kind = getattr(cu.CUmemAllocationHandleType, handle_type)
        held = self.objs.setdefault(tag, {})
        keep = None
        if handle_type == POSIX_FD:
            os_handle = held["fd"]
        else:
            keep = cu.CUmemFabricHandle()
            keep.data = fabric_handle
            os_handle = keep.getPtr()
        handle = self._cuda(
            f"cuMemImportFromShareableHandle({handle_type})", cu.cuMemImportFromShareableHandle, os_handle, kind
        )
        held["handle"], held["size"] = handle, size
        del keep
        if "fd" in held:  # the imported handle holds its own reference
            self._host("close(received fd)", os.close, held.pop("fd"))
        va = self._map(held, handle, size, (self.device,))
        read_ok = self._compare("importer reads the exporter's memory (peer read)", va, size, expect)
        self._fill("importer writes the exporter's memory (peer write)", va, size, write)
        return {"peer_read_ok": read_ok}

    def cmd_ipc_export(self, tag: str, size: int, pattern: int) -> dict:
        cu = self.cu
        ptr = self._cuda("cuMemAlloc", cu.cuMemAlloc, size)
        self.objs[tag] = {"alloc": ptr, "size": size}
        self._fill("exporter writes its memory", ptr, size, pattern)
        local_ok = self._compare("exporter reads its memory", ptr, size, pattern)
        handle = self._cuda("cuIpcGetMemHandle", cu.cuIpcGetMemHandle, ptr)
        return {"handle": ctypes.string_at(handle.getPtr(), 64), "local_ok": local_ok}

    def cmd_ipc_import(self, tag: str, handle: bytes, size: int, expect: int, write: int) -> dict:
        cu = self.cu
        ipc = cu.CUipcMemHandle()
        ctypes.memmove(ipc.getPtr(), handle, 64)
        flags = cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        ptr = self._cuda("cuIpcOpenMemHandle(LAZY_ENABLE_PEER_ACCESS)", cu.cuIpcOpenMemHandle, ipc, int(flags.value))
        self.objs[tag] = {"ipc_ptr": ptr, "size": size}
        read_ok = self._compare("importer reads the exporter's memory (peer read)", ptr, size, expect)
        self._fill("importer writes the exporter's memory (peer write)", ptr, size, write)
        return {"peer_read_ok": read_ok}

    def cmd_read_back(self, tag: str, expect: int) -> dict:
        held = self.objs[tag]
        ptr = held.get("va", held.get("alloc"))
        return {"peer_write_ok": self._compare("exporter reads what the importer wrote", ptr, held["size"], expect)}

    def cmd_free(self, tag: str) -> dict:
        """Release whatever this process holds for `tag` (each call recorded, failures kept going)."""
        cu, held = self.cu, self.objs.pop(tag, {})
        errors = []

        def attempt(name, fn, *args):
            try:
                self._cuda(name, fn, *args)
            except _Failed:
                errors.append(_describe_step(self.steps[-1]))

        if held.get("mapped"):
            attempt("cuMemUnmap", cu.cuMemUnmap, held["va"], held["va_size"])
        if "va" in held:
            attempt("cuMemAddressFree", cu.cuMemAddressFree, held["va"], held["va_size"])
        if "handle" in held:
            attempt("cuMemRelease", cu.cuMemRelease, held["handle"])
        if "ipc_ptr" in held:
            attempt("cuIpcCloseMemHandle", cu.cuIpcCloseMemHandle, held["ipc_ptr"])
        if "alloc" in held:
            attempt("cuMemFree", cu.cuMemFree, held["alloc"])
        if "fd" in held:
            try:
                self._host("close(fd)", os.close, held["fd"])
            except _Failed:
                errors.append(_describe_step(self.steps[-1]))
        return {"errors": errors}


def _child_main(label: str, device: int, conn) -> None:
    worker = _Worker(label, device)
    while True:
        try:
            name, kwargs = conn.recv()
        except (EOFError, OSError):
            break
        if name == "exit":
            break
        reply = worker.handle(name, kwargs)
        try:
            conn.send(reply)
        except Exception as e:  # e.g. an unpicklable value slipped into the reply
            try:
                conn.send({"ok": False, "failed": {"call": "send reply", "ok": False, "exception": _exc(e)}})
            except Exception:
                break
    os._exit(0)  # no interpreter or driver teardown that could block


# ---------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------


class _Clock:
    def __init__(self, budget_s: float):
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def step_timeout(self, limit: float) -> float:
        return min(limit, self.left())


def _signal_name(code) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Child:
    """One spawned child and its pipe; every wait is bounded, a silent child is killed."""

    def __init__(self, ctx, label: str, device: int):
        self.label = label
        self.broken: str | None = None
        parent_end, child_end = ctx.Pipe()
        self.proc = ctx.Process(target=_child_main, args=(label, device, child_end), name=f"ipc_probe-{label}")
        self.proc.daemon = True
        self.proc.start()
        child_end.close()  # so a dead child reads as EOF here
        self.conn = parent_end

    def _died(self, name: str, e: BaseException) -> dict:
        self.proc.join(0.5)
        self.broken = f"the {self.label} process died during '{name}' ({_signal_name(self.proc.exitcode)}; {_exc(e)})"
        return {"ok": False, "error": self.broken, "exitcode": self.proc.exitcode}

    def send(self, name: str, kwargs: dict) -> dict | None:
        if self.broken:
            return {"ok": False, "skipped": f"not sent: {self.broken}"}
        try:
            self.conn.send((name, kwargs))
        except Exception as e:
            return self._died(name, e)
        return None

    def receive(self, name: str, end: float, timeout: float) -> dict:
        try:
            if not self.conn.poll(max(0.0, end - time.monotonic())):
                self.broken = f"no answer from the {self.label} process to '{name}' within {timeout:.0f} s (killed)"
                self.kill()
                return {"ok": False, "timeout": True, "error": self.broken}
            return self.conn.recv()
        except Exception as e:
            return self._died(name, e)

    def kill(self):
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(1.0)

    def close(self):
        if self.proc.is_alive() and not self.broken:
            try:
                self.conn.send(("exit", {}))
            except Exception:
                pass
            self.proc.join(1.0)
        self.kill()
        self.conn.close()


def _ask_many(clock: _Clock, requests: list, limit: float = ROUTE_STEP_TIMEOUT_S) -> list[dict]:
    """Send each (child, command, kwargs), then collect the answers, all within one step timeout."""
    timeout = clock.step_timeout(limit)
    if timeout < MIN_STEP_S:
        return [
            {"ok": False, "skipped": "time budget spent", "worker": child.label, "cmd": name}
            for child, name, _ in requests
        ]
    t0 = time.monotonic()
    end = t0 + timeout
    replies = [child.send(name, kwargs) for child, name, kwargs in requests]
    for i, (child, name, _) in enumerate(requests):
        if replies[i] is None:
            replies[i] = child.receive(name, end, timeout)
        replies[i].update(worker=child.label, cmd=name, wall_ms=round((time.monotonic() - t0) * 1e3, 3))
    return replies


class _SeqFailed(Exception):
    def __init__(self, reply: dict):
        super().__init__(reply.get("cmd"))
        self.reply = reply


def _describe_reply(reply: dict) -> str:
    where = f"{reply.get('worker')} {reply.get('cmd')}"
    if reply.get("skipped"):
        return f"{where}: skipped ({reply['skipped']})"
    if reply.get("error"):
        return f"{where}: {reply['error']}"
    if reply.get("failed"):
        return f"{where}: {_describe_step(reply['failed'])}"
    return f"{where}: failed"


class _Sequence:
    """Commands of one test in order; the first failing one ends it (raises _SeqFailed)."""

    def __init__(self, clock: _Clock, record: dict):
        self.clock, self.record = clock, record
        record.setdefault("log", [])

    def __call__(self, child: _Child, name: str, **kwargs) -> dict:
        reply = _ask_many(self.clock, [(child, name, kwargs)])[0]
        self.record["log"].append(reply)
        if not reply.get("ok"):
            raise _SeqFailed(reply)
        return reply.get("data") or {}


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _host_facts() -> dict:
    facts: dict = {}

    def fact(key, fn):
        try:
            facts[key] = fn()
        except Exception as e:
            facts[key] = f"error: {_exc(e)}"

    def status():
        keep = ("Seccomp", "Seccomp_filters", "NoNewPrivs", "CapEff", "CapPrm", "CapBnd")
        lines = dict(line.split(":", 1) for line in _read("/proc/self/status").splitlines() if ":" in line)
        out = {k: lines[k].strip() for k in keep if k in lines}
        if "CapEff" in out:
            out["CAP_SYS_PTRACE_effective"] = bool(int(out["CapEff"], 16) >> 19 & 1)
        return out

    def shm():
        st = os.statvfs("/dev/shm")
        return {"size_mib": st.f_blocks * st.f_frsize / 2**20, "free_mib": st.f_bavail * st.f_frsize / 2**20}

    def nvidia_nodes():
        nodes = sorted(n for n in os.listdir("/dev") if n.startswith("nvidia"))
        caps = {}
        for sub in ("nvidia-caps", "nvidia-caps-imex-channels"):
            if os.path.isdir(f"/dev/{sub}"):
                caps[sub] = sorted(os.listdir(f"/dev/{sub}"))
        return {"nodes": nodes, **caps}

    def packages():
        from importlib import metadata

        out = {}
        for name in ("cuda-python", "cuda-bindings", "numpy"):
            try:
                out[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                out[name] = None
        return out

    def namespaces():
        out = {}
        for ns in ("pid", "ipc", "net", "user", "mnt"):
            try:
                out[ns] = os.readlink(f"/proc/self/ns/{ns}")
            except OSError as e:
                out[ns] = f"error: {_exc(e)}"
        return out

    def env():
        prefixes = ("CUDA_", "NCCL_", "NVSHMEM_", "NVIDIA_")
        return {k: v for k, v in sorted(os.environ.items()) if k.startswith(prefixes)}

    fact("python", lambda: sys.version.split()[0])
    fact("uname", lambda: " ".join(os.uname()))
    fact("proc_version", lambda: _read("/proc/version"))
    fact("packages", packages)
    fact("ptrace_scope", lambda: _read("/proc/sys/kernel/yama/ptrace_scope"))
    fact("status", status)
    fact("dev_shm", shm)
    fact("dev_nvidia", nvidia_nodes)
    fact("nvidia_driver", lambda: _read("/proc/driver/nvidia/version").splitlines()[0])
    fact("uid_gid", lambda: [os.getuid(), os.getgid()])
    fact("namespaces", namespaces)
    fact("container_hints", lambda: {p: os.path.exists(p) for p in ("/.dockerenv", "/run/.containerenv")})
    fact("cpu_count", os.cpu_count)
    fact("env", env)
    return facts


def _patterns(route_index: int, exporter: int, importer: int) -> tuple[int, int]:
    return (
        0xA5000000 | route_index << 16 | exporter << 8 | 0x01,
        0x5A000000 | route_index << 16 | importer << 8 | 0x02,
    )


class _Pair:
    """The two GPU processes (gpu0 on device 0, gpu1 on device 1), started and initialised together."""

    def __init__(self, ctx, clock: _Clock, starts: list):
        self.kids = {r: _Child(ctx, f"gpu{r}", r) for r in (0, 1)}
        replies = _ask_many(clock, [(kid, "init", {}) for kid in self.kids.values()], STEP_TIMEOUT_S)
        self.ok = all(r.get("ok") for r in replies)
        starts.append({"at_s": round(clock.elapsed(), 3), "ok": self.ok, "log": replies})
        self.failed_at = None if self.ok else "; ".join(_describe_reply(r) for r in replies if not r.get("ok"))

    def __getitem__(self, rank: int) -> _Child:
        return self.kids[rank]

    def healthy(self) -> bool:
        return self.ok and not any(kid.broken for kid in self.kids.values())

    def close(self):
        for kid in self.kids.values():
            kid.close()


def _transports(pair: _Pair, clock: _Clock, tmp: str) -> dict:
    out = {}
    payload = b"ipc_probe fd payload " + uuid.uuid4().hex.encode()
    for name, path in (
        ("uds_path_scm_rights", os.path.join(tmp, "t.sock")),
        ("uds_abstract_scm_rights", "\0ipc_probe-" + uuid.uuid4().hex),
    ):
        record: dict = {"address": path.replace("\0", "@")}
        seq, tag = _Sequence(clock, record), "t_" + name
        try:
            seq(pair[0], "memfd", tag=tag, payload=payload)
            seq(pair[1], "fd_listen", path=path)
            seq(pair[0], "fd_send", path=path, tag=tag)
            seq(pair[1], "fd_accept", tag=tag)
            seq(pair[1], "fd_read", tag=tag, expect=payload)
            record.update(ok=True, failed_at=None)
        except _SeqFailed as f:
            record.update(ok=False, failed_at=_describe_reply(f.reply))
        for rank in (0, 1):
            _ask_many(clock, [(pair[rank], "free", {"tag": tag})])
        out[name] = record
    record = {}
    seq, tag = _Sequence(clock, record), "t_pidfd"
    try:
        sent = seq(pair[0], "memfd", tag=tag, payload=payload)
        seq(pair[1], "pidfd_getfd", tag=tag, pid=sent["pid"], fd=sent["fd"])
        seq(pair[1], "fd_read", tag=tag, expect=payload)
        record.update(ok=True, failed_at=None)
    except _SeqFailed as f:
        record.update(ok=False, failed_at=_describe_reply(f.reply))
    for rank in (0, 1):
        _ask_many(clock, [(pair[rank], "free", {"tag": tag})])
    out["pidfd_getfd"] = record
    return out


def _route(pair: _Pair, clock: _Clock, tmp: str, index: int, route: str, exporter: int, importer: int) -> dict:
    record: dict = {
        "route": route,
        "direction": f"gpu{exporter} -> gpu{importer}",
        "exporter": exporter,
        "importer": importer,
        "ok": False,
        "peer_read_ok": None,
        "peer_write_ok": None,
        "failed_at": None,
    }
    seq, tag = _Sequence(clock, record), f"r{index}"
    exp, imp = pair[exporter], pair[importer]
    p0, p1 = _patterns(index, exporter, importer)
    record["patterns"] = {"exporter_writes": f"0x{p0:08x}", "importer_writes": f"0x{p1:08x}"}
    try:
        if route == "legacy_ipc":
            size = 2 << 20
            made = seq(exp, "ipc_export", tag=tag, size=size, pattern=p0)
            got = seq(imp, "ipc_import", tag=tag, handle=made["handle"], size=size, expect=p0, write=p1)
        else:
            handle_type = ROUTE_HANDLE_TYPES[route]
            made = seq(exp, "vmm_export", tag=tag, handle_type=handle_type, pattern=p0)
            if handle_type == POSIX_FD:
                path = os.path.join(tmp, f"{tag}.sock")
                seq(imp, "fd_listen", path=path)
                seq(exp, "fd_send", path=path, tag=tag)
                seq(imp, "fd_accept", tag=tag)
            got = seq(
                imp,
                "vmm_import",
                tag=tag,
                handle_type=handle_type,
                size=made["size"],
                fabric_handle=made.get("fabric_handle"),
                expect=p0,
                write=p1,
            )
        record["peer_read_ok"] = got["peer_read_ok"]
        back = seq(exp, "read_back", tag=tag, expect=p1)
        record["peer_write_ok"] = back["peer_write_ok"]
        record["ok"] = bool(record["peer_read_ok"] and record["peer_write_ok"])
        if not record["ok"]:
            record["failed_at"] = "data mismatch: " + (
                "the importer did not read the exporter's pattern"
                if not record["peer_read_ok"]
                else "the exporter did not see the importer's pattern"
            )
    except _SeqFailed as f:
        record["failed_at"] = _describe_reply(f.reply)
    record["cleanup"] = _ask_many(clock, [(imp, "free", {"tag": tag})]) + _ask_many(
        clock, [(exp, "free", {"tag": tag})]
    )
    record["wall_ms"] = round(sum(r.get("wall_ms", 0) for r in record["log"]), 3)
    return record


def _probe(report: dict, clock: _Clock, tmp: str) -> None:
    ctx = mp.get_context("spawn")
    solo = _Child(ctx, "solo", 0)
    try:
        env = _ask_many(clock, [(solo, "env", {})], STEP_TIMEOUT_S)[0]
        report["cuda"] = env
        if not env.get("ok"):
            report["stop_reason"] = "CUDA unusable: " + _describe_reply(env)
            return
        count = env["data"]["device_count"]
        if count < 2:
            report["stop_reason"] = f"{count} GPU(s) visible: cross-process peer memory needs 2"
            return
        patterns = [0x11111111, 0x22222222, 0x33333333, 0x44444444]
        report["in_process_p2p"] = _ask_many(clock, [(solo, "in_process", {"patterns": patterns})], STEP_TIMEOUT_S)[0]
    finally:
        solo.close()

    report["pair_starts"] = []
    pair = _Pair(ctx, clock, report["pair_starts"])
    try:
        if not pair.ok:
            report["stop_reason"] = "the two GPU processes did not start: " + pair.failed_at
            return
        report["transports"] = _transports(pair, clock, tmp)
        report["routes"] = []
        for index, (route, exporter, importer) in enumerate(ROUTES):
            if not pair.healthy():  # a fresh pair after a failure: no state carried into the next route
                pair.close()
                if clock.left() < 2 * MIN_STEP_S + 3:
                    break
                pair = _Pair(ctx, clock, report["pair_starts"])
                if not pair.ok:
                    report["stop_reason"] = "the two GPU processes did not restart: " + pair.failed_at
                    return
            if clock.left() < 2 * MIN_STEP_S:
                break
            record = _route(pair, clock, tmp, index, route, exporter, importer)
            report["routes"].append(record)
            if not record["ok"]:
                pair.ok = False  # restart before the next route
        done = {(r["route"], r["exporter"]) for r in report["routes"]}
        skipped = [f"{r} gpu{e} -> gpu{i}" for r, e, i in ROUTES if (r, e) not in done]
        if skipped:
            report["skipped_routes"] = {"routes": skipped, "why": "time budget spent"}
    finally:
        pair.close()


def _verdict(report: dict) -> dict:
    routes = report.get("routes", [])
    working = [f"{r['route']} {r['direction']}" for r in routes if r["ok"]]
    failed = {f"{r['route']} {r['direction']}": r["failed_at"] for r in routes if not r["ok"]}
    both_ways = sorted(
        {r["route"] for r in routes if r["ok"]}
        & {r["route"] for r in routes if r["ok"] and r["exporter"] == 1}
        & {r["route"] for r in routes if r["ok"] and r["exporter"] == 0}
    )
    if not routes:
        state = "not tested"
    elif both_ways:
        state = "works"
    else:
        state = "one direction only" if working else "fails"
    verdict = {
        "cross_process_peer_memory": state,
        "working_routes": working,
        "routes_working_both_directions": both_ways,
        "failed_routes": failed,
    }
    if "stop_reason" in report:
        verdict["stop_reason"] = report["stop_reason"]
    control = report.get("in_process_p2p")
    if control:
        data = control.get("data") or {}
        verdict["in_process_p2p"] = (
            {k: bool(v.get("ok")) for k, v in data.items()} if data else _describe_reply(control)
        )
    if "transports" in report:
        verdict["fd_transports"] = {k: v["ok"] for k, v in report["transports"].items()}
    return verdict


def _summary(report: dict, path: str) -> str:
    lines = ["== CUDA cross-process peer memory probe =="]
    host = report.get("host", {})
    status = host.get("status") if isinstance(host.get("status"), dict) else {}
    shm = host.get("dev_shm") if isinstance(host.get("dev_shm"), dict) else {}
    lines.append(
        f"host: {host.get('uname', '?')}\n"
        f"      ptrace_scope={host.get('ptrace_scope')} Seccomp={status.get('Seccomp')} "
        f"(filters {status.get('Seccomp_filters')}) NoNewPrivs={status.get('NoNewPrivs')} "
        f"CAP_SYS_PTRACE={status.get('CAP_SYS_PTRACE_effective')} "
        f"/dev/shm free {shm.get('free_mib', float('nan')):.0f} MiB"
    )
    cuda = report.get("cuda")
    if cuda is None:
        lines.append("cuda: not queried")
    elif not cuda.get("ok"):
        lines.append("cuda: " + _describe_reply(cuda))
    else:
        facts = cuda["data"]
        lines.append(
            f"cuda: driver {facts.get('driver_version')} ({facts.get('driver_version_text', '?')}), "
            f"{facts['device_count']} device(s)"
        )
        for d in facts.get("devices", []):
            lines.append(
                f"  gpu{d['ordinal']}: {d.get('name')} [{d.get('pci_bus_id')}] "
                f"VMM={d.get('VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED')} "
                f"POSIX_FD={d.get('HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED')} "
                f"FABRIC={d.get('HANDLE_TYPE_FABRIC_SUPPORTED')} compute_mode={d.get('COMPUTE_MODE')}"
            )
        for p in facts.get("peer_pairs", []):
            lines.append(
                f"  gpu{p['from']} -> gpu{p['to']}: canAccessPeer={p.get('can_access_peer')} "
                f"native_atomics={p.get('NATIVE_ATOMIC_SUPPORTED')} rank={p.get('PERFORMANCE_RANK')}"
            )
    control = report.get("in_process_p2p")
    if control is not None:
        if control.get("ok"):
            parts = [
                f"{k} {'OK' if v.get('ok') else 'FAILED (' + str(v.get('failed_at')) + ')'}"
                for k, v in control["data"].items()
            ]
            lines.append("in-process P2P (control, one process, both GPUs): " + ", ".join(parts))
        else:
            lines.append("in-process P2P (control): " + _describe_reply(control))
    if "transports" in report:
        lines.append("fd transports between the two GPU processes:")
        for k, v in report["transports"].items():
            lines.append(f"  {k}: {'OK' if v['ok'] else 'FAILED at ' + str(v['failed_at'])}")
    if report.get("routes"):
        lines.append("routes (peer read: the importer sees the exporter's pattern; peer write: the reverse):")
        for r in report["routes"]:
            head = f"  {r['route']:<13} {r['direction']}: "
            if r["ok"]:
                lines.append(head + f"OK (peer read ok, peer write ok; {r['wall_ms']:.0f} ms)")
            else:
                lines.append(head + f"FAILED at {r['failed_at']}")
    restarts = [f"{s['at_s']:.1f} s" + ("" if s["ok"] else " FAILED") for s in report.get("pair_starts", [])[1:]]
    if restarts:
        lines.append(f"  (a fresh pair of GPU processes after each failed route, started at {', '.join(restarts)})")
    if report.get("skipped_routes"):
        lines.append(f"not run ({report['skipped_routes']['why']}): {', '.join(report['skipped_routes']['routes'])}")
    v = report["verdict"]
    if v["cross_process_peer_memory"] == "works":
        lines.append(
            "VERDICT: cross-process peer memory WORKS via "
            + ", ".join(v["working_routes"])
            + (
                f" (both directions: {', '.join(v['routes_working_both_directions'])})"
                if v["routes_working_both_directions"]
                else ""
            )
        )
    elif v["cross_process_peer_memory"] == "fails":
        lines.append("VERDICT: cross-process peer memory FAILS on every route tried (failed_at above)")
    elif v["cross_process_peer_memory"] == "one direction only":
        lines.append(
            "VERDICT: cross-process peer memory works in ONE direction only: " + ", ".join(v["working_routes"])
        )
    else:
        lines.append(f"VERDICT: not tested: {report.get('stop_reason', 'see the JSON')}")
    lines.append(f"probe took {report['wall_s']:.1f} s; JSON: {path}")
    return "\n".join(lines)


def _json_default(value):
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    return repr(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for ipc_probe.json (created if missing)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "ipc_probe.json")

    os.environ.update(NVLS_OFF)  # inherited by the spawned children
    clock = _Clock(TOTAL_BUDGET_S)
    report: dict = {
        "probe": "ipc_probe",
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "limits_s": {
            "startup_step": STEP_TIMEOUT_S,
            "route_step": ROUTE_STEP_TIMEOUT_S,
            "total": TOTAL_BUDGET_S,
            "socket": SOCKET_TIMEOUT_S,
        },
        "children_env": dict(NVLS_OFF),
        "host": _host_facts(),
    }
    tmp = tempfile.mkdtemp(prefix="ipcprobe-", dir="/tmp")
    try:
        _probe(report, clock, tmp)
    except Exception as e:
        report["probe_error"] = {"exception": _exc(e), "traceback": traceback.format_exc()}
        report.setdefault("stop_reason", f"the probe itself failed: {_exc(e)}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report["wall_s"] = round(clock.elapsed(), 3)
    report["verdict"] = _verdict(report)
    # the verdict first in the file
    ordered = {"verdict": report.pop("verdict"), **report}
    with open(path + ".tmp", "w") as f:
        json.dump(ordered, f, indent=1, default=_json_default)
        f.write("\n")
    os.replace(path + ".tmp", path)
    print(_summary(ordered, path), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # never wait on a child stuck in the driver (multiprocessing's exit handler would)
