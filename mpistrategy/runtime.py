"""This process's mpistrategy runtime: start, stop, rank, size.

`init` starts MPI (unless already initialized) and the C++ engine through
the op library's C ABI (cc/kernels/c_api.cc); `shutdown` stops the engine.
`rank`, `size`, `local_rank` and `local_size` describe the MPI world, and
`tuned_parameters` the fusion parameters in force.  The C ABI answers with
a status code (cc/engine/common.h); this module maps it to `ValueError` or
the `tf.errors` class of that code.

The rest of the package reaches the runtime through `ensure_started` (start
an engine unless one runs, never restarting one that stopped) and
`started_library` (the loaded op library, starting the engine first).  An
uncaught exception on a rank ends every rank (`Options.abort_on_exception`,
see `_abort_on_exception`).
"""

import atexit
import ctypes
import os
import sys
import tempfile
import threading
import time
import traceback

import tensorflow as tf

from mpistrategy import _library
from mpistrategy import _output
from mpistrategy import _tf_threads
from mpistrategy import checkpoint
from mpistrategy import options as options_lib
from mpistrategy.options import Options

__all__ = [
    "init", "shutdown", "is_initialized", "current_options", "rank", "size",
    "local_rank", "local_size", "mpi_threads_supported", "built_with_cuda",
    "built_with_nccl", "tuned_parameters", "ensure_started",
    "started_library",
]

# StatusCode (cc/engine/common.h) returned by mpistrategy_init: invalid
# arguments become ValueError, the rest the tf.errors class of that code.
_INVALID_ARGUMENT = 3
# After a peer timeout, the engine calls MPI_Abort itself about a second
# later (cc/kernels/c_api.cc); the excepthook waits longer than that.
_PEER_TIMEOUT_EXIT_WAIT_SECONDS = 5.0
_ERRORS_BY_CODE = {
    2: tf.errors.UnknownError,
    4: tf.errors.DeadlineExceededError,
    9: tf.errors.FailedPreconditionError,
    10: tf.errors.AbortedError,
    12: tf.errors.UnimplementedError,
    13: tf.errors.InternalError,
    14: tf.errors.UnavailableError,
}


class _State:
  """This process's view of the engine; guarded by `lock`."""

  def __init__(self):
    self.lock = threading.RLock()
    self.options = None          # the Options the engine runs with
    self.atexit_registered = False
    self.previous_excepthook = None
    self.previous_thread_excepthook = None
    # (rank, size, local_rank, local_size) once an engine ran: MPI stays
    # up across shutdown(), so they never change (see `_world`).
    self.world = None
    # Why this process' last engine start failed, until one succeeds.
    self.start_error = None


_state = _State()


def _lib():
  return _library.load()


def init(options=None):
  """Starts mpistrategy: MPI (unless already initialized) and the engine.

  Idempotent: calling it again with the same resolved options does nothing,
  unless the engine stopped on an error (another rank shut down or raised,
  a stall timed out): then it starts a new one, which, like the first
  `init()`, every rank must call.
  The `MPISTRATEGY_<FIELD>` environment variables override `options` (see
  `mpistrategy.Options.from_env`).  When several ranks share a host and the
  launcher did not bind them to CPUs, TensorFlow's thread pools are sized to
  this rank's share of the host's CPUs unless chosen already (see
  `mpistrategy._tf_threads`).  MPI is initialized with
  `MPI_THREAD_MULTIPLE` unless it already is (e.g. by mpi4py, which then
  keeps owning it); an MPI initialized here is finalized at process exit.

  Args:
    options: An `mpistrategy.Options`, or None for the defaults.

  Raises:
    TypeError: `options` is not an `mpistrategy.Options`.
    ValueError: An option is invalid, or mpistrategy already runs with
      different options (call `shutdown()` first).
    tf.errors.OpError: MPI or the engine failed to start (e.g.
      `tf.errors.FailedPreconditionError` when MPI was finalized already).
  """
  _init(options, restart_stopped=True)


