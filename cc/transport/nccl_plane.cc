// See nccl_plane.h.  Host C++ only (no device code): compiled with
// -DGOOGLE_CUDA=1 against the CUDA runtime and NCCL headers.

#include "cc/transport/nccl_plane.h"

#if GOOGLE_CUDA

#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cc/common/checks.h"
#include "cc/common/logging.h"
#include "cc/transport/hierarchical_plane.h"
#include "cc/transport/host_plane.h"
#include "cc/transport/mpi_transport.h"
#include "cc/transport/staging_plane.h"

namespace mpistrategy {
namespace {

// NCCL 2.12 has everything used here (ncclAvg, ncclBfloat16, send/recv,
// ncclCommGetAsyncError, ncclGetLastError).  Version codes since 2.9 are
// major * 10000 + minor * 100 + patch.
constexpr int kMinNcclVersion = 21200;
// How often the watchdog polls ncclCommGetAsyncError.
constexpr std::chrono::milliseconds kWatchdogPeriod(50);

std::string NcclVersionString(int code) {
  const int major = code >= 10000 ? code / 10000 : code / 1000;
  const int minor = code >= 10000 ? (code % 10000) / 100 : (code % 1000) / 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." +
         std::to_string(code % 100);
}

// NCCL's type and op for (dtype, op).  bool travels as uint8 with max (or)
// for sum/max and min (and) for min/product, as the MPI transport does.
// kMean is ncclAvg (floating dtypes only; the engine checks).
void ToNccl(DataType dtype, ReduceOp op, ncclDataType_t* type,
            ncclRedOp_t* nccl_op) {
  *type = ncclUint8;
  *nccl_op = ncclSum;
  switch (dtype) {
    case DataType::kUint8: *type = ncclUint8; break;
    case DataType::kInt8: *type = ncclInt8; break;
    case DataType::kBool: *type = ncclUint8; break;
    case DataType::kInt32: *type = ncclInt32; break;
    case DataType::kInt64: *type = ncclInt64; break;
    case DataType::kFloat16: *type = ncclFloat16; break;
    case DataType::kBFloat16: *type = ncclBfloat16; break;
    case DataType::kFloat32: *type = ncclFloat32; break;
    case DataType::kFloat64: *type = ncclFloat64; break;
  }
  const bool is_bool = dtype == DataType::kBool;
  switch (op) {
    case ReduceOp::kSum: *nccl_op = is_bool ? ncclMax : ncclSum; break;
    case ReduceOp::kMean: *nccl_op = ncclAvg; break;
    case ReduceOp::kMin: *nccl_op = ncclMin; break;
    case ReduceOp::kMax: *nccl_op = ncclMax; break;
    case ReduceOp::kProduct: *nccl_op = is_bool ? ncclMin : ncclProd; break;
  }
}

bool AllEqual(const std::vector<int64_t>& v) {
  return std::adjacent_find(v.begin(), v.end(),
                            std::not_equal_to<int64_t>()) == v.end();
}

cudaStream_t CudaStreamOf(const Stream* stream) {
  return static_cast<cudaStream_t>(stream->native_handle());
}

// The NCCL communicators of one GPU (all ranks, and for hierarchical
// allreduce the host's ranks), their sticky status and the watchdog that
// aborts them all when one fails.
class NcclComms {
 public:
  NcclComms(int rank, int32_t device) : rank_(rank), device_(device) {}
  NcclComms(const NcclComms&) = delete;
  NcclComms& operator=(const NcclComms&) = delete;

  // Before MPI_Finalize (the engine is destroyed first).  A communicator
  // that failed is aborted (destroying it could wait for dead peers).
  ~NcclComms() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    const bool failed = !async_->Get().ok();
    for (ncclComm_t& comm : comms_) {
      if (comm == nullptr) continue;
      if (failed) {
        ncclCommAbort(comm);
      } else {
        ncclCommDestroy(comm);
      }
      comm = nullptr;
    }
  }

