// PeerMonitor's logic with a fake clock: heartbeats, warnings, the
// deadline, rank 0's abort notices and the pause of this process itself.

#include "cc/engine/peer_monitor.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace mpistrategy {
namespace {

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

std::vector<PeerInfo> Peers(int n) {
  std::vector<PeerInfo> peers(n);
  for (int r = 0; r < n; ++r) {
    peers[r].host = "h" + std::to_string(r);
    peers[r].pid = 10 + r;
  }
  return peers;
}

// Ticks `m` every 0.1 s from `from` to `to` (exclusive), delivering a
// heartbeat from each rank in `alive` before every tick; collects the
// warnings and returns the first tick's actions that timed out (if any).
struct DriveResult {
  std::vector<std::string> warnings;
  bool timed_out = false;
  double timed_out_at = 0.0;
  PeerMonitor::Actions fired;
};

DriveResult Drive(PeerMonitor* m, double from, double to,
          const std::vector<int>& alive, const std::string& notice = "H") {
  DriveResult run;
  // t from an integer count, so that 10 s of ticks lands on 10.0 exactly.
  for (int k = 0;; ++k) {
    const double t = from + k * 0.1;
    if (t >= to - 1e-9) break;
    for (int r : alive) m->OnNotice(r, notice, t);
    PeerMonitor::Actions a = m->Tick(t);
    for (std::string& w : a.warnings) run.warnings.push_back(std::move(w));
    if (a.timed_out && !run.timed_out) {
      run.timed_out = true;
      run.timed_out_at = t;
      run.fired = a;
    }
  }
  return run;
}

bool AnyContains(const std::vector<std::string>& lines,
                 const std::string& part) {
  for (const std::string& l : lines) {
    if (Contains(l, part)) return true;
  }
  return false;
}

TEST(PeerMonitor, HeartbeatPeriod) {
  EXPECT_EQ(PeerMonitor::HeartbeatSeconds(10.0), 0.25);
  EXPECT_EQ(PeerMonitor::HeartbeatSeconds(120.0), 0.25);
  EXPECT_EQ(PeerMonitor::HeartbeatSeconds(2.0), 0.05);
  EXPECT_EQ(PeerMonitor::HeartbeatSeconds(0.01), 0.005);
}

TEST(PeerMonitor, SendsHeartbeatsInAStar) {
  PeerMonitor coordinator(0, 3, Peers(3), 10.0, 0.0, 0.0);
  PeerMonitor::Actions a = coordinator.Tick(0.0);
  ASSERT_EQ(a.sends.size(), 2u);
  EXPECT_EQ(a.sends[0].first, 1);
  EXPECT_EQ(a.sends[1].first, 2);
  EXPECT_EQ(a.sends[0].second, "H");
  // Not again before the period.
  EXPECT_TRUE(coordinator.Tick(0.1).sends.empty());
  EXPECT_EQ(coordinator.Tick(0.25).sends.size(), 2u);

  PeerMonitor worker(2, 3, Peers(3), 10.0, 0.0, 0.0);
  a = worker.Tick(0.0);
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].first, 0);
}

