"""The rank program that tests/launcher/test_run_launcher.py starts with
`python -m mpistrategy.run`.

Initializes mpistrategy, allreduces rank + 1 (SUM) and prints the result and
the resolved options.  Then, depending on the flags, exits with a code on one
rank or waits to be killed.

Events: PID (the process id), CPUS (the CPUs it may run on, comma-separated),
INIT (rank, size), RESULT (the allreduce
result), OPTIONS (`field=value` of `mpistrategy.current_options()`), READY
(--wait: waiting for a signal), DONE.
"""

import dataclasses
import os
import sys
import time

import _rankio as io

p = io.parser(__doc__)
p.add_argument("--exit-code", type=int, default=0,
               help="exit with this code on --exit-rank after the allreduce")
p.add_argument("--exit-rank", type=int, default=-1)
p.add_argument("--wait", action="store_true",
               help="after the allreduce, sleep until killed")
args = p.parse_args()

io.emit("PID", str(os.getpid()))
io.emit("CPUS", ",".join(str(c) for c in sorted(os.sched_getaffinity(0))))

import tensorflow as tf
import mpistrategy
from mpistrategy import ops

mpistrategy.init()
rank, size = mpistrategy.rank(), mpistrategy.size()
io.emit("INIT", f"rank={rank} size={size}")
total = ops.allreduce(tf.constant(float(rank + 1)), op=ops.Sum)
io.emit("RESULT", f"{float(total.numpy()):g}")
options = mpistrategy.current_options()
io.emit("OPTIONS", " ".join(f"{f.name}={getattr(options, f.name)!r}"
                            for f in dataclasses.fields(options)))

if args.wait:
  io.emit("READY")
  while True:
    time.sleep(0.1)

if rank == args.exit_rank:
  io.emit("EXIT", str(args.exit_code))
  sys.exit(args.exit_code)
io.emit("DONE")
