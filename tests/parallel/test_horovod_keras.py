"""mpistrategy.horovod.tensorflow.keras under mpirun: Horovod's Keras API.

    tests/mpirun_pytest.sh 2 900 tests/parallel/test_horovod_keras.py
    tests/mpirun_pytest.sh 3 900 tests/parallel/test_horovod_keras.py

`model.fit` with `hvd.DistributedOptimizer` is compared with one process
training the same model on the global batch; the callbacks against their
closed forms.
"""

import os
import shutil
import tempfile

import numpy as np
import pytest
import tensorflow as tf
import keras

import mpistrategy.horovod.tensorflow as hvd_tf
import mpistrategy.horovod.tensorflow.keras as hvd
from mpistrategy.horovod.tensorflow import gradients as hvd_gradients

RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK",
                          os.environ.get("PMI_RANK", "0")))
SIZE = int(os.environ.get("OMPI_COMM_WORLD_SIZE",
                          os.environ.get("PMI_SIZE", "1")))
S = SIZE * (SIZE + 1) / 2
LOCAL_BATCH = 8
STEPS = 6


@pytest.fixture(autouse=True, scope="module")
def _initialized():
  hvd.init()
  yield


def _data():
  """The global data set (identical on every rank) and this rank's shard.

  Rank r's batch i is rows [(i * SIZE + r) * B, ... + B) of the global data,
  so the global batch i is the concatenation of the ranks' batches i.
  """
  rng = np.random.default_rng(7)
  n = LOCAL_BATCH * SIZE * STEPS
  x = rng.normal(size=[n, 5]).astype(np.float32)
  y = (x @ np.arange(1, 6, dtype=np.float32)[:, None] + 0.5).astype(
      np.float32)
  idx = np.concatenate([
      np.arange((i * SIZE + RANK) * LOCAL_BATCH,
                (i * SIZE + RANK + 1) * LOCAL_BATCH) for i in range(STEPS)])
  return x, y, x[idx], y[idx]


def _model(seed):
  keras.utils.set_random_seed(seed)
  return keras.Sequential([keras.Input((5,)), keras.layers.Dense(3),
                           keras.layers.Dense(1)])


def _all_equal_across_ranks(weights):
  digest = np.concatenate([w.ravel() for w in weights]).astype(np.float64)
  gathered = hvd.allgather(digest[None, :])
  return all(np.array_equal(gathered[0], g) for g in gathered)


def test_fit_matches_one_process_on_the_global_batch():
  x, y, local_x, local_y = _data()
  model = _model(seed=1)  # the same initial weights on every rank
  reference = _model(seed=1)
  model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)),
                loss="mse", experimental_run_tf_function=False)
  model.fit(local_x, local_y, batch_size=LOCAL_BATCH, epochs=2, shuffle=False,
            verbose=0)
  reference.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
  reference.fit(x, y, batch_size=LOCAL_BATCH * SIZE, epochs=2, shuffle=False,
                verbose=0)
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  assert int(model.optimizer.iterations.numpy()) == 2 * STEPS


@pytest.mark.timeout(180)
def test_mixed_float16_overflow_on_one_rank_skips_the_step_everywhere():
  # Keras wraps the DistributedOptimizer in a LossScaleOptimizer, whose
  # "finite" branch alone runs the optimizer's reducing `apply`: the rank
  # whose float16 gradients overflow must not take the other branch alone
  # (that stalled until the stall timeout).
  _, _, local_x, local_y = _data()
  if RANK == SIZE - 1:
    local_x = local_x * 1e4  # only this rank's gradients overflow
  keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    model = _model(seed=1)
    model.compile(
        optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)),
        loss="mse")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    model.fit(local_x, local_y, batch_size=LOCAL_BATCH, epochs=1,
              shuffle=False, verbose=0)
  finally:
    keras.mixed_precision.set_global_policy("float32")
  scale = float(model.optimizer.dynamic_scale.numpy())
  assert scale < 2.0 ** 15, scale  # it did skip steps (halving the scale)
  assert _all_equal_across_ranks(
      model.get_weights() + [np.array([scale])])


