"""One rank is frozen with SIGSTOP while the others run collectives.

Rank 0 (rank 1 when rank 0 is the one frozen) sends SIGSTOP to
`--frozen-rank` (all ranks share the host) and, with `--freeze-seconds`,
SIGCONT after that long.  Every rank runs
`--steps` eager allreduces of `[rank + 1] * step`, checking each result;
a rank whose collective fails reports the error and then stays alive doing
nothing (`--linger` seconds), as a program that catches the error would:
the library itself must end the job.  With MPISTRATEGY_PEER_TIMEOUT_SECONDS
set by the test, a freeze shorter than the timeout must not be noticed.

Events: INIT (pid host), PIDS, FREEZE, THAW, STEP_ERROR (wrong result),
CAUGHT (the error), LINGER, FINISHED.
"""

import os
import signal
import socket
import time

import _rankio as io

p = io.parser(__doc__)
p.add_argument("--frozen-rank", type=int, default=1)
p.add_argument("--freeze-seconds", type=float, default=0.0,
               help="0: never SIGCONT")
p.add_argument("--steps", type=int, default=30)
p.add_argument("--linger", type=float, default=120.0)
args = p.parse_args()

import tensorflow as tf
import mpistrategy
from mpistrategy import ops

mpistrategy.init()
rank, size = mpistrategy.rank(), mpistrategy.size()
io.emit("INIT", f"pid={os.getpid()} host={socket.gethostname()}")
pids = ops.allgather(tf.constant([os.getpid()], tf.int64),
                     name="pids").numpy().tolist()
io.emit("PIDS", " ".join(map(str, pids)))

stopper = 1 if args.frozen_rank == 0 else 0
try:
  for step in range(1, args.steps + 1):
    if rank == stopper and step == 5:
      os.kill(pids[args.frozen_rank], signal.SIGSTOP)
      io.emit("FREEZE", str(pids[args.frozen_rank]))
      if args.freeze_seconds > 0:
        time.sleep(args.freeze_seconds)
        os.kill(pids[args.frozen_rank], signal.SIGCONT)
        io.emit("THAW", str(pids[args.frozen_rank]))
    out = ops.allreduce(tf.constant([float(rank + 1) * step]), name="step")
    expected = step * size * (size + 1) / 2
    if abs(float(out.numpy()[0]) - expected) > 1e-3:
      io.emit("STEP_ERROR", f"step {step}: {out.numpy()} != {expected}")
    time.sleep(0.05)
except tf.errors.OpError as e:
  io.emit("CAUGHT", io.error_text(e))
  io.emit("LINGER", f"{args.linger} s")
  time.sleep(args.linger)
  io.emit("LINGER_OVER")
else:
  io.emit("FINISHED")
