// The generic launch (launch.h) and the library's launch targets, which every kernel but the peer
// mode's goes through: the CuTe consumer in each of its modes (oproj_jax/cute/backend.py) and the
// Triton kernels (oproj_jax/triton/library.py). Python names the cubin, the launch shape, the
// typed parameters and the in-place operands in the call's attributes:
//   instantiate (once per call site and executable) reads them into the site's state: the
//               launch shape and every parameter but the buffers' addresses;
//   execute     binds the call's buffers into a copy of the site's launch, runs the in-place
//               copies, then cuLaunchKernelEx on XLA's stream (cluster and PDL
//               attributes where the call asks for them); the module is loaded on first use,
//               cached per (context, cubin, entry);
//   record      (inside an XLA command buffer, i.e. a CUDA graph) the same as graph nodes XLA
//               owns: a memcpy node per in-place copy, the kernel node after them; when XLA hands
//               new buffers it only rewrites their arguments (no capture, no re-instantiation);
//   initialize  (the traced twin, registered without a record stage: oproj_jax/ffi.py
//               LAUNCH_TRACED_TARGET says when Python names it) loads the module ahead, so that
//               XLA's stream capture of execute never loads one.
// No allocation and no synchronization in execute; a PDL launch only where the call says so: the
// kernel must wait for the grid before it (griddepcontrol.wait) before it reads anything.
#include "launch.h"

#include <cuda.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace oproj {

ffi::Error Invalid(std::string_view entry, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(entry) + ": " + what);
}

namespace {

// The address of the call's buffer `index` (operands, then results) plus `offset` bytes.
ffi::ErrorOr<void*> BufferAddress(ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t index, int64_t offset,
                                  std::string_view entry) {
  const int64_t n_args = int64_t(args.size()), n_rets = int64_t(rets.size());
  if (index < 0 || index >= n_args + n_rets)
    return Invalid(entry, "params: buffer " + std::to_string(index) + " of " + std::to_string(n_args + n_rets));
  void* data = nullptr;
  size_t bytes = 0;
  if (index < n_args) {
    auto got = args.get<ffi::AnyBuffer>(index);
    if (got.has_error()) return got.error();
    data = got->untyped_data(), bytes = offset ? got->size_bytes() : 0;
  } else {
    auto got = rets.get<ffi::AnyBuffer>(index - n_args);
    if (got.has_error()) return got.error();
    data = (*got)->untyped_data(), bytes = offset ? (*got)->size_bytes() : 0;
  }
  if (offset < 0 || (offset > 0 && size_t(offset) >= bytes))
    return Invalid(entry, "params: offset " + std::to_string(offset) + " outside buffer " + std::to_string(index) +
                              " (" + std::to_string(bytes) + " bytes)");
  return static_cast<char*>(data) + offset;
}

// Three values of a [x, y, z] attribute, each in [low, high[i]].
ffi::Error Dims3(std::string_view entry, const char* name, ffi::Span<const int64_t> got, int64_t low,
                 const int64_t (&high)[3], unsigned (&out)[3]) {
  if (got.size() != 3) return Invalid(entry, std::string(name) + ": expected [x, y, z], got " + std::to_string(got.size()) + " values");
  for (int i = 0; i < 3; ++i) {
    if (got[i] < low || got[i] > high[i])
      return Invalid(entry, std::string(name) + "[" + std::to_string(i) + "]: expected " + std::to_string(low) + ".." +
                                std::to_string(high[i]) + ", got " + std::to_string(got[i]));
    out[i] = unsigned(got[i]);
  }
  return ffi::Error::Success();
}

}  // namespace

// ---- Kernel -------------------------------------------------------------------------------------
ffi::Error Kernel::Shape(const LaunchAttrs& a) {
  cubin_ = a.cubin, entry_ = a.entry, pdl_ = a.pdl;
  // CUDA's limits (a launch past them fails in the driver with a less helpful error)
  if (auto e = Dims3(entry_, "grid", a.grid, 1, {(int64_t(1) << 31) - 1, 65535, 65535}, grid_); e.failure()) return e;
  if (auto e = Dims3(entry_, "block", a.block, 1, {1024, 1024, 64}, block_); e.failure()) return e;
  if (int64_t(block_[0]) * block_[1] * block_[2] > 1024)
    return Invalid(entry_, "block: at most 1024 threads per CTA");
  const bool none = a.cluster.size() == 3 && a.cluster[0] == 0 && a.cluster[1] == 0 && a.cluster[2] == 0;
  if (!none)
    if (auto e = Dims3(entry_, "cluster", a.cluster, 1, {16, 16, 16}, cluster_); e.failure()) return e;
  if (a.smem < 0 || a.smem > 227 * 1024)
    return Invalid(entry_, "smem: expected 0..232448 bytes, got " + std::to_string(a.smem));
  smem_ = uint32_t(a.smem);
  return ffi::Error::Success();
}

