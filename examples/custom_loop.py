"""A custom training loop with MPIStrategy (no Keras fit).

    mpirun -np 2 python examples/custom_loop.py

Shows the tf.distribute building blocks that MPIStrategy makes
multi-process: `experimental_distribute_dataset` (each rank reads its own
shard of every global batch), `strategy.run`, `tf.nn.compute_average_loss`
with the global batch, `strategy.reduce` and `strategy.gather`.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
import keras
from sklearn.datasets import load_digits

import mpistrategy


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=5)
  parser.add_argument("--batch-size", type=int, default=64, help="global")
  args = parser.parse_args()

  strategy = mpistrategy.MPIStrategy()
  chief = mpistrategy.rank() == 0
  x, y = load_digits(return_X_y=True)
  n = len(x) // args.batch_size * args.batch_size  # full global batches only
  x, y = (x[:n] / 16.0).astype(np.float32), y[:n].astype(np.int32)
  ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(n).batch(
      args.batch_size)
  dist_ds = strategy.experimental_distribute_dataset(ds)

  with strategy.scope():
    model = keras.Sequential([keras.Input((64,)),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    optimizer = keras.optimizers.Adam(3e-3)
    accuracy = keras.metrics.SparseCategoricalAccuracy()
  loss_fn = keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction=None)

  @tf.function
  def train_step(batch):

    def step(inputs):
      features, labels = inputs
      with tf.GradientTape() as tape:
        logits = model(features, training=True)
        loss = tf.nn.compute_average_loss(
            loss_fn(labels, logits), global_batch_size=args.batch_size)
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      accuracy.update_state(labels, logits)
      return loss

    per_replica = strategy.run(step, args=(batch,))
    return strategy.reduce("SUM", per_replica, axis=None)

  for epoch in range(args.epochs):
    total, steps = 0.0, 0
    for batch in dist_ds:
      total += float(train_step(batch))
      steps += 1
    acc = float(accuracy.result())  # global: SUM of every rank's counts
    accuracy.reset_state()
    if chief:
      print(f"epoch {epoch + 1}: loss {total / steps:.4f} "
            f"accuracy {acc:.4f}", flush=True)

  # Every rank holds the same weights; gather shows each rank's checksum.
  checksum = tf.reduce_sum([tf.reduce_sum(w) for w in model.weights])
  sums = strategy.gather(tf.reshape(checksum, [1]), axis=0).numpy()
  if chief:
    print("weight checksums per rank:", np.round(sums, 6).tolist(),
          "identical" if np.all(sums == sums[0]) else "DIFFERENT", flush=True)


if __name__ == "__main__":
  main()
