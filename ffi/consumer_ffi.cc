// XLA FFI handlers that launch the CuTe-DSL consumer cubins (oproj_jax/cute/ABI.md) from JAX.
//
// Built with g++ only (oproj_jax/ffi.py): cuda.h is included for its types, the few driver
// entry points are resolved from libcuda.so.1 with dlopen at first use. Three targets (oneshot,
// ready, twoshot: see oproj_jax/cute/ABI.md), each with two stages:
//   initialize  loads the cubin once per (CUDA context, cubin, entry), cached under a mutex, and
//               sets the max dynamic shared memory and the non-portable cluster attribute;
//   execute     cuLaunchKernelEx: grid (7, T, 1), cluster (7, 1, 1), PDL (plus a stream-ordered
//               copy where XLA did not alias an in-place operand). No allocation, no
//               synchronization: safe inside CUDA-graph capture (XLA command buffers).
//
// `status` and `hints` are caller-owned 1-element buffers passed in and returned (aliased):
// the kernel only ever *sets* status (nonzero = a slot was not published within spin_limit
// polling rounds) and *adds* to hints, so the caller zeroes them (or carries them through a
// loop: status is then sticky and is checked once, hints counts every publishing warp).
// The host cannot read status right after the launch without a sync; Python reads the
// returned buffer when it wants to know (oproj_jax.cute.backend.check_status).
#include <dlfcn.h>
#include <cuda.h>

#include <cstdint>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr unsigned kCluster = 7;  // CTAs per token: 7 * 128 threads * 8 elements = H = 7168

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
  }
};

Driver& driver() {
  static Driver d;
  return d;
}

// "<kernel entry>: <call>: CUDA_ERROR_X (description)"
ffi::Error CudaError(CUresult result, std::string_view entry, std::string_view call) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (driver().GetErrorName) driver().GetErrorName(result, &name);
  if (driver().GetErrorString) driver().GetErrorString(result, &text);
  return ffi::Error::Internal(std::string(entry) + ": " + std::string(call) + ": " +
                              (name ? name : "CUDA error " + std::to_string(int(result))) + " (" +
                              (text ? text : "no description") + ")");
}

// ---- module cache: one CUfunction per (context, cubin path, entry) -----------------------------
std::mutex cache_mutex;
std::map<std::string, std::string> cubin_images;  // path -> file bytes (kept: modules are loaded from it)
std::map<std::tuple<CUcontext, std::string, std::string>, CUfunction> functions;

ffi::ErrorOr<CUfunction> GetFunction(std::string_view cubin, std::string_view entry, int64_t smem) {
  if (!driver().error.empty()) return ffi::Error::Internal(std::string(entry) + ": libcuda: " + driver().error);
  CUcontext ctx = nullptr;  // cuCtxGetCurrent (not cuStreamGetCtx) also works during capture
  if (CUresult r = driver().CtxGetCurrent(&ctx)) return CudaError(r, entry, "cuCtxGetCurrent");
  if (!ctx) return ffi::Error::Internal(std::string(entry) + ": no current CUDA context");
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto key = std::make_tuple(ctx, std::string(cubin), std::string(entry));
  if (auto it = functions.find(key); it != functions.end()) return it->second;

  std::string& image = cubin_images[std::string(cubin)];
  if (image.empty()) {
    std::ifstream file{std::string(cubin), std::ios::binary};
    image.assign(std::istreambuf_iterator<char>(file), {});
    if (image.empty())
      return ffi::Error::InvalidArgument(std::string(entry) + ": cannot read cubin '" + std::string(cubin) +
                                         "' (build it: python -m oproj_jax.cute.build)");
  }
  CUmodule module = nullptr;
  CUfunction fn = nullptr;
  if (CUresult r = driver().ModuleLoadData(&module, image.data())) return CudaError(r, entry, "cuModuleLoadData");
  if (CUresult r = driver().ModuleGetFunction(&fn, module, std::string(entry).c_str()))
    return CudaError(r, entry, "cuModuleGetFunction");
  if (CUresult r = driver().FuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(smem)))
    return CudaError(r, entry, "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)");
  if (CUresult r = driver().FuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))
    return CudaError(r, entry, "cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED)");
  functions.emplace(std::move(key), fn);
  return fn;
}

