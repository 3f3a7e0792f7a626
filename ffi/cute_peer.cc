// mode="peer": the TP all-reduce by peer writes into mailboxes this library owns, consumed by the
// CuTe kernel's Lamport protocol (oproj_jax/cute/peer.py is the Python side; cute/ABI.md).
//
// A group runs in one process driving all its GPUs (JAX's usual single-host layout), or with one
// rank per process ("groups across processes" below: the same, except that each process
// allocates only its own rank's mailbox and maps the others' by CUDA IPC). Each group (its
// devices' CUDA ordinals in rank order) has ONE mailbox per device, R slots of max_tokens rows
// of row_bytes (both from the call: [R, max_tokens, H] bf16) plus its meeting words, allocated
// when the group opens (first use, or the cross-process connect) in the device's primary
// context, peer access enabled between every pair, armed with the sentinel 0x80000000; every
// T <= max_tokens uses rows 0..T-1 of each slot, so a fragment's
// address never depends on T. Per device and group, 64 bytes of control words come from a pool
// that is never freed (see "Fail-stop"). OprojPeerClose frees the mailboxes and unmaps the
// other processes' (peer.close()); memory: R * max_tokens * row_bytes plus R u64 meeting words
// (256 bytes up to R = 32) per group and device, plus the 64 KiB pool per device.
//
// The kernels are Python's: the call's attributes name the publish launch and the consumer
// launch (launch.h: cubin, shape, typed parameters). What only this file knows reaches them as
// the parameter kinds it resolves: this rank's mailbox, its slot in every rank's mailbox, its
// control words, and a scalar that is 0 on one rank (a test's rank that publishes nothing).
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
// The re-arm is kernel.py's st.relaxed.sys on the owning GPU and the publisher's poll an
// ld.relaxed.sys: both at least relaxed at system scope, so by the PTX memory model the
// publisher observes the re-arm (and the coherence order of the one address orders the two
// sides' accesses); the publisher's store is st.relaxed.sys too.
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
// This needs every rank's peer calls for one group to run in the same order on every
// device (SPMD) and in program order on each: XLA's thunk sequence and its default command
// buffer scheduling (LHS: one stream's commands serialized) do that. Under
// --xla_gpu_command_buffer_scheduling_mode=CONCURRENT two peer calls with no data dependence
// could overlap in a graph: not supported.
//
// ---- Fail-stop, one deadline per call, reset ------------------------------------------------
// Each rank's control words hold a fail-stop word (u32 at +8). Every wait gives up after
// `timeout_us` microseconds of wall time, or as soon as the fail-stop word is set (another wave
// or CTA of the same call gave up first), so a call reports a missing rank within about one
// timeout whatever T is. A consumer that gives up stores status 1 into flags[0], ORs 1 into the
// fail-stop word and reads NaN for every fragment it did not receive (it re-arms only those it
// read); a publish thread that gives up stores nothing there and ORs 4 into both flags[2] and the
// fail-stop word. Both kernels read the fail-stop word first: a nonzero word makes the call
// refuse (status 8 | the word; no mailbox access at all; every output NaN). So after
// the first failure no step of that rank can consume a late publish as its own, and the ranks
// it waits for fail in turn (each within one timeout): every later step of the group is refused
// on every rank until OprojPeerReset (peer.reset(), with no call in flight), which re-arms every
// slot and zeroes the control words. A test's rank that publishes nothing launches the publish
// kernel with no destination (its n_dest: kPeerU32UnlessRank).
//
// ---- First calls meet -----------------------------------------------------------------------
// In a group across processes each process compiles on its own clock. The first execution of
// each call site (ffi::State made by the instantiate stage; in a command buffer, each new
// recording) meets the other ranks on the host before launching anything: it stores its meeting
// count into its word of every rank's meeting words and waits, at most connect_timeout_s, until
// its own words all reach it. Compile skew is absorbed there, never by timeout_us.
//
// ---- Close ----------------------------------------------------------------------------------
// OprojPeerClose sets kClosed in each fail-stop word it owns, keeps those control words (a
// recorded graph or a compiled executable still points at them) and frees the rest. A closed
// one-process group reopens on its next call; a closed group across processes routes its calls
// to the retired words (status 8 | 16, NaN, no mailbox access) until a traced step connects it.
//
// ---- Command buffers ------------------------------------------------------------------------
// The target is command-buffer compatible and has a record stage (OprojPeerRecord): inside an
// XLA command buffer it adds [a memcpy of an unaliased prefix,] the publish kernel node and the
// consumer node depending on it, each with its launch's cluster and PDL attributes; when XLA
// hands new buffers (partial, prefix, outputs) it updates their arguments. The mailboxes and
// control blocks are this library's and never move, so a recorded graph stays valid until the
// process ends.
#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include "common.h"
#include "launch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace oproj;  // driver(), CudaError, Kernel, Copies, Resolver, the parameter kinds

constexpr unsigned kSentinel = 0x80000000u;  // an empty mailbox word (docs/spec.md "Mailbox protocol")
constexpr const char* kTarget = "oproj_cute_peer";