  // Takes `comm`; returns its index for Get.  Starts the watchdog.
  int Add(ncclComm_t comm) {
    std::lock_guard<std::mutex> lock(mu_);
    comms_.push_back(comm);
    if (!watchdog_.joinable()) watchdog_ = std::thread([this] { Watch(); });
    return static_cast<int>(comms_.size()) - 1;
  }

  // The communicator `index`, or the error that aborted it.  Requires mu().
  Status Get(int index, ncclComm_t* comm) const {
    MPISTRATEGY_RETURN_IF_ERROR(async_->Get());
    *comm = comms_[index];
    if (*comm == nullptr) {
      return Status::Unavailable(DeviceString(device_) +
                                 ": the NCCL communicator was aborted");
    }
    return Status::Ok();
  }

  std::mutex& mu() { return mu_; }
  const std::shared_ptr<AsyncStatus>& status() const { return async_; }

 private:
  void Watch() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, kWatchdogPeriod, [this] { return stop_; });
      if (stop_) break;
      for (ncclComm_t comm : comms_) {
        if (comm == nullptr) continue;
        ncclResult_t async = ncclSuccess;
        const ncclResult_t r = ncclCommGetAsyncError(comm, &async);
        if (r != ncclSuccess) async = r;
        if (async == ncclSuccess || async == ncclInProgress) continue;
        std::string why = ncclGetErrorString(async);
        const char* last = ncclGetLastError(comm);
        if (last != nullptr && last[0] != '\0') {
          why += std::string(" (") + last + ")";
        }
        const std::string message =
            DeviceString(device_) + ": NCCL failed asynchronously: " + why +
            "; the communicator was aborted and every GPU collective on this "
            "device fails from now on (a rank may have died or the network "
            "failed; see the other ranks' logs)";
        async_->Fail(Status::Unavailable(message));
        LogLine(rank_, message);
        // Aborting makes the work stuck on the streams finish, so the ops
        // waiting for it complete (with this error).
        for (ncclComm_t& c : comms_) {
          if (c != nullptr) ncclCommAbort(c);
          c = nullptr;
        }
        break;
      }
    }
  }

  const int rank_;
  const int32_t device_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::vector<ncclComm_t> comms_;  // nulled by the watchdog's abort
  std::shared_ptr<AsyncStatus> async_ = std::make_shared<AsyncStatus>();
  std::thread watchdog_;
};