def _init(options, restart_stopped):
  """`init`; with `restart_stopped=False` a running engine is kept as it is.

  The library's own calls (the strategy, its cross-device ops) use False:
  their engine may have stopped because another rank raised or shut down,
  and a new start would wait for that rank forever; and an engine the user
  started with `init(options)` must not be compared with the defaults.
  """
  if options is not None and not isinstance(options, Options):
    raise TypeError("init: options must be an mpistrategy.Options or None, "
                    f"got {type(options).__name__}")
  resolved = Options.from_env(base=options)
  with _state.lock:
    lib = _lib()
    # In a fork child the C call below fails with the reason (the engine's
    # thread and MPI do not survive fork).
    forked = bool(lib.c.mpistrategy_is_forked_child())
    stopped = bool(lib.c.mpistrategy_engine_stopped())
    if not restart_stopped and _state.options is not None and not forked:
      # The library's own calls only make sure an engine runs: they keep a
      # stopped one, and one the user started with their own options.
      if stopped or (options is None and lib.c.mpistrategy_is_initialized()):
        return
    # An engine that stopped on an error (a rank shut down or raised, a
    # stall timed out) is replaced below, like a first init.
    if (_state.options is not None and lib.c.mpistrategy_is_initialized() and
        not stopped and not forked):
      if resolved == _state.options:
        return
      diff = ", ".join(
          f"{name} (running: {getattr(_state.options, name)!r}, requested: "
          f"{getattr(resolved, name)!r})"
          for name in resolved.__dataclass_fields__
          if getattr(resolved, name) != getattr(_state.options, name))
      raise ValueError(
          "mpistrategy is already initialized with different options: "
          f"{diff}; call mpistrategy.shutdown() first")
    error_buf = ctypes.create_string_buffer(4096)
    # The engine parses and validates it with the same C++ code as Options
    # did (cc/engine/config.cc).
    config = options_lib.config_text(resolved)
    code = lib.c.mpistrategy_init(config, len(config), error_buf,
                                  len(error_buf))
    if code != 0:
      # Without a started engine the excepthook that prefixes tracebacks
      # with "[rank N]" is not installed: the message says which rank.
      rank = _output.rank_from_env()
      _state.start_error = options_lib.name_horovod_sources(
          error_buf.value.decode(errors="replace"))
      _raise_for_code(code, ctypes.create_string_buffer(
                          _state.start_error.encode()),
                      "init" if rank is None else f"init (rank {rank})",
                      " failed")
    _state.options = resolved
    _state.start_error = None
    if resolved.verbose:
      _output.undo_quiet()
    _tf_threads.share_cpus(lib.c.mpistrategy_local_size())
    if not _state.atexit_registered:
      # Registered after mpi4py's own exit handler (if mpi4py was imported
      # first), so it runs before MPI is finalized.
      atexit.register(_shutdown_at_exit)
      _state.atexit_registered = True
    if resolved.abort_on_exception and lib.c.mpistrategy_size() > 1:
      _install_excepthook()


def shutdown():
  """Stops the engine; `init()` may be called again afterwards.

  Collectives still pending fail with `tf.errors.AbortedError` on every rank.
  A collective called afterwards, on any thread, starts a new engine as on
  first use (`init()` with the defaults and the environment), which every
  rank must then join: call `shutdown()` on every rank, once no other
  thread of this process runs collectives.  MPI itself stays initialized
  until the process exits.  A no-op when not initialized.
  """
  with _state.lock:
    if _library.loaded() is None:
      return
    _lib().c.mpistrategy_shutdown()
    _state.options = None
    _uninstall_excepthook()


def _shutdown_at_exit():
  try:
    lib = _library.loaded()
    if (lib is not None and lib.c.mpistrategy_is_initialized() and
        lib.c.mpistrategy_size() > 1):
      # Collectives other ranks still wait in fail naming this exit, not a
      # plain "shut down" (which a shutdown() call also gives).
      me = _describe_rank(lib, lib.c.mpistrategy_rank())
      reason = (f"{me} exited (its script ended, or called sys.exit) "
                "before the other ranks")
      lib.c.mpistrategy_abort(reason.encode(errors="replace"), 0.0)
    shutdown()
  except Exception:  # pylint: disable=broad-except
    pass  # interpreter teardown: nothing sensible left to report to


