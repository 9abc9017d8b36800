// Engine: the background thread that runs the negotiation cycles described
// in negotiator.h, plus Enqueue-time validation.
//
// Threading: Enqueue/Abort/stats may be called from any thread; they touch
// only the state guarded by `mu_`.  Everything else (pending table, response
// cache, negotiator, executor, transport) belongs to the engine thread.
// `done` callbacks run on the engine thread without `mu_` held, so they may
// call Enqueue again (TF does, for the next step).

#include "cc/engine/engine.h"

#include <pthread.h>
#include <sys/prctl.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <list>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "cc/engine/autotuner.h"
#include "cc/engine/executor.h"
#include "cc/engine/fusion.h"
#include "cc/common/logging.h"
#include "cc/engine/message.h"
#include "cc/engine/negotiator.h"
#include "cc/engine/peer_monitor.h"
#include "cc/engine/response_cache.h"
#include "cc/engine/stall_inspector.h"
#include "cc/engine/timeline.h"

namespace mpistrategy {

namespace {

// After a peer timeout: how long the monitor waits (for the engine thread
// to fail the pending collectives and for abort notices to leave) before it
// calls the embedding's PeerTimeoutHandler.
constexpr double kPeerTimeoutGraceSeconds = 1.0;

// The engine whose cycle this thread is running, if any: a `done` that TF
// continues on the same thread may enqueue again, and that enqueue must not
// start a cycle inside the cycle.
thread_local const void* cycle_owner_on_this_thread = nullptr;

// An op's thread that starts a cycle (TryCycleOnThisThread) waits this long
// for its peers before it hands the cycle to the engine thread, and runs
// the collectives itself only up to this many bytes: it is one of
// TensorFlow's few inter-op threads, which must not sit out a late peer or
// a large copy.
constexpr double kOpThreadPatienceSeconds = 50e-6;
constexpr int64_t kOpThreadMaxBytes = 64 * 1024;

// An idle rank's empty cycles only keep its peers' rendezvous moving (a
// submission wakes the engine at once), yet each costs a rendezvous and its
// wait on every rank, which is CPU taken from TensorFlow where ranks share
// cores.  So while nothing is submitted on this rank, the idle period
// doubles after every empty cycle, from cycle_time_ms up to this (or
// cycle_time_ms if larger); the next submission resets it.
constexpr double kMaxIdlePeriodMs = 16.0;
// The first idle period is at least this: a cycle_time_ms far below what a
// sleep can measure (1e-30 is valid) would otherwise need a thousand
// doublings, each an empty cycle at once, to reach kMaxIdlePeriodMs.
constexpr double kMinIdlePeriodMs = 1e-3;

// A cycle whose rendezvous agrees on nothing while this rank has entries
// pending means the peers have submitted other tensors first: TensorFlow
// may run independent collectives in a different order on every rank, and
// one that is ready may wait behind a long kernel for TensorFlow's only
// inter-op thread.  Cycling again at once repeats that empty rendezvous as
// fast as the ranks can meet (hundreds of thousands a second, on every
// rank), which takes the cores from the kernels that compute the missing
// tensors.  A short run of such cycles is a race that the next cycle
// settles, so after kEmptyCyclesBeforeBackoff of them in a row the engine
// thread waits between cycles for a submission of its own or a back-off
// that doubles from the first to the last bound below; a peer's late
// submission then waits at most that long for this rank's rendezvous.
constexpr int kEmptyCyclesBeforeBackoff = 32;
constexpr std::chrono::microseconds kFirstEmptyCycleBackoff(8);
constexpr std::chrono::microseconds kMaxEmptyCycleBackoff(128);

// Calls fn(i) for every response-cache bit i set in a cycle's bit vector
// (words 1 and up; word 0 holds the flags), in bit order, while fn returns
// true.  False when fn stopped it.
template <typename Fn>
bool ForEachCacheBit(const std::vector<uint64_t>& bits, Fn fn) {
  for (size_t w = 1; w < bits.size(); ++w) {
    uint64_t word = bits[w];
    while (word != 0) {
      const int b = __builtin_ctzll(word);
      word &= word - 1;
      if (!fn(static_cast<int>((w - 1) * 64 + b))) return false;
    }
  }
  return true;
}

struct PendingEntry {
  TensorEntry entry;
  Request request;
  double enqueued_seconds = 0.0;
  // Sent to the coordinator in a slow cycle; from then on only a response
  // from the coordinator completes it.
  bool announced = false;
};

// A finished entry's callback and status, until it is called (CallDone).
struct FinishedEntry {
  std::function<void(const Status&)> done;
  Status status;
};

std::string Describe(const TensorEntry& e) {
  return std::string(CollectiveTypeName(e.type)) + " \"" + e.name + "\"";
}

// InvalidArgument naming `e` and `shape` (its `what`) when a dimension of
// `shape` is negative.
Status CheckNoNegativeDimension(const TensorEntry& e, const char* what,
                                const Shape& shape) {
  for (int64_t d : shape) {
    if (d < 0) {
      return Status::InvalidArgument(Describe(e) + ": " + what + " " +
                                     ShapeString(shape) +
                                     " has a negative dimension");
    }
  }
  return Status::Ok();
}

// A group its kernel packed into one buffer (TensorEntry::packed_shapes and,
// when it mixes dtypes, packed_dtypes).
Status ValidatePackedGroup(const TensorEntry& e) {
  for (const Shape& member : e.packed_shapes) {
    MPISTRATEGY_RETURN_IF_ERROR(
        CheckNoNegativeDimension(e, "packed shape", member));
  }
  if (e.packed_dtypes.empty()) {
    int64_t packed_elements = 0;
    for (const Shape& member : e.packed_shapes) {
      packed_elements += NumElements(member);
    }
    if (e.type != CollectiveType::kAllreduce || e.shape.size() != 1 ||
        e.shape[0] < packed_elements) {
      return Status::InvalidArgument(
          Describe(e) + ": packed_shapes need a 1-D allreduce with room for " +
          std::to_string(packed_elements) + " elements, got shape " +
          ShapeString(e.shape));
    }
    if (!e.packed_inputs.empty()) {
      if (e.packed_inputs.size() != e.packed_shapes.size() ||
          e.device != kCpuDevice) {
        return Status::InvalidArgument(
            Describe(e) + ": packed_inputs need a CPU group with one input "
            "per packed shape (" + std::to_string(e.packed_inputs.size()) +
            " inputs, " + std::to_string(e.packed_shapes.size()) +
            " shapes)");
      }
      const std::vector<DataType> dtypes(e.packed_shapes.size(), e.dtype);
      if (PackedGroupLayout(dtypes, e.packed_shapes).total_bytes >
          NumElements(e.shape) * DataTypeSize(e.dtype)) {
        return Status::InvalidArgument(
            Describe(e) + ": the packed layout of packed_inputs does not fit "
            "shape " + ShapeString(e.shape));
      }
      for (size_t i = 0; i < e.packed_inputs.size(); ++i) {
        if (e.packed_inputs[i] == nullptr &&
            NumElements(e.packed_shapes[i]) > 0) {
          return Status::InvalidArgument(Describe(e) + ": packed input " +
                                         std::to_string(i) + " is null");
        }
      }
    }
    if (!e.packed_outputs.empty()) {
      if (e.packed_outputs.size() != e.packed_inputs.size()) {
        return Status::InvalidArgument(
            Describe(e) + ": packed_outputs need packed_inputs, one each (" +
            std::to_string(e.packed_outputs.size()) + " outputs, " +
            std::to_string(e.packed_inputs.size()) + " inputs)");
      }
      for (size_t i = 0; i < e.packed_outputs.size(); ++i) {
        if (e.packed_outputs[i] == nullptr &&
            NumElements(e.packed_shapes[i]) > 0) {
          return Status::InvalidArgument(Describe(e) + ": packed output " +
                                         std::to_string(i) + " is null");
        }
      }
    }
    return Status::Ok();
  }
  if (!e.packed_inputs.empty() || !e.packed_outputs.empty()) {
    return Status::InvalidArgument(
        Describe(e) + ": packed_inputs need a group of one dtype");
  }
  if (e.type != CollectiveType::kAllreduce ||
      e.packed_dtypes.size() != e.packed_shapes.size() ||
      e.dtype != DataType::kUint8) {
    return Status::InvalidArgument(
        Describe(e) + ": packed_dtypes need a uint8 allreduce with one "
        "dtype per packed shape (" + std::to_string(e.packed_dtypes.size()) +
        " dtypes, " + std::to_string(e.packed_shapes.size()) + " shapes)");
  }
  for (size_t i = 0; i < e.packed_dtypes.size(); ++i) {
    if (!IsValidDataType(e.packed_dtypes[i])) {
      return Status::InvalidArgument(Describe(e) + ": tensor " +
                                     std::to_string(i) + " has an unknown dtype");
    }
    if (e.reduce_op == ReduceOp::kMean &&
        !IsFloatingDataType(e.packed_dtypes[i])) {
      return Status::InvalidArgument(
          Describe(e) + ": reduce_op mean needs floating dtypes, but tensor " +
          std::to_string(i) + " is " + DataTypeName(e.packed_dtypes[i]));
    }
  }
  const int64_t bytes =
      PackedGroupLayout(e.packed_dtypes, e.packed_shapes).total_bytes;
  if (e.shape != Shape{bytes}) {
    return Status::InvalidArgument(
        Describe(e) + ": a mixed-dtype packed group needs shape [" +
        std::to_string(bytes) + "] (bytes), got " + ShapeString(e.shape));
  }
  return Status::Ok();
}

// Collectives that split or concatenate their input along dimension 0.
bool NeedsDim0(const TensorEntry& e) {
  return e.type == CollectiveType::kAllgather ||
         e.type == CollectiveType::kReducescatter ||
         e.type == CollectiveType::kAlltoall;
}

// Misuse of the engine by its caller (the kernels), checked before anything
// is queued; the error is returned at once.
Status ValidateEntry(const TensorEntry& e, int rank) {
  if (e.name.empty()) {
    return Status::InvalidArgument("collective name must not be empty");
  }
  if (!IsValidCollectiveType(e.type)) {
    return Status::InvalidArgument("\"" + e.name +
                                   "\": unknown collective type " +
                                   std::to_string(static_cast<int>(e.type)));
  }
  if (!e.done) {
    return Status::InvalidArgument(Describe(e) + ": `done` must be set");
  }
  if (e.type == CollectiveType::kBarrier) return Status::Ok();
  if (!IsValidDataType(e.dtype)) {
    return Status::InvalidArgument(Describe(e) + ": unknown dtype " +
                                   std::to_string(static_cast<int>(e.dtype)));
  }
  if (!IsValidReduceOp(e.reduce_op)) {
    return Status::InvalidArgument(
        Describe(e) + ": unknown reduce op " +
        std::to_string(static_cast<int>(e.reduce_op)));
  }
  MPISTRATEGY_RETURN_IF_ERROR(CheckNoNegativeDimension(e, "shape", e.shape));
  const int64_t bytes = NumElements(e.shape) * DataTypeSize(e.dtype);
  if (!e.packed_shapes.empty() || !e.packed_dtypes.empty() ||
      !e.packed_inputs.empty() || !e.packed_outputs.empty()) {
    MPISTRATEGY_RETURN_IF_ERROR(ValidatePackedGroup(e));
  }
  if (NeedsDim0(e) && !e.allocate_output) {
    return Status::InvalidArgument(Describe(e) +
                                   ": `allocate_output` must be set");
  }
  const bool needs_output = e.type == CollectiveType::kAllreduce ||
                            e.type == CollectiveType::kBroadcast;
  if (needs_output && bytes > 0 && e.output == nullptr &&
      e.packed_outputs.empty()) {
    return Status::InvalidArgument(Describe(e) + ": `output` is null");
  }
  const bool needs_input =
      e.type != CollectiveType::kBroadcast || e.root_rank == rank;
  if (needs_input && bytes > 0 && e.input == nullptr &&
      e.packed_inputs.empty()) {
    return Status::InvalidArgument(Describe(e) + ": `input` is null");
  }
  return Status::Ok();
}

// Arguments that may be wrong on one rank only (a splits tensor computed
// from that rank's data, say), checked after ValidateEntry.  An error here
// is not returned at once: the request carries it (Request::invalid), so
// that the collective fails on every rank instead of only here while the
// others wait for this rank forever.
Status CheckArguments(const TensorEntry& e, int size) {
  if (e.type == CollectiveType::kBarrier) return Status::Ok();
  const bool reduces = e.type == CollectiveType::kAllreduce ||
                       e.type == CollectiveType::kReducescatter;
  // A mixed-dtype group's buffer is uint8; its tensors' dtypes are checked
  // with the group.
  if (e.packed_dtypes.empty() && reduces && e.reduce_op == ReduceOp::kMean &&
      !IsFloatingDataType(e.dtype)) {
    // A bool's sum is a logical or: nothing to divide.
    return Status::InvalidArgument(
        Describe(e) + ": reduce_op mean needs a floating dtype (float16, "
        "bfloat16, float32, float64), got " + DataTypeName(e.dtype) +
        (e.dtype == DataType::kBool ? "" : "; use sum and divide"));
  }
  if (NeedsDim0(e) && e.shape.empty()) {
    return Status::InvalidArgument(
        Describe(e) + ": the input must have at least one dimension (it is "
        "split or concatenated along dimension 0), got a scalar");
  }
  if (e.type == CollectiveType::kBroadcast &&
      (e.root_rank < 0 || e.root_rank >= size)) {
    return Status::InvalidArgument(
        Describe(e) + ": root_rank must be in [0, " + std::to_string(size) +
        "), got " + std::to_string(e.root_rank));
  }
  if (e.type == CollectiveType::kAlltoall && !e.splits.empty()) {
    if (static_cast<int>(e.splits.size()) != size) {
      return Status::InvalidArgument(
          Describe(e) + ": splits must have one entry per rank (" +
          std::to_string(size) + "), got " +
          std::to_string(e.splits.size()));
    }
    int64_t sum = 0;
    for (int64_t s : e.splits) {
      if (s < 0) {
        return Status::InvalidArgument(Describe(e) +
                                       ": splits must be >= 0, got " +
                                       ShapeString(e.splits));
      }
      // A sum that wraps around could otherwise equal the first dimension.
      if (__builtin_add_overflow(sum, s, &sum)) {
        return Status::InvalidArgument(
            Describe(e) + ": splits " + ShapeString(e.splits) +
            " overflow int64 when summed; they must sum to the first "
            "dimension of the input (" + std::to_string(e.shape[0]) + ")");
      }
    }
    if (sum != e.shape[0]) {
      return Status::InvalidArgument(
          Describe(e) + ": splits " + ShapeString(e.splits) + " sum to " +
          std::to_string(sum) + " but the first dimension of the input is " +
          std::to_string(e.shape[0]));
    }
  } else if (e.type == CollectiveType::kAlltoall && e.shape[0] % size != 0) {
    return Status::InvalidArgument(
        Describe(e) + ": without splits the first dimension (" +
        std::to_string(e.shape[0]) + ") must be divisible by the number of "
        "ranks (" + std::to_string(size) + ")");
  }
  return Status::Ok();
}

// The request this rank announces for a validated entry; `arguments` is
// CheckArguments' verdict.  Fields that do not apply to the collective are
// normalised so that comparisons ignore them.
Request MakeRequest(const TensorEntry& e, int rank, int size,
                    const Status& arguments) {
  Request q;
  q.rank = rank;
  q.type = e.type;
  q.name = e.name;
  q.device = e.device;
  if (!arguments.ok()) {
    // The coordinator fails the collective with this; nothing else is read.
    q.invalid = arguments.message();
    return q;
  }
  if (e.type == CollectiveType::kBarrier) return q;
  q.dtype = e.dtype;
  q.shape = e.shape;
  q.packed_shapes = e.packed_shapes;
  q.packed_dtypes = e.packed_dtypes;
  q.grouped = e.grouped || !e.packed_shapes.empty();
  if (e.type == CollectiveType::kAllreduce ||
      e.type == CollectiveType::kReducescatter) {
    q.reduce_op = e.reduce_op;
  }
  if (e.type == CollectiveType::kBroadcast) q.root_rank = e.root_rank;
  if (e.type == CollectiveType::kAlltoall) {
    if (e.splits.empty()) {
      q.splits.assign(size, e.shape[0] / size);
    } else {
      q.splits = e.splits;
    }
  }
  return q;
}

// The settings that every rank must share, as "key=value" in a fixed
// order: `cache_capacity` sizes the bit vector of every negotiation cycle,
// and `data_plane`, `shm_bytes` and `hierarchical_allreduce` decide which
// collectives set up the data planes, so ranks that differ would pass MPI
// mismatched calls.  The keys are Options' field names.
std::vector<std::pair<std::string, std::string>> SharedSettings(
    const EngineConfig& config) {
  return {
      {"cache_capacity", std::to_string(config.cache_capacity)},
      {"data_plane", HostDataPlaneName(config.data_plane)},
      {"shm_bytes", std::to_string(config.shm_bytes)},
      {"hierarchical_allreduce",
       config.hierarchical_allreduce ? "true" : "false"},
  };
}

// SharedSettings as one line without ';' (values are names and numbers).
std::string SharedSettingsLine(const EngineConfig& config) {
  std::string line;
  for (const auto& [key, value] : SharedSettings(config)) {
    line += (line.empty() ? "" : ",") + key + "=" + value;
  }
  return line;
}

// The error for rank `rank`, whose settings line differs from rank 0's.
std::string DisagreementMessage(const std::string& line0,
                                const std::string& line, size_t rank) {
  auto split = [](const std::string& text) {
    std::vector<std::string> items;
    size_t at = 0;
    while (at <= text.size()) {
      const size_t comma = std::min(text.find(',', at), text.size());
      items.push_back(text.substr(at, comma - at));
      at = comma + 1;
    }
    return items;
  };
  const std::vector<std::string> mine = split(line0);
  const std::vector<std::string> theirs = split(line);
  for (size_t i = 0; i < mine.size() && i < theirs.size(); ++i) {
    if (mine[i] == theirs[i]) continue;
    const size_t eq = mine[i].find('=');
    const std::string key = mine[i].substr(0, eq);
    std::string env = "MPISTRATEGY_" + key;
    for (char& c : env) c = static_cast<char>(std::toupper(c));
    // The Horovod layer reads these from Horovod's variables too.
    std::string horovod;
    if (key == "cache_capacity") horovod = "HOROVOD_CACHE_CAPACITY";
    if (key == "hierarchical_allreduce") {
      horovod = "HOROVOD_HIERARCHICAL_ALLREDUCE";
    }
    return "ranks disagree on " + key + " (rank 0: " + mine[i].substr(eq + 1) +
           ", rank " + std::to_string(rank) + ": " +
           theirs[i].substr(theirs[i].find('=') + 1) + "); set " + env +
           " (or Options." + key +
           (horovod.empty() ? "" : ", or " + horovod + " with hvd") +
           ") alike on every rank";
  }
  return "ranks disagree on their settings (rank 0: " + line0 + ", rank " +
         std::to_string(rank) + ": " + line + ")";
}

// Startup agreement, the first exchange of every engine: each rank tells
// rank 0 whether it could start ("" or its error), rank 0 broadcasts the
// first failure ("" when none).  A rank whose Engine::Create failed (it
// cannot create its timeline file, say) still takes part, so the other
// ranks fail their collectives with its reason instead of waiting for it
// forever.  The same exchange checks the settings every rank must share
// (SharedSettings).  It also gives every rank every rank's host and pid
// (*peers, for messages).  Returns the agreed failure, or OK.
Status AgreeOnStartup(Transport* transport, const Status& mine,
                      const EngineConfig& config,
                      std::vector<PeerInfo>* peers) {
  const PeerInfo me = transport->peer_info();
  // "<settings>;<host>;<pid>;<error or empty>"
  std::string message = SharedSettingsLine(config) + ";" + me.host + ";" +
                        std::to_string(me.pid) + ";";
  if (!mine.ok()) {
    message += mpistrategy::DescribeRank(transport->rank(), {}) + " (host " + me.host +
               ", pid " + std::to_string(me.pid) +
               ") could not start mpistrategy: " + mine.message();
  }
  std::vector<std::string> all;
  MPISTRATEGY_RETURN_IF_ERROR(transport->GatherBytes(message, &all));
  // Rank 0 broadcasts "<failure length>:<failure><host>\t<pid>\n..." .
  std::string first_failure;
  std::string table;
  if (transport->rank() == 0) {
    for (std::string& m : all) {
      // Move the host and pid out; what remains is "<settings>;<error>".
      const size_t a = m.find(';');
      const size_t b = m.find(';', a + 1);
      const size_t c = m.find(';', b + 1);
      table += m.substr(a + 1, b - a - 1) + "\t" + m.substr(b + 1, c - b - 1) +
               "\n";
      m = m.substr(0, a) + ";" + m.substr(c + 1);
    }
    const std::string settings0 = all[0].substr(0, all[0].find(';'));
    for (size_t r = 0; r < all.size() && first_failure.empty(); ++r) {
      const size_t split = all[r].find(';');
      const std::string error = all[r].substr(split + 1);
      if (!error.empty()) {
        first_failure = error;
      } else if (all[r].substr(0, split) != settings0) {
        first_failure =
            DisagreementMessage(settings0, all[r].substr(0, split), r);
      }
    }
  }
  std::string agreed =
      std::to_string(first_failure.size()) + ":" + first_failure + table;
  MPISTRATEGY_RETURN_IF_ERROR(transport->BroadcastBytes(&agreed));
  const size_t colon = agreed.find(':');
  const size_t length = std::strtoull(agreed.c_str(), nullptr, 10);
  first_failure = agreed.substr(colon + 1, length);
  peers->clear();
  size_t pos = colon + 1 + length;
  while (pos < agreed.size()) {
    const size_t tab = agreed.find('\t', pos);
    const size_t end = agreed.find('\n', pos);
    if (tab == std::string::npos || end == std::string::npos) break;
    PeerInfo info;
    info.host = agreed.substr(pos, tab - pos);
    info.pid = std::strtoll(agreed.c_str() + tab + 1, nullptr, 10);
    peers->push_back(std::move(info));
    pos = end + 1;
  }
  if (first_failure.empty()) return Status::Ok();
  return Status::FailedPrecondition(first_failure);
}

}  // namespace

class Engine::Impl {
 public:
  // Args:
  //   timeline: this rank's timeline (timeline.h), or null.
  //   autotune_log: rank 0's open autotune log (EngineConfig::autotune_log),
  //     or null; closed by the destructor.
  Impl(const EngineConfig& config, std::unique_ptr<Transport> transport,
       std::unique_ptr<Timeline> timeline, std::FILE* autotune_log,
       PeerTimeoutHandler on_peer_timeout);
  ~Impl();

