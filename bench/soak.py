"""Soak: many small training steps on N ranks; resident memory must not grow.

Run:
    mpirun --allow-run-as-root -np 2 .venv/bin/python bench/soak.py \
        [--steps 3000] [--measure-at 500] [--mode keras|ops] [--json out.json]

--mode keras (default): a tiny Keras MLP trained with `model.fit` under
`mpistrategy.MPIStrategy` (every step allreduces the gradients, the loss
and the metrics through the engine).
--mode ops: a `tf.function` loop computing a gradient by hand and averaging
it with `mpistrategy.ops.allreduce` (no strategy, no Keras).

Resident memory (VmRSS from /proc/self/status) is read on every rank after
step `--measure-at` (everything is traced, cached and allocated by then) and
after the last step.  Each rank prints one line:

    rank R: RSS at step 500: 612.3 MiB; at step 3000: 613.0 MiB;
    growth +0.11 % (target < 5 %): PASS      (one line)

Exit status: 0 if every rank is within --max-growth, 1 otherwise.
"""

import argparse
import json
import os
import sys
import time

# Runnable from a source checkout without PYTHONPATH.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)


def rss_kib():
  with open("/proc/self/status", encoding="ascii") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1])
  raise RuntimeError("no VmRSS in /proc/self/status")


def run_keras(args, marks):
  import numpy as np
  import tensorflow as tf
  import keras
  import mpistrategy

  strategy = mpistrategy.MPIStrategy()
  size = mpistrategy.size()
  global_batch = args.batch * size
  rng = np.random.RandomState(0)
  n = global_batch * 64
  x = rng.rand(n, 16).astype(np.float32)
  y = (x.sum(axis=1, keepdims=True) > 8).astype(np.float32)
  ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(
      global_batch, drop_remainder=True).repeat()

  with strategy.scope():
    model = keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(1, activation="sigmoid"),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss="binary_crossentropy", metrics=["accuracy"])

  class Probe(keras.callbacks.Callback):

    def on_train_batch_end(self, batch, logs=None):
      step = batch + 1
      if step == args.measure_at:
        marks["measure"] = (step, rss_kib(), time.time())
      if step % args.report_every == 0 and mpistrategy.rank() == 0:
        print(f"  step {step}: RSS {rss_kib() / 1024:.1f} MiB", flush=True)

  model.fit(ds, epochs=1, steps_per_epoch=args.steps, verbose=0,
            shuffle=False, callbacks=[Probe()])
  marks["end"] = (args.steps, rss_kib(), time.time())
  loss = model.evaluate(ds, steps=4, verbose=0)
  return {"final_loss": float(loss[0] if isinstance(loss, list) else loss)}


def run_ops(args, marks):
  import numpy as np
  import tensorflow as tf
  import mpistrategy
  from mpistrategy import ops

  mpistrategy.init()
  rank = mpistrategy.rank()
  w1 = tf.Variable(tf.random.stateless_normal([16, 32], seed=[1, 2]) * 0.1)
  w2 = tf.Variable(tf.random.stateless_normal([32, 1], seed=[3, 4]) * 0.1)
  rng = np.random.RandomState(rank)

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      h = tf.nn.relu(x @ w1)
      loss = tf.reduce_mean((h @ w2 - y) ** 2)
    grads = tape.gradient(loss, [w1, w2])
    grads = ops.grouped_allreduce(grads, op=ops.Average)
    w1.assign_sub(0.05 * grads[0])
    w2.assign_sub(0.05 * grads[1])
    return ops.allreduce(loss, op=ops.Average)

  x = tf.constant(rng.rand(args.batch, 16).astype(np.float32))
  y = tf.reduce_sum(x, axis=1, keepdims=True) / 16.0
  loss = None
  for i in range(1, args.steps + 1):
    loss = step(x, y)
    if i == args.measure_at:
      float(loss)
      marks["measure"] = (i, rss_kib(), time.time())
    if i % args.report_every == 0 and rank == 0:
      print(f"  step {i}: RSS {rss_kib() / 1024:.1f} MiB", flush=True)
  marks["end"] = (args.steps, rss_kib(), time.time())
  return {"final_loss": float(loss)}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=3000)
  p.add_argument("--measure-at", type=int, default=500,
                 help="step after which the baseline RSS is read")
  p.add_argument("--batch", type=int, default=32, help="per-rank batch")
  p.add_argument("--mode", choices=["keras", "ops"], default="keras")
  p.add_argument("--max-growth", type=float, default=5.0,
                 help="allowed RSS growth in percent")
  p.add_argument("--report-every", type=int, default=0,
                 help="rank 0 prints RSS every N steps (0: never)")
  p.add_argument("--json", help="rank 0 writes all ranks' results here")
  p.add_argument("--marker", default="", help=argparse.SUPPRESS)
  args = p.parse_args()
  if not 0 < args.measure_at < args.steps:
    p.error("--measure-at must be between 0 and --steps")
  if args.report_every <= 0:
    args.report_every = args.steps + 1

  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import mpistrategy
  from mpistrategy import ops
  import tensorflow as tf

  marks = {}
  t0 = time.time()
  extra = (run_keras if args.mode == "keras" else run_ops)(args, marks)
  rank, size = mpistrategy.rank(), mpistrategy.size()
  step0, rss0, t_measure = marks["measure"]
  step1, rss1, t_end = marks["end"]
  growth = 100.0 * (rss1 - rss0) / rss0
  ok = growth < args.max_growth
  ms_per_step = 1e3 * (t_end - t_measure) / max(1, step1 - step0)
  mine = {"rank": rank, "rss_kib_at_measure": rss0, "measure_step": step0,
          "rss_kib_at_end": rss1, "end_step": step1, "growth_pct": growth,
          "ms_per_step": ms_per_step, "pass": ok, **extra}
  print(f"rank {rank}: RSS at step {step0}: {rss0 / 1024:.1f} MiB; at step "
        f"{step1}: {rss1 / 1024:.1f} MiB; growth {growth:+.2f} % "
        f"(target < {args.max_growth:g} %): {'PASS' if ok else 'FAIL'} "
        f"[{ms_per_step:.2f} ms/step, mode {args.mode}]", flush=True)

  # Gather every rank's verdict (as one allgather of fixed-size rows).
  row = tf.constant([[rank, rss0, rss1, int(ok)]], dtype=tf.int64)
  rows = ops.allgather(row, name="soak/results").numpy()
  all_ok = bool(rows[:, 3].all())
  if rank == 0:
    worst = max(100.0 * (r[2] - r[1]) / r[1] for r in rows)
    print(f"soak: {size} ranks, {args.steps} steps ({args.mode}), "
          f"{time.time() - t0:.1f} s; worst RSS growth {worst:+.2f} %: "
          f"{'PASS' if all_ok else 'FAIL'}", flush=True)
    if args.json:
      with open(args.json, "w", encoding="utf-8") as f:
        json.dump({"rank0": mine, "rows": rows.tolist(),
                   "worst_growth_pct": worst, "pass": all_ok}, f, indent=1)
  mpistrategy.shutdown()
  return 0 if all_ok else 1


if __name__ == "__main__":
  sys.exit(main())
