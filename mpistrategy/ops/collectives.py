"""Collective ops over MPI: `allreduce`, `allgather`, `broadcast`, ...

One Python function per op in cc/ops/mpi_ops.cc; each validates its
arguments, picks the name that pairs the collective across ranks (see
`mpistrategy.ops._naming`) and calls the generated op.  The kernels hand the
tensor to the C++ engine, whose background thread negotiates with the other
ranks, so collectives may be issued in any order on different ranks as long
as their names agree.  Their gradients are in `mpistrategy.ops.gradients`.

Every function initializes mpistrategy on first use (`init()` with
`Options.from_env()`) unless `init` was called before; see
`mpistrategy.runtime`.
"""

import enum
import operator

import tensorflow as tf

from mpistrategy import compression as compression_lib
from mpistrategy import runtime
from mpistrategy.ops import _naming

__all__ = [
    "ReduceOp", "Sum", "Average", "Mean", "Min", "Max", "Product",
    "allreduce", "grouped_allreduce", "allgather", "broadcast",
    "reducescatter", "alltoall", "barrier",
]


class ReduceOp(enum.Enum):
  """Element-wise reductions across ranks (`ops.Sum`, `ops.Average`, ...)."""
  SUM = "sum"
  MEAN = "mean"  # SUM divided by the world size; floating dtypes only
  MIN = "min"
  MAX = "max"
  PRODUCT = "product"


Sum = ReduceOp.SUM
Average = ReduceOp.MEAN
Mean = ReduceOp.MEAN
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
# A MEAN over these is divided before the sum: summing N float16 values of a
# mean's magnitude overflows (65504) N times sooner than the mean does.
_DIVIDE_FIRST_DTYPES = (tf.float16, tf.bfloat16)
_ALL_DTYPES = FLOAT_DTYPES + (tf.int32, tf.int64, tf.uint8, tf.int8, tf.bool)
_NUMERIC_DTYPES = FLOAT_DTYPES + (tf.int32, tf.int64, tf.uint8, tf.int8)

# ---------------------------------------------------------------------------
# Argument checking and names


def _to_tensor(value, fn, arg="tensor", dtypes=_ALL_DTYPES):
  if isinstance(value, tf.IndexedSlices):
    raise TypeError(
        f"{fn}: `{arg}` must be a dense tensor, got tf.IndexedSlices "
        "(allgather its values and indices instead)")
  try:
    tensor = tf.convert_to_tensor(value)
  except (TypeError, ValueError) as e:
    raise TypeError(
        f"{fn}: `{arg}` must be convertible to a tf.Tensor, got "
        f"{type(value).__name__}: {e}") from None
  if tensor.dtype not in dtypes:
    raise TypeError(
        f"{fn}: `{arg}` has dtype {tensor.dtype.name}; accepted dtypes are "
        f"{', '.join(d.name for d in dtypes)}")
  return tensor


def _reduce_op(op, fn):
  """Maps `op` to a ReduceOp member; ValueError for anything else."""
  if isinstance(op, ReduceOp):
    return op
  if isinstance(op, tf.distribute.ReduceOp):
    return ReduceOp.SUM if op == tf.distribute.ReduceOp.SUM else ReduceOp.MEAN
  if isinstance(op, str):
    spelled = op.lower()
    if spelled == "average":
      spelled = "mean"
    for member in ReduceOp:
      if member.value == spelled:
        return member
  raise ValueError(
      f"{fn}: `op` must be one of mpistrategy.ops.Sum, Average (Mean), Min, "
      f"Max, Product (or tf.distribute.ReduceOp.SUM/MEAN), got {op!r}")


def _check_name(name, fn):
  if name is not None and (not isinstance(name, str) or not name):
    raise TypeError(
        f"{fn}: `name` must be a non-empty str or None, got {name!r}")


# ---------------------------------------------------------------------------
# Collectives


