// Fusion planning: which responses of one cycle share one transport call.
//
// A pure function of the ordered response list, so every rank computes the
// same plan and issues the same transport calls in the same order.

#ifndef MPISTRATEGY_CC_ENGINE_FUSION_H_
#define MPISTRATEGY_CC_ENGINE_FUSION_H_

#include <cstdint>
#include <vector>

#include "cc/engine/message.h"

namespace mpistrategy {

// Responses executed together; `members` index the planner's input list and
// are in list order.  `bytes` is the sum of the members' payload bytes.
struct FusionBucket {
  std::vector<int> members;
  int64_t bytes = 0;
};

// Packs allreduce responses with identical (dtype, reduce_op, device)
// greedily: each such key has at most one open bucket, a response joins it
// while the bucket's total stays <= `threshold_bytes`, otherwise the bucket
// closes and the response opens a new one.  Everything else (other
// collectives, errors, allreduces larger than the threshold, mixed-dtype
// packed groups, or any response when `threshold_bytes` is 0) is a bucket of
// its own.  Buckets are returned in the order of their first member.
//
// Args:
//   responses: the cycle's ordered responses.
//   bytes: payload bytes of each response (same length as `responses`).
//   threshold_bytes: EngineConfig::fusion_threshold_bytes (>= 0).
std::vector<FusionBucket> PlanFusion(
    const std::vector<const Response*>& responses,
    const std::vector<int64_t>& bytes, int64_t threshold_bytes);

// Same, over values (tests).
std::vector<FusionBucket> PlanFusion(const std::vector<Response>& responses,
                                     const std::vector<int64_t>& bytes,
                                     int64_t threshold_bytes);

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_ENGINE_FUSION_H_
