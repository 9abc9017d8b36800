"""A dataset the user sharded (`ds.shard(size, rank)`) is not sharded again.

    tests/mpirun_pytest.sh 2 600 tests/parallel/test_user_sharding.py
    tests/mpirun_pytest.sh 3 600 tests/parallel/test_user_sharding.py

Horovod programs shard their input per rank and batch it per rank.  Under
`MPIStrategy` such a dataset keeps its meaning: each rank reads all of its
own shard, in batches of the dataset's batch size, in `model.fit` and in
custom loops (`experimental_distribute_dataset`,
`distribute_datasets_from_function`).  A dataset that is not sharded by the
user is still auto-sharded (global batch split over the ranks).
"""

import threading
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import mpistrategy
from mpistrategy import ops
from mpistrategy.strategy import MPIStrategy

R = mpistrategy.rank()
N = mpistrategy.size()
PER_RANK = 500
BATCH = 10


@pytest.fixture(scope="module")
def strategy():
  return MPIStrategy()


def _local_rows(strategy, distributed):
  """Every element this rank's replica received, in order."""
  rows = []
  for batch in distributed:
    for local in strategy.experimental_local_results(batch):
      rows.extend(local.numpy().tolist())
  return rows


def _my_shard(total):
  return [i for i in range(total) if i % N == R]


@pytest.mark.timeout(120)
def test_experimental_distribute_dataset_keeps_the_users_shard(strategy):
  ds = tf.data.Dataset.range(PER_RANK * N).shard(N, R).batch(BATCH)
  rows = _local_rows(strategy, strategy.experimental_distribute_dataset(ds))
  assert rows == _my_shard(PER_RANK * N), (len(rows), rows[:12])


@pytest.mark.timeout(120)
def test_shard_is_found_behind_other_transformations(strategy):
  ds = (tf.data.Dataset.range(PER_RANK * N).shard(num_shards=N, index=R)
        .map(lambda x: x * 2).batch(BATCH).prefetch(2))
  rows = _local_rows(strategy, strategy.experimental_distribute_dataset(ds))
  assert rows == [2 * i for i in _my_shard(PER_RANK * N)]


@pytest.mark.timeout(120)
def test_uneven_user_shards_end_together(strategy):
  # 1000 elements on 3 ranks: 334, 333, 333, so the ranks' batch counts
  # differ; every rank still gets all of its own and nothing hangs.
  total = 1000
  ds = tf.data.Dataset.range(total).shard(N, R).batch(BATCH)
  rows = _local_rows(strategy, strategy.experimental_distribute_dataset(ds))
  assert rows == _my_shard(total)


@pytest.mark.timeout(120)
def test_distribute_datasets_from_function_with_the_users_shard(strategy):
  def dataset_fn(context):
    assert context.num_input_pipelines == N
    assert context.input_pipeline_id == R
    return tf.data.Dataset.range(PER_RANK * N).shard(N, R).batch(BATCH)

  rows = _local_rows(strategy,
                     strategy.distribute_datasets_from_function(dataset_fn))
  assert rows == _my_shard(PER_RANK * N)


@pytest.mark.timeout(120)
def test_unsharded_dataset_is_still_split_over_the_ranks(strategy):
  ds = tf.data.Dataset.range(PER_RANK * N).batch(BATCH * N)
  rows = _local_rows(strategy, strategy.experimental_distribute_dataset(ds))
  everyone = ops.allgather(tf.constant(rows, tf.int64)).numpy().tolist()
  assert len(rows) == PER_RANK
  assert sorted(everyone) == list(range(PER_RANK * N))


@pytest.mark.timeout(120)
def test_a_split_with_the_same_index_everywhere_is_sharded_again(strategy):
  if N == 1:
    pytest.skip("needs several ranks")
  # shard(N, 0) on every rank holds out a part (a train/validation split):
  # the ranks share it, as the replicas of one process would.
  held_out = tf.data.Dataset.range(PER_RANK * N).shard(N, 0)
  ds = held_out.batch(BATCH * N)
  rows = _local_rows(strategy, strategy.experimental_distribute_dataset(ds))
  everyone = ops.allgather(tf.constant(rows, tf.int64)).numpy().tolist()
  assert sorted(everyone) == list(range(0, PER_RANK * N, N))


