// The engine's view of a communicator.
//
// Two planes share one interface:
//   * control plane (negotiation): BitwiseAnd, GatherBytes, BroadcastBytes;
//   * data plane (payload): Allreduce, Allgatherv, Broadcast, Reducescatter,
//     Alltoallv, Barrier.
// Every method is a collective: all ranks call it in the same order.  The
// engine calls a transport from its background thread only, so
// implementations need no locking.  Implementations: MpiTransport
// (mpi_transport.h) and, in tests, FakeTransport (fake_transport.h).

#ifndef MPISTRATEGY_CC_TRANSPORT_TRANSPORT_H_
#define MPISTRATEGY_CC_TRANSPORT_TRANSPORT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "cc/engine/common.h"

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
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_TRANSPORT_TRANSPORT_H_
