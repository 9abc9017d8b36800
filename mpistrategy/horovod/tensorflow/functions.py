"""Collectives of `mpistrategy.horovod.tensorflow`, with Horovod's semantics.

Built on `mpistrategy.ops`.  Where the two differ, these follow Horovod:

* `allreduce`, `grouped_allreduce`, `reducescatter` and
  `grouped_reducescatter` average by default (`mpistrategy.ops`: Sum).
  Average of integer tensors is the sum divided by the number of ranks,
  truncated toward zero (Horovod scales in double and casts back).
* `prescale_factor` multiplies every rank's input before the reduction,
  `postscale_factor` the result.
* `allreduce` of a `tf.IndexedSlices` allgathers its values and indices (an
  IndexedSlices with every rank's rows; Average divides the values by the
  number of ranks), as Horovod does.
* A compression is any object with Horovod's `compress(tensor) -> (tensor,
  ctx)` / `decompress(tensor, ctx)` (Horovod's custom compressor classes with
  static methods work too).
* `alltoall` returns `(tensor, received_splits)` with int32 splits.

Collectives are paired across ranks by name as described in
`mpistrategy.ops`; an explicit `name` is used as is.
"""

import pickle

import numpy as np
import tensorflow as tf

from mpistrategy import ops
from mpistrategy import compression as compression_lib
from mpistrategy.ops import _naming
from mpistrategy.horovod.tensorflow import basics

try:  # Horovod pickles objects with cloudpickle (lambdas, local classes).
  import cloudpickle as _pickle
except ImportError:
  _pickle = pickle

__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression",
    "Compressor", "NoneCompressor", "FP16Compressor", "allreduce",
    "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
    "broadcast_", "broadcast_variables", "broadcast_object",
    "broadcast_object_fn", "allgather_object", "alltoall", "reducescatter",
    "grouped_reducescatter", "barrier", "join",
]

Average = ops.Average
Sum = ops.Sum
Min = ops.Min
Max = ops.Max
Product = ops.Product


class _AdasumOp:
  """Horovod's Adasum reduction: accepted as a value, refused when used."""

  def __repr__(self):
    return "hvd.Adasum"


Adasum = _AdasumOp()

Compressor = compression_lib.Compressor
Compression = compression_lib.Compression
NoneCompressor = type(compression_lib.Compression.none)
FP16Compressor = type(compression_lib.Compression.fp16)

_FLOATS = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
_HALF = (tf.float16, tf.bfloat16)
_REDUCE_OPS = (Average, Sum, Min, Max, Product)


def _resolve_op(op, average, fn, allowed=_REDUCE_OPS):
  """Horovod's `op`/`average` arguments -> a ReduceOp (default Average)."""
  if average is not None:
    if op is not None:
      raise ValueError(f"{fn}: the `average` and `op` arguments are mutually "
                       "exclusive; use `op` (`average` is deprecated)")
    op = Average if average else Sum
  if op is None:
    op = Average
  if op is Adasum:
    raise NotImplementedError(
        f"{fn}: op=hvd.Adasum is not provided by mpistrategy.horovod; use "
        "op=hvd.Average (the default) or hvd.Sum")
  if op not in allowed:
    names = ", ".join(f"hvd.{o.name.title()}".replace("Mean", "Average")
                      for o in allowed)
    raise ValueError(f"{fn}: `op` must be one of {names}, got {op!r}")
  return op


def _check_device(device, arg, fn):
  if device:
    raise NotImplementedError(
        f"{fn}: {arg}={device!r} is not provided by mpistrategy.horovod; "
        "tensors are reduced where they live (CPU over MPI, GPU over NCCL)")


def _compression(compression, fn):
  if compression is None:
    return Compression.none
  if isinstance(compression, str):
    return compression_lib.get(compression, fn)
  if not (hasattr(compression, "compress") and
          hasattr(compression, "decompress")):
    raise TypeError(f"{fn}: `compression` must have compress() and "
                    f"decompress() (e.g. hvd.Compression.fp16), got "
                    f"{compression!r}")
  return compression


def _scale(tensor, factor):
  """`tensor * factor` as Horovod scales: 16-bit floats in float32, integers
  in double (truncated), other floats in their own dtype."""
  if isinstance(factor, (int, float)) and factor == 1:
    return tensor
  if tensor.dtype in (tf.float16, tf.bfloat16):
    scaled = tf.cast(tensor, tf.float32) * tf.cast(factor, tf.float32)
    return tf.cast(scaled, tensor.dtype)
  if tensor.dtype in _FLOATS:
    return tensor * tf.cast(factor, tensor.dtype)
  scaled = tf.cast(tensor, tf.float64) * tf.cast(factor, tf.float64)
  return tf.cast(scaled, tensor.dtype)