  void Start() {
    // A wait for peers ends as soon as the peer monitor gave up on them.
    transport_->SetWaitHook([this]() -> Status {
      if (!peer_timeout_.load(std::memory_order_relaxed)) return Status::Ok();
      std::lock_guard<std::mutex> lock(mu_);
      return Status::Unavailable(peer_timeout_message_);
    });
    thread_ = std::thread([this] { Loop(); });
    // Named so that top -H, perf and gdb show which thread is the engine;
    // by this thread, so that the name is set before Create returns.
    pthread_setname_np(thread_.native_handle(), "mpistrategy");
  }
  Status Enqueue(TensorEntry entry);
  Status EnqueueGroup(std::vector<TensorEntry> entries);
  // Enqueue's checks that need mu_ (held by the caller): stopped, shutting
  // down, duplicate name in flight.  Marks the name in flight when OK.
  Status AdmitLocked(const TensorEntry& entry);
  void Abort(const std::string& reason, double timeout_seconds);
  EngineStats stats() const;
  bool stopped() const;
  TunedParameters tuned_parameters() const;
  Status SetTimeline(const std::string& path);
  bool cpu_plane_reduces_parts() const {
    return cpu_plane_reduces_parts_.load(std::memory_order_acquire);
  }
  // mpistrategy::DescribeRank(rank, peers_) under mu_ (any thread).
  std::string DescribeRankLocked(int rank) const {
    std::lock_guard<std::mutex> lock(mu_);
    return mpistrategy::DescribeRank(rank, peers_);
  }
  Status WaitForPeers(std::vector<PeerInfo>* peers) const;
  Status WaitUntilStarted() const;

