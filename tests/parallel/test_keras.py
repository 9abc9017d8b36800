"""Keras 3 compile/fit/evaluate/predict under MPIStrategy vs one process.

Run under mpirun (every rank runs every test, in order):

    tests/mpirun_pytest.sh 2 900 tests/parallel/test_keras.py
    tests/mpirun_pytest.sh 3 1200 tests/parallel/test_keras.py

The single-process reference is computed in the same process with the
default strategy and the *global* batch; it starts from the distributed
model's initial weights (which are rank 0's, broadcast by the strategy).
"""

import hashlib

import numpy as np
import pytest
import tensorflow as tf
import keras

import mpistrategy
from mpistrategy import ops
from mpistrategy.strategy import MPIStrategy

N_SAMPLES = 768           # divisible by the global batch at np 1, 2, 3
PER_REPLICA_BATCH = 32


@pytest.fixture(scope="module")
def strategy():
  return MPIStrategy()


@pytest.fixture(scope="module")
def digits():
  from sklearn.datasets import load_digits
  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  y = y.astype(np.int32)
  return x[:N_SAMPLES], y[:N_SAMPLES], x[N_SAMPLES:N_SAMPLES + 256], y[
      N_SAMPLES:N_SAMPLES + 256]


def _gbs(strategy):
  return PER_REPLICA_BATCH * strategy.num_replicas_in_sync


def _seed_rank_differently():
  # Different seeds per rank: only the strategy's broadcast makes the initial
  # weights agree.
  keras.utils.set_random_seed(1234 + 17 * mpistrategy.rank())


def _mlp(extra=None):
  layers = [keras.Input((64,)), keras.layers.Dense(32, activation="relu")]
  layers += extra or []
  layers.append(keras.layers.Dense(10))
  return keras.Sequential(layers)