@tf.autograph.experimental.do_not_convert
def allreduce(tensor, op=Sum, name=None, compression=None):
  """Reduces `tensor` element-wise across all ranks.

  With a compression such as `mpistrategy.Compression.fp16`, float32 and
  float64 tensors travel (and are summed) as float16/bfloat16 and are cast
  back, so the result keeps the input's dtype with the wire's precision;
  `op=Average` then divides by the world size *before* the cast and sums.
  Other dtypes are not compressed.  See `mpistrategy.compression`.

  Args:
    tensor: A `tf.Tensor` (or value convertible to one) of dtype float16,
      bfloat16, float32, float64, int32, int64, uint8, int8 or bool; the same
      shape and dtype on every rank.
    op: `ops.Sum`, `ops.Average` (alias `ops.Mean`; floating dtypes only),
      `ops.Min`, `ops.Max` or `ops.Product`.  For bool, Sum/Max are logical
      or and Min/Product logical and.  Min/Max propagate NaN like
      `tf.minimum`.  Average of float16/bfloat16 divides before summing,
      so it overflows only if the mean does.
    name: Pairs the collective across ranks; see the module docstring.
    compression: `None` or "none" (default), "fp16", "bf16", or a
      `mpistrategy.Compression` member; the same on every rank.

  Returns:
    A `tf.Tensor` with the reduction, shaped like `tensor`, of its dtype.
    Its gradient is the allreduce of the upstream gradient with the same op
    (and, when compressed, on the same 16-bit wire).

  Raises:
    TypeError: `tensor` is not convertible to a tensor of a supported dtype,
      or `name` is not a str.
    ValueError: `op` is not one of the constants, or `compression` is
      unknown.
    tf.errors.InvalidArgumentError: On every rank: `op=Average` with a dtype
      that is not floating, on some rank (the error names it).
    tf.errors.FailedPreconditionError: Ranks disagree on shape, dtype, op or
      compression.
  """
  fn = "mpistrategy.ops.allreduce"
  tensor = _to_tensor(tensor, fn)
  op = _reduce_op(op, fn)
  _check_name(name, fn)
  compressor = compression_lib.get(compression, fn)
  lib = runtime.started_library()
  tensor_name = _naming.tensor_name(name, "allreduce")
  if not compressor.compresses(tensor.dtype):
    [tensor], op = _divide_first_if_16_bit([tensor], op, lib)
    return lib.ops.mpi_strategy_allreduce(
        tensor, reduce_op=op.value, tensor_name=tensor_name)
  # The wire is 16-bit, so a MEAN always divides first.
  [tensor], op = _mean_as_divided_sum([tensor], op, lib)
  wire, context = compressor.compress(tensor)
  reduced = lib.ops.mpi_strategy_allreduce(
      wire, reduce_op=op.value, tensor_name=tensor_name)
  return compressor.decompress(reduced, context)


@tf.autograph.experimental.do_not_convert
def grouped_allreduce(tensors, op=Sum, name=None, compression=None):
  """Reduces a list of tensors across ranks in one collective.

  On CPU the group is reduced as a single collective: one negotiation and
  one transport call per dtype however many tensors there are.  The tensors
  are copied into one buffer the size of the group and the results are
  views of it, except for a group of one dtype whose tensors average 4 KB
  or more on the shared-memory data plane, which reduces each tensor
  straight from where it is into an output of its own (in place where the
  op holds the only reference to the input).  On GPU the group is packed
  the same way, on the op's stream.  Ranks whose groups differ (length, a
  tensor's shape or dtype) get a `FailedPreconditionError` naming the group
  and the tensor.  An empty group is a collective too: it returns `[]` when
  every rank passes one, and fails like any other group that differs when
  only some do.

  Args:
    tensors: A list of tensors (dtypes may differ; see `allreduce`).
    op: As for `allreduce`; applies to every tensor.
    name: Name pairing the group across ranks.
    compression: As for `allreduce`; applies to every float32/float64
      tensor.  With `op=Average`, when at least one tensor is compressed the
      whole group is divided by the world size first and summed (so a
      float16 tensor in such a group is divided in float16 before the sum).
      Without compression every tensor is averaged the way its own
      `allreduce` averages it (float16 and bfloat16 divided before the sum,
      the others after it).

  Returns:
    A list of `tf.Tensor`, one per input, each of its input's dtype.

  Raises:
    TypeError: `tensors` is not a list/tuple of tensor-convertible values.
    ValueError: `op` is not one of the constants, or `compression` is
      unknown.
    tf.errors.InvalidArgumentError: On every rank: `op=Average` with a
      tensor that is not floating, on some rank.
  """
  fn = "mpistrategy.ops.grouped_allreduce"
  if not isinstance(tensors, (list, tuple)):
    raise TypeError(f"{fn}: `tensors` must be a list or tuple of tensors, "
                    f"got {type(tensors).__name__}")
  converted = [_to_tensor(t, fn, f"tensors[{i}]")
               for i, t in enumerate(tensors)]
  op = _reduce_op(op, fn)
  _check_name(name, fn)
  compressor = compression_lib.get(compression, fn)
  lib = runtime.started_library()
  tensor_name = _naming.tensor_name(name, "grouped_allreduce")
  if not any(compressor.compresses(t.dtype) for t in converted):
    return _grouped_allreduce_uncompressed(converted, op, tensor_name, lib)
  # The wire is 16-bit, so a MEAN always divides first.
  converted, op = _mean_as_divided_sum(converted, op, lib)
  compressed = [compressor.compress(t) for t in converted]
  reduced = lib.ops.mpi_strategy_grouped_allreduce(
      [wire for wire, _ in compressed], reduce_op=op.value,
      tensor_name=tensor_name)
  return [compressor.decompress(r, context)
          for r, (_, context) in zip(reduced, compressed)]


