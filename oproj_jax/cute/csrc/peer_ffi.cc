// mode="peer": the TP all-reduce by peer writes into mailboxes this library owns, consumed by the
// CuTe kernel's Lamport protocol (oproj_jax/cute/peer.py is the Python side; cute/ABI.md).
//
// A group runs in one process driving all its GPUs (JAX's usual single-host layout), or with one
// rank per process ("groups across processes" below: the same, except that each process
// allocates only its own rank's mailbox and maps the others' by CUDA IPC). For each group
// (its devices' CUDA ordinals in rank order), T and R, the first call that needs it (execute,
// record or initialize, under `groups_mutex`; never under stream capture) allocates, on every
// device of the group, ONE mailbox [R, T, H] bf16 plus a 256-byte control block (cuMemAlloc in
// the device's primary context, the one XLA uses), enables peer access between every pair,
// arms the mailbox with the sentinel 0x80000000 and zeroes the control block. Nothing is ever
// freed: a group's memory lives as long as the process (R * T * H * 2 bytes per device, plus
// 256: 0.5 MiB at R=2, T=16; 117 MiB at R=16, T=512).
//
// One call on rank `me`:
//   1. publish kernel (cute/publish.py): for each 16-byte fragment of the partial [T, H]
//      (-0.0 -> +0.0) and each rank r: WAIT FOR EMPTY (poll fragment of slot `me` of r's
//      mailbox, ld.relaxed.sys.v4, until all four words are the sentinel), then store it
//      there (st.relaxed.sys.v4). Thread 0 zeroes flags[0] (the consumer's status); the
//      launch's last CTA stores the publish status into flags[2] (0, or 4: a slot was never
//      re-armed within timeout_us microseconds; nothing was stored there);
//   2. the consumer cubin in protocol mode on this device's mailbox: polls every slot until
//      published, sums in the `groups` order (the prefix bits of mode="oneshot"), re-arms each
//      fragment after reading it (the same thread, kernel.py), may set flags[0] = 1.
// Both on XLA's stream with PDL (outside command buffers: execute) or as two graph kernel nodes,
// consumer after publish (inside an XLA command buffer: record). The publish kernel waits
// (griddepcontrol.wait) before its first load or store, the consumer before its first global
// read. Nothing depends on a host-side count of steps: the mailbox's contents alone say who
// may write what, so a CUDA graph may replay the same two launches forever.
//
// ---- Why one mailbox is safe ----------------------------------------------------------------
// Fix rank A publishing into B's mailbox, and one fragment f of slot A there (16 bytes).
//   (a) One writer of data: only A's publish kernels store data into it (slot A of every
//       mailbox is A's), and only B's consumers re-arm it. So the fragment's history is
//       armed -> data_0 -> rearm_0 -> data_1 -> rearm_1 -> ...: data_k only after rearm_{k-1},
//       because A's step-k publish stores only after it has SEEN all four words of rearm_{k-1}
//       (and nothing else can make the four words the sentinel again: published data never
//       holds the sentinel word, -0.0 -> +0.0).
//   (b) The consumer reads before it re-arms: B's step-k consumer thread loads the fragment
//       (until no word is the sentinel, so all four words are data_k) and only then stores
//       rearm_k to the same address, in its own program order. A's step-(k+1) data is stored
//       only after A saw rearm_k (a), so it can never be what B's step-k read returned, and
//       B's step-(k+1) consumer (after B's step-k consumer completed, stream order) can only
//       find rearm_k or data_{k+1} there: no stale and no future step is ever read.
//   (c) A's step-(k+1) poll cannot mistake an OLD sentinel for rearm_k: A's step-k stores
//       completed before A's step-(k+1) publish passed its griddepcontrol.wait (A's step-k
//       consumer completed in between, stream order), so A's poll sees data_k or later.
//   (d) Words are checked one by one (a v4 access need not be single-copy atomic across its
//       16 bytes): the consumer waits until no word is the sentinel, the publisher until all
//       four are. Each word is written once per step by each side.
// The re-arm is kernel.py's plain st.global on the owning GPU; the publisher's load and store
// reach that GPU's L2, which orders the accesses to one address; this is the same
// per-address ordering the Lamport protocol of every mode relies on.
//
// ---- Progress and deadlock freedom ----------------------------------------------------------
// Per device, the stream (or graph) order is publish(0), consume(0), publish(1), consume(1), ...
// publish(k) waits only for the other ranks' consume(k-1) (their re-arms); consume(k) waits only
// for the other ranks' publish(k) (their data). Induction on k: if every consume(k-1) completes,
// every publish(k) completes (all slots it writes get re-armed; publish(0) finds the arming),
// and then every consume(k) completes. The waits point from step k to step k or k-1, never
// forward, so there is no cycle. Publish and consume are different kernels, so a spinning
// publish never holds back its own rank's re-arms. PDL does not break this: a dependent grid
// is launched only once every CTA of the previous one is resident (or done), so an early
// launched consumer never keeps its own publish off the GPU, and the publish's
// griddepcontrol.wait (before its first load or store) keeps publish(k+1) from overlapping
// this rank's consume(k) and publish(k).
// This needs every rank's peer calls for one (group, T, R) to run in the same order on every
// device (SPMD) and in program order on each: XLA's thunk sequence and its default command
// buffer scheduling (LHS: one stream's commands serialized) do that. Under
// --xla_gpu_command_buffer_scheduling_mode=CONCURRENT two peer calls with no data dependence
// could overlap in a graph: not supported.
//
// ---- Bounded waits, errors, reset -----------------------------------------------------------
// Every wait gives up after `timeout_us` microseconds of wall time: a consumer whose slot
// stays empty stores status 1 into flags[0] and still re-arms; a publish thread whose
// destination is never re-armed stores nothing there and makes flags[2] = 4. Python ORs the
// two words (PeerResult.status) and raises on nonzero. After such an error, slots may hold
// data of a step nobody will consume (a late publish): call OprojPeerReset (peer.reset()),
// with no peer call in flight, which re-arms every mailbox and zeroes every control block.
// `skip_rank` (tests only) makes that rank launch the publish kernel with no destination.
//
// ---- Command buffers ------------------------------------------------------------------------
// The target is command-buffer compatible and has a record stage (OprojPeerRecord): inside an
// XLA command buffer it adds [a memcpy of an unaliased prefix,] the publish kernel node (no
// cluster) and the consumer node (cluster (7, 1, 1)) depending on it, both with PDL; when XLA
// hands new buffers (partial, prefix, outputs) it updates their arguments. The mailboxes and
// control blocks are this library's and never move, so a recorded graph stays valid until the
// process ends. OprojPeerInitialize (used only where the record stage is not registered,
// ffi.REGISTRATION "traced") allocates and loads the modules before XLA captures execute.
#include <cuda.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace oproj;  // driver(), CudaError, GetFunction, Launch, CubinImage, kCluster

