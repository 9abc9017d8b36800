#include "cc/device/cuda_stream.h"

#if GOOGLE_CUDA

#include <cuda_runtime_api.h>

#include "cc/common/checks.h"

namespace mpistrategy {
namespace {

class CudaEvent : public Event {
 public:
  explicit CudaEvent(cudaEvent_t event) : event_(event) {}
  ~CudaEvent() override { cudaEventDestroy(event_); }
  Status Synchronize() override {
    MPISTRATEGY_CUDA_CHECK(cudaEventSynchronize(event_));
    return Status::Ok();
  }
  cudaEvent_t event() const { return event_; }

 private:
  const cudaEvent_t event_;
};

cudaMemcpyKind CudaKind(CopyKind kind) {
  switch (kind) {
    case CopyKind::kDeviceToHost: return cudaMemcpyDeviceToHost;
    case CopyKind::kHostToDevice: return cudaMemcpyHostToDevice;
    case CopyKind::kDeviceToDevice: return cudaMemcpyDeviceToDevice;
  }
  return cudaMemcpyDefault;
}

Status EventOf(Event* event, cudaEvent_t* out) {
  auto* e = dynamic_cast<CudaEvent*>(event);
  if (e == nullptr) return Status::Internal("not an event of a CudaStream");
  *out = e->event();
  return Status::Ok();
}

}  // namespace

Status CudaStream::Memcpy(void* dst, const void* src, int64_t bytes,
                          CopyKind kind) {
  if (bytes == 0 || dst == src) return Status::Ok();
  MPISTRATEGY_CUDA_CHECK(cudaSetDevice(ordinal_));
  MPISTRATEGY_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes),
                                         CudaKind(kind),
                                         static_cast<cudaStream_t>(stream_)));
  return Status::Ok();
}

Status CudaStream::Synchronize() {
  MPISTRATEGY_CUDA_CHECK(
      cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
  return Status::Ok();
}

Status CudaStream::Allocate(int64_t bytes, std::shared_ptr<void>* buffer) {
  MPISTRATEGY_CUDA_CHECK(cudaSetDevice(ordinal_));
  void* data = nullptr;
  const cudaError_t e = cudaMalloc(&data, static_cast<size_t>(bytes));
  if (e != cudaSuccess) {
    return Status::Internal("out of GPU memory: cudaMalloc of " +
                            std::to_string(bytes) + " bytes failed: " +
                            cudaGetErrorString(e));
  }
  *buffer = std::shared_ptr<void>(data, [](void* p) { cudaFree(p); });
  return Status::Ok();
}

Status CudaStream::NewEvent(std::unique_ptr<Event>* event) {
  MPISTRATEGY_CUDA_CHECK(cudaSetDevice(ordinal_));
  cudaEvent_t e = nullptr;
  MPISTRATEGY_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  event->reset(new CudaEvent(e));
  return Status::Ok();
}

Status CudaStream::Record(Event* event) {
  cudaEvent_t e = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(EventOf(event, &e));
  MPISTRATEGY_CUDA_CHECK(cudaEventRecord(e, static_cast<cudaStream_t>(stream_)));
  return Status::Ok();
}

Status CudaStream::Wait(Event* event) {
  cudaEvent_t e = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(EventOf(event, &e));
  MPISTRATEGY_CUDA_CHECK(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream_), e, 0));
  return Status::Ok();
}

}  // namespace mpistrategy

#endif  // GOOGLE_CUDA
