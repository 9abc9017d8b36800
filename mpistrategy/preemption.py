"""Preemption: every rank stops at the same step, saves, and exits with 42.

Clusters announce a preemption with a signal some seconds before they kill
a job (Slurm: SIGTERM, then SIGKILL `KillWait` = 30 s later; Kubernetes:
SIGTERM, then SIGKILL after `terminationGracePeriodSeconds`).  The signal
may reach every rank (Slurm), one rank, or only the launcher
(`python -m mpistrategy.run` then sends it to its local ranks).

While a `tf.distribute.experimental.PreemptionCheckpointHandler` exists, or
a `fit` with a `keras.callbacks.BackupAndRestore` runs, each rank catches
the preemption signal (`watch`) instead of dying of it and only notes it.
At every step boundary (the handler's `run()` /
`save_checkpoint_if_preempted()`, the callback's batch end) the ranks
all-reduce (max) one small int64 tensor `[noted, step, -step]` (`agree`):
a rank that noted the signal makes every rank see it at the same boundary,
and the step check catches ranks that are not in step.  Then every rank
saves collectively (rank 0 writes the user's path; see
`mpistrategy.checkpoint`) and exits with `EXIT_CODE` (42, the exit code
TensorFlow's handler uses by default; a `TerminationConfig(exit_fn=...)`
still wins).

The signal is SIGTERM unless `MPISTRATEGY_PREEMPTION_SIGNAL` names another
one (`SIGUSR1`, `USR1` or a number; `python -m mpistrategy.run
--preemption-signal`).  Outside a handler or a `fit` with
`BackupAndRestore` the signal keeps its previous disposition, so a script
that does not checkpoint still dies of SIGTERM as before.

This module imports TensorFlow only when a collective or a patch needs it:
the launcher imports it for `EXIT_CODE` and `signal_from_env`.
"""

import json
import os
import signal
import sys
import threading
import time
import weakref

EXIT_CODE = 42

SIGNAL_VARIABLE = "MPISTRATEGY_PREEMPTION_SIGNAL"

# The collective's name: a rank that skipped a boundary shows up under it in
# the engine's stall warnings.
_AGREE_NAME = "MPIPreemption/agree"


def parse_signal(text, what=SIGNAL_VARIABLE):
  """Returns the `signal.Signals` that `text` names.

  Args:
    text: "SIGTERM", "TERM", "term" or a number such as "15".
    what: What to name in the error (the variable or the flag).

  Returns:
    A `signal.Signals`.

  Raises:
    ValueError: `text` names no signal, or one that cannot be caught.
  """
  value = str(text).strip()
  try:
    if value.isdigit():
      signum = signal.Signals(int(value))
    else:
      name = value.upper()
      signum = signal.Signals[name if name.startswith("SIG") else
                              "SIG" + name]
  except (KeyError, ValueError):
    raise ValueError(f"{what}: {text!r} is not a signal name or number "
                     "(e.g. SIGTERM, SIGUSR1, 10)") from None
  if signum in (signal.SIGKILL, signal.SIGSTOP):
    raise ValueError(f"{what}: {signum.name} cannot be caught; use a signal "
                     "a process can handle, e.g. SIGTERM or SIGUSR1")
  return signum


def signal_from_env(environ=None):
  """The preemption signal: `MPISTRATEGY_PREEMPTION_SIGNAL` or SIGTERM.

  Args:
    environ: A mapping; default `os.environ`.

  Returns:
    A `signal.Signals`.

  Raises:
    ValueError: The variable names no catchable signal.
  """
  environ = os.environ if environ is None else environ
  text = environ.get(SIGNAL_VARIABLE, "").strip()
  return parse_signal(text) if text else signal.SIGTERM


class _Watch:
  """This process' signal watch (one per process, reference counted)."""

  def __init__(self):
    self.lock = threading.Lock()
    self.users = 0
    self.signum = None
    self.previous = None
    self.noted_at = None   # time.monotonic() of the first signal
    self.noted_name = None  # its name, for messages
    self.told_unsaved_at = None  # the noted_at the end of a watch reported


_WATCH = _Watch()


def _say(text):
  sys.stderr.write(f"mpistrategy: {text}\n")
  sys.stderr.flush()


def _rank():
  # No import: a handler's `__del__` can get here while the interpreter
  # shuts down, when imports fail ("sys.meta_path is None").
  runtime = sys.modules.get("mpistrategy.runtime")
  return runtime.rank() if runtime and runtime.is_initialized() else 0


