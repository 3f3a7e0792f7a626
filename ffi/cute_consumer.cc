// XLA FFI handlers that launch the CuTe-DSL consumer cubins (oproj_jax/cute/ABI.md) from JAX.
//
// Built with g++ only (oproj_jax/cute/ffi.py): cuda.h is included for its types, the few driver
// entry points are resolved from libcuda.so.1 with dlopen at first use. Three targets (oneshot,
// ready, twoshot: see oproj_jax/cute/ABI.md). Each call is first planned (shape checks, the
// kernel parameters, a copy per in-place operand XLA did not alias), then:
//   execute     (outside command buffers) runs the plan on XLA's stream: cuLaunchKernelEx with
//               grid (7, T, 1), cluster (7, 1, 1) and PDL; the module is loaded on first use,
//               cached per (context, cubin, entry);
//   record      (inside an XLA command buffer, i.e. a CUDA graph) turns the plan into graph
//               nodes XLA owns and, when XLA hands new buffers, updates their arguments;
//   initialize  (the ready target of many tokens, registered without a record stage:
//               ffi.READY_TRACED_TARGET) loads the module ahead, so that its traced execute
//               never loads one under stream capture.
// No allocation, no synchronization in execute or record.
//
// `status` and `hints` are caller-owned 1-element buffers passed in and returned (aliased):
// the kernel only ever *sets* status (nonzero = a slot was not published within timeout_us
// microseconds) and *adds* to hints, so the caller zeroes them (or carries them through a
// loop: status is then sticky and is checked once, hints counts every publishing warp).
// The host cannot read status right after the launch without a sync; Python reads the
// returned buffer when it wants to know (oproj_jax.cute.backend.check_status).
#include <cuda.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace oproj;  // driver(), CudaError, Launch, kCluster

// ---- in-place operands ------------------------------------------------------------------------
// The kernel reads and writes one pointer per in-place operand (prefix, mailbox, hints, status),
// so the result must hold the operand's values. XLA usually gives both the same buffer (the
// alias), but not always: a dynamic-slice fusion (a scan body writing the result straight into
// the stacked ys) hands over a different result buffer. Then the plan copies first, on the same
// stream (or as a memcpy command the launch depends on), so the kernel still reads what the
// caller passed. Whether the two differ is fixed by XLA's buffer assignment, so a recorded
// plan keeps its shape when XLA updates it with new addresses.
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

// One call's work: the copies of in-place operands XLA did not alias, then one kernel launch.
// The execute stage runs it on the stream; the record stage turns it into command-buffer nodes.
struct Plan {
  struct Copy {
    const char* name;
    const void* src;
    void* dst;
    size_t bytes;
  };
  Copy copies[5];
  int n_copies = 0;
  LaunchSpec spec{};
  // The kernel parameters in cute/ABI.md order: 0..13 for every target, then 14 (control, none
  // here: ptr[10] stays null) for oneshot or 14..16 for twoshot.
  // Launches take the address of each value, so they live here.
  void* ptr[12] = {};
  float eps = 0, out_eps = 0;
  int32_t tokens = 0, timeout_us = 0, me = 0;
  int n_params = 15;

  Plan() = default;
  Plan(const Plan&) = delete;  // params() points into this object

  void InPlace(const char* name, const void* in, void* out, size_t bytes) {
    if (in != out && bytes) copies[n_copies++] = {name, in, out, bytes};
  }
  template <typename In, typename Out>
  void InPlace(const char* name, const In& in, Out& out, size_t element_bytes) {
    InPlace(name, in.untyped_data(), out->untyped_data(), in.element_count() * element_bytes);
  }

  void Params(void* slots, void* prefix, const Bf16_3& blocks, const Bf16_1& norm, const Bf16_1& query,
              const Bf16_1& out_norm, ffi::Result<Bf16_2>& output, ffi::Result<Bf16_3>& xmoe, void* hints,
              void* status, float eps_, float out_eps_, int32_t tokens_, int32_t timeout_us_) {
    void* values[12] = {slots,
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
                        nullptr};
    std::copy(values, values + 12, ptr);
    eps = eps_, out_eps = out_eps_, tokens = tokens_, timeout_us = timeout_us_;
  }

