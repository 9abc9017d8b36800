// A Stream (cc/common/stream.h) on a CUDA stream: cudaMemcpyAsync,
// cudaStreamSynchronize, cudaEvent_t; memory from cudaMalloc unless a
// subclass supplies the framework's allocator (the TF kernels do).
// Host C++ only, compiled with -DGOOGLE_CUDA=1.

#ifndef MPISTRATEGY_CC_DEVICE_CUDA_STREAM_H_
#define MPISTRATEGY_CC_DEVICE_CUDA_STREAM_H_

#include <cstdint>
#include <memory>

#include "cc/common/common.h"
#include "cc/common/stream.h"

namespace mpistrategy {

class CudaStream : public Stream {
 public:
  // Args:
  //   ordinal: the CUDA device; made current before each call.
  //   stream: the cudaStream_t; not owned.
  CudaStream(int ordinal, void* stream) : ordinal_(ordinal), stream_(stream) {}

  bool host_synchronous() const override { return false; }
  const void* id() const override { return stream_; }
  void* native_handle() const override { return stream_; }
  int ordinal() const { return ordinal_; }

  Status Memcpy(void* dst, const void* src, int64_t bytes,
                CopyKind kind) override;
  Status Synchronize() override;
  // cudaMalloc / cudaFree (cudaFree waits for the device).
  Status Allocate(int64_t bytes, std::shared_ptr<void>* buffer) override;
  Status NewEvent(std::unique_ptr<Event>* event) override;
  Status Record(Event* event) override;
  Status Wait(Event* event) override;

 private:
  const int ordinal_;
  void* const stream_;
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_DEVICE_CUDA_STREAM_H_
