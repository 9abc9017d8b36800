"""Configuration of the mpistrategy engine.

`Options` is the one configuration object.  Every field can be overridden by
an environment variable `MPISTRATEGY_<FIELD>` (upper case), resolved here by
`Options.from_env`; this module is the only place that reads the environment
(the C++ engine receives the resolved values).
"""

import dataclasses
import math
import numbers
import operator
import os
import warnings

__all__ = ["Options"]

_ENV_PREFIX = "MPISTRATEGY_"

# MPISTRATEGY_* variables that are not Options fields but are read by other
# tools (the build, the test runner), so `from_env` must not warn about them.
_NON_OPTION_VARIABLES = frozenset({
    "MPISTRATEGY_CUDA_LINK",      # third_party/gpu (Bazel --config=cuda)
    "MPISTRATEGY_TEST_TIMEOUT",   # tests/mpirun_pytest.sh
    "MPISTRATEGY_PREEMPTION_SIGNAL",  # mpistrategy/preemption.py
    "MPISTRATEGY_RESTART_COUNT",  # python -m mpistrategy.run --restarts
})

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Options:
  """Configuration of the mpistrategy engine (immutable).

  Every field can be overridden with the environment variable
  `MPISTRATEGY_<FIELD>`, e.g. `MPISTRATEGY_CYCLE_TIME_MS=5`, when the options
  are resolved with `Options.from_env()` (which `mpistrategy.init()` does).

  Example:

  ```python
  options = mpistrategy.Options(fusion_threshold_bytes=32 << 20,
                                stall_timeout_seconds=600)
  mpistrategy.init(options)
  ```

  Args:
    fusion_threshold_bytes: Ready allreduces of the same dtype, reduce op and
      device are packed into one buffer of at most this many bytes and reduced
      with one transport call.  An integer >= 0; 0 disables fusion.  Default
      64 MiB.
    cycle_time_ms: How long (milliseconds) the engine's background thread
      sleeps when idle before joining an empty negotiation cycle anyway.
      Submitting a tensor wakes it immediately, so this is not a latency
      floor; it bounds how stale the stall inspector's view can get.  A
      number > 0.  Default 1.
    fusion_wait_ms: After the first tensor reaches an idle engine, wait this
      many milliseconds for more before negotiating, so that tensors
      arriving a little apart share a fusion bucket.  A number in
      [0, 1000]; 0 (the default) negotiates at once, so a lone small tensor
      gets no added latency.
    autotune: When True, rank 0 tunes `fusion_threshold_bytes` and
      `fusion_wait_ms` online, starting from the configured values: it
      measures allreduce throughput (bytes per second) of each candidate
      against the current choice in interleaved pairs of samples of a few
      hundred milliseconds, switches only to a candidate that wins at least
      6 of 7 pairs by a median of at least 5 %, and publishes each switch to
      every rank through the negotiation, so all ranks always fuse alike.
      Tuning takes roughly 10-60 seconds of steady traffic, then the
      choice is final (`mpistrategy.ops.tuned_parameters()` reports it).
      Default False.
    autotune_log: Path of a CSV file to which rank 0 appends the
      autotuner's samples and decisions (columns phase,
      fusion_threshold_bytes, fusion_wait_ms, bytes_per_second, gain,
      event); empty (the default) disables it.
    cache_capacity: Number of negotiated collectives remembered for the
      steady-state fast path (bit-vector agreement instead of a gather and a
      broadcast); when full, the least recently used one is forgotten.  An
      integer >= 0; 0 disables the cache.  Default 1024.
    stall_warning_seconds: A collective submitted by some ranks but not by
      others for this long is logged with the missing ranks.  A number >= 0;
      0 disables the warning.  Default 60.
    stall_timeout_seconds: ... and after this long it fails with
      `tf.errors.DeadlineExceededError` on the ranks that submitted it.  A
      number >= 0; 0 (the default) waits forever, as MPI does.
    peer_timeout_seconds: Every rank's engine exchanges heartbeats with
      rank 0 several times a second from its own thread, whatever the Python
      code is doing, so a rank that stays silent is frozen (e.g. SIGSTOP),
      dead, cut off by the network, or its engine stopped.  After
      `stall_warning_seconds` of silence the other ranks log the silent ones
      (as `rank N (host H, pid P)`); after `peer_timeout_seconds` every rank
      that can still run fails its pending and future collectives with
      `tf.errors.UnavailableError` naming them, prints the same message and,
      about a second later, ends its process with `MPI_Abort` (exit status
      14), so the whole job ends even if the Python code catches the
      error.  Ranks cut off from rank 0 stop by themselves after the same
      time.  A rank frozen for less than this resumes normally.  A number
      >= 0; 0 disables it (silent peers are waited for forever).  Default
      120: long enough for a machine under heavy load, short enough that a
      hung job does not hold its nodes for long; set 0 when a rank may be
      stopped in a debugger.
    timeline: Path of a Chrome-trace JSON file (open it in Perfetto or
      chrome://tracing) written by rank 0's engine: one row per collective
      name with its NEGOTIATE, QUEUE, fusion-buffer copy and collective
      spans, and one span per negotiation cycle.  If the path contains
      `{rank}`, every rank writes its own file with `{rank}` replaced by its
      rank (e.g. "/tmp/trace.{rank}.json").  The file is complete after
      `mpistrategy.shutdown()` (or at exit); `mpistrategy.init()` raises
      `ValueError` when it cannot be created.  Empty (the default) disables
      the timeline.
    hierarchical_allreduce: GPU tensors: NCCL inside a node, MPI between
      nodes.  Default False.
    data_plane: How CPU tensors travel.  "auto" (the default): through a
      POSIX shared-memory segment among the ranks of each host (each rank
      reduces its share of every rank's buffer, then copies the others'
      shares), and when the job spans several hosts, with the same number
      of ranks on each, MPI between hosts for allreduce (each rank's share
      across hosts) and MPI for the other collectives; where that cannot
      be used (one rank per host, hosts of different sizes, /dev/shm too
      small or missing) everything goes through MPI and rank 0 logs why
      once.  "mpi": MPI only.  "shm": as "auto", but a job that cannot use
      shared memory fails to start, saying why.  Alltoall always uses MPI.
      The segment is unlinked from /dev/shm as soon as every rank of the
      host has mapped it, so nothing is left behind however the job ends.
    shm_bytes: Size of each host's shared-memory segment in bytes (taken
      from /dev/shm); a tensor larger than this moves in several rounds.
      An integer >= 1048576.  Default 16777216 (16 MiB).
    abort_on_exception: When True (the default) and the world has more than
      one rank, `mpistrategy.init()` installs a `sys.excepthook` that prints
      the uncaught exception prefixed with the rank, tells the other ranks'
      engines (their pending collectives fail with
      `tf.errors.AbortedError` naming this rank) and then calls `MPI_Abort`,
      so no rank hangs waiting for a rank that died.
    checkpoint_read_timeout_seconds: How long a rank waits in a read into
      the strategy's variables (`tf.train.Checkpoint.read/restore`,
      `Model.load_weights`, `BackupAndRestore`'s resume,
      `CheckpointManager.restore_or_initialize`), which every rank must
      make, for the other ranks to make it too; then it fails with
      `tf.errors.DeadlineExceededError` saying so (e.g. code that restores
      on rank 0 only).  A number > 0.  Default 120.
    verbose: When False (the default), ranks other than 0 hide TensorFlow's
      C++ INFO/WARNING lines, Python warnings and the "tensorflow"/"absl"
      loggers' INFO/WARNING records, which every rank would print alike
      (see `mpistrategy.quiet`); errors are never hidden.  True (or
      `MPISTRATEGY_VERBOSE=1`, the launcher's `--verbose`) shows
      everything on every rank.  The start-up lines are decided when
      mpistrategy is imported, so only the variable (or the launcher)
      brings those back.

  Raises:
    TypeError: A field has the wrong type.
    ValueError: A field has an out-of-range value.
  """

  fusion_threshold_bytes: int = 64 << 20
  cycle_time_ms: float = 1.0
  fusion_wait_ms: float = 0.0
  autotune: bool = False
  autotune_log: str = ""
  cache_capacity: int = 1024
  stall_warning_seconds: float = 60.0
  stall_timeout_seconds: float = 0.0
  peer_timeout_seconds: float = 120.0
  timeline: str = ""
  hierarchical_allreduce: bool = False
  data_plane: str = "auto"
  shm_bytes: int = 16 << 20
  abort_on_exception: bool = True
  checkpoint_read_timeout_seconds: float = 120.0
  verbose: bool = False

  def __post_init__(self):
    _check_int(self, "fusion_threshold_bytes", minimum=0,
               hint="an integer >= 0 (0 disables fusion)")
    _check_float(self, "cycle_time_ms", positive=True,
                 hint="a finite number > 0")
    _check_float(self, "fusion_wait_ms", positive=False,
                 hint="a number in [0, 1000] (0 negotiates at once)")
    if self.fusion_wait_ms > 1000:
      raise ValueError(
          "Options.fusion_wait_ms must be a number in [0, 1000] (0 "
          f"negotiates at once), got {self.fusion_wait_ms!r}")
    _check_int(self, "cache_capacity", minimum=0, maximum=2**31 - 1,
               hint="an integer >= 0 (0 disables the cache)")
    _check_float(self, "stall_warning_seconds", positive=False,
                 hint="a number >= 0 (0 disables the warning)")
    _check_float(self, "stall_timeout_seconds", positive=False,
                 hint="a number >= 0 (0 waits forever)")
    _check_float(self, "peer_timeout_seconds", positive=False,
                 hint="a number >= 0 (0 waits for silent peers forever)")
    _check_float(self, "checkpoint_read_timeout_seconds", positive=True,
                 hint="a number > 0")
    for name in ("timeline", "autotune_log"):
      _check_path(self, name)
    if not isinstance(self.data_plane, str):
      raise TypeError(
          'Options.data_plane must be "auto", "mpi" or "shm", got '
          f"{type(self.data_plane).__name__} {self.data_plane!r}")
    if self.data_plane.strip().lower() not in _DATA_PLANES:
      raise ValueError(
          'Options.data_plane must be "auto", "mpi" or "shm", got '
          f"{self.data_plane!r}")
    object.__setattr__(self, "data_plane", self.data_plane.strip().lower())
    _check_int(self, "shm_bytes", minimum=1 << 20, maximum=2**62,
               hint="an integer >= 1048576 (1 MiB)")
    for name in ("autotune", "hierarchical_allreduce", "abort_on_exception",
                 "verbose"):
      value = getattr(self, name)
      if not isinstance(value, bool):
        raise TypeError(
            f"Options.{name} must be True or False, got "
            f"{type(value).__name__} {value!r}")

  @classmethod
  def from_env(cls, base=None, environ=None):
    """Returns `base` with the `MPISTRATEGY_<FIELD>` overrides applied.

    Unknown `MPISTRATEGY_*` variables are reported with a warning naming them
    and the known ones (they are usually typos).

    Args:
      base: The `Options` to start from; default `Options()`.
      environ: The mapping to read; default `os.environ`.

    Returns:
      An `Options`.

    Raises:
      TypeError: `base` is not an `Options`.
      ValueError: A variable's value cannot be parsed or is out of range;
        the message names the variable, the value and what is accepted.
    """
    if base is None:
      base = cls()
    if not isinstance(base, Options):
      raise TypeError(
          f"base must be an mpistrategy.Options, got {type(base).__name__}")
    environ = os.environ if environ is None else environ
    fields = {f.name: f for f in dataclasses.fields(cls)}
    known = sorted(_ENV_PREFIX + name.upper() for name in fields)
    changes = {}
    for variable in sorted(environ):
      if not variable.startswith(_ENV_PREFIX):
        continue
      name = variable[len(_ENV_PREFIX):].lower()
      if name not in fields:
        if variable not in _NON_OPTION_VARIABLES:
          warnings.warn(
              f"Ignoring unknown environment variable {variable}; the known "
              f"mpistrategy variables are {', '.join(known)}",
              stacklevel=2)
        continue
      changes[name] = _parse_env(variable, name, fields[name].type,
                                 environ[variable])
    if not changes:
      return base
    try:
      return dataclasses.replace(base, **changes)
    except (TypeError, ValueError) as e:
      variables = ", ".join(
          f"{_ENV_PREFIX}{n.upper()}={environ[_ENV_PREFIX + n.upper()]!r}"
          for n in changes)
      raise ValueError(f"{e} (from the environment: {variables})") from None

  def replace(self, **changes):
    """Returns a copy with `changes` applied (and validated).

    Args:
      **changes: Field names and their new values.

    Returns:
      An `Options`.

    Raises:
      TypeError: An unknown field name, or a value of the wrong type.
      ValueError: An out-of-range value.
    """
    names = {f.name for f in dataclasses.fields(self)}
    for name in changes:
      if name not in names:
        raise TypeError(
            f"Options has no field {name!r}; the fields are "
            f"{', '.join(sorted(names))}")
    return dataclasses.replace(self, **changes)

  def merge(self, other):
    """Returns these options overridden by the non-default fields of `other`.

    Args:
      other: An `Options` or None (which returns `self`).

    Returns:
      An `Options`.

    Raises:
      TypeError: `other` is not an `Options`.
    """
    if other is None:
      return self
    if not isinstance(other, Options):
      raise TypeError(
          f"other must be an mpistrategy.Options, got {type(other).__name__}")
    defaults = Options()
    changes = {
        f.name: getattr(other, f.name)
        for f in dataclasses.fields(self)
        if getattr(other, f.name) != getattr(defaults, f.name)
    }
    return dataclasses.replace(self, **changes) if changes else self


