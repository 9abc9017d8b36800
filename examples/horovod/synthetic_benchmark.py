"""Training throughput on random images with the Horovod TF2 API.

Written for mpistrategy in the style of a Horovod TF2 benchmark script (it is
not one of Horovod's files).  Only the import of `hvd` names mpistrategy;
switch it back to `import horovod.tensorflow as hvd` and the script runs
unchanged under Horovod.

    mpirun -np 2 python examples/horovod/synthetic_benchmark.py \
        --model MobileNetV3Small --image-size 96 --batch-size 16

The default model and image size are small enough for a CPU; any
`keras.applications` model name works with --model (ResNet50 and 224 for
the usual GPU numbers).  Prints img/s per rank and for all ranks on rank 0
(mean +- 1.96 standard deviations over the timed iterations), then a digest
of each rank's weights.
"""

import argparse
import hashlib
import timeit

import numpy as np
import tensorflow as tf
import keras

import mpistrategy.horovod.tensorflow as hvd


def parse_args():
  p = argparse.ArgumentParser(
      description="Synthetic-data training benchmark (Horovod TF2 API)",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--model", default="MobileNetV3Small",
                 help="a keras.applications model name")
  p.add_argument("--image-size", type=int, default=64,
                 help="height and width of the random images")
  p.add_argument("--batch-size", type=int, default=16,
                 help="images per rank per batch")
  p.add_argument("--num-warmup-batches", type=int, default=5,
                 help="untimed batches before measuring")
  p.add_argument("--num-batches-per-iter", type=int, default=5,
                 help="batches timed together as one iteration")
  p.add_argument("--num-iters", type=int, default=5,
                 help="timed iterations")
  args = p.parse_args()
  if not hasattr(keras.applications, args.model):
    p.error(f"--model: keras.applications has no model {args.model!r}")
  for name in ("image_size", "batch_size", "num_batches_per_iter",
               "num_iters"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be at least 1")
  if args.num_warmup_batches < 0:
    p.error("--num-warmup-batches must not be negative")
  return args


def main():
  args = parse_args()
  hvd.init()
  gpus = tf.config.list_physical_devices("GPU")
  for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
  if gpus:
    tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
  device = "GPU" if gpus else "CPU"

  model = getattr(keras.applications, args.model)(
      weights=None, input_shape=(args.image_size, args.image_size, 3))
  optimizer = keras.optimizers.SGD(learning_rate=0.01)
  loss_fn = keras.losses.SparseCategoricalCrossentropy()

  rng = np.random.default_rng(hvd.rank())
  images = tf.constant(rng.random(
      (args.batch_size, args.image_size, args.image_size, 3),
      dtype=np.float32))
  labels = tf.constant(rng.integers(0, 1000, args.batch_size))

  @tf.function
  def train_step():
    with tf.GradientTape() as tape:
      loss = loss_fn(labels, model(images, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

  def log(text):
    if hvd.rank() == 0:
      print(text, flush=True)

  log(f"Model: {args.model}, image size {args.image_size}, "
      f"batch size {args.batch_size} per rank")
  log(f"Number of {device}s: {hvd.size()}")

  # The first step creates the optimizer's variables; then every rank takes
  # rank 0's model and optimizer state.
  train_step()
  hvd.broadcast_variables(model.variables, root_rank=0)
  hvd.broadcast_variables(optimizer.variables, root_rank=0)

  log("Warming up")
  for _ in range(args.num_warmup_batches):
    train_step()

  log("Timing")
  rates = []
  for i in range(args.num_iters):
    seconds = timeit.timeit(train_step, number=args.num_batches_per_iter)
    rate = args.batch_size * args.num_batches_per_iter / seconds
    log(f"Iteration {i}: {rate:.1f} img/s per {device}")
    rates.append(rate)

  mean, spread = np.mean(rates), 1.96 * np.std(rates)
  log(f"img/s per {device}: {mean:.1f} +- {spread:.1f}")
  log(f"Total img/s on {hvd.size()} {device}(s): "
      f"{hvd.size() * mean:.1f} +- {hvd.size() * spread:.1f}")

  h = hashlib.sha256()
  for w in model.trainable_weights:
    h.update(np.ascontiguousarray(w.numpy()).tobytes())
  print(f"rank {hvd.rank()} weights sha256 {h.hexdigest()}", flush=True)


if __name__ == "__main__":
  main()
