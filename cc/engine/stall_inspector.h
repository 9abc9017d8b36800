// Stall detection over the coordinator's message table.
//
// A collective is *stalled* when some ranks announced it and others did not.
// After `warning_seconds` the coordinator logs, once per collective, which
// ranks are missing; after `timeout_seconds` (when > 0) the collective fails
// with DeadlineExceeded on the ranks that announced it.  Pure logic: time is
// passed in, so tests drive it with a fake clock.
//
// Thread-compatible; the engine uses it from its thread on rank 0 only.

#ifndef MPISTRATEGY_CC_ENGINE_STALL_INSPECTOR_H_
#define MPISTRATEGY_CC_ENGINE_STALL_INSPECTOR_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "cc/common/common.h"

namespace mpistrategy {

// Monotonic seconds; injectable so tests control time.
using Clock = std::function<double()>;
// std::chrono::steady_clock in seconds.
double SteadyClockSeconds();

// The part of a message-table entry the inspector looks at.
struct PendingCollective {
  std::string name;
  // Clock time when the first rank announced it.
  double first_seen_seconds = 0.0;
  // submitted[r]: rank r announced it.
  std::vector<bool> submitted;
  // Set by the inspector once the warning was logged.
  bool warned = false;
};

struct StallTimeout {
  std::string name;
  // Ranks that announced the collective: the error is for them.
  std::vector<int32_t> submitted_ranks;
  Status status;  // DeadlineExceeded
};

struct StallReport {
  // Lines to log (at most kMaxStallWarningLines plus a summary line).
  std::vector<std::string> warnings;
  std::vector<StallTimeout> timeouts;
};

class StallInspector {
 public:
  static constexpr int kMaxStallWarningLines = 20;

  // Args:
  //   warning_seconds: 0 disables the warning.
  //   timeout_seconds: 0 disables the timeout.
  StallInspector(double warning_seconds, double timeout_seconds)
      : warning_seconds_(warning_seconds), timeout_seconds_(timeout_seconds) {}

  bool enabled() const {
    return warning_seconds_ > 0.0 || timeout_seconds_ > 0.0;
  }

  // Inspects `pending` (entries some ranks are still missing) at time `now`.
  // Marks warned entries.  Entries returned as timeouts must be removed from
  // the table by the caller.  Messages name ranks with their host and pid
  // from `peers` (DescribeRank).
  StallReport Inspect(const std::vector<PendingCollective*>& pending,
                      double now,
                      const std::vector<PeerInfo>& peers = {}) const;

 private:
  double warning_seconds_;
  double timeout_seconds_;
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_ENGINE_STALL_INSPECTOR_H_
