"""Horovod's synthetic benchmark through mpistrategy.horovod vs MPIStrategy.

    python bench/horovod_synthetic.py           # driver, ~3 min on 2 cores
    python bench/horovod_synthetic.py --np 2 --rounds 2 --model MobileNetV3Small

The driver launches `mpirun -np N` jobs of this script in two modes, in
turn for `--rounds` rounds (so slow drift of a shared machine affects both
alike), and prints one table of img/s:

* `horovod`: the training step of a Horovod TF2 synthetic benchmark
  (as in examples/horovod/synthetic_benchmark.py), written against
  `mpistrategy.horovod.tensorflow` (`hvd.DistributedGradientTape`, SGD(0.01),
  `hvd.broadcast_variables` after the first step): a Horovod script after
  its one-line migration.
* `strategy`: the same model, data, optimizer and measurement under
  `mpistrategy.MPIStrategy` with a custom loop (`strategy.run`; Keras'
  optimizer all-reduces the gradients), i.e. the same training written for
  `tf.distribute`.

Both use a `keras.applications` model with `weights=None` on random
224x224 images (Horovod's shapes), per-rank batch `--batch-size`, and
Horovod's timing: `--num-warmup-batches`, then `--num-iters` timings of
`--num-batches-per-iter` steps each; img/s per rank = batch * steps / time.
The default model is small (MobileNetV3Small) so that the run fits a CPU.
"""

import argparse
import json
import os
import subprocess
import sys
import timeit

from _mpirun import mpirun_command  # bench/, this script's directory

MODES = ("horovod", "strategy")


def _parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--np", type=int, default=2, help="ranks per job")
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--model", default="MobileNetV3Small",
                 help="a keras.applications model name")
  p.add_argument("--batch-size", type=int, default=8, help="per rank")
  p.add_argument("--num-warmup-batches", type=int, default=3)
  p.add_argument("--num-batches-per-iter", type=int, default=5)
  p.add_argument("--num-iters", type=int, default=4)
  p.add_argument("--fp16-allreduce", action="store_true")
  p.add_argument("--timeout", type=int, default=600, help="per job, seconds")
  p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
  return p.parse_args(argv)


def _measure(step, args):
  """Horovod's timing loop; returns the img/s per rank of each iteration."""
  step(True)
  timeit.timeit(lambda: step(False), number=args.num_warmup_batches)
  rates = []
  for _ in range(args.num_iters):
    seconds = timeit.timeit(lambda: step(False),
                            number=args.num_batches_per_iter)
    rates.append(args.batch_size * args.num_batches_per_iter / seconds)
  return rates


def _worker(args):
  import numpy as np
  import tensorflow as tf
  from tensorflow.keras import applications

  tf.keras.utils.set_random_seed(1)
  data = tf.random.uniform([args.batch_size, 224, 224, 3])
  target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=999,
                             dtype=tf.int64)

  if args.worker == "horovod":
    import mpistrategy.horovod.tensorflow as hvd
    hvd.init()
    model = getattr(applications, args.model)(weights=None)
    opt = tf.optimizers.SGD(0.01)
    compression = (hvd.Compression.fp16 if args.fp16_allreduce
                   else hvd.Compression.none)

    @tf.function
    def step(first_batch):
      with tf.GradientTape() as tape:
        probs = model(data, training=True)
        loss = tf.losses.sparse_categorical_crossentropy(target, probs)
      tape = hvd.DistributedGradientTape(tape, compression=compression)
      gradients = tape.gradient(loss, model.trainable_variables)
      opt.apply_gradients(zip(gradients, model.trainable_variables))
      if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)

    rank, size = hvd.rank(), hvd.size()
  else:
    import mpistrategy
    strategy = mpistrategy.MPIStrategy(
        compression="fp16" if args.fp16_allreduce else None)
    with strategy.scope():
      model = getattr(applications, args.model)(weights=None)
      opt = tf.optimizers.SGD(0.01)
    replicas = strategy.num_replicas_in_sync

    def replica_step():
      with tf.GradientTape() as tape:
        probs = model(data, training=True)
        # Keras sums the replicas' gradients: scale for their mean.
        loss = tf.reduce_mean(tf.losses.sparse_categorical_crossentropy(
            target, probs)) / replicas
      gradients = tape.gradient(loss, model.trainable_variables)
      opt.apply_gradients(zip(gradients, model.trainable_variables))

    @tf.function
    def strategy_step():
      strategy.run(replica_step)

    def step(first_batch):  # MPIStrategy broadcasts the initial variables
      del first_batch
      strategy_step()

    rank, size = mpistrategy.rank(), mpistrategy.size()

  rates = _measure(step, args)
  if rank == 0:
    print("RESULT " + json.dumps({
        "mode": args.worker, "np": size, "per_rank": float(np.mean(rates)),
        "conf": float(1.96 * np.std(rates)),
        "params": int(model.count_params())}), flush=True)


def _run_job(mode, args):
  here = os.path.abspath(__file__)
  argv = [sys.executable, here, "--worker", mode, "--model", args.model,
          "--batch-size", str(args.batch_size), "--num-warmup-batches",
          str(args.num_warmup_batches), "--num-batches-per-iter",
          str(args.num_batches_per_iter), "--num-iters", str(args.num_iters)]
  if args.fp16_allreduce:
    argv.append("--fp16-allreduce")
  exports = [n for n in ("PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL")
             if n in os.environ]
  env = dict(os.environ)
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  env["CUDA_VISIBLE_DEVICES"] = ""
  cmd = mpirun_command(args.np, argv,
                       exports=exports + ["CUDA_VISIBLE_DEVICES"])
  out = subprocess.run(cmd, env=env, capture_output=True, text=True,
                       timeout=args.timeout, check=False)
  for line in out.stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[len("RESULT "):])
  raise RuntimeError(f"{mode} job failed (exit {out.returncode}):\n"
                     f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def main():
  args = _parse()
  if args.worker:
    _worker(args)
    return
  results = {m: [] for m in MODES}
  for r in range(args.rounds):
    for mode in MODES:
      result = _run_job(mode, args)
      print(f"round {r + 1} {mode:8s}: {result['per_rank']:.1f} img/s per "
            f"rank", flush=True)
      results[mode].append(result)
  params = results[MODES[0]][0]["params"]
  print(f"\n{args.model} ({params:,} parameters), 224x224, batch "
        f"{args.batch_size} per rank, {args.np} ranks, CPU"
        f"{', fp16 allreduce' if args.fp16_allreduce else ''}; best of "
        f"{args.rounds} rounds\n")
  print("| mode | img/s per rank | total img/s |")
  print("|---|---:|---:|")
  labels = {"horovod": "Horovod script via `mpistrategy.horovod`",
            "strategy": "same model under `MPIStrategy`"}
  best = {}
  for mode in MODES:
    b = max(results[mode], key=lambda x: x["per_rank"])
    best[mode] = b["per_rank"]
    print(f"| {labels[mode]} | {b['per_rank']:.1f} +-{b['conf']:.1f} | "
          f"{b['per_rank'] * args.np:.1f} |")
  print(f"\nratio horovod/strategy: {best['horovod'] / best['strategy']:.2f}")


if __name__ == "__main__":
  main()