  const EngineConfig config_;
  const std::unique_ptr<Transport> transport_;
  const int rank_;
  const int size_;
  // Declared before executor_, which points to it.  Replaced only under
  // cycle_mu_ (SetTimeline), and used only by whoever holds cycle_mu_.
  std::unique_ptr<Timeline> timeline_;

 private:
  using PendingIter = std::list<PendingEntry>::iterator;

  void Loop();
  // The engine thread's wait while this rank has nothing in flight: until
  // something is enqueued, a cycle elsewhere left work pending, a shutdown
  // is asked for, or cycle_time_ms passed.  False once cycles have ended.
  bool WaitForWork();
  // One negotiation cycle, or what is left of one; false when the loop must
  // stop.  The caller holds cycle_mu_ and cycling_ is true.  On an op's
  // thread it stops early, leaving stage_ for the engine thread, when the
  // peers are late (kOpThreadPatienceSeconds) or when the cycle is not a
  // fast one of at most kOpThreadMaxBytes.
  bool RunCycle(bool on_op_thread);
  // Drains incoming_, sets this rank's bits and starts the BitwiseAnd.
  bool BeginCycle();
  // After the AND: whether the cycle is a fast one of CPU allreduces small
  // enough for an op's thread.
  bool SmallFastCycle() const;
  // After the AND: the slow or the fast path, and the collectives.
  bool EndCycle();
  // RunCycle by whoever holds cycle_mu_ (the engine thread or an op's
  // thread); ends the cycles for good when it returns false.
  bool RunCycleLocked(bool on_op_thread);
  // On the thread that just enqueued: runs one cycle here if no cycle is
  // running, so that a small collective whose peers are ready completes
  // without waking the engine thread and without `done` crossing threads.
  // False when it did not (the engine thread must be woken instead).
  bool TryCycleOnThisThread();
  bool SlowPath(bool want_shutdown, const std::string& shutdown_reason);
  // Runs the cycle's responses (errors, then fused buckets in plan order).
  bool ExecuteResponses(const std::vector<const Response*>& responses);
  // Removes the entry from the tables and queues its `done` in finished_.
  void Finish(PendingIter it, const Status& status);
  // Calls the `done`s queued in `finished` (then empty) on this thread, as
  // the owner of a cycle: an Enqueue from one of them only wakes the engine
  // thread.
  void CallDone(std::vector<FinishedEntry>* finished);
  // Makes `suffix` the sticky error (unless one is set) and returns false.
  bool Fatal(StatusCode code, const std::string& suffix);
  // Fatal for a failed transport call `what`; after a peer timeout the
  // monitor's message is the reason.
  bool TransportFailed(const std::string& what, const Status& s);

