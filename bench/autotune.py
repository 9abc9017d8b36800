"""Effect of autotuning (Options.autotune) on fusion-sensitive workloads.

Run (not under mpirun: it launches its own jobs):

    .venv/bin/python bench/autotune.py [--np 2] [--skip-synthetic]

Each workload is first run with `autotune=True` until the tuning is final;
then the starting parameters and the chosen ones are timed *alternately*
(several rounds, medians over all rounds), so the ratio is not skewed by the
slow drift of a shared machine (back-to-back blocks of the same
configuration differ by up to 40 % on the 2-core development VM).

  200 x 16 KB   200 float32 16 KB tensors per tf.function call, as one
                `grouped_allreduce` and as 200 separate `allreduce` ops
                (which reach the engine a little apart, so the fusion wait
                matters).  Tuned on the separate-ops workload, from two
                starting points: the defaults, and a poor start
                (fusion_wait_ms=2, which adds 2 ms to every step), to show
                that tuning finds its way back.
  synthetic     examples/synthetic_benchmark.py (a convolutional model with
                many variables, `model.fit`): one job with
                MPISTRATEGY_AUTOTUNE=1 and enough warm-up steps for tuning to
                finish, then alternating jobs with the default and with the
                chosen parameters.

Rank 0 prints a markdown table: median latency per call (or step time and
img/s) for the starting and the chosen parameters and their ratio.  This is
a measurement, not a test: exit status 0 unless a job fails.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import numpy as np

from _mpirun import mpirun_command

COUNT = 200
TENSOR_BYTES = 16 << 10
STARTS = {
    "defaults": {},
    "poor start (wait 2 ms)": {"fusion_wait_ms": 2.0},
}


def _mpirun(np_, argv, extra_env=None, timeout=900):
  """Runs `python argv` on np_ ranks; returns rank 0's stdout."""
  env = dict(os.environ)
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  env["PYTHONPATH"] = _ROOT + (os.pathsep + env["PYTHONPATH"]
                               if env.get("PYTHONPATH") else "")
  env.update(extra_env or {})
  exports = ["PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL"] + sorted(extra_env or {})
  cmd = mpirun_command(np_, [sys.executable] + argv, exports)
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                        timeout=timeout, check=False)
  if proc.returncode != 0:
    sys.stderr.write(proc.stdout + proc.stderr)
    raise SystemExit(f"bench/autotune.py: job failed ({proc.returncode}): "
                     f"{' '.join(cmd)}")
  return proc.stdout


# ---------------------------------------------------------------- worker