constexpr int64_t kMaxRanks = 16;  // publish kernel destinations (cute/publish.py MAX_RANKS)
constexpr int64_t kHidden = int64_t(kCluster) * 1024;
constexpr unsigned kSentinel = 0x80000000u;
constexpr unsigned kPublishThreads = 128;
constexpr size_t kControlBytes = 256;  // per device: the publish kernel's CTA counter (u64 at 0)
constexpr int kPublishParams = 1 + kMaxRanks + 5;  // cute/publish.py PUBLISH_PARAMS
constexpr const char* kTarget = "oproj_cute_peer";

using Bf16_1 = ffi::Buffer<ffi::BF16, 1>;
using Bf16_2 = ffi::Buffer<ffi::BF16, 2>;
using Bf16_3 = ffi::Buffer<ffi::BF16, 3>;
// [3] i32: consumer status (0 = ok, 1 = a slot stayed empty), hints counter (scratch), publish
// status (0 = ok, 4 = a destination was never re-armed)
using Flags = ffi::Buffer<ffi::S32, 1>;

ffi::Error Invalid(const std::string& what) { return ffi::Error::InvalidArgument(std::string(kTarget) + ": " + what); }

// ---- the group's mailboxes --------------------------------------------------------------------
struct Key {
  std::vector<int64_t> ordinals;  // CUDA ordinals of the group's devices, rank order
  int64_t tokens, ranks;
  bool operator<(const Key& o) const {
    return std::tie(ordinals, tokens, ranks) < std::tie(o.ordinals, o.tokens, o.ranks);
  }
};

struct Mailboxes {
  std::vector<CUcontext> contexts;  // per rank: the primary context its base is mapped in
  std::vector<CUdeviceptr> base;    // per rank: the mailbox [R, T, H] bf16, then the control block
  std::vector<bool> owned;          // per rank: allocated here (armed and reset here), else mapped by IPC
  size_t mailbox_bytes = 0;         // R * T * H * 2 (a multiple of 256: the control block is aligned)
};

std::mutex groups_mutex;
std::map<Key, Mailboxes> groups;  // never erased (see the file comment)

// The calling thread's current context is `ctx` while this lives.
class ScopedContext {
 public:
  explicit ScopedContext(CUcontext ctx) : result_(driver().CtxPushCurrent(ctx)) {}
  ~ScopedContext() {
    CUcontext popped;
    if (result_ == CUDA_SUCCESS) driver().CtxPopCurrent(&popped);
  }
  CUresult result() const { return result_; }

 private:
  CUresult result_;
};

// Stores the sentinel into every rank's mailbox and zeroes its control block. On a private
// non-blocking stream per device, waited for here: XLA's streams may hold kernels of other
// groups that spin until a peer (whose host thread may be waiting for our mutex) publishes or
// re-arms, so a device-wide synchronization could stall until their spin limit.
ffi::Error Arm(Mailboxes& m) {
  for (size_t r = 0; r < m.base.size(); ++r) {
    if (!m.owned[r]) continue;  // another process's mailbox: its owner arms it
    ScopedContext scope(m.contexts[r]);
    if (scope.result()) return CudaError(scope.result(), kTarget, "cuCtxPushCurrent");
    CUstream stream = nullptr;
    if (CUresult e = driver().StreamCreate(&stream, CU_STREAM_NON_BLOCKING)) return CudaError(e, kTarget, "cuStreamCreate");
    CUresult e = driver().MemsetD32Async(m.base[r], kSentinel, m.mailbox_bytes / 4, stream);
    if (!e) e = driver().MemsetD32Async(m.base[r] + m.mailbox_bytes, 0, kControlBytes / 4, stream);
    CUresult s = e ? e : driver().StreamSynchronize(stream);
    driver().StreamDestroy(stream);
    if (e) return CudaError(e, kTarget, "cuMemsetD32Async (arming the mailboxes)");
    if (s) return CudaError(s, kTarget, "cuStreamSynchronize (arming the mailboxes)");
  }
  return ffi::Error::Success();
}

