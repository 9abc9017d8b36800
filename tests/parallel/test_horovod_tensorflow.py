"""mpistrategy.horovod.tensorflow under mpirun: Horovod's API, closed forms.

    tests/mpirun_pytest.sh 2 900 tests/parallel/test_horovod_tensorflow.py
    tests/mpirun_pytest.sh 3 900 tests/parallel/test_horovod_tensorflow.py

Each rank builds its input from its rank and checks the result against the
value computed from every rank's input (Horovod's semantics: allreduce
averages by default, alltoall returns int32 received splits, ...).
"""

import importlib
import os

import numpy as np
import pytest
import tensorflow as tf
import keras

import mpistrategy
import mpistrategy.horovod.tensorflow as hvd

RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK",
                          os.environ.get("PMI_RANK", "0")))
SIZE = int(os.environ.get("OMPI_COMM_WORLD_SIZE",
                          os.environ.get("PMI_SIZE", "1")))
S = SIZE * (SIZE + 1) / 2  # sum over ranks of (rank + 1)
MODES = ["eager", "function"]


@pytest.fixture(autouse=True, scope="module")
def _initialized():
  hvd.init()
  yield


def run(mode, fn, *args):
  """Calls `fn(*args)` eagerly or inside a tf.function."""
  if mode == "eager":
    return fn(*args)
  return tf.function(fn)(*args)


# --- process control ---------------------------------------------------------


def test_init_in_a_tf1_graph():
  # Horovod's tests call init() under tf.Graph().as_default() and after
  # disable_eager_execution(); the topology needs no TF op.
  with tf.Graph().as_default():
    hvd.init()
    assert (hvd.rank(), hvd.size(), hvd.cross_size()) == (RANK, SIZE, 1)


def test_rank_size_and_topology():
  assert hvd.is_initialized()
  assert (hvd.rank(), hvd.size()) == (RANK, SIZE)
  # mpirun_pytest.sh runs every rank on this host.
  assert (hvd.local_rank(), hvd.local_size()) == (RANK, SIZE)
  assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
  assert hvd.is_homogeneous()
  for op, value in ((hvd.rank_op, RANK), (hvd.size_op, SIZE),
                    (hvd.local_rank_op, RANK), (hvd.local_size_op, SIZE)):
    t = op()
    assert t.dtype == tf.int32 and int(t) == value
  assert int(hvd.process_set_included_op()) == 1
  assert hvd.global_process_set.size() == SIZE
  assert hvd.global_process_set.ranks == list(range(SIZE))


def test_build_queries():
  assert hvd.mpi_enabled() and hvd.mpi_built()
  assert not hvd.gloo_enabled() and not hvd.gloo_built()
  assert not hvd.ddl_built() and not hvd.ccl_built() and not hvd.rocm_built()
  assert hvd.nccl_built() in (True, False)
  assert hvd.cuda_built() in (True, False)
  assert hvd.mpi_threads_supported() in (True, False)


def test_init_is_idempotent_and_accepts_the_world():
  hvd.init()
  hvd.init(comm=list(range(SIZE)))
  assert hvd.size() == SIZE


# --- allreduce ---------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [tf.float16, tf.float32, tf.float64])
def test_allreduce_defaults_to_average(mode, dtype):
  x = tf.fill([3, 4], tf.cast(RANK + 1, dtype))
  out = run(mode, hvd.allreduce, x)
  assert out.dtype == dtype
  np.testing.assert_allclose(out.numpy().astype(np.float64), S / SIZE,
                             rtol=1e-3)


