#include "cc/device/fake_device.h"

#include <chrono>
#include <cstring>
#include <utility>

namespace mpistrategy {

// The stream's work, shared with the deleters of its buffers.
struct FakeStream::Queue {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> items;
  int64_t enqueued = 0;
  int64_t completed = 0;
  bool stop = false;
  int delay_us = 0;

  // Returns the item's ticket: it has run once completed >= ticket.
  int64_t Push(std::function<void()> work) {
    std::lock_guard<std::mutex> lock(mu);
    items.push_back(std::move(work));
    cv.notify_all();
    return ++enqueued;
  }
  void WaitFor(int64_t ticket) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return completed >= ticket; });
  }
  void Run() {
    for (;;) {
      std::function<void()> work;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || !items.empty(); });
        if (items.empty()) return;
        work = std::move(items.front());
        items.pop_front();
      }
      if (delay_us > 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
      }
      work();
      std::lock_guard<std::mutex> lock(mu);
      ++completed;
      cv.notify_all();
    }
  }
};

namespace {

// A point of one stream's work: (queue, ticket).
class FakeEvent : public Event {
 public:
  Status Synchronize() override {
    if (queue_ != nullptr) queue_->WaitFor(ticket_);
    return Status::Ok();
  }
  std::shared_ptr<FakeStream::Queue> queue_;
  int64_t ticket_ = 0;
};

}  // namespace

FakeStream::FakeStream(int delay_us) : queue_(std::make_shared<Queue>()) {
  queue_->delay_us = delay_us;
  std::shared_ptr<Queue> q = queue_;
  thread_ = std::thread([q] { q->Run(); });
}

FakeStream::~FakeStream() {
  {
    std::lock_guard<std::mutex> lock(queue_->mu);
    queue_->stop = true;
    queue_->cv.notify_all();
  }
  thread_.join();
}

void FakeStream::Enqueue(std::function<void()> work) {
  queue_->Push(std::move(work));
}

int64_t FakeStream::completed() const {
  std::lock_guard<std::mutex> lock(queue_->mu);
  return queue_->completed;
}

Status FakeStream::Memcpy(void* dst, const void* src, int64_t bytes,
                          CopyKind /*kind*/) {
  if (bytes < 0) return Status::Internal("FakeStream::Memcpy: bytes < 0");
  if (bytes == 0) return Status::Ok();
  if (dst == nullptr || src == nullptr) {
    return Status::Internal("FakeStream::Memcpy: null pointer");
  }
  queue_->Push([dst, src, bytes] {
    std::memmove(dst, src, static_cast<size_t>(bytes));
  });
  return Status::Ok();
}

Status FakeStream::Synchronize() {
  int64_t ticket;
  {
    std::lock_guard<std::mutex> lock(queue_->mu);
    ticket = queue_->enqueued;
  }
  queue_->WaitFor(ticket);
  return Status::Ok();
}

Status FakeStream::Allocate(int64_t bytes, std::shared_ptr<void>* buffer) {
  if (bytes <= 0) return Status::Internal("FakeStream::Allocate: bytes <= 0");
  char* data = new char[static_cast<size_t>(bytes)];
  std::memset(data, 0xA5, static_cast<size_t>(bytes));
  std::weak_ptr<Queue> weak = queue_;
  *buffer = std::shared_ptr<void>(data, [weak](void* p) {
    // Stream-ordered free: after the work that may still use the buffer.
    if (std::shared_ptr<Queue> q = weak.lock()) {
      std::lock_guard<std::mutex> lock(q->mu);
      if (!q->stop) {
        q->items.push_back([p] { delete[] static_cast<char*>(p); });
        ++q->enqueued;
        q->cv.notify_all();
        return;
      }
    }
    delete[] static_cast<char*>(p);
  });
  return Status::Ok();
}

Status FakeStream::NewEvent(std::unique_ptr<Event>* event) {
  event->reset(new FakeEvent());
  return Status::Ok();
}

Status FakeStream::Record(Event* event) {
  auto* e = dynamic_cast<FakeEvent*>(event);
  if (e == nullptr) return Status::Internal("not a FakeEvent");
  std::lock_guard<std::mutex> lock(queue_->mu);
  e->queue_ = queue_;
  e->ticket_ = queue_->enqueued;
  return Status::Ok();
}

Status FakeStream::Wait(Event* event) {
  auto* e = dynamic_cast<FakeEvent*>(event);
  if (e == nullptr) return Status::Internal("not a FakeEvent");
  if (e->queue_ == nullptr || e->queue_ == queue_) return Status::Ok();
  // Captured now: a later Record does not change what this waits for.
  std::shared_ptr<Queue> other = e->queue_;
  const int64_t ticket = e->ticket_;
  queue_->Push([other, ticket] { other->WaitFor(ticket); });
  return Status::Ok();
}

}  // namespace mpistrategy
