"""The names that pair a collective across ranks.

A collective is matched across ranks by name.  Without an explicit
`name`, calls inside a `tf.function` are named `<function graph path>/<name
scope>/<op>`, which is identical on every rank because every rank traces the
same program.  The graph path is the `tf.function` and the control-flow
branches and gradient graphs inside it (e.g. `train_step/cond_true/...`),
not the functions that call it (a function is traced where it is first
called, which can differ between ranks), with TensorFlow's process-global
uid suffixes removed, so a rank that traced more functions than the others
(say, rank 0 saving a checkpoint) still agrees.  The name scope loses
TensorFlow's `_<n>` suffixes too, which count earlier uses in the same
trace, and a graph's collectives of the same name are numbered in the
order they are created (`#1`, `#2`, ...), so that a rank that traced a
function again (a last batch of another shape) names its collectives as
the first trace did.

Eager calls are named `eager/<op>`, the same name for every call: an eager
call blocks until its collective is done, so one thread has at most one in
flight, and eager code runs in the same order on every rank.  The name is
an op attribute and TensorFlow builds and caches one kernel per distinct set
of attributes, so a name that changed per call would build a new kernel
every call (about 0.5 ms, and a cache that only grows) and miss the engine's
response cache.  For the same reason an explicit `name` should not contain
a step counter.  Only the main thread may rely on default eager names: in
any other thread an eager collective without `name=` raises `ValueError`,
because calls of several threads have no order that is the same on every
rank (their results would silently mix up the threads' values).  Other
threads either pass explicit names that agree across ranks and differ
between threads, or run inside `collective_names(prefix)`, which allows
their default eager names and puts `<prefix>/` before the name of every
collective they issue or trace (the way for calls without a `name=`
argument: `strategy.reduce`, variable creation, a distributed dataset's
iterator, Keras' steps).  The prefixes are a context variable: each thread
and each asyncio task has its own.  The thread in which an eager
`strategy.run` runs the replica's function while its caller waits names
its calls as the caller does (`named_as_caller`).

An explicit `name` is used as-is (after any `collective_names` prefixes).
A default name made while a communicating Keras call runs (`model.fit`,
`evaluate`, `predict`, `save`, ...; see `mpistrategy.compat`) starts with
that call, e.g.
`Model.evaluate/eager/allreduce` or `Model.fit/Model.evaluate/<graph
path>/allreduce_1`, so a stall warning or timeout says which Keras call the
waiting ranks are in, and collectives of different Keras calls never pair.
"""

import collections
import contextlib
import contextvars
import functools
import re
import threading
import weakref

import tensorflow as tf


def tensor_name(name, kind):
  """The name pairing this collective across ranks (see module docstring)."""
  _COMMUNICATING_THREADS.add(threading.get_ident())
  if name is not None:
    return _under(_naming_of_this_thread()[1], name)
  if tf.executing_eagerly():
    scopes = _scopes_or_raise(f"mpistrategy.ops.{kind}")
    return _under(scopes, library_name(f"eager/{kind}"))
  graph = tf.compat.v1.get_default_graph()
  return _under(_naming_of_this_thread()[1], library_name(
      f"{_graph_path(graph)}/{_name_in_graph(graph, kind)}"))


def library_name(name):
  """`name` after the communicating Keras calls this thread is inside.

  Default names get them, and so do the library's own explicit names (e.g.
  "Model.evaluate/MPIStrategy/dataset_shape"), so a stall says which call
  the waiting ranks are in.

  Args:
    name: the collective's own name.

  Returns:
    The name to pass as `name=`.
  """
  return _under(entry_points(), name)


def _under(prefixes, name):
  """`name` after each of `prefixes`, outermost first, joined by "/"."""
  return "".join(f"{prefix}/" for prefix in prefixes) + name


# Threads that issued or traced a collective (`threading.get_ident()`): an
# exception that ends one of them leaves the other ranks waiting, so the
# runtime's thread excepthook ends the job for those (runtime.py).
_COMMUNICATING_THREADS = set()


def thread_communicated(ident):
  """True where the thread `ident` issued or traced a collective."""
  return ident in _COMMUNICATING_THREADS


# The public calls (e.g. "Model.evaluate") this thread is inside, outermost
# first; pushed by `entry_point`.
_entry = threading.local()


def entry_points():
  """The public calls that communicate which this thread is inside.

  Returns:
    A tuple of str, outermost first, e.g. `("Model.fit", "Model.evaluate")`.
  """
  return tuple(getattr(_entry, "stack", ()))


