#include "cc/transport/handoff_tuner.h"

#include <algorithm>

namespace mpistrategy {

namespace {

Handoff Other(Handoff way) {
  return way == Handoff::kCached ? Handoff::kStreaming : Handoff::kCached;
}

// floor(log2(bytes)) for bytes > 0.
int SizeClass(int64_t bytes) {
  return 63 - __builtin_clzll(static_cast<unsigned long long>(bytes));
}

// Gaps of at least 1, the largest at least the smallest.
HandoffTunerSettings Checked(HandoffTunerSettings settings) {
  settings.min_probe_gap = std::max<int64_t>(1, settings.min_probe_gap);
  settings.max_probe_gap =
      std::max(settings.min_probe_gap, settings.max_probe_gap);
  settings.settle = std::max(0, settings.settle);
  return settings;
}

}  // namespace

const char* HandoffName(Handoff way) {
  return way == Handoff::kCached ? "cached" : "streaming";
}

HandoffTuner::HandoffTuner(const HandoffTunerSettings& settings)
    : settings_(Checked(settings)),
      incumbent_(settings.initial),
      probe_gap_(settings_.min_probe_gap),
      last_way_(settings.initial) {}

Handoff HandoffTuner::Next() {
  if (probe_left_ > 0) {
    --probe_left_;
    return Other(incumbent_);
  }
  if (++since_probe_ < probe_gap_) return incumbent_;
  since_probe_ = 0;
  probe_left_ = settings_.settle;
  return Other(incumbent_);
}

double HandoffTuner::IncumbentSecondsPerByte(int size_class) const {
  const Recent& r = recent_[size_class];
  // Timed collectives reported since the newest (the probe at hand, the
  // last one reported, not counted).
  const int64_t since = records_ - r.newest - 1;
  if (r.count == 0 || since > kMaxAgeInGaps * settings_.max_probe_gap) {
    return -1.0;
  }
  std::array<double, kKept> sorted = r.seconds_per_byte;
  const int n = static_cast<int>(std::min<int64_t>(r.count, kKept));
  std::sort(sorted.begin(), sorted.begin() + n);
  return sorted[n / 2];
}

void HandoffTuner::Record(Handoff way, int64_t bytes, double seconds) {
  if (bytes <= 0 || bytes < settings_.min_bytes) return;
  ++records_;
  // The first collectives after a change of way are not representative.
  same_way_ = way == last_way_ ? same_way_ + 1 : 1;
  last_way_ = way;
  if (same_way_ <= settings_.settle) return;
  const int size_class = SizeClass(bytes);
  const double per_byte = seconds / static_cast<double>(bytes);
  if (way == incumbent_) {
    Recent& r = recent_[size_class];
    r.seconds_per_byte[r.count % kKept] = per_byte;  // over the oldest
    ++r.count;
    r.newest = records_;
    return;
  }
  const double incumbent = IncumbentSecondsPerByte(size_class);
  // Nothing of this size to compare with: the probe does not count.
  if (incumbent < 0) return;
  if (per_byte >= (1.0 - settings_.min_gain) * incumbent) {
    wins_ = 0;
    probe_gap_ = std::min(2 * probe_gap_, settings_.max_probe_gap);
    return;
  }
  probe_gap_ = settings_.min_probe_gap;
  if (++wins_ < settings_.wins_to_switch) return;
  // The kept times are the old incumbent's.
  incumbent_ = way;
  wins_ = 0;
  ++switches_;
  recent_.fill(Recent{});
}

}  // namespace mpistrategy