  // ---- peer monitor (peer_monitor.h) ---------------------------------------
  // Starts the monitor's thread when the peer timeout is on.
  void StartMonitor();
  // Stops it (the engine thread, when the loop ends).
  void StopMonitor();
  void MonitorLoop(PeerMonitor* monitor);
  // The monitor gave up on silent peers: fail everything, end the job.
  void OnPeerTimeout(const std::string& message);
  Status StickyStatusFor(const std::string& name) const;  // requires mu_

  // ---- fusion parameters and autotune --------------------------------------
  // With parameters_.fusion_wait_ms > 0, after the first tensor reaches an
  // idle engine: waits that long (or until shutdown) for more.  `lock`
  // holds mu_.
  void WaitForMoreTensors(std::unique_lock<std::mutex>* lock);
  // Every rank, slow path: adopt the parameters rank 0 published.
  void ApplyParameters(const TunedParameters& parameters);
  // Rank 0 with an autotuner: one cycle executed `bytes` of allreduce
  // payload.  Feeds the tuner, schedules a publication, writes the log.
  void RecordForAutotune(int64_t bytes);

  // ---- timeline hooks (timeline.h); callers check timeline_ != nullptr ----
  // Times are clock_() values: SteadyClockSeconds, the Timeline's clock.
  // REQUEST instants on the coordinator: `rank` announced `list` this cycle.
  void TraceRequests(int rank, const RequestList& list, double at);
  // NEGOTIATE: from Enqueue until the response for `p` was known.
  void TraceNegotiated(const PendingEntry& p, double responded,
                       const Response& response);
  // The cycle's span, when it ran anything.
  void TraceCycle(int64_t tensors, int64_t errors, int64_t buckets,
                  int64_t fused_buckets, int64_t bytes);

  // ---- shared, guarded by mu_ ------------------------------------------
  mutable std::mutex mu_;
  std::condition_variable wake_cv_;     // engine thread waits here
  // Abort, WaitForPeers and WaitUntilStarted wait here.
  mutable std::condition_variable stopped_cv_;
  // The loop runs collectives: startup agreed, the host plane set up.
  bool started_ = false;
  std::vector<PendingEntry> incoming_;
  std::unordered_set<std::string> in_flight_;
  bool shutdown_requested_ = false;
  std::string shutdown_reason_;
  bool stopped_ = false;
  // The engine thread's loop has finished everything: pending entries
  // failed, the timeline closed.  Abort waits for it.
  bool loop_ended_ = false;
  StatusCode sticky_code_ = StatusCode::kOk;
  std::string sticky_suffix_;  // "was aborted because ..."
  bool monitor_stop_ = false;
  std::condition_variable monitor_cv_;  // the monitor's thread waits here
  std::string peer_timeout_message_;
  // Set with peer_timeout_message_; read without mu_ by the wait hook.
  std::atomic<bool> peer_timeout_{false};

  // Every rank's host and pid (AgreeOnStartup); this rank's, described, for
  // log lines.  Engine thread, before the monitor starts.
  std::vector<PeerInfo> peers_;
  std::string self_;
  const PeerTimeoutHandler on_peer_timeout_;
  std::thread monitor_thread_;

  // Set after every cycle, wherever it ran, for the engine thread's wait:
  // whether work is left (pending entries, or a cycle left half done),
  // whether that cycle ended the cycles, and when it ended.
  bool work_left_ = false;
  bool cycles_ended_ = false;
  std::chrono::steady_clock::time_point last_cycle_end_;
  // Cycles the engine thread ran since this rank's last submission because
  // its idle period ran out (WaitForWork); under mu_.
  int idle_cycles_ = 0;
  // Cycles in a row that agreed on nothing while entries were pending
  // (kEmptyCyclesBeforeBackoff); under mu_, reset by a submission.
  int empty_cycles_ = 0;
  // A GPU entry was ever enqueued: cycles stay on the engine thread, whose
  // device and streams the GPU path sets up.
  std::atomic<bool> saw_device_entry_{false};
  // Set once by the engine thread after the CPU plane is set up.
  std::atomic<bool> cpu_plane_reduces_parts_{false};

  // ---- cycle state: whoever holds cycle_mu_ --------------------------------
  // Cycles run one at a time, in order, on every rank; usually on the engine
  // thread, and on an op's thread when it finds no cycle running
  // (TryCycleOnThisThread).  Everything below is that cycle's state.
  std::mutex cycle_mu_;
  bool cycling_ = false;  // from a good start until a cycle returns false
  // Where the current cycle is: an op's thread may leave it after starting
  // the AND, or after the AND, for the engine thread to finish.
  enum class CycleStage { kIdle, kAndStarted, kAndDone };
  CycleStage stage_ = CycleStage::kIdle;
  bool cycle_want_shutdown_ = false;
  std::string cycle_shutdown_reason_;
  std::list<PendingEntry> pending_;
  std::unordered_map<std::string, PendingIter> by_name_;
  ResponseCache cache_;
  std::unique_ptr<Negotiator> negotiator_;  // rank 0 only
  Executor executor_;
  Clock clock_;
  double announce_after_seconds_;
  // Reused every cycle so that steady-state cycles do not allocate.
  std::vector<PendingEntry> drained_;
  std::vector<uint64_t> bits_;
  std::vector<const Response*> responses_;
  std::vector<const Response*> ok_responses_;
  std::vector<PendingIter> ok_entries_;
  std::vector<int64_t> ok_bytes_;
  std::vector<const Response*> bucket_responses_;
  std::vector<TensorEntry*> bucket_entries_;
  std::vector<Status> bucket_status_;
  // `done`s of finished entries not yet called.  Those of a cycle's last
  // bucket are called after cycle_mu_ is released: a `done` wakes the
  // thread that continues the graph, whose next Enqueue (on two cores, often
  // before this thread is scheduled again) must find no cycle running to
  // run its own; otherwise every rank's engine thread keeps every cycle.
  std::vector<FinishedEntry> finished_;
  std::string bytes_;
  std::vector<std::string> gathered_;
  // Timeline only: when the current cycle started, and its path.
  double trace_cycle_start_ = 0.0;
  bool trace_slow_cycle_ = false;

  std::atomic<int64_t> cycles_{0};
  std::atomic<int64_t> slow_cycles_{0};
  std::atomic<int64_t> fast_responses_{0};
  std::atomic<int64_t> slow_responses_{0};
  std::atomic<int64_t> buckets_{0};
  std::atomic<int64_t> fused_buckets_{0};

  // Fusion parameters in force on this rank (engine thread), the same on
  // every rank from the first slow cycle on: rank 0 publishes its own then,
  // and the autotuner's choices later.
  TunedParameters parameters_;
  bool publish_pending_ = false;             // rank 0
  std::unique_ptr<Autotuner> autotuner_;     // rank 0 with config.autotune
  std::FILE* autotune_log_ = nullptr;        // rank 0, owned
  TunedParameters published_parameters_;     // guarded by mu_, for readers

  std::thread thread_;
};

Engine::Impl::Impl(const EngineConfig& config,
                   std::unique_ptr<Transport> transport,
                   std::unique_ptr<Timeline> timeline,
                   std::FILE* autotune_log,
                   PeerTimeoutHandler on_peer_timeout)
    : config_(config),
      transport_(std::move(transport)),
      rank_(transport_->rank()),
      size_(transport_->size()),
      timeline_(std::move(timeline)),
      on_peer_timeout_(std::move(on_peer_timeout)),
      cache_(config.cache_capacity),
      executor_(transport_.get(), config.hierarchical_allreduce,
                timeline_.get()),
      clock_(SteadyClockSeconds) {
  StallInspector stall(config.stall_warning_seconds,
                       config.stall_timeout_seconds);
  if (rank_ == 0) {
    negotiator_.reset(new Negotiator(size_, stall, clock_));
  }
  parameters_.fusion_threshold_bytes = config.fusion_threshold_bytes;
  parameters_.fusion_wait_ms = config.fusion_wait_ms;
  parameters_.final = !config.autotune;
  published_parameters_ = parameters_;
  autotune_log_ = autotune_log;
  if (rank_ == 0) {
    // Ranks may have been configured differently (an environment variable
    // set on one host only); fusion plans must match, so rank 0's
    // parameters govern from the first slow cycle on.
    publish_pending_ = true;
    if (config.autotune) {
      autotuner_.reset(new Autotuner(parameters_, config.autotune_settings));
    }
  }
  // A cached request whose bit keeps failing the AND (some rank has not
  // submitted it) is eventually announced, so the coordinator's stall
  // inspector can see it.
  announce_after_seconds_ = std::numeric_limits<double>::infinity();
  if (stall.enabled()) {
    announce_after_seconds_ = 5.0;
    if (config.stall_warning_seconds > 0) {
      announce_after_seconds_ =
          std::min(announce_after_seconds_, config.stall_warning_seconds / 4);
    }
    if (config.stall_timeout_seconds > 0) {
      announce_after_seconds_ =
          std::min(announce_after_seconds_, config.stall_timeout_seconds / 4);
    }
  }
}

Engine::Impl::~Impl() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopped_ && !shutdown_requested_) shutdown_requested_ = true;
  }
  wake_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (autotune_log_ != nullptr) std::fclose(autotune_log_);
}