def _divide_by_size(tensor):
  world = basics.size()
  if tensor.dtype in _FLOATS:
    return tensor / tf.cast(world, tensor.dtype)
  return tf.truncatediv(tensor, tf.cast(world, tensor.dtype))


def _horovod_gradient(tensor, factor):
  """`tensor`, whose gradient is scaled by `factor` on its way back.

  mpistrategy.ops' gradients sum every rank's upstream gradient (every
  rank's loss counts).  Horovod's average it for allgather and broadcast
  (factor 1 / size) and multiply it by the size for reducescatter (factor
  size); scaling the upstream gradient gives Horovod's.
  """
  if not tensor.dtype.is_floating and not tensor.dtype.is_complex:
    return tensor  # no gradient flows

  @tf.custom_gradient
  def scaled(x):
    def grad(upstream):
      return upstream * tf.cast(factor, upstream.dtype)
    return tf.identity(x), grad

  return scaled(tensor)


def _check_name(name, fn):
  """Raises where this thread may not leave `fn`'s collectives unnamed.

  `fn`'s own names for them pair across threads by order, as
  `mpistrategy.ops`' default names do (see `mpistrategy.collective_names`),
  so the error names `fn` rather than the op underneath.
  """
  if name is None:
    _naming.check_default_name(fn)


def _sub_name(name, suffix):
  return None if name is None else f"{name}/{suffix}"


def _allreduce_indexed_slices(slices, op, prescale, postscale, name, fn):
  if op not in (Average, Sum):
    raise NotImplementedError(
        f"{fn}: only hvd.Sum and hvd.Average are supported for "
        "tf.IndexedSlices (as in Horovod); pass a dense tensor for "
        f"{op.name.title()}")
  if prescale != 1 or postscale != 1:
    raise NotImplementedError(
        f"{fn}: prescale_factor and postscale_factor are not supported for "
        "tf.IndexedSlices (as in Horovod); scale the values yourself")
  values = ops.allgather(slices.values, name=_sub_name(name, "values"))
  indices = ops.allgather(slices.indices, name=_sub_name(name, "indices"))
  if op == Average:
    # As Horovod: a true division, so integer values become floats and
    # duplicate indices still add up to their mean.
    values = values / tf.cast(basics.size(), values.dtype)
  return tf.IndexedSlices(_horovod_gradient(values, 1 / basics.size()),
                          indices, dense_shape=slices.dense_shape)


def _reduce_dense_group(tensors, op, compression, prescale, postscale, name,
                        fn, grouped=False):
  """Reduces dense tensors as one ops.grouped_allreduce.

  A single tensor travels as a plain allreduce unless `grouped`: what
  `hvd.grouped_allreduce` sends, so that every rank's group, empty or not,
  is compared with the others' (a rank with no tensors must not return
  alone).
  """
  tensors = [_scale(tf.convert_to_tensor(t), prescale) for t in tensors]
  if op == Average and any(t.dtype == tf.bool for t in tensors):
    raise ValueError(f"{fn}: op=hvd.Average is not defined for bool tensors; "
                     "use hvd.Sum (logical or) or hvd.Min (logical and)")
  # Horovod's Average sums, then scales: integers (truncated) and, in
  # float32, 16-bit floats; the engine's own 16-bit mean divides first.
  int_average = op == Average and any(t.dtype not in _FLOATS
                                      for t in tensors)
  half_average = op == Average and any(t.dtype in _HALF for t in tensors)
  wire_op = Sum if int_average or half_average else op
  if wire_op != op:
    tensors = [t if t.dtype not in _FLOATS or t.dtype in _HALF
               else _divide_by_size(t) for t in tensors]
  compressed = [compression.compress(t) for t in tensors]
  wires = [w for w, _ in compressed]
  if len(wires) == 1 and not grouped:
    reduced = [ops.allreduce(wires[0], op=wire_op, name=name)]
  else:
    reduced = ops.grouped_allreduce(wires, op=wire_op, name=name)
  out = []
  for r, (original, (_, ctx)) in zip(reduced, zip(tensors, compressed)):
    r = compression.decompress(r, ctx)
    if wire_op != op and original.dtype in _HALF:
      r = _scale(r, 1.0 / basics.size())
    elif int_average and original.dtype not in _FLOATS:
      r = _divide_by_size(r)
    out.append(_scale(r, postscale))
  return out


