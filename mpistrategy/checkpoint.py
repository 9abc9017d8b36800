"""Checkpointing with the same user code as a single process.

`mpistrategy.compat.install()` (called by `MPIStrategy.__init__`) applies the
patches of this module once per process, in a multi-process run (world size
> 1) only:

* **Writes** -- `tf.train.Checkpoint.write/save` (`Checkpoint._write`),
  `tf.train.CheckpointManager`, `tf.saved_model.save` (TF's
  `save_and_return_nodes`, which `Model.export` also reaches), Keras
  `ModelCheckpoint`, `BackupAndRestore`, `Model.save`, `Model.save_weights`,
  `Model.export` and `keras.saving.save_model`.  Every rank runs the same
  save code (saving may read `SyncOnRead` variables, which is a collective,
  so a rank that skipped saving would leave the others hanging), but only
  rank 0 writes the path the user gave.  Ranks > 0 write to a private
  scratch mirror of that path, `<scratch>/<abs path>`, where `<scratch>`
  is a per-process temporary directory (`$TMPDIR/mpistrategy-rank<r>-*`)
  removed at exit, and
  make the directory a `CheckpointManager` was given (so code that deletes
  a non-chief worker's own directory, as the TF tutorials do, works).
  Return values (the path returned by `Checkpoint.save`, `CheckpointManager`
  paths) are the user's path on every rank.
  The Keras saves and `tf.saved_model.save` of an object that holds
  nothing made under a multi-process MPIStrategy (a model built outside
  the strategy, a module of plain variables) are each rank's own: every
  rank that saves one writes the user's path, atomically, as rank 0 does.
* **Atomic writes on rank 0** -- every write above goes to a temporary name
  in the same directory (`.mpistrategy-tmp-<pid>-<host>-<hex>-<name>`; a
  later save into the directory removes those of killed writers on this
  host), is fsynced, and
  then replaces the user's file with a rename; a directory (SavedModel) is
  swapped in with `renameat2(RENAME_EXCHANGE)`.  Keras files (`.keras`,
  `.weights.h5`) are first written into this process' scratch directory
  and copied: h5py cannot fail cleanly on a full disk.  At every instant the
  previous file or directory, or the new complete one, is under the user's
  name; a failed write (e.g. ENOSPC) removes its temporary files and leaves
  the previous copy as it was.  (`Checkpoint.write` to a fixed prefix
  renames the data shards and then the index: between those two renames
  the pair is inconsistent; `Checkpoint.save` and `CheckpointManager` write
  new prefixes and switch with the atomic `checkpoint` state file.)
* **Reads into the strategy's variables are collective** --
  `tf.train.Checkpoint.read/restore`, `Model.load_weights` of a model
  built under the strategy, `BackupAndRestore`'s resume and
  `CheckpointManager.restore_or_initialize`: rank 0 decides what to read
  (its `save_path`, whether a backup exists) and broadcasts the bytes of
  the files, which ranks > 0 put in their scratch mirror and read from
  there.  Every rank therefore restores rank 0's state and takes the same
  branch, and no shared file system is needed.  (Files travel through
  `mpistrategy.ops.broadcast`; they must fit in memory.)  Every rank must
  make such a call.  One made on some ranks only (the Horovod habit
  `if rank == 0: checkpoint.restore(...)`) never hangs: each read starts
  with a *blocking join* (cc/engine/negotiator.h).  When the ranks that
  skipped it wait in another collective (the script's
  `hvd.broadcast_variables`, the next training step's allreduce, a
  barrier), the engine sees the two sides crossed and, about a second
  later, fails the read with `FailedPreconditionError` naming the call, the
  ranks that did not make it and the collective they wait in, and saying
  what to do (make the call on every rank); their collective fails with an
  error naming the checkpoint read.  When they are in no collective
  (computing, or idle in Python), the read fails after
  `Options.checkpoint_read_timeout_seconds` (default 120) with
  `DeadlineExceededError` saying the same.  (Rank-0-only restore followed
  by a broadcast is not made to work: a broadcast of some variables cannot
  be known to cover everything the read restored, e.g. optimizer slots, so
  ranks could silently differ.)
* **Other reads are local** -- `keras.models.load_model`,
  `tf.saved_model.load`, `tf.train.latest_checkpoint` and `load_weights`
  of a model outside the strategy read this rank's file system, as in
  single-process code (so evaluating on rank 0 only works).  On ranks > 0
  they read this rank's own scratch copy of a path it saved itself, while
  the directory the user named for it exists: a rank reads back what it
  has just saved, per-rank path or shared path, and never a file rank 0
  is still writing.

A killed and restarted job resumes from rank 0's `BackupAndRestore` backup on
every rank, at the same epoch, with identical weights.  Code that saves on
rank 0 only (Horovod style) keeps working: the patched writes communicate
nothing.
"""

import atexit
import contextlib
import copy
import ctypes
import errno
import fcntl
import functools
import glob
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import threading
import time
import uuid

import numpy as np
import tensorflow as tf

from mpistrategy import _tf_private as _tfp

# "rule": "chief" under MPIStrategy (rank 0 writes the user's paths, ranks
# > 0 scratch copies, reads are collective); "own" under the Horovod layer
# alone (every rank writes what it saves itself, reads are its own).
_STATE = {"rank": 0, "size": 1, "rule": "chief", "scratch": None,
          "scratch_lock": None}
_SCRATCH_PREFIX = "mpistrategy-rank"
_OWNER_FILE = ".owner"
# Per thread: nesting depth of patched writes (only the outermost one
# redirects or makes the write atomic), and whether reads are local.
_LOCAL = threading.local()
_TMP_TAG = ".mpistrategy-tmp-"
_DEFAULT_READ_TIMEOUT = 120.0  # Options.checkpoint_read_timeout_seconds


def _active():
  return _STATE["size"] > 1


def _is_chief():
  """True where this rank writes the paths the user gives itself.

  Rank 0 under MPIStrategy; every rank under the Horovod layer alone.
  """
  return _STATE["rank"] == 0 or _STATE["rule"] == "own"


def _collective_reads():
  """True where reads of saved state take rank 0's files on every rank."""
  return _active() and _STATE["rule"] == "chief"


def _on_chief_host():
  """True if rank 0 runs on this host, so both see the same directories.

  False where that is unknown (the engine is not running); the caller then
  assumes separate file systems, as between hosts.
  """
  if "on_chief_host" not in _STATE:
    from mpistrategy import runtime  # pylint: disable=g-import-not-at-top
    if not runtime.is_initialized():
      return False
    try:
      hosts = runtime.rank_hosts()
    except tf.errors.OpError:
      return False
    _STATE["on_chief_host"] = hosts[0] == hosts[_STATE["rank"]]
  return _STATE["on_chief_host"]


def _scratch_root():
  """This process' scratch directory, made (and older ones swept) on first use.

  `$TMPDIR/mpistrategy-rank<r>-*/` holds ranks > 0's copies of what they
  save and rank 0's staged h5 writes.  It is removed at exit and before an
  uncaught exception ends the job (`remove_scratch`).  A rank killed
  outright leaves it behind, so the first rank on this host that makes a
  scratch directory later removes those whose process is gone.

  Returns:
    The directory's path.
  """
  if _STATE["scratch"] is None:
    _remove_abandoned_scratch(tempfile.gettempdir())
    root = tempfile.mkdtemp(prefix="%s%d-" % (_SCRATCH_PREFIX, _STATE["rank"]))
    _STATE["scratch_lock"] = _hold_owner_lock(root)
    _STATE["scratch"] = root
  return _STATE["scratch"]


