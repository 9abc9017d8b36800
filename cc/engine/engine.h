// The collective engine: one background thread per process that negotiates,
// fuses and executes collectives.  Framework-free; the TF kernels submit
// TensorEntry objects and get a callback.
//
// Why a background thread: TensorFlow runs independent ops in whatever order
// its executor picks, so two ranks can reach the same pair of collectives in
// opposite orders.  Kernels therefore never call the transport themselves.
// They enqueue, and the engine's cycles, in lock-step with the other ranks'
// engines, decide which tensors are ready everywhere and in which order they
// run (see negotiator.h for the protocol).  Cycles run one at a time, usually
// on the engine's thread; the thread that enqueues a small CPU allreduce runs
// the cycle itself when none is running and its peers are ready, which saves
// two thread wake-ups per collective (docs/DESIGN.md, "Who runs a cycle").

#ifndef MPISTRATEGY_CC_ENGINE_ENGINE_H_
#define MPISTRATEGY_CC_ENGINE_ENGINE_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cc/engine/autotuner.h"
#include "cc/common/common.h"
#include "cc/engine/config.h"
#include "cc/transport/transport.h"

namespace mpistrategy {

class DeviceContext;  // device.h

// One tensor submitted to one collective on this rank.
struct TensorEntry {
  CollectiveType type = CollectiveType::kAllreduce;
  // Identifies the collective across ranks: every rank submits the same name,
  // and a name may be in flight only once per rank.
  std::string name;
  DataType dtype = DataType::kFloat32;
  Shape shape;                         // of `input`
  ReduceOp reduce_op = ReduceOp::kSum;  // allreduce, reducescatter
  int32_t root_rank = 0;               // broadcast
  // alltoall: rows (first-dimension slices) sent to each rank; empty means
  // an even split.
  std::vector<int64_t> splits;
  // allreduce only: this entry is a group of tensors that the kernel packed
  // into one 1-D buffer (grouped_allreduce), and these are their shapes, in
  // order.  The engine treats the entry as one tensor; the shapes only take
  // part in the cross-rank comparison, so a group that differs between ranks
  // fails naming the tensor instead of being reduced as matching totals.
  std::vector<Shape> packed_shapes;
  // With packed_shapes, when the group mixes dtypes: each tensor's dtype, in
  // order.  The entry is then a byte buffer (dtype kUint8, shape
  // {PackedGroupLayout(...).total_bytes}) laid out by PackedGroupLayout and
  // reduced one dtype segment at a time; still one name and one
  // negotiation, so ranks whose groups differ in dtypes fail naming the
  // tensor.  Empty for single-dtype groups (the buffer has `dtype`).  Never
  // fused with other entries.
  std::vector<DataType> packed_dtypes;
  // Set by the grouped_allreduce kernel on its packed entry, even for a
  // group of no tensors (a 0-size entry with empty packed_shapes): ranks
  // then compare groups, and one rank's empty group fails the others'
  // instead of leaving them waiting.
  bool grouped = false;
  // With packed_shapes of one dtype, on the CPU: where each tensor of the
  // group still is, in order, when the kernel left the packing to the engine
  // (`input` is null then, and `output` is the packed buffer).  The engine
  // copies them into `output` at their PackedGroupLayout offsets before
  // reducing it in place, or, on a data plane that reduces_parts(), reduces
  // them from where they are into those offsets, which saves that copy.
  // Not owned; valid until `done` runs; null for 0-size tensors.
  std::vector<const void*> packed_inputs;
  // With packed_inputs: where each tensor's output is, in order, when the
  // kernel gave each its own (its input's buffer where TF let it forward
  // it, so that the tensor is reduced in place) instead of views of
  // `output` (null then).  Only on an engine whose CPU plane
  // reduces_parts() (Engine::cpu_plane_reduces_parts).  Not owned; valid
  // until `done` runs; null for 0-size tensors.
  std::vector<void*> packed_outputs;
  int32_t device = kCpuDevice;
  // GPU entries (device != kCpuDevice): the op's stream and GPU; null for
  // CPU entries.  See device.h.
  std::shared_ptr<DeviceContext> device_context;

  // Not owned; valid until `done` runs.  May be null for 0-size tensors.
  const void* input = nullptr;
  // Preallocated output for allreduce and broadcast (same shape as input).
  // Not owned; valid until `done` runs.
  void* output = nullptr;
  // For collectives whose output shape is only known after negotiation
  // (allgather, reducescatter, alltoall): called once, from the engine
  // thread, with the final shape; must set *data to a buffer of that size.
  std::function<Status(const Shape& shape, void** data)> allocate_output;
  // alltoall: called with the rows received from each rank, before `done`.
  std::function<void(const std::vector<int64_t>& received_splits)>
      set_received_splits;

