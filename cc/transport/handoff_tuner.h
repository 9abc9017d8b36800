// How the shared-memory plane writes the lines that another rank's core
// reads next, and which of two ways is faster on this machine now.
//
//   kCached: ordinary stores.  The lines stay in the writer's caches and
//     the reader's core fetches them from there.
//   kStreaming: non-temporal stores (streaming_copy.h).  The lines go
//     towards memory and the reader's core fetches them from there.
//
// Which is faster depends on where the two cores sit, and on a VM that
// changes while a job runs: on the 2-vCPU development VM, two processes
// handing 1 MiB back and forth moved 16-42 GB/s with ordinary stores in
// some phases and 4 GB/s in others, 9-25 GB/s with streaming ones
// (bench/RESULTS.md sections 17 and 24).  So the plane measures.
//
// HandoffTuner does the measuring for rank 0 of a host, which publishes its
// choice to the host's other ranks (shm_plane.h).  It times only
// collectives of at least `min_bytes`; smaller ones use the incumbent.  A
// collective's time is rank 0's time copying and reducing, without the
// waits in barriers, whose length depends on the other ranks and the
// scheduler.  The tuner keeps an incumbent way and now and then picks the
// other one for a few timed collectives in a row (a probe).  The caches
// need a collective or two to settle after a change of way
// (bench/RESULTS.md section 24: on the VM the second collective after a
// switch to ordinary stores took four times as long as the third), so
// neither the probe's first `settle` collectives nor the incumbent's first
// ones after it are compared.  The probe's last collective's time per byte
// is compared with the median of the latest three timed collectives of the
// same power-of-two size class done the incumbent way.  The other way
// takes over after `wins_to_switch` probes in a row that were faster by
// `min_gain`.  A probe that loses doubles the gap to the next one, up to
// `max_probe_gap` timed collectives, so that a clearly slower way costs
// little while a phase change is still found a few probes later.
//
// Thread-compatible.  Clock-free (times are passed in), so tests drive it
// with synthetic times.

#ifndef MPISTRATEGY_CC_TRANSPORT_HANDOFF_TUNER_H_
#define MPISTRATEGY_CC_TRANSPORT_HANDOFF_TUNER_H_

#include <array>
#include <cstdint>

namespace mpistrategy {

enum class Handoff : uint32_t { kCached = 0, kStreaming = 1 };

// "cached" or "streaming".
const char* HandoffName(Handoff way);

struct HandoffTunerSettings {
  // The incumbent before any probe.  Streaming: its worst phase measured
  // (9 GB/s) is far better than the cached way's (4 GB/s).
  Handoff initial = Handoff::kStreaming;
  // Timed collectives between probes: at first, after a probe that won and
  // after a switch; doubled by each probe that lost, up to max_probe_gap.
  int64_t min_probe_gap = 8;
  int64_t max_probe_gap = 256;
  // Probes in a row that must win before the other way takes over.
  int wins_to_switch = 3;
  // Timed collectives after a change of way that are not compared; a
  // probe lasts settle + 1 timed collectives.
  int settle = 2;
  // A probe wins when its time per byte is below (1 - min_gain) times the
  // incumbent's.
  double min_gain = 0.1;
  // Collectives of fewer bytes are not timed: their lines stay in the
  // caches whichever the way, and they are too short to time well.
  int64_t min_bytes = 256 << 10;
};

class HandoffTuner {
 public:
  // Gaps below 1, a max_probe_gap below min_probe_gap and a negative
  // settle are raised.
  explicit HandoffTuner(const HandoffTunerSettings& settings = {});

  // The way the next timed collective uses (the incumbent, or a probe of
  // the other way).
  Handoff Next();
  // Reports a timed collective that used `way` (as Next() returned it; the
  // report may come after later Next() calls) and moved a vector of
  // `bytes` in `seconds`.  Collectives of fewer than settings.min_bytes are
  // ignored.
  void Record(Handoff way, int64_t bytes, double seconds);

  Handoff incumbent() const { return incumbent_; }
  // How often the incumbent changed.
  int switches() const { return switches_; }

 private:
  // Times per byte of the latest kKept incumbent collectives of a size
  // class (the power of 2 of their bytes), in a ring.
  static constexpr int kKept = 3;
  static constexpr int kClasses = 64;
  struct Recent {
    std::array<double, kKept> seconds_per_byte{};
    int64_t count = 0;    // recorded so far
    int64_t newest = 0;   // records_ when the newest was recorded
  };
  // The median of the kept times of `size_class`, or a negative number if
  // none is kept or more than kMaxAgeInGaps * max_probe_gap timed
  // collectives came since the newest (another phase of the machine,
  // maybe).
  double IncumbentSecondsPerByte(int size_class) const;
  static constexpr int64_t kMaxAgeInGaps = 4;

  const HandoffTunerSettings settings_;
  Handoff incumbent_;
  int64_t probe_gap_;
  int64_t since_probe_ = 0;
  int probe_left_ = 0;  // of the probe under way, after the current one
  // The way of the last reported collective, and how many in a row used it.
  Handoff last_way_;
  int same_way_ = 0;
  int64_t records_ = 0;  // timed collectives reported
  int wins_ = 0;
  int switches_ = 0;
  std::array<Recent, kClasses> recent_{};
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_TRANSPORT_HANDOFF_TUNER_H_
