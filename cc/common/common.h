// Types shared by the engine, the transports and the TF adapter.
//
// Nothing here depends on TensorFlow or MPI: the engine is framework-free,
// the TF kernels (cc/kernels) translate to and from these types.

#ifndef MPISTRATEGY_CC_COMMON_COMMON_H_
#define MPISTRATEGY_CC_COMMON_COMMON_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace mpistrategy {

// Error codes mirror tensorflow::error::Code so the adapter maps 1:1.
enum class StatusCode : int {
  kOk = 0,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kFailedPrecondition = 9,
  kAborted = 10,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
};

// A cheap value type: OK, or a code plus a message meant for the user.
class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message)
      : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string m) {
    return Status(StatusCode::kInvalidArgument, std::move(m));
  }
  static Status FailedPrecondition(std::string m) {
    return Status(StatusCode::kFailedPrecondition, std::move(m));
  }
  static Status DeadlineExceeded(std::string m) {
    return Status(StatusCode::kDeadlineExceeded, std::move(m));
  }
  static Status Aborted(std::string m) {
    return Status(StatusCode::kAborted, std::move(m));
  }
  static Status Unavailable(std::string m) {
    return Status(StatusCode::kUnavailable, std::move(m));
  }
  static Status Unimplemented(std::string m) {
    return Status(StatusCode::kUnimplemented, std::move(m));
  }
  static Status Internal(std::string m) {
    return Status(StatusCode::kInternal, std::move(m));
  }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

#define MPISTRATEGY_RETURN_IF_ERROR(expr)          \
  do {                                             \
    ::mpistrategy::Status status_ = (expr);        \
    if (!status_.ok()) return status_;             \
  } while (0)

// Element types the engine can move and reduce.  Values are part of the wire
// format: append, never renumber.
enum class DataType : uint8_t {
  kUint8 = 0,
  kInt8 = 1,
  kBool = 2,
  kInt32 = 3,
  kInt64 = 4,
  kFloat16 = 5,
  kBFloat16 = 6,
  kFloat32 = 7,
  kFloat64 = 8,
};

// Size of one element in bytes.
int64_t DataTypeSize(DataType dtype);
// "float32", "int64", ... (numpy / TF spelling).
const char* DataTypeName(DataType dtype);

// Reduction applied element-wise across ranks.  kMean is kSum followed by a
// division by the world size (floating dtypes only).
enum class ReduceOp : uint8_t {
  kSum = 0,
  kMean = 1,
  kMin = 2,
  kMax = 3,
  kProduct = 4,
};
const char* ReduceOpName(ReduceOp op);

enum class CollectiveType : uint8_t {
  kAllreduce = 0,
  kAllgather = 1,
  kBroadcast = 2,
  kReducescatter = 3,
  kAlltoall = 4,
  kBarrier = 5,
};
const char* CollectiveTypeName(CollectiveType type);

// How CPU tensors travel between the ranks (EngineConfig::data_plane).
enum class HostDataPlane : uint8_t {
  kAuto = 0,  // shared memory where ranks share a host, else MPI
  kMpi = 1,
  kShm = 2,   // shared memory, or the engine fails to start saying why
};
const char* HostDataPlaneName(HostDataPlane plane);  // "auto", "mpi", "shm"

// Where a tensor lives.  kCpu tensors go through MPI, GPU tensors through
// NCCL (or MPI with host staging when NCCL cannot be used).
constexpr int32_t kCpuDevice = -1;

using Shape = std::vector<int64_t>;
int64_t NumElements(const Shape& shape);
std::string ShapeString(const Shape& shape);  // "[2, 3]"
// Elements in one first-dimension row (product of all dims but the first).
int64_t RowElements(const Shape& shape);
// `shape` with its first dimension replaced by `first`.
Shape WithFirstDim(const Shape& shape, int64_t first);

// ---- Helpers added by the engine (not part of the frozen interface) -----

// True when the value is one of the enumerators above (wire input checks).
bool IsValidDataType(DataType dtype);
bool IsValidReduceOp(ReduceOp op);
bool IsValidCollectiveType(CollectiveType type);
// float16, bfloat16, float32, float64.
bool IsFloatingDataType(DataType dtype);
// "cpu" for kCpuDevice, "gpu:N" otherwise.
std::string DeviceString(int32_t device);
// "[0, 2]".
std::string RanksString(const std::vector<int>& ranks);
// Seconds for messages: "61", "30", "0.5".
std::string FormatSeconds(double seconds);

// Who a rank is, for messages: its host (MPI_Get_processor_name) and process
// id, gathered from every rank once when the engine starts.
struct PeerInfo {
  std::string host;
  int64_t pid = 0;
};
// "rank 3 (host node7, pid 1234)": the one form in which stall, timeout and
// abort messages name a rank.  Just "rank 3" when `peers` has no entry for it
// (before the engines exchanged their identities).
std::string DescribeRank(int rank, const std::vector<PeerInfo>& peers);
// "rank 1 (host a, pid 5), rank 3 (host b, pid 7)"; "no rank" when empty.
std::string DescribeRanks(const std::vector<int>& ranks,
                          const std::vector<PeerInfo>& peers);
// This process's host name (gethostname) and pid.
PeerInfo LocalPeerInfo();

// Layout of a grouped allreduce packed into one buffer by its kernel: one
// segment per dtype (so one segment when the tensors share a dtype), in
// order of the dtype's first appearance, holding that dtype's tensors in
// group order.  Every tensor and segment starts at a multiple of
// kPackAlignmentBytes (TF's allocation alignment, so the kernel's output
// views are valid inputs to any op); the gaps are reduced like the tensors
// and never read.  The kernel and, for several dtypes
// (TensorEntry::packed_dtypes), the executor both use this layout.
constexpr int64_t kPackAlignmentBytes = 64;
struct PackedSegment {
  DataType dtype = DataType::kFloat32;
  int64_t byte_offset = 0;
  int64_t elements = 0;  // from the first tensor's start to the last's end
};
struct PackedLayout {
  std::vector<PackedSegment> segments;
  std::vector<int64_t> byte_offsets;  // one per tensor, in group order
  int64_t total_bytes = 0;
};
// `dtypes` and `shapes` have one entry per tensor and the same length.
PackedLayout PackedGroupLayout(const std::vector<DataType>& dtypes,
                             const std::vector<Shape>& shapes);

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_COMMON_COMMON_H_
