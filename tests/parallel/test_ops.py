"""mpistrategy.ops under mpirun: every op against numpy closed forms.

Run on every rank with the same arguments:

    tests/mpirun_pytest.sh 2 900 tests/parallel/test_ops.py
    tests/mpirun_pytest.sh 3 1200 tests/parallel/test_ops.py

Every test is collective-symmetric: each rank builds its input from its rank,
runs the collective, and checks the result against the closed form computed
from all ranks' inputs.
"""

import os
import random
import sys

import numpy as np
import pytest
import tensorflow as tf

import mpistrategy
from mpistrategy import ops
from mpistrategy.ops import collectives

# From the launcher, so that collecting this module starts nothing; the
# fixture below initializes mpistrategy and test_rank_and_size_match_mpirun
# checks that it agrees.
RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK",
                          os.environ.get("PMI_RANK", "0")))
SIZE = int(os.environ.get("OMPI_COMM_WORLD_SIZE",
                          os.environ.get("PMI_SIZE", "1")))


@pytest.fixture(autouse=True, scope="module")
def _initialized():
  # Another test module of the same session may have started the engine with
  # its own options; keep them.
  if not mpistrategy.is_initialized():
    mpistrategy.init()
  yield

FLOATS = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
INTS = [tf.int32, tf.int64, tf.uint8, tf.int8]
NUMERIC = FLOATS + INTS
ALL = NUMERIC + [tf.bool]
SHAPES = [(), (0,), (17,), (3, 5, 7)]
MODES = ["eager", "function"]
OPS = {
    "sum": ops.Sum, "mean": ops.Average, "min": ops.Min, "max": ops.Max,
    "product": ops.Product,
}
BIG = (1 << 20,)  # 4 MiB of float32
needs_peers = pytest.mark.skipif(SIZE < 2, reason="needs other ranks")
S = SIZE * (SIZE + 1) / 2  # sum over ranks of (rank + 1)


def _ids(values):
  return [getattr(v, "name", str(v)) for v in values]


def contribution(r, shape, dtype, op="sum"):
  """Rank r's input: small integers, exact in every dtype and reduction."""
  n = int(np.prod(shape, dtype=np.int64))
  i = np.arange(n, dtype=np.int64)
  if dtype == tf.bool:
    values = (i + r) % 3 == 0
  elif op == "product":
    values = i % 2 + 1 + r % 2          # 1..3: 3**3 fits int8
  else:
    values = i % 5 + 1 + r              # sums stay far below 127
  return values.reshape(shape).astype(dtype.as_numpy_dtype)


def expected_reduce(arrays, op, dtype):
  stack = np.stack([a.astype(np.float64) for a in arrays])
  if dtype == tf.bool:
    stack = stack.astype(bool)
    if op in ("sum", "max"):
      return np.any(stack, axis=0)
    return np.all(stack, axis=0)
  result = {
      "sum": lambda: stack.sum(0),
      "mean": lambda: stack.sum(0) / len(arrays),
      "min": lambda: stack.min(0),
      "max": lambda: stack.max(0),
      "product": lambda: stack.prod(0),
  }[op]()
  return result


def as_float(t):
  a = t.numpy() if hasattr(t, "numpy") else np.asarray(t)
  return a if a.dtype == bool else a.astype(np.float64)


def tolerance(dtype):
  return {tf.float16: 1e-3, tf.bfloat16: 1e-2}.get(dtype, 1e-12)


def run(mode, fn, *args):
  if mode == "eager":
    return fn(*args)
  return tf.function(fn)(*args)


# ---------------------------------------------------------------- process


def test_rank_and_size_match_mpirun():
  assert mpistrategy.is_initialized()
  assert mpistrategy.rank() == RANK
  assert mpistrategy.size() == SIZE
  assert 0 <= mpistrategy.local_rank() < mpistrategy.local_size() <= SIZE
  assert mpistrategy.local_rank() == int(
      os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))


def test_world_has_several_ranks():
  if SIZE == 1:
    pytest.skip("a world of one rank: every test below degenerates to the "
                "identity (run under mpirun -np >= 2 for real coverage)")
  assert "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_RANK" in os.environ


# --------------------------------------------------------------- allreduce


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ALL, ids=_ids(ALL))
def test_allreduce_sum_dtypes_shapes(dtype, shape, mode):
  x = tf.constant(contribution(RANK, shape, dtype), dtype=dtype)
  y = run(mode, lambda t: ops.allreduce(t, op=ops.Sum), x)
  assert y.dtype == dtype and tuple(y.shape) == shape
  want = expected_reduce(
      [contribution(r, shape, dtype) for r in range(SIZE)], "sum", dtype)
  np.testing.assert_array_equal(as_float(y), want)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", ALL, ids=_ids(ALL))
def test_allreduce_ops(dtype, op, mode):
  if op == "mean" and dtype not in FLOATS:
    pytest.skip("mean needs a floating dtype (tested in test_ops_single)")
  shape = (3, 5, 7)
  x = tf.constant(contribution(RANK, shape, dtype, op), dtype=dtype)
  y = run(mode, lambda t: ops.allreduce(t, op=OPS[op]), x)
  want = expected_reduce(
      [contribution(r, shape, dtype, op) for r in range(SIZE)], op, dtype)
  if dtype == tf.bool:
    np.testing.assert_array_equal(y.numpy(), want)
  else:
    np.testing.assert_allclose(as_float(y), want, rtol=tolerance(dtype))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_allreduce_large(op, mode):
  x = tf.constant(contribution(RANK, BIG, tf.float32))
  y = run(mode, lambda t: ops.allreduce(t, op=OPS[op]), x)
  want = expected_reduce(
      [contribution(r, BIG, tf.float32) for r in range(SIZE)], op, tf.float32)
  np.testing.assert_allclose(y.numpy(), want, rtol=1e-6)


