// The data plane through POSIX shared memory among the ranks of one host.
//
// One segment per host: the host's first rank creates it when the plane is
// created, the others map it, and the creator unlinks it as soon as every
// rank has it mapped, so nothing stays in /dev/shm after the job, however it
// ends.  Only a kill inside those set-up calls (the creator waits there for
// the host's slowest rank) can leave one behind; the next job's creator on
// the host removes it (RemoveAbandonedShmSegments).
//
// The segment holds the barrier's words, the area of the negotiation's
// rendezvous (host_rendezvous.h), the word through which rank 0 publishes
// how large allreduces hand their lines over (below) and two sets of one
// slot per rank.  A collective moves its data in rounds of at most a slot,
// and at most kShmMaxRoundBytes, per rank, alternating the sets, so that a
// round's writes never touch the set the previous round's readers may still
// read:
//   * allreduce: every rank copies its chunk into its slot; barrier; rank r
//     reduces the r-th part of every slot (in rank order, in cache-sized
//     blocks; kMean divides each block right there) into its own slot;
//     barrier; every rank copies the reduced parts out.  Each rank
//     reads and writes the payload a few times, instead of MPI's many small
//     fragments through its queues;
//   * allgatherv / broadcast: copy in; barrier; copy out;
//   * reducescatter: every rank copies the part of each block for this
//     round; barrier; rank r reduces block r into its output.
// Alltoallv is not done in shared memory: it goes to the `fallback` plane
// (MPI), whose ranks must be this plane's ranks.
//
// A large allreduce writes what the peers read next (its slot) either with
// ordinary or with non-temporal stores, whichever is faster on this machine
// now (handoff_tuner.h).  Rank 0 times its copying and reducing in large
// allreduces of at least HandoffTunerSettings::min_bytes (timed ones) and
// its tuner picks the ways.  At the start of each timed allreduce rank 0
// writes into the segment's word the way of the next timed allreduce and
// the way of the smaller ones, before it arrives at the first barrier;
// every rank reads the word after that barrier.  Rank 0 cannot write the
// word again before every rank has arrived at the next barrier, and which
// allreduces are timed depends on their size only, so all ranks use the
// same way for every allreduce.
//
// A barrier is a round of the HostRounds at the start of the segment
// (peer_wait.h): the last rank to arrive wakes the others, who spin
// briefly, then sleep (ranks may outnumber cores), calling the wait hook
// every millisecond or so: a non-OK status from it ends the wait, so the
// engine's peer monitor ends a collective whose peer died.

#ifndef MPISTRATEGY_CC_TRANSPORT_SHM_PLANE_H_
#define MPISTRATEGY_CC_TRANSPORT_SHM_PLANE_H_

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cc/transport/data_plane.h"
#include "cc/transport/handoff_tuner.h"
#include "cc/transport/host_rendezvous.h"
#include "cc/transport/peer_wait.h"

namespace mpistrategy {

// The smallest segment ShmPlane::Create accepts per rank of the host.
constexpr int64_t kShmMinBytesPerRank = 64 << 10;

// The most bytes one rank moves through its slot in one round.  The peers
// read a round's slots right after its barrier: rounds this small are still
// in the caches then, where rounds of a few MiB had gone to memory and back
// (bench/RESULTS.md section 16: a 64 MiB allreduce on 2 ranks up to a third
// faster than in the default segment's 4 MiB slots).  Smaller rounds were
// no faster on 2 ranks and slower on 3 ranks sharing 2 cores, where each
// extra barrier may wait for a rank the scheduler has put aside.
constexpr int64_t kShmMaxRoundBytes = 1 << 20;

// A segment's set-up lasts at most until the host's slowest rank starts its
// engine; an abandoned one is removed only when older than this, so that a
// creator that only looks dead (another PID namespace sharing /dev/shm)
// keeps its segment through its set-up.
constexpr int kShmAbandonedAfterSeconds = 600;

// Unlinks the ShmPlane segments in `dir` (/dev/shm in production) that this
// user's ranks left behind when killed inside ShmPlane::Create: those whose
// creating process no longer exists and that are older than
// `min_age_seconds`.  Best effort: what cannot be removed is left.
//
// Returns:
//   The removed segments' paths, for the log.
std::vector<std::string> RemoveAbandonedShmSegments(
    const std::string& dir = "/dev/shm",
    int min_age_seconds = kShmAbandonedAfterSeconds);

class ShmPlane : public DataPlane {
 public:
  // Collective over `comm`, whose ranks must share this host's memory (e.g.
  // from MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)); the plane's ranks are
  // `comm`'s.  `comm` is only used here, not kept.
  //
  // Args:
  //   segment_bytes: the segment's size (the host's shared memory in use);
  //     at least kShmMinBytesPerRank per rank of `comm`.
  //   fallback: runs Alltoallv; its ranks are `comm`'s.  Not owned;
  //     outlives the plane.
  //   out: the plane, or null when shared memory cannot be used on this
  //     host (then *why_not says why, e.g. /dev/shm is too small); the same
  //     on every rank of `comm`.
  // Returns an error only when MPI fails.
  static Status Create(MPI_Comm comm, int64_t segment_bytes,
                       DataPlane* fallback, std::unique_ptr<ShmPlane>* out,
                       std::string* why_not);

  ~ShmPlane() override;

