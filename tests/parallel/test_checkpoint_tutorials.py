"""The TF tutorials' save/load steps, with only the strategy line changed.

    tests/mpirun_pytest.sh 2 900 tests/parallel/test_checkpoint_tutorials.py
    tests/mpirun_pytest.sh 3 900 tests/parallel/test_checkpoint_tutorials.py

From tensorflow/docs site/en/tutorials/distribute/: "Multi-worker training
with Keras" (multi_worker_with_keras), "Custom training loop with Keras and
MultiWorkerMirroredStrategy" (multi_worker_with_ctl) and "Save and load a
model using a distribution strategy" (save_and_load), reduced to their save
and load steps, MNIST replaced by random data of the same shape, and
Keras 2 spellings replaced by Keras 3 ones (`.keras` suffixes, `export` for
SavedModels, `reset_state`).  Every rank runs the same code, as every worker
does under MultiWorkerMirroredStrategy; non-chief workers save into
`workertemp_<id>` directories of their own and delete them.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import mpistrategy
from mpistrategy import ops

R = mpistrategy.rank()
N = mpistrategy.size()


def _same_everywhere(arrays):
  flat = np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays])
  allv = ops.allgather(tf.constant(flat[None, :])).numpy()
  return all(np.array_equal(allv[i], allv[0]) for i in range(N))


# -------------------------------------------- the tutorials' own helpers


def mnist_dataset(batch_size):
  rng = np.random.default_rng(0)
  x_train = rng.random((256, 28, 28), np.float32)
  y_train = rng.integers(0, 10, 256).astype(np.int64)
  return tf.data.Dataset.from_tensor_slices(
      (x_train, y_train)).shuffle(256, seed=0).repeat().batch(batch_size)


def build_and_compile_cnn_model():
  model = tf.keras.Sequential([
      tf.keras.layers.InputLayer(shape=(28, 28)),
      tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
      tf.keras.layers.Conv2D(4, 3, activation="relu"),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(16, activation="relu"),
      tf.keras.layers.Dense(10)
  ])
  model.compile(
      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      optimizer=tf.keras.optimizers.SGD(learning_rate=0.001),
      metrics=["accuracy"])
  return model


def _is_chief(task_type, task_id, cluster_spec=None):
  return (task_type is None or task_type == "chief" or
          (task_type == "worker" and task_id == 0 and
           (cluster_spec is None or "chief" not in cluster_spec.as_dict())))


def _get_temp_dir(dirpath, task_id):
  base_dirpath = "workertemp_" + str(task_id)
  temp_dir = os.path.join(dirpath, base_dirpath)
  tf.io.gfile.makedirs(temp_dir)
  return temp_dir


def write_filepath(filepath, task_type, task_id, cluster_spec=None):
  dirpath = os.path.dirname(filepath)
  base = os.path.basename(filepath)
  if not _is_chief(task_type, task_id, cluster_spec):
    dirpath = _get_temp_dir(dirpath, task_id)
  return os.path.join(dirpath, base)


# ------------------------------------ "Multi-worker training with Keras"


@pytest.mark.timeout(300)
def test_keras_tutorial_model_save_and_load(strategy, workdir):
  with strategy.scope():
    multi_worker_model = build_and_compile_cnn_model()
  multi_worker_model.fit(mnist_dataset(16 * N), epochs=1, steps_per_epoch=3,
                         verbose=0)
  model_path = os.path.join(workdir, "keras-model", "model.keras")
  os.makedirs(os.path.dirname(model_path), exist_ok=True)
  task_type, task_id = (strategy.cluster_resolver.task_type,
                        strategy.cluster_resolver.task_id)
  assert _is_chief(task_type, task_id) == (R == 0)
  write_model_path = write_filepath(model_path, task_type, task_id)
  multi_worker_model.save(write_model_path)
  # Point 2: this rank reads back what it has just saved (per-rank path).
  mine = tf.keras.models.load_model(write_model_path)
  for a, b in zip(mine.weights, multi_worker_model.weights):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  if not _is_chief(task_type, task_id):
    tf.io.gfile.rmtree(os.path.dirname(write_model_path))
  ops.barrier()  # the chief's model is complete (the tutorial's workers wait)
  assert sorted(os.listdir(os.path.dirname(model_path))) == ["model.keras"]
  loaded_model = tf.keras.models.load_model(model_path)
  for a, b in zip(loaded_model.weights, multi_worker_model.weights):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  loaded_model.fit(mnist_dataset(16), epochs=1, steps_per_epoch=2, verbose=0)
  # After the user removed it, this rank's copy is gone too, as in MWMS.
  if R > 0:
    with pytest.raises(ValueError):
      tf.keras.models.load_model(write_model_path)


@pytest.mark.timeout(300)
def test_keras_tutorial_checkpoint_manager(strategy, workdir):
  with strategy.scope():
    multi_worker_model = build_and_compile_cnn_model()
  multi_worker_model.fit(mnist_dataset(16 * N), epochs=1, steps_per_epoch=2,
                         verbose=0)
  checkpoint_dir = os.path.join(workdir, "ckpt")
  task_type, task_id = (strategy.cluster_resolver.task_type,
                        strategy.cluster_resolver.task_id)
  checkpoint = tf.train.Checkpoint(model=multi_worker_model)
  write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id)
  checkpoint_manager = tf.train.CheckpointManager(
      checkpoint, directory=write_checkpoint_dir, max_to_keep=1)
  assert checkpoint_manager.directory == write_checkpoint_dir
  saved = checkpoint_manager.save()
  # Point 1: the user's path, and the user's directory exists to delete.
  assert saved == os.path.join(write_checkpoint_dir, "ckpt-1"), saved
  assert checkpoint_manager.latest_checkpoint == saved
  assert checkpoint_manager.checkpoints == [saved]
  assert os.path.isdir(write_checkpoint_dir)
  assert tf.train.latest_checkpoint(write_checkpoint_dir) == saved
  if not _is_chief(task_type, task_id):
    tf.io.gfile.rmtree(write_checkpoint_dir)
    assert tf.train.latest_checkpoint(write_checkpoint_dir) is None
  ops.barrier()
  expected = [w.numpy() for w in multi_worker_model.weights]
  for w in multi_worker_model.weights:
    w.assign(w + 1.0 + R)
  latest_checkpoint = tf.train.latest_checkpoint(checkpoint_dir)
  assert latest_checkpoint == os.path.join(checkpoint_dir, "ckpt-1")
  checkpoint.restore(latest_checkpoint)
  for a, b in zip(multi_worker_model.weights, expected):
    np.testing.assert_array_equal(a.numpy(), b)
  multi_worker_model.fit(mnist_dataset(16 * N), epochs=1, steps_per_epoch=2,
                         verbose=0)
  assert _same_everywhere([w.numpy() for w in multi_worker_model.weights])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("save_freq", ["epoch", 2])
def test_keras_tutorial_backup_and_restore(strategy, workdir, save_freq):
  callbacks = [tf.keras.callbacks.BackupAndRestore(
      backup_dir=os.path.join(workdir, "backup"), save_freq=save_freq)]
  with strategy.scope():
    multi_worker_model = build_and_compile_cnn_model()
  multi_worker_model.fit(mnist_dataset(16 * N), epochs=2, steps_per_epoch=3,
                         callbacks=callbacks, verbose=0)
  # (A collective: rank 0 has also finished deleting the backup.)
  assert _same_everywhere([w.numpy() for w in multi_worker_model.weights])
  assert not os.path.exists(os.path.join(workdir, "backup"))


# ------------------------- "Custom training loop with Keras and MWMS"


def _ctl_job(strategy, checkpoint_dir, num_epochs, stop_after_epoch=None):
  """The tutorial's main.py (its loop and checkpointing), 4 steps/epoch."""
  per_worker_batch_size = 8
  global_batch_size = per_worker_batch_size * N
  num_steps_per_epoch = 4

  def dataset_fn(input_context):
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    dataset = mnist_dataset(batch_size).unbatch()
    dataset = dataset.shard(input_context.num_input_pipelines,
                            input_context.input_pipeline_id)
    return dataset.batch(batch_size)

  with strategy.scope():
    multi_worker_model = tf.keras.Sequential([
        tf.keras.Input(shape=(28, 28)),
        tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
        tf.keras.layers.Conv2D(4, 3, activation="relu"),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(10)])
    multi_worker_dataset = strategy.distribute_datasets_from_function(
        dataset_fn)
    optimizer = tf.keras.optimizers.RMSprop(learning_rate=0.001)
    train_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(
        name="train_accuracy")

  @tf.function
  def train_step(iterator):

    def step_fn(inputs):
      x, y = inputs
      with tf.GradientTape() as tape:
        predictions = multi_worker_model(x, training=True)
        per_example_loss = tf.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=None)(y, predictions)
        loss = tf.nn.compute_average_loss(per_example_loss)
      grads = tape.gradient(loss, multi_worker_model.trainable_variables)
      optimizer.apply_gradients(
          zip(grads, multi_worker_model.trainable_variables))
      train_accuracy.update_state(y, predictions)
      return loss

    per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
    return strategy.reduce(
        tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

  epoch = tf.Variable(
      initial_value=tf.constant(0, dtype=tf.dtypes.int64), name="epoch")
  step_in_epoch = tf.Variable(
      initial_value=tf.constant(0, dtype=tf.dtypes.int64),
      name="step_in_epoch")
  task_type, task_id, cluster_spec = (strategy.cluster_resolver.task_type,
                                      strategy.cluster_resolver.task_id,
                                      strategy.cluster_resolver.cluster_spec())
  checkpoint = tf.train.Checkpoint(
      model=multi_worker_model, epoch=epoch, step_in_epoch=step_in_epoch)
  write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id,
                                        cluster_spec)
  checkpoint_manager = tf.train.CheckpointManager(
      checkpoint, directory=write_checkpoint_dir, max_to_keep=1)
  latest_checkpoint = tf.train.latest_checkpoint(checkpoint_dir)
  if latest_checkpoint:
    checkpoint.restore(latest_checkpoint)
  started_at = (int(epoch.numpy()), int(step_in_epoch.numpy()))

  while epoch.numpy() < num_epochs:
    iterator = iter(multi_worker_dataset)
    total_loss = 0.0
    num_batches = 0
    while step_in_epoch.numpy() < num_steps_per_epoch:
      total_loss += train_step(iterator)
      num_batches += 1
      step_in_epoch.assign_add(1)
    train_accuracy.reset_state()
    checkpoint_manager.save()
    if not _is_chief(task_type, task_id, cluster_spec):
      tf.io.gfile.rmtree(write_checkpoint_dir)
    epoch.assign_add(1)
    step_in_epoch.assign(0)
    if stop_after_epoch is not None and epoch.numpy() > stop_after_epoch:
      break
  return started_at, multi_worker_model