def is_initialized():
  """Returns True between `init()` and `shutdown()`.

  Also True after the engine stopped on an error (its collectives then fail
  with that error until `init()` starts a new engine); see `init`.
  """
  if _library.loaded() is None:
    return False
  return bool(_lib().c.mpistrategy_is_initialized())


def current_options():
  """Returns the `mpistrategy.Options` the engine runs with, or None."""
  with _state.lock:
    return _state.options if is_initialized() else None


def ensure_started(options=None):
  """Starts the engine unless one runs; the library's own start.

  Unlike `init`, an engine that stopped on an error is kept (its collectives
  fail with that error): it may have stopped because another rank failed to
  start, and a new start would wait for that rank forever.  And an engine
  the user started with `init(options)` is kept when `options` is None.
  The strategy and its cross-device ops call this.

  Args:
    options: An `mpistrategy.Options` for a first start, or None.

  Raises:
    As `init`.
  """
  _init(options, restart_stopped=False)


def started_library():
  """Returns the loaded op library (`_library.Library`), starting if needed.

  Starts the engine as `ensure_started()` when it is not initialized; the
  collectives call this before they create an op.
  """
  if not is_initialized():
    _init(None, restart_stopped=False)
  return _lib()


def _world():
  """(rank, size, local_rank, local_size), starting the engine if none ran.

  Once an engine has run they are answered from what it reported, also
  after `shutdown()`: starting an engine again is collective, and a query
  made on one rank only would wait in that start for ever.  For the same
  reason, after a start that failed (and before any succeeded) they raise.

  Raises:
    ValueError: this process' engine start failed and none ran before.
  """
  with _state.lock:
    if not is_initialized():
      lib = _library.loaded()
      if lib is not None and not lib.c.mpistrategy_is_forked_child():
        if _state.world is not None:
          return _state.world
        if _state.start_error is not None:
          # A query in the handler of that error on this rank alone.
          raise ValueError(
              "mpistrategy.rank/size: mpistrategy failed to start on this "
              f"rank ({_state.start_error}), so the world is unknown here; "
              "starting it again is collective: call mpistrategy.init() on "
              "every rank")
    c = started_library().c
    _state.world = (c.mpistrategy_rank(), c.mpistrategy_size(),
                    c.mpistrategy_local_rank(), c.mpistrategy_local_size())
    return _state.world


def rank():
  """Returns this process's rank in the MPI world (initializing if needed)."""
  return _world()[0]


def size():
  """Returns the number of processes in the MPI world."""
  return _world()[1]


def local_rank():
  """Returns this process's rank among the processes on its host."""
  return _world()[2]


def local_size():
  """Returns the number of processes on this process's host."""
  return _world()[3]


def mpi_threads_supported():
  """Returns True when MPI runs with `MPI_THREAD_MULTIPLE`."""
  return bool(started_library().c.mpistrategy_mpi_threads_supported())


def tuned_parameters():
  """Returns the fusion parameters in force on this rank.

  Every rank plans fusion with rank 0's parameters (published in the first
  negotiation).  With `Options.autotune`, they are the autotuner's latest
  choice: they change while it measures candidates and stop changing once
  `final` is True.  Without autotune they are the configured ones, final.

  Returns:
    A dict with keys "fusion_threshold_bytes" (int), "fusion_wait_ms"
    (float) and "final" (bool).

  Raises:
    ValueError: mpistrategy is not initialized.
  """
  threshold = ctypes.c_int64()
  wait_ms = ctypes.c_double()
  final = ctypes.c_int()
  # The C call also answers "not initialized" (-1), e.g. after a shutdown
  # on another thread; is_initialized() first avoids loading the library.
  if not is_initialized() or _lib().c.mpistrategy_tuned_parameters(
      ctypes.byref(threshold), ctypes.byref(wait_ms), ctypes.byref(final)):
    raise ValueError("mpistrategy.ops.tuned_parameters: mpistrategy is not "
                     "initialized; call mpistrategy.init() first")
  return {"fusion_threshold_bytes": threshold.value,
          "fusion_wait_ms": wait_ms.value, "final": bool(final.value)}


