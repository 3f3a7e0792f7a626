// The one kernel launch of the library's FFI targets: a cubin's entry, its launch shape and a
// typed parameter list, all read from the call's attributes. Python builds them
// (oproj_jax/launch.py: for the CuTe kernels from the lists of oproj_jax/abi.py, for the
// Triton ones from Triton's signature), so nothing here knows a kernel: a kernel's new scalar is
// a new entry of the list, not a change here.
//
// A parameter is three int64 words of a `params` attribute, (kind, value, extra):
//   kNull    (0, 0, 0)              a null pointer
//   kBuffer  (1, index, offset)     the address of the call's buffer `index` (the operands, then
//                                   the results) plus `offset` bytes (e.g. one word of a scratch)
//   kU32, kI32, kF32  (2, 3, 4; bits, 0)   a 32-bit scalar, the low 32 bits of `bits`
//   kU64     (5, bits, 0)           a 64-bit scalar
// and the kinds only a target's Resolver knows (the peer transport, cute_peer.cc), because only
// the transport has them: memory it owns, and which rank of its group this device is:
//   kPeerMailbox  (16, 0, offset)   this rank's mailbox, plus `offset` bytes
//   kPeerSlot     (17, r, 0)        this rank's slot in rank r's mailbox (null when r >= R)
//   kPeerControl  (18, 0, offset)   this rank's control words, plus `offset` bytes
//   kPeerU32UnlessRank (19, bits, rank)  a u32 scalar `bits`, but 0 on rank `rank` (-1: none)
// Pointers reach the kernel as 8-byte values (and the record API as device pointers), scalars
// as 4 or 8 bytes of host value.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <string_view>
#include <vector>

#include "common.h"

namespace oproj {

enum Kind : int64_t {
  kNull = 0,
  kBuffer = 1,
  kU32 = 2,
  kI32 = 3,
  kF32 = 4,
  kU64 = 5,
  kPeerMailbox = 16,
  kPeerSlot = 17,
  kPeerControl = 18,
  kPeerU32UnlessRank = 19,
};
constexpr int kParamWords = 3;
constexpr int kMaxParams = 32;
constexpr int kMaxCopies = 8;

// One parameter's value as the kernel receives it.
struct Param {
  uint64_t bits = 0;
  uint32_t size = 8;     // bytes the kernel reads: 4 or 8
  bool pointer = true;   // a device address (null included), else a scalar
};

// The attributes of one launch (LAUNCH_ATTRS names them; a target with a second launch binds
// the same set under a prefix).
struct LaunchAttrs {
  std::string_view cubin;                  // absolute path of the cubin
  std::string_view entry;                  // its kernel entry name
  ffi::Span<const int64_t> grid;           // [x, y, z] CTAs
  ffi::Span<const int64_t> block;          // [x, y, z] threads per CTA
  ffi::Span<const int64_t> cluster;        // [x, y, z] CTAs per cluster; [0, 0, 0]: no cluster launch
  int64_t smem;                            // dynamic shared memory, bytes
  bool pdl;                                // programmatic stream serialization (PDL)
  ffi::Span<const int64_t> params;         // (kind, value, extra) per parameter, above
};

// What a target adds to the kinds above (the peer transport's): the value of one parameter.
class Resolver {
 public:
  virtual ~Resolver() = default;
  virtual ffi::Error Resolve(int64_t kind, int64_t value, int64_t extra, Param& out) const = 0;
};

// One planned kernel launch: run on a stream (execute) or recorded as a graph node (record).
class Kernel {
 public:
  Kernel() = default;
  Kernel(const Kernel&) = delete;  // the launch reads the parameters from this object

