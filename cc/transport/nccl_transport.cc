// See nccl_transport.h.  Host C++ only (no device code): compiled with
// -DGOOGLE_CUDA=1 against the CUDA runtime and NCCL headers; the cuda*/nccl*
// symbols resolve at run time to the libraries TensorFlow loads.

#include "cc/transport/nccl_transport.h"

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
#include "cc/common/reduce_kernels.h"
#include "cc/transport/mpi_transport.h"

namespace mpistrategy {
namespace {

// NCCL 2.12 has everything used here (ncclAvg, ncclBfloat16, send/recv,
// ncclCommGetAsyncError, ncclGetLastError).  Version codes since 2.9 are
// major * 10000 + minor * 100 + patch.
constexpr int kMinNcclVersion = 21200;
// How often the watchdog polls ncclCommGetAsyncError.
constexpr std::chrono::milliseconds kWatchdogPeriod(50);
// Device scratch buffers grow in steps of this many bytes.
constexpr int64_t kBufferGranularity = int64_t{1} << 20;

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

// kMean over MPI or NCCL-then-MPI: sum, then divide on the host.
ReduceOp SumForMean(ReduceOp op) {
  return op == ReduceOp::kMean ? ReduceOp::kSum : op;
}

cudaStream_t StreamOf(const TensorEntry& entry) {
  return static_cast<cudaStream_t>(entry.device_context->stream());
}

bool AllEqual(const std::vector<int64_t>& v) {
  return std::adjacent_find(v.begin(), v.end(),
                            std::not_equal_to<int64_t>()) == v.end();
}

enum class Path { kNccl, kStaging };

// One framework GPU id's communicators and buffers.
struct DeviceComm {
  DeviceComm() = default;
  DeviceComm(const DeviceComm&) = delete;
  DeviceComm& operator=(const DeviceComm&) = delete;

  // Before MPI_Finalize (the engine is destroyed first).  A communicator
  // that failed is aborted (destroying it could wait for dead peers).
  ~DeviceComm() {
    const bool failed = !status->Get().ok();
    for (ncclComm_t* comm : {&local, &world}) {
      if (*comm == nullptr) continue;
      if (failed) {
        ncclCommAbort(*comm);
      } else {
        ncclCommDestroy(*comm);
      }
      *comm = nullptr;
    }
    if (event != nullptr) cudaEventDestroy(event);
  }

  int32_t device = kCpuDevice;  // TensorEntry::device
  int ordinal = 0;              // CUDA device
  Path path = Path::kStaging;
  // NCCL over all ranks, and (hierarchical) over this host's ranks.  The
  // watchdog aborts and nulls them under NcclTransport::mu_.
  ncclComm_t world = nullptr;
  ncclComm_t local = nullptr;
  // Hierarchical allreduce is set up (`local` and `cross` exist).  Unlike
  // the handles, never changed after set-up.
  bool hierarchical = false;
  int local_rank = 0;
  int local_size = 1;
  // Hierarchical: MPI among the ranks with this rank's local rank.
  std::unique_ptr<Transport> cross;
  // Sticky: the first asynchronous NCCL error.
  std::shared_ptr<AsyncStatus> status = std::make_shared<AsyncStatus>();
  // Fusion buffer / scratch space on the device; grows only.
  std::shared_ptr<void> buffer;
  int64_t capacity = 0;
  // The stream that last used `buffer`.
  cudaStream_t buffer_stream = nullptr;
  // Orders streams when a bucket spans several (reused: a wait captures
  // the event's state when it is enqueued).
  cudaEvent_t event = nullptr;
};

class NcclTransport : public DeviceTransport {
 public:
  NcclTransport(Transport* control, bool hierarchical)
      : control_(control),
        hierarchical_(hierarchical),
        rank_(control->rank()),
        size_(control->size()) {}

  ~NcclTransport() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    watchdog_cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    if (host_stream_ != nullptr) cudaStreamSynchronize(host_stream_);
    comms_.clear();
  }

  Status Execute(const std::vector<const Response*>& responses,
                 const std::vector<TensorEntry*>& entries,
                 std::vector<Status>* entry_status) override;

 private:
  // The communicators of the entry's device, created on first use.
  Status GetComm(const TensorEntry& entry, DeviceComm** comm);
  Status Setup(DeviceComm* c);
  Status SetupHierarchical(DeviceComm* c);
  void Watchdog();

  // Makes `stream` wait for the bucket's other streams (and the buffer's
  // last user); ForkStreams makes them wait for `stream` afterwards.
  Status JoinStreams(DeviceComm* c, cudaStream_t stream,
                     const std::vector<TensorEntry*>& entries);
  Status ForkStreams(DeviceComm* c, cudaStream_t stream);

  // The device buffer of `c`, at least `bytes` (> 0) long.
  Status DeviceBuffer(DeviceComm* c, const DeviceContext& ctx, int64_t bytes,
                      char** buffer);
  // The host staging buffer, at least `bytes` long, once no copy from it is
  // pending on any stream.  Call MarkHostRead after enqueueing a copy from
  // it.
  Status HostBuffer(int64_t bytes, char** buffer);
  void MarkHostRead(cudaStream_t stream) { host_stream_ = stream; }

