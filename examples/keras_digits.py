"""Train a small Keras MLP on scikit-learn's digits with MPIStrategy.

Single-process code plus two lines (create the strategy, build in its
scope).  Run it on any number of ranks:

    mpirun -np 2 python examples/keras_digits.py
    mpirun -np 2 python examples/keras_digits.py --compression fp16
    python examples/keras_digits.py            # one process works too

`batch_size` is the *global* batch: each of the N ranks trains on
batch_size / N samples per step and the gradients are averaged, so the
result matches one process training with the same global batch.  Rank 0
prints the progress and, last, the line `test loss <x>  test accuracy <y>`;
every rank holds the same model.  `--compression fp16|bf16` sends the
gradients as 16-bit floats (`mpistrategy.MPIStrategy(compression=...)`).
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import keras
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import mpistrategy


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=12)
  parser.add_argument("--batch-size", type=int, default=64,
                      help="global batch size (all ranks together)")
  parser.add_argument("--steps-per-execution", type=int, default=4)
  parser.add_argument("--compression", choices=["none", "fp16", "bf16"],
                      default="none",
                      help="wire dtype of the gradients (default: float32)")
  parser.add_argument("--seed", type=int, default=0,
                      help="seeds weights and data order (same on all ranks)")
  parser.add_argument("--backup-dir",
                      help="resume after a kill or preemption from this "
                      "keras.callbacks.BackupAndRestore directory")
  # tests/launcher tags the command lines of its jobs with a marker.
  parser.add_argument("--marker", default="", help=argparse.SUPPRESS)
  args = parser.parse_args()

  # Before the strategy: it broadcasts a seed drawn from rank 0's numpy
  # generator, which this makes reproducible too.
  keras.utils.set_random_seed(args.seed)
  strategy = mpistrategy.MPIStrategy(compression=args.compression)
  chief = mpistrategy.rank() == 0

  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  x_train, x_test, y_train, y_test = train_test_split(
      x, y, test_size=0.2, random_state=0, stratify=y)

  with strategy.scope():
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=args.steps_per_execution)

  if chief:
    print(f"MPIStrategy: {mpistrategy.size()} ranks, "
          f"{strategy.num_replicas_in_sync} replicas, global batch "
          f"{args.batch_size}, compression {args.compression}", flush=True)
  callbacks = []
  if args.backup_dir:
    # Saves after every epoch and, on a preemption signal, at the step the
    # ranks agree on (they then exit with status 42).
    callbacks.append(keras.callbacks.BackupAndRestore(args.backup_dir))
  model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
            validation_split=0.1, verbose=2, callbacks=callbacks)
  loss, accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size,
                                  verbose=0)
  if chief:
    print(f"test loss {loss:.4f}  test accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
  main()
