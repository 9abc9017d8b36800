#include "cc/engine/autotuner.h"

#include <cmath>
#include <functional>
#include <random>
#include <string>

#include <gtest/gtest.h>

namespace mpistrategy {
namespace {

constexpr int64_t kMiB = 1 << 20;

AutotuneSettings FastSettings() {
  AutotuneSettings s;
  s.min_sample_seconds = 0.05;
  s.min_cycles_per_sample = 2;
  return s;
}

TunedParameters Defaults() {
  TunedParameters p;
  p.fusion_threshold_bytes = 64 * kMiB;
  p.fusion_wait_ms = 0.0;
  return p;
}

// Drives `tuner` with cycles of 10 ms moving rate(parameters) bytes/s until
// it is done.  A published change takes one cycle to be applied.  Returns
// the number of parameter switches.
int RunToCompletion(Autotuner* tuner,
                    const std::function<double(const TunedParameters&, int)>&
                        rate) {
  const double dt = 0.01;
  double now = 0.0;
  int switches = 0;
  for (int cycle = 0; cycle < 100000 && !tuner->done(); ++cycle) {
    now += dt;
    const int64_t bytes =
        static_cast<int64_t>(rate(tuner->current(), cycle) * dt);
    if (tuner->Record(now, bytes)) {
      ++switches;
      if (tuner->done()) break;
      now += dt;
      // Records before Applied are ignored.
      EXPECT_FALSE(tuner->Record(now, 1 << 30));
      tuner->Applied(now);
    }
  }
  return switches;
}

TEST(Autotuner, PicksTheFastestWaitThenThreshold) {
  Autotuner tuner(Defaults(), FastSettings());
  RunToCompletion(&tuner, [](const TunedParameters& p, int) {
    double rate = 1e8;
    if (p.fusion_wait_ms == 0.5) rate *= 2;
    if (p.fusion_wait_ms == 0.5 && p.fusion_threshold_bytes == 16 * kMiB) {
      rate *= 1.5;
    }
    return rate;
  });
  ASSERT_TRUE(tuner.done());
  EXPECT_EQ(tuner.current().fusion_threshold_bytes, 16 * kMiB);
  EXPECT_EQ(tuner.current().fusion_wait_ms, 0.5);
  EXPECT_TRUE(tuner.current().final);
}

TEST(Autotuner, KeepsTheStartingParametersWhenNothingIsClearlyBetter) {
  TunedParameters start = Defaults();
  start.fusion_threshold_bytes = 32 * kMiB;
  Autotuner tuner(start, FastSettings());
  // +-2 % noise and a 3 % better candidate: below the 5 % bar.
  RunToCompletion(&tuner, [](const TunedParameters& p, int cycle) {
    double rate = 1e8 * (1.0 + 0.02 * std::sin(cycle * 1.7));
    if (p.fusion_wait_ms == 1.0) rate *= 1.03;
    return rate;
  });
  ASSERT_TRUE(tuner.done());
  EXPECT_EQ(tuner.current().fusion_threshold_bytes, 32 * kMiB);
  EXPECT_EQ(tuner.current().fusion_wait_ms, 0.0);
}

// Decisions ("accepted"/"rejected") in the log, as "threshold/wait".
std::vector<std::string> Decisions(const std::vector<std::string>& lines) {
  std::vector<std::string> out;
  for (const std::string& line : lines) {
    if (line.find(",accepted") == std::string::npos &&
        line.find(",rejected") == std::string::npos) {
      continue;
    }
    // "phase,threshold,wait,..." -> "threshold/wait"
    const size_t a = line.find(',');
    const size_t b = line.find(',', a + 1);
    const size_t c = line.find(',', b + 1);
    out.push_back(line.substr(a + 1, b - a - 1) + "/" +
                  line.substr(b + 1, c - b - 1));
  }
  return out;
}

TEST(Autotuner, DecidesEveryCandidateOnceInOrder) {
  Autotuner tuner(Defaults(), FastSettings());
  RunToCompletion(&tuner, [](const TunedParameters&, int) { return 1e8; });
  ASSERT_TRUE(tuner.done());
  const std::vector<std::string> expected = {
      "67108864/0.1",    "67108864/0.25",   "67108864/0.5",
      "67108864/1",      "67108864/2",      "0/0",
      "1048576/0",       "4194304/0",       "16777216/0",
      "33554432/0",      "134217728/0"};
  EXPECT_TRUE(Decisions(tuner.TakeLogLines()) == expected);
}

TEST(Autotuner, SteadyDriftDoesNotMakeLaterCandidatesWin) {
  // Throughput improves by 0.5 % per cycle whatever the parameters (the
  // input pipeline warming up): measured in blocks, every later candidate
  // would look better.  The interleaved pairs see through it.
  Autotuner tuner(Defaults(), FastSettings());
  RunToCompletion(&tuner, [](const TunedParameters&, int cycle) {
    return 1e8 * (1.0 + 0.005 * cycle);
  });
  ASSERT_TRUE(tuner.done());
  EXPECT_EQ(tuner.current().fusion_threshold_bytes, 64 * kMiB);
  EXPECT_EQ(tuner.current().fusion_wait_ms, 0.0);
}

TEST(Autotuner, ALosingCandidateIsDroppedOnceItLostTwoPairs) {
  AutotuneSettings settings = FastSettings();
  settings.fusion_threshold_bytes = {};
  settings.fusion_wait_ms = {2.0};
  Autotuner tuner(Defaults(), settings);
  RunToCompletion(&tuner, [](const TunedParameters& p, int) {
    return p.fusion_wait_ms == 2.0 ? 5e7 : 1e8;
  });
  ASSERT_TRUE(tuner.done());
  int samples = 0;
  for (const std::string& line : tuner.TakeLogLines()) {
    if (line.find(",sample") != std::string::npos) ++samples;
  }
  EXPECT_EQ(samples, 4);  // two pairs, not settings.rounds
  EXPECT_EQ(tuner.current().fusion_wait_ms, 0.0);
}

TEST(Autotuner, OneDisturbedPairDoesNotHideARealGain) {
  AutotuneSettings settings = FastSettings();
  settings.fusion_threshold_bytes = {};
  settings.fusion_wait_ms = {0.5};
  Autotuner tuner(Defaults(), settings);
  // Wait 0.5 ms is 30 % faster, but another process steals the CPU during
  // its first 8 cycles (the 2 warm-up cycles and its whole first sample of
  // 5-6 cycles), so it loses the first pair.
  int candidate_cycles = 0;
  RunToCompletion(&tuner, [&](const TunedParameters& p, int) {
    if (p.fusion_wait_ms != 0.5) return 1e8;
    return ++candidate_cycles <= 8 ? 1e7 : 1.3e8;
  });
  ASSERT_TRUE(tuner.done());
  EXPECT_EQ(tuner.current().fusion_wait_ms, 0.5);
  const std::vector<std::string> lines = tuner.TakeLogLines();
  ASSERT_GE(lines.size(), 3u);
  // The candidate's first sample really was the disturbed one.
  EXPECT_NE(lines[1].find(",0.5,1e+07,,sample"), std::string::npos)
      << lines[1];
}

// Fraction of `sessions` tuning sessions, each with one candidate (a 1 ms
// wait) whose true throughput is `factor` times the incumbent's, that end
// on the candidate.  Every 10 ms cycle's throughput is also multiplied by
// log-normal noise with sigma 0.45, so that samples of 5-6 cycles differ
// by about 20 %, as back-to-back blocks on a shared 2-core VM do.
double AcceptanceUnderNoise(double factor, int sessions) {
  AutotuneSettings settings = FastSettings();
  settings.fusion_threshold_bytes = {};
  settings.fusion_wait_ms = {1.0};
  std::mt19937 random(12345);  // fixed: the test is deterministic
  std::lognormal_distribution<double> noise(0.0, 0.45);
  int accepted = 0;
  for (int session = 0; session < sessions; ++session) {
    Autotuner tuner(Defaults(), settings);
    RunToCompletion(&tuner, [&](const TunedParameters& p, int) {
      return 1e8 * noise(random) * (p.fusion_wait_ms == 1.0 ? factor : 1.0);
    });
    if (tuner.current().fusion_wait_ms == 1.0) ++accepted;
  }
  return static_cast<double>(accepted) / sessions;
}

TEST(Autotuner, UnderNoiseRarelyTakesASlightlyWorseCandidate) {
  // The rule (at most one lost pair of 7, median gain above 5 %) takes a
  // 4 % worse candidate in 21 of these 400 sessions; allowing 3 lost pairs
  // it took it in 97, and allowing 2 without the 5 % bar in 70.
  EXPECT_LT(AcceptanceUnderNoise(0.96, 400), 0.08);
}

TEST(Autotuner, UnderNoiseStillFindsALargeGain) {
  // 1.5x, as removing a 2 ms wait from a latency-bound job: found in 356
  // of these 400 sessions.
  EXPECT_GT(AcceptanceUnderNoise(1.5, 400), 0.8);
}

TEST(Autotuner, IgnoresWarmupCycles) {
  AutotuneSettings settings = FastSettings();
  settings.warmup_cycles = 8;
  Autotuner tuner(Defaults(), settings);
  // Right after each switch the throughput is terrible for a few cycles;
  // only then the candidate's real rate shows.  Wait 2 ms is best once warm.
  int last_switch_cycle = 0;
  double now = 0.0;
  for (int cycle = 0; cycle < 100000 && !tuner.done(); ++cycle) {
    now += 0.01;
    const TunedParameters& p = tuner.current();
    const bool cold = cycle - last_switch_cycle < 8;
    double rate = p.fusion_wait_ms == 2.0 ? 3e8 : 1e8;
    if (cold) rate = 1e6;
    if (tuner.Record(now, static_cast<int64_t>(rate * 0.01))) {
      if (tuner.done()) break;
      tuner.Applied(now);
      last_switch_cycle = cycle;
    }
  }
  ASSERT_TRUE(tuner.done());
  EXPECT_EQ(tuner.current().fusion_wait_ms, 2.0);
}

TEST(Autotuner, LogsSamplesDecisionsAndTheFinalChoice) {
  Autotuner tuner(Defaults(), FastSettings());
  RunToCompletion(&tuner, [](const TunedParameters& p, int) {
    return p.fusion_wait_ms == 0.5 ? 2e8 : 1e8;
  });
  const std::vector<std::string> lines = tuner.TakeLogLines();
  ASSERT_FALSE(lines.empty());
  int accepted = 0;
  int rejected = 0;
  for (const std::string& line : lines) {
    if (line.find(",accepted") != std::string::npos) {
      ++accepted;
      // The gain column: 2x.
      EXPECT_NE(line.find(",2.0000,accepted"), std::string::npos) << line;
    }
    if (line.find(",rejected") != std::string::npos) ++rejected;
  }
  EXPECT_EQ(accepted, 1);
  EXPECT_EQ(rejected, 10);
  EXPECT_NE(lines.back().find(",final"), std::string::npos) << lines.back();
  EXPECT_TRUE(tuner.TakeLogLines().empty());
}

TEST(Autotuner, WithNothingToTryItIsDoneAtOnce) {
  AutotuneSettings settings = FastSettings();
  settings.fusion_wait_ms = {0.0};
  settings.fusion_threshold_bytes = {64 * kMiB};
  Autotuner tuner(Defaults(), settings);
  EXPECT_TRUE(tuner.done());
  EXPECT_EQ(tuner.current().fusion_threshold_bytes, 64 * kMiB);
}

TEST(Autotuner, DoesNothingAfterItIsDone) {
  Autotuner tuner(Defaults(), FastSettings());
  RunToCompletion(&tuner, [](const TunedParameters&, int) { return 1e8; });
  ASSERT_TRUE(tuner.done());
  const TunedParameters final_parameters = tuner.current();
  for (int i = 0; i < 1000; ++i) {
    EXPECT_FALSE(tuner.Record(100.0 + i, 1 << 30));
  }
  EXPECT_TRUE(tuner.current() == final_parameters);
}

}  // namespace
}  // namespace mpistrategy
