// Transport over MPI (CPU tensors, and the control plane for every device).
//
// The transport owns a private duplicate of the parent communicator, so our
// traffic never matches user (e.g. mpi4py) messages and a new engine after
// re-initialisation starts from a clean communicator.  Errors on it return
// (MPI_ERRORS_RETURN) and become Status values carrying MPI_Error_string.
//
// Threading: Create and the destructor run on the caller's thread; every
// other method runs on the engine thread only.  MPI must provide at least
// MPI_THREAD_SERIALIZED (Create checks).

#ifndef MPISTRATEGY_CC_TRANSPORT_MPI_TRANSPORT_H_
#define MPISTRATEGY_CC_TRANSPORT_MPI_TRANSPORT_H_

#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "cc/transport/transport.h"

namespace mpistrategy {

class HostRendezvous;

// Initialises MPI with MPI_THREAD_MULTIPLE unless something (e.g. mpi4py)
// already did.  *we_initialized says whether this call initialised it; if
// `provided_level` is not null it receives the thread level MPI provides.
// Fails (FailedPrecondition) when MPI was already finalized.
Status EnsureMpiInitialized(bool* we_initialized,
                            int* provided_level = nullptr);

// Calls MPI_Finalize if EnsureMpiInitialized initialised MPI in this process
// and MPI is not finalized yet.  Destroy every MpiTransport first.
void FinalizeMpiIfWeInitialized();

// MPI_Init and MPI_Finalize wait for every rank, without a deadline, before
// the engine's peer timeout runs or after it stopped: a rank frozen then
// (importing, at exit) holds the others silently.  The two calls above log
// a line after `seconds` of waiting there, and again at each doubling (0:
// never).  The engine's stall_warning_seconds; 60 until set.
void SetMpiWaitNoticeSeconds(double seconds);

class MpiTransport : public Transport {
 public:
  // Duplicates `parent` (MPI must be initialised), sets MPI_ERRORS_RETURN on
  // the duplicate and splits it by host (MPI_COMM_TYPE_SHARED) for
  // local_rank/local_size.
  static Status Create(MPI_Comm parent, std::unique_ptr<Transport>* out);

  // Frees the communicators, datatypes and ops (before MPI_Finalize).
  ~MpiTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return local_rank_; }
  int local_size() const override { return local_size_; }

  Status BitwiseAnd(std::vector<uint64_t>* bits) override;
  bool SplitsBitwiseAnd() const override { return true; }
  Status StartBitwiseAnd(std::vector<uint64_t>* bits) override;
  Status FinishBitwiseAnd(double max_wait_seconds, bool* done) override;
  Status GatherBytes(const std::string& mine,
                     std::vector<std::string>* all) override;
  Status BroadcastBytes(std::string* bytes) override;
  // float16/bfloat16 reduce through user-defined MPI_Ops; bool uses
  // MPI_C_BOOL with LOR (sum, max) / LAND (min, product).  kMean reduces
  // like kSum (the engine divides).  Counts above INT_MAX are chunked.
  Status Allreduce(const void* in, void* out, int64_t count, DataType dtype,
                   ReduceOp op) override;
  Status Allgatherv(const void* in, void* out,
                    const std::vector<int64_t>& bytes_per_rank) override;
  Status Broadcast(void* buffer, int64_t bytes, int root_rank) override;
  // Counts above INT_MAX (per rank) are rejected with InvalidArgument.
  Status Reducescatter(const void* in, void* out,
                       const std::vector<int64_t>& counts, DataType dtype,
                       ReduceOp op) override;
  // Byte counts / displacements above INT_MAX are rejected.
  Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes,
                   void* out,
                   const std::vector<int64_t>& recv_bytes) override;
  // Polled (MPI_Ibarrier), like the control plane.
  Status Barrier() override;

  PeerInfo peer_info() const override { return peer_info_; }
  void SetWaitHook(std::function<Status()> hook) override {
    wait_hook_ = std::move(hook);
  }
  // Notices travel on a second private communicator; they need
  // MPI_THREAD_MULTIPLE because the peer monitor's thread sends and receives
  // them while the engine thread is inside a collective.
  bool SupportsNotices() const override { return notices_supported_; }
  Status PostNotice(int to_rank, const std::string& bytes) override;
  Status TakeNotice(int* from_rank, std::string* bytes, bool* got) override;

  // data_plane "auto" / "shm": a ShmPlane (shm_plane.h) when the job runs
  // on one host, else a HierarchicalPlane (ShmPlane inside each host, MPI
  // across, `world` for the rest): shards across hosts where every host has
  // the same number of ranks, each host's first rank where they differ (a
  // host of one rank has no segment).  Where shared memory cannot be used
  // (one rank per host, /dev/shm too small), "auto" leaves *plane null and
  // rank 0 logs why once; "shm" fails with FailedPrecondition saying why.
  // Every rank decides alike.
  Status CreateHostPlane(HostDataPlane kind, int64_t shm_bytes,
                         DataPlane* world,
                         std::unique_ptr<DataPlane>* plane) override;

  MPI_Comm comm() const { return comm_; }

 private:
  MpiTransport() = default;
  Status Init(MPI_Comm parent);
  // Completes a non-blocking request without holding a core while waiting;
  // calls the wait hook while it waits and returns its error, if any.
  Status WaitPolitely(MPI_Request* request, const char* what);
  // StartBitwiseAnd's request, until FinishBitwiseAnd saw it complete.
  MPI_Request and_request_ = MPI_REQUEST_NULL;
  // Where every rank shares one host and its ShmPlane: the AND through
  // shared memory instead (host_rendezvous.h), from CreateHostPlane on.
  std::unique_ptr<HostRendezvous> host_and_;
  // MPI_Ibcast in chunks of at most INT_MAX bytes, each WaitPolitely.
  Status BroadcastPolled(void* buffer, int64_t bytes, int root_rank);
  // MPI datatype and op for (dtype, op).
  void Map(DataType dtype, ReduceOp op, MPI_Datatype* mpi_type,
           MPI_Op* mpi_op) const;

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm local_comm_ = MPI_COMM_NULL;
  // Notices only (PostNotice/TakeNotice), used by the monitor's thread.
  MPI_Comm notice_comm_ = MPI_COMM_NULL;
  bool notices_supported_ = false;
  // Sends in flight per destination rank; a notice is dropped when all of a
  // rank's slots are busy (that rank is not receiving).
  struct NoticeSlot {
    MPI_Request request = MPI_REQUEST_NULL;
    std::string bytes;
  };
  static constexpr int kNoticeSlotsPerRank = 4;
  std::vector<NoticeSlot> notice_slots_;  // size_ * kNoticeSlotsPerRank
  std::function<Status()> wait_hook_;
  PeerInfo peer_info_;
  int rank_ = 0;
  int size_ = 1;
  int local_rank_ = 0;
  int local_size_ = 1;
  // A 2-byte contiguous type for float16/bfloat16.
  MPI_Datatype half_type_ = MPI_DATATYPE_NULL;
  // User-defined ops where MPI's predefined ones do not fit (see
  // NeedsUserOp in the .cc), by [DataType][ReduceOp]; MPI_OP_NULL elsewhere
  // (kMean uses kSum's).
  static constexpr int kNumDataTypes = 9;
  static constexpr int kNumReduceOps = 5;
  MPI_Op user_ops_[kNumDataTypes][kNumReduceOps];
  bool ops_created_ = false;
  // Reused by the control plane.
  std::vector<int> counts_;
  std::vector<int> displs_;
  std::string gathered_;
};

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_TRANSPORT_MPI_TRANSPORT_H_
