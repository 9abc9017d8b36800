"""Rank output: whole lines, and only rank 0 prints TF's start-up noise.

Whole lines: under an MPI launcher, importing mpistrategy makes
`sys.stdout` and `sys.stderr` line-buffered (and not write-through), so
each line reaches the launcher in one write, promptly, even when stdout is
a pipe or PYTHONUNBUFFERED is set.  Otherwise a `print(a, b)` under
PYTHONUNBUFFERED arrives in four pieces, and `mpirun --tag-output` tags
each piece.

Quiet ranks:

Every rank of an N-rank job imports TensorFlow and builds the same model,
so without care the log shows each start-up line and each Keras warning N
times.  By default, ranks other than 0 hide:

* TensorFlow's C++ INFO and WARNING lines (`I0000 00:00:...` /
  `W0000 ...`, the older `2026-01-01 12:00:00.0: I tensorflow/...` form,
  and absl's "All log messages before absl::InitializeLog()" banner);
* Python warnings (`warnings.warn`) and INFO/WARNING records of the
  "tensorflow" and "absl" Python loggers.

ERROR and FATAL lines, tracebacks, `print` output and everything else are
never hidden, on any rank.  `MPISTRATEGY_VERBOSE=1` (the launcher's
`--verbose`, or `Options(verbose=True)` for the Python part) keeps
everything on every rank.

There are two parts:

* `python -m mpistrategy.quiet PROGRAM [ARGS ...]` (what
  `python -m mpistrategy.run` puts in front of the program): on rank 0, or
  when verbose, it simply execs PROGRAM.  On other ranks it sets
  PYTHONWARNINGS=ignore and TF_CPP_MIN_LOG_LEVEL=2 (each unless set) and
  runs PROGRAM with its stderr
  through a filter that drops the C++ INFO/WARNING lines and the Python
  loggers' INFO/WARNING lines.  This also covers the lines TensorFlow prints
  while it is imported, before any mpistrategy code runs.  Users of plain
  `mpirun` can use it the same way:
  `mpirun -np 4 python -m mpistrategy.quiet python train.py`.
* `import mpistrategy` (via `setup_this_process`): on ranks other than 0
  it ignores Python warnings (unless the user gave -W or PYTHONWARNINGS),
  raises the "tensorflow" and "absl" loggers to ERROR, and, when TensorFlow
  is not imported yet and TF_CPP_MIN_LOG_LEVEL is not set, sets it to 2
  (TensorFlow's own C++ INFO and WARNING lines; absl's lines printed while
  TensorFlow loads its libraries are not covered by it).  So with plain
  `mpirun python train.py`, `import mpistrategy` before `import tensorflow`
  gives the quiet start-up that the launcher gives.

The rank is read from the environment that the MPI launcher sets, before
MPI is initialized: OMPI_COMM_WORLD_RANK (Open MPI), PMIX_RANK (PMIx),
PMI_RANK (MPICH, Intel MPI), SLURM_PROCID (srun).  Outside an MPI job
nothing is changed.
"""

import ctypes
import logging
import os
import re
import signal
import sys
import warnings

__all__ = ["rank_from_env", "verbose_from_env", "setup_this_process",
           "quiet_this_process", "undo_quiet", "is_noise", "main"]

VERBOSE_VARIABLE = "MPISTRATEGY_VERBOSE"
# Set by the wrapper for its program: "<fd of unfiltered stderr>:<the
# variables the wrapper set, comma-separated>".
_WRAPPER_VARIABLE = "MPISTRATEGY_QUIET_WRAPPER"

# In order of preference: SLURM_PROCID last, because mpirun inside a Slurm
# allocation leaves the batch step's SLURM_PROCID (0) on every rank.
_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK",
                   "SLURM_PROCID")
_TRUE = ("1", "true", "yes", "on")

# C++ log lines of severity INFO or WARNING: absl's format
# ("I0000 00:00:1796315091.956375    9843 cudart_stub.cc:31] ...") and
# TensorFlow's older one ("2026-12-03 16:00:00.000000: W tensorflow/...").
_NOISE = re.compile(
    r"^(?:"
    r"[IW]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [^ \]]+:\d+\] "
    r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IW] \S+:\d+\] "
    r"|WARNING: All log messages before absl::InitializeLog\(\) is called "
    r"are written to STDERR$"
    r"|(?:INFO|WARNING):(?:tensorflow|absl):"
    r")")
