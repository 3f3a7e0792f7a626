// The XLA FFI target that launches a Triton-compiled cubin of the consumer (oproj_jax/triton/
// library.py compiles it and names the launch in the call's attributes).
//
// Built into the package's one FFI library with the CuTe targets (common.h: the driver, the
// per-context module cache, the record API). A Triton kernel's parameters are device pointers
// only here (every size is a compile-time constant), in the order the `params` attribute gives:
// an index into the call's operands then results, or -1 for a null pointer (the global and
// profile scratch pointers Triton appends to every kernel, unused: the lowering refuses a kernel
// that needs either).
//   execute  the in-place copies (below), then cuLaunchKernelEx on XLA's stream;
//   record   the same as command-buffer nodes XLA owns: a memcpy node per in-place copy, the
//            kernel node after them; an update only rewrites their arguments.
// A programmatic (PDL) launch only where the call says so (`pdl`): the kernel must wait for the
// grid before it (griddepcontrol.wait) before reading anything, as kernel.py's sync kernel
// compiled with PDL does; any other kernel could read its inputs before they are written.
#include <cuda.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace oproj;

constexpr int kMaxParams = 32;
constexpr int kMaxCopies = 4;

// ---- in-place operands ------------------------------------------------------------------------
// `inplace` pairs (operand, result) whose result buffer the kernel reads as it was passed in
// (the sync kernels' arrival counters, zeroed by XLA before the call). XLA aliases them
// (input_output_aliases) and then there is nothing to do; where it hands a different result
// buffer (a fusion writing into a larger array), the plan copies the operand there first.
struct Plan {
  struct Copy {
    const void* src;
    void* dst;
    size_t bytes;
  };
  Copy copies[kMaxCopies];
  int n_copies = 0;
  void* ptr[kMaxParams] = {};
  int n_params = 0;
  std::string_view cubin, entry;
  int64_t smem = 0, block = 0;
  unsigned grid[3] = {1, 1, 1};
  bool pdl = false;

  Plan() = default;
  Plan(const Plan&) = delete;  // params() points into this object

  void** params() {
    for (int i = 0; i < n_params; ++i) addresses_[i] = &ptr[i];
    return addresses_;
  }
  std::vector<ffi::KernelArg> args() const {
    std::vector<ffi::KernelArg> out;
    for (int i = 0; i < n_params; ++i) out.push_back(ffi::DevicePointer{ptr[i]});
    return out;
  }

 private:
  void* addresses_[kMaxParams] = {};
};

ffi::Error Invalid(std::string_view entry, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(entry) + ": " + what);
}

