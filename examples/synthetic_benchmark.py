"""Synthetic-data training throughput, in the style of Horovod's
tensorflow2_synthetic_benchmark.py.

    mpirun -np 2 python examples/synthetic_benchmark.py
    mpirun -np 2 python examples/synthetic_benchmark.py --image-size 64 \
        --batch-size 32 --num-iters 10

A small convolutional network with many variables (so the gradient
all-reduce has many tensors to fuse) trains on random images with
`model.fit`.  Rank 0 prints samples/s per rank and in total.  The defaults
are small so it finishes in well under a minute on a CPU.
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
import keras

import mpistrategy


def build_model(image_size, blocks, width, classes):
  inputs = keras.Input((image_size, image_size, 3))
  h = keras.layers.Conv2D(width, 3, padding="same", activation="relu")(inputs)
  for i in range(blocks):
    r = keras.layers.Conv2D(width, 3, padding="same", activation="relu",
                            name=f"block{i}_a")(h)
    r = keras.layers.Conv2D(width, 3, padding="same", name=f"block{i}_b")(r)
    h = keras.layers.Activation("relu")(keras.layers.Add()([h, r]))
    if i % 2 == 1:
      h = keras.layers.MaxPooling2D()(h)
  h = keras.layers.GlobalAveragePooling2D()(h)
  outputs = keras.layers.Dense(classes)(h)
  return keras.Model(inputs, outputs)


class _StepTimer(keras.callbacks.Callback):

  def __init__(self):
    super().__init__()
    self.times = []
    self._start = None

  def on_train_batch_begin(self, batch, logs=None):
    self._start = time.perf_counter()

  def on_train_batch_end(self, batch, logs=None):
    self.times.append(time.perf_counter() - self._start)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch-size", type=int, default=16,
                      help="per-rank batch size")
  parser.add_argument("--image-size", type=int, default=32)
  parser.add_argument("--blocks", type=int, default=6)
  parser.add_argument("--width", type=int, default=32)
  parser.add_argument("--num-warmup", type=int, default=3)
  parser.add_argument("--num-iters", type=int, default=20)
  args = parser.parse_args()

  strategy = mpistrategy.MPIStrategy()
  size, chief = mpistrategy.size(), mpistrategy.rank() == 0
  global_batch = args.batch_size * size
  with strategy.scope():
    model = build_model(args.image_size, args.blocks, args.width, 1000)
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
  steps = args.num_warmup + args.num_iters
  rng = np.random.RandomState(0)
  images = rng.rand(global_batch, args.image_size, args.image_size,
                    3).astype(np.float32)
  labels = rng.randint(0, 1000, size=[global_batch]).astype(np.int32)
  ds = tf.data.Dataset.from_tensors((images, labels)).repeat(steps)

  if chief:
    print(f"Model: {len(model.trainable_variables)} variables, "
          f"{model.count_params():,} parameters; batch {args.batch_size} "
          f"per rank, {size} ranks", flush=True)
  timer = _StepTimer()
  model.fit(ds, epochs=1, steps_per_epoch=steps, callbacks=[timer],
            shuffle=False, verbose=0)
  measured = np.array(timer.times[args.num_warmup:])
  per_rank = args.batch_size / measured
  if chief:
    print(f"Step time: median {np.median(measured) * 1e3:.1f} ms", flush=True)
    print(f"Img/sec per rank: {np.mean(per_rank):.1f} +- "
          f"{1.96 * np.std(per_rank):.1f}", flush=True)
    print(f"Total img/sec on {size} rank(s): {np.mean(per_rank) * size:.1f} "
          f"+- {1.96 * np.std(per_rank) * size:.1f}", flush=True)
    options = mpistrategy.current_options()
    if options is not None and options.autotune:
      # MPISTRATEGY_AUTOTUNE=1: what rank 0's autotuner chose (or is trying).
      tuned = mpistrategy.ops.tuned_parameters()
      print(f"Tuned parameters: fusion_threshold_bytes="
            f"{tuned['fusion_threshold_bytes']} fusion_wait_ms="
            f"{tuned['fusion_wait_ms']:g}"
            f"{'' if tuned['final'] else ' (not final)'}", flush=True)


if __name__ == "__main__":
  main()