  Status Allreduce(DeviceComm* c, cudaStream_t stream,
                   const std::vector<const Response*>& responses,
                   const std::vector<TensorEntry*>& entries,
                   std::vector<Status>* entry_status);
  Status StagedAllreduce(cudaStream_t stream,
                         const std::vector<const Response*>& responses,
                         const std::vector<TensorEntry*>& entries,
                         int64_t total, std::vector<Status>* entry_status);
  Status HierarchicalAllreduce(DeviceComm* c, cudaStream_t stream,
                               const std::vector<const Response*>& responses,
                               const std::vector<TensorEntry*>& entries,
                               int64_t total,
                               std::vector<Status>* entry_status);
  Status Allgather(DeviceComm* c, cudaStream_t stream,
                   const Response& response, TensorEntry* entry,
                   Status* entry_status);
  Status Broadcast(DeviceComm* c, cudaStream_t stream,
                   const Response& response, TensorEntry* entry);
  Status Reducescatter(DeviceComm* c, cudaStream_t stream,
                       const Response& response, TensorEntry* entry,
                       Status* entry_status);
  Status Alltoall(DeviceComm* c, cudaStream_t stream,
                  const Response& response, TensorEntry* entry,
                  Status* entry_status);

  // Device-to-device copies between the entries and a packed buffer.
  Status Pack(const std::vector<const Response*>& responses,
              const std::vector<TensorEntry*>& entries, char* buffer,
              cudaStream_t stream);
  Status Unpack(const std::vector<const Response*>& responses,
                const std::vector<TensorEntry*>& entries, const char* buffer,
                cudaStream_t stream);

  Transport* const control_;
  const bool hierarchical_;
  const int rank_;
  const int size_;

  // Guards the communicator handles against the watchdog (and comms_'s
  // structure).  The engine thread holds it while it enqueues NCCL work,
  // never while it waits for a stream.
  std::mutex mu_;
  std::condition_variable watchdog_cv_;
  bool stop_ = false;
  std::map<int32_t, std::unique_ptr<DeviceComm>> comms_;
  std::thread watchdog_;

  // Host staging (engine thread only).
  std::vector<char> host_;
  cudaStream_t host_stream_ = nullptr;  // a copy from host_ may be pending
  // Reused per call.
  std::vector<cudaStream_t> streams_;
  std::vector<int64_t> counts_;
  std::vector<int64_t> counts2_;
};

Status NcclTransport::Execute(const std::vector<const Response*>& responses,
                              const std::vector<TensorEntry*>& entries,
                              std::vector<Status>* entry_status) {
  entry_status->assign(entries.size(), Status::Ok());
  for (const TensorEntry* e : entries) {
    if (e->device_context == nullptr) {
      return Status::Internal("GPU collective \"" + e->name +
                              "\" has no device context");
    }
  }
  const Response& first = *responses[0];
  DeviceComm* c = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(GetComm(*entries[0], &c));
  // A failed communicator fails every later collective on the device.
  MPISTRATEGY_RETURN_IF_ERROR(c->status->Get());
  MPISTRATEGY_CUDA_CHECK(cudaSetDevice(c->ordinal));
  const cudaStream_t stream = StreamOf(*entries[0]);
  MPISTRATEGY_RETURN_IF_ERROR(JoinStreams(c, stream, entries));
  Status s;
  switch (first.type) {
    case ResponseType::kAllreduce:
      s = Allreduce(c, stream, responses, entries, entry_status);
      break;
    case ResponseType::kAllgather:
      s = Allgather(c, stream, first, entries[0], &(*entry_status)[0]);
      break;
    case ResponseType::kBroadcast:
      s = Broadcast(c, stream, first, entries[0]);
      break;
    case ResponseType::kReducescatter:
      s = Reducescatter(c, stream, first, entries[0], &(*entry_status)[0]);
      break;
    case ResponseType::kAlltoall:
      s = Alltoall(c, stream, first, entries[0], &(*entry_status)[0]);
      break;
    case ResponseType::kBarrier:
    case ResponseType::kError:
      s = Status::Internal(std::string("NcclTransport given a ") +
                           ResponseTypeName(first.type) + " response");
      break;
  }
  MPISTRATEGY_RETURN_IF_ERROR(s);
  MPISTRATEGY_RETURN_IF_ERROR(ForkStreams(c, stream));
  std::shared_ptr<const AsyncStatus> async;
  if (c->path == Path::kNccl) async = c->status;
  for (TensorEntry* e : entries) e->device_context->set_async_status(async);
  return Status::Ok();
}

// ---- set-up -----------------------------------------------------------------

Status NcclTransport::GetComm(const TensorEntry& entry, DeviceComm** comm) {
  auto it = comms_.find(entry.device);
  if (it != comms_.end()) {
    *comm = it->second.get();
    return Status::Ok();
  }
  std::unique_ptr<DeviceComm> c(new DeviceComm());
  c->device = entry.device;
  c->ordinal = entry.device_context->ordinal();
  MPISTRATEGY_RETURN_IF_ERROR(Setup(c.get()));
  const bool nccl = c->path == Path::kNccl;
  *comm = c.get();
  {
    std::lock_guard<std::mutex> lock(mu_);
    comms_[entry.device] = std::move(c);
  }
  if (nccl && !watchdog_.joinable()) {
    watchdog_ = std::thread([this] { Watchdog(); });
  }
  return Status::Ok();
}

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

Status NcclTransport::Setup(DeviceComm* c) {
  MPISTRATEGY_CUDA_CHECK(cudaSetDevice(c->ordinal));
  MPISTRATEGY_CUDA_CHECK(
      cudaEventCreateWithFlags(&c->event, cudaEventDisableTiming));
  char bus[64] = {0};
  MPISTRATEGY_CUDA_CHECK(
      cudaDeviceGetPCIBusId(bus, static_cast<int>(sizeof(bus)), c->ordinal));
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) != 0) {
    std::snprintf(host, sizeof(host), "unknown-host-of-rank-%d", rank_);
  }
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess) version = 0;

  // 1. Rank 0 decides for everyone, from everyone's (host, GPU, NCCL).
  std::vector<std::string> all;
  MPISTRATEGY_RETURN_IF_ERROR(control_->GatherBytes(
      std::string(host) + "\n" + bus + "\n" + std::to_string(version), &all));
  // 'N' + ncclUniqueId, or 'S' + the reason for host staging.
  std::string decision;
  if (rank_ == 0) {
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
  MPISTRATEGY_RETURN_IF_ERROR(control_->BroadcastBytes(&decision));
  if (decision.empty() || (decision[0] != 'N' && decision[0] != 'S') ||
      (decision[0] == 'N' && decision.size() != 1 + sizeof(ncclUniqueId))) {
    return Status::Internal("malformed NCCL set-up message from rank 0");
  }
  if (decision[0] == 'S') {
    c->path = Path::kStaging;
    if (rank_ == 0) {
      LogLine(rank_, DeviceString(c->device) + ": NCCL cannot be used (" +
                     decision.substr(1) +
                     "); GPU collectives go through MPI with host staging "
                     "(device-to-host copy, MPI, host-to-device copy)");
    }
    return Status::Ok();
  }

  // 2. NCCL over all ranks.
  ncclUniqueId id;
  std::memcpy(&id, decision.data() + 1, sizeof(id));
  c->path = Path::kNccl;
  MPISTRATEGY_NCCL_CHECK(ncclCommInitRank(&c->world, size_, id, rank_),
                         nullptr);
  // 3. Hierarchical allreduce.
  if (hierarchical_) MPISTRATEGY_RETURN_IF_ERROR(SetupHierarchical(c));
  if (rank_ == 0) {
    std::string how = DeviceString(c->device) + ": NCCL " +
                      NcclVersionString(version) + " over " +
                      std::to_string(size_) + " rank(s)";
    if (c->hierarchical) {
      how += "; hierarchical allreduce: NCCL among the " +
             std::to_string(c->local_size) +
             " rank(s) of each host, MPI across hosts";
    }
    LogLine(rank_, how);
  }
  return Status::Ok();
}