def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, name=None, process_set=None,
              ignore_name_scope=False):
  """Reduces `tensor` across all ranks; averages by default (as Horovod).

  Args:
    tensor: a `tf.Tensor`, variable or `tf.IndexedSlices`; dense tensors
      have the same shape and dtype on every rank.
    average: deprecated (Horovod): True is op=Average, False op=Sum.
    device_dense: must be empty (device placement is automatic).
    device_sparse: must be empty.
    compression: `hvd.Compression.none` or `.fp16` (or a Horovod-style
      compressor).
    op: `hvd.Average` (None: the default), `hvd.Sum`, `hvd.Min`, `hvd.Max`,
      `hvd.Product`; `hvd.Adasum` is not provided.  IndexedSlices: Average or
      Sum only.
    prescale_factor: multiplies the input before the reduction.
    postscale_factor: multiplies the result.
    name: pairs the collective across ranks (see `mpistrategy.ops`).
    process_set: only the global process set (the default) is provided.
    ignore_name_scope: accepted for compatibility; names never include
      the name scope here.

  Returns:
    A tensor like `tensor` (an IndexedSlices holding every rank's rows for
    an IndexedSlices input).

  Raises:
    NotImplementedError: op=Adasum, a process set, a device argument, or
      Min/Max/Product of IndexedSlices.
    ValueError: `op` and `average` both given, or an invalid op.
  """
  del ignore_name_scope
  fn = "hvd.allreduce"
  basics.check_initialized()
  basics.check_process_set(process_set, fn)
  _check_name(name, fn)
  _check_device(device_dense, "device_dense", fn)
  _check_device(device_sparse, "device_sparse", fn)
  op = _resolve_op(op, average, fn)
  compression = _compression(compression, fn)
  if isinstance(tensor, tf.IndexedSlices):
    return _allreduce_indexed_slices(tensor, op, prescale_factor,
                                     postscale_factor, name, fn)
  return _reduce_dense_group([tensor], op, compression, prescale_factor,
                             postscale_factor, name, fn)[0]


def grouped_allreduce(tensors, average=None, device_dense="",
                      device_sparse="", compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=None, name=None, ignore_name_scope=False):
  """Reduces a list of tensors in one collective; see `allreduce`.

  Dense tensors travel as one `mpistrategy.ops.grouped_allreduce`;
  IndexedSlices are each allgathered as in `allreduce`.

  Returns:
    A list, one result per input, in order.
  """
  del ignore_name_scope
  fn = "hvd.grouped_allreduce"
  basics.check_initialized()
  basics.check_process_set(process_set, fn)
  _check_name(name, fn)
  _check_device(device_dense, "device_dense", fn)
  _check_device(device_sparse, "device_sparse", fn)
  if not isinstance(tensors, (list, tuple)):
    raise TypeError(f"{fn}: `tensors` must be a list or tuple, got "
                    f"{type(tensors).__name__}")
  op = _resolve_op(op, average, fn)
  compression = _compression(compression, fn)
  results = [None] * len(tensors)
  dense = [i for i, t in enumerate(tensors)
           if not isinstance(t, tf.IndexedSlices)]
  for i, t in enumerate(tensors):
    if isinstance(t, tf.IndexedSlices):
      results[i] = _allreduce_indexed_slices(
          t, op, prescale_factor, postscale_factor, _sub_name(name, str(i)),
          fn)
  if dense or not tensors:
    reduced = _reduce_dense_group([tensors[i] for i in dense], op,
                                  compression, prescale_factor,
                                  postscale_factor, name, fn, grouped=True)
    for i, r in zip(dense, reduced):
      results[i] = r
  return results


def allgather(tensor, name=None, ignore_name_scope=False, process_set=None):
  """Concatenates every rank's `tensor` along dimension 0, in rank order.

  The first dimension may differ across ranks.
  """
  del ignore_name_scope
  basics.check_initialized()
  basics.check_process_set(process_set, "hvd.allgather")
  _check_name(name, "hvd.allgather")
  return _horovod_gradient(ops.allgather(tensor, name=name),
                           1 / basics.size())


def grouped_allgather(tensors, name=None, ignore_name_scope=False,
                      process_set=None):
  """`allgather` of each tensor of a list; returns a list."""
  del ignore_name_scope
  basics.check_initialized()
  basics.check_process_set(process_set, "hvd.grouped_allgather")
  _check_name(name, "hvd.grouped_allgather")
  if not isinstance(tensors, (list, tuple)):
    raise TypeError("hvd.grouped_allgather: `tensors` must be a list or "
                    f"tuple, got {type(tensors).__name__}")
  return [_horovod_gradient(ops.allgather(t, name=_sub_name(name, str(i))),
                            1 / basics.size())
          for i, t in enumerate(tensors)]


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=None):
  """Returns `root_rank`'s `tensor` on every rank."""
  del ignore_name_scope
  basics.check_initialized()
  basics.check_process_set(process_set, "hvd.broadcast")
  _check_name(name, "hvd.broadcast")
  return _horovod_gradient(
      ops.broadcast(tensor, root_rank=root_rank, name=name),
      1 / basics.size())