class entry_point:  # pylint: disable=invalid-name
  """`with entry_point("Model.evaluate"):` names the collectives inside.

  Used by `mpistrategy.compat.keras` around Keras' public methods.  A call
  of the same entry directly inside itself (a subclass's `fit` calling
  `super().fit`) is recorded once.
  """

  def __init__(self, name):
    self._name = name
    self._pushed = False

  def __enter__(self):
    stack = getattr(_entry, "stack", None)
    if stack is None:
      stack = _entry.stack = []
    if not stack or stack[-1] != self._name:
      stack.append(self._name)
      self._pushed = True
    return self

  def __exit__(self, *unused_exc):
    if self._pushed:
      _entry.stack.pop()
    return False


# The prefixes of `collective_names`, outermost first: a context variable,
# so each thread and each asyncio task has its own.
_scopes = contextvars.ContextVar("mpistrategy_collective_names", default=())
# `caller`: in the thread of an eager `strategy.run`, the naming of the
# thread that called it (`named_as_caller`).
_replica = threading.local()


@contextlib.contextmanager
def collective_names(prefix):
  """Prefixes the names of the collectives of this thread (or asyncio task).

  Default eager names pair each rank's k-th call with every other rank's
  k-th call, which is only defined within one thread, so outside the main
  thread eager collectives without `name=` raise `ValueError`.  Inside this
  context they are allowed in any thread: a training loop in a worker
  thread, or calls without a `name=` argument (`strategy.reduce`,
  `strategy.gather`, variables created under `strategy.scope()`, iterating
  a distributed dataset).  Every collective issued or traced here is named
  `<prefix>/<its name>` (explicit names, the library's own and those of a
  `tf.function` traced here too), so threads or tasks that communicate at
  the same time under different prefixes never pair with each other.  A
  `tf.function` keeps the names of the context it was traced in: give
  each thread its own.

  Args:
    prefix: a non-empty str, the same on every rank for the same thread's
      work and different for each thread that communicates at the same
      time (e.g. "trainer", or f"worker{i}").  Nested contexts join their
      prefixes with "/".

  Yields:
    None.

  Raises:
    ValueError: if `prefix` is not a non-empty str.
  """
  if not isinstance(prefix, str) or not prefix:
    raise ValueError("mpistrategy.collective_names: prefix must be a "
                     f"non-empty str, got {prefix!r}")
  token = _scopes.set(_scopes.get() + (prefix,))
  try:
    yield
  finally:
    _scopes.reset(token)


def _naming_of_this_thread():
  """(may use default eager names, `collective_names` prefixes)."""
  caller = getattr(_replica, "caller", None)
  if caller is not None:
    return caller
  scopes = _scopes.get()
  return (bool(scopes) or
          threading.current_thread() is threading.main_thread()), scopes


def named_as_caller(fn):
  """`fn`, to run in the thread of an eager `strategy.run`.

  Outside a `tf.function`, `strategy.run` runs the replica's function in a
  thread of its own (`mirrored_run`) while the calling thread waits, never
  both at once, so with one replica per process that thread's collectives
  (an optimizer's variables broadcast as it builds them, a
  `ReplicaContext.all_reduce`) keep the caller's program order: they are
  named as the caller's would be, and allowed where the caller's are.

  Args:
    fn: the replica's function (not a `tf.function`, whose collectives
      are named by its graph).

  Returns:
    A function calling `fn` with the calling thread's eager naming.
  """
  caller = _naming_of_this_thread()

  @functools.wraps(fn)
  def fn_named_as_caller(*args, **kwargs):
    _replica.caller = caller
    try:
      return fn(*args, **kwargs)
    finally:
      _replica.caller = None

  return fn_named_as_caller


def check_default_name(call, takes_name=True):
  """Raises where this thread may not name `call`'s collectives by default.

  For a public call that names its collectives itself when given no name
  (e.g. `hvd.broadcast_object`, "broadcast_object/length"): such names pair
  across threads as default eager names do, so they follow the same rule.
  Traced calls are named by their graph and always allowed.

  Args:
    call: the public call, for the message, e.g. "hvd.barrier".
    takes_name: whether `call` takes `name=`, for the message.

  Raises:
    ValueError: this thread may not use default eager names.
  """
  if tf.executing_eagerly():
    _scopes_or_raise(call, takes_name)