def start_timeline(path):
  """Starts writing the engine timeline to `path`, from now on.

  `Options.timeline` records the whole run, which for a long job makes a
  file of gigabytes; this records a window of it (like Horovod's
  `hvd.start_timeline`).  The file is the same Chrome trace (README,
  "Timeline"): only rank 0 writes it unless `path` contains "{rank}".  A
  timeline already being written (this one's or `Options.timeline`'s) is
  closed first, a complete file.  Each rank switches on its own, between
  negotiation cycles: call it on every rank (at the same step, for traces
  that line up); nothing is communicated.

  Args:
    path: The file to write (str or os.PathLike).

  Raises:
    ValueError: `path` is empty or cannot be opened for writing (the
      message names the file and the OS error); the previous timeline, if
      any, goes on.  Only a rank that opens a file can find that out: for
      a path without "{rank}" that is rank 0, and the others stop their
      own timelines as for any such path.
    tf.errors.FailedPreconditionError: the engine has stopped.
  """
  path = os.fspath(path)
  if not path:
    raise ValueError("mpistrategy.start_timeline: the path is empty; use "
                     "mpistrategy.stop_timeline() to stop recording")
  _set_timeline(started_library(), path, "start_timeline")


def stop_timeline():
  """Closes the timeline file being written; a no-op when there is none.

  The file is complete (valid JSON) when this returns.  Local, like
  `start_timeline`.

  Raises:
    tf.errors.FailedPreconditionError: the engine has stopped.
  """
  if is_initialized():
    _set_timeline(_lib(), "", "stop_timeline")


def _set_timeline(lib, path, caller):
  error_buf = ctypes.create_string_buffer(4096)
  code = lib.c.mpistrategy_set_timeline(path.encode(), error_buf,
                                        len(error_buf))
  _raise_for_code(code, error_buf, caller)


def _raise_for_code(code, error_buf, caller, failed=""):
  """Raises for a C call's StatusCode `code` (0: returns).

  InvalidArgument (the caller's input) is a ValueError; the other codes
  are their `tf.errors` classes.  The message is `error_buf`'s, after
  "mpistrategy.<caller><failed>: ".
  """
  if code == 0:
    return
  message = error_buf.value.decode(errors="replace")
  if code == _INVALID_ARGUMENT:
    raise ValueError(f"mpistrategy.{caller}: {message}")
  error_class = _ERRORS_BY_CODE.get(code, tf.errors.UnknownError)
  raise error_class(None, None, f"mpistrategy.{caller}{failed}: {message}")


def built_with_cuda():
  """Returns True when the op library has the GPU kernels."""
  return bool(_lib().c.mpistrategy_built_with_cuda())


def built_with_nccl():
  """Returns True when the op library can use NCCL for GPU tensors."""
  return bool(_lib().c.mpistrategy_built_with_nccl())


def rank_hosts():
  """Returns every rank's host name, in rank order (initializing if needed).

  The engines exchange them when they start, so no collective runs here; the
  call waits for that exchange if it is still under way.

  Returns:
    A list of `size()` strings, each host's `gethostname()`.

  Raises:
    tf.errors.OpError: the engine stopped before the ranks agreed at
      startup (e.g. a rank could not start); the error says why.
  """
  lib = started_library()
  # A host name is at most 255 bytes, plus its newline.
  buf = ctypes.create_string_buffer(256 * lib.c.mpistrategy_size() + 4096)
  code = lib.c.mpistrategy_rank_hosts(buf, len(buf))
  text = buf.value.decode(errors="replace")
  if code != 0:
    # -1: shut down by another thread since started_library().
    raise _ERRORS_BY_CODE.get(code, tf.errors.AbortedError)(
        None, None, text or "mpistrategy.rank_hosts: not initialized")
  return text.splitlines()


