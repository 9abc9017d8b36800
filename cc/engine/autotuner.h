// Online tuning of the engine's fusion parameters (EngineConfig::autotune).
//
// Rank 0's engine feeds the Autotuner the payload bytes it executed each
// cycle.  The tuner scores parameters by throughput (bytes per second of
// wall time) and, by coordinate descent, first tunes the fusion wait, then
// the fusion threshold.  Each choice is published to every rank through the
// negotiation (ResponseList::parameters), so all ranks plan fusion with the
// same threshold from the same cycle on.
//
// Throughput is a proxy for training speed: in a training loop gradients
// arrive at the rate the model produces them, so the parameters that move
// the most bytes per second are the ones that stall the step the least.
//
// Shared machines are noisy and drift (another job starts, the input
// pipeline warms up), so a candidate is never compared with a measurement
// taken long before.  It is measured against the incumbent in interleaved
// pairs of samples (incumbent then candidate, candidate then incumbent, ...)
// and replaces it only if it wins all pairs but at most `max_lost_rounds`
// and its median gain is at least `min_improvement`.  A candidate is dropped
// as soon as it has lost too many pairs, so a compute-bound job (where
// nothing helps) keeps its configured parameters and tunes quickly.
//
// Thread-compatible; the engine thread only.  Framework-free and clock-free
// (times are passed in), so tests drive it with synthetic measurements.

#ifndef MPISTRATEGY_CC_ENGINE_AUTOTUNER_H_
#define MPISTRATEGY_CC_ENGINE_AUTOTUNER_H_

#include <cstdint>
#include <string>
#include <vector>

namespace mpistrategy {

// The parameters every rank must agree on, published by rank 0.
struct TunedParameters {
  int64_t fusion_threshold_bytes = 64 << 20;
  double fusion_wait_ms = 0.0;
  // Set once tuning finished; the parameters are final.
  bool final = false;

  bool operator==(const TunedParameters& other) const {
    return fusion_threshold_bytes == other.fusion_threshold_bytes &&
           fusion_wait_ms == other.fusion_wait_ms && final == other.final;
  }
  bool operator!=(const TunedParameters& other) const {
    return !(*this == other);
  }
};

struct AutotuneSettings {
  // Cycles ignored after each switch (the pipeline refills).
  int warmup_cycles = 2;
  // A sample lasts at least this long and spans at least this many cycles
  // that executed collectives.
  double min_sample_seconds = 0.3;
  int min_cycles_per_sample = 5;
  // Pairs of samples (incumbent, candidate) per candidate; the order
  // alternates so that a steady drift favours neither.
  int rounds = 7;
  // To switch, the candidate may lose at most this many pairs (one sample
  // disturbed by another process must not hide a real gain), and the median
  // candidate/incumbent throughput ratio must exceed 1 + min_improvement.
  int max_lost_rounds = 1;
  double min_improvement = 0.05;
  // Candidates, searched in this order (wait first, then threshold).
  std::vector<double> fusion_wait_ms = {0.0, 0.1, 0.25, 0.5, 1.0, 2.0};
  std::vector<int64_t> fusion_threshold_bytes = {
      0, 1 << 20, 4 << 20, 16 << 20, 32 << 20, 64 << 20, 128 << 20};
};

class Autotuner {
 public:
  // `initial`: the configured parameters, the first incumbent.
  Autotuner(const TunedParameters& initial, const AutotuneSettings& settings);

  // The parameters the tuner wants in force now.  After Record returns true
  // the engine publishes them and calls Applied once they are in force.
  const TunedParameters& current() const { return current_; }
  bool done() const { return current_.final; }

  // One cycle that executed `bytes` of payload ended at `now_seconds`.
  // Returns true when current() changed (publish it).  Ignored while a
  // published change is not yet Applied, and once done.
  bool Record(double now_seconds, int64_t bytes);

  // current() is in force on every rank from `now_seconds` on.
  void Applied(double now_seconds);

  // One CSV line per sample and decision, in order (kLogHeader names the
  // columns; `gain` is set for decisions only).  Drained by the caller (the
  // engine appends them to EngineConfig::autotune_log).
  static constexpr const char* kLogHeader =
      "phase,fusion_threshold_bytes,fusion_wait_ms,bytes_per_second,gain,"
      "event";
  std::vector<std::string> TakeLogLines();

 private:
  // True when leg `leg` (0 or 1) of round `round` measures the candidate.
  static bool LegIsCandidate(int round, int leg) {
    return (leg == 1) != (round % 2 == 1);
  }
  // A sample ended: next leg, round, candidate or the end.  Returns true
  // when current() changed.
  bool Advance(double now_seconds);
  // The next candidate around the incumbent, moving to the next phase when
  // this one is exhausted; false when there is none.
  bool NextCandidate();
  void StartSample(double now_seconds);
  void Log(const TunedParameters& parameters, double bytes_per_second,
           double gain, const char* event);

  const AutotuneSettings settings_;
  TunedParameters incumbent_;
  TunedParameters candidate_;
  TunedParameters current_;
  int phase_ = 0;            // 0: the wait, 1: the threshold
  size_t next_index_ = 0;    // into the current phase's list
  int round_ = 0;
  int leg_ = 0;
  std::vector<double> incumbent_scores_;  // this candidate's rounds
  std::vector<double> candidate_scores_;
  std::vector<double> ratios_;
  int lost_rounds_ = 0;
  bool waiting_for_apply_ = false;
  int warmup_left_ = 0;
  double sample_start_ = -1.0;  // < 0: no cycle seen yet
  int64_t sample_bytes_ = 0;
  int sample_cycles_ = 0;
  std::vector<std::string> log_;
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_ENGINE_AUTOTUNER_H_