@pytest.mark.timeout(120)
def test_other_shard_counts_and_explicit_policies_are_left_alone(strategy):
  if N == 1:
    pytest.skip("needs several ranks")
  # shard(2N): not a per-rank shard, so the strategy auto-shards it.
  ds = tf.data.Dataset.range(PER_RANK * N).shard(2 * N, R).batch(BATCH)
  rows = _local_rows(strategy, strategy.experimental_distribute_dataset(ds))
  assert len(rows) < len(_my_shard(PER_RANK * N)) // 2 + BATCH
  # An explicit DATA policy is the user's choice too.
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = (
      tf.data.experimental.AutoShardPolicy.DATA)
  ds = tf.data.Dataset.range(PER_RANK * N).shard(N, R).batch(
      BATCH).with_options(options)
  rows = _local_rows(strategy, strategy.experimental_distribute_dataset(ds))
  assert len(rows) < PER_RANK


@pytest.mark.timeout(300)
def test_keras_fit_reads_each_ranks_whole_shard(strategy):
  seen = set()
  lock = threading.Lock()

  def record(x):
    with lock:
      seen.update(x.numpy().tolist())
    return x

  def features(i):
    i = tf.py_function(record, [i], tf.int64)
    i.set_shape([None])
    x = tf.cast(tf.reshape(i, [-1, 1]), tf.float32) / 1000.0
    return x, 2.0 * x

  ds = (tf.data.Dataset.range(PER_RANK * N).shard(N, R).batch(BATCH)
        .map(features))
  with strategy.scope():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  model.fit(ds, epochs=1, verbose=0)
  assert sorted(seen) == _my_shard(PER_RANK * N), (len(seen),)
  # One step per batch of this rank (Horovod's meaning of the batch size).
  assert int(model.optimizer.iterations.numpy()) == PER_RANK // BATCH
  weights = np.concatenate([w.ravel() for w in model.get_weights()])
  gathered = ops.allgather(tf.constant(weights[None, :])).numpy()
  for other in gathered:
    np.testing.assert_array_equal(other, gathered[0])


@pytest.mark.timeout(300)
def test_keras_fit_with_uneven_user_shards(strategy):
  # One element more than PER_RANK * N: rank 0 has one batch more than the
  # others.  Every rank still reads all of its shard, and no rank waits for
  # the others in a step they never take.
  total = PER_RANK * N + 1
  seen = set()
  lock = threading.Lock()

  def record(x):
    with lock:
      seen.update(x.numpy().tolist())
    return x

  def features(i):
    i = tf.py_function(record, [i], tf.int64)
    i.set_shape([None])
    x = tf.cast(tf.reshape(i, [-1, 1]), tf.float32) / 1000.0
    return x, 2.0 * x

  ds = tf.data.Dataset.range(total).shard(N, R).batch(BATCH).map(features)
  with strategy.scope():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  history = model.fit(ds, epochs=2, verbose=0)
  assert np.isfinite(history.history["loss"]).all(), history.history
  assert sorted(seen) == _my_shard(total), (len(seen),)
  weights = np.concatenate([w.ravel() for w in model.get_weights()])
  assert np.isfinite(weights).all(), weights
  gathered = ops.allgather(tf.constant(weights[None, :])).numpy()
  for other in gathered:
    np.testing.assert_array_equal(other, gathered[0])


class _Record(keras.layers.Layer):
  """The identity; passes `on_rows` the rows of each training step here."""

  def __init__(self, on_rows, **kwargs):
    super().__init__(**kwargs)
    self._on_rows = on_rows

  def call(self, inputs, training=None):
    if training:
      def note(values):
        self._on_rows(values.numpy()[:, 0].tolist())
        return values
      inputs = tf.py_function(note, [inputs], inputs.dtype)
      inputs.set_shape([None, 1])
    return inputs


def _unsharded(ds):
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = (
      tf.data.experimental.AutoShardPolicy.OFF)
  return ds.with_options(options)