ffi::Error Invalid(const std::string& what) { return oproj::Invalid(kTarget, what); }

// One call site's state (the instantiate stage makes it once per executable): whether its first
// execution has met the other processes (Meet).
struct Site {
  static ffi::TypeId id;
  bool met = false;
};
ffi::TypeId Site::id = {};
const bool site_registered = AddStateType({"oproj_peer_site", &Site::id, ffi::MakeTypeInfo<Site>()});

// ---- the groups' memory ------------------------------------------------------------------------
// Layout of one rank's mailbox allocation: R slots of max_tokens rows of row_bytes ([R,
// max_tokens, H] bf16; a call with T tokens uses rows 0..T-1 of every slot, so each fragment's
// address is the same for every T), then the meeting words (R u64, one per rank: how many
// first-call meetings that rank has entered, padded to kMeetAlign bytes). The control words of
// a rank live apart, in a per-device pool that is never freed (kControlBytes each: u64 CTA
// counter of the publish kernel at 0, u32 fail-stop word at 8, u32 publish status accumulator
// at 12), so that an executable recorded before close() still finds them: the kernels read the
// fail-stop word (kClosed) before anything else and refuse.
constexpr size_t kMeetAlign = 256;         // the meeting words' size is a multiple of it
constexpr size_t kControlBytes = 64;       // one rank's control words
constexpr size_t kControlPoolBytes = 1 << 16;  // per device: 1024 groups opened over the process's life
constexpr unsigned kClosed = 16;           // the fail-stop word of a closed group (peer.STATUS_CLOSED)

struct Key {
  std::vector<int64_t> ordinals;  // the group's devices (CUDA ordinals, -(1 + id) elsewhere), rank order
  bool operator<(const Key& o) const { return ordinals < o.ordinals; }
  bool cross() const {
    return std::any_of(ordinals.begin(), ordinals.end(), [](int64_t o) { return o < 0; });
  }
};

struct Group {
  int64_t capacity = 0;             // max_tokens: rows per slot
  int64_t row_bytes = 0;            // bytes per row
  size_t slot_bytes = 0;            // capacity * row_bytes
  size_t mailbox_bytes = 0;         // R * slot_bytes; the meeting words follow
  size_t meet_bytes = 0;            // R u64, padded to kMeetAlign
  std::vector<CUcontext> contexts;  // per rank: the primary context its base is mapped in
  std::vector<CUdeviceptr> base;    // per rank: its mailbox allocation (here, or mapped by IPC)
  std::vector<bool> owned;          // per rank: allocated here (armed, reset, freed here)
  std::vector<CUdeviceptr> control; // per rank: its control words (owned ranks only)
  int64_t meetings = 0;             // first-call meetings entered (groups across processes)
  CUipcMemHandle handle{};          // across processes: this rank's export
};

std::mutex groups_mutex;
std::map<Key, Group> groups;                            // open groups (peer.close() frees them)
std::map<Key, Group> pending;  // across processes: this rank exported, the others not mapped yet
std::map<Key, std::vector<CUdeviceptr>> retired;        // closed groups' control words (kClosed)
std::map<int64_t, std::pair<CUdeviceptr, size_t>> pools;  // per CUDA ordinal: control pool, used

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

// A private non-blocking stream of the current context, destroyed with this object. Host work of
// the handler (arming, meetings, reading a word) runs on it and waits for it alone: XLA's streams
// may hold kernels of other groups that spin until a peer publishes, so a device-wide
// synchronization could stall until their deadline.
class PrivateStream {
 public:
  PrivateStream() : result_(driver().StreamCreate(&stream_, CU_STREAM_NON_BLOCKING)) {}
  ~PrivateStream() {
    if (result_ == CUDA_SUCCESS) driver().StreamDestroy(stream_);
  }
  CUresult result() const { return result_; }
  CUstream get() const { return stream_; }
  CUresult sync() const { return driver().StreamSynchronize(stream_); }

 private:
  CUstream stream_ = nullptr;
  CUresult result_;
};

// Fills `words` u32 at `ptr` with `value` in context `ctx` and waits for it.
ffi::Error Fill(CUcontext ctx, CUdeviceptr ptr, unsigned value, size_t words, const char* what) {
  ScopedContext scope(ctx);
  if (scope.result()) return CudaError(scope.result(), kTarget, "cuCtxPushCurrent");
  PrivateStream stream;
  if (stream.result()) return CudaError(stream.result(), kTarget, "cuStreamCreate");
  if (CUresult e = driver().MemsetD32Async(ptr, value, words, stream.get()))
    return CudaError(e, kTarget, std::string("cuMemsetD32Async (") + what + ")");
  if (CUresult e = stream.sync()) return CudaError(e, kTarget, std::string("cuStreamSynchronize (") + what + ")");
  return ffi::Error::Success();
}

