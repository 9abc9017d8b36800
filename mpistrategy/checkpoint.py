"""Checkpointing with the same user code as a single process.

`MPIStrategy.__init__` calls `install()`.  In a multi-process run (world size
> 1) it patches, once per process:

* **Writes** -- `tf.train.Checkpoint.write/save` (`Checkpoint._write`), Keras
  `ModelCheckpoint`, `BackupAndRestore`, `Model.save`, `Model.save_weights`,
  `Model.export` and `keras.saving.save_model`, and
  `tf.train.CheckpointManager` (not `tf.saved_model.save`):
  every rank runs the same save code (saving may read `SyncOnRead` variables,
  which is a collective, so a rank that skipped saving would leave the others
  hanging), but only rank 0 writes the path the user gave.  Ranks > 0 write
  to a private scratch mirror of that path, `<scratch>/rank<r>/<abs path>`,
  where `<scratch>` is a per-process temporary directory removed at exit.
  Return values (e.g. the path returned by `Checkpoint.save`) are the user's
  path on every rank.
* **Reads** -- `tf.train.Checkpoint.read/restore`, `BackupAndRestore`'s
  resume and `CheckpointManager.restore_or_initialize`: rank 0 decides what to
  read (its `save_path`, whether a backup exists) and broadcasts the bytes of
  the files, which ranks > 0 put in their scratch mirror and read from there.
  Every rank therefore restores rank 0's state and takes the same branch, and
  no shared file system is needed.  (Files travel through
  `mpistrategy.ops.broadcast`; they must fit in memory.)  Reads are
  therefore collective: every rank must call them, also in code that
  saves on rank 0 only.  A `CheckpointManager` on ranks > 0 starts from
  rank 0's state file when it can read it (same host or shared file
  system), so `latest_checkpoint` and `checkpoints` agree with rank 0's.

A killed and restarted job resumes from rank 0's `BackupAndRestore` backup on
every rank, at the same epoch, with identical weights.

Paths the user reads directly (`model.load_weights(path)`,
`keras.models.load_model(path)`) are read by each rank from its own file
system, as in single-process code; with several hosts the path must be on a
shared file system, and a rank that reads what rank 0 just saved must wait
for it (`mpistrategy.ops.barrier()`).  Code that saves on rank 0 only
(Horovod style) keeps working: the patched writes communicate nothing.
"""

import atexit
import contextlib
import os
import shutil
import tempfile

import numpy as np
import tensorflow as tf

from mpistrategy import _tf_private as _tfp

_STATE = {"rank": 0, "size": 1, "scratch": None, "installed": set()}


def _active():
  return _STATE["size"] > 1


def _is_chief():
  return _STATE["rank"] == 0


def _scratch_root():
  if _STATE["scratch"] is None:
    root = tempfile.mkdtemp(prefix="mpistrategy-rank%d-" % _STATE["rank"])
    atexit.register(shutil.rmtree, root, True)
    _STATE["scratch"] = root
  return _STATE["scratch"]


def mirror_path(path):
  """Where this rank writes/reads `path`: `path` itself on rank 0.

  Args:
    path: a file or directory path (may contain `{}` format fields).

  Returns:
    `path` on rank 0 or in a single process, else the path's mirror inside
    this rank's scratch directory.
  """
  path = os.fspath(path)
  if not _active() or _is_chief():
    return path
  root = _scratch_root()
  if path == root or path.startswith(root + os.sep):
    return path  # already a mirror (e.g. a CheckpointManager's directory)
  if "://" in path:  # gs://bucket/x -> <scratch>/gs/bucket/x
    scheme, rest = path.split("://", 1)
    rel = os.path.join(scheme, rest)
  else:
    rel = os.path.abspath(path).lstrip(os.sep)
  return os.path.join(root, rel)


def _mirror_path_tensor(path):
  """`mirror_path` for a string tensor (ranks > 0, local paths only)."""
  root = _scratch_root()
  absolute = tf.where(tf.strings.regex_full_match(path, "/.*"), path,
                      tf.strings.join([os.getcwd(), os.sep, path]))
  return tf.strings.join([root, absolute])


def _unmirror(path):
  if path is None or not _active() or _is_chief():
    return path
  root = _scratch_root()
  if isinstance(path, bytes):
    path = path.decode()
  if path.startswith(root + os.sep):
    return os.sep + path[len(root) + 1:]
  return path


# ------------------------------------------------------------ broadcasting


def _bcast_bytes(data):
  """Broadcasts `bytes` (or `None`) from rank 0; returns it on every rank."""
  from mpistrategy import ops  # pylint: disable=g-import-not-at-top
  with tf.init_scope(), tf.name_scope("MPICheckpointFiles"):
    n = -1 if data is None else len(data)
    # Named, so that a rank that skipped a collective read shows up as
    # "MPICheckpointFiles/..." in the stall warnings.
    n = int(ops.broadcast(tf.constant(n, tf.int64), root_rank=0,
                          name="MPICheckpointFiles/size").numpy())
    if n < 0:
      return None
    buf = (np.frombuffer(data, np.uint8) if _is_chief() else
           np.zeros([n], np.uint8))
    out = ops.broadcast(tf.constant(buf), root_rank=0,
                        name="MPICheckpointFiles/bytes").numpy()
  return out.tobytes()


