// HandoffTuner with synthetic times: it keeps the faster way, finds a
// phase change, shrugs off single noisy probes, probes a clearly slower
// way ever more rarely, and lets the caches settle after a change of way.
// Most tests count single-collective probes (settle 0); the settling has
// tests of its own.

#include "cc/transport/handoff_tuner.h"

#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

namespace mpistrategy {
namespace {

constexpr int64_t kBytes = 4 << 20;

// Runs `collectives` collectives of kBytes through `tuner`, each taking
// `cost(way)` seconds per byte, and returns the ways used.
template <typename Cost>
std::vector<Handoff> RunCollectives(HandoffTuner* tuner, int collectives,
                                    Cost cost) {
  std::vector<Handoff> ways;
  for (int i = 0; i < collectives; ++i) {
    const Handoff way = tuner->Next();
    ways.push_back(way);
    tuner->Record(way, kBytes, cost(way) * kBytes);
  }
  return ways;
}

int Count(const std::vector<Handoff>& ways, Handoff way) {
  int n = 0;
  for (Handoff w : ways) n += w == way;
  return n;
}

// Probes of one collective, compared at once.
HandoffTunerSettings NoSettling() {
  HandoffTunerSettings settings;
  settings.settle = 0;
  return settings;
}

// Cached twice as fast as streaming, or the other way round.
double CachedFast(Handoff way) {
  return way == Handoff::kCached ? 1e-10 : 2e-10;
}
double StreamingFast(Handoff way) {
  return way == Handoff::kStreaming ? 1e-10 : 5e-10;
}

TEST(HandoffTunerTest, SwitchesToTheFasterWay) {
  HandoffTuner tuner(NoSettling());  // streaming first
  EXPECT_EQ(tuner.incumbent(), Handoff::kStreaming);
  // Three winning probes, every min_probe_gap (8) collectives.
  RunCollectives(&tuner, 3 * 8, CachedFast);
  EXPECT_EQ(tuner.incumbent(), Handoff::kCached);
  EXPECT_EQ(tuner.switches(), 1);
  // Then the streaming probes lose and get rare.
  const std::vector<Handoff> ways = RunCollectives(&tuner, 2000, CachedFast);
  EXPECT_EQ(tuner.incumbent(), Handoff::kCached);
  EXPECT_EQ(tuner.switches(), 1);
  // Gaps of 8, 16, ..., 256, then every 256.
  EXPECT_LE(Count(ways, Handoff::kStreaming), 12);
  EXPECT_GE(Count(ways, Handoff::kStreaming), 6);
}

TEST(HandoffTunerTest, KeepsTheFasterIncumbent) {
  HandoffTuner tuner(NoSettling());
  const std::vector<Handoff> ways =
      RunCollectives(&tuner, 5000, StreamingFast);
  EXPECT_EQ(tuner.incumbent(), Handoff::kStreaming);
  EXPECT_EQ(tuner.switches(), 0);
  EXPECT_LE(Count(ways, Handoff::kCached), 26);
}

TEST(HandoffTunerTest, FindsAPhaseChange) {
  HandoffTuner tuner(NoSettling());
  RunCollectives(&tuner, 3000, StreamingFast);
  ASSERT_EQ(tuner.incumbent(), Handoff::kStreaming);
  // The probes are 256 apart by now.  The first one after the change may
  // still be compared with the incumbent's times from before it and lose;
  // the next one wins, and two more 8 apart.
  RunCollectives(&tuner, 2 * 256 + 2 * 8, CachedFast);
  EXPECT_EQ(tuner.incumbent(), Handoff::kCached);
  // And back.
  RunCollectives(&tuner, 3000, CachedFast);
  RunCollectives(&tuner, 2 * 256 + 2 * 8, StreamingFast);
  EXPECT_EQ(tuner.incumbent(), Handoff::kStreaming);
  EXPECT_EQ(tuner.switches(), 2);
}

TEST(HandoffTunerTest, OneNoisyProbeDoesNotSwitch) {
  HandoffTuner tuner(NoSettling());
  int probes = 0;
  // Streaming is faster, but every other probe of the cached way happens
  // to be faster (a hiccup in the incumbent's collectives, say).
  for (int i = 0; i < 3000; ++i) {
    const Handoff way = tuner.Next();
    double cost = StreamingFast(way);
    if (way == Handoff::kCached && ++probes % 2 == 0) cost = 0.5e-10;
    tuner.Record(way, kBytes, cost * kBytes);
  }
  EXPECT_EQ(tuner.incumbent(), Handoff::kStreaming);
  EXPECT_EQ(tuner.switches(), 0);
}

TEST(HandoffTunerTest, NeedsTheMinimumGain) {
  HandoffTuner tuner(NoSettling());
  // Cached only 5% faster: not worth a switch (min_gain 10%).
  RunCollectives(&tuner, 3000, [](Handoff way) {
    return way == Handoff::kCached ? 0.95e-10 : 1e-10;
  });
  EXPECT_EQ(tuner.switches(), 0);
}

TEST(HandoffTunerTest, ComparesWithinASizeClass) {
  HandoffTuner tuner(NoSettling());
  // Small collectives cost more per byte than large ones whichever the
  // way; the cached way is slower at every size.  Probes on the small
  // size must not be compared with the large size's times.
  int i = 0;
  for (; i < 4000; ++i) {
    const int64_t bytes = i % 2 == 0 ? (512 << 10) : (16 << 20);
    const Handoff way = tuner.Next();
    double per_byte = bytes < (1 << 20) ? 10e-10 : 1e-10;
    if (way == Handoff::kCached) per_byte *= 1.5;
    tuner.Record(way, bytes, per_byte * static_cast<double>(bytes));
  }
  EXPECT_EQ(tuner.switches(), 0);
}

TEST(HandoffTunerTest, AProbeWithNothingToCompareDoesNotCount) {
  HandoffTunerSettings settings = NoSettling();
  settings.min_probe_gap = 1;  // every collective a probe
  settings.wins_to_switch = 1;
  HandoffTuner tuner(settings);
  // No incumbent time of this size yet: however fast, no switch.
  for (int i = 0; i < 10; ++i) {
    const Handoff way = tuner.Next();
    ASSERT_EQ(way, Handoff::kCached);
    tuner.Record(way, kBytes, 1e-9);
  }
  EXPECT_EQ(tuner.switches(), 0);
  // Zero bytes, and fewer than min_bytes, are ignored.
  tuner.Record(Handoff::kStreaming, 0, 1.0);
  tuner.Record(Handoff::kStreaming, settings.min_bytes - 1, 1.0);
  tuner.Record(Handoff::kCached, kBytes, 1e-9);
  tuner.Record(Handoff::kCached, settings.min_bytes - 1, 1e-9);
  EXPECT_EQ(tuner.switches(), 0);
  tuner.Record(Handoff::kStreaming, kBytes, 1.0);
  tuner.Record(Handoff::kCached, kBytes, 1e-9);
  EXPECT_EQ(tuner.incumbent(), Handoff::kCached);
}

// The plane reports a collective when the next timed one starts, after
// it asked for that one's way: reports one collective late.
TEST(HandoffTunerTest, SwitchesWithReportsOneLate) {
  HandoffTuner tuner(NoSettling());
  Handoff pending = tuner.incumbent();  // the first collective's way
  for (int i = 0; i < 200; ++i) {
    const Handoff next = tuner.Next();
    tuner.Record(pending, kBytes, CachedFast(pending) * kBytes);
    pending = next;
  }
  EXPECT_EQ(tuner.incumbent(), Handoff::kCached);
  EXPECT_EQ(tuner.switches(), 1);
}

// Probes compare with the median of the last three incumbent times: one
// fast or slow outlier among them changes nothing.
TEST(HandoffTunerTest, ComparesWithTheMedian) {
  for (const double outlier : {0.5e-10, 3e-10}) {
    HandoffTuner tuner(NoSettling());
    int incumbent_calls = 0;
    for (int i = 0; i < 3000; ++i) {
      const Handoff way = tuner.Next();
      // Streaming 1e-10 but every third time `outlier`; cached 0.85e-10
      // with a fast outlier among streaming's times (a win against the
      // median, a loss against the minimum), 1.5e-10 with a slow one (a
      // loss against the median, a win against the maximum).
      double cost = outlier < 1e-10 ? 0.85e-10 : 1.5e-10;
      if (way == Handoff::kStreaming) {
        cost = ++incumbent_calls % 3 == 0 ? outlier : 1e-10;
      }
      tuner.Record(way, kBytes, cost * kBytes);
      if (tuner.switches() > 0) break;
    }
    EXPECT_EQ(tuner.switches(), outlier < 1e-10 ? 1 : 0) << outlier;
  }
}

TEST(HandoffTunerTest, ForgetsTheOldIncumbentsTimesOnASwitch) {
  HandoffTunerSettings settings = NoSettling();
  settings.wins_to_switch = 1;
  HandoffTuner tuner(settings);
  for (int i = 0; i < 3; ++i) {
    tuner.Record(Handoff::kStreaming, kBytes, 1e-10 * kBytes);
  }
  tuner.Record(Handoff::kCached, kBytes, 0.5e-10 * kBytes);
  ASSERT_EQ(tuner.incumbent(), Handoff::kCached);
  // Nothing of the new incumbent's to compare with yet: a fast streaming
  // time is not a win (the kept times were streaming's own).
  tuner.Record(Handoff::kStreaming, kBytes, 0.1e-10 * kBytes);
  EXPECT_EQ(tuner.incumbent(), Handoff::kCached);
  EXPECT_EQ(tuner.switches(), 1);
}

TEST(HandoffTunerTest, OldTimesExpire) {
  HandoffTunerSettings settings = NoSettling();
  settings.wins_to_switch = 1;
  settings.min_probe_gap = 1;
  settings.max_probe_gap = 4;
  HandoffTuner tuner(settings);
  constexpr int64_t kRare = 64 << 20;
  tuner.Record(Handoff::kStreaming, kRare, 1e-10 * kRare);
  // 16 = kMaxAgeInGaps * max_probe_gap timed collectives of another size.
  for (int i = 0; i < 16; ++i) {
    tuner.Record(Handoff::kStreaming, kBytes, 1e-10 * kBytes);
  }
  tuner.Record(Handoff::kCached, kRare, 0.5e-10 * kRare);
  EXPECT_EQ(tuner.switches(), 1);  // 16 old: still compared
  HandoffTuner other(settings);
  other.Record(Handoff::kStreaming, kRare, 1e-10 * kRare);
  for (int i = 0; i < 17; ++i) {
    other.Record(Handoff::kStreaming, kBytes, 1e-10 * kBytes);
  }
  other.Record(Handoff::kCached, kRare, 0.5e-10 * kRare);
  EXPECT_EQ(other.switches(), 0);  // 17 old: expired
}

TEST(HandoffTunerTest, RaisesBadGaps) {
  HandoffTunerSettings settings = NoSettling();
  settings.min_probe_gap = 0;
  settings.max_probe_gap = -5;
  HandoffTuner tuner(settings);
  // Gaps of 1: every collective probes.
  for (int i = 0; i < 4; ++i) EXPECT_EQ(tuner.Next(), Handoff::kCached);
  settings.min_probe_gap = 8;
  settings.max_probe_gap = 2;  // raised to 8
  settings.settle = -3;        // raised to 0
  HandoffTuner fixed(settings);
  std::vector<Handoff> ways = RunCollectives(&fixed, 64, StreamingFast);
  EXPECT_EQ(Count(ways, Handoff::kCached), 8);
}

// As on the VM (RESULTS section 24): after a change to ordinary stores the
// first collective is as slow as streaming, the second four times slower,
// and from the third on they are twice as fast.
class SettlingCost {
 public:
  double operator()(Handoff way) {
    run_ = way == last_ ? run_ + 1 : 1;
    last_ = way;
    if (way == Handoff::kStreaming) return 1e-10;
    return run_ == 1 ? 1e-10 : run_ == 2 ? 4e-10 : 0.5e-10;
  }