// Arms the slots of every rank this process owns (the sentinel) and zeroes its control words.
ffi::Error Arm(Group& g) {
  for (size_t r = 0; r < g.base.size(); ++r) {
    if (!g.owned[r]) continue;  // another process's mailbox: its owner arms it
    if (auto e = Fill(g.contexts[r], g.base[r], kSentinel, g.mailbox_bytes / 4, "arming the mailbox"); e.failure())
      return e;
    if (auto e = Fill(g.contexts[r], g.control[r], 0, kControlBytes / 4, "zeroing the control words"); e.failure())
      return e;
  }
  return ffi::Error::Success();
}

// The next free control words of device `ordinal` (context `ctx`), from its pool; zeroed by Arm.
ffi::ErrorOr<CUdeviceptr> TakeControl(int64_t ordinal, CUcontext ctx) {
  auto& [pool, used] = pools[ordinal];
  if (!pool) {
    ScopedContext scope(ctx);
    if (scope.result()) return CudaError(scope.result(), kTarget, "cuCtxPushCurrent");
    if (CUresult e = driver().MemAlloc(&pool, kControlPoolBytes))
      return CudaError(e, kTarget, "cuMemAlloc (the control words' pool)");
  }
  if (used + kControlBytes > kControlPoolBytes)
    return Invalid("mode='peer': " + std::to_string(kControlPoolBytes / kControlBytes) +
                   " groups were opened on CUDA device " + std::to_string(ordinal) +
                   " over this process's life; their control words are never reused (an executable recorded before "
                   "peer.close() may still read them)");
  CUdeviceptr out = pool + used;
  used += kControlBytes;
  return out;
}

// Frees what the group holds (mapped mailboxes closed, owned ones freed, contexts released).
void Release(Group& g) {
  for (size_t r = 0; r < g.base.size(); ++r) {
    if (!g.base[r]) continue;
    ScopedContext scope(g.contexts[r]);
    if (g.owned[r])
      driver().MemFree(g.base[r]);
    else
      driver().IpcCloseMemHandle(g.base[r]);
    g.base[r] = 0;
  }
  for (size_t r = 0; r < g.contexts.size(); ++r) {
    if (!g.owned[r] || !g.contexts[r]) continue;
    CUdevice device = 0;
    ScopedContext scope(g.contexts[r]);
    if (!scope.result() && !driver().CtxGetDevice(&device)) driver().DevicePrimaryCtxRelease(device);
  }
}

// Allocates, for the ranks of `key` that live in this process (all of them, or one across
// processes), the mailbox allocation and control words, enables peer access between the
// devices of a one-process group, arms the slots and zeroes the meeting words. On failure
// everything it allocated is released.
ffi::Error Open(const Key& key, int64_t capacity, int64_t row_bytes, Group& g) {
  const size_t R = key.ordinals.size();
  g.capacity = capacity, g.row_bytes = row_bytes;
  g.slot_bytes = size_t(capacity) * size_t(row_bytes);
  g.mailbox_bytes = R * g.slot_bytes;
  g.meet_bytes = (R * 8 + kMeetAlign - 1) / kMeetAlign * kMeetAlign;
  g.contexts.assign(R, nullptr);
  g.base.assign(R, 0);
  g.owned.assign(R, false);
  g.control.assign(R, 0);
  std::vector<CUdevice> devices(R, 0);
  for (size_t r = 0; r < R; ++r) {
    if (key.ordinals[r] < 0) continue;
    if (CUresult e = driver().DeviceGet(&devices[r], int(key.ordinals[r])))
      return CudaError(e, kTarget, "cuDeviceGet(" + std::to_string(key.ordinals[r]) + ")");
    if (CUresult e = driver().DevicePrimaryCtxRetain(&g.contexts[r], devices[r]))
      return CudaError(e, kTarget, "cuDevicePrimaryCtxRetain");
    g.owned[r] = true;
  }
  auto fail = [&g](ffi::Error error) {
    Release(g);
    return error;
  };
  for (size_t a = 0; a < R; ++a)
    for (size_t b = 0; b < R; ++b) {
      if (a == b || !g.owned[a] || !g.owned[b]) continue;
      int can = 1;
      if (CUresult e = driver().DeviceCanAccessPeer(&can, devices[a], devices[b]))
        return fail(CudaError(e, kTarget, "cuDeviceCanAccessPeer"));
      if (!can)
        return fail(Invalid("mode='peer': GPU " + std::to_string(key.ordinals[a]) + " cannot write to GPU " +
                            std::to_string(key.ordinals[b]) + "'s memory (no peer access between them)"));
      ScopedContext scope(g.contexts[a]);
      if (scope.result()) return fail(CudaError(scope.result(), kTarget, "cuCtxPushCurrent"));
      CUresult e = driver().CtxEnablePeerAccess(g.contexts[b], 0);
      if (e && e != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)  // XLA usually enabled it already
        return fail(CudaError(e, kTarget, "cuCtxEnablePeerAccess"));
    }
  for (size_t r = 0; r < R; ++r) {
    if (!g.owned[r]) continue;
    {
      ScopedContext scope(g.contexts[r]);
      if (scope.result()) return fail(CudaError(scope.result(), kTarget, "cuCtxPushCurrent"));
      if (CUresult e = driver().MemAlloc(&g.base[r], g.mailbox_bytes + g.meet_bytes))
        return fail(CudaError(e, kTarget, "cuMemAlloc (" + std::to_string(g.mailbox_bytes + g.meet_bytes) +
                                               " bytes of mailbox: R * max_tokens * row_bytes plus the meeting words)"));
    }
    auto control = TakeControl(key.ordinals[r], g.contexts[r]);
    if (control.has_error()) return fail(control.error());
    g.control[r] = *control;
    if (auto e = Fill(g.contexts[r], g.base[r] + g.mailbox_bytes, 0, g.meet_bytes / 4, "zeroing the meeting words");
        e.failure())
      return fail(e);
  }
  if (auto e = Arm(g); e.failure()) return fail(e);
  return ffi::Error::Success();
}

