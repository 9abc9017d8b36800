#include "cc/common/common.h"

#include <unistd.h>

#include <cstdio>

namespace mpistrategy {

namespace {

const char* StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kUnknown:
      return "UNKNOWN";
    case StatusCode::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case StatusCode::kDeadlineExceeded:
      return "DEADLINE_EXCEEDED";
    case StatusCode::kFailedPrecondition:
      return "FAILED_PRECONDITION";
    case StatusCode::kAborted:
      return "ABORTED";
    case StatusCode::kUnimplemented:
      return "UNIMPLEMENTED";
    case StatusCode::kInternal:
      return "INTERNAL";
    case StatusCode::kUnavailable:
      return "UNAVAILABLE";
  }
  return "UNKNOWN";
}

}  // namespace

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(StatusCodeName(code_)) + ": " + message_;
}

int64_t DataTypeSize(DataType dtype) {
  switch (dtype) {
    case DataType::kUint8:
    case DataType::kInt8:
    case DataType::kBool:
      return 1;
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return 2;
    case DataType::kInt32:
    case DataType::kFloat32:
      return 4;
    case DataType::kInt64:
    case DataType::kFloat64:
      return 8;
  }
  return 0;
}

const char* DataTypeName(DataType dtype) {
  switch (dtype) {
    case DataType::kUint8:
      return "uint8";
    case DataType::kInt8:
      return "int8";
    case DataType::kBool:
      return "bool";
    case DataType::kInt32:
      return "int32";
    case DataType::kInt64:
      return "int64";
    case DataType::kFloat16:
      return "float16";
    case DataType::kBFloat16:
      return "bfloat16";
    case DataType::kFloat32:
      return "float32";
    case DataType::kFloat64:
      return "float64";
  }
  return "unknown_dtype";
}

bool IsValidDataType(DataType dtype) {
  return static_cast<uint8_t>(dtype) <= static_cast<uint8_t>(DataType::kFloat64);
}

bool IsFloatingDataType(DataType dtype) {
  return dtype == DataType::kFloat16 || dtype == DataType::kBFloat16 ||
         dtype == DataType::kFloat32 || dtype == DataType::kFloat64;
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kMean:
      return "mean";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kProduct:
      return "product";
  }
  return "unknown_op";
}

bool IsValidReduceOp(ReduceOp op) {
  return static_cast<uint8_t>(op) <= static_cast<uint8_t>(ReduceOp::kProduct);
}

const char* HostDataPlaneName(HostDataPlane plane) {
  switch (plane) {
    case HostDataPlane::kAuto:
      return "auto";
    case HostDataPlane::kMpi:
      return "mpi";
    case HostDataPlane::kShm:
      return "shm";
  }
  return "?";
}

const char* CollectiveTypeName(CollectiveType type) {
  switch (type) {
    case CollectiveType::kAllreduce:
      return "allreduce";
    case CollectiveType::kAllgather:
      return "allgather";
    case CollectiveType::kBroadcast:
      return "broadcast";
    case CollectiveType::kReducescatter:
      return "reducescatter";
    case CollectiveType::kAlltoall:
      return "alltoall";
    case CollectiveType::kBarrier:
      return "barrier";
  }
  return "unknown_collective";
}

bool IsValidCollectiveType(CollectiveType type) {
  return static_cast<uint8_t>(type) <=
         static_cast<uint8_t>(CollectiveType::kBarrier);
}

std::string DeviceString(int32_t device) {
  if (device == kCpuDevice) return "cpu";
  return "gpu:" + std::to_string(device);
}

int64_t NumElements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeString(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  s += "]";
  return s;
}

std::string DescribeRank(int rank, const std::vector<PeerInfo>& peers) {
  std::string s = "rank " + std::to_string(rank);
  if (rank < 0 || rank >= static_cast<int>(peers.size())) return s;
  const PeerInfo& p = peers[rank];
  return s + " (host " + (p.host.empty() ? "?" : p.host) + ", pid " +
         std::to_string(p.pid) + ")";
}

std::string DescribeRanks(const std::vector<int>& ranks,
                          const std::vector<PeerInfo>& peers) {
  if (ranks.empty()) return "no rank";
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) s += ", ";
    s += DescribeRank(ranks[i], peers);
  }
  return s;
}

PeerInfo LocalPeerInfo() {
  PeerInfo info;
  char name[256] = {0};
  if (gethostname(name, sizeof(name) - 1) == 0) info.host = name;
  info.pid = static_cast<int64_t>(getpid());
  return info;
}

std::string RanksString(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(ranks[i]);
  }
  s += "]";
  return s;
}

std::string FormatSeconds(double seconds) {
  char buf[64];
  if (seconds >= 10.0 || seconds == static_cast<int64_t>(seconds)) {
    std::snprintf(buf, sizeof(buf), "%.0f", seconds);
  } else {
    std::snprintf(buf, sizeof(buf), "%.2g", seconds);
  }
  return buf;
}

int64_t RowElements(const Shape& shape) {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

Shape WithFirstDim(const Shape& shape, int64_t first) {
  Shape out = shape;
  out[0] = first;
  return out;
}

PackedLayout PackedGroupLayout(const std::vector<DataType>& dtypes,
                             const std::vector<Shape>& shapes) {
  auto align = [](int64_t bytes) {
    return (bytes + kPackAlignmentBytes - 1) / kPackAlignmentBytes *
           kPackAlignmentBytes;
  };
  PackedLayout layout;
  layout.byte_offsets.assign(dtypes.size(), 0);
  std::vector<bool> placed(dtypes.size(), false);
  int64_t end = 0;  // bytes
  for (size_t first = 0; first < dtypes.size(); ++first) {
    if (placed[first]) continue;
    PackedSegment segment;
    segment.dtype = dtypes[first];
    segment.byte_offset = align(end);
    end = segment.byte_offset;
    const int64_t element_size = DataTypeSize(segment.dtype);
    for (size_t i = first; i < dtypes.size(); ++i) {
      if (dtypes[i] != segment.dtype) continue;
      placed[i] = true;
      layout.byte_offsets[i] = align(end);
      end = layout.byte_offsets[i] + NumElements(shapes[i]) * element_size;
    }
    // Alignments are multiples of every element size, so this divides.
    segment.elements = (end - segment.byte_offset) / element_size;
    layout.segments.push_back(segment);
  }
  layout.total_bytes = end;
  return layout;
}

}  // namespace mpistrategy
