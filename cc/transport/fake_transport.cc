#include "cc/transport/fake_transport.h"

#include <chrono>
#include <cstring>

#include "cc/engine/reduce_kernels.h"

namespace mpistrategy {

namespace {

enum Op {
  kOpBitwiseAnd,
  kOpGather,
  kOpBroadcastBytes,
  kOpAllreduce,
  kOpAllgatherv,
  kOpBroadcast,
  kOpReducescatter,
  kOpAlltoallv,
  kOpBarrier,
};

const char* OpName(int op) {
  static const char* const kNames[] = {
      "BitwiseAnd", "GatherBytes", "BroadcastBytes", "Allreduce",
      "Allgatherv", "Broadcast",   "Reducescatter",  "Alltoallv",
      "Barrier"};
  return op >= 0 && op <= kOpBarrier ? kNames[op] : "?";
}

struct ReduceArgs {
  const void* in;
  int64_t count;
  DataType dtype;
  ReduceOp op;
};

struct AlltoallArgs {
  const void* in;
  const std::vector<int64_t>* send_bytes;
};

}  // namespace

std::shared_ptr<FakeWorld> FakeWorld::Create(int size, int ranks_per_host,
                                             double timeout_seconds) {
  return std::shared_ptr<FakeWorld>(new FakeWorld(
      size, ranks_per_host > 0 ? ranks_per_host : size, timeout_seconds));
}

FakeWorld::FakeWorld(int size, int ranks_per_host, double timeout_seconds)
    : size_(size),
      ranks_per_host_(ranks_per_host),
      timeout_seconds_(timeout_seconds),
      slots_(size) {}

std::unique_ptr<Transport> FakeWorld::CreateTransport(int rank) {
  return std::unique_ptr<Transport>(
      new FakeTransport(shared_from_this(), rank, ranks_per_host_));
}

// Two-phase rendezvous.  A generation counter makes the barrier reusable;
// arrivals in [0, size) are phase 1, [size, 2 * size) phase 2.
Status FakeWorld::Wait(std::unique_lock<std::mutex>* lock) {
  const int64_t gen = generation_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return Status::Ok();
  }
  if (!cv_.wait_for(*lock, std::chrono::duration<double>(timeout_seconds_),
                    [&] { return generation_ != gen; })) {
    return Status::Unavailable("FakeTransport: ranks did not meet within " +
                               std::to_string(timeout_seconds_) + " s");
  }
  return Status::Ok();
}

Status FakeWorld::Arrive(int rank, int op, const void* args,
                         const std::vector<Slot>** slots) {
  std::unique_lock<std::mutex> lock(mu_);
  slots_[rank].op = op;
  slots_[rank].args = args;
  MPISTRATEGY_RETURN_IF_ERROR(Wait(&lock));
  for (int r = 0; r < size_; ++r) {
    if (slots_[r].op != op) {
      // Still complete the second phase so the others are not stranded.
      Wait(&lock);
      return Status::Internal(std::string("FakeTransport: rank ") +
                              std::to_string(rank) + " called " + OpName(op) +
                              " but rank " + std::to_string(r) + " called " +
                              OpName(slots_[r].op));
    }
  }
  *slots = &slots_;
  return Status::Ok();
}

Status FakeWorld::Leave(int /*rank*/) {
  std::unique_lock<std::mutex> lock(mu_);
  return Wait(&lock);
}

FakeTransport::FakeTransport(std::shared_ptr<FakeWorld> world, int rank,
                             int ranks_per_host)
    : world_(std::move(world)), rank_(rank), ranks_per_host_(ranks_per_host) {}

int FakeTransport::local_size() const {
  const int host = rank_ / ranks_per_host_;
  const int first = host * ranks_per_host_;
  const int n = world_->size() - first;
  return n < ranks_per_host_ ? n : ranks_per_host_;
}

Status FakeTransport::BitwiseAnd(std::vector<uint64_t>* bits) {
  ++num_bitwise_and_;
  const std::vector<uint64_t> mine = *bits;
  const std::vector<FakeWorld::Slot>* slots = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(world_->Arrive(rank_, kOpBitwiseAnd, &mine, &slots));
  for (const FakeWorld::Slot& s : *slots) {
    const auto* theirs = static_cast<const std::vector<uint64_t>*>(s.args);
    if (theirs->size() != mine.size()) {
      world_->Leave(rank_);
      return Status::Internal("FakeTransport: BitwiseAnd length mismatch");
    }
    for (size_t i = 0; i < mine.size(); ++i) (*bits)[i] &= (*theirs)[i];
  }
  return world_->Leave(rank_);
}

Status FakeTransport::GatherBytes(const std::string& mine,
                                  std::vector<std::string>* all) {
  ++num_gather_;
  const std::vector<FakeWorld::Slot>* slots = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(world_->Arrive(rank_, kOpGather, &mine, &slots));
  all->clear();
  if (rank_ == 0) {
    for (const FakeWorld::Slot& s : *slots) {
      all->push_back(*static_cast<const std::string*>(s.args));
    }
  }
  return world_->Leave(rank_);
}

