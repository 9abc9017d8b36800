// How the ranks of one host wait for each other through shared memory
// (ShmPlane's barriers, HostRendezvous's AND): HostRounds, the rounds they
// pass together, and PeerWait, how a wait for a round passes its time.
//
// It spins for 20 us first: in a training loop the others usually arrive
// within microseconds, and a longer spin takes the core from a late peer
// where ranks share cores.  After that the caller gives the core away in
// its own way (yield, sleep, futex), for at most until next_hook(); the
// wait hook runs about every millisecond, and a non-OK status from it (the
// engine's peer deadline) ends the wait.  Per pass, while the others have
// not arrived:
//
//   bool spinning = false;
//   MPISTRATEGY_RETURN_IF_ERROR(wait.Pass(&spinning));
//   if (spinning) continue;
//   ... give the core away until at most wait.next_hook() ...
//
// Give it away by sleeping on a futex that the last rank to arrive wakes,
// not by yielding or polling: a core whose waiter sleeps goes idle, and the
// kernel then moves a runnable thread there, such as a late peer's that
// waits behind TensorFlow's on the other core (ranks may outnumber cores).
//
// Thread-compatible.

#ifndef MPISTRATEGY_CC_TRANSPORT_PEER_WAIT_H_
#define MPISTRATEGY_CC_TRANSPORT_PEER_WAIT_H_

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <ctime>
#include <functional>

#include "cc/common/common.h"

namespace mpistrategy {

// The cache line, the unit of layout in the shared segment: words that
// different ranks write lie on different lines.
constexpr int64_t kCacheLineBytes = 64;

// Sleeps until *word != expected, a wake-up, or `timeout`.  Shared between
// processes (no FUTEX_PRIVATE_FLAG): `word` may lie in a shared segment.
inline void FutexWait(uint32_t* word, uint32_t expected,
                      std::chrono::nanoseconds timeout) {
  if (timeout.count() <= 0) return;
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

// Wakes every process sleeping in FutexWait on `word`.
inline void FutexWakeAll(uint32_t* word) {
  syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

class PeerWait {
 public:
  using Clock = std::chrono::steady_clock;

  // `hook` (may be empty) must outlive the wait.
  explicit PeerWait(const std::function<Status()>& hook) : hook_(hook) {}

  // One pass of the wait; the first one starts its clock.  *spinning: the
  // pass spun, and the caller should check again at once.  Returns the
  // hook's error, if it ran and failed.
  Status Pass(bool* spinning) {
    now_ = Clock::now();
    if (!started_) {
      started_ = true;
      start_ = now_;
      next_hook_ = now_ + kHookEvery;
    }
    *spinning = now_ - start_ < kSpin;
    if (*spinning) {
      for (int i = 0; i < 16; ++i) CpuRelax();
      return Status::Ok();
    }
    if (now_ >= next_hook_) {
      next_hook_ = now_ + kHookEvery;
      if (hook_) return hook_();
    }
    return Status::Ok();
  }

  // The time of the last pass, and how long the wait has lasted then.
  Clock::time_point now() const { return now_; }
  Clock::duration waited() const { return now_ - start_; }
  // When the next pass calls the hook.
  Clock::time_point next_hook() const { return next_hook_; }

 private:
  static constexpr auto kSpin = std::chrono::microseconds(20);
  static constexpr auto kHookEvery = std::chrono::milliseconds(1);

  static void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  const std::function<Status()>& hook_;
  bool started_ = false;
  Clock::time_point start_;
  Clock::time_point now_;
  Clock::time_point next_hook_;
};

// Rounds that every rank of the host passes together, kept in kBytes of
// shared memory: an arrival counter on one cache line and, on the next, a
// futex word with the number of the last completed round (mod 2^32) beside
// a count of the ranks asleep on it.  Round k is complete when the counter
// reaches k * size; its last arrival stores k and wakes the sleepers.  The
// counter's read-modify-writes chain every rank's release, so that store
// publishes what every rank wrote before arriving to every rank that sees
// the round complete.
//
// Thread-compatible: one rank's arrivals and waits come one at a time.
class HostRounds {
 public:
  static constexpr int64_t kBytes = 2 * kCacheLineBytes;

  // `words`: kBytes of the segment, line-aligned, zero before any rank's
  // first arrival.  `size`: the ranks that pass each round.
  HostRounds(char* words, int size)
      : arrivals_(reinterpret_cast<uint64_t*>(words)),
        completed_(reinterpret_cast<uint32_t*>(words + kCacheLineBytes)),
        sleepers_(completed_ + 1),
        size_(size) {}

  // Rounds this rank has arrived at; the last one is the one it may wait
  // for.
  uint64_t arrived() const { return arrived_; }

  // Counts this rank's arrival at its next round.
  void Arrive() {
    const uint64_t k = ++arrived_;
    if (__atomic_add_fetch(arrivals_, 1, __ATOMIC_ACQ_REL) ==
        k * static_cast<uint64_t>(size_)) {
      // Sequentially consistent against a sleeper's count-then-check:
      // either it sees k and does not sleep, or this sees it counted and
      // wakes it.
      __atomic_store_n(completed_, static_cast<uint32_t>(k), __ATOMIC_SEQ_CST);
      if (__atomic_load_n(sleepers_, __ATOMIC_SEQ_CST) != 0) {
        FutexWakeAll(completed_);
      }
    }
  }

  // Waits for the round this rank last arrived at to complete: spins, then
  // sleeps on the futex word, with `hook` called as PeerWait does.  Returns
  // with *complete false at `deadline` (time_point::max(): none), or the
  // hook's error.
  Status Wait(PeerWait::Clock::time_point deadline,
              const std::function<Status()>& hook, bool* complete) {
    // Until then the word holds the previous round's number: no rank can
    // complete a later round before this one has arrived at it.
    const uint32_t round = static_cast<uint32_t>(arrived_);
    PeerWait wait(hook);
    while (!(*complete = __atomic_load_n(completed_, __ATOMIC_ACQUIRE) ==
                         round)) {
      bool spinning = false;
      MPISTRATEGY_RETURN_IF_ERROR(wait.Pass(&spinning));
      if (wait.now() >= deadline) return Status::Ok();  // not yet
      if (spinning) continue;
      __atomic_add_fetch(sleepers_, 1, __ATOMIC_SEQ_CST);
      if (__atomic_load_n(completed_, __ATOMIC_SEQ_CST) != round) {
        FutexWait(completed_, round - 1,
                  std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::min(wait.next_hook(), deadline) - wait.now()));
      }
      __atomic_sub_fetch(sleepers_, 1, __ATOMIC_SEQ_CST);
    }
    return Status::Ok();
  }

 private:
  uint64_t* const arrivals_;
  uint32_t* const completed_;  // the futex word
  uint32_t* const sleepers_;
  const int size_;
  uint64_t arrived_ = 0;
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_TRANSPORT_PEER_WAIT_H_
