#include "cc/transport/host_rendezvous.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "cc/transport/peer_wait.h"

namespace mpistrategy {

int64_t HostRendezvous::AreaBytes(int size) {
  return HostRounds::kBytes + 2 * static_cast<int64_t>(size) * kMaxWords * 8;
}

HostRendezvous::HostRendezvous(std::shared_ptr<void> mapping, char* area,
                               int rank, int size)
    : mapping_(std::move(mapping)),
      rounds_(area, size),
      slots_(reinterpret_cast<uint64_t*>(area + HostRounds::kBytes)),
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
  const uint64_t k = rounds_.arrived() + 1;
  std::copy(bits->begin(), bits->end(), Slot(static_cast<int>(k % 2), rank_));
  bits_ = bits;
  rounds_.Arrive();
  return Status::Ok();
}

Status HostRendezvous::Finish(double max_wait_seconds, bool* done) {
  *done = false;
  if (!in_flight()) {
    return Status::Internal("HostRendezvous: no AND was started");
  }
  using Clock = PeerWait::Clock;
  const Clock::time_point deadline =
      max_wait_seconds >= 0
          ? Clock::now() + std::chrono::duration_cast<Clock::duration>(
                               std::chrono::duration<double>(max_wait_seconds))
          : Clock::time_point::max();
  bool complete = false;
  MPISTRATEGY_RETURN_IF_ERROR(rounds_.Wait(deadline, wait_hook_, &complete));
  if (!complete) return Status::Ok();  // not yet
  const int set = static_cast<int>(rounds_.arrived() % 2);
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