ffi::Error PlanCall(Plan& plan, ffi::RemainingArgs args, ffi::RemainingRets rets, std::string_view cubin,
                    std::string_view entry, int64_t smem, int64_t block, ffi::Span<const int64_t> grid,
                    ffi::Span<const int64_t> params, ffi::Span<const int64_t> inplace, bool pdl) {
  plan.cubin = cubin, plan.entry = entry, plan.smem = smem, plan.block = block, plan.pdl = pdl;
  if (block < 32 || block > 1024 || block % 32)
    return Invalid(entry, "block: expected a multiple of 32 in 32..1024 threads, got " + std::to_string(block));
  if (smem < 0 || smem > 227 * 1024) return Invalid(entry, "smem: expected 0..232448 bytes, got " + std::to_string(smem));
  const int64_t limits[3] = {(int64_t(1) << 31) - 1, 65535, 65535};
  if (grid.size() != 3) return Invalid(entry, "grid: expected 3 values, got " + std::to_string(grid.size()));
  for (int i = 0; i < 3; ++i) {
    if (grid[i] < 1 || grid[i] > limits[i])
      return Invalid(entry, "grid[" + std::to_string(i) + "]: expected 1.." + std::to_string(limits[i]) + ", got " +
                                std::to_string(grid[i]));
    plan.grid[i] = unsigned(grid[i]);
  }
  const int64_t n_args = int64_t(args.size()), n_rets = int64_t(rets.size());
  auto pointer = [&](int64_t index) -> ffi::ErrorOr<void*> {
    if (index < n_args) {
      auto buffer = args.get<ffi::AnyBuffer>(index);
      if (buffer.has_error()) return buffer.error();
      return buffer->untyped_data();
    }
    auto buffer = rets.get<ffi::AnyBuffer>(index - n_args);
    if (buffer.has_error()) return buffer.error();
    return (*buffer)->untyped_data();
  };
  if (params.size() > size_t(kMaxParams))
    return Invalid(entry, "params: at most " + std::to_string(kMaxParams) + ", got " + std::to_string(params.size()));
  for (int64_t index : params) {
    if (index < -1 || index >= n_args + n_rets)
      return Invalid(entry, "params: expected -1 or an index below " + std::to_string(n_args + n_rets) + ", got " +
                                std::to_string(index));
    void* p = nullptr;
    if (index >= 0) {
      auto got = pointer(index);
      if (got.has_error()) return got.error();
      p = *got;
    }
    plan.ptr[plan.n_params++] = p;
  }
  if (inplace.size() % 2 || inplace.size() > size_t(2 * kMaxCopies))
    return Invalid(entry, "inplace: expected at most " + std::to_string(kMaxCopies) + " (operand, result) pairs");
  for (size_t i = 0; i < inplace.size(); i += 2) {
    const int64_t in = inplace[i], out = inplace[i + 1];
    if (in < 0 || in >= n_args || out < 0 || out >= n_rets)
      return Invalid(entry, "inplace: pair (" + std::to_string(in) + ", " + std::to_string(out) + ") out of range");
    auto src = args.get<ffi::AnyBuffer>(in);
    auto dst = rets.get<ffi::AnyBuffer>(out);
    if (src.has_error()) return src.error();
    if (dst.has_error()) return dst.error();
    if (src->size_bytes() != (*dst)->size_bytes())
      return Invalid(entry, "inplace: operand " + std::to_string(in) + " and result " + std::to_string(out) +
                                " differ in size");
    if (src->untyped_data() != (*dst)->untyped_data() && src->size_bytes())
      plan.copies[plan.n_copies++] = {src->untyped_data(), (*dst)->untyped_data(), src->size_bytes()};
  }
  return ffi::Error::Success();
}

ffi::Error Run(CUstream stream, Plan& plan) {
  for (int i = 0; i < plan.n_copies; ++i) {
    const auto& c = plan.copies[i];
    if (CUresult r = driver().MemcpyDtoDAsync(CUdeviceptr(c.dst), CUdeviceptr(c.src), c.bytes, stream))
      return CudaError(r, plan.entry, "cuMemcpyDtoDAsync(in-place operand)");
  }
  auto fn = GetFunction(plan.cubin, plan.entry, plan.smem, /*cluster=*/false);
  if (fn.has_error()) return fn.error();
  CUlaunchConfig config = {};
  config.gridDimX = plan.grid[0], config.gridDimY = plan.grid[1], config.gridDimZ = plan.grid[2];
  config.blockDimX = unsigned(plan.block), config.blockDimY = 1, config.blockDimZ = 1;
  config.sharedMemBytes = unsigned(plan.smem);
  config.hStream = stream;
  CUlaunchAttribute attr = {};
  attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attr.value.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attr;
  config.numAttrs = plan.pdl ? 1 : 0;
  if (CUresult r = driver().LaunchKernelEx(&config, *fn, plan.params(), nullptr))
    return CudaError(r, plan.entry, "cuLaunchKernelEx");
  return ffi::Error::Success();
}