  // Called exactly once, after the output is written or with the error:
  // from the engine thread, or from Enqueue itself (when the entry is
  // rejected, or when Enqueue ran the cycle that completed it).  It may
  // enqueue again; that enqueue never runs a cycle of its own.
  std::function<void(const Status&)> done;
};

// Counters for tests and diagnostics (added by the engine engineer; not
// part of the original frozen interface).  Monotonic since Create.
struct EngineStats {
  int64_t cycles = 0;          // negotiation cycles run
  int64_t slow_cycles = 0;     // cycles that took the coordinator path
  int64_t fast_responses = 0;  // responses taken from the cache bits
  int64_t slow_responses = 0;  // responses sent by the coordinator
  int64_t buckets = 0;         // transport calls for collectives
  int64_t fused_buckets = 0;   // ... of which packed more than one tensor
};

// Calls entry->allocate_output for `shape`.  On failure, or when the
// callback gives no buffer for a non-empty output, *data is null and the
// status says why (the rank must still take part in the collective).
Status AllocateOutput(TensorEntry* entry, const Shape& shape, void** data);

// Called once, on the peer monitor's thread, about a second after a peer
// timeout (EngineConfig::peer_timeout_seconds) failed this rank's
// collectives, with the message naming the silent ranks.  The process
// embedding the engine ends the job here (the C ABI calls MPI_Abort); tests
// pass none.
using PeerTimeoutHandler = std::function<void(const std::string& message)>;

class Engine {
 public:
  // Validates `config`, opens this rank's files (timeline, autotune log),
  // takes ownership of `transport` and starts the background thread.
  //
  // Collective: every rank must call it.  The engines' first exchange tells
  // every rank whether all others started; when one rank's Create fails, it
  // still takes part (and returns its error), and the other ranks' engines
  // stop, failing their collectives with FailedPrecondition naming that
  // rank and its error, instead of waiting for it forever.
  //
  // With EngineConfig::peer_timeout_seconds > 0 (and more than one rank) a
  // monitor thread watches the other ranks (peer_monitor.h); when they go
  // silent, every pending and future collective fails with Unavailable
  // naming them, and `on_peer_timeout` (if set) is called.
  static Status Create(const EngineConfig& config,
                       std::unique_ptr<Transport> transport,
                       std::unique_ptr<Engine>* engine,
                       PeerTimeoutHandler on_peer_timeout = nullptr);

  // Fails every pending entry with Aborted and joins the thread.  Tells the
  // other ranks' engines, which fail their pending entries too.
  //
  // Runs one last negotiation cycle with the other ranks (their engine
  // threads keep cycling in the background, so they join it), unless the
  // engine already stopped (remote shutdown, Abort, transport error).  Must
  // not be called from a `done` callback (that runs inside a cycle).
  // No Enqueue may run concurrently with or after the destructor.
  ~Engine();

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Thread-safe.  Validates the entry locally (InvalidArgument: dtype/op
  // combination, root rank range, splits, duplicate name in flight) and
  // queues it.  On a local validation error `done` has been called with it
  // and the same Status is returned.  After a fatal error (a remote rank
  // failed, a stall timed out under a shutdown, the transport broke) every
  // Enqueue fails fast with that sticky error.
  Status Enqueue(TensorEntry entry);

  // Enqueue for several entries at once: the accepted ones become visible
  // to the engine thread together, so they are negotiated in the same cycle
  // and can share a fusion bucket (grouped_allreduce).  Each rejected entry
  // gets its own `done`; returns the first rejection, or OK.
  Status EnqueueGroup(std::vector<TensorEntry> entries);

  // Asks every rank's engine to stop: pending and future entries fail with
  // Aborted carrying `reason` (e.g. "rank 1 raised ValueError: ...").
  // Returns once this rank's engine has told the others and stopped (its
  // pending entries failed, its timeline file complete), or after
  // `timeout_seconds`.
  void Abort(const std::string& reason, double timeout_seconds);

  // Thread-safe.  True once the background thread has stopped (a remote
  // shutdown, Abort, a peer timeout or a transport error): every Enqueue
  // then fails with the sticky error.
  bool stopped() const;
  int rank() const;
  int size() const;
  int local_rank() const;
  int local_size() const;
  const EngineConfig& config() const;
  // Thread-safe.  "rank N (host H, pid P)" for rank `rank`, from the
  // identities the engines exchanged at startup ("rank N" before that).
  std::string DescribeRank(int rank) const;
  // Thread-safe; blocks until the engines have agreed at startup.  Fills
  // `peers` with every rank's host and pid, or returns the error that
  // stopped this engine first.
  Status WaitForPeers(std::vector<PeerInfo>* peers) const;
  // Thread-safe; blocks until the engine runs collectives (startup agreed,
  // the host data plane set up), or returns the error that stopped it
  // first, so that a failed start fails `init` rather than the first
  // collective.
  Status WaitUntilStarted() const;

  // Thread-safe snapshot of the counters.
  EngineStats stats() const;

  // Thread-safe.  True once the plane of CPU tensors is set up and reduces
  // tensors where they are (DataPlane::reduces_parts, e.g. shared memory),
  // so a group's packed_inputs may come with packed_outputs; false before.
  bool cpu_plane_reduces_parts() const;

  // Thread-safe.  Starts writing a timeline to `path` (Timeline::PathForRank
  // decides which ranks write, as for EngineConfig::timeline_path), closing
  // the file written so far, if any; an empty `path` only closes it.  The
  // switch happens between cycles: spans of collectives under way go to
  // the file in force when they end.  Returns InvalidArgument naming a file
  // that cannot be opened (the current file then stays), or
  // FailedPrecondition once the engine has stopped.
  Status SetTimeline(const std::string& path);

  // Thread-safe: the fusion parameters in force on this rank.  Rank 0's
  // (which govern every rank from the first negotiation on) or, with
  // EngineConfig::autotune, the autotuner's latest choice; `final` once
  // tuning ended (always, without autotune).
  TunedParameters tuned_parameters() const;

 private:
  Engine() = default;
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_ENGINE_ENGINE_H_