_DATA_PLANES = ("auto", "mpi", "shm")


def _check_int(options, name, minimum, hint, maximum=None):
  value = getattr(options, name)
  if isinstance(value, bool):
    raise TypeError(f"Options.{name} must be {hint}, got bool {value!r}")
  try:
    value = operator.index(value)  # int, numpy integers; not float or str
  except TypeError:
    raise TypeError(
        f"Options.{name} must be {hint}, got {type(value).__name__} "
        f"{value!r}") from None
  object.__setattr__(options, name, value)
  if value < minimum or (maximum is not None and value > maximum):
    raise ValueError(f"Options.{name} must be {hint}, got {value!r}")


def _check_float(options, name, positive, hint):
  value = getattr(options, name)
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(
        f"Options.{name} must be {hint}, got {type(value).__name__} "
        f"{value!r}")
  value = float(value)
  object.__setattr__(options, name, value)
  if math.isnan(value) or math.isinf(value) or value < 0 or (
      positive and value == 0):
    raise ValueError(f"Options.{name} must be {hint}, got {value!r}")


def _check_path(options, name):
  value = getattr(options, name)
  if value is None:
    value = ""
  if isinstance(value, os.PathLike):
    value = os.fspath(value)
  if not isinstance(value, str):
    raise TypeError(
        f"Options.{name} must be a file path (str) or empty, got "
        f"{type(getattr(options, name)).__name__} {getattr(options, name)!r}")
  object.__setattr__(options, name, value)


def _parse_env(variable, name, field_type, text):
  """Parses one environment override; ValueError names variable and value."""
  stripped = text.strip()
  if not isinstance(field_type, str):
    field_type = field_type.__name__
  if field_type == "bool":
    if stripped.lower() in _TRUE:
      return True
    if stripped.lower() in _FALSE:
      return False
    raise ValueError(
        f"{variable}={text!r} is not a boolean; accepted values are "
        f"{', '.join(_TRUE + _FALSE)} (case-insensitive)")
  if field_type == "int":
    try:
      return int(stripped, 10)
    except ValueError:
      raise ValueError(
          f"{variable}={text!r} is not an integer; Options.{name} accepts a "
          f"decimal integer") from None
  if field_type == "float":
    try:
      return float(stripped)
    except ValueError:
      raise ValueError(
          f"{variable}={text!r} is not a number; Options.{name} accepts a "
          f"decimal number") from None
  return text
