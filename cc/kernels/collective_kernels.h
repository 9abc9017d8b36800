// The kernels of the ops in cc/ops/mpi_ops.cc, once for every device.
//
// Each kernel is thin: it validates its inputs, wraps them in a TensorEntry
// (engine.h), enqueues it with the engine and returns; the engine's thread
// later runs the collective in lock-step with the other ranks and calls the
// entry's `done`, which completes the op.  Kernels never call MPI or NCCL
// themselves: TensorFlow runs independent ops in any order, so only the
// engine's negotiation can make every rank execute collectives in the same
// order.
//
// The kernels are templates on a device policy, registered once per device:
// CpuDevice (collective_kernels.cc) and GpuDevice (collective_kernels_gpu.cc,
// CUDA build).  A policy supplies
//
//   struct Op;  // what an op's entries need from its device
//   static absl::Status Prepare(OpKernelContext*, const std::string& kernel,
//                               Op*);
//   // Gives `entry` its device context and a `done` that calls `finish`
//   // once the device has the output (at once with the engine's error);
//   // `keep_alive` (the input) is held until then.
//   static void Attach(const Op&, TensorEntry* entry, Tensor keep_alive,
//                      FinishCallback finish);
//   // Copies / zeroes device memory in the op's order of work.
//   static absl::Status Copy(const Op&, void* dst, const void* src,
//                            int64_t bytes);
//   static absl::Status Zero(const Op&, void* dst, int64_t bytes);
//   // Whether the engine may read inputs where they are (host memory), so
//   // that a grouped allreduce leaves its packing to the engine.
//   static constexpr bool kEngineReadsInputs;
//
// Everything else (validation, naming, grouping and packing) is written once,
// so the CPU and GPU kernels cannot drift apart.

#ifndef MPISTRATEGY_CC_KERNELS_COLLECTIVE_KERNELS_H_
#define MPISTRATEGY_CC_KERNELS_COLLECTIVE_KERNELS_H_

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cc/common/common.h"
#include "cc/engine/engine.h"
#include "cc/kernels/engine_holder.h"
#include "cc/kernels/tf_adapter.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"

namespace mpistrategy {
namespace kernels {

using ::tensorflow::AsyncOpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;

// Completes an op with a status (OK or the collective's error).
using FinishCallback = std::function<void(const absl::Status&)>;

// Base of all collective kernels: the pairing name and the submission path.
template <typename Device>
class CollectiveKernel : public AsyncOpKernel {
 public:
  using Op = typename Device::Op;

  explicit CollectiveKernel(OpKernelConstruction* context)
      : AsyncOpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("tensor_name", &tensor_name_));
    if (tensor_name_.empty()) tensor_name_ = name();
  }

  // ComputeAsync only validates and enqueues; the collective runs on the
  // engine thread.  Telling TF's executor so lets it run the kernel inline
  // instead of handing it to the inter-op pool (one thread hop per op).
  bool IsExpensive() override { return false; }

 protected:
  // The name pairing this op's collective across ranks.
  const std::string& tensor_name() const { return tensor_name_; }

  // The running engine and the op's device, or false after failing the op
  // (and calling `done`).
  bool Begin(OpKernelContext* ctx, const DoneCallback& done,
             std::shared_ptr<Engine>* engine, Op* op) const {
    *engine = EngineHolder::Instance().Get();
    if (*engine == nullptr) {
      ctx->SetStatus(absl::FailedPreconditionError(
          "mpistrategy is not initialized; call mpistrategy.init()"));
      done();
      return false;
    }
    // A fork child would enqueue to an engine whose thread is not there.
    const Status forked = EngineHolder::Instance().ForkedChildError();
    if (!forked.ok()) {
      ctx->SetStatus(ToTfStatus(forked));
      done();
      return false;
    }
    const absl::Status prepared = Device::Prepare(ctx, name(), op);
    if (!prepared.ok()) {
      ctx->SetStatus(prepared);
      done();
      return false;
    }
    return true;
  }

  // Fills the entry's common fields from input 0 (when there is one).
  static absl::Status DescribeInput(OpKernelContext* ctx, const Tensor& input,
                                    TensorEntry* entry) {
    TF_RETURN_IF_ERROR(ToEngineDataType(input.dtype(), &entry->dtype));
    entry->shape = ToEngineShape(input.shape());
    entry->device = EngineDevice(ctx);
    entry->input = input.NumElements() > 0 ? input.data() : nullptr;
    return absl::OkStatus();
  }