@pytest.mark.timeout(400)
def test_ctl_tutorial_checkpoints_and_resumes(strategy, workdir):
  checkpoint_dir = os.path.join(workdir, "ckpt")
  started, _ = _ctl_job(strategy, checkpoint_dir, num_epochs=3,
                        stop_after_epoch=0)
  assert started == (0, 0)
  ops.barrier()
  # The tutorial deletes workertemp_<id>/ckpt and leaves workertemp_<id>
  # (empty), under MultiWorkerMirroredStrategy as here.
  temps = ["workertemp_%d" % r for r in range(1, N)]
  assert sorted(os.listdir(workdir)) == ["ckpt"] + temps
  assert all(not os.listdir(os.path.join(workdir, t)) for t in temps)
  assert sorted(os.listdir(checkpoint_dir)) == [
      "checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index"]
  # The "restarted" job: a new model; every rank restores what the chief
  # saved at the end of epoch 0 (the tutorial saves before incrementing
  # `epoch`: epoch 0, all 4 steps done), saves that epoch again, and runs
  # epochs 1 and 2.
  started, model = _ctl_job(strategy, checkpoint_dir, num_epochs=3)
  assert started == (0, 4)
  assert _same_everywhere([w.numpy() for w in model.weights])
  ops.barrier()
  assert sorted(os.listdir(checkpoint_dir)) == [
      "checkpoint", "ckpt-4.data-00000-of-00001", "ckpt-4.index"]