// What a call of rank `me` needs beyond its kernels' parameters: whether its first execution
// meets the other processes first, and where.
struct Route {
  bool meets = false;                   // a group across processes, open
  std::vector<CUdeviceptr> meet_words;  // per rank: its meeting words (the mapping in this context)
  CUcontext context = nullptr;
};

// The peer kinds of launch.h for rank `me` of an open group (or, for `g` null, a closed group's
// retired control words only): the same addresses on every call, which lets a recorded graph
// keep them.
class GroupResolver : public Resolver {
 public:
  GroupResolver(const Group* g, size_t me, CUdeviceptr control) : g_(g), me_(me), control_(control) {}

  ffi::Error Resolve(int64_t kind, int64_t value, int64_t extra, Param& out) const override {
    switch (kind) {
      case kPeerMailbox:  // this rank's own mailbox
        out = Param{g_ ? g_->base[me_] + uint64_t(extra) : 0, 8, true};
        return ffi::Error::Success();
      case kPeerSlot:  // slot `me` of rank `value`'s mailbox
        out = Param{g_ && value >= 0 && size_t(value) < g_->base.size() ? g_->base[value] + me_ * g_->slot_bytes : 0,
                    8, true};
        return ffi::Error::Success();
      case kPeerControl:  // this rank's control words
        out = Param{control_ + uint64_t(extra), 8, true};
        return ffi::Error::Success();
      case kPeerU32UnlessRank:
        out = Param{int64_t(me_) == extra ? 0 : uint64_t(uint32_t(value)), 4, false};
        return ffi::Error::Success();
    }
    return Invalid("params: kind " + std::to_string(kind) + " is not a parameter kind of launch.h");
  }

 private:
  const Group* g_;
  size_t me_;
  CUdeviceptr control_;
};

// Rank `me`'s route in the group `key` (opening a one-process group on first use), and `plan`
// run with the group's resolver while the group cannot be closed. A closed group across
// processes (peer.close(); reconnected only when a step is traced again) resolves to its retired
// control words and null mailboxes: both kernels refuse (status kClosed) and touch no mailbox.
template <typename PlanFn>
ffi::ErrorOr<Route> GetRoute(const Key& key, size_t me, int64_t capacity, int64_t row_bytes, PlanFn&& plan) {
  std::lock_guard<std::mutex> lock(groups_mutex);
  auto it = groups.find(key);
  Route route;
  if (it == groups.end()) {
    if (key.cross()) {
      auto old = retired.find(key);
      if (old != retired.end() && old->second[me]) {
        if (auto e = plan(GroupResolver(nullptr, me, old->second[me])); e.failure()) return e;
        return route;
      }
      return Invalid(
          "mode='peer': this group spans processes and its mailboxes are not connected in this process "
          "(oproj_jax.cute.peer_ipc.connect, which tp_consumer runs when it traces a step, maps them)");
    }
    Group fresh;
    if (auto error = Open(key, capacity, row_bytes, fresh); error.failure()) return error;
    it = groups.emplace(key, std::move(fresh)).first;
  }
  const Group& g = it->second;
  if (g.capacity != capacity || g.row_bytes != row_bytes)
    return Invalid("max_tokens: this group's mailboxes are open with max_tokens = " + std::to_string(g.capacity) +
                   " rows of " + std::to_string(g.row_bytes) + " bytes, this call has " + std::to_string(capacity) +
                   " of " + std::to_string(row_bytes) +
                   "; every call of a group uses one max_tokens (or call oproj_jax.cute.peer.close() first)");
  if (auto e = plan(GroupResolver(&g, me, g.control[me])); e.failure()) return e;
  if (key.cross()) {
    route.meets = true;
    route.context = g.contexts[me];
    for (size_t r = 0; r < g.base.size(); ++r) route.meet_words.push_back(g.base[r] + g.mailbox_bytes);
  }
  return route;
}

