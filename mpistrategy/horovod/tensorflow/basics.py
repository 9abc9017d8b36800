"""Process control and build queries of `mpistrategy.horovod.tensorflow`.

Horovod's `init`, `rank`, `size`, ... on mpistrategy's engine.  As in
Horovod, everything but `init`, `is_initialized`, `shutdown` and the build
queries raises `ValueError` before `init()`.  `init()` is collective: every
rank calls it (it exchanges each rank's host placement once, for
`cross_rank`, `cross_size` and `is_homogeneous`).
"""

import os
import threading

import tensorflow as tf

import mpistrategy
from mpistrategy import compat
from mpistrategy import ops
from mpistrategy import options as options_lib
from mpistrategy import runtime

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank",
    "local_size", "cross_rank", "cross_size", "is_homogeneous",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
    "rocm_built", "rank_op", "size_op", "local_rank_op", "local_size_op",
    "process_set_included_op", "ProcessSet", "global_process_set",
    "check_process_set", "check_initialized",
]

_NOT_INITIALIZED = ("Horovod has not been initialized; use hvd.init() "
                    "(mpistrategy.horovod: call hvd.init() on every rank)")

class _Topology:
  """What `init()` learned about the placement of the ranks."""

  def __init__(self):
    self.lock = threading.Lock()
    self.cross_rank = None
    self.cross_size = None
    self.homogeneous = None


_topology = _Topology()


class ProcessSet:
  """Horovod's process set; only the global one (all ranks) is provided.

  `hvd.ProcessSet(ranks)` for a subset of the ranks raises
  `NotImplementedError`: every collective of this layer runs on all ranks.

  Args:
    ranks: the ranks of the set; must be all ranks.

  Raises:
    NotImplementedError: `ranks` is an MPI communicator (Horovod's other
      way to make a set).
  """

  def __init__(self, ranks=None):
    if ranks is not None and hasattr(ranks, "Get_size"):
      raise NotImplementedError(
          f"hvd.ProcessSet({type(ranks).__name__}): process sets from an MPI "
          "communicator are not provided by mpistrategy.horovod; every "
          "collective runs on all ranks: use hvd.global_process_set or leave "
          "process_set out")
    self._ranks = None if ranks is None else sorted(ranks)
    # Horovod numbers a set when it is registered; only the global set
    # (id 0) ever is here.  The size is unknown before init(), so a subset
    # raises when it is used, not here.
    self.process_set_id = 0 if ranks is None else None

  def _check(self):
    if self._ranks is not None and self._ranks != list(range(size())):
      raise NotImplementedError(
          f"process sets are not provided by mpistrategy.horovod (got a "
          f"ProcessSet of ranks {self._ranks}); every collective runs on all "
          "ranks: use hvd.global_process_set or leave process_set out")

  @property
  def ranks(self):
    """The set's ranks: all ranks for the global set ([] before init())."""
    if self._ranks is not None:
      return list(self._ranks)
    return list(range(size())) if is_initialized() else []

  def size(self):
    self._check()
    return size()

  def rank(self):
    self._check()
    return rank()

  def included(self):
    self._check()
    return True

  def __repr__(self):
    ranks = "all" if self._ranks is None else self._ranks
    return f"ProcessSet(process_set_id={self.process_set_id}, ranks={ranks})"


global_process_set = ProcessSet()


def check_process_set(process_set, fn):
  """Raises NotImplementedError unless `process_set` is the global set.

  Args:
    process_set: what the caller passed.
    fn: the calling function's name, for the message.
  """
  if process_set is None or process_set is global_process_set:
    return
  if isinstance(process_set, ProcessSet):
    try:
      process_set._check()  # pylint: disable=protected-access
      return
    except NotImplementedError:
      pass
  raise NotImplementedError(
      f"{fn}: process sets are not provided by mpistrategy.horovod (got "
      f"process_set={process_set!r}); every collective runs on all ranks: "
      "leave process_set out")


def check_initialized():
  """Raises ValueError (as Horovod) when `init()` was not called."""
  if not mpistrategy.is_initialized():
    raise ValueError(_NOT_INITIALIZED)