def remove_scratch():
  """Removes this process' scratch directory, if it made one.

  Called at exit, and by the runtime before an uncaught exception ends the
  job (MPI_Abort skips `atexit`).
  """
  root, lock = _STATE["scratch"], _STATE["scratch_lock"]
  _STATE["scratch"], _STATE["scratch_lock"] = None, None
  if root is not None:
    shutil.rmtree(root, ignore_errors=True)
  if lock is not None:
    os.close(lock)


atexit.register(remove_scratch)


def _hold_owner_lock(root):
  """Locks `root`'s owner file for as long as this process lives.

  The kernel drops the lock when the process dies however it dies, which is
  how `_remove_abandoned_scratch` tells an abandoned directory from a live
  one.  The file gets its final name only once locked, so a directory whose
  owner file exists but is not locked is never one still being set up.

  Args:
    root: the new scratch directory.

  Returns:
    The open, locked file descriptor (closed by `remove_scratch`).
  """
  fd, locking = tempfile.mkstemp(dir=root, prefix=".owner-")
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(locking, os.path.join(root, _OWNER_FILE))
  except BaseException:
    os.close(fd)
    raise
  return fd


def _remove_abandoned_scratch(directory):
  """Removes scratch directories in `directory` whose process is gone.

  Only this user's directories with an owner file that nobody holds
  locked: those of older versions (no owner file) and of live processes
  stay.

  Args:
    directory: where scratch directories are made (`tempfile.gettempdir()`).
  """
  uid = os.getuid()
  for path in glob.glob(os.path.join(glob.escape(directory),
                                     _SCRATCH_PREFIX + "*")):
    try:
      info = os.lstat(path)
      if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
        continue
      fd = os.open(os.path.join(path, _OWNER_FILE),
                   os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
      continue
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      os.close(fd)  # its process still runs
      continue
    try:
      shutil.rmtree(path, ignore_errors=True)
    finally:
      os.close(fd)


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
  if _is_mirror(path):
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


def _is_path(path):
  return isinstance(path, (str, os.PathLike))


def _is_local(path):
  return _is_path(path) and "://" not in os.fspath(path)


def _read_path(path):
  """The path a local read of the user's `path` opens on this rank.

  Ranks > 0 read their own scratch copy of a path they saved themselves
  (it is complete, unlike a file rank 0 may be replacing, and it exists
  also when each rank saved to a path of its own), as long as the
  directory the user named for it still exists (after the user deleted
  that directory, the read fails as it would in one process) and the path
  itself was not written or moved in after that copy was begun (rank 0
  saved it again alone, or put another file there: every rank reads what
  is on disk, as in one process).

  Args:
    path: the path the user passed to a loader.

  Returns:
    `path`, or its mirror.
  """
  if not _active() or _is_chief() or not _is_local(path):
    return path
  mirrored = mirror_path(path)
  parent = os.path.dirname(os.path.abspath(os.fspath(path)))
  if (mirrored != os.fspath(path) and os.path.lexists(mirrored) and
      os.path.isdir(parent) and not _newer(path, mirrored)):
    return mirrored
  return path


def _date_copy(mirrored, start_ns):
  """Dates this rank's copy `mirrored` to when its write began.

  Rank 0 writes the same data at about that time, and `_read_path` reads
  the file on disk only where rank 0 wrote it after that: a save of its
  own, later, rather than the same save finishing after this one began.
  """
  try:
    os.utime(mirrored, ns=(start_ns, start_ns), follow_symlinks=False)
  except (OSError, NotImplementedError):
    pass  # no copy (a writer that made other names), or no such support


def _check_no_file_above(directory):
  """NotADirectoryError where `directory` or an ancestor is not one.

  Rank 0's write fails there (no directory can be made under a file);
  a rank > 0 on its host must not succeed in its private copy instead.
  """
  while not os.path.lexists(directory):
    parent = os.path.dirname(directory)
    if parent == directory:
      return
    directory = parent
  if not os.path.isdir(directory):
    raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR),
                             directory)


def _newer(path, than):
  """True if `path` exists and was modified or put there after `than`.

  A file moved into place keeps its old modification time (`os.replace`,
  `shutil.copy2`); its change time is the move's.
  """
  try:
    status = os.stat(path)
    return (max(status.st_mtime_ns, status.st_ctime_ns) >
            os.stat(than).st_mtime_ns)
  except OSError:
    return False


def _mirror_for_write(path, fresh=False):
  """`mirror_path(path)`, ready for a write as rank 0 would do it.

  Args:
    path: the user's path (anything else is returned as it is).
    fresh: remove an earlier copy first (rank 0 writes a new temporary
      file or directory and moves it into place).

  Returns:
    The path to write.
  """
  if not _active() or _is_chief() or not _is_path(path):
    return path
  mirrored = mirror_path(path)
  mirror_parent = os.path.dirname(mirrored)
  if _is_local(path) and _on_chief_host():
    # Rank 0 writes through links, into the same directories.
    user_parent = os.path.dirname(os.path.realpath(os.fspath(path)))
    _check_no_file_above(user_parent)
  else:
    user_parent = None
  if user_parent is not None and not os.path.isdir(user_parent):
    # Rank 0 sees no such directory either: its writer fails (Keras) or
    # makes it (SavedModel), and this rank's writer must do the same.
    # Copies under it are of a deleted directory.
    _remove_quietly(mirror_parent)
  else:
    tf.io.gfile.makedirs(mirror_parent)
  if fresh and os.path.isdir(mirrored) and not os.path.islink(mirrored):
    shutil.rmtree(mirrored)
  return mirrored


@contextlib.contextmanager
def _naming_user_path(path, written):
  """Makes an error of a write of `written` for the user's `path` name `path`.

  Ranks > 0 write a scratch mirror and rank 0 a temporary sibling or a
  staged copy; an error naming those (Keras' "Invalid filepath extension",
  a missing directory) would point the user at a file they never named.

  Args:
    path: the path the user gave.
    written: the path this rank actually writes (a string tensor, inside a
      `tf.function`, is left alone).

  Yields:
    Nothing; an exception raised inside is edited in place and re-raised.
  """
  try:
    yield
  except Exception as error:  # pylint: disable=broad-except
    if _is_path(written) and _is_path(path):
      _rename_in_error(error, os.fspath(written), os.fspath(path))
    raise


@contextlib.contextmanager
def _messages_naming(path, written):
  """Makes Keras' messages during a write of `written` name `path`.

  `Model.export` and `ModelCheckpoint(verbose=1)` print the path they
  write ("Saved artifact at ..."); the user named another one.

  Args:
    path: the path the user gave (None: only this rank's mirrors are named
      as the user's paths).
    written: the path this rank actually writes, or None.

  Yields:
    Nothing.
  """
  io_utils = _tfp.keras_io_utils
  orig_print_msg = io_utils.print_msg

  def print_msg(message, *args, **kwargs):
    if isinstance(message, str):
      message = _rename_in_text(message, written, path)
    return orig_print_msg(message, *args, **kwargs)

  io_utils.print_msg = print_msg
  try:
    yield
  finally:
    io_utils.print_msg = orig_print_msg