  // twoshot: the receive slots, the gather target and this rank's slice
  void Twoshot(void* recv, void* gather_target, int32_t me_) {
    ptr[10] = recv, ptr[11] = gather_target, me = me_, n_params = 17;
  }

  // The addresses cuLaunchKernelEx reads the parameters from.
  void** params() {
    params_ = {&ptr[0], &ptr[1], &ptr[2], &ptr[3], &ptr[4], &ptr[5], &ptr[6], &ptr[7], &ptr[8],
               &ptr[9], &eps,    &out_eps, &tokens, &timeout_us, &ptr[10], &ptr[11], &me};
    return params_.data();
  }

  // The same parameters for the record API: pointers as device pointers, scalars by value.
  std::vector<ffi::KernelArg> args() const {
    std::vector<ffi::KernelArg> out;
    out.reserve(n_params);
    for (int i = 0; i < 10; ++i) out.push_back(ffi::DevicePointer{ptr[i]});
    for (const void* value : {static_cast<const void*>(&eps), static_cast<const void*>(&out_eps),
                              static_cast<const void*>(&tokens), static_cast<const void*>(&timeout_us)})
      out.push_back(ffi::HostValue{value, 4});
    out.push_back(ffi::DevicePointer{ptr[10]});
    if (n_params == 17) {
      out.push_back(ffi::DevicePointer{ptr[11]});
      out.push_back(ffi::HostValue{&me, 4});
    }
    return out;
  }

 private:
  std::array<void*, 17> params_{};
};

// Execute stage: the copies and the launch on XLA's stream. No allocation, no synchronization.
ffi::Error Run(CUstream stream, Plan& plan) {
  for (int i = 0; i < plan.n_copies; ++i) {
    const auto& c = plan.copies[i];
    if (CUresult r = driver().MemcpyDtoDAsync(CUdeviceptr(c.dst), CUdeviceptr(c.src), c.bytes, stream))
      return CudaError(r, plan.spec.entry, std::string("cuMemcpyDtoDAsync(") + c.name + ")");
  }
  return Launch(stream, plan.spec, plan.params());
}

// Record stage (inside an XLA command buffer): the plan becomes graph nodes that XLA owns, a
// kernel node (PDL edges when spec.pdl) after a memcpy node per unaliased in-place operand.
// When XLA hands new buffers it asks for an update, which only rewrites the nodes' arguments:
// no stream capture, no re-instantiation, so a jitted chain pays the kernel, not the host.
ffi::Error Record(RecordContext ctx, Plan& plan) {
  const auto& spec = plan.spec;
  auto commands = ctx.commands();
  if (ctx.action() == ffi::RecordAction::kUpdate) {
    if (commands.size() != plan.n_copies + 1)
      return ffi::Error::Internal(std::string(spec.entry) + ": recorded " + std::to_string(commands.size()) +
                                  " commands, the update has " + std::to_string(plan.n_copies + 1));
    for (int i = 0; i < plan.n_copies; ++i) {
      const auto& c = plan.copies[i];
      if (auto e = ctx.UpdateMemcpyD2D(commands[i], c.dst, const_cast<void*>(c.src), c.bytes); e.failure()) return e;
    }
    return ctx.UpdateLaunch(commands[plan.n_copies], plan.args());
  }
  if (commands.capacity() < plan.n_copies + 1) {
    // XLA will trace the execute stage instead: load the module now, outside the capture.
    auto fn = GetFunction(spec.cubin, spec.entry, spec.smem);
    return fn.has_error() ? fn.error() : ctx.RequestStreamCapture();
  }
  auto image = CubinImage(spec.cubin, spec.entry);
  if (image.has_error()) return image.error();
  std::vector<const XLA_FFI_Command*> copies;
  for (int i = 0; i < plan.n_copies; ++i) {
    const auto& c = plan.copies[i];
    auto command = ctx.CreateMemcpyD2D(c.dst, const_cast<void*>(c.src), c.bytes);
    if (command.has_error()) return command.error();
    copies.push_back(*command);
  }
  XLA_FFI_LaunchDims dims{{int32_t(kCluster), int32_t(spec.tokens), 1}, {int32_t(spec.block), 1, 1},
                          {int32_t(kCluster), 1, 1}};
  auto launch = ctx.CreateLaunch(std::string(spec.entry).c_str(), (*image)->data(), (*image)->size(),
                                 ffi::SourceFormat::kCubin, dims, uint32_t(spec.smem), spec.pdl, plan.args(), copies);
  return launch.has_error() ? launch.error() : ffi::Error::Success();
}