def test_broadcast_callback_makes_every_rank_equal():
  _, _, local_x, local_y = _data()
  model = _model(seed=100 + RANK)  # different initial weights per rank
  opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
  model.compile(optimizer=opt, loss="mse")
  assert not _all_equal_across_ranks(model.get_weights()) or SIZE == 1
  model.fit(local_x, local_y, batch_size=LOCAL_BATCH, epochs=1, verbose=0,
            callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
  assert _all_equal_across_ranks(model.get_weights())
  assert _all_equal_across_ranks(
      [np.asarray(v.numpy()) for v in opt.variables])


def test_broadcast_callback_keeps_local_variables():
  # Horovod 0.28's local_variables (and register_local_var): those keep
  # each rank's own value, the rest take rank 0's.
  def layer(value):
    init = keras.initializers.Constant(value)
    return keras.layers.Dense(3, kernel_initializer=init,
                              bias_initializer=init, trainable=False)

  model = keras.Sequential([keras.Input((3,)), layer(RANK), layer(RANK),
                            layer(RANK)])
  model.compile(loss="mse")
  first, second, third = model.layers
  callback = hvd.callbacks.BroadcastGlobalVariablesCallback(
      0, local_variables=list(first.variables))
  callback.register_local_var(third.kernel)
  model.fit(np.ones((1, 3)), np.ones((1, 3)), callbacks=[callback],
            verbose=0)
  assert float(first.kernel.numpy()[0, 0]) == RANK
  assert float(first.bias.numpy()[0]) == RANK
  assert float(second.kernel.numpy()[0, 0]) == 0
  assert float(third.kernel.numpy()[0, 0]) == RANK
  assert float(third.bias.numpy()[0]) == 0
  with pytest.raises(ValueError, match="local_variables"):
    hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[1.0])


def test_backward_passes_per_step_in_fit():
  x, y, local_x, local_y = _data()
  model = _model(seed=1)
  reference = _model(seed=1)
  opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05),
                                 backward_passes_per_step=2,
                                 average_aggregated_gradients=True)
  model.compile(optimizer=opt, loss="mse")
  model.fit(local_x, local_y, batch_size=LOCAL_BATCH, epochs=1,
            shuffle=False, verbose=0)
  assert int(opt.iterations.numpy()) == STEPS  # counts skipped steps too
  # Closed form: every second step applies the mean of the gradients of
  # two consecutive global batches, both taken at the same weights.
  reference.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
  for i in range(0, STEPS, 2):
    rows = slice(i * SIZE * LOCAL_BATCH, (i + 2) * SIZE * LOCAL_BATCH)
    grads = []
    for half in (slice(rows.start, rows.start + SIZE * LOCAL_BATCH),
                 slice(rows.start + SIZE * LOCAL_BATCH, rows.stop)):
      with tf.GradientTape() as tape:
        loss = keras.losses.mean_squared_error(
            y[half], reference(x[half]))
        loss = tf.reduce_mean(loss)
      grads.append(tape.gradient(loss, reference.trainable_variables))
    for v, g0, g1 in zip(reference.trainable_variables, *grads):
      v.assign_sub(0.05 * (g0 + g1) / 2)
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_metric_average_callback():
  callback = hvd.callbacks.MetricAverageCallback()
  logs = {"loss": RANK + 1.0, "accuracy": np.float32(2.0 * (RANK + 1)),
          "name": "not a number"}
  callback.on_epoch_end(0, logs)
  assert logs["loss"] == pytest.approx(S / SIZE)
  assert logs["accuracy"] == pytest.approx(2 * S / SIZE)
  assert logs["name"] == "not a number"


class _RecordLr(keras.callbacks.Callback):

  def __init__(self):
    super().__init__()
    self.rates = []

  def on_train_batch_begin(self, batch, logs=None):
    self.rates.append(float(self.model.optimizer.learning_rate.numpy()))


def _fit_recording(callback, epochs=3, steps=4, optimizer=None):
  _, _, local_x, local_y = _data()
  model = _model(seed=1)
  model.compile(optimizer=hvd.DistributedOptimizer(
      optimizer or keras.optimizers.Adam(1.0)), loss="mse")
  record = _RecordLr()
  model.fit(local_x[:steps * 2], local_y[:steps * 2], batch_size=2,
            epochs=epochs, verbose=0, callbacks=[callback, record])
  return record.rates


def test_learning_rate_warmup_callback():
  initial, warmup, steps = 0.4 * SIZE, 2, 4
  rates = _fit_recording(hvd.callbacks.LearningRateWarmupCallback(
      initial_lr=initial, warmup_epochs=warmup))
  # Horovod counts the batch as done: e = epoch + (batch + 1) / steps, so the
  # warmup's last batch and everything after it train with `initial`.
  want = []
  for epoch in range(3):
    for batch in range(steps):
      e = min(epoch + (batch + 1) / steps, warmup)
      want.append(initial / SIZE * (e * (SIZE - 1) / warmup + 1))
  np.testing.assert_allclose(rates, want, rtol=1e-6)
  assert rates[warmup * steps - 1] == pytest.approx(initial)