def _rename_in_text(text, written, path):
  """`text` with `written` (and this rank's scratch prefix) read as `path`."""
  if _is_path(written) and _is_path(path):
    if os.fspath(written) == os.fspath(path):
      return text
    text = text.replace(os.fspath(written), os.fspath(path))
  root = _STATE["scratch"]
  if root is not None and not _is_chief():
    # A mirror is <root>/<absolute path>: derived names (its directory,
    # a suffixed file) read as the user's absolute path.
    text = text.replace(root + os.sep, os.sep)
  return text


def _rename_in_error(error, written, path):
  """Replaces `written` (and this rank's scratch prefix) in `error`'s text."""
  if written == path:
    return

  def fix(value):
    if not isinstance(value, str):
      return value
    return _rename_in_text(value, written, path)

  try:
    error.args = tuple(fix(a) for a in error.args)
    if isinstance(error, OSError):
      # str() shows strerror and the file names, not args; a file name set
      # to None would read ": None" or "-> None".
      error.strerror = fix(error.strerror)
      if error.filename is not None:
        error.filename = fix(error.filename)
      if error.filename2 is not None:
        error.filename2 = fix(error.filename2)
    if isinstance(error, tf.errors.OpError):
      error._message = fix(error._message)  # pylint: disable=protected-access
  except (AttributeError, TypeError):
    pass  # an exception type whose text cannot be edited keeps it


# ------------------------------------------------------ atomic writes


def _temp_sibling(path, like=None):
  """A fresh name next to `path` that ends like it (Keras checks suffixes).

  Args:
    path: the path to write.
    like: the name to end like instead (the user's, where `path` is a
      symbolic link's target).

  Returns:
    The new name.
  """
  directory, base = os.path.split(os.path.abspath(path))
  if like is not None:
    base = os.path.basename(os.path.abspath(like))
  _remove_abandoned_temps(directory)
  return os.path.join(directory, "%s%d-%s-%s-%s" % (
      _TMP_TAG, os.getpid(), _host_tag(), uuid.uuid4().hex[:8], base))


# A temporary name: the writer's pid, a tag of its host, a random part.
_TEMP_NAME = re.compile(re.escape(_TMP_TAG) +
                        r"(?P<pid>\d+)-(?P<host>[0-9a-f]{8})-[0-9a-f]{8}-")
_SWEPT = set()  # directories already swept by this process


def _host_tag():
  return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _remove_abandoned_temps(directory):
  """Removes temporary names in `directory` whose writer was killed.

  A process killed during a save (`kill -9`, the OOM killer) leaves its
  `.mpistrategy-tmp-*` file or directory next to the user's; later saves
  write other temporary names, so nothing else would remove it.  Only
  names of this host whose process is gone are removed, once per
  directory and process.

  Args:
    directory: the directory a save writes into.
  """
  if directory in _SWEPT:
    return
  _SWEPT.add(directory)
  try:
    names = os.listdir(directory)
  except OSError:
    return
  host = _host_tag()
  for name in names:
    match = _TEMP_NAME.match(name)
    if match is None or match.group("host") != host:
      continue
    pid = int(match.group("pid"))
    if pid == os.getpid():
      continue
    try:
      os.kill(pid, 0)
      continue  # alive (or a new process with its pid): keep
    except ProcessLookupError:
      pass
    except (PermissionError, OverflowError, ValueError):
      continue
    _remove_quietly(os.path.join(directory, name))


def _fsync(path, directory=False):
  try:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
  except OSError:
    if directory:
      return
    raise
  try:
    os.fsync(fd)
  except OSError as e:
    # Some file systems cannot fsync a directory; file data errors count.
    if not directory or e.errno not in (errno.EINVAL, errno.EBADF):
      raise
  finally:
    os.close(fd)


def _sync_tree(path):
  """fsyncs a file, or every file and directory under `path`."""
  if not os.path.isdir(path) or os.path.islink(path):
    _fsync(path)
    return
  for root, _, files in os.walk(path):
    for name in files:
      full = os.path.join(root, name)
      if not os.path.islink(full):
        _fsync(full)
    _fsync(root, directory=True)


def _remove_quietly(path):
  try:
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
      os.remove(path)
  except OSError:
    pass


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_RENAMEAT2 = []


def _exchange(a, b):
  """Atomically swaps paths `a` and `b`; False where the OS cannot."""
  if not _RENAMEAT2:
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is not None:
      fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                     ctypes.c_char_p, ctypes.c_uint]
      fn.restype = ctypes.c_int
    _RENAMEAT2.append(fn)
  fn = _RENAMEAT2[0]
  if fn is None:
    return False
  if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b),
        _RENAME_EXCHANGE) == 0:
    return True
  err = ctypes.get_errno()
  if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
    return False
  raise OSError(err, os.strerror(err), a, None, b)


def _check_same_kind(new, path, shown=None):
  """Raises as a plain write would where `new` and `path` differ in kind.

  A file is never put where a directory is, nor the reverse: a plain
  write fails there (`IsADirectoryError`, `NotADirectoryError`), and a
  replacement would delete the user's directory or file.

  Args:
    new: the complete file or directory written.
    path: what it would replace (may not exist).
    shown: the path to name in the error (default: `path`).

  Raises:
    IsADirectoryError: `new` is a file and `path` a directory.
    NotADirectoryError: `new` is a directory and `path` something else.
  """
  if not os.path.lexists(path):
    return
  shown = path if shown is None else shown
  new_is_dir = os.path.isdir(new) and not os.path.islink(new)
  old_is_dir = os.path.isdir(path)
  if not new_is_dir and old_is_dir:
    raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), shown)
  if new_is_dir and not old_is_dir:
    raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR),
                             shown)
  if new_is_dir:  # its entries replace those of `path` one by one
    for name in os.listdir(new):
      _check_same_kind(os.path.join(new, name), os.path.join(path, name),
                       os.path.join(shown, name))


def _move_into_place(tmp, path):
  """Makes the complete `tmp` appear as `path`, replacing what was there.

  The caller has checked that `tmp` and `path` are of the same kind, entries
  included (`_check_same_kind`).
  """
  parent = os.path.dirname(os.path.abspath(path))
  new_is_dir = os.path.isdir(tmp) and not os.path.islink(tmp)
  old_is_dir = os.path.isdir(path) and not os.path.islink(path)
  if not new_is_dir and not old_is_dir:
    if os.path.isfile(path):
      shutil.copymode(path, tmp)  # a private file stays private
    os.replace(tmp, path)  # atomic
  elif new_is_dir and old_is_dir:
    _replace_entries(tmp, path)
  else:
    # No atomic swap here: move the old one aside for the shortest time.
    old = None
    if os.path.lexists(path):
      old = _temp_sibling(path)
      os.rename(path, old)
    try:
      if old is None:
        _rename_to_new_name(tmp, path)
      else:
        os.rename(tmp, path)
    except BaseException:
      if old is not None:
        os.rename(old, path)
      raise
    if old is not None:
      _remove_quietly(old)
  _fsync(parent, directory=True)


