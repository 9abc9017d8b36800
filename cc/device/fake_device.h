// A fake device for tests: the GPU code paths (host staging, hierarchical
// allreduce, the executor's device buckets) on CPUs, without CUDA.
//
// Its memory is host memory, and its stream runs the work enqueued on it
// later, in order, on a thread of its own (optionally after a delay per
// item), like a CUDA stream: a caller that reads a result before
// synchronising, reuses a host buffer a pending copy still reads, or
// forgets to join two streams, sees wrong data in the tests instead of
// only on a GPU.  Events record a point of a stream's work; Wait makes
// another stream's later work wait for it.

#ifndef MPISTRATEGY_CC_DEVICE_FAKE_DEVICE_H_
#define MPISTRATEGY_CC_DEVICE_FAKE_DEVICE_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "cc/common/common.h"
#include "cc/common/stream.h"

namespace mpistrategy {

class FakeStream : public Stream {
 public:
  // `delay_us`: how long the stream's thread sleeps before each item, so
  // that the host races ahead of the stream.
  explicit FakeStream(int delay_us = 0);
  // Runs the work still queued, then stops the thread.
  ~FakeStream() override;

  bool host_synchronous() const override { return false; }
  const void* id() const override { return this; }
  void* native_handle() const override { return nullptr; }

  Status Memcpy(void* dst, const void* src, int64_t bytes,
                CopyKind kind) override;
  Status Synchronize() override;
  // Host memory, poisoned with 0xA5; freed on the stream after the work
  // enqueued before the last reference went.
  Status Allocate(int64_t bytes, std::shared_ptr<void>* buffer) override;
  Status NewEvent(std::unique_ptr<Event>* event) override;
  Status Record(Event* event) override;
  Status Wait(Event* event) override;

  // Enqueues `work` (tests: a kernel that writes an input).
  void Enqueue(std::function<void()> work);
  // Items the stream's thread has run.
  int64_t completed() const;

  struct Queue;  // the work; internal (fake_device.cc)

 private:
  std::shared_ptr<Queue> queue_;
  std::thread thread_;
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_DEVICE_FAKE_DEVICE_H_
