"""Keras model.fit on MNIST-shaped data with the Horovod Keras API.

Written for mpistrategy in the style of a Horovod TF2 Keras script (it is
not one of Horovod's files).  Only the import of `hvd` names mpistrategy;
switch it back to `import horovod.tensorflow.keras as hvd` and the script
runs unchanged under Horovod.

    mpirun -np 2 python examples/horovod/keras_mnist.py

Synthetic data (a fixed random projection decides each image's class), so
nothing is downloaded.  HVD_EXAMPLE_EPOCHS (default 3) and HVD_EXAMPLE_STEPS
(global steps per epoch, default 200; each rank runs a 1/hvd.size() share)
size the run.  Rank 0 writes checkpoint-<epoch>.weights.h5 into the working
directory.
"""

import hashlib
import os

import numpy as np
import tensorflow as tf
import keras

import mpistrategy.horovod.tensorflow.keras as hvd

NUM_CLASSES = 10
BATCH = 64


def make_dataset(count, seed=1234):
  """The same images and labels on every rank."""
  rng = np.random.default_rng(seed)
  images = rng.random((count, 28, 28), dtype=np.float32)
  projection = rng.standard_normal((28 * 28, NUM_CLASSES)).astype(np.float32)
  labels = np.argmax(images.reshape(count, -1) @ projection, axis=1)
  return tf.data.Dataset.from_tensor_slices(
      (images[..., None], labels.astype(np.int64)))


def weights_digest(model):
  h = hashlib.sha256()
  for w in model.trainable_weights:
    h.update(np.ascontiguousarray(w.numpy()).tobytes())
  return h.hexdigest()


def main():
  hvd.init()
  gpus = tf.config.list_physical_devices("GPU")
  for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
  if gpus:
    tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")

  keras.utils.set_random_seed(7 + hvd.rank())
  epochs = int(os.environ.get("HVD_EXAMPLE_EPOCHS", "3"))
  steps_per_epoch = int(os.environ.get("HVD_EXAMPLE_STEPS", "200"))

  data = (make_dataset(8192)
          .repeat()
          .shuffle(4096, seed=hvd.rank())
          .batch(BATCH))

  model = keras.Sequential([
      keras.Input((28, 28, 1)),
      keras.layers.Conv2D(16, 3, activation="relu"),
      keras.layers.MaxPooling2D(),
      keras.layers.Flatten(),
      keras.layers.Dense(64, activation="relu"),
      keras.layers.Dense(NUM_CLASSES),
  ])

  base_lr = 0.001
  optimizer = hvd.DistributedOptimizer(
      keras.optimizers.Adam(learning_rate=base_lr * hvd.size()))
  model.compile(
      optimizer=optimizer,
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=["accuracy"])

  callbacks = [
      # Start every rank from rank 0's weights and optimizer state.
      hvd.callbacks.BroadcastGlobalVariablesCallback(0),
      # Report metrics averaged over all ranks, not rank 0's alone.
      hvd.callbacks.MetricAverageCallback(),
      # Ramp the learning rate up to base_lr * size over the first epoch.
      hvd.callbacks.LearningRateWarmupCallback(
          initial_lr=base_lr * hvd.size(), warmup_epochs=1, verbose=1),
  ]
  if hvd.rank() == 0:
    # One writer is enough: the ranks hold the same weights.
    callbacks.append(keras.callbacks.ModelCheckpoint(
        "./checkpoint-{epoch}.weights.h5", save_weights_only=True))

  history = model.fit(
      data,
      steps_per_epoch=max(1, steps_per_epoch // hvd.size()),
      epochs=epochs,
      callbacks=callbacks,
      verbose=1 if hvd.rank() == 0 else 0)

  if hvd.rank() == 0:
    print(f"final accuracy {history.history['accuracy'][-1]:.4f}", flush=True)
  print(f"rank {hvd.rank()} weights sha256 {weights_digest(model)}",
        flush=True)


if __name__ == "__main__":
  main()
