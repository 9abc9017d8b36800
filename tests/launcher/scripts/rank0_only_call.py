"""Only rank 0 makes a Keras call that communicates (a Horovod habit).

All ranks build and fit a small model together; then rank 0 alone calls
`model.<--call>` (evaluate, predict or save) while the other ranks go on:
with `--others barrier` they wait in `ops.barrier(name="after_call")`, with
`--others exit` they end the script.  Expected: rank 0's call fails (stall
timeout or the others' shutdown) with a message naming the Keras call;
the job ends.  With `--others raise` every rank calls `fit` again and the
ranks > 0 raise from a callback in it: rank 0's error then reports their
exception, and no broken rule.

Events: PID, FITTED, CALL (rank 0, before the call), ERROR (rank 0: the
exception with its notes), OTHER_ERROR, UNEXPECTED_OK.
"""

import os
import traceback

import _rankio as io

p = io.parser(__doc__)
p.add_argument("--call", choices=("evaluate", "predict", "save"),
               default="evaluate")
p.add_argument("--others", choices=("barrier", "exit", "raise"),
               default="barrier")
p.add_argument("--save-dir", default="/tmp")
args = p.parse_args()

io.emit("PID", str(os.getpid()))

import keras
import numpy as np
import tensorflow as tf

import mpistrategy
from mpistrategy import ops

strategy = mpistrategy.MPIStrategy()
rank = mpistrategy.rank()
x = np.random.RandomState(0).rand(64, 4).astype("float32")
y = x.sum(axis=1, keepdims=True)
with strategy.scope():
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
  model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
model.fit(x, y, batch_size=16, epochs=1, verbose=0)
io.emit("FITTED")



class _RaiseOnOthers(keras.callbacks.Callback):

  def on_train_batch_end(self, batch, logs=None):
    if rank > 0 and batch == 1:
      raise RuntimeError("deliberate failure on a rank > 0")


if args.others == "raise":
  io.emit("CALL", "fit")
  try:
    model.fit(x, y, batch_size=16, epochs=1, verbose=0,
              callbacks=[_RaiseOnOthers()])
    io.emit("UNEXPECTED_OK")
  except (tf.errors.DeadlineExceededError, tf.errors.AbortedError) as e:
    io.emit("ERROR", "".join(traceback.format_exception_only(e)))
    raise
elif rank == 0:
  io.emit("CALL", args.call)
  try:
    if args.call == "evaluate":
      model.evaluate(x, y, batch_size=16, verbose=0)
    elif args.call == "predict":
      model.predict(x, batch_size=16, verbose=0)
    else:
      model.save(os.path.join(args.save_dir, "model.keras"))
    io.emit("UNEXPECTED_OK")
  except (tf.errors.DeadlineExceededError, tf.errors.AbortedError) as e:
    io.emit("ERROR", "".join(traceback.format_exception_only(e)))
    raise
  except Exception as e:  # pylint: disable=broad-except
    io.emit("OTHER_ERROR", io.error_text(e))
    raise
elif args.others == "barrier":
  try:
    ops.barrier(name="after_call")
    io.emit("UNEXPECTED_OK")
  except Exception as e:  # pylint: disable=broad-except
    io.emit("OTHER_ERROR", io.error_text(e))
    raise