// Allocates and arms the group's mailboxes on every device of the group; frees what it
// allocated if any step fails (the group then stays unregistered and the next call retries).
ffi::Error Allocate(const Key& key, Mailboxes& m) {
  const size_t R = key.ordinals.size();
  std::vector<CUdevice> devices(R);
  m.contexts.assign(R, nullptr);
  m.mailbox_bytes = size_t(key.ranks) * size_t(key.tokens) * size_t(kHidden) * 2;
  const size_t bytes = m.mailbox_bytes + kControlBytes;
  for (size_t r = 0; r < R; ++r) {
    if (CUresult e = driver().DeviceGet(&devices[r], int(key.ordinals[r])))
      return CudaError(e, kTarget, "cuDeviceGet(" + std::to_string(key.ordinals[r]) + ")");
    if (CUresult e = driver().DevicePrimaryCtxRetain(&m.contexts[r], devices[r]))
      return CudaError(e, kTarget, "cuDevicePrimaryCtxRetain");
  }
  for (size_t a = 0; a < R; ++a)
    for (size_t b = 0; b < R; ++b) {
      int can = 1;
      if (a == b) continue;
      if (CUresult e = driver().DeviceCanAccessPeer(&can, devices[a], devices[b]))
        return CudaError(e, kTarget, "cuDeviceCanAccessPeer");
      if (!can)
        return Invalid("mode='peer': GPU " + std::to_string(key.ordinals[a]) + " cannot write to GPU " +
                       std::to_string(key.ordinals[b]) + "'s memory (no peer access between them)");
    }
  auto release = [&m] {
    for (size_t r = 0; r < m.base.size(); ++r) {
      ScopedContext scope(m.contexts[r]);
      driver().MemFree(m.base[r]);
    }
    m.base.clear();
  };
  for (size_t a = 0; a < R; ++a) {
    ScopedContext scope(m.contexts[a]);
    if (scope.result()) {
      release();
      return CudaError(scope.result(), kTarget, "cuCtxPushCurrent");
    }
    for (size_t b = 0; b < R; ++b) {  // a's kernels read and write b's memory (the publish kernel)
      if (a == b) continue;
      CUresult e = driver().CtxEnablePeerAccess(m.contexts[b], 0);
      if (e && e != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED) {  // XLA usually enabled it already
        release();
        return CudaError(e, kTarget, "cuCtxEnablePeerAccess");
      }
    }
    CUdeviceptr ptr = 0;
    if (CUresult e = driver().MemAlloc(&ptr, bytes)) {
      release();
      return CudaError(e, kTarget, "cuMemAlloc (" + std::to_string(bytes) + " bytes of mailbox)");
    }
    m.base.push_back(ptr);
    m.owned.push_back(true);
  }
  if (auto error = Arm(m); error.failure()) {
    release();
    return error;
  }
  return ffi::Error::Success();
}

// Where rank `me` of the group publishes and polls: the same addresses on every call (what
// lets a recorded graph keep them).
struct Route {
  CUdeviceptr dest[kMaxRanks] = {};  // slot `me` of every rank's mailbox
  CUdeviceptr mailbox = 0;           // this rank's own mailbox
  CUdeviceptr control = 0;           // this rank's control block
};

// The group's memory, allocated on first use.
ffi::ErrorOr<Route> GetRoute(const Key& key, size_t me) {
  std::lock_guard<std::mutex> lock(groups_mutex);
  auto it = groups.find(key);
  if (it == groups.end()) {
    if (std::any_of(key.ordinals.begin(), key.ordinals.end(), [](int64_t o) { return o < 0; }))
      return Invalid(
          "mode='peer': this group spans processes and its mailboxes are not connected in this process "
          "(oproj_jax.cute.peer_ipc.connect, which tp_consumer runs when it traces a step, exchanges them)");
    Mailboxes fresh;
    if (auto error = Allocate(key, fresh); error.failure()) return error;
    it = groups.emplace(key, std::move(fresh)).first;
  }
  const Mailboxes& m = it->second;
  const size_t slot = me * (m.mailbox_bytes / size_t(key.ranks));
  Route route;
  for (size_t r = 0; r < m.base.size(); ++r) route.dest[r] = m.base[r] + slot;
  route.mailbox = m.base[me];
  route.control = m.base[me] + m.mailbox_bytes;
  return route;
}