Status Engine::Impl::Enqueue(TensorEntry entry) {
  std::vector<TensorEntry> group;
  group.push_back(std::move(entry));
  return EnqueueGroup(std::move(group));
}

Status Engine::Impl::AdmitLocked(const TensorEntry& entry) {
  if (stopped_) return StickyStatusFor(entry.name);
  if (shutdown_requested_) {
    return Status::Aborted(
        "mpistrategy: collective \"" + entry.name +
        "\" was aborted because " + mpistrategy::DescribeRank(rank_, peers_) +
        " stopped: " +
        (shutdown_reason_.empty() ? mpistrategy::DescribeRank(rank_, peers_) + " shut down"
                                  : shutdown_reason_));
  }
  if (!in_flight_.insert(entry.name).second) {
    return Status::InvalidArgument(
        Describe(entry) + " is already in flight on rank " +
        std::to_string(rank_) +
        "; a name may be submitted again only after the previous "
        "collective with that name completed");
  }
  return Status::Ok();
}

Status Engine::Impl::EnqueueGroup(std::vector<TensorEntry> entries) {
  const size_t n = entries.size();
  std::vector<Status> status(n);
  std::vector<PendingEntry> prepared(n);
  for (size_t i = 0; i < n; ++i) {
    status[i] = ValidateEntry(entries[i], rank_);
    if (!status[i].ok()) continue;
    prepared[i].request = MakeRequest(entries[i], rank_, size_,
                                      CheckArguments(entries[i], size_));
    prepared[i].enqueued_seconds = clock_();
    if (entries[i].device != kCpuDevice) saw_device_entry_ = true;
  }
  bool queued_any = false;
  {
    // One critical section for the whole group, so the engine thread drains
    // all of it in one cycle and the entries can share a fusion bucket.
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < n; ++i) {
      if (!status[i].ok()) continue;
      status[i] = AdmitLocked(entries[i]);
      if (!status[i].ok()) continue;
      prepared[i].entry = std::move(entries[i]);
      incoming_.push_back(std::move(prepared[i]));
      queued_any = true;
    }
    if (queued_any) idle_cycles_ = empty_cycles_ = 0;
  }
  if (queued_any && !TryCycleOnThisThread()) wake_cv_.notify_one();
  Status first_error;
  for (size_t i = 0; i < n; ++i) {
    if (status[i].ok()) continue;
    // Rejected: entries[i] was not moved from.
    if (entries[i].done) entries[i].done(status[i]);
    if (first_error.ok()) first_error = status[i];
  }
  return first_error;
}

void Engine::Impl::Abort(const std::string& reason, double timeout_seconds) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!stopped_ && !shutdown_requested_) {
    shutdown_requested_ = true;
    shutdown_reason_ = reason;
  }
  wake_cv_.notify_all();
  stopped_cv_.wait_for(
      lock, std::chrono::duration<double>(std::max(0.0, timeout_seconds)),
      [this] { return loop_ended_; });
}

EngineStats Engine::Impl::stats() const {
  EngineStats s;
  s.cycles = cycles_.load();
  s.slow_cycles = slow_cycles_.load();
  s.fast_responses = fast_responses_.load();
  s.slow_responses = slow_responses_.load();
  s.buckets = buckets_.load();
  s.fused_buckets = fused_buckets_.load();
  return s;
}

TunedParameters Engine::Impl::tuned_parameters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return published_parameters_;
}

Status Engine::Impl::WaitForPeers(std::vector<PeerInfo>* peers) const {
  std::unique_lock<std::mutex> lock(mu_);
  stopped_cv_.wait(lock, [this] { return !peers_.empty() || loop_ended_; });
  if (peers_.empty()) {
    return Status(sticky_code_, "mpistrategy: the engine " + sticky_suffix_);
  }
  *peers = peers_;
  return Status::Ok();
}

Status Engine::Impl::WaitUntilStarted() const {
  std::unique_lock<std::mutex> lock(mu_);
  stopped_cv_.wait(lock, [this] { return started_ || loop_ended_; });
  if (!started_) {
    return Status(sticky_code_, "mpistrategy: the engine " + sticky_suffix_);
  }
  return Status::Ok();
}

Status Engine::Impl::StickyStatusFor(const std::string& name) const {
  return Status(sticky_code_,
                "mpistrategy: collective \"" + name + "\" " + sticky_suffix_);
}

void Engine::Impl::Loop() {
  // Enqueues from `done` callbacks that TF continues on this thread only
  // wake it; they never start a cycle of their own here.
  cycle_owner_on_this_thread = this;
  // The waits for peers sleep in steps of a few microseconds; Linux's
  // default slack of 50 us per sleep would stretch each of them.
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  std::vector<PeerInfo> peers;
  const Status startup =
      AgreeOnStartup(transport_.get(), Status::Ok(), config_, &peers);
  if (!startup.ok()) {
    Fatal(startup.code() == StatusCode::kFailedPrecondition
              ? StatusCode::kFailedPrecondition
              : StatusCode::kUnavailable,
          "failed because " + startup.message());
  } else {
    {
      // Enqueue reads peers_ (under mu_) for its messages.
      std::lock_guard<std::mutex> lock(mu_);
      peers_ = std::move(peers);
    }
    stopped_cv_.notify_all();
    self_ = mpistrategy::DescribeRank(rank_, peers_);
    if (negotiator_ != nullptr) negotiator_->SetPeers(peers_);
    StartMonitor();
    const Status plane =
        executor_.SetUpHostPlane(config_.data_plane, config_.shm_bytes);
    if (!plane.ok()) {
      Fatal(plane.code() == StatusCode::kFailedPrecondition
                ? StatusCode::kFailedPrecondition
                : StatusCode::kUnavailable,
            "failed because " + plane.message());
    } else {
      cpu_plane_reduces_parts_ = executor_.cpu_plane_reduces_parts();
      {
        std::lock_guard<std::mutex> cycle(cycle_mu_);
        cycling_ = true;
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        started_ = true;
      }
      stopped_cv_.notify_all();
      bool go_on = true;
      std::vector<FinishedEntry> finished;
      while (go_on && WaitForWork()) {
        {
          std::lock_guard<std::mutex> cycle(cycle_mu_);
          go_on = cycling_ && RunCycleLocked(/*on_op_thread=*/false);
          finished.swap(finished_);
        }
        CallDone(&finished);
      }
    }
  }
  // Stopped: fail everything still pending or queued with the sticky error.
  // cycle_mu_ keeps out a cycle that an op's thread might try to start.
  std::lock_guard<std::mutex> cycle(cycle_mu_);
  cycling_ = false;
  std::vector<PendingEntry> late;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (sticky_code_ == StatusCode::kOk) {
      sticky_code_ = StatusCode::kAborted;
      sticky_suffix_ = "was aborted because the engine stopped";
    }
    stopped_ = true;
    late.swap(incoming_);
  }
  for (PendingEntry& p : late) {
    pending_.push_back(std::move(p));
    by_name_[pending_.back().request.name] = std::prev(pending_.end());
  }
  while (!pending_.empty()) {
    Status s;
    {
      std::lock_guard<std::mutex> lock(mu_);
      s = StickyStatusFor(pending_.front().request.name);
    }
    Finish(pending_.begin(), s);
  }
  CallDone(&finished_);
  // Nothing is recorded after the loop.  A job that a failing rank ends
  // with MPI_Abort (after Abort waited for this) still leaves whole files.
  if (timeline_ != nullptr) timeline_->Close();
  {
    std::lock_guard<std::mutex> lock(mu_);
    loop_ended_ = true;
  }
  stopped_cv_.notify_all();
  StopMonitor();
}

bool Engine::Impl::WaitForWork() {
  std::unique_lock<std::mutex> lock(mu_);
  if (work_left_ && empty_cycles_ >= kEmptyCyclesBeforeBackoff) {
    // Entries pending, but the last cycles agreed on none of them: wait a
    // little before the next rendezvous, unless this rank submits.
    const int doublings =
        std::min(empty_cycles_ - kEmptyCyclesBeforeBackoff, 16);
    const auto backoff = std::min<std::chrono::steady_clock::duration>(
        kFirstEmptyCycleBackoff * (1 << doublings), kMaxEmptyCycleBackoff);
    wake_cv_.wait_until(lock, last_cycle_end_ + backoff, [this] {
      return !incoming_.empty() || shutdown_requested_ || cycles_ended_;
    });
    return !cycles_ended_;
  }
  // Otherwise sleep only when this rank has nothing in flight.  With
  // pending entries the other ranks are about to submit theirs (or are
  // slow), and we must be in the next cycle's rendezvous when they do:
  // sleeping here would add up to the idle period to every collective whose
  // ranks arrive a little apart.  The transport's rendezvous waits without
  // spinning.  Idle, a rank still cycles once per idle period (counted from
  // its last cycle, wherever that ran), so that peers waiting in a cycle
  // hear from it; the period grows from cycle_time_ms while the rank stays
  // idle (kMaxIdlePeriodMs).
  const double cap_ms = std::max(config_.cycle_time_ms, kMaxIdlePeriodMs);
  const double period_ms = std::min(
      cap_ms, std::ldexp(std::max(config_.cycle_time_ms, kMinIdlePeriodMs),
                         std::min(idle_cycles_, 30)));
  const auto period =
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::duration<double, std::milli>(period_ms));
  bool timed_out = false;
  while (incoming_.empty() && !work_left_ && !shutdown_requested_ &&
         !cycles_ended_) {
    const auto deadline = last_cycle_end_ + period;
    if (std::chrono::steady_clock::now() >= deadline) {
      timed_out = true;
      break;
    }
    wake_cv_.wait_until(lock, deadline);
  }
  if (timed_out) ++idle_cycles_;
  return !cycles_ended_;
}