@pytest.mark.parametrize("dtype", [tf.int32, tf.int64, tf.uint8])
def test_allreduce_average_of_integers_truncates(dtype):
  x = tf.constant([RANK + 1, 7 * (RANK + 1)], dtype)
  out = hvd.allreduce(x)
  assert out.dtype == dtype
  np.testing.assert_array_equal(out.numpy(), [int(S) // SIZE,
                                              int(7 * S) // SIZE])


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_ops(mode):
  x = tf.constant([RANK + 1.0, -(RANK + 1.0)])
  ranks = np.arange(1, SIZE + 1, dtype=np.float64)
  expected = {
      hvd.Sum: [S, -S],
      hvd.Min: [1.0, -SIZE],
      hvd.Max: [SIZE, -1.0],
      hvd.Product: [np.prod(ranks), np.prod(-ranks)],
  }
  for op, want in expected.items():
    out = run(mode, lambda t, op=op: hvd.allreduce(t, op=op), x)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6)


def test_allreduce_deprecated_average_argument():
  x = tf.constant([RANK + 1.0])
  np.testing.assert_allclose(hvd.allreduce(x, average=False).numpy(), [S])
  np.testing.assert_allclose(hvd.allreduce(x, average=True).numpy(),
                             [S / SIZE])
  with pytest.raises(ValueError, match="mutually exclusive"):
    hvd.allreduce(x, average=True, op=hvd.Sum)


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_prescale_postscale(mode):
  x = tf.constant([RANK + 1.0, 2.0])
  out = run(mode, lambda t: hvd.allreduce(
      t, op=hvd.Sum, prescale_factor=3.0, postscale_factor=0.5), x)
  np.testing.assert_allclose(out.numpy(), [1.5 * S, 1.5 * 2 * SIZE])
  out = hvd.allreduce(x, prescale_factor=2.0)  # Average
  np.testing.assert_allclose(out.numpy(), [2 * S / SIZE, 4.0])
  ints = hvd.allreduce(tf.constant([RANK + 1]), op=hvd.Sum,
                       postscale_factor=0.5)
  assert ints.dtype == tf.int32 and int(ints[0]) == int(S * 0.5)


def test_allreduce_fp16_compression():
  x = tf.fill([1000], tf.constant(RANK + 1.0) / 3.0)
  out = hvd.allreduce(x, compression=hvd.Compression.fp16)
  assert out.dtype == tf.float32
  np.testing.assert_allclose(out.numpy(), S / SIZE / 3.0, rtol=2e-3)


def test_allreduce_horovod_style_compressor_class():
  calls = []

  class ToFloat64(hvd.Compressor):  # Horovod's pattern: static methods
    @staticmethod
    def compress(tensor):
      calls.append("compress")
      return tf.cast(tensor, tf.float64), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
      calls.append("decompress")
      return tf.cast(tensor, ctx)

  out = hvd.allreduce(tf.constant([RANK + 1.0]), op=hvd.Sum,
                      compression=ToFloat64)
  assert out.dtype == tf.float32 and float(out[0]) == S
  assert calls == ["compress", "decompress"]


def _slices(rank):
  rows = rank + 1
  values = tf.fill([rows, 3], float(rank + 1))
  indices = tf.range(rows, dtype=tf.int64) + rank
  return tf.IndexedSlices(values, indices, dense_shape=tf.constant([10, 3],
                                                                    tf.int64))


@pytest.mark.parametrize("op", [hvd.Average, hvd.Sum])
def test_allreduce_indexed_slices_allgathers(op):
  out = hvd.allreduce(_slices(RANK), op=op)
  assert isinstance(out, tf.IndexedSlices)
  values = np.concatenate([np.full([r + 1, 3], r + 1.0) for r in range(SIZE)])
  indices = np.concatenate([np.arange(r + 1) + r for r in range(SIZE)])
  if op == hvd.Average:
    values = values / SIZE
  np.testing.assert_allclose(out.values.numpy(), values)
  np.testing.assert_array_equal(out.indices.numpy(), indices)
  np.testing.assert_array_equal(out.dense_shape.numpy(), [10, 3])
  # The dense view equals the reduction of the dense tensors.
  dense = tf.convert_to_tensor(out).numpy()
  want = sum(tf.convert_to_tensor(_slices(r)).numpy() for r in range(SIZE))
  np.testing.assert_allclose(dense, want / (SIZE if op == hvd.Average else 1))


def test_allreduce_indexed_slices_refuses_min_and_scaling():
  with pytest.raises(NotImplementedError, match="IndexedSlices"):
    hvd.allreduce(_slices(RANK), op=hvd.Min)
  # Horovod refuses these rather than ignore them.
  for kwargs in ({"prescale_factor": 2.0}, {"postscale_factor": 0.5}):
    with pytest.raises(NotImplementedError, match="postscale_factor"):
      hvd.allreduce(_slices(RANK), **kwargs)
    with pytest.raises(NotImplementedError, match="postscale_factor"):
      hvd.grouped_allreduce([_slices(RANK)], **kwargs)


def test_allreduce_indexed_slices_average_of_integers():
  # As Horovod: values / size, a true division (float64 for int32), so that
  # the dense view is the mean of the ranks' dense tensors.
  ones = tf.IndexedSlices(tf.constant([1], tf.int32),
                          tf.constant([0], tf.int64),
                          tf.constant([4], tf.int64))
  out = hvd.allreduce(ones, op=hvd.Average)
  assert out.values.dtype == tf.float64
  np.testing.assert_allclose(tf.convert_to_tensor(out).numpy(),
                             [1.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_16_bit_average_sums_then_scales_in_float32(dtype):
  # Horovod's float16 Average: the sum, then times 1/size in float32
  # (its test_horovod_allreduce_average_cpu asserts this exactly at np 3).
  x = tf.cast(tf.constant(np.random.RandomState(RANK).uniform(
      -10, 10, 4000).astype(np.float32)), dtype)
  total = hvd.allreduce(x, op=hvd.Sum)
  want = tf.cast(tf.cast(total, tf.float32) * np.float32(1.0 / SIZE), dtype)
  np.testing.assert_array_equal(hvd.allreduce(x).numpy(), want.numpy())
  [grouped] = hvd.grouped_allreduce([x])
  np.testing.assert_array_equal(grouped.numpy(), want.numpy())


def test_broadcast_gradient_in_a_tf1_session():
  # The non-root ranks' gradient must still run the allreduce the root
  # waits in (a constant zero would be pruned from the session's graph).
  with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [3])
    y = hvd.broadcast(x, root_rank=0)
    [grad] = tf.gradients(tf.reduce_sum(y), [x])
    with tf.compat.v1.Session() as session:
      got = session.run(grad, {x: np.ones(3, np.float32)})
  np.testing.assert_allclose(got, [1.0] * 3 if RANK == 0 else [0.0] * 3)


def test_fp16_scaling_in_float32():
  # Horovod scales 16-bit floats in float32: one rounding, not two.
  x = tf.constant(np.linspace(-3, 3, 289), tf.float16)
  out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=1.0 / 3,
                      postscale_factor=0.7)
  want = (x.numpy().astype(np.float32) * np.float32(1.0 / 3)).astype(
      np.float16).astype(np.float32) * SIZE
  want = (want.astype(np.float16).astype(np.float32) *
          np.float32(0.7)).astype(np.float16)
  np.testing.assert_array_equal(out.numpy(), want)


def test_allreduce_refuses_adasum_process_sets_devices():
  x = tf.constant([1.0])
  with pytest.raises(NotImplementedError, match="Adasum"):
    hvd.allreduce(x, op=hvd.Adasum)
  with pytest.raises(NotImplementedError, match="process set") as raised:
    hvd.allreduce(x, process_set=hvd.ProcessSet([0]) if SIZE > 1 else "x")
  if SIZE > 1:  # the message shows the set's ranks, not the global set's
    assert "ranks=[0]" in str(raised.value), str(raised.value)
    assert hvd.ProcessSet([0]).process_set_id is None
  assert repr(hvd.global_process_set) == (
      "ProcessSet(process_set_id=0, ranks=all)")
  from mpi4py import MPI  # pylint: disable=import-outside-toplevel
  with pytest.raises(NotImplementedError,
                     match=r"ProcessSet\(Intracomm\): process sets from an "
                     "MPI communicator are not provided"):
    hvd.ProcessSet(MPI.COMM_WORLD)  # Horovod's process_set.rst, pattern 2
  with pytest.raises(NotImplementedError, match="device_dense"):
    hvd.allreduce(x, device_dense="/gpu:0")
  with pytest.raises(ValueError, match="bool"):
    hvd.allreduce(tf.constant([True]))


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allreduce(mode):
  def fn(a, b, c):
    return hvd.grouped_allreduce([a, b, c])
  a = tf.constant([RANK + 1.0, 1.0])
  b = tf.fill([2, 2], tf.constant(2.0 * (RANK + 1), tf.float64))
  c = tf.constant([3 * (RANK + 1)], tf.int64)
  out = run(mode, fn, a, b, c)
  np.testing.assert_allclose(out[0].numpy(), [S / SIZE, 1.0])
  assert out[1].dtype == tf.float64
  np.testing.assert_allclose(out[1].numpy(), np.full([2, 2], 2 * S / SIZE))
  assert out[2].dtype == tf.int64 and int(out[2][0]) == int(3 * S) // SIZE
  summed = hvd.grouped_allreduce([a, _slices(RANK)], op=hvd.Sum)
  np.testing.assert_allclose(summed[0].numpy(), [S, SIZE])
  assert isinstance(summed[1], tf.IndexedSlices)
  assert summed[1].values.shape[0] == S


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("others", [1, 2])
def test_grouped_allreduce_of_an_empty_list_on_one_rank_fails_everywhere(
    mode, others):
  # Horovod's grouped_allreduce([]) is a collective too; a group of one
  # must not travel as a plain allreduce that the empty group never meets.
  if SIZE == 1:
    pytest.skip("needs two ranks")
  last = SIZE - 1
  def call():
    group = [] if RANK == last else [tf.ones([3])] * others
    return hvd.grouped_allreduce(group, name=f"hvd/empty/{mode}/{others}")
  with pytest.raises(tf.errors.FailedPreconditionError,
                     match=f"rank 0 has a group of {others} tensors? but "
                     f"rank {last} has a group of 0 tensors"):
    run(mode, call)
  assert run(mode, lambda: hvd.grouped_allreduce(
      [], name=f"hvd/all-empty/{mode}/{others}")) == []


# --- allgather, broadcast ---------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_allgather_and_grouped_allgather(mode):
  x = tf.fill([RANK + 1, 2], RANK)
  want = np.concatenate([np.full([r + 1, 2], r) for r in range(SIZE)])
  np.testing.assert_array_equal(run(mode, hvd.allgather, x).numpy(), want)
  out = run(mode, lambda a, b: hvd.grouped_allgather([a, b]), x,
            tf.constant([float(RANK)]))
  np.testing.assert_array_equal(out[0].numpy(), want)
  np.testing.assert_array_equal(out[1].numpy(), np.arange(SIZE))


@pytest.mark.parametrize("mode", MODES)
def test_broadcast(mode):
  root = SIZE - 1
  out = run(mode, lambda t: hvd.broadcast(t, root), tf.fill([3], RANK))
  np.testing.assert_array_equal(out.numpy(), [root] * 3)


def test_broadcast_in_place():
  a = tf.Variable([float(RANK), 1.0])
  b = tf.Variable(RANK * 10)
  values = hvd.broadcast_([a, b], root_rank=SIZE - 1)
  np.testing.assert_array_equal(a.numpy(), [SIZE - 1.0, 1.0])
  assert int(b.numpy()) == (SIZE - 1) * 10
  assert len(values) == 2
  c = tf.Variable([RANK])
  single = hvd.broadcast_(c, 0)
  assert int(single[0]) == 0 and int(c[0]) == 0


def test_broadcast_in_place_in_a_tf1_session():
  # Horovod's test_horovod_broadcast_inplace_cpu, graph half: running the
  # returned tensors assigns the variables.
  with tf.Graph().as_default():
    v = tf.compat.v1.Variable([float(RANK)] * 2, use_resource=True)
    values = hvd.broadcast_([v], root_rank=SIZE - 1)
    with tf.compat.v1.Session() as session:
      session.run(v.initializer)
      np.testing.assert_array_equal(session.run(values)[0], [SIZE - 1.0] * 2)
      np.testing.assert_array_equal(session.run(v), [SIZE - 1.0] * 2)


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_variables(mode):
  vs = [tf.Variable(tf.fill([2, 3], float(RANK))),
        tf.Variable(RANK, dtype=tf.int64)]

  def fn():
    hvd.broadcast_variables(vs, root_rank=0)  # a tf.Operation in a graph

  run(mode, fn)
  np.testing.assert_array_equal(vs[0].numpy(), np.zeros([2, 3]))
  assert int(vs[1].numpy()) == 0


def test_broadcast_and_allgather_objects():
  obj = {"rank": RANK, "payload": list(range(RANK * 100))}
  got = hvd.broadcast_object(obj, root_rank=SIZE - 1)
  assert got == {"rank": SIZE - 1, "payload": list(range((SIZE - 1) * 100))}
  fn = hvd.broadcast_object_fn(root_rank=0)
  assert fn(("x", RANK)) == ("x", 0)
  everyone = hvd.allgather_object({"r": RANK, "s": "x" * RANK})
  assert everyone == [{"r": r, "s": "x" * r} for r in range(SIZE)]


@pytest.mark.timeout(120)
def test_object_collectives_in_threads_keep_their_objects():
  # Their internal names ("broadcast_object/length") took no thread prefix:
  # a thread received another thread's object.
  import threading  # pylint: disable=g-import-not-at-top
  results = {}

  def work(t):
    with mpistrategy.collective_names(f"thread{t}"):
      results[t] = [
          (hvd.broadcast_object({"t": t, "k": k, "from": RANK}, root_rank=0),
           hvd.allgather_object((t, RANK)))
          for k in range(10)]

  threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(100)
  for t in range(3):
    assert results[t] == [({"t": t, "k": k, "from": 0},
                           [(t, r) for r in range(SIZE)])
                          for k in range(10)], t


@pytest.mark.timeout(120)
def test_unnamed_calls_outside_the_main_thread_name_the_horovod_call():
  # They used to name mpistrategy.ops.<op> and suggest name= to a call that
  # takes none (hvd.barrier); hvd.broadcast_object's own default name went
  # through unchecked and paired with any other unprefixed thread's.
  import threading  # pylint: disable=g-import-not-at-top
  errors, results = {}, {}
  calls = {
      "hvd.barrier": hvd.barrier,
      "hvd.broadcast_variables": lambda: hvd.broadcast_variables(
          [tf.Variable(1.0)], root_rank=0),
      "hvd.broadcast_object": lambda: hvd.broadcast_object(RANK),
      "hvd.allgather_object": lambda: hvd.allgather_object(RANK),
      "hvd.allreduce": lambda: hvd.allreduce(tf.ones([2])),
      "hvd.grouped_allreduce": lambda: hvd.grouped_allreduce([tf.ones([2])]),
      "hvd.allgather": lambda: hvd.allgather(tf.ones([1])),
      "hvd.broadcast": lambda: hvd.broadcast(tf.ones([1]), root_rank=0),
      "hvd.reducescatter": lambda: hvd.reducescatter(tf.ones([SIZE])),
  }

  def work():
    for call, fn in calls.items():
      try:
        fn()
        errors[call] = None
      except ValueError as e:
        errors[call] = str(e)
    results["named"] = hvd.broadcast_object(RANK, name="worker/object")

  thread = threading.Thread(target=work, name="hvd-worker")
  thread.start()
  thread.join(100)
  for call in calls:
    error = errors[call]
    assert error is not None and error.startswith(f"{call}: "), (call, error)
    assert "'hvd-worker'" in error and "collective_names" in error, error
    takes_name = call not in ("hvd.barrier", "hvd.broadcast_variables")
    assert (f"pass name= to {call}," in error) == takes_name, error
  assert results["named"] == 0


# --- alltoall, reducescatter, barrier ----------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_alltoall_returns_received_splits(mode):
  # Rank r sends j + 1 rows of value 100 r + j to rank j.
  splits = [j + 1 for j in range(SIZE)]
  rows = np.concatenate([np.full([j + 1, 2], 100 * RANK + j)
                         for j in range(SIZE)]).astype(np.int32)
  out, received = run(mode, lambda t, s: hvd.alltoall(t, splits=s),
                      tf.constant(rows), tf.constant(splits, tf.int32))
  want = np.concatenate([np.full([RANK + 1, 2], 100 * i + RANK)
                         for i in range(SIZE)])
  np.testing.assert_array_equal(out.numpy(), want)
  assert received.dtype == tf.int32
  np.testing.assert_array_equal(received.numpy(), [RANK + 1] * SIZE)
  # Without splits Horovod returns the tensor alone.
  even = run(mode, hvd.alltoall, tf.fill([SIZE], RANK))
  assert isinstance(even, tf.Tensor)
  np.testing.assert_array_equal(even.numpy(), np.arange(SIZE))


@pytest.mark.parametrize("mode", MODES)
def test_gradients_of_collectives_are_horovods(mode):
  # Horovod's gradient functions (horovod/tensorflow/mpi_ops.py): allgather
  # and broadcast average the upstream gradients, reducescatter multiplies
  # them by the size (Sum) or passes them on (Average); loss = sum(output)
  # on every rank.
  def grads(x):
    with tf.GradientTape(persistent=True) as tape:
      tape.watch(x)
      rows = tf.tile(x, [SIZE])  # x appears SIZE times in the input
      outs = [hvd.allgather(x), hvd.grouped_allgather([x])[0],
              hvd.broadcast(x, root_rank=0),
              hvd.reducescatter(rows, op=hvd.Sum),
              hvd.reducescatter(rows, op=hvd.Average),
              hvd.grouped_reducescatter([rows], op=hvd.Sum)[0]]
      losses = [tf.reduce_sum(o) for o in outs]
    return [tape.gradient(loss, x) for loss in losses]

  got = [g.numpy() for g in run(mode, grads, tf.ones([2]))]
  ones = np.ones(2, np.float32)
  np.testing.assert_allclose(got[0], ones)   # the mean over ranks of 1
  np.testing.assert_allclose(got[1], ones)
  np.testing.assert_allclose(got[2], ones if RANK == 0 else 0 * ones)
  np.testing.assert_allclose(got[3], SIZE * SIZE * ones)
  np.testing.assert_allclose(got[4], SIZE * ones)
  np.testing.assert_allclose(got[5], SIZE * SIZE * ones)


def _block(rank, n):
  rows = n // SIZE + (1 if rank < n % SIZE else 0)
  start = rank * (n // SIZE) + min(rank, n % SIZE)
  return start, rows


@pytest.mark.parametrize("mode", MODES)
def test_reducescatter_defaults_to_average(mode):
  n = 2 * SIZE + 1
  x = tf.fill([n, 2], RANK + 1.0)
  out = run(mode, hvd.reducescatter, x)
  _, rows = _block(RANK, n)
  np.testing.assert_allclose(out.numpy(), np.full([rows, 2], S / SIZE))
  summed = run(mode, lambda t: hvd.reducescatter(t, op=hvd.Sum,
                                                 postscale_factor=2.0), x)
  np.testing.assert_allclose(summed.numpy(), np.full([rows, 2], 2 * S))
  with pytest.raises(ValueError, match="op"):
    hvd.reducescatter(x, op=hvd.Max)


def test_grouped_reducescatter():
  a = tf.reshape(tf.range(2 * SIZE, dtype=tf.float32), [2 * SIZE, 1]) * (
      RANK + 1)
  b = tf.fill([SIZE, 3], RANK + 1)
  out = hvd.grouped_reducescatter([a, b], op=hvd.Sum)
  start, rows = _block(RANK, 2 * SIZE)
  np.testing.assert_allclose(out[0].numpy()[:, 0],
                             np.arange(start, start + rows) * S)
  np.testing.assert_array_equal(out[1].numpy(), np.full([1, 3], int(S)))
  avg = hvd.grouped_reducescatter([b])  # integer Average truncates
  np.testing.assert_array_equal(avg[0].numpy(), np.full([1, 3],
                                                        int(S) // SIZE))


def test_barrier():
  hvd.barrier()

  @tf.function
  def in_graph():
    hvd.barrier()  # a tf.Operation in a graph

  in_graph()


# --- not provided -------------------------------------------------------------


def test_unsupported_features_raise():
  cases = [
      (hvd.join, (), "join"),
      (hvd.add_process_set, ([0],), "process set"),
      (hvd.remove_process_set, (None,), "process set"),
      (hvd.broadcast_global_variables, (0,), "broadcast_variables"),
      (hvd.SyncBatchNormalization, (), "synchronized=True"),
      (hvd.BroadcastGlobalVariablesHook, (0,), "broadcast_variables"),
      (hvd.elastic.run, (lambda: None,), "elastic"),
      (hvd.elastic.TensorFlowKerasState, (None,), "elastic"),
      (hvd.init, (None, [hvd.ProcessSet([0])]), "process sets"),
  ]
  import mpistrategy.horovod as horovod
  cases.append((horovod.run, (lambda: None,), "mpirun"))
  for fn, args, words in cases:
    with pytest.raises(NotImplementedError, match=words):
      fn(*args)
  if SIZE > 1:
    with pytest.raises(NotImplementedError, match="comm"):
      hvd.init(comm=[0])
  with pytest.raises(NotImplementedError, match="process_set_id"):
    hvd.size_op(process_set_id=1)
  with pytest.raises(NotImplementedError, match="TF1 optimizers"):
    hvd.DistributedOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1))


def test_data_service_import_says_it_is_not_provided():
  # Horovod's data-service examples import horovod.tensorflow.data.*: the
  # migrated import must fail naming the feature, not ModuleNotFoundError.
  with pytest.raises(NotImplementedError, match="tf.data service"):
    import mpistrategy.horovod.tensorflow.data.compute_service  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import


@pytest.mark.parametrize("module, says", [
    ("mpistrategy.horovod.tensorflow.elastic", "--restarts"),
    ("mpistrategy.horovod.tensorflow.keras.elastic", "--restarts"),
    ("mpistrategy.horovod.runner.common.util.env", "horovodrun"),
    ("mpistrategy.horovod.spark", "Spark"),
    ("mpistrategy.horovod.ray", "Ray")])
def test_horovod_modules_not_provided_say_so_at_import(module, says):
  # Horovod's elastic and data-service examples import these.
  with pytest.raises(NotImplementedError, match=says):
    importlib.import_module(module)
  # hvd.elastic itself stays an attribute whose names refuse when called.
  with pytest.raises(NotImplementedError, match="--restarts"):
    hvd.elastic.run(lambda state: None)


# --- DistributedGradientTape --------------------------------------------------


def _local_x():
  return tf.constant([[RANK + 1.0, 2.0 * (RANK + 1)]])


def _mean_x():
  return np.array([S / SIZE, 2 * S / SIZE])


@pytest.mark.parametrize("mode", MODES)
def test_gradient_tape_averages(mode):
  w = tf.Variable([[1.0], [1.0]])
  b = tf.Variable([0.5])

  def step(tape_kwargs):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.matmul(_local_x(), w) + b)
    tape = hvd.DistributedGradientTape(tape, **tape_kwargs)
    return tape.gradient(loss, [w, b])

  gw, gb = run(mode, lambda: step({}))
  np.testing.assert_allclose(gw.numpy()[:, 0], _mean_x())
  np.testing.assert_allclose(gb.numpy(), [1.0])
  gw, gb = run(mode, lambda: step({"op": hvd.Sum}))
  np.testing.assert_allclose(gw.numpy()[:, 0], _mean_x() * SIZE)
  np.testing.assert_allclose(gb.numpy(), [SIZE])
  for kwargs in ({"gradient_predivide_factor": 2.0}, {"num_groups": 2},
                 {"groups": [[w], [b]]},
                 {"compression": hvd.Compression.fp16}):
    gw, gb = run(mode, lambda kwargs=kwargs: step(kwargs))
    np.testing.assert_allclose(gw.numpy()[:, 0], _mean_x(), rtol=1e-3)
    np.testing.assert_allclose(gb.numpy(), [1.0], rtol=1e-3)


def test_gradient_tape_keeps_structure_and_none():
  w = tf.Variable(2.0)
  unused = tf.Variable(1.0)
  with tf.GradientTape() as tape:
    loss = w * (RANK + 1)
  tape = hvd.DistributedGradientTape(tape)
  assert isinstance(tape, tf.GradientTape)
  grads = tape.gradient(loss, {"w": w, "unused": unused})
  assert grads["unused"] is None
  np.testing.assert_allclose(grads["w"].numpy(), S / SIZE)
  with pytest.raises(ValueError, match="predivide"):
    hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Sum,
                                gradient_predivide_factor=2.0)


