// The negotiation's bitwise AND among ranks that all share one host, through
// the shared-memory segment of their ShmPlane instead of MPI.
//
// Every cycle of the engine starts with this AND, and ranks reach it far
// apart (one is still computing its gradients).  MPI can only be polled:
// the waiting rank wakes again and again to test its request, and each
// wake-up takes a core from TensorFlow where ranks share cores
// (bench/RESULTS.md section 11: about 25 per Keras step).  Here a waiting
// rank sleeps on a futex in the segment that the last rank to arrive wakes,
// so it wakes once, when the result is there.
//
// Layout (inside the segment's header, zero when created): the words of a
// HostRounds (peer_wait.h), one round per AND, and two sets of one
// bit-vector slot per rank.  The AND number k writes its slot in set k % 2
// and arrives at round k; once the round is complete (its last arrival
// wakes the sleepers) each rank ANDs the slots itself.  No rank can start
// AND k + 2 (and overwrite set k % 2) before every rank has arrived at
// k + 1, that is, has finished reading AND k.
//
// A waiting rank calls the wait hook about every millisecond; a non-OK
// status from it ends the wait (the engine's peer deadline).
//
// Thread-compatible: one AND at a time per rank, as the engine runs them.

#ifndef MPISTRATEGY_CC_TRANSPORT_HOST_RENDEZVOUS_H_
#define MPISTRATEGY_CC_TRANSPORT_HOST_RENDEZVOUS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "cc/common/common.h"
#include "cc/transport/peer_wait.h"

namespace mpistrategy {

class HostRendezvous {
 public:
  // Bit vectors of up to this many words go through shared memory (the
  // engine's are 1 + cache_capacity / 64: 17 by default); longer ones stay
  // on MPI, which decides alike on every rank (every rank's vector has the
  // same length).
  static constexpr int64_t kMaxWords = 64;

  // Bytes of the segment's header the area takes for `size` ranks.
  static int64_t AreaBytes(int size);

  // Args:
  //   mapping: keeps the segment mapped while this object lives.
  //   area: AreaBytes(size) bytes of it, 64-byte aligned, zero before any
  //     rank's first Start.
  //   rank, size: this rank among the host's ranks, which must be all ranks
  //     of the job.
  HostRendezvous(std::shared_ptr<void> mapping, char* area, int rank,
                 int size);

  void SetWaitHook(std::function<Status()> hook) {
    wait_hook_ = std::move(hook);
  }

  // Whether a vector of `words` words goes through shared memory.
  bool Fits(int64_t words) const { return words <= kMaxWords; }
  // Between Start and the Finish that reports it done.
  bool in_flight() const { return bits_ != nullptr; }

  // Starts the AND of `bits` (Fits(bits->size()), the same length on
  // every rank) with every rank's; `bits` must stay alive until Finish
  // reports it done, and then holds the result.
  Status Start(std::vector<uint64_t>* bits);
  // Waits at most `max_wait_seconds` (< 0: until done, or until the wait
  // hook fails) and sets *done when `bits` holds the result.
  Status Finish(double max_wait_seconds, bool* done);

 private:
  uint64_t* Slot(int set, int rank) const;

  const std::shared_ptr<void> mapping_;
  HostRounds rounds_;  // one per AND
  uint64_t* const slots_;
  const int rank_;
  const int size_;
  std::function<Status()> wait_hook_;
  std::vector<uint64_t>* bits_ = nullptr;  // the AND in flight
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_TRANSPORT_HOST_RENDEZVOUS_H_
