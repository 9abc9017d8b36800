#include "cc/transport/mpi_transport.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

#include "cc/common/checks.h"
#include "cc/common/logging.h"
#include "cc/common/reduce_kernels.h"
#include "cc/transport/hierarchical_plane.h"
#include "cc/transport/host_plane.h"
#include "cc/transport/host_rendezvous.h"
#include "cc/transport/shm_plane.h"

#include <unistd.h>

namespace mpistrategy {

namespace {

// Largest element count passed to one MPI call (MPI counts are int).
constexpr int64_t kMaxChunk = INT_MAX;

// Calls fn(first, n) for [0, count) in consecutive pieces of n elements
// that one MPI call can count; returns fn's first error.
template <typename Fn>
Status ForEachIntPiece(int64_t count, Fn fn) {
  for (int64_t first = 0; first < count; first += kMaxChunk) {
    MPISTRATEGY_RETURN_IF_ERROR(
        fn(first, static_cast<int>(std::min(kMaxChunk, count - first))));
  }
  return Status::Ok();
}

// Tag of the point-to-point alltoall (blocks above INT_MAX bytes).  Pieces
// between two ranks match in order, and the engine runs one collective at
// a time on this communicator.
constexpr int kAlltoallTag = 7301;

// Tag of notices on notice_comm_ (the only tag used there).
constexpr int kNoticeTag = 7;

// Whether EnsureMpiInitialized called MPI_Init_thread.  MPI initialisation
// is itself process-wide state, so this one flag mirrors it; nothing else in
// the library is global.
std::atomic<bool> g_we_initialized_mpi{false};
// ... in this process: a fork child inherits the flag but must not
// finalize its parent's MPI.
std::atomic<int64_t> g_initialized_in_pid{0};

template <DataType kDtype, ReduceOp kOp>
void UserReduce(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  ReduceInto(kDtype, kOp, in, inout, *len);
}

using MpiUserFn = void (*)(void*, void*, int*, MPI_Datatype*);

template <DataType kDtype>
MpiUserFn UserReduceFnFor(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean:
      return &UserReduce<kDtype, ReduceOp::kSum>;
    case ReduceOp::kMin:
      return &UserReduce<kDtype, ReduceOp::kMin>;
    case ReduceOp::kMax:
      return &UserReduce<kDtype, ReduceOp::kMax>;
    case ReduceOp::kProduct:
      return &UserReduce<kDtype, ReduceOp::kProduct>;
  }
  return nullptr;
}

MpiUserFn UserReduceFn(DataType dtype, ReduceOp op) {
  switch (dtype) {
    case DataType::kFloat16:
      return UserReduceFnFor<DataType::kFloat16>(op);
    case DataType::kBFloat16:
      return UserReduceFnFor<DataType::kBFloat16>(op);
    case DataType::kInt8:
      return UserReduceFnFor<DataType::kInt8>(op);
    case DataType::kUint8:
      return UserReduceFnFor<DataType::kUint8>(op);
    case DataType::kFloat32:
      return UserReduceFnFor<DataType::kFloat32>(op);
    case DataType::kFloat64:
      return UserReduceFnFor<DataType::kFloat64>(op);
    default:
      return nullptr;
  }
}

// Where MPI's predefined op is missing or does not give TensorFlow's result,
// reduce_kernels' own loop runs as a user-defined op instead:
// * float16/bfloat16: MPI has no such types.
// * int8/uint8 sum and product: Open MPI 4.1's AVX op component saturates
//   8-bit sums of longer vectors (100 + 100 gives 127 instead of -56), so the
//   result would depend on the tensor's length; TF wraps around.
// * float32/float64 min and max: MPI_MIN/MPI_MAX keep or drop a NaN
//   depending on operand order and vector length; tf.minimum/tf.maximum
//   propagate it, and so do we.
bool NeedsUserOp(DataType dtype, ReduceOp op) {
  switch (dtype) {
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return true;
    case DataType::kInt8:
    case DataType::kUint8:
      return op == ReduceOp::kSum || op == ReduceOp::kMean ||
             op == ReduceOp::kProduct;
    case DataType::kFloat32:
    case DataType::kFloat64:
      return op == ReduceOp::kMin || op == ReduceOp::kMax;
    default:
      return false;
  }
}

Status CheckIntRange(int64_t v, const char* what) {
  if (v < 0 || v > INT_MAX) {
    return Status::InvalidArgument(
        std::string("MpiTransport: ") + what + " of " + std::to_string(v) +
        " does not fit an MPI int count; split the tensor into pieces below "
        "2^31 elements");
  }
  return Status::Ok();
}

std::atomic<double> g_mpi_wait_notice_seconds{60.0};

// While alive, logs that `call` still waits for the other ranks after
// g_mpi_wait_notice_seconds, then at each doubling of the wait.
class MpiWaitNotice {
 public:
  MpiWaitNotice(std::string call, std::string cause)
      : call_(std::move(call)), cause_(std::move(cause)) {
    const double first = g_mpi_wait_notice_seconds.load();
    if (first > 0) thread_ = std::thread([this, first] { Run(first); });
  }
  ~MpiWaitNotice() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  // "rank N (host H, pid P)" as the engine names ranks, with the rank the
  // launcher announced (MPI cannot be asked while it is starting); the same
  // variables as mpistrategy/_output.py's rank_from_env.
  static std::string DescribeThisProcess() {
    const char* rank = nullptr;
    for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK",
                             "SLURM_PROCID"}) {
      if ((rank = std::getenv(name)) != nullptr) break;
    }
    const PeerInfo me = LocalPeerInfo();
    return std::string("rank ") + (rank != nullptr ? rank : "?") + " (host " +
           me.host + ", pid " + std::to_string(me.pid) + ")";
  }

  void Run(double first) {
    const auto start = std::chrono::steady_clock::now();
    const std::string who = DescribeThisProcess();
    std::unique_lock<std::mutex> lock(mu_);
    for (double at = first;; at *= 2) {
      if (cv_.wait_until(lock,
                         start + std::chrono::duration_cast<
                                     std::chrono::steady_clock::duration>(
                                     std::chrono::duration<double>(at)),
                         [this] { return done_; })) {
        return;
      }
      LogLine(who,
              "has waited " + std::to_string(static_cast<int64_t>(at)) +
                  " s in " + call_ + " for the other ranks " + cause_ +
                  "; mpistrategy's peer timeout does not cover this wait");
    }
  }

  const std::string call_;
  const std::string cause_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace

void SetMpiWaitNoticeSeconds(double seconds) {
  g_mpi_wait_notice_seconds.store(seconds);
}

Status EnsureMpiInitialized(bool* we_initialized, int* provided_level) {
  *we_initialized = false;
  int finalized = 0;
  MPISTRATEGY_MPI_CHECK(MPI_Finalized(&finalized), "MPI_Finalized");
  if (finalized) {
    return Status::FailedPrecondition(
        "MPI has already been finalized in this process; mpistrategy cannot "
        "be initialized again after MPI_Finalize");
  }
  int initialized = 0;
  MPISTRATEGY_MPI_CHECK(MPI_Initialized(&initialized), "MPI_Initialized");
  int provided = 0;
  if (!initialized) {
    MpiWaitNotice notice("MPI_Init",
                         "to start (a rank frozen or still importing?)");
    MPISTRATEGY_MPI_CHECK(
        MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided),
        "MPI_Init_thread");
    *we_initialized = true;
    g_we_initialized_mpi = true;
    g_initialized_in_pid = static_cast<int64_t>(getpid());
  } else {
    MPISTRATEGY_MPI_CHECK(MPI_Query_thread(&provided), "MPI_Query_thread");
  }
  if (provided_level != nullptr) *provided_level = provided;
  return Status::Ok();
}

void FinalizeMpiIfWeInitialized() {
  if (g_initialized_in_pid.load() != static_cast<int64_t>(getpid())) return;
  if (!g_we_initialized_mpi.exchange(false)) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) {
    MpiWaitNotice notice("MPI_Finalize at exit",
                         "to end (a rank frozen, or still working?)");
    MPI_Finalize();
  }
}

Status MpiTransport::Create(MPI_Comm parent, std::unique_ptr<Transport>* out) {
  int initialized = 0;
  MPISTRATEGY_MPI_CHECK(MPI_Initialized(&initialized), "MPI_Initialized");
  int finalized = 0;
  MPISTRATEGY_MPI_CHECK(MPI_Finalized(&finalized), "MPI_Finalized");
  if (!initialized || finalized) {
    return Status::FailedPrecondition(
        "MpiTransport::Create: MPI is not initialized (call "
        "EnsureMpiInitialized first)");
  }
  int provided = 0;
  MPISTRATEGY_MPI_CHECK(MPI_Query_thread(&provided), "MPI_Query_thread");
  if (provided < MPI_THREAD_SERIALIZED) {
    return Status::FailedPrecondition(
        "MPI was initialized with thread level " + std::to_string(provided) +
        " but mpistrategy's background thread needs at least "
        "MPI_THREAD_SERIALIZED (initialize MPI with MPI_THREAD_MULTIPLE, "
        "e.g. mpi4py's default)");
  }
  std::unique_ptr<MpiTransport> t(new MpiTransport());
  MPISTRATEGY_RETURN_IF_ERROR(t->Init(parent));
  *out = std::move(t);
  return Status::Ok();
}