def _compile(model, optimizer="adam", spe=1):
  opt = {"adam": lambda: keras.optimizers.Adam(0.01),
         "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9)}[optimizer]()
  model.compile(
      optimizer=opt,
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=["accuracy"], steps_per_execution=spe)


def _digest(arrays):
  h = hashlib.sha256()
  for a in arrays:
    h.update(np.ascontiguousarray(np.asarray(a)).tobytes())
  return np.frombuffer(h.digest(), np.uint8)


def _assert_bit_identical_across_ranks(arrays, what):
  mine = _digest(arrays)
  everyone = ops.allgather(tf.constant(mine[None, :])).numpy()
  assert everyone.shape[0] == mpistrategy.size()
  differ = [r for r in range(everyone.shape[0])
            if not np.array_equal(everyone[r], everyone[0])]
  assert not differ, f"{what} differ from rank 0 on ranks {differ}"


def _assert_close(got, want, what, rel=1e-5):
  assert len(got) == len(want), what
  for i, (g, w) in enumerate(zip(got, want)):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    err = np.max(np.abs(g - w)) if g.size else 0.0
    scale = max(1.0, float(np.max(np.abs(w))) if w.size else 1.0)
    assert err <= rel * scale, (
        f"{what}[{i}]: max|diff| {err:g} > {rel}*{scale:g}")


def _weights_and_slots(model):
  return ([v.numpy() for v in model.weights] +
          [v.numpy() for v in model.optimizer.variables])


class _EpochLogs(keras.callbacks.Callback):

  def __init__(self):
    super().__init__()
    self.epochs = []
    self.batches = 0

  def on_train_batch_end(self, batch, logs=None):
    self.batches += 1

  def on_epoch_end(self, epoch, logs=None):
    self.epochs.append(dict(logs))


def _fit_pair(strategy, digits, spe, optimizer, build=_mlp, epochs=2,
              x_transform=None):
  """Trains the same model distributed and single-process."""
  x, y, xv, yv = digits
  gbs = _gbs(strategy)
  _seed_rank_differently()
  with strategy.scope():
    model = build()
    _compile(model, optimizer, spe)
  init = [w.numpy() for w in model.weights]
  cb = _EpochLogs()
  hist = model.fit(x, y, batch_size=gbs, epochs=epochs, shuffle=False,
                   validation_data=(xv, yv), callbacks=[cb], verbose=0)

  keras.utils.set_random_seed(99)
  ref = build()
  _compile(ref, optimizer, spe)
  ref.set_weights(init)
  ref_cb = _EpochLogs()
  ref_hist = ref.fit(x, y, batch_size=gbs, epochs=epochs, shuffle=False,
                     validation_data=(xv, yv), callbacks=[ref_cb], verbose=0)
  return model, ref, hist, ref_hist, cb, ref_cb, init


@pytest.mark.timeout(600)
@pytest.mark.parametrize("spe,optimizer", [(1, "sgd"), (4, "adam")])
def test_fit_evaluate_predict_match_single_process(strategy, digits, spe,
                                                   optimizer):
  x, y, xv, yv = digits
  model, ref, hist, ref_hist, cb, ref_cb, init = _fit_pair(
      strategy, digits, spe, optimizer)
  _assert_bit_identical_across_ranks(init, "initial weights")
  _assert_bit_identical_across_ranks(_weights_and_slots(model),
                                     "weights and optimizer state")

  gbs = _gbs(strategy)
  ev = model.evaluate(xv, yv, batch_size=gbs, verbose=0, return_dict=True)
  ref_ev = ref.evaluate(xv, yv, batch_size=gbs, verbose=0, return_dict=True)
  pred = model.predict(xv, batch_size=gbs, verbose=0)
  ref_pred = ref.predict(xv, batch_size=gbs, verbose=0)

  _assert_close([w.numpy() for w in model.weights],
                [w.numpy() for w in ref.weights], "weights")
  _assert_close([v.numpy() for v in model.optimizer.variables],
                [v.numpy() for v in ref.optimizer.variables],
                "optimizer variables")
  assert int(model.optimizer.iterations.numpy()) == (
      2 * N_SAMPLES // gbs)
  for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
    _assert_close(hist.history[key], ref_hist.history[key], key)
  assert len(cb.epochs) == 2 and cb.epochs[-1].keys() == ref_cb.epochs[
      -1].keys()
  for key in ev:
    _assert_close([ev[key]], [ref_ev[key]], "evaluate " + key)
  assert pred.shape == (len(xv), 10), "predict must return every row"
  _assert_close([pred], [ref_pred], "predict", rel=1e-4)
  _assert_bit_identical_across_ranks([pred], "predictions")


@pytest.mark.timeout(300)
def test_fit_shuffle_partitions_the_data(strategy, digits):
  """Unseeded shuffle draws the same order on every rank (seed broadcast)."""
  x, y, _, _ = digits
  gbs = _gbs(strategy)
  ids = np.arange(N_SAMPLES, dtype=np.float32)[:, None]
  xi = np.concatenate([ids, x], axis=1)
  # Seed numpy/TF differently per rank *after* the strategy exists: the data
  # order still has to agree, because the strategy fixed the TF global seed.
  with strategy.scope():
    seen = tf.Variable(tf.zeros([N_SAMPLES]), trainable=False,
                       synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=tf.VariableAggregation.SUM)

    class IdModel(keras.Model):

      def __init__(self):
        super().__init__()
        self.body = _mlp()

      def call(self, inputs):
        return self.body(inputs[:, 1:])

      def train_step(self, data):
        xb, _ = data
        ids = tf.cast(xb[:, 0], tf.int32)
        seen.assign_add(tf.math.bincount(ids, minlength=N_SAMPLES,
                                         maxlength=N_SAMPLES,
                                         dtype=tf.float32))
        return super().train_step(data)

    model = IdModel()
    _compile(model, "sgd", 1)
  model.fit(xi, y, batch_size=gbs, epochs=2, shuffle=True, verbose=0)
  counts = seen.numpy()  # SUM over ranks
  assert np.array_equal(counts, np.full([N_SAMPLES], 2.0)), (
      "every sample must be seen exactly once per epoch across ranks; "
      f"min {counts.min()} max {counts.max()}")


@pytest.mark.timeout(300)
def test_sparse_embedding_gradients(strategy):
  """Embedding gradients are IndexedSlices; reduced by allgather."""
  rng = np.random.RandomState(0)
  x = rng.randint(0, 50, size=(288, 6)).astype(np.int32)
  y = (x.sum(axis=1) % 2).astype(np.int32)
  gbs = 16 * strategy.num_replicas_in_sync

  def build():
    return keras.Sequential([
        keras.Input((6,), dtype="int32"),
        keras.layers.Embedding(50, 8),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(2)])

  _seed_rank_differently()
  with strategy.scope():
    model = build()
    _compile(model, "sgd", 1)
  init = [w.numpy() for w in model.weights]
  model.fit(x, y, batch_size=gbs, epochs=1, shuffle=False, verbose=0)
  ref = build()
  _compile(ref, "sgd", 1)
  ref.set_weights(init)
  ref.fit(x, y, batch_size=gbs, epochs=1, shuffle=False, verbose=0)
  _assert_bit_identical_across_ranks(_weights_and_slots(model), "embedding")
  _assert_close([w.numpy() for w in model.weights],
                [w.numpy() for w in ref.weights], "embedding weights")


@pytest.mark.timeout(300)
def test_synchronized_batch_norm_agrees(strategy, digits):
  """BatchNormalization(synchronized=True): global statistics everywhere."""
  def build():
    return _mlp([keras.layers.BatchNormalization(synchronized=True)])

  model, ref, _, _, _, _, _ = _fit_pair(strategy, digits, 1, "sgd",
                                        build=build, epochs=1)
  _assert_bit_identical_across_ranks(_weights_and_slots(model),
                                     "BN model (incl. moving statistics)")
  _assert_close([w.numpy() for w in model.weights],
                [w.numpy() for w in ref.weights], "BN weights", rel=1e-4)


@pytest.mark.timeout(300)
def test_unsynchronized_batch_norm_statistics_stay_identical(strategy, digits):
  """BatchNormalization(synchronized=False): no per-rank drift."""
  def build():
    return keras.Sequential([
        keras.Input((64,)), keras.layers.BatchNormalization(),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.BatchNormalization(), keras.layers.Dense(10)])

  model, ref, _, _, _, _, _ = _fit_pair(strategy, digits, 2, "sgd",
                                        build=build, epochs=1)
  # Every rank saw different rows; the moving statistics must still agree
  # bit for bit (they are what predict uses and what checkpoints save).
  _assert_bit_identical_across_ranks(_weights_and_slots(model),
                                     "weights incl. BN moving statistics")
  # The first layer normalizes the inputs themselves, so its moving mean is
  # the single-process one: the global batch's mean is the mean of the
  # equal shards' means.
  first, ref_first = model.layers[0], ref.layers[0]
  _assert_close([first.moving_mean.numpy()], [ref_first.moving_mean.numpy()],
                "first BN moving mean")
  if mpistrategy.size() > 1:
    # The statistics moved away from their initial values.
    assert not np.allclose(first.moving_mean.numpy(), 0.0)


@pytest.mark.parametrize("source", ["PyDataset", "from_generator"])
def test_batches_from_python_leave_the_users_arrays_alone(strategy, source):
  # A PyDataset's (or a generator's) numpy batches reach TensorFlow without
  # a copy; after the ranks' split the step's kernels reused a label buffer
  # in place and wrote over the user's own array (labels of later epochs
  # were gradients).  The labels are row ids: their sum checks every row.
  rows, batch = 24, 6
  x = np.zeros((rows, 3), np.float32)
  x[:, 0] = np.arange(rows) / rows
  y = np.arange(rows, dtype=np.float32).reshape(rows, 1)
  x_before, y_before = x.copy(), y.copy()

  class Batches(keras.utils.PyDataset):
    def __len__(self):
      return rows // batch

    def __getitem__(self, i):
      return x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]

  def generated():
    for i in range(rows // batch):
      yield x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]

  class LabelSum(keras.metrics.Metric):
    def __init__(self, name="label_sum", **kwargs):
      super().__init__(name=name, **kwargs)
      self.total = self.add_weight(name="total", shape=(),
                                   initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
      del y_pred, sample_weight
      self.total.assign_add(tf.reduce_sum(y_true))

    def result(self):
      return self.total

  with strategy.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse",
                  metrics=[LabelSum()])
  if source == "PyDataset":
    data = Batches()
  else:
    data = tf.data.Dataset.from_generator(generated, output_signature=(
        tf.TensorSpec([None, 3]), tf.TensorSpec([None, 1])))
  history = model.fit(data, epochs=12, verbose=0, shuffle=False)
  np.testing.assert_array_equal(y, y_before)
  np.testing.assert_array_equal(x, x_before)
  assert history.history["label_sum"] == [rows * (rows - 1) / 2] * 12


def test_a_python_generator_is_refused_by_fit_and_evaluate(strategy):
  # Keras' generator adapter gives the ranks batches out of step (rows
  # missed or repeated, no error): refused on every rank; predict keeps it.
  with strategy.scope():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
  def pairs():
    for _ in range(4):
      yield np.ones([4, 2], np.float32), np.ones([4, 1], np.float32)
  def inputs():
    for _ in range(4):
      yield (np.ones([4, 2], np.float32),)
  calls = [("Model.fit", lambda: model.fit(pairs(), epochs=1, verbose=0)),
           ("Model.fit", lambda: model.fit(
               np.ones([8, 2]), np.ones([8, 1]), validation_data=pairs(),
               verbose=0)),
           ("Model.evaluate", lambda: model.evaluate(pairs(), verbose=0))]
  for call, run_call in calls:
    if mpistrategy.size() == 1:
      run_call()
      continue
    with pytest.raises(ValueError,
                       match=f"a Python generator as the data of {call} is "
                       f"not supported with {mpistrategy.size()} ranks"):
      run_call()
  assert model.predict(inputs(), verbose=0).shape == (16, 1)


class _StopAt(keras.callbacks.Callback):
  """Sets model.stop_training after a batch or an epoch, on some ranks."""

  def __init__(self, batch=None, epoch=None, ranks=None):
    super().__init__()
    self.batch, self.epoch = batch, epoch
    self.ranks = ranks

  def _mine(self):
    return self.ranks is None or mpistrategy.rank() in self.ranks

  def on_train_batch_end(self, batch, logs=None):
    if batch == self.batch and self._mine():
      self.model.stop_training = True

  def on_epoch_end(self, epoch, logs=None):
    if epoch == self.epoch and self._mine():
      self.model.stop_training = True


@pytest.mark.timeout(300)
def test_a_loop_stopped_on_some_ranks_fails_on_every_rank(strategy):
  # A callback that stops fit on rank 0 only (its own clock, say) used to
  # leave the other ranks waiting in the next step for ever.
  with strategy.scope():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
  x, y = np.ones([64, 2], np.float32), np.ones([64, 1], np.float32)
  fit = dict(x=x, y=y, batch_size=4, verbose=0)  # 16 steps an epoch

  # Every rank stops at the same step: fit ends there, as in one process.
  for stop in (_StopAt(batch=2), _StopAt(epoch=1)):
    model.fit(**fit, epochs=3, callbacks=[stop])
    steps = int(model.optimizer.iterations.numpy())
    model.optimizer.iterations.assign(0)
    assert steps == (3 if stop.batch is not None else 32), steps

  if mpistrategy.size() == 1:
    return
  for stop in (_StopAt(batch=2, ranks=[0]), _StopAt(epoch=0, ranks=[0])):
    with pytest.raises(tf.errors.FailedPreconditionError) as info:
      model.fit(**fit, epochs=3, callbacks=[stop])
    text = info.value.message
    if mpistrategy.rank() == 0:
      where = ("after batch 2" if stop.batch is not None else
               "at the end of epoch 0")
      assert f"rank 0 set model.stop_training {where}, but other ranks " \
             "went on" in text, text
    else:
      assert "Model.fit stop_training" in text, text

  # evaluate's and predict's own flags, likewise.
  class StopTest(keras.callbacks.Callback):

    def on_test_batch_end(self, batch, logs=None):
      if batch == 1 and mpistrategy.rank() == 0:
        self.model.stop_evaluating = True

    def on_predict_batch_end(self, batch, logs=None):
      if batch == 1 and mpistrategy.rank() == 0:
        self.model.stop_predicting = True

  for call, flag in (("evaluate", "stop_evaluating"),
                     ("predict", "stop_predicting")):
    with pytest.raises(tf.errors.FailedPreconditionError) as info:
      if call == "evaluate":
        model.evaluate(x, y, batch_size=4, verbose=0, callbacks=[StopTest()])
      else:
        model.predict(x, batch_size=4, verbose=0, callbacks=[StopTest()])
    text = info.value.message
    if mpistrategy.rank() == 0:
      assert f"rank 0 set model.{flag} after batch 1" in text, text
    else:
      assert f"Model.{call} {flag}" in text, text
  # The engine goes on: a fit on every rank works.
  model.fit(**fit, epochs=1)


def test_uneven_batches_and_an_empty_rank(strategy):
  """Global batches that do not split evenly, and a rank with no rows.

  Keras builds the model from the first distributed batch (it used to
  all-reduce it, which fails when the shards differ in shape); batch norm
  moving statistics weight each rank by its rows, so they equal the global
  batch's and a rank without rows (NaN moments) does not poison them, nor
  the gradients of gamma and beta.
  """
  size = mpistrategy.size()
  batch = 4 * size + 1              # shards differ by one row
  rows = batch + size - 1           # the last batch leaves one rank empty
  rng = np.random.RandomState(7)
  x = rng.randn(rows, 4).astype(np.float32) + 3.0
  y = rng.randn(rows, 1).astype(np.float32)
  momentum = 0.5
  with strategy.scope():
    model = keras.Sequential([
        keras.Input((4,)),
        keras.layers.BatchNormalization(momentum=momentum),
        keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
  model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
  expected = np.zeros(4)
  for start in (0, batch):
    expected = (momentum * expected +
                (1 - momentum) * x[start:start + batch].mean(axis=0))
  moving_mean = model.layers[0].moving_mean.numpy()
  np.testing.assert_allclose(moving_mean, expected, rtol=1e-5)
  _assert_bit_identical_across_ranks([moving_mean], "BN moving mean")
  for w in model.weights:
    assert np.isfinite(w.numpy()).all(), f"{w.path}: {w.numpy()}"
  # Fewer rows than ranks.
  x_few, y_few = x[:size - 1 or 1], y[:size - 1 or 1]
  loss = model.evaluate(x_few, y_few, batch_size=batch, verbose=0)
  prediction = model.predict(x_few, batch_size=batch, verbose=0)
  np.testing.assert_allclose(loss, np.mean((prediction - y_few) ** 2),
                             rtol=1e-5)


class _CountRows(keras.metrics.Metric):
  """The Keras guides' custom-metric pattern: `result()` is the variable."""

  def __init__(self, name="rows", **kwargs):
    super().__init__(name=name, **kwargs)
    self.count = self.add_variable(shape=(), name="count",
                                   initializer="zeros")

  def update_state(self, y_true, y_pred, sample_weight=None):
    del y_pred, sample_weight
    self.count.assign_add(tf.cast(tf.shape(y_true)[0], tf.float32))

  def result(self):
    return self.count

  def reset_state(self):
    self.count.assign(0.0)


def test_metric_whose_result_is_its_variable_counts_every_rank(strategy):
  # Reducing the returned keras.Variable failed ("Cannot convert
  # `input_tensor` to a `PerReplica` object"); its value is the count over
  # all ranks, as in one process.
  size = mpistrategy.size()
  rows = 12 * size + 1                  # a short last batch
  x = np.ones((rows, 4), np.float32)
  y = np.ones((rows, 1), np.float32)
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", metrics=[_CountRows()])
  history = model.fit(x, y, batch_size=4 * size, epochs=2, verbose=0)
  assert history.history["rows"] == [float(rows)] * 2
  _, counted = model.evaluate(x, y, batch_size=4 * size, verbose=0)
  assert counted == rows


@pytest.mark.timeout(300)
def test_compile_outside_the_scope_logs_the_global_loss(strategy, digits):
  # Keras 3 makes the loss tracker (and an optimizer given by name) in
  # compile; outside the scope each rank logged its own loss, and callbacks
  # reading it acted at different epochs on different ranks.
  x, y, _, _ = digits
  _seed_rank_differently()
  with strategy.scope():
    model = _mlp()
  init = [w.numpy() for w in model.weights]
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  model.compile(optimizer="sgd", loss=loss_fn)
  history = model.fit(x, y, batch_size=_gbs(strategy), epochs=2,
                      shuffle=False, verbose=0)
  loss = model.evaluate(x, y, batch_size=_gbs(strategy), verbose=0)

  ref = _mlp()
  ref.compile(optimizer="sgd", loss=loss_fn)
  ref.set_weights(init)
  ref_history = ref.fit(x, y, batch_size=_gbs(strategy), epochs=2,
                        shuffle=False, verbose=0)
  _assert_close(history.history["loss"], ref_history.history["loss"], "loss")
  _assert_close([loss], [ref.evaluate(x, y, batch_size=_gbs(strategy),
                                      verbose=0)], "evaluate")
  _assert_bit_identical_across_ranks(
      history.history["loss"] + [loss] + model.get_weights(), "logs")


def test_compile_in_the_scope_of_a_model_made_outside_it_is_refused(strategy):
  # Keras failed in fit's first update, with a bare AssertionError.
  model = _mlp()
  with strategy.scope():
    with pytest.raises(ValueError, match="the model was created outside it"):
      model.compile(optimizer="adam", loss="mse")


def test_a_batch_size_that_differs_between_ranks_is_refused_everywhere(
    strategy):
  # Keras' array input hides its batch size from the dataset check: the
  # ranks went into different steps and waited there.
  rank = mpistrategy.rank()
  x = np.ones((48, 4), np.float32)
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
  with pytest.raises(ValueError, match=r"Model.fit: the ranks' inputs differ "
                     r"\(rank 0: batch_size 8, 6 batches, 48 rows; rank 1: "
                     r"batch_size 9, 6 batches, 48 rows"):
    model.fit(x, x[:, :1], batch_size=8 + rank, verbose=0)
  # As many batches from fewer rows (48 and 42 rows of 8): each rank
  # trained on data of its own, without a word.
  with pytest.raises(ValueError, match=r"rank 1: batch_size 8, 6 batches, "
                     r"42 rows"):
    model.fit(x[:48 - 6 * rank], x[:48 - 6 * rank, :1], batch_size=8,
              verbose=0)
  with pytest.raises(ValueError, match="Model.predict: the ranks' inputs"):
    model.predict(x[:48 - 8 * rank], batch_size=8, verbose=0)


class ModelWithoutCall(keras.Model):
  """The Keras guide's GAN pattern: parts, a train_step, no call()."""

  def __init__(self):
    super().__init__()
    self.part = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    self.loss_tracker = keras.metrics.Mean(name="loss")

  @property
  def metrics(self):
    return [self.loss_tracker]

  def compile(self, part_optimizer):  # pylint: disable=arguments-differ
    super().compile()
    self.part_optimizer = part_optimizer

  def train_step(self, data):
    x, y = data
    with tf.GradientTape() as tape:
      # A loss object: divided by the number of replicas under a strategy.
      loss = keras.losses.MeanSquaredError()(y, self.part(x))
    weights = self.part.trainable_weights
    self.part_optimizer.apply_gradients(
        zip(tape.gradient(loss, weights), weights))
    self.loss_tracker.update_state(loss)
    return {"loss": self.loss_tracker.result()}


@pytest.mark.timeout(300)
def test_a_model_without_call_trains_as_in_one_process(strategy):
  # Under a strategy, Keras built the model from a batch before fit, which
  # a model without call() cannot do ("Unable to automatically build").
  size = mpistrategy.size()
  x = np.random.RandomState(3).rand(16 * size, 4).astype(np.float32)
  y = x.sum(axis=1, keepdims=True)
  with strategy.scope():
    model = ModelWithoutCall()
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9))
  init = model.part.get_weights()
  model.fit(x, y, batch_size=4 * size, epochs=2, shuffle=False, verbose=0)

  ref = ModelWithoutCall()
  ref.compile(keras.optimizers.SGD(0.05, momentum=0.9))
  ref.part.set_weights(init)
  ref.fit(x, y, batch_size=4 * size, epochs=2, shuffle=False, verbose=0)
  _assert_close(model.part.get_weights(), ref.part.get_weights(), "weights")
  _assert_bit_identical_across_ranks(
      model.part.get_weights() + [model.part_optimizer.iterations.numpy()],
      "weights")
  assert int(model.part_optimizer.iterations.numpy()) == 8


def test_fit_on_per_rank_datasets_of_different_lengths(strategy):
  """distribute_datasets_from_function with r + 2 batches on rank r.

  Keras sizes the epoch by the dataset's cardinality, which is per rank;
  the strategy makes it unknown when the ranks disagree, so every rank
  steps until all are exhausted instead of waiting in different
  collectives.
  """
  x = np.arange(40, dtype=np.float32).reshape(20, 2) / 40.0
  y = x.sum(axis=1, keepdims=True)
  with strategy.scope():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")

  def dataset_fn(context):
    batches = context.input_pipeline_id + 2
    return tf.data.Dataset.from_tensor_slices(
        (x[:2 * batches], y[:2 * batches])).batch(2)

  dataset = strategy.distribute_datasets_from_function(dataset_fn)
  history = model.fit(dataset, epochs=2, verbose=0)
  assert np.isfinite(history.history["loss"]).all()
  _assert_bit_identical_across_ranks(
      [w.numpy() for w in model.weights], "weights after uneven per-rank data")


@pytest.mark.timeout(300)
def test_mixed_float16_one_rank_overflows(strategy, digits):
  """Only rank 1 overflows: every rank skips the same steps, no hang."""
  x, y, _, _ = digits
  gbs = _gbs(strategy)
  n = 4 * gbs
  xs = x[:n].copy()
  # Rank 1's shard of every global batch is scaled by 1e4 -> inf in float16.
  per = PER_REPLICA_BATCH
  mask = np.zeros([n], bool)
  for start in range(0, n, gbs):
    mask[start + per:start + 2 * per] = True
  xs[mask] *= 1e4
  keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    _seed_rank_differently()
    with strategy.scope():
      model = _mlp()
      _compile(model, "sgd", 2)
    assert isinstance(model.optimizer,
                      keras.optimizers.LossScaleOptimizer)
    model.fit(xs, y[:n], batch_size=gbs, epochs=1, shuffle=False, verbose=0)
  finally:
    keras.mixed_precision.set_global_policy("float32")
  opt = model.optimizer
  scale = float(opt.dynamic_scale.numpy())
  it = int(opt.inner_optimizer.iterations.numpy())
  _assert_bit_identical_across_ranks(
      _weights_and_slots(model) + [np.float64(scale), np.int64(it)],
      "mixed_float16 state")
  if mpistrategy.size() > 1:
    assert it == 0, "every step had an overflow on rank 1: all must skip"
    assert scale < 32768.0


@pytest.mark.timeout(300)
def test_mixed_bfloat16_fit(strategy, digits):
  x, y, _, _ = digits
  keras.mixed_precision.set_global_policy("mixed_bfloat16")
  try:
    _seed_rank_differently()
    with strategy.scope():
      model = _mlp()
      _compile(model, "adam", 1)
    model.fit(x[:4 * _gbs(strategy)], y[:4 * _gbs(strategy)],
              batch_size=_gbs(strategy), epochs=1, verbose=0)
  finally:
    keras.mixed_precision.set_global_policy("float32")
  _assert_bit_identical_across_ranks(_weights_and_slots(model),
                                     "mixed_bfloat16 state")
  assert int(model.optimizer.iterations.numpy()) == 4


@pytest.mark.timeout(120)
def test_progress_bar_only_on_rank_0(strategy, digits, capsys):
  x, y, _, _ = digits
  with strategy.scope():
    model = _mlp()
    _compile(model, "sgd", 1)
  model.fit(x[:2 * _gbs(strategy)], y[:2 * _gbs(strategy)],
            batch_size=_gbs(strategy), epochs=1, verbose=2)
  out = capsys.readouterr().out
  if mpistrategy.rank() == 0:
    assert "loss" in out
  else:
    assert "loss" not in out, out


@pytest.mark.timeout(120)
def test_fit_of_a_model_built_outside_the_scope_warns(strategy, caplog):
  # It trains on each rank's own data alone, nothing averaged: the ranks'
  # weights parted ways without a word.
  del strategy  # created: the patches are in place
  x = np.ones([8, 3], np.float32)
  y = np.ones([8, 1], np.float32)
  caplog.clear()
  with caplog.at_level("WARNING", logger="tensorflow"):
    alone = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)],
                             name="built_outside_the_scope")
    alone.compile(optimizer="sgd", loss="mse")
    alone.fit(x, y, epochs=1, verbose=0)
  warned = [r.message for r in caplog.records
            if "built_outside_the_scope" in r.message]
  assert len(warned) == (1 if mpistrategy.rank() == 0 and
                         mpistrategy.size() > 1 else 0), warned
  if warned:
    assert "trains it on each rank alone" in warned[0]
    assert "inside `with strategy.scope():`" in warned[0]
