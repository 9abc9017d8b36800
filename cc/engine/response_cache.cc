#include "cc/engine/response_cache.h"

#include <algorithm>

namespace mpistrategy {

namespace {

bool SameTrailingDims(const Shape& a, const Shape& b) {
  return a.size() == b.size() && !a.empty() &&
         std::equal(a.begin() + 1, a.end(), b.begin() + 1);
}

}  // namespace

bool ResponseMatchesRequest(const Response& response, const Request& request,
                            int world_size) {
  if (response.type == ResponseType::kError || response.names.size() != 1 ||
      response.shapes.size() != 1 ||
      response.type != ToResponseType(request.type) ||
      response.names[0] != request.name || response.device != request.device) {
    return false;
  }
  if (request.type == CollectiveType::kBarrier) return true;
  if (response.dtype != request.dtype ||
      response.reduce_op != request.reduce_op ||
      response.root_rank != request.root_rank) {
    return false;
  }
  const int rank = request.rank;
  if (rank < 0 || rank >= world_size) return false;
  switch (request.type) {
    case CollectiveType::kAllgather:
      return SameTrailingDims(response.shapes[0], request.shape) &&
             static_cast<int>(response.first_dims.size()) == world_size &&
             response.first_dims[rank] == request.shape[0];
    case CollectiveType::kAlltoall: {
      if (!SameTrailingDims(response.shapes[0], request.shape) ||
          static_cast<int>(request.splits.size()) != world_size ||
          response.splits.size() !=
              static_cast<size_t>(world_size) * world_size) {
        return false;
      }
      return std::equal(request.splits.begin(), request.splits.end(),
                        response.splits.begin() +
                            static_cast<size_t>(rank) * world_size);
    }
    default:
      return response.shapes[0] == request.shape &&
             response.packed_shapes == request.packed_shapes &&
             response.packed_dtypes == request.packed_dtypes;
  }
}

int ResponseCache::Lookup(const Request& request, int world_size) const {
  auto it = bit_by_name_.find(request.name);
  if (it == bit_by_name_.end()) return -1;
  return ResponseMatchesRequest(entries_[it->second], request, world_size)
             ? it->second
             : -1;
}

void ResponseCache::Put(const Response& response) {
  if (response.type == ResponseType::kError || response.names.size() != 1) {
    return;
  }
  if (capacity_ <= 0) return;
  auto it = bit_by_name_.find(response.names[0]);
  if (it != bit_by_name_.end()) {
    entries_[it->second] = response;
    Touch(it->second);
    return;
  }
  if (size() < capacity_) {
    bit_by_name_.emplace(response.names[0], size());
    entries_.push_back(response);
    last_used_.push_back(0);
    Touch(size() - 1);
    return;
  }
  const int victim = static_cast<int>(
      std::min_element(last_used_.begin(), last_used_.end()) -
      last_used_.begin());
  bit_by_name_.erase(entries_[victim].names[0]);
  bit_by_name_.emplace(response.names[0], victim);
  entries_[victim] = response;
  Touch(victim);
}

}  // namespace mpistrategy