Status FakeTransport::BroadcastBytes(std::string* bytes) {
  const std::vector<FakeWorld::Slot>* slots = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(
      world_->Arrive(rank_, kOpBroadcastBytes, bytes, &slots));
  if (rank_ != 0) *bytes = *static_cast<const std::string*>((*slots)[0].args);
  return world_->Leave(rank_);
}

Status FakeTransport::Allreduce(const void* in, void* out, int64_t count,
                                DataType dtype, ReduceOp op) {
  ++num_allreduce_;
  const int64_t bytes = count * DataTypeSize(dtype);
  // Read everyone's input before anybody writes an (in-place) output.
  std::vector<char> mine(static_cast<const char*>(in),
                         static_cast<const char*>(in) + bytes);
  ReduceArgs args{mine.data(), count, dtype, op};
  const std::vector<FakeWorld::Slot>* slots = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(world_->Arrive(rank_, kOpAllreduce, &args, &slots));
  std::vector<char> acc(static_cast<const char*>(
                            static_cast<const ReduceArgs*>((*slots)[0].args)->in),
                        static_cast<const char*>(
                            static_cast<const ReduceArgs*>((*slots)[0].args)->in) +
                            bytes);
  for (size_t r = 1; r < slots->size(); ++r) {
    const auto* a = static_cast<const ReduceArgs*>((*slots)[r].args);
    if (a->count != count || a->dtype != dtype || a->op != op) {
      world_->Leave(rank_);
      return Status::Internal("FakeTransport: Allreduce arguments differ");
    }
    ReduceInto(dtype, op, a->in, acc.data(), count);
  }
  MPISTRATEGY_RETURN_IF_ERROR(world_->Leave(rank_));
  if (bytes > 0) std::memcpy(out, acc.data(), bytes);
  return Status::Ok();
}

Status FakeTransport::Allgatherv(const void* in, void* out,
                                 const std::vector<int64_t>& bytes_per_rank) {
  const std::vector<FakeWorld::Slot>* slots = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(world_->Arrive(rank_, kOpAllgatherv, in, &slots));
  char* dst = static_cast<char*>(out);
  for (size_t r = 0; r < slots->size(); ++r) {
    if (bytes_per_rank[r] > 0) {
      std::memcpy(dst, (*slots)[r].args, bytes_per_rank[r]);
    }
    dst += bytes_per_rank[r];
  }
  return world_->Leave(rank_);
}

Status FakeTransport::Broadcast(void* buffer, int64_t bytes, int root_rank) {
  const std::vector<FakeWorld::Slot>* slots = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(world_->Arrive(rank_, kOpBroadcast, buffer, &slots));
  if (rank_ != root_rank && bytes > 0) {
    std::memcpy(buffer, (*slots)[root_rank].args, bytes);
  }
  return world_->Leave(rank_);
}

Status FakeTransport::Reducescatter(const void* in, void* out,
                                    const std::vector<int64_t>& counts,
                                    DataType dtype, ReduceOp op) {
  int64_t offset = 0;
  for (int r = 0; r < rank_; ++r) offset += counts[r];
  const int64_t esize = DataTypeSize(dtype);
  ReduceArgs args{in, 0, dtype, op};
  const std::vector<FakeWorld::Slot>* slots = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(
      world_->Arrive(rank_, kOpReducescatter, &args, &slots));
  const int64_t n = counts[rank_];
  std::vector<char> acc(n * esize);
  for (size_t r = 0; r < slots->size(); ++r) {
    const char* src =
        static_cast<const char*>(static_cast<const ReduceArgs*>((*slots)[r].args)->in) +
        offset * esize;
    if (r == 0) {
      if (n > 0) std::memcpy(acc.data(), src, n * esize);
    } else {
      ReduceInto(dtype, op, src, acc.data(), n);
    }
  }
  MPISTRATEGY_RETURN_IF_ERROR(world_->Leave(rank_));
  if (n > 0) std::memcpy(out, acc.data(), n * esize);
  return Status::Ok();
}

Status FakeTransport::Alltoallv(const void* in,
                                const std::vector<int64_t>& send_bytes,
                                void* out,
                                const std::vector<int64_t>& recv_bytes) {
  AlltoallArgs args{in, &send_bytes};
  const std::vector<FakeWorld::Slot>* slots = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(world_->Arrive(rank_, kOpAlltoallv, &args, &slots));
  char* dst = static_cast<char*>(out);
  for (size_t r = 0; r < slots->size(); ++r) {
    const auto* a = static_cast<const AlltoallArgs*>((*slots)[r].args);
    int64_t offset = 0;
    for (int j = 0; j < rank_; ++j) offset += (*a->send_bytes)[j];
    const int64_t n = (*a->send_bytes)[rank_];
    if (n != recv_bytes[r]) {
      world_->Leave(rank_);
      return Status::Internal("FakeTransport: Alltoallv sizes differ");
    }
    if (n > 0) std::memcpy(dst, static_cast<const char*>(a->in) + offset, n);
    dst += n;
  }
  return world_->Leave(rank_);
}

Status FakeTransport::Barrier() {
  const std::vector<FakeWorld::Slot>* slots = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(world_->Arrive(rank_, kOpBarrier, nullptr, &slots));
  return world_->Leave(rank_);
}

}  // namespace mpistrategy