def _on_signal(signum, unused_frame):
  if _WATCH.noted_at is None:
    _WATCH.noted_at = time.monotonic()
    _WATCH.noted_name = signal.Signals(signum).name
    _say(f"rank {_rank()} got {_WATCH.noted_name}: every rank saves at the "
         "next step boundary of fit (BackupAndRestore) or of the "
         f"preemption handler's loop, and exits with status {EXIT_CODE}")


def watch():
  """Catches the preemption signal from now on (until `unwatch`).

  Nested calls are counted; the signal's previous handler comes back when
  the last user calls `unwatch`.  Only the main thread can install a
  handler; from another thread this does nothing and returns False.

  Returns:
    True if the signal is watched.

  Raises:
    ValueError: `MPISTRATEGY_PREEMPTION_SIGNAL` is not a catchable signal.
  """
  with _WATCH.lock:
    if _WATCH.users == 0:
      signum = signal_from_env()
      if threading.current_thread() is not threading.main_thread():
        return False
      _WATCH.previous = signal.signal(signum, _on_signal)
      _WATCH.signum = signum
    _WATCH.users += 1
    return True


def unwatch():
  """Ends one `watch`; the last one restores the previous handler."""
  with _WATCH.lock:
    if _WATCH.users == 0:
      return
    _WATCH.users -= 1
    if (_WATCH.users == 0 and
        threading.current_thread() is threading.main_thread()):
      signal.signal(_WATCH.signum, _WATCH.previous or signal.SIG_DFL)
      _WATCH.signum = _WATCH.previous = None
      if _WATCH.noted_at not in (None, _WATCH.told_unsaved_at):
        # The signal came after the last step boundary (the end of fit):
        # nothing acted on it, and the program goes on.
        _WATCH.told_unsaved_at = _WATCH.noted_at
        _say(f"rank {_rank()}: {_WATCH.noted_name or 'the signal'} came "
             "after the last step boundary, so nothing was saved or stopped "
             "for it; the program goes on (a later fit or preemption handler "
             "saves and exits at its first step boundary)")


# The BackupAndRestore callbacks that watch the signal during a fit.  Keras
# skips on_train_end when fit raises, so the end of fit releases them
# (`release_fit_watches`, called by compat's Model.fit wrapper); otherwise
# the process would go on catching the signal after the fit, and a later
# SIGTERM would only be noted instead of ending it.
_FIT_WATCHERS = weakref.WeakSet()


def release_fit_watches():
  """Ends the watches of fits that are over (also when fit raised)."""
  for callback in list(_FIT_WATCHERS):
    callback._stop_watching()  # pylint: disable=protected-access


def note():
  """Notes a preemption as if the signal had arrived (tests, watchers)."""
  if _WATCH.noted_at is None:
    _WATCH.noted_at = time.monotonic()


def noted():
  """True once this rank got the preemption signal (or `note` was called)."""
  return _WATCH.noted_at is not None


