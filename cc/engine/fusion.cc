#include "cc/engine/fusion.h"

#include <map>
#include <tuple>

namespace mpistrategy {

std::vector<FusionBucket> PlanFusion(
    const std::vector<const Response*>& responses,
    const std::vector<int64_t>& bytes, int64_t threshold_bytes) {
  std::vector<FusionBucket> buckets;
  buckets.reserve(responses.size());
  // (dtype, op, device) -> index of its open bucket in `buckets`.
  std::map<std::tuple<DataType, ReduceOp, int32_t>, size_t> open;
  for (size_t i = 0; i < responses.size(); ++i) {
    const Response& r = *responses[i];
    // A mixed-dtype packed group is reduced segment by segment in its own
    // buffer, so it never shares a bucket.
    const bool fusible = threshold_bytes > 0 &&
                         r.type == ResponseType::kAllreduce &&
                         r.packed_dtypes.empty() &&
                         bytes[i] <= threshold_bytes;
    if (!fusible) {
      FusionBucket b;
      b.members.push_back(static_cast<int>(i));
      b.bytes = bytes[i];
      buckets.push_back(std::move(b));
      continue;
    }
    const auto key = std::make_tuple(r.dtype, r.reduce_op, r.device);
    auto it = open.find(key);
    if (it != open.end() &&
        buckets[it->second].bytes + bytes[i] <= threshold_bytes) {
      buckets[it->second].members.push_back(static_cast<int>(i));
      buckets[it->second].bytes += bytes[i];
      continue;
    }
    FusionBucket b;
    b.members.push_back(static_cast<int>(i));
    b.bytes = bytes[i];
    open[key] = buckets.size();
    buckets.push_back(std::move(b));
  }
  return buckets;
}

std::vector<FusionBucket> PlanFusion(const std::vector<Response>& responses,
                                     const std::vector<int64_t>& bytes,
                                     int64_t threshold_bytes) {
  std::vector<const Response*> pointers;
  pointers.reserve(responses.size());
  for (const Response& r : responses) pointers.push_back(&r);
  return PlanFusion(pointers, bytes, threshold_bytes);
}

}  // namespace mpistrategy