def _grouped_allreduce_uncompressed(tensors, op, tensor_name, lib):
  """`grouped_allreduce` without compression: each tensor as its own op.

  One reduce op covers a group, but a float16/bfloat16 MEAN divides before
  its sum and a float32/float64 MEAN after it.  A group with both is
  therefore one SUM, its 16-bit tensors divided before it and the others
  after it, so that every tensor is averaged the way its own `allreduce`
  averages it.

  Args:
    tensors: the group's tensors.
    op: the `ReduceOp` asked for.
    tensor_name: the group's engine name.
    lib: the loaded op library.

  Returns:
    The list of reduced tensors.
  """
  if not tensors:
    # Still a collective, so that ranks passing a non-empty group fail
    # with this one instead of waiting for it.  In a graph the op has no
    # outputs and is an `Operation`; the function runs it as stateful.
    lib.ops.mpi_strategy_grouped_allreduce(
        [], reduce_op=op.value, tensor_name=tensor_name)
    return []
  divide_after = []
  if (op == ReduceOp.MEAN and _all_floating(tensors) and
      any(t.dtype in _DIVIDE_FIRST_DTYPES for t in tensors)):
    world = lib.c.mpistrategy_size()
    divide_after = [t.dtype not in _DIVIDE_FIRST_DTYPES for t in tensors]
    tensors = [t if after else t / tf.cast(world, t.dtype)
               for t, after in zip(tensors, divide_after)]
    op = ReduceOp.SUM
  reduced = list(lib.ops.mpi_strategy_grouped_allreduce(
      tensors, reduce_op=op.value, tensor_name=tensor_name))
  if any(divide_after):
    reduced = [r / tf.cast(world, r.dtype) if after else r
               for r, after in zip(reduced, divide_after)]
  return reduced


def _all_floating(tensors):
  """False where a MEAN must go to the engine as is, which refuses it on
  every rank: dividing an integer tensor here would make it float64."""
  return all(t.dtype in FLOAT_DTYPES for t in tensors)


def _mean_as_divided_sum(tensors, op, lib):
  """A MEAN as a division by the world size, then a SUM.

  The engine's MEAN sums in the tensors' dtype and then divides, so two
  ranks' float16 40000s would overflow to inf although their mean fits.
  Dividing first keeps every partial sum at the mean's magnitude.  One
  reduce op covers a whole group, so all of its tensors are divided.

  Args:
    tensors: a list of tensors.
    op: the `ReduceOp` asked for.
    lib: the loaded op library.

  Returns:
    `(tensors, op)` to submit: unchanged unless `op` is MEAN and every
    tensor floating (`_all_floating`).
  """
  if op != ReduceOp.MEAN or not _all_floating(tensors):
    return tensors, op
  world = lib.c.mpistrategy_size()
  return [t / tf.cast(world, t.dtype) for t in tensors], ReduceOp.SUM


