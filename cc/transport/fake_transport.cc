#include "cc/transport/fake_transport.h"

#include <chrono>
#include <cstring>
#include <thread>

#include "cc/common/reduce_kernels.h"

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
      slots_(size),
      frozen_(size, false),
      mail_(size) {}

void FakeWorld::Freeze(int rank) {
  std::lock_guard<std::mutex> lock(fault_mu_);
  frozen_[rank] = true;
}

void FakeWorld::Thaw(int rank) {
  {
    std::lock_guard<std::mutex> lock(fault_mu_);
    frozen_[rank] = false;
  }
  thaw_cv_.notify_all();
}

void FakeWorld::BlockIfFrozen(int rank) {
  std::unique_lock<std::mutex> lock(fault_mu_);
  thaw_cv_.wait(lock, [&] { return !frozen_[rank]; });
}

void FakeWorld::Post(int from, int to, const std::string& bytes) {
  std::lock_guard<std::mutex> lock(fault_mu_);
  mail_[to].emplace_back(from, bytes);
}

bool FakeWorld::Take(int rank, int* from, std::string* bytes) {
  std::lock_guard<std::mutex> lock(fault_mu_);
  if (mail_[rank].empty()) return false;
  *from = mail_[rank].front().first;
  *bytes = std::move(mail_[rank].front().second);
  mail_[rank].pop_front();
  return true;
}

std::unique_ptr<Transport> FakeWorld::CreateTransport(int rank) {
  return std::unique_ptr<Transport>(
      new FakeTransport(shared_from_this(), rank, ranks_per_host_));
}

// Two-phase rendezvous.  A generation counter makes the barrier reusable;
// arrivals in [0, size) are phase 1, [size, 2 * size) phase 2.
Status FakeWorld::Wait(int rank, std::unique_lock<std::mutex>* lock,
                       const std::function<Status()>& hook) {
  static const Status kBroken = Status::Unavailable(
      "FakeTransport: a rank abandoned a collective; the world is broken");
  if (broken_) return WaitBroken(rank, lock, hook);
  const int64_t gen = generation_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return Status::Ok();
  }
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::duration<double>(timeout_seconds_));
  for (;;) {
    if (cv_.wait_for(*lock, std::chrono::milliseconds(2),
                     [&] { return generation_ != gen || broken_; })) {
      if (generation_ != gen) return Status::Ok();
      return WaitBroken(rank, lock, hook);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return Status::Unavailable("FakeTransport: ranks did not meet within " +
                                 std::to_string(timeout_seconds_) + " s");
    }
    // As a frozen process would, stop here; and let the hook end the wait.
    lock->unlock();
    BlockIfFrozen(rank);
    Status s = hook ? hook() : Status::Ok();
    lock->lock();
    if (generation_ != gen) return Status::Ok();
    if (!s.ok()) {
      broken_ = true;
      cv_.notify_all();
      return s;
    }
  }
}

