"""MPIStrategy API and custom training loops (collective-symmetric).

    tests/mpirun_pytest.sh 2 600 tests/parallel/test_strategy.py
    tests/mpirun_pytest.sh 3 900 tests/parallel/test_strategy.py
"""

import copy
import hashlib
import logging
import socket
import threading

import numpy as np
import pytest
import tensorflow as tf
import keras
from tensorflow.python.distribute import multi_worker_util  # pylint: disable=g-direct-tensorflow-import

import mpistrategy
from mpistrategy import ops
from mpistrategy import runtime
from mpistrategy import strategy as strategy_lib
from mpistrategy.cross_device_ops import MPIAllReduce, NcclAllReduce
from mpistrategy.strategy import MPIStrategy

R = mpistrategy.rank()
N = mpistrategy.size()


@pytest.fixture(scope="module")
def strategy():
  return MPIStrategy()


def _same_everywhere(arrays):
  h = hashlib.sha256()
  for a in arrays:
    h.update(np.ascontiguousarray(np.asarray(a)).tobytes())
  mine = np.frombuffer(h.digest(), np.uint8)
  allh = ops.allgather(tf.constant(mine[None, :])).numpy()
  return all(np.array_equal(allh[i], allh[0]) for i in range(N))


def test_basics(strategy):
  assert isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
  assert isinstance(strategy,
                    tf.distribute.experimental.MultiWorkerMirroredStrategy)
  assert strategy.num_replicas_in_sync == N
  assert strategy.extended._in_multi_worker_mode() == (N > 1)
  assert strategy.extended.should_checkpoint == (R == 0)
  cr = strategy.cluster_resolver
  assert cr.task_type == "worker" and cr.task_id == R
  # One worker per rank, as MultiWorkerMirroredStrategy's spec: TF's own
  # helpers and ClusterSpec's accessors work on it.
  spec = cr.cluster_spec()
  assert spec.jobs == ["worker"] and spec.num_tasks("worker") == N
  assert spec.task_address("worker", R) == socket.gethostname()
  # Every rank's host, from the engines' start-up exchange (tests/multihost
  # checks hosts that differ).
  assert spec.job_tasks("worker") == [socket.gethostname()] * N
  assert runtime.rank_hosts() == [socket.gethostname()] * N
  assert multi_worker_util.is_chief(spec, "worker", R) == (R == 0)
  assert multi_worker_util.worker_count(spec, "worker") == N
  dup = copy.deepcopy(strategy)
  assert dup.extended._num_workers == N
  with pytest.raises(ValueError, match="cluster"):
    strategy.extended._configure(cluster_spec={"worker": ["a:1", "b:2"]},
                                 task_type="worker", task_id=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("in_function", [False, True])
@pytest.mark.parametrize("update", ["assign", "assign_add"])
def test_only_first_replica_takes_rank_0s_value(strategy, in_function,
                                                update):
  # MirroredStrategy over N devices gives every replica replica 0's value;
  # rank r's replica must not keep its own.
  with strategy.scope():
    v = tf.Variable(1.0, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

  def step():
    rid = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group,
                  tf.float32)
    getattr(v, update)(rid + 10.0)

  fn = tf.function(lambda: strategy.run(step)) if in_function else (
      lambda: strategy.run(step))
  fn()
  want = 10.0 if update == "assign" else 11.0
  assert float(v.numpy()) == want
  assert _same_everywhere([v.numpy()])


@pytest.mark.timeout(120)
def test_variables_are_mirrored_and_broadcast(strategy):
  tf.random.set_seed(100 + R)  # different per rank on purpose
  with strategy.scope():
    v = tf.Variable(float(R) + 7.0)
    w = tf.Variable(tf.random.normal([3, 4]))
    i = tf.Variable(R + 3, dtype=tf.int64)
  assert isinstance(v, tf.distribute.DistributedValues)
  assert v.numpy() == 7.0 and i.numpy() == 3
  assert _same_everywhere([w.numpy()])


@pytest.mark.parametrize("dtype", [tf.int16, tf.uint16, tf.uint32,
                                   tf.uint64, tf.complex64, tf.complex128])
def test_variables_of_other_numeric_dtypes_start_from_rank_0(strategy, dtype):
  # Dtypes the engine does not reduce still start from rank 0's value
  # (they travel as bytes), instead of silently keeping each rank's own.
  with strategy.scope():
    v = tf.Variable(tf.cast(tf.fill([2, 3], R + 1), dtype))
    scalar = tf.Variable(tf.cast(R + 5, dtype))
  np.testing.assert_array_equal(v.numpy(), np.ones([2, 3]))
  assert scalar.numpy() == 5


@pytest.mark.timeout(120)
def test_reduce(strategy):
  t = tf.constant(float(R + 1))
  tri = N * (N + 1) / 2.0
  assert strategy.reduce("SUM", t, axis=None).numpy() == tri
  assert strategy.reduce(tf.distribute.ReduceOp.MEAN, t, axis=None).numpy() == (
      pytest.approx(tri / N))
  # int32 must not fall back to a local reduction.
  i = strategy.reduce("SUM", tf.constant(R + 1, tf.int32), axis=None)
  assert i.dtype == tf.int32 and i.numpy() == tri
  i64 = strategy.reduce("SUM", tf.constant([R, 1], tf.int64), axis=None)
  assert i64.numpy().tolist() == [N * (N - 1) // 2, N]
  # MEAN of ints comes back as float (as in TF's CollectiveAllReduce).
  m = strategy.reduce("MEAN", tf.constant(R + 1, tf.int32), axis=None)
  assert m.dtype.is_floating and m.numpy() == pytest.approx(tri / N)
  per = strategy.run(lambda: tf.constant([float(R), 1.0, 2.0]))
  assert strategy.reduce("SUM", per, axis=0).numpy() == pytest.approx(
      N * (N - 1) / 2.0 + 3 * N)
  assert strategy.reduce("MEAN", per, axis=0).numpy() == pytest.approx(
      (N * (N - 1) / 2.0 + 3 * N) / (3 * N))
  # Scalars with axis=0 (Keras' per-step logs) reduce across replicas.
  sc = strategy.run(lambda: tf.constant(float(R)))
  assert strategy.reduce("MEAN", sc, axis=0).numpy() == pytest.approx(
      (N - 1) / 2.0)
  assert strategy.reduce("SUM", sc, axis=0).numpy() == N * (N - 1) / 2.0
  # Nests (Keras' first-batch reduce).
  nest = (strategy.run(lambda: tf.constant(1.0)),
          strategy.run(lambda: tf.constant([2.0])))
  out = strategy.extended.reduce_to("SUM", nest, "/device:CPU:0")
  assert out[0].numpy() == N and out[1].numpy().tolist() == [2.0 * N]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_sum_on_one_rank_and_mean_on_another_fails_on_every_rank(strategy,
                                                                   dtype):
  if N < 2:
    pytest.skip("needs peers")
  op = "SUM" if R == 0 else "MEAN"
  with pytest.raises(tf.errors.FailedPreconditionError) as info:
    strategy.reduce(op, tf.constant([1.0, 2.0], dtype), axis=None)
  assert "reduce op" in str(info.value), str(info.value)
  # Nothing is left pending: the next reduce pairs as usual.
  assert strategy.reduce("MEAN", tf.constant(float(R)), axis=None).numpy() == (
      pytest.approx((N - 1) / 2.0))


@pytest.mark.timeout(120)
def test_gather_uneven(strategy):
  t = tf.fill([R + 1, 2], float(R))
  g = strategy.gather(t, axis=0).numpy()
  want = np.concatenate([np.full([r + 1, 2], float(r)) for r in range(N)])
  np.testing.assert_array_equal(g, want)
  g1 = strategy.gather(tf.fill([2, R + 1], float(R)), axis=1).numpy()
  want1 = np.concatenate([np.full([2, r + 1], float(r)) for r in range(N)], 1)
  np.testing.assert_array_equal(g1, want1)


@pytest.mark.timeout(120)
def test_replica_context_collectives(strategy):

  def step(x):
    ctx = tf.distribute.get_replica_context()
    a = ctx.all_reduce("SUM", tf.constant(R + 1, tf.int32))
    b = ctx.all_reduce("MEAN", [x, tf.constant([1.0, 2.0])])
    c = ctx.all_gather(tf.fill([2], float(R)), axis=0)
    return a, b, c

  x = tf.constant(float(R))
  for fn in (tf.function(lambda: strategy.run(step, args=(x,))),
             lambda: strategy.run(step, args=(x,))):
    a, (b0, b1), c = fn()
    assert a.numpy() == N * (N + 1) // 2
    assert b0.numpy() == pytest.approx((N - 1) / 2.0)
    assert b1.numpy().tolist() == [1.0, 2.0]
    assert c.numpy().tolist() == sum([[float(r)] * 2 for r in range(N)], [])


@pytest.mark.timeout(120)
def test_gradient_through_all_reduce(strategy):

  @tf.function
  def fn():
    def step():
      w = tf.constant(float(R + 1))
      with tf.GradientTape() as tape:
        tape.watch(w)
        y = tf.distribute.get_replica_context().all_reduce("SUM", w * w)
      return tape.gradient(y, w)
    return strategy.run(step)
  # d/dw_r sum_r w_r^2 summed over replicas' upstream gradients of 1: 2*w*N
  assert fn().numpy() == pytest.approx(2.0 * (R + 1) * N)


@pytest.mark.timeout(120)
def test_distribute_dataset_shards_per_rank(strategy):
  gbs = 4 * N
  ds = tf.data.Dataset.range(8 * N).batch(gbs)
  dist = strategy.experimental_distribute_dataset(ds)
  seen = []
  for batch in dist:
    local = strategy.experimental_local_results(batch)[0]
    assert local.shape[0] == 4
    seen.append(local.numpy())
  got = strategy.gather(tf.constant(np.concatenate(seen)), axis=0).numpy()
  assert sorted(got.tolist()) == list(range(8 * N))

  contexts = []

  def dataset_fn(ctx):
    contexts.append((ctx.num_input_pipelines, ctx.input_pipeline_id,
                     ctx.num_replicas_in_sync,
                     ctx.get_per_replica_batch_size(gbs)))
    return tf.data.Dataset.range(8 * N).shard(
        ctx.num_input_pipelines, ctx.input_pipeline_id).batch(4)

  dist2 = strategy.distribute_datasets_from_function(dataset_fn)
  assert contexts == [(N, R, N, 4)]
  total = sum(int(tf.reduce_sum(strategy.experimental_local_results(b)[0]))
              for b in dist2)
  assert strategy.reduce("SUM", tf.constant(total, tf.int64),
                         axis=None).numpy() == sum(range(8 * N))


@pytest.mark.timeout(120)
def test_uneven_shards_end_together(strategy):
  """Rank 0 has 3 batches, the others 2: everyone stops together."""

  def dataset_fn(ctx):
    n = 3 if ctx.input_pipeline_id == 0 else 2
    return tf.data.Dataset.from_tensor_slices(tf.ones([n * 2])).batch(2)

  dist = strategy.distribute_datasets_from_function(dataset_fn)

  @tf.function
  def step(batch):
    return strategy.run(
        lambda b: tf.distribute.get_replica_context().all_reduce(
            "SUM", tf.reduce_sum(b)), args=(batch,))

  steps = 0
  it = iter(dist)
  while True:
    opt = it.get_next_as_optional()
    if not opt.has_value():
      break
    step(opt.get_value())
    steps += 1
  assert steps == 3


@pytest.mark.timeout(180)
def test_cpu_input_builds_no_generator_dataset(strategy, monkeypatch):
  """A CPU rank reads its batches through plain iterators.

  TF's multi-device iterator is a `GeneratorDataset`, whose kernel turns
  off glibc's adaptive mmap threshold for the whole process (TF 2.21 on
  Python 3.11+); every later tensor over 128 KiB then costs a fresh mmap.
  """
  from tensorflow.python.ops import gen_dataset_ops
  built = []
  original = gen_dataset_ops.generator_dataset

  def counting_generator_dataset(*args, **kwargs):
    built.append(kwargs.get("name"))
    return original(*args, **kwargs)

  monkeypatch.setattr(gen_dataset_ops, "generator_dataset",
                      counting_generator_dataset)
  buffered = tf.distribute.InputOptions(experimental_per_replica_buffer_size=3)
  for options in (None, buffered):
    ds = tf.data.Dataset.range(4 * N).batch(2 * N)
    got = [strategy.experimental_local_results(b)[0].numpy().tolist()
           for b in strategy.experimental_distribute_dataset(ds, options)]
    assert got == [[2 * N * i + 2 * R, 2 * N * i + 2 * R + 1]
                   for i in range(2)]
    dist = strategy.distribute_datasets_from_function(
        lambda ctx: tf.data.Dataset.range(3).map(lambda x: x + 10 * R),
        options)
    got = [int(strategy.experimental_local_results(b)[0]) for b in dist]
    assert got == [10 * R, 10 * R + 1, 10 * R + 2]

  with strategy.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
  model.fit(np.ones((8 * N, 3), np.float32), np.ones((8 * N, 1), np.float32),
            batch_size=4 * N, epochs=1, verbose=0)
  assert built == []

  # Options the plain iterator does not serve keep TF's own answer.
  per_replica = tf.distribute.InputOptions(
      experimental_replication_mode=(
          tf.distribute.InputReplicationMode.PER_REPLICA),
      experimental_fetch_to_device=False)
  with pytest.raises(NotImplementedError, match="PER_REPLICA"):
    strategy.experimental_distribute_dataset(
        tf.data.Dataset.range(4).batch(2 * N), per_replica)


@pytest.mark.timeout(120)
def test_unbatched_dataset_gets_a_clear_error(strategy):
  if N == 1:
    pytest.skip("one rank uses the dataset as it is")
  with pytest.raises(ValueError, match="scalar component.*Batch it first"):
    strategy.experimental_distribute_dataset(tf.data.Dataset.range(12))
  # Elements with a first axis are split, as before.
  dist = strategy.experimental_distribute_dataset(
      tf.data.Dataset.range(4 * N).batch(2 * N))
  assert len(list(dist)) == 2


def _warns(strategy, caplog, dataset, words):
  """Whether distributing `dataset` logs a warning containing `words`."""
  caplog.clear()
  with caplog.at_level("WARNING", logger="tensorflow"):
    strategy.experimental_distribute_dataset(dataset)
  return any(words in r.message for r in caplog.records)


@pytest.mark.timeout(120)
def test_an_order_that_may_differ_per_rank_gets_a_warning(strategy, caplog):
  if N == 1:
    pytest.skip("one rank uses the dataset as it is")
  loose = tf.data.Options()
  loose.deterministic = False
  base = tf.data.Dataset.range(8 * N)
  for dataset, warns in (
      (base.map(lambda x: x, num_parallel_calls=2,
                deterministic=False).batch(2 * N), True),
      (base.batch(2 * N).with_options(loose), True),
      (base.map(lambda x: x, num_parallel_calls=2).batch(2 * N), False)):
    assert _warns(strategy, caplog, dataset, "another order") == warns


@pytest.mark.timeout(120)
def test_elements_of_unknown_rank_get_a_warning(strategy, caplog):
  # A rank whose data runs out first gets a batch of 0 rows shaped like the
  # elements (TF's input code): for an element of unknown rank a scalar,
  # which its gather or model rejected with an error that did not say why.
  if N == 1:
    pytest.skip("one rank never runs out before the others")
  unknown = tf.data.Dataset.range(2 * N + 1).map(
      lambda i: tf.io.parse_tensor(
          tf.io.serialize_tensor(tf.fill([2], tf.cast(i, tf.float32))),
          tf.float32))
  known = unknown.map(lambda x: tf.ensure_shape(x, [None]))
  for dataset, warns in ((unknown.batch(2 * N), True),
                         (known.batch(2 * N), False)):
    strategy_lib._LOGGED.discard("unknown_rank")  # pylint: disable=protected-access
    assert _warns(strategy, caplog, dataset, "unknown rank") == warns
  strategy_lib._LOGGED.discard("unknown_rank")  # pylint: disable=protected-access
  caplog.clear()
  with caplog.at_level("WARNING", logger="tensorflow"):
    strategy.distribute_datasets_from_function(
        lambda unused_context: unknown.batch(2))
  assert any("ensure_shape" in r.message for r in caplog.records)
  # With a known rank, the last step's ranks without rows give 0 rows.
  rows = [int(strategy.gather(x, axis=0).shape[0])
          for x in strategy.experimental_distribute_dataset(known.batch(2 * N))]
  assert rows == [2 * N, 1]


@pytest.mark.timeout(120)
def test_unbatched_rows_of_features_get_a_warning(strategy, caplog):
  if N == 1:
    pytest.skip("one rank uses the dataset as it is")
  rows = np.arange(3 * 8, dtype=np.float32).reshape(3, 8)
  unbatched = (tf.data.Dataset.from_tensor_slices((rows, rows))
               .map(lambda x, y: (x, y)).shuffle(3).prefetch(1))
  batched = tf.data.Dataset.from_tensor_slices(rows).batch(2 * N).prefetch(1)
  whole_batches = tf.data.Dataset.from_tensors(rows)
  for dataset, warns in ((unbatched, True), (batched, False),
                         (whole_batches, False),
                         (batched.unbatch().repeat(2), True)):
    assert _warns(strategy, caplog, dataset, "reads single rows") == warns


@pytest.mark.timeout(120)
def test_datasets_that_differ_between_ranks_are_refused_everywhere(strategy):
  # A rank-dependent batch size split the rows wrongly without an error.
  rows = tf.data.Dataset.range(48).map(lambda i: tf.cast(i, tf.float32))
  with pytest.raises(ValueError,
                     match="batch size 8 on rank 0, batch size 9 on rank 1"):
    strategy.experimental_distribute_dataset(rows.batch(8 + R))
  with pytest.raises(ValueError, match="elements 6 on rank 0, elements 5 on"):
    strategy.experimental_distribute_dataset(rows.take(48 - 8 * R).batch(8))
  # The same dataset everywhere is distributed as before.
  assert len(list(strategy.experimental_distribute_dataset(
      rows.batch(8)))) == 6


@pytest.mark.timeout(120)
def test_distribute_values_from_function(strategy):
  vals = strategy.experimental_distribute_values_from_function(
      lambda ctx: tf.constant(float(ctx.replica_id_in_sync_group)))
  assert strategy.experimental_local_results(vals)[0].numpy() == R
  assert strategy.reduce("SUM", vals, axis=None).numpy() == N * (N - 1) / 2


@pytest.mark.timeout(120)
def test_mirrored_assign_in_replica_context(strategy):
  with strategy.scope():
    v = tf.Variable(0.0, aggregation=tf.VariableAggregation.SUM)
    m = tf.Variable(0.0, aggregation=tf.VariableAggregation.MEAN)

  @tf.function
  def fn():
    def step():
      v.assign_add(float(R + 1))
      m.assign(float(R))
    strategy.run(step)
  fn()
  assert v.numpy() == N * (N + 1) / 2
  assert m.numpy() == pytest.approx((N - 1) / 2.0)


@pytest.mark.timeout(300)
def test_custom_training_loop_matches_single_process(strategy):
  from sklearn.datasets import load_digits
  x, y = load_digits(return_X_y=True)
  n = 384
  x, y = (x[:n] / 16.0).astype(np.float32), y[:n].astype(np.int32)
  gbs = 16 * N

  def build():
    return keras.Sequential([keras.Input((64,)),
                             keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(10)])

  keras.utils.set_random_seed(7 + R)
  with strategy.scope():
    model = build()
    opt = keras.optimizers.Adam(0.01)
    opt.build(model.trainable_variables)
  init = [w.numpy() for w in model.weights]
  loss_obj = keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction=None)
  ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(gbs)
  dist = strategy.experimental_distribute_dataset(ds)

  @tf.function
  def train_step(batch):
    def step(b):
      xb, yb = b
      with tf.GradientTape() as tape:
        per_ex = loss_obj(yb, model(xb, training=True))
        loss = tf.nn.compute_average_loss(per_ex, global_batch_size=gbs)
      grads = tape.gradient(loss, model.trainable_variables)
      opt.apply_gradients(zip(grads, model.trainable_variables))
      return loss
    return strategy.reduce("SUM", strategy.run(step, args=(batch,)), axis=None)

  losses = [float(train_step(b)) for b in dist]

  ref = build()
  ref.set_weights(init)
  ref_opt = keras.optimizers.Adam(0.01)
  ref_losses = []
  for i in range(0, n, gbs):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(loss_obj(y[i:i + gbs], ref(x[i:i + gbs])))
    grads = tape.gradient(loss, ref.trainable_variables)
    ref_opt.apply_gradients(zip(grads, ref.trainable_variables))
    ref_losses.append(float(loss))

  assert _same_everywhere([w.numpy() for w in model.weights] +
                          [v.numpy() for v in opt.variables])
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  for a, b in zip(model.weights, ref.weights):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(120)
def test_a_function_traced_inside_another_on_some_ranks_still_pairs(strategy):
  # `step` serves a later call from inside `two_steps`: ranks whose first
  # batch had the later shape reuse their direct trace, the others trace
  # it anew inside `two_steps`.  Its collectives must pair either way.
  def per_rank(sizes):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.ones([sizes[ctx.replica_id_in_sync_group]]))

  @tf.function
  def step(batch):
    return strategy.reduce("SUM", strategy.run(tf.reduce_sum, args=(batch,)),
                           axis=None)

  @tf.function
  def two_steps(batch):
    return step(batch) + step(batch)

  first = [2 if r % 2 == 0 else 0 for r in range(N)]
  assert step(per_rank(first)).numpy() == sum(first)
  assert two_steps(per_rank([2] * N)).numpy() == 4 * N
  assert step(per_rank([3] * N)).numpy() == 3 * N