@needs_peers
@pytest.mark.parametrize("dtype", [tf.int8, tf.uint8])
@pytest.mark.parametrize("count", [8, 64, 1000])
def test_allreduce_8_bit_sums_wrap_like_numpy(dtype, count):
  # Open MPI's vectorised MPI_SUM saturates 8-bit sums of longer vectors;
  # the result must not depend on the length.
  value = 100 if dtype == tf.int8 else 200
  x = tf.fill([count], tf.constant(value, dtype))
  want = (np.full([count], value, np.int64) * SIZE).astype(dtype.as_numpy_dtype)
  grouped = ops.grouped_allreduce([x, x], name=f"wrap/g/{dtype.name}/{count}")
  for y in (ops.allreduce(x, name=f"wrap/{dtype.name}/{count}"), grouped[1]):
    np.testing.assert_array_equal(y.numpy(), want)


@needs_peers
@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32,
                                   tf.float64])
@pytest.mark.parametrize("op", ["min", "max"])
def test_allreduce_min_max_propagate_nan(dtype, op):
  # Like tf.minimum/tf.maximum: a NaN on any rank wins, whatever the
  # vector length (MPI_MIN/MPI_MAX keep or drop it by position).
  for count in (1, 64):
    x = np.full([count], 1.0 + RANK)
    x[count // 2] = np.nan if RANK == 0 else 5.0
    y = ops.allreduce(tf.constant(x, dtype), op=getattr(ops, op.capitalize()),
                      name=f"nan/{dtype.name}/{op}/{count}")
    y = y.numpy().astype(np.float64)
    assert np.isnan(y[count // 2]), y
    assert not np.isnan(np.delete(y, count // 2)).any(), y


@needs_peers
@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_16_bit_mean_overflows_only_if_the_mean_does(dtype):
  # Every rank holds 40000: the float16 sum overflows (> 65504), the mean
  # does not.
  x = tf.constant([[40000.0], [1.0]] * SIZE, dtype)
  want = np.array([[40000.0], [1.0]] * SIZE)
  y = ops.allreduce(x, op=ops.Average, name=f"mean16/{dtype.name}")
  np.testing.assert_allclose(y.numpy().astype(np.float64), want, rtol=1e-2)
  ys = ops.grouped_allreduce([x, tf.ones([2])], op=ops.Average,
                             name=f"mean16/g/{dtype.name}")
  np.testing.assert_allclose(ys[0].numpy().astype(np.float64), want,
                             rtol=1e-2)
  np.testing.assert_allclose(ys[1].numpy(), [1.0, 1.0], rtol=1e-6)
  z = ops.reducescatter(x, op=ops.Average, name=f"mean16/rs/{dtype.name}")
  np.testing.assert_allclose(z.numpy().astype(np.float64), [[40000.0], [1.0]],
                             rtol=1e-2)


def test_allreduce_scalar_mean_from_python_float():
  y = ops.allreduce(float(RANK), op=ops.Average)
  assert y.shape == ()
  assert y.numpy() == pytest.approx(sum(range(SIZE)) / SIZE)


def test_allreduce_accepts_tf_distribute_reduce_op():
  y = ops.allreduce(tf.constant([1.0, RANK]), op=tf.distribute.ReduceOp.SUM)
  np.testing.assert_array_equal(y.numpy(), [SIZE, sum(range(SIZE))])


def test_allreduce_repeated_same_name_hits_cache():
  # The same name over and over (a training loop) exercises the engine's
  # response-cache fast path.
  @tf.function
  def step(t):
    return ops.allreduce(t, name="loop/grad")
  for i in range(50):
    y = step(tf.fill([8], float(RANK + i)))
    assert y.numpy()[0] == sum(r + i for r in range(SIZE))


def test_allreduce_same_name_new_shape():
  for n in (1, 5, 3):
    y = ops.allreduce(tf.ones([n]), name="reshaped")
    np.testing.assert_array_equal(y.numpy(), np.full([n], SIZE))


# ------------------------------------------------------- grouped_allreduce


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allreduce_50_tensors(mode):
  specs = [(ALL[i % len(ALL)], [(), (0,), (17,), (3, 5, 7), (4, 2)][i % 5])
           for i in range(50)]
  xs = [tf.constant(contribution(RANK, shape, dtype), dtype=dtype)
        for dtype, shape in specs]
  ys = run(mode, lambda *t: ops.grouped_allreduce(list(t), op=ops.Sum), *xs)
  assert len(ys) == 50
  for (dtype, shape), y in zip(specs, ys):
    assert y.dtype == dtype and tuple(y.shape) == shape
    want = expected_reduce(
        [contribution(r, shape, dtype) for r in range(SIZE)], "sum", dtype)
    np.testing.assert_array_equal(as_float(y), want)


def test_grouped_allreduce_mean_and_empty():
  ys = ops.grouped_allreduce(
      [tf.fill([3], float(RANK)), tf.fill([2, 2], float(2 * RANK))],
      op=ops.Average)
  mean = sum(range(SIZE)) / SIZE
  np.testing.assert_allclose(ys[0].numpy(), np.full([3], mean))
  np.testing.assert_allclose(ys[1].numpy(), np.full([2, 2], 2 * mean))
  assert ops.grouped_allreduce([]) == []
  assert ops.grouped_allreduce([], op=ops.Average) == []


@needs_peers
@pytest.mark.parametrize("mode", MODES)
def test_an_empty_group_on_one_rank_fails_on_every_rank(mode):
  # An empty group is a collective too: the last rank's must not return at
  # once and leave the others waiting for it.
  last = SIZE - 1
  def call():
    group = [] if RANK == last else [tf.ones([3]), tf.ones([2])]
    return ops.grouped_allreduce(group, name=f"grouped/empty/{mode}")
  with pytest.raises(tf.errors.FailedPreconditionError,
                     match=f"rank 0 has a group of 2 tensors but rank {last} "
                     "has a group of 0 tensors"):
    run(mode, call)
  assert run(mode, lambda: ops.grouped_allreduce(
      [], name=f"grouped/all-empty/{mode}")) == []


@pytest.mark.parametrize("mode", MODES)
def test_grouped_average_reduces_each_tensor_as_its_own_allreduce(mode):
  # A float16 member makes the group one SUM; float32/float64 members must
  # still divide their sum (not sum their quotients), and float16 divide
  # first.  Integer values keep every sum exact in any order, so only where
  # the division happens can move a bit (at 3 ranks: x / 3 is inexact).
  n = 1000
  def values(r, dtype):
    return (np.arange(n) % 97 + 10 * r + 1).astype(dtype.as_numpy_dtype)
  dtypes = [tf.float16, tf.float32, tf.float64, tf.bfloat16]
  xs = [tf.constant(values(RANK, d), dtype=d) for d in dtypes]
  ys = run(mode, lambda *t: ops.grouped_allreduce(
      list(t), op=ops.Average, name=f"grouped/mean16/{mode}"), *xs)
  for dtype, y in zip(dtypes, ys):
    assert y.dtype == dtype
    if dtype in (tf.float32, tf.float64):
      np_dtype = dtype.as_numpy_dtype
      total = sum(values(r, dtype) for r in range(SIZE))
      np.testing.assert_array_equal(y.numpy(), total / np_dtype(SIZE))
    else:
      mean = sum(values(r, tf.float64) for r in range(SIZE)) / SIZE
      np.testing.assert_allclose(as_float(y), mean, rtol=2e-2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pack", [True, False])
def test_grouped_allreduce_odd_sizes_and_mixed_dtypes(mode, pack):
  # Odd element counts put every packed tensor after padding (each output
  # must start aligned); float16 and int8 make the padding uneven in bytes.
  specs = [(tf.float16, [3]), (tf.float32, [5, 1]), (tf.int8, [7]),
           (tf.float16, []), (tf.float32, [0]), (tf.float32, [129])]
  xs = [tf.constant(contribution(RANK, shape, dtype), dtype=dtype)
        for dtype, shape in specs]

  def fn(*t):
    if pack:
      ys = ops.grouped_allreduce(list(t), name=f"grouped/odd/{mode}")
    else:
      ys = collectives._grouped_allreduce_unpacked(  # pylint: disable=protected-access
          list(t), f"grouped/odd/{mode}/each")
    # The outputs feed ordinary kernels (which may assume alignment).
    return [y * tf.cast(2, y.dtype) for y in ys]

  for _ in range(2):  # the second call takes the cached fast path
    ys = run(mode, fn, *xs)
    for (dtype, shape), y in zip(specs, ys):
      assert y.dtype == dtype and y.shape.as_list() == shape
      want = 2 * np.asarray(expected_reduce(
          [contribution(r, shape, dtype) for r in range(SIZE)], "sum", dtype))
      np.testing.assert_array_equal(as_float(y), want.astype(np.float64))


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", NUMERIC, ids=_ids(NUMERIC))
def test_grouped_allreduce_of_one_dtype_odd_sizes(dtype, op):
  # One dtype: on the CPU the engine reads the tensors where they are
  # (TensorEntry::packed_inputs) instead of the kernel copying them into the
  # group's buffer, where they average 4 KB or more (every dtype here but
  # int8/uint8, which stay packed).  Odd sizes leave gaps between the
  # outputs, and the group is over the shared-memory plane's one-barrier
  # limit (16 KB), so the ranks' shares straddle the tensors.
  if op == "mean" and dtype not in FLOATS:
    pytest.skip("mean needs a floating dtype")
  shapes = [(3,), (0,), (17, 5), (), (20000,), (1,)]
  xs = [tf.constant(contribution(RANK, shape, dtype, op), dtype=dtype)
        for shape in shapes]
  before = [x.numpy().copy() for x in xs]
  fn = tf.function(lambda *t: ops.grouped_allreduce(list(t), op=OPS[op]))
  for _ in range(2):  # the second call takes the cached fast path
    ys = fn(*xs)
    for shape, y in zip(shapes, ys):
      assert y.dtype == dtype and tuple(y.shape) == shape
      want = expected_reduce(
          [contribution(r, shape, dtype, op) for r in range(SIZE)], op, dtype)
      np.testing.assert_allclose(as_float(y), want, rtol=tolerance(dtype))
  for x, b in zip(xs, before):
    np.testing.assert_array_equal(x.numpy(), b)


def test_grouped_allreduce_chained_reads_views_of_the_last_group():
  # Each group's inputs are the previous group's outputs: through MPI,
  # views of its buffer, read there while the next buffer is written; on
  # shared memory, tensors the op alone holds, so it forwards them and the
  # group is reduced in place.
  @tf.function
  def chain(t):
    ts = tf.split(t, [3, 1000, 4097, 0])
    for _ in range(4):
      ts = ops.grouped_allreduce(ts, op=ops.Sum)
    return ts

  x = tf.range(5100, dtype=tf.float32) + RANK
  ys = chain(x)
  got = np.concatenate([y.numpy() for y in ys])
  want = (np.arange(5100) * SIZE + S - SIZE) * SIZE ** 3
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_grouped_allreduce_leaves_inputs_that_are_used_again():
  # Inputs another op still reads cannot be reduced in place: the group
  # gets outputs of its own and the inputs keep their values.
  @tf.function
  def f(t):
    a = t + 1.0
    b = t * 2.0
    ys = ops.grouped_allreduce([a, b, a], op=ops.Sum)
    return a, b, ys

  x = tf.range(6000, dtype=tf.float32) + RANK
  for _ in range(2):
    a, b, ys = f(x)
    np.testing.assert_array_equal(a.numpy(), x.numpy() + 1.0)
    np.testing.assert_array_equal(b.numpy(), x.numpy() * 2.0)
    base = np.arange(6000) * SIZE + S - SIZE  # sum over ranks of x
    np.testing.assert_allclose(ys[0].numpy(), base + SIZE, rtol=1e-6)
    np.testing.assert_allclose(ys[1].numpy(), 2 * base, rtol=1e-6)
    np.testing.assert_allclose(ys[2].numpy(), base + SIZE, rtol=1e-6)


def test_grouped_allreduce_outputs_outlive_each_other():
  # The outputs share one buffer: dropping some must not free the others.
  ys = ops.grouped_allreduce([tf.fill([1000], float(RANK)) for _ in range(4)],
                             name="grouped/lifetime")
  keep = ys[2]
  del ys
  _ = [tf.ones([1000]) * 7.0 for _ in range(20)]  # reuse freed memory
  np.testing.assert_array_equal(keep.numpy(), np.full([1000], S - SIZE))


# ---------------------------------------------------------------- allgather


def gather_input(r, dtype, trailing):
  rows = r + 1 if r % 2 else r  # rank 0 contributes no rows
  return contribution(r, (rows,) + trailing, dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("trailing", [(), (3,), (2, 0), (5, 7)], ids=str)
@pytest.mark.parametrize("dtype", ALL, ids=_ids(ALL))
def test_allgather_rank_dependent_rows(dtype, trailing, mode):
  x = tf.constant(gather_input(RANK, dtype, trailing), dtype=dtype)
  y = run(mode, ops.allgather, x)
  want = np.concatenate([gather_input(r, dtype, trailing)
                         for r in range(SIZE)])
  assert y.dtype == dtype and tuple(y.shape) == want.shape
  np.testing.assert_array_equal(as_float(y), as_float(want))


def test_allgather_large():
  rows = (1 << 18) + RANK  # ~1 MiB of float32 per rank, uneven
  x = tf.fill([rows, 4], float(RANK))
  y = ops.allgather(x)
  sizes = [(1 << 18) + r for r in range(SIZE)]
  assert y.shape == (sum(sizes), 4)
  want = np.concatenate([np.full([n, 4], r, np.float32)
                         for r, n in enumerate(sizes)])
  np.testing.assert_array_equal(y.numpy(), want)


def test_allgather_static_shape_in_function():
  @tf.function
  def fn(t):
    y = ops.allgather(t)
    assert y.shape.as_list() == [None, 3]
    return y
  assert fn(tf.ones([2, 3])).shape == (2 * SIZE, 3)


# ---------------------------------------------------------------- broadcast


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ALL, ids=_ids(ALL))
def test_broadcast_from_every_root(dtype, shape, mode):
  for root in range(SIZE):
    x = tf.constant(contribution(RANK, shape, dtype), dtype=dtype)
    y = run(mode, lambda t, root=root: ops.broadcast(t, root_rank=root), x)
    assert y.dtype == dtype and tuple(y.shape) == shape
    np.testing.assert_array_equal(as_float(y),
                                  as_float(contribution(root, shape, dtype)))


def test_broadcast_large():
  x = tf.fill(BIG, float(RANK + 1))
  y = ops.broadcast(x, root_rank=SIZE - 1)
  np.testing.assert_array_equal(y.numpy(), np.full(BIG, SIZE, np.float32))


# ------------------------------------------------------------ reducescatter


def scatter_rows(n):
  """Rows rank r receives: n // SIZE, one more for the first n % SIZE."""
  counts = [n // SIZE + (1 if r < n % SIZE else 0) for r in range(SIZE)]
  start = sum(counts[:RANK])
  return start, start + counts[RANK]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ["sum", "mean", "min", "max", "product"])
@pytest.mark.parametrize("dtype", NUMERIC, ids=_ids(NUMERIC))
def test_reducescatter_uneven(dtype, op, mode):
  if op == "mean" and dtype not in FLOATS:
    pytest.skip("mean needs a floating dtype")
  shape = (2 * SIZE + 1, 3)
  x = tf.constant(contribution(RANK, shape, dtype, op), dtype=dtype)
  y = run(mode, lambda t: ops.reducescatter(t, op=OPS[op]), x)
  full = expected_reduce(
      [contribution(r, shape, dtype, op) for r in range(SIZE)], op, dtype)
  begin, end = scatter_rows(shape[0])
  assert tuple(y.shape) == (end - begin, 3)
  np.testing.assert_allclose(as_float(y), full[begin:end],
                             rtol=tolerance(dtype))


@pytest.mark.parametrize("rows", [0, 1, SIZE, 17])
def test_reducescatter_row_counts(rows):
  x = tf.fill([rows, 2], float(RANK + 1))
  y = ops.reducescatter(x)
  begin, end = scatter_rows(rows)
  np.testing.assert_array_equal(
      y.numpy(), np.full([end - begin, 2], SIZE * (SIZE + 1) / 2))


def test_reducescatter_large():
  x = tf.fill([1 << 18, 4], 1.0)
  y = ops.reducescatter(x)
  begin, end = scatter_rows(1 << 18)
  np.testing.assert_array_equal(y.numpy(), np.full([end - begin, 4], SIZE))


# ----------------------------------------------------------------- alltoall


def alltoall_splits(src):
  """Rows rank `src` sends to each rank (uneven, some zero)."""
  return [(src + dst) % 3 for dst in range(SIZE)]


def alltoall_input(src, dtype, trailing=(2,)):
  splits = alltoall_splits(src)
  rows = []
  for dst, n in enumerate(splits):
    for i in range(n):
      rows.append(np.full(trailing, 10 * src + dst + i))
  shape = (sum(splits),) + trailing
  data = np.array(rows, dtype=np.int64).reshape(shape)
  if dtype == tf.bool:
    return (data % 2 == 1)
  return data.astype(dtype.as_numpy_dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("splits_dtype", [tf.int32, tf.int64],
                         ids=["int32", "int64"])
@pytest.mark.parametrize("dtype", ALL, ids=_ids(ALL))
def test_alltoall_uneven_splits(dtype, splits_dtype, mode):
  x = tf.constant(alltoall_input(RANK, dtype), dtype=dtype)
  splits = tf.constant(alltoall_splits(RANK), splits_dtype)
  y, received = run(mode, lambda t, s: ops.alltoall(t, splits=s), x, splits)
  want_rows = [alltoall_splits(src)[RANK] for src in range(SIZE)]
  assert received.dtype == splits_dtype
  np.testing.assert_array_equal(received.numpy(), want_rows)
  parts = []
  for src in range(SIZE):
    s = alltoall_splits(src)
    start = sum(s[:RANK])
    parts.append(alltoall_input(src, dtype)[start:start + s[RANK]])
  want = np.concatenate(parts)
  assert tuple(y.shape) == want.shape
  np.testing.assert_array_equal(as_float(y), as_float(want))


def test_alltoall_even_split_default():
  x = tf.reshape(tf.range(2 * SIZE * 3, dtype=tf.int64) + 1000 * RANK,
                 [2 * SIZE, 3])
  y, received = ops.alltoall(x)
  np.testing.assert_array_equal(received.numpy(), [2] * SIZE)
  want = np.concatenate([
      (np.arange(2 * SIZE * 3).reshape(2 * SIZE, 3) + 1000 * src)
      [2 * RANK:2 * RANK + 2] for src in range(SIZE)])
  np.testing.assert_array_equal(y.numpy(), want)


def test_alltoall_large():
  rows = 1 << 18  # 1 MiB of float32 to each rank
  x = tf.fill([rows * SIZE, 1], float(RANK))
  y, received = ops.alltoall(x)
  np.testing.assert_array_equal(received.numpy(), [rows] * SIZE)
  want = np.repeat(np.arange(SIZE, dtype=np.float32), rows)[:, None]
  np.testing.assert_array_equal(y.numpy(), want)


def test_alltoall_python_list_splits():
  splits = [1] * SIZE
  y, received = ops.alltoall(tf.fill([SIZE], RANK), splits=splits)
  np.testing.assert_array_equal(y.numpy(), np.arange(SIZE))
  np.testing.assert_array_equal(received.numpy(), splits)


@pytest.mark.parametrize("mode", MODES)
def test_alltoall_splits_wrong_on_one_rank_fail_on_every_rank(mode):
  # Splits computed from one rank's data that do not fit its tensor: every
  # rank fails naming that rank (none waits for it), and the next
  # collective works.
  last = SIZE - 1
  splits = [2] * SIZE if RANK == last else [1] * SIZE
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=f"splits \\[{', '.join(['2'] * SIZE)}\\] sum to "
                     f"{2 * SIZE} but the first dimension of the input is "
                     f"{SIZE} \\(on rank {last}\\)"):
    run(mode, lambda t, s: ops.alltoall(t, splits=s),
        tf.fill([SIZE], RANK), tf.constant(splits, tf.int64))
  y, _ = ops.alltoall(tf.fill([SIZE], RANK))
  np.testing.assert_array_equal(y.numpy(), np.arange(SIZE))


_WRONG_ON_THE_LAST_RANK = {
    # case: (the call, given `wrong` for the last rank, the error's text)
    "broadcast root out of range": (
        lambda wrong: ops.broadcast(tf.ones([3]),
                                    root_rank=SIZE + 3 if wrong else 0),
        f"root_rank must be in \\[0, {SIZE}\\), got {SIZE + 3}"),
    "allgather of a scalar": (
        lambda wrong: ops.allgather(tf.constant(1.0) if wrong
                                    else tf.ones([2])), "got a scalar"),
    "reducescatter of a scalar": (
        lambda wrong: ops.reducescatter(tf.constant(1.0) if wrong
                                        else tf.ones([SIZE])), "got a scalar"),
    "alltoall of a scalar": (
        lambda wrong: ops.alltoall(tf.constant(1.0) if wrong
                                   else tf.ones([SIZE]))[0], "got a scalar"),
    "alltoall splits of another length": (
        lambda wrong: ops.alltoall(tf.ones([SIZE + 1]), splits=(
            [1] * (SIZE + 1) if wrong else [2] + [1] * (SIZE - 1)))[0],
        f"splits must have one entry per rank \\({SIZE}\\), got {SIZE + 1}"),
    "average of integers": (
        lambda wrong: ops.allreduce(tf.ones([2], tf.int32 if wrong
                                            else tf.float32), op=ops.Average),
        "reduce_op mean needs a floating dtype"),
}


@needs_peers
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(_WRONG_ON_THE_LAST_RANK))
def test_an_argument_wrong_on_one_rank_fails_on_every_rank(case, mode):
  # Eagerly and inside a tf.function (whose graph must still build on the
  # wrong rank): no rank raises alone while the others wait for it.
  call, text = _WRONG_ON_THE_LAST_RANK[case]
  last = SIZE - 1
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=f"{text}.* \\(on rank {last}\\)"):
    run(mode, lambda: call(RANK == last))
  ops.barrier()


# -------------------------------------------------- counts above int32

# 2**31 + 1031 one-byte elements: more than a C int (an MPI count) holds, so
# every layer must split or widen its counts.  Each rank's input is one
# value, so a part skipped or reduced twice changes the result's minimum or
# maximum.  About 5 GiB per rank: broadcast and allgather run at np 2 only,
# to bound the CI machine's time and memory.
HUGE = 2**31 + 1031
only_two_ranks = pytest.mark.skipif(
    SIZE != 2, reason="multi-GiB buffers on every rank: np 2 only")


def assert_all_equal(t, value):
  assert (int(tf.reduce_min(t)), int(tf.reduce_max(t))) == (value, value)


@needs_peers
def test_allreduce_count_above_int32_range():
  if SIZE > 2 and mpistrategy.current_options().data_plane == "mpi":
    pytest.skip("the MPI plane's huge allreduce runs at np 2 (35 s at np 3)")
  y = ops.allreduce(tf.fill([HUGE], tf.constant(RANK + 1, tf.uint8)),
                    name="huge/allreduce")
  assert y.shape == (HUGE,)
  assert_all_equal(y, int(S) % 256)


@only_two_ranks
def test_broadcast_count_above_int32_range():
  y = ops.broadcast(tf.fill([HUGE], tf.constant(RANK + 5, tf.uint8)),
                    root_rank=1, name="huge/broadcast")
  assert y.shape == (HUGE,)
  assert_all_equal(y, 6)


@only_two_ranks
def test_allgather_output_above_int32_range():
  rows = HUGE // 2 + 7 * (RANK + 1)  # uneven
  y = ops.allgather(tf.fill([rows], tf.constant(RANK + 1, tf.uint8)),
                    name="huge/allgather")
  first = HUGE // 2 + 7
  assert y.shape == (first + HUGE // 2 + 14,)
  assert_all_equal(y[:first], 1)
  assert_all_equal(y[first:], 2)


@needs_peers
def test_reducescatter_input_above_int32_range():
  y = ops.reducescatter(tf.fill([HUGE], tf.constant(RANK + 1, tf.uint8)),
                        name="huge/reducescatter")
  begin, end = scatter_rows(HUGE)
  assert y.shape == (end - begin,)
  assert_all_equal(y, int(S) % 256)



@only_two_ranks
def test_alltoall_block_above_int32_range():
  # Each rank keeps 8 rows and sends the rest, more than 2**31 bytes, to the
  # other rank.
  def splits(src):
    return [8 if dst == src else HUGE - 8 for dst in range(SIZE)]
  y, received = ops.alltoall(
      tf.fill([HUGE], tf.constant(RANK + 1, tf.uint8)), splits=splits(RANK),
      name="huge/alltoall")
  from_0 = splits(0)[RANK]
  np.testing.assert_array_equal(received.numpy(),
                                [splits(src)[RANK] for src in range(SIZE)])
  assert y.shape == (HUGE,)
  assert_all_equal(y[:from_0], 1)
  assert_all_equal(y[from_0:], 2)

# ------------------------------------------------------------------ barrier


def test_barrier_eager_and_function():
  assert ops.barrier() is None

  @tf.function
  def fn():
    ops.barrier()
    return ops.allreduce(tf.constant(1))

  assert fn().numpy() == SIZE
  assert fn().numpy() == SIZE


# ------------------------------------------------- concurrency and ordering


def test_named_allreduces_created_in_rank_dependent_order():
  # Odd ranks create the 30 ops in reverse order, even ranks >= 2 shuffled:
  # only name-based negotiation makes them pair (automatic control
  # dependencies would otherwise run them in creation order and deadlock).
  order = list(range(30))
  if RANK % 2:
    order.reverse()
  elif RANK:
    random.Random(RANK).shuffle(order)

  @tf.function
  def fn(x):
    out = [None] * 30
    for i in order:
      out[i] = ops.allreduce(x * (i + 1), name=f"ordered/{i}")
    return out

  for _ in range(3):
    ys = fn(tf.fill([5], float(RANK + 1)))
    total = SIZE * (SIZE + 1) / 2
    for i, y in enumerate(ys):
      np.testing.assert_array_equal(y.numpy(), np.full([5], total * (i + 1)))


def test_rank_dependent_order_mixed_collectives():
  work = [
      ("a", lambda: ops.allreduce(tf.fill([4], float(RANK)), name="mix/a")),
      ("g", lambda: ops.allgather(tf.fill([RANK + 1], RANK), name="mix/g")),
      ("b", lambda: ops.broadcast(tf.fill([3], RANK), root_rank=SIZE - 1,
                                  name="mix/b")),
      ("s", lambda: ops.reducescatter(tf.ones([SIZE, 2]), name="mix/s")),
      ("t", lambda: ops.alltoall(tf.fill([SIZE], RANK), name="mix/t")[0]),
  ]
  if RANK % 2:
    work.reverse()

  @tf.function
  def fn():
    return {key: make() for key, make in work}

  out = fn()
  np.testing.assert_array_equal(out["a"].numpy(),
                                np.full([4], sum(range(SIZE))))
  np.testing.assert_array_equal(
      out["g"].numpy(), np.concatenate([np.full([r + 1], r)
                                        for r in range(SIZE)]))
  np.testing.assert_array_equal(out["b"].numpy(), np.full([3], SIZE - 1))
  np.testing.assert_array_equal(out["s"].numpy(), np.full([1, 2], SIZE))
  np.testing.assert_array_equal(out["t"].numpy(), np.arange(SIZE))


def test_100_independent_unnamed_allreduces_in_one_function():
  @tf.function
  def fn(x):
    return [ops.allreduce(x + i) for i in range(100)]

  for _ in range(2):
    ys = fn(tf.fill([3], float(RANK)))
    for i, y in enumerate(ys):
      np.testing.assert_array_equal(
          y.numpy(), np.full([3], sum(range(SIZE)) + SIZE * i))


def test_names_survive_rank_dependent_tracing():
  # Rank 0 traces extra functions first (as when only rank 0 saves a
  # checkpoint), which advances TensorFlow's global uids only there.  The
  # cond-branch and gradient graphs traced next get different uid suffixes
  # on different ranks; the default names must still pair.
  if RANK == 0:
    for i in range(3):
      tf.function(lambda t: tf.cond(t > 0, lambda: t + 1, lambda: t - 1))(
          tf.constant(float(i)))

  x = tf.Variable([1.0, 2.0])

  @tf.function
  def step():
    with tf.GradientTape() as tape:
      y = tf.cond(x[0] > 0, lambda: ops.allreduce(x * (RANK + 1)),
                  lambda: ops.allgather(x))
      loss = tf.reduce_sum(y)
    return y, tape.gradient(loss, x)

  y, g = step()
  np.testing.assert_allclose(y.numpy(), [S, 2 * S])
  np.testing.assert_allclose(g.numpy(), [SIZE * (RANK + 1)] * 2)


def test_collectives_in_function_are_not_chained():
  @tf.function
  def fn(x):
    return [ops.allreduce(x, name=f"unchained/{i}") for i in range(3)]

  graph = fn.get_concrete_function(tf.ones([2])).graph
  collectives = [op for op in graph.get_operations()
                 if op.type == "MpiStrategyAllreduce"]
  assert len(collectives) == 3
  for op in collectives:
    assert not [c for c in op.control_inputs
                if c.type == "MpiStrategyAllreduce"], op.control_inputs


# ------------------------------------------------------------- mismatches


def _expect_failed_precondition(fn, name):
  with pytest.raises(tf.errors.FailedPreconditionError) as info:
    fn()
  assert name in str(info.value)
  return str(info.value)


@needs_peers
def test_mismatched_shape_fails_on_every_rank():
  _expect_failed_precondition(
      lambda: ops.allreduce(tf.ones([RANK + 2]), name="mismatch/shape"),
      "mismatch/shape")


@needs_peers
def test_mismatched_dtype_fails_on_every_rank():
  dtype = tf.float32 if RANK % 2 == 0 else tf.int32
  _expect_failed_precondition(
      lambda: ops.allreduce(tf.ones([3], dtype), name="mismatch/dtype"),
      "mismatch/dtype")


@needs_peers
def test_mismatched_op_fails_on_every_rank():
  op = ops.Sum if RANK % 2 == 0 else ops.Max
  _expect_failed_precondition(
      lambda: ops.allreduce(tf.ones([3]), op=op, name="mismatch/op"),
      "mismatch/op")


@needs_peers
def test_mismatched_root_fails_on_every_rank():
  _expect_failed_precondition(
      lambda: ops.broadcast(tf.ones([3]), root_rank=RANK,
                            name="mismatch/root"),
      "mismatch/root")


@needs_peers
def test_mismatched_collective_type_fails_on_every_rank():
  def fn():
    if RANK % 2 == 0:
      return ops.allreduce(tf.ones([3]), name="mismatch/type")
    return ops.allgather(tf.ones([3]), name="mismatch/type")
  _expect_failed_precondition(fn, "mismatch/type")


@needs_peers
def test_mismatched_allgather_trailing_dims_in_function():
  @tf.function
  def fn(x):
    return ops.allgather(x, name="mismatch/gather")
  _expect_failed_precondition(lambda: fn(tf.ones([2, RANK + 1])),
                              "mismatch/gather")


@needs_peers
def test_mismatched_grouped_tensor_shape_fails_naming_it():
  # Same total size on every rank ([2, 3] vs [3, 2]): only the packed
  # shapes tell the groups apart.
  shape = [2, 3] if RANK == 0 else [3, 2]
  message = _expect_failed_precondition(
      lambda: ops.grouped_allreduce(
          [tf.ones([4]), tf.ones(shape), tf.ones([1])],
          name="mismatch/grouped"),
      "mismatch/grouped")
  assert "grouped tensor 1" in message, message
  assert "[2, 3]" in message and "[3, 2]" in message, message


@needs_peers
def test_mismatched_group_length_fails_naming_it():
  xs = [tf.ones([4])] * (2 if RANK == 0 else 3)
  message = _expect_failed_precondition(
      lambda: ops.grouped_allreduce(xs, name="mismatch/group_length"),
      "mismatch/group_length")
  assert "a group of 2 tensors" in message, message


@needs_peers
@pytest.mark.parametrize("case", ["mixed_vs_one_dtype", "swapped_dtypes"])
def test_mismatched_grouped_dtypes_fail_naming_the_tensor(case):
  # Groups whose dtypes differ between ranks meet under one name however
  # their dtypes split, and fail on every rank (neither a stall nor tensors
  # reduced with the wrong partners).
  if case == "mixed_vs_one_dtype":
    second = tf.ones([3], tf.int32) if RANK == 1 else tf.ones([3])
    xs, position = [tf.ones([2]), second], 1
  else:  # the same dtypes and shapes, in a different order on rank 1
    a, b = tf.ones([3]), tf.ones([3], tf.int32)
    xs, position = ([b, a] if RANK == 1 else [a, b]), 0
  name = f"mismatch/grouped_dtype/{case}"
  message = _expect_failed_precondition(
      lambda: ops.grouped_allreduce(xs, name=name), name)
  assert f"grouped tensor {position}" in message, message
  assert "float32" in message and "int32" in message, message
  # The name works again with matching groups.
  ys = ops.grouped_allreduce([tf.ones([2]), tf.ones([3], tf.int32)],
                             name=name)
  np.testing.assert_array_equal(ys[1].numpy(), [SIZE] * 3)


@needs_peers
def test_engine_works_after_mismatch():
  with pytest.raises(tf.errors.FailedPreconditionError):
    ops.allreduce(tf.ones([RANK + 1]), name="mismatch/then-ok")
  y = ops.allreduce(tf.ones([2]), name="mismatch/then-ok")
  np.testing.assert_array_equal(y.numpy(), [SIZE, SIZE])


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_gradient_sum_and_mean(mode):
  x = tf.Variable(tf.fill([4], float(RANK)))

  def grads():
    with tf.GradientTape(persistent=True) as tape:
      s = tf.reduce_sum(ops.allreduce(x, op=ops.Sum) * (RANK + 1))
      m = tf.reduce_sum(ops.allreduce(x, op=ops.Average) * (RANK + 1))
    return tape.gradient(s, x), tape.gradient(m, x)

  g_sum, g_mean = run(mode, grads)
  np.testing.assert_allclose(g_sum.numpy(), np.full([4], S))
  np.testing.assert_allclose(g_mean.numpy(), np.full([4], S / SIZE))


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_gradient_max(mode):
  # Rank r holds [r, -r]: the max of column 0 is on the last rank, of
  # column 1 on rank 0; the gradient reaches only the arg-max rank.
  x = tf.Variable([float(RANK), -float(RANK)])

  def grad():
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(ops.allreduce(x, op=ops.Max) * (RANK + 1))
    return tape.gradient(loss, x)

  g = run(mode, grad).numpy()
  want = [S if RANK == SIZE - 1 else 0.0, S if RANK == 0 else 0.0]
  np.testing.assert_allclose(g, want)


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_gradient_max_ties_share(mode):
  # Every rank holds the maximum 7 in column 0 (as tf.reduce_max, the tied
  # ranks share the gradient) and only rank 0 does in column 1.
  x = tf.Variable([7.0, 7.0 if RANK == 0 else 1.0])

  def grad():
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(ops.allreduce(x, op=ops.Max) * (RANK + 1))
    return tape.gradient(loss, x)

  g = run(mode, grad).numpy()
  np.testing.assert_allclose(g, [S / SIZE, S if RANK == 0 else 0.0])


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_gradient_product_with_zeros(mode):
  # Column 0: no zeros; column 1: rank 0 holds the only zero; column 2:
  # ranks 0 and 1 hold zeros.  d prod / d x_i = product of the others.
  values = np.array([[RANK + 2.0, 0.0 if RANK == 0 else RANK + 2.0,
                      0.0 if RANK < 2 else RANK + 2.0]])
  x = tf.Variable(values[0])

  def grad():
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(ops.allreduce(x, op=ops.Product) * (RANK + 1))
    return tape.gradient(loss, x)

  g = run(mode, grad).numpy()
  everyone = np.array([[r + 2.0, 0.0 if r == 0 else r + 2.0,
                        0.0 if r < 2 else r + 2.0] for r in range(SIZE)])
  want = [S * np.prod(np.delete(everyone[:, c], RANK)) for c in range(3)]
  np.testing.assert_allclose(g, want)


@pytest.mark.parametrize("mode", MODES)
def test_allgather_gradient(mode):
  rows = RANK + 1
  x = tf.Variable(tf.ones([rows, 2]))
  total_rows = SIZE * (SIZE + 1) // 2
  weights = tf.constant(
      np.arange(1, total_rows + 1, dtype=np.float32)[:, None] * (RANK + 1)
      * np.ones([1, 2], np.float32))

  def grad():
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(ops.allgather(x) * weights)
    return tape.gradient(loss, x)

  g = run(mode, grad).numpy()
  offset = sum(r + 1 for r in range(RANK))
  want = (np.arange(offset + 1, offset + rows + 1)[:, None] * S
          * np.ones([1, 2]))
  np.testing.assert_allclose(g, want)


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_gradient(mode):
  x = tf.Variable(tf.fill([3], float(RANK)))
  root = SIZE - 1

  def grad():
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(ops.broadcast(x, root_rank=root) * (RANK + 1))
    return tape.gradient(loss, x)

  g = run(mode, grad).numpy()
  np.testing.assert_allclose(g, np.full([3], S if RANK == root else 0.0))


def test_allreduce_gradient_through_gather_is_densified():
  # tf.gather's gradient is a tf.IndexedSlices.
  x = tf.Variable(tf.ones([4, 2]))
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(tf.gather(ops.allreduce(x), [1, 3])) * (RANK + 1)
  g = tf.convert_to_tensor(tape.gradient(loss, x)).numpy()
  np.testing.assert_allclose(g, [[0, 0], [S, S], [0, 0], [S, S]])


def test_grouped_allreduce_gradient():
  a = tf.Variable([1.0, 2.0])
  b = tf.Variable([[3.0]])
  with tf.GradientTape() as tape:
    ya, yb = ops.grouped_allreduce([a, b])
    loss = tf.reduce_sum(ya) * (RANK + 1) + tf.reduce_sum(yb)
  ga, gb = tape.gradient(loss, [a, b])
  np.testing.assert_allclose(ga.numpy(), [S, S])
  np.testing.assert_allclose(gb.numpy(), [[SIZE]])


def test_reducescatter_and_alltoall_gradients():
  x = tf.Variable(tf.ones([2 * SIZE, 2]))
  with tf.GradientTape(persistent=True) as tape:
    rs = tf.reduce_sum(ops.reducescatter(x)) * (RANK + 1)
    at = tf.reduce_sum(ops.alltoall(x)[0] * (RANK + 1))
  g_rs = tape.gradient(rs, x).numpy()
  g_at = tape.gradient(at, x).numpy()
  # Row block d of every rank's input feeds rank d's loss, weighted d + 1.
  want = np.repeat(np.arange(1, SIZE + 1, dtype=np.float32), 2)[:, None] * \
      np.ones([1, 2])
  np.testing.assert_allclose(g_rs, want)
  np.testing.assert_allclose(g_at, want)


# ------------------------------------------------- init / shutdown / re-init


def test_shutdown_and_reinit():
  @tf.function
  def fn(x):
    return ops.allreduce(x, name="reinit/x")

  assert fn(tf.ones([2])).numpy().tolist() == [SIZE, SIZE]
  options = mpistrategy.current_options()
  mpistrategy.shutdown()
  assert not mpistrategy.is_initialized()
  assert mpistrategy.current_options() is None
  # A function traced earlier does not re-initialize: its kernel reports it.
  with pytest.raises(tf.errors.FailedPreconditionError,
                     match="not initialized"):
    fn(tf.ones([2]))
  mpistrategy.init(options)
  assert mpistrategy.is_initialized()
  assert (mpistrategy.rank(), mpistrategy.size()) == (RANK, SIZE)
  assert fn(tf.ones([2])).numpy().tolist() == [SIZE, SIZE]
  y = ops.allreduce(tf.constant(RANK + 1))
  assert y.numpy() == S


def test_init_twice_is_noop_and_different_options_rejected():
  options = mpistrategy.current_options()
  mpistrategy.init(options)  # same options: no-op
  assert mpistrategy.is_initialized()
  with pytest.raises(ValueError, match="cycle_time_ms"):
    mpistrategy.init(options.replace(cycle_time_ms=options.cycle_time_ms + 1))
  assert ops.allreduce(tf.constant(1)).numpy() == SIZE


def test_shutdown_reinit_with_new_options():
  options = mpistrategy.current_options()
  mpistrategy.shutdown()
  mpistrategy.init(options.replace(fusion_threshold_bytes=1024,
                                   cache_capacity=0))
  try:
    assert mpistrategy.current_options().fusion_threshold_bytes == 1024
    ys = ops.grouped_allreduce([tf.fill([300], float(RANK))] * 8)
    for y in ys:
      np.testing.assert_array_equal(y.numpy(),
                                    np.full([300], sum(range(SIZE))))
  finally:
    mpistrategy.shutdown()
    mpistrategy.init(options)
  assert ops.allreduce(tf.constant(2)).numpy() == 2 * SIZE


def test_an_error_code_reports_through_excepthook_ends_nothing(capfd):
  # h5py's destructors report a failed write through sys.excepthook, also
  # after the caller caught that write's OSError; the abort-on-exception
  # hook took it for an uncaught exception and ended the job.
  if SIZE > 1:
    assert sys.excepthook.__name__ == "_abort_on_exception"
  if RANK == 0:
    try:
      raise RuntimeError("reported by a library, which goes on")
    except RuntimeError as e:
      sys.excepthook(type(e), e, e.__traceback__)
    assert "reported by a library" in capfd.readouterr().err
  ops.barrier(name="excepthook/after")


def test_world_queries_after_shutdown_start_no_engine():
  # rank() started a new engine after shutdown(), which is collective:
  # called on one rank only, it waited in that start for ever.
  previous = mpistrategy.current_options()
  mpistrategy.shutdown()
  try:
    if RANK == SIZE - 1:
      assert mpistrategy.rank() == RANK
      assert mpistrategy.size() == SIZE
      assert 0 <= mpistrategy.local_rank() < mpistrategy.local_size()
    assert not mpistrategy.is_initialized()
  finally:
    mpistrategy.init(previous)
  ops.barrier(name="world_queries/after")