// The first-call meeting of a group across processes: this rank enters meeting n (its n-th
// first execution of a call site of the group; every rank runs the same call sites in the same
// order) by storing n into its word of every rank's meeting words, then waits until every word
// of its own is >= n, at most `timeout_s` seconds. Host work only, before this call's kernels:
// compile skew between processes is absorbed here, never by the kernels' timeout_us.
ffi::Error Meet(const Key& key, size_t me, const Route& route, float timeout_s) {
  int64_t n = 0;
  {
    std::lock_guard<std::mutex> lock(groups_mutex);
    auto it = groups.find(key);
    if (it == groups.end()) return ffi::Error::Success();  // closed meanwhile: the kernels refuse
    n = ++it->second.meetings;
  }
  const size_t R = route.meet_words.size();
  ScopedContext scope(route.context);
  if (scope.result()) return CudaError(scope.result(), kTarget, "cuCtxPushCurrent");
  PrivateStream stream;
  if (stream.result()) return CudaError(stream.result(), kTarget, "cuStreamCreate");
  uint64_t mine = uint64_t(n);
  for (size_t r = 0; r < R; ++r)
    if (CUresult e = driver().MemcpyHtoDAsync(route.meet_words[r] + me * 8, &mine, 8, stream.get()))
      return CudaError(e, kTarget, "cuMemcpyHtoDAsync (first-call meeting)");
  if (CUresult e = stream.sync()) return CudaError(e, kTarget, "cuStreamSynchronize (first-call meeting)");
  const auto start = std::chrono::steady_clock::now();
  std::vector<uint64_t> words(R, 0);
  for (;;) {
    if (CUresult e = driver().MemcpyDtoHAsync(words.data(), route.meet_words[me], R * 8, stream.get()))
      return CudaError(e, kTarget, "cuMemcpyDtoHAsync (first-call meeting)");
    if (CUresult e = stream.sync()) return CudaError(e, kTarget, "cuStreamSynchronize (first-call meeting)");
    size_t late = R;
    for (size_t r = 0; r < R; ++r)
      if (words[r] < mine) late = r;
    if (late == R) return ffi::Error::Success();
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > timeout_s)
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                        std::string(kTarget) + ": mode='peer': rank " + std::to_string(late) +
                            " did not reach the first call of this step within connect_timeout_s = " +
                            std::to_string(timeout_s) + " s (does every process run the same steps?)");
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// ---- the group of this device ------------------------------------------------------------------
// Finds this device in the group table ([groups, R] CUDA ordinals, flattened): its row is the
// group, its column `me`. With `check_context`, checked against the current context, whose
// device the module cache and the launches use (execute; the record stage hands XLA the cubin
// bytes and never launches itself).
ffi::ErrorOr<std::pair<Key, size_t>> FindGroup(int32_t ordinal, ffi::Span<const int64_t> table, int64_t ranks,
                                               bool check_context) {
  if (ranks < 1) return Invalid("ranks: expected R >= 1, got " + std::to_string(ranks));
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
  Key key{std::vector<int64_t>(table.begin() + row * ranks, table.begin() + (row + 1) * ranks)};
  return std::make_pair(std::move(key), index % size_t(ranks));
}

// ---- one call's work --------------------------------------------------------------------------
// [a copy of an unaliased in-place operand,] the publish launch, the consumer launch. The execute
// stage runs it on the stream, the record stage turns it into graph nodes (and updates them).
struct PeerPlan {
  Kernel publish, consumer;
  Copies copies;
  // the call site's first execution of a group across processes meets the other ranks first
  Key key;
  size_t me = 0;
  Route route;
};

// The attributes every stage binds (names are matched, order is free): the consumer launch, the
// publish launch ("publish_"), the in-place operands and the group.
#define PEER_ATTR_SIG                                                                                    \
  OPROJ_LAUNCH_SIG(), OPROJ_LAUNCH_SIG(publish_), ffi::Span<const int64_t> inplace,                      \
      ffi::Span<const int64_t> group, int64_t ranks, int64_t max_tokens, int64_t row_bytes,             \
      float connect_timeout_s
#define PEER_ATTR_ARGS                                                                                   \
  cubin, entry, grid, block, cluster, smem, pdl, params, publish_cubin, publish_entry, publish_grid,       \
      publish_block, publish_cluster, publish_smem, publish_pdl, publish_params, inplace, group, ranks,  \
      max_tokens, row_bytes, connect_timeout_s

ffi::Error PlanPeer(PeerPlan& plan, int32_t ordinal, bool check_context, ffi::RemainingArgs args,
                    ffi::RemainingRets rets, PEER_ATTR_SIG) {
  if (max_tokens < 1 || row_bytes < 1)
    return Invalid("max_tokens, row_bytes: expected >= 1, got " + std::to_string(max_tokens) + ", " +
                   std::to_string(row_bytes));
  auto found = FindGroup(ordinal, group, ranks, check_context);
  if (found.has_error()) return found.error();
  const auto& [key, me] = *found;
  auto route = GetRoute(key, me, max_tokens, row_bytes, [&](const Resolver& resolver) {
    if (auto e = plan.publish.Plan(OPROJ_LAUNCH_VALUES(publish_), args, rets, &resolver); e.failure()) return e;
    return plan.consumer.Plan(OPROJ_LAUNCH_VALUES(), args, rets, &resolver);
  });
  if (route.has_error()) return route.error();
  plan.key = key, plan.me = me, plan.route = std::move(*route);
  return plan.copies.Plan(inplace, args, rets, kTarget);
}

