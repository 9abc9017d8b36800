"""Median Keras training-step time: MPIStrategy vs MultiWorkerMirroredStrategy.

    python bench/keras_step.py            # driver: launches every run

The driver runs the same model (MLP 1024-1024-1024-10, 2.1 M parameters,
global batch 128, steps_per_execution 1) in six configurations, `--rounds`
times in turn (so that slow drift of the machine affects all alike), and
prints a table of the medians.  Default 7 rounds: on a small machine each
run's placement of threads on cores moves its step time by up to 50 %, and
on 2 cores medians of 3 rounds put the plane ratio anywhere from 0.3 to
1.2 (bench/RESULTS.md section 10).

* `single`: one process, default strategy, the global batch;
* `mpi`:    `mpirun -np 2`, `mpistrategy.MPIStrategy` (the default
  `data_plane="auto"`: CPU tensors through shared memory);
* `mpi_plane_mpi`: the same with `MPISTRATEGY_DATA_PLANE=mpi` (CPU tensors
  through MPI's messages);
* `mwms`:   `mpirun -np 2`, TF's own `tf.distribute.MultiWorkerMirroredStrategy`
  with `TF_CONFIG` on localhost ports (mpirun only launches; the rank comes
  from OMPI_COMM_WORLD_RANK);
* `mwms_shared`: `mwms` with TensorFlow's thread pools sized the way
  `mpistrategy.init()` sizes them (`TF_NUM_INTRAOP_THREADS` and
  `TF_NUM_INTEROP_THREADS` = CPUs // ranks): shows how much of the gap is
  that sizing rather than communication;
* `independent`: `mpirun -np 2`, each rank training its own model on its
  share of the batch with the default strategy and the same thread sizing:
  the same compute and the same competition for cores as a 2-rank
  MPIStrategy job, without any communication.

Overhead = step time minus the single-process step time.  The target is an
MPIStrategy overhead of at most 1/3 of MWMS's.  On one machine the ranks
share its cores, so part of every 2-rank overhead is not communication; the
`independent` row measures that part, and the last lines compare the
communication cost alone (step time minus `independent`): MPIStrategy against
MWMS, and the shared-memory data plane against the MPI one (target: at
most half).  `--modes` runs a subset (`single` and `independent` always
run).

Every configuration places its ranks as `mpistrategyrun` does: each on a
share of the CPUs of its own where they fit (bench/_mpirun.py);
`--floating` lets every rank run on every CPU instead, as every run before
bench/RESULTS.md section 23 did.

The last column is the CPU time (user + system) one step takes, summed
over the ranks: the work each configuration adds, apart from how the
ranks' waits happened to line up (where ranks and their threads outnumber
cores, it varies from run to run about as much as the step time).

Stock MWMS cannot run Keras 3.15 `fit` (TF-INTEGRATION-NOTES §6); the `mwms`
worker applies the two minimal patches below, and *only* there.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

from _mpirun import cpu_share_flags  # bench/, this script's directory
from _mpirun import mpirun_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_ports(n):
  socks = [socket.socket() for _ in range(n)]
  for s in socks:
    s.bind(("localhost", 0))
  ports = [s.getsockname()[1] for s in socks]
  for s in socks:
    s.close()
  return ports


def _patch_stock_mwms_for_keras3():
  """BENCHMARK-ONLY patches so stock MWMS can run Keras 3.15 fit.

  P-K1: CollectiveAllReduceExtended._reduce_to does not map over nests.
  P-K2: Strategy.reduce(MEAN, scalar, axis=0) from Keras' per-step logs.
  """
  import tensorflow as tf
  from tensorflow.python.distribute import collective_all_reduce_strategy as c
  ext = c.CollectiveAllReduceExtended
  orig_reduce_to = ext._reduce_to  # pylint: disable=protected-access

  def _reduce_to(self, reduce_op, value, destinations, options):
    if tf.nest.is_nested(value):
      return tf.nest.map_structure(
          lambda v: orig_reduce_to(self, reduce_op, v, destinations, options),
          value)
    return orig_reduce_to(self, reduce_op, value, destinations, options)

  ext._reduce_to = _reduce_to  # pylint: disable=protected-access
  cls = c.CollectiveAllReduceStrategy
  orig_reduce = cls.reduce

  def reduce(self, reduce_op, value, axis):
    v = value.values[0] if hasattr(value, "values") else value
    if axis is not None and getattr(v, "shape", None) is not None and (
        v.shape.rank == 0):
      axis = None
    return orig_reduce(self, reduce_op, value, axis)

  cls.reduce = reduce


def worker(args):
  """One process of one configuration; rank 0 writes the JSON result."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
  if args.mode in ("mwms", "mwms_shared"):
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": ["localhost:%d" % p for p in args.ports]},
        "task": {"type": "worker", "index": rank}})
  import numpy as np
  import tensorflow as tf
  import keras
  if args.mode in ("mpi", "mpi_plane_mpi"):
    sys.path.insert(0, ROOT)
    import mpistrategy
    strategy = mpistrategy.MPIStrategy()
  elif args.mode in ("mwms", "mwms_shared"):
    _patch_stock_mwms_for_keras3()
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental
            .CommunicationImplementation.RING))
  else:
    strategy = tf.distribute.get_strategy()

  gbs = args.global_batch
  if args.mode == "independent":
    gbs //= args.np  # this rank's share, as under a 2-rank strategy
  rng = np.random.RandomState(0)
  x = rng.rand(gbs, 1024).astype(np.float32)
  y = rng.randint(0, 10, size=[gbs]).astype(np.int32)
  steps = args.warmup + args.steps
  ds = tf.data.Dataset.from_tensors((x, y)).repeat(steps)

  with strategy.scope():
    model = keras.Sequential([keras.Input((1024,))] + [
        keras.layers.Dense(1024, activation="relu") for _ in range(2)] + [
            keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))

  times = []
  cpu = {}

  def cpu_seconds():
    t = os.times()
    return t.user + t.system

  class Timer(keras.callbacks.Callback):

    def on_train_batch_begin(self, batch, logs=None):
      if batch == args.warmup:
        cpu["start"] = cpu_seconds()
      self.t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
      times.append(time.perf_counter() - self.t)
      if batch == steps - 1:
        cpu["end"] = cpu_seconds()

  model.fit(ds, epochs=1, steps_per_epoch=steps, callbacks=[Timer()],
            shuffle=False, verbose=0)
  median = float(np.median(times[args.warmup:]))
  # Every rank writes its own file: the driver sums the ranks' CPU time.
  out = args.out if rank == 0 else "%s.%d" % (args.out, rank)
  with open(out, "w") as f:
    json.dump({"mode": args.mode, "median_s": median,
               "cpu_per_step_s": (cpu["end"] - cpu["start"]) / args.steps,
               "params": model.count_params()}, f)


