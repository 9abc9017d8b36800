// Op registrations for the mpistrategy collectives.
//
// Every op is stateful so that TensorFlow never prunes, deduplicates
// (common-subexpression elimination) or constant-folds a collective: each one
// is a rendezvous with the other ranks and must run exactly once per
// execution.  Every op carries a `tensor_name` attribute set by the Python
// wrapper (mpistrategy/ops/mpi_ops.py); ranks pair collectives by this name,
// not by the order TensorFlow's executor happens to run them in.  The kernels
// live in cc/kernels/collective_kernels.cc.

#include "absl/status/status.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace mpistrategy {
namespace {

using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// Output has the input's shape except for an unknown first dimension (the
// per-rank first dimensions are only known after negotiation).  A scalar
// input is not refused here: a rank whose graph failed to build would never
// submit, and the others would wait for it.  The engine fails the collective
// on every rank instead, naming the rank.
absl::Status UnknownFirstDimShape(InferenceContext* c) {
  ShapeHandle input = c->input(0);
  if (!c->RankKnown(input) || c->Rank(input) == 0) {
    c->set_output(0, c->UnknownShape());
    return absl::OkStatus();
  }
  ShapeHandle output;
  TF_RETURN_IF_ERROR(
      c->ReplaceDim(input, 0, c->UnknownDim(), &output));
  c->set_output(0, output);
  return absl::OkStatus();
}

}  // namespace

// Every op is marked SetIsDistributedCommunication, like TensorFlow's own
// collectives: TensorFlow otherwise turns an UNAVAILABLE status of an op
// inside a tf.function into INTERNAL, and a peer timeout (UNAVAILABLE, see
// EngineConfig::peer_timeout_seconds) would reach Keras' fit as an
// InternalError.
//
// Attribute spellings shared with cc/kernels (kernel attribute parsing) and
// mpistrategy/ops/mpi_ops.py.
#define MPISTRATEGY_ALL_TYPES \
  "{half, bfloat16, float, double, int32, int64, uint8, int8, bool}"
#define MPISTRATEGY_NUMERIC_TYPES \
  "{half, bfloat16, float, double, int32, int64, uint8, int8}"
#define MPISTRATEGY_REDUCE_OP_ATTR \
  "reduce_op: {'sum', 'mean', 'min', 'max', 'product'} = 'sum'"

REGISTER_OP("MpiStrategyAllreduce")
    .Input("tensor: T")
    .Output("reduced: T")
    .Attr("T: " MPISTRATEGY_ALL_TYPES)
    .Attr(MPISTRATEGY_REDUCE_OP_ATTR)
    .Attr("tensor_name: string = ''")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc(R"doc(
Reduces a tensor element-wise across all ranks; every rank gets the result.

tensor: The local contribution.  Every rank must pass the same shape and dtype.
reduced: The element-wise reduction over all ranks, shaped like `tensor`.
T: Element type.  bool supports 'sum' (logical or), 'min' (and), 'max' (or)
  and 'product' (and); 'mean' needs a floating type.
reduce_op: One of 'sum', 'mean' (sum divided by the world size), 'min',
  'max', 'product'.
tensor_name: Pairs this collective across ranks: every rank must submit the
  same name, and a name may be in flight only once per rank.  Empty means the
  node name.
)doc");

REGISTER_OP("MpiStrategyGroupedAllreduce")
    .Input("tensors: T")
    .Output("reduced: T")
    .Attr("T: list(" MPISTRATEGY_ALL_TYPES ") >= 0")
    .Attr(MPISTRATEGY_REDUCE_OP_ATTR)
    .Attr("tensor_name: string = ''")
    .Attr("pack: bool = true")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Reduces a list of tensors element-wise across all ranks in one submission.

tensors: The local contributions; may mix dtypes.
reduced: The reductions, one per input, shaped like the inputs.
T: Element types.
reduce_op: One of 'sum', 'mean', 'min', 'max', 'product'; applies to every
  tensor.
tensor_name: Base name pairing this group across ranks.  Empty means the node
  name.