// ---- execute: launches on XLA's stream (outside command buffers) ------------------------------
ffi::Error PeerExecute(CUstream stream, int32_t ordinal, Site* site, ffi::RemainingArgs args, ffi::RemainingRets rets,
                       PEER_ATTR_SIG) {
  PeerPlan plan;
  if (auto error = PlanPeer(plan, ordinal, true, args, rets, PEER_ATTR_ARGS); error.failure()) return error;
  if (plan.route.meets && !site->met) {  // this call site's first execution: meet the other processes
    if (auto error = Meet(plan.key, plan.me, plan.route, connect_timeout_s); error.failure()) return error;
    site->met = true;
  }
  if (auto error = plan.copies.Run(stream, kTarget); error.failure()) return error;
  if (auto error = plan.publish.Launch(stream); error.failure()) return error;
  return plan.consumer.Launch(stream);
}

// ---- record: graph nodes inside an XLA command buffer -----------------------------------------
// [memcpy ->] consumer <- publish, the publish depending on what XLA depends on (no explicit
// dependency), the consumer last (XLA's dependency for what follows). On kUpdate only XLA's
// buffers can have moved (operands, results): the arguments are rewritten.
ffi::Error PeerRecord(RecordContext ctx, int32_t ordinal, ffi::RemainingArgs args, ffi::RemainingRets rets,
                      PEER_ATTR_SIG) {
  PeerPlan plan;
  if (auto error = PlanPeer(plan, ordinal, false, args, rets, PEER_ATTR_ARGS); error.failure()) return error;
  // a new command buffer: its first execution follows, so a group across processes meets first
  if (plan.route.meets && ctx.action() != ffi::RecordAction::kUpdate)
    if (auto error = Meet(plan.key, plan.me, plan.route, connect_timeout_s); error.failure()) return error;
  auto commands = ctx.commands();
  const int64_t copies = plan.copies.size(), needed = copies + 2;
  if (ctx.action() == ffi::RecordAction::kUpdate) {
    if (commands.size() != needed)
      return ffi::Error::Internal(std::string(kTarget) + ": recorded " + std::to_string(commands.size()) +
                                  " commands, the update has " + std::to_string(needed));
    if (auto e = plan.copies.Update(ctx, commands); e.failure()) return e;
    if (auto e = plan.publish.Update(ctx, commands[copies]); e.failure()) return e;
    return plan.consumer.Update(ctx, commands[copies + 1]);
  }
  if (commands.capacity() < needed) {
    // XLA will trace the execute stage instead: load the modules now, outside the capture (the
    // mailboxes are allocated already: PlanPeer).
    for (const Kernel* kernel : {&plan.consumer, &plan.publish})
      if (auto fn = kernel->Function(); fn.has_error()) return fn.error();
    return ctx.RequestStreamCapture();
  }
  std::vector<const XLA_FFI_Command*> deps;
  if (auto e = plan.copies.Record(ctx, deps); e.failure()) return e;
  auto publish = plan.publish.Record(ctx, {});
  if (publish.has_error()) return publish.error();
  deps.push_back(*publish);
  auto consumer = plan.consumer.Record(ctx, deps);
  return consumer.has_error() ? consumer.error() : ffi::Error::Success();
}

// ---- instantiate: one state per call site -------------------------------------------------------
ffi::ErrorOr<std::unique_ptr<Site>> PeerInstantiate(PEER_ATTR_SIG) { return std::make_unique<Site>(); }

}  // namespace

// The two launches' attributes (launch.h), then the in-place operands and the group's.
#define OPROJ_PEER_ATTRS                                                                       \
  OPROJ_LAUNCH_ATTRS("") OPROJ_LAUNCH_ATTRS("publish_")                                        \
      .Attr<ffi::Span<const int64_t>>("inplace") /* (operand, result) pairs read in place */   \
      .Attr<ffi::Span<const int64_t>>("group")   /* [groups, R] CUDA ordinals, rank order */   \
      .Attr<int64_t>("ranks")                    /* R */                                       \
      .Attr<int64_t>("max_tokens")               /* rows per mailbox slot */                   \
      .Attr<int64_t>("row_bytes")                /* bytes per row */                           \
      .Attr<float>("connect_timeout_s")          /* bound of a first-call meeting, seconds */

// Graph-safe (file comment): every stage is compatible with XLA command buffers.
constexpr auto kPeerCmdBuffer = ffi::Traits::kCmdBufferCompatible;

XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojPeerInstantiate, PeerInstantiate, ffi::Ffi::BindInstantiate() OPROJ_PEER_ATTRS,
                              {kPeerCmdBuffer});

XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojPeerExecute, PeerExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<Site>>()
                                  .RemainingArgs()
                                  .RemainingRets() OPROJ_PEER_ATTRS,
                              {kPeerCmdBuffer});

XLA_FFI_DEFINE_HANDLER_SYMBOL(OprojPeerRecord, PeerRecord,
                              ffi::Ffi::BindRecord()
                                  .Ctx<ffi::Extension<RecordExtension>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets() OPROJ_PEER_ATTRS,
                              {kPeerCmdBuffer});

