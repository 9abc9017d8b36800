"""Finds and loads the op library `_mpi_ops.so` (once per process).

The same file is loaded twice: by `tf.load_op_library`, which registers the
ops and kernels and returns the generated op wrappers, and by `ctypes`, which
gives Python the C ABI of cc/kernels/c_api.cc.  Both `dlopen` the same path,
so they get the same handle and share the engine.  Loading also registers
the collectives with tf.function's automatic control dependencies (see
`_register_order_insensitive`).

The runtime (`mpistrategy.runtime`, the C ABI) and the collectives
(`mpistrategy.ops`, the generated wrappers) both sit on this module.
"""

import ctypes
import os
import threading

import tensorflow as tf

from mpistrategy import _tf_private as _tfp

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_PACKAGE)
_NAME = "_mpi_ops.so"

# Where to look, in order: mpistrategy/ops/ (`make build` copies it there,
# pip installs it there), then Bazel's output tree of a source checkout.
# Tests may put a path in front.
SEARCH_PATHS = [
    os.path.join(_PACKAGE, "ops", _NAME),
    os.path.join(_REPO, "bazel-bin", "cc", _NAME),
]

_lock = threading.Lock()
_loaded = None


class Library:
  """The loaded op library.

  Attributes:
    path: The file that was loaded.
    ops: The module `tf.load_op_library` returned (generated op wrappers such
      as `mpi_strategy_allreduce`).
    c: The `ctypes.CDLL` of the same file, with argument and result types set.
  """

  def __init__(self, path, ops, c):
    self.path = path
    self.ops = ops
    self.c = c


# Inside a tf.function, automatic control dependencies chain every stateful op
# without resource inputs in program order.  For these collectives that
# chaining is harmful: the engine pairs them by name, so they need no order,
# and chaining would (a) serialize them, one negotiation round-trip each, so
# nothing is ever fused, and (b) deadlock programs that issue the same
# collectives in different orders on different ranks (each rank would wait
# for its own first op).  Registering them as "must run, order insensitive"
# keeps them from being pruned while letting the executor run them all at
# once.  The barrier is not listed: it keeps program order with other
# stateful ops, which is what a barrier is for.
_ORDER_INSENSITIVE_OPS = frozenset((
    "MpiStrategyAllreduce",
    "MpiStrategyGroupedAllreduce",
    "MpiStrategyAllgather",
    "MpiStrategyBroadcast",
    "MpiStrategyReducescatter",
    "MpiStrategyAlltoall",
))


def _register_order_insensitive():
  """Adds the collectives to TF's order-insensitive stateful ops.

  Done when the library loads (the ops exist from then on), not at import:
  it changes a TensorFlow global.
  """
  acd = _tfp.auto_control_deps
  acd.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS = (
      acd.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS | _ORDER_INSENSITIVE_OPS)


def _declare(c):
  """Sets the ctypes signatures of the C ABI (cc/kernels/c_api.cc)."""
  c.mpistrategy_init.argtypes = [
      ctypes.c_char_p,  # config: "key=value\0" entries (runtime.py)
      ctypes.c_size_t,  # its length in bytes
      ctypes.c_char_p,  # error_buf
      ctypes.c_int,     # error_len
  ]
  c.mpistrategy_init.restype = ctypes.c_int
  c.mpistrategy_tuned_parameters.argtypes = [
      ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_double),
      ctypes.POINTER(ctypes.c_int)]
  c.mpistrategy_tuned_parameters.restype = ctypes.c_int
  c.mpistrategy_set_timeline.argtypes = [ctypes.c_char_p, ctypes.c_char_p,
                                         ctypes.c_int]
  c.mpistrategy_set_timeline.restype = ctypes.c_int
  c.mpistrategy_shutdown.argtypes = []
  c.mpistrategy_shutdown.restype = None
  c.mpistrategy_engine_stopped.argtypes = []
  c.mpistrategy_engine_stopped.restype = ctypes.c_int
  c.mpistrategy_abort.argtypes = [ctypes.c_char_p, ctypes.c_double]
  c.mpistrategy_abort.restype = None
  c.mpistrategy_mpi_abort.argtypes = [ctypes.c_int]
  c.mpistrategy_mpi_abort.restype = None
  c.mpistrategy_describe_rank.argtypes = [ctypes.c_int, ctypes.c_char_p,
                                          ctypes.c_int]
  c.mpistrategy_describe_rank.restype = ctypes.c_int
  c.mpistrategy_rank_hosts.argtypes = [ctypes.c_char_p, ctypes.c_int]
  c.mpistrategy_rank_hosts.restype = ctypes.c_int
  for name in ("is_initialized", "is_forked_child", "rank", "size",
               "local_rank", "local_size",
               "mpi_threads_supported", "built_with_cuda",
               "built_with_nccl"):
    fn = getattr(c, "mpistrategy_" + name)
    fn.argtypes = []
    fn.restype = ctypes.c_int


def load():
  """Returns the `Library`, loading it on the first call.

  Returns:
    A `Library`.

  Raises:
    ImportError: No library was found (it must be built first) or it failed
      to load.
  """
  global _loaded
  with _lock:
    if _loaded is not None:
      return _loaded
    found = [p for p in SEARCH_PATHS if os.path.isfile(p)]
    if not found:
      raise ImportError(
          "mpistrategy's op library _mpi_ops.so was not found (looked in "
          f"{', '.join(SEARCH_PATHS)}); build it with `make build` in the "
          "source checkout (or `bazel build //cc:_mpi_ops.so`)")
    path = os.path.abspath(found[0])
    try:
      ops = tf.load_op_library(path)
      c = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
      _declare(c)
    except (OSError, AttributeError, tf.errors.NotFoundError) as e:
      raise ImportError(
          f"mpistrategy's op library {path} failed to load: {e}. It must be "
          f"built against the installed TensorFlow {tf.__version__}; rebuild "
          "it with `make build`") from e
    _register_order_insensitive()
    _loaded = Library(path, ops, c)
    return _loaded


def loaded():
  """Returns the `Library` if `load()` succeeded already, else None."""
  return _loaded