Status MpiTransport::Init(MPI_Comm parent) {
  MPISTRATEGY_MPI_CHECK(MPI_Comm_dup(parent, &comm_), "MPI_Comm_dup");
  MPISTRATEGY_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN),
                        "MPI_Comm_set_errhandler");
  MPISTRATEGY_MPI_CHECK(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  MPISTRATEGY_MPI_CHECK(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  MPISTRATEGY_MPI_CHECK(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED,
                                            rank_, MPI_INFO_NULL,
                                            &local_comm_),
                        "MPI_Comm_split_type");
  MPISTRATEGY_MPI_CHECK(MPI_Comm_set_errhandler(local_comm_, MPI_ERRORS_RETURN),
                        "MPI_Comm_set_errhandler");
  MPISTRATEGY_MPI_CHECK(MPI_Comm_rank(local_comm_, &local_rank_),
                        "MPI_Comm_rank");
  MPISTRATEGY_MPI_CHECK(MPI_Comm_size(local_comm_, &local_size_),
                        "MPI_Comm_size");
  MPISTRATEGY_MPI_CHECK(MPI_Comm_dup(comm_, &notice_comm_), "MPI_Comm_dup");
  MPISTRATEGY_MPI_CHECK(
      MPI_Comm_set_errhandler(notice_comm_, MPI_ERRORS_RETURN),
      "MPI_Comm_set_errhandler");
  int provided = 0;
  MPISTRATEGY_MPI_CHECK(MPI_Query_thread(&provided), "MPI_Query_thread");
  notices_supported_ = provided == MPI_THREAD_MULTIPLE;
  notice_slots_.resize(static_cast<size_t>(size_) * kNoticeSlotsPerRank);
  char host[MPI_MAX_PROCESSOR_NAME + 1] = {0};
  int host_len = 0;
  if (MPI_Get_processor_name(host, &host_len) == MPI_SUCCESS && host_len > 0) {
    peer_info_.host.assign(host, host_len);
  } else {
    peer_info_ = LocalPeerInfo();
  }
  peer_info_.pid = static_cast<int64_t>(getpid());
  MPISTRATEGY_MPI_CHECK(MPI_Type_contiguous(2, MPI_BYTE, &half_type_),
                        "MPI_Type_contiguous");
  MPISTRATEGY_MPI_CHECK(MPI_Type_commit(&half_type_), "MPI_Type_commit");
  for (auto& row : user_ops_) {
    for (MPI_Op& op : row) op = MPI_OP_NULL;
  }
  ops_created_ = true;
  for (int d = 0; d < kNumDataTypes; ++d) {
    for (int o = 0; o < kNumReduceOps; ++o) {
      const DataType dtype = static_cast<DataType>(d);
      const ReduceOp op = static_cast<ReduceOp>(o);
      if (op == ReduceOp::kMean || !NeedsUserOp(dtype, op)) continue;
      MPISTRATEGY_MPI_CHECK(
          MPI_Op_create(UserReduceFn(dtype, op), 1, &user_ops_[d][o]),
          "MPI_Op_create");
    }
  }
  return Status::Ok();
}

MpiTransport::~MpiTransport() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;  // too late to free anything
  if (ops_created_) {
    for (auto& row : user_ops_) {
      for (MPI_Op& op : row) {
        if (op != MPI_OP_NULL) MPI_Op_free(&op);
      }
    }
  }
  if (half_type_ != MPI_DATATYPE_NULL) MPI_Type_free(&half_type_);
  // A notice to a rank that never took it stays in flight; MPI completes
  // (or drops) it after the request is freed.
  for (NoticeSlot& slot : notice_slots_) {
    if (slot.request != MPI_REQUEST_NULL) MPI_Request_free(&slot.request);
  }
  if (notice_comm_ != MPI_COMM_NULL) MPI_Comm_free(&notice_comm_);
  if (local_comm_ != MPI_COMM_NULL) MPI_Comm_free(&local_comm_);
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void MpiTransport::Map(DataType dtype, ReduceOp op, MPI_Datatype* mpi_type,
                       MPI_Op* mpi_op) const {
  const ReduceOp o = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  switch (dtype) {
    case DataType::kFloat16:
    case DataType::kBFloat16:
      *mpi_type = half_type_;
      break;
    case DataType::kBool:
      *mpi_type = MPI_C_BOOL;
      *mpi_op = (o == ReduceOp::kSum || o == ReduceOp::kMax) ? MPI_LOR
                                                             : MPI_LAND;
      return;
    case DataType::kUint8:
      *mpi_type = MPI_UINT8_T;
      break;
    case DataType::kInt8:
      *mpi_type = MPI_INT8_T;
      break;
    case DataType::kInt32:
      *mpi_type = MPI_INT32_T;
      break;
    case DataType::kInt64:
      *mpi_type = MPI_INT64_T;
      break;
    case DataType::kFloat32:
      *mpi_type = MPI_FLOAT;
      break;
    case DataType::kFloat64:
      *mpi_type = MPI_DOUBLE;
      break;
  }
  switch (o) {
    case ReduceOp::kSum:
    case ReduceOp::kMean:
      *mpi_op = MPI_SUM;
      break;
    case ReduceOp::kMin:
      *mpi_op = MPI_MIN;
      break;
    case ReduceOp::kMax:
      *mpi_op = MPI_MAX;
      break;
    case ReduceOp::kProduct:
      *mpi_op = MPI_PROD;
      break;
  }
  const MPI_Op user = user_ops_[static_cast<int>(dtype)][static_cast<int>(o)];
  if (user != MPI_OP_NULL) *mpi_op = user;
}