# The second line of TensorFlow's CPU-instructions notice.
_NOISE_CONTINUATION = re.compile(
    r"^To enable the following instructions: .*, in other operations, "
    r"rebuild TensorFlow with the appropriate compiler flags\.$")

_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP,
                      signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                      signal.SIGCONT)


def rank_from_env(environ=None):
  """This process's MPI rank as the launcher announced it, or None.

  Args:
    environ: The mapping to read; default `os.environ`.

  Returns:
    An int, or None outside an MPI/Slurm job (or for an unreadable value).
  """
  environ = os.environ if environ is None else environ
  for name in _RANK_VARIABLES:
    value = environ.get(name)
    if value is not None:
      try:
        return int(value)
      except ValueError:
        return None
  return None


def verbose_from_env(environ=None):
  """True when MPISTRATEGY_VERBOSE is set to 1/true/yes/on."""
  environ = os.environ if environ is None else environ
  return environ.get(VERBOSE_VARIABLE, "").strip().lower() in _TRUE


def is_noise(line):
  """True for a stderr line that ranks other than 0 drop (see module doc).

  Args:
    line: One line, with or without its line ending.

  Returns:
    A bool.
  """
  line = line.rstrip("\r\n")
  return bool(_NOISE.match(line) or _NOISE_CONTINUATION.match(line))


def line_buffer_output():
  """Makes sys.stdout and sys.stderr line-buffered, not write-through."""
  for stream in (sys.stdout, sys.stderr):
    reconfigure = getattr(stream, "reconfigure", None)
    if reconfigure is None:  # replaced by the user (a logger, a file)
      continue
    try:
      reconfigure(line_buffering=True, write_through=False)
    except (ValueError, OSError):
      pass


def setup_this_process(environ=None):
  """What `import mpistrategy` does to a rank's output (see the module doc).

  Args:
    environ: The environment; default `os.environ`.
  """
  environ = os.environ if environ is None else environ
  if rank_from_env(environ) is None:
    return
  line_buffer_output()
  quiet_this_process(environ)


# What `quiet_this_process` changed, so that `undo_quiet` can restore it.
_changed = {}


def quiet_this_process(environ=None):
  """Quiets this process's Python warnings and TF loggers on ranks > 0.

  Called when mpistrategy is imported.  Does nothing on rank 0, outside an
  MPI job, when MPISTRATEGY_VERBOSE is set, or twice.

  Args:
    environ: The environment to read (and, for TF_CPP_MIN_LOG_LEVEL, to
      write); default `os.environ`.

  Returns:
    True if this process was quieted.
  """
  environ = os.environ if environ is None else environ
  rank = rank_from_env(environ)
  if rank is None or rank == 0 or verbose_from_env(environ) or _changed:
    return False
  if "tensorflow" not in sys.modules and (
      "TF_CPP_MIN_LOG_LEVEL" not in environ):
    environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    _changed["environ"] = environ
  if not sys.warnoptions:  # -W or PYTHONWARNINGS: the user's choice
    _changed["filters"] = list(warnings.filters)
    warnings.simplefilter("ignore")
  levels = {}
  for name in ("tensorflow", "absl"):
    logger = logging.getLogger(name)
    levels[name] = logger.level
    if logger.getEffectiveLevel() < logging.ERROR:
      logger.setLevel(logging.ERROR)
  _changed["levels"] = levels
  return True


def undo_quiet(environ=None):
  """Shows later output in full again (for `Options(verbose=True)`).

  Restores what `quiet_this_process` changed and, behind `python -m
  mpistrategy.quiet`, what the wrapper did: stderr goes to the wrapper's
  own, unfiltered stderr, and the `PYTHONWARNINGS=ignore` it set is taken
  back.  TensorFlow's start-up lines cannot be brought back.

  Args:
    environ: The environment; default `os.environ`.
  """
  environ = os.environ if environ is None else environ
  wrapper = environ.pop(_WRAPPER_VARIABLE, None)
  if wrapper is not None:
    fd, _, set_there = wrapper.partition(":")
    try:
      sys.stderr.flush()
      os.dup2(int(fd), 2)
    except (ValueError, OSError):
      pass  # closed by the program, or not from the wrapper: stay filtered
    if "PYTHONWARNINGS" in set_there.split(","):
      _drop_ignore_all_filter()
  if "filters" in _changed:
    warnings.filters[:] = _changed.pop("filters")
    warnings._filters_mutated()  # pylint: disable=protected-access
  for name, level in _changed.pop("levels", {}).items():
    logging.getLogger(name).setLevel(level)
  environ = _changed.pop("environ", None)
  if environ is not None and environ.get("TF_CPP_MIN_LOG_LEVEL") == "2":
    del environ["TF_CPP_MIN_LOG_LEVEL"]


