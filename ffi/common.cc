#include "common.h"

#include <algorithm>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <cstring>
#include <vector>

namespace oproj {

namespace {
std::mutex cache_mutex;  // guards the maps below (the fast path of GetFunction does not lock)
std::map<std::string, std::string> cubin_images;  // path -> file bytes (kept: modules are loaded from it)
std::map<std::tuple<CUcontext, std::string, std::string>, CUfunction> functions;
}  // namespace

ffi::ErrorOr<CUfunction> LoadFunction(std::string_view cubin, std::string_view entry, int64_t smem, bool cluster);

// ---- module cache: one CUfunction per (context, cubin path, entry) -----------------------------
ffi::ErrorOr<CUfunction> GetFunction(std::string_view cubin, std::string_view entry, int64_t smem, bool cluster) {
  if (!driver().error.empty()) return ffi::Error::Internal(std::string(entry) + ": libcuda: " + driver().error);
  CUcontext ctx = nullptr;  // cuCtxGetCurrent (not cuStreamGetCtx) also works during capture
  if (CUresult r = driver().CtxGetCurrent(&ctx)) return CudaError(r, entry, "cuCtxGetCurrent");
  if (!ctx) return ffi::Error::Internal(std::string(entry) + ": no current CUDA context");
  // Lock-free fast path: a call site asks for the same kernels on every execution, from XLA's
  // thread for its device; the last few answers per thread are kept (no allocation, no lock).
  // Several: a peer call launches two kernels, a step several call sites.
  struct Hit {
    CUcontext ctx = nullptr;
    std::string cubin, entry;
    CUfunction fn = nullptr;
  };
  thread_local Hit last[4];
  thread_local unsigned next = 0;
  for (const Hit& hit : last)
    if (hit.fn && hit.ctx == ctx && hit.entry == entry && hit.cubin == cubin) return hit.fn;
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto key = std::make_tuple(ctx, std::string(cubin), std::string(entry));
  auto it = functions.find(key);
  if (it == functions.end()) {
    auto loaded = LoadFunction(cubin, entry, smem, cluster);
    if (loaded.has_error()) return loaded.error();
    it = functions.emplace(std::move(key), *loaded).first;
  }
  Hit& slot = last[next++ % 4];
  slot.ctx = ctx, slot.cubin = cubin, slot.entry = entry, slot.fn = it->second;
  return it->second;
}

ffi::ErrorOr<const std::string*> ImageLocked(std::string_view cubin, std::string_view entry) {
  std::string& image = cubin_images[std::string(cubin)];
  if (image.empty()) {
    std::ifstream file{std::string(cubin), std::ios::binary};
    image.assign(std::istreambuf_iterator<char>(file), {});
    if (image.empty())
      return ffi::Error::InvalidArgument(std::string(entry) + ": cannot read cubin '" + std::string(cubin) +
                                         "' (the call names it from where it was when the call was traced; "
                                         "python -m oproj_jax.build builds the prebuilt ones)");
  }
  return &image;
}

ffi::ErrorOr<const std::string*> CubinImage(std::string_view cubin, std::string_view entry) {
  std::lock_guard<std::mutex> lock(cache_mutex);
  return ImageLocked(cubin, entry);
}

// Loads the module into the current context (cache_mutex held).
ffi::ErrorOr<CUfunction> LoadFunction(std::string_view cubin, std::string_view entry, int64_t smem, bool cluster) {
  auto image = ImageLocked(cubin, entry);
  if (image.has_error()) return image.error();
  CUmodule module = nullptr;
  CUfunction fn = nullptr;
  if (CUresult r = driver().ModuleLoadData(&module, (*image)->data())) return CudaError(r, entry, "cuModuleLoadData");
  if (CUresult r = driver().ModuleGetFunction(&fn, module, std::string(entry).c_str()))
    return CudaError(r, entry, "cuModuleGetFunction");
  if (CUresult r = driver().FuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(smem)))
    return CudaError(r, entry, "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)");
  if (!cluster) return fn;
  if (CUresult r = driver().FuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))
    return CudaError(r, entry, "cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED)");
  return fn;
}

}  // namespace oproj