Status MpiTransport::BitwiseAnd(std::vector<uint64_t>* bits) {
  bool done = false;
  MPISTRATEGY_RETURN_IF_ERROR(StartBitwiseAnd(bits));
  return FinishBitwiseAnd(-1.0, &done);
}

Status MpiTransport::StartBitwiseAnd(std::vector<uint64_t>* bits) {
  MPISTRATEGY_RETURN_IF_ERROR(
      CheckIntRange(static_cast<int64_t>(bits->size()), "bit vector length"));
  if (and_request_ != MPI_REQUEST_NULL ||
      (host_and_ != nullptr && host_and_->in_flight())) {
    return Status::Internal("StartBitwiseAnd: the previous one is unfinished");
  }
  // Every rank's vector has the same length, so every rank picks alike.
  if (host_and_ != nullptr &&
      host_and_->Fits(static_cast<int64_t>(bits->size()))) {
    return host_and_->Start(bits);
  }
  // This is the per-cycle rendezvous, so ranks often reach it far apart (an
  // idle rank wakes up every cycle_time_ms).  A blocking MPI_Allreduce would
  // busy-wait for the whole gap and take a core away from TensorFlow; the
  // non-blocking form lets WaitPolitely spin briefly, then sleep.
  MPISTRATEGY_MPI_CHECK(
      MPI_Iallreduce(MPI_IN_PLACE, bits->data(), static_cast<int>(bits->size()),
                     MPI_UINT64_T, MPI_BAND, comm_, &and_request_),
      "MPI_Iallreduce(BAND)");
  return Status::Ok();
}

Status MpiTransport::FinishBitwiseAnd(double max_wait_seconds, bool* done) {
  *done = false;
  if (host_and_ != nullptr && host_and_->in_flight()) {
    return host_and_->Finish(max_wait_seconds, done);
  }
  if (and_request_ == MPI_REQUEST_NULL) {
    return Status::Internal("FinishBitwiseAnd: none was started");
  }
  if (max_wait_seconds < 0) {
    MPISTRATEGY_RETURN_IF_ERROR(
        WaitPolitely(&and_request_, "MPI_Iallreduce(BAND)"));
    *done = true;
    return Status::Ok();
  }
  // A short, bounded spin: the caller hands the request on if it is late.
  const auto until =
      std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::duration<double>(max_wait_seconds));
  int flag = 0;
  do {
    MPISTRATEGY_MPI_CHECK(MPI_Test(&and_request_, &flag, MPI_STATUS_IGNORE),
                          "MPI_Iallreduce(BAND)");
  } while (!flag && std::chrono::steady_clock::now() < until);
  *done = flag != 0;
  return Status::Ok();
}

Status MpiTransport::WaitPolitely(MPI_Request* request, const char* what) {
  // Spin first: in a training loop the other ranks usually arrive within
  // microseconds, and sleeping then would add latency.  Briefly: where ranks
  // share cores with TensorFlow, a longer spin takes CPU from a late peer
  // (100 us cost the Keras step benchmark 1-2 ms of CPU per step).  After
  // that, back off exponentially to a sleep short enough not to matter next
  // to a step (the engine thread's timer slack is 1 us, so short sleeps
  // are as short as asked).
  constexpr auto kSpin = std::chrono::microseconds(20);
  constexpr auto kMaxSleep = std::chrono::microseconds(200);
  const auto spin_until = std::chrono::steady_clock::now() + kSpin;
  auto sleep = std::chrono::microseconds(2);
  for (;;) {
    int done = 0;
    MPISTRATEGY_MPI_CHECK(MPI_Test(request, &done, MPI_STATUS_IGNORE), what);
    if (done) return Status::Ok();
    if (std::chrono::steady_clock::now() < spin_until) continue;
    if (wait_hook_) {
      // The request is abandoned: its peers are gone or the engine stops.
      MPISTRATEGY_RETURN_IF_ERROR(wait_hook_());
    }
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, kMaxSleep);
  }
}

