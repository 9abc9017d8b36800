"""Configuration of the mpistrategy engine.

`Options` is the one configuration object.  Every field can be overridden by
an environment variable `MPISTRATEGY_<FIELD>` (upper case), resolved here by
`Options.from_env`; this module is the only place that reads the environment
(the C++ engine receives the resolved values).

Ranges are checked in one place, in C++ (`EngineConfig::Validate` and the
parsing table of cc/engine/config.cc); `Options` reaches that code through
the small TF-free library `mpistrategy/_config.so` (ctypes) and raises its
messages unchanged, the same ones `mpistrategy.init` would get.  What stays
here is Python's own: types and their coercion (numpy integers, path-like
objects), the parsing of environment strings and the warning about unknown
variables.
"""

import ctypes
import dataclasses
import numbers
import operator
import os
import threading
import warnings

__all__ = ["Options"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
# Where the validation library is looked for: next to this file (`make
# build` copies it there, pip installs it there), then Bazel's output tree of
# a source checkout.
CONFIG_LIBRARY_PATHS = [
    os.path.join(_PACKAGE, "_config.so"),
    os.path.join(os.path.dirname(_PACKAGE), "bazel-bin", "cc", "_config.so"),
]
# StatusCode kInvalidArgument (cc/common/common.h).
_INVALID_ARGUMENT = 3

# The fields the C++ engine receives (`engine_config`), and those the C++
# configuration table checks (the engine's and Python's own timeout).
ENGINE_FIELDS = (
    "fusion_threshold_bytes", "cycle_time_ms", "fusion_wait_ms", "autotune",
    "autotune_log", "cache_capacity", "stall_warning_seconds",
    "stall_timeout_seconds", "peer_timeout_seconds", "timeline",
    "hierarchical_allreduce", "data_plane", "shm_bytes",
)
_VALIDATED_FIELDS = ENGINE_FIELDS + ("checkpoint_read_timeout_seconds",)

_INT_FIELDS = ("fusion_threshold_bytes", "cache_capacity", "shm_bytes")
_FLOAT_FIELDS = ("cycle_time_ms", "fusion_wait_ms", "stall_warning_seconds",
                 "stall_timeout_seconds", "peer_timeout_seconds",
                 "checkpoint_read_timeout_seconds")
_PATH_FIELDS = ("timeline", "autotune_log")
_BOOL_FIELDS = ("autotune", "hierarchical_allreduce", "abort_on_exception",
                "verbose")

_ENV_PREFIX = "MPISTRATEGY_"

# MPISTRATEGY_* variables that are not Options fields but are read by other
# tools (the build, the test runner, the quiet wrapper), so `from_env` must
# not warn about them.
_NON_OPTION_VARIABLES = frozenset({
    "MPISTRATEGY_CUDA",           # setup.py (build the GPU kernels)
    "MPISTRATEGY_PREBUILT_LIBRARY",  # setup.py
    "MPISTRATEGY_PREBUILT_CONFIG_LIBRARY",  # setup.py
    "MPISTRATEGY_CUDA_LINK",      # third_party/gpu (Bazel --config=cuda)
    "MPISTRATEGY_QUIET_WRAPPER",  # python -m mpistrategy.quiet (_output.py)
    "MPISTRATEGY_TEST_TIMEOUT",   # tests/mpirun_pytest.sh
    "MPISTRATEGY_PREEMPTION_SIGNAL",  # mpistrategy/preemption.py
    "MPISTRATEGY_RESTART_COUNT",  # python -m mpistrategy.run --restarts
})

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _horovod_bool(text):
  """A HOROVOD_* switch: Horovod's integers (above 0 is on) or the words.

  Horovod reads these with strtol, so "false" is off there; "true" too,
  which no user means.  Anything else is refused, not read as on.
  """
  word = text.strip().lower()
  if word in _TRUE or word in _FALSE:
    return word in _TRUE
  try:
    return int(word) > 0
  except ValueError:
    raise ValueError("accepted values are an integer (above 0 is on) or "
                     f"{'/'.join(_TRUE)} and {'/'.join(_FALSE)}") from None


# Horovod's environment variables that have an Options field, as
# variable -> (field, parse).  They count once the Horovod layer is imported
# (`count_horovod_variables`), below the MPISTRATEGY_* variables, for every
# start of the engine: a Horovod job script's settings must apply whether
# hvd.init() or an MPIStrategy created first starts it.
HOROVOD_VARIABLES = {
    "HOROVOD_FUSION_THRESHOLD": ("fusion_threshold_bytes", int),
    "HOROVOD_CYCLE_TIME": ("cycle_time_ms", float),
    "HOROVOD_CACHE_CAPACITY": ("cache_capacity", int),
    "HOROVOD_TIMELINE": ("timeline", str),
    "HOROVOD_AUTOTUNE": ("autotune", _horovod_bool),
    "HOROVOD_AUTOTUNE_LOG": ("autotune_log", str),
    "HOROVOD_STALL_CHECK_TIME_SECONDS": ("stall_warning_seconds", float),
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": ("stall_timeout_seconds", float),
    "HOROVOD_HIERARCHICAL_ALLREDUCE": ("hierarchical_allreduce",
                                       _horovod_bool),
}
_count_horovod_variables = False


def count_horovod_variables():
  """Makes `Options.from_env` read HOROVOD_VARIABLES too (the Horovod layer)."""
  global _count_horovod_variables
  _count_horovod_variables = True


def _horovod_changes(environ):
  """{field: (variable, value)} from the set HOROVOD_* variables."""
  changes = {}
  if not _count_horovod_variables:
    return changes
  for variable, (name, parse) in HOROVOD_VARIABLES.items():
    text = environ.get(variable, "")
    if text == "":
      continue
    if parse in (int, float):  # says what it accepts, as for MPISTRATEGY_*
      changes[name] = (variable, _parse_env(variable, name, parse, text))
      continue
    try:
      changes[name] = (variable, parse(text))
    except ValueError as error:
      why = f"; {error}" if parse is _horovod_bool else ""
      raise ValueError(f"environment variable {variable}={text!r} is not a "
                       f"valid Options.{name}{why}") from None
  return changes


def name_horovod_sources(message, environ=None):
  """`message` naming the HOROVOD_* variables that set its fields.

  The engine's errors name a field's MPISTRATEGY_* variable
  ("Options.timeline (MPISTRATEGY_TIMELINE): ..."); where a HOROVOD_*
  variable gave the value instead (no MPISTRATEGY_* one is set), that one
  is named.

  Args:
    message: an error message of the engine.
    environ: the mapping the options were read from; default `os.environ`.

  Returns:
    The message, with those variable names replaced.
  """
  environ = os.environ if environ is None else environ
  for name, (variable, _) in _horovod_changes(environ).items():
    ours = _ENV_PREFIX + name.upper()
    if environ.get(ours, "") == "":
      message = message.replace(f"({ours})", f"({variable})")
  return message


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
      While the rank stays idle the sleep doubles after each empty cycle
      (from 1 microsecond where this is less), up to 16 ms (or this, if
      larger), so that an idle engine takes little
      CPU from TensorFlow.  Submitting a tensor wakes it immediately (and
      resets the sleep), so this is not a latency floor; it bounds how
      stale the stall inspector's view can get.  A number > 0 and at most
      1000.  Default 1.
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
      error.  (A rank whose engine is inside a blocking MPI transfer of
      tensor data with a silent rank prints the message, but its pending
      collectives cannot fail before the job ends.)  Ranks cut off from
      rank 0 stop by themselves after the same time.  A rank frozen for
      less than this resumes normally.  A number >= 0; 0 disables it
      (silent peers are waited for forever).  Default 120: long enough for
      a machine under heavy load, short enough that a hung job does not
      hold its nodes for long; set 0 when a rank may be stopped in a
      debugger.
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
      shares), and when the job spans several hosts, MPI between hosts for
      allreduce (each rank's share across hosts, or each host's sum from
      its first rank where hosts run different numbers of ranks) and MPI
      for the other collectives; where that cannot be used (one rank per
      host, /dev/shm too small or missing) everything goes through MPI and
      rank 0 logs why once.  "mpi": MPI only.  "shm": as "auto", but a
      job that cannot use shared memory fails to start, saying why (a job
      of one process needs no data plane and runs with any value).
      Alltoall always uses MPI.  The segment is unlinked from /dev/shm as
      soon as every rank of the host has mapped it, so nothing is left
      behind however the job ends.
    shm_bytes: Size of each host's shared-memory segment in bytes (taken
      from /dev/shm).  Tensors move through it in rounds of at most 1 MiB
      per rank (rounds that small are still in the caches when the other
      ranks read them), less where the segment holds less than 2 MiB per
      rank of the host.  An integer >= 1048576.  Default 16777216 (16 MiB).
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
    ValueError: A field has an out-of-range value (the message is the C++
      validation's, naming `Options.<field>`, what it accepts and the
      value).
    ImportError: The validation library `mpistrategy/_config.so` is
      missing (a source checkout that was not built: run `make build`).
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
    for name in _INT_FIELDS:
      _coerce_int(self, name)
    for name in _FLOAT_FIELDS:
      _coerce_float(self, name)
    for name in _PATH_FIELDS:
      _coerce_path(self, name)
    # The name's spelling is Python's business; its value is checked by C++.
    if not isinstance(self.data_plane, str):
      raise TypeError(
          'Options.data_plane must be "auto", "mpi" or "shm", got '
          f"{type(self.data_plane).__name__} {self.data_plane!r}")
    object.__setattr__(self, "data_plane", self.data_plane.strip().lower())
    for name in _BOOL_FIELDS:
      value = getattr(self, name)
      if not isinstance(value, bool):
        raise TypeError(
            f"Options.{name} must be True or False, got "
            f"{type(value).__name__} {value!r}")
    message = validation_error(config_text(self, _VALIDATED_FIELDS))
    if message is not None:
      raise ValueError(message)

  @classmethod
  def from_env(cls, base=None, environ=None):
    """Returns `base` with the `MPISTRATEGY_<FIELD>` overrides applied.

    Once the Horovod layer is imported, Horovod's variables of
    `HOROVOD_VARIABLES` apply too, below the `MPISTRATEGY_*` ones.  Unknown
    `MPISTRATEGY_*` variables are reported with a warning naming them and
    the known ones (they are usually typos).

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
    # HOROVOD_* first (where the Horovod layer counts them): MPISTRATEGY_*
    # variables of the same field win.
    sources = {}
    changes = {}
    for name, (variable, value) in _horovod_changes(environ).items():
      sources[name] = variable
      changes[name] = value
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
      sources[name] = variable
    if not changes:
      return base
    try:
      return dataclasses.replace(base, **changes)
    except (TypeError, ValueError) as e:
      variables = ", ".join(f"{sources[n]}={environ[sources[n]]!r}"
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


def _coerce_int(options, name):
  value = getattr(options, name)
  if isinstance(value, bool):
    raise TypeError(f"Options.{name} must be an integer, got bool {value!r}")
  try:
    value = operator.index(value)  # int, numpy integers; not float or str
  except TypeError:
    raise TypeError(
        f"Options.{name} must be an integer, got {type(value).__name__} "
        f"{value!r}") from None
  object.__setattr__(options, name, value)


def _coerce_float(options, name):
  value = getattr(options, name)
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(
        f"Options.{name} must be a number, got {type(value).__name__} "
        f"{value!r}")
  object.__setattr__(options, name, float(value))


def _coerce_path(options, name):
  value = getattr(options, name)
  if value is None:
    value = ""
  if isinstance(value, os.PathLike):
    value = os.fspath(value)
  if not isinstance(value, str):
    raise TypeError(
        f"Options.{name} must be a file path (str) or empty, got "
        f"{type(getattr(options, name)).__name__} {getattr(options, name)!r}")
  if "\0" in value:  # it would end its "key=value" entry early
    raise ValueError(f"Options.{name} must not contain a NUL character")
  object.__setattr__(options, name, value)


def config_text(options, names=ENGINE_FIELDS):
  """The configuration text of the C++ side: "key=value" entries, NUL-ended.

  What `mpistrategy_init` (the engine) and `mpistrategy_validate_config`
  take; the keys are field names, parsed by one table in
  cc/engine/config.cc.

  Args:
    options: An `Options` (its values have their final types).
    names: The fields to write; default the engine's (`ENGINE_FIELDS`).

  Returns:
    bytes.
  """
  entries = []
  for name in names:
    value = getattr(options, name)
    if isinstance(value, bool):
      text = "1" if value else "0"
    elif isinstance(value, float):
      text = repr(value)  # round-trips; "inf" and "nan" included
    else:
      text = str(value)
    entries.append(f"{name}={text}\0".encode(errors="surrogateescape"))
  return b"".join(entries)


_library_lock = threading.Lock()
_library = None


def _config_library():
  """The ctypes handle of mpistrategy/_config.so, loaded once."""
  global _library
  with _library_lock:
    if _library is not None:
      return _library
    found = [p for p in CONFIG_LIBRARY_PATHS if os.path.isfile(p)]
    if not found:
      raise ImportError(
          "mpistrategy's option validation library _config.so was not found "
          f"(looked in {', '.join(CONFIG_LIBRARY_PATHS)}); build it with "
          "`make build` in the source checkout (or `bazel build "
          "//cc:_config.so`)")
    try:
      library = ctypes.CDLL(os.path.abspath(found[0]))
      validate = library.mpistrategy_validate_config
    except (OSError, AttributeError) as e:
      raise ImportError(
          f"mpistrategy's option validation library {found[0]} failed to "
          f"load: {e}; rebuild it with `make build`") from e
    validate.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
                         ctypes.c_int]
    validate.restype = ctypes.c_int
    _library = library
    return _library


def validation_error(text):
  """Runs the C++ validation on configuration text.

  Args:
    text: bytes, as `config_text` writes them.

  Returns:
    None when every value is valid, else the C++ message (str).
  """
  error_buf = ctypes.create_string_buffer(4096)
  code = _config_library().mpistrategy_validate_config(
      text, len(text), error_buf, len(error_buf))
  if code == 0:
    return None
  message = error_buf.value.decode(errors="replace")
  if code != _INVALID_ARGUMENT:  # the C++ side has no other answer today
    message = f"option validation failed (status {code}): {message}"
  return message


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