def _rename_to_new_name(new, path):
  """Renames `new` to `path`, which did not exist a moment ago.

  Where another process made `path` a directory meanwhile (ranks saving
  the same object of their own, e.g. a model built outside the strategy,
  to one path), `new` replaces it entry by entry instead of failing.
  """
  try:
    os.rename(new, path)
  except OSError as error:
    if (error.errno not in (errno.ENOTEMPTY, errno.EEXIST) or
        not os.path.isdir(new) or not os.path.isdir(path)):
      raise
    _replace_entries(new, path)


def _replace_entries(tmp, path):
  """Moves the entries of the complete directory `tmp` into directory `path`.

  `path` itself stays: it may hold the user's other files, or be a
  process' working directory.  Each entry is replaced atomically, a
  SavedModel's index (`*.pb`, `*.pbtxt`) after its variables and assets;
  entries of `path` that `tmp` lacks stay, as a plain write leaves them.
  """
  names = sorted(os.listdir(tmp),
                 key=lambda n: (n.endswith((".pb", ".pbtxt")), n))
  for name in names:
    new, old = os.path.join(tmp, name), os.path.join(path, name)
    if not os.path.lexists(old):
      _rename_to_new_name(new, old)
    elif not _exchange(new, old):  # else the old entry is now in `tmp`
      _move_into_place(new, old)
  shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _outermost_write():
  depth = getattr(_LOCAL, "write_depth", 0)
  _LOCAL.write_depth = depth + 1
  try:
    yield depth == 0
  finally:
    _LOCAL.write_depth = depth


@contextlib.contextmanager
def _late_errors():
  """Collects errors reported from destructors during a write.

  h5py reports a failed write at file close (e.g. ENOSPC while flushing)
  from an object's destructor, through `sys.excepthook` or
  `sys.unraisablehook`, and the Keras call then returns as if it had
  succeeded, leaving a truncated file.  Such a write counts as failed:
  the caller raises an error for it, which the caller's caller may catch.
  The hooks the context replaces are not called (with `abort_on_exception`
  they would end the job, even where that error is caught).

  Yields:
    A list that receives those exceptions.
  """
  late = []
  hooks = sys.excepthook, sys.unraisablehook

  def excepthook(exc_type, exc, tb):
    del exc_type, tb
    late.append(exc)

  def unraisablehook(unraisable):
    late.append(unraisable.exc_value)

  sys.excepthook, sys.unraisablehook = excepthook, unraisablehook
  try:
    yield late
  finally:
    sys.excepthook, sys.unraisablehook = hooks


def _as_os_error(error):
  """`error` as an OSError with its errno, where its text names one."""
  match = re.search(r"errno = (\d+)", str(error))
  if match is None:
    return error
  code = int(match.group(1))
  return OSError(code, "%s (%s: %s)" % (os.strerror(code),
                                        type(error).__name__, error))


def _copy_tree(source, destination):
  if os.path.isdir(source) and not os.path.islink(source):
    shutil.copytree(source, destination, symlinks=True)
  else:
    shutil.copyfile(source, destination, follow_symlinks=False)


def _write_atomically(path, write, stage=False, shown=None):
  """Rank 0: `write(tmp)` next to `path`, then moves it into place.

  Args:
    path: the local path to write (file or directory), symbolic links
      resolved.
    write: callable taking the path to write; its result is returned.
    stage: write into this process' scratch directory first and copy the
      result next to `path`.  For h5py, which cannot fail cleanly when the
      destination fills up (it reports the error from a destructor and may
      then crash); the copy fails with an ordinary `OSError`.
    shown: the path the user gave, for errors, messages and the result
      (default: `path`).

  Returns:
    `write`'s result, with the temporary name replaced by `shown`.
  """
  path = os.fspath(path)
  shown = path if shown is None else os.fspath(shown)
  tmp = _temp_sibling(path, like=shown)
  staged = None
  if stage:
    staged = os.path.join(_scratch_root(), "stage-" + uuid.uuid4().hex[:12])
    os.makedirs(staged)
  target = tmp if staged is None else os.path.join(
      staged, os.path.basename(os.path.abspath(shown)))
  try:
    try:
      with (_late_errors() as late, _naming_user_path(shown, target),
            _messages_naming(shown, target)):
        result = write(target)
      if late:
        error = _as_os_error(late[0])
        if error is late[0]:
          raise error
        raise error from late[0]
    except (OSError, tf.errors.OpError) as error:
      if staged is not None:
        _raise_if_scratch_full(error, shown, staging=True)
      raise
    if os.path.lexists(target):
      _check_same_kind(target, path, shown)
      try:
        if staged is not None:
          _copy_tree(target, tmp)
        _sync_tree(tmp)
      except OSError as error:
        # Between two names of ours (the staged copy, the temporary
        # sibling): the user named neither.
        raise OSError(error.errno, error.strerror, shown) from None
      with _naming_user_path(shown, tmp):
        _move_into_place(tmp, path)
  except BaseException:
    _remove_quietly(tmp)
    raise
  finally:
    if staged is not None:
      _remove_quietly(staged)
  if isinstance(result, str) and result.startswith(target):
    result = shown + result[len(target):]
  return result


def _write_for_user(path, write, atomic=True, stage=False, saved=None,
                    unasked=None):
  """Runs the user's write of `path` the way this rank must do it.

  Rank 0 writes `path` itself, atomically where it can; ranks > 0 write
  their scratch mirror, unless `saved` holds none of the strategy's state
  (then each rank's object is its own, and every rank writes `path` as
  rank 0 does).  Nested patched writes (`Model.save` calls `save_model`,
  `Model.export` calls `tf.saved_model.save`) pass through.

  Where Keras asks whether to replace `path` (`overwrite=False`), rank 0
  asks on the job's stdin and, on a yes, writes atomically as always.
  Ranks > 0 have no stdin: they write their copy without asking and date
  it before any file rank 0 writes, so that their reads of `path`, once
  rank 0 has its answer, are of what rank 0 kept.

  Args:
    path: the path the user gave.
    write: callable taking the path to actually write.
    atomic: False where the write is several files named after `path`
      (sharded weights), which must go to `path` itself.
    stage: see `_write_atomically`.
    saved: the object saved, or None (treated as the strategy's state).
    unasked: None, or where Keras asks before replacing an existing
      `path`, the same write without asking (`_keras_writes`).

  Returns:
    `write`'s result.
  """
  if not _active() or not _is_path(path):
    return write(path)
  with _outermost_write() as outermost:
    if not outermost:
      return write(path)
    asks = unasked is not None
    # Sharded weights of ranks' own objects on one path would mix their
    # files: rank 0's rule holds for them too.
    if not _is_chief() and (saved is None or not atomic or _is_mirror(path)
                            or _holds_strategy_state(saved)):
      mirrored = _mirror_for_write(path, fresh=atomic)
      start = time.time_ns()
      try:
        with (_naming_user_path(path, mirrored),
              _messages_naming(path, mirrored)):
          result = (unasked if asks else write)(mirrored)
      except (OSError, tf.errors.OpError) as error:
        _raise_if_scratch_full(error, path)
        raise
      _date_copy(mirrored, 0 if asks else start)
      if _is_local(path) and _on_chief_host():
        # As rank 0's replacement: never a file for a directory, or back.
        try:
          _check_same_kind(mirrored, os.path.realpath(os.fspath(path)), path)
        except OSError:
          _remove_quietly(mirrored)
          raise
      return result
    if asks:
      # Asked here, as Keras would, the write itself can be atomic.
      if (os.path.exists(path) and
          not _tfp.keras_io_utils.ask_to_proceed_with_overwrite(
              os.fspath(path))):
        return None
      write = unasked
    if not atomic or not _is_local(path):
      return write(path)  # nothing to protect, or not a local file system
    # Through symbolic links, as a plain write (and onto ".").
    real = os.path.realpath(os.fspath(path))
    if not os.path.isdir(os.path.dirname(real)):
      return write(path)  # the writer fails, or makes the directories
    return _write_atomically(real, write, stage=stage, shown=path)


