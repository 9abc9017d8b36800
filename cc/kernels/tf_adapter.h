// Translation between TensorFlow's types and the framework-free engine's:
// the one status-conversion pair, dtypes, reduce ops, shapes and devices.

#ifndef MPISTRATEGY_CC_KERNELS_TF_ADAPTER_H_
#define MPISTRATEGY_CC_KERNELS_TF_ADAPTER_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "cc/common/common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.pb.h"

namespace mpistrategy {

// Engine status -> TF status, keeping the code (the engine's codes mirror
// absl::StatusCode) and the message.
absl::Status ToTfStatus(const Status& status);
// TF status -> engine status (for errors raised inside engine callbacks,
// e.g. a failed output allocation).
Status FromTfStatus(const absl::Status& status);

// InvalidArgument for dtypes the engine cannot move.
absl::Status ToEngineDataType(tensorflow::DataType tf_dtype, DataType* dtype);

// Parses the ops' `reduce_op` attribute ('sum', 'mean', 'min', 'max',
// 'product').
absl::Status ParseReduceOp(const std::string& name, ReduceOp* op);

Shape ToEngineShape(const tensorflow::TensorShape& shape);
absl::Status ToTfShape(const Shape& shape, tensorflow::TensorShape* tf_shape);

// The engine device of the kernel's device: kCpuDevice for CPU kernels, the
// GPU ordinal for GPU kernels.
int32_t EngineDevice(tensorflow::OpKernelContext* ctx);

}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_KERNELS_TF_ADAPTER_H_
