"""Where the time of one allreduce call goes: TF dispatch, engine, MPI.

Run on 2 ranks (~1 min on 2 cores):

    mpirun -np 2 .venv/bin/python bench/latency_breakdown.py [--iters 300]

For each size, in one job: raw mpi4py `Allreduce` on numpy buffers (before
the engine starts), the `tf.function` floor (the same call with
`tf.identity`), and `mpistrategy.ops.allreduce` in a `tf.function` with the
engine's timeline on.  From the timeline (rank 0's) it takes, per call, the
NEGOTIATE span (enqueue until every rank agreed; includes waiting for the
other rank) and the ALLREDUCE span (the MPI call itself).  What is left of
the call after the floor, NEGOTIATE and ALLREDUCE is the kernel, the
callback and TF's handling of the async op.  Medians in ms, as seen on
rank 0.
"""

import argparse
import collections
import json
import os
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import numpy as np

SIZES = {"4 KB": 4 << 10, "256 KB": 256 << 10, "4 MB": 4 << 20}


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--iters", type=int, default=300)
  args = p.parse_args()

  from mpi4py import MPI
  import tensorflow as tf
  import mpistrategy
  from mpistrategy import ops

  comm = MPI.COMM_WORLD
  rank = comm.Get_rank()

  def median_ms(fn, iters):
    for _ in range(10):
      fn()
    comm.Barrier()
    samples = []
    for _ in range(iters):
      t0 = time.perf_counter()
      fn()
      samples.append(time.perf_counter() - t0)
    return float(np.median(samples)) * 1e3

  raw = {}
  for label, nbytes in SIZES.items():
    a = np.full(nbytes // 4, rank + 1, np.float32)
    b = np.empty_like(a)
    raw[label] = median_ms(lambda: comm.Allreduce(a, b), args.iters)  # pylint: disable=cell-var-from-loop

  directory = tempfile.mkdtemp(prefix="mpistrategy_breakdown_")
  trace = os.path.join(directory, "trace.{rank}.json")
  mpistrategy.init(mpistrategy.Options(timeline=trace))
  rows = []
  for label, nbytes in SIZES.items():
    x = tf.fill([nbytes // 4], float(rank + 1))

    @tf.function
    def floor(t):
      return tf.identity(t)

    @tf.function
    def reduce(t, name=label):
      return ops.allreduce(t, op=ops.Sum, name=f"breakdown {name}")

    floor_ms = median_ms(lambda: np.asarray(floor(x)), args.iters)  # pylint: disable=cell-var-from-loop
    call_ms = median_ms(lambda: np.asarray(reduce(x)), args.iters)  # pylint: disable=cell-var-from-loop
    rows.append((label, call_ms, floor_ms))
  mpistrategy.shutdown()  # completes the timeline file

  if rank != 0:
    return 0
  with open(trace.replace("{rank}", "0")) as f:
    events = json.load(f)
  rows_by_tid = {e["tid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "thread_name"}
  spans = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X":
      spans[(rows_by_tid.get(e["tid"], ""), e["name"])].append(
          e["dur"] / 1000.0)

  def span_ms(label, kind):
    # The timed iterations are the last ones of that collective.
    values = spans.get((f"breakdown {label}", kind), [])[-args.iters:]
    return float(np.median(values)) if values else float("nan")

  print(f"\nAllreduce latency breakdown, {comm.Get_size()} ranks, float32 SUM,"
        f" median of {args.iters} (ms)\n")
  print("| size | raw MPI | ops call | tf.function floor | NEGOTIATE | "
        "ALLREDUCE | rest | ops / raw |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|")
  for label, call_ms, floor_ms in rows:
    negotiate = span_ms(label, "NEGOTIATE")
    allreduce = span_ms(label, "ALLREDUCE")
    rest = call_ms - floor_ms - negotiate - allreduce
    print(f"| {label} | {raw[label]:.3f} | {call_ms:.3f} | {floor_ms:.3f} | "
          f"{negotiate:.3f} | {allreduce:.3f} | {rest:.3f} | "
          f"{call_ms / raw[label]:.2f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