Status NcclTransport::SetupHierarchical(DeviceComm* c) {
  auto* mpi = dynamic_cast<MpiTransport*>(control_);
  if (mpi == nullptr) {
    if (rank_ == 0) {
      LogLine(rank_, "hierarchical_allreduce needs the MPI transport; GPU "
                 "allreduces use NCCL over all ranks");
    }
    return Status::Ok();
  }
  MPI_Comm world = mpi->comm();
  MPI_Comm local = MPI_COMM_NULL;
  MPISTRATEGY_MPI_CHECK(MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED,
                                            rank_, MPI_INFO_NULL, &local),
                        "MPI_Comm_split_type");
  int local_rank = 0;
  int local_size = 1;
  MPI_Comm_rank(local, &local_rank);
  MPI_Comm_size(local, &local_size);
  // {min, -max} of the hosts' rank counts.
  int sizes[2] = {local_size, -local_size};
  int rc = MPI_Allreduce(MPI_IN_PLACE, sizes, 2, MPI_INT, MPI_MIN, world);
  if (rc != MPI_SUCCESS || sizes[0] != -sizes[1]) {
    MPI_Comm_free(&local);
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Allreduce");
    if (rank_ == 0) {
      LogLine(rank_, "hierarchical_allreduce needs the same number of ranks on "
                 "every host (found " + std::to_string(sizes[0]) + " to " +
                 std::to_string(-sizes[1]) +
                 "); GPU allreduces use NCCL over all ranks");
    }
    return Status::Ok();
  }
  MPI_Comm cross = MPI_COMM_NULL;
  rc = MPI_Comm_split(world, local_rank, rank_, &cross);
  if (rc != MPI_SUCCESS) {
    MPI_Comm_free(&local);
    return MpiError(rc, "MPI_Comm_split");
  }
  Status s = MpiTransport::Create(cross, &c->cross);
  MPI_Comm_free(&cross);
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
                 local);
  MPI_Comm_free(&local);
  MPISTRATEGY_RETURN_IF_ERROR(s);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Bcast");
  if (message[0] != 1) {
    return Status::Unavailable(
        "hierarchical allreduce: ncclGetUniqueId failed on the first rank "
        "of this host");
  }
  ncclUniqueId id;
  std::memcpy(&id, message + 1, sizeof(id));
  MPISTRATEGY_NCCL_CHECK(
      ncclCommInitRank(&c->local, local_size, id, local_rank), nullptr);
  c->hierarchical = true;
  c->local_rank = local_rank;
  c->local_size = local_size;
  return Status::Ok();
}