def _holds_strategy_state(obj):
  """True if `obj` or an object it tracks was made under MPIStrategy.

  Such state is the same on every rank, so rank 0's copy is everyone's.
  Anything else (a model built outside the strategy, under another
  strategy, a module of plain variables) may differ per rank, and a rank
  that saves it keeps its own file, as in one process.
  """
  try:
    tracked = [obj] + list(tf.train.TrackableView(obj).descendants())
  except Exception:  # pylint: disable=broad-except
    return True  # not walkable: keep the strategy's rule
  return any(_in_mpi_strategy(t) for t in tracked)


def _is_mirror(path):
  """True if `path` is this rank's scratch directory or lies inside it."""
  root, path = _STATE["scratch"], os.fspath(path)
  return root is not None and (path == root or
                               path.startswith(root + os.sep))


def _raise_if_scratch_full(error, path, staging=False):
  """A full scratch disk, named as such.

  The error of a full disk names the user's path (`_naming_user_path`),
  which may have plenty of room: the disk that filled up is this rank's
  `$TMPDIR`, where a rank > 0 writes its copy and a rank writing the path
  itself stages Keras files.

  Args:
    error: the write's error.
    path: the path the user gave.
    staging: True where this rank staged a write of `path` itself.

  Raises:
    OSError: `error` says the disk is full (ENOSPC, EDQUOT).
  """
  code = getattr(_as_os_error(error), "errno", None)
  if code not in (errno.ENOSPC, errno.EDQUOT):
    return
  if staging:
    what = (f"rank {_STATE['rank']} writes {os.fspath(path)} under "
            f"{_STATE['scratch']} first (in $TMPDIR, on this host) and then "
            "copies it to the path you gave, and that disk is full")
  else:
    what = (f"rank {_STATE['rank']} writes its own copy of "
            f"{os.fspath(path)} under {_STATE['scratch']} (in $TMPDIR, on "
            "this host), and that disk is full; rank 0 writes the path you "
            "gave")
  raise OSError(code, f"{os.strerror(code)}: {what}. Free space there or set "
                "TMPDIR to a larger local disk") from error


def _write_tf_checkpoint_atomically(orig_write, ckpt, prefix, options):
  """Rank 0's `Checkpoint._write`: files under a temporary prefix, renamed.

  The write callbacks (`Checkpoint.save`'s and `CheckpointManager`'s state
  file updates) run after the rename, with the user's prefix.
  """
  prefix = os.fspath(prefix)
  tmp = _temp_sibling(prefix)
  callbacks = None
  if options is not None and options.experimental_write_callbacks:
    options = copy.copy(options)
    callbacks = options.experimental_write_callbacks
    options.experimental_write_callbacks = None
  try:
    with _naming_user_path(prefix, tmp):
      orig_write(ckpt, tmp, options)
    produced = sorted(glob.glob(glob.escape(tmp) + ".*"))
    for f in produced:
      _sync_tree(f)
    # Data shards first, the index (which names them) last.
    produced.sort(key=lambda f: f.endswith(".index"))
    final = [prefix + f[len(tmp):] for f in produced]
    for f, to in zip(produced, final):
      _check_same_kind(f, to)
    for f, to in zip(produced, final):
      os.replace(f, to)
    for old in glob.glob(glob.escape(prefix) + ".data-*"):
      if old not in final:  # shards of an older checkpoint of this prefix
        _remove_quietly(old)
    _fsync(os.path.dirname(os.path.abspath(prefix)), directory=True)
  except BaseException:
    for f in glob.glob(glob.escape(tmp) + "*"):
      _remove_quietly(f)
    raise
  if callbacks:
    _tfp.tf_checkpoint._execute_callbacks(callbacks, prefix)  # pylint: disable=protected-access
  return prefix


def _check_files_like_chief(local, prefix):
  """On rank 0's host, a rank > 0's `Checkpoint` write fails where rank 0's.

  Rank 0 never puts a checkpoint file where the user has a directory
  (`_write_tf_checkpoint_atomically`); this rank's files, written under its
  mirror prefix `local`, are checked against the user's `prefix` the same
  way, and removed if one differs.

  Raises:
    IsADirectoryError: a file of the checkpoint is a directory at `prefix`.
  """
  real = os.path.realpath(os.fspath(prefix))
  produced = glob.glob(glob.escape(local) + ".*")
  try:
    for f in produced:
      suffix = f[len(local):]
      _check_same_kind(f, real + suffix, os.fspath(prefix) + suffix)
  except OSError:
    for f in produced:
      _remove_quietly(f)
    raise


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


def _read_timeout():
  from mpistrategy import ops  # pylint: disable=g-import-not-at-top
  options = ops.current_options()
  return (options.checkpoint_read_timeout_seconds if options is not None else
          _DEFAULT_READ_TIMEOUT)


# What a rank that made a collective read alone must do about it.
_READ_ADVICE = (
    "Under MPIStrategy a read into the strategy's variables is collective: "
    "every rank must call it (rank 0 chooses the files and sends them to the "
    "others, so no shared file system is needed). Code that restores on rank "
    "0 only (the Horovod habit `if rank == 0: ...restore(...)`, then a "
    "broadcast) must make the call on every rank; the broadcast may stay. "
    "Saving on rank 0 only needs no change.")


def _join_name(what):
  """The blocking join's name (after its prefix) before the read `what`."""
  # The engine's messages on the other ranks quote this name.
  return "%s (a collective checkpoint read: every rank must call it)" % what


def _join_read(what):
  """Waits until every rank has entered the collective read `what`.

  A read into the strategy's variables must be made by every rank.  When
  some rank never makes it (`if rank == 0: checkpoint.restore(p)`), the
  ranks that did would wait forever.  Instead (`ops.blocking_join`):

  * if a rank that did not make it waits in another collective (the usual
    case: a broadcast, an allreduce of the next training step, a barrier),
    the engine sees the two sides crossed: within about a second this read
    fails with `FailedPreconditionError` here, and that collective fails on
    the ranks that wait in it, every message naming the read;
  * otherwise (a rank computes, or waits in Python) the read fails after the
    read timeout.  (The join itself then stays posted; the job cannot
    continue after this error, and with `abort_on_exception` it ends.)

  Args:
    what: the user's call, for the messages.

  Raises:
    tf.errors.FailedPreconditionError: other ranks went on to other
      collectives instead of making the call.
    tf.errors.DeadlineExceededError: the other ranks did not join in time.
  """
  from mpistrategy.ops import blocking_join  # pylint: disable=g-import-not-at-top
  timeout = _read_timeout()
  try:
    joined = blocking_join.join(_join_name(what), timeout)
  except tf.errors.FailedPreconditionError as e:
    raise tf.errors.FailedPreconditionError(
        None, None,
        "mpistrategy: rank %d called %s, but other ranks went on to other "
        "collectives instead of making the same call. %s\n(engine: %s)" %
        (_STATE["rank"], what, _READ_ADVICE, e.message)) from None
  if not joined:
    raise tf.errors.DeadlineExceededError(
        None, None,
        "mpistrategy: rank %d waited %g s in %s for the other ranks, which "
        "did not make the same call. %s To wait longer, set "
        "Options.checkpoint_read_timeout_seconds "
        "(MPISTRATEGY_CHECKPOINT_READ_TIMEOUT_SECONDS)." %
        (_STATE["rank"], timeout, what, _READ_ADVICE))