def _scopes_or_raise(call, takes_name=True):
  """The prefixes of this thread's default eager names.

  Default eager names (`eager/<op>`) pair the k-th call of each rank with
  the k-th call of every other rank: program order, as long as one thread
  issues them.  Among several threads the order is whatever the threads
  happen to reach the engine in, which differs across ranks, so results
  would silently mix up different threads' values.  The main thread is the
  one thread that is the same on every rank (a first-come owner would not
  be: a different thread may come first on each rank), so it alone may use
  default eager names; every other thread must pass `name=` or name its
  calls with `collective_names`.

  Args:
    call: the public call, for the message, e.g. "mpistrategy.ops.allreduce".
    takes_name: whether `call` takes `name=`, for the message.

  Returns:
    A tuple of str, the `collective_names` prefixes, outermost first.

  Raises:
    ValueError: this thread may not use default eager names.
  """
  allowed, scopes = _naming_of_this_thread()
  if allowed:
    return scopes
  current = threading.current_thread()
  pass_a_name = f"pass name= to {call}, " if takes_name else ""
  raise ValueError(
      f"{call}: an eager collective without `name=` can "
      f"only be issued from the main thread, and this is thread "
      f"{current.name!r}. Default eager names pair calls across ranks by "
      "their order, which is not defined between threads, so results would "
      "silently mix up different threads' values. Run this thread's work "
      "inside `with mpistrategy.collective_names(prefix):` (the same prefix "
      "on every rank, a different one for each thread, e.g. "
      "f\"worker{i}\"; this also covers strategy.reduce, variable creation "
      f"and dataset iteration, which take no name), {pass_a_name}"
      "or issue the collective from the main thread.")


# TensorFlow appends process-global uids to the names of the graphs it
# creates for cond/while branches and gradients ("cond_true_48",
# "while_body_115", "__backward_f_12", "cond_true_48_grad_69").  Those uids
# count every graph built in the process, so they differ across ranks as soon
# as one rank traces something the others do not (e.g. rank 0 saving a
# checkpoint): they are dropped.  The chain of enclosing graphs keeps names
# of branches of different functions apart.
_TF_UID = re.compile(r"_\d+(?=_|$)")


# The names a graph's collectives took so far, by name without ordinal.
_TAKEN = weakref.WeakKeyDictionary()
# The suffixes that make a name unique: TensorFlow's in its graph (`_1` for
# a scope's second use) after Keras' in the process (optimizer `sgd_1`).
_SCOPE_ORDINAL = re.compile(r"(_\d+)+$")


def _name_in_graph(graph, kind):
  """`<name scope>/<kind>`, unique in `graph` by the order of creation.

  TensorFlow makes a name scope unique by appending `_1`, `_2`, ... for
  each earlier use in the same graph, so its names depend on what this
  trace did before: the first trace of a custom training step also builds
  the optimizer (`sgd`), and its apply scope becomes `sgd_1`, while a
  later trace (a rank whose last batch has another shape) applies under
  `sgd`; Keras, too, numbers an optimizer named like an earlier one
  (`sgd_1`, whose second use is `sgd_1_1`).  Those ordinals are dropped,
  and the graph's collectives of the same name are told apart by the order
  in which they are created, which is the same in every trace of the same
  code.

  Args:
    graph: the graph the collective is created in.
    kind: the op, e.g. "allreduce".

  Returns:
    The name, e.g. "sgd/MPIAllReduce/allreduce" or, for the next one of
    that name, "sgd/MPIAllReduce/allreduce#1".
  """
  scope = graph.get_name_scope()
  parts = [_SCOPE_ORDINAL.sub("", part) for part in scope.split("/") if part]
  base = "/".join(parts + [kind])
  taken = _TAKEN.setdefault(graph, collections.Counter())
  ordinal = taken[base]
  taken[base] += 1
  return base if ordinal == 0 else f"{base}#{ordinal}"


def _graph_path(graph):
  """"function/branch" names of `graph` and its enclosing graphs.

  The path climbs through control-flow branches and gradient graphs to the
  `tf.function` they belong to, and stops there.  The functions that call
  that one are left out: a function is traced where it is first called, and
  that place can differ between ranks (rank 0 calls `step` directly first
  and later reuses that trace inside `two_steps`, while rank 1, whose batch
  had another shape, traces `step` anew inside `two_steps`).

  Args:
    graph: the graph a collective is created in.

  Returns:
    e.g. "train_step", "train_step/cond_true" or "step/__backward_step".
  """
  parts = []
  while graph is not None:
    name = getattr(graph, "name", None)  # plain tf.Graph: no name
    if not isinstance(name, str) or not name:
      break
    parts.append(_TF_UID.sub("", name))
    if not _belongs_to_outer_graph(graph, name):
      break
    graph = getattr(graph, "outer_graph", None)
  return "/".join(reversed(parts)) or "graph"


def _belongs_to_outer_graph(graph, name):
  """True for a control-flow branch or a function's gradient graph.

  Both are part of the function that encloses them (a gradient graph's
  outer graph is the function it differentiates); any other named graph
  is a traced function of its own.
  """
  return (getattr(graph, "is_control_flow_graph", False) or
          name.startswith("__backward_"))