@pytest.mark.timeout(120)
def test_eager_custom_loop_builds_its_optimizer_in_the_replica_thread(
    strategy):
  # The tutorial's loop without tf.function (debugging): the optimizer
  # makes its variables in the first apply_gradients, in the thread that
  # strategy.run uses eagerly; their initial values are broadcast.
  with strategy.scope():
    w = tf.Variable([1.0, 2.0])
    opt = keras.optimizers.Adam(0.1)

  def step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(x * w) / (2 * N)
    opt.apply_gradients([(tape.gradient(loss, w), w)])
    # A collective of the replica's own, too.
    return tf.distribute.get_replica_context().all_reduce("SUM", loss)

  x = strategy.experimental_distribute_values_from_function(
      lambda ctx: tf.fill([2, 2], float(ctx.replica_id_in_sync_group + 1)))
  for _ in range(2):
    total = strategy.experimental_local_results(strategy.run(step,
                                                             args=(x,)))[0]
  # Every rank's rows: sum over r of 2 * (r + 1) * (w0 + w1) / (2 N).
  assert _same_everywhere([w.numpy(), total.numpy()] +
                          [v.numpy() for v in opt.variables])
  assert int(opt.iterations.numpy()) == 2
  # Adam's first steps move each weight by about the learning rate.
  np.testing.assert_allclose(w.numpy(), [0.8, 1.8], atol=1e-3)