// ---- oneshot: mailbox [R, T, H] ----------------------------------------------------------------
ffi::Error PlanOneshot(Plan& plan,
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
                       float eps, float out_eps, int32_t timeout_us, bool pdl, ffi::Span<const int64_t> variant) {
  auto tokens = CheckCommon(entry, mailbox, prefix, blocks, norm, query, out_norm, output, xmoe, hints, status);
  if (tokens.has_error()) return tokens.error();
  auto fits = CheckVariant(entry, variant, mailbox.dimensions()[0], blocks.dimensions()[1], xmoe->dimensions()[0]);
  if (fits.failure()) return fits;
  int32_t T = int32_t(*tokens);
  plan.InPlace("mailbox", mailbox, mailbox_out, 2);
  plan.InPlace("prefix", prefix, prefix_out, 2);
  plan.InPlace("hints", hints, hints_out, 4);
  plan.InPlace("status", status, status_out, 4);
  plan.Params(mailbox_out->untyped_data(), prefix_out->untyped_data(), blocks, norm, query, out_norm, output, xmoe,
              hints_out->untyped_data(), status_out->untyped_data(), eps, out_eps, T, timeout_us);
  plan.spec = {cubin, entry, smem, block, pdl, T};
  return ffi::Error::Success();
}

// ---- ready: mailbox [R, T, H] produced by XLA before the launch; read once, never written ------
ffi::Error PlanReady(Plan& plan,
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
                     float eps, float out_eps, int32_t timeout_us, bool pdl, ffi::Span<const int64_t> variant) {
  auto T = CheckInputs(entry, mailbox, prefix, blocks, norm, query, out_norm, output, xmoe);
  if (T.has_error()) return T.error();
  auto fits = CheckVariant(entry, variant, mailbox.dimensions()[0], blocks.dimensions()[1], xmoe->dimensions()[0]);
  if (fits.failure()) return fits;
  if (scratch->dimensions()[0] != 2) return ShapeError(entry, "scratch", "[2]", scratch->dimensions());
  if (timeout_us >= 0)
    return ffi::Error::InvalidArgument(std::string(entry) + ": timeout_us: the ready target needs < 0, got " +
                                       std::to_string(timeout_us));
  plan.InPlace("prefix", prefix, prefix_out, 2);
  int32_t tokens = int32_t(*T);
  auto* words = static_cast<uint32_t*>(scratch->untyped_data());
  plan.Params(mailbox.untyped_data(), prefix_out->untyped_data(), blocks, norm, query, out_norm, output, xmoe, words,
              words + 1, eps, out_eps, tokens, timeout_us);
  plan.spec = {cubin, entry, smem, block, pdl, tokens};
  return ffi::Error::Success();
}