// NCCL over one communicator of `comms`.
class NcclPlane : public DataPlane {
 public:
  NcclPlane(std::shared_ptr<NcclComms> comms, int index, int rank, int size,
            int ordinal)
      : comms_(std::move(comms)),
        index_(index),
        rank_(rank),
        size_(size),
        ordinal_(ordinal) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "NCCL"; }
  std::shared_ptr<const AsyncStatus> async_status() const override {
    return comms_->status();
  }

  Status Allreduce(const void* in, void* out, int64_t count, DataType dtype,
                   ReduceOp op, Stream* stream) override {
    if (count == 0) return Status::Ok();
    ncclDataType_t type;
    ncclRedOp_t nccl_op;
    ToNccl(dtype, op, &type, &nccl_op);
    MPISTRATEGY_CUDA_CHECK(cudaSetDevice(ordinal_));
    std::lock_guard<std::mutex> lock(comms_->mu());
    ncclComm_t comm = nullptr;
    MPISTRATEGY_RETURN_IF_ERROR(comms_->Get(index_, &comm));
    MPISTRATEGY_NCCL_CHECK(
        ncclAllReduce(in, out, static_cast<size_t>(count), type, nccl_op, comm,
                      CudaStreamOf(stream)),
        comm);
    return Status::Ok();
  }

  Status Allgatherv(const void* in, void* out,
                    const std::vector<int64_t>& bytes_per_rank,
                    Stream* stream) override {
    int64_t total = 0;
    for (int64_t b : bytes_per_rank) total += b;
    if (total == 0) return Status::Ok();
    MPISTRATEGY_CUDA_CHECK(cudaSetDevice(ordinal_));
    const cudaStream_t s = CudaStreamOf(stream);
    std::lock_guard<std::mutex> lock(comms_->mu());
    ncclComm_t comm = nullptr;
    MPISTRATEGY_RETURN_IF_ERROR(comms_->Get(index_, &comm));
    if (AllEqual(bytes_per_rank)) {
      MPISTRATEGY_NCCL_CHECK(
          ncclAllGather(in, out, static_cast<size_t>(bytes_per_rank[rank_]),
                        ncclUint8, comm, s),
          comm);
      return Status::Ok();
    }
    // Uneven contributions: one broadcast per rank, fused by the group.
    char* const out_bytes = static_cast<char*>(out);
    MPISTRATEGY_NCCL_CHECK(ncclGroupStart(), comm);
    int64_t offset = 0;
    Status status;
    for (int r = 0; r < size_ && status.ok(); ++r) {
      if (bytes_per_rank[r] > 0) {
        const ncclResult_t nr = ncclBroadcast(
            r == rank_ ? in : out_bytes + offset, out_bytes + offset,
            static_cast<size_t>(bytes_per_rank[r]), ncclUint8, r, comm, s);
        if (nr != ncclSuccess) status = NcclError(nr, "ncclBroadcast", comm);
      }
      offset += bytes_per_rank[r];
    }
    MPISTRATEGY_NCCL_CHECK(ncclGroupEnd(), comm);
    return status;
  }

  Status Broadcast(void* buffer, int64_t bytes, int root_rank,
                   Stream* stream) override {
    if (bytes == 0) return Status::Ok();
    MPISTRATEGY_CUDA_CHECK(cudaSetDevice(ordinal_));
    std::lock_guard<std::mutex> lock(comms_->mu());
    ncclComm_t comm = nullptr;
    MPISTRATEGY_RETURN_IF_ERROR(comms_->Get(index_, &comm));
    MPISTRATEGY_NCCL_CHECK(
        ncclBroadcast(buffer, buffer, static_cast<size_t>(bytes), ncclUint8,
                      root_rank, comm, CudaStreamOf(stream)),
        comm);
    return Status::Ok();
  }

  Status Reducescatter(const void* in, void* out,
                       const std::vector<int64_t>& counts, DataType dtype,
                       ReduceOp op, Stream* stream) override {
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    if (total == 0) return Status::Ok();
    ncclDataType_t type;
    ncclRedOp_t nccl_op;
    ToNccl(dtype, op, &type, &nccl_op);
    MPISTRATEGY_CUDA_CHECK(cudaSetDevice(ordinal_));
    const cudaStream_t s = CudaStreamOf(stream);
    std::lock_guard<std::mutex> lock(comms_->mu());
    ncclComm_t comm = nullptr;
    MPISTRATEGY_RETURN_IF_ERROR(comms_->Get(index_, &comm));
    if (AllEqual(counts)) {
      MPISTRATEGY_NCCL_CHECK(
          ncclReduceScatter(in, out, static_cast<size_t>(counts[0]), type,
                            nccl_op, comm, s),
          comm);
      return Status::Ok();
    }
    // Uneven blocks: one reduce per block, to its rank, fused by the group.
    const char* in_bytes = static_cast<const char*>(in);
    const int64_t element_size = DataTypeSize(dtype);
    MPISTRATEGY_NCCL_CHECK(ncclGroupStart(), comm);
    int64_t offset = 0;
    Status status;
    for (int r = 0; r < size_ && status.ok(); ++r) {
      if (counts[r] > 0) {
        const ncclResult_t nr =
            ncclReduce(in_bytes + offset * element_size, out,
                       static_cast<size_t>(counts[r]), type, nccl_op, r, comm,
                       s);
        if (nr != ncclSuccess) status = NcclError(nr, "ncclReduce", comm);
      }
      offset += counts[r];
    }
    MPISTRATEGY_NCCL_CHECK(ncclGroupEnd(), comm);
    return status;
  }

  Status Alltoallv(const void* in, const std::vector<int64_t>& send_bytes,
                   void* out, const std::vector<int64_t>& recv_bytes,
                   Stream* stream) override {
    const char* in_bytes = static_cast<const char*>(in);
    char* out_bytes = static_cast<char*>(out);
    MPISTRATEGY_CUDA_CHECK(cudaSetDevice(ordinal_));
    const cudaStream_t s = CudaStreamOf(stream);
    int64_t send_offset = 0;
    int64_t recv_offset = 0;
    for (int j = 0; j < rank_; ++j) {
      send_offset += send_bytes[j];
      recv_offset += recv_bytes[j];
    }
    if (send_bytes[rank_] > 0) {  // our own block: a local copy
      MPISTRATEGY_RETURN_IF_ERROR(stream->Memcpy(
          out_bytes + recv_offset, in_bytes + send_offset, send_bytes[rank_],
          CopyKind::kDeviceToDevice));
    }
    std::lock_guard<std::mutex> lock(comms_->mu());
    ncclComm_t comm = nullptr;
    MPISTRATEGY_RETURN_IF_ERROR(comms_->Get(index_, &comm));
    MPISTRATEGY_NCCL_CHECK(ncclGroupStart(), comm);
    Status status;
    send_offset = 0;
    recv_offset = 0;
    for (int j = 0; j < size_ && status.ok(); ++j) {
      if (j != rank_ && send_bytes[j] > 0) {
        const ncclResult_t nr =
            ncclSend(in_bytes + send_offset, static_cast<size_t>(send_bytes[j]),
                     ncclUint8, j, comm, s);
        if (nr != ncclSuccess) status = NcclError(nr, "ncclSend", comm);
      }
      if (status.ok() && j != rank_ && recv_bytes[j] > 0) {
        const ncclResult_t nr =
            ncclRecv(out_bytes + recv_offset,
                     static_cast<size_t>(recv_bytes[j]), ncclUint8, j, comm, s);
        if (nr != ncclSuccess) status = NcclError(nr, "ncclRecv", comm);
      }
      send_offset += send_bytes[j];
      recv_offset += recv_bytes[j];
    }
    MPISTRATEGY_NCCL_CHECK(ncclGroupEnd(), comm);
    return status;
  }

 private:
  const std::shared_ptr<NcclComms> comms_;
  const int index_;
  const int rank_;
  const int size_;
  const int ordinal_;
};