  // An allocate_output callback that allocates output `index` of `ctx`.
  static std::function<Status(const Shape&, void**)> OutputAllocator(
      OpKernelContext* ctx, int index) {
    return [ctx, index](const Shape& shape, void** data) -> Status {
      TensorShape tf_shape;
      absl::Status status = ToTfShape(shape, &tf_shape);
      Tensor* output = nullptr;
      if (status.ok()) status = ctx->allocate_output(index, tf_shape, &output);
      if (!status.ok()) return FromTfStatus(status);
      *data = output->NumElements() > 0 ? output->data() : nullptr;
      return Status::Ok();
    };
  }

  // The FinishCallback of a single-entry op.
  static FinishCallback Finisher(OpKernelContext* ctx, DoneCallback done) {
    return [ctx, done = std::move(done)](const absl::Status& status) {
      if (!status.ok()) ctx->SetStatus(status);
      done();
    };
  }

  // Attaches the device and the completion to `entry` and hands it to the
  // engine.  On a local validation error Enqueue has already run `done`.
  static void Submit(Engine* engine, const Op& op, TensorEntry entry,
                     Tensor keep_alive, FinishCallback finish) {
    Device::Attach(op, &entry, std::move(keep_alive), std::move(finish));
    engine->Enqueue(std::move(entry));
  }

 private:
  std::string tensor_name_;
};

// Collectives that reduce: parse `reduce_op` once.
template <typename Device>
class ReducingKernel : public CollectiveKernel<Device> {
 public:
  explicit ReducingKernel(OpKernelConstruction* context)
      : CollectiveKernel<Device>(context) {
    std::string reduce_op;
    OP_REQUIRES_OK(context, context->GetAttr("reduce_op", &reduce_op));
    OP_REQUIRES_OK(context, ParseReduceOp(reduce_op, &reduce_op_));
  }

 protected:
  ReduceOp reduce_op() const { return reduce_op_; }

 private:
  ReduceOp reduce_op_ = ReduceOp::kSum;
};

template <typename Device>
class AllreduceKernel : public ReducingKernel<Device> {
 public:
  using ReducingKernel<Device>::ReducingKernel;

  void ComputeAsync(OpKernelContext* ctx, AsyncOpKernel::DoneCallback done)
      override {
    std::shared_ptr<Engine> engine;
    typename Device::Op op;
    if (!this->Begin(ctx, done, &engine, &op)) return;
    const Tensor& input = ctx->input(0);
    TensorEntry entry;
    entry.type = CollectiveType::kAllreduce;
    entry.name = this->tensor_name();
    entry.reduce_op = this->reduce_op();
    OP_REQUIRES_OK_ASYNC(ctx, this->DescribeInput(ctx, input, &entry), done);
    Tensor* output = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx,
                         ctx->forward_input_or_allocate_output(
                             {0}, 0, input.shape(), &output),
                         done);
    entry.output = output->NumElements() > 0 ? output->data() : nullptr;
    this->Submit(engine.get(), op, std::move(entry), input,
                 this->Finisher(ctx, std::move(done)));
  }
};

// With `pack` (the default) it copies the inputs into one buffer and
// all-reduces it in place (a group of several dtypes: one byte buffer with a
// segment per dtype, see PackedGroupLayout); the outputs are views of it.  The
// engine then sees one entry instead of one per tensor: one name to
// negotiate and no copies into and out of its fusion buffer, which is what
// makes a group of many small tensors cheap.  The inputs' shapes (and, when
// mixed, dtypes) travel as TensorEntry::packed_shapes/packed_dtypes, so
// ranks whose groups differ fail naming the tensor.  Without `pack` every
// input is its own entry, all enqueued together, and the engine fuses them.
template <typename Device>
class GroupedAllreduceKernel : public ReducingKernel<Device> {
 public:
  explicit GroupedAllreduceKernel(OpKernelConstruction* context)
      : ReducingKernel<Device>(context) {
    OP_REQUIRES_OK(context, context->GetAttr("pack", &pack_));
  }