def init(comm=None, process_sets=None):
  """Starts mpistrategy's engine on all ranks (collective: every rank calls).

  Idempotent, as Horovod's.  Horovod's tuning variables
  (HOROVOD_FUSION_THRESHOLD, HOROVOD_CYCLE_TIME, HOROVOD_TIMELINE,
  HOROVOD_AUTOTUNE, HOROVOD_CACHE_CAPACITY, HOROVOD_STALL_CHECK_TIME_SECONDS,
  HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, HOROVOD_HIERARCHICAL_ALLREDUCE) become
  the matching `mpistrategy.Options`; MPISTRATEGY_* variables win over them.
  They apply to any start of the engine once `mpistrategy.horovod` is
  imported, so an engine that an `MPIStrategy` started first already has
  them and is kept as it is.

  Args:
    comm: None (all ranks), or a list of all ranks; sub-communicators are
      not provided.
    process_sets: None or []; process sets are not provided.

  Raises:
    NotImplementedError: `comm` is a subset or an MPI communicator, or
      `process_sets` is given.
    ValueError: an option is invalid, or the engine runs with other options
      than the HOROVOD_* variables ask for (it was started before
      `mpistrategy.horovod` was imported).
  """
  if process_sets:
    raise NotImplementedError(
        "hvd.init(process_sets=...): process sets are not provided by "
        "mpistrategy.horovod; every collective runs on all ranks")
  if mpistrategy.is_initialized():
    _check_running_options()
  else:
    mpistrategy.init()
  if comm is not None:
    if (isinstance(comm, (list, tuple, range)) and
        sorted(comm) == list(range(mpistrategy.size()))):
      pass
    else:
      raise NotImplementedError(
          f"hvd.init(comm={comm!r}): only the world of all ranks is provided "
          "by mpistrategy.horovod (no sub-communicators, no mpi4py "
          "communicators); start the job with the ranks you want instead")
  _exchange_topology()
  # Saves stay Horovod's (each rank writes what it saves) but atomic.
  compat.install_saving_for_horovod(mpistrategy.rank(), mpistrategy.size())


def _check_running_options():
  """Raises ValueError if the running engine lacks a HOROVOD_* setting."""
  running = runtime.current_options()
  wanted = options_lib.Options.from_env(base=running)
  differ = [(variable, name) for variable, (name, _)
            in options_lib.HOROVOD_VARIABLES.items()
            if os.environ.get(variable, "") != "" and
            getattr(wanted, name) != getattr(running, name)]
  if not differ:
    return
  asked = "; ".join(
      f"{variable}={os.environ.get(variable)!r} asks for {name}="
      f"{getattr(wanted, name)!r}, the engine runs with "
      f"{getattr(running, name)!r}" for variable, name in differ)
  raise ValueError(
      f"hvd.init: {asked}.  mpistrategy was started (by MPIStrategy() or "
      "mpistrategy.init()) before mpistrategy.horovod was imported; import "
      "mpistrategy.horovod.tensorflow before creating the strategy, or call "
      "hvd.init() first")


def _exchange_topology():
  """Cross rank/size and homogeneity from every rank's host.

  Horovod's cross communicator joins the ranks of equal local rank (one per
  host); a rank's cross rank is its index among them by world rank.  The
  hosts come from the engines' start-up exchange (`runtime.rank_hosts`),
  so no collective runs here and `init` works in a TF1 graph too.
  """
  hosts = runtime.rank_hosts()
  local_ranks = [hosts[:r].count(host) for r, host in enumerate(hosts)]
  me = mpistrategy.rank()
  peers = [r for r in range(len(hosts)) if local_ranks[r] == local_ranks[me]]
  with _topology.lock:
    _topology.cross_rank = peers.index(me)
    _topology.cross_size = len(peers)
    _topology.homogeneous = len({hosts.count(h) for h in hosts}) == 1


def shutdown():
  """Stops the engine; `init()` may be called again (collectively)."""
  with _topology.lock:
    _topology.cross_rank = None
    _topology.cross_size = None
    _topology.homogeneous = None
  mpistrategy.shutdown()