// Why NCCL cannot be used, from every rank's "host\nbus id\nNCCL version";
// empty when it can.
std::string StagingReason(const std::vector<std::string>& all) {
  std::map<std::string, int> owner;  // "host bus" -> first rank
  for (size_t r = 0; r < all.size(); ++r) {
    const std::string& m = all[r];
    const size_t a = m.find('\n');
    const size_t b = a == std::string::npos ? a : m.find('\n', a + 1);
    if (b == std::string::npos) {
      return "rank " + std::to_string(r) + " sent a malformed setup message";
    }
    const std::string host = m.substr(0, a);
    const std::string bus = m.substr(a + 1, b - a - 1);
    const int version = std::atoi(m.c_str() + b + 1);
    if (version < kMinNcclVersion) {
      return "rank " + std::to_string(r) +
             (version <= 0 ? " has no usable NCCL library"
                           : " has NCCL " + NcclVersionString(version) +
                                 ", older than " +
                                 NcclVersionString(kMinNcclVersion));
    }
    auto inserted = owner.emplace(host + " " + bus, static_cast<int>(r));
    if (!inserted.second) {
      return "ranks " + std::to_string(inserted.first->second) + " and " +
             std::to_string(r) + " share GPU " + bus + " on host " + host +
             "; NCCL needs a GPU of its own for every rank";
    }
  }
  return std::string();
}