# ----------------------------------------------------------- tf.train.*


def _copy_state_file(directory, mirror):
  """Copies `directory`'s "checkpoint" state file into `mirror`, if any."""
  source = os.path.join(directory, "checkpoint")
  if not tf.io.gfile.exists(source):
    return
  tf.io.gfile.makedirs(mirror)
  tf.io.gfile.copy(source, os.path.join(mirror, "checkpoint"), overwrite=True)


def patch_tf_checkpoint():
  cls = _tfp.tf_checkpoint.Checkpoint
  orig_write, orig_read = cls._write, cls.read  # pylint: disable=protected-access

  def _write(self, file_prefix, options=None):
    if not _active():
      return orig_write(self, file_prefix, options)
    if _is_chief():
      if (not _is_local(file_prefix) or
          (options is not None and options.experimental_enable_async_checkpoint)
          or not os.path.isdir(os.path.dirname(
              os.path.abspath(os.fspath(file_prefix))))):
        return orig_write(self, file_prefix, options)
      return _write_tf_checkpoint_atomically(orig_write, self, file_prefix,
                                             options)
    if isinstance(file_prefix, tf.Tensor):  # e.g. an argument of a tf.function
      local = _mirror_path_tensor(file_prefix)
    else:
      local = _mirror_for_write(file_prefix)
    with _naming_user_path(file_prefix, local):
      written = orig_write(self, local, options)
    if (not isinstance(written, tf.Tensor) and _is_local(file_prefix) and
        _on_chief_host()):
      _check_files_like_chief(local, file_prefix)
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
    if not _collective_reads():
      return orig_read(self, save_path, options)
    _join_read("tf.train.Checkpoint.read/restore")
    # Rank 0 decides the path; its files are what every rank restores.
    save_path = _bcast_str(save_path)
    if save_path is None:
      return orig_read(self, None, options)
    _sync_prefix(save_path)
    return orig_read(self, mirror_path(save_path), options)

  _write.__doc__, read.__doc__ = orig_write.__doc__, orig_read.__doc__
  cls._write, cls.read = _write, read  # pylint: disable=protected-access

  orig_checkpoint_save = cls.save

  def checkpoint_save(self, file_prefix, options=None):
    if (not _active() or _is_chief() or not _is_local(file_prefix) or
        not tf.executing_eagerly()):
      return orig_checkpoint_save(self, file_prefix, options)
    start = time.time_ns()
    result = orig_checkpoint_save(self, file_prefix, options)
    # The state file `latest_checkpoint` reads, dated as `_write_for_user`
    # dates a copy: rank 0's own later save of the directory then wins.
    _date_copy(os.path.join(os.path.dirname(mirror_path(file_prefix)),
                            "checkpoint"), start)
    return result

  checkpoint_save.__doc__ = orig_checkpoint_save.__doc__
  cls.save = checkpoint_save

  mgr = _tfp.checkpoint_management.CheckpointManager
  orig_init, orig_roi = mgr.__init__, mgr.restore_or_initialize
  orig_save = mgr.save

  def __init__(self, checkpoint, directory, *args, **kwargs):
    # Ranks > 0 keep their manager (state file, numbering, deletion of old
    # checkpoints) entirely inside their scratch mirror, starting from rank
    # 0's state file where they can read it (same host or shared file
    # system), so that `latest_checkpoint` and `checkpoints` agree with rank
    # 0's and code like `if manager.latest_checkpoint: restore(...)` takes
    # the same branch everywhere.  Nothing is communicated: managers made on
    # rank 0 only keep working.
    self._mpistrategy_directory = None
    mirror = mirror_path(directory)
    if mirror != os.fspath(directory):
      self._mpistrategy_directory = os.fspath(directory)
      _copy_state_file(os.fspath(directory), mirror)
    orig_init(self, checkpoint, mirror, *args, **kwargs)

  def _users(self, path):
    """`path` in the manager's mirror, as a path in the user's directory."""
    user_dir = getattr(self, "_mpistrategy_directory", None)
    if path is None or user_dir is None:
      return path
    # checkpoint_name may hold directories ("nested/dir/ck").
    relative = os.path.relpath(path, self._directory)  # pylint: disable=protected-access
    if relative.startswith(os.pardir):
      relative = os.path.basename(path)
    return os.path.join(user_dir, relative)

  def save(self, *args, **kwargs):
    user_dir = getattr(self, "_mpistrategy_directory", None)
    if user_dir is not None and _is_local(user_dir):
      # Under MultiWorkerMirroredStrategy this rank's save creates the
      # directory; scripts then delete it (`tf.io.gfile.rmtree`).
      tf.io.gfile.makedirs(user_dir)
    return _users(self, orig_save(self, *args, **kwargs))

  def restore_or_initialize(self):
    if not _collective_reads():
      return orig_roi(self)
    _join_read("tf.train.CheckpointManager.restore_or_initialize")
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
    return _users(self, latest)

  __init__.__doc__ = orig_init.__doc__
  save.__doc__ = orig_save.__doc__
  restore_or_initialize.__doc__ = orig_roi.__doc__
  mgr.__init__, mgr.restore_or_initialize = __init__, restore_or_initialize
  mgr.save = save

  # The user's paths, not the mirror's, from the manager's properties.
  orig_directory = mgr.directory
  mgr.directory = property(
      lambda self: (getattr(self, "_mpistrategy_directory", None) or
                    orig_directory.fget(self)), doc=orig_directory.__doc__)
  orig_latest = mgr.latest_checkpoint
  mgr.latest_checkpoint = property(
      lambda self: (orig_latest.fget(self)
                    if getattr(self, "_mpistrategy_raw", False) else
                    _users(self, orig_latest.fget(self))),
      doc=orig_latest.__doc__)
  orig_record_state = mgr._record_state  # pylint: disable=protected-access

  def _record_state(self):
    # TF's state file records the manager's own (mirror) paths.
    self._mpistrategy_raw = True
    try:
      return orig_record_state(self)
    finally:
      self._mpistrategy_raw = False

  mgr._record_state = _record_state  # pylint: disable=protected-access
  orig_checkpoints = mgr.checkpoints
  mgr.checkpoints = property(
      lambda self: [_users(self, p) for p in orig_checkpoints.fget(self)],
      doc=orig_checkpoints.__doc__)

  # tf.train.latest_checkpoint on a directory this rank saved into itself.
  cm = _tfp.checkpoint_management
  orig_latest_checkpoint = cm.latest_checkpoint

  def latest_checkpoint(checkpoint_dir, latest_filename=None):
    if _active() and not _is_chief() and _is_local(checkpoint_dir):
      directory = os.fspath(checkpoint_dir)
      mirror = mirror_path(directory)
      state = os.path.join(mirror, latest_filename or "checkpoint")
      if (mirror != directory and os.path.isdir(directory) and
          os.path.exists(state) and not _newer(
              os.path.join(directory, latest_filename or "checkpoint"),
              state)):
        found = orig_latest_checkpoint(mirror, latest_filename)
        return (None if found is None else
                os.path.join(directory, os.path.relpath(found, mirror)))
    return orig_latest_checkpoint(checkpoint_dir, latest_filename)

  latest_checkpoint.__doc__ = orig_latest_checkpoint.__doc__
  cm.latest_checkpoint = latest_checkpoint
  for namespace in (tf.train, tf.compat.v1.train):
    if getattr(namespace, "latest_checkpoint", None) is orig_latest_checkpoint:
      namespace.latest_checkpoint = latest_checkpoint


