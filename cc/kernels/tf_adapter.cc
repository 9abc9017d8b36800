#include "cc/kernels/tf_adapter.h"

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/types.h"

namespace mpistrategy {

absl::Status ToTfStatus(const Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.code()),
                      status.message());
}

Status FromTfStatus(const absl::Status& status) {
  if (status.ok()) return Status::Ok();
  StatusCode code;
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
      code = StatusCode::kInvalidArgument;
      break;
    case absl::StatusCode::kDeadlineExceeded:
      code = StatusCode::kDeadlineExceeded;
      break;
    case absl::StatusCode::kFailedPrecondition:
      code = StatusCode::kFailedPrecondition;
      break;
    case absl::StatusCode::kAborted:
      code = StatusCode::kAborted;
      break;
    case absl::StatusCode::kUnimplemented:
      code = StatusCode::kUnimplemented;
      break;
    case absl::StatusCode::kUnavailable:
      code = StatusCode::kUnavailable;
      break;
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kResourceExhausted:  // e.g. allocation failures
      code = StatusCode::kInternal;
      break;
    default:
      code = StatusCode::kUnknown;
      break;
  }
  return Status(code, std::string(status.message()));
}

absl::Status ToEngineDataType(tensorflow::DataType tf_dtype, DataType* dtype) {
  switch (tf_dtype) {
    case tensorflow::DT_UINT8:
      *dtype = DataType::kUint8;
      return absl::OkStatus();
    case tensorflow::DT_INT8:
      *dtype = DataType::kInt8;
      return absl::OkStatus();
    case tensorflow::DT_BOOL:
      *dtype = DataType::kBool;
      return absl::OkStatus();
    case tensorflow::DT_INT32:
      *dtype = DataType::kInt32;
      return absl::OkStatus();
    case tensorflow::DT_INT64:
      *dtype = DataType::kInt64;
      return absl::OkStatus();
    case tensorflow::DT_HALF:
      *dtype = DataType::kFloat16;
      return absl::OkStatus();
    case tensorflow::DT_BFLOAT16:
      *dtype = DataType::kBFloat16;
      return absl::OkStatus();
    case tensorflow::DT_FLOAT:
      *dtype = DataType::kFloat32;
      return absl::OkStatus();
    case tensorflow::DT_DOUBLE:
      *dtype = DataType::kFloat64;
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("mpistrategy collectives do not support dtype ",
                       tensorflow::DataTypeString(tf_dtype)));
  }
}

absl::Status ParseReduceOp(const std::string& name, ReduceOp* op) {
  if (name == "sum") {
    *op = ReduceOp::kSum;
  } else if (name == "mean") {
    *op = ReduceOp::kMean;
  } else if (name == "min") {
    *op = ReduceOp::kMin;
  } else if (name == "max") {
    *op = ReduceOp::kMax;
  } else if (name == "product") {
    *op = ReduceOp::kProduct;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("reduce_op must be one of 'sum', 'mean', 'min', 'max', "
                     "'product', got '",
                     name, "'"));
  }
  return absl::OkStatus();
}

Shape ToEngineShape(const tensorflow::TensorShape& shape) {
  Shape result;
  result.reserve(shape.dims());
  for (int i = 0; i < shape.dims(); ++i) result.push_back(shape.dim_size(i));
  return result;
}

absl::Status ToTfShape(const Shape& shape, tensorflow::TensorShape* tf_shape) {
  *tf_shape = tensorflow::TensorShape();
  for (int64_t dim : shape) {
    TF_RETURN_IF_ERROR(tf_shape->AddDimWithStatus(dim));
  }
  return absl::OkStatus();
}

int32_t EngineDevice(tensorflow::OpKernelContext* ctx) {
  // GPU kernels (a later addition) run on "GPU:<ordinal>" devices; their
  // entries carry the ordinal so the engine picks the NCCL transport.
  if (ctx->device()->device_type() == tensorflow::DEVICE_CPU) {
    return kCpuDevice;
  }
  return static_cast<int32_t>(ctx->device()->parsed_name().id);
}

}  // namespace mpistrategy
