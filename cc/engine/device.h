// The engine's CUDA-free view of GPU tensors.
//
// A GPU kernel (cc/kernels/*_gpu.cc) puts a DeviceContext into the
// TensorEntry it enqueues: the op's CUDA stream (as an opaque pointer), the
// CUDA device, device memory from the framework's allocator, and a factory
// for the DeviceTransport that runs GPU collectives (NCCL, or MPI through
// host staging: cc/transport/nccl_transport.h).  The engine never includes
// a CUDA header: the executor hands GPU buckets to the DeviceTransport, which
// the first GPU bucket creates through its entry's DeviceContext.  Every rank
// runs the same buckets in the same order, so every rank creates it at the
// same point of the collective sequence, on the engine thread.

#ifndef MPISTRATEGY_CC_ENGINE_DEVICE_H_
#define MPISTRATEGY_CC_ENGINE_DEVICE_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "cc/common/common.h"
#include "cc/engine/engine.h"
#include "cc/engine/message.h"
#include "cc/transport/transport.h"

namespace mpistrategy {

// The status of asynchronous device work (e.g. one NCCL communicator): OK
// until the first failure, which then sticks.  Thread-safe.
class AsyncStatus {
 public:
  Status Get() const {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }
  // Keeps the first error; OK is ignored.
  void Fail(const Status& status) {
    if (status.ok()) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (status_.ok()) status_ = status;
  }

 private:
  mutable std::mutex mu_;
  Status status_;
};

// Runs the collectives of GPU tensors.  Owned by the engine's executor and
// called from the engine thread only.
class DeviceTransport {
 public:
  virtual ~DeviceTransport() = default;

  // Same contract as Executor::Execute (executor.h) for a bucket whose
  // responses have device != kCpuDevice and type != kBarrier: `entries[k]`
  // (each with a device_context) is this rank's entry for responses[k].
  // The collective is enqueued on the entries' streams; before returning,
  // the transport sets each entry's DeviceContext::async_status to what the
  // enqueued work will report.  A returned error is fatal for the engine.
  virtual Status Execute(const std::vector<const Response*>& responses,
                         const std::vector<TensorEntry*>& entries,
                         std::vector<Status>* entry_status) = 0;
};

// What a GPU entry tells the engine about its device.  Implemented by the GPU
// kernels; shared by the entry and the kernel's completion callback.
class DeviceContext {
 public:
  virtual ~DeviceContext() = default;

  // The CUDA device ordinal (for cudaSetDevice).  It can differ from
  // TensorEntry::device, the framework's GPU id, when only some GPUs are
  // visible to the framework.
  virtual int ordinal() const = 0;
  // The op's cudaStream_t.  Work for the entry is enqueued here, after
  // everything the framework enqueued before the op.
  virtual void* stream() const = 0;

  // `bytes` (> 0) of device memory on ordinal() from the framework's
  // allocator; freed (stream-ordered, like any framework buffer) when the
  // last reference goes.  Thread-safe.
  virtual Status Allocate(int64_t bytes,
                          std::shared_ptr<void>* buffer) const = 0;

  // Creates the engine's DeviceTransport.  Called on the engine thread, by
  // every rank at the same point (the first GPU bucket).
  //
  // Args:
  //   control: the engine's MPI transport (negotiation, the NCCL unique id,
  //     host staging).  Not owned; outlives the DeviceTransport.
  //   hierarchical_allreduce: EngineConfig::hierarchical_allreduce.
  virtual Status CreateTransport(
      Transport* control, bool hierarchical_allreduce,
      std::unique_ptr<DeviceTransport>* transport) const = 0;

  // Set by the DeviceTransport (engine thread) before the entry's `done`;
  // read by the completion callback once the stream has run the work.  Null
  // means the work cannot fail asynchronously.
  void set_async_status(std::shared_ptr<const AsyncStatus> status) {
    async_status_ = std::move(status);
  }
  const std::shared_ptr<const AsyncStatus>& async_status() const {
    return async_status_;
  }

 private:
  std::shared_ptr<const AsyncStatus> async_status_;
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_ENGINE_DEVICE_H_