ffi::Error Record(RecordContext ctx, Plan& plan) {
  auto commands = ctx.commands();
  if (ctx.action() == ffi::RecordAction::kUpdate) {
    if (commands.size() != size_t(plan.n_copies + 1))
      return ffi::Error::Internal(std::string(plan.entry) + ": recorded " + std::to_string(commands.size()) +
                                  " commands, the update has " + std::to_string(plan.n_copies + 1));
    for (int i = 0; i < plan.n_copies; ++i) {
      const auto& c = plan.copies[i];
      if (auto e = ctx.UpdateMemcpyD2D(commands[i], c.dst, const_cast<void*>(c.src), c.bytes); e.failure()) return e;
    }
    return ctx.UpdateLaunch(commands[plan.n_copies], plan.args());
  }
  if (commands.capacity() < size_t(plan.n_copies + 1)) {
    // XLA traces the execute stage instead: load the module now, outside the capture.
    auto fn = GetFunction(plan.cubin, plan.entry, plan.smem, /*cluster=*/false);
    return fn.has_error() ? fn.error() : ctx.RequestStreamCapture();
  }
  auto image = CubinImage(plan.cubin, plan.entry);
  if (image.has_error()) return image.error();
  std::vector<const XLA_FFI_Command*> copies;
  for (int i = 0; i < plan.n_copies; ++i) {
    const auto& c = plan.copies[i];
    auto command = ctx.CreateMemcpyD2D(c.dst, const_cast<void*>(c.src), c.bytes);
    if (command.has_error()) return command.error();
    copies.push_back(*command);
  }
  XLA_FFI_LaunchDims dims{{int32_t(plan.grid[0]), int32_t(plan.grid[1]), int32_t(plan.grid[2])},
                          {int32_t(plan.block), 1, 1},
                          {0, 0, 0}};  // no cluster
  auto launch = ctx.CreateLaunch(std::string(plan.entry).c_str(), (*image)->data(), (*image)->size(),
                                 ffi::SourceFormat::kCubin, dims, uint32_t(plan.smem), plan.pdl,
                                 plan.args(), copies);
  return launch.has_error() ? launch.error() : ffi::Error::Success();
}

#define TRITON_SIG                                                                                            \
  ffi::RemainingArgs args, ffi::RemainingRets rets, std::string_view cubin, std::string_view entry, int64_t smem, \
      int64_t block, ffi::Span<const int64_t> grid, ffi::Span<const int64_t> params,                            \
      ffi::Span<const int64_t> inplace, bool pdl
#define TRITON_ARGS args, rets, cubin, entry, smem, block, grid, params, inplace, pdl

ffi::Error Execute(CUstream stream, TRITON_SIG) {
  Plan plan;
  if (auto error = PlanCall(plan, TRITON_ARGS); error.failure()) return error;
  return Run(stream, plan);
}

ffi::Error RecordStage(RecordContext ctx, TRITON_SIG) {
  Plan plan;
  if (auto error = PlanCall(plan, TRITON_ARGS); error.failure()) return error;
  return Record(ctx, plan);
}

// Initialize (a traced execute only): loads the module ahead, never under stream capture.
ffi::Error Initialize(TRITON_SIG) {
  auto fn = GetFunction(cubin, entry, smem, /*cluster=*/false);
  return fn.has_error() ? fn.error() : ffi::Error::Success();
}

}  // namespace

#define TRITON_ATTRS                                                                              \
  .RemainingArgs()                                                                                \
      .RemainingRets()                                                                            \
      .Attr<std::string_view>("cubin")           /* absolute path of the kernel's cubin */       \
      .Attr<std::string_view>("entry")           /* its kernel entry name */                      \
      .Attr<int64_t>("smem")                     /* dynamic shared memory, bytes */               \
      .Attr<int64_t>("block")                    /* threads per program = 32 * num_warps */       \
      .Attr<ffi::Span<const int64_t>>("grid")    /* [x, y, z] programs */                         \
      .Attr<ffi::Span<const int64_t>>("params")  /* operand/result index per parameter, -1 null */ \
      .Attr<ffi::Span<const int64_t>>("inplace") /* (operand, result) pairs read in place */  \
      .Attr<bool>("pdl")                         /* programmatic dependent launch */

constexpr auto kCmdBuffer = ffi::Traits::kCmdBufferCompatible;

XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojTritonInitialize, Initialize, ffi::Ffi::BindInitialize() TRITON_ATTRS,
                              {kCmdBuffer});
XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojTritonExecute, Execute,
                              ffi::Ffi::Bind().Ctx<ffi::PlatformStream<CUstream>>() TRITON_ATTRS, {kCmdBuffer});
XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojTritonRecord, RecordStage,
                              ffi::Ffi::BindRecord().Ctx<ffi::Extension<RecordExtension>>() TRITON_ATTRS,
                              {kCmdBuffer});