def _bcast_str(s):
  out = _bcast_bytes(None if s is None else os.fspath(s).encode())
  return None if out is None else out.decode()


def _read(path):
  if not tf.io.gfile.exists(path) or tf.io.gfile.isdir(path):
    return None
  with tf.io.gfile.GFile(path, "rb") as f:
    return f.read()


def _sync_files(paths):
  """Rank 0's files at `paths` appear at `mirror_path(p)` on other ranks.

  Missing on rank 0 means removed from the mirror.  Collective: every rank
  must call it with the same number of paths.
  """
  for p in paths:
    data = _bcast_bytes(_read(p) if _is_chief() else None)
    if _is_chief():
      continue
    local = mirror_path(p)
    if data is None:
      if tf.io.gfile.exists(local) and not tf.io.gfile.isdir(local):
        tf.io.gfile.remove(local)
      continue
    tf.io.gfile.makedirs(os.path.dirname(local))
    with tf.io.gfile.GFile(local, "wb") as f:
      f.write(data)


def _sync_prefix(prefix):
  """Broadcasts every file of the TF checkpoint `prefix` (rank 0's view)."""
  names = []
  if _is_chief():
    names = sorted(os.path.basename(p)
                   for p in tf.io.gfile.glob(prefix + ".*"))
  names = _bcast_str("\n".join(names)).split("\n")
  names = [n for n in names if n]
  directory = os.path.dirname(prefix)
  _sync_files([os.path.join(directory, n) for n in names])


# ----------------------------------------------------------- tf.train.*


def _copy_state_file(directory, mirror):
  """Copies `directory`'s "checkpoint" state file into `mirror`, if any."""
  source = os.path.join(directory, "checkpoint")
  if not tf.io.gfile.exists(source):
    return
  tf.io.gfile.makedirs(mirror)
  tf.io.gfile.copy(source, os.path.join(mirror, "checkpoint"), overwrite=True)


def _patch_tf_checkpoint():
  cls = _tfp.tf_checkpoint.Checkpoint
  orig_write, orig_read = cls._write, cls.read  # pylint: disable=protected-access

  def _write(self, file_prefix, options=None):
    if not _active() or _is_chief():
      return orig_write(self, file_prefix, options)
    if isinstance(file_prefix, tf.Tensor):  # e.g. an argument of a tf.function
      local = _mirror_path_tensor(file_prefix)
    else:
      local = _mirror_for_write(file_prefix)
    written = orig_write(self, local, options)
    if isinstance(written, tf.Tensor):  # written inside a tf.function
      with tf.control_dependencies([written]):
        return tf.identity(tf.convert_to_tensor(file_prefix, tf.string))
    if isinstance(written, bytes):
      written = written.decode()
    if isinstance(written, str) and written.startswith(local):
      # The user's spelling (relative, gs://...), as rank 0 returns it.
      return os.fspath(file_prefix) + written[len(local):]
    return _unmirror(written)

  def read(self, save_path, options=None):
    if not _active():
      return orig_read(self, save_path, options)
    # Rank 0 decides the path; its files are what every rank restores.
    save_path = _bcast_str(save_path)
    if save_path is None:
      return orig_read(self, None, options)
    _sync_prefix(save_path)
    return orig_read(self, mirror_path(save_path), options)

  _write.__doc__, read.__doc__ = orig_write.__doc__, orig_read.__doc__
  cls._write, cls.read = _write, read  # pylint: disable=protected-access

  mgr = _tfp.checkpoint_management.CheckpointManager
  orig_init, orig_roi = mgr.__init__, mgr.restore_or_initialize

  def __init__(self, checkpoint, directory, *args, **kwargs):
    # Ranks > 0 keep their manager (state file, numbering, deletion of old
    # checkpoints) entirely inside their scratch mirror, starting from rank
    # 0's state file where they can read it (same host or shared file
    # system), so that `latest_checkpoint` and `checkpoints` agree with rank
    # 0's and code like `if manager.latest_checkpoint: restore(...)` takes
    # the same branch everywhere.  Nothing is communicated: managers made on
    # rank 0 only keep working.
    mirror = mirror_path(directory)
    if mirror != os.fspath(directory):
      _copy_state_file(os.fspath(directory), mirror)
    orig_init(self, checkpoint, mirror, *args, **kwargs)

  def restore_or_initialize(self):
    if not _active():
      return orig_roi(self)
    # Rank 0's latest checkpoint decides the branch on every rank.
    latest = _bcast_str(_unmirror(self._latest_checkpoint))  # pylint: disable=protected-access
    if latest is None:
      if self._init_fn is not None:  # pylint: disable=protected-access
        self._init_fn()  # pylint: disable=protected-access
      return None
    self._checkpoint.restore(latest)  # pylint: disable=protected-access
    if self._checkpoint_interval is not None:  # pylint: disable=protected-access
      # As TF's version: the interval counts from the restored step.
      self._last_checkpoint_step = _tfp.checkpoint_management._evaluate(  # pylint: disable=protected-access
          self._step_counter)  # pylint: disable=protected-access
    return latest

  __init__.__doc__ = orig_init.__doc__
  restore_or_initialize.__doc__ = orig_roi.__doc__
  mgr.__init__, mgr.restore_or_initialize = __init__, restore_or_initialize