Status MpiTransport::BroadcastPolled(void* buffer, int64_t bytes,
                                     int root_rank) {
  char* p = static_cast<char*>(buffer);
  return ForEachIntPiece(bytes, [&](int64_t done, int n) -> Status {
    MPI_Request request;
    MPISTRATEGY_MPI_CHECK(
        MPI_Ibcast(p + done, n, MPI_BYTE, root_rank, comm_, &request),
        "MPI_Ibcast");
    return WaitPolitely(&request, "MPI_Ibcast");
  });
}

Status MpiTransport::PostNotice(int to_rank, const std::string& bytes) {
  if (to_rank < 0 || to_rank >= size_ || to_rank == rank_) {
    return Status::InvalidArgument("PostNotice: bad rank " +
                                   std::to_string(to_rank));
  }
  NoticeSlot* free_slot = nullptr;
  for (int i = 0; i < kNoticeSlotsPerRank; ++i) {
    NoticeSlot& slot = notice_slots_[to_rank * kNoticeSlotsPerRank + i];
    if (slot.request != MPI_REQUEST_NULL) {
      int done = 0;
      MPISTRATEGY_MPI_CHECK(MPI_Test(&slot.request, &done, MPI_STATUS_IGNORE),
                            "MPI_Test(notice)");
      if (!done) continue;
    }
    if (free_slot == nullptr) free_slot = &slot;
  }
  if (free_slot == nullptr) return Status::Ok();  // that rank is not listening
  free_slot->bytes = bytes;
  MPISTRATEGY_MPI_CHECK(
      MPI_Isend(free_slot->bytes.data(), static_cast<int>(bytes.size()),
                MPI_BYTE, to_rank, kNoticeTag, notice_comm_,
                &free_slot->request),
      "MPI_Isend(notice)");
  return Status::Ok();
}

Status MpiTransport::TakeNotice(int* from_rank, std::string* bytes,
                                bool* got) {
  *got = false;
  int flag = 0;
  MPI_Message message;
  MPI_Status status;
  MPISTRATEGY_MPI_CHECK(MPI_Improbe(MPI_ANY_SOURCE, kNoticeTag, notice_comm_,
                                    &flag, &message, &status),
                        "MPI_Improbe(notice)");
  if (!flag) return Status::Ok();
  int count = 0;
  MPISTRATEGY_MPI_CHECK(MPI_Get_count(&status, MPI_BYTE, &count),
                        "MPI_Get_count(notice)");
  bytes->resize(static_cast<size_t>(count));
  MPISTRATEGY_MPI_CHECK(MPI_Mrecv(count > 0 ? &(*bytes)[0] : nullptr, count,
                                  MPI_BYTE, &message, MPI_STATUS_IGNORE),
                        "MPI_Mrecv(notice)");
  *from_rank = status.MPI_SOURCE;
  *got = true;
  return Status::Ok();
}

Status MpiTransport::GatherBytes(const std::string& mine,
                                 std::vector<std::string>* all) {
  MPISTRATEGY_RETURN_IF_ERROR(CheckIntRange(
      static_cast<int64_t>(mine.size()), "negotiation message size"));
  int my_size = static_cast<int>(mine.size());
  counts_.resize(size_);
  MPI_Request request;
  MPISTRATEGY_MPI_CHECK(MPI_Igather(&my_size, 1, MPI_INT, counts_.data(), 1,
                                    MPI_INT, 0, comm_, &request),
                        "MPI_Igather");
  MPISTRATEGY_RETURN_IF_ERROR(WaitPolitely(&request, "MPI_Igather"));
  all->clear();
  int64_t total = 0;
  if (rank_ == 0) {
    displs_.resize(size_);
    for (int r = 0; r < size_; ++r) {
      displs_[r] = static_cast<int>(std::min<int64_t>(total, INT_MAX));
      total += counts_[r];
    }
    gathered_.resize(static_cast<size_t>(std::min<int64_t>(total, INT_MAX)));
  }
  // Every rank must enter Gatherv; an oversized total is reported after.
  const bool too_big = rank_ == 0 && total > INT_MAX;
  MPISTRATEGY_MPI_CHECK(
      MPI_Igatherv(mine.data(), my_size, MPI_BYTE,
                   too_big ? nullptr : &gathered_[0], counts_.data(),
                   displs_.empty() ? nullptr : displs_.data(), MPI_BYTE, 0,
                   comm_, &request),
      "MPI_Igatherv");
  MPISTRATEGY_RETURN_IF_ERROR(WaitPolitely(&request, "MPI_Igatherv"));
  if (rank_ == 0) {
    MPISTRATEGY_RETURN_IF_ERROR(
        CheckIntRange(total, "total negotiation message size"));
    for (int r = 0; r < size_; ++r) {
      all->emplace_back(gathered_.data() + displs_[r], counts_[r]);
    }
  }
  return Status::Ok();
}