def test_learning_rate_warmup_prints_on_rank_0_only(capsys):
  _fit_recording(hvd.callbacks.LearningRateWarmupCallback(
      initial_lr=0.4, warmup_epochs=1, verbose=1), epochs=1)
  printed = "finished gradual learning rate warmup" in capsys.readouterr().out
  assert printed == (RANK == 0)


@pytest.mark.parametrize("staircase", [True, False])
def test_constant_multiplier_decays_from_start_epoch(staircase):
  # Horovod >= 0.23: a constant m means initial_lr * m ** (epoch - start).
  rates = _fit_recording(hvd.callbacks.LearningRateScheduleCallback(
      initial_lr=0.5, multiplier=0.5, start_epoch=1, end_epoch=3,
      staircase=staircase))
  if staircase:
    want = [1.0] * 4 + [0.5] * 4 + [0.25] * 4
  else:
    want = [1.0] * 4 + [0.5 * 0.5 ** (e + b / 4 - 1)
                        for e in (1, 2) for b in range(4)]
  np.testing.assert_allclose(rates, want, rtol=1e-6)


def test_learning_rate_schedule_callback():
  rates = _fit_recording(hvd.callbacks.LearningRateScheduleCallback(
      initial_lr=0.5, multiplier=lambda epoch: 0.1 ** epoch, start_epoch=1,
      end_epoch=3))
  # Epoch 0 untouched (Adam(1.0)), then staircase 0.5 * 0.1 ** epoch.
  want = [1.0] * 4 + [0.05] * 4 + [0.005] * 4
  np.testing.assert_allclose(rates, want, rtol=1e-6)


def test_schedule_callback_warns_about_momentum_correction():
  with pytest.warns(UserWarning, match="momentum_correction"):
    _fit_recording(hvd.callbacks.LearningRateScheduleCallback(
        initial_lr=0.1, multiplier=1.0), epochs=1,
                   optimizer=keras.optimizers.SGD(0.1, momentum=0.9))


def test_keras_functions_return_numpy():
  out = hvd.allreduce([RANK + 1.0, 1.0])
  assert isinstance(out, np.ndarray)
  np.testing.assert_allclose(out, [S / SIZE, 1.0])
  np.testing.assert_allclose(hvd.allreduce([RANK + 1.0], op=hvd.Sum), [S])
  np.testing.assert_array_equal(hvd.allgather([RANK]), np.arange(SIZE))
  np.testing.assert_array_equal(hvd.broadcast([RANK, 5], SIZE - 1),
                                [SIZE - 1, 5])
  part = hvd.reducescatter(np.full([SIZE, 2], RANK + 1.0))
  np.testing.assert_allclose(part, np.full([1, 2], S / SIZE))