def patch_saved_model():
  # `tf.saved_model.save` and Keras' `Model.export` both end in this
  # module-level function (looked up at call time), so hooking it holds
  # whichever name the user called.
  module = _tfp.saved_model_save
  orig_save = module.save_and_return_nodes

  def save_and_return_nodes(obj, export_dir, *args, **kwargs):
    return _write_for_user(export_dir,
                           lambda p: orig_save(obj, p, *args, **kwargs),
                           saved=obj)

  save_and_return_nodes.__doc__ = orig_save.__doc__
  module.save_and_return_nodes = save_and_return_nodes

  load_module = _tfp.saved_model_load
  orig_load_partial = load_module.load_partial

  def load_partial(export_dir, *args, **kwargs):
    return orig_load_partial(_read_path(export_dir), *args, **kwargs)

  load_partial.__doc__ = orig_load_partial.__doc__
  load_module.load_partial = load_partial


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


@contextlib.contextmanager
def _local_reads():
  """Reads inside already read rank 0's files (no second broadcast)."""
  before = getattr(_LOCAL, "local_reads", False)
  _LOCAL.local_reads = True
  try:
    yield
  finally:
    _LOCAL.local_reads = before


# In BackupAndRestore's training_metadata.json: the weights file of the same
# save, until it is renamed over the backup's weights.
_PENDING_WEIGHTS = "mpistrategy_pending_weights"
_PENDING_PREFIX = ".mpistrategy-pending-"


def _pending_weights(weights, token):
  """Where rank 0 writes a backup's weights before the metadata commits
  them: a name of its own per save (`token`), ending in the `.weights.h5`
  that Keras requires."""
  directory, name = os.path.split(weights)
  return os.path.join(directory, f"{_PENDING_PREFIX}{token}-{name}")


def _finish_backup(callback):
  """Completes or discards a backup save that a kill interrupted.

  The metadata names the pending weights file of its save (see the patched
  `_save_model`): where that file is still there, the save was committed
  and is finished by renaming it over the weights; a pending file that the
  metadata does not name is from a save that never committed.
  """
  weights = callback._weights_path  # pylint: disable=protected-access
  directory, name = os.path.split(weights)
  try:
    pending = [os.path.join(directory, n) for n in os.listdir(directory or ".")
               if n.startswith(_PENDING_PREFIX) and n.endswith("-" + name)]
  except OSError:  # no backup yet
    return
  if not pending:
    return
  named = None
  try:
    with open(callback._training_metadata_path) as f:  # pylint: disable=protected-access
      named = json.load(f).get(_PENDING_WEIGHTS)
  except (OSError, ValueError, AttributeError):
    pass
  for path in pending:
    if os.path.basename(path) == named:
      os.replace(path, weights)
      _fsync(os.path.dirname(os.path.abspath(weights)), directory=True)
    else:
      _remove_quietly(path)


def patch_keras_callbacks():
  backup_and_restore = _tfp.keras_backup_and_restore
  model_checkpoint = _tfp.keras_model_checkpoint
  file_utils = _tfp.keras_file_utils

  bar = backup_and_restore.BackupAndRestore
  orig_begin, orig_save, orig_end = (bar.on_train_begin, bar._save_model,  # pylint: disable=protected-access
                                     bar.on_train_end)

  def _call(fn, self, *args):
    if not _active() or _is_chief():
      return fn(self, *args)
    with _swapped(self, _BAR_ATTRS):
      return fn(self, *args)

  def on_train_begin(self, logs=None):
    if not _active():
      return orig_begin(self, logs)
    if _is_chief() and _is_local(self._training_metadata_path):  # pylint: disable=protected-access
      _finish_backup(self)
    _join_read("BackupAndRestore (fit's start)")
    # Every rank resumes from rank 0's backup (same epoch, same weights).
    _sync_files([getattr(self, a) for a in _BAR_ATTRS[1:]])
    with _local_reads():
      return _call(orig_begin, self, logs)

  def _save_model(self):
    if not _active() or not _is_chief():
      return _call(orig_save, self)
    final = self._training_metadata_path  # pylint: disable=protected-access
    if not _is_local(final):
      return orig_save(self)
    # Weights and metadata change together: the weights go to a pending
    # file, the metadata (naming it) to a temporary file renamed over the
    # old one, which commits the pair; then the pending file is renamed
    # over the weights.  A kill before the commit leaves the old pair, one
    # after it is finished by the next `fit` (`_finish_backup`).
    weights = self._weights_path  # pylint: disable=protected-access
    if getattr(self, "double_checkpoint", False):
      for path, prev in ((weights, self._prev_weights_path),  # pylint: disable=protected-access
                         (final, self._prev_training_metadata_path)):  # pylint: disable=protected-access
        if file_utils.exists(path):
          file_utils.copy(path, prev)
    pending = _pending_weights(weights, uuid.uuid4().hex[:12])
    tmp = _temp_sibling(final)
    self._weights_path, self._training_metadata_path = pending, tmp  # pylint: disable=protected-access
    committed = False
    try:
      orig_save(self)
      with open(tmp) as f:
        meta = json.load(f)
      meta[_PENDING_WEIGHTS] = os.path.basename(pending)
      with open(tmp, "w") as f:
        json.dump(meta, f)
      _sync_tree(tmp)
      os.replace(tmp, final)
      committed = True
      os.replace(pending, weights)
      _fsync(os.path.dirname(os.path.abspath(final)), directory=True)
    except BaseException:
      _remove_quietly(tmp)
      if not committed:  # a committed one is finished by `_finish_backup`
        _remove_quietly(pending)
      raise
    finally:
      self._weights_path, self._training_metadata_path = weights, final  # pylint: disable=protected-access

  def on_train_end(self, logs=None):
    return _call(orig_end, self, logs)

  bar.on_train_begin, bar._save_model, bar.on_train_end = (  # pylint: disable=protected-access
      on_train_begin, _save_model, on_train_end)

  mc = model_checkpoint.ModelCheckpoint
  orig_mc_save = mc._save_model  # pylint: disable=protected-access

  def mc_save_model(self, epoch, batch, logs):
    if not _active() or _is_chief():
      return orig_mc_save(self, epoch, batch, logs)
    # Its messages name the epoch's file, as the user spelled it.
    try:
      shown = self._get_file_path(epoch, batch, dict(logs or {}))  # pylint: disable=protected-access
    except (KeyError, ValueError, IndexError):
      shown = None  # the save itself raises Keras' error
    with (_swapped(self, ("filepath",)),
          _messages_naming(shown, None if shown is None else
                           mirror_path(shown))):
      return orig_mc_save(self, epoch, batch, logs)

  mc._save_model = mc_save_model  # pylint: disable=protected-access

  # TensorBoard derives every path it writes (event files, the profile,
  # projector config, embeddings) from log_dir in set_model; CSVLogger
  # opens its file in on_train_begin.  Ranks > 0 write into their scratch
  # copies: one set of event files, one profile, one CSV row per epoch.
  for cls, method, attr in (
      (_tfp.keras_tensorboard.TensorBoard, "set_model", "log_dir"),
      (_tfp.keras_csv_logger.CSVLogger, "on_train_begin", "filename")):
    setattr(cls, method, _writing_to_mirror(getattr(cls, method), attr))


