// An in-process world of N ranks for tests: FakeWorld::Create(n) and one
// FakeTransport per rank, each driven from its own thread.  Every collective
// is implemented for real on host memory: ranks deposit a pointer to their
// arguments in a shared slot, meet at a barrier, compute their own result
// from everybody's arguments and meet again before returning.
//
// A rank that calls a different collective than the others (a protocol bug)
// gets Internal; a rendezvous that does not complete within the world's
// timeout gets Unavailable instead of hanging the test forever.
//
// Faults: Freeze(rank) stops that rank at its next transport call (or where
// it waits inside one), notices included, as SIGSTOP would, until
// Thaw(rank).  A rank whose wait hook (Transport::SetWaitHook) ends a wait
// breaks the world: every wait of every rank then ends with its own hook's
// error or, after a second, Unavailable, as in a job whose peers went out
// of step.

#ifndef MPISTRATEGY_CC_TRANSPORT_FAKE_TRANSPORT_H_
#define MPISTRATEGY_CC_TRANSPORT_FAKE_TRANSPORT_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cc/transport/transport.h"

namespace mpistrategy {

class FakeWorld : public std::enable_shared_from_this<FakeWorld> {
 public:
  // Args:
  //   size: number of ranks (>= 1).
  //   ranks_per_host: local_size(); local_rank() = rank % ranks_per_host.
  //   timeout_seconds: how long a rank waits for the others in a collective.
  static std::shared_ptr<FakeWorld> Create(int size, int ranks_per_host = 0,
                                           double timeout_seconds = 60.0);

  // The transport for `rank`; call once per rank.
  std::unique_ptr<Transport> CreateTransport(int rank);

  int size() const { return size_; }

  // See the file comment.
  void Freeze(int rank);
  void Thaw(int rank);
  // Blocks while `rank` is frozen.
  void BlockIfFrozen(int rank);

  // Notices (Transport::PostNotice/TakeNotice).
  void Post(int from, int to, const std::string& bytes);
  bool Take(int rank, int* from, std::string* bytes);

  // Internal to FakeTransport.
  struct Slot {
    int op = -1;
    const void* args = nullptr;
  };
  // Phase 1 of a collective: publish `args`, wait for all ranks.  Returns
  // the published slots (valid until Leave).
  // `hook` (may be empty) is called while waiting; see SetWaitHook.
  Status Arrive(int rank, int op, const void* args,
                const std::vector<Slot>** slots,
                const std::function<Status()>& hook);
  // Phase 2: wait until every rank has finished reading the slots.
  Status Leave(int rank, const std::function<Status()>& hook);

 private:
  FakeWorld(int size, int ranks_per_host, double timeout_seconds);
  Status Wait(int rank, std::unique_lock<std::mutex>* lock,
              const std::function<Status()>& hook);
  // Wait in a broken world: the hook's error within a second, or
  // Unavailable.
  Status WaitBroken(int rank, std::unique_lock<std::mutex>* lock,
                    const std::function<Status()>& hook);

  const int size_;
  const int ranks_per_host_;
  const double timeout_seconds_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Slot> slots_;
  int arrived_ = 0;
  int64_t generation_ = 0;
  bool broken_ = false;  // guarded by mu_

  std::mutex fault_mu_;
  std::condition_variable thaw_cv_;
  std::vector<bool> frozen_;                                 // fault_mu_
  std::vector<std::deque<std::pair<int, std::string>>> mail_;  // fault_mu_
};

class FakeTransport : public Transport {
 public:
  FakeTransport(std::shared_ptr<FakeWorld> world, int rank,
                int ranks_per_host);

  int rank() const override { return rank_; }
  int size() const override { return world_->size(); }
  int local_rank() const override { return rank_ % ranks_per_host_; }
  int local_size() const override;

  Status BitwiseAnd(std::vector<uint64_t>* bits) override;
  Status GatherBytes(const std::string& mine,
                     std::vector<std::string>* all) override;
  Status BroadcastBytes(std::string* bytes) override;
  Status Allreduce(const void* in, void* out, int64_t count, DataType dtype,
                   ReduceOp op) override;
  Status Allgatherv(const void* in, void* out,
                    const std::vector<int64_t>& bytes_per_rank) override;
  Status Broadcast(void* buffer, int64_t bytes, int root_rank) override;
  Status Reducescatter(const void* in, void* out,
                       const std::vector<int64_t>& counts, DataType dtype,
                       ReduceOp op) override;
  Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes,
                   void* out,
                   const std::vector<int64_t>& recv_bytes) override;
  Status Barrier() override;

  // host "host<rank / ranks_per_host>", pid 1000 + rank.
  PeerInfo peer_info() const override;
  void SetWaitHook(std::function<Status()> hook) override {
    hook_ = std::move(hook);
  }
  bool SupportsNotices() const override { return true; }
  Status PostNotice(int to_rank, const std::string& bytes) override;
  Status TakeNotice(int* from_rank, std::string* bytes, bool* got) override;

  // Number of collectives this rank has called, by kind (tests).
  int64_t num_bitwise_and() const { return num_bitwise_and_; }
  int64_t num_gather() const { return num_gather_; }
  int64_t num_allreduce() const { return num_allreduce_; }

 private:
  std::shared_ptr<FakeWorld> world_;
  const int rank_;
  const int ranks_per_host_;
  std::function<Status()> hook_;
  int64_t num_bitwise_and_ = 0;
  int64_t num_gather_ = 0;
  int64_t num_allreduce_ = 0;
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_TRANSPORT_FAKE_TRANSPORT_H_
