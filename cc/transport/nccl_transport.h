// GPU collectives: NCCL on the op's CUDA stream, or MPI through host staging.
//
// The DeviceTransport (cc/engine/device.h) the engine uses for GPU tensors.
// Per framework GPU id it keeps one lazily created "device communicator",
// set up on the engine thread by every rank at the same collective:
//
//   1. Every rank reports (hostname, PCI bus id, NCCL version) through the
//      engine's MPI control plane; rank 0 decides for all ranks:
//      * NCCL when every rank has NCCL >= 2.12 and no two ranks share a GPU
//        (NCCL refuses several ranks per GPU);
//      * otherwise MPI with host staging: cudaMemcpyAsync device-to-host on
//        the op's stream, synchronise, MPI on the host, cudaMemcpyAsync
//        host-to-device.  Rank 0 logs the reason once.
//   2. NCCL: rank 0's ncclUniqueId goes out with the decision (same
//      broadcast), then ncclCommInitRank over all ranks.
//   3. hierarchical_allreduce (NCCL only, same number of ranks on every
//      host): an NCCL communicator among the ranks of a host
//      (MPI_Comm_split_type) and an MPI transport among the ranks with the
//      same local rank (MPI_Comm_split).  Allreduce then runs NCCL
//      reduce-scatter inside the host, MPI allreduce of each rank's shard
//      across hosts (host staging of the shard), NCCL allgather inside the
//      host.  The other collectives use the all-ranks NCCL communicator.
//
// NCCL work is enqueued on the op's stream and never waited for on the host;
// fusion packs allreduces into a device buffer from the framework's
// allocator.  A watchdog thread polls ncclCommGetAsyncError; on an error it
// records it (Unavailable, sticky: the op whose work was on the stream and
// every later GPU collective fail with it) and aborts the communicator so
// that work stuck on the stream finishes.
//
// Threading: Execute runs on the engine thread; the watchdog only polls and
// aborts communicators, under a mutex the engine thread holds while it
// enqueues NCCL work (never while it waits for a stream).

#ifndef MPISTRATEGY_CC_TRANSPORT_NCCL_TRANSPORT_H_
#define MPISTRATEGY_CC_TRANSPORT_NCCL_TRANSPORT_H_

#include <memory>

#include "cc/common/common.h"
#include "cc/engine/device.h"
#include "cc/transport/transport.h"

namespace mpistrategy {

// Creates the GPU transport.
//
// Args:
//   control: the engine's transport (an MpiTransport); used, on the engine
//     thread, for the setup exchange and host staging, and (through its
//     communicator) for the hierarchical split.  Not owned; must outlive the
//     result.
//   hierarchical_allreduce: EngineConfig::hierarchical_allreduce.
//   transport: receives the new transport.
Status CreateNcclTransport(Transport* control, bool hierarchical_allreduce,
                           std::unique_ptr<DeviceTransport>* transport);

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_TRANSPORT_NCCL_TRANSPORT_H_
