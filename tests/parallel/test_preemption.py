"""The preemption agreement and TF's handler, in one process per rank.

    tests/mpirun_pytest.sh 2 600 tests/parallel/test_preemption.py
    tests/mpirun_pytest.sh 3 600 tests/parallel/test_preemption.py

A signal noted on the last rank only stops every rank at the same
boundary; ranks at different steps get an error instead of a wrong answer;
a signal to one rank during a `PreemptionCheckpointHandler`'s life is
caught (the rank does not die), and every rank saves at the same step.
(The real exit with status 42 is tested in tests/launcher/test_preemption.py.)
"""

import os
import signal

import pytest
import tensorflow as tf

import mpistrategy
from mpistrategy import preemption

R = mpistrategy.rank()
N = mpistrategy.size()


class _Exit(Exception):
  pass


def _exit():
  raise _Exit()


@pytest.fixture(autouse=True)
def _no_notice():
  preemption._WATCH.noted_at = None  # pylint: disable=protected-access
  yield
  preemption._WATCH.noted_at = None  # pylint: disable=protected-access


def test_one_ranks_notice_stops_every_rank_at_the_same_step(strategy):
  del strategy
  assert not preemption.agree(1)
  if R == N - 1:
    preemption.note()
  assert preemption.agree(2)
  assert preemption.noted()  # now also on the ranks that got no signal


def test_ranks_at_different_steps_fail_on_every_rank(strategy):
  del strategy
  with pytest.raises(RuntimeError, match="the ranks are at different steps"):
    preemption.agree(R)


def test_handler_catches_the_signal_and_every_rank_saves_at_one_step(
    strategy, workdir):
  with strategy.scope():
    v = tf.Variable(0.0)
  ckpt = tf.train.Checkpoint(v=v)
  handler = tf.distribute.experimental.PreemptionCheckpointHandler(
      strategy.cluster_resolver, ckpt, workdir,
      tf.distribute.experimental.TerminationConfig(exit_fn=_exit))
  assert signal.getsignal(signal.SIGTERM) is preemption._on_signal  # pylint: disable=protected-access
  step = 0
  with pytest.raises(_Exit):
    for step in range(10):
      handler.run(lambda: v.assign_add(1.0))
      if step == 3 and R == N - 1:
        os.kill(os.getpid(), signal.SIGTERM)  # caught: only noted
  assert step == 4  # stopped at the next boundary, on every rank
  assert v.numpy() == 4.0
  assert tf.train.latest_checkpoint(workdir) is not None
  restored = tf.Variable(0.0)
  tf.train.Checkpoint(v=restored).read(
      tf.train.latest_checkpoint(workdir)).expect_partial()
  assert restored.numpy() == 4.0
  handler.__del__()  # as garbage collection does: the handler goes
  assert signal.getsignal(signal.SIGTERM) is not preemption._on_signal  # pylint: disable=protected-access


def test_save_checkpoint_if_preempted_names_the_steps_done(
    strategy, workdir, capfd):
  # TF's other API: called after each of the user's steps, it counts that
  # step only on its return, yet the message must count it.
  with strategy.scope():
    v = tf.Variable(0.0)
  handler = tf.distribute.experimental.PreemptionCheckpointHandler(
      strategy.cluster_resolver, tf.train.Checkpoint(v=v), workdir,
      tf.distribute.experimental.TerminationConfig(exit_fn=_exit))
  with pytest.raises(_Exit):
    for step in range(1, 10):
      v.assign_add(1.0)
      if step == 3 and R == N - 1:
        os.kill(os.getpid(), signal.SIGTERM)
      handler.save_checkpoint_if_preempted()
  assert v.numpy() == 3.0
  assert (f"preempted: rank {R} saved after step 3 and exits"
          in capfd.readouterr().err)
  handler.__del__()


def test_a_periodic_save_of_the_handlers_checkpoint_resumes_at_its_step(
    strategy, workdir):
  # The README's recipe after a kill -9: the checkpoint the user saved at
  # step 7 held total_run_calls 0 (TF counts only the handler's own saves),
  # so the restarted loop began at step 0 on step-7 weights.
  with strategy.scope():
    v = tf.Variable(0.0)
  ckpt = tf.train.Checkpoint(v=v)
  manager = tf.train.CheckpointManager(ckpt, workdir, max_to_keep=2)
  handler = tf.distribute.experimental.PreemptionCheckpointHandler(
      strategy.cluster_resolver, manager)
  for step in range(handler.total_run_calls, 10):
    handler.run(lambda: v.assign_add(1.0))
    if step == 6:
      manager.save(checkpoint_number=step + 1)
  handler.__del__()
  # A restart: new objects, the same directory.
  with strategy.scope():
    resumed = tf.Variable(0.0)
  ckpt = tf.train.Checkpoint(v=resumed)
  handler = tf.distribute.experimental.PreemptionCheckpointHandler(
      strategy.cluster_resolver,
      tf.train.CheckpointManager(ckpt, workdir, max_to_keep=2))
  assert resumed.numpy() == 7.0
  assert handler.total_run_calls == 7
  handler.__del__()