// Re-arms every open group's slots this process owns and zeroes their control words (the
// fail-stop word included): after a failed step, a rank that published late may have left data
// nobody will consume. Call with no peer call in flight on any device. Returns 0, or -1 with the
// reason in `message`. No group: no CUDA call.
extern "C" int OprojPeerReset(char* message, size_t size) {
  std::lock_guard<std::mutex> lock(groups_mutex);
  for (auto& [key, g] : groups)
    if (auto error = Arm(g); error.failure()) {
      std::snprintf(message, size, "%s", error.message().c_str());
      return -1;
    }
  return 0;
}

namespace {
int Report(char* message, size_t size, const std::string& text) {
  std::snprintf(message, size, "%s", text.c_str());
  return -1;
}

// Closes one group: waits for its devices' work, marks its control words closed (kernels of an
// executable recorded before refuse with status kClosed and touch no mailbox), keeps them as
// retired, frees the mailboxes this process owns and unmaps the others'.
std::string CloseGroup(const Key& key, Group& g) {
  std::string error;
  std::vector<CUdeviceptr> controls(g.base.size(), 0);
  for (size_t r = 0; r < g.base.size(); ++r) {
    if (!g.owned[r]) continue;
    {
      ScopedContext scope(g.contexts[r]);
      if (CUresult e = scope.result() ? scope.result() : driver().CtxSynchronize())
        if (error.empty()) error = CudaError(e, kTarget, "cuCtxSynchronize (close)").message();
    }
    if (auto e = Fill(g.contexts[r], g.control[r] + 8, kClosed, 1, "closing the control words"); e.failure())
      if (error.empty()) error = e.message();
    controls[r] = g.control[r];
  }
  retired[key] = controls;
  Release(g);
  return error;
}
}  // namespace

// Frees every group this process opened (mailboxes freed, other processes' mailboxes unmapped)
// and forgets them: the next traced step opens its group again. Their control words stay (a
// closed group's executables are refused, never fault). Call with no peer call in flight, in
// every process of a group (peer.close() waits for all of them before and after). Returns 0, or
// -1 with the first error in `message` (the groups are closed anyway).
extern "C" int OprojPeerClose(char* message, size_t size) {
  std::lock_guard<std::mutex> lock(groups_mutex);
  std::string error;
  for (auto* table : {&groups, &pending})
    for (auto& [key, g] : *table) {
      std::string e = CloseGroup(key, g);
      if (error.empty()) error = e;
    }
  groups.clear();
  pending.clear();
  return error.empty() ? 0 : Report(message, size, error);
}

// How many groups are open in this process (tests and diagnostics).
extern "C" int64_t OprojPeerGroupCount() {
  std::lock_guard<std::mutex> lock(groups_mutex);
  return int64_t(groups.size());
}

// Bytes of mailbox memory this process holds (its own ranks' allocations, not the fixed pool of
// control words: kControlPoolBytes per device once).
extern "C" int64_t OprojPeerAllocatedBytes() {
  std::lock_guard<std::mutex> lock(groups_mutex);
  int64_t total = 0;
  for (auto* table : {&groups, &pending})
    for (auto& [key, g] : *table)
      for (size_t r = 0; r < g.base.size(); ++r)
        if (g.owned[r] && g.base[r]) total += int64_t(g.mailbox_bytes + g.meet_bytes);
  return total;
}

// The OR of the fail-stop words of every open group's ranks in this process (0: none failed);
// -1 with the reason in `message` if one cannot be read.
extern "C" int64_t OprojPeerFailed(char* message, size_t size) {
  std::lock_guard<std::mutex> lock(groups_mutex);
  uint32_t all = 0;
  for (auto& [key, g] : groups)
    for (size_t r = 0; r < g.base.size(); ++r) {
      if (!g.owned[r]) continue;
      ScopedContext scope(g.contexts[r]);
      if (scope.result()) return Report(message, size, CudaError(scope.result(), kTarget, "cuCtxPushCurrent").message());
      PrivateStream stream;
      uint32_t word = 0;
      CUresult e = stream.result() ? stream.result() : driver().MemcpyDtoHAsync(&word, g.control[r] + 8, 4, stream.get());
      if (!e) e = stream.sync();
      if (e) return Report(message, size, CudaError(e, kTarget, "reading the fail-stop word").message());
      all |= word;
    }
  return int64_t(all);
}