bool Engine::Impl::RunCycleLocked(bool on_op_thread) {
  const void* outer = cycle_owner_on_this_thread;
  cycle_owner_on_this_thread = this;
  const int64_t responses_before = fast_responses_ + slow_responses_;
  const bool go_on = RunCycle(on_op_thread);
  // A whole cycle (its rendezvous done) that agreed on nothing pending.
  const bool empty = stage_ == CycleStage::kIdle && !pending_.empty() &&
                     fast_responses_ + slow_responses_ == responses_before;
  cycle_owner_on_this_thread = outer;
  if (!go_on) cycling_ = false;
  std::lock_guard<std::mutex> lock(mu_);
  empty_cycles_ = empty ? empty_cycles_ + 1 : 0;
  work_left_ = !pending_.empty() || stage_ != CycleStage::kIdle;
  last_cycle_end_ = std::chrono::steady_clock::now();
  if (!go_on) cycles_ended_ = true;
  return go_on;
}

bool Engine::Impl::TryCycleOnThisThread() {
  // Not inside a cycle (a `done` continued on this thread), not for GPU
  // work, not while fusion_wait_ms asks the engine thread to wait, and only
  // where the rendezvous can be handed over.
  if (cycle_owner_on_this_thread != nullptr ||
      saw_device_entry_.load(std::memory_order_relaxed) ||
      !transport_->SplitsBitwiseAnd()) {
    return false;
  }
  std::unique_lock<std::mutex> cycle(cycle_mu_, std::try_to_lock);
  if (!cycle.owns_lock() || !cycling_ || stage_ != CycleStage::kIdle ||
      parameters_.fusion_wait_ms > 0) {
    return false;
  }
  const bool go_on = RunCycleLocked(/*on_op_thread=*/true);
  // The engine thread is needed when this cycle left work or ended the
  // cycles.  Entries enqueued meanwhile found cycle_mu_ taken and woke it
  // themselves, as do Abort and the peer monitor.
  const bool wake =
      !go_on || !pending_.empty() || stage_ != CycleStage::kIdle;
  std::vector<FinishedEntry> finished;
  finished.swap(finished_);
  cycle.unlock();
  if (wake) wake_cv_.notify_one();
  CallDone(&finished);
  return true;
}

bool Engine::Impl::RunCycle(bool on_op_thread) {
  if (stage_ == CycleStage::kIdle && !BeginCycle()) return false;
  if (stage_ == CycleStage::kAndStarted) {
    bool done = false;
    const Status s = transport_->FinishBitwiseAnd(
        on_op_thread ? kOpThreadPatienceSeconds : -1.0, &done);
    if (!s.ok()) {
      stage_ = CycleStage::kIdle;
      return TransportFailed("negotiation (BitwiseAnd)", s);
    }
    if (!done) return true;  // late peers: the engine thread finishes it
    stage_ = CycleStage::kAndDone;
    ++cycles_;
  }
  if (on_op_thread && !SmallFastCycle()) return true;
  stage_ = CycleStage::kIdle;
  return EndCycle();
}

bool Engine::Impl::BeginCycle() {
  bool want_shutdown = false;
  std::string shutdown_reason;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (parameters_.fusion_wait_ms > 0 && pending_.empty() &&
        !incoming_.empty() && !shutdown_requested_) {
      WaitForMoreTensors(&lock);
    }
    drained_.swap(incoming_);
    want_shutdown = shutdown_requested_;
    if (want_shutdown) shutdown_reason = shutdown_reason_;
  }
  for (PendingEntry& p : drained_) {
    pending_.push_back(std::move(p));
    by_name_[pending_.back().request.name] = std::prev(pending_.end());
  }
  drained_.clear();
  if (peer_timeout_.load()) {
    return TransportFailed("negotiation", Status::Ok());
  }
  cycle_want_shutdown_ = want_shutdown;
  cycle_shutdown_reason_ = std::move(shutdown_reason);

  // Step 1: flags and cache bits.
  const double now = clock_();
  if (timeline_ != nullptr) {
    trace_cycle_start_ = now;
    trace_slow_cycle_ = false;
  }
  bits_.assign(1 + (cache_.size() + 63) / 64, 0);
  uint64_t flags = kAllFlagsClear;
  for (PendingEntry& p : pending_) {
    if (p.announced) {
      flags &= ~kFlagNoAnnouncedPending;
      continue;
    }
    // A request with invalid arguments is never a cache hit: it must reach
    // the coordinator, which fails it on every rank.
    const int bit = cache_.size() > 0 && p.request.invalid.empty()
                        ? cache_.Lookup(p.request, size_)
                        : -1;
    // A blocking join is announced at once, so that the coordinator can see
    // a crossing (negotiator.h) even when the join is cached.
    if (bit < 0 || now - p.enqueued_seconds > announce_after_seconds_ ||
        IsBlockingJoin(p.request)) {
      flags &= ~kFlagNoUncached;
      continue;
    }
    bits_[1 + bit / 64] |= uint64_t{1} << (bit % 64);
  }
  if (want_shutdown) flags &= ~kFlagNoShutdown;
  if (publish_pending_) flags &= ~kFlagNoParameterChange;
  bits_[0] = flags;
  const Status s = transport_->StartBitwiseAnd(&bits_);
  if (!s.ok()) return TransportFailed("negotiation (BitwiseAnd)", s);
  stage_ = CycleStage::kAndStarted;
  return true;
}

bool Engine::Impl::SmallFastCycle() const {
  if (bits_[0] != kAllFlagsClear) return false;
  int64_t bytes = 0;
  return ForEachCacheBit(bits_, [&](int bit) {
    const Response& r = cache_.Get(bit);
    bytes += AllreduceBytes(r);
    return r.type == ResponseType::kAllreduce && r.device == kCpuDevice &&
           bytes <= kOpThreadMaxBytes;
  });
}

bool Engine::Impl::EndCycle() {
  if (bits_[0] != kAllFlagsClear) {
    return SlowPath(cycle_want_shutdown_, cycle_shutdown_reason_);
  }

  // Step 2: fast path.
  responses_.clear();
  ForEachCacheBit(bits_, [&](int bit) {
    cache_.Touch(bit);
    responses_.push_back(&cache_.Get(bit));
    return true;
  });
  if (responses_.empty()) return true;
  fast_responses_ += static_cast<int64_t>(responses_.size());
  return ExecuteResponses(responses_);
}

bool Engine::Impl::SlowPath(bool want_shutdown,
                            const std::string& shutdown_reason) {
  ++slow_cycles_;
  if (timeline_ != nullptr) trace_slow_cycle_ = true;
  // Step 3: announce everything not yet announced.
  RequestList mine;
  for (PendingEntry& p : pending_) {
    if (p.announced) continue;
    mine.requests.push_back(p.request);
    p.announced = true;
  }
  mine.shutdown = want_shutdown;
  mine.shutdown_reason = shutdown_reason;
  SerializeRequestList(mine, &bytes_);
  Status s = transport_->GatherBytes(bytes_, &gathered_);
  if (!s.ok()) return TransportFailed("negotiation (GatherBytes)", s);
  ResponseList list;
  if (rank_ == 0) {
    for (int r = 0; r < size_ && r < static_cast<int>(gathered_.size());
         ++r) {
      RequestList theirs;
      Status parsed = ParseRequestList(gathered_[r], &theirs);
      if (!parsed.ok()) {
        // Still answer, so no rank hangs: shut everyone down.
        theirs = RequestList();
        theirs.shutdown = true;
        theirs.shutdown_reason = parsed.message();
      }
      if (timeline_ != nullptr) TraceRequests(r, theirs, clock_());
      negotiator_->AddRequestList(r, theirs);
    }
    std::vector<std::string> warnings;
    list = negotiator_->ComputeResponses(&warnings);
    for (const std::string& w : warnings) LogLine(self_, w);
    if (publish_pending_) {
      list.has_parameters = true;
      list.parameters =
          autotuner_ != nullptr ? autotuner_->current() : parameters_;
      publish_pending_ = false;
    }
    SerializeResponseList(list, &bytes_);
  }
  s = transport_->BroadcastBytes(&bytes_);
  if (!s.ok()) return TransportFailed("negotiation (BroadcastBytes)", s);
  if (rank_ != 0) {
    s = ParseResponseList(bytes_, &list);
    if (!s.ok()) return Fatal(StatusCode::kInternal, "failed: " + s.message());
  }
  // The new parameters govern this cycle's fusion plan on every rank.
  if (list.has_parameters) ApplyParameters(list.parameters);
  // Step 4: same cache inserts, in the same order, on every rank.
  responses_.clear();
  for (const Response& r : list.responses) {
    if (r.type != ResponseType::kError) cache_.Put(r);
    responses_.push_back(&r);
  }
  slow_responses_ += static_cast<int64_t>(list.responses.size());
  const bool keep_going = ExecuteResponses(responses_);
  responses_.clear();
  if (list.shutdown) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (sticky_code_ == StatusCode::kOk) {
        sticky_code_ = StatusCode::kAborted;
        sticky_suffix_ = "was aborted because " +
                         mpistrategy::DescribeRank(list.shutdown_rank, peers_) +
                         " stopped: " + list.shutdown_reason;
      }
    }
    return false;
  }
  return keep_going;
}