  void ComputeAsync(OpKernelContext* ctx, AsyncOpKernel::DoneCallback done)
      override {
    std::shared_ptr<Engine> engine;
    typename Device::Op op;
    if (!this->Begin(ctx, done, &engine, &op)) return;
    if (!pack_) {
      SubmitEach(ctx, engine.get(), op, std::move(done));
      return;
    }
    // Always one entry named tensor_name(), whatever the dtypes, so that
    // ranks whose groups differ in dtypes meet under one name and fail
    // naming the tensor instead of waiting for each other's names.
    TensorEntry entry;
    entry.type = CollectiveType::kAllreduce;
    entry.name = this->tensor_name();
    entry.reduce_op = this->reduce_op();
    entry.device = EngineDevice(ctx);
    entry.grouped = true;
    Tensor buffer;
    std::vector<Tensor> inputs;
    OP_REQUIRES_OK_ASYNC(
        ctx,
        Pack(ctx, op, engine->cpu_plane_reduces_parts(), &entry, &buffer,
             &inputs),
        done);
    std::vector<TensorEntry> entries;
    entries.push_back(std::move(entry));
    std::vector<Tensor> buffers;
    buffers.push_back(std::move(buffer));
    SubmitGroup(ctx, engine.get(), op, std::move(entries), std::move(buffers),
                std::move(done), std::move(inputs));
  }

 private:
  // pack=false: tensor i becomes the entry `<tensor_name>.<i>`, its output
  // forwarded from its input where TF allows; the engine fuses them.
  void SubmitEach(OpKernelContext* ctx, Engine* engine,
                  const typename Device::Op& op,
                  AsyncOpKernel::DoneCallback done) {
    const int n = ctx->num_inputs();
    std::vector<TensorEntry> entries(n);
    std::vector<Tensor> inputs(n);
    for (int i = 0; i < n; ++i) {
      const Tensor& input = ctx->input(i);
      TensorEntry& entry = entries[i];
      entry.type = CollectiveType::kAllreduce;
      entry.name = absl::StrCat(this->tensor_name(), ".", i);
      entry.reduce_op = this->reduce_op();
      OP_REQUIRES_OK_ASYNC(ctx, this->DescribeInput(ctx, input, &entry), done);
      Tensor* output = nullptr;
      OP_REQUIRES_OK_ASYNC(ctx,
                           ctx->forward_input_or_allocate_output(
                               {i}, i, input.shape(), &output),
                           done);
      entry.output = output->NumElements() > 0 ? output->data() : nullptr;
      inputs[i] = input;
    }
    SubmitGroup(ctx, engine, op, std::move(entries), std::move(inputs),
                std::move(done), {});
  }

  // Enqueues `entries` together; entry k keeps `keep_alive[k]` until it
  // completes, the group keeps `held` until all have, and the op completes
  // when the last one does, with the first error any of them reported.
  static void SubmitGroup(OpKernelContext* ctx, Engine* engine,
                          const typename Device::Op& op,
                          std::vector<TensorEntry> entries,
                          std::vector<Tensor> keep_alive,
                          AsyncOpKernel::DoneCallback done,
                          std::vector<Tensor> held) {
    struct Group {
      std::atomic<int> remaining;
      std::mutex mu;
      absl::Status status;  // first error
      AsyncOpKernel::DoneCallback done;
      std::vector<Tensor> held;
    };
    auto group = std::make_shared<Group>();
    group->remaining = static_cast<int>(entries.size());
    group->done = std::move(done);
    group->held = std::move(held);
    if (entries.empty()) {
      group->done();
      return;
    }
    for (size_t k = 0; k < entries.size(); ++k) {
      Device::Attach(op, &entries[k], std::move(keep_alive[k]),
                     [ctx, group](const absl::Status& status) {
                       if (!status.ok()) {
                         std::lock_guard<std::mutex> lock(group->mu);
                         if (group->status.ok()) group->status = status;
                       }
                       if (group->remaining.fetch_sub(1) == 1) {
                         // As Attach does with keep_alive: let go before
                         // TF sees the op done.
                         group->held.clear();
                         if (!group->status.ok()) {
                           ctx->SetStatus(group->status);
                         }
                         group->done();
                       }
                     });
    }
    // Every entry is enqueued even if an earlier one was rejected, so the
    // other ranks never wait for a name this rank skipped.
    engine->EnqueueGroup(std::move(entries));
  }