// ---- shape checks, the group ------------------------------------------------------------------
std::string Shape(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

ffi::Error ShapeError(std::string_view name, std::string_view expected, ffi::Span<const int64_t> got) {
  return Invalid(std::string(name) + ": expected shape " + std::string(expected) + ", got " + Shape(got));
}

// Finds this device in the group table ([groups, R] CUDA ordinals, flattened): its row is the
// group, its column `me`. With `check_context`, checked against the current context, whose
// device the module cache and the launches use (execute, initialize; the record stage hands
// XLA the cubin bytes and never launches itself).
ffi::ErrorOr<std::pair<Key, size_t>> FindGroup(int32_t ordinal, ffi::Span<const int64_t> table, int64_t ranks,
                                               int64_t tokens, bool check_context) {
  if (ranks < 1 || ranks > kMaxRanks) return Invalid("ranks: expected 1..16, got " + std::to_string(ranks));
  if (table.size() == 0 || table.size() % size_t(ranks))
    return Invalid("group: expected [groups, R = " + std::to_string(ranks) + "] device ordinals, got " +
                   std::to_string(table.size()) + " values");
  auto at = std::find(table.begin(), table.end(), int64_t(ordinal));
  if (at == table.end())
    return Invalid("this device (CUDA ordinal " + std::to_string(ordinal) + ") is in no group of the table");
  if (check_context) {
    CUdevice current = 0, mine = 0;
    if (CUresult e = driver().CtxGetDevice(&current)) return CudaError(e, kTarget, "cuCtxGetDevice");
    if (CUresult e = driver().DeviceGet(&mine, ordinal)) return CudaError(e, kTarget, "cuDeviceGet");
    if (current != mine)
      return Invalid("XLA's device ordinal " + std::to_string(ordinal) + " is not the current context's device");
  }
  const size_t index = size_t(at - table.begin()), row = index / size_t(ranks);
  Key key{std::vector<int64_t>(table.begin() + row * ranks, table.begin() + (row + 1) * ranks), tokens, ranks};
  return std::make_pair(std::move(key), index % size_t(ranks));
}

// A zero-size buffer may have no storage; the kernel ignores it but wants a valid pointer.
void* OrValid(void* maybe, size_t count, void* valid) { return count ? maybe : valid; }

// ---- one call's work --------------------------------------------------------------------------
// [a copy of an unaliased prefix,] the publish launch, the consumer launch. The execute stage
// runs it on the stream, the record stage turns it into graph nodes (and updates them).
struct PeerPlan {
  // the publish kernel's parameters, cute/publish.py PUBLISH_PARAMS order
  void* src = nullptr;
  void* dests[kMaxRanks] = {};
  int32_t n_dest = 0;
  void* flags = nullptr;
  int32_t fragments = 0, timeout_us = 0;
  void* control = nullptr;
  std::string_view publish_cubin, publish_entry;
  // the consumer's parameters, cute/ABI.md order (0..13)
  void* ptr[10] = {};
  float eps = 0, out_eps = 0;
  int32_t tokens = 0;
  LaunchSpec consumer{};
  // the kernel updates one prefix pointer: where XLA did not alias, copy first
  const void* prefix_in = nullptr;
  void* prefix_out = nullptr;
  size_t prefix_bytes = 0;

  PeerPlan() = default;
  PeerPlan(const PeerPlan&) = delete;  // the params arrays point into this object

  bool copies_prefix() const { return prefix_in != prefix_out && prefix_bytes; }
  int32_t publish_grid() const { return int32_t((unsigned(fragments) + kPublishThreads - 1) / kPublishThreads); }

  void** publish_params() {
    int i = 0;
    publish_params_[i++] = &src;
    for (auto& d : dests) publish_params_[i++] = &d;
    for (void* p : {static_cast<void*>(&n_dest), static_cast<void*>(&flags), static_cast<void*>(&fragments),
                    static_cast<void*>(&timeout_us), static_cast<void*>(&control)})
      publish_params_[i++] = p;
    return publish_params_.data();
  }
  std::vector<ffi::KernelArg> publish_args() const {
    std::vector<ffi::KernelArg> out{ffi::DevicePointer{src}};
    for (void* d : dests) out.push_back(ffi::DevicePointer{d});
    out.push_back(ffi::HostValue{&n_dest, 4});
    out.push_back(ffi::DevicePointer{flags});
    out.push_back(ffi::HostValue{&fragments, 4});
    out.push_back(ffi::HostValue{&timeout_us, 4});
    out.push_back(ffi::DevicePointer{control});
    return out;
  }

  void** consumer_params() {
    consumer_params_ = {&ptr[0], &ptr[1], &ptr[2], &ptr[3], &ptr[4], &ptr[5],    &ptr[6],
                        &ptr[7], &ptr[8], &ptr[9], &eps,    &out_eps, &tokens, &timeout_us};
    return consumer_params_.data();
  }
  std::vector<ffi::KernelArg> consumer_args() const {
    std::vector<ffi::KernelArg> out;
    for (void* p : ptr) out.push_back(ffi::DevicePointer{p});
    for (const void* value : {static_cast<const void*>(&eps), static_cast<const void*>(&out_eps),
                              static_cast<const void*>(&tokens), static_cast<const void*>(&timeout_us)})
      out.push_back(ffi::HostValue{value, 4});
    return out;
  }

 private:
  std::array<void*, kPublishParams> publish_params_{};
  std::array<void*, 14> consumer_params_{};
};

// The attributes every stage binds (names are matched, order is free).
#define PEER_ATTR_SIG                                                                                         \
  std::string_view cubin, std::string_view entry, int64_t smem, int64_t block, float eps, float out_eps,     \
      int32_t timeout_us, bool pdl, ffi::Span<const int64_t> variant, std::string_view publish_cubin,        \
      std::string_view publish_entry, ffi::Span<const int64_t> group, int64_t ranks, int32_t skip_rank
#define PEER_ATTR_ARGS                                                                                        \
  cubin, entry, smem, block, eps, out_eps, timeout_us, pdl, variant, publish_cubin, publish_entry, group, ranks, \
      skip_rank
#define PEER_BUFFER_SIG                                                                                       \
  Bf16_2 partial, Bf16_2 prefix, Bf16_3 blocks, Bf16_1 norm, Bf16_1 query, Bf16_1 out_norm,                  \
      ffi::Result<Bf16_2> prefix_out, ffi::Result<Bf16_2> output, ffi::Result<Bf16_3> xmoe,                  \
      ffi::Result<Flags> flags
#define PEER_BUFFER_ARGS partial, prefix, blocks, norm, query, out_norm, prefix_out, output, xmoe, flags

ffi::Error PlanPeer(PeerPlan& plan, int32_t ordinal, bool check_context,
                    Bf16_2 partial,   // [T, H] this rank's partial o-projection (published)
                    Bf16_2 prefix,    // [T, H] read when has_delta, always written (in place)
                    Bf16_3 blocks,    // [T, NB, H] completed blocks
                    Bf16_1 norm,      // [H] AttnRes key RMSNorm weight
                    Bf16_1 query,     // [H] AttnRes pseudo-query
                    Bf16_1 out_norm,  // [H] next sub-layer's RMSNorm weight
                    ffi::Result<Bf16_2> prefix_out,  // aliases prefix
                    ffi::Result<Bf16_2> output,      // [T, H]
                    ffi::Result<Bf16_3> xmoe,        // [reps, T, H]
                    ffi::Result<Flags> flags,        // [3] i32: consumer status, hints, publish status
                    PEER_ATTR_SIG) {
  auto p = prefix.dimensions();
  const int64_t T = p[0], H = p[1];
  if (T < 1 || T > 65535 || H != kHidden) return ShapeError("prefix", "[T, 7168] with 1 <= T <= 65535", p);
  if (partial.dimensions()[0] != T || partial.dimensions()[1] != H)
    return ShapeError("partial", "[T, H] of prefix", partial.dimensions());
  auto b = blocks.dimensions();
  if (b[0] != T || b[2] != H) return ShapeError("blocks", "[T, NB, H] with T, H of prefix", b);
  for (auto [name, w] : {std::pair{"norm", &norm}, std::pair{"query", &query}, std::pair{"out_norm", &out_norm}})
    if (w->dimensions()[0] != H) return ShapeError(name, "[7168]", w->dimensions());
  if (output->dimensions()[0] != T || output->dimensions()[1] != H)
    return ShapeError("output", "[T, H] of prefix", output->dimensions());
  if (xmoe->dimensions()[1] != T || xmoe->dimensions()[2] != H)
    return ShapeError("xmoe", "[reps, T, H] with T, H of prefix", xmoe->dimensions());
  if (flags->dimensions()[0] != 3) return ShapeError("flags", "[3]", flags->dimensions());
  if (auto fits = CheckVariant(kTarget, variant, ranks, b[1], xmoe->dimensions()[0]); fits.failure()) return fits;
  if (timeout_us <= 0) return Invalid("timeout_us: every wait is bounded, expected > 0 microseconds, got " + std::to_string(timeout_us));
  if (block < 1 || block > 1024) return Invalid("block: expected 1..1024 threads, got " + std::to_string(block));

  auto found = FindGroup(ordinal, group, ranks, T, check_context);
  if (found.has_error()) return found.error();
  const auto& [key, me] = *found;
  auto route = GetRoute(key, me);
  if (route.has_error()) return route.error();

  auto* words = static_cast<int32_t*>(flags->untyped_data());
  plan.src = partial.untyped_data();
  for (int64_t r = 0; r < kMaxRanks; ++r) plan.dests[r] = reinterpret_cast<void*>(route->dest[r]);
  plan.n_dest = int64_t(me) == skip_rank ? 0 : int32_t(ranks);
  plan.flags = words;
  plan.fragments = int32_t(T * H / 8);
  plan.timeout_us = timeout_us;
  plan.control = reinterpret_cast<void*>(route->control);
  plan.publish_cubin = publish_cubin, plan.publish_entry = publish_entry;

  plan.prefix_in = prefix.untyped_data();
  plan.prefix_out = prefix_out->untyped_data();
  plan.prefix_bytes = size_t(T * H) * 2;
  void* values[10] = {reinterpret_cast<void*>(route->mailbox),
                      plan.prefix_out,
                      OrValid(blocks.untyped_data(), blocks.element_count(), plan.prefix_out),
                      norm.untyped_data(),
                      query.untyped_data(),
                      out_norm.untyped_data(),
                      output->untyped_data(),
                      OrValid(xmoe->untyped_data(), xmoe->element_count(), output->untyped_data()),
                      words + 1,   // hints: counted, never read
                      words + 0};  // status: zeroed by the publish kernel
  std::copy(values, values + 10, plan.ptr);
  plan.eps = eps, plan.out_eps = out_eps, plan.tokens = int32_t(T);
  plan.consumer = {cubin, entry, smem, block, pdl, T};
  return ffi::Error::Success();
}

// ---- execute: launches on XLA's stream (outside command buffers) ------------------------------
ffi::Error LaunchPublish(CUstream stream, PeerPlan& plan) {
  auto fn = GetFunction(plan.publish_cubin, plan.publish_entry, 0);  // loaded on first use
  if (fn.has_error()) return fn.error();
  CUlaunchAttribute attr = {};
  attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attr.value.programmaticStreamSerializationAllowed = plan.consumer.pdl ? 1 : 0;
  CUlaunchConfig config = {};
  config.gridDimX = unsigned(plan.publish_grid());
  config.gridDimY = config.gridDimZ = 1;
  config.blockDimX = kPublishThreads;
  config.blockDimY = config.blockDimZ = 1;
  config.hStream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
  if (CUresult r = driver().LaunchKernelEx(&config, *fn, plan.publish_params(), nullptr))
    return CudaError(r, plan.publish_entry, "cuLaunchKernelEx");
  return ffi::Error::Success();
}

ffi::Error PeerExecute(CUstream stream, int32_t ordinal, PEER_BUFFER_SIG, PEER_ATTR_SIG) {
  PeerPlan plan;
  if (auto error = PlanPeer(plan, ordinal, true, PEER_BUFFER_ARGS, PEER_ATTR_ARGS); error.failure()) return error;
  if (plan.copies_prefix())
    if (CUresult r = driver().MemcpyDtoDAsync(CUdeviceptr(plan.prefix_out), CUdeviceptr(plan.prefix_in),
                                              plan.prefix_bytes, stream))
      return CudaError(r, kTarget, "cuMemcpyDtoDAsync(prefix)");
  if (auto error = LaunchPublish(stream, plan); error.failure()) return error;
  return Launch(stream, plan.consumer, plan.consumer_params());
}

// ---- record: graph nodes inside an XLA command buffer -----------------------------------------
// [memcpy prefix ->] consumer <- publish, the publish depending on what XLA depends on (no
// explicit dependency), the consumer last (XLA's dependency for what follows). On kUpdate only
// XLA's buffers can have moved (partial, prefix, outputs, flags): the arguments are rewritten.
ffi::Error PeerRecord(RecordContext ctx, int32_t ordinal, PEER_BUFFER_SIG, PEER_ATTR_SIG) {
  PeerPlan plan;
  if (auto error = PlanPeer(plan, ordinal, false, PEER_BUFFER_ARGS, PEER_ATTR_ARGS); error.failure()) return error;
  auto commands = ctx.commands();
  const int64_t needed = (plan.copies_prefix() ? 1 : 0) + 2;
  if (ctx.action() == ffi::RecordAction::kUpdate) {
    if (commands.size() != needed)
      return ffi::Error::Internal(std::string(kTarget) + ": recorded " + std::to_string(commands.size()) +
                                  " commands, the update has " + std::to_string(needed));
    int64_t i = 0;
    if (plan.copies_prefix())
      if (auto e = ctx.UpdateMemcpyD2D(commands[i++], plan.prefix_out, const_cast<void*>(plan.prefix_in),
                                       plan.prefix_bytes);
          e.failure())
        return e;
    if (auto e = ctx.UpdateLaunch(commands[i++], plan.publish_args()); e.failure()) return e;
    return ctx.UpdateLaunch(commands[i], plan.consumer_args());
  }
  if (commands.capacity() < needed) {
    // XLA will trace the execute stage instead: load the modules now, outside the capture (the
    // mailboxes are allocated already: PlanPeer).
    for (auto [cubin_, entry_, smem_] : {std::tuple{cubin, entry, smem}, std::tuple{publish_cubin, publish_entry,
                                                                                     int64_t(0)}})
      if (auto fn = GetFunction(cubin_, entry_, smem_); fn.has_error()) return fn.error();
    return ctx.RequestStreamCapture();
  }
  auto consumer_image = CubinImage(cubin, entry);
  if (consumer_image.has_error()) return consumer_image.error();
  auto publish_image = CubinImage(publish_cubin, publish_entry);
  if (publish_image.has_error()) return publish_image.error();
  std::vector<const XLA_FFI_Command*> deps;
  if (plan.copies_prefix()) {
    auto copy = ctx.CreateMemcpyD2D(plan.prefix_out, const_cast<void*>(plan.prefix_in), plan.prefix_bytes);
    if (copy.has_error()) return copy.error();
    deps.push_back(*copy);
  }
  XLA_FFI_LaunchDims publish_dims{{plan.publish_grid(), 1, 1}, {int32_t(kPublishThreads), 1, 1}, {0, 0, 0}};
  auto publish = ctx.CreateLaunch(std::string(publish_entry).c_str(), (*publish_image)->data(),
                                  (*publish_image)->size(), ffi::SourceFormat::kCubin, publish_dims, 0u, pdl,
                                  plan.publish_args());
  if (publish.has_error()) return publish.error();
  deps.push_back(*publish);
  XLA_FFI_LaunchDims consumer_dims{{int32_t(kCluster), plan.tokens, 1}, {int32_t(block), 1, 1},
                                   {int32_t(kCluster), 1, 1}};
  auto consumer = ctx.CreateLaunch(std::string(entry).c_str(), (*consumer_image)->data(), (*consumer_image)->size(),
                                   ffi::SourceFormat::kCubin, consumer_dims, uint32_t(smem), pdl,
                                   plan.consumer_args(), deps);
  return consumer.has_error() ? consumer.error() : ffi::Error::Success();
}

// ---- initialize (only where the record stage is not registered) ---------------------------------
// Allocates the group and loads both kernels before XLA may trace execute under stream capture.
ffi::Error PeerInitialize(int32_t ordinal, ffi::RemainingArgs args, ffi::RemainingRets, PEER_ATTR_SIG) {
  if (block < 1 || block > 1024) return Invalid("block: expected 1..1024 threads, got " + std::to_string(block));
  auto prefix = args.get<Bf16_2>(1);
  if (prefix.has_error()) return prefix.error();
  auto found = FindGroup(ordinal, group, ranks, prefix->dimensions()[0], true);
  if (found.has_error()) return found.error();
  if (auto route = GetRoute(found->first, found->second); route.has_error()) return route.error();
  for (auto [path, name, bytes] : {std::tuple{cubin, entry, smem}, std::tuple{publish_cubin, publish_entry, int64_t(0)}})
    if (auto fn = GetFunction(path, name, bytes); fn.has_error()) return fn.error();
  return ffi::Error::Success();
}

}  // namespace