def agree(step, noted_here=False):
  """Returns True on every rank if any rank noted a preemption.

  A collective: every rank must call it at the same step boundary.

  Args:
    step: This rank's step count (the same on every rank).
    noted_here: Also count as noted (e.g. TF's `termination_watcher_fn`).

  Returns:
    A bool, the same on every rank.

  Raises:
    RuntimeError: The ranks are at different steps.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from mpistrategy import ops  # pylint: disable=g-import-not-at-top
  from mpistrategy import runtime  # pylint: disable=g-import-not-at-top
  flag = int(noted() or bool(noted_here))
  step = int(step)
  if not runtime.is_initialized() or runtime.size() == 1:
    return bool(flag)
  with tf.init_scope():
    out = ops.allreduce(tf.constant(np.array([flag, step, -step], np.int64)),
                        op=ops.Max, name=_AGREE_NAME).numpy()
  if out[1] != -out[2]:
    raise RuntimeError(
        f"mpistrategy preemption check: the ranks are at different steps "
        f"({-out[2]} to {out[1]}; this rank: {step}); every rank must call "
        "PreemptionCheckpointHandler.run (or fit's batches) equally often")
  if out[0]:
    note()  # this rank has seen it too
  return bool(out[0])


def acted_on():
  """The noted signal was acted on (a save, then the exit): `unwatch` must
  not report it as one that came after the last step boundary."""
  _WATCH.told_unsaved_at = _WATCH.noted_at


def exit_preempted(step, exit_fn=None):
  """Says where the job stopped, then exits (`exit_fn` or `EXIT_CODE`)."""
  acted_on()
  elapsed = ("" if _WATCH.noted_at is None else
             f" {time.monotonic() - _WATCH.noted_at:.1f} s after the signal")
  _say(f"preempted: rank {_rank()} saved after step {step} and exits"
       f"{elapsed} with status {EXIT_CODE if exit_fn is None else '(exit_fn)'}")
  if exit_fn is not None:
    exit_fn()
    # An exit_fn that returns: training goes on, until the next signal.
    _WATCH.noted_at = None
    return
  sys.stdout.flush()
  sys.exit(EXIT_CODE)


# ---------------------------------------------------------------------------
# tf.distribute.experimental.PreemptionCheckpointHandler


def _mpi_job():
  from mpistrategy import runtime  # pylint: disable=g-import-not-at-top
  return runtime.is_initialized()


def _record_runs(handler):
  """Keeps the handler's checkpointed run count at the runs done.

  TF sets the count (restored as `total_run_calls`) only in the handler's
  own preemption save, so a checkpoint the user saves periodically (a
  `CheckpointManager` of the same checkpoint, the README's resume recipe)
  held a stale count: restarted after a `kill -9`, the loop began at the
  last preemption's step on later weights and trained steps again.  Kept
  current after every step, any save of that checkpoint resumes at its
  own step.  Local: every rank counts alike.
  """
  if _mpi_job():
    handler._checkpointed_runs.assign(handler._run_counter)  # pylint: disable=protected-access


def patch_preemption_checkpoint_handler():
  """Makes TF's handler agree over MPI instead of its coordination service.

  With `MPIStrategy`'s cluster spec (a worker per rank, no coordination
  service) TF's multi-worker mode would wait on a coordination service that
  does not exist; with an empty one, its single-worker mode has each rank
  act on its own signal alone, and the saving rank waits in a collective
  forever.  In an mpistrategy job the handler runs in the single-worker
  mode (it is given an empty cluster spec) but watches the preemption
  signal and agrees at each `run()` / `save_checkpoint_if_preempted()`
  over MPI (see `agree`).
  TF's countdown for long grace periods (keep training until shortly before
  the deadline) is not used: the ranks save at the first boundary after
  the signal and exit.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from mpistrategy import _tf_private as _tfp  # pylint: disable=g-import-not-at-top
  handler = _tfp.failure_handling.PreemptionCheckpointHandler
  orig_watch = handler._start_watching_for_signal  # pylint: disable=protected-access
  orig_check = handler._check_preemption_and_maybe_checkpoint  # pylint: disable=protected-access
  orig_init, orig_del = handler.__init__, handler.__del__
  util = _tfp.failure_handling.failure_handling_util

  def __init__(self, cluster_resolver, *args, **kwargs):
    if not _mpi_job():
      return orig_init(self, cluster_resolver, *args, **kwargs)
    if cluster_resolver is not None:  # the single-worker mode (see above)
      cluster_resolver = _tfp.SimpleClusterResolver(
          tf.train.ClusterSpec({}), task_type=cluster_resolver.task_type,
          task_id=cluster_resolver.task_id)
    # TF asks the GCE metadata server (up to 5 s) and then, on GCE, uses
    # GCE's maintenance watcher and a one-hour grace period; an MPI job
    # handles a signal, wherever it runs.
    detect = util.detect_platform
    has_gpu = bool(_tfp.context.context().list_logical_devices("GPU"))
    util.detect_platform = lambda: (util.PlatformDevice.INTERNAL_GPU if has_gpu
                                    else util.PlatformDevice.INTERNAL_CPU)
    try:
      orig_init(self, cluster_resolver, *args, **kwargs)
    finally:
      util.detect_platform = detect
    config = self._termination_config  # pylint: disable=protected-access
    if config is None or config.exit_fn is None:
      self._exit_fn = None  # exit_preempted: sys.exit(EXIT_CODE)  # pylint: disable=protected-access

  def _start_watching_for_signal(self):
    if not _mpi_job():
      return orig_watch(self)
    self._mpistrategy_watching = watch()  # pylint: disable=protected-access
    return None

  def _check_preemption_and_maybe_checkpoint(self, *args, **kwargs):
    if not _mpi_job():
      return orig_check(self, *args, **kwargs)
    step = int(self._run_counter)  # pylint: disable=protected-access
    if not agree(step, self._received_own_sigterm.is_set()):  # pylint: disable=protected-access
      return None
    self._save_checkpoint(*args, **kwargs)  # pylint: disable=protected-access
    self._stop_poll_termination_signal_thread()  # pylint: disable=protected-access
    # run() checks before its step; save_checkpoint_if_preempted() after
    # the user's step, counted only on its return.
    done = step + (1 if getattr(self, "_mpistrategy_after_step", False) else 0)
    exit_preempted(done, self._exit_fn)  # pylint: disable=protected-access
    self._received_own_sigterm.clear()  # pylint: disable=protected-access
    return None

  def __del__(self):
    if getattr(self, "_mpistrategy_watching", False):
      self._mpistrategy_watching = False
      unwatch()
    return orig_del(self)

  orig_save_if, orig_run = handler.save_checkpoint_if_preempted, handler.run

  def save_checkpoint_if_preempted(self, *args, **kwargs):
    self._mpistrategy_after_step = True  # pylint: disable=protected-access
    try:
      result = orig_save_if(self, *args, **kwargs)
    finally:
      self._mpistrategy_after_step = False  # pylint: disable=protected-access
    _record_runs(self)
    return result

  def run(self, *args, **kwargs):
    result = orig_run(self, *args, **kwargs)
    _record_runs(self)
    return result

  save_checkpoint_if_preempted.__doc__ = orig_save_if.__doc__
  run.__doc__ = orig_run.__doc__
  handler.__init__ = __init__
  handler.save_checkpoint_if_preempted = save_checkpoint_if_preempted
  handler.run = run
  handler._start_watching_for_signal = _start_watching_for_signal  # pylint: disable=protected-access
  handler._check_preemption_and_maybe_checkpoint = (  # pylint: disable=protected-access
      _check_preemption_and_maybe_checkpoint)
  handler.__del__ = __del__


