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
// choice to the host's other ranks (shm_plane.h).  A collective's time is
// rank 0's time copying and reducing, without the waits in barriers, whose
// length depends on the other ranks and the scheduler.  The tuner keeps an
// incumbent way and now and then picks the other one for a single
// collective (a probe), whose time per byte it compares with the latest
// collectives of similar size (within a factor of 2) done the incumbent
// way.  The other way takes over after `wins_to_switch` probes in a row
// that were faster by `min_gain`.  A probe that loses doubles the gap to
// the next one, up to `max_probe_gap` collectives, so that a clearly slower
// way costs little while a phase change is still found a few probes later.
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
  // (11 GB/s) is far better than the cached way's (4 GB/s).
  Handoff initial = Handoff::kStreaming;
  // Collectives between probes: at first, after a probe that won and after
  // a switch; doubled by each probe that lost, up to max_probe_gap.
  int min_probe_gap = 8;
  int max_probe_gap = 256;
  // Probes in a row that must win before the other way takes over.
  int wins_to_switch = 3;
  // A probe wins when its time per byte is below (1 - min_gain) times the
  // incumbent's.
  double min_gain = 0.1;
  // Collectives of fewer bytes per rank are not counted: their lines stay
  // in the caches whichever the way, and they are too short to time well.
  // (They may still be probes, since a way is picked before its
  // collective's size is known.)
  int64_t min_bytes = 256 << 10;
};

class HandoffTuner {
 public:
  explicit HandoffTuner(const HandoffTunerSettings& settings = {});

  // The way the next collective uses (the incumbent, or a probe of the
  // other way).
  Handoff Next();
  // Reports a collective that used `way` (as Next() returned it) and moved
  // `bytes` per rank in `seconds`.  Collectives of fewer than
  // settings.min_bytes are ignored.
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
    int64_t count = 0;  // recorded so far
  };
  // The median of the kept times of `size_class`, or a negative number if
  // none is kept.
  double IncumbentSecondsPerByte(int size_class) const;

  const HandoffTunerSettings settings_;
  Handoff incumbent_;
  int probe_gap_;
  int since_probe_ = 0;
  int wins_ = 0;
  int switches_ = 0;
  std::array<Recent, kClasses> recent_{};
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_TRANSPORT_HANDOFF_TUNER_H_
