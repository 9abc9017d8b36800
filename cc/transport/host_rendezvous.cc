#include "cc/transport/host_rendezvous.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "cc/transport/peer_wait.h"

namespace mpistrategy {

namespace {

constexpr int64_t kLine = 64;

}  // namespace

int64_t HostRendezvous::AreaBytes(int size) {
  return 2 * kLine + 2 * static_cast<int64_t>(size) * kMaxWords * 8;
}

HostRendezvous::HostRendezvous(std::shared_ptr<void> mapping, char* area,
                               int rank, int size)
    : mapping_(std::move(mapping)),
      arrived_(reinterpret_cast<uint64_t*>(area)),
      completed_(reinterpret_cast<uint32_t*>(area + kLine)),
      slots_(reinterpret_cast<uint64_t*>(area + 2 * kLine)),
      rank_(rank),
      size_(size) {}

uint64_t* HostRendezvous::Slot(int set, int rank) const {
  return slots_ + (static_cast<int64_t>(set) * size_ + rank) * kMaxWords;
}

Status HostRendezvous::Start(std::vector<uint64_t>* bits) {
  if (in_flight()) {
    return Status::Internal("HostRendezvous: the previous AND is unfinished");
  }
  if (!Fits(static_cast<int64_t>(bits->size()))) {
    return Status::Internal("HostRendezvous: the bit vector has " +
                            std::to_string(bits->size()) + " words, more than " +
                            std::to_string(kMaxWords));
  }
  const uint64_t k = ++ands_;
  std::copy(bits->begin(), bits->end(), Slot(static_cast<int>(k % 2), rank_));
  completed_before_ = static_cast<uint32_t>(k - 1);
  bits_ = bits;
  // The counter's read-modify-writes chain every rank's release, so the
  // last arrival sees every slot; its store of k publishes them to all.
  const uint64_t arrived =
      __atomic_add_fetch(arrived_, 1, __ATOMIC_ACQ_REL);
  if (arrived == k * static_cast<uint64_t>(size_)) {
    __atomic_store_n(completed_, static_cast<uint32_t>(k), __ATOMIC_RELEASE);
    FutexWakeAll(completed_);
  }
  return Status::Ok();
}

Status HostRendezvous::Finish(double max_wait_seconds, bool* done) {
  *done = false;
  if (!in_flight()) {
    return Status::Internal("HostRendezvous: no AND was started");
  }
  using Clock = PeerWait::Clock;
  // After PeerWait's spin, sleep until the last arrival wakes us, or until
  // the next call of the wait hook.
  const bool bounded = max_wait_seconds >= 0;
  const Clock::time_point deadline =
      bounded ? Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(
                                       max_wait_seconds))
              : Clock::time_point::max();
  PeerWait wait(wait_hook_);
  auto complete = [this] {
    return __atomic_load_n(completed_, __ATOMIC_ACQUIRE) != completed_before_;
  };
  while (!complete()) {
    bool spinning = false;
    MPISTRATEGY_RETURN_IF_ERROR(wait.Pass(&spinning));
    if (bounded && wait.now() >= deadline) return Status::Ok();  // not yet
    if (spinning) continue;
    FutexWait(completed_, completed_before_,
              std::chrono::duration_cast<std::chrono::nanoseconds>(
                  std::min(wait.next_hook(), deadline) - wait.now()));
  }
  const int set = static_cast<int>(ands_ % 2);
  std::vector<uint64_t>& bits = *bits_;
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;  // bits already holds this rank's
    const uint64_t* theirs = Slot(set, q);
    for (size_t i = 0; i < bits.size(); ++i) bits[i] &= theirs[i];
  }
  bits_ = nullptr;
  *done = true;
  return Status::Ok();
}

}  // namespace mpistrategy