TEST(PeerMonitor, MissingRankWarnedThenTimedOutAndNamed) {
  PeerMonitor m(0, 3, Peers(3), 10.0, 4.0, 0.0);
  DriveResult run = Drive(&m, 0.0, 12.0, {1});  // rank 2 never heard from
  ASSERT_TRUE(run.timed_out);
  EXPECT_NEAR(run.timed_out_at, 10.0, 0.11);
  // The warning (once) after 4 s names rank 2 with host and pid.
  ASSERT_EQ(run.warnings.size(), 1u);
  EXPECT_TRUE(Contains(run.warnings[0], "no message from rank 2 (host h2, "
                                        "pid 12) for 4.0 s"))
      << run.warnings[0];
  EXPECT_TRUE(Contains(run.warnings[0], "peer_timeout_seconds = 10"))
      << run.warnings[0];
  const std::string& msg = run.fired.message;
  EXPECT_TRUE(Contains(msg, "peer timeout: no message from rank 2 (host h2, "
                            "pid 12) for 10.0 s (peer_timeout_seconds = 10)"))
      << msg;
  EXPECT_FALSE(Contains(msg, "rank 1")) << msg;
  // Rank 0 tells the ranks it can still reach, not the silent one.
  ASSERT_EQ(run.fired.sends.size(), 1u);
  EXPECT_EQ(run.fired.sends[0].first, 1);
  EXPECT_EQ(run.fired.sends[0].second[0], 'A');
  EXPECT_TRUE(Contains(run.fired.sends[0].second, "rank 2 (host h2, pid 12)"));
  // Reported once.
  EXPECT_TRUE(m.timed_out());
  EXPECT_FALSE(m.Tick(12.0).timed_out);
}

TEST(PeerMonitor, SeveralSilentRanksAreAllNamed) {
  PeerMonitor m(0, 4, Peers(4), 3.0, 0.0, 0.0);
  DriveResult run = Drive(&m, 0.0, 4.0, {2});
  ASSERT_TRUE(run.timed_out);
  EXPECT_TRUE(Contains(run.fired.message,
                       "rank 1 (host h1, pid 11), rank 3 (host h3, pid 13)"))
      << run.fired.message;
  ASSERT_EQ(run.fired.sends.size(), 1u);
  EXPECT_EQ(run.fired.sends[0].first, 2);
}

TEST(PeerMonitor, RanksThatWentSilentTogetherAreNamedTogether) {
  // One host's link goes down: rank 3 was last heard at 0.0 s, rank 2 at
  // 0.2 s. When rank 3 passes the 10 s deadline, rank 2 (quiet 9.8 s) is
  // part of the same fault and is named too; rank 1 (alive) is not.
  PeerMonitor m(0, 4, Peers(4), 10.0, 0.0, 0.0);
  Drive(&m, 0.0, 0.3, {1, 2});
  DriveResult run = Drive(&m, 0.3, 11.0, {1});
  ASSERT_TRUE(run.timed_out);
  EXPECT_LT(run.timed_out_at, 10.15);
  EXPECT_TRUE(Contains(run.fired.message,
                       "rank 2 (host h2, pid 12), rank 3 (host h3, pid 13)"))
      << run.fired.message;
  EXPECT_FALSE(Contains(run.fired.message, "rank 1 ")) << run.fired.message;
  ASSERT_EQ(run.fired.sends.size(), 1u);
  EXPECT_EQ(run.fired.sends[0].first, 1);
}

TEST(PeerMonitor, ARankLateByAFewHeartbeatsIsNotNamed) {
  // Rank 2 missed two heartbeats (0.5 s) when rank 3 passes the deadline:
  // that is ordinary jitter, not the same fault.
  PeerMonitor m(0, 4, Peers(4), 10.0, 0.0, 0.0);
  Drive(&m, 0.0, 0.1, {1, 2});
  for (int k = 1; k <= 95; ++k) m.OnNotice(2, "H", k * 0.1);
  DriveResult run = Drive(&m, 0.1, 11.0, {1});
  ASSERT_TRUE(run.timed_out);
  EXPECT_TRUE(Contains(run.fired.message, "rank 3 (host h3, pid 13)"));
  EXPECT_FALSE(Contains(run.fired.message, "rank 2 ")) << run.fired.message;
}