  // Allocates one byte `buffer` laid out by PackedGroupLayout (a segment per
  // dtype, every tensor aligned like a TF allocation, so the outputs are
  // valid inputs to every kernel), sets the outputs to views of it and
  // describes it in `entry` (packed_shapes).  With one dtype the entry is a
  // 1-D tensor of that dtype, fusible like any allreduce; with several it
  // is the uint8 bytes plus packed_dtypes.  Copies every input into the
  // buffer (input = output), except for a group of one dtype in host
  // memory (Device::kEngineReadsInputs) whose tensors are not small: its
  // inputs go to the engine as packed_inputs, held in `inputs` until the op
  // is done, and the engine packs them or, on shared memory, reduces them
  // from where they are.  There (`engine_reduces_parts`) each tensor also
  // gets an output of its own instead of a view of `buffer` (which is then
  // not allocated): its input's buffer where TF lets the op forward it, so
  // that a group whose inputs the op alone holds (a chain of groups,
  // gradients) is reduced in place, as a single tensor is.
  static absl::Status Pack(OpKernelContext* ctx, const typename Device::Op& op,
                           bool engine_reduces_parts, TensorEntry* entry,
                           Tensor* buffer, std::vector<Tensor>* inputs) {
    static_assert(kPackAlignmentBytes %
                          tensorflow::Allocator::kAllocatorAlignment ==
                      0,
                  "packed views must be aligned like TF allocations");
    const int n = ctx->num_inputs();
    std::vector<DataType> dtypes(n);
    for (int i = 0; i < n; ++i) {
      TF_RETURN_IF_ERROR(ToEngineDataType(ctx->input(i).dtype(), &dtypes[i]));
      entry->packed_shapes.push_back(ToEngineShape(ctx->input(i).shape()));
    }
    const PackedLayout layout =
        PackedGroupLayout(dtypes, entry->packed_shapes);
    if (layout.segments.size() == 1) {
      entry->dtype = dtypes[0];
      entry->shape = Shape{layout.total_bytes / DataTypeSize(dtypes[0])};
    } else if (n == 0) {
      // An empty group still meets the other ranks' groups (`grouped`);
      // float32 takes every reduce op.
      entry->dtype = DataType::kFloat32;
      entry->shape = Shape{0};
    } else {
      entry->dtype = DataType::kUint8;
      entry->shape = Shape{layout.total_bytes};
      entry->packed_dtypes = std::move(dtypes);
    }
    // Where the tensors average under kLeaveInputsMinBytes, copying them is
    // cheaper than the engine's handling each one apart (measured on shared
    // memory: 200 x 1 KB 6-11 us slower per call left, 200 x 4 KB 15-40 us
    // faster).
    const bool leave_inputs =
        Device::kEngineReadsInputs && layout.segments.size() == 1 &&
        layout.total_bytes >= kLeaveInputsMinBytes * n;
    if (leave_inputs && engine_reduces_parts) {
      return LeaveInputsAndOutputs(ctx, entry, inputs);
    }
    TF_RETURN_IF_ERROR(ctx->allocate_temp(
        tensorflow::DT_UINT8, TensorShape({layout.total_bytes}), buffer));
    char* base = layout.total_bytes > 0
                     ? static_cast<char*>(buffer->data())
                     : nullptr;
    // Tensors in buffer order (a segment per dtype), so that the gaps
    // between them can be zeroed as they are passed: they are reduced with
    // the tensors and never read back.
    std::vector<int> order(n);
    for (int i = 0; i < n; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&layout](int a, int b) {
      return layout.byte_offsets[a] < layout.byte_offsets[b];
    });
    int64_t written = 0;  // bytes
    for (int i : order) {
      const Tensor& input = ctx->input(i);
      const int64_t offset = layout.byte_offsets[i];
      const int64_t bytes = input.TotalBytes();
      if (leave_inputs) {
        // One segment: buffer order is group order.
        entry->packed_inputs.push_back(bytes > 0 ? input.data() : nullptr);
        inputs->push_back(input);
      } else {
        if (offset > written) {
          TF_RETURN_IF_ERROR(
              Device::Zero(op, base + written, offset - written));
        }
        if (bytes > 0) {
          TF_RETURN_IF_ERROR(
              Device::Copy(op, base + offset, input.data(), bytes));
        }
      }
      written = std::max(written, offset + bytes);
      Tensor output;
      const absl::Status viewed = output.BitcastFrom(
          buffer->Slice(offset, offset + bytes), input.dtype(), input.shape());
      if (!viewed.ok()) {
        return absl::InternalError(absl::StrCat(
            "grouped allreduce \"", entry->name, "\": cannot view tensor ", i,
            " of the packed buffer as ", input.shape().DebugString(), ": ",
            viewed.message()));
      }
      ctx->set_output(i, output);
    }
    entry->input = leave_inputs ? nullptr : base;
    entry->output = base;
    return absl::OkStatus();
  }

  // Pack's group of one dtype (entry's dtype and shape set) on an engine
  // that reduces tensors where they are: packed_inputs and packed_outputs,
  // each output its input forwarded or newly allocated.
  static absl::Status LeaveInputsAndOutputs(OpKernelContext* ctx,
                                            TensorEntry* entry,
                                            std::vector<Tensor>* inputs) {
    const int n = ctx->num_inputs();
    for (int i = 0; i < n; ++i) {
      // Forwarding needs the op to be the input's only holder, so it comes
      // before `inputs` takes a reference.
      Tensor* output = nullptr;
      TF_RETURN_IF_ERROR(ctx->forward_input_or_allocate_output(
          {i}, i, ctx->input(i).shape(), &output));
      const Tensor& input = ctx->input(i);
      const bool empty = input.NumElements() == 0;
      entry->packed_inputs.push_back(empty ? nullptr : input.data());
      entry->packed_outputs.push_back(empty ? nullptr : output->data());
      inputs->push_back(input);
    }
    entry->input = nullptr;
    entry->output = nullptr;
    return absl::OkStatus();
  }

  static constexpr int64_t kLeaveInputsMinBytes = 4096;

  bool pack_ = true;
};

