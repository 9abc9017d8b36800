"""Allreduce op=Average against op=Sum, float32, in one job.

Run:
    mpirun --allow-run-as-root -np 2 .venv/bin/python bench/mean_vs_sum.py \
        [--sizes 4MB,64MB,50x64KB] [--rounds 5] [--json out.json]

Each case is timed as "per op, chained" (bench/allreduce.py's form): k
dependent `ops.allreduce` calls in one `tf.function`, time per op, the
result read on the host.  `NxSIZE` is N separate ops per link of the
chain (k = 2), which the engine fuses through its fusion buffer (the path
where MEAN's division rides on the copies out of the buffer).  Sum and
Average alternate within each round (the order flips every round), and the
ratio reported is the median over rounds of that round's Average/Sum ratio,
so both sides of it were measured seconds apart on a machine whose load
drifts.  Rank 0
prints a markdown table and the machine's load average.
"""

import argparse
import json
import os
import re
import sys
import time

# Runnable from a source checkout without PYTHONPATH.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import numpy as np

_UNITS = {"KB": 1 << 10, "MB": 1 << 20}


def parse_case(text):
  """'4MB' -> (1, 4 << 20); '200x16KB' -> (200, 16 << 10)."""
  m = re.fullmatch(r"(?:(\d+)[xX])?(\d+)(KB|MB)", text.strip().upper())
  if not m:
    raise ValueError(f"--sizes: {text!r} is not SIZE or NxSIZE (KB, MB)")
  return int(m.group(1) or 1), int(m.group(2)) * _UNITS[m.group(3)]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="4MB,64MB,50x64KB")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--json", default="")
  args = parser.parse_args()
  try:
    cases = [parse_case(t) for t in args.sizes.split(",")]
  except ValueError as e:
    print(e, file=sys.stderr)
    return 2
  if args.rounds < 1:
    print("--rounds must be >= 1", file=sys.stderr)
    return 2

  import tensorflow as tf
  import mpistrategy
  from mpistrategy import ops

  rank, size = mpistrategy.rank(), mpistrategy.size()
  results = []
  for count, nbytes in cases:
    n = nbytes // 4
    total = count * nbytes
    if count > 1:
      k = 2  # count ops per link: tracing cost grows with count * k
    else:
      k = 30 if total <= 64 << 10 else (8 if total <= 16 << 20 else 4)
    iters = 15 if total <= 4 << 20 else 4
    inputs = [tf.fill([n], tf.constant(rank + 1, tf.float32))
              for _ in range(count)]

    def make_chain(op):
      @tf.function
      def chain(*ts):
        ts = list(ts)
        for _ in range(k):
          ts = [ops.allreduce(t, op=op) for t in ts]
        return ts
      return chain

    chains = {"sum": make_chain(ops.Sum), "average": make_chain(ops.Average)}
    expected = {"sum": (size * (size + 1) / 2) * size ** (k - 1),
                "average": (size + 1) / 2}
    samples = {"sum": [], "average": []}
    ratios = []
    for r in range(args.rounds):
      order = ("sum", "average") if r % 2 == 0 else ("average", "sum")
      medians = {}
      for name in order:
        chain = chains[name]
        for _ in range(2):  # warm-up: tracing, response cache, buffers
          chain(*inputs)
        ops.barrier()
        times = []
        for _ in range(iters):
          t0 = time.perf_counter()
          out = chain(*inputs)
          first = np.asarray(out[0])
          times.append((time.perf_counter() - t0) / k)
        if not np.all(first == expected[name]):
          raise AssertionError(f"{name}: got {first[:4]}, expected "
                               f"{expected[name]}")
        samples[name] += times
        medians[name] = float(np.median(times))
      ratios.append(medians["average"] / medians["sum"])
    label = (f"{count}x{nbytes >> 10} KB" if count > 1 else
             f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else
             f"{nbytes >> 10} KB")
    results.append({
        "case": label, "chain_length": k,
        "sum_ms": float(np.median(samples["sum"]) * 1e3),
        "average_ms": float(np.median(samples["average"]) * 1e3),
        "ratio": float(np.median(ratios)),
        "ratios": ratios,
    })
    if rank == 0:  # progress, in case a slow machine ends the job early
      print(f"{label}: Average/Sum per round "
            f"{' '.join(f'{x:.3f}' for x in ratios)}", flush=True)

  if rank == 0:
    print(f"\n{size} ranks, float32, per op chained, {args.rounds} rounds")
    print("| case | Sum ms | Average ms | Average / Sum (median of rounds) |")
    print("|---|---|---|---|")
    for r in results:
      print(f"| {r['case']} | {r['sum_ms']:.3f} | {r['average_ms']:.3f} | "
            f"{r['ratio']:.3f} |")
    print(f"load average: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if args.json:
      with open(args.json, "w") as f:
        json.dump({"size": size, "results": results}, f, indent=1)
  mpistrategy.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
