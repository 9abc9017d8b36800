"""Peak CPU memory of a grouped_allreduce against one allreduce per tensor.

On the shared-memory plane a group of one dtype whose inputs the op alone
holds is reduced in place, so the group must not take more memory than the
same tensors reduced one by one (no buffer the size of the group).  Events:
PEAK "<case> <MiB> ok|WRONG ..." for "grouped" and "single", DONE.
"""

import os

# TensorFlow reports CPU memory only through its BFC allocator.
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"

import _rankio as io

p = io.parser(__doc__)
args = p.parse_args()

import tensorflow as tf
import mpistrategy
from mpistrategy import ops

mpistrategy.init()
N = 4 << 20  # 16 MiB of float32 per tensor


@tf.function
def grouped(a):
  ys = ops.grouped_allreduce([a * 2.0, a * 3.0], op=ops.Sum)
  return tf.reduce_sum(ys[0]) + tf.reduce_sum(ys[1])


@tf.function
def single(a):
  return (tf.reduce_sum(ops.allreduce(a * 2.0, op=ops.Sum)) +
          tf.reduce_sum(ops.allreduce(a * 3.0, op=ops.Sum)))


a = tf.ones([N])
want = 5.0 * N * mpistrategy.size()
for name, fn in (("grouped", grouped), ("single", single)):
  fn(a)  # traces
  tf.config.experimental.reset_memory_stats("CPU:0")
  got = float(fn(a))
  peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20
  verdict = "ok" if abs(got - want) <= 1e-6 * want else f"WRONG {got}"
  io.emit("PEAK", f"{name} {peak:.1f} {verdict}")
ops.barrier()
io.emit("DONE")
