// A copy whose destination another core reads next.
//
// The shared-memory data plane hands every round of a large allreduce from
// one core to another through its segment.  With ordinary stores the
// written lines stay in the writer's caches and each reader fetches them
// from there, a cross-core transfer that on a 2-vCPU VM ran at 4 GB/s
// instead of 42 GB/s for tens of seconds at a time; non-temporal stores
// send the lines towards memory, which every core reads at the same speed
// (bench/RESULTS.md section 18).  In other phases ordinary stores are twice
// as fast (section 24), so the plane measures which to use
// (cc/transport/handoff_tuner.h).

#ifndef MPISTRATEGY_CC_COMMON_STREAMING_COPY_H_
#define MPISTRATEGY_CC_COMMON_STREAMING_COPY_H_

#include <cstdint>

namespace mpistrategy {

// Copies below this many bytes are plain memcpy: aligning the destination
// and fencing would cost more than the stores save.
constexpr int64_t kMinStreamingCopyBytes = 4 << 10;

// Copies `bytes` from `src` to `dst` (the two do not overlap) with
// non-temporal stores where the CPU has them (x86-64; memcpy elsewhere and
// below kMinStreamingCopyBytes), then fences them, so that a release store
// after the call (a barrier's arrival) publishes the data to other cores.
// Thread-compatible.
void StreamingCopy(void* dst, const void* src, int64_t bytes);

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_COMMON_STREAMING_COPY_H_