def _divide_first_if_16_bit(tensors, op, lib):
  """`_mean_as_divided_sum` when any tensor is float16 or bfloat16."""
  if not any(t.dtype in _DIVIDE_FIRST_DTYPES for t in tensors):
    return tensors, op
  return _mean_as_divided_sum(tensors, op, lib)


def _grouped_allreduce_unpacked(tensors, name):
  """A SUM `grouped_allreduce` without the kernel's packing.

  Each tensor is its own engine entry, `<name>.<i>`, and the engine fuses
  them through its fusion buffer (the op's `pack=False`).  For the tests
  and benchmarks that observe or time the engine's fusion.

  Args:
    tensors: A non-empty list of tensors.
    name: Base name pairing the group across ranks.

  Returns:
    A list of `tf.Tensor`, one per input.
  """
  return list(runtime.started_library().ops.mpi_strategy_grouped_allreduce(
      tensors, reduce_op=ReduceOp.SUM.value, tensor_name=name, pack=False))


@tf.autograph.experimental.do_not_convert
def allgather(tensor, name=None):
  """Concatenates every rank's `tensor` along the first dimension.

  Args:
    tensor: A tensor of rank >= 1 (any supported dtype).  The first
      dimension may differ across ranks; the others must agree.
    name: Pairs the collective across ranks.

  Returns:
    A `tf.Tensor`: all ranks' rows, in rank order.

  Raises:
    TypeError: `tensor` is not convertible to a supported tensor.
    tf.errors.InvalidArgumentError: On every rank: `tensor` is a scalar on
      some rank.
    tf.errors.FailedPreconditionError: Ranks disagree on dtype or trailing
      dimensions.
  """
  fn = "mpistrategy.ops.allgather"
  tensor = _to_tensor(tensor, fn)
  _check_name(name, fn)
  lib = runtime.started_library()
  return lib.ops.mpi_strategy_allgather(
      tensor, tensor_name=_naming.tensor_name(name, "allgather"))


def every_ranks_values(values, name):
  """Every rank's `values`, in rank order, through one eager allgather.

  For the library's own agreements (are the ranks' datasets alike?).  Not
  exported from `mpistrategy.ops`.

  Args:
    values: a list of Python ints, of the same length on every rank.
    name: the collective's own name; the Keras call it runs in goes before
      it (`_naming.library_name`).

  Returns:
    A list of `size()` lists of ints.
  """
  return allgather(tf.constant([values], tf.int64),
                   name=_naming.library_name(name)).numpy().tolist()


@tf.autograph.experimental.do_not_convert
def broadcast(tensor, root_rank=0, name=None):
  """Returns `root_rank`'s `tensor` on every rank.

  Args:
    tensor: A tensor of any supported dtype; the same shape on every rank.
    root_rank: The sending rank, an int in [0, size()).
    name: Pairs the collective across ranks.

  Returns:
    A `tf.Tensor`.

  Raises:
    TypeError: `tensor` is not convertible, or `root_rank` is not an int.
    tf.errors.InvalidArgumentError: On every rank: `root_rank` is out of
      range on some rank.
    tf.errors.FailedPreconditionError: Ranks disagree on `root_rank`.
  """
  fn = "mpistrategy.ops.broadcast"
  tensor = _to_tensor(tensor, fn)
  _check_name(name, fn)
  try:
    if isinstance(root_rank, bool):
      raise TypeError
    root_rank = operator.index(root_rank)  # int or numpy integer
  except TypeError:
    raise TypeError(f"{fn}: `root_rank` must be an int, got "
                    f"{type(root_rank).__name__} {root_rank!r}") from None
  lib = runtime.started_library()
  return lib.ops.mpi_strategy_broadcast(
      tensor, root_rank=root_rank,
      tensor_name=_naming.tensor_name(name, "broadcast"))