void NcclTransport::Watchdog() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    watchdog_cv_.wait_for(lock, kWatchdogPeriod, [this] { return stop_; });
    if (stop_) break;
    for (auto& item : comms_) {
      DeviceComm* c = item.second.get();
      for (ncclComm_t comm : {c->world, c->local}) {
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
            DeviceString(c->device) + ": NCCL failed asynchronously: " + why +
            "; the communicator was aborted and every GPU collective on this "
            "device fails from now on (a rank may have died or the network "
            "failed; see the other ranks' logs)";
        c->status->Fail(Status::Unavailable(message));
        LogLine(rank_, message);
        // Aborting makes the work stuck on the streams finish, so the ops
        // waiting for it complete (with this error).
        for (ncclComm_t* h : {&c->world, &c->local}) {
          if (*h != nullptr) ncclCommAbort(*h);
          *h = nullptr;
        }
        break;
      }
    }
  }
}

// ---- streams and buffers ---------------------------------------------------

Status NcclTransport::JoinStreams(DeviceComm* c, cudaStream_t stream,
                                  const std::vector<TensorEntry*>& entries) {
  streams_.clear();
  auto add = [this, stream](cudaStream_t s) {
    if (s != nullptr && s != stream &&
        std::find(streams_.begin(), streams_.end(), s) == streams_.end()) {
      streams_.push_back(s);
    }
  };
  for (const TensorEntry* e : entries) add(StreamOf(*e));
  add(c->buffer_stream);
  for (cudaStream_t s : streams_) {
    MPISTRATEGY_CUDA_CHECK(cudaEventRecord(c->event, s));
    MPISTRATEGY_CUDA_CHECK(cudaStreamWaitEvent(stream, c->event, 0));
  }
  return Status::Ok();
}

Status NcclTransport::ForkStreams(DeviceComm* c, cudaStream_t stream) {
  c->buffer_stream = stream;
  if (streams_.empty()) return Status::Ok();
  MPISTRATEGY_CUDA_CHECK(cudaEventRecord(c->event, stream));
  for (cudaStream_t s : streams_) {
    MPISTRATEGY_CUDA_CHECK(cudaStreamWaitEvent(s, c->event, 0));
  }
  return Status::Ok();
}

Status NcclTransport::DeviceBuffer(DeviceComm* c, const DeviceContext& ctx,
                                   int64_t bytes, char** buffer) {
  if (bytes > c->capacity) {
    // Freed first so the allocator can reuse the space; like any buffer of
    // the framework's, it may be reused by work enqueued after ours.
    c->buffer.reset();
    c->capacity = 0;
    const int64_t want =
        (bytes + kBufferGranularity - 1) / kBufferGranularity *
        kBufferGranularity;
    MPISTRATEGY_RETURN_IF_ERROR(ctx.Allocate(want, &c->buffer));
    c->capacity = want;
  }
  *buffer = static_cast<char*>(c->buffer.get());
  return Status::Ok();
}

Status NcclTransport::HostBuffer(int64_t bytes, char** buffer) {
  // A pending host-to-device copy may still read the buffer (cudaMemcpyAsync
  // from pageable memory may return before it has read it).
  if (host_stream_ != nullptr) {
    const cudaStream_t s = host_stream_;
    host_stream_ = nullptr;
    MPISTRATEGY_CUDA_CHECK(cudaStreamSynchronize(s));
  }
  if (static_cast<int64_t>(host_.size()) < bytes) {
    host_.resize(static_cast<size_t>(bytes));
  }
  *buffer = host_.data();
  return Status::Ok();
}

Status NcclTransport::Pack(const std::vector<const Response*>& responses,
                           const std::vector<TensorEntry*>& entries,
                           char* buffer, cudaStream_t stream) {
  const int64_t element_size = DataTypeSize(responses[0]->dtype);
  int64_t offset = 0;
  for (size_t k = 0; k < responses.size(); ++k) {
    const int64_t bytes = NumElements(responses[k]->shapes[0]) * element_size;
    if (bytes > 0) {
      MPISTRATEGY_CUDA_CHECK(cudaMemcpyAsync(buffer + offset, entries[k]->input,
                                             bytes, cudaMemcpyDeviceToDevice,
                                             stream));
    }
    offset += bytes;
  }
  return Status::Ok();
}

Status NcclTransport::Unpack(const std::vector<const Response*>& responses,
                             const std::vector<TensorEntry*>& entries,
                             const char* buffer, cudaStream_t stream) {
  const int64_t element_size = DataTypeSize(responses[0]->dtype);
  int64_t offset = 0;
  for (size_t k = 0; k < responses.size(); ++k) {
    const int64_t bytes = NumElements(responses[k]->shapes[0]) * element_size;
    if (bytes > 0) {
      MPISTRATEGY_CUDA_CHECK(cudaMemcpyAsync(entries[k]->output,
                                             buffer + offset, bytes,
                                             cudaMemcpyDeviceToDevice, stream));
    }
    offset += bytes;
  }
  return Status::Ok();
}