// ---- launch -----------------------------------------------------------------------------------
struct LaunchSpec {
  std::string_view cubin, entry;
  int64_t smem, block;
  bool pdl;
  int64_t tokens;
};

ffi::Error Launch(CUstream stream, const LaunchSpec& spec, void** params) {
  // Loaded in the initialize stage; this lookup only hits the cache (no module load here).
  auto fn = GetFunction(spec.cubin, spec.entry, spec.smem);
  if (fn.has_error()) return fn.error();
  CUlaunchAttribute attrs[2] = {};
  attrs[0].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
  attrs[0].value.clusterDim.x = kCluster;
  attrs[0].value.clusterDim.y = 1;
  attrs[0].value.clusterDim.z = 1;
  attrs[1].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attrs[1].value.programmaticStreamSerializationAllowed = spec.pdl ? 1 : 0;
  CUlaunchConfig config = {};
  config.gridDimX = kCluster;
  config.gridDimY = unsigned(spec.tokens);
  config.gridDimZ = 1;
  config.blockDimX = unsigned(spec.block);
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = unsigned(spec.smem);
  config.hStream = stream;
  config.attrs = attrs;
  config.numAttrs = 2;
  if (CUresult r = driver().LaunchKernelEx(&config, *fn, params, nullptr)) return CudaError(r, spec.entry, "cuLaunchKernelEx");
  return ffi::Error::Success();
}

// ---- in-place operands ------------------------------------------------------------------------
// The kernel reads and writes one pointer per in-place operand (prefix, mailbox, hints, status),
// so the result must hold the operand's values. XLA usually gives both the same buffer (the
// alias), but not always: a dynamic-slice fusion (a scan body writing the result straight into
// the stacked ys) hands over a different result buffer. Then copy first, on the same stream (a
// memcpy node under graph capture), so the kernel still reads what the caller passed.
ffi::Error InPlace(CUstream stream, std::string_view entry, const char* name, const void* in, void* out,
                   size_t bytes) {
  if (in == out || bytes == 0) return ffi::Error::Success();
  if (CUresult r = driver().MemcpyDtoDAsync(CUdeviceptr(out), CUdeviceptr(in), bytes, stream))
    return CudaError(r, entry, std::string("cuMemcpyDtoDAsync(") + name + ")");
  return ffi::Error::Success();
}

template <typename In, typename Out>
ffi::Error InPlace(CUstream stream, std::string_view entry, const char* name, const In& in, Out& out,
                   size_t element_bytes) {
  return InPlace(stream, entry, name, in.untyped_data(), out->untyped_data(), in.element_count() * element_bytes);
}

