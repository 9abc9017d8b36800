// How a wait for the other ranks of the host passes its time, for the waits
// through shared memory (ShmPlane's barriers, HostRendezvous's AND), and
// the futex calls those waits sleep and wake with.
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

#include <chrono>
#include <climits>
#include <cstdint>
#include <ctime>
#include <functional>

#include "cc/common/common.h"

namespace mpistrategy {

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

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_TRANSPORT_PEER_WAIT_H_
