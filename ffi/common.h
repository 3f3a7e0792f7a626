// What every FFI target of the library shares: the CUDA driver (dlopen'ed libcuda), error
// formatting, the per-context module cache, XLA's record API and the target registration.
// The launch itself (a cubin, its launch shape and a typed parameter list) is launch.h's.
#pragma once

#include <dlfcn.h>
#include <cuda.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"
#include "xla/ffi/api/record_api.h"

namespace oproj {

namespace ffi = xla::ffi;


// ---- the driver, through dlopen (the JAX CUDA plugin has already mapped libcuda) ----------
struct Driver {
  decltype(&::cuGetErrorName) GetErrorName = nullptr;
  decltype(&::cuGetErrorString) GetErrorString = nullptr;
  decltype(&::cuCtxGetCurrent) CtxGetCurrent = nullptr;
  decltype(&::cuModuleLoadData) ModuleLoadData = nullptr;
  decltype(&::cuModuleGetFunction) ModuleGetFunction = nullptr;
  decltype(&::cuFuncSetAttribute) FuncSetAttribute = nullptr;
  CUresult (*LaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**) = nullptr;
  decltype(&::cuMemcpyDtoDAsync) MemcpyDtoDAsync = nullptr;
  // mode="peer" (cute_peer.cc): the group's mailboxes, allocated and armed once per group
  decltype(&::cuDeviceGet) DeviceGet = nullptr;
  decltype(&::cuDeviceCanAccessPeer) DeviceCanAccessPeer = nullptr;
  decltype(&::cuDevicePrimaryCtxRetain) DevicePrimaryCtxRetain = nullptr;
  decltype(&::cuCtxGetDevice) CtxGetDevice = nullptr;
  decltype(&::cuCtxPushCurrent) CtxPushCurrent = nullptr;
  decltype(&::cuCtxPopCurrent) CtxPopCurrent = nullptr;
  decltype(&::cuCtxEnablePeerAccess) CtxEnablePeerAccess = nullptr;
  decltype(&::cuMemAlloc) MemAlloc = nullptr;
  decltype(&::cuMemFree) MemFree = nullptr;
  decltype(&::cuMemsetD32Async) MemsetD32Async = nullptr;
  decltype(&::cuStreamCreate) StreamCreate = nullptr;
  decltype(&::cuStreamSynchronize) StreamSynchronize = nullptr;
  decltype(&::cuStreamDestroy) StreamDestroy = nullptr;
  decltype(&::cuMemcpyHtoDAsync) MemcpyHtoDAsync = nullptr;
  decltype(&::cuMemcpyDtoHAsync) MemcpyDtoHAsync = nullptr;
  decltype(&::cuCtxSynchronize) CtxSynchronize = nullptr;
  decltype(&::cuDevicePrimaryCtxRelease) DevicePrimaryCtxRelease = nullptr;
  // mode="peer" across processes: a rank's mailbox exported and mapped by legacy CUDA IPC
  decltype(&::cuIpcGetMemHandle) IpcGetMemHandle = nullptr;
  decltype(&::cuIpcOpenMemHandle) IpcOpenMemHandle = nullptr;
  decltype(&::cuIpcCloseMemHandle) IpcCloseMemHandle = nullptr;
  std::string error;  // empty when every symbol resolved