def _describe_rank(lib, which):
  """"rank N (host H, pid P)", as the engine's messages name ranks."""
  buf = ctypes.create_string_buffer(512)
  if lib.c.mpistrategy_describe_rank(which, buf, len(buf)) != 0:
    return f"rank {which}"
  return buf.value.decode(errors="replace")


def _install_excepthook():
  """Makes an uncaught exception end every rank instead of hanging them.

  In the main thread, and in any other thread that took part in
  collectives (the others would wait for its next one for ever); an
  exception in a thread that never communicated ends only that thread, as
  Python does.
  """
  if _state.previous_excepthook is not None:
    return
  _state.previous_excepthook = sys.excepthook
  _state.previous_thread_excepthook = threading.excepthook
  sys.excepthook = _abort_on_exception
  threading.excepthook = _abort_on_thread_exception


def _uninstall_excepthook():
  if _state.previous_excepthook is None:
    return
  if sys.excepthook is _abort_on_exception:
    sys.excepthook = _state.previous_excepthook
  if threading.excepthook is _abort_on_thread_exception:
    threading.excepthook = _state.previous_thread_excepthook
  _state.previous_excepthook = None


def _abort_on_thread_exception(args):
  """threading.excepthook: `_abort_on_exception` for communicating threads."""
  from mpistrategy.ops import _naming  # pylint: disable=g-import-not-at-top
  if (args.exc_type is SystemExit or args.thread is None or
      not _naming.thread_communicated(args.thread.ident)):
    _state.previous_thread_excepthook(args)
    return
  sys.stderr.write(f"Exception in thread {args.thread.name}:\n")
  _abort(args.exc_type, args.exc_value, args.exc_traceback)


_AUTOGRAPH_PREFIX = "__autograph_generated_file"


def _remove_autograph_files():
  """Removes the modules autograph wrote into $TMPDIR, as its atexit would.

  Autograph loads each converted function from a temporary file that it
  deletes at exit; a job that ends by MPI_Abort would leave them all.
  """
  directory = os.path.realpath(tempfile.gettempdir())
  for name, module in list(sys.modules.items()):
    path = getattr(module, "__file__", None)
    if (not name.startswith(_AUTOGRAPH_PREFIX) or not path or
        os.path.dirname(os.path.realpath(path)) != directory):
      continue
    try:
      os.remove(path)
    except OSError:
      pass


def _abort_on_exception(exc_type, exc, tb):
  """sys.excepthook: `_abort` for an uncaught exception.

  Python calls the hook for one with no frame of the program left.  Code
  that calls it itself reports an error and goes on (h5py's destructors
  report a failed write so, also after the caller caught that write's
  error): that is printed as Python's own hook does, and nothing ends.
  """
  try:
    sys._getframe(1)  # pylint: disable=protected-access
  except ValueError:
    _abort(exc_type, exc, tb)
    return
  _state.previous_excepthook(exc_type, exc, tb)


def _abort(exc_type, exc, tb):
  """Prints with the rank, tells the other ranks, MPI_Abort."""
  lib = _library.loaded()
  my_rank = lib.c.mpistrategy_rank() if lib is not None else -1
  text = "".join(traceback.format_exception(exc_type, exc, tb))
  sys.stderr.write("".join(f"[rank {my_rank}] {line}\n"
                           for line in text.rstrip("\n").split("\n")))
  sys.stderr.flush()
  if lib is None:
    return
  # MPI_Abort below skips atexit, where these files would be removed.
  checkpoint.remove_scratch()
  _remove_autograph_files()
  if (isinstance(exc, tf.errors.UnavailableError) and
      "peer_timeout_seconds" in str(exc)):
    # A peer timeout: the engine itself ends the job a moment later, after
    # the other ranks had time to print their own message; an immediate
    # MPI_Abort here would kill them before they do.
    time.sleep(_PEER_TIMEOUT_EXIT_WAIT_SECONDS)
  reason = f"{_describe_rank(lib, my_rank)} raised {exc_type.__name__}: {exc}"
  lib.c.mpistrategy_abort(reason.encode(errors="replace"), 2.0)
  lib.c.mpistrategy_mpi_abort(1)

