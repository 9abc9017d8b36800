"""The rank program of the multi-host tests (tests/multihost).

--part topology  print rank, size, local rank/size, hostname; one allreduce
--part ops       also every collective over TCP, results printed as JSON
--part keras     also Keras `fit` (tiny model, synthetic data); weight hash
--part train     a training loop (allreduce of gradients every step) that
                 runs until every rank has trained --seconds, then checks a
                 final allreduce; for the fault tests
--part resume    Keras `fit` with `BackupAndRestore(--backup-dir)`, --slow
                 seconds per batch; resumes where an earlier attempt saved

Several parts may be given (--part topology --part ops --part keras).  Every
observation is one `@@ <rank> <time> <EVENT> <text>` line (_rankio.py from
tests/launcher/scripts).  Events: PID (pid hostname), INIT (JSON topology),
OP (name JSON), WEIGHTS (hash loss...), TRAINING, PROGRESS (step), CAUGHT
(an error from a collective, before it is re-raised), FINISHED (JSON),
RESUMED (the optimizer step fit starts from).
"""

import hashlib
import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))), "launcher", "scripts"))
import _rankio as io

p = io.parser(__doc__)
p.add_argument("--part", action="append",
               choices=["topology", "ops", "keras", "train", "resume"])
p.add_argument("--seconds", type=float, default=20.0,
               help="--part train: train at least this long on every rank")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--backup-dir", help="--part resume: BackupAndRestore's folder")
p.add_argument("--slow", type=float, default=0.0,
               help="--part resume: sleep this long after each batch")
args = p.parse_args()
parts = args.part or ["topology"]

io.emit("PID", f"{os.getpid()} {socket.gethostname()}")

import numpy as np
import tensorflow as tf
import mpistrategy
from mpistrategy import ops
from mpistrategy import runtime

mpistrategy.init()
rank, size = mpistrategy.rank(), mpistrategy.size()


def emit_json(event, value):
  io.emit(event, json.dumps(value, separators=(",", ":")))


def tolist(t):
  return np.asarray(t).tolist()


def part_topology():
  total = ops.allreduce(tf.constant(float(rank + 1)), op=ops.Sum,
                        name="topology_sum")
  emit_json("INIT", {"rank": rank, "size": size,
                     "local_rank": mpistrategy.local_rank(),
                     "local_size": mpistrategy.local_size(),
                     "host": socket.gethostname(), "pid": os.getpid(),
                     "rank_hosts": runtime.rank_hosts(),
                     "sum": float(total.numpy())})


def part_ops():
  """Each collective once, with inputs that differ per rank."""
  x = tf.constant([rank + 1.0, 2.0 * (rank + 1), 10.0])
  emit_json("OP", ["allreduce_sum", tolist(ops.allreduce(x, op=ops.Sum))])
  emit_json("OP", ["allreduce_avg", tolist(ops.allreduce(x, op=ops.Average))])
  # 4 MiB: many TCP segments, not one small message.
  big = tf.fill([1 << 20], float(rank + 1))
  got = ops.allreduce(big, op=ops.Sum).numpy()
  emit_json("OP", ["allreduce_big", [float(got.min()), float(got.max()),
                                     int(got.size)]])
  # Not a multiple of the ranks per host (hierarchical allreduce pads the
  # host's shards); the mean divides by all ranks.
  odd = tf.range(1001, dtype=tf.float32) * float(rank + 1)
  got = ops.allreduce(odd, op=ops.Average).numpy()
  want = np.arange(1001, dtype=np.float32) * ((size + 1) / 2.0)
  emit_json("OP", ["allreduce_odd_mean", bool((got == want).all())])
  # The shared-memory segments this rank maps (the CPU data plane).
  with open("/proc/self/maps") as f:
    emit_json("OP", ["shm_segments", sorted(
        {line.split()[5] for line in f if "/dev/shm/mpistrategy-" in line})])
  # Different first dimensions: rank r contributes r + 1 rows.
  rows = tf.constant([[100 * rank + 10 * i + j for j in range(2)]
                      for i in range(rank + 1)], tf.int32)
  emit_json("OP", ["allgather", tolist(ops.allgather(rows))])
  # The root sits on the second host.
  root = size - 1
  emit_json("OP", ["broadcast", tolist(ops.broadcast(
      tf.constant([7.0 * rank + 1.0, -float(rank)]), root_rank=root))])
  # Rank r sends j + 1 rows of value 10 r + j to rank j.
  send = tf.constant([[10 * rank + j] for j in range(size)
                      for _ in range(j + 1)], tf.int64)
  out, received = ops.alltoall(send, splits=[j + 1 for j in range(size)])
  emit_json("OP", ["alltoall", [tolist(out), tolist(received)]])
  n = 2 * size + 1
  base = tf.reshape(tf.range(2 * n, dtype=tf.float32), [n, 2])
  emit_json("OP", ["reducescatter", tolist(
      ops.reducescatter(base * float(rank + 1), op=ops.Sum))])