// The consumer's attributes (common.h), then the publish kernel's and the group's.
#define OPROJ_PEER_ATTRS                                                                       \
  OPROJ_ATTRS                                                                                  \
      .Attr<std::string_view>("publish_cubin")  /* cute/publish.py's cubin */                  \
      .Attr<std::string_view>("publish_entry")  /* its kernel entry */                         \
      .Attr<ffi::Span<const int64_t>>("group")  /* [groups, R] CUDA ordinals, rank order */    \
      .Attr<int64_t>("ranks")                   /* R */                                        \
      .Attr<int32_t>("skip_rank")               /* tests: this rank publishes nothing; -1 */

#define OPROJ_PEER_BUFFERS                                \
  .Arg<Bf16_2>()      /* partial [T, H] */                \
      .Arg<Bf16_2>()  /* prefix [T, H] */                 \
      .Arg<Bf16_3>()  /* blocks [T, NB, H] */             \
      .Arg<Bf16_1>()  /* norm [H] */                      \
      .Arg<Bf16_1>()  /* query [H] */                     \
      .Arg<Bf16_1>()  /* out_norm [H] */                  \
      .Ret<Bf16_2>()  /* prefix, updated (aliased) */     \
      .Ret<Bf16_2>()  /* output [T, H] */                 \
      .Ret<Bf16_3>()  /* xmoe [reps, T, H] */             \
      .Ret<Flags>()   /* [3] i32: status, hints, publish status */