@pytest.mark.timeout(300)
def test_keras_with_sharding_off_sees_every_row_on_every_rank(strategy):
  # OFF: every rank reads the whole dataset and splits each global batch,
  # so each rank's epoch is N pieces per batch of the dataset.  Keras used
  # to stop at the dataset's own cardinality: after 1/N of the rows, the
  # same ones on every rank, the rest never seen.  With a last partial
  # batch (9 rows).
  rows = 9
  x = np.arange(rows, dtype="float32")[:, None]
  ds = _unsharded(tf.data.Dataset.from_tensor_slices((x, x)).batch(4))
  batches = sum(1 for _ in strategy.experimental_distribute_dataset(ds))
  trained = []
  with strategy.scope():
    model = keras.Sequential([
        keras.Input((1,)), _Record(trained.extend),
        keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)])
    model.compile(optimizer="sgd", loss="mse")
  got = sorted(model.predict(ds, verbose=0)[:, 0].tolist())
  assert got == sorted(list(range(rows)) * N), got
  steps = []
  record_steps = keras.callbacks.LambdaCallback(
      on_train_batch_end=lambda batch, logs: steps.append(batch))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.fit(ds, epochs=2, verbose=0, callbacks=[record_steps])
  assert len(steps) == 2 * batches, (steps, batches)
  # Each epoch ends where the data does, as it should: no "ran out of data".
  assert not [w for w in caught if "ran out of data" in str(w.message)]
  # Every row N times per epoch, over the ranks.
  everyone = ops.allgather(tf.constant(trained, tf.float32)).numpy().tolist()
  assert sorted(everyone) == sorted(list(range(rows)) * N * 2), everyone


@pytest.mark.timeout(120)
def test_custom_loop_with_sharding_off_sees_every_row(strategy):
  ds = _unsharded(tf.data.Dataset.range(PER_RANK).batch(BATCH * N))
  distributed = strategy.experimental_distribute_dataset(ds)
  rows = _local_rows(strategy, distributed)
  assert sorted(rows) == list(range(PER_RANK)), (len(rows), rows[:12])
  # Its length is the pieces each rank iterates, which TF's cardinality
  # (the dataset's own) does not say.
  if N > 1:
    assert distributed.cardinality == tf.data.UNKNOWN_CARDINALITY


@pytest.mark.timeout(300)
def test_files_zipped_with_labels_in_memory_stay_paired(strategy, tmp_path):
  # Sharding by file (AUTO's choice for files) would give each rank its own
  # files but every label: features paired with the wrong labels, rows
  # lost.  Each rank writes the same files under its own directory.
  rows, files = 103, 4
  paths = []
  for f in range(files):
    paths.append(str(tmp_path / f"part{f}.tfr"))
    with tf.io.TFRecordWriter(paths[-1]) as writer:
      for i in range(f, rows, files):
        writer.write(tf.constant(float(i)).numpy().tobytes())
  order = [i for f in range(files) for i in range(f, rows, files)]
  features = tf.data.TFRecordDataset(paths).map(
      lambda record: tf.io.decode_raw(record, tf.float32)[0])
  labels = tf.data.Dataset.from_tensor_slices(np.array(order, np.float32))
  for joined in (tf.data.Dataset.zip((features, labels)),
                 tf.data.Dataset.zip((labels, features))):
    pairs = []
    for batch in strategy.experimental_distribute_dataset(joined.batch(8)):
      a, b = (strategy.experimental_local_results(t)[0].numpy()
              for t in batch)
      pairs.extend(zip(a.tolist(), b.tolist()))
    assert all(a == b for a, b in pairs), pairs[:8]
    values = [a for a, _ in pairs]
    everyone = ops.allgather(tf.constant(values, tf.float32)).numpy()
    assert sorted(everyone.tolist()) == list(range(rows))
  # Keras: evaluate with the right weights gives no loss at all.
  with strategy.scope():
    model = keras.Sequential([
        keras.Input(()), keras.layers.Reshape((1,)),
        keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)])
    model.compile(loss="mse")
  loss = model.evaluate(tf.data.Dataset.zip((features, labels)).batch(8),
                        verbose=0)
  assert loss == 0.0, loss