// ---- shape checks (host side, from the buffer descriptors; no device access) ------------------
std::string Shape(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

ffi::Error ShapeError(std::string_view entry, std::string_view name, std::string_view expected,
                      ffi::Span<const int64_t> got) {
  return ffi::Error::InvalidArgument(std::string(entry) + ": " + std::string(name) + ": expected shape " +
                                     std::string(expected) + ", got " + Shape(got));
}

using Bf16_1 = ffi::Buffer<ffi::BF16, 1>;
using Bf16_2 = ffi::Buffer<ffi::BF16, 2>;
using Bf16_3 = ffi::Buffer<ffi::BF16, 3>;
using Counter = ffi::Buffer<ffi::U32, 1>;
using Status = ffi::Buffer<ffi::S32, 1>;
using Scratch = ffi::Buffer<ffi::U32, 1>;

// Checks the operands every target shares; returns T. `slots` is mailbox [R, T, H] (oneshot,
// ready) or the gather row [1, T, H] (twoshot).
ffi::ErrorOr<int64_t> CheckInputs(std::string_view entry, const Bf16_3& slots, const Bf16_2& prefix,
                                  const Bf16_3& blocks, const Bf16_1& norm, const Bf16_1& query,
                                  const Bf16_1& out_norm, const ffi::Result<Bf16_2>& output,
                                  const ffi::Result<Bf16_3>& xmoe) {
  auto p = prefix.dimensions();
  const int64_t T = p[0], H = p[1];
  if (T < 1 || T > 65535) return ShapeError(entry, "prefix", "[T, H] with 1 <= T <= 65535 (grid.y)", p);
  if (H != int64_t(kCluster) * 1024) return ShapeError(entry, "prefix", "[T, 7168]", p);
  auto m = slots.dimensions();
  if (m[1] != T || m[2] != H) return ShapeError(entry, "mailbox", "[R, T, H] with T, H of prefix", m);
  auto b = blocks.dimensions();
  if (b[0] != T || b[2] != H) return ShapeError(entry, "blocks", "[T, NB, H] with T, H of prefix", b);
  for (auto [name, w] : {std::pair{"norm", &norm}, std::pair{"query", &query}, std::pair{"out_norm", &out_norm}})
    if (w->dimensions()[0] != H) return ShapeError(entry, name, "[H] = [7168]", w->dimensions());
  auto o = output->dimensions();
  if (o[0] != T || o[1] != H) return ShapeError(entry, "output", "[T, H] of prefix", o);
  auto x = xmoe->dimensions();
  if (x[1] != T || x[2] != H) return ShapeError(entry, "xmoe", "[reps, T, H] with T, H of prefix", x);
  return T;
}

// The above plus the caller-owned flags of the protocol targets (oneshot, twoshot).
ffi::ErrorOr<int64_t> CheckCommon(std::string_view entry, const Bf16_3& slots, const Bf16_2& prefix,
                                  const Bf16_3& blocks, const Bf16_1& norm, const Bf16_1& query,
                                  const Bf16_1& out_norm, const ffi::Result<Bf16_2>& output,
                                  const ffi::Result<Bf16_3>& xmoe, const Counter& hints, const Status& status) {
  if (hints.dimensions()[0] != 1) return ShapeError(entry, "hints", "[1]", hints.dimensions());
  if (status.dimensions()[0] != 1) return ShapeError(entry, "status", "[1]", status.dimensions());
  return CheckInputs(entry, slots, prefix, blocks, norm, query, out_norm, output, xmoe);
}

// A zero-size buffer may have no storage: the kernel ignores such operands, but still wants a
// valid pointer (cute/ABI.md: blocks when NB = 0, xmoe when reps = 0).
void* OrValid(void* maybe, size_t count, void* valid) { return count ? maybe : valid; }

// The kernel parameters in cute/ABI.md order: 0..13 for every target, 14..16 for twoshot.
// cuLaunchKernelEx takes the address of each value, so they live here for the launch.
struct KernelParams {
  void* ptr[12];
  float eps, out_eps;
  int32_t tokens, spin_limit, me = 0;
  void* params[17];

  KernelParams(void* slots, void* prefix, const Bf16_3& blocks, const Bf16_1& norm, const Bf16_1& query,
               const Bf16_1& out_norm, ffi::Result<Bf16_2>& output, ffi::Result<Bf16_3>& xmoe, void* hints,
               void* status, float eps_, float out_eps_, int32_t tokens_, int32_t spin_limit_)
      : ptr{slots,
            prefix,
            OrValid(blocks.untyped_data(), blocks.element_count(), prefix),
            norm.untyped_data(),
            query.untyped_data(),
            out_norm.untyped_data(),
            output->untyped_data(),
            OrValid(xmoe->untyped_data(), xmoe->element_count(), output->untyped_data()),
            hints,
            status,
            nullptr,
            nullptr},
        eps(eps_), out_eps(out_eps_), tokens(tokens_), spin_limit(spin_limit_),
        params{&ptr[0], &ptr[1], &ptr[2], &ptr[3], &ptr[4], &ptr[5], &ptr[6], &ptr[7], &ptr[8],
               &ptr[9], &eps,    &out_eps, &tokens, &spin_limit, &ptr[10], &ptr[11], &me} {}

  KernelParams(const KernelParams&) = delete;  // `params` points into this object

  // twoshot: the receive slots, the gather target and this rank's slice
  void** Twoshot(void* recv, void* gather_target, int32_t me_) {
    ptr[10] = recv;
    ptr[11] = gather_target;
    me = me_;
    return params;
  }
};

// ---- oneshot: mailbox [R, T, H] ----------------------------------------------------------------
ffi::Error OneshotExecute(CUstream stream,
                          Bf16_3 mailbox,  // [R, T, H] rank slots: polled, then re-armed in place
                          Bf16_2 prefix,   // [T, H] read when has_delta, always written (in place)
                          Bf16_3 blocks,   // [T, NB, H] completed blocks
                          Bf16_1 norm,     // [H] AttnRes key RMSNorm weight
                          Bf16_1 query,    // [H] AttnRes pseudo-query
                          Bf16_1 out_norm, // [H] next sub-layer's RMSNorm weight
                          Counter hints,   // [1] u32, added to by every publishing warp (reps > 0)
                          Status status,   // [1] i32, set nonzero if polling gave up
                          ffi::Result<Bf16_3> mailbox_out,  // aliases mailbox
                          ffi::Result<Bf16_2> prefix_out,   // aliases prefix
                          ffi::Result<Bf16_2> output,       // [T, H] the normalized hidden state
                          ffi::Result<Bf16_3> xmoe,         // [reps, T, H] sanitized replicas
                          ffi::Result<Counter> hints_out,   // aliases hints
                          ffi::Result<Status> status_out,   // aliases status
                          std::string_view cubin, std::string_view entry, int64_t smem, int64_t block,
                          float eps, float out_eps, int32_t spin_limit, bool pdl) {
  auto tokens = CheckCommon(entry, mailbox, prefix, blocks, norm, query, out_norm, output, xmoe, hints, status);
  if (tokens.has_error()) return tokens.error();
  int32_t T = int32_t(*tokens);
  for (auto error : {InPlace(stream, entry, "mailbox", mailbox, mailbox_out, 2),
                     InPlace(stream, entry, "prefix", prefix, prefix_out, 2),
                     InPlace(stream, entry, "hints", hints, hints_out, 4),
                     InPlace(stream, entry, "status", status, status_out, 4)})
    if (error.failure()) return error;
  KernelParams params(mailbox_out->untyped_data(), prefix_out->untyped_data(), blocks, norm, query, out_norm, output,
                      xmoe, hints_out->untyped_data(), status_out->untyped_data(), eps, out_eps, T, spin_limit);
  return Launch(stream, {cubin, entry, smem, block, pdl, T}, params.params);
}

// ---- ready: mailbox [R, T, H] produced by XLA before the launch; read once, never written ------
ffi::Error ReadyExecute(CUstream stream,
                        Bf16_3 mailbox,  // [R, T, H] rank slots, complete: read only (no poll, no re-arm)
                        Bf16_2 prefix,   // [T, H] read when has_delta, always written (in place)
                        Bf16_3 blocks,   // [T, NB, H] completed blocks
                        Bf16_1 norm,     // [H] AttnRes key RMSNorm weight
                        Bf16_1 query,    // [H] AttnRes pseudo-query
                        Bf16_1 out_norm, // [H] next sub-layer's RMSNorm weight
                        ffi::Result<Bf16_2> prefix_out,  // aliases prefix
                        ffi::Result<Bf16_2> output,      // [T, H] the normalized hidden state
                        ffi::Result<Bf16_3> xmoe,        // [reps, T, H] sanitized replicas
                        ffi::Result<Scratch> scratch,    // [2] u32: hints counter, status word (unread)
                        std::string_view cubin, std::string_view entry, int64_t smem, int64_t block,
                        float eps, float out_eps, int32_t spin_limit, bool pdl) {
  auto T = CheckInputs(entry, mailbox, prefix, blocks, norm, query, out_norm, output, xmoe);
  if (T.has_error()) return T.error();
  if (scratch->dimensions()[0] != 2) return ShapeError(entry, "scratch", "[2]", scratch->dimensions());
  if (spin_limit >= 0)
    return ffi::Error::InvalidArgument(std::string(entry) + ": spin_limit: the ready target needs < 0, got " +
                                       std::to_string(spin_limit));
  if (auto error = InPlace(stream, entry, "prefix", prefix, prefix_out, 2); error.failure()) return error;
  int32_t tokens = int32_t(*T);
  auto* words = static_cast<uint32_t*>(scratch->untyped_data());
  KernelParams params(mailbox.untyped_data(), prefix_out->untyped_data(), blocks, norm, query, out_norm, output,
                      xmoe, words, words + 1, eps, out_eps, tokens, spin_limit);
  return Launch(stream, {cubin, entry, smem, block, pdl, tokens}, params.params);
}

// ---- twoshot: gather row [1, T, H] + receive slots [R, T, H/R] ---------------------------------
ffi::Error TwoshotExecute(CUstream stream,
                          Bf16_3 gather,   // [1, T, H] gather row: the kernel's one-slot mailbox
                          Bf16_2 prefix,   // [T, H] read when has_delta, always written (in place)
                          Bf16_3 blocks,   // [T, NB, H] completed blocks
                          Bf16_1 norm,     // [H] AttnRes key RMSNorm weight
                          Bf16_1 query,    // [H] AttnRes pseudo-query
                          Bf16_1 out_norm, // [H] next sub-layer's RMSNorm weight
                          Counter hints,   // [1] u32, added to by every publishing warp (reps > 0)
                          Status status,   // [1] i32, set nonzero if polling gave up
                          Bf16_3 recv,     // [R, T, H/R] every rank's partial of this rank's columns
                          ffi::Result<Bf16_3> gather_out,   // aliases gather
                          ffi::Result<Bf16_2> prefix_out,   // aliases prefix
                          ffi::Result<Bf16_2> output,       // [T, H] the normalized hidden state
                          ffi::Result<Bf16_3> xmoe,         // [reps, T, H] sanitized replicas
                          ffi::Result<Counter> hints_out,   // aliases hints
                          ffi::Result<Status> status_out,   // aliases status
                          ffi::Result<Bf16_3> recv_out,     // aliases recv
                          std::string_view cubin, std::string_view entry, int64_t smem, int64_t block,
                          float eps, float out_eps, int32_t spin_limit, bool pdl, int32_t me) {
  auto tokens = CheckCommon(entry, gather, prefix, blocks, norm, query, out_norm, output, xmoe, hints, status);
  if (tokens.has_error()) return tokens.error();
  int32_t T = int32_t(*tokens);
  auto g = gather.dimensions();
  if (g[0] != 1) return ShapeError(entry, "gather", "[1, T, H]", g);
  auto r = recv.dimensions();
  const int64_t H = g[2];
  if (r[0] < 1 || r[1] != T || r[0] * r[2] != H) return ShapeError(entry, "recv", "[R, T, H/R]", r);
  if (me < 0 || me >= r[0])
    return ffi::Error::InvalidArgument(std::string(entry) + ": me: expected 0 <= me < R = " + std::to_string(r[0]) +
                                       ", got " + std::to_string(me));
  for (auto error : {InPlace(stream, entry, "gather", gather, gather_out, 2),
                     InPlace(stream, entry, "prefix", prefix, prefix_out, 2),
                     InPlace(stream, entry, "hints", hints, hints_out, 4),
                     InPlace(stream, entry, "status", status, status_out, 4),
                     InPlace(stream, entry, "recv", recv, recv_out, 2)})
    if (error.failure()) return error;
  KernelParams params(gather_out->untyped_data(), prefix_out->untyped_data(), blocks, norm, query, out_norm, output,
                      xmoe, hints_out->untyped_data(), status_out->untyped_data(), eps, out_eps, T, spin_limit);
  // one GPU: the gather target is the gather row itself
  return Launch(stream, {cubin, entry, smem, block, pdl, T},
                params.Twoshot(recv_out->untyped_data(), gather_out->untyped_data(), me));
}

// initialize stage: the same call frame (every attribute must be bound); loads the module.
ffi::Error Initialize(ffi::RemainingArgs, ffi::RemainingRets, std::string_view cubin, std::string_view entry,
                      int64_t smem, int64_t block, float, float, int32_t, bool) {
  if (block < 1 || block > 1024)
    return ffi::Error::InvalidArgument(std::string(entry) + ": block: expected 1..1024 threads, got " +
                                       std::to_string(block));
  auto fn = GetFunction(cubin, entry, smem);
  return fn.has_error() ? fn.error() : ffi::Error::Success();
}

ffi::Error TwoshotInitialize(ffi::RemainingArgs args, ffi::RemainingRets rets, std::string_view cubin,
                             std::string_view entry, int64_t smem, int64_t block, float eps, float out_eps,
                             int32_t spin_limit, bool pdl, int32_t) {
  return Initialize(args, rets, cubin, entry, smem, block, eps, out_eps, spin_limit, pdl);
}

}  // namespace