def test_gradient_tape_wrapping_before_the_forward_pass():
  w = tf.Variable(3.0)
  with hvd.DistributedGradientTape(tf.GradientTape()) as tape:
    loss = w * w * (RANK + 1)
  np.testing.assert_allclose(tape.gradient(loss, w).numpy(), 6.0 * S / SIZE)


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_gradient_tape_embedding_gradients(sparse_as_dense):
  table = tf.Variable(tf.zeros([SIZE + 1, 2]))
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(tf.gather(table, [RANK, RANK + 1]))
  tape = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
  [grad] = tape.gradient(loss, [table])
  assert isinstance(grad, tf.IndexedSlices) != sparse_as_dense
  want = np.zeros([SIZE + 1, 2])
  for r in range(SIZE):
    want[[r, r + 1]] += 1.0 / SIZE
  np.testing.assert_allclose(tf.convert_to_tensor(grad).numpy(), want,
                             rtol=1e-6)


def test_partial_gradient_tape_keeps_local_layers_local():
  shared = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
  local = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
  x = _local_x()
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(shared(x)) + tf.reduce_sum(local(x))
  tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local])
  g_shared, g_local = tape.gradient(
      loss, [shared.kernel, local.kernel])
  np.testing.assert_allclose(g_shared.numpy()[:, 0], _mean_x())
  # Local gradients are this rank's own, divided by size (Horovod's
  # scale_local_gradients=True).
  np.testing.assert_allclose(g_local.numpy()[:, 0],
                             x.numpy()[0] / SIZE)


