#include "cc/engine/autotuner.h"

#include <algorithm>
#include <cstdio>

namespace mpistrategy {

namespace {

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  if (n == 0) return 0.0;
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

bool SameParameters(const TunedParameters& a, const TunedParameters& b) {
  return a.fusion_threshold_bytes == b.fusion_threshold_bytes &&
         a.fusion_wait_ms == b.fusion_wait_ms;
}

}  // namespace

Autotuner::Autotuner(const TunedParameters& initial,
                     const AutotuneSettings& settings)
    : settings_(settings), incumbent_(initial) {
  incumbent_.final = false;
  current_ = incumbent_;
  warmup_left_ = settings_.warmup_cycles;
  if (!NextCandidate()) current_.final = true;  // nothing to try
}

bool Autotuner::Record(double now_seconds, int64_t bytes) {
  if (done() || waiting_for_apply_) return false;
  if (sample_start_ < 0 || warmup_left_ > 0) {
    // Ignored cycle: the sample starts where it ended.
    if (sample_start_ >= 0) --warmup_left_;
    StartSample(now_seconds);
    return false;
  }
  sample_bytes_ += bytes;
  ++sample_cycles_;
  const double elapsed = now_seconds - sample_start_;
  if (elapsed < settings_.min_sample_seconds ||
      sample_cycles_ < settings_.min_cycles_per_sample) {
    return false;
  }
  const double score = static_cast<double>(sample_bytes_) / elapsed;
  Log(current_, score, 0.0, "sample");
  (LegIsCandidate(round_, leg_) ? candidate_scores_ : incumbent_scores_)
      .push_back(score);
  return Advance(now_seconds);
}

void Autotuner::Applied(double now_seconds) {
  waiting_for_apply_ = false;
  warmup_left_ = settings_.warmup_cycles;
  StartSample(now_seconds);
}

std::vector<std::string> Autotuner::TakeLogLines() {
  std::vector<std::string> lines;
  lines.swap(log_);
  return lines;
}

bool Autotuner::Advance(double now_seconds) {
  if (leg_ == 0) {
    leg_ = 1;
  } else {
    const double incumbent = incumbent_scores_.back();
    const double ratio =
        incumbent > 0 ? candidate_scores_.back() / incumbent : 0.0;
    ratios_.push_back(ratio);
    if (ratio <= 1.0) ++lost_rounds_;
    ++round_;
    leg_ = 0;
    const bool lost = lost_rounds_ > settings_.max_lost_rounds;
    if (lost || round_ >= settings_.rounds) {
      const double gain = Median(ratios_);
      const bool accepted =
          !lost && gain > 1.0 + settings_.min_improvement;
      Log(candidate_, Median(candidate_scores_), gain,
          accepted ? "accepted" : "rejected");
      if (accepted) incumbent_ = candidate_;
      round_ = 0;
      lost_rounds_ = 0;
      incumbent_scores_.clear();
      candidate_scores_.clear();
      ratios_.clear();
      if (!NextCandidate()) {
        current_ = incumbent_;
        current_.final = true;
        Log(current_, 0.0, 0.0, "final");
        return true;
      }
    }
  }
  const TunedParameters& wanted =
      LegIsCandidate(round_, leg_) ? candidate_ : incumbent_;
  if (!SameParameters(wanted, current_)) {
    current_ = wanted;
    waiting_for_apply_ = true;
    return true;
  }
  StartSample(now_seconds);
  return false;
}

bool Autotuner::NextCandidate() {
  while (phase_ < 2) {
    const size_t count = phase_ == 0 ? settings_.fusion_wait_ms.size()
                                     : settings_.fusion_threshold_bytes.size();
    while (next_index_ < count) {
      TunedParameters p = incumbent_;
      if (phase_ == 0) {
        p.fusion_wait_ms = settings_.fusion_wait_ms[next_index_++];
      } else {
        p.fusion_threshold_bytes =
            settings_.fusion_threshold_bytes[next_index_++];
      }
      if (SameParameters(p, incumbent_)) continue;
      candidate_ = p;
      return true;
    }
    ++phase_;
    next_index_ = 0;
  }
  return false;
}

void Autotuner::StartSample(double now_seconds) {
  sample_start_ = now_seconds;
  sample_bytes_ = 0;
  sample_cycles_ = 0;
}

void Autotuner::Log(const TunedParameters& parameters,
                    double bytes_per_second, double gain, const char* event) {
  char line[256];
  char gain_text[32] = "";
  if (gain > 0) std::snprintf(gain_text, sizeof(gain_text), "%.4f", gain);
  std::snprintf(line, sizeof(line), "%d,%lld,%g,%.6g,%s,%s",
                std::min(phase_, 1),
                static_cast<long long>(parameters.fusion_threshold_bytes),
                parameters.fusion_wait_ms, bytes_per_second, gain_text, event);
  log_.push_back(line);
}

}  // namespace mpistrategy