# ---------------------------------------------------------------------------
# keras.callbacks.BackupAndRestore

# Added to BackupAndRestore's training_metadata.json: how many batches of
# "epoch" the saved weights have seen (Keras' own "batch" is ambiguous: 0
# after an epoch and after the first batch).
_BATCHES_DONE = "mpistrategy_batches_done"


def _skip_batches(model, count):
  """Makes the next `count` training steps only draw their batch.

  Keras 3 resumes a backup at the start of its epoch; this skips the
  batches that the saved weights have already seen, so that the resumed
  run trains exactly the batches the interrupted one had left.
  """
  original = model.train_function
  state = {"left": count}

  def skip_then_train(iterator):
    if state["left"] <= 0:
      return original(iterator)
    next(iterator)  # the batch the interrupted run trained already
    state["left"] -= 1
    if state["left"] == 0:
      model.train_function = original
    return {}

  model.train_function = skip_then_train


def _fit_step(model, batch, epoch):
  """"12 (batch 4 of epoch 2)": optimizer steps, then Keras' 1-based count."""
  where = f"batch {batch + 1} of epoch {epoch + 1}"
  optimizer = getattr(model, "optimizer", None)
  if optimizer is None:
    return where
  return f"{int(optimizer.iterations.numpy())} ({where})"


