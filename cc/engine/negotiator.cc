#include "cc/engine/negotiator.h"

#include <algorithm>
#include <utility>

namespace mpistrategy {

namespace {

std::string Mismatch(const Request& a, const Request& b,
                     const std::string& field, const std::string& va,
                     const std::string& vb, const std::string& suffix = "") {
  return std::string("Mismatched ") + CollectiveTypeName(a.type) + " \"" +
         a.name + "\": rank " + std::to_string(a.rank) + " has " + field +
         " " + va + " but rank " + std::to_string(b.rank) + " has " + field +
         " " + vb + suffix;
}

bool IsHalfFloat(DataType dtype) {
  return dtype == DataType::kFloat16 || dtype == DataType::kBFloat16;
}

bool IsWideFloat(DataType dtype) {
  return dtype == DataType::kFloat32 || dtype == DataType::kFloat64;
}

// A dtype mismatch message.  A 16-bit float against a wider one is what
// ranks built with different compressions submit (compression casts before
// the engine sees the tensor), so the message says so.
std::string DtypeMismatch(const Request& a, const Request& b, DataType da,
                          DataType db, const std::string& suffix = "") {
  std::string hint;
  if ((IsHalfFloat(da) && IsWideFloat(db)) ||
      (IsWideFloat(da) && IsHalfFloat(db))) {
    hint = " (16-bit floats against wider ones: do all ranks use the same "
           "compression?)";
  }
  return Mismatch(a, b, "dtype", DataTypeName(da), DataTypeName(db),
                  suffix + hint);
}

// A shape mismatch where one rank's tensor is empty: typically a per-row
// value (an unreduced loss) on a rank that a short last batch left no rows,
// against a scalar or full tensor elsewhere, so the message says so.
std::string EmptyTensorHint(const Request& a, const Request& b) {
  const bool a_empty = NumElements(a.shape) == 0;
  if (a_empty == (NumElements(b.shape) == 0)) return "";
  return " (rank " + std::to_string(a_empty ? a.rank : b.rank) +
         "'s tensor has no elements: did a short last batch leave that rank "
         "no rows? Reduce per-row values to one value per rank first, e.g. "
         "with tf.nn.compute_average_loss)";
}

bool TrailingDimsMatch(const Shape& a, const Shape& b) {
  return a.size() == b.size() && !a.empty() &&
         std::equal(a.begin() + 1, a.end(), b.begin() + 1);
}

// Dtype of tensor `i` of a packed group: its own in a mixed-dtype group,
// else the buffer's.
DataType PackedDtype(const Request& q, size_t i) {
  return q.packed_dtypes.empty() ? q.dtype : q.packed_dtypes[i];
}

std::string CalledWhat(const Request& q) {
  if (!q.grouped) return CollectiveTypeName(q.type);
  return "grouped_allreduce of " + std::to_string(q.packed_shapes.size()) +
         " tensors";
}

// Empty string when the packed groups of `a` and `b` (if any) agree tensor
// by tensor.
std::string ComparePackedGroups(const Request& a, const Request& b) {
  if (!a.grouped && !b.grouped) return "";
  if (a.grouped != b.grouped) {
    return "Mismatched collective \"" + a.name + "\": rank " +
           std::to_string(a.rank) + " called " + CalledWhat(a) +
           " but rank " + std::to_string(b.rank) + " called " + CalledWhat(b);
  }
  if (a.packed_shapes.size() != b.packed_shapes.size()) {
    return Mismatch(a, b, "a group of",
                    std::to_string(a.packed_shapes.size()) + " tensors",
                    std::to_string(b.packed_shapes.size()) + " tensors");
  }
  for (size_t i = 0; i < a.packed_shapes.size(); ++i) {
    const std::string tensor = " for grouped tensor " + std::to_string(i);
    if (PackedDtype(a, i) != PackedDtype(b, i)) {
      return DtypeMismatch(a, b, PackedDtype(a, i), PackedDtype(b, i),
                           tensor);
    }
    if (a.packed_shapes[i] != b.packed_shapes[i]) {
      return Mismatch(a, b, "shape", ShapeString(a.packed_shapes[i]),
                      ShapeString(b.packed_shapes[i]), tensor);
    }
  }
  return "";
}

// Empty string when `b` agrees with the reference `a`.
std::string CompareRequests(const Request& a, const Request& b) {
  if (a.type != b.type) {
    return "Mismatched collective \"" + a.name + "\": rank " +
           std::to_string(a.rank) + " called " + CollectiveTypeName(a.type) +
           " but rank " + std::to_string(b.rank) + " called " +
           CollectiveTypeName(b.type);
  }
  if (a.type == CollectiveType::kBarrier) return "";
  // Before dtype and shape: a packed group's buffer agrees whenever its
  // tensors do, and naming the tensor that differs is the useful message.
  const std::string group = ComparePackedGroups(a, b);
  if (!group.empty()) return group;
  if (a.dtype != b.dtype) {
    return DtypeMismatch(a, b, a.dtype, b.dtype);
  }
  if ((a.type == CollectiveType::kAllreduce ||
       a.type == CollectiveType::kReducescatter) &&
      a.reduce_op != b.reduce_op) {
    return Mismatch(a, b, "reduce op", ReduceOpName(a.reduce_op),
                    ReduceOpName(b.reduce_op));
  }
  if (a.type == CollectiveType::kBroadcast && a.root_rank != b.root_rank) {
    return Mismatch(a, b, "root rank", std::to_string(a.root_rank),
                    std::to_string(b.root_rank));
  }
  if (a.device != b.device) {
    return Mismatch(a, b, "device", DeviceString(a.device),
                    DeviceString(b.device));
  }
  if (a.type == CollectiveType::kAllgather ||
      a.type == CollectiveType::kAlltoall) {
    if (!TrailingDimsMatch(a.shape, b.shape)) {
      return Mismatch(a, b, "shape", ShapeString(a.shape),
                      ShapeString(b.shape),
                      " (all dimensions but the first must match)");
    }
  } else if (a.shape != b.shape) {
    return Mismatch(a, b, "shape", ShapeString(a.shape), ShapeString(b.shape),
                    EmptyTensorHint(a, b));
  }
  return "";
}

// The ranks in 0..size-1 for which `in[r] == want`.
std::vector<int> RanksWhere(const std::vector<bool>& in, bool want) {
  std::vector<int> ranks;
  for (size_t r = 0; r < in.size(); ++r) {
    if (in[r] == want) ranks.push_back(static_cast<int>(r));
  }
  return ranks;
}

}  // namespace

bool IsBlockingJoin(const Request& request) {
  return request.type == CollectiveType::kBarrier &&
         request.name.rfind(kBlockingJoinPrefix, 0) == 0;
}

Response BuildResponse(const std::string& name,
                       const std::vector<Request>& requests) {
  Response response;
  response.names.push_back(name);
  // A rank's invalid arguments first: the others' requests may agree with
  // each other, and this is what is wrong.
  for (const Request& q : requests) {
    if (!q.invalid.empty()) {
      response.type = ResponseType::kError;
      response.error_code = StatusCode::kInvalidArgument;
      response.error_message =
          q.invalid + " (on rank " + std::to_string(q.rank) + ")";
      return response;
    }
  }
  const Request& ref = requests[0];
  for (size_t r = 1; r < requests.size(); ++r) {
    std::string mismatch = CompareRequests(ref, requests[r]);
    if (!mismatch.empty()) {
      response.type = ResponseType::kError;
      response.error_code = StatusCode::kFailedPrecondition;
      response.error_message = std::move(mismatch);
      return response;
    }
  }
  const int size = static_cast<int>(requests.size());
  response.type = ToResponseType(ref.type);
  response.dtype = ref.dtype;
  response.reduce_op = ref.reduce_op;
  response.root_rank = ref.root_rank;
  response.device = ref.device;
  response.shapes.push_back(ref.shape);
  response.packed_shapes = ref.packed_shapes;
  response.packed_dtypes = ref.packed_dtypes;
  if (ref.type == CollectiveType::kAllgather) {
    for (const Request& q : requests) response.first_dims.push_back(q.shape[0]);
  } else if (ref.type == CollectiveType::kAlltoall) {
    for (const Request& q : requests) {
      if (static_cast<int>(q.splits.size()) != size) {
        response = Response();
        response.names.push_back(name);
        response.type = ResponseType::kError;
        response.error_code = StatusCode::kFailedPrecondition;
        response.error_message =
            "Mismatched alltoall \"" + name + "\": rank " +
            std::to_string(q.rank) + " sent " +
            std::to_string(q.splits.size()) + " splits for " +
            std::to_string(size) + " ranks";
        return response;
      }
      response.splits.insert(response.splits.end(), q.splits.begin(),
                             q.splits.end());
    }
  }
  return response;
}

Negotiator::Negotiator(int world_size, StallInspector stall, Clock clock)
    : world_size_(world_size), stall_(stall), clock_(std::move(clock)) {}

void Negotiator::AddRequestList(int rank, const RequestList& list) {
  if (list.shutdown && !shutdown_) {
    shutdown_ = true;
    shutdown_rank_ = rank;
    shutdown_reason_ = list.shutdown_reason.empty()
                           ? DescribeRank(rank, peers_) + " shut down"
                           : list.shutdown_reason;
  }
  for (const Request& q : list.requests) {
    auto it = table_.find(q.name);
    if (it == table_.end()) {
      Entry e;
      e.pending.name = q.name;
      e.pending.first_seen_seconds = clock_();
      e.pending.submitted.assign(world_size_, false);
      e.requests.resize(world_size_);
      e.blocking_join = IsBlockingJoin(q);
      it = table_.emplace(q.name, std::move(e)).first;
    }
    Entry& e = it->second;
    // A rank cannot announce a name twice (Enqueue rejects duplicates in
    // flight), so a repeat is a protocol bug; keep the first.
    if (e.pending.submitted[rank]) continue;
    e.pending.submitted[rank] = true;
    e.requests[rank] = q;
    e.requests[rank].rank = rank;
    if (++e.count == world_size_) ready_.push_back(q.name);
  }
}

ResponseList Negotiator::ComputeResponses(std::vector<std::string>* warnings) {
  ResponseList list;
  for (const std::string& name : ready_) {
    auto it = table_.find(name);
    if (it == table_.end()) continue;
    list.responses.push_back(BuildResponse(name, it->second.requests));
    table_.erase(it);
  }
  ready_.clear();
  FailCrossedJoins(&list);
  if (stall_.enabled() && !table_.empty()) {
    std::vector<PendingCollective*> pending;
    pending.reserve(table_.size());
    for (auto& kv : table_) pending.push_back(&kv.second.pending);
    // Deterministic log/response order.
    std::sort(pending.begin(), pending.end(),
              [](const PendingCollective* a, const PendingCollective* b) {
                return a->first_seen_seconds != b->first_seen_seconds
                           ? a->first_seen_seconds < b->first_seen_seconds
                           : a->name < b->name;
              });
    StallReport report = stall_.Inspect(pending, clock_(), peers_);
    for (std::string& w : report.warnings) warnings->push_back(std::move(w));
    for (StallTimeout& t : report.timeouts) {
      Response r;
      r.type = ResponseType::kError;
      r.names.push_back(t.name);
      r.error_code = t.status.code();
      r.error_message = t.status.message();
      r.error_ranks = std::move(t.submitted_ranks);
      list.responses.push_back(std::move(r));
      table_.erase(t.name);
    }
  }
  if (shutdown_) {
    list.shutdown = true;
    list.shutdown_rank = shutdown_rank_;
    list.shutdown_reason = shutdown_reason_;
  }
  return list;
}

void Negotiator::FailCrossedJoins(ResponseList* list) {
  // The common case (no join pending) costs one pass and no allocation.
  if (std::none_of(table_.begin(), table_.end(), [](const auto& kv) {
        return kv.second.blocking_join;
      })) {
    return;
  }
  std::vector<Entry*> entries;
  for (auto& kv : table_) entries.push_back(&kv.second);
  // Deterministic response order.
  std::sort(entries.begin(), entries.end(), [](const Entry* a, const Entry* b) {
    return a->pending.first_seen_seconds != b->pending.first_seen_seconds
               ? a->pending.first_seen_seconds < b->pending.first_seen_seconds
               : a->pending.name < b->pending.name;
  });
  const double now = clock_();
  std::vector<const Entry*> failed;
  auto is_failed = [&failed](const Entry* e) {
    return std::find(failed.begin(), failed.end(), e) != failed.end();
  };
  for (Entry* join : entries) {
    if (!join->blocking_join || is_failed(join)) continue;
    const std::vector<bool>& joined = join->pending.submitted;
    // Crossed when every rank that did not join waits in a collective that
    // some joined rank has not submitted (and will not before the join
    // completes).  A rank in no such collective may still be on its way to
    // the join: then the caller's timeout decides.  Per rank, the first such
    // collective, for the message.
    bool all_crossed = true;
    std::vector<int> crossed;
    std::vector<const Entry*> crossed_in;
    std::vector<Entry*> waits;  // all such collectives
    for (int r = 0; r < world_size_; ++r) {
      if (joined[r]) continue;
      const Entry* first = nullptr;
      for (Entry* other : entries) {
        if (other == join || is_failed(other) ||
            !other->pending.submitted[r]) {
          continue;
        }
        bool blocked = false;
        for (int s = 0; s < world_size_ && !blocked; ++s) {
          blocked = joined[s] && !other->pending.submitted[s];
        }
        if (!blocked) continue;
        if (first == nullptr) first = other;
        if (std::find(waits.begin(), waits.end(), other) == waits.end()) {
          waits.push_back(other);
        }
      }
      if (first == nullptr) {
        all_crossed = false;
        break;
      }
      crossed.push_back(r);
      crossed_in.push_back(first);
    }
    if (!all_crossed) {
      join->crossed_since = -1.0;
      continue;
    }
    if (join->crossed_since < 0.0) join->crossed_since = now;
    if (now - join->crossed_since < kCrossedJoinSeconds) continue;

    const std::string& name = join->pending.name;
    const std::vector<int> in_join = RanksWhere(joined, true);
    const std::vector<int> missing = RanksWhere(joined, false);
    std::string where;
    for (size_t i = 0; i < crossed.size(); ++i) {
      const Entry* x = crossed_in[i];
      where += (i == 0 ? "" : "; ") + DescribeRank(crossed[i], peers_) +
               " waits in " +
               CollectiveTypeName(x->requests[crossed[i]].type) + " \"" +
               x->pending.name + "\", which " +
               DescribeRanks(RanksWhere(x->pending.submitted, false), peers_) +
               " did not submit";
    }
    Response r;
    r.type = ResponseType::kError;
    r.names.push_back(name);
    r.error_code = StatusCode::kFailedPrecondition;
    r.error_message =
        "Blocking join \"" + name + "\" cannot complete: " +
        DescribeRanks(missing, peers_) + " did not enter it; " + where +
        ". The ranks are crossed (they run different code): every rank must "
        "make the call that enters the join.";
    r.error_ranks.assign(in_join.begin(), in_join.end());
    list->responses.push_back(std::move(r));
    failed.push_back(join);
    for (Entry* x : waits) {
      const std::vector<int> have = RanksWhere(x->pending.submitted, true);
      std::vector<int> blocked;
      for (int s : in_join) {
        if (!x->pending.submitted[s]) blocked.push_back(s);
      }
      const Request& q = x->requests[have[0]];
      Response e;
      e.type = ResponseType::kError;
      e.names.push_back(x->pending.name);
      e.error_code = StatusCode::kFailedPrecondition;
      e.error_message =
          std::string(CollectiveTypeName(q.type)) + " \"" + x->pending.name +
          "\" cannot complete: " + DescribeRanks(blocked, peers_) +
          " will not submit it, being blocked in the blocking join \"" +
          name + "\", which " + DescribeRanks(missing, peers_) +
          " did not enter. The ranks are crossed (they run different code): "
          "every rank must make the call that enters the join.";
      e.error_ranks.assign(have.begin(), have.end());
      list->responses.push_back(std::move(e));
      failed.push_back(x);
    }
  }
  for (const Entry* e : failed) {
    const std::string name = e->pending.name;  // `e` dies with the erase
    table_.erase(name);
  }
}

}  // namespace mpistrategy