  // Called while a barrier waits (see above).  Set before the first
  // collective.
  void SetWaitHook(std::function<Status()> hook) {
    wait_hook_ = std::move(hook);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "shared memory"; }
  // The negotiation's AND through this plane's segment (host_rendezvous.h),
  // for jobs whose ranks are all this plane's.  Keeps the segment mapped
  // while it lives.
  std::unique_ptr<HostRendezvous> CreateRendezvous() const;

  // Bytes one rank moves per round (tests use it to cross round borders).
  int64_t round_bytes() const { return round_bytes_; }

  // Tests: restarts the hand-off tuning with `settings` (on every rank,
  // between collectives; every rank starts with settings.initial).
  void SetHandoffTuning(const HandoffTunerSettings& settings);
  // How the last large allreduce wrote its slot (tests).
  Handoff last_handoff() const { return last_handoff_; }
  // HandoffName(last_handoff()) when the last allreduce was a large one,
  // else null (small ones write their slots with ordinary stores).
  const char* last_allreduce_handoff() const override {
    return last_was_large_ ? HandoffName(last_handoff_) : nullptr;
  }

  // Every method needs a host-synchronous stream (Internal error otherwise).
  // kMean on a non-floating dtype is InvalidArgument on every rank, before
  // any rank waits.
  Status Allreduce(const void* in, void* out, int64_t count, DataType dtype,
                   ReduceOp op, Stream* stream) override;
  // Copies the parts straight into and out of the segment.
  bool reduces_parts() const override { return true; }
  Status AllreduceParts(const std::vector<AllreducePart>& parts,
                        DataType dtype, ReduceOp op, Stream* stream) override;
  Status Allgatherv(const void* in, void* out,
                    const std::vector<int64_t>& bytes_per_rank,
                    Stream* stream) override;
  Status Broadcast(void* buffer, int64_t bytes, int root_rank,
                   Stream* stream) override;
  Status Reducescatter(const void* in, void* out,
                       const std::vector<int64_t>& counts, DataType dtype,
                       ReduceOp op, Stream* stream) override;
  Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes,
                   void* out, const std::vector<int64_t>& recv_bytes,
                   Stream* stream) override;

 private:
  ShmPlane(int rank, int size, void* base, int64_t mapped_bytes,
           int64_t header_bytes, int64_t slot_bytes, DataPlane* fallback);

  // This round's slot of `rank`, in the current set.
  char* Slot(int rank) const;
  // Arrives at the next barrier and waits for every rank to arrive.
  Status Barrier();
  // Ends a round: the next one uses the other set.
  void NextSet() { set_ ^= 1; }
  // Allreduce and AllreduceParts: the parts laid end to end.
  Status RunAllreduce(const AllreducePart* parts, int num_parts,
                      DataType dtype, ReduceOp op);
  // RunAllreduce above kSmallAllreduceBytes: reduce-scatter and allgather
  // through the slots, in rounds.  `count` elements in all.
  Status RunLargeAllreduce(const AllreducePart* parts, int64_t count,
                           DataType dtype, ReduceOp op);
  // Copies elements [begin, begin + n) of the parts laid end to end: out of
  // their inputs to `to` (CopyIn; with non-temporal stores when
  // `streaming`, see streaming_copy.h), or from `from` to their outputs
  // (CopyOut).
  // starts_ holds the parts' first elements.
  void CopyIn(const AllreducePart* parts, int64_t begin, int64_t n,
              int64_t esize, char* to, bool streaming) const;
  void CopyOut(const AllreducePart* parts, int64_t begin, int64_t n,
               int64_t esize, const char* from) const;
  // dst[0, count) = srcs[0] op srcs[1] op ... (size_ sources, rank order),
  // divided by size_ for kMean, and the same into also_to unless null; dst
  // and also_to may each be one of the sources.  `streaming`: dst gets
  // non-temporal stores (also_to never does).
  void ReduceSlots(const char* const* srcs, char* dst, int64_t count,
                   DataType dtype, ReduceOp op, bool streaming = false,
                   char* also_to = nullptr);

  const int rank_;
  const int size_;
  // Unmapped when the plane and every rendezvous on it are gone.
  const std::shared_ptr<void> mapping_;
  void* const base_;
  HostRounds barriers_;  // at the start of the segment
  const int64_t header_bytes_;
  const int64_t slot_bytes_;
  const int64_t round_bytes_;  // min(slot_bytes_, kShmMaxRoundBytes)
  DataPlane* const fallback_;
  std::function<Status()> wait_hook_;
  int set_ = 0;
  // The segment's word in which rank 0 publishes the ways (above): bit 0
  // the next timed allreduce's, bit 1 the untimed ones'.
  uint32_t* const handoff_word_;
  // Allreduces of at least timed_bytes_ are timed; the ways as rank 0 last
  // published them; the way of this rank's last large allreduce.
  int64_t timed_bytes_ = 0;
  Handoff next_timed_way_ = Handoff::kStreaming;
  Handoff untimed_way_ = Handoff::kStreaming;
  Handoff last_handoff_ = Handoff::kStreaming;
  bool last_was_large_ = false;
  // Rank 0 only: picks the ways from the time of its last timed allreduce
  // (reported when the next timed one starts).
  std::unique_ptr<HandoffTuner> tuner_;
  Handoff last_timed_way_ = Handoff::kStreaming;
  int64_t last_bytes_ = 0;
  double last_seconds_ = 0.0;
  // Reused per call.
  std::vector<const char*> srcs_;
  std::vector<int64_t> starts_;
  std::vector<char> block_;
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_TRANSPORT_SHM_PLANE_H_