def broadcast_(variables, root_rank, name=None, process_set=None):
  """Broadcasts variables in place: every rank's variables get the root's
  values.

  Args:
    variables: a variable or a list of variables.
    root_rank: the sending rank.
    name: base name pairing the broadcasts across ranks.
    process_set: only the global process set.

  Returns:
    The broadcast values (a list, or one tensor for one variable).
  """
  basics.check_initialized()
  basics.check_process_set(process_set, "hvd.broadcast_")
  _check_name(name, "hvd.broadcast_")
  single = not isinstance(variables, (list, tuple))
  variables = [variables] if single else list(variables)
  for v in variables:
    if not hasattr(v, "assign"):
      raise TypeError("hvd.broadcast_: expects variables (with assign()), "
                      f"got {type(v).__name__}")
  values = []
  for i, v in enumerate(variables):
    value = ops.broadcast(v, root_rank=root_rank,
                          name=_sub_name(name, str(i)))
    # The control dependency runs the assignment in a TF1 graph too, where
    # the caller runs only the returned tensors.
    with tf.control_dependencies([v.assign(value)]):
      values.append(tf.identity(value))
  return values[0] if single else values


def broadcast_variables(variables, root_rank, process_set=None,
                        inplace=False):
  """Assigns `root_rank`'s values to `variables` on every rank.

  Call it on every rank with the same variables (e.g. `model.variables`
  and `optimizer.variables`), eagerly or inside a `tf.function`.

  Args:
    variables: an iterable of variables.
    root_rank: the sending rank.
    process_set: only the global process set.
    inplace: accepted (both forms assign in place here).

  Returns:
    None when eager, else a `tf.Operation` grouping the assignments.
  """
  del inplace
  basics.check_initialized()
  basics.check_process_set(process_set, "hvd.broadcast_variables")
  _naming.check_default_name("hvd.broadcast_variables", takes_name=False)
  assigns = []
  for v in variables:
    assigns.append(v.assign(ops.broadcast(v, root_rank=root_rank)))
  if tf.executing_eagerly():
    return None
  return tf.group(*assigns)


def _check_eager(fn):
  if not tf.executing_eagerly():
    raise RuntimeError(f"{fn} works eagerly only (outside tf.function); "
                       "it pickles Python objects")


def broadcast_object(obj, root_rank=0, session=None, name=None,
                     process_set=None):
  """Returns `root_rank`'s Python object on every rank (pickled; eager).

  The root returns `obj` itself, the others an unpickled copy.
  """
  fn = "hvd.broadcast_object"
  del session
  basics.check_initialized()
  basics.check_process_set(process_set, fn)
  _check_eager(fn)
  _check_name(name, fn)
  name = name or "broadcast_object"
  if basics.rank() == root_rank:
    payload = _pickle.dumps(obj)
    length = tf.constant([len(payload)], tf.int64)
  else:
    payload = None
    length = tf.zeros([1], tf.int64)
  length = int(ops.broadcast(length, root_rank=root_rank,
                             name=f"{name}/length")[0])
  if payload is None:
    data = tf.zeros([length], tf.uint8)
  else:
    data = tf.constant(np.frombuffer(payload, np.uint8))
  data = ops.broadcast(data, root_rank=root_rank, name=f"{name}/data")
  if payload is not None:
    return obj
  return _pickle.loads(data.numpy().tobytes())


def broadcast_object_fn(root_rank=0, session=None, name=None,
                        process_set=None):
  """Returns `lambda obj: broadcast_object(obj, root_rank, ...)`."""
  return lambda obj: broadcast_object(obj, root_rank, session, name,
                                      process_set)


