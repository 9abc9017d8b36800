"""A training loop in which one rank dies mid-training.

--mode raise  the failing rank raises an unhandled RuntimeError
--mode exit   the failing rank calls os._exit(3)
--mode kill   the failing rank sends itself SIGKILL

The other ranks keep training and block in the next allreduce; the library
(abort propagation) or mpirun must stop them.  A surviving rank that gets an
error prints it (CAUGHT) and re-raises it, as a user program would.

Events: INIT, TRAINING, SHM (after a step: the shared-memory segments this
rank maps, "name exists|gone" each), FAIL (failing rank, just before dying),
CAUGHT (survivors, if they get to see an error), FINISHED (must not happen).
"""

import os
import signal

import _rankio as io

p = io.parser(__doc__)
p.add_argument("--mode", choices=["raise", "exit", "kill"], required=True)
p.add_argument("--fail-rank", type=int, default=1)
p.add_argument("--fail-step", type=int, default=50)
p.add_argument("--steps", type=int, default=1000000)
args = p.parse_args()

import numpy as np
import tensorflow as tf
import mpistrategy
from mpistrategy import ops

mpistrategy.init()
rank, size = mpistrategy.rank(), mpistrategy.size()
io.emit("INIT", f"rank={rank} size={size}")

w = tf.Variable(tf.zeros([64]))
x = tf.constant(np.linspace(0, 1, 64, dtype=np.float32) + rank)


@tf.function
def train_step(x):
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum((w * x - 1.0) ** 2)
  grad = tape.gradient(loss, w)
  grad = ops.allreduce(grad, op=ops.Average)
  w.assign_sub(0.001 * grad)
  return loss


io.emit("TRAINING")
try:
  for step in range(args.steps):
    if step == 1:
      with open("/proc/self/maps") as f:
        names = sorted({l.split()[5] for l in f
                        if "/dev/shm/mpistrategy-" in l})
      io.emit("SHM", " ".join(
          f"{n} {'exists' if os.path.exists(n) else 'gone'}" for n in names))
    if rank == args.fail_rank and step == args.fail_step:
      io.emit("FAIL", f"{args.mode} at step {step}")
      if args.mode == "raise":
        raise RuntimeError(f"injected failure on rank {rank} at step {step}")
      if args.mode == "exit":
        os._exit(3)  # pylint: disable=protected-access
      os.kill(os.getpid(), signal.SIGKILL)
    train_step(x)
except tf.errors.OpError as e:
  io.emit("CAUGHT", io.error_text(e))
  raise
io.emit("FINISHED", f"{args.steps} steps")
mpistrategy.shutdown()