// The attributes every variant carries (names are matched, order is free).
#define OPROJ_ATTRS                                                                 \
  .Attr<std::string_view>("cubin")       /* absolute path of the variant's cubin */ \
      .Attr<std::string_view>("entry")   /* its kernel entry (mangled) name */      \
      .Attr<int64_t>("smem")             /* dynamic shared memory, bytes */         \
      .Attr<int64_t>("block")            /* threads per CTA = 128 * groups */       \
      .Attr<float>("eps")                /* AttnRes key RMSNorm epsilon */          \
      .Attr<float>("out_eps")            /* output RMSNorm epsilon */               \
      .Attr<int32_t>("spin_limit")       /* polling rounds; 0 = wait forever */     \
      .Attr<bool>("pdl")                 /* programmatic stream serialization */

#define OPROJ_BUFFERS                                                \
  .Arg<Bf16_3>()    /* mailbox [R, T, H] or gather row [1, T, H] */  \
      .Arg<Bf16_2>()  /* prefix [T, H] */                            \
      .Arg<Bf16_3>()  /* blocks [T, NB, H] */                        \
      .Arg<Bf16_1>()  /* norm [H] */                                 \
      .Arg<Bf16_1>()  /* query [H] */                                \
      .Arg<Bf16_1>()  /* out_norm [H] */                             \
      .Arg<Counter>() /* hints [1] u32 */                            \
      .Arg<Status>()  /* status [1] i32 */