# ------------ "Save and load a model using a distribution strategy"


def _get_model(strategy):
  with strategy.scope():
    model = tf.keras.Sequential([
        tf.keras.Input(shape=(28, 28, 1)),
        tf.keras.layers.Conv2D(4, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(16, activation="relu"),
        tf.keras.layers.Dense(10)
    ])
    model.compile(
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.Adam(),
        metrics=[tf.keras.metrics.SparseCategoricalAccuracy()])
  return model


def _train_dataset(batch):
  return mnist_dataset(batch).map(
      lambda x, y: (tf.expand_dims(x, -1), y)).take(3)


@pytest.mark.timeout(400)
def test_save_and_load_tutorial_keras_format(strategy, workdir):
  model = _get_model(strategy)
  train_dataset = _train_dataset(16 * N)
  model.fit(train_dataset, epochs=1, verbose=0)
  keras_model_path = os.path.join(workdir, "keras_save.keras")
  model.save(keras_model_path)
  # Every rank loads the path all ranks saved to: its own complete copy,
  # never rank 0's file while rank 0 writes it (no barrier needed).
  restored_keras_model = tf.keras.models.load_model(keras_model_path)
  for a, b in zip(restored_keras_model.weights, model.weights):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  restored_keras_model.fit(_train_dataset(16), epochs=1, verbose=0)
  another_strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
  with another_strategy.scope():
    restored_keras_model_ds = tf.keras.models.load_model(keras_model_path)
    restored_keras_model_ds.fit(_train_dataset(16), epochs=1, verbose=0)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("api", ["tf.saved_model.save", "Model.export"])
def test_save_and_load_tutorial_saved_model(strategy, workdir, api):
  model = _get_model(strategy)
  model.fit(_train_dataset(16 * N), epochs=1, verbose=0)
  saved_model_path = os.path.join(workdir, "tf_save")
  batch = np.random.default_rng(1).random((4, 28, 28, 1), np.float32)
  for _ in range(2):  # the second save replaces the first one
    if api == "tf.saved_model.save":
      # Keras 3 models need an explicit serving signature.
      serve = tf.function(lambda x: model(x, training=False),
                          input_signature=[tf.TensorSpec([None, 28, 28, 1],
                                                         tf.float32)])
      tf.saved_model.save(model, saved_model_path, signatures=serve)
      key = "serving_default"
    else:
      model.export(saved_model_path)
      key = "serving_default"
    loaded = tf.saved_model.load(saved_model_path)
    inference_func = loaded.signatures[key]
    out = list(inference_func(tf.constant(batch)).values())[0]
    np.testing.assert_allclose(out.numpy(), model(batch).numpy(), rtol=1e-5,
                               atol=1e-6)
  another_strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
  with another_strategy.scope():
    loaded = tf.saved_model.load(saved_model_path)
    inference_func = loaded.signatures[key]
    dist = another_strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(batch).batch(4))
    for b in dist:
      another_strategy.run(inference_func, args=(b,))
  ops.barrier()
  assert sorted(os.listdir(workdir)) == ["tf_save"]  # no temporary names


