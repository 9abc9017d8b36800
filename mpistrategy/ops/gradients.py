"""Gradients of the collectives (`tf.RegisterGradient`).

Convention: every rank's loss is summed, so d(total)/d(x_local) gathers the
upstream gradients of all ranks.  Importing `mpistrategy.ops` registers them.
"""

import tensorflow as tf

from mpistrategy import runtime
from mpistrategy.ops.collectives import allgather
from mpistrategy.ops.collectives import allreduce
from mpistrategy.ops.collectives import alltoall
from mpistrategy.ops.collectives import FLOAT_DTYPES
from mpistrategy.ops.collectives import grouped_allreduce
from mpistrategy.ops.collectives import Product
from mpistrategy.ops.collectives import ReduceOp
from mpistrategy.ops.collectives import Sum


def _attr_str(op, name):
  value = op.get_attr(name)
  return value.decode() if isinstance(value, bytes) else value


def _dense(grad):
  # Gradients of gathers arrive as tf.IndexedSlices; the ops take dense
  # tensors.
  return tf.convert_to_tensor(grad) if isinstance(
      grad, tf.IndexedSlices) else grad


def _allreduce_grad(x, y, grad, reduce_op):
  grad = _dense(grad)
  if reduce_op in (ReduceOp.SUM, ReduceOp.MEAN):
    return allreduce(grad, op=reduce_op)
  if x.dtype not in FLOAT_DTYPES:
    return None
  total = allreduce(grad, op=Sum)
  if reduce_op in (ReduceOp.MIN, ReduceOp.MAX):
    # As tf.reduce_max: the ranks holding the extreme share the gradient.
    is_extreme = tf.cast(tf.equal(x, y), grad.dtype)
    holders = allreduce(is_extreme, op=Sum)
    return total * tf.math.divide_no_nan(is_extreme, holders)
  # PRODUCT: d y / d x = the product of the other ranks' values.  y / x
  # gives it wherever x != 0; where x == 0 it is the product of the other
  # (nonzero) values if this is the only zero, else 0.
  is_zero = tf.equal(x, tf.zeros_like(x))
  zeros = allreduce(tf.cast(is_zero, tf.int32), op=Sum)
  nonzero_product = allreduce(tf.where(is_zero, tf.ones_like(x), x),
                              op=Product)
  others = tf.where(
      is_zero,
      tf.where(tf.equal(zeros, 1), nonzero_product, tf.zeros_like(x)),
      tf.math.divide_no_nan(y, x))
  return total * tf.cast(others, grad.dtype)


@tf.RegisterGradient("MpiStrategyAllreduce")
def _allreduce_gradient(op, grad):
  return _allreduce_grad(op.inputs[0], op.outputs[0], grad,
                         ReduceOp(_attr_str(op, "reduce_op")))


@tf.RegisterGradient("MpiStrategyGroupedAllreduce")
def _grouped_allreduce_gradient(op, *grads):
  reduce_op = ReduceOp(_attr_str(op, "reduce_op"))
  if reduce_op in (ReduceOp.SUM, ReduceOp.MEAN):
    present = [i for i, g in enumerate(grads) if g is not None]
    reduced = grouped_allreduce([_dense(grads[i]) for i in present],
                                op=reduce_op)
    result = [None] * len(grads)
    for i, r in zip(present, reduced):
      result[i] = r
    return result
  return [None if g is None else _allreduce_grad(x, y, g, reduce_op)
          for x, y, g in zip(op.inputs, op.outputs, grads)]


@tf.RegisterGradient("MpiStrategyAllgather")
def _allgather_gradient(op, grad):
  x = op.inputs[0]
  total = allreduce(_dense(grad), op=Sum)
  rows = tf.shape(x, out_type=tf.int64)[:1]
  sizes = allgather(rows)
  my_rank = runtime.rank()
  offset = tf.reduce_sum(sizes[:my_rank])
  return total[offset:offset + rows[0]]


@tf.RegisterGradient("MpiStrategyBroadcast")
def _broadcast_gradient(op, grad):
  total = allreduce(_dense(grad), op=Sum)
  if runtime.rank() == op.get_attr("root_rank"):
    return total
  # Not zeros_like: with a static shape that is a constant, and a TF1
  # session would prune this rank's allreduce while the root waits in it.
  return total * tf.zeros([], total.dtype)


@tf.RegisterGradient("MpiStrategyReducescatter")
def _reducescatter_gradient(op, grad):
  reduce_op = ReduceOp(_attr_str(op, "reduce_op"))
  if reduce_op not in (ReduceOp.SUM, ReduceOp.MEAN):
    return None
  gathered = allgather(_dense(grad))
  if reduce_op == ReduceOp.MEAN:
    gathered = gathered / tf.cast(runtime.size(), gathered.dtype)
  return gathered


@tf.RegisterGradient("MpiStrategyAlltoall")
def _alltoall_gradient(op, grad, unused_splits_grad):
  del unused_splits_grad
  back, _ = alltoall(_dense(grad), splits=op.outputs[1])
  return back, None


tf.no_gradient("MpiStrategyBarrier")
