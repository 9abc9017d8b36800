"""What a rank prints: started by tests/launcher/test_run_launcher.py.

Prints a plain line with `print` (several pieces under PYTHONUNBUFFERED), a
Python warning and a "tensorflow" logger warning after importing
TensorFlow and mpistrategy, allreduces, and, with --raise-rank R, raises
on rank R after the allreduce.

Events: PID, RESULT, DONE.
"""

import logging
import os
import warnings

import _rankio as io

p = io.parser(__doc__)
p.add_argument("--raise-rank", type=int, default=-1)
args = p.parse_args()

io.emit("PID", str(os.getpid()))

import tensorflow as tf
import mpistrategy
from mpistrategy import ops

mpistrategy.init()
rank = mpistrategy.rank()
warnings.warn(f"a Python warning from rank {rank}")
logging.getLogger("tensorflow").warning("a tensorflow logger warning from "
                                        "rank %d", rank)
print("plain print from rank", rank, "of", mpistrategy.size())
total = ops.allreduce(tf.constant(1.0), op=ops.Sum)
io.emit("RESULT", f"{float(total.numpy()):g}")
if rank == args.raise_rank:
  raise RuntimeError(f"deliberate failure on rank {rank}")
io.emit("DONE")
