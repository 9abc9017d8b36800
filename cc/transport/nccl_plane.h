// The data plane of one GPU: NCCL on the op's CUDA stream, or MPI through
// host staging, or hierarchical (NCCL inside a host, MPI across hosts).
//
// CreateNcclPlane runs on the engine thread, on every rank at the same
// collective (the device's first bucket):
//
//   1. Every rank reports (hostname, PCI bus id, NCCL version) through the
//      engine's control plane; rank 0 decides for all ranks:
//      * NCCL when every rank has NCCL >= 2.12 and no two ranks share a GPU
//        (NCCL refuses several ranks per GPU);
//      * otherwise a StagingPlane over the engine's MPI transport.  Rank 0
//        logs the reason once.
//   2. NCCL: rank 0's ncclUniqueId goes out with the decision (same
//      broadcast), then ncclCommInitRank over all ranks.
//   3. hierarchical_allreduce (NCCL only, an MpiTransport, the same number
//      of ranks on every host): an NCCL communicator among the ranks of a
//      host (MPI_Comm_split_type) and an MPI communicator among the ranks
//      with the same local rank (MPI_Comm_split), put together by a
//      HierarchicalPlane (hierarchical_plane.h).
//
// NCCL work is enqueued on the stream and never waited for on the host.  A
// watchdog thread polls ncclCommGetAsyncError; on an error it records it in
// the plane's async_status (Unavailable, sticky: the op whose work was on
// the stream and every later collective of the device fail with it) and
// aborts the device's communicators so that work stuck on the stream
// finishes.  The engine thread holds the watchdog's mutex while it enqueues
// NCCL work, never while it waits for a stream.

#ifndef MPISTRATEGY_CC_TRANSPORT_NCCL_PLANE_H_
#define MPISTRATEGY_CC_TRANSPORT_NCCL_PLANE_H_

#include <cstdint>
#include <memory>

#include "cc/common/common.h"
#include "cc/transport/data_plane.h"
#include "cc/transport/transport.h"

namespace mpistrategy {

// Creates the data plane of one GPU.
//
// Args:
//   control: the engine's transport (an MpiTransport for the hierarchical
//     split); used on the engine thread for the set-up exchange and host
//     staging.  Not owned; must outlive the result.
//   hierarchical_allreduce: EngineConfig::hierarchical_allreduce.
//   device: the framework's GPU id (for messages).
//   ordinal: the CUDA device.
//   plane: receives the new plane.
Status CreateNcclPlane(Transport* control, bool hierarchical_allreduce,
                       int32_t device, int ordinal,
                       std::unique_ptr<DataPlane>* plane);

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_TRANSPORT_NCCL_PLANE_H_