ffi::Error Kernel::Plan(const LaunchAttrs& a, ffi::RemainingArgs args, ffi::RemainingRets rets,
                        const Resolver* resolver) {
  if (auto e = Prepare(a, resolver); e.failure()) return e;
  return Bind(args, rets);
}

ffi::Error Kernel::Prepare(const LaunchAttrs& a, const Resolver* resolver) {
  if (auto e = Shape(a); e.failure()) return e;
  n_buffers_ = 0;
  if (a.params.size() % kParamWords || a.params.size() > size_t(kParamWords * kMaxParams))
    return Invalid(entry_, "params: expected (kind, value, extra) for at most " + std::to_string(kMaxParams) +
                               " parameters, got " + std::to_string(a.params.size()) + " words");
  n_params_ = int(a.params.size() / kParamWords);
  for (int i = 0; i < n_params_; ++i) {
    const int64_t kind = a.params[kParamWords * i], value = a.params[kParamWords * i + 1],
                  extra = a.params[kParamWords * i + 2];
    Param& p = params_[i];
    switch (kind) {
      case kNull:
        p = Param{};
        break;
      case kBuffer:
        p = Param{};
        buffers_[n_buffers_++] = {i, value, extra};
        break;
      case kU32:
      case kI32:
      case kF32:
        p = Param{uint64_t(uint32_t(value)), 4, false};
        break;
      case kU64:
        p = Param{uint64_t(value), 8, false};
        break;
      default:
        if (!resolver)
          return Invalid(entry_, "params: parameter " + std::to_string(i) + " has kind " + std::to_string(kind) +
                                     ", which this target does not resolve");
        if (auto e = resolver->Resolve(kind, value, extra, p); e.failure()) return e;
    }
    addresses_[i] = &p.bits;  // little-endian: a 4-byte scalar is the low half
  }
  return ffi::Error::Success();
}

ffi::Error Kernel::Bind(ffi::RemainingArgs args, ffi::RemainingRets rets) {
  for (int k = 0; k < n_buffers_; ++k) {
    const BufferParam& b = buffers_[k];
    auto address = BufferAddress(args, rets, b.index, b.offset, entry_);
    if (address.has_error()) return address.error();
    params_[b.param].bits = reinterpret_cast<uint64_t>(*address);
  }
  return ffi::Error::Success();
}

void Kernel::CopyFrom(const Kernel& other) {
  cubin_ = other.cubin_, entry_ = other.entry_;
  std::copy(other.grid_, other.grid_ + 3, grid_);
  std::copy(other.block_, other.block_ + 3, block_);
  std::copy(other.cluster_, other.cluster_ + 3, cluster_);
  smem_ = other.smem_, pdl_ = other.pdl_;
  n_params_ = other.n_params_, n_buffers_ = other.n_buffers_;
  std::copy(other.params_, other.params_ + n_params_, params_);
  std::copy(other.buffers_, other.buffers_ + n_buffers_, buffers_);
  for (int i = 0; i < n_params_; ++i) addresses_[i] = &params_[i].bits;
}

ffi::ErrorOr<CUfunction> Kernel::Function() const { return GetFunction(cubin_, entry_, smem_, clustered()); }