template <typename Device>
class AllgatherKernel : public CollectiveKernel<Device> {
 public:
  using CollectiveKernel<Device>::CollectiveKernel;

  void ComputeAsync(OpKernelContext* ctx, AsyncOpKernel::DoneCallback done)
      override {
    std::shared_ptr<Engine> engine;
    typename Device::Op op;
    if (!this->Begin(ctx, done, &engine, &op)) return;
    const Tensor& input = ctx->input(0);
    TensorEntry entry;
    entry.type = CollectiveType::kAllgather;
    entry.name = this->tensor_name();
    OP_REQUIRES_OK_ASYNC(ctx, this->DescribeInput(ctx, input, &entry), done);
    entry.allocate_output = this->OutputAllocator(ctx, 0);
    this->Submit(engine.get(), op, std::move(entry), input,
                 this->Finisher(ctx, std::move(done)));
  }
};

template <typename Device>
class BroadcastKernel : public CollectiveKernel<Device> {
 public:
  explicit BroadcastKernel(OpKernelConstruction* context)
      : CollectiveKernel<Device>(context) {
    OP_REQUIRES_OK(context, context->GetAttr("root_rank", &root_rank_));
  }

  void ComputeAsync(OpKernelContext* ctx, AsyncOpKernel::DoneCallback done)
      override {
    std::shared_ptr<Engine> engine;
    typename Device::Op op;
    if (!this->Begin(ctx, done, &engine, &op)) return;
    const Tensor& input = ctx->input(0);
    TensorEntry entry;
    entry.type = CollectiveType::kBroadcast;
    entry.name = this->tensor_name();
    entry.root_rank = root_rank_;
    OP_REQUIRES_OK_ASYNC(ctx, this->DescribeInput(ctx, input, &entry), done);
    Tensor* output = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx,
                         ctx->forward_input_or_allocate_output(
                             {0}, 0, input.shape(), &output),
                         done);
    entry.output = output->NumElements() > 0 ? output->data() : nullptr;
    this->Submit(engine.get(), op, std::move(entry), input,
                 this->Finisher(ctx, std::move(done)));
  }

 private:
  int32_t root_rank_ = 0;
};

template <typename Device>
class ReducescatterKernel : public ReducingKernel<Device> {
 public:
  using ReducingKernel<Device>::ReducingKernel;