// ---- twoshot: gather row [1, T, H] + receive slots [R, T, H/R] ---------------------------------
ffi::Error PlanTwoshot(Plan& plan,
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
                       float eps, float out_eps, int32_t timeout_us, bool pdl, ffi::Span<const int64_t> variant,
                       int32_t me) {
  auto tokens = CheckCommon(entry, gather, prefix, blocks, norm, query, out_norm, output, xmoe, hints, status);
  if (tokens.has_error()) return tokens.error();
  int32_t T = int32_t(*tokens);
  auto g = gather.dimensions();
  if (g[0] != 1) return ShapeError(entry, "gather", "[1, T, H]", g);
  auto r = recv.dimensions();
  const int64_t H = g[2];
  if (r[0] < 1 || r[1] != T || r[0] * r[2] != H) return ShapeError(entry, "recv", "[R, T, H/R]", r);
  auto fits = CheckVariant(entry, variant, r[0], blocks.dimensions()[1], xmoe->dimensions()[0]);
  if (fits.failure()) return fits;
  if (me < 0 || me >= r[0])
    return ffi::Error::InvalidArgument(std::string(entry) + ": me: expected 0 <= me < R = " + std::to_string(r[0]) +
                                       ", got " + std::to_string(me));
  plan.InPlace("gather", gather, gather_out, 2);
  plan.InPlace("prefix", prefix, prefix_out, 2);
  plan.InPlace("hints", hints, hints_out, 4);
  plan.InPlace("status", status, status_out, 4);
  plan.InPlace("recv", recv, recv_out, 2);
  plan.Params(gather_out->untyped_data(), prefix_out->untyped_data(), blocks, norm, query, out_norm, output, xmoe,
              hints_out->untyped_data(), status_out->untyped_data(), eps, out_eps, T, timeout_us);
  // one GPU: the gather target is the gather row itself
  plan.Twoshot(recv_out->untyped_data(), gather_out->untyped_data(), me);
  plan.spec = {cubin, entry, smem, block, pdl, T};
  return ffi::Error::Success();
}

// The stage handlers: each plans the call, then runs (execute) or records (record) the plan.
#define OPROJ_STAGES(NAME, PLAN, SIGNATURE, ARGS)                                      \
  ffi::Error NAME##Execute(CUstream stream, SIGNATURE) {                                \
    Plan plan;                                                                         \
    if (auto error = PLAN(plan, ARGS); error.failure()) return error;                  \
    return Run(stream, plan);                                                          \
  }                                                                                    \
  ffi::Error NAME##Record(RecordContext ctx, SIGNATURE) {                               \
    Plan plan;                                                                         \
    if (auto error = PLAN(plan, ARGS); error.failure()) return error;                  \
    return Record(ctx, plan);                                                          \
  }

#define COMMA ,
#define ATTR_SIG std::string_view cubin, std::string_view entry, int64_t smem, int64_t block, float eps, \
                 float out_eps, int32_t timeout_us, bool pdl, ffi::Span<const int64_t> variant
#define ATTR_ARGS cubin, entry, smem, block, eps, out_eps, timeout_us, pdl, variant
#define PROTOCOL_SIG Bf16_3 slots, Bf16_2 prefix, Bf16_3 blocks, Bf16_1 norm, Bf16_1 query, Bf16_1 out_norm, \
                     Counter hints, Status status
#define PROTOCOL_ARGS slots, prefix, blocks, norm, query, out_norm, hints, status
#define PROTOCOL_RETS ffi::Result<Bf16_3> slots_out, ffi::Result<Bf16_2> prefix_out, ffi::Result<Bf16_2> output, \
                      ffi::Result<Bf16_3> xmoe, ffi::Result<Counter> hints_out, ffi::Result<Status> status_out
#define PROTOCOL_RET_ARGS slots_out, prefix_out, output, xmoe, hints_out, status_out

OPROJ_STAGES(Oneshot, PlanOneshot, PROTOCOL_SIG COMMA PROTOCOL_RETS COMMA ATTR_SIG,
             PROTOCOL_ARGS COMMA PROTOCOL_RET_ARGS COMMA ATTR_ARGS)
OPROJ_STAGES(Ready, PlanReady,
             Bf16_3 mailbox COMMA Bf16_2 prefix COMMA Bf16_3 blocks COMMA Bf16_1 norm COMMA Bf16_1 query COMMA
                 Bf16_1 out_norm COMMA ffi::Result<Bf16_2> prefix_out COMMA ffi::Result<Bf16_2> output COMMA
                     ffi::Result<Bf16_3> xmoe COMMA ffi::Result<Scratch> scratch COMMA ATTR_SIG,
             mailbox COMMA prefix COMMA blocks COMMA norm COMMA query COMMA out_norm COMMA prefix_out COMMA output
                 COMMA xmoe COMMA scratch COMMA ATTR_ARGS)