// ---- groups across processes (one process per GPU) -----------------------------------------------
// A group whose devices belong to several processes (jax.distributed, one process per GPU) has
// one rank here. Its table row holds this device's CUDA ordinal and -(1 + global device id) for
// every other rank (oproj_jax/cute/peer_ipc.py). Python connects it when it traces a step:
// OprojPeerExport opens this rank's part (mailbox allocation armed, control words) and returns
// its legacy CUDA IPC handle (64 bytes); the processes exchange the handles through
// jax.distributed's key-value store; OprojPeerImport maps every other rank's mailbox into this
// device's context (cuIpcOpenMemHandle, peer access enabled lazily) and registers the group,
// after which the FFI stages find it like a group of this process. Each process arms, resets
// and frees only its own mailbox; a handle is published only after its mailbox is armed.
namespace {

// The row's key and this device's rank in it, or a message.
std::string RowKey(int32_t ordinal, const int64_t* row, int64_t ranks, int64_t capacity, int64_t row_bytes, Key& key,
                   size_t& me) {
  if (ranks < 1) return "ranks: expected R >= 1, got " + std::to_string(ranks);
  if (capacity < 1 || row_bytes < 1)
    return "max_tokens, row_bytes: expected >= 1, got " + std::to_string(capacity) + ", " + std::to_string(row_bytes);
  key = Key{std::vector<int64_t>(row, row + ranks)};
  if (std::count(key.ordinals.begin(), key.ordinals.end(), int64_t(ordinal)) != 1)
    return "row: expected CUDA ordinal " + std::to_string(ordinal) + " exactly once";
  me = size_t(std::find(key.ordinals.begin(), key.ordinals.end(), int64_t(ordinal)) - key.ordinals.begin());
  if (!driver().error.empty()) return "the CUDA driver is unavailable: " + driver().error;
  return "";
}

}  // namespace

// Opens this rank's part of the cross-process group `row` (R entries: this device's CUDA
// ordinal, -(1 + id) for the other ranks) with `max_tokens` rows of `row_bytes` per slot and writes its IPC
// handle (64 bytes) to `handle`. Called again for the same group: the same handle. Returns 0, or
// -1 with the reason in `message`.
extern "C" int OprojPeerExport(int32_t ordinal, const int64_t* row, int64_t ranks, int64_t max_tokens, int64_t row_bytes,
                               unsigned char* handle, char* message, size_t size) {
  Key key;
  size_t me = 0;
  if (auto bad = RowKey(ordinal, row, ranks, max_tokens, row_bytes, key, me); !bad.empty())
    return Report(message, size, bad);
  std::lock_guard<std::mutex> lock(groups_mutex);
  Group* g = nullptr;
  if (auto open = groups.find(key); open != groups.end()) g = &open->second;
  if (auto half = pending.find(key); half != pending.end()) g = &half->second;
  if (!g) {
    Group fresh;
    if (auto error = Open(key, max_tokens, row_bytes, fresh); error.failure())
      return Report(message, size, error.message());
    ScopedContext scope(fresh.contexts[me]);
    if (CUresult e = scope.result() ? scope.result() : driver().IpcGetMemHandle(&fresh.handle, fresh.base[me])) {
      Release(fresh);
      return Report(message, size, CudaError(e, kTarget, "cuIpcGetMemHandle").message());
    }
    g = &pending.emplace(key, std::move(fresh)).first->second;
  }
  if (g->capacity != max_tokens || g->row_bytes != row_bytes)
    return Report(message, size, "max_tokens: this group is open with max_tokens = " + std::to_string(g->capacity) +
                                     " rows of " + std::to_string(g->row_bytes) + " bytes, asked for " +
                                     std::to_string(max_tokens) + " of " + std::to_string(row_bytes) +
                                     " (close the groups first)");
  std::memcpy(handle, g->handle.reserved, CU_IPC_HANDLE_SIZE);
  return 0;
}

// Maps every other rank's mailbox of the group (`handles`: R * 64 bytes, rank order; this rank's
// entry is ignored) into this device's context and registers the group for the FFI stages.
// Needs OprojPeerExport of the same group first. Called again once registered: nothing to do.
// Returns 0, or -1 with the reason in `message` (then nothing stays mapped).
extern "C" int OprojPeerImport(int32_t ordinal, const int64_t* row, int64_t ranks, int64_t max_tokens, int64_t row_bytes,
                               const unsigned char* handles, char* message, size_t size) {
  Key key;
  size_t me = 0;
  if (auto bad = RowKey(ordinal, row, ranks, max_tokens, row_bytes, key, me); !bad.empty())
    return Report(message, size, bad);
  std::lock_guard<std::mutex> lock(groups_mutex);
  if (groups.count(key)) return 0;
  auto it = pending.find(key);
  if (it == pending.end()) return Report(message, size, "this rank's mailbox was not exported (OprojPeerExport) first");
  Group& g = it->second;
  ScopedContext scope(g.contexts[me]);
  if (scope.result()) return Report(message, size, CudaError(scope.result(), kTarget, "cuCtxPushCurrent").message());
  for (size_t r = 0; r < size_t(ranks); ++r) {
    if (r == me) continue;
    CUipcMemHandle ipc{};
    std::memcpy(ipc.reserved, handles + r * CU_IPC_HANDLE_SIZE, CU_IPC_HANDLE_SIZE);
    g.contexts[r] = g.contexts[me];
    if (CUresult e = driver().IpcOpenMemHandle(&g.base[r], ipc, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)) {
      for (size_t q = 0; q < r; ++q)
        if (q != me && g.base[q]) driver().IpcCloseMemHandle(g.base[q]), g.base[q] = 0;
      return Report(message, size,
                    CudaError(e, kTarget, "cuIpcOpenMemHandle (rank " + std::to_string(r) + "'s mailbox)").message());
    }
  }
  groups.emplace(key, std::move(g));
  pending.erase(it);
  return 0;
}