@pytest.mark.timeout(300)
def test_fewer_files_than_ranks_are_sharded_by_data(strategy, tmp_path):
  # Sharding by file (AUTO's choice for files) would leave a rank without
  # a file: TensorFlow's error at the first step, on that rank only.  Each
  # rank writes the same files under its own directory.
  rows, files = 50, N - 1
  paths = [str(tmp_path / f"part{f}.tfr") for f in range(files)]
  for f, path in enumerate(paths):
    with tf.io.TFRecordWriter(path) as writer:
      for i in range(f, rows, files):
        writer.write(tf.constant(float(i)).numpy().tobytes())

  def decoded(dataset):
    return dataset.map(lambda r: tf.io.decode_raw(r, tf.float32)[0]).batch(8)

  readers = {
      "TFRecordDataset": tf.data.TFRecordDataset(paths),
      "parallel reads": tf.data.TFRecordDataset(paths, num_parallel_reads=2),
      "interleave": tf.data.Dataset.from_tensor_slices(paths).interleave(
          tf.data.TFRecordDataset, cycle_length=1),
  }
  for name, reader in readers.items():
    one_process = [float(x) for x in decoded(reader).unbatch()]
    local = _local_rows(strategy,
                        strategy.experimental_distribute_dataset(
                            decoded(reader)))
    everyone = ops.allgather(tf.constant(local, tf.float32)).numpy()
    # Sharded by data: each batch of one process split over the ranks.
    mine = [row for start in range(0, rows, 8)
            for row in _split(one_process[start:start + 8])[R]]
    assert local == mine, (name, local[:8], mine[:8])
    assert sorted(everyone.tolist()) == list(range(rows)), name

  by_file = decoded(readers["TFRecordDataset"])
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = (
      tf.data.experimental.AutoShardPolicy.FILE)
  with pytest.raises(ValueError, match=rf"reads {files} file\(s\) for {N} "):
    strategy.experimental_distribute_dataset(by_file.with_options(options))


def _split(batch):
  """`batch` cut into N consecutive pieces, as the ranks' auto-sharding."""
  sizes = [len(batch) // N + (r < len(batch) % N) for r in range(N)]
  starts = np.cumsum([0] + sizes)
  return [batch[starts[r]:starts[r + 1]] for r in range(N)]


@pytest.mark.timeout(300)
def test_a_pydataset_shuffled_with_numpy_partitions_every_epoch():
  # The Keras guides' PyDataset shuffles its indices with numpy's global
  # generator in on_epoch_end.  Ranks whose numpy states differ (a seed per
  # rank, or none) took their parts of different batches: rows lost and
  # doubled.  The strategy gives every rank rank 0's numpy state.
  import random  # pylint: disable=import-outside-toplevel
  np.random.seed(100 + R)
  random.seed(200 + R)
  strategy = MPIStrategy()
  draws = np.array([[np.random.rand(), random.random()]])
  gathered = ops.allgather(tf.constant(draws)).numpy()
  assert (gathered == gathered[0]).all(), gathered
  rows, batch = 48, 8

  class Shuffled(keras.utils.PyDataset):

    def __init__(self):
      super().__init__()
      self.order = np.arange(rows)
      np.random.shuffle(self.order)

    def __len__(self):
      return rows // batch

    def __getitem__(self, index):
      picked = self.order[index * batch:(index + 1) * batch]
      x = picked.astype(np.float32)[:, None]
      return x, x

    def on_epoch_end(self):
      np.random.shuffle(self.order)

  trained = []
  with strategy.scope():
    model = keras.Sequential([keras.Input((1,)), _Record(trained.append),
                              keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
  model.fit(Shuffled(), epochs=2, verbose=0)
  for epoch in range(2):
    mine = [r for step in trained[epoch * (rows // batch):
                                   (epoch + 1) * (rows // batch)]
            for r in step]
    everyone = ops.allgather(tf.constant(mine, tf.float32)).numpy()
    assert sorted(everyone.tolist()) == list(range(rows)), (epoch, everyone)