def _drop_ignore_all_filter():
  """Removes the filter that PYTHONWARNINGS=ignore installed at start-up."""
  if "ignore" in sys.warnoptions:
    sys.warnoptions.remove("ignore")
  ignore_all = ("ignore", None, Warning, None, 0)
  if ignore_all in warnings.filters:
    warnings.filters.remove(ignore_all)
    warnings._filters_mutated()  # pylint: disable=protected-access


def _die_with_parent():
  """In the child: SIGKILL when the filter process dies (Linux only)."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass


def _filter(read_fd, out):
  """Copies lines from `read_fd` to `out` (binary), dropping the noise."""
  with os.fdopen(read_fd, "rb", buffering=0) as pipe:
    pending = b""
    while True:
      chunk = pipe.read(65536)
      if not chunk:
        break
      pending += chunk
      *lines, pending = pending.split(b"\n")
      kept = [l + b"\n" for l in lines
              if not is_noise(l.decode("utf-8", errors="replace"))]
      if kept:
        out.write(b"".join(kept))
        out.flush()
    if pending and not is_noise(pending.decode("utf-8", errors="replace")):
      out.write(pending)
      out.flush()


def _exec(argv):
  try:
    os.execvp(argv[0], argv)
  except OSError as e:
    sys.stderr.write(f"mpistrategy.quiet: cannot run {argv[0]}: {e}\n")
    sys.stderr.flush()
    os._exit(127)  # pylint: disable=protected-access


def main(argv=None):
  """`python -m mpistrategy.quiet PROGRAM [ARGS ...]`; see the module doc.

  Args:
    argv: PROGRAM and its arguments; default `sys.argv[1:]`.

  Returns:
    The program's exit status (on ranks other than 0; rank 0 execs it), or
    128 + N when it died of signal N and this process could not die of N.
  """
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv and argv[0] == "--":
    argv = argv[1:]
  if not argv:
    sys.stderr.write("usage: python -m mpistrategy.quiet PROGRAM [ARGS ...]"
                     "\n")
    return 2
  rank = rank_from_env()
  if rank is None or rank == 0 or verbose_from_env():
    _exec(argv)
  set_here = [name for name in ("PYTHONWARNINGS", "TF_CPP_MIN_LOG_LEVEL")
               if name not in os.environ]
  os.environ.setdefault("PYTHONWARNINGS", "ignore")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  # For `Options(verbose=True)` in the program (undo_quiet): this stderr,
  # unfiltered, and what was set here.
  unfiltered = os.dup(2)
  os.set_inheritable(unfiltered, True)
  os.environ[_WRAPPER_VARIABLE] = f"{unfiltered}:{','.join(set_here)}"
  read_fd, write_fd = os.pipe()
  pid = os.fork()
  if pid == 0:
    os.close(read_fd)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    _die_with_parent()
    _exec(argv)
  os.close(write_fd)
  os.close(unfiltered)

  def forward(signum, unused_frame):
    try:
      os.kill(pid, signum)
    except ProcessLookupError:
      pass

  for signum in _FORWARDED_SIGNALS:
    signal.signal(signum, forward)
  _filter(read_fd, sys.stderr.buffer)
  while True:
    try:
      _, status = os.waitpid(pid, 0)
      break
    except ChildProcessError:
      return 0
    except InterruptedError:
      continue
  if os.WIFSIGNALED(status):
    signum = os.WTERMSIG(status)
    sys.stderr.flush()
    if signum != signal.SIGKILL:  # SIGKILL takes no handler: nothing to reset
      signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # die of the same signal, as the shell does
    return 128 + signum
  return os.WEXITSTATUS(status)


