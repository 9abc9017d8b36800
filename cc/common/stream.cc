#include "cc/common/stream.h"

#include <cstring>
#include <new>

namespace mpistrategy {

Status HostStream::Memcpy(void* dst, const void* src, int64_t bytes,
                          CopyKind /*kind*/) {
  if (bytes > 0 && dst != src) std::memcpy(dst, src, static_cast<size_t>(bytes));
  return Status::Ok();
}

Status HostStream::Allocate(int64_t bytes, std::shared_ptr<void>* buffer) {
  char* data = new (std::nothrow) char[static_cast<size_t>(bytes)];
  if (data == nullptr) {
    return Status::Internal("out of host memory: could not allocate " +
                                     std::to_string(bytes) + " bytes");
  }
  *buffer = std::shared_ptr<void>(data, [](void* p) {
    delete[] static_cast<char*>(p);
  });
  return Status::Ok();
}

Status HostStream::NewEvent(std::unique_ptr<Event>* event) {
  event->reset(new Event());
  return Status::Ok();
}

}  // namespace mpistrategy