Status MpiTransport::BroadcastBytes(std::string* bytes) {
  uint64_t n = bytes->size();
  MPI_Request request;
  MPISTRATEGY_MPI_CHECK(MPI_Ibcast(&n, 1, MPI_UINT64_T, 0, comm_, &request),
                        "MPI_Ibcast(size)");
  MPISTRATEGY_RETURN_IF_ERROR(WaitPolitely(&request, "MPI_Ibcast(size)"));
  if (rank_ != 0) bytes->resize(n);
  if (n == 0) return Status::Ok();
  return BroadcastPolled(&(*bytes)[0], static_cast<int64_t>(n), 0);
}

Status MpiTransport::Allreduce(const void* in, void* out, int64_t count,
                               DataType dtype, ReduceOp op) {
  MPI_Datatype type;
  MPI_Op mpi_op;
  Map(dtype, op, &type, &mpi_op);
  const int64_t esize = DataTypeSize(dtype);
  return ForEachIntPiece(count, [&](int64_t done, int n) -> Status {
    char* dst = static_cast<char*>(out) + done * esize;
    const void* src = in == out ? MPI_IN_PLACE
                                : static_cast<const char*>(in) + done * esize;
    MPISTRATEGY_MPI_CHECK(MPI_Allreduce(src, dst, n, type, mpi_op, comm_),
                          "MPI_Allreduce");
    return Status::Ok();
  });
}

Status MpiTransport::Allgatherv(const void* in, void* out,
                                const std::vector<int64_t>& bytes_per_rank) {
  int64_t total = 0;
  bool fits = true;
  counts_.resize(size_);
  displs_.resize(size_);
  for (int r = 0; r < size_; ++r) {
    if (bytes_per_rank[r] > INT_MAX || total > INT_MAX) fits = false;
    counts_[r] = static_cast<int>(std::min<int64_t>(bytes_per_rank[r], INT_MAX));
    displs_[r] = static_cast<int>(std::min<int64_t>(total, INT_MAX));
    total += bytes_per_rank[r];
  }
  if (fits) {
    MPISTRATEGY_MPI_CHECK(
        MPI_Allgatherv(in, counts_[rank_], MPI_BYTE, out, counts_.data(),
                       displs_.data(), MPI_BYTE, comm_),
        "MPI_Allgatherv");
    return Status::Ok();
  }
  // Large: every rank broadcasts its block (chunked).
  char* dst = static_cast<char*>(out);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_ && bytes_per_rank[r] > 0) {
      std::memmove(dst, in, bytes_per_rank[r]);
    }
    MPISTRATEGY_RETURN_IF_ERROR(Broadcast(dst, bytes_per_rank[r], r));
    dst += bytes_per_rank[r];
  }
  return Status::Ok();
}

Status MpiTransport::Broadcast(void* buffer, int64_t bytes, int root_rank) {
  char* p = static_cast<char*>(buffer);
  return ForEachIntPiece(bytes, [&](int64_t done, int n) -> Status {
    MPISTRATEGY_MPI_CHECK(MPI_Bcast(p + done, n, MPI_BYTE, root_rank, comm_),
                          "MPI_Bcast");
    return Status::Ok();
  });
}

Status MpiTransport::Reducescatter(const void* in, void* out,
                                   const std::vector<int64_t>& counts,
                                   DataType dtype, ReduceOp op) {
  counts_.resize(size_);
  int64_t total = 0;
  for (int r = 0; r < size_; ++r) {
    total += counts[r];
    counts_[r] = static_cast<int>(std::min<int64_t>(counts[r], INT_MAX));
  }
  MPI_Datatype type;
  MPI_Op mpi_op;
  Map(dtype, op, &type, &mpi_op);
  if (total > INT_MAX) {
    // MPI_Reduce_scatter's total is an int inside Open MPI; reduce each
    // rank's block to that rank instead, in pieces an int can count.  Every
    // rank sees the same counts, so every rank takes this path.
    const int64_t esize = DataTypeSize(dtype);
    const char* block = static_cast<const char*>(in);
    for (int r = 0; r < size_; ++r) {
      MPISTRATEGY_RETURN_IF_ERROR(
          ForEachIntPiece(counts[r], [&](int64_t done, int n) -> Status {
            void* to = r == rank_ ? static_cast<char*>(out) + done * esize
                                  : nullptr;
            MPISTRATEGY_MPI_CHECK(MPI_Reduce(block + done * esize, to, n,
                                             type, mpi_op, r, comm_),
                                  "MPI_Reduce");
            return Status::Ok();
          }));
      block += counts[r] * esize;
    }
    return Status::Ok();
  }
  MPISTRATEGY_MPI_CHECK(MPI_Reduce_scatter(in, out,
                                           counts_.data(), type, mpi_op,
                                           comm_),
                        "MPI_Reduce_scatter");
  return Status::Ok();
}

