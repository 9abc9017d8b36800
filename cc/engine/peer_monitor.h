// Liveness of the other ranks (EngineConfig::peer_timeout_seconds).
//
// Every rank's engine runs a monitor thread next to its engine thread.  The
// monitors exchange small notices (Transport::PostNotice) in a star around
// rank 0, the coordinator:
//   * every non-zero rank sends rank 0 a heartbeat every heartbeat_seconds;
//   * rank 0 sends every other rank a heartbeat carrying the ranks it has
//     not heard from for a second or more (so they can log who is missing);
//   * when rank 0 has heard nothing from some ranks for timeout_seconds, it
//     sends every other rank an abort notice naming them and stops;
//   * a non-zero rank that has heard nothing from rank 0 for timeout_seconds
//     (rank 0 frozen, dead, or cut off from it by the network) stops by
//     itself naming rank 0.
// The monitor's thread does not wait for the engine thread, so it keeps
// beating while the engine thread is blocked inside a transfer: a rank is
// silent only when its whole process is (frozen, dead, unreachable) or its
// engine has stopped.
//
// This class is the pure logic (no thread, no transport, time passed in):
// the engine feeds it the notices it receives and performs what Tick asks.
// A gap between two Ticks longer than kPauseSeconds means this process
// itself did not run (it was stopped, or starved of CPU); that time is not
// counted as anyone's silence.
//
// Thread-compatible.

#ifndef MPISTRATEGY_CC_ENGINE_PEER_MONITOR_H_
#define MPISTRATEGY_CC_ENGINE_PEER_MONITOR_H_

#include <string>
#include <utility>
#include <vector>

#include "cc/common/common.h"

namespace mpistrategy {

class PeerMonitor {
 public:
  // Own ticks further apart than this are a pause of this process.
  static constexpr double kPauseSeconds = 1.0;
  // Rank 0 relays ranks silent for at least this long in its heartbeats.
  static constexpr double kRelayQuietSeconds = 1.0;

  // The heartbeat period for `timeout_seconds`: timeout / 40, between 5 ms
  // and 250 ms, so a rank frozen for less than timeout - period is never
  // declared silent.
  static double HeartbeatSeconds(double timeout_seconds);

  // Args:
  //   rank, size: this rank and the world size (>= 2).
  //   peers: every rank's identity, for messages.
  //   timeout_seconds: > 0.
  //   warning_seconds: silence logged after this long; 0 (or >= the
  //     timeout) never.
  //   now: the clock now; everybody counts as heard from at this time.
  PeerMonitor(int rank, int size, std::vector<PeerInfo> peers,
              double timeout_seconds, double warning_seconds, double now);

  // A notice from `from` arrived at `now`.
  void OnNotice(int from, const std::string& bytes, double now);

  struct Actions {
    // Notices to post: (to rank, bytes).
    std::vector<std::pair<int, std::string>> sends;
    // Lines to log.
    std::vector<std::string> warnings;
    // The timeout happened (reported once): `message` says why; every
    // pending collective fails with it and the job ends.
    bool timed_out = false;
    std::string message;
  };
  // What to do at `now`; call every heartbeat_seconds / 2 or so.
  Actions Tick(double now);

  bool timed_out() const { return timed_out_; }
  double heartbeat_seconds() const { return heartbeat_seconds_; }

 private:
  // The ranks this one watches: all others on rank 0, rank 0 elsewhere.
  bool Watches(int r) const { return r != rank_ && (rank_ == 0 || r == 0); }
  std::string Heartbeat(double now) const;
  // When one rank passes the deadline, the other ranks quiet for at least
  // this long are named with it (they missed many heartbeats in a row).
  double CompanionQuietSeconds() const;

  const int rank_;
  const int size_;
  const std::vector<PeerInfo> peers_;
  const double timeout_seconds_;
  const double warning_seconds_;
  const double heartbeat_seconds_;
  double last_tick_;
  double last_sent_ = -1e300;
  std::vector<double> last_heard_;
  std::vector<bool> warned_;
  // Non-zero ranks: rank 0's latest list of quiet ranks, (rank, seconds),
  // and which of them were logged already.
  std::vector<std::pair<int, double>> relayed_quiet_;
  std::vector<bool> relay_warned_;
  // Non-zero ranks: rank 0's abort notice, when one arrived.
  std::string abort_notice_;
  bool timed_out_ = false;
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_ENGINE_PEER_MONITOR_H_