TEST(PeerMonitor, LateRankWithinTheDeadlineResumes) {
  PeerMonitor m(0, 3, Peers(3), 10.0, 4.0, 0.0);
  DriveResult silent = Drive(&m, 0.0, 9.0, {1});  // rank 2 quiet for 9 s ...
  EXPECT_FALSE(silent.timed_out);
  EXPECT_TRUE(AnyContains(silent.warnings, "rank 2 (host h2, pid 12)"));
  DriveResult back = Drive(&m, 9.0, 30.0, {1, 2});  // ... then back
  EXPECT_FALSE(back.timed_out);
  EXPECT_TRUE(AnyContains(back.warnings, "rank 2 (host h2, pid 12) is heard "
                                         "from again"));
  EXPECT_FALSE(m.timed_out());
}

TEST(PeerMonitor, CoordinatorSilenceStopsAWorkerByItself) {
  PeerMonitor m(1, 3, Peers(3), 5.0, 2.0, 0.0);
  DriveResult run = Drive(&m, 0.0, 6.0, {2});  // only rank 2 talks; ignored
  ASSERT_TRUE(run.timed_out);
  EXPECT_NEAR(run.timed_out_at, 5.0, 0.11);
  EXPECT_TRUE(Contains(run.fired.message,
                       "no message from rank 0 (host h0, pid 10), the "
                       "coordinator, for 5.0 s (peer_timeout_seconds = 5)"))
      << run.fired.message;
  EXPECT_TRUE(run.fired.sends.empty());
  EXPECT_TRUE(AnyContains(run.warnings, "rank 0 (host h0, pid 10), the "
                                        "coordinator,"));
}

TEST(PeerMonitor, WorkerRelaysTheCoordinatorsViewAndAbortNotice) {
  PeerMonitor m(1, 3, Peers(3), 10.0, 3.0, 0.0);
  // Rank 0 reports rank 2 quiet for 3.5 s.
  DriveResult run = Drive(&m, 0.0, 1.0, {0}, "H 2:3500");
  EXPECT_FALSE(run.timed_out);
  ASSERT_EQ(run.warnings.size(), 1u);  // once, not per heartbeat
  EXPECT_TRUE(Contains(run.warnings[0],
                       "rank 0 (host h0, pid 10) has had no message from "
                       "rank 2 (host h2, pid 12) for 3.5 s"))
      << run.warnings[0];
  // A worker that was frozen itself does not warn about itself.
  EXPECT_TRUE(Drive(&m, 1.0, 1.05, {0}, "H 1:9000").warnings.empty());
  m.OnNotice(0, "Ano message from rank 2 (host h2, pid 12) for 10.0 s "
                "(peer_timeout_seconds = 10)", 1.0);
  PeerMonitor::Actions a = m.Tick(1.05);
  ASSERT_TRUE(a.timed_out);
  EXPECT_TRUE(Contains(a.message, "peer timeout reported by rank 0 (host h0, "
                                  "pid 10): no message from rank 2 (host h2, "
                                  "pid 12)"))
      << a.message;
}

TEST(PeerMonitor, OwnPauseIsNobodysSilence) {
  // This process did not run for 20 s (SIGSTOP of the observer, or of the
  // whole job): on waking up nobody has timed out.
  PeerMonitor m(0, 2, Peers(2), 10.0, 4.0, 0.0);
  EXPECT_FALSE(Drive(&m, 0.0, 1.0, {1}).timed_out);
  PeerMonitor::Actions a = m.Tick(21.0);
  EXPECT_FALSE(a.timed_out);
  EXPECT_TRUE(a.warnings.empty());
  // ... but the clock runs again from there.
  DriveResult run = Drive(&m, 21.1, 33.0, {});
  ASSERT_TRUE(run.timed_out);
  EXPECT_NEAR(run.timed_out_at, 31.0, 0.25);
}

TEST(PeerMonitor, WarningAtOrAfterTheTimeoutIsNotLogged) {
  PeerMonitor m(0, 2, Peers(2), 2.0, 5.0, 0.0);
  DriveResult run = Drive(&m, 0.0, 3.0, {});
  EXPECT_TRUE(run.timed_out);
  EXPECT_TRUE(run.warnings.empty());
}

}  // namespace
}  // namespace mpistrategy