  void ComputeAsync(OpKernelContext* ctx, AsyncOpKernel::DoneCallback done)
      override {
    std::shared_ptr<Engine> engine;
    typename Device::Op op;
    if (!this->Begin(ctx, done, &engine, &op)) return;
    const Tensor& input = ctx->input(0);
    TensorEntry entry;
    entry.type = CollectiveType::kReducescatter;
    entry.name = this->tensor_name();
    entry.reduce_op = this->reduce_op();
    OP_REQUIRES_OK_ASYNC(ctx, this->DescribeInput(ctx, input, &entry), done);
    entry.allocate_output = this->OutputAllocator(ctx, 0);
    this->Submit(engine.get(), op, std::move(entry), input,
                 this->Finisher(ctx, std::move(done)));
  }
};

// `splits` and `received_splits` are host memory on every device.
template <typename Device>
class AlltoallKernel : public CollectiveKernel<Device> {
 public:
  using CollectiveKernel<Device>::CollectiveKernel;

  void ComputeAsync(OpKernelContext* ctx, AsyncOpKernel::DoneCallback done)
      override {
    std::shared_ptr<Engine> engine;
    typename Device::Op op;
    if (!this->Begin(ctx, done, &engine, &op)) return;
    const Tensor& input = ctx->input(0);
    const Tensor& splits = ctx->input(1);
    OP_REQUIRES_ASYNC(
        ctx, splits.dims() == 1,
        absl::InvalidArgumentError(absl::StrCat(
            "alltoall '", this->tensor_name(), "' needs 1-D splits, got shape ",
            splits.shape().DebugString())),
        done);
    TensorEntry entry;
    entry.type = CollectiveType::kAlltoall;
    entry.name = this->tensor_name();
    OP_REQUIRES_OK_ASYNC(ctx, this->DescribeInput(ctx, input, &entry), done);
    const tensorflow::DataType splits_dtype = splits.dtype();
    entry.splits.resize(splits.NumElements());
    for (int64_t i = 0; i < splits.NumElements(); ++i) {
      entry.splits[i] = splits_dtype == tensorflow::DT_INT32
                            ? splits.flat<int32_t>()(i)
                            : splits.flat<int64_t>()(i);
    }
    entry.allocate_output = this->OutputAllocator(ctx, 0);
    // The engine calls this before `done`, on its thread; an allocation
    // failure is reported through the op's status.
    auto splits_status = std::make_shared<absl::Status>();
    entry.set_received_splits = [ctx, splits_dtype, splits_status](
                                    const std::vector<int64_t>& received) {
      Tensor* output = nullptr;
      *splits_status = ctx->allocate_output(
          1, TensorShape({static_cast<int64_t>(received.size())}), &output);
      if (!splits_status->ok()) return;
      for (size_t i = 0; i < received.size(); ++i) {
        if (splits_dtype == tensorflow::DT_INT32) {
          output->flat<int32_t>()(i) = static_cast<int32_t>(received[i]);
        } else {
          output->flat<int64_t>()(i) = received[i];
        }
      }
    };
    this->Submit(engine.get(), op, std::move(entry), input,
                 [ctx, splits_status, done = std::move(done)](
                     const absl::Status& status) {
                   if (!status.ok()) {
                     ctx->SetStatus(status);
                   } else if (!splits_status->ok()) {
                     ctx->SetStatus(*splits_status);
                   }
                   done();
                 });
  }
};

template <typename Device>
class BarrierKernel : public CollectiveKernel<Device> {
 public:
  using CollectiveKernel<Device>::CollectiveKernel;

  void ComputeAsync(OpKernelContext* ctx, AsyncOpKernel::DoneCallback done)
      override {
    std::shared_ptr<Engine> engine;
    typename Device::Op op;
    if (!this->Begin(ctx, done, &engine, &op)) return;
    TensorEntry entry;
    entry.type = CollectiveType::kBarrier;
    entry.name = this->tensor_name();
    entry.dtype = DataType::kUint8;
    entry.shape = Shape{0};
    entry.device = EngineDevice(ctx);
    this->Submit(engine.get(), op, std::move(entry), Tensor(),
                 this->Finisher(ctx, std::move(done)));
  }
};

}  // namespace kernels
}  // namespace mpistrategy

#endif  // MPISTRATEGY_CC_KERNELS_COLLECTIVE_KERNELS_H_
