// The coordinator side of the negotiation protocol, and the protocol itself.
//
// Protocol (one *cycle*, every rank's engine thread in lock-step; rank 0 is
// the coordinator):
//
//   1. Every rank builds a bit vector.  Word 0 holds four *inverted* flags
//      (bit set = "no"): kFlagNoUncached ("I have no unannounced request
//      that misses the response cache"), kFlagNoAnnouncedPending ("none of
//      my announced requests is still waiting for a response"),
//      kFlagNoShutdown and kFlagNoParameterChange (rank 0 only: "I have no
//      new fusion parameters to publish").  Words 1.. hold one bit per response-cache entry: set
//      when this rank has a pending, unannounced request matching it.  The
//      vector is 1 + ceil(cache size / 64) words long; the cache is identical
//      on every rank, so the length is too.  One Transport::BitwiseAnd.
//   2. Fast path: all four flag bits survived (no rank has news), so the
//      responses are the cache entries whose bits survived, in bit order.
//      No other control traffic; this is a training loop's steady state.
//   3. Slow path (some flag cleared somewhere): every rank serialises all of
//      its pending unannounced requests (cached or not) and its shutdown
//      request into a RequestList, marks them announced and GatherBytes it
//      to rank 0.  Rank 0 feeds each list to Negotiator::AddRequestList
//      (this class), then Negotiator::ComputeResponses:
//        a. every name now announced by all ranks becomes a Response, in
//           the order in which the names completed; ranks must agree on
//           type, dtype, reduce op, root rank, device and shape (allgather
//           and alltoall: all dims but the first), otherwise the response is
//           a FailedPrecondition ERROR naming the tensor, field, values and
//           ranks;
//        b. a blocking join (IsBlockingJoin) that is *crossed* fails after
//           kCrossedJoinSeconds, with what it is crossed with (below);
//        c. the stall inspector warns about, and after the timeout fails
//           (DeadlineExceeded, for the ranks that announced it), names only
//           some ranks announced;
//        d. a shutdown request from any rank makes the list a SHUTDOWN list
//           carrying "rank R: reason".
//      Rank 0 BroadcastBytes the serialised ResponseList, which also carries
//      its fusion parameters when they changed (always in the first slow
//      cycle, so every rank plans fusion with rank 0's threshold; later
//      when the autotuner picks new ones).
//   4. Every rank inserts the successful responses into its response cache
//      in list order (so bit numbers agree everywhere), plans fusion
//      (fusion.h, a pure function of the list) and executes the buckets in
//      the same order, calling each entry's `done`.  ERROR responses fail the
//      matching *announced* entries only; a rank that never announced the
//      name ignores it.  After a SHUTDOWN list every rank fails what is
//      still pending with Aborted and leaves the loop.
//
// Deadlock freedom: all ranks execute the same ordered list, and a response
// exists only once every rank has announced the name, so every transport
// call in step 4 is matched on every rank.
//
// A request that matched the cache but keeps waiting (its bit does not
// survive because another rank has not submitted it) is announced after a
// while so that the coordinator's stall inspector can see it.
//
// Blocking joins: a barrier whose name starts with kBlockingJoinPrefix is a
// join that its ranks wait for before they submit anything else (a
// checkpoint read, mpistrategy/checkpoint.py: the calling thread blocks in
// it).  It is always announced at once.  When some ranks wait in such a
// join while every rank that did not enter it waits in another collective
// that a joined rank has not submitted, neither side can go on: the join is
// *crossed* (typically `if rank == 0: restore(...)` followed by a
// collective on every rank).  Other collectives are not judged this way: TF
// submits ops asynchronously, so a crossing is not a deadlock in general.
// Once a crossing has lasted kCrossedJoinSeconds (a rank that submitted the
// other collective asynchronously may still arrive), the join fails with
// FailedPrecondition on the ranks that entered it, and every pending
// collective of the crossed ranks that a joined rank has not submitted fails
// on the ranks that submitted it; each message names both sides.  While a
// rank that did not join waits in no collective (it may still be on its way
// to the join), nothing is judged: the caller's own timeout covers that.

#ifndef MPISTRATEGY_CC_ENGINE_NEGOTIATOR_H_
#define MPISTRATEGY_CC_ENGINE_NEGOTIATOR_H_

#include <cstdint>
#include <list>
#include <string>
#include <unordered_map>
#include <vector>

#include "cc/engine/message.h"
#include "cc/engine/stall_inspector.h"

namespace mpistrategy {

// Bits of word 0 of the cycle's bit vector (inverted: set means "no").
constexpr uint64_t kFlagNoUncached = 1u << 0;
constexpr uint64_t kFlagNoAnnouncedPending = 1u << 1;
constexpr uint64_t kFlagNoShutdown = 1u << 2;
// Cleared by rank 0 alone when it has fusion parameters to publish
// (ResponseList::parameters), which forces a slow cycle to carry them.
constexpr uint64_t kFlagNoParameterChange = 1u << 3;
constexpr uint64_t kAllFlagsClear = kFlagNoUncached | kFlagNoAnnouncedPending |
                                    kFlagNoShutdown | kFlagNoParameterChange;

// Names that start with this mark a barrier as a blocking join (above); the
// rest of the name says what the joined ranks are doing, for messages.
constexpr char kBlockingJoinPrefix[] = "MPIBlockingJoin/";
// How long a crossing must last before the join fails.
constexpr double kCrossedJoinSeconds = 1.0;

// True for a barrier named with kBlockingJoinPrefix.
bool IsBlockingJoin(const Request& request);

// Builds the response for `name` from one request per rank (requests[r] from
// rank r): the agreed collective, or a FailedPrecondition ERROR describing
// the first mismatch.  Exposed for tests.
Response BuildResponse(const std::string& name,
                       const std::vector<Request>& requests);

// The coordinator's message table.  Thread-compatible; rank 0's engine
// thread only.
class Negotiator {
 public:
  // Args:
  //   world_size: number of ranks.
  //   stall: the stall policy.
  //   clock: time source for stall detection.  Not null.
  Negotiator(int world_size, StallInspector stall, Clock clock);

  // Adds the requests rank `rank` announced this cycle (step 3).
  void AddRequestList(int rank, const RequestList& list);

  // Step 3a-d: the responses for this cycle.  Stall warnings are appended to
  // `warnings` (the caller logs them).
  ResponseList ComputeResponses(std::vector<std::string>* warnings);

  // Names announced by some but not all ranks.
  size_t num_pending() const { return table_.size(); }

  // Every rank's host and pid, for naming ranks in messages.
  void SetPeers(std::vector<PeerInfo> peers) { peers_ = std::move(peers); }

 private:
  struct Entry {
    PendingCollective pending;
    std::vector<Request> requests;  // indexed by rank
    int count = 0;
    bool blocking_join = false;
    // Clock time since when a blocking join has been crossed; < 0: it is
    // not.
    double crossed_since = -1.0;
  };

  // Step 3b: appends the error responses for crossed blocking joins (and the
  // collectives they are crossed with) to `list`, removing them from the
  // table.
  void FailCrossedJoins(ResponseList* list);

  int world_size_;
  StallInspector stall_;
  Clock clock_;
  std::vector<PeerInfo> peers_;
  std::unordered_map<std::string, Entry> table_;
  // Names announced by every rank, in completion order.
  std::vector<std::string> ready_;
  // First shutdown seen (lowest rank wins within a cycle).
  bool shutdown_ = false;
  int32_t shutdown_rank_ = -1;
  std::string shutdown_reason_;
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_ENGINE_NEGOTIATOR_H_