// Graph-safe (file comment): every stage is compatible with XLA command buffers.
constexpr auto kPeerCmdBuffer = ffi::Traits::kCmdBufferCompatible;

XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojPeerInitialize, PeerInitialize,
                              ffi::Ffi::BindInitialize()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets() OPROJ_PEER_ATTRS,
                              {kPeerCmdBuffer});

XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojPeerExecute, PeerExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Ctx<ffi::DeviceOrdinal>() OPROJ_PEER_BUFFERS OPROJ_PEER_ATTRS,
                              {kPeerCmdBuffer});

XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojPeerRecord, PeerRecord,
                              ffi::Ffi::BindRecord()
                                  .Ctx<ffi::Extension<RecordExtension>>()
                                  .Ctx<ffi::DeviceOrdinal>() OPROJ_PEER_BUFFERS OPROJ_PEER_ATTRS,
                              {kPeerCmdBuffer});

// Re-arms every group's mailboxes and zeroes their control blocks (after a failed step: a rank
// that published late may have left data nobody will consume). Call with no peer call in
// flight on any device. Returns 0, or -1 with the reason in `message`. No group: no CUDA call.
extern "C" int OprojPeerReset(char* message, size_t size) {
  std::lock_guard<std::mutex> lock(groups_mutex);
  for (auto& [key, mailboxes] : groups)
    if (auto error = Arm(mailboxes); error.failure()) {
      std::snprintf(message, size, "%s", error.message().c_str());
      return -1;
    }
  return 0;
}