def _writing_to_mirror(method, attr):
  """`method`, run with `self.<attr>` as this rank's mirror of it."""

  def wrapper(self, *args, **kwargs):
    if not _active() or _is_chief():
      return method(self, *args, **kwargs)
    # The user's directories exist on rank 0's side only.
    os.makedirs(os.path.dirname(mirror_path(getattr(self, attr))),
                exist_ok=True)
    with _swapped(self, (attr,)):
      return method(self, *args, **kwargs)

  wrapper.__doc__ = method.__doc__
  wrapper.__wrapped__ = method
  return wrapper


def _keras_writes(call, filepath, args, kwargs):
  """A Keras save as the user called it, and the same save without asking.

  Args:
    call: `call(path, *args, **kwargs)` saves; `args[0]` is `overwrite`.
    filepath: the path the user gave.
    args: the call's positional arguments after the path.
    kwargs: its keyword arguments.

  Returns:
    `(write, unasked)`: callables taking the path to write. `unasked` is
    None where Keras never asks whether to replace `filepath`
    (`overwrite=True`), else `write` with `overwrite=True`.
  """
  def write(path):
    return call(path, *args, **kwargs)
  overwrite = kwargs.get("overwrite", args[0] if args else True)
  if overwrite or not _is_path(filepath):
    return write, None
  if args:
    unasked_args, unasked_kwargs = (True,) + tuple(args[1:]), kwargs
  else:
    unasked_args, unasked_kwargs = args, dict(kwargs, overwrite=True)
  return write, lambda path: call(path, *unasked_args, **unasked_kwargs)


def _in_mpi_strategy(obj):
  """True if `obj` (a model, a variable) was made under a multi-process
  MPIStrategy."""
  # MPIStrategy's mark; importing strategy.py here would be a cycle.
  s = getattr(obj, "_distribute_strategy", None)
  return (getattr(s, "_is_mpi_strategy", False) and
          s.extended._num_workers > 1)  # pylint: disable=protected-access


def patch_keras_model_saving():
  model_lib = _tfp.keras_model
  cls = model_lib.Model
  orig_save, orig_save_weights = cls.save, cls.save_weights

  def save(self, filepath, *args, **kwargs):
    write, unasked = _keras_writes(functools.partial(orig_save, self),
                                   filepath, args, kwargs)
    return _write_for_user(filepath, write, stage=True, saved=self,
                           unasked=unasked)

  def save_weights(self, filepath, *args, **kwargs):
    sharded = kwargs.get("max_shard_size", args[1] if len(args) > 1 else None)
    write, unasked = _keras_writes(functools.partial(orig_save_weights, self),
                                   filepath, args, kwargs)
    return _write_for_user(filepath, write, atomic=sharded is None,
                           stage=True, saved=self, unasked=unasked)

  save.__doc__ = orig_save.__doc__
  save_weights.__doc__ = orig_save_weights.__doc__
  cls.save, cls.save_weights = save, save_weights

  orig_export = cls.export

  def export(self, filepath, *args, **kwargs):
    return _write_for_user(filepath,
                           lambda p: orig_export(self, p, *args, **kwargs),
                           saved=self)

  export.__doc__ = orig_export.__doc__
  cls.export = export

  orig_load_weights = cls.load_weights

  def load_weights(self, filepath, *args, **kwargs):
    if (not _collective_reads() or getattr(_LOCAL, "local_reads", False) or
        not _in_mpi_strategy(self)):
      return orig_load_weights(self, _read_path(filepath), *args, **kwargs)
    # Into mirrored variables: collective, rank 0's file on every rank.
    _join_read("Model.load_weights")
    path = _bcast_str(os.fspath(filepath) if _is_chief() else None)
    is_file = _bcast_str("1" if _is_chief() and os.path.isfile(path) else
                         "0") == "1"
    if not is_file:  # a directory (or missing): every rank reads its own
      return orig_load_weights(self, _read_path(filepath), *args, **kwargs)
    _sync_files([path])
    return orig_load_weights(self, mirror_path(path), *args, **kwargs)

  load_weights.__doc__ = orig_load_weights.__doc__
  cls.load_weights = load_weights

  # The function forms, under each public name they have.
  import keras  # pylint: disable=g-import-not-at-top
  saving_api = _tfp.keras_saving_api
  orig_save_model = saving_api.save_model

  def save_model(model, filepath, *args, **kwargs):
    write, unasked = _keras_writes(functools.partial(orig_save_model, model),
                                   filepath, args, kwargs)
    return _write_for_user(filepath, write, stage=True, saved=model,
                           unasked=unasked)

  save_model.__doc__ = orig_save_model.__doc__
  for module in (saving_api, keras.saving, keras.models):
    if getattr(module, "save_model", None) is orig_save_model:
      module.save_model = save_model

  orig_load_model = saving_api.load_model

  def load_model(filepath, *args, **kwargs):
    return orig_load_model(_read_path(filepath), *args, **kwargs)

  load_model.__doc__ = orig_load_model.__doc__
  for module in (saving_api, keras.saving, keras.models):
    if getattr(module, "load_model", None) is orig_load_model:
      module.load_model = load_model


def set_world(rank, size):
  """Records the MPI world that the patches of this module act for, under
  MPIStrategy's rule (rank 0 writes, every rank reads rank 0's files).

  Args:
    rank: this process' MPI rank.
    size: the MPI world size (the largest one seen is kept).
  """
  _STATE["rank"], _STATE["size"] = rank, max(_STATE["size"], size)
  _STATE["rule"] = "chief"


def set_world_for_horovod(rank, size):
  """Records the MPI world for the Horovod layer without MPIStrategy.

  Every rank then writes the paths it saves to itself, as Horovod's plain
  writes do, but atomically; reads are each rank's own.  Once MPIStrategy
  has set its rule (`set_world`), that rule stays.

  Args:
    rank: this process' MPI rank.
    size: the MPI world size.
  """
  if _active() and _STATE["rule"] == "chief":
    return
  _STATE["rank"], _STATE["size"] = rank, max(_STATE["size"], size)
  _STATE["rule"] = "own"