ffi::Error Kernel::Launch(CUstream stream) {
  auto fn = Function();
  if (fn.has_error()) return fn.error();
  CUlaunchAttribute attrs[2] = {};
  unsigned n = 0;
  if (clustered()) {
    attrs[n].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attrs[n].value.clusterDim.x = cluster_[0];
    attrs[n].value.clusterDim.y = cluster_[1];
    attrs[n].value.clusterDim.z = cluster_[2];
    ++n;
  }
  if (pdl_) {
    attrs[n].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attrs[n].value.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  CUlaunchConfig config = {};
  config.gridDimX = grid_[0], config.gridDimY = grid_[1], config.gridDimZ = grid_[2];
  config.blockDimX = block_[0], config.blockDimY = block_[1], config.blockDimZ = block_[2];
  config.sharedMemBytes = smem_;
  config.hStream = stream;
  config.attrs = attrs;
  config.numAttrs = n;
  if (CUresult r = driver().LaunchKernelEx(&config, *fn, addresses_, nullptr)) return CudaError(r, entry_, "cuLaunchKernelEx");
  return ffi::Error::Success();
}

std::vector<ffi::KernelArg> Kernel::Args() const {
  std::vector<ffi::KernelArg> out;
  out.reserve(n_params_);
  for (int i = 0; i < n_params_; ++i) {
    const Param& p = params_[i];
    if (p.pointer)
      out.push_back(ffi::DevicePointer{reinterpret_cast<void*>(p.bits)});
    else
      out.push_back(ffi::HostValue{&p.bits, p.size});
  }
  return out;
}

ffi::ErrorOr<const XLA_FFI_Command*> Kernel::Record(RecordContext& ctx,
                                                    const std::vector<const XLA_FFI_Command*>& deps) const {
  auto image = CubinImage(cubin_, entry_);
  if (image.has_error()) return image.error();
  XLA_FFI_LaunchDims dims{{int32_t(grid_[0]), int32_t(grid_[1]), int32_t(grid_[2])},
                          {int32_t(block_[0]), int32_t(block_[1]), int32_t(block_[2])},
                          {int32_t(cluster_[0]), int32_t(cluster_[1]), int32_t(cluster_[2])}};
  return ctx.CreateLaunch(std::string(entry_).c_str(), (*image)->data(), (*image)->size(), ffi::SourceFormat::kCubin,
                          dims, smem_, pdl_, Args(), deps);
}

ffi::Error Kernel::Update(RecordContext& ctx, const XLA_FFI_Command* command) const {
  return ctx.UpdateLaunch(command, Args());
}

// ---- Copies -------------------------------------------------------------------------------------
ffi::Error Copies::Plan(ffi::Span<const int64_t> inplace, ffi::RemainingArgs args, ffi::RemainingRets rets,
                        std::string_view entry) {
  n_ = 0;
  if (inplace.size() % 2 || inplace.size() > size_t(2 * kMaxCopies))
    return Invalid(entry, "inplace: expected at most " + std::to_string(kMaxCopies) + " (operand, result) pairs");
  for (size_t i = 0; i < inplace.size(); i += 2) {
    const int64_t in = inplace[i], out = inplace[i + 1];
    if (in < 0 || in >= int64_t(args.size()) || out < 0 || out >= int64_t(rets.size()))
      return Invalid(entry, "inplace: pair (" + std::to_string(in) + ", " + std::to_string(out) + ") out of range");
    auto src = args.get<ffi::AnyBuffer>(in);
    auto dst = rets.get<ffi::AnyBuffer>(out);
    if (src.has_error()) return src.error();
    if (dst.has_error()) return dst.error();
    if (src->size_bytes() != (*dst)->size_bytes())
      return Invalid(entry, "inplace: operand " + std::to_string(in) + " and result " + std::to_string(out) +
                                " differ in size");
    if (src->untyped_data() != (*dst)->untyped_data() && src->size_bytes())
      copies_[n_++] = {src->untyped_data(), (*dst)->untyped_data(), src->size_bytes()};
  }
  return ffi::Error::Success();
}

ffi::Error Copies::Run(CUstream stream, std::string_view entry) const {
  for (int i = 0; i < n_; ++i) {
    const Copy& c = copies_[i];
    if (CUresult r = driver().MemcpyDtoDAsync(CUdeviceptr(c.dst), CUdeviceptr(c.src), c.bytes, stream))
      return CudaError(r, entry, "cuMemcpyDtoDAsync(in-place operand)");
  }
  return ffi::Error::Success();
}

ffi::Error Copies::Record(RecordContext& ctx, std::vector<const XLA_FFI_Command*>& commands) const {
  for (int i = 0; i < n_; ++i) {
    const Copy& c = copies_[i];
    auto command = ctx.CreateMemcpyD2D(c.dst, const_cast<void*>(c.src), c.bytes);
    if (command.has_error()) return command.error();
    commands.push_back(*command);
  }
  return ffi::Error::Success();
}

ffi::Error Copies::Update(RecordContext& ctx, const ffi::BoundedCommandVector& commands) const {
  for (int i = 0; i < n_; ++i) {
    const Copy& c = copies_[i];
    if (auto e = ctx.UpdateMemcpyD2D(commands[i], c.dst, const_cast<void*>(c.src), c.bytes); e.failure()) return e;
  }
  return ffi::Error::Success();
}

}  // namespace oproj

