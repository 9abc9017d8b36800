"""Autotune and fusion wait under mpirun (Options.autotune, fusion_wait_ms).

    tests/mpirun_pytest.sh 2 900 tests/parallel/test_autotune.py
    tests/mpirun_pytest.sh 3 1200 tests/parallel/test_autotune.py

Each test restarts the engine with its own options and restores the
defaults afterwards, so test modules that run later in the same process see
a default engine.
"""

import csv
import os
import shutil
import tempfile
import time

import numpy as np
import pytest
import tensorflow as tf

import mpistrategy
from mpistrategy import ops

SIZE = int(os.environ.get("OMPI_COMM_WORLD_SIZE",
                          os.environ.get("PMI_SIZE", "1")))
RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK",
                          os.environ.get("PMI_RANK", "0")))
# Generous: default sample lengths need ~10 s of steady traffic; a loaded
# 2-core machine running 3 ranks may need several times that.
TUNING_BUDGET_SECONDS = 150.0


def _restart(options):
  if mpistrategy.is_initialized():
    mpistrategy.shutdown()
  mpistrategy.init(options)


@pytest.fixture(autouse=True)
def _default_engine_afterwards():
  yield
  _restart(mpistrategy.Options())


@pytest.fixture()
def shared_directory():
  """A directory path chosen by rank 0, the same string on every rank.

  Only rank 0 writes there (the autotune log); it removes it afterwards.
  """
  path = tempfile.mkdtemp(prefix="mpistrategy_autotune_") if RANK == 0 else ""
  encoded = np.frombuffer(path.encode().ljust(256, b"\0"), np.uint8)
  agreed = ops.broadcast(tf.constant(encoded), root_rank=0)
  yield bytes(np.asarray(agreed)).rstrip(b"\0").decode()
  if RANK == 0:
    shutil.rmtree(path, ignore_errors=True)


def _agree_min(value):
  return float(np.asarray(ops.allreduce(tf.constant(float(value)),
                                        op=ops.Min)))


def test_without_autotune_the_configured_parameters_are_final():
  _restart(mpistrategy.Options(fusion_threshold_bytes=3 << 20,
                               fusion_wait_ms=0.25))
  assert ops.tuned_parameters() == {
      "fusion_threshold_bytes": 3 << 20, "fusion_wait_ms": 0.25,
      "final": True}


def test_tuned_parameters_needs_an_initialized_engine():
  mpistrategy.shutdown()
  with pytest.raises(ValueError, match="not initialized"):
    ops.tuned_parameters()


def test_rank_zeros_fusion_parameters_govern_every_rank():
  # As if MPISTRATEGY_FUSION_THRESHOLD_BYTES were set on some hosts only:
  # fusion plans must still match, so every rank adopts rank 0's.
  _restart(mpistrategy.Options(
      fusion_threshold_bytes=(64 << 20) if RANK == 0 else 4096 * RANK,
      fusion_wait_ms=0.0 if RANK == 0 else 1.0))
  x = [tf.fill([1000 + i], float(RANK + 1)) for i in range(30)]
  expected = SIZE * (SIZE + 1) / 2
  for _ in range(3):
    out = ops.grouped_allreduce(x, op=ops.Sum)
    for i, o in enumerate(out):
      np.testing.assert_array_equal(np.asarray(o), np.full([1000 + i],
                                                           expected))
  assert ops.tuned_parameters() == {
      "fusion_threshold_bytes": 64 << 20, "fusion_wait_ms": 0.0,
      "final": True}


def test_fusion_wait_keeps_results_correct():
  _restart(mpistrategy.Options(fusion_wait_ms=2.0))
  x = tf.fill([1000], float(RANK + 1))

  @tf.function
  def separate(t):
    return [ops.allreduce(t * float(i), op=ops.Sum) for i in range(20)]

  for _ in range(3):
    out = separate(x)
  expected = SIZE * (SIZE + 1) / 2
  for i, o in enumerate(out):
    np.testing.assert_allclose(np.asarray(o), expected * i)


def test_autotune_finishes_with_the_same_parameters_on_every_rank(
    shared_directory):
  log_path = os.path.join(shared_directory, "autotune.csv")
  _restart(mpistrategy.Options(autotune=True, autotune_log=log_path))
  assert not ops.tuned_parameters()["final"] or SIZE == 1

  count = 50
  x = tf.fill([count * 1024], float(RANK + 1))
  expected = SIZE * (SIZE + 1) / 2

  @tf.function
  def step(t):
    return [ops.allreduce(p, op=ops.Sum) for p in tf.split(t, count)]

  start = time.monotonic()
  while True:
    for _ in range(20):
      out = step(x)
    # Results stay right while parameters change under the traffic.
    np.testing.assert_array_equal(np.asarray(out[-1]), expected)
    final = _agree_min(ops.tuned_parameters()["final"])
    out_of_time = _agree_min(time.monotonic() - start <
                             TUNING_BUDGET_SECONDS) == 0.0
    if final == 1.0 or out_of_time:
      break
  assert final == 1.0, (
      f"autotune not final after {time.monotonic() - start:.0f} s")

  mine = ops.tuned_parameters()
  gathered = np.asarray(ops.allgather(tf.constant(
      [[float(mine["fusion_threshold_bytes"]), mine["fusion_wait_ms"]]],
      tf.float64)))
  assert (gathered == gathered[0]).all(), gathered
  assert mine["fusion_threshold_bytes"] >= 0
  assert 0.0 <= mine["fusion_wait_ms"] <= 1000.0

  mpistrategy.shutdown()  # closes the log
  if RANK == 0:  # only rank 0 writes it
    with open(log_path, newline="") as f:
      rows = list(csv.DictReader(f))
    events = [r["event"] for r in rows]
    assert "sample" in events, events
    assert "accepted" in events or "rejected" in events, events
    assert events[-1] == "final", events
    last = rows[-1]
    assert int(last["fusion_threshold_bytes"]) == mine[
        "fusion_threshold_bytes"]
    assert float(last["fusion_wait_ms"]) == mine["fusion_wait_ms"]
