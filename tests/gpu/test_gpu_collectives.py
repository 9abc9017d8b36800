"""GPU collectives: NCCL (one GPU per rank) or MPI with host staging.

Collective-symmetric: every rank runs every test in the same order with
rank-derived inputs and closed-form expected values.  Runs with any number
of ranks (run_on_gpu.sh: 1 rank, and 2 ranks sharing one GPU).
"""

import numpy as np
import pytest
import tensorflow as tf

import mpistrategy
from mpistrategy import ops

GPU = "/GPU:0"

_FLOATS = ("float16", "bfloat16", "float32", "float64")
_DTYPES = _FLOATS + ("int64", "uint8", "int8", "bool")
_OPS = {"sum": ops.Sum, "mean": ops.Mean, "min": ops.Min, "max": ops.Max,
        "product": ops.Product}


def _on_gpu(value, dtype):
  """`value` (array-like) as a `dtype` tensor in GPU memory."""
  with tf.device("/CPU:0"):
    host = tf.cast(tf.constant(np.asarray(value)), dtype)
  with tf.device(GPU):
    return tf.identity(host)


def _assert_on_gpu(tensor):
  assert "GPU" in tensor.device, tensor.device


def _close(actual, expected, dtype):
  actual = np.asarray(actual).astype(np.float64)
  expected = np.asarray(expected).astype(np.float64)
  tolerance = {"float16": 1e-2, "bfloat16": 2e-2}.get(dtype, 1e-6)
  np.testing.assert_allclose(actual, expected, rtol=tolerance, atol=tolerance)


def _contribution(rank, dtype, n=37):
  if dtype == "bool":
    return (np.arange(n) + rank) % 3 == 0
  return (np.arange(n) % 4 + 1 + rank).astype(np.float64)


def _expected(world, dtype, op, n=37):
  parts = np.stack([_contribution(r, dtype, n) for r in range(world.size)])
  if dtype == "bool":
    return parts.any(0) if op in ("sum", "max") else parts.all(0)
  return {"sum": parts.sum(0), "mean": parts.mean(0), "min": parts.min(0),
          "max": parts.max(0), "product": parts.prod(0)}[op]


def test_pinned_to_one_gpu(world):
  assert world.device is not None
  assert len(tf.config.get_visible_devices("GPU")) == 1


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("op", sorted(_OPS))
def test_allreduce(world, dtype, op):
  if op == "mean" and dtype not in _FLOATS:
    pytest.skip("mean needs a floating dtype")
  x = _on_gpu(_contribution(world.rank, dtype), dtype)
  with tf.device(GPU):
    y = ops.allreduce(x, op=_OPS[op])
  _assert_on_gpu(y)
  assert y.dtype == x.dtype and y.shape == x.shape
  if dtype == "bool":
    np.testing.assert_array_equal(y.numpy(), _expected(world, dtype, op))
  else:
    _close(y.numpy(), _expected(world, dtype, op), dtype)


def test_allreduce_large_and_empty(world):
  n = 1 << 24  # 64 MiB of float32: larger than the fusion threshold
  x = _on_gpu(np.full([n], world.rank + 1.0, np.float32), tf.float32)
  empty = _on_gpu(np.zeros([0, 3], np.float32), tf.float32)
  with tf.device(GPU):
    y = ops.allreduce(x)
    m = ops.allreduce(x, op=ops.Mean)
    e = ops.allreduce(empty)
  total = world.size * (world.size + 1) / 2
  assert float(tf.reduce_min(y)) == total == float(tf.reduce_max(y))
  _close(tf.reduce_max(m).numpy(), total / world.size, "float32")
  assert e.shape == (0, 3)


def test_fused_allreduces_in_tf_function(world):
  """Many small allreduces in one step: packed into the device buffer."""
  count = 40

  @tf.function
  def step(xs):
    with tf.device(GPU):
      return [ops.allreduce(x, op=ops.Sum) for x in xs]

  xs = [_on_gpu(np.full([k + 1, 3], world.rank + k, np.float32), tf.float32)
        for k in range(count)]
  for _ in range(3):  # the second and later steps take the cached path
    ys = step(xs)
    for k, y in enumerate(ys):
      _assert_on_gpu(y)
      expected = world.size * k + world.size * (world.size - 1) / 2
      np.testing.assert_array_equal(y.numpy(),
                                    np.full([k + 1, 3], expected, np.float32))


def test_grouped_allreduce_mixed_sizes(world):
  xs = [_on_gpu(np.full([k * 7 + 1], float(world.rank * k), np.float64),
                tf.float64) for k in range(10)]
  with tf.device(GPU):
    ys = ops.grouped_allreduce(xs, op=ops.Mean)
  for k, y in enumerate(ys):
    _assert_on_gpu(y)
    expected = k * (world.size - 1) / 2
    _close(y.numpy(), np.full([k * 7 + 1], expected), "float64")