def driver(args):
  py = sys.executable
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
             OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  modes = [m for m in _MODES
           if m in args.modes or m in ("single", "independent")]
  # What mpistrategy.init() sets for ranks sharing this host (unbound).
  share = str(max(1, (os.cpu_count() or 1) // args.np))
  runs = {mode: [] for mode in modes}
  for _, mode in [(r, m) for r in range(args.rounds) for m in modes]:
    out = os.path.join("/tmp", "keras_step_%s_%d.json" % (mode, os.getpid()))
    cmd = [py, os.path.abspath(__file__), "--worker", "--mode", mode,
           "--out", out, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--np", str(args.np),
           "--global-batch", str(args.global_batch)]
    if mode != "single":
      if mode in ("mwms", "mwms_shared"):
        cmd += ["--ports"] + [str(p) for p in _free_ports(args.np)]
      exports = ["PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL"]
      if mode in ("mwms_shared", "independent"):
        exports += ["TF_NUM_INTRAOP_THREADS=" + share,
                    "TF_NUM_INTEROP_THREADS=" + share]
      if mode == "mpi_plane_mpi":
        exports.append("MPISTRATEGY_DATA_PLANE=mpi")
      cmd = mpirun_command(args.np, cmd, exports, mpirun=args.mpirun,
                           floating=args.floating)
    print("running", mode, "...", flush=True)
    proc = subprocess.run(cmd, env=env, timeout=args.timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, check=False)
    if proc.returncode != 0 or not os.path.exists(out):
      print(proc.stdout[-4000:])
      raise SystemExit("%s run failed (exit %d)" % (mode, proc.returncode))
    with open(out) as f:
      run = json.load(f)
    os.remove(out)
    for rank in range(1, 1 if mode == "single" else args.np):
      with open("%s.%d" % (out, rank)) as f:
        run["cpu_per_step_s"] += json.load(f)["cpu_per_step_s"]
      os.remove("%s.%d" % (out, rank))
    runs[mode].append(run)
  results = {}
  for mode in modes:
    times = sorted(r["median_s"] for r in runs[mode])
    cpus = sorted(r["cpu_per_step_s"] for r in runs[mode])
    results[mode] = {"median_s": times[len(times) // 2],
                     "cpu_s": cpus[len(cpus) // 2],
                     "params": runs[mode][0]["params"]}

  single = results["single"]["median_s"]
  print("\nMLP 1024x3 (%.2f M params), global batch %d, %d ranks, median of %d"
        " steps, median of %d rounds" % (
            results["single"]["params"] / 1e6, args.global_batch, args.np,
            args.steps, args.rounds))
  placement = None if args.floating else cpu_share_flags(args.np)
  print("ranks placed: %s" % (
      "on CPUs of their own (%s)" % " ".join(placement) if placement
      else "floating over every CPU (--bind-to none)"))
  print("%-30s %12s %14s %16s" % ("configuration", "step (ms)", "overhead (ms)",
                                  "CPU/step (ms)"))
  labels = {"single": "1 process", "mpi": "MPIStrategy",
            "mpi_plane_mpi": "MPIStrategy, data_plane=mpi",
            "mwms": "MWMS (gRPC, patched)",
            "mwms_shared": "MWMS, threads sized",
            "independent": "%d independent procs" % args.np}
  for mode in modes:
    t = results[mode]["median_s"]
    print("%-30s %12.2f %14.2f %16.2f" % (labels[mode], t * 1e3,
                                         (t - single) * 1e3,
                                         results[mode]["cpu_s"] * 1e3))

  def ratio(a, b):
    return a / b if b > 0 else float("nan")

  def over(mode):
    return results[mode]["median_s"] - single

  def comm(mode):
    return results[mode]["median_s"] - results["independent"]["median_s"]

  if "mpi" in results and "mwms" in results:
    print("MPIStrategy overhead / MWMS overhead = %.2f (target <= 0.33)" %
          ratio(over("mpi"), over("mwms")))
  if "mpi" in results and "mwms_shared" in results:
    print("MPIStrategy overhead / overhead of MWMS with the same thread "
          "sizing = %.2f" % ratio(over("mpi"), over("mwms_shared")))
    print("Communication alone (step minus independent, both with sized "
          "threads): MPIStrategy %.2f ms, MWMS %.2f ms, ratio %.2f" % (
              comm("mpi") * 1e3, comm("mwms_shared") * 1e3,
              ratio(comm("mpi"), comm("mwms_shared"))))
  if "mpi" in results and "mpi_plane_mpi" in results:
    print("MPIStrategy over independent: shared memory %.2f ms, MPI plane "
          "%.2f ms, ratio %.2f (target <= 0.5)" % (
              comm("mpi") * 1e3, comm("mpi_plane_mpi") * 1e3,
              ratio(comm("mpi"), comm("mpi_plane_mpi"))))

    def cpu_over(mode):
      return results[mode]["cpu_s"] - results["independent"]["cpu_s"]

    print("CPU time per step over independent (all ranks): shared memory "
          "%.2f ms, MPI plane %.2f ms, ratio %.2f" % (
              cpu_over("mpi") * 1e3, cpu_over("mpi_plane_mpi") * 1e3,
              ratio(cpu_over("mpi"), cpu_over("mpi_plane_mpi"))))


_MODES = ("single", "mpi", "mpi_plane_mpi", "mwms", "mwms_shared",
          "independent")


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--mode", choices=_MODES)
  p.add_argument("--modes", type=lambda v: v.split(","), default=_MODES,
                 help="comma-separated configurations to run, e.g. "
                 "mpi,mpi_plane_mpi (default: all)")
  p.add_argument("--out")
  p.add_argument("--ports", type=int, nargs="*")
  p.add_argument("--np", type=int, default=2)
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--warmup", type=int, default=8)
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--global-batch", type=int, default=128)
  p.add_argument("--mpirun", default="mpirun")
  p.add_argument("--floating", action="store_true",
                 help="let every rank run on every CPU (--bind-to none) "
                 "instead of a share of its own (bench/_mpirun.py)")
  p.add_argument("--timeout", type=int, default=600)
  args = p.parse_args()
  if args.worker:
    worker(args)
  else:
    driver(args)


if __name__ == "__main__":
  main()
