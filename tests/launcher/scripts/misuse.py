"""Bad configuration, local misuse and cross-rank mismatches, in one job.

The test starts this with MPISTRATEGY_FUSION_THRESHOLD_BYTES=abc in the
environment.  Each case prints one event per rank with the exception class
and message (or OK), and the script goes on: every error here must be
recoverable, raised on every rank, and must not hang.

Events (text = "<case> <ExceptionClass>: <message>" or "<case> OK ..."):
  CFG     configuration cases, before and without a running engine, and
          a start that fails on rank 0
  INIT    the engine started once the environment was fixed
  MISUSE  local misuse with a running engine (bad root rank, non-tensor)
  MM      cross-rank mismatches (shape, dtype, op, root, collective type)
  FINAL   a correct allreduce after all of the above, with its result
  DONE
"""

import os

import _rankio as io

p = io.parser(__doc__)
args = p.parse_args()

import numpy as np
import tensorflow as tf
import mpistrategy
from mpistrategy import ops

VAR = "MPISTRATEGY_FUSION_THRESHOLD_BYTES"


def attempt(event, case, fn):
  try:
    result = fn()
  except Exception as e:  # pylint: disable=broad-except
    io.emit(event, f"{case} {io.error_text(e)}")
    return None
  io.emit(event, f"{case} OK {io.one_line(repr(result))[:200]}")
  return result


# --- configuration, before the engine runs --------------------------------
attempt("CFG", "env_abc", mpistrategy.init)
io.emit("CFG", f"initialized_after_env_abc {mpistrategy.is_initialized()}")
os.environ[VAR] = "-5"
attempt("CFG", "env_negative", mpistrategy.init)
io.emit("CFG", f"initialized_after_env_negative "
        f"{mpistrategy.is_initialized()}")
attempt("CFG", "options_negative",
        lambda: mpistrategy.Options(fusion_threshold_bytes=-1))
attempt("CFG", "options_type",
        lambda: mpistrategy.Options(cycle_time_ms="fast"))
attempt("CFG", "init_not_options", lambda: mpistrategy.init({"a": 1}))
del os.environ[VAR]
# A start that fails on rank 0 (its timeline cannot be created; the others'
# fails naming rank 0), then a query in the handler on each rank: it waited
# for ever on rank 0 in a new (collective) start.
attempt("CFG", "start_fails", lambda: mpistrategy.init(
    mpistrategy.Options(timeline="/nonexistent-mpistrategy-dir/t.json")))
attempt("CFG", "rank_after_failed_start", mpistrategy.rank)

mpistrategy.init()
rank, size = mpistrategy.rank(), mpistrategy.size()
io.emit("INIT", f"rank={rank} size={size}")

# --- local misuse ----------------------------------------------------------
attempt("MISUSE", "root_too_large",
        lambda: ops.broadcast(tf.ones([4]), root_rank=size + 5,
                              name="bad_root_large"))
attempt("MISUSE", "root_negative",
        lambda: ops.broadcast(tf.ones([4]), root_rank=-1,
                              name="bad_root_negative"))
attempt("MISUSE", "dict_input",
        lambda: ops.allreduce({"a": tf.ones([2])}, name="bad_dict"))
attempt("MISUSE", "bad_reduce_op",
        lambda: ops.allreduce(tf.ones([2]), op="median", name="bad_op"))

# --- cross-rank mismatches -------------------------------------------------
f64 = tf.float64 if rank % 2 else tf.float32
attempt("MM", "shape",
        lambda: ops.allreduce(tf.ones([2 + rank]), name="mm_shape"))
attempt("MM", "dtype",
        lambda: ops.allreduce(tf.ones([4], dtype=f64), name="mm_dtype"))
attempt("MM", "op",
        lambda: ops.allreduce(tf.ones([4]),
                              op=ops.Max if rank % 2 else ops.Sum,
                              name="mm_op"))
attempt("MM", "root",
        lambda: ops.broadcast(tf.ones([4]), root_rank=rank % 2,
                              name="mm_root"))
if rank % 2:
  attempt("MM", "collective",
          lambda: ops.allgather(tf.ones([4]), name="mm_collective"))
else:
  attempt("MM", "collective",
          lambda: ops.allreduce(tf.ones([4]), name="mm_collective"))
attempt("MM", "gather_shape",
        lambda: ops.allgather(tf.ones([2, 3 + rank]), name="mm_gather_shape"))


@tf.function
def in_function(t):
  return ops.allreduce(t)


attempt("MM", "shape_in_function",
        lambda: in_function(tf.ones([5 + rank])))

# --- still usable ----------------------------------------------------------
out = attempt("FINAL", "allreduce",
              lambda: ops.allreduce(tf.fill([3], float(rank + 1)),
                                    name="final").numpy().tolist())
expected = float(size * (size + 1) // 2)
io.emit("FINAL", "correct" if out is not None and np.allclose(out, expected)
        else f"WRONG got {out} expected {expected}")
mpistrategy.shutdown()
io.emit("DONE")