def _in_threads(work, names):
  """Runs `work(i)` in one thread per name at once; returns its results."""
  results = {}

  def run(i):
    try:
      results[i] = work(i)
    except Exception as e:  # pylint: disable=broad-except
      results[i] = e

  threads = [threading.Thread(target=run, args=(i,), name=name)
             for i, name in enumerate(names)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(100)
  return [results.get(i, "still running") for i in range(len(names))]


@pytest.mark.timeout(120)
def test_strategy_calls_without_names_in_a_worker_thread(strategy):
  # The calls of a training loop in a thread: none of them takes name=.
  dataset = tf.data.Dataset.range(6 * N).map(
      lambda i: tf.cast(i, tf.float32)).batch(2 * N)

  def train(unused_i):
    with strategy.scope():
      w = tf.Variable(float(R + 1))  # rank 0's value, broadcast
      on_read = tf.Variable(
          0.0, synchronization=tf.VariableSynchronization.ON_READ,
          aggregation=tf.VariableAggregation.SUM)

    def step(x):
      on_read.assign_add(1.0)
      return tf.distribute.get_replica_context().all_reduce(
          "SUM", tf.reduce_sum(x) * w)

    totals = [strategy.experimental_local_results(strategy.run(step, (x,)))[0]
              for x in strategy.experimental_distribute_dataset(dataset)]
    gathered = strategy.gather(strategy.run(lambda: tf.constant([R])), axis=0)
    return (float(w.numpy()), [float(t) for t in totals],
            float(on_read.read_value()), gathered.numpy().tolist(),
            float(strategy.reduce("SUM", tf.constant(1.0), axis=None)))

  refused = _in_threads(train, ["trainer"])[0]
  assert isinstance(refused, ValueError), refused
  assert "mpistrategy.collective_names" in str(refused), refused

  with_names = _in_threads(
      lambda i: _with_names("trainer", train, i), ["trainer"])[0]
  rows = np.arange(6 * N, dtype=np.float32).reshape(3, 2 * N)
  assert with_names == (1.0, rows.sum(axis=1).tolist(), float(3 * N),
                        list(range(N)), float(N)), with_names


def _with_names(prefix, work, i):
  with mpistrategy.collective_names(prefix):
    return work(i)


@pytest.mark.timeout(120)
def test_threads_with_their_own_prefixes_keep_their_values(strategy):
  # Equal shapes in every thread: a call paired with another thread's on
  # another rank would return a wrong sum, not an error.
  def work(i):
    return [float(strategy.reduce(
        "SUM", tf.constant(float(i + 1) * (R + 1)), axis=None))
            for _ in range(20)]

  sums = _in_threads(lambda i: _with_names(f"worker{i}", work, i),
                     [f"w{i}" for i in range(3)])
  for i, got in enumerate(sums):
    assert got == [(i + 1) * N * (N + 1) / 2] * 20, (i, got)
  with pytest.raises(ValueError, match="non-empty str"):
    with mpistrategy.collective_names(""):
      pass


@pytest.mark.timeout(120)
def test_threads_functions_of_one_name_take_their_prefixes(strategy):
  # Each thread traces its own tf.function, all named `step`, and runs it
  # at the same time as the others.  Without the prefixes in the traced
  # names, the threads submitted the same names: "already in flight", or a
  # rank paired one thread's collective with another's (wrong sums).
  def work(i):
    @tf.function
    def step(x):
      return strategy.reduce("SUM", strategy.run(lambda: x), axis=None)

    with mpistrategy.collective_names(f"worker{i}"):
      return [float(step(tf.constant(float(i + 1) * (R + 1))))
              for _ in range(5)]

  results = _in_threads(work, [f"w{i}" for i in range(3)])
  for i, got in enumerate(results):
    assert got == [(i + 1) * N * (N + 1) / 2] * 5, (i, got)


@pytest.mark.timeout(120)
def test_asyncio_tasks_take_their_own_prefixes(strategy):
  import asyncio  # pylint: disable=g-import-not-at-top

  async def task(label, value):
    with mpistrategy.collective_names(label):
      total = 0.0
      for _ in range(4):
        total += float(strategy.reduce("SUM", tf.constant(value), axis=None))
        await asyncio.sleep(0.001 * (R + 1))  # interleave unlike other ranks
      return total

  async def both():
    return await asyncio.gather(task("A", 1.0), task("B", 100.0))

  assert asyncio.run(both()) == [4.0 * N, 400.0 * N]


@pytest.mark.timeout(120)
def test_a_rank_that_traces_the_step_again_still_pairs(strategy):
  # The README's custom loop, with an optimizer built in the first trace:
  # the last global batch is one row short, so only the last rank gets a
  # new shape and traces `train_step` again, now without the optimizer's
  # build.  Its collectives must keep the names of the first trace.
  gbs = 4 * N
  rows = np.arange(2 * gbs - 1, dtype=np.float32)
  with strategy.scope():
    w = tf.Variable(1.0)
    keras.optimizers.SGD(0.1)  # so that Keras names the next one "sgd_<n>"
    opt = keras.optimizers.SGD(0.1)
  dist = strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices(rows).batch(gbs))

  @tf.function
  def train_step(batch):
    def step(x):
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(x * w) / gbs
      opt.apply_gradients([(tape.gradient(loss, w), w)])
      return loss
    return strategy.reduce("SUM", strategy.run(step, args=(batch,)), axis=None)

  for batch in dist:
    train_step(batch)
  assert train_step.experimental_get_tracing_count() == (2 if R == N - 1
                                                         else 1)
  want = 1.0
  for begin in range(0, len(rows), gbs):
    want -= 0.1 * rows[begin:begin + gbs].sum() / gbs
  np.testing.assert_allclose(w.numpy(), want, rtol=1e-6)