# ---------------------------------------------------------------- Keras


_BAR_ATTRS = ("backup_dir", "_weights_path", "_training_metadata_path",
              "_prev_weights_path", "_prev_training_metadata_path")


@contextlib.contextmanager
def _swapped(obj, attrs):
  saved = {a: getattr(obj, a) for a in attrs}
  try:
    for a in attrs:
      setattr(obj, a, mirror_path(saved[a]))
    yield
  finally:
    for a, v in saved.items():
      setattr(obj, a, v)


def _patch_keras_callbacks():
  from keras.src.callbacks import backup_and_restore  # pylint: disable=g-import-not-at-top
  from keras.src.callbacks import model_checkpoint  # pylint: disable=g-import-not-at-top

  bar = backup_and_restore.BackupAndRestore
  orig_begin, orig_save, orig_end = (bar.on_train_begin, bar._save_model,  # pylint: disable=protected-access
                                     bar.on_train_end)

  def _call(fn, self, *args):
    if not _active() or _is_chief():
      return fn(self, *args)
    with _swapped(self, _BAR_ATTRS):
      return fn(self, *args)

  def on_train_begin(self, logs=None):
    if _active():
      # Every rank resumes from rank 0's backup (same epoch, same weights).
      _sync_files([getattr(self, a) for a in _BAR_ATTRS[1:]])
    return _call(orig_begin, self, logs)

  def _save_model(self):
    return _call(orig_save, self)

  def on_train_end(self, logs=None):
    return _call(orig_end, self, logs)

  bar.on_train_begin, bar._save_model, bar.on_train_end = (  # pylint: disable=protected-access
      on_train_begin, _save_model, on_train_end)

  mc = model_checkpoint.ModelCheckpoint
  orig_mc_save = mc._save_model  # pylint: disable=protected-access

  def mc_save_model(self, epoch, batch, logs):
    if not _active() or _is_chief():
      return orig_mc_save(self, epoch, batch, logs)
    with _swapped(self, ("filepath",)):
      return orig_mc_save(self, epoch, batch, logs)

  mc._save_model = mc_save_model  # pylint: disable=protected-access


def _mirror_for_write(path):
  """`mirror_path(path)` with its parent directory made, for paths only."""
  if not _active() or _is_chief() or not isinstance(path, (str, os.PathLike)):
    return path
  mirrored = mirror_path(path)
  tf.io.gfile.makedirs(os.path.dirname(mirrored))
  return mirrored


def _patch_keras_model_saving():
  from keras.src.models import model as model_lib  # pylint: disable=g-import-not-at-top
  cls = model_lib.Model
  orig_save, orig_save_weights = cls.save, cls.save_weights

  def save(self, filepath, *args, **kwargs):
    return orig_save(self, _mirror_for_write(filepath), *args, **kwargs)

  def save_weights(self, filepath, *args, **kwargs):
    return orig_save_weights(self, _mirror_for_write(filepath), *args,
                             **kwargs)

  save.__doc__, save_weights.__doc__ = orig_save.__doc__, orig_save_weights.__doc__
  cls.save, cls.save_weights = save, save_weights

  orig_export = cls.export

  def export(self, filepath, *args, **kwargs):
    return orig_export(self, _mirror_for_write(filepath), *args, **kwargs)

  export.__doc__ = orig_export.__doc__
  cls.export = export

  # The function form, under each public name it has.
  import keras  # pylint: disable=g-import-not-at-top
  from keras.src.saving import saving_api  # pylint: disable=g-import-not-at-top
  orig_save_model = saving_api.save_model

  def save_model(model, filepath, *args, **kwargs):
    return orig_save_model(model, _mirror_for_write(filepath), *args, **kwargs)

  save_model.__doc__ = orig_save_model.__doc__
  for module in (saving_api, keras.saving, keras.models):
    if getattr(module, "save_model", None) is orig_save_model:
      module.save_model = save_model


def install(rank, size):
  """Records the MPI world and applies the patches once (idempotent).

  Args:
    rank: this process' MPI rank.
    size: the MPI world size; with 1 nothing is patched.
  """
  _STATE["rank"], _STATE["size"] = rank, max(_STATE["size"], size)
  if size <= 1:
    return
  if "tf" not in _STATE["installed"]:
    _patch_tf_checkpoint()
    _STATE["installed"].add("tf")
  if "keras" not in _STATE["installed"]:
    _patch_keras_callbacks()
    _patch_keras_model_saving()
    _STATE["installed"].add("keras")