// ---- collectives -----------------------------------------------------------

Status NcclTransport::Allreduce(DeviceComm* c, cudaStream_t stream,
                                const std::vector<const Response*>& responses,
                                const std::vector<TensorEntry*>& entries,
                                std::vector<Status>* entry_status) {
  const Response& first = *responses[0];
  int64_t total = 0;
  for (const Response* r : responses) total += NumElements(r->shapes[0]);
  if (total == 0) return Status::Ok();
  if (c->path == Path::kStaging) {
    return StagedAllreduce(stream, responses, entries, total, entry_status);
  }
  if (c->hierarchical) {
    return HierarchicalAllreduce(c, stream, responses, entries, total,
                                 entry_status);
  }
  ncclDataType_t type;
  ncclRedOp_t op;
  ToNccl(first.dtype, first.reduce_op, &type, &op);
  if (responses.size() == 1) {
    // The big-tensor path: straight from input to output.
    std::lock_guard<std::mutex> lock(mu_);
    MPISTRATEGY_RETURN_IF_ERROR(c->status->Get());
    MPISTRATEGY_NCCL_CHECK(
        ncclAllReduce(entries[0]->input, entries[0]->output,
                      static_cast<size_t>(total), type, op, c->world, stream),
        c->world);
    return Status::Ok();
  }
  char* buffer = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(
      DeviceBuffer(c, *entries[0]->device_context,
                   total * DataTypeSize(first.dtype), &buffer));
  MPISTRATEGY_RETURN_IF_ERROR(Pack(responses, entries, buffer, stream));
  {
    std::lock_guard<std::mutex> lock(mu_);
    MPISTRATEGY_RETURN_IF_ERROR(c->status->Get());
    MPISTRATEGY_NCCL_CHECK(ncclAllReduce(buffer, buffer,
                                         static_cast<size_t>(total), type, op,
                                         c->world, stream),
                           c->world);
  }
  return Unpack(responses, entries, buffer, stream);
}

Status NcclTransport::StagedAllreduce(
    cudaStream_t stream, const std::vector<const Response*>& responses,
    const std::vector<TensorEntry*>& entries, int64_t total,
    std::vector<Status>* entry_status) {
  const Response& first = *responses[0];
  const int64_t element_size = DataTypeSize(first.dtype);
  char* host = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(HostBuffer(total * element_size, &host));
  int64_t offset = 0;
  for (size_t k = 0; k < responses.size(); ++k) {
    const int64_t bytes = NumElements(responses[k]->shapes[0]) * element_size;
    if (bytes > 0) {
      MPISTRATEGY_CUDA_CHECK(cudaMemcpyAsync(host + offset, entries[k]->input,
                                             bytes, cudaMemcpyDeviceToHost,
                                             stream));
    }
    offset += bytes;
  }
  MPISTRATEGY_CUDA_CHECK(cudaStreamSynchronize(stream));
  MPISTRATEGY_RETURN_IF_ERROR(control_->Allreduce(
      host, host, total, first.dtype, SumForMean(first.reduce_op)));
  if (first.reduce_op == ReduceOp::kMean) {
    Status s = DivideInPlace(first.dtype, host, total, size_);
    if (!s.ok()) entry_status->assign(entries.size(), s);
  }
  offset = 0;
  for (size_t k = 0; k < responses.size(); ++k) {
    const int64_t bytes = NumElements(responses[k]->shapes[0]) * element_size;
    if (bytes > 0) {
      MPISTRATEGY_CUDA_CHECK(cudaMemcpyAsync(entries[k]->output, host + offset,
                                             bytes, cudaMemcpyHostToDevice,
                                             stream));
    }
    offset += bytes;
  }
  MarkHostRead(stream);
  return Status::Ok();
}

