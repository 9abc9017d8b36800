"""Restoring on rank 0 only (the Horovod habit) fails fast, never hangs.

    tests/mpirun_pytest.sh 2 600 tests/parallel/test_checkpoint_rank0_restore.py
    tests/mpirun_pytest.sh 3 600 tests/parallel/test_checkpoint_rank0_restore.py

A read into the strategy's variables is collective.  When rank 0 alone
makes it and the other ranks go on to a collective (a broadcast of the
variables, an allreduce), the engine sees the two sides crossed: rank 0's
read fails within seconds saying what to do, and the others' collective
fails naming rank 0's checkpoint read.  When the other ranks are in no
collective, the read timeout decides.  Every-rank restores keep working
after all of it.  (The job-level form, where the errors end the job, is in
tests/launcher/test_checkpoint_job.py.)
"""

import os
import time

import numpy as np
import pytest
import tensorflow as tf
import keras

import mpistrategy
from mpistrategy import checkpoint as mpi_checkpoint
from mpistrategy import ops
from mpistrategy.ops import blocking_join
import mpistrategy.horovod.tensorflow as hvd

R = mpistrategy.rank()
N = mpistrategy.size()
# Well under the default read timeout (120 s): the crossing is what fails.
FAST_S = 15.0
WHAT = {"checkpoint": "tf.train.Checkpoint.read/restore",
        "load_weights": "Model.load_weights"}


def _model(strategy):
  with strategy.scope():
    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    m.compile(optimizer="sgd", loss="mse")
  return m


def _set(model, value):
  for w in model.weights:
    w.assign(np.full(w.shape, value, np.float32))


def _saved(strategy, workdir, api):
  """A model whose rank-0 state (all 1) is saved by rank 0 alone."""
  m = _model(strategy)
  _set(m, 1.0)
  path = os.path.join(workdir, "r0" + (".weights.h5" if api == "load_weights"
                                       else ""))
  if R == 0:  # Horovod style: no communication
    if api == "load_weights":
      m.save_weights(path)
    else:
      tf.train.Checkpoint(model=m).write(path)
  _set(m, float(R + 2))  # every rank differs from the saved state
  ops.barrier(name="rank0_restore/saved")
  return m, path


def _restore(m, path, api):
  if api == "load_weights":
    m.load_weights(path)
  else:
    tf.train.Checkpoint(model=m).restore(path)


@pytest.fixture(scope="module", autouse=True)
def _hvd(strategy):
  del strategy
  hvd.init()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("then", ["broadcast_variables", "allreduce"])
@pytest.mark.parametrize("api", ["checkpoint", "load_weights"])
def test_rank0_only_restore_then_a_collective_fails_fast(strategy, workdir,
                                                          api, then):
  m, path = _saved(strategy, workdir, api)
  start = time.monotonic()
  with pytest.raises(tf.errors.FailedPreconditionError) as info:
    if R == 0:
      _restore(m, path, api)
    # Every rank (rank 0 too, in the Horovod script) goes on to:
    if then == "broadcast_variables":
      hvd.broadcast_variables(m.variables, root_rank=0)
    else:
      ops.allreduce(tf.ones([3]), name="rank0_restore/allreduce")
  elapsed = time.monotonic() - start
  print(f"rank {R}: {api} then {then} failed after {elapsed:.2f} s")
  assert elapsed < FAST_S, f"took {elapsed:.1f} s"
  message = str(info.value.message)
  if R == 0:
    assert f"rank 0 called {WHAT[api]}" in message, message
    assert "must make the call on every rank" in message, message
    assert "Saving on rank 0 only needs no change" in message, message
    for r in range(1, N):
      assert f"rank {r} (host" in message, message
    assert ("waits in broadcast" if then == "broadcast_variables" else
            "waits in allreduce") in message, message
  else:
    assert "cannot complete: rank 0 (host" in message, message
    assert f"MPIBlockingJoin/{WHAT[api]} (a collective checkpoint read: " \
           "every rank must call it)" in message, message
    assert f"rank {R} (host" in message, message
  # Both sides failed cleanly: the ranks go on together, nothing restored.
  ops.barrier(name="rank0_restore/after")
  for w in m.weights:
    np.testing.assert_array_equal(w.numpy(), float(R + 2))


@pytest.mark.timeout(120)
def test_rank0_only_restore_while_the_others_compute_times_out(
    strategy, workdir, monkeypatch):
  read_timeout = 4.0
  monkeypatch.setattr(mpi_checkpoint, "_read_timeout", lambda: read_timeout)
  m, path = _saved(strategy, workdir, "checkpoint")
  start = time.monotonic()
  if R == 0:
    with pytest.raises(tf.errors.DeadlineExceededError) as info:
      _restore(m, path, "checkpoint")
    elapsed = time.monotonic() - start
    print(f"rank 0: timed out after {elapsed:.2f} s")
    assert read_timeout <= elapsed < read_timeout + 5.0, elapsed
    message = info.value.message
    assert "waited 4 s in tf.train.Checkpoint.read/restore" in message
    assert "must make the call on every rank" in message
  else:
    # In no collective (computing, or in Python) past rank 0's timeout.
    time.sleep(read_timeout + 2.0)
    # The join rank 0 left posted: join it, so that it completes (a real
    # job ends on rank 0's error instead).
    ops.barrier(name=blocking_join.PREFIX + mpi_checkpoint._join_name(  # pylint: disable=protected-access
        WHAT["checkpoint"]))
  ops.barrier(name="rank0_restore/after_timeout")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("api", ["checkpoint", "load_weights"])
def test_every_rank_restore_still_works(strategy, workdir, api):
  m, path = _saved(strategy, workdir, api)
  start = time.monotonic()
  _restore(m, path, api)
  hvd.broadcast_variables(m.variables, root_rank=0)  # harmless, may stay
  print(f"rank {R}: every-rank {api} took {time.monotonic() - start:.2f} s")
  for w in m.weights:
    np.testing.assert_array_equal(w.numpy(), 1.0)