def _worker(args):
  """Runs inside mpirun: tune, then time start vs chosen alternately."""
  import tensorflow as tf
  import mpistrategy
  from mpistrategy import ops

  def restart(**fields):
    if mpistrategy.is_initialized():
      mpistrategy.shutdown()
    mpistrategy.init(mpistrategy.Options(**fields))

  restart()
  rank, size = mpistrategy.rank(), mpistrategy.size()
  x = tf.fill([COUNT * TENSOR_BYTES // 4], tf.constant(rank + 1, tf.float32))
  expected = size * (size + 1) / 2

  @tf.function
  def grouped(t):
    return ops.grouped_allreduce(tf.split(t, COUNT), op=ops.Sum)

  @tf.function
  def separate(t):
    return [ops.allreduce(p, op=ops.Sum) for p in tf.split(t, COUNT)]

  def timed(fn, iters):
    samples = []
    for _ in range(iters):
      t0 = time.perf_counter()
      out = fn(x)
      np.asarray(out[-1])
      samples.append(time.perf_counter() - t0)
    return samples

  def agreed(value, op):
    return float(np.asarray(ops.allreduce(tf.constant(float(value)), op=op)))

  results = {}
  for label, start in STARTS.items():
    # 1. Tune on the separate-ops workload until every rank sees the final
    #    parameters (agreed, so all ranks leave the loop together).
    restart(autotune=True, **start)
    t0 = time.perf_counter()
    while True:
      timed(separate, 20)
      all_final = agreed(ops.tuned_parameters()["final"], ops.Min)
      elapsed = agreed(time.perf_counter() - t0, ops.Max)
      if all_final == 1.0 or elapsed > args.tune_seconds:
        break
    chosen = ops.tuned_parameters()
    tune_seconds = time.perf_counter() - t0
    fixed = {"fusion_threshold_bytes": chosen["fusion_threshold_bytes"],
             "fusion_wait_ms": chosen["fusion_wait_ms"]}

    # 2. Start vs chosen, alternating.
    samples = {("start", "grouped"): [], ("start", "separate"): [],
               ("chosen", "grouped"): [], ("chosen", "separate"): []}
    for _ in range(args.rounds):
      for which, fields in (("start", start), ("chosen", fixed)):
        restart(**fields)
        timed(grouped, 5)
        timed(separate, 5)
        ops.barrier()
        samples[(which, "grouped")] += timed(grouped, args.iters)
        samples[(which, "separate")] += timed(separate, args.iters)
        assert float(np.asarray(separate(x)[0])[0]) == expected
    results[label] = {
        "start": start, "chosen": chosen, "tune_seconds": tune_seconds,
        "ms": {f"{w}/{k}": float(np.median(v)) * 1e3
               for (w, k), v in samples.items()},
    }
  restart()
  if rank == 0:
    print("RESULT " + json.dumps(results), flush=True)


# ---------------------------------------------------------------- driver


def _synthetic(np_, args, env, warmup):
  argv = [os.path.join(_ROOT, "examples", "synthetic_benchmark.py"),
          "--num-warmup", str(warmup), "--num-iters",
          str(args.synthetic_iters)]
  out = _mpirun(np_, argv, env)
  step = re.search(r"Step time: median ([\d.]+) ms", out)
  total = re.search(r"Total img/sec on \d+ rank\(s\): ([\d.]+)", out)
  tuned = re.search(r"Tuned parameters: fusion_threshold_bytes=(\d+) "
                    r"fusion_wait_ms=([\d.e+-]+)( \(not final\))?", out)
  if not step or not total:
    raise SystemExit("bench/autotune.py: cannot parse synthetic output:\n" +
                     out)
  result = {"step_ms": float(step.group(1)), "img_s": float(total.group(1))}
  if tuned:
    result["parameters"] = {
        "fusion_threshold_bytes": int(tuned.group(1)),
        "fusion_wait_ms": float(tuned.group(2)),
        "final": tuned.group(3) is None}
  return result


def _fmt_parameters(p):
  return (f"threshold {p['fusion_threshold_bytes'] / (1 << 20):g} MiB, wait "
          f"{p['fusion_wait_ms']:g} ms" + ("" if p.get("final", True) else
                                           " (not final)"))


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--np", type=int, default=2)
  p.add_argument("--iters", type=int, default=20,
                 help="timed calls per configuration and round")
  p.add_argument("--rounds", type=int, default=5,
                 help="alternations of start and chosen parameters")
  p.add_argument("--tune-seconds", type=float, default=180.0,
                 help="give up waiting for final parameters after this long")
  p.add_argument("--skip-synthetic", action="store_true")
  p.add_argument("--synthetic-tune-steps", type=int, default=1500,
                 help="warm-up steps of the autotuned synthetic job")
  p.add_argument("--synthetic-iters", type=int, default=40)
  p.add_argument("--synthetic-rounds", type=int, default=2)
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.worker:
    _worker(args)
    return 0

  out = _mpirun(args.np, [os.path.abspath(__file__), "--worker",
                          "--iters", str(args.iters), "--rounds",
                          str(args.rounds), "--tune-seconds",
                          str(args.tune_seconds)], timeout=1800)
  line = [l for l in out.splitlines() if l.startswith("RESULT ")]
  if not line:
    raise SystemExit("bench/autotune.py: worker printed no result:\n" + out)
  micro = json.loads(line[-1][len("RESULT "):])

  print(f"\nAutotune, {args.np} ranks: starting vs chosen parameters, timed "
        "alternately (median; ratio = chosen / start)\n")
  print("| case | start | chosen parameters | start | chosen | ratio |")
  print("|---|---|---|---:|---:|---:|")
  for label, r in micro.items():
    for kind, what in (("grouped", "grouped_allreduce, ms/call"),
                       ("separate", "200 separate allreduce ops, ms/call")):
      s, c = r["ms"][f"start/{kind}"], r["ms"][f"chosen/{kind}"]
      print(f"| 200 x 16 KB, {what} | {label} | "
            f"{_fmt_parameters(r['chosen'])} (tuned in "
            f"{r['tune_seconds']:.0f} s) | {s:.2f} | {c:.2f} | {c / s:.2f} |")

  if not args.skip_synthetic:
    tuned = _synthetic(args.np, args, {"MPISTRATEGY_AUTOTUNE": "1"},
                       args.synthetic_tune_steps)
    chosen = tuned.get("parameters")
    if chosen is None:
      raise SystemExit("bench/autotune.py: the synthetic job did not report "
                       "tuned parameters")
    env = {"MPISTRATEGY_FUSION_THRESHOLD_BYTES":
               str(chosen["fusion_threshold_bytes"]),
           "MPISTRATEGY_FUSION_WAIT_MS": repr(chosen["fusion_wait_ms"])}
    runs = {"start": [], "chosen": []}
    for _ in range(args.synthetic_rounds):
      runs["start"].append(_synthetic(args.np, args, {}, 5))
      runs["chosen"].append(_synthetic(args.np, args, env, 5))
    for key, what in (("step_ms", "step time, ms"),
                      ("img_s", "total img/s")):
      s = float(np.median([r[key] for r in runs["start"]]))
      c = float(np.median([r[key] for r in runs["chosen"]]))
      print(f"| synthetic_benchmark, {what} | defaults | "
            f"{_fmt_parameters(chosen)} | {s:.1f} | {c:.1f} | {c / s:.2f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
