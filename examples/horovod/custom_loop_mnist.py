"""Custom-loop training on MNIST-shaped data with the Horovod TF2 API.

Written for mpistrategy in the style of a Horovod TF2 training script (it is
not one of Horovod's files).  Only the import of `hvd` names mpistrategy;
switch it back to `import horovod.tensorflow as hvd` and the script runs
unchanged under Horovod.

    mpirun -np 2 python examples/horovod/custom_loop_mnist.py

The data are synthetic so nothing is downloaded: 28x28 images whose class is
given by a fixed random linear projection, which a small network can learn.
HVD_EXAMPLE_STEPS sets the number of global steps (default 200); each rank
runs steps // hvd.size() of them on its shard of the data.
"""

import hashlib
import os

import numpy as np
import tensorflow as tf
import keras

import mpistrategy.horovod.tensorflow as hvd

NUM_CLASSES = 10
BATCH = 64


def make_dataset(count, seed=1234):
  """The same images and labels on every rank (sharded below)."""
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
  # One visible GPU per local rank, if there are GPUs at all.
  gpus = tf.config.list_physical_devices("GPU")
  for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
  if gpus:
    tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")

  # Different initial weights per rank on purpose: the broadcast after the
  # first step is what makes the ranks agree.
  keras.utils.set_random_seed(42 + hvd.rank())

  total_steps = int(os.environ.get("HVD_EXAMPLE_STEPS", "200"))
  local_steps = max(1, total_steps // hvd.size())

  data = (make_dataset(8192)
          .shard(hvd.size(), hvd.rank())
          .repeat()
          .shuffle(2048, seed=hvd.rank())
          .batch(BATCH))

  model = keras.Sequential([
      keras.Input((28, 28, 1)),
      keras.layers.Conv2D(16, 3, activation="relu"),
      keras.layers.MaxPooling2D(),
      keras.layers.Flatten(),
      keras.layers.Dense(64, activation="relu"),
      keras.layers.Dense(NUM_CLASSES),
  ])
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  # Each step sees hvd.size() times more samples, so the step size grows too.
  optimizer = keras.optimizers.Adam(learning_rate=0.001 * hvd.size())

  @tf.function
  def train_step(x, y):
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  for step, (x, y) in enumerate(data.take(local_steps)):
    loss = train_step(x, y)
    if step == 0:
      # The optimizer's slots exist only after its first update.
      hvd.broadcast_variables(model.variables, root_rank=0)
      hvd.broadcast_variables(optimizer.variables, root_rank=0)
    if hvd.rank() == 0 and step % 10 == 0:
      print(f"step {step}/{local_steps}  loss {float(loss):.4f}", flush=True)

  print(f"rank {hvd.rank()} weights sha256 {weights_digest(model)}",
        flush=True)


if __name__ == "__main__":
  main()