 private:
  Handoff last_ = Handoff::kStreaming;
  int run_ = 0;
};

TEST(HandoffTunerTest, ProbesAfterTheCachesSettle) {
  HandoffTuner tuner;  // settle 2: probes of three collectives
  SettlingCost cost;
  std::vector<Handoff> ways;
  for (int i = 0; i < 200 && tuner.switches() == 0; ++i) {
    const Handoff way = tuner.Next();
    ways.push_back(way);
    tuner.Record(way, kBytes, cost(way) * kBytes);
  }
  EXPECT_EQ(tuner.incumbent(), Handoff::kCached);
  // Three probes of three collectives each.
  EXPECT_EQ(Count(ways, Handoff::kCached), 9);
  // Single-collective probes see only the unsettled caches.
  HandoffTuner hasty(NoSettling());
  SettlingCost cost2;
  for (int i = 0; i < 2000; ++i) {
    const Handoff way = hasty.Next();
    hasty.Record(way, kBytes, cost2(way) * kBytes);
  }
  EXPECT_EQ(hasty.switches(), 0);
}

TEST(HandoffTunerTest, TheIncumbentAfterAProbeSettlesToo) {
  HandoffTunerSettings settings;
  settings.wins_to_switch = 1;
  HandoffTuner tuner(settings);
  // Streaming settled at 1e-10 (the first two after the start not kept).
  for (int i = 0; i < 5; ++i) {
    tuner.Record(Handoff::kStreaming, kBytes, 1e-10 * kBytes);
  }
  // A probe of three cached that loses (only the third counts).
  tuner.Record(Handoff::kCached, kBytes, 0.1e-10 * kBytes);
  tuner.Record(Handoff::kCached, kBytes, 0.1e-10 * kBytes);
  tuner.Record(Handoff::kCached, kBytes, 2e-10 * kBytes);
  EXPECT_EQ(tuner.switches(), 0);
  // Back on streaming: two slow ones while the caches settle, not kept, so
  // the next probe still compares with 1e-10 and loses.
  tuner.Record(Handoff::kStreaming, kBytes, 9e-10 * kBytes);
  tuner.Record(Handoff::kStreaming, kBytes, 9e-10 * kBytes);
  tuner.Record(Handoff::kStreaming, kBytes, 1e-10 * kBytes);
  tuner.Record(Handoff::kCached, kBytes, 1e-10 * kBytes);
  tuner.Record(Handoff::kCached, kBytes, 1e-10 * kBytes);
  tuner.Record(Handoff::kCached, kBytes, 2e-10 * kBytes);
  EXPECT_EQ(tuner.switches(), 0);
}

TEST(HandoffTunerTest, Names) {
  EXPECT_STREQ(HandoffName(Handoff::kCached), "cached");
  EXPECT_STREQ(HandoffName(Handoff::kStreaming), "streaming");
}

}  // namespace
}  // namespace mpistrategy