Status FakeWorld::WaitBroken(int rank, std::unique_lock<std::mutex>* lock,
                             const std::function<Status()>& hook) {
  // In a real job the other ranks keep waiting until their own monitor gives
  // up (told by rank 0, or by their own clock); give the hook that chance
  // before failing with a transport error.
  lock->unlock();
  Status s;
  for (int i = 0; i < 500 && s.ok(); ++i) {
    BlockIfFrozen(rank);
    s = hook ? hook() : Status::Ok();
    if (s.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  lock->lock();
  if (!s.ok()) return s;
  return Status::Unavailable(
      "FakeTransport: a rank abandoned a collective; the world is broken");
}

Status FakeWorld::Arrive(int rank, int op, const void* args,
                         const std::vector<Slot>** slots,
                         const std::function<Status()>& hook) {
  BlockIfFrozen(rank);
  std::unique_lock<std::mutex> lock(mu_);
  slots_[rank].op = op;
  slots_[rank].args = args;
  MPISTRATEGY_RETURN_IF_ERROR(Wait(rank, &lock, hook));
  for (int r = 0; r < size_; ++r) {
    if (slots_[r].op != op) {
      // Still complete the second phase so the others are not stranded.
      Wait(rank, &lock, hook);
      return Status::Internal(std::string("FakeTransport: rank ") +
                              std::to_string(rank) + " called " + OpName(op) +
                              " but rank " + std::to_string(r) + " called " +
                              OpName(slots_[r].op));
    }
  }
  *slots = &slots_;
  return Status::Ok();
}

Status FakeWorld::Leave(int rank, const std::function<Status()>& hook) {
  std::unique_lock<std::mutex> lock(mu_);
  return Wait(rank, &lock, hook);
}

FakeTransport::FakeTransport(std::shared_ptr<FakeWorld> world, int rank,
                             int ranks_per_host)
    : world_(std::move(world)), rank_(rank), ranks_per_host_(ranks_per_host) {}

PeerInfo FakeTransport::peer_info() const {
  PeerInfo info;
  info.host = "host" + std::to_string(rank_ / ranks_per_host_);
  info.pid = 1000 + rank_;
  return info;
}

Status FakeTransport::PostNotice(int to_rank, const std::string& bytes) {
  world_->BlockIfFrozen(rank_);
  world_->Post(rank_, to_rank, bytes);
  return Status::Ok();
}

Status FakeTransport::TakeNotice(int* from_rank, std::string* bytes,
                                 bool* got) {
  world_->BlockIfFrozen(rank_);
  *got = world_->Take(rank_, from_rank, bytes);
  return Status::Ok();
}

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
  MPISTRATEGY_RETURN_IF_ERROR(world_->Arrive(rank_, kOpBitwiseAnd, &mine, &slots, hook_));
  for (const FakeWorld::Slot& s : *slots) {
    const auto* theirs = static_cast<const std::vector<uint64_t>*>(s.args);
    if (theirs->size() != mine.size()) {
      world_->Leave(rank_, hook_);
      return Status::Internal("FakeTransport: BitwiseAnd length mismatch");
    }
    for (size_t i = 0; i < mine.size(); ++i) (*bits)[i] &= (*theirs)[i];
  }
  return world_->Leave(rank_, hook_);
}

Status FakeTransport::GatherBytes(const std::string& mine,
                                  std::vector<std::string>* all) {
  ++num_gather_;
  const std::vector<FakeWorld::Slot>* slots = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(world_->Arrive(rank_, kOpGather, &mine, &slots, hook_));
  all->clear();
  if (rank_ == 0) {
    for (const FakeWorld::Slot& s : *slots) {
      all->push_back(*static_cast<const std::string*>(s.args));
    }
  }
  return world_->Leave(rank_, hook_);
}

Status FakeTransport::BroadcastBytes(std::string* bytes) {
  const std::vector<FakeWorld::Slot>* slots = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(
      world_->Arrive(rank_, kOpBroadcastBytes, bytes, &slots, hook_));
  if (rank_ != 0) *bytes = *static_cast<const std::string*>((*slots)[0].args);
  return world_->Leave(rank_, hook_);
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
  MPISTRATEGY_RETURN_IF_ERROR(world_->Arrive(rank_, kOpAllreduce, &args, &slots, hook_));
  std::vector<char> acc(static_cast<const char*>(
                            static_cast<const ReduceArgs*>((*slots)[0].args)->in),
                        static_cast<const char*>(
                            static_cast<const ReduceArgs*>((*slots)[0].args)->in) +
                            bytes);
  for (size_t r = 1; r < slots->size(); ++r) {
    const auto* a = static_cast<const ReduceArgs*>((*slots)[r].args);
    if (a->count != count || a->dtype != dtype || a->op != op) {
      world_->Leave(rank_, hook_);
      return Status::Internal("FakeTransport: Allreduce arguments differ");
    }
    ReduceInto(dtype, op, a->in, acc.data(), count);
  }
  MPISTRATEGY_RETURN_IF_ERROR(world_->Leave(rank_, hook_));
  if (bytes > 0) std::memcpy(out, acc.data(), bytes);
  return Status::Ok();
}

Status FakeTransport::Allgatherv(const void* in, void* out,
                                 const std::vector<int64_t>& bytes_per_rank) {
  const std::vector<FakeWorld::Slot>* slots = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(world_->Arrive(rank_, kOpAllgatherv, in, &slots, hook_));
  char* dst = static_cast<char*>(out);
  for (size_t r = 0; r < slots->size(); ++r) {
    if (bytes_per_rank[r] > 0) {
      std::memcpy(dst, (*slots)[r].args, bytes_per_rank[r]);
    }
    dst += bytes_per_rank[r];
  }
  return world_->Leave(rank_, hook_);
}

Status FakeTransport::Broadcast(void* buffer, int64_t bytes, int root_rank) {
  const std::vector<FakeWorld::Slot>* slots = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(world_->Arrive(rank_, kOpBroadcast, buffer, &slots, hook_));
  if (rank_ != root_rank && bytes > 0) {
    std::memcpy(buffer, (*slots)[root_rank].args, bytes);
  }
  return world_->Leave(rank_, hook_);
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
      world_->Arrive(rank_, kOpReducescatter, &args, &slots, hook_));
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
  MPISTRATEGY_RETURN_IF_ERROR(world_->Leave(rank_, hook_));
  if (n > 0) std::memcpy(out, acc.data(), n * esize);
  return Status::Ok();
}

Status FakeTransport::Alltoallv(const void* in,
                                const std::vector<int64_t>& send_bytes,
                                void* out,
                                const std::vector<int64_t>& recv_bytes) {
  AlltoallArgs args{in, &send_bytes};
  const std::vector<FakeWorld::Slot>* slots = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(world_->Arrive(rank_, kOpAlltoallv, &args, &slots, hook_));
  char* dst = static_cast<char*>(out);
  for (size_t r = 0; r < slots->size(); ++r) {
    const auto* a = static_cast<const AlltoallArgs*>((*slots)[r].args);
    int64_t offset = 0;
    for (int j = 0; j < rank_; ++j) offset += (*a->send_bytes)[j];
    const int64_t n = (*a->send_bytes)[rank_];
    if (n != recv_bytes[r]) {
      world_->Leave(rank_, hook_);
      return Status::Internal("FakeTransport: Alltoallv sizes differ");
    }
    if (n > 0) std::memcpy(dst, static_cast<const char*>(a->in) + offset, n);
    dst += n;
  }
  return world_->Leave(rank_, hook_);
}

Status FakeTransport::Barrier() {
  const std::vector<FakeWorld::Slot>* slots = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(world_->Arrive(rank_, kOpBarrier, nullptr, &slots, hook_));
  return world_->Leave(rank_, hook_);
}

}  // namespace mpistrategy
