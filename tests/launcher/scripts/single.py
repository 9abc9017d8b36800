"""Run without mpirun: mpistrategy must work as a world of size 1.

Every collective returns its input (allreduce Sum/Average, grouped_allreduce,
allgather, broadcast), eagerly and inside a tf.function.  Events: INIT, CHECK
(one per case: "<case> ok" or "<case> WRONG ..."), DONE.
"""

import _rankio as io

p = io.parser(__doc__)
args = p.parse_args()

import numpy as np
import tensorflow as tf
import mpistrategy
from mpistrategy import ops

mpistrategy.init()
io.emit("INIT", f"rank={mpistrategy.rank()} size={mpistrategy.size()} "
        f"local_rank={mpistrategy.local_rank()} "
        f"local_size={mpistrategy.local_size()}")

x = tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3))


def check(case, got, want):
  got = np.asarray(got)
  ok = got.shape == np.shape(want) and np.allclose(got, want)
  io.emit("CHECK", f"{case} ok" if ok else
          f"{case} WRONG got {got.tolist()} want {np.asarray(want).tolist()}")


check("allreduce_sum", ops.allreduce(x, op=ops.Sum), x)
check("allreduce_average", ops.allreduce(x, op=ops.Average), x)
check("grouped_allreduce",
      ops.grouped_allreduce([x, 2 * x])[1], 2 * x)
check("allgather", ops.allgather(x), x)
check("broadcast", ops.broadcast(x, root_rank=0), x)
ops.barrier()


@tf.function
def fn(t):
  return ops.allreduce(t, op=ops.Sum) + ops.allgather(t)


check("tf_function", fn(x), 2 * x)
mpistrategy.shutdown()
io.emit("DONE")