Status MpiTransport::Alltoallv(const void* in,
                               const std::vector<int64_t>& send_bytes,
                               void* out,
                               const std::vector<int64_t>& recv_bytes) {
  std::vector<int> scounts(size_), sdispls(size_), rcounts(size_),
      rdispls(size_);
  int64_t stotal = 0;
  int64_t rtotal = 0;
  bool fits = true;
  for (int r = 0; r < size_; ++r) {
    // MPI_Alltoallv counts and displacements are ints.
    if (send_bytes[r] > INT_MAX || recv_bytes[r] > INT_MAX ||
        stotal > INT_MAX || rtotal > INT_MAX) {
      fits = false;
    }
    scounts[r] = static_cast<int>(std::min<int64_t>(send_bytes[r], INT_MAX));
    rcounts[r] = static_cast<int>(std::min<int64_t>(recv_bytes[r], INT_MAX));
    sdispls[r] = static_cast<int>(std::min<int64_t>(stotal, INT_MAX));
    rdispls[r] = static_cast<int>(std::min<int64_t>(rtotal, INT_MAX));
    stotal += send_bytes[r];
    rtotal += recv_bytes[r];
  }
  // Whether every rank's blocks fit differs between ranks; all must take
  // the same path.
  int all_fit = fits ? 1 : 0;
  MPISTRATEGY_MPI_CHECK(
      MPI_Allreduce(MPI_IN_PLACE, &all_fit, 1, MPI_INT, MPI_LAND, comm_),
      "MPI_Allreduce(LAND)");
  if (all_fit) {
    MPISTRATEGY_MPI_CHECK(
        MPI_Alltoallv(in, scounts.data(), sdispls.data(), MPI_BYTE, out,
                      rcounts.data(), rdispls.data(), MPI_BYTE, comm_),
        "MPI_Alltoallv");
    return Status::Ok();
  }
  // Point to point, in pieces an int can count, with 64-bit offsets; every
  // request is posted before any is waited for.
  std::vector<MPI_Request> requests;
  const char* send = static_cast<const char*>(in);
  char* recv = static_cast<char*>(out);
  for (int r = 0; r < size_; ++r) {
    MPISTRATEGY_RETURN_IF_ERROR(
        ForEachIntPiece(recv_bytes[r], [&](int64_t done, int n) -> Status {
          requests.emplace_back();
          MPISTRATEGY_MPI_CHECK(MPI_Irecv(recv + done, n, MPI_BYTE, r,
                                          kAlltoallTag, comm_,
                                          &requests.back()),
                                "MPI_Irecv");
          return Status::Ok();
        }));
    MPISTRATEGY_RETURN_IF_ERROR(
        ForEachIntPiece(send_bytes[r], [&](int64_t done, int n) -> Status {
          requests.emplace_back();
          MPISTRATEGY_MPI_CHECK(MPI_Isend(send + done, n, MPI_BYTE, r,
                                          kAlltoallTag, comm_,
                                          &requests.back()),
                                "MPI_Isend");
          return Status::Ok();
        }));
    recv += recv_bytes[r];
    send += send_bytes[r];
  }
  for (MPI_Request& request : requests) {
    MPISTRATEGY_RETURN_IF_ERROR(WaitPolitely(&request, "alltoall piece"));
  }
  return Status::Ok();
}

Status MpiTransport::Barrier() {
  MPI_Request request;
  MPISTRATEGY_MPI_CHECK(MPI_Ibarrier(comm_, &request), "MPI_Ibarrier");
  return WaitPolitely(&request, "MPI_Ibarrier");
}