// The host's ranks and the cross-host MPI transport for hierarchical
// allreduce; leaves `*local` null (and logs why on rank 0) when the
// job does not allow it.
Status SetupHierarchical(Transport* control, int ordinal,
                         const std::shared_ptr<NcclComms>& comms,
                         std::unique_ptr<DataPlane>* local,
                         std::unique_ptr<DataPlane>* cross) {
  const int rank = control->rank();
  auto* mpi = dynamic_cast<MpiTransport*>(control);
  if (mpi == nullptr) {
    if (rank == 0) {
      LogLine(rank, "hierarchical_allreduce needs the MPI transport; GPU "
                    "allreduces use NCCL over all ranks");
    }
    return Status::Ok();
  }
  MPI_Comm world = mpi->comm();
  MPI_Comm local_comm = MPI_COMM_NULL;
  MPISTRATEGY_MPI_CHECK(MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, rank,
                                            MPI_INFO_NULL, &local_comm),
                        "MPI_Comm_split_type");
  int local_rank = 0;
  int local_size = 1;
  MPI_Comm_rank(local_comm, &local_rank);
  MPI_Comm_size(local_comm, &local_size);
  // {min, -max} of the hosts' rank counts.
  int sizes[2] = {local_size, -local_size};
  int rc = MPI_Allreduce(MPI_IN_PLACE, sizes, 2, MPI_INT, MPI_MIN, world);
  if (rc != MPI_SUCCESS || sizes[0] != -sizes[1]) {
    MPI_Comm_free(&local_comm);
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Allreduce");
    if (rank == 0) {
      LogLine(rank, "hierarchical_allreduce needs the same number of ranks "
                    "on every host (found " + std::to_string(sizes[0]) +
                        " to " + std::to_string(-sizes[1]) +
                        "); GPU allreduces use NCCL over all ranks");
    }
    return Status::Ok();
  }
  MPI_Comm cross_comm = MPI_COMM_NULL;
  rc = MPI_Comm_split(world, local_rank, rank, &cross_comm);
  if (rc != MPI_SUCCESS) {
    MPI_Comm_free(&local_comm);
    return MpiError(rc, "MPI_Comm_split");
  }
  std::unique_ptr<Transport> cross_transport;
  Status s = MpiTransport::Create(cross_comm, &cross_transport);
  MPI_Comm_free(&cross_comm);
  // The host's NCCL id, from its local rank 0.
  char message[1 + sizeof(ncclUniqueId)] = {0};
  if (local_rank == 0 && s.ok()) {
    ncclUniqueId id;
    if (ncclGetUniqueId(&id) == ncclSuccess) {
      message[0] = 1;
      std::memcpy(message + 1, &id, sizeof(id));
    }
  }
  rc = MPI_Bcast(message, static_cast<int>(sizeof(message)), MPI_BYTE, 0,
                 local_comm);
  MPI_Comm_free(&local_comm);
  MPISTRATEGY_RETURN_IF_ERROR(s);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Bcast");
  if (message[0] != 1) {
    return Status::Unavailable(
        "hierarchical allreduce: ncclGetUniqueId failed on the first rank "
        "of this host");
  }
  ncclUniqueId id;
  std::memcpy(&id, message + 1, sizeof(id));
  ncclComm_t comm = nullptr;
  MPISTRATEGY_NCCL_CHECK(ncclCommInitRank(&comm, local_size, id, local_rank),
                         nullptr);
  const int index = comms->Add(comm);
  local->reset(new NcclPlane(comms, index, local_rank, local_size, ordinal));
  // Across hosts: host staging of each rank's shard; kMean divides by all
  // ranks, as the shards are sums over a host.
  cross->reset(new StagingPlane(
      std::make_unique<HostPlane>(std::move(cross_transport)),
      control->size()));
  return Status::Ok();
}

}  // namespace