def test_load_model_keeps_state_and_distributes():
  _, _, local_x, local_y = _data()
  # Every rank builds and trains the same objects (no collectives: a plain
  # optimizer): Keras numbers unnamed layers and optimizers per process, and
  # those names end up in the name scopes that pair collectives across
  # ranks, so a rank that built extra ones would pair later collectives
  # wrongly.  Only rank 0 saves.
  model = _model(seed=1)
  model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
  model.fit(local_x, local_y, batch_size=LOCAL_BATCH, epochs=1, verbose=0)
  path = None
  if RANK == 0:
    path = os.path.join(tempfile.mkdtemp(prefix="hvd-keras-"), "m.keras")
    model.save(path)
  path = hvd_tf.broadcast_object(path, root_rank=0)  # after rank 0 saved
  loaded = hvd.load_model(path)
  assert isinstance(loaded.optimizer, hvd_gradients._DistributedOptimizerMixin)  # pylint: disable=protected-access
  assert int(loaded.optimizer.iterations.numpy()) == STEPS
  # Different data per rank; averaged gradients keep the ranks equal.
  loaded.fit(local_x * (RANK + 1), local_y, batch_size=LOCAL_BATCH, epochs=1,
             verbose=0)
  assert _all_equal_across_ranks(loaded.get_weights())
  hvd_tf.barrier()  # every rank has loaded it
  if RANK == 0:
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def test_every_rank_saving_one_path_leaves_one_ranks_whole_file():
  # Without MPIStrategy each rank writes what it saves itself (Horovod's
  # rule), and atomically: ranks saving one path at once used to fail in
  # h5py's file lock or leave a .keras zip mixed from several writers.
  model = _model(seed=RANK + 10)  # every rank's weights differ
  model.compile(optimizer="sgd", loss="mse")
  model.build((None, 5))
  digests = hvd_tf.allgather_object(_digest(model.get_weights()))
  directory = hvd_tf.broadcast_object(
      tempfile.mkdtemp(prefix="hvd-save-") if RANK == 0 else None,
      root_rank=0)
  paths = {"keras": os.path.join(directory, "m.keras"),
           "h5": os.path.join(directory, "m.weights.h5"),
           "ckpt": os.path.join(directory, "ckpt")}
  for _ in range(3):
    hvd_tf.barrier()
    model.save(paths["keras"])
    model.save_weights(paths["h5"])
    tf.train.Checkpoint(model=model).write(paths["ckpt"])
  hvd_tf.barrier()
  loaded = {"keras": keras.models.load_model(paths["keras"]).get_weights()}
  other = _model(seed=0)
  other.build((None, 5))
  other.load_weights(paths["h5"])
  loaded["h5"] = other.get_weights()
  tf.train.Checkpoint(model=other).read(paths["ckpt"]).expect_partial()
  loaded["ckpt"] = other.get_weights()
  for kind, weights in loaded.items():
    assert _digest(weights) in digests, kind
  assert sorted(os.listdir(directory)) == [
      "ckpt.data-00000-of-00001", "ckpt.index", "m.keras", "m.weights.h5"]
  hvd_tf.barrier()
  if RANK == 0:
    shutil.rmtree(directory, ignore_errors=True)


def _digest(arrays):
  return b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)


def test_auto_jit_compile_is_off_for_the_distributed_optimizer(monkeypatch):
  # Keras resolves "auto" to XLA where it sees a GPU and no strategy (a
  # Horovod script): the optimizer's collectives have no XLA kernels, so
  # such a script failed at its first step.  A GPU is pretended here.
  physical = tf.config.list_physical_devices
  monkeypatch.setattr(tf.config, "list_physical_devices", lambda *a: [
      *physical(*a), tf.config.PhysicalDevice("/physical_device:GPU:0",
                                              "GPU")])
  plain, distributed = _model(seed=1), _model(seed=1)
  plain.compile(optimizer="sgd", loss="mse")
  assert plain.jit_compile  # what Keras does on a GPU
  distributed.compile(optimizer=hvd.DistributedOptimizer(
      keras.optimizers.SGD()), loss="mse", experimental_run_tf_function=False)
  assert not distributed.jit_compile
  asked = _model(seed=1)
  asked.compile(hvd.DistributedOptimizer(keras.optimizers.SGD()), "mse",
                jit_compile=True)
  assert asked.jit_compile  # as asked


def test_keras_unsupported():
  with pytest.raises(NotImplementedError, match="broadcast_variables"):
    hvd.broadcast_global_variables(0)
  with pytest.raises(NotImplementedError, match="device"):
    hvd.callbacks.MetricAverageCallback(device="/gpu:0")
  with pytest.raises(NotImplementedError, match="Adasum"):
    hvd.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Adasum)
  for op in (hvd.Min, hvd.Max, hvd.Product):  # Horovod refuses them too
    with pytest.raises(ValueError, match="only supports Average and Sum"):
      hvd.DistributedOptimizer(keras.optimizers.SGD(), op=op)
  with pytest.raises(NotImplementedError, match="process set"):
    hvd.add_process_set([0])
  with pytest.raises(NotImplementedError, match="process set"):
    hvd.remove_process_set(hvd.global_process_set)


def test_keras_module_has_horovods_names():
  # horovod.tensorflow.keras (0.28) exports these beside the collectives.
  for name in ("init", "shutdown", "is_initialized", "start_timeline",
               "stop_timeline", "size", "local_size", "cross_size", "rank",
               "local_rank", "cross_rank", "mpi_threads_supported",
               "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
               "ProcessSet", "global_process_set", "add_process_set",
               "remove_process_set", "nccl_built", "ddl_built", "ccl_built",
               "cuda_built", "rocm_built", "Average", "Sum", "Compression",
               "callbacks", "elastic", "DistributedOptimizer",
               "broadcast_global_variables", "allreduce", "allgather",
               "broadcast", "reducescatter", "load_model"):
    assert hasattr(hvd, name), name
  assert hvd.start_timeline is hvd_tf.start_timeline