pack: If true (CPU kernel), the tensors are copied into one buffer that is
  reduced in place as a single collective named `<tensor_name>` (one
  transport call per dtype when the group mixes dtypes); the outputs are
  views of it.  This costs one buffer of the group's size and
  makes many small tensors cheap.  If false (and always on GPU), tensor i is
  submitted as `<tensor_name>.<i>` and the engine fuses the tensors through
  its fusion buffer.  Either way a group that differs between ranks fails
  naming the tensor.
)doc");

REGISTER_OP("MpiStrategyAllgather")
    .Input("tensor: T")
    .Output("gathered: T")
    .Attr("T: " MPISTRATEGY_ALL_TYPES)
    .Attr("tensor_name: string = ''")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(UnknownFirstDimShape)
    .Doc(R"doc(
Concatenates every rank's tensor along the first dimension, in rank order.

tensor: The local rows.  Rank >= 1; all dimensions but the first must agree
  across ranks, the first may differ.
gathered: The concatenation of all ranks' `tensor` along dimension 0.
T: Element type.
tensor_name: Pairs this collective across ranks.  Empty means the node name.
)doc");

REGISTER_OP("MpiStrategyBroadcast")
    .Input("tensor: T")
    .Output("broadcast: T")
    .Attr("T: " MPISTRATEGY_ALL_TYPES)
    .Attr("root_rank: int = 0")
    .Attr("tensor_name: string = ''")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc(R"doc(
Copies the root rank's tensor to every rank.

tensor: The value to send on the root; on other ranks it only fixes the shape
  and dtype, which must match the root's.
broadcast: The root's `tensor`, on every rank.
T: Element type.
root_rank: The rank whose value is sent; 0 <= root_rank < world size and the
  same on every rank.
tensor_name: Pairs this collective across ranks.  Empty means the node name.
)doc");

REGISTER_OP("MpiStrategyReducescatter")
    .Input("tensor: T")
    .Output("scattered: T")
    .Attr("T: " MPISTRATEGY_NUMERIC_TYPES)
    .Attr(MPISTRATEGY_REDUCE_OP_ATTR)
    .Attr("tensor_name: string = ''")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(UnknownFirstDimShape)
    .Doc(R"doc(
Reduces a tensor across ranks and leaves a block of its rows on each rank.

With n rows and world size s, rank r receives n / s rows and the first
n % s ranks one more, in rank order.

tensor: The local contribution.  Rank >= 1 and the same shape on every rank.
scattered: This rank's rows of the element-wise reduction.
T: Element type.
reduce_op: One of 'sum', 'mean', 'min', 'max', 'product'.
tensor_name: Pairs this collective across ranks.  Empty means the node name.
)doc");

REGISTER_OP("MpiStrategyAlltoall")
    .Input("tensor: T")
    .Input("splits: Tsplits")
    .Output("output: T")
    .Output("received_splits: Tsplits")
    .Attr("T: " MPISTRATEGY_ALL_TYPES)
    .Attr("Tsplits: {int32, int64} = DT_INT64")
    .Attr("tensor_name: string = ''")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(UnknownFirstDimShape(c));
      ShapeHandle splits;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &splits));
      c->set_output(1, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Sends consecutive blocks of rows to each rank and concatenates what arrives.

tensor: The local rows (rank >= 1); block r goes to rank r.  All dimensions
  but the first must agree across ranks.
splits: Number of rows sent to each rank: one non-negative entry per rank
  summing to the first dimension of `tensor`, or empty for an even split
  (which then must divide the first dimension).
output: The blocks received from every rank, concatenated in rank order.
received_splits: Number of rows received from each rank.
T: Element type.
Tsplits: Integer type of `splits` and `received_splits`.
tensor_name: Pairs this collective across ranks.  Empty means the node name.
)doc");

REGISTER_OP("MpiStrategyBarrier")
    .Attr("tensor_name: string = ''")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(::tensorflow::shape_inference::NoOutputs)
    .Doc(R"doc(
Completes once every rank has reached the barrier with the same name.

tensor_name: Pairs this barrier across ranks.  Empty means the node name.
)doc");

#undef MPISTRATEGY_ALL_TYPES
#undef MPISTRATEGY_NUMERIC_TYPES
#undef MPISTRATEGY_REDUCE_OP_ATTR

}  // namespace mpistrategy