def allgather_object(obj, session=None, name=None, process_set=None):
  """Returns the list of every rank's Python object, in rank order (eager)."""
  fn = "hvd.allgather_object"
  del session
  basics.check_initialized()
  basics.check_process_set(process_set, fn)
  _check_eager(fn)
  _check_name(name, fn)
  name = name or "allgather_object"
  payload = _pickle.dumps(obj)
  lengths = ops.allgather(tf.constant([len(payload)], tf.int64),
                          name=f"{name}/lengths").numpy()
  data = ops.allgather(tf.constant(np.frombuffer(payload, np.uint8)),
                       name=f"{name}/data").numpy().tobytes()
  out, offset = [], 0
  for n in lengths:
    out.append(_pickle.loads(data[offset:offset + int(n)]))
    offset += int(n)
  return out


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False,
             process_set=None):
  """Sends block r of `tensor`'s rows to rank r.

  Args:
    tensor: a tensor of rank >= 1.
    splits: rows for each rank (size() entries), or None for equal blocks
      (the first dimension must then divide evenly).
    name: pairs the collective across ranks.
    ignore_name_scope: accepted for compatibility.
    process_set: only the global process set.

  Returns:
    The rows from every rank in rank order; with `splits` given, as
    Horovod, `(received, received_splits)`, the second how many rows came
    from each rank (int32).
  """
  del ignore_name_scope
  basics.check_initialized()
  basics.check_process_set(process_set, "hvd.alltoall")
  _check_name(name, "hvd.alltoall")
  received, received_splits = ops.alltoall(tensor, splits=splits, name=name)
  if splits is None:
    return received
  return received, tf.cast(received_splits, tf.int32)


def reducescatter(tensor, device_dense="", compression=Compression.none,
                  op=Average, name=None, process_set=None,
                  ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
  """Reduces `tensor` across ranks and keeps this rank's block of rows.

  Rank r of s gets n // s rows of the n, plus one more for r < n % s.

  Args:
    tensor: a tensor of rank >= 1, the same shape on every rank.
    device_dense: must be empty.
    compression: `hvd.Compression.none` or `.fp16`.
    op: `hvd.Average` (default; None means Average too) or `hvd.Sum`.
    name: pairs the collective across ranks.
    process_set: only the global process set.
    ignore_name_scope: accepted for compatibility.
    prescale_factor: multiplies the input before the reduction.
    postscale_factor: multiplies the result.

  Returns:
    This rank's rows of the reduction.
  """
  del ignore_name_scope
  return _reducescatter_list(
      [tensor], device_dense, compression, op, process_set, prescale_factor,
      postscale_factor, name, "hvd.reducescatter")[0]


def grouped_reducescatter(tensors, device_dense="",
                          compression=Compression.none, op=Average,
                          process_set=None, prescale_factor=1.0,
                          postscale_factor=1.0, name=None):
  """`reducescatter` of each tensor of a list; returns a list."""
  return _reducescatter_list(
      tensors, device_dense, compression, op, process_set, prescale_factor,
      postscale_factor, name, "hvd.grouped_reducescatter")


def _reducescatter_list(tensors, device_dense, compression, op, process_set,
                        prescale_factor, postscale_factor, name, fn):
  basics.check_initialized()
  basics.check_process_set(process_set, fn)
  _check_name(name, fn)
  _check_device(device_dense, "device_dense", fn)
  op = _resolve_op(op, None, fn, allowed=(Average, Sum))
  compression = _compression(compression, fn)
  if not isinstance(tensors, (list, tuple)):
    raise TypeError(f"{fn}: `tensors` must be a list or tuple, got "
                    f"{type(tensors).__name__}")
  out = []
  for i, t in enumerate(tensors):
    t = _scale(tf.convert_to_tensor(t), prescale_factor)
    int_average = op == Average and t.dtype not in _FLOATS
    wire, ctx = compression.compress(t)
    part = ops.reducescatter(
        wire, op=Sum if int_average else op,
        name=name if len(tensors) == 1 else _sub_name(name, str(i)))
    part = _horovod_gradient(compression.decompress(part, ctx),
                             basics.size())
    if int_average:
      part = _divide_by_size(part)
    out.append(_scale(part, postscale_factor))
  return out


def barrier(process_set=None):
  """Blocks until every rank reached the barrier."""
  basics.check_initialized()
  basics.check_process_set(process_set, "hvd.barrier")
  _naming.check_default_name("hvd.barrier", takes_name=False)
  return ops.barrier()


def join(device=""):
  """Not provided: Horovod's join (uneven inputs across ranks).

  Raises:
    NotImplementedError: always.  The engine has no join protocol (a rank
      that joined would have to answer every other rank's collectives with
      zeros).  Give every rank the same number of steps instead, e.g.
      `dataset.repeat()` with `steps_per_epoch`, or shard the data evenly.
  """
  del device
  raise NotImplementedError(
      "hvd.join() is not provided by mpistrategy.horovod: the engine has no "
      "join protocol for uneven inputs.  Give every rank the same number of "
      "steps (e.g. dataset.repeat() plus steps_per_epoch, or an evenly "
      "sharded dataset)")