  Driver() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      error = std::string("dlopen(libcuda.so.1) failed: ") + dlerror();
      return;
    }
    auto resolve = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (!fn) error += std::string(" missing symbol ") + name;
    };
    resolve(GetErrorName, "cuGetErrorName");
    resolve(GetErrorString, "cuGetErrorString");
    resolve(CtxGetCurrent, "cuCtxGetCurrent");
    resolve(ModuleLoadData, "cuModuleLoadData");
    resolve(ModuleGetFunction, "cuModuleGetFunction");
    resolve(FuncSetAttribute, "cuFuncSetAttribute");
    resolve(LaunchKernelEx, "cuLaunchKernelEx");
    resolve(MemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2");
    resolve(DeviceGet, "cuDeviceGet");
    resolve(DeviceCanAccessPeer, "cuDeviceCanAccessPeer");
    resolve(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    resolve(CtxGetDevice, "cuCtxGetDevice");
    resolve(CtxPushCurrent, "cuCtxPushCurrent_v2");
    resolve(CtxPopCurrent, "cuCtxPopCurrent_v2");
    resolve(CtxEnablePeerAccess, "cuCtxEnablePeerAccess");
    resolve(MemAlloc, "cuMemAlloc_v2");
    resolve(MemFree, "cuMemFree_v2");
    resolve(MemsetD32Async, "cuMemsetD32Async");
    resolve(StreamCreate, "cuStreamCreate");
    resolve(StreamSynchronize, "cuStreamSynchronize");
    resolve(StreamDestroy, "cuStreamDestroy_v2");
    resolve(MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
    resolve(MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
    resolve(CtxSynchronize, "cuCtxSynchronize");
    resolve(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    resolve(IpcGetMemHandle, "cuIpcGetMemHandle");
    resolve(IpcOpenMemHandle, "cuIpcOpenMemHandle_v2");
    resolve(IpcCloseMemHandle, "cuIpcCloseMemHandle");
  }
};

inline Driver& driver() {
  static Driver d;
  return d;
}

// "<kernel entry>: <call>: CUDA_ERROR_X (description)"
inline ffi::Error CudaError(CUresult result, std::string_view entry, std::string_view call) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (driver().GetErrorName) driver().GetErrorName(result, &name);
  if (driver().GetErrorString) driver().GetErrorString(result, &text);
  return ffi::Error::Internal(std::string(entry) + ": " + std::string(call) + ": " +
                              (name ? name : "CUDA error " + std::to_string(int(result))) + " (" +
                              (text ? text : "no description") + ")");
}

// ---- module cache (common.cc) ------------------------------------------------------------------
// The kernel of (current context, cubin path, entry), loaded on first use and cached for the
// process; max dynamic shared memory is set on load, and for a cluster launch the non-portable
// cluster size, an attribute GPUs before sm_90 refuse.
ffi::ErrorOr<CUfunction> GetFunction(std::string_view cubin, std::string_view entry, int64_t smem, bool cluster);

// The bytes of a cubin file, read once and kept for the process (the record stage hands them to
// XLA, which loads its own module from them).
ffi::ErrorOr<const std::string*> CubinImage(std::string_view cubin, std::string_view entry);

// ---- the record stage ---------------------------------------------------------------------------
// XLA's command-buffer recording API (xla/ffi/api/record_api.h): a handler's record stage adds
// kernel / memcpy nodes to XLA's CUDA graph and later updates their arguments in place.
using RecordContext = ffi::internal::RecordContextBase<ffi::internal::ErrorPolicy>;
struct RecordExtension : ffi::internal::RecordExtensionBase<RecordContext> {};

// ---- target registration --------------------------------------------------------------------------
// jax.ffi.register_ffi_target passes only the instantiate/prepare/initialize/execute stages to
// the CUDA plugin, not the record stage. So Python registers and runs one bootstrap call,
// OprojRegisterTargets (common.cc), on a CUDA device; its attributes carry the library's target
// table (names, the five stage handlers of each as addresses, traits: oproj_jax/ffi.py),
// which it hands to the XLA runtime's XLA_FFI_Handler_Register.
//
// A handler whose stages keep per-call-site state (ffi::State<T>) names its type here, from a
// static initializer (dlopen time): the bootstrap registers every such type with the XLA
// runtime before the targets, which fills in T::id.
struct StateType {
  const char* name;
  XLA_FFI_TypeId* id;
  XLA_FFI_TypeInfo info;
};
bool AddStateType(StateType type);

}  // namespace oproj