// NCCL reduce-scatter inside the host, MPI allreduce of this rank's shard
// across hosts, NCCL allgather inside the host.  The packed buffer is padded
// to a multiple of the host's rank count; the padding is reduced too and
// then ignored.
Status NcclTransport::HierarchicalAllreduce(
    DeviceComm* c, cudaStream_t stream,
    const std::vector<const Response*>& responses,
    const std::vector<TensorEntry*>& entries, int64_t total,
    std::vector<Status>* entry_status) {
  const Response& first = *responses[0];
  const int64_t element_size = DataTypeSize(first.dtype);
  const int64_t shard = (total + c->local_size - 1) / c->local_size;
  const int64_t shard_bytes = shard * element_size;
  char* buffer = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(DeviceBuffer(c, *entries[0]->device_context,
                                           shard_bytes * c->local_size,
                                           &buffer));
  char* mine = buffer + c->local_rank * shard_bytes;
  MPISTRATEGY_RETURN_IF_ERROR(Pack(responses, entries, buffer, stream));
  ncclDataType_t type;
  ncclRedOp_t op;
  ToNccl(first.dtype, SumForMean(first.reduce_op), &type, &op);
  {
    std::lock_guard<std::mutex> lock(mu_);
    MPISTRATEGY_RETURN_IF_ERROR(c->status->Get());
    MPISTRATEGY_NCCL_CHECK(
        ncclReduceScatter(buffer, mine, static_cast<size_t>(shard), type, op,
                          c->local, stream),
        c->local);
  }
  char* host = nullptr;
  MPISTRATEGY_RETURN_IF_ERROR(HostBuffer(shard_bytes, &host));
  MPISTRATEGY_CUDA_CHECK(cudaMemcpyAsync(host, mine, shard_bytes,
                                         cudaMemcpyDeviceToHost, stream));
  // Waits for the reduce-scatter; without the mutex, so the watchdog can
  // abort a communicator that hangs.
  MPISTRATEGY_CUDA_CHECK(cudaStreamSynchronize(stream));
  MPISTRATEGY_RETURN_IF_ERROR(c->status->Get());
  MPISTRATEGY_RETURN_IF_ERROR(c->cross->Allreduce(
      host, host, shard, first.dtype, SumForMean(first.reduce_op)));
  if (first.reduce_op == ReduceOp::kMean) {
    Status s = DivideInPlace(first.dtype, host, shard, size_);
    if (!s.ok()) entry_status->assign(entries.size(), s);
  }
  MPISTRATEGY_CUDA_CHECK(cudaMemcpyAsync(mine, host, shard_bytes,
                                         cudaMemcpyHostToDevice, stream));
  MarkHostRead(stream);
  {
    std::lock_guard<std::mutex> lock(mu_);
    MPISTRATEGY_RETURN_IF_ERROR(c->status->Get());
    MPISTRATEGY_NCCL_CHECK(ncclAllGather(mine, buffer,
                                         static_cast<size_t>(shard), type,
                                         c->local, stream),
                           c->local);
  }
  return Unpack(responses, entries, buffer, stream);
}