Status CreateNcclPlane(Transport* control, bool hierarchical_allreduce,
                       int32_t device, int ordinal,
                       std::unique_ptr<DataPlane>* plane) {
  if (control == nullptr) {
    return Status::InvalidArgument("CreateNcclPlane: control is null");
  }
  const int rank = control->rank();
  const int size = control->size();
  MPISTRATEGY_CUDA_CHECK(cudaSetDevice(ordinal));
  char bus[64] = {0};
  MPISTRATEGY_CUDA_CHECK(
      cudaDeviceGetPCIBusId(bus, static_cast<int>(sizeof(bus)), ordinal));
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) != 0) {
    std::snprintf(host, sizeof(host), "unknown-host-of-rank-%d", rank);
  }
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess) version = 0;

  // 1. Rank 0 decides for everyone, from everyone's (host, GPU, NCCL).
  std::vector<std::string> all;
  MPISTRATEGY_RETURN_IF_ERROR(control->GatherBytes(
      std::string(host) + "\n" + bus + "\n" + std::to_string(version), &all));
  // 'N' + ncclUniqueId, or 'S' + the reason for host staging.
  std::string decision;
  if (rank == 0) {
    std::string reason = StagingReason(all);
    ncclUniqueId id;
    std::memset(&id, 0, sizeof(id));
    if (reason.empty()) {
      const ncclResult_t r = ncclGetUniqueId(&id);
      if (r != ncclSuccess) {
        reason = std::string("ncclGetUniqueId failed on rank 0: ") +
                 ncclGetErrorString(r);
      }
    }
    decision = reason.empty()
                   ? "N" + std::string(reinterpret_cast<const char*>(&id),
                                       sizeof(id))
                   : "S" + reason;
  }
  MPISTRATEGY_RETURN_IF_ERROR(control->BroadcastBytes(&decision));
  if (decision.empty() || (decision[0] != 'N' && decision[0] != 'S') ||
      (decision[0] == 'N' && decision.size() != 1 + sizeof(ncclUniqueId))) {
    return Status::Internal("malformed NCCL set-up message from rank 0");
  }
  if (decision[0] == 'S') {
    if (rank == 0) {
      LogLine(rank, DeviceString(device) + ": NCCL cannot be used (" +
                        decision.substr(1) +
                        "); GPU collectives go through MPI with host staging "
                        "(device-to-host copy, MPI, host-to-device copy)");
    }
    plane->reset(new StagingPlane(std::make_unique<HostPlane>(control)));
    return Status::Ok();
  }

  // 2. NCCL over all ranks.
  ncclUniqueId id;
  std::memcpy(&id, decision.data() + 1, sizeof(id));
  ncclComm_t world_comm = nullptr;
  MPISTRATEGY_NCCL_CHECK(ncclCommInitRank(&world_comm, size, id, rank),
                         nullptr);
  auto comms = std::make_shared<NcclComms>(rank, device);
  const int world_index = comms->Add(world_comm);
  std::unique_ptr<DataPlane> world(
      new NcclPlane(comms, world_index, rank, size, ordinal));
  // 3. Hierarchical allreduce.
  std::unique_ptr<DataPlane> local;
  std::unique_ptr<DataPlane> cross;
  if (hierarchical_allreduce) {
    MPISTRATEGY_RETURN_IF_ERROR(
        SetupHierarchical(control, ordinal, comms, &local, &cross));
  }
  if (rank == 0) {
    std::string how = DeviceString(device) + ": NCCL " +
                      NcclVersionString(version) + " over " +
                      std::to_string(size) + " rank(s)";
    if (local != nullptr) {
      how += "; hierarchical allreduce: NCCL among the " +
             std::to_string(local->size()) +
             " rank(s) of each host, MPI across hosts";
    }
    LogLine(rank, how);
  }
  if (local != nullptr) {
    plane->reset(new HierarchicalPlane(std::move(world), std::move(local),
                                       std::move(cross)));
  } else {
    *plane = std::move(world);
  }
  return Status::Ok();
}

}  // namespace mpistrategy

#else  // !GOOGLE_CUDA

namespace mpistrategy {

Status CreateNcclPlane(Transport* /*control*/, bool /*hierarchical_allreduce*/,
                       int32_t /*device*/, int /*ordinal*/,
                       std::unique_ptr<DataPlane>* /*plane*/) {
  return Status::Unimplemented(
      "mpistrategy was built without CUDA; rebuild with "
      "`bazel build --config=cuda //cc:_mpi_ops.so` for GPU collectives");
}

}  // namespace mpistrategy

#endif  // GOOGLE_CUDA
