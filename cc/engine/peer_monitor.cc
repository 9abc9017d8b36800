#include "cc/engine/peer_monitor.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace mpistrategy {

namespace {

// Notice kinds (first byte).
constexpr char kHeartbeat = 'H';
constexpr char kAbort = 'A';
// At most this many quiet ranks ride on one of rank 0's heartbeats.
constexpr size_t kMaxRelayed = 32;

std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", s);
  return buf;
}

}  // namespace

double PeerMonitor::HeartbeatSeconds(double timeout_seconds) {
  return std::min(0.25, std::max(0.005, timeout_seconds / 40.0));
}

double PeerMonitor::CompanionQuietSeconds() const {
  // Eight missed heartbeats; never more than the deadline itself.
  return std::min(timeout_seconds_, 8.0 * heartbeat_seconds_);
}

PeerMonitor::PeerMonitor(int rank, int size, std::vector<PeerInfo> peers,
                         double timeout_seconds, double warning_seconds,
                         double now)
    : rank_(rank),
      size_(size),
      peers_(std::move(peers)),
      timeout_seconds_(timeout_seconds),
      warning_seconds_(warning_seconds),
      heartbeat_seconds_(HeartbeatSeconds(timeout_seconds)),
      last_tick_(now),
      last_heard_(size, now),
      warned_(size, false),
      relay_warned_(size, false) {}

void PeerMonitor::OnNotice(int from, const std::string& bytes, double now) {
  if (from < 0 || from >= size_ || bytes.empty()) return;
  last_heard_[from] = std::max(last_heard_[from], now);
  if (from != 0 || rank_ == 0) return;
  if (bytes[0] == kAbort) {
    if (abort_notice_.empty()) abort_notice_ = bytes.substr(1);
    return;
  }
  if (bytes[0] != kHeartbeat) return;
  // "H r:ms r:ms ..."
  relayed_quiet_.clear();
  const char* p = bytes.c_str() + 1;
  while (*p != '\0') {
    char* end = nullptr;
    const long r = std::strtol(p, &end, 10);
    if (end == p || *end != ':') break;
    const char* q = end + 1;
    const long ms = std::strtol(q, &end, 10);
    if (end == q) break;
    // Not about ourselves (we were frozen, and are back).
    if (r >= 0 && r < size_ && r != rank_) {
      relayed_quiet_.emplace_back(r, ms / 1000.0);
    }
    p = end;
  }
}

std::string PeerMonitor::Heartbeat(double now) const {
  std::string h(1, kHeartbeat);
  if (rank_ != 0) return h;
  size_t n = 0;
  for (int r = 1; r < size_ && n < kMaxRelayed; ++r) {
    const double quiet = now - last_heard_[r];
    if (quiet < kRelayQuietSeconds) continue;
    h += " " + std::to_string(r) + ":" +
         std::to_string(static_cast<long long>(quiet * 1000));
    ++n;
  }
  return h;
}

PeerMonitor::Actions PeerMonitor::Tick(double now) {
  Actions actions;
  if (timed_out_) return actions;
  // A long gap since our last tick: this process did not run, so nobody's
  // silence can be judged for that time.
  const double gap = now - last_tick_;
  if (gap > kPauseSeconds) {
    for (double& t : last_heard_) t += gap;
  }
  last_tick_ = now;

  const std::string deadline_note =
      "collectives wait for it; after peer_timeout_seconds = " +
      FormatSeconds(timeout_seconds_) + " s of silence the job ends";
  const bool warn = warning_seconds_ > 0.0 && warning_seconds_ < timeout_seconds_;
  std::vector<int> silent;
  // Ranks quiet long enough to be part of the same fault (one host's link,
  // heard from a few milliseconds apart); named with the ranks past the
  // deadline so that the error lists every rank that went away.
  std::vector<int> companions;
  double longest = 0.0;
  for (int r = 0; r < size_; ++r) {
    if (!Watches(r)) continue;
    const double quiet = now - last_heard_[r];
    if (quiet >= timeout_seconds_) {
      silent.push_back(r);
      longest = std::max(longest, quiet);
      continue;
    }
    if (quiet >= CompanionQuietSeconds()) companions.push_back(r);
    const std::string who =
        DescribeRank(r, peers_) + (r == 0 ? ", the coordinator," : "");
    if (warn && quiet >= warning_seconds_ && !warned_[r]) {
      warned_[r] = true;
      actions.warnings.push_back("no message from " + who + " for " +
                                 Seconds(quiet) +
                                 " s: is it frozen, dead or unreachable? " +
                                 deadline_note);
    } else if (warned_[r] && quiet < heartbeat_seconds_ * 4) {
      warned_[r] = false;
      actions.warnings.push_back(DescribeRank(r, peers_) +
                                 " is heard from again");
    }
  }
  if (rank_ != 0 && warn) {
    std::vector<bool> listed(size_, false);
    for (const auto& [r, quiet] : relayed_quiet_) {
      listed[r] = true;
      if (quiet >= warning_seconds_ && !relay_warned_[r]) {
        relay_warned_[r] = true;
        actions.warnings.push_back(
            DescribeRank(0, peers_) + " has had no message from " +
            DescribeRank(r, peers_) + " for " + Seconds(quiet) +
            " s: is it frozen, dead or unreachable? " + deadline_note);
      }
    }
    for (int r = 0; r < size_; ++r) {
      if (!listed[r]) relay_warned_[r] = false;
    }
  }

  const std::string consequence =
      ": that process is frozen (e.g. SIGSTOP), dead, or cut off by the "
      "network";
  if (!silent.empty()) {
    silent.insert(silent.end(), companions.begin(), companions.end());
    std::sort(silent.begin(), silent.end());
    timed_out_ = true;
    actions.timed_out = true;
    const std::string core =
        "no message from " + DescribeRanks(silent, peers_) +
        (rank_ != 0 ? ", the coordinator," : "") + " for " + Seconds(longest) +
        " s (peer_timeout_seconds = " + FormatSeconds(timeout_seconds_) +
        ")" + consequence;
    actions.message = "peer timeout: " + core;
    if (rank_ == 0) {
      for (int r = 1; r < size_; ++r) {
        if (std::find(silent.begin(), silent.end(), r) != silent.end()) {
          continue;
        }
        actions.sends.emplace_back(r, std::string(1, kAbort) + core);
      }
    }
    return actions;
  }
  if (!abort_notice_.empty()) {
    timed_out_ = true;
    actions.timed_out = true;
    actions.message = "peer timeout reported by " + DescribeRank(0, peers_) +
                      ": " + abort_notice_;
    return actions;
  }

  if (now - last_sent_ >= heartbeat_seconds_) {
    last_sent_ = now;
    const std::string h = Heartbeat(now);
    for (int r = 0; r < size_; ++r) {
      if (Watches(r)) actions.sends.emplace_back(r, h);
    }
  }
  return actions;
}

}  // namespace mpistrategy
