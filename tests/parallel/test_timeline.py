"""The engine timeline (`mpistrategy.Options(timeline=...)`) under mpirun.

    tests/mpirun_pytest.sh 2 600 tests/parallel/test_timeline.py
    tests/mpirun_pytest.sh 3 600 tests/parallel/test_timeline.py

Each test restarts the engine with a timeline in a directory rank 0 created
(its path is broadcast), runs a `tf.function` with every kind of collective,
shuts the engine down (which closes the file) and restarts it with the
options it had before.  The files are then parsed with `json.load`.
"""

import collections
import json
import os
import shutil
import socket
import tempfile

import numpy as np
import pytest
import tensorflow as tf

import mpistrategy
from mpistrategy import ops
from mpistrategy.ops import collectives

RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK",
                          os.environ.get("PMI_RANK", "0")))
SIZE = int(os.environ.get("OMPI_COMM_WORLD_SIZE",
                          os.environ.get("PMI_SIZE", "1")))
S = SIZE * (SIZE + 1) / 2  # sum over ranks of (rank + 1)

GROUP = 4
# Row name -> the span of its collective.
COLLECTIVES = dict(
    [(f"tl/grouped.{i}", "ALLREDUCE") for i in range(GROUP)] + [
        ("tl/packed", "ALLREDUCE"),
        ("tl/packed_large", "ALLREDUCE"),
        ("tl/allreduce", "ALLREDUCE"),
        ("tl/large", "ALLREDUCE"),
        ("tl/allgather", "ALLGATHER"),
        ("tl/broadcast", "BROADCAST"),
        ("tl/barrier", "BARRIER"),
    ])
FUSED = [f"tl/grouped.{i}" for i in range(GROUP)]
# int64: no other allreduce here has that dtype, so it is never fused.  Above
# the shared-memory plane's 16 KB small-allreduce path.
LARGE_ELEMENTS = 128 << 10
# float16, no other allreduce's dtype: a packed group above 16 KB, which the
# shared-memory plane reduces where its tensors are.
PACKED_LARGE = [16 << 10, (16 << 10) + 3]
_PATH_BYTES = 4096


@pytest.fixture(autouse=True, scope="module")
def _initialized():
  if not mpistrategy.is_initialized():
    mpistrategy.init()
  yield


@pytest.fixture(scope="module")
def shared_dir():
  """A directory rank 0 created; the same path on every rank."""
  path = tempfile.mkdtemp(prefix="mpistrategy-timeline-") if RANK == 0 else ""
  buffer = np.zeros([_PATH_BYTES], np.uint8)
  encoded = path.encode()
  assert len(encoded) < _PATH_BYTES
  buffer[:len(encoded)] = np.frombuffer(encoded, np.uint8)
  received = ops.broadcast(tf.constant(buffer), root_rank=0,
                           name="timeline/shared_dir")
  path = bytes(received.numpy()).rstrip(b"\0").decode()
  yield path
  ops.barrier(name="timeline/cleanup")
  if RANK == 0:
    shutil.rmtree(path, ignore_errors=True)