OPROJ_STAGES(Twoshot, PlanTwoshot,
             PROTOCOL_SIG COMMA Bf16_3 recv COMMA PROTOCOL_RETS COMMA ffi::Result<Bf16_3> recv_out COMMA ATTR_SIG
                 COMMA int32_t me,
             PROTOCOL_ARGS COMMA recv COMMA PROTOCOL_RET_ARGS COMMA recv_out COMMA ATTR_ARGS COMMA me)

// initialize stage: the same call frame (every attribute must be bound); loads the module.
ffi::Error Initialize(ffi::RemainingArgs, ffi::RemainingRets, std::string_view cubin, std::string_view entry,
                      int64_t smem, int64_t block, float, float, int32_t, bool, ffi::Span<const int64_t>) {
  if (block < 1 || block > 1024)
    return ffi::Error::InvalidArgument(std::string(entry) + ": block: expected 1..1024 threads, got " +
                                       std::to_string(block));
  auto fn = GetFunction(cubin, entry, smem);
  return fn.has_error() ? fn.error() : ffi::Error::Success();
}

}  // namespace

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

#define OPROJ_READY_OPERANDS                                 \
  .Arg<Bf16_3>()     /* mailbox [R, T, H], read only */      \
      .Arg<Bf16_2>() /* prefix [T, H] */                     \
      .Arg<Bf16_3>() /* blocks [T, NB, H] */                 \
      .Arg<Bf16_1>() /* norm [H] */                          \
      .Arg<Bf16_1>() /* query [H] */                         \
      .Arg<Bf16_1>() /* out_norm [H] */                      \
      .Ret<Bf16_2>() /* prefix, updated (aliased) */         \
      .Ret<Bf16_2>() /* output [T, H] */                     \
      .Ret<Bf16_3>() /* xmoe [reps, T, H] */                 \
      .Ret<Scratch>() /* [2] u32 scratch: hints, status */

#define OPROJ_TWOSHOT_OPERANDS                                                     \
  OPROJ_BUFFERS.Arg<Bf16_3>() /* recv [R, T, H/R] */                               \
      OPROJ_RESULTS.Ret<Bf16_3>() /* recv, re-armed (aliased) */

#define OPROJ_EXECUTE ffi::Ffi::Bind().Ctx<ffi::PlatformStream<CUstream>>()
#define OPROJ_RECORD ffi::Ffi::BindRecord().Ctx<ffi::Extension<RecordExtension>>()
#define OPROJ_ME .Attr<int32_t>("me") /* twoshot: this rank owns columns [me*H/R, (me+1)*H/R) */
constexpr auto kCmdBuffer = ffi::Traits::kCmdBufferCompatible;

XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojOneshotInitialize, Initialize,
                              ffi::Ffi::BindInitialize().RemainingArgs().RemainingRets() OPROJ_ATTRS, {kCmdBuffer});
XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojOneshotExecute, OneshotExecute,
                              OPROJ_EXECUTE OPROJ_BUFFERS OPROJ_RESULTS OPROJ_ATTRS, {kCmdBuffer});
XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojOneshotRecord, OneshotRecord,
                              OPROJ_RECORD OPROJ_BUFFERS OPROJ_RESULTS OPROJ_ATTRS, {kCmdBuffer});

XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojReadyExecute, ReadyExecute, OPROJ_EXECUTE OPROJ_READY_OPERANDS OPROJ_ATTRS,
                              {kCmdBuffer});
XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojReadyRecord, ReadyRecord, OPROJ_RECORD OPROJ_READY_OPERANDS OPROJ_ATTRS,
                              {kCmdBuffer});

XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojTwoshotExecute, TwoshotExecute,
                              OPROJ_EXECUTE OPROJ_TWOSHOT_OPERANDS OPROJ_ATTRS OPROJ_ME, {kCmdBuffer});
XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojTwoshotRecord, TwoshotRecord,
                              OPROJ_RECORD OPROJ_TWOSHOT_OPERANDS OPROJ_ATTRS OPROJ_ME, {kCmdBuffer});