namespace {
namespace ffi = xla::ffi;

struct Target {
  std::string name;
  XLA_FFI_Handler_Bundle bundle;
  XLA_FFI_Handler_Traits traits;
};
thread_local std::vector<Target> decoded;  // the bootstrap call's table, decoded on this thread
std::string registration_error;            // the registration's outcome, reported by every call
constexpr int kStages = 5;                 // instantiate, prepare, initialize, execute, record

using Word = ffi::Buffer<ffi::U32, 1>;

// The bootstrap's typed handler: decodes the table (its output is never written).
ffi::Error DecodeTable(ffi::Result<Word>, std::string_view names, ffi::Span<const int64_t> handlers,
                       ffi::Span<const int64_t> traits) {
  decoded.clear();
  for (size_t start = 0; start < names.size();) {
    size_t end = std::min(names.find(',', start), names.size());
    decoded.push_back({std::string(names.substr(start, end - start)), {}, 0});
    start = end + 1;
  }
  if (handlers.size() != decoded.size() * kStages || traits.size() != decoded.size())
    return ffi::Error::InvalidArgument("oproj_jax bootstrap: expected 5 handlers and 1 traits word per target name");
  for (size_t i = 0; i < decoded.size(); ++i) {
    auto stage = [&](int k) { return reinterpret_cast<XLA_FFI_Handler*>(handlers[i * kStages + k]); };
    decoded[i].bundle = {stage(0), stage(1), stage(2), stage(3), stage(4)};
    decoded[i].traits = XLA_FFI_Handler_Traits(traits[i]);
    if (!decoded[i].bundle.execute)
      return ffi::Error::InvalidArgument("oproj_jax bootstrap: target " + decoded[i].name + " has no execute stage");
  }
  if (!registration_error.empty()) return ffi::Error::Internal("oproj_jax: " + registration_error);
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER(BootstrapTyped, DecodeTable,
                       ffi::Ffi::Bind()
                           .Ret<Word>()
                           .Attr<std::string_view>("names")            // comma-separated target names
                           .Attr<ffi::Span<const int64_t>>("handlers")  // 5 stage handler addresses each, 0: none
                           .Attr<ffi::Span<const int64_t>>("traits"));  // XLA_FFI_Handler_Traits each

std::vector<oproj::StateType>& StateTypes() {
  static std::vector<oproj::StateType> types;
  return types;
}

void RegisterAll(const XLA_FFI_Api* api) {
  for (auto& type : StateTypes())
    if (XLA_FFI_Error* error = ffi::Ffi::RegisterTypeId(api, type.name, type.id, type.info)) {
      registration_error =
          std::string("registering the state type ") + type.name + ": " + ffi::internal::GetErrorMessage(api, error);
      ffi::internal::DestroyError(api, error);
      return;
    }
  for (const auto& target : decoded) {
    XLA_FFI_Handler_Register_Args args;
    args.struct_size = XLA_FFI_Handler_Register_Args_STRUCT_SIZE;
    args.extension_start = nullptr;
    args.name = XLA_FFI_ByteSpan{target.name.data(), target.name.size()};
    args.platform = XLA_FFI_ByteSpan{"CUDA", 4};
    args.bundle = target.bundle;
    args.traits = target.traits;
    if (XLA_FFI_Error* error = api->XLA_FFI_Handler_Register(&args)) {
      registration_error = "registering FFI target " + target.name + ": " + ffi::internal::GetErrorMessage(api, error);
      ffi::internal::DestroyError(api, error);
      return;
    }
  }
}

XLA_FFI_Error* MakeError(const XLA_FFI_Api* api, const std::string& message) {
  XLA_FFI_Error_Create_Args args;
  args.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  args.extension_start = nullptr;
  args.message = message.c_str();
  args.errc = XLA_FFI_Error_Code_INTERNAL;
  return api->XLA_FFI_Error_Create(&args);
}
}  // namespace

bool oproj::AddStateType(StateType type) {
  StateTypes().push_back(type);
  return true;
}

// The bootstrap call: registers the decoded table with the XLA runtime that calls it, once per
// process (a second registration of a name would fail); every call reports the outcome.
extern "C" XLA_FFI_Error* OprojRegisterTargets(XLA_FFI_CallFrame* frame) {
  if (XLA_FFI_Error* error = BootstrapTyped(frame)) return error;  // metadata queries end here too
  bool metadata = frame->extension_start != nullptr && frame->extension_start->type == XLA_FFI_Extension_Metadata;
  if (metadata || frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return nullptr;
  static std::once_flag once;
  std::call_once(once, [&] { RegisterAll(frame->api); });
  return registration_error.empty() ? nullptr : MakeError(frame->api, "oproj_jax: " + registration_error);
}
