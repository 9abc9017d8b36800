// The engine's view of a communicator.
//
// Two planes share one interface:
//   * control plane (negotiation): BitwiseAnd, GatherBytes, BroadcastBytes;
//   * data plane (payload): Allreduce, Allgatherv, Broadcast, Reducescatter,
//     Alltoallv, Barrier.
// Every collective method is called by all ranks in the same order.  The
// engine calls them from its background thread only, so implementations
// need no locking for them; the notices (PostNotice/TakeNotice) are the
// exception: the engine's peer monitor calls them from its own thread.  Implementations: MpiTransport
// (mpi_transport.h) and, in tests, FakeTransport (fake_transport.h).

#ifndef MPISTRATEGY_CC_TRANSPORT_TRANSPORT_H_
#define MPISTRATEGY_CC_TRANSPORT_TRANSPORT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cc/common/common.h"
#include "cc/transport/data_plane.h"

namespace mpistrategy {

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Rank and size among the processes on this host.
  virtual int local_rank() const = 0;
  virtual int local_size() const = 0;

  // ---- control plane ----------------------------------------------------
  // In place: bits[i] becomes the AND of bits[i] over all ranks.  All ranks
  // pass vectors of the same length.
  virtual Status BitwiseAnd(std::vector<uint64_t>* bits) = 0;
  // BitwiseAnd in two halves, so that one thread can start it and, when the
  // peers are late, another can finish it.  StartBitwiseAnd begins it on
  // `bits`, which must stay alive and untouched until it is finished;
  // FinishBitwiseAnd waits at most `max_wait_seconds` (< 0: as long as it
  // takes, like BitwiseAnd) and sets `*done` when `bits` holds the result.
  // Where SplitsBitwiseAnd() is false (the default), StartBitwiseAnd runs
  // the whole BitwiseAnd and FinishBitwiseAnd only reports it done.
  virtual bool SplitsBitwiseAnd() const { return false; }
  virtual Status StartBitwiseAnd(std::vector<uint64_t>* bits) {
    return BitwiseAnd(bits);
  }
  virtual Status FinishBitwiseAnd(double max_wait_seconds, bool* done) {
    (void)max_wait_seconds;
    *done = true;
    return Status::Ok();
  }
  // Rank 0 receives every rank's `mine` in rank order in `all`; other ranks
  // get `all` cleared.
  virtual Status GatherBytes(const std::string& mine,
                             std::vector<std::string>* all) = 0;
  // Rank 0's `bytes` replace every other rank's.
  virtual Status BroadcastBytes(std::string* bytes) = 0;

  // ---- data plane -------------------------------------------------------
  // out[i] = reduce over ranks of in[i]; `in == out` means in place.
  virtual Status Allreduce(const void* in, void* out, int64_t count,
                           DataType dtype, ReduceOp op) = 0;
  // Concatenates every rank's bytes in rank order into `out`;
  // bytes_per_rank[r] is rank r's contribution.
  virtual Status Allgatherv(const void* in, void* out,
                            const std::vector<int64_t>& bytes_per_rank) = 0;
  virtual Status Broadcast(void* buffer, int64_t bytes, int root_rank) = 0;
  // Reduces `in` (sum of counts elements) and leaves block r, of
  // counts[r] elements, on rank r in `out`.
  virtual Status Reducescatter(const void* in, void* out,
                               const std::vector<int64_t>& counts,
                               DataType dtype, ReduceOp op) = 0;
  // send_bytes[r] bytes go to rank r (consecutive in `in`); recv_bytes[r]
  // bytes come from rank r (consecutive in `out`).
  virtual Status Alltoallv(const void* in,
                           const std::vector<int64_t>& send_bytes, void* out,
                           const std::vector<int64_t>& recv_bytes) = 0;
  virtual Status Barrier() = 0;

  // ---- the data plane of CPU tensors ------------------------------------
  // Called once by every rank, on the engine thread, after SetWaitHook and
  // before the first collective.  Leaves `*plane` null when `world` (a
  // plane over this transport, outliving the created one) is to carry CPU
  // tensors; else creates a plane for them that needs `world` (e.g. shared
  // memory inside the host, MPI across hosts: shm_plane.h).  `shm_bytes`:
  // EngineConfig::shm_bytes.  An error stops the engine (e.g. kShm where
  // shared memory cannot be used).
  virtual Status CreateHostPlane(HostDataPlane kind, int64_t shm_bytes,
                                 DataPlane* world,
                                 std::unique_ptr<DataPlane>* plane) {
    (void)kind;
    (void)shm_bytes;
    (void)world;
    plane->reset();
    return Status::Ok();
  }

  // ---- identity --------------------------------------------------------
  // This rank's host and process id, for messages (common.h PeerInfo).
  virtual PeerInfo peer_info() const { return LocalPeerInfo(); }

  // ---- liveness (EngineConfig::peer_timeout_seconds) ---------------------
  // The control-plane calls (BitwiseAnd, GatherBytes, BroadcastBytes) and
  // Barrier wait for their peers by polling; while they wait they call the
  // hook every few milliseconds, and a non-OK status from it ends the wait
  // at once with that status.  The call's peers are then out of step for
  // good: the engine stops.  Set before the first collective.
  virtual void SetWaitHook(std::function<Status()> hook) { (void)hook; }

  // A side channel of small messages ("notices") for the peer monitor,
  // independent of the collectives: PostNotice and TakeNotice never wait for
  // a peer, and may be called from one other thread (the monitor's) while
  // the engine's cycle is inside a collective, blocking or not.  False when
  // the transport cannot do that (MPI below MPI_THREAD_MULTIPLE).
  virtual bool SupportsNotices() const { return false; }
  // Queues `bytes` for `to_rank`.  A notice to a rank that has not taken the
  // previous one from us yet may be dropped (heartbeats only say "alive").
  virtual Status PostNotice(int to_rank, const std::string& bytes) {
    (void)to_rank;
    (void)bytes;
    return Status::Unimplemented("this transport has no notices");
  }
  // Takes one notice sent to this rank, if any: *got says whether it did.
  virtual Status TakeNotice(int* from_rank, std::string* bytes, bool* got) {
    (void)from_rank;
    (void)bytes;
    *got = false;
    return Status::Unimplemented("this transport has no notices");
  }
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_TRANSPORT_TRANSPORT_H_