bool Engine::Impl::ExecuteResponses(
    const std::vector<const Response*>& responses) {
  ok_responses_.clear();
  ok_entries_.clear();
  ok_bytes_.clear();
  const double responded = timeline_ != nullptr ? clock_() : 0.0;
  int64_t traced_errors = 0;
  for (const Response* r : responses) {
    if (r->type == ResponseType::kError) {
      const bool for_me =
          r->error_ranks.empty() ||
          std::find(r->error_ranks.begin(), r->error_ranks.end(), rank_) !=
              r->error_ranks.end();
      if (!for_me) continue;
      for (const std::string& name : r->names) {
        auto it = by_name_.find(name);
        // Only an announced entry is the one the coordinator judged; a rank
        // that never announced the name ignores the error.
        if (it == by_name_.end() || !it->second->announced) continue;
        if (timeline_ != nullptr) {
          TraceNegotiated(*it->second, responded, *r);
          ++traced_errors;
        }
        Finish(it->second, Status(r->error_code, r->error_message));
      }
      continue;
    }
    auto it = by_name_.find(r->names[0]);
    if (it == by_name_.end()) {
      return Fatal(StatusCode::kInternal,
                   "failed: internal error: rank " + std::to_string(rank_) +
                       " got a response for unknown collective \"" +
                       r->names[0] + "\"");
    }
    ok_responses_.push_back(r);
    ok_entries_.push_back(it->second);
    ok_bytes_.push_back(AllreduceBytes(*r));
    if (timeline_ != nullptr) TraceNegotiated(*it->second, responded, *r);
  }
  if (ok_responses_.empty()) {
    if (timeline_ != nullptr && traced_errors > 0) {
      TraceCycle(0, traced_errors, 0, 0, 0);
    }
    return true;
  }
  const std::vector<FusionBucket> plan =
      PlanFusion(ok_responses_, ok_bytes_, parameters_.fusion_threshold_bytes);
  for (const FusionBucket& bucket : plan) {
    bucket_responses_.clear();
    bucket_entries_.clear();
    for (int m : bucket.members) {
      bucket_responses_.push_back(ok_responses_[m]);
      bucket_entries_.push_back(&ok_entries_[m]->entry);
    }
    if (timeline_ != nullptr) {
      const double start = clock_();
      for (const TensorEntry* e : bucket_entries_) {
        timeline_->Span(e->name, kTimelineQueue, responded, start);
      }
    }
    Status s =
        executor_.Execute(bucket_responses_, bucket_entries_, &bucket_status_);
    ++buckets_;
    if (bucket.members.size() > 1) ++fused_buckets_;
    if (!s.ok()) {
      const Response& r = *bucket_responses_[0];
      return TransportFailed(std::string("the transport during ") +
                                 ResponseTypeName(r.type) + " \"" +
                                 r.names[0] + "\"",
                             s);
    }
    for (size_t k = 0; k < bucket.members.size(); ++k) {
      Finish(ok_entries_[bucket.members[k]], bucket_status_[k]);
    }
    // Earlier buckets' results go to TF at once, to overlap with the rest
    // of the cycle; the last bucket's wait for the cycle's end (finished_).
    if (&bucket != &plan.back()) CallDone(&finished_);
  }
  const bool tuning = autotuner_ != nullptr && !autotuner_->done();
  if (timeline_ == nullptr && !tuning) return true;
  int64_t bytes = 0;
  for (int64_t b : ok_bytes_) bytes += b;
  if (timeline_ != nullptr) {
    int64_t fused = 0;
    for (const FusionBucket& bucket : plan) {
      if (bucket.members.size() > 1) ++fused;
    }
    TraceCycle(static_cast<int64_t>(ok_responses_.size()), traced_errors,
               static_cast<int64_t>(plan.size()), fused, bytes);
  }
  if (tuning) RecordForAutotune(bytes);
  return true;
}

void Engine::Impl::Finish(PendingIter it, const Status& status) {
  if (it->entry.done) {
    finished_.push_back({std::move(it->entry.done), status});
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.erase(it->request.name);
  }
  by_name_.erase(it->request.name);
  pending_.erase(it);
}

void Engine::Impl::CallDone(std::vector<FinishedEntry>* finished) {
  if (finished->empty()) return;
  const void* outer = cycle_owner_on_this_thread;
  cycle_owner_on_this_thread = this;
  for (FinishedEntry& f : *finished) f.done(f.status);
  cycle_owner_on_this_thread = outer;
  finished->clear();
}

bool Engine::Impl::Fatal(StatusCode code, const std::string& suffix) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (sticky_code_ == StatusCode::kOk) {
      sticky_code_ = code;
      sticky_suffix_ = suffix;
    }
  }
  LogLine(self_.empty() ? mpistrategy::DescribeRank(rank_, {}) : self_,
          "engine stopped: every pending and future collective " + suffix);
  return false;
}

bool Engine::Impl::TransportFailed(const std::string& what,
                                   const Status& s) {
  if (peer_timeout_.load()) {
    std::string message;
    {
      std::lock_guard<std::mutex> lock(mu_);
      message = peer_timeout_message_;
    }
    return Fatal(StatusCode::kUnavailable, "failed: " + message);
  }
  return Fatal(StatusCode::kUnavailable,
               "failed because " + what + " failed: " + s.ToString());
}

// ---- peer monitor -------------------------------------------------------

void Engine::Impl::StartMonitor() {
  if (config_.peer_timeout_seconds <= 0.0 || size_ < 2) return;
  if (!transport_->SupportsNotices()) {
    LogLine(self_,
            "peer_timeout_seconds is not enforced: the transport cannot "
            "exchange heartbeats next to the collectives (MPI must provide "
            "MPI_THREAD_MULTIPLE); a frozen, dead or unreachable rank makes "
            "the others wait forever");
    return;
  }
  auto monitor = std::make_shared<PeerMonitor>(
      rank_, size_, peers_, config_.peer_timeout_seconds,
      config_.stall_warning_seconds, clock_());
  monitor_thread_ = std::thread([this, monitor] { MonitorLoop(monitor.get()); });
  pthread_setname_np(monitor_thread_.native_handle(), "mpistrategy-mon");
}

void Engine::Impl::StopMonitor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    monitor_stop_ = true;
  }
  monitor_cv_.notify_all();
  if (monitor_thread_.joinable()) monitor_thread_.join();
}

void Engine::Impl::MonitorLoop(PeerMonitor* monitor) {
  const auto period = std::chrono::duration<double>(
      monitor->heartbeat_seconds() / 2);
  bool post_failed = false;
  for (;;) {
    const double now = clock_();
    for (;;) {
      int from = -1;
      std::string bytes;
      bool got = false;
      if (!transport_->TakeNotice(&from, &bytes, &got).ok() || !got) break;
      monitor->OnNotice(from, bytes, now);
    }
    PeerMonitor::Actions actions = monitor->Tick(now);
    for (const auto& [to, bytes] : actions.sends) {
      const Status s = transport_->PostNotice(to, bytes);
      if (!s.ok() && !post_failed) {
        post_failed = true;  // logged once; the timeout still works
        LogLine(self_, "cannot send heartbeats: " + s.ToString());
      }
    }
    for (const std::string& w : actions.warnings) LogLine(self_, w);
    if (actions.timed_out) {
      OnPeerTimeout(actions.message);
      return;
    }
    std::unique_lock<std::mutex> lock(mu_);
    if (monitor_cv_.wait_for(lock, period, [this] { return monitor_stop_; })) {
      return;
    }
  }
}

void Engine::Impl::OnPeerTimeout(const std::string& message) {
  LogLine(self_, message + ". Every pending and future collective of " +
                     self_ + " fails with UNAVAILABLE and the job ends.");
  {
    std::lock_guard<std::mutex> lock(mu_);
    peer_timeout_message_ = message;
    peer_timeout_ = true;
  }
  wake_cv_.notify_all();
  if (!on_peer_timeout_) return;
  // A moment for the engine thread to fail the pending collectives (the
  // Python code sees the error) and for rank 0's abort notices to leave;
  // MPI moves them only inside MPI calls, hence TakeNotice.
  const double until = clock_() + kPeerTimeoutGraceSeconds;
  while (clock_() < until) {
    int from = -1;
    std::string bytes;
    bool got = false;
    transport_->TakeNotice(&from, &bytes, &got);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  on_peer_timeout_(message);
}

// ---- fusion parameters and autotune ------------------------------------

void Engine::Impl::WaitForMoreTensors(std::unique_lock<std::mutex>* lock) {
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::duration<double, std::milli>(parameters_.fusion_wait_ms));
  // Enqueue notifies on every submission; only a shutdown cuts the wait.
  wake_cv_.wait_until(*lock, deadline, [this] { return shutdown_requested_; });
}