@pytest.mark.timeout(400)
def test_save_and_load_tutorial_per_rank_saved_model(strategy, workdir):
  # Each rank exports to a path of its own and reads it back (point 2).
  model = _get_model(strategy)
  mine = os.path.join(workdir, "rank%d" % R, "exported")
  os.makedirs(os.path.dirname(mine))
  model.export(mine)
  loaded = tf.saved_model.load(mine)
  batch = np.ones((2, 28, 28, 1), np.float32)
  np.testing.assert_allclose(loaded.serve(batch).numpy(),
                             model(batch).numpy(), rtol=1e-5, atol=1e-6)
  ops.barrier()
  assert os.path.isdir(os.path.join(workdir, "rank0", "exported"))
  if R > 0:
    assert os.listdir(os.path.dirname(mine)) == []  # written to scratch


@pytest.mark.timeout(400)
def test_save_and_load_tutorial_subclassed_model(strategy, workdir):

  class SubclassedModel(tf.keras.Model):
    output_name = "output_layer"

    def __init__(self):
      super().__init__()
      self._dense_layer = tf.keras.layers.Dense(
          5, dtype=tf.dtypes.float32, name=self.output_name)

    def call(self, inputs):
      return self._dense_layer(inputs)

  with strategy.scope():
    my_model = SubclassedModel()
    my_model.compile(optimizer="adam", loss="mean_squared_error")
  dataset = tf.data.Dataset.from_tensors(
      (tf.range(5, dtype=tf.float32), tf.range(5, dtype=tf.float32))
  ).repeat(16).batch(4 * N)
  my_model.fit(dataset, epochs=1, verbose=0)
  saved_model_path = os.path.join(workdir, "tf_save")
  tf.saved_model.save(my_model, saved_model_path)
  x = tf.saved_model.load(saved_model_path)
  del x
  my_model.save(os.path.join(workdir, "subclassed.keras"))
  ops.barrier()
  assert sorted(os.listdir(workdir)) == ["subclassed.keras", "tf_save"]
