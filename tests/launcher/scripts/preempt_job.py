"""A tiny training job that can be preempted, for test_preemption.py.

--mode loop: a custom loop through TF's PreemptionCheckpointHandler.run.
--mode fit: `model.fit` with `keras.callbacks.BackupAndRestore`.
Both train a 4-input linear model with SGD on fixed data (no shuffling),
so a run's final weights depend only on the steps it trained.

--act ATTEMPT:RANK:STEP:SIGNAL makes RANK send SIGNAL to itself once
global training step STEP (counted from the start of training, over all
attempts) is done, in the attempt MPISTRATEGY_RESTART_COUNT == ATTEMPT
(may be repeated).  After training, every rank trains a fresh model over
all steps without interruption in the same process (the reference) and
reports the largest difference to it.

Events (scripts/_rankio.py): PID, START <steps restored>, STEP <n> (rank 0,
loop), DONE <weights json>, REF <max abs difference to the reference>.
"""

import json
import os
import signal
import time

from _rankio import emit
from _rankio import parser

GLOBAL_BATCH = 12      # divisible by 2 and 3 ranks
LOOP_STEPS = 30
FIT_EXAMPLES, FIT_EPOCHS = 96, 3
W0 = [[0.5], [-0.25], [0.1], [0.0]]


def _data(n):
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(0)
  x = rng.randn(n, 4).astype(np.float32)
  y = (x @ np.array([[1.0], [2.0], [-1.0], [0.5]], np.float32) +
       0.1 * rng.randn(n, 1).astype(np.float32))
  return x, y


def _model(strategy):
  import keras  # pylint: disable=g-import-not-at-top
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        1, use_bias=False,
        kernel_initializer=keras.initializers.Constant(W0))])
    optimizer = keras.optimizers.SGD(0.05)
    optimizer.build(model.trainable_variables)
  return model, optimizer


def _acts(specs):
  attempt = int(os.environ.get("MPISTRATEGY_RESTART_COUNT", "0"))
  rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
  acts = {}
  for spec in specs:
    a, r, step, name = spec.split(":")
    if int(a) == attempt and int(r) == rank:
      acts[int(step)] = getattr(signal, name)
  return acts


def _act(acts, step):
  if step in acts:
    os.kill(os.getpid(), acts.pop(step))


def _loop(args, strategy, acts):
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  rank, size = strategy.cluster_resolver.task_id, strategy.num_replicas_in_sync
  x, y = _data(LOOP_STEPS * GLOBAL_BATCH)

  def batch(k):  # this rank's rows of global batch k
    rows = slice(k * GLOBAL_BATCH + rank, (k + 1) * GLOBAL_BATCH, size)
    return tf.constant(x[rows]), tf.constant(y[rows])

  def trainer(model, optimizer):
    @tf.function
    def train_step(xb, yb):
      def step(xb, yb):
        with tf.GradientTape() as tape:
          loss = tf.reduce_sum(tf.square(model(xb) - yb)) / GLOBAL_BATCH
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
      strategy.run(step, args=(xb, yb))
    return train_step

  model, optimizer = _model(strategy)
  ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer)
  handler = tf.distribute.experimental.PreemptionCheckpointHandler(
      strategy.cluster_resolver, ckpt, args.dir)
  start = int(handler.total_run_calls)
  emit("START", start)
  train_step = trainer(model, optimizer)
  for k in range(start, LOOP_STEPS):
    handler.run(train_step, *batch(k))
    _act(acts, k + 1)
    if rank == 0:
      emit("STEP", k + 1)
    time.sleep(args.slow)
  ref_model, ref_optimizer = _model(strategy)
  ref_step = trainer(ref_model, ref_optimizer)
  for k in range(LOOP_STEPS):
    ref_step(*batch(k))
  return model, ref_model, np


def _fit(args, strategy, acts):
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  x, y = _data(FIT_EXAMPLES)

  class Act(keras.callbacks.Callback):

    def on_train_batch_end(self, batch, logs=None):
      # Batches that a resumed run skips do not count (no optimizer step).
      _act(acts, int(self.model.optimizer.iterations.numpy()))
      time.sleep(args.slow)

  class Start(keras.callbacks.Callback):

    def on_train_begin(self, logs=None):
      emit("START", int(self.model.optimizer.iterations.numpy()))

  def compiled():
    model, optimizer = _model(strategy)
    with strategy.scope():
      model.compile(optimizer=optimizer, loss="mse")
    return model

  model = compiled()
  # Act before BackupAndRestore: a signal at batch end is seen by its check.
  model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=FIT_EPOCHS, shuffle=False,
            verbose=0, callbacks=[
                Act(), keras.callbacks.BackupAndRestore(args.dir, save_freq=4),
                Start()])
  ref_model = compiled()
  ref_model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=FIT_EPOCHS,
                shuffle=False, verbose=0)
  return model, ref_model, np


def main():
  p = parser(__doc__.splitlines()[0])
  p.add_argument("--mode", choices=("loop", "fit"), required=True)
  p.add_argument("--dir", required=True)
  p.add_argument("--act", action="append", default=[])
  p.add_argument("--slow", type=float, default=0.0,
                 help="seconds to sleep after each step")
  args = p.parse_args()
  emit("PID", os.getpid())
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import mpistrategy  # pylint: disable=g-import-not-at-top
  strategy = mpistrategy.MPIStrategy()
  acts = _acts(args.act)
  run = _loop if args.mode == "loop" else _fit
  model, ref_model, np = run(args, strategy, acts)
  weights = model.get_weights()[0]
  emit("DONE", json.dumps(weights.ravel().tolist()))
  emit("REF", float(np.max(np.abs(weights - ref_model.get_weights()[0]))))


if __name__ == "__main__":
  main()