// ---- groups across processes (one process per GPU) -----------------------------------------------
// A group whose devices belong to several processes (jax.distributed, one process per GPU) has
// one rank here. Its table row holds this device's CUDA ordinal and -(1 + global device id) for
// every other rank (oproj_jax/cute/peer_ipc.py). Python connects it when it traces a step, before
// any call: OprojPeerExport allocates and arms this rank's mailbox and returns its legacy CUDA
// IPC handle (64 bytes); the processes exchange the handles through jax.distributed's key-value
// store; OprojPeerImport maps every other rank's mailbox into this device's context
// (cuIpcOpenMemHandle, peer access enabled lazily) and registers the group, after which the FFI
// stages find it like a group of this process. The protocol is unchanged: the addresses are
// other GPUs' memory either way, and each process arms and resets only its own mailbox (the
// owner of slot data is still the only one to re-arm it). A handle is published only after its
// mailbox is armed and the arming has completed, so no peer can see an unarmed slot.
namespace {

struct Exported {
  CUcontext context = nullptr;
  CUdeviceptr base = 0;
  CUipcMemHandle handle{};
  size_t mailbox_bytes = 0;
};
std::map<Key, Exported> exported;  // under groups_mutex; never erased, like `groups`

int Report(char* message, size_t size, const std::string& text) {
  std::snprintf(message, size, "%s", text.c_str());
  return -1;
}

// The row's key and this device's rank in it, or a message.
std::string RowKey(int32_t ordinal, const int64_t* row, int64_t ranks, int64_t tokens, Key& key, size_t& me) {
  if (ranks < 1 || ranks > kMaxRanks) return "ranks: expected 1..16, got " + std::to_string(ranks);
  if (tokens < 1 || tokens > 65535) return "tokens: expected 1..65535, got " + std::to_string(tokens);
  key = Key{std::vector<int64_t>(row, row + ranks), tokens, ranks};
  if (std::count(key.ordinals.begin(), key.ordinals.end(), int64_t(ordinal)) != 1)
    return "row: expected CUDA ordinal " + std::to_string(ordinal) + " exactly once";
  me = size_t(std::find(key.ordinals.begin(), key.ordinals.end(), int64_t(ordinal)) - key.ordinals.begin());
  if (!driver().error.empty()) return "the CUDA driver is unavailable: " + driver().error;
  return "";
}

}  // namespace