def weights_hash(model):
  h = hashlib.sha256()
  for w in model.get_weights():
    h.update(np.ascontiguousarray(w, np.float32).tobytes())
  return h.hexdigest()[:16]


def part_keras():
  import keras
  keras.utils.set_random_seed(1234 + 17 * rank)  # only the broadcast agrees
  strategy = mpistrategy.MPIStrategy()
  data = np.random.default_rng(7)
  x = data.normal(size=(512, 16)).astype(np.float32)
  y = (x @ data.normal(size=(16, 1)) > 0).astype(np.float32)
  with strategy.scope():
    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
  before = weights_hash(model)
  history = model.fit(x, y, batch_size=64, epochs=args.epochs, verbose=0)
  io.emit("WEIGHTS", f"{weights_hash(model)} before={before} loss="
          + ",".join(f"{v:.6f}" for v in history.history["loss"]))


def part_train():
  """Trains until every rank has trained `--seconds` (agreed each step)."""
  w = tf.Variable(tf.zeros([256]))
  x = tf.constant(np.linspace(0, 1, 256, dtype=np.float32) + rank)

  @tf.function
  def train_step(x, done):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum((w * x - 1.0) ** 2)
    grad = ops.allreduce(tape.gradient(loss, w), op=ops.Average,
                         name="grad")
    w.assign_sub(1e-4 * grad)
    # Every rank stops at the same step: once any rank's time is up.
    return ops.allreduce(done, op=ops.Sum, name="done")

  io.emit("TRAINING")
  start = last = time.time()
  step = 0
  try:
    while True:
      done = train_step(x, tf.constant(
          1.0 if time.time() - start >= args.seconds else 0.0))
      step += 1
      if time.time() - last >= 1.0:
        last = time.time()
        io.emit("PROGRESS", str(step))
      if float(done.numpy()) > 0:
        break
    total = ops.allreduce(tf.constant(float(rank + 1)), op=ops.Sum,
                          name="final_sum")
  except tf.errors.OpError as e:
    io.emit("CAUGHT", io.error_text(e))
    raise
  emit_json("FINISHED", {"steps": step, "sum": float(total.numpy()),
                         "w": hashlib.sha256(w.numpy().tobytes()).hexdigest()[
                             :16]})


def part_resume():
  """fit with BackupAndRestore: 4 epochs of 8 global batches of 24 rows."""
  import keras
  strategy = mpistrategy.MPIStrategy()
  rng = np.random.RandomState(0)
  x = rng.randn(192, 4).astype(np.float32)
  y = x @ np.array([[1.0], [2.0], [-1.0], [0.5]], np.float32)
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        1, kernel_initializer="zeros")])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")

  class Report(keras.callbacks.Callback):

    def on_train_begin(self, logs=None):
      # After BackupAndRestore (earlier in the list) restored the backup.
      io.emit("RESUMED", str(int(self.model.optimizer.iterations.numpy())))

    def on_train_batch_end(self, batch, logs=None):
      io.emit("PROGRESS", str(int(self.model.optimizer.iterations.numpy())))
      time.sleep(args.slow)

  model.fit(x, y, batch_size=24, epochs=4, shuffle=False, verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(args.backup_dir,
                                                        save_freq=2),
                       Report()])
  emit_json("FINISHED", {
      "steps": int(model.optimizer.iterations.numpy()),
      "w": hashlib.sha256(model.get_weights()[0].tobytes()).hexdigest()[:16]})


for part in parts:
  {"topology": part_topology, "ops": part_ops, "keras": part_keras,
   "train": part_train, "resume": part_resume}[part]()
io.emit("DONE")
mpistrategy.shutdown()
