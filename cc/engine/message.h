// Negotiation messages and their wire format.
//
// Every rank sends the coordinator (rank 0) a RequestList per slow cycle; the
// coordinator answers with one ResponseList that every rank executes in order
// (see negotiator.h).  The binary format is private to one build of the
// engine: all ranks must run the same library.  Parsing never trusts its
// input: truncated or malformed bytes give an InvalidArgument/Internal
// Status, never a crash.

#ifndef MPISTRATEGY_CC_ENGINE_MESSAGE_H_
#define MPISTRATEGY_CC_ENGINE_MESSAGE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "cc/engine/autotuner.h"
#include "cc/common/common.h"

namespace mpistrategy {

// What one rank submitted under one name.
struct Request {
  int32_t rank = 0;
  CollectiveType type = CollectiveType::kAllreduce;
  std::string name;
  DataType dtype = DataType::kFloat32;
  Shape shape;
  ReduceOp reduce_op = ReduceOp::kSum;
  int32_t root_rank = 0;
  int32_t device = kCpuDevice;
  // alltoall: rows sent to each rank (always explicit, one per rank).
  std::vector<int64_t> splits;
  // allreduce of a group packed into one buffer by its kernel
  // (TensorEntry::packed_shapes): the shapes of the packed tensors, in
  // order; empty otherwise.  Compared across ranks like `shape`.
  std::vector<Shape> packed_shapes;
  // TensorEntry::packed_dtypes (mixed-dtype groups); empty otherwise.
  std::vector<DataType> packed_dtypes;
  // A grouped_allreduce's entry (packed_shapes may then be empty: a group of
  // no tensors), so that a rank passing an empty group fails with the ranks
  // passing a non-empty one instead of leaving them waiting.
  bool grouped = false;
  // Why this rank's arguments are invalid (empty when they are valid; the
  // fields above are then unset): the coordinator fails the collective on
  // every rank with it, so that no rank waits for this one.
  std::string invalid;

  bool operator==(const Request& other) const;
};

// One slow-cycle message from one rank.
struct RequestList {
  std::vector<Request> requests;
  // This rank asks every engine to stop (destructor or Abort).
  bool shutdown = false;
  std::string shutdown_reason;
};

enum class ResponseType : uint8_t {
  // Values 0..5 equal the CollectiveType values.
  kAllreduce = 0,
  kAllgather = 1,
  kBroadcast = 2,
  kReducescatter = 3,
  kAlltoall = 4,
  kBarrier = 5,
  // The named collective failed; see error_code/error_message.
  kError = 6,
};

ResponseType ToResponseType(CollectiveType type);
// Only meaningful when type != kError.
CollectiveType ToCollectiveType(ResponseType type);
const char* ResponseTypeName(ResponseType type);

// The coordinator's decision about one (or, after fusion planning, several)
// named collectives.  Responses built by the coordinator always carry one
// name; they are what the response cache stores.
struct Response {
  ResponseType type = ResponseType::kAllreduce;
  std::vector<std::string> names;
  DataType dtype = DataType::kFloat32;
  ReduceOp reduce_op = ReduceOp::kSum;
  int32_t root_rank = 0;
  int32_t device = kCpuDevice;
  // One entry per name.  allreduce/broadcast/reducescatter: the common input
  // shape.  allgather/alltoall: rank 0's input shape (dims after the first
  // are common to all ranks).
  std::vector<Shape> shapes;
  // allgather: first dimension of every rank's input, in rank order.
  std::vector<int64_t> first_dims;
  // alltoall: splits[r * size + j] = rows rank r sends to rank j.
  std::vector<int64_t> splits;
  // Single-name allreduce responses: Request::packed_shapes of the name.
  std::vector<Shape> packed_shapes;
  // Single-name allreduce responses: Request::packed_dtypes of the name.
  std::vector<DataType> packed_dtypes;

  // kError only.
  StatusCode error_code = StatusCode::kOk;
  std::string error_message;
  // kError only: ranks the error is for; empty means every rank that
  // announced the name.
  std::vector<int32_t> error_ranks;

  bool operator==(const Response& other) const;
};

struct ResponseList {
  std::vector<Response> responses;
  // Some rank asked to stop: after executing `responses`, every engine fails
  // its pending entries with Aborted and exits its loop.
  bool shutdown = false;
  // The (lowest) rank that asked, and its reason (never empty; defaults to
  // "rank R shut down").  ShutdownString() gives "rank R: reason".
  int32_t shutdown_rank = -1;
  std::string shutdown_reason;

  // Autotune (EngineConfig::autotune): rank 0 publishes new fusion
  // parameters; every rank applies them before executing `responses`, so
  // all ranks plan fusion with the same threshold from this cycle on.
  bool has_parameters = false;
  TunedParameters parameters;

  std::string ShutdownString() const {
    return "rank " + std::to_string(shutdown_rank) + ": " + shutdown_reason;
  }
};

// Serialization.  Serialize* never fails; Parse* validates lengths and enum
// values and rejects trailing bytes.
void SerializeRequestList(const RequestList& list, std::string* out);
Status ParseRequestList(const std::string& bytes, RequestList* list);
void SerializeResponseList(const ResponseList& list, std::string* out);
Status ParseResponseList(const std::string& bytes, ResponseList* list);

// The layout of an allgather's output: rank r contributes
// (*bytes_per_rank)[r] bytes; the result has *rows rows and *total_bytes
// bytes.  `world_size` entries of response.first_dims are read.
void AllgatherLayout(const Response& response, int world_size,
                     std::vector<int64_t>* bytes_per_rank, int64_t* rows,
                     int64_t* total_bytes);

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_ENGINE_MESSAGE_H_
