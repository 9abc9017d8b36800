#include "cc/engine/stall_inspector.h"

#include <chrono>

namespace mpistrategy {

double SteadyClockSeconds() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

StallReport StallInspector::Inspect(
    const std::vector<PendingCollective*>& pending, double now,
    const std::vector<PeerInfo>& peers) const {
  StallReport report;
  int suppressed = 0;
  for (PendingCollective* p : pending) {
    const double waited = now - p->first_seen_seconds;
    std::vector<int> have;
    std::vector<int> missing;
    for (size_t r = 0; r < p->submitted.size(); ++r) {
      (p->submitted[r] ? have : missing).push_back(static_cast<int>(r));
    }
    if (missing.empty()) continue;
    if (timeout_seconds_ > 0.0 && waited >= timeout_seconds_) {
      StallTimeout t;
      t.name = p->name;
      t.submitted_ranks.assign(have.begin(), have.end());
      t.status = Status::DeadlineExceeded(
          "Collective \"" + p->name + "\" timed out after " +
          FormatSeconds(timeout_seconds_) + " s waiting for " +
          DescribeRanks(missing, peers) + "; " + DescribeRanks(have, peers) +
          " submitted it. Every rank must run the same collectives with the "
          "same names (stall_timeout_seconds = " +
          FormatSeconds(timeout_seconds_) + ").");
      report.timeouts.push_back(std::move(t));
      continue;
    }
    if (warning_seconds_ > 0.0 && waited >= warning_seconds_ && !p->warned) {
      p->warned = true;
      if (static_cast<int>(report.warnings.size()) >= kMaxStallWarningLines) {
        ++suppressed;
        continue;
      }
      report.warnings.push_back("Stalled: collective \"" + p->name +
                                "\" was submitted by " +
                                DescribeRanks(have, peers) + " but not by " +
                                DescribeRanks(missing, peers) + " for " +
                                FormatSeconds(waited) + " s");
    }
  }
  if (suppressed > 0) {
    report.warnings.push_back("... and " + std::to_string(suppressed) +
                              " more stalled collectives");
  }
  return report;
}

}  // namespace mpistrategy