void Engine::Impl::ApplyParameters(const TunedParameters& parameters) {
  parameters_ = parameters;
  if (autotuner_ != nullptr) autotuner_->Applied(clock_());
  std::lock_guard<std::mutex> lock(mu_);
  published_parameters_ = parameters;
}

void Engine::Impl::RecordForAutotune(int64_t bytes) {
  if (autotuner_->Record(clock_(), bytes)) publish_pending_ = true;
  const std::vector<std::string> lines = autotuner_->TakeLogLines();
  if (autotune_log_ != nullptr && !lines.empty()) {
    for (const std::string& line : lines) {
      std::fprintf(autotune_log_, "%s\n", line.c_str());
    }
    std::fflush(autotune_log_);
  }
  if (autotuner_->done()) {
    const TunedParameters& p = autotuner_->current();
    LogLine(rank_, "autotune finished: fusion_threshold_bytes=" +
                       std::to_string(p.fusion_threshold_bytes) +
                       " fusion_wait_ms=" + std::to_string(p.fusion_wait_ms));
  }
}

// ---- timeline hooks -----------------------------------------------------

void Engine::Impl::TraceRequests(int rank, const RequestList& list,
                                 double at) {
  for (const Request& q : list.requests) {
    timeline_->Instant(q.name, kTimelineRequest, at,
                       TimelineArgs().Add("rank", rank).Json());
  }
}

void Engine::Impl::TraceNegotiated(const PendingEntry& p, double responded,
                                   const Response& response) {
  TimelineArgs args;
  args.Add("path", trace_slow_cycle_ ? "slow" : "fast");
  if (response.type == ResponseType::kError) {
    args.Add("error", response.error_message);
  } else {
    args.Add("shape", ShapeString(p.request.shape));
  }
  timeline_->Span(p.request.name, kTimelineNegotiate, p.enqueued_seconds,
                  responded, args.Json());
}

void Engine::Impl::TraceCycle(int64_t tensors, int64_t errors,
                              int64_t buckets, int64_t fused_buckets,
                              int64_t bytes) {
  TimelineArgs args;
  args.Add("path", trace_slow_cycle_ ? "slow" : "fast")
      .Add("tensors", tensors)
      .Add("buckets", buckets)
      .Add("fused_buckets", fused_buckets)
      .Add("allreduce_bytes", bytes);
  if (errors > 0) args.Add("errors", errors);
  timeline_->CycleSpan(trace_cycle_start_, clock_(), args.Json());
}

// ---- Engine -------------------------------------------------------------

namespace {

// Opens this rank's timeline for `path` (EngineConfig::timeline_path), or
// leaves *timeline null where the rank writes none (Timeline::PathForRank).
Status OpenTimeline(const std::string& path, int rank, const PeerInfo& me,
                    std::unique_ptr<Timeline>* timeline) {
  const std::string file = Timeline::PathForRank(path, rank);
  if (file.empty()) return Status::Ok();
  Timeline::Options options;
  options.process_name = "rank " + std::to_string(rank) + " (host " +
                         me.host + ", pid " + std::to_string(me.pid) + ")";
  return Timeline::Open(file, rank, options, timeline);
}

// Engine::Create's rank-local part: validates `config` and opens this rank's
// files.
Status OpenEngineFiles(const EngineConfig& config, int rank,
                       const PeerInfo& me,
                       std::unique_ptr<Timeline>* timeline,
                       std::FILE** autotune_log) {
  MPISTRATEGY_RETURN_IF_ERROR(config.Validate());
  const Status opened = OpenTimeline(config.timeline_path, rank, me, timeline);
  if (!opened.ok()) {
    // Named as the user sets it (start_timeline's error names that call).
    return Status(opened.code(), "Options.timeline (MPISTRATEGY_TIMELINE): " +
                                     opened.message());
  }
  // Rank 0 appends the autotuner's CSV log (header first when new).
  if (config.autotune && !config.autotune_log.empty() && rank == 0) {
    // Rank 0 alone writes it: "{rank}" in its path is 0.
    const std::string path = Timeline::PathForRank(config.autotune_log, 0);
    *autotune_log = std::fopen(path.c_str(), "a");
    if (*autotune_log == nullptr) {
      const int error = errno;
      return Status::InvalidArgument(
          "Options.autotune_log (MPISTRATEGY_AUTOTUNE_LOG): cannot open the "
          "autotune log \"" + path + "\" for appending: " +
          std::generic_category().message(error));
    }
    std::fseek(*autotune_log, 0, SEEK_END);
    if (std::ftell(*autotune_log) == 0) {
      std::fprintf(*autotune_log, "%s\n", Autotuner::kLogHeader);
      std::fflush(*autotune_log);
    }
  }
  return Status::Ok();
}

}  // namespace

Status Engine::Impl::SetTimeline(const std::string& path) {
  static const char kStopped[] =
      "cannot switch the timeline: the engine has stopped";
  if (stopped()) return Status::FailedPrecondition(kStopped);
  // Opened (and a replaced one closed) outside cycle_mu_: file I/O must not
  // hold up the cycles.  The file being written goes on until the next one
  // is open, unless the next one is the same file: opening that would
  // truncate it under its writer, so that one is closed first.
  const std::string file = Timeline::PathForRank(path, rank_);
  std::unique_ptr<Timeline> same;
  {
    std::lock_guard<std::mutex> cycle(cycle_mu_);
    if (timeline_ != nullptr && !file.empty() && timeline_->Writes(file)) {
      same = std::move(timeline_);
      executor_.set_timeline(nullptr);
    }
  }
  if (same != nullptr) same->Close();
  std::unique_ptr<Timeline> next;
  MPISTRATEGY_RETURN_IF_ERROR(
      OpenTimeline(path, rank_, transport_->peer_info(), &next));
  std::unique_ptr<Timeline> previous;
  {
    std::lock_guard<std::mutex> cycle(cycle_mu_);
    if (stopped()) {
      if (next != nullptr) next->Close();
      return Status::FailedPrecondition(kStopped);
    }
    previous = std::move(timeline_);
    timeline_ = std::move(next);
    executor_.set_timeline(timeline_.get());
    // A cycle that an op's thread left half done ends with a span from here.
    trace_cycle_start_ = clock_();
  }
  if (previous != nullptr) previous->Close();
  return Status::Ok();
}

Status Engine::Create(const EngineConfig& config,
                      std::unique_ptr<Transport> transport,
                      std::unique_ptr<Engine>* engine,
                      PeerTimeoutHandler on_peer_timeout) {
  if (transport == nullptr) {
    return Status::InvalidArgument("Engine::Create: transport is null");
  }
  std::unique_ptr<Timeline> timeline;
  std::FILE* autotune_log = nullptr;
  const Status local =
      OpenEngineFiles(config, transport->rank(), transport->peer_info(),
                      &timeline, &autotune_log);
  if (!local.ok()) {
    if (autotune_log != nullptr) std::fclose(autotune_log);
    // The other ranks' engines wait for this rank's startup report; failing
    // without it would leave them hanging (see AgreeOnStartup).
    std::vector<PeerInfo> peers;
    AgreeOnStartup(transport.get(), local, config, &peers);
    return local;
  }
  std::unique_ptr<Engine> e(new Engine());
  e->impl_.reset(new Impl(config, std::move(transport), std::move(timeline),
                          autotune_log, std::move(on_peer_timeout)));
  e->impl_->Start();
  *engine = std::move(e);
  return Status::Ok();
}

Engine::~Engine() = default;

Status Engine::Enqueue(TensorEntry entry) {
  return impl_->Enqueue(std::move(entry));
}

Status Engine::EnqueueGroup(std::vector<TensorEntry> entries) {
  return impl_->EnqueueGroup(std::move(entries));
}

void Engine::Abort(const std::string& reason, double timeout_seconds) {
  impl_->Abort(reason, timeout_seconds);
}

bool Engine::Impl::stopped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stopped_;
}

bool Engine::stopped() const { return impl_->stopped(); }
int Engine::rank() const { return impl_->rank_; }
int Engine::size() const { return impl_->size_; }
int Engine::local_rank() const { return impl_->transport_->local_rank(); }
int Engine::local_size() const { return impl_->transport_->local_size(); }
bool Engine::cpu_plane_reduces_parts() const {
  return impl_->cpu_plane_reduces_parts();
}
const EngineConfig& Engine::config() const { return impl_->config_; }
std::string Engine::DescribeRank(int rank) const {
  return impl_->DescribeRankLocked(rank);
}
Status Engine::WaitForPeers(std::vector<PeerInfo>* peers) const {
  return impl_->WaitForPeers(peers);
}

Status Engine::WaitUntilStarted() const { return impl_->WaitUntilStarted(); }
EngineStats Engine::stats() const { return impl_->stats(); }
TunedParameters Engine::tuned_parameters() const {
  return impl_->tuned_parameters();
}

Status Engine::SetTimeline(const std::string& path) {
  return impl_->SetTimeline(path);
}

}  // namespace mpistrategy