@tf.autograph.experimental.do_not_convert
def reducescatter(tensor, op=Sum, name=None):
  """Reduces `tensor` across ranks; each rank keeps a block of the rows.

  With n rows and world size s, rank r gets n // s rows, plus one more for
  the first n % s ranks, in rank order.

  Args:
    tensor: A tensor of rank >= 1 (numeric dtypes); the same shape on every
      rank.
    op: As for `allreduce`.
    name: Pairs the collective across ranks.

  Returns:
    A `tf.Tensor` with this rank's rows of the reduction.

  Raises:
    TypeError: `tensor` is not convertible to a supported tensor.
    ValueError: `op` is not one of the constants.
    tf.errors.InvalidArgumentError: On every rank: `tensor` is a scalar, or
      `op=Average` is given a dtype that is not floating, on some rank.
  """
  fn = "mpistrategy.ops.reducescatter"
  tensor = _to_tensor(tensor, fn, dtypes=_NUMERIC_DTYPES)
  op = _reduce_op(op, fn)
  _check_name(name, fn)
  lib = runtime.started_library()
  [tensor], op = _divide_first_if_16_bit([tensor], op, lib)
  return lib.ops.mpi_strategy_reducescatter(
      tensor, reduce_op=op.value,
      tensor_name=_naming.tensor_name(name, "reducescatter"))


@tf.autograph.experimental.do_not_convert
def alltoall(tensor, splits=None, name=None):
  """Sends block r of `tensor`'s rows to rank r; returns what arrives.

  Args:
    tensor: A tensor of rank >= 1 (any supported dtype); all dimensions but
      the first agree across ranks.
    splits: Rows sent to each rank: a 1-D int32/int64 tensor or list with
      size() non-negative entries summing to the first dimension, or None
      for an even split (which must divide the first dimension).
    name: Pairs the collective across ranks.

  Returns:
    `(output, received_splits)`: the received rows concatenated in rank
    order, and the number of rows from each rank (dtype of `splits`, int64
    when `splits` is None).

  Raises:
    TypeError: `tensor` or `splits` have unsupported types.
    ValueError: `splits` is not 1-D, or is an empty list.
    tf.errors.InvalidArgumentError: On every rank: on some rank, `tensor`
      is a scalar, or `splits` do not have one entry per rank or do not fit
      the tensor.
  """
  fn = "mpistrategy.ops.alltoall"
  tensor = _to_tensor(tensor, fn)
  explicit_splits = splits is not None
  if splits is None:
    splits = tf.zeros([0], tf.int64)
  else:
    if not isinstance(splits, tf.Tensor) and isinstance(splits, (list, tuple)):
      splits = tf.constant(splits, tf.int64) if splits else tf.zeros(
          [0], tf.int64)
    splits = _to_tensor(splits, fn, "splits", dtypes=(tf.int32, tf.int64))
    if splits.shape.rank is not None and splits.shape.rank != 1:
      raise ValueError(f"{fn}: `splits` must be 1-D, got shape "
                       f"{splits.shape}")
  _check_name(name, fn)
  lib = runtime.started_library()
  if explicit_splits and splits.shape.rank == 1 and splits.shape[0] == 0:
    # The op's encoding of an even split; other lengths that do not match
    # the world fail in the engine, on every rank.
    raise ValueError(f"{fn}: `splits` must have one entry per rank "
                     f"({lib.c.mpistrategy_size()}), got 0; pass None for "
                     "an even split")
  output, received = lib.ops.mpi_strategy_alltoall(
      tensor, splits, tensor_name=_naming.tensor_name(name, "alltoall"))
  return output, received


@tf.autograph.experimental.do_not_convert
def barrier(name=None):
  """Blocks until every rank reached the barrier with the same name.

  Args:
    name: Pairs the barrier across ranks.

  Returns:
    None when executing eagerly, else the barrier `tf.Operation` (stateful;
    inside `tf.function` it runs in program order with other stateful ops).
  """
  fn = "mpistrategy.ops.barrier"
  _check_name(name, fn)
  lib = runtime.started_library()
  op = lib.ops.mpi_strategy_barrier(
      tensor_name=_naming.tensor_name(name, "barrier"))
  return None if tf.executing_eagerly() else op