#define OPROJ_RESULTS                                               \
  .Ret<Bf16_3>()    /* mailbox / gather row, re-armed (aliased) */  \
      .Ret<Bf16_2>()  /* prefix, updated (aliased) */               \
      .Ret<Bf16_2>()  /* output [T, H] */                           \
      .Ret<Bf16_3>()  /* xmoe [reps, T, H] */                       \
      .Ret<Counter>() /* hints (aliased) */                         \
      .Ret<Status>()  /* status (aliased) */

XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojOneshotInitialize, Initialize,
                              ffi::Ffi::BindInitialize().RemainingArgs().RemainingRets() OPROJ_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojOneshotExecute, OneshotExecute,
                              ffi::Ffi::Bind().Ctx<ffi::PlatformStream<CUstream>>() OPROJ_BUFFERS OPROJ_RESULTS
                                  OPROJ_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojReadyExecute, ReadyExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Arg<Bf16_3>()   /* mailbox [R, T, H], read only */
                                  .Arg<Bf16_2>()   /* prefix [T, H] */
                                  .Arg<Bf16_3>()   /* blocks [T, NB, H] */
                                  .Arg<Bf16_1>()   /* norm [H] */
                                  .Arg<Bf16_1>()   /* query [H] */
                                  .Arg<Bf16_1>()   /* out_norm [H] */
                                  .Ret<Bf16_2>()   /* prefix, updated (aliased) */
                                  .Ret<Bf16_2>()   /* output [T, H] */
                                  .Ret<Bf16_3>()   /* xmoe [reps, T, H] */
                                  .Ret<Scratch>()  /* [2] u32 scratch: hints, status */
                                      OPROJ_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojTwoshotInitialize, TwoshotInitialize,
                              ffi::Ffi::BindInitialize().RemainingArgs().RemainingRets() OPROJ_ATTRS
                                  .Attr<int32_t>("me"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojTwoshotExecute, TwoshotExecute,
                              ffi::Ffi::Bind().Ctx<ffi::PlatformStream<CUstream>>() OPROJ_BUFFERS
                                  .Arg<Bf16_3>()  /* recv [R, T, H/R] */
                                  OPROJ_RESULTS
                                  .Ret<Bf16_3>()  /* recv, re-armed (aliased) */
                                  OPROJ_ATTRS
                                  .Attr<int32_t>("me"),  /* this rank: owns columns [me*H/R, (me+1)*H/R) */
                              {ffi::Traits::kCmdBufferCompatible});