def patch_backup_and_restore():
  """BackupAndRestore: preemption-aware, and resumes at the saved batch.

  During `fit` the preemption signal is watched; at each batch end the
  ranks `agree`, and when one was signalled every rank saves the backup
  (weights after this batch) and exits with `EXIT_CODE`.  The backup
  records the batches done in its epoch; on resume, those batches are
  drawn but not trained again (Keras itself restarts the epoch), when
  `steps_per_execution` is 1.  Must be applied before `mpistrategy.
  checkpoint`'s patch of the same class, which wraps these methods.
  """
  from mpistrategy import _tf_private as _tfp  # pylint: disable=g-import-not-at-top
  bar = _tfp.keras_backup_and_restore.BackupAndRestore
  file_utils = _tfp.keras_file_utils
  orig_begin, orig_load = bar.on_train_begin, bar._load_model  # pylint: disable=protected-access
  orig_save, orig_end = bar._save_model, bar.on_train_end  # pylint: disable=protected-access
  orig_epoch_end, orig_batch_end = bar.on_epoch_end, bar.on_train_batch_end

  def _load_model(self):
    orig_load(self)
    self._mpistrategy_resume_batches = 0  # pylint: disable=protected-access
    path = self._training_metadata_path  # pylint: disable=protected-access
    if file_utils.exists(path):
      with file_utils.File(path, "r") as f:
        meta = json.loads(f.read())
      self._mpistrategy_resume_batches = int(meta.get(_BATCHES_DONE, 0))  # pylint: disable=protected-access

  def on_train_begin(self, logs=None):
    self._mpistrategy_resume_batches = 0  # pylint: disable=protected-access
    orig_begin(self, logs)
    model = self.model
    # Keras leaves _current_epoch at 0 after a resume, so a save in the
    # first resumed epoch would record epoch 0.
    self._current_epoch = model._initial_epoch or 0  # pylint: disable=protected-access
    self._mpistrategy_done = 0  # pylint: disable=protected-access
    self._mpistrategy_steps = 0  # pylint: disable=protected-access
    skip = self._mpistrategy_resume_batches  # pylint: disable=protected-access
    steps = (self.params or {}).get("steps")
    if skip > 0 and steps and skip >= steps:
      # Saved after the epoch's last batch, before its end: resume at the
      # next epoch (skipping every batch would end this one with no logs).
      model._initial_epoch = (model._initial_epoch or 0) + 1  # pylint: disable=protected-access
      self._current_epoch = model._initial_epoch  # pylint: disable=protected-access
      skip = 0
    if skip > 0:
      if getattr(model, "steps_per_execution", 1) == 1:
        _skip_batches(model, skip)
        self._mpistrategy_done = skip  # pylint: disable=protected-access
        self._last_batch_seen = skip - 1  # pylint: disable=protected-access
      elif _rank() == 0:
        _say("BackupAndRestore: steps_per_execution > 1, so the resumed "
             "epoch starts at its first batch (as Keras does)")
    self._mpistrategy_watching = watch()  # pylint: disable=protected-access
    if self._mpistrategy_watching:  # pylint: disable=protected-access
      _FIT_WATCHERS.add(self)

  def _save_model(self):
    orig_save(self)
    # Under mpistrategy.checkpoint's patch this is still the temporary file,
    # renamed over the user's afterwards.
    path = self._training_metadata_path  # pylint: disable=protected-access
    with file_utils.File(path, "r") as f:
      meta = json.loads(f.read())
    meta[_BATCHES_DONE] = getattr(self, "_mpistrategy_done", 0)
    with file_utils.File(path, "w") as f:
      f.write(json.dumps(meta))

  def on_train_batch_end(self, batch, logs=None):
    done = getattr(self, "_mpistrategy_done", 0)
    if batch < done:  # a skipped batch (see _skip_batches)
      return None
    self._mpistrategy_done = batch + 1  # pylint: disable=protected-access
    self._mpistrategy_steps = getattr(self, "_mpistrategy_steps", 0) + 1  # pylint: disable=protected-access
    result = orig_batch_end(self, batch, logs)
    if getattr(self, "_mpistrategy_watching", False) and agree(
        self._mpistrategy_steps):  # pylint: disable=protected-access
      self._last_batch_seen = batch  # pylint: disable=protected-access
      self._save_model()  # pylint: disable=protected-access
      acted_on()
      self._stop_watching()
      exit_preempted(_fit_step(self.model, batch, self._current_epoch))  # pylint: disable=protected-access
    return result

  def on_epoch_end(self, epoch, logs=None):
    self._mpistrategy_done = 0  # pylint: disable=protected-access
    return orig_epoch_end(self, epoch, logs)

  def _stop_watching(self):
    _FIT_WATCHERS.discard(self)
    if getattr(self, "_mpistrategy_watching", False):
      self._mpistrategy_watching = False  # pylint: disable=protected-access
      unwatch()

  def on_train_end(self, logs=None):
    self._stop_watching()
    return orig_end(self, logs)

  bar._load_model, bar.on_train_begin = _load_model, on_train_begin  # pylint: disable=protected-access
  bar._save_model, bar.on_train_end = _save_model, on_train_end  # pylint: disable=protected-access
  bar.on_train_batch_end, bar.on_epoch_end = on_train_batch_end, on_epoch_end
  bar._stop_watching = _stop_watching  # pylint: disable=protected-access
