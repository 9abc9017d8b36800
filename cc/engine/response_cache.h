// The response cache behind the bit-vector fast path.
//
// Every rank inserts the coordinator's successful responses in the order of
// the broadcast response list, so entry i (its "bit") names the same
// collective on every rank.  A rank sets bit i in a cycle when it has a
// pending, unannounced entry whose request matches entry i; if the bit
// survives the cross-rank AND, every rank has a matching request and the
// cached response can run without talking to the coordinator.
//
// Policy: a name negotiated again with different parameters replaces its
// entry in place (same bit); once `capacity` names are cached, new names are
// simply not cached (no eviction, so bits never move).
//
// Thread-compatible; used by the engine thread only.

#ifndef MPISTRATEGY_CC_ENGINE_RESPONSE_CACHE_H_
#define MPISTRATEGY_CC_ENGINE_RESPONSE_CACHE_H_

#include <string>
#include <unordered_map>
#include <vector>

#include "cc/engine/message.h"

namespace mpistrategy {

// True when `request` (from request.rank, in a world of `world_size` ranks)
// is what that rank submitted for `response`: same type, dtype, op, root,
// device and shape, and, for allgather/alltoall, this rank's first dimension
// / splits row.  `response` must be a single-name, non-error response.
bool ResponseMatchesRequest(const Response& response, const Request& request,
                            int world_size);

class ResponseCache {
 public:
  // capacity >= 0; 0 disables caching.
  explicit ResponseCache(int capacity) : capacity_(capacity) {}

  // Number of cached entries; bits are [0, size()).
  int size() const { return static_cast<int>(entries_.size()); }

  // The bit of the entry for request.name when it matches `request`,
  // otherwise -1.
  int Lookup(const Request& request, int world_size) const;

  // Entry `bit`; 0 <= bit < size().
  const Response& Get(int bit) const { return entries_[bit]; }

  // Inserts (or replaces in place) a single-name, non-error response.
  // Ignores error responses and multi-name responses.
  void Put(const Response& response);

 private:
  int capacity_;
  std::vector<Response> entries_;
  std::unordered_map<std::string, int> bit_by_name_;
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_ENGINE_RESPONSE_CACHE_H_