// ---- the launch targets -------------------------------------------------------------------------
namespace {

using namespace oproj;

#define ATTRS_SIG OPROJ_LAUNCH_SIG(), ffi::Span<const int64_t> inplace
#define LAUNCH_SIG ffi::RemainingArgs args, ffi::RemainingRets rets, ATTRS_SIG

// One call site's launch, made once by the instantiate stage from its attributes (which never
// change): execute then only binds the call's buffers, and its binding decodes no attribute.
struct Site {
  static ffi::TypeId id;
  std::string cubin, entry;  // the kernel's views point here
  Kernel kernel;             // prepared: every value but the buffers' addresses
  std::vector<int64_t> inplace;
};
ffi::TypeId Site::id = {};
const bool site_registered = AddStateType({"oproj_launch_site", &Site::id, ffi::MakeTypeInfo<Site>()});

ffi::ErrorOr<std::unique_ptr<Site>> Instantiate(ATTRS_SIG) {
  auto site = std::make_unique<Site>();
  site->cubin = std::string(cubin), site->entry = std::string(entry);
  site->inplace.assign(inplace.begin(), inplace.end());
  LaunchAttrs attrs = OPROJ_LAUNCH_VALUES();
  attrs.cubin = site->cubin, attrs.entry = site->entry;
  if (auto e = site->kernel.Prepare(attrs); e.failure()) return e;
  return site;
}

ffi::Error Execute(CUstream stream, Site* site, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  Kernel kernel;  // per call: calls of one site may run at once (one executable, several threads)
  kernel.CopyFrom(site->kernel);
  if (auto e = kernel.Bind(args, rets); e.failure()) return e;
  Copies copies;
  const ffi::Span<const int64_t> inplace(site->inplace.data(), site->inplace.size());
  if (auto e = copies.Plan(inplace, args, rets, site->entry); e.failure()) return e;
  if (auto e = copies.Run(stream, site->entry); e.failure()) return e;
  return kernel.Launch(stream);
}

ffi::Error RecordStage(RecordContext ctx, LAUNCH_SIG) {
  Kernel kernel;
  Copies copies;
  if (auto e = kernel.Plan(OPROJ_LAUNCH_VALUES(), args, rets); e.failure()) return e;
  if (auto e = copies.Plan(inplace, args, rets, entry); e.failure()) return e;
  auto commands = ctx.commands();
  const int64_t needed = copies.size() + 1;
  if (ctx.action() == ffi::RecordAction::kUpdate) {
    if (commands.size() != needed)
      return ffi::Error::Internal(std::string(entry) + ": recorded " + std::to_string(commands.size()) +
                                  " commands, the update has " + std::to_string(needed));
    if (auto e = copies.Update(ctx, commands); e.failure()) return e;
    return kernel.Update(ctx, commands[copies.size()]);
  }
  if (commands.capacity() < needed) {
    // XLA traces the execute stage instead: load the module now, outside the capture.
    auto fn = kernel.Function();
    return fn.has_error() ? fn.error() : ctx.RequestStreamCapture();
  }
  std::vector<const XLA_FFI_Command*> deps;
  if (auto e = copies.Record(ctx, deps); e.failure()) return e;
  auto launch = kernel.Record(ctx, deps);
  return launch.has_error() ? launch.error() : ffi::Error::Success();
}

// Initialize (the traced twin only): loads the module ahead, never under stream capture.
ffi::Error Initialize(LAUNCH_SIG) {
  Kernel kernel;
  if (auto e = kernel.Shape(OPROJ_LAUNCH_VALUES()); e.failure()) return e;
  auto fn = kernel.Function();
  return fn.has_error() ? fn.error() : ffi::Error::Success();
}

}  // namespace

#define ATTRS_BINDING \
  OPROJ_LAUNCH_ATTRS("").Attr<ffi::Span<const int64_t>>("inplace") /* (operand, result) pairs read in place */
#define LAUNCH_BINDING .RemainingArgs().RemainingRets() ATTRS_BINDING

constexpr auto kCmdBuffer = ffi::Traits::kCmdBufferCompatible;

XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojLaunchInstantiate, Instantiate, ffi::Ffi::BindInstantiate() ATTRS_BINDING,
                              {kCmdBuffer});
XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojLaunchInitialize, Initialize, ffi::Ffi::BindInitialize() LAUNCH_BINDING,
                              {kCmdBuffer});
// No attribute bound: XLA decodes none per call (the site holds what they say).
XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojLaunchExecute, Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Ctx<ffi::State<Site>>()
                                  .RemainingArgs()
                                  .RemainingRets(),
                              {kCmdBuffer});
XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojLaunchRecord, RecordStage,
                              ffi::Ffi::BindRecord().Ctx<ffi::Extension<RecordExtension>>() LAUNCH_BINDING,
                              {kCmdBuffer});