def _run_with_timeline(timeline, iterations, data_plane):
  """Runs the workload with the engine writing `timeline`; restores it.

  Args:
    timeline: `Options.timeline` for the run.
    iterations: How often to call the workload function (the first call
      negotiates through the coordinator, later ones through the cache).
    data_plane: `Options.data_plane` for the run ("shm" or "mpi").
  """
  previous = mpistrategy.current_options()
  mpistrategy.shutdown()
  try:
    mpistrategy.init(mpistrategy.Options(timeline=timeline,
                                         data_plane=data_plane))
    assert mpistrategy.current_options().timeline == timeline

    @tf.function
    def step(xs, y, g, b, large):
      # pack=False: one engine entry per tensor, fused by the engine (on
      # the MPI plane through the fusion buffer, which the
      # MEMCPY_*_FUSION_BUFFER spans show).  grouped_allreduce packs
      # the group itself: one row, no fusion-buffer copies.
      fused = collectives._grouped_allreduce_unpacked(xs, "tl/grouped")  # pylint: disable=protected-access
      # int32: no other allreduce here has that dtype, so the packed
      # buffer is never fused with another entry.
      packed = ops.grouped_allreduce([tf.cast(x, tf.int32) for x in xs],
                                     name="tl/packed")
      packed_large = ops.grouped_allreduce(
          [tf.fill([n], tf.constant(RANK + 1, tf.float16))
           for n in PACKED_LARGE], name="tl/packed_large")
      summed = ops.allreduce(y, name="tl/allreduce")
      large = ops.allreduce(large, name="tl/large")
      gathered = ops.allgather(g, name="tl/allgather")
      root = ops.broadcast(b, root_rank=0, name="tl/broadcast")
      ops.barrier(name="tl/barrier")
      return fused + packed, summed, gathered, root, large, packed_large

    xs = [tf.fill([16 + i], float(RANK + 1)) for i in range(GROUP)]
    y = tf.constant([RANK + 1.0], tf.float64)  # float64: never fused with xs
    g = tf.fill([RANK + 1, 2], RANK)
    b = tf.fill([3], float(RANK))
    large = tf.fill([LARGE_ELEMENTS], tf.constant(RANK + 1, tf.int64))
    for _ in range(iterations):
      fused, summed, gathered, root, large_sum, packed_large = step(
          xs, y, g, b, large)
      for n, t in zip(PACKED_LARGE, packed_large):
        np.testing.assert_array_equal(t.numpy(), np.full([n], S, np.float16))
      assert len(fused) == 2 * GROUP
      for i, t in enumerate(fused):
        np.testing.assert_array_equal(t.numpy(),
                                      np.full([16 + i % GROUP], S))
      assert summed.numpy().tolist() == [S]
      assert tuple(gathered.shape) == (SIZE * (SIZE + 1) // 2, 2)
      assert root.numpy().tolist() == [0.0] * 3
      np.testing.assert_array_equal(large_sum.numpy(),
                                    np.full([LARGE_ELEMENTS], S))
  finally:
    # Shutting down flushes and closes the file.
    mpistrategy.shutdown()
    mpistrategy.init(previous)
  # Every rank has closed its file once all of them got here.
  ops.barrier(name="timeline/closed")


def _load(path):
  with open(path) as f:
    events = json.load(f)
  assert isinstance(events, list) and events, path
  return events


def _rows(events):
  """{row name: [its non-metadata events in file order]} and the tid map."""
  names = {}
  for e in events:
    if e["ph"] == "M" and e["name"] == "thread_name":
      names[e["tid"]] = e["args"]["name"]
  rows = collections.defaultdict(list)
  for e in events:
    if e["ph"] != "M":
      assert e["tid"] in names, f"event on an unnamed row: {e}"
      rows[names[e["tid"]]].append(e)
  return rows


def _spans(row, events):
  """The row's complete spans, after checking they are ordered and apart."""
  spans = [e for e in events if e["ph"] == "X"]
  end = None
  for e in spans:
    assert e["dur"] >= 0, (row, e)
    if end is not None:
      # In file order, each span starts after the previous one ended (the
      # engine emits a row's spans in time order); 1 ns of slack for the
      # decimal printing.
      assert e["ts"] + 1e-3 >= end, (row, spans)
    end = e["ts"] + e["dur"]
  return spans


def _check_rows(events, iterations, data_plane):
  """Checks the per-tensor spans of every collective of the workload."""
  rows = _rows(events)
  for name, collective in COLLECTIVES.items():
    assert name in rows, f"no row for {name}; rows: {sorted(rows)}"
    spans = _spans(name, rows[name])
    sequence = [e["name"] for e in spans]
    per_call = ["NEGOTIATE", "QUEUE"]
    if name in FUSED and data_plane == "mpi":
      per_call += ["MEMCPY_IN_FUSION_BUFFER", collective,
                   "MEMCPY_OUT_FUSION_BUFFER"]
    else:
      per_call += [collective]
    assert sequence == per_call * iterations, (name, sequence)
  for name in FUSED:
    bucket = [e for e in rows[name] if e["name"] == "ALLREDUCE"]
    assert all(e["args"]["bucket_tensors"] >= GROUP for e in bucket), bucket
  # Only the shared-memory plane's allreduces above 16 KB say with which
  # stores they handed their data over (its tuner's choice).
  for name, collective in COLLECTIVES.items():
    handoffs = [e["args"].get("handoff") for e in rows[name]
                if e["name"] == collective]
    if name in ("tl/large", "tl/packed_large") and data_plane == "shm":
      assert handoffs and set(handoffs) <= {"cached", "streaming"}, handoffs
    else:
      assert handoffs == [None] * len(handoffs), (name, handoffs)
  # The packed buffer: tensors of 16..19 int32s, each starting at a
  # multiple of 16 elements (64 bytes): offsets 0, 16, 48, 80; 99 in all.
  packed = [e for e in rows["tl/packed"] if e["name"] == "NEGOTIATE"]
  assert [e["args"]["shape"] for e in packed] == ["[99]"] * len(packed), (
      packed)
  return rows


def test_rank0_writes_a_chrome_trace(shared_dir):
  path = os.path.join(shared_dir, "trace.json")
  iterations = 2
  # Shared memory gathers a fused bucket's tensors itself: no fusion-buffer
  # spans (the MPI plane's are checked below).
  _run_with_timeline(path, iterations, "shm")
  if RANK != 0:
    return
  assert os.listdir(shared_dir) == ["trace.json"], (
      "only rank 0 writes without {rank}")
  events = _load(path)
  assert all(e["pid"] == 0 for e in events)
  assert {"process_name", "thread_name"} <= {
      e["name"] for e in events if e["ph"] == "M"}
  # The process row names the rank with its host and pid.
  [process] = [e for e in events if e["name"] == "process_name"]
  assert process["args"]["name"] == (
      f"rank 0 (host {socket.gethostname()}, pid {os.getpid()})"), process
  rows = _check_rows(events, iterations, "shm")
  # The coordinator's REQUEST instants: one per rank, in the first
  # (negotiated) call only; later calls take the cached fast path.
  for name in COLLECTIVES:
    ranks = sorted(e["args"]["rank"] for e in rows[name]
                   if e["name"] == "REQUEST")
    assert ranks == list(range(SIZE)), (name, ranks)
    negotiate = [e for e in rows[name] if e["name"] == "NEGOTIATE"]
    assert [e["args"]["path"] for e in negotiate][0] == "slow", negotiate
  # Cycles: every executed collective is counted in exactly one cycle.
  cycles = [e for e in rows["negotiation cycles"] if e["name"] == "CYCLE"]
  _spans("negotiation cycles", rows["negotiation cycles"])
  assert sum(e["args"]["tensors"] for e in cycles) == (
      len(COLLECTIVES) * iterations), cycles
  fused_cycles = [e for e in cycles if e["args"]["fused_buckets"] >= 1 and
                  e["args"]["tensors"] >= GROUP]
  assert fused_cycles, cycles
  assert {e["args"]["path"] for e in fused_cycles} == {"slow", "fast"}, (
      fused_cycles)
  assert not [e for e in events if e["name"] == "DROPPED_EVENTS"]


def test_rank_placeholder_writes_one_file_per_rank(shared_dir):
  pattern = os.path.join(shared_dir, "ranks", "trace.{rank}.json")
  if RANK == 0:
    os.makedirs(os.path.dirname(pattern))
  ops.barrier(name="timeline/ranks_dir")
  _run_with_timeline(pattern, 1, "mpi")
  mine = pattern.replace("{rank}", str(RANK))
  events = _load(mine)
  assert all(e["pid"] == RANK for e in events)
  _check_rows(events, 1, "mpi")
  if RANK == 0:
    assert sorted(os.listdir(os.path.dirname(pattern))) == sorted(
        f"trace.{r}.json" for r in range(SIZE))
    for r in range(1, SIZE):
      _load(pattern.replace("{rank}", str(r)))


def test_a_rank_that_cannot_create_the_file_fails_every_rank(shared_dir):
  # Only rank 0 writes (no "{rank}"), and its directory does not exist: its
  # init raises, and so does the other ranks' init, naming rank 0 and the
  # path, instead of waiting for rank 0 forever (or returning, and failing
  # at the first collective).
  missing = os.path.join(shared_dir, "missing", "trace.json")
  previous = mpistrategy.current_options()
  mpistrategy.shutdown()
  try:
    if RANK == 0:
      with pytest.raises(ValueError, match="missing/trace.json"):
        mpistrategy.init(mpistrategy.Options(timeline=missing))
    else:
      with pytest.raises(tf.errors.FailedPreconditionError,
                         match=r"rank 0 \(host [^,]+, pid \d+\) could not "
                         r"start mpistrategy: .*"
                         r"missing/trace\.json"):
        mpistrategy.init(mpistrategy.Options(timeline=missing))
  finally:
    mpistrategy.shutdown()
    mpistrategy.init(previous)


def test_engine_runs_without_timeline_afterwards():
  assert mpistrategy.current_options().timeline == ""
  assert ops.allreduce(tf.constant(RANK + 1.0),
                       name="timeline/after").numpy() == S


def _row_names(path):
  with open(path) as f:
    events = json.load(f)
  return {e["args"]["name"] for e in events
          if e["ph"] == "M" and e["name"] == "thread_name"}


def test_start_and_stop_timeline_on_every_rank(shared_dir):
  ops.allreduce(tf.constant(1.0), name="window/before")
  path = os.path.join(shared_dir, "window.{rank}.json")
  mpistrategy.start_timeline(path)
  ops.allreduce(tf.constant(1.0), name="window/during")
  ops.allgather(tf.constant([1.0]), name="window/gather")
  mpistrategy.stop_timeline()
  ops.allreduce(tf.constant(1.0), name="window/after")
  rows = _row_names(path.replace("{rank}", str(RANK)))
  assert {"window/during", "window/gather"} <= rows
  assert not {"window/before", "window/after"} & rows


def test_start_timeline_again_on_the_file_being_written(shared_dir):
  # The first window's file was truncated under its writer, which then
  # wrote on at its old offset: NUL bytes and two windows mixed.
  path = os.path.join(shared_dir, "again.{rank}.json")
  link = os.path.join(shared_dir, "link.{rank}.json")  # another name of it
  mine = path.replace("{rank}", str(RANK))
  os.symlink(os.path.basename(mine), link.replace("{rank}", str(RANK)))
  for first, second in ((path, path), (path, link)):
    mpistrategy.start_timeline(first)
    for i in range(200):  # far more bytes than the second window's
      ops.allreduce(tf.constant(1.0), name=f"again/first{i % 20}")
    mpistrategy.start_timeline(second)
    ops.allreduce(tf.constant(1.0), name="again/second")
    mpistrategy.stop_timeline()
    with open(mine, "rb") as f:
      assert b"\0" not in f.read()
    rows = _row_names(mine)
    assert "again/second" in rows and not any(
        r.startswith("again/first") for r in rows), (second, sorted(rows))


def test_horovod_start_timeline_writes_rank_0s_file(shared_dir):
  import mpistrategy.horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
  hvd.init()
  path = os.path.join(shared_dir, "hvd.json")
  hvd.start_timeline(path, mark_cycles=True)
  hvd.allreduce(tf.constant([1.0]), name="window/hvd")
  hvd.stop_timeline()
  ops.barrier(name="window/hvd_written")
  assert os.path.exists(path)
  assert "window/hvd" in _row_names(path)
