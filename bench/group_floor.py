"""What a group of many tensors costs TF itself, before any transfer.

Run in a world of one (~20 s; no mpirun needed):

    .venv/bin/python bench/group_floor.py [--tensors 200] [--elements 4096]

The 200 x 16 KB case of `allreduce.py` compares `grouped_allreduce` with
raw MPI on one numpy buffer, which never handles 200 tensors.  Here the
same chain of dependent ops (each op's outputs are the next op's inputs,
inside one `tf.function`) runs with nothing to transfer, so what is left
is TF's own handling of the tensors and the op's packing:

* `tf.identity_n`: TF's executor passing the tensors from op to op;
* `tf.split(tf.concat(...))`: the same plus one copy into one buffer, the
  TF-native form of what `grouped_allreduce` does on CPU;
* `grouped_allreduce`: the op itself (packing, engine round trip, slices).

Prints, per variant, milliseconds per op: the fastest and the median of
`--blocks` timed blocks.
"""

import argparse
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import tensorflow as tf

import mpistrategy
from mpistrategy import ops


def _chain(body, length):
  """A tf.function applying `body(tensors, k)` `length` times in a row."""

  @tf.function
  def run(tensors):
    for k in range(length):
      tensors = body(tensors, k)
    return tensors[0]

  return run


def _ms_per_op(fn, tensors, chain, calls, blocks):
  """(fastest, median) over `blocks` blocks of `calls` calls, per op."""
  for _ in range(max(3, calls // 5)):  # trace and warm up
    fn(tensors)
  per_op = []
  for _ in range(blocks):
    start = time.perf_counter()
    for _ in range(calls):
      fn(tensors)
    per_op.append((time.perf_counter() - start) / calls / chain * 1e3)
  per_op.sort()
  return per_op[0], per_op[len(per_op) // 2]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tensors", type=int, default=200)
  parser.add_argument("--elements", type=int, default=4096,
                      help="float32 elements per tensor (4096: 16 KB)")
  parser.add_argument("--chain", type=int, default=8,
                      help="dependent ops per tf.function call")
  parser.add_argument("--calls", type=int, default=50,
                      help="tf.function calls per timed block")
  parser.add_argument("--blocks", type=int, default=5)
  # tests/launcher tags its jobs' command lines to find leftover processes.
  parser.add_argument("--marker", default="", help=argparse.SUPPRESS)
  args = parser.parse_args()
  for name in ("tensors", "elements", "chain", "calls", "blocks"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be at least 1")

  mpistrategy.init()
  if mpistrategy.size() != 1:
    sys.exit("group_floor.py measures TF alone: run it without mpirun")
  count = args.tensors
  tensors = [tf.fill([args.elements], float(i)) for i in range(count)]
  variants = (
      ("tf.identity_n", lambda ts, k: tf.identity_n(ts)),
      ("tf.split(tf.concat(...))",
       lambda ts, k: tf.split(tf.concat(ts, 0), count)),
      ("ops.grouped_allreduce",
       lambda ts, k: ops.grouped_allreduce(ts, name=f"group_floor/{k}")),
  )
  print(f"{count} x {args.elements * 4 / 1024:g} KB float32, "
        f"{args.chain} dependent ops per tf.function call, world of one; "
        "ms per op")
  print("| variant | fastest | median |")
  print("|---|---|---|")
  for label, body in variants:
    fastest, median = _ms_per_op(_chain(body, args.chain), tensors,
                                 args.chain, args.calls, args.blocks)
    print(f"| {label} | {fastest:.3f} | {median:.3f} |")
  mpistrategy.shutdown()


if __name__ == "__main__":
  main()
