// Where a collective's work runs: an in-order stream of work on one device,
// with that device's memory and events.
//
// The data planes (cc/transport/data_plane.h) and the executor enqueue all
// their copies and collectives on a Stream, so that the same code drives
// the CPU (HostStream: every call completes before it returns), a CUDA
// stream (cc/device/cuda_stream.h) and, in tests, a fake device whose
// stream runs its work later on a thread of its own (cc/device/
// fake_device.h).  Nothing here includes a CUDA header.

#ifndef MPISTRATEGY_CC_COMMON_STREAM_H_
#define MPISTRATEGY_CC_COMMON_STREAM_H_

#include <cstdint>
#include <memory>
#include <mutex>

#include "cc/common/common.h"

namespace mpistrategy {

// A marker in a stream's work (cudaEvent_t).  Created by Stream::NewEvent.
class Event {
 public:
  virtual ~Event() = default;
  // Waits on the host until the work before the last Record has run (at
  // once when never recorded).
  virtual Status Synchronize() { return Status::Ok(); }
};

enum class CopyKind : uint8_t {
  kDeviceToHost,
  kHostToDevice,
  kDeviceToDevice,
};

class Stream {
 public:
  virtual ~Stream() = default;

  // True when every call has finished its work before it returns and the
  // device's memory is host memory (the CPU).  Planes that work on host
  // memory (HostPlane) accept only such streams.
  virtual bool host_synchronous() const = 0;
  // Equal for two Stream objects that wrap the same underlying stream (two
  // ops on one CUDA stream); work on them needs no join.
  virtual const void* id() const = 0;
  // The platform's handle (cudaStream_t); null for the host.
  virtual void* native_handle() const = 0;

  // Enqueues a copy of `bytes` (>= 0) from `src` to `dst`.  A copy from host
  // memory may read it until the copy has run: keep the host memory intact
  // until Synchronize.
  virtual Status Memcpy(void* dst, const void* src, int64_t bytes,
                        CopyKind kind) = 0;
  // Waits on the host until all work enqueued so far has run.
  virtual Status Synchronize() = 0;

  // `bytes` (> 0) of this stream's device memory, freed when the last
  // reference goes (stream-ordered for a device: like any framework buffer,
  // it may be reused by work enqueued after ours).
  virtual Status Allocate(int64_t bytes, std::shared_ptr<void>* buffer) = 0;

  // Events order work between streams: Record(e) on one stream, then Wait(e)
  // on another makes the other's later work wait for everything the first
  // had enqueued before Record.  Wait captures the event's state when it is
  // called, so an event can be recorded again at once.
  virtual Status NewEvent(std::unique_ptr<Event>* event) = 0;
  virtual Status Record(Event* event) = 0;
  virtual Status Wait(Event* event) = 0;
};

// The CPU: memcpy, operator new; work runs in the calling thread.
class HostStream : public Stream {
 public:
  bool host_synchronous() const override { return true; }
  const void* id() const override { return this; }
  void* native_handle() const override { return nullptr; }
  Status Memcpy(void* dst, const void* src, int64_t bytes,
                CopyKind kind) override;
  Status Synchronize() override { return Status::Ok(); }
  Status Allocate(int64_t bytes, std::shared_ptr<void>* buffer) override;
  Status NewEvent(std::unique_ptr<Event>* event) override;
  Status Record(Event* /*event*/) override { return Status::Ok(); }
  Status Wait(Event* /*event*/) override { return Status::Ok(); }
};

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

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_COMMON_STREAM_H_
