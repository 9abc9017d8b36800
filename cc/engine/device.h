// The engine's CUDA-free view of GPU tensors.
//
// A GPU kernel (cc/kernels) puts a DeviceContext into the TensorEntry it
// enqueues: the op's stream (cc/common/stream.h: copies, device memory,
// events) and the factory of the data plane that runs the device's
// collectives (cc/transport/data_plane.h: NCCL, host staging or
// hierarchical).  The engine never includes a CUDA header: the executor
// computes layouts and fusion as for the CPU and calls the device's plane,
// which the first bucket of the device creates through its entry's
// DeviceContext.  Every rank runs the same buckets in the same order, so
// every rank creates it at the same point of the collective sequence, on
// the engine thread.  Tests use a fake device (cc/device/fake_device.h).

#ifndef MPISTRATEGY_CC_ENGINE_DEVICE_H_
#define MPISTRATEGY_CC_ENGINE_DEVICE_H_

#include <cstdint>
#include <memory>
#include <utility>

#include "cc/common/common.h"
#include "cc/common/stream.h"
#include "cc/transport/data_plane.h"
#include "cc/transport/transport.h"

namespace mpistrategy {

// What a GPU entry tells the engine about its device.  Implemented by the GPU
// kernels; shared by the entry and the kernel's completion callback.
class DeviceContext {
 public:
  virtual ~DeviceContext() = default;

  // The device ordinal (for cudaSetDevice).  It can differ from
  // TensorEntry::device, the framework's GPU id, when only some GPUs are
  // visible to the framework.
  virtual int ordinal() const = 0;
  // The op's stream.  Work for the entry is enqueued there, after
  // everything the framework enqueued before the op.  Never null.
  virtual const std::shared_ptr<Stream>& stream() const = 0;

  // Creates the data plane of the entry's device.  Called on the engine
  // thread, by every rank at the same point (the device's first bucket),
  // with the op's device current.
  //
  // Args:
  //   control: the engine's transport (negotiation, set-up exchanges, host
  //     staging).  Not owned; outlives the plane.
  //   hierarchical_allreduce: EngineConfig::hierarchical_allreduce.
  //   device: TensorEntry::device (for messages).
  virtual Status CreatePlane(Transport* control, bool hierarchical_allreduce,
                             int32_t device,
                             std::unique_ptr<DataPlane>* plane) const = 0;

  // Set by the executor (engine thread) before the entry's `done`; read by
  // the completion callback once the stream has run the work.  Null means
  // the work cannot fail asynchronously.
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