Status NcclTransport::Allgather(DeviceComm* c, cudaStream_t stream,
                                const Response& response, TensorEntry* entry,
                                Status* entry_status) {
  int64_t rows = 0;
  int64_t total_bytes = 0;
  AllgatherLayout(response, size_, &counts_, &rows, &total_bytes);
  void* out = nullptr;
  *entry_status =
      AllocateOutput(entry, WithFirstDim(response.shapes[0], rows), &out);
  if (total_bytes == 0) return Status::Ok();
  if (out == nullptr) {
    char* scratch = nullptr;
    MPISTRATEGY_RETURN_IF_ERROR(
        DeviceBuffer(c, *entry->device_context, total_bytes, &scratch));
    out = scratch;
  }
  char* const out_bytes = static_cast<char*>(out);
  const int64_t my_bytes = counts_[rank_];
  if (c->path == Path::kStaging) {
    // [gathered | mine]
    char* host = nullptr;
    MPISTRATEGY_RETURN_IF_ERROR(HostBuffer(total_bytes + my_bytes, &host));
    if (my_bytes > 0) {
      MPISTRATEGY_CUDA_CHECK(cudaMemcpyAsync(host + total_bytes, entry->input,
                                             my_bytes, cudaMemcpyDeviceToHost,
                                             stream));
      MPISTRATEGY_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    MPISTRATEGY_RETURN_IF_ERROR(
        control_->Allgatherv(host + total_bytes, host, counts_));
    MPISTRATEGY_CUDA_CHECK(cudaMemcpyAsync(out, host, total_bytes,
                                           cudaMemcpyHostToDevice, stream));
    MarkHostRead(stream);
    return Status::Ok();
  }
  std::lock_guard<std::mutex> lock(mu_);
  MPISTRATEGY_RETURN_IF_ERROR(c->status->Get());
  if (AllEqual(counts_)) {
    MPISTRATEGY_NCCL_CHECK(
        ncclAllGather(entry->input, out, static_cast<size_t>(my_bytes),
                      ncclUint8, c->world, stream),
        c->world);
    return Status::Ok();
  }
  // Uneven first dimensions: one broadcast per rank, fused by the group.
  MPISTRATEGY_NCCL_CHECK(ncclGroupStart(), c->world);
  int64_t offset = 0;
  Status s;
  for (int r = 0; r < size_ && s.ok(); ++r) {
    if (counts_[r] > 0) {
      const ncclResult_t nr = ncclBroadcast(
          r == rank_ ? entry->input : out_bytes + offset, out_bytes + offset,
          static_cast<size_t>(counts_[r]), ncclUint8, r, c->world, stream);
      if (nr != ncclSuccess) s = NcclError(nr, "ncclBroadcast", c->world);
    }
    offset += counts_[r];
  }
  MPISTRATEGY_NCCL_CHECK(ncclGroupEnd(), c->world);
  return s;
}

Status NcclTransport::Broadcast(DeviceComm* c, cudaStream_t stream,
                                const Response& response, TensorEntry* entry) {
  const int64_t bytes =
      NumElements(response.shapes[0]) * DataTypeSize(response.dtype);
  if (bytes == 0) return Status::Ok();
  const bool root = rank_ == response.root_rank;
  if (c->path == Path::kStaging) {
    char* host = nullptr;
    MPISTRATEGY_RETURN_IF_ERROR(HostBuffer(bytes, &host));
    if (root) {
      MPISTRATEGY_CUDA_CHECK(cudaMemcpyAsync(host, entry->input, bytes,
                                             cudaMemcpyDeviceToHost, stream));
      MPISTRATEGY_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    MPISTRATEGY_RETURN_IF_ERROR(
        control_->Broadcast(host, bytes, response.root_rank));
    if (root) {
      if (entry->output != entry->input) {
        MPISTRATEGY_CUDA_CHECK(cudaMemcpyAsync(entry->output, entry->input,
                                               bytes, cudaMemcpyDeviceToDevice,
                                               stream));
      }
    } else {
      MPISTRATEGY_CUDA_CHECK(cudaMemcpyAsync(entry->output, host, bytes,
                                             cudaMemcpyHostToDevice, stream));
      MarkHostRead(stream);
    }
    return Status::Ok();
  }
  std::lock_guard<std::mutex> lock(mu_);
  MPISTRATEGY_RETURN_IF_ERROR(c->status->Get());
  MPISTRATEGY_NCCL_CHECK(
      ncclBroadcast(root ? entry->input : entry->output, entry->output,
                    static_cast<size_t>(bytes), ncclUint8, response.root_rank,
                    c->world, stream),
      c->world);
  return Status::Ok();
}

Status NcclTransport::Reducescatter(DeviceComm* c, cudaStream_t stream,
                                    const Response& response,
                                    TensorEntry* entry, Status* entry_status) {
  const Shape& shape = response.shapes[0];
  const DataType dtype = response.dtype;
  const int64_t element_size = DataTypeSize(dtype);
  const int64_t row_elements = RowElements(shape);
  const int64_t base = shape[0] / size_;
  const int64_t extra = shape[0] % size_;
  counts_.resize(size_);
  for (int r = 0; r < size_; ++r) {
    counts_[r] = (base + (r < extra ? 1 : 0)) * row_elements;
  }
  const int64_t my_rows = base + (rank_ < extra ? 1 : 0);
  void* out = nullptr;
  *entry_status = AllocateOutput(entry, WithFirstDim(shape, my_rows), &out);
  const int64_t total = NumElements(shape);
  if (total == 0) return Status::Ok();
  if (out == nullptr) {
    // Also when this rank's block is empty: NCCL wants a valid pointer.
    char* scratch = nullptr;
    MPISTRATEGY_RETURN_IF_ERROR(DeviceBuffer(
        c, *entry->device_context,
        std::max(counts_[rank_], int64_t{1}) * element_size, &scratch));
    out = scratch;
  }
  const int64_t my_bytes = counts_[rank_] * element_size;
  if (c->path == Path::kStaging) {
    // [input | my block]
    char* host = nullptr;
    const int64_t in_bytes = total * element_size;
    MPISTRATEGY_RETURN_IF_ERROR(HostBuffer(in_bytes + my_bytes, &host));
    MPISTRATEGY_CUDA_CHECK(cudaMemcpyAsync(host, entry->input, in_bytes,
                                           cudaMemcpyDeviceToHost, stream));
    MPISTRATEGY_CUDA_CHECK(cudaStreamSynchronize(stream));
    MPISTRATEGY_RETURN_IF_ERROR(control_->Reducescatter(
        host, host + in_bytes, counts_, dtype,
        SumForMean(response.reduce_op)));
    if (response.reduce_op == ReduceOp::kMean && entry_status->ok()) {
      *entry_status =
          DivideInPlace(dtype, host + in_bytes, counts_[rank_], size_);
    }
    if (my_bytes > 0) {
      MPISTRATEGY_CUDA_CHECK(cudaMemcpyAsync(out, host + in_bytes, my_bytes,
                                             cudaMemcpyHostToDevice, stream));
      MarkHostRead(stream);
    }
    return Status::Ok();
  }
  ncclDataType_t type;
  ncclRedOp_t op;
  ToNccl(dtype, response.reduce_op, &type, &op);
  std::lock_guard<std::mutex> lock(mu_);
  MPISTRATEGY_RETURN_IF_ERROR(c->status->Get());
  if (AllEqual(counts_)) {
    MPISTRATEGY_NCCL_CHECK(
        ncclReduceScatter(entry->input, out, static_cast<size_t>(counts_[0]),
                          type, op, c->world, stream),
        c->world);
    return Status::Ok();
  }
  // Uneven blocks: one reduce per block, to its rank, fused by the group.
  const char* in = static_cast<const char*>(entry->input);
  MPISTRATEGY_NCCL_CHECK(ncclGroupStart(), c->world);
  int64_t offset = 0;
  Status s;
  for (int r = 0; r < size_ && s.ok(); ++r) {
    if (counts_[r] > 0) {
      const ncclResult_t nr =
          ncclReduce(in + offset * element_size, out,
                     static_cast<size_t>(counts_[r]), type, op, r, c->world,
                     stream);
      if (nr != ncclSuccess) s = NcclError(nr, "ncclReduce", c->world);
    }
    offset += counts_[r];
  }
  MPISTRATEGY_NCCL_CHECK(ncclGroupEnd(), c->world);
  return s;
}

Status NcclTransport::Alltoall(DeviceComm* c, cudaStream_t stream,
                               const Response& response, TensorEntry* entry,
                               Status* entry_status) {
  const int64_t row_bytes =
      RowElements(response.shapes[0]) * DataTypeSize(response.dtype);
  counts_.resize(size_);   // send bytes
  counts2_.resize(size_);  // receive bytes
  std::vector<int64_t> received_rows(size_);
  int64_t my_rows = 0;
  int64_t send_total = 0;
  int64_t recv_total = 0;
  int64_t all_bytes = 0;
  for (int j = 0; j < size_; ++j) {
    counts_[j] =
        response.splits[static_cast<size_t>(rank_) * size_ + j] * row_bytes;
    received_rows[j] = response.splits[static_cast<size_t>(j) * size_ + rank_];
    counts2_[j] = received_rows[j] * row_bytes;
    my_rows += received_rows[j];
    send_total += counts_[j];
    recv_total += counts2_[j];
  }
  for (int64_t s : response.splits) all_bytes += s * row_bytes;
  void* out = nullptr;
  *entry_status =
      AllocateOutput(entry, WithFirstDim(response.shapes[0], my_rows), &out);
  if (all_bytes > 0) {
    if (out == nullptr && recv_total > 0) {
      char* scratch = nullptr;
      MPISTRATEGY_RETURN_IF_ERROR(
          DeviceBuffer(c, *entry->device_context, recv_total, &scratch));
      out = scratch;
    }
    const char* in = static_cast<const char*>(entry->input);
    char* out_bytes = static_cast<char*>(out);
    if (c->path == Path::kStaging) {
      // [send | receive]
      char* host = nullptr;
      MPISTRATEGY_RETURN_IF_ERROR(HostBuffer(send_total + recv_total, &host));
      if (send_total > 0) {
        MPISTRATEGY_CUDA_CHECK(cudaMemcpyAsync(host, in, send_total,
                                               cudaMemcpyDeviceToHost, stream));
        MPISTRATEGY_CUDA_CHECK(cudaStreamSynchronize(stream));
      }
      MPISTRATEGY_RETURN_IF_ERROR(control_->Alltoallv(
          host, counts_, host + send_total, counts2_));
      if (recv_total > 0) {
        MPISTRATEGY_CUDA_CHECK(cudaMemcpyAsync(out, host + send_total,
                                               recv_total,
                                               cudaMemcpyHostToDevice, stream));
        MarkHostRead(stream);
      }
    } else {
      // Send and receive offsets of the peer blocks.
      int64_t send_offset = 0;
      int64_t recv_offset = 0;
      for (int j = 0; j < rank_; ++j) {
        send_offset += counts_[j];
        recv_offset += counts2_[j];
      }
      if (counts_[rank_] > 0) {  // our own block: a local copy
        MPISTRATEGY_CUDA_CHECK(cudaMemcpyAsync(
            out_bytes + recv_offset, in + send_offset, counts_[rank_],
            cudaMemcpyDeviceToDevice, stream));
      }
      std::lock_guard<std::mutex> lock(mu_);
      MPISTRATEGY_RETURN_IF_ERROR(c->status->Get());
      MPISTRATEGY_NCCL_CHECK(ncclGroupStart(), c->world);
      Status s;
      send_offset = 0;
      recv_offset = 0;
      for (int j = 0; j < size_ && s.ok(); ++j) {
        if (j != rank_ && counts_[j] > 0) {
          const ncclResult_t nr =
              ncclSend(in + send_offset, static_cast<size_t>(counts_[j]),
                       ncclUint8, j, c->world, stream);
          if (nr != ncclSuccess) s = NcclError(nr, "ncclSend", c->world);
        }
        if (s.ok() && j != rank_ && counts2_[j] > 0) {
          const ncclResult_t nr =
              ncclRecv(out_bytes + recv_offset,
                       static_cast<size_t>(counts2_[j]), ncclUint8, j,
                       c->world, stream);
          if (nr != ncclSuccess) s = NcclError(nr, "ncclRecv", c->world);
        }
        send_offset += counts_[j];
        recv_offset += counts2_[j];
      }
      MPISTRATEGY_NCCL_CHECK(ncclGroupEnd(), c->world);
      MPISTRATEGY_RETURN_IF_ERROR(s);
    }
  }
  if (entry_status->ok() && entry->set_received_splits) {
    entry->set_received_splits(received_rows);
  }
  return Status::Ok();
}

}  // namespace

Status CreateNcclTransport(Transport* control, bool hierarchical_allreduce,
                           std::unique_ptr<DeviceTransport>* transport) {
  if (control == nullptr) {
    return Status::InvalidArgument("CreateNcclTransport: control is null");
  }
  transport->reset(new NcclTransport(control, hierarchical_allreduce));
  return Status::Ok();
}

}  // namespace mpistrategy

#else  // !GOOGLE_CUDA

namespace mpistrategy {

Status CreateNcclTransport(Transport* /*control*/,
                           bool /*hierarchical_allreduce*/,
                           std::unique_ptr<DeviceTransport>* /*transport*/) {
  return Status::Unimplemented(
      "mpistrategy was built without CUDA; rebuild with "
      "`bazel build --config=cuda //cc:_mpi_ops.so` for GPU collectives");
}

}  // namespace mpistrategy

#endif  // GOOGLE_CUDA