# --- DistributedOptimizer (custom loop) --------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_distributed_optimizer_apply_gradients(mode):
  w = tf.Variable([1.0, 1.0])
  opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0))
  assert isinstance(opt, keras.optimizers.SGD)
  g = tf.constant([RANK + 1.0, 1.0])
  run(mode, lambda: opt.apply_gradients([(g, w)]))
  np.testing.assert_allclose(w.numpy(), [1.0 - S / SIZE, 0.0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("average_aggregated", [False, True])
def test_distributed_optimizer_backward_passes(mode, average_aggregated):
  w = tf.Variable([0.0])
  opt = hvd.DistributedOptimizer(
      keras.optimizers.SGD(1.0), backward_passes_per_step=2,
      average_aggregated_gradients=average_aggregated)
  step = (lambda g: opt.apply([g], [w])) if mode == "eager" else tf.function(
      lambda g: opt.apply([g], [w]))
  step(tf.constant([RANK + 1.0]))
  np.testing.assert_allclose(w.numpy(), [0.0])  # aggregated, not applied
  assert int(opt.iterations.numpy()) == 1
  step(tf.constant([10.0 * (RANK + 1)]))
  total = 11.0 * S / SIZE / (2 if average_aggregated else 1)
  np.testing.assert_allclose(w.numpy(), [-total], rtol=1e-6)
  assert int(opt.iterations.numpy()) == 2
  step(tf.constant([1.0]))  # the aggregate restarted from zero
  np.testing.assert_allclose(w.numpy(), [-total], rtol=1e-6)
  step(tf.constant([1.0]))
  np.testing.assert_allclose(
      w.numpy(), [-total - 2.0 / (2 if average_aggregated else 1)],
      rtol=1e-6)
  # The aggregation variables are not optimizer state (never broadcast).
  assert len(opt.variables) == len(keras.optimizers.SGD(1.0).variables) or (
      all("hvd" not in v.path for v in opt.variables))


def test_distributed_optimizer_arguments():
  with pytest.raises(ValueError, match="backward_passes_per_step"):
    hvd.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=0)
  with pytest.raises(ValueError, match="already distributed"):
    hvd.DistributedOptimizer(hvd.DistributedOptimizer(keras.optimizers.SGD()))
  with pytest.raises(TypeError, match="Keras optimizer"):
    hvd.DistributedOptimizer("sgd")
  plain = keras.optimizers.Adam(0.5, name="my_adam")
  opt = hvd.PartialDistributedOptimizer(plain, local_layers=[])
  assert float(opt.learning_rate.numpy()) == 0.5
  assert opt.name == "my_adam"  # checkpoint paths do not change


def test_optimizer_variables_is_callable_for_horovod_scripts():
  opt = keras.optimizers.Adam()
  opt.build([tf.Variable([1.0])])
  assert opt.variables() == opt.variables
  assert isinstance(opt.variables, list)


# --- Horovod's tuning variables (restart the engine) -----------------------


@pytest.fixture()
def restarts_the_engine():
  # Listed before monkeypatch: the restart comes after the variables are
  # put back.
  yield
  if mpistrategy.is_initialized():
    mpistrategy.shutdown()
  hvd.init()


@pytest.mark.parametrize("first", ["hvd.init", "MPIStrategy"])
def test_horovod_variables_apply_however_the_engine_starts(
    restarts_the_engine, monkeypatch, first):
  # Horovod job scripts set these; a script that creates its MPIStrategy
  # before hvd.init() must get them too, not a conflict.
  monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1000000")
  monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "17")
  monkeypatch.setenv("HOROVOD_CYCLE_TIME", "3.5")
  monkeypatch.setenv("MPISTRATEGY_CYCLE_TIME_MS", "2.5")  # wins
  mpistrategy.shutdown()
  if first == "MPIStrategy":
    mpistrategy.MPIStrategy()
  hvd.init()
  running = mpistrategy.runtime.current_options()
  assert running.fusion_threshold_bytes == 1000000
  assert running.stall_warning_seconds == 17.0
  assert running.cycle_time_ms == 2.5
  np.testing.assert_allclose(hvd.allreduce(tf.constant([RANK + 1.0])).numpy(),
                             [S / SIZE])


def test_an_engine_started_before_the_import_names_the_variable(
    restarts_the_engine, monkeypatch):
  mpistrategy.shutdown()
  mpistrategy.init(mpistrategy.Options(stall_warning_seconds=30))
  monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "17")
  with pytest.raises(ValueError,
                     match=r"HOROVOD_STALL_CHECK_TIME_SECONDS='17' asks for "
                     r"stall_warning_seconds=17.0, the engine runs with 30.0"
                     r".*before mpistrategy.horovod was imported"):
    hvd.init()
  monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "30")
  hvd.init()  # what runs is what the variable asks for


# --- shutdown (last: restarts the engine) -----------------------------------


def test_zz_shutdown_and_init_again():
  hvd.shutdown()
  assert not hvd.is_initialized()
  with pytest.raises(ValueError, match="hvd.init"):
    hvd.rank()
  with pytest.raises(ValueError, match="hvd.init"):
    hvd.allreduce(tf.constant([1.0]))
  hvd.init()
  assert hvd.rank() == RANK and hvd.cross_size() == 1
  np.testing.assert_allclose(hvd.allreduce(tf.constant([RANK + 1.0])).numpy(),
                             [S / SIZE])