def start_timeline(file_path, mark_cycles=False):
  """Starts writing the timeline to `file_path` (`mpistrategy.start_timeline`).

  Args:
    file_path: The Chrome-trace file; rank 0 writes it (every rank, with
      "{rank}" in the path).
    mark_cycles: Accepted for Horovod's signature: the timeline always has
      a row of negotiation cycles.

  Raises:
    ValueError: `file_path` cannot be opened for writing.
  """
  del mark_cycles
  check_initialized()
  mpistrategy.start_timeline(file_path)


def stop_timeline():
  """Closes the timeline file (`mpistrategy.stop_timeline`)."""
  check_initialized()
  mpistrategy.stop_timeline()


def is_initialized():
  """Returns True between `init()` and `shutdown()`."""
  return mpistrategy.is_initialized()


def rank():
  """Returns this process's rank in [0, size())."""
  check_initialized()
  return mpistrategy.rank()


def size():
  """Returns the number of processes."""
  check_initialized()
  return mpistrategy.size()


def local_rank():
  """Returns this process's rank among the processes on its host."""
  check_initialized()
  return mpistrategy.local_rank()


def local_size():
  """Returns the number of processes on this process's host."""
  check_initialized()
  return mpistrategy.local_size()


def _topology_value(attribute, fn):
  check_initialized()
  with _topology.lock:
    value = getattr(_topology, attribute)
  if value is None:
    # mpistrategy was started without hvd.init() (e.g. by MPIStrategy).
    raise ValueError(f"hvd.{fn}() needs hvd.init() (called on every rank) "
                     "first")
  return value


def cross_rank():
  """Returns the index of this process's host among the hosts (Horovod's
  cross rank: rank among the processes with the same local rank)."""
  return _topology_value("cross_rank", "cross_rank")


def cross_size():
  """Returns the number of processes with this process's local rank (the
  number of hosts when every host runs as many processes)."""
  return _topology_value("cross_size", "cross_size")


def is_homogeneous():
  """Returns True when every host runs the same number of processes."""
  return _topology_value("homogeneous", "is_homogeneous")


def mpi_threads_supported():
  """Returns True when MPI runs with MPI_THREAD_MULTIPLE."""
  check_initialized()
  return ops.mpi_threads_supported()


def mpi_enabled():
  """Returns True: mpistrategy always runs on MPI."""
  return True


def mpi_built():
  """Returns True: mpistrategy is always built with MPI."""
  return True


def gloo_enabled():
  """Returns False: mpistrategy has no Gloo controller."""
  return False


def gloo_built():
  """Returns False: mpistrategy has no Gloo controller."""
  return False


def nccl_built():
  """Returns True when the op library has NCCL GPU kernels (Horovod returns
  the NCCL version; only its truth value is portable)."""
  return ops.built_with_nccl()


def ddl_built():
  """Returns False: IBM DDL is not supported."""
  return False


def ccl_built():
  """Returns False: Intel oneCCL is not supported."""
  return False


def cuda_built():
  """Returns True when the op library has CUDA kernels."""
  return ops.built_with_cuda()


def rocm_built():
  """Returns False: ROCm is not supported."""
  return False


def _int_op(value, name):
  return tf.constant(value, dtype=tf.int32, name=name)


def size_op(process_set_id=0, name=None):
  """Returns `size()` as an int32 scalar tensor.

  Args:
    process_set_id: 0 (the global process set); others are not provided.
    name: the op name.
  """
  _check_process_set_id(process_set_id, "size_op")
  return _int_op(size(), name)


def local_size_op(name=None):
  """Returns `local_size()` as an int32 scalar tensor."""
  return _int_op(local_size(), name)


def rank_op(name=None):
  """Returns `rank()` as an int32 scalar tensor."""
  return _int_op(rank(), name)


def local_rank_op(name=None):
  """Returns `local_rank()` as an int32 scalar tensor."""
  return _int_op(local_rank(), name)


def process_set_included_op(process_set_id=0, name=None):
  """Returns 1 (int32 tensor): every rank belongs to the global set."""
  _check_process_set_id(process_set_id, "process_set_included_op")
  check_initialized()
  return _int_op(1, name)


def _check_process_set_id(process_set_id, fn):
  if process_set_id != 0:
    raise NotImplementedError(
        f"hvd.{fn}(process_set_id={process_set_id!r}): process sets are not "
        "provided by mpistrategy.horovod; only id 0 (all ranks) exists")