def test_communication_options():
  opts = tf.distribute.experimental.CommunicationOptions
  impl = tf.distribute.experimental.CommunicationImplementation
  if not tf.config.list_logical_devices("GPU"):
    with pytest.raises(ValueError, match="GPU"):
      MPIStrategy(communication_options=opts(implementation=impl.NCCL))
    with pytest.raises(ValueError, match="GPU"):
      NcclAllReduce()
  with pytest.raises(ValueError, match="NCCL"):
    MPIAllReduce(opts(implementation=impl.NCCL))
  with pytest.raises(ValueError, match="CommunicationOptions"):
    MPIStrategy(communication_options="fast")
  with pytest.raises(ValueError, match="cross_device_ops"):
    MPIStrategy(cross_device_ops=tf.distribute.ReductionToOneDevice())
  s = MPIStrategy(communication_options=opts(implementation=impl.RING))
  assert s.reduce("SUM", tf.constant(1.0), axis=None).numpy() == N


def test_per_call_communication_options_are_hints():
  # TF: "only hints ... ignored by others"; its own docstring's example
  # passes all three per call, as MultiWorkerMirroredStrategy code does.
  opts = tf.distribute.experimental.CommunicationOptions
  impl = tf.distribute.experimental.CommunicationImplementation
  records = []
  handler = logging.Handler()
  handler.emit = records.append
  tf.get_logger().addHandler(handler)
  try:
    s = MPIStrategy()
    hint = opts(bytes_per_pack=1024, timeout_seconds=120.0,
                implementation=impl.NCCL)
    for _ in range(2):
      assert s.extended.reduce_to("SUM", tf.constant(1.0), "/device:CPU:0",
                                  options=hint).numpy() == N
      got = s.run(lambda: tf.distribute.get_replica_context().all_reduce(
          "SUM", tf.constant(2.0), options=hint))
      assert got.numpy() == 2.0 * N
  finally:
    tf.get_logger().removeHandler(handler)
  # Rank 0 says once per field that the engine-wide value stays.
  said = [r.getMessage() for r in records if "per-call" in r.getMessage()]
  if R == 0:
    assert len(said) == 2, said
    assert "bytes_per_pack=1024" in said[0]
    assert "fusion_threshold_bytes" in said[0]
    assert "timeout_seconds=120.0" in said[1] and "stall_timeout" in said[1]
  else:
    assert not said
