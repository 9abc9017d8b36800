"""Allreduce latency: mpistrategy ops vs raw mpi4py (and optionally MWMS).

Run:
    mpirun --allow-run-as-root -np 2 .venv/bin/python bench/allreduce.py \
        [--sizes 4KB,256KB,4MB,64MB,200x16KB] [--iters N] [--rounds R] \
        [--json out.json] [--plot out.png] [--mwms-json F | --include-mwms] \
        [--device cpu|gpu]

All cases are float32 SUM allreduces.  Each sample is the wall time of one
call plus the host read of its result (``np.asarray`` on the output, which is
zero-copy on CPU and a device-to-host copy on GPU), so asynchronous
completion cannot hide cost.  Ranks meet in a barrier before each
measurement, run warm-up iterations (tracing, response cache, buffer
allocation), then the timed ones.  Reported: median, p10 and p90 over the
timed iterations, as seen on rank 0.

Each case runs in R rounds (default 5; iterations are split between them).
A round times raw MPI with the mpistrategy engine stopped, then starts the
engine, times the ops, and stops it.  The table's latencies pool the samples
of all rounds; a ratio is the median over rounds of that round's ratio, so
both sides of it were measured seconds apart (load on a shared machine
drifts by several times within one run).

Raw MPI, mpi4py ``Comm.Allreduce`` on preallocated numpy buffers:
  raw          into a separate output buffer;
  raw in-place ``MPI.IN_PLACE`` (no input-to-output copy).  Ratios are taken
               against the faster of the two, because the ops reduce in
               place whenever TensorFlow lets them forward their input.
  ``200x16KB``: one fused call of 3.2 MB (the baseline), and 200 separate
  calls (informational).

mpistrategy, in three forms:
  one tf.function call   a ``tf.function`` doing one ``allreduce`` (for
                         ``200x16KB`` one ``grouped_allreduce``), so TF's
                         function-call dispatch is included; the
                         "tf.function floor" row is the same call doing
                         ``tf.identity``, the dispatch no op can go below;
  one eager call         ``ops.allreduce`` outside any function;
  per op, chained        k dependent ops in one ``tf.function`` (each input
                         is the previous output), time per op: the op's own
                         latency as in a training step, where the dispatch
                         is paid once per step.  k is 30 up to 64 KB, 8
                         above.
  For ``200x16KB`` also: the group with ``pack=False`` (each tensor an
  engine entry, fused by the engine) and 200 separate ``allreduce`` ops in
  one ``tf.function``.

Rank 0 prints a markdown table, then each target with PASS/MISS for each
form: ratio (ops / faster raw) <= 1.25 at 4 MB and 64 MB, <= 2.0 for
200x16KB (grouped vs raw fused), 4 KB latency < 0.1 ms.  With
``--planes shm,...`` also the shared-memory plane's, per op chained:
<= 0.7x raw at 4 MB, <= 0.6x at 64 MB, <= 1.0x raw fused for 200x16KB,
and 4 KB within raw + 0.02 ms.  Exit status is 0
even on MISS (this is a measurement, not a test); it is 2 for unusable
arguments or environments.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

# Runnable from a source checkout without PYTHONPATH.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import numpy as np

DEFAULT_CASES = "4KB,256KB,4MB,64MB,200x16KB"
CHAIN_LENGTH = 30

_UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


def parse_case(text):
  """'4KB' -> (1, 4096); '200x16KB' -> (200, 16384)."""
  m = re.fullmatch(r"(?:(\d+)[xX])?(\d+)\s*(B|KB|MB|GB)", text.strip().upper())
  if not m:
    raise ValueError(
      f"--sizes: cannot parse {text!r}; expected e.g. 4KB, 64MB or 200x16KB")
  count = int(m.group(1) or 1)
  nbytes = int(m.group(2)) * _UNITS[m.group(3)]
  if nbytes % 4 or nbytes == 0 or count == 0:
    raise ValueError(
      f"--sizes: {text!r} must be a positive multiple of 4 bytes (float32)")
  return count, nbytes


def default_iters(count, nbytes):
  """(warmup, iters) that give stable medians and keep a run < ~2 min."""
  total = count * nbytes
  if count > 1:
    # Enough chained samples (iters / 8) for a median that holds still.
    return 20, 800
  if total <= 256 << 10:
    return 50, 1000
  if total <= 4 << 20:
    return 20, 200
  return 5, 30


def summarize(samples):
  a = np.asarray(samples) * 1e3  # ms
  return {
    "median_ms": float(np.median(a)),
    "p10_ms": float(np.percentile(a, 10)),
    "p90_ms": float(np.percentile(a, 90)),
    "n": int(a.size),
  }


def time_calls(fn, warmup, iters, sync=None):
  for _ in range(warmup):
    r = fn()
    if sync:
      sync(r)
  samples = []
  for _ in range(iters):
    t0 = time.perf_counter()
    r = fn()
    if sync:
      sync(r)
    samples.append(time.perf_counter() - t0)
  return samples, r


def host_sync(result):
  """Reads the result on the host; zero-copy for CPU tensors."""
  if isinstance(result, (list, tuple)):
    for t in result:
      np.asarray(t)
  else:
    np.asarray(result)


def fmt_size(nbytes):
  for unit in ("GB", "MB", "KB"):
    if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
      return f"{nbytes // _UNITS[unit]} {unit}"
  return f"{nbytes} B"


def case_label(count, nbytes):
  return fmt_size(nbytes) if count == 1 else f"{count} x {fmt_size(nbytes)}"


# --------------------------------------------------------------------------
# Raw MPI (mpi4py)


def bench_raw(comm, cases, args):
  """Returns {label: {"raw": samples, "raw_inplace": samples, ...}}.

  "raw" reduces into a separate output buffer, "raw_inplace" uses
  `MPI.IN_PLACE` (no copy of the input into the output; faster for large
  messages).  Ratios are taken against the faster of the two, because the
  ops reduce in place whenever TensorFlow lets them forward the input.
  For groups, "raw" is one fused call and "raw_separate" one call per
  tensor.
  """
  from mpi4py import MPI
  rank, size = comm.Get_rank(), comm.Get_size()
  expected = size * (size + 1) / 2

  def time_inplace(n, warmup, iters, what):
    # Checked once, then timed on zeros so repeated in-place sums stay 0.
    z = np.full(n, rank + 1, np.float32)
    comm.Allreduce(MPI.IN_PLACE, z, op=MPI.SUM)
    check(z, expected, what)
    z[:] = 0
    comm.Barrier()
    s, _ = time_calls(lambda: comm.Allreduce(MPI.IN_PLACE, z, op=MPI.SUM),
                      warmup, iters)
    return s

  results = {}
  for count, nbytes in cases:
    warmup, iters = iters_for(args, count, nbytes)
    n = nbytes // 4
    label = case_label(count, nbytes)
    if count == 1:
      x = np.full(n, rank + 1, np.float32)
      y = np.empty_like(x)
      comm.Barrier()
      s, _ = time_calls(lambda x=x, y=y: comm.Allreduce(x, y, op=MPI.SUM),
                        warmup, iters)
      check(y, expected, "raw " + label)
      # The memory floor: one core copying the same bytes, no MPI.
      floor_out = np.empty_like(x)
      s_copy, _ = time_calls(lambda: np.copyto(floor_out, x), warmup, iters)
      results[label] = {
          "raw": s,
          "raw_inplace": time_inplace(n, warmup, iters,
                                      "raw in-place " + label),
          "memcpy": s_copy}
    else:
      xs = [np.full(n, rank + 1, np.float32) for _ in range(count)]
      ys = [np.empty_like(x) for x in xs]

      def separate(xs=xs, ys=ys):
        for x, y in zip(xs, ys):
          comm.Allreduce(x, y, op=MPI.SUM)

      comm.Barrier()
      s_sep, _ = time_calls(separate, warmup, iters)
      check(ys[-1], expected, "raw separate " + label)
      xf = np.full(n * count, rank + 1, np.float32)
      yf = np.empty_like(xf)
      comm.Barrier()
      s_fused, _ = time_calls(
        lambda: comm.Allreduce(xf, yf, op=MPI.SUM), warmup, iters)
      check(yf, expected, "raw fused " + label)
      results[label] = {
          "raw_separate": s_sep, "raw": s_fused,
          "raw_inplace": time_inplace(n * count, warmup, iters,
                                      "raw fused in-place " + label)}
  return results


# --------------------------------------------------------------------------
# mpistrategy ops inside tf.function


def chain_length(total_bytes, size):
  """Dependent allreduces per chained sample.

  Many for small messages (so TF's per-call dispatch is spread thin), 8 for
  large ones (so a sample stays short).  Each SUM multiplies the values by
  `size`, so the chain is shortened where float32 would overflow.
  """
  k = CHAIN_LENGTH if total_bytes <= 64 << 10 else 8
  while k > 1 and size ** (k - 1) * size * (size + 1) / 2 > 1e30:
    k -= 1
  return k


def bench_ops(cases, args, device):
  """Times mpistrategy.ops for each case.

  Keys of a case's result: "floor" (tf.function doing tf.identity), "ops"
  (one op per tf.function call), "ops_chain_per_op" (k dependent ops in one
  tf.function, per op), "ops_eager" (one eager call; single tensors), and
  for groups "ops_unpacked" and "ops_separate".
  """
  import tensorflow as tf
  import mpistrategy
  from mpistrategy import ops
  from mpistrategy.ops import collectives

  rank, size = mpistrategy.rank(), mpistrategy.size()
  expected = size * (size + 1) / 2
  results = {}

  def barrier():
    ops.barrier()

  def time_chain(res, label, fn, x, k, warmup, iters):
    # k dependent collectives: each input is the previous output, so
    # nothing overlaps, and inputs after the first can be reduced in place.
    barrier()
    s, r = time_calls(lambda: fn(x), max(2, warmup // k),
                      max(5, iters // k), host_sync)
    last = r[-1] if isinstance(r, (list, tuple)) else r
    check(np.asarray(last), expected * size ** (k - 1), "ops chain " + label)
    res["ops_chain_per_op"] = list(np.asarray(s) / k)
    res["chain_length"] = k

  for count, nbytes in cases:
    warmup, iters = iters_for(args, count, nbytes)
    n = nbytes // 4
    label = case_label(count, nbytes)
    k = chain_length(count * nbytes, size)
    res = {}
    with tf.device(device):
      if count == 1:
        x = tf.fill([n], tf.constant(rank + 1, tf.float32))

        floor_fn = tf.function(tf.identity)
        barrier()
        s, _ = time_calls(lambda: floor_fn(x), warmup, iters, host_sync)
        res["floor"] = s

        @tf.function
        def one(t):
          return ops.allreduce(t, op=ops.Sum)

        barrier()
        s, r = time_calls(lambda: one(x), warmup, iters, host_sync)
        check(np.asarray(r), expected, "ops " + label)
        res["ops"] = s

        barrier()
        s, r = time_calls(lambda: ops.allreduce(x, op=ops.Sum), warmup, iters,
                          host_sync)
        check(np.asarray(r), expected, "ops eager " + label)
        res["ops_eager"] = s

        if not args.no_chain:
          @tf.function
          def chain(t):
            for _ in range(k):
              t = ops.allreduce(t, op=ops.Sum)
            return t

          time_chain(res, label, chain, x, k, warmup, iters)
      else:
        # One input buffer split into `count` tensors inside the function
        # (zero-copy on CPU): passing 200 separate arguments would add
        # ~4 ms of tf.function argument handling to every sample.
        x = tf.fill([n * count], tf.constant(rank + 1, tf.float32))

        @tf.function
        def floor_fn(t):
          return [tf.identity(p) for p in tf.split(t, count)]

        barrier()
        s, _ = time_calls(lambda: floor_fn(x), warmup, iters, host_sync)
        res["floor"] = s

        @tf.function
        def grouped(t):
          return ops.grouped_allreduce(tf.split(t, count), op=ops.Sum)

        barrier()
        s, r = time_calls(lambda: grouped(x), warmup, iters, host_sync)
        check(np.asarray(r[-1]), expected, "ops grouped " + label)
        res["ops"] = s

        if not args.no_chain:
          @tf.function
          def grouped_chain(t):
            ts = tf.split(t, count)
            for _ in range(k):
              ts = ops.grouped_allreduce(ts, op=ops.Sum)
            # The collectives run whatever is returned; reading 200
            # outputs on the host would only add Python time per sample.
            return ts[-1]

          time_chain(res, label, grouped_chain, x, k, warmup, iters)

        # The same group through the engine's fusion buffer instead of the
        # kernel's packing (the raw op's pack=False): shows what packing
        # saves.
        @tf.function
        def unpacked(t):
          return collectives._grouped_allreduce_unpacked(  # pylint: disable=protected-access
              tf.split(t, count), "bench/unpacked")

        barrier()
        s, r = time_calls(lambda: unpacked(x), warmup, iters, host_sync)
        check(np.asarray(r[-1]), expected, "ops unpacked " + label)
        res["ops_unpacked"] = s

        @tf.function
        def separate(t):
          return [ops.allreduce(p, op=ops.Sum) for p in tf.split(t, count)]

        barrier()
        s, r = time_calls(lambda: separate(x), warmup, iters, host_sync)
        check(np.asarray(r[-1]), expected, "ops separate " + label)
        res["ops_separate"] = s
    results[label] = res
    if rank == 0 and args.verbose:
      print(f"  done {label}", flush=True)
  return results


def check(array, expected, what):
  got = np.asarray(array).reshape(-1)
  if got.size and not np.allclose(got[[0, -1]], expected):
    raise SystemExit(
      f"bench/allreduce.py: wrong result for {what}: got {got[[0, -1]]}, "
      f"expected {expected}")


def iters_for(args, count, nbytes):
  """(warmup, timed iterations) for one round of a case."""
  warmup, iters = default_iters(count, nbytes)
  if args.iters:
    iters = args.iters
    warmup = max(1, min(warmup, iters // 5))
  if args.warmup is not None:
    warmup = args.warmup
  return warmup, max(1, -(-iters // args.rounds))


# --------------------------------------------------------------------------
# tf.distribute.MultiWorkerMirroredStrategy (optional anchor)


def mwms_worker(args):
  """One MWMS worker; TF_CONFIG is set by the parent (see run_mwms)."""
  args.rounds = 1  # one pass: the workers run alone, after the main rounds
  import tensorflow as tf
  comm_opts = tf.distribute.experimental.CommunicationOptions(
    implementation=tf.distribute.experimental.CommunicationImplementation.RING)
  strategy = tf.distribute.MultiWorkerMirroredStrategy(
    communication_options=comm_opts)
  index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
  cases = [parse_case(c) for c in args.sizes.split(",")]
  results = {}
  for count, nbytes in cases:
    warmup, iters = iters_for(args, count, nbytes)
    n = nbytes // 4
    label = case_label(count, nbytes)
    if count == 1:
      x = tf.fill([n], tf.constant(index + 1, tf.float32))

      # tf.identity inside the replica function gives the value a device;
      # a bare function input has none, and MWMS then fails with
      # "destinations can not be empty" (TF-INTEGRATION-NOTES P5).
      @tf.function
      def step(t):
        return strategy.run(lambda t: tf.distribute.get_replica_context()
                            .all_reduce(tf.distribute.ReduceOp.SUM,
                                        tf.identity(t)),
                            args=(t,))
    else:
      x = tf.fill([n * count], tf.constant(index + 1, tf.float32))

      @tf.function
      def step(t):
        def replica_fn(t):
          return tf.distribute.get_replica_context().all_reduce(
              tf.distribute.ReduceOp.SUM,
              [tf.identity(p) for p in tf.split(t, count)])
        return strategy.run(replica_fn, args=(t,))

    s, _ = time_calls(lambda: step(x), warmup, iters, host_sync)
    results[label] = {"mwms": summarize(s)}
  if index == 0:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=1)


def run_mwms(args):
  """Runs two MWMS workers on localhost (gRPC); returns their results."""
  import socket
  ports = []
  socks = []
  for _ in range(2):
    s = socket.socket()
    s.bind(("localhost", 0))
    ports.append(s.getsockname()[1])
    socks.append(s)
  for s in socks:
    s.close()
  cluster = {"worker": [f"localhost:{p}" for p in ports]}
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("OMPI_", "PMIX_", "OPAL_", "MPISTRATEGY_"))}
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
  procs = []
  for index in range(2):
    e = dict(env, TF_CONFIG=json.dumps(
      {"cluster": cluster, "task": {"type": "worker", "index": index}}))
    cmd = [sys.executable, os.path.abspath(__file__), "--mwms-worker",
           "--json", out, "--sizes", args.sizes]
    if args.iters:
      cmd += ["--iters", str(args.iters)]
    procs.append(subprocess.Popen(cmd, env=e))
  # A worker that fails leaves the other one blocked in a collective: stop
  # both as soon as one fails, or after 240 s.
  deadline = time.time() + 240
  while any(p.poll() is None for p in procs):
    failed = any(p.poll() not in (None, 0) for p in procs)
    if failed or time.time() > deadline:
      for p in procs:
        if p.poll() is None:
          p.kill()
      for p in procs:
        p.wait()
      if not failed:
        raise SystemExit("MWMS workers timed out after 240 s")
      break
    time.sleep(0.1)
  rcs = [p.returncode for p in procs]
  if any(rcs):
    raise SystemExit(f"MWMS workers failed with exit statuses {rcs}")
  with open(out, encoding="utf-8") as f:
    data = json.load(f)
  os.unlink(out)
  return data


# --------------------------------------------------------------------------
# Reporting


# The forms an op is timed in (result key, description in targets).
FORMS = {
    "ops": "one tf.function call, incl. TF dispatch",
    "ops_eager": "one eager call",
    "ops_chain_per_op": "per op, chained in one tf.function",
}

TARGETS = [
    # (description, case label, form, kind, limit)
    ("ratio ops/raw <= 1.25 at 4 MB", "4 MB", "ops", "ratio", 1.25),
    ("ratio ops/raw <= 1.25 at 4 MB", "4 MB", "ops_chain_per_op", "ratio",
     1.25),
    ("ratio ops/raw <= 1.25 at 64 MB", "64 MB", "ops", "ratio", 1.25),
    ("ratio ops/raw <= 1.25 at 64 MB", "64 MB", "ops_chain_per_op", "ratio",
     1.25),
    ("ratio ops/raw <= 2.0 for 200 x 16 KB (grouped vs raw fused)",
     "200 x 16 KB", "ops", "ratio", 2.0),
    ("ratio ops/raw <= 2.0 for 200 x 16 KB (grouped vs raw fused)",
     "200 x 16 KB", "ops_chain_per_op", "ratio", 2.0),
    ("4 KB latency < 0.1 ms", "4 KB", "ops", "latency", 0.1),
    ("4 KB latency < 0.1 ms", "4 KB", "ops_eager", "latency", 0.1),
    ("4 KB latency < 0.1 ms", "4 KB", "ops_chain_per_op", "latency", 0.1),
]

# The shared-memory plane's own targets, checked when it fills the ops
# columns (--planes shm,...): per op chained, against the faster raw
# variant; "excess" is ops minus raw in ms.
SHM_TARGETS = [
    ("shared memory <= 0.7 x raw at 4 MB", "4 MB", "ops_chain_per_op",
     "ratio", 0.7),
    ("shared memory <= 0.6 x raw at 64 MB", "64 MB", "ops_chain_per_op",
     "ratio", 0.6),
    ("shared memory <= 1.0 x raw fused for 200 x 16 KB", "200 x 16 KB",
     "ops_chain_per_op", "ratio", 1.0),
    ("shared memory within raw + 0.02 ms at 4 KB", "4 KB",
     "ops_chain_per_op", "excess", 0.02),
]


def ms(entry):
  return (f"{entry['median_ms']:.3f} "
          f"({entry['p10_ms']:.3f}-{entry['p90_ms']:.3f})")


def _ops_and_faster_raw_by_round(r, key):
  """Per round: the ops median and the faster raw variant's median (ms)."""
  ops_rounds = r[key]["median_ms_by_round"]
  raw_rounds = [min(values) for values in zip(
      *[r[k]["median_ms_by_round"] for k in ("raw", "raw_inplace") if k in r])]
  return zip(ops_rounds, raw_rounds)


def excess_over_raw(r, key):
  """Median over rounds of (ops median - faster raw median) in ms."""
  return float(np.median(
      [o - w for o, w in _ops_and_faster_raw_by_round(r, key)]))


def ratio_to_raw(r, key):
  """Median over rounds of (ops median / faster raw median) in that round.

  Each round times raw and ops back to back, so a round's ratio sees one
  machine state; the pooled medians would mix states several times apart.
  """
  return float(np.median(
      [o / w for o, w in _ops_and_faster_raw_by_round(r, key)]))


def report(results, meta):
  """The markdown table and the target verdicts.

  Ratios are ops over the faster raw variant (see bench_raw).
  """
  lines = []
  lines.append(
    f"## allreduce float32 SUM, {meta['size']} ranks, device {meta['device']}"
    f" — median ms (p10-p90)")
  lines.append("")
  has_mwms = any("mwms" in r for r in results.values())
  header = ["case", "mpistrategy ops", "raw mpi4py", "raw in-place",
            "ratio ops/faster raw (median of rounds)", "tf.function floor"]
  if has_mwms:
    header.append("MWMS (RING)")
  lines.append("| " + " | ".join(header) + " |")
  lines.append("|" + "---|" * len(header))

  def add_row(cells, mwms=""):
    if has_mwms:
      cells = cells + [mwms]
    lines.append("| " + " | ".join(cells) + " |")

  def versus_raw(r, name, key, floor=""):
    """A row of one ops variant against the case's raw baselines."""
    raw_inplace = ms(r["raw_inplace"]) if "raw_inplace" in r else ""
    add_row([name, ms(r[key]), ms(r["raw"]), raw_inplace,
             f"{ratio_to_raw(r, key):.2f}", floor],
            ms(r["mwms"]) if key == "ops" and "mwms" in r else "")

  for label, r in results.items():
    if "ops" not in r or "raw" not in r:
      continue
    is_group = "x" in label
    what = f"{label} grouped_allreduce vs raw fused" if is_group else label
    versus_raw(r, f"{what}, one tf.function call", "ops", ms(r["floor"]))
    if "ops_eager" in r:
      versus_raw(r, f"{what}, one eager call", "ops_eager")
    if "ops_chain_per_op" in r:
      versus_raw(r, f"{what}, per op, {r['chain_length']} chained in one "
                 "tf.function", "ops_chain_per_op")
    for key in sorted(k for k in r if k.startswith("ops_chain_per_op[")):
      versus_raw(r, f"{what}, per op chained, data_plane="
                 f"{key[len('ops_chain_per_op['):-1]}", key)
    if "memcpy" in r:
      add_row([f"{label} memory floor: one core copies the bytes", "",
               ms(r["memcpy"]), "", "", ""])
    if "ops_unpacked" in r:
      versus_raw(r, f"{label} grouped, pack=False (engine fusion), one "
                 "tf.function call", "ops_unpacked")
    if "ops_separate" in r:
      versus_raw(r, f"{label} as separate allreduces in one tf.function",
                 "ops_separate")
      add_row([f"{label} raw: separate Allreduce calls", "",
               ms(r["raw_separate"]), "", "", ""])
  lines.append("")
  lines.append("Targets (ratios against the faster raw variant):")
  verdicts = []
  targets = list(TARGETS)
  if meta.get("planes", [""])[0] == "shm":
    targets += SHM_TARGETS
  for desc, label, form, kind, limit in targets:
    desc = f"{desc} ({FORMS[form]})"
    r = results.get(label)
    if r is None or "ops" not in r:
      lines.append(f"- {desc}: SKIPPED (case not run)")
      continue
    if form not in r:
      lines.append(f"- {desc}: SKIPPED (--no-chain)")
      continue
    if kind == "ratio":
      value = ratio_to_raw(r, form)
      ok = value <= limit
      shown = f"{value:.2f}"
    elif kind == "excess":
      value = excess_over_raw(r, form)
      ok = value <= limit
      shown = f"raw + {value:.3f} ms"
    else:
      value = r[form]["median_ms"]
      ok = value < limit
      shown = f"{value:.3f} ms"
      if form == "ops":
        shown += (f" (tf.function floor with tf.identity: "
                  f"{r['floor']['median_ms']:.3f} ms)")
    verdicts.append({"target": desc, "value": value, "pass": ok})
    lines.append(f"- {desc}: {shown} -> {'PASS' if ok else 'MISS'}")
  return "\n".join(lines), verdicts


def plot(results, path, meta=None):
  """Latency vs message size (single-tensor cases), log-log, as a PNG.

  Args:
    results: {case label: {series: summary}} as built by main().
    path: the PNG file to write.
    meta: main()'s run metadata ("size", "device"), shown in the title.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  single = [(parse_case(lab.replace(" ", ""))[1], r)
            for lab, r in results.items() if "x" not in lab]
  single.sort(key=lambda t: t[0])
  xs = [s for s, _ in single]
  fig, ax = plt.subplots(figsize=(7, 4.5))
  series = [("ops", "mpistrategy ops (one tf.function call)"),
            ("ops_chain_per_op",
             "mpistrategy ops (per op, chained in one tf.function)"),
            ("raw", "raw mpi4py Allreduce"),
            ("raw_inplace", "raw mpi4py Allreduce, in place"),
            ("mwms", "TF MultiWorkerMirroredStrategy (RING)"),
            ("floor", "tf.function floor (tf.identity)")]
  for key, name in series:
    pts = [(s, r[key]) for s, r in single if key in r]
    if not pts:
      continue
    ax.errorbar([p[0] for p in pts], [p[1]["median_ms"] for p in pts],
                yerr=[[p[1]["median_ms"] - p[1]["p10_ms"] for p in pts],
                [p[1]["p90_ms"] - p[1]["median_ms"] for p in pts]],
                marker="o", capsize=3, label=name,
                linestyle=":" if key == "floor" else "-")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xticks(xs)
  ax.set_xticklabels([fmt_size(s) for s in xs])
  ax.set_xlabel("message size (float32)")
  ax.set_ylabel("latency, ms (median, p10-p90)")
  title = "float32 SUM allreduce latency"
  if meta:
    title += f" ({meta['size']} ranks, {meta['device']})"
  ax.set_title(title)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


# --------------------------------------------------------------------------


def pool_rounds(rounds):
  """Merges per-round {label: {key: samples}} into summaries.

  Each summary also lists the median of every round ("median_ms_by_round"),
  which shows how much the machine drifted during the run.
  """
  pooled = {}
  for one_round in rounds:
    for label, keys in one_round.items():
      for key, value in keys.items():
        entry = pooled.setdefault(label, {})
        if isinstance(value, list):
          entry.setdefault(key, []).append(value)
        else:
          entry[key] = value
  results = {}
  for label, keys in pooled.items():
    results[label] = {}
    for key, value in keys.items():
      if isinstance(value, list):
        summary = summarize([x for samples in value for x in samples])
        summary["median_ms_by_round"] = [
            round(summarize(samples)["median_ms"], 4) for samples in value]
        value = summary
      results[label][key] = value
  return results


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--sizes", default=DEFAULT_CASES,
                 help="comma-separated cases, e.g. 4KB,64MB,200x16KB")
  p.add_argument("--iters", type=int, default=0,
                 help="timed iterations per case (default: by size)")
  p.add_argument("--warmup", type=int, default=None)
  p.add_argument("--rounds", type=int, default=5,
                 help="alternating raw/ops rounds per case; iterations are "
                 "split between them (default 5)")
  p.add_argument("--json", help="write all results to this file (rank 0)")
  p.add_argument("--plot", help="write a latency-vs-size PNG (rank 0)")
  p.add_argument("--mwms-json",
                 help="MWMS results from an earlier --include-mwms run")
  p.add_argument("--include-mwms", action="store_true",
                 help="also measure MultiWorkerMirroredStrategy (2 gRPC "
                 "workers on localhost, spawned by rank 0 afterwards)")
  p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
  p.add_argument("--no-chain", action="store_true",
                 help="skip the chained per-op measurements")
  p.add_argument("--planes", default="",
                 help="comma-separated Options.data_plane values, e.g. "
                 "shm,mpi: every round runs the ops once per plane; the "
                 "first fills the usual columns, the others add chained "
                 "per-op rows (default: the engine's choice only)")
  p.add_argument("--verbose", action="store_true")
  p.add_argument("--mwms-worker", action="store_true", help=argparse.SUPPRESS)
  # Tags the processes of a test run so the launcher tests can find leftovers.
  p.add_argument("--marker", default="", help=argparse.SUPPRESS)
  args = p.parse_args()

  try:
    cases = [parse_case(c) for c in args.sizes.split(",") if c.strip()]
  except ValueError as e:
    print(f"bench/allreduce.py: {e}", file=sys.stderr)
    return 2
  if args.rounds < 1:
    print(f"bench/allreduce.py: --rounds must be >= 1, got {args.rounds}",
          file=sys.stderr)
    return 2

  if args.mwms_worker:
    mwms_worker(args)
    return 0

  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  # mpi4py first: it initialises MPI (MPI_THREAD_MULTIPLE), and the
  # mpistrategy engine then reuses the initialised MPI.
  from mpi4py import MPI
  comm = MPI.COMM_WORLD
  rank, size = comm.Get_rank(), comm.Get_size()

  import tensorflow as tf
  device = "/CPU:0"
  if args.device == "gpu":
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
      if rank == 0:
        print("bench/allreduce.py: --device gpu: TensorFlow sees no GPU on "
              "this machine (tf.config.list_physical_devices('GPU') is "
              "empty); run without --device gpu for the CPU benchmark.",
              file=sys.stderr)
      return 2
    local_rank = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
    tf.config.set_visible_devices(gpus[local_rank % len(gpus)], "GPU")
    device = "/GPU:0"

  t_start = time.perf_counter()
  if rank == 0:
    print(f"bench/allreduce.py: {size} ranks, cases {args.sizes}, "
          f"device {device}", flush=True)
  # Each case runs in rounds that alternate raw MPI (engine stopped, so its
  # thread cannot perturb the baseline) with mpistrategy ops (engine
  # running).  Load on a shared machine drifts by several times within a
  # run; ratios are taken round by round (see ratio_to_raw).
  import mpistrategy
  planes = [p.strip() for p in args.planes.split(",") if p.strip()] or [""]
  if rank == 0 and planes != [""]:
    print(f"bench/allreduce.py: data planes {', '.join(planes)} (the first "
          "fills the ops columns)", flush=True)
  rounds = []
  for case in cases:
    for _ in range(args.rounds):
      rounds.append(bench_raw(comm, [case], args))
      comm.Barrier()
      for i, plane in enumerate(planes):
        mpistrategy.init(
            mpistrategy.Options(data_plane=plane) if plane else None)
        if mpistrategy.size() != size:
          raise SystemExit(f"mpistrategy.size()={mpistrategy.size()} but "
                           f"MPI size is {size}")
        result = bench_ops([case], args, device)
        if i > 0:  # the other planes: only their chained per-op row
          result = {label: {f"ops_chain_per_op[{plane}]":
                            r["ops_chain_per_op"]}
                    for label, r in result.items() if "ops_chain_per_op" in r}
        rounds.append(result)
        mpistrategy.shutdown()
        comm.Barrier()
  results = pool_rounds(rounds)

  if args.include_mwms:
    # Only rank 0 drives the MWMS workers; the other ranks wait without
    # spinning so the two workers get both cores.  Rank 0 joins the barrier
    # even when the workers fail, so no rank is left waiting.
    mwms, mwms_error = {}, None
    if rank == 0:
      try:
        mwms = run_mwms(args)
      except (SystemExit, OSError, ValueError) as e:
        mwms_error = e
    req = comm.Ibarrier()
    while not req.Test():
      time.sleep(0.05)
    if mwms_error is not None:
      print(f"bench/allreduce.py: --include-mwms: {mwms_error}; the MWMS "
            "column is left out", file=sys.stderr)
    for label, r in mwms.items():
      results.setdefault(label, {}).update(r)
  if args.mwms_json and rank == 0:
    with open(args.mwms_json, encoding="utf-8") as f:
      data = json.load(f)
    # Either a --mwms-worker file or a full --json file of this script.
    data = data.get("results", data)
    for label, r in data.items():
      if "mwms" in r:
        results.setdefault(label, {})["mwms"] = r["mwms"]

  if rank == 0:
    meta = {"size": size, "device": device, "planes": planes,
            "wall_s": round(time.perf_counter() - t_start, 1),
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
            "cpus": os.cpu_count()}
    text, verdicts = report(results, meta)
    # A line at a time: one write of the whole table reaches mpirun's
    # --tag-output in pieces that split lines.
    for line in text.split("\n"):
      print(line)
    print(f"\n(wall time {meta['wall_s']} s; 1-min load average at the "
          f"end {meta['loadavg_1m_at_end']} on {meta['cpus']} CPUs -- "
          f"numbers from a loaded machine are not comparable)")
    if args.json:
      with open(args.json, "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "results": results, "targets": verdicts},
                  f, indent=1)
    if args.plot:
      plot(results, args.plot, meta)
      print(f"plot written to {args.plot}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