  // The launch shape, checked against CUDA's limits (enough to load the kernel: Function()).
  ffi::Error Shape(const LaunchAttrs& attrs);
  // The shape and every parameter's value but the buffers' addresses, which Bind fills in: what
  // a call site keeps from call to call (its attributes never change).
  ffi::Error Prepare(const LaunchAttrs& attrs, const Resolver* resolver = nullptr);
  ffi::Error Bind(ffi::RemainingArgs args, ffi::RemainingRets rets);
  // Prepare, then Bind.
  ffi::Error Plan(const LaunchAttrs& attrs, ffi::RemainingArgs args, ffi::RemainingRets rets,
                  const Resolver* resolver = nullptr);
  // This kernel := a prepared `other` (its own parameter storage, so one call binds its buffers
  // while another call of the same site binds theirs).
  void CopyFrom(const Kernel& other);
  // The kernel in the current context: loaded once, then a cache hit (common.h).
  ffi::ErrorOr<CUfunction> Function() const;
  // cuLaunchKernelEx on `stream`, with the cluster and PDL attributes the call asks for.
  ffi::Error Launch(CUstream stream);
  // A kernel node after `deps`, and the update of its arguments when XLA hands new buffers.
  ffi::ErrorOr<const XLA_FFI_Command*> Record(RecordContext& ctx, const std::vector<const XLA_FFI_Command*>& deps) const;
  ffi::Error Update(RecordContext& ctx, const XLA_FFI_Command* command) const;
  std::string_view entry() const { return entry_; }

 private:
  std::vector<ffi::KernelArg> Args() const;
  bool clustered() const { return cluster_[0] != 0; }

  std::string_view cubin_, entry_;
  unsigned grid_[3] = {1, 1, 1}, block_[3] = {1, 1, 1}, cluster_[3] = {0, 0, 0};
  uint32_t smem_ = 0;
  bool pdl_ = false;
  Param params_[kMaxParams];
  void* addresses_[kMaxParams] = {};
  int n_params_ = 0;
  struct BufferParam {
    int param;
    int64_t index, offset;
  };
  BufferParam buffers_[kMaxParams];  // the kBuffer parameters, which Bind resolves
  int n_buffers_ = 0;
};

// The in-place operands of a call: `inplace` (operand, result) pairs whose result buffer the
// kernel reads as it was passed in. XLA aliases them (input_output_aliases) and then there is
// nothing to do; where it hands a different result buffer (a dynamic-slice fusion writing into
// a larger array), the operand is copied there first, on the stream or as a memcpy node the
// kernel node depends on. Whether the two differ is fixed by XLA's buffer assignment, so a
// recorded call keeps its number of commands when XLA updates it with new addresses.
class Copies {
 public:
  ffi::Error Plan(ffi::Span<const int64_t> inplace, ffi::RemainingArgs args, ffi::RemainingRets rets,
                  std::string_view entry);
  ffi::Error Run(CUstream stream, std::string_view entry) const;
  ffi::Error Record(RecordContext& ctx, std::vector<const XLA_FFI_Command*>& commands) const;
  ffi::Error Update(RecordContext& ctx, const ffi::BoundedCommandVector& commands) const;  // the first size()
  int size() const { return n_; }

 private:
  struct Copy {
    const void* src;
    void* dst;
    size_t bytes;
  };
  Copy copies_[kMaxCopies];
  int n_ = 0;
};

ffi::Error Invalid(std::string_view entry, const std::string& what);

}  // namespace oproj

// The attributes of one launch, bound in LaunchAttrs order (a handler takes them as parameters
// in this order; PREFIX names a target's second launch, e.g. "publish_").
#define OPROJ_LAUNCH_ATTRS(PREFIX)                          \
  .Attr<std::string_view>(PREFIX "cubin")                   \
      .Attr<std::string_view>(PREFIX "entry")               \
      .Attr<ffi::Span<const int64_t>>(PREFIX "grid")        \
      .Attr<ffi::Span<const int64_t>>(PREFIX "block")       \
      .Attr<ffi::Span<const int64_t>>(PREFIX "cluster")     \
      .Attr<int64_t>(PREFIX "smem")                         \
      .Attr<bool>(PREFIX "pdl")                             \
      .Attr<ffi::Span<const int64_t>>(PREFIX "params")
#define OPROJ_LAUNCH_SIG(P)                                                                                 \
  std::string_view P##cubin, std::string_view P##entry, ffi::Span<const int64_t> P##grid,                    \
      ffi::Span<const int64_t> P##block, ffi::Span<const int64_t> P##cluster, int64_t P##smem, bool P##pdl, \
      ffi::Span<const int64_t> P##params
#define OPROJ_LAUNCH_VALUES(P) \
  oproj::LaunchAttrs { P##cubin, P##entry, P##grid, P##block, P##cluster, P##smem, P##pdl, P##params }
