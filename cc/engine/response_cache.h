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
// entry in place (same bit).  Once `capacity` names are cached, a new name
// takes the bit of the least recently used entry, so one-shot names (say,
// explicit names with a step counter) cannot crowd out a training step's
// collectives for good.  "Used" means inserted or executed from the cache
// (Touch); every rank executes the same responses in the same order, so
// every rank evicts the same entry and the bits keep naming the same
// collective everywhere.
// Evictions happen only in slow cycles, where no rank relies on its bits.
//
// Thread-compatible; used by the engine thread only.

#ifndef MPISTRATEGY_CC_ENGINE_RESPONSE_CACHE_H_
#define MPISTRATEGY_CC_ENGINE_RESPONSE_CACHE_H_

#include <cstdint>
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

  // Inserts (or replaces in place) a single-name, non-error response and
  // marks it used; when the cache is full, the least recently used entry
  // gives up its bit.  Ignores error responses and multi-name responses.
  void Put(const Response& response);

  // Marks entry `bit` used (it ran from the cache); 0 <= bit < size().
  void Touch(int bit) { last_used_[bit] = ++uses_; }

 private:
  int capacity_;
  std::vector<Response> entries_;
  std::vector<uint64_t> last_used_;  // per bit, in units of uses_
  uint64_t uses_ = 0;
  std::unordered_map<std::string, int> bit_by_name_;
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_ENGINE_RESPONSE_CACHE_H_
