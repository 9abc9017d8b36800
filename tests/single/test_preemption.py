"""Preemption in one process: the signal, fit's save and mid-epoch resume.

A SIGTERM during `fit` with `BackupAndRestore` is caught, the backup is
saved at that batch and `fit` ends with `SystemExit(42)`; a new `fit` with
the same callback resumes at the next batch (not at the start of the
epoch, as Keras 3 alone does) and ends with the weights of an
uninterrupted run.  Signal names parse or fail with a clear message.
"""

import json
import os
import signal

import numpy as np
import pytest
import keras

import mpistrategy
from mpistrategy import preemption


@pytest.fixture(autouse=True)
def _no_notice():
  preemption._WATCH.noted_at = None  # pylint: disable=protected-access
  yield
  preemption._WATCH.noted_at = None  # pylint: disable=protected-access


def _data():
  rng = np.random.RandomState(0)
  x = rng.randn(64, 4).astype(np.float32)
  return x, x @ np.array([[1.0], [2.0], [-1.0], [0.5]], np.float32)


def _model(strategy):
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        1, kernel_initializer="ones")])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
  return model


def _fit_setup(tmp_path, epochs):
  """A strategy, `fit`'s arguments (8 batches an epoch) and a backup dir."""
  strategy = mpistrategy.MPIStrategy()
  x, y = _data()
  fit = dict(x=x, y=y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
  return strategy, fit, str(tmp_path / "backup")


def _assert_as_uninterrupted(strategy, fit, resumed):
  reference = _model(strategy)
  reference.fit(**fit)
  np.testing.assert_array_equal(resumed.get_weights()[0],
                                reference.get_weights()[0])


class _SignalAt(keras.callbacks.Callback):

  def __init__(self, step):
    super().__init__()
    self.step = step

  def on_train_batch_end(self, batch, logs=None):
    if int(self.model.optimizer.iterations.numpy()) == self.step:
      os.kill(os.getpid(), signal.SIGTERM)


def test_fit_saves_on_sigterm_and_resumes_at_the_next_batch(tmp_path):
  strategy, fit, backup = _fit_setup(tmp_path, epochs=2)
  model = _model(strategy)
  before = signal.getsignal(signal.SIGTERM)
  with pytest.raises(SystemExit) as stop:
    model.fit(**fit, callbacks=[
        _SignalAt(11), keras.callbacks.BackupAndRestore(backup)])
  assert stop.value.code == preemption.EXIT_CODE
  with open(os.path.join(backup, "training_metadata.json")) as f:
    meta = json.load(f)
  # 8 batches an epoch: step 11 is the 3rd batch of epoch 1 (0-based).
  assert (meta["epoch"], meta["mpistrategy_batches_done"]) == (1, 3), meta

  preemption._WATCH.noted_at = None  # a new process would start clean  # pylint: disable=protected-access
  resumed = _model(strategy)
  resumed.fit(**fit, callbacks=[keras.callbacks.BackupAndRestore(backup)])
  assert int(resumed.optimizer.iterations.numpy()) == 16  # 11 + 5, no redo
  assert signal.getsignal(signal.SIGTERM) is before  # restored after fit
  _assert_as_uninterrupted(strategy, fit, resumed)


class _SignalAtTheLastEpochEnd(keras.callbacks.Callback):

  def on_epoch_end(self, epoch, logs=None):
    if epoch == self.params["epochs"] - 1:
      os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_after_the_last_step_says_nothing_was_saved(tmp_path,
                                                             capfd):
  # No step boundary follows, so fit returns; the rank must not leave the
  # promise of a save standing.
  strategy, fit, backup = _fit_setup(tmp_path, epochs=1)
  model = _model(strategy)
  model.fit(**fit, callbacks=[keras.callbacks.BackupAndRestore(backup),
                              _SignalAtTheLastEpochEnd()])
  err = capfd.readouterr().err
  assert "got SIGTERM: every rank saves at the next step boundary" in err
  assert ("SIGTERM came after the last step boundary, so nothing was saved "
          "or stopped for it; the program goes on") in err, err


class _RaiseAtEpoch(keras.callbacks.Callback):

  def on_epoch_begin(self, epoch, logs=None):
    if epoch == 1:
      raise RuntimeError("crash at the start of epoch 1")


class _Logs(keras.callbacks.Callback):

  def on_epoch_end(self, epoch, logs=None):
    self.seen = getattr(self, "seen", []) + [(epoch, dict(logs or {}))]


def test_backup_of_an_epochs_last_batch_resumes_at_the_next_epoch(tmp_path):
  # save_freq=8 with 8 batches an epoch: the backup is taken after the
  # epoch's last batch, before its end.  Every batch of that epoch is done,
  # so the resume starts at the next epoch, not at an epoch of no batches
  # and no logs.
  strategy, fit, backup = _fit_setup(tmp_path, epochs=3)
  model = _model(strategy)
  with pytest.raises(RuntimeError, match="crash at the start of epoch 1"):
    model.fit(**fit, callbacks=[keras.callbacks.BackupAndRestore(
        backup, save_freq=8), _RaiseAtEpoch()])
  with open(os.path.join(backup, "training_metadata.json")) as f:
    meta = json.load(f)
  assert (meta["epoch"], meta["mpistrategy_batches_done"]) == (0, 8), meta

  resumed = _model(strategy)
  logs = _Logs()
  history = resumed.fit(**fit, callbacks=[
      keras.callbacks.BackupAndRestore(backup, save_freq=8), logs])
  assert history.epoch == [1, 2], history.epoch
  assert [epoch for epoch, _ in logs.seen] == [1, 2]
  assert all("loss" in epoch_logs for _, epoch_logs in logs.seen), logs.seen
  assert int(resumed.optimizer.iterations.numpy()) == 24
  _assert_as_uninterrupted(strategy, fit, resumed)


class _RaiseAt(keras.callbacks.Callback):

  def on_train_batch_end(self, batch, logs=None):
    if batch == 2:
      raise RuntimeError("deliberate failure in fit")


def test_fit_that_raises_gives_the_signal_back(tmp_path):
  # Keras skips on_train_end when fit raises; the signal must still stop
  # being caught once fit is over, or a later SIGTERM would only be noted.
  strategy = mpistrategy.MPIStrategy()
  x, y = _data()
  model = _model(strategy)
  before = signal.getsignal(signal.SIGTERM)
  backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
  with pytest.raises(RuntimeError, match="deliberate failure in fit"):
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[backup, _RaiseAt()])
  assert signal.getsignal(signal.SIGTERM) is before
  assert preemption._WATCH.users == 0  # pylint: disable=protected-access


@pytest.mark.parametrize("text, expected", [
    ("SIGUSR1", signal.SIGUSR1), ("usr1", signal.SIGUSR1),
    ("15", signal.SIGTERM)])
def test_signal_names(text, expected):
  assert preemption.parse_signal(text) == expected
  assert preemption.signal_from_env(
      {preemption.SIGNAL_VARIABLE: text}) == expected
  assert preemption.signal_from_env({}) == signal.SIGTERM


@pytest.mark.parametrize("text, message", [
    ("SIGKILL", "SIGKILL cannot be caught"),
    ("bogus", "'bogus' is not a signal name or number")])
def test_bad_signal_names(text, message):
  with pytest.raises(ValueError, match=preemption.SIGNAL_VARIABLE + ".*" +
                     message):
    preemption.signal_from_env({preemption.SIGNAL_VARIABLE: text})