Status MpiTransport::CreateHostPlane(HostDataPlane kind, int64_t shm_bytes,
                                     DataPlane* world,
                                     std::unique_ptr<DataPlane>* plane) {
  plane->reset();
  if (kind == HostDataPlane::kMpi || size_ == 1) return Status::Ok();
  // {min, -max} of the hosts' rank counts: the same on every rank.
  int sizes[2] = {local_size_, -local_size_};
  MPISTRATEGY_MPI_CHECK(
      MPI_Allreduce(MPI_IN_PLACE, sizes, 2, MPI_INT, MPI_MIN, comm_),
      "MPI_Allreduce(host sizes)");
  const bool even_hosts = sizes[0] == -sizes[1];
  const bool one_host = local_size_ == size_;
  std::string why = -sizes[1] == 1 ? "no two ranks share a host" : "";
  // Hosts with one rank need no segment; the others map one each.
  std::unique_ptr<ShmPlane> shm;
  std::string host_why;
  if (why.empty() && local_size_ > 1) {
    if (local_rank_ == 0) {
      for (const std::string& path : RemoveAbandonedShmSegments()) {
        LogLine(rank_, "removed " + path +
                           ", a shared-memory segment that a killed job "
                           "left behind");
      }
    }
    MPISTRATEGY_RETURN_IF_ERROR(ShmPlane::Create(
        local_comm_, shm_bytes, one_host ? world : nullptr, &shm, &host_why));
  }
  if (why.empty()) {
    // Every host must agree, or the hierarchical steps would not match.
    int ok = shm != nullptr || local_size_ == 1 ? 1 : 0;
    MPISTRATEGY_MPI_CHECK(
        MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, comm_),
        "MPI_Allreduce(shared memory set up)");
    if (!ok) {
      shm.reset();
      // The reason is this host's, or (rank 0's host had none) another's,
      // which that host's first rank logs.
      if (!host_why.empty() && local_rank_ == 0 && rank_ != 0) {
        LogLine(rank_, "shared memory unavailable on this host: " + host_why);
      }
      why = host_why.empty() ? "shared memory is unavailable on another host "
                               "(its first rank logs why)"
                             : host_why;
    }
  }
  if (!why.empty()) {
    if (kind == HostDataPlane::kShm) {
      return Status::FailedPrecondition(
          "data_plane is \"shm\" but shared memory cannot carry this job's "
          "CPU tensors: " + why + " (data_plane \"auto\" falls back to MPI)");
    }
    if (rank_ == 0) LogLine(rank_, "CPU collectives use MPI: " + why);
    return Status::Ok();
  }
  // The plane's waits end when the engine's would (peer timeout).
  auto hook = [this]() -> Status {
    return wait_hook_ ? wait_hook_() : Status::Ok();
  };
  if (shm != nullptr) shm->SetWaitHook(hook);
  if (one_host) {
    // The negotiation too: a rank waiting for the others sleeps until the
    // last one arrives instead of polling MPI (host_rendezvous.h).
    host_and_ = shm->CreateRendezvous();
    host_and_->SetWaitHook(hook);
    *plane = std::move(shm);
    return Status::Ok();
  }
  // Inside a host: shared memory, or nothing to share with one rank.
  std::unique_ptr<DataPlane> local;
  if (shm != nullptr) {
    local = std::move(shm);
  } else {
    std::unique_ptr<Transport> self;
    MPISTRATEGY_RETURN_IF_ERROR(MpiTransport::Create(MPI_COMM_SELF, &self));
    local = std::make_unique<HostPlane>(std::move(self));
  }
  // Across hosts: the ranks with this local rank, one per host that has it.
  // kMean divides by all ranks, as each rank's shard is a sum over its host.
  MPI_Comm cross_comm = MPI_COMM_NULL;
  MPISTRATEGY_MPI_CHECK(MPI_Comm_split(comm_, local_rank_, rank_, &cross_comm),
                        "MPI_Comm_split(cross-host)");
  std::unique_ptr<Transport> cross;
  const Status s = MpiTransport::Create(cross_comm, &cross);
  MPI_Comm_free(&cross_comm);
  MPISTRATEGY_RETURN_IF_ERROR(s);
  cross->SetWaitHook(hook);
  // Hosts of different sizes cannot split a buffer into the same shards:
  // each host's first rank carries the host's whole sum across instead.
  if (!even_hosts && rank_ == 0) {
    LogLine(rank_, "the hosts run different numbers of ranks (" +
                       std::to_string(sizes[0]) + " to " +
                       std::to_string(-sizes[1]) +
                       "): CPU allreduce crosses hosts from each host's "
                       "first rank");
  }
  plane->reset(new HierarchicalPlane(
      std::make_unique<HostPlane>(this), std::move(local),
      std::make_unique<HostPlane>(std::move(cross), size_),
      even_hosts ? HierarchicalPlane::CrossHost::kShards
                 : HierarchicalPlane::CrossHost::kFirstRanks));
  return Status::Ok();
}

}  // namespace mpistrategy