def test_allgather_uneven(world):
  x = _on_gpu(np.full([world.rank + 1, 3], world.rank, np.float32),
              tf.float32)
  with tf.device(GPU):
    y = ops.allgather(x)
  _assert_on_gpu(y)
  expected = np.concatenate(
      [np.full([r + 1, 3], r, np.float32) for r in range(world.size)])
  np.testing.assert_array_equal(y.numpy(), expected)


def test_allgather_even_int64(world):
  x = _on_gpu(np.arange(6).reshape(2, 3) + 100 * world.rank, tf.int64)
  with tf.device(GPU):
    y = ops.allgather(x)
  expected = np.concatenate(
      [np.arange(6).reshape(2, 3) + 100 * r for r in range(world.size)])
  np.testing.assert_array_equal(y.numpy(), expected)


@pytest.mark.parametrize("root", ["first", "last"])
def test_broadcast(world, root):
  root_rank = 0 if root == "first" else world.size - 1
  x = _on_gpu(np.arange(1000, dtype=np.float32) + 10 * world.rank,
              tf.bfloat16)
  with tf.device(GPU):
    y = ops.broadcast(x, root_rank=root_rank)
  _assert_on_gpu(y)
  _close(y.numpy(), np.arange(1000) + 10 * root_rank, "bfloat16")


@pytest.mark.parametrize("rows_per_rank", [2, None])
def test_reducescatter(world, rows_per_rank):
  rows = world.size * 2 if rows_per_rank else 2 * world.size + 1
  x = _on_gpu(np.arange(rows * 3).reshape(rows, 3) * (world.rank + 1),
              tf.float32)
  with tf.device(GPU):
    y = ops.reducescatter(x)
  _assert_on_gpu(y)
  base, extra = divmod(rows, world.size)
  start = world.rank * base + min(world.rank, extra)
  mine = base + (1 if world.rank < extra else 0)
  total = np.arange(rows * 3).reshape(rows, 3) * (
      world.size * (world.size + 1) / 2)
  np.testing.assert_array_equal(y.numpy(), total[start:start + mine])


def test_alltoall_with_splits(world):
  # Rank r sends j + 1 rows to rank j; row values encode (sender, row).
  splits = [j + 1 for j in range(world.size)]
  rows = sum(splits)
  x = _on_gpu(np.arange(rows)[:, None] * np.ones([1, 2]) + 1000 * world.rank,
              tf.float32)
  with tf.device(GPU):
    y, received = ops.alltoall(x, splits=splits)
  _assert_on_gpu(y)
  offset = sum(splits[:world.rank])
  expected = np.concatenate([
      np.arange(offset, offset + world.rank + 1)[:, None] * np.ones([1, 2]) +
      1000 * j for j in range(world.size)])
  np.testing.assert_array_equal(y.numpy(), expected)
  np.testing.assert_array_equal(np.asarray(received),
                                [world.rank + 1] * world.size)


def test_cpu_and_gpu_in_one_function(world):
  @tf.function
  def step(a, b):
    with tf.device("/CPU:0"):
      ya = ops.allreduce(a)
    with tf.device(GPU):
      yb = ops.allreduce(b)
    return ya, yb

  with tf.device("/CPU:0"):
    a = tf.constant([1.0, 2.0]) * (world.rank + 1)
  b = _on_gpu(np.array([3.0, 4.0]) * (world.rank + 1), tf.float32)
  ya, yb = step(a, b)
  total = world.size * (world.size + 1) / 2
  np.testing.assert_array_equal(ya.numpy(), np.array([1.0, 2.0]) * total)
  np.testing.assert_array_equal(yb.numpy(), np.array([3.0, 4.0]) * total)
  _assert_on_gpu(yb)


def test_rank_dependent_shape_fails_everywhere(world):
  if world.size < 2:
    pytest.skip("needs at least 2 ranks")
  x = _on_gpu(np.zeros([world.rank + 1], np.float32), tf.float32)
  with pytest.raises(tf.errors.FailedPreconditionError):
    with tf.device(GPU):
      ops.allreduce(x, name="gpu_mismatch").numpy()


def test_hierarchical_allreduce(world):
  """hierarchical_allreduce: NCCL inside the host, MPI across hosts."""
  mpistrategy.shutdown()
  try:
    mpistrategy.init(mpistrategy.Options(hierarchical_allreduce=True))
    xs = [_on_gpu(np.arange(n, dtype=np.float32) + world.rank, tf.float32)
          for n in (1, 7, 1000, 4099)]
    with tf.device(GPU):
      sums = ops.grouped_allreduce(xs)
      means = [ops.allreduce(x, op=ops.Mean) for x in xs]
      halves = ops.allreduce(tf.cast(xs[2], tf.float16), op=ops.Max)
    shift = world.size * (world.size - 1) / 2
    for x, s, m in zip(xs, sums, means):
      n = x.shape[0]
      np.testing.assert_array_equal(s.numpy(),
                                    world.size * np.arange(n) + shift)
      _close(m.numpy(), np.arange(n) + shift / world.size, "float32")
    _close(halves.numpy(), np.arange(1000) + world.size - 1, "float16")
  finally:
    mpistrategy.shutdown()
    mpistrategy.init()
