"""One rank never submits a tensor the others wait on.

Every rank but the last submits `stall_tensor`; the last rank does not.  With
MPISTRATEGY_STALL_WARNING_SECONDS / MPISTRATEGY_STALL_TIMEOUT_SECONDS set by
the test, the coordinator logs a stall warning naming the tensor and the
missing rank, and the waiting ranks get `tf.errors.DeadlineExceededError`.
The lagging rank waits (on a file, not a collective) until every waiting rank
has seen its error; then all ranks meet in a barrier -- proving the engine is
still usable after a stall timeout -- and exit cleanly.

Events: INIT, SUBMIT, DEADLINE (or UNEXPECTED_OK / OTHER_ERROR), BARRIER_OK,
DONE.
"""

import os
import time

import _rankio as io

p = io.parser(__doc__)
p.add_argument("--sync-dir", required=True,
               help="directory for the waiting ranks' 'seen it' files")
p.add_argument("--max-wait", type=float, default=40.0)
args = p.parse_args()

import tensorflow as tf
import mpistrategy
from mpistrategy import ops

mpistrategy.init()
rank, size = mpistrategy.rank(), mpistrategy.size()
io.emit("INIT", f"rank={rank} size={size}")
lagging = size - 1

# Everybody is up before the stall window starts.
ops.allreduce(tf.ones([4]), name="warmup")

if rank != lagging:
  io.emit("SUBMIT", "stall_tensor")
  try:
    out = ops.allreduce(tf.ones([4]), name="stall_tensor")
    io.emit("UNEXPECTED_OK", out.numpy().tolist())
  except tf.errors.DeadlineExceededError as e:
    io.emit("DEADLINE", io.error_text(e))
  except tf.errors.OpError as e:  # pylint: disable=broad-except
    io.emit("OTHER_ERROR", io.error_text(e))
  with open(os.path.join(args.sync_dir, f"seen.{rank}"), "w",
            encoding="utf-8"):
    pass
else:
  deadline = time.time() + args.max_wait
  while time.time() < deadline:
    seen = [f for f in os.listdir(args.sync_dir) if f.startswith("seen.")]
    if len(seen) == size - 1:
      break
    time.sleep(0.1)
  io.emit("LAGGING_RANK_DONE_WAITING", f"waited for {size - 1} ranks")

try:
  ops.barrier(name="after_stall")
  io.emit("BARRIER_OK")
except tf.errors.OpError as e:  # pylint: disable=broad-except
  io.emit("BARRIER_ERROR", io.error_text(e))
mpistrategy.shutdown()
io.emit("DONE")