// Allocates and arms this rank's mailbox of the cross-process group `row` (R entries: this
// device's CUDA ordinal, -(1 + id) for the other ranks) for T tokens and writes its IPC handle
// (64 bytes) to `handle`. Called again for the same group: the same handle, nothing allocated.
// Returns 0, or -1 with the reason in `message`.
extern "C" int OprojPeerExport(int32_t ordinal, const int64_t* row, int64_t ranks, int64_t tokens,
                               unsigned char* handle, char* message, size_t size) {
  Key key;
  size_t me = 0;
  if (auto bad = RowKey(ordinal, row, ranks, tokens, key, me); !bad.empty()) return Report(message, size, bad);
  std::lock_guard<std::mutex> lock(groups_mutex);
  auto it = exported.find(key);
  if (it == exported.end()) {
    Mailboxes own;
    own.mailbox_bytes = size_t(ranks) * size_t(tokens) * size_t(kHidden) * 2;
    CUdevice device = 0;
    CUcontext context = nullptr;
    if (CUresult e = driver().DeviceGet(&device, ordinal)) return Report(message, size, CudaError(e, kTarget, "cuDeviceGet").message());
    if (CUresult e = driver().DevicePrimaryCtxRetain(&context, device))
      return Report(message, size, CudaError(e, kTarget, "cuDevicePrimaryCtxRetain").message());
    ScopedContext scope(context);
    if (scope.result()) return Report(message, size, CudaError(scope.result(), kTarget, "cuCtxPushCurrent").message());
    CUdeviceptr base = 0;
    if (CUresult e = driver().MemAlloc(&base, own.mailbox_bytes + kControlBytes))
      return Report(message, size, CudaError(e, kTarget, "cuMemAlloc (mailbox)").message());
    own.contexts = {context};
    own.base = {base};
    own.owned = {true};
    CUipcMemHandle ipc{};
    ffi::Error error = Arm(own);
    if (error.success())
      if (CUresult e = driver().IpcGetMemHandle(&ipc, base)) error = CudaError(e, kTarget, "cuIpcGetMemHandle");
    if (error.failure()) {
      driver().MemFree(base);
      return Report(message, size, error.message());
    }
    it = exported.emplace(key, Exported{context, base, ipc, own.mailbox_bytes}).first;
  }
  std::memcpy(handle, it->second.handle.reserved, CU_IPC_HANDLE_SIZE);
  return 0;
}

// Maps every other rank's mailbox of the group (`handles`: R * 64 bytes, rank order; this rank's
// entry is ignored) into this device's context and registers the group for the FFI stages.
// Needs OprojPeerExport of the same group first. Called again once registered: nothing to do.
// Returns 0, or -1 with the reason in `message` (then nothing stays mapped).
extern "C" int OprojPeerImport(int32_t ordinal, const int64_t* row, int64_t ranks, int64_t tokens,
                               const unsigned char* handles, char* message, size_t size) {
  Key key;
  size_t me = 0;
  if (auto bad = RowKey(ordinal, row, ranks, tokens, key, me); !bad.empty()) return Report(message, size, bad);
  std::lock_guard<std::mutex> lock(groups_mutex);
  if (groups.count(key)) return 0;
  auto it = exported.find(key);
  if (it == exported.end()) return Report(message, size, "this rank's mailbox was not exported (OprojPeerExport) first");
  const Exported& own = it->second;
  Mailboxes m;
  m.mailbox_bytes = own.mailbox_bytes;
  m.contexts.assign(size_t(ranks), own.context);
  m.base.assign(size_t(ranks), 0);
  m.owned.assign(size_t(ranks), false);
  ScopedContext scope(own.context);
  if (scope.result()) return Report(message, size, CudaError(scope.result(), kTarget, "cuCtxPushCurrent").message());
  for (size_t r = 0; r < size_t(ranks); ++r) {
    if (r == me) {
      m.base[r] = own.base, m.owned[r] = true;
      continue;
    }
    CUipcMemHandle ipc{};
    std::memcpy(ipc.reserved, handles + r * CU_IPC_HANDLE_SIZE, CU_IPC_HANDLE_SIZE);
    if (CUresult e = driver().IpcOpenMemHandle(&m.base[r], ipc, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)) {
      for (size_t q = 0; q < r; ++q)
        if (q != me) driver().IpcCloseMemHandle(m.base[q]);
      return Report(message, size,
                    CudaError(e, kTarget, "cuIpcOpenMemHandle (rank " + std::to_string(r) + "'s mailbox)").message());
    }
  }
  groups.emplace(key, std::move(m));
  return 0;
}

// How many groups have mailboxes (tests and diagnostics).
extern "C" int64_t OprojPeerGroupCount() {
  std::lock_guard<std::mutex> lock(groups_mutex);
  return int64_t(groups.size());
}
