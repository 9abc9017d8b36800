"""mpistrategy.ops without mpirun: a world of size 1, argument checking,
naming, and process-level behaviour (run in subprocesses where it needs a
fresh process or mpirun).

    .venv/bin/python -m pytest tests/single/test_ops_single_process.py
"""

import os
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import tensorflow as tf

import mpistrategy
from mpistrategy import _library
from mpistrategy import ops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
ALL = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64,
       tf.uint8, tf.int8, tf.bool]
NUMERIC = ALL[:-1]
SHAPES = [(), (0,), (17,), (3, 5, 7)]


pytestmark = pytest.mark.usefixtures("single_process_engine")


def value(shape, dtype):
  n = int(np.prod(shape, dtype=np.int64))
  a = (np.arange(n) % 5 + 1).reshape(shape)
  if dtype == tf.bool:
    return tf.constant(a % 2 == 0)
  return tf.constant(a.astype(dtype.as_numpy_dtype), dtype=dtype)


def run(mode, fn, *args):
  return fn(*args) if mode == "eager" else tf.function(fn)(*args)


def _ids(values):
  return [v.name for v in values]


# ------------------------------------------------------------- world size 1


def test_world_of_one():
  assert mpistrategy.is_initialized()
  assert (mpistrategy.rank(), mpistrategy.size()) == (0, 1)
  assert (mpistrategy.local_rank(), mpistrategy.local_size()) == (0, 1)
  assert isinstance(ops.mpi_threads_supported(), bool)
  assert ops.built_with_cuda() in (True, False)
  assert ops.built_with_nccl() in (True, False)


def test_no_excepthook_for_world_of_one():
  assert mpistrategy.current_options().abort_on_exception
  assert sys.excepthook is sys.__excepthook__ or (
      getattr(sys.excepthook, "__name__", "") != "_abort_on_exception")


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ALL, ids=_ids(ALL))
def test_every_op_is_identity_like(dtype, shape, mode):
  x = value(shape, dtype)

  def body(t):
    out = {
        "sum": ops.allreduce(t),
        "min": ops.allreduce(t, op=ops.Min),
        "max": ops.allreduce(t, op=ops.Max),
        "product": ops.allreduce(t, op=ops.Product),
        "grouped": ops.grouped_allreduce([t, t])[1],
        "broadcast": ops.broadcast(t, root_rank=0),
    }
    if dtype.is_floating:
      out["mean"] = ops.allreduce(t, op=ops.Average)
    if shape:
      out["allgather"] = ops.allgather(t)
      out["alltoall"], out["received"] = ops.alltoall(t)
      if dtype != tf.bool:
        out["reducescatter"] = ops.reducescatter(t)
    return out

  out = run(mode, body, x)
  received = out.pop("received", None)
  if received is not None:
    np.testing.assert_array_equal(received.numpy(), [shape[0]])
  for key, y in out.items():
    assert y.dtype == dtype, key
    assert tuple(y.shape) == shape, key
    np.testing.assert_array_equal(y.numpy(), x.numpy(), err_msg=key)


def test_barrier():
  assert ops.barrier() is None
  assert ops.barrier(name="named-barrier") is None


def test_large_allreduce():
  x = tf.range(1 << 20, dtype=tf.float32)
  np.testing.assert_array_equal(ops.allreduce(x).numpy(), x.numpy())


def test_gradients_single_rank():
  x = tf.Variable([1.0, 2.0])
  with tf.GradientTape(persistent=True) as tape:
    a = tf.reduce_sum(ops.allreduce(x) * 3.0)
    g = tf.reduce_sum(ops.allgather(x) * 2.0)
    b = tf.reduce_sum(ops.broadcast(x) * 5.0)
  np.testing.assert_allclose(tape.gradient(a, x).numpy(), [3.0, 3.0])
  np.testing.assert_allclose(tape.gradient(g, x).numpy(), [2.0, 2.0])
  np.testing.assert_allclose(tape.gradient(b, x).numpy(), [5.0, 5.0])


# ------------------------------------------------------ argument checking


@pytest.mark.parametrize("fn", [ops.allreduce, ops.allgather, ops.broadcast,
                                ops.reducescatter, ops.alltoall])
def test_non_tensor_input_is_type_error_naming_argument(fn):
  with pytest.raises(TypeError, match="`tensor`"):
    fn(object())


def test_unsupported_dtype_lists_accepted_dtypes():
  with pytest.raises(TypeError, match="tf.string|string") as info:
    ops.allreduce(tf.constant(["a"]))
  assert "float32" in str(info.value) and "`tensor`" in str(info.value)
  with pytest.raises(TypeError, match="`tensor`"):
    ops.reducescatter(tf.constant([True]))  # bool cannot be reduce-scattered


@pytest.mark.parametrize("bad", ["bogus", 3, None, tf.float32])
def test_bad_reduce_op_is_value_error_naming_op(bad):
  with pytest.raises(ValueError, match="`op`"):
    ops.allreduce(tf.ones([2]), op=bad)


def test_reduce_op_spellings():
  for op in (ops.Sum, "sum", "SUM", tf.distribute.ReduceOp.SUM):
    assert ops.allreduce(tf.ones([2]), op=op).numpy().tolist() == [1, 1]
  for op in (ops.Average, ops.Mean, "average", tf.distribute.ReduceOp.MEAN):
    assert ops.allreduce(tf.ones([2]), op=op).numpy().tolist() == [1, 1]


# Argument errors that may hold on one rank only are the engine's, so that
# they fail the collective on every rank (tests/parallel/test_ops.py).
def test_mean_of_integers_is_refused():
  with pytest.raises(tf.errors.InvalidArgumentError, match="floating"):
    ops.allreduce(tf.ones([2], tf.int32), op=ops.Average)
  with pytest.raises(tf.errors.InvalidArgumentError, match="floating"):
    ops.grouped_allreduce([tf.ones([2]), tf.ones([2], tf.int64)],
                          op=ops.Average)
  with pytest.raises(tf.errors.InvalidArgumentError, match="floating"):
    ops.reducescatter(tf.ones([2], tf.int32), op=ops.Average)
  # Beside a tensor divided before the sum (16-bit, or compressed), an
  # integer is not divided into a float64 either.
  with pytest.raises(tf.errors.InvalidArgumentError, match="floating"):
    ops.grouped_allreduce([tf.ones([2], tf.float16), tf.ones([2], tf.int32)],
                          op=ops.Average)
  with pytest.raises(tf.errors.InvalidArgumentError, match="floating"):
    ops.grouped_allreduce([tf.ones([2]), tf.ones([2], tf.int32)],
                          op=ops.Average, compression="fp16")
  # A bool's sum is a logical or: no "use sum and divide" hint.
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"float64\), got bool \(on rank 0\)"):
    ops.allreduce(tf.constant([True]), op=ops.Average)


@pytest.mark.parametrize("root, error, match", [
    ("0", TypeError, "`root_rank`"), (1.0, TypeError, "`root_rank`"),
    (True, TypeError, "`root_rank`"),
    (1, tf.errors.InvalidArgumentError,
     r"root_rank must be in \[0, 1\), got 1"),
    (-1, tf.errors.InvalidArgumentError, "got -1")])
def test_bad_root_rank(root, error, match):
  with pytest.raises(error, match=match):
    ops.broadcast(tf.ones([2]), root_rank=root)


def test_numpy_integer_root_rank():
  assert ops.broadcast(tf.ones([2]), root_rank=np.int64(0)).shape == (2,)


@pytest.mark.parametrize("name", [3, "", b"x"])
def test_bad_name(name):
  with pytest.raises(TypeError, match="`name`"):
    ops.allreduce(tf.ones([2]), name=name)


@pytest.mark.parametrize("in_function", [False, True])
def test_scalars_rejected_where_rows_are_needed(in_function):
  for fn in (ops.allgather, ops.reducescatter, ops.alltoall):
    if in_function:
      fn = tf.function(fn)
    with pytest.raises(tf.errors.InvalidArgumentError, match="got a scalar"):
      fn(tf.constant(1.0))


def test_grouped_allreduce_needs_a_list():
  with pytest.raises(TypeError, match="`tensors`"):
    ops.grouped_allreduce(tf.ones([2]))
  with pytest.raises(TypeError, match=r"`tensors\[1\]`"):
    ops.grouped_allreduce([tf.ones([2]), object()])


def test_alltoall_bad_splits():
  with pytest.raises(ValueError, match="`splits`"):
    ops.alltoall(tf.ones([2]), splits=tf.ones([1, 1], tf.int64))
  with pytest.raises(TypeError, match="`splits`"):
    ops.alltoall(tf.ones([2]), splits=tf.ones([1], tf.float32))
  with pytest.raises(tf.errors.InvalidArgumentError, match="sum to 3"):
    ops.alltoall(tf.ones([2]), splits=[3])
  # An empty list is not "even": that is None.
  with pytest.raises(ValueError, match="one entry per rank"):
    ops.alltoall(tf.ones([2]), splits=[])
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"one entry per rank \(1\), got 2"):
    ops.alltoall(tf.ones([2]), splits=[1, 1])


def test_indexed_slices_rejected():
  slices = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]),
                            tf.constant([3, 2]))
  with pytest.raises(TypeError, match="IndexedSlices"):
    ops.allreduce(slices)


# ------------------------------------------------------------------- names


def test_default_names_in_function_are_graph_scoped_and_unique():
  @tf.function
  def my_step(x):
    with tf.name_scope("scope"):
      a = ops.allreduce(x)
    return a, ops.allreduce(x), ops.allgather(x), ops.allreduce(x, name="own")

  graph = my_step.get_concrete_function(tf.ones([2])).graph
  names = sorted(op.get_attr("tensor_name").decode()
                 for op in graph.get_operations()
                 if op.type.startswith("MpiStrategy"))
  assert names == ["my_step/allgather", "my_step/allreduce",
                   "my_step/scope/allreduce", "own"]


def test_a_function_names_its_collectives_the_same_wherever_it_is_traced():
  # A function is traced where it is first called, which can differ between
  # ranks (a batch of another shape): the callers must not be in the name.
  @tf.function
  def inner(x):
    return ops.allreduce(x)

  @tf.function
  def outer(x):
    y = tf.cond(x[0] > 0, lambda: inner(x), lambda: ops.allreduce(x))
    with tf.GradientTape() as tape:
      tape.watch(y)
      z = inner(y)
    return tape.gradient(z, y)

  def names(graph):
    found = set()
    for op in graph.get_operations():
      if op.type.startswith("MpiStrategy"):
        found.add(op.get_attr("tensor_name").decode())
    for function in graph._functions.values():  # pylint: disable=protected-access
      found |= names(function.graph)
    return found

  direct = names(inner.get_concrete_function(tf.ones([2])).graph)
  nested = names(outer.get_concrete_function(tf.ones([3])).graph)
  assert direct == {"inner/allreduce"}
  assert nested == {
      "inner/allreduce", "outer/cond_false/cond/allreduce",
      "inner/__backward_inner/gradients/MpiStrategyAllreduce_grad/allreduce"}


def test_explicit_names_pair_in_eager_mode():
  y = ops.allreduce(tf.ones([2]), name="eager-explicit")
  assert y.numpy().tolist() == [1, 1]


# ---------------------------------------------------- shutdown and re-init


def test_not_initialized_error_from_kernel_then_reinit():
  @tf.function
  def fn(x):
    return ops.allreduce(x, name="reinit-single")

  assert fn(tf.ones([1])).numpy().tolist() == [1.0]
  options = mpistrategy.current_options()
  mpistrategy.shutdown()
  mpistrategy.shutdown()  # a no-op
  assert not mpistrategy.is_initialized()
  with pytest.raises(tf.errors.FailedPreconditionError,
                     match=r"not initialized; call mpistrategy.init\(\)"):
    fn(tf.ones([1]))
  mpistrategy.init(options)
  assert fn(tf.ones([1])).numpy().tolist() == [1.0]
  # Eager wrappers initialize on first use.
  mpistrategy.shutdown()
  assert ops.allreduce(tf.ones([1])).numpy().tolist() == [1.0]
  assert mpistrategy.is_initialized()


def test_init_replaces_an_engine_that_stopped_on_an_error():
  mpistrategy.init()
  options = mpistrategy.current_options()
  lib = _library.load()
  # What another rank's shutdown or exception does to this rank's engine.
  lib.c.mpistrategy_abort(b"rank 1 raised ValueError: test", 1.0)
  try:
    assert mpistrategy.is_initialized()
    for _ in range(2):  # the error is sticky
      with pytest.raises(tf.errors.AbortedError, match="rank 1 raised"):
        ops.allreduce(tf.ones([1]), name="after-abort")
    # Even with other options: the stopped engine's options no longer hold.
    mpistrategy.init(options.replace(cache_capacity=options.cache_capacity + 1))
    assert ops.allreduce(tf.ones([2]), name="after-abort").numpy().tolist() == [
        1.0, 1.0]
    assert not lib.c.mpistrategy_engine_stopped()
  finally:
    mpistrategy.shutdown()
    mpistrategy.init(options)
  assert ops.allreduce(tf.ones([1]), name="after-abort").numpy().tolist() == [
      1.0]


def _engine_threads():
  """Threads of this process named like the engine's (Linux)."""
  names = []
  for task in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{task}/comm") as f:
        names.append(f.read().strip())
    except FileNotFoundError:  # the thread ended meanwhile
      pass
  return [n for n in names if n == "mpistrategy"]


def _engine_threads_after_join():
  """`_engine_threads()` once the kernel has reaped a joined thread.

  `pthread_join` returns when the kernel clears the thread's id, which is
  before it removes the thread from /proc/self/task; a joined thread can
  stay listed for a moment (CI saw it once).  A thread that was never
  joined stays listed, so the deadline only bounds how long that takes
  to fail.
  """
  deadline = time.monotonic() + 5.0
  while _engine_threads() and time.monotonic() < deadline:
    time.sleep(0.01)
  return _engine_threads()


def test_engine_thread_is_named_and_joined_by_shutdown():
  mpistrategy.init()
  assert _engine_threads() == ["mpistrategy"]
  options = mpistrategy.current_options()
  mpistrategy.shutdown()
  try:
    assert _engine_threads_after_join() == []
  finally:
    mpistrategy.init(options)  # later tests expect a running engine
  assert _engine_threads() == ["mpistrategy"]


def test_init_validates_options():
  with pytest.raises(TypeError, match="options"):
    mpistrategy.init({"cycle_time_ms": 1.0})
  current = mpistrategy.current_options()
  with pytest.raises(ValueError, match="already initialized"):
    mpistrategy.init(current.replace(cache_capacity=current.cache_capacity + 1))


def test_env_override_applies_at_init(monkeypatch):
  options = mpistrategy.current_options()
  mpistrategy.shutdown()
  monkeypatch.setenv("MPISTRATEGY_CYCLE_TIME_MS", "7")
  try:
    mpistrategy.init()
    assert mpistrategy.current_options().cycle_time_ms == 7.0
  finally:
    mpistrategy.shutdown()
    monkeypatch.delenv("MPISTRATEGY_CYCLE_TIME_MS")
    mpistrategy.init(options)


# ---------------------------------------------- fresh processes and mpirun


def _python(code, env=None, timeout=120):
  full_env = dict(os.environ)
  full_env.update({"TF_CPP_MIN_LOG_LEVEL": "3"})
  for key in list(full_env):
    if key.startswith(("OMPI_", "PMIX_")):
      del full_env[key]
  full_env.update(env or {})
  return subprocess.run([sys.executable, "-P", "-c", textwrap.dedent(code)],
                        capture_output=True, text=True, timeout=timeout,
                        env=full_env, cwd=ROOT, check=False)


def _library_path():
  from mpistrategy import _library
  return _library.load().path


def test_missing_library_says_make_build():
  proc = _python("""
      from mpistrategy import _library
      _library.SEARCH_PATHS[:] = ["/nonexistent/_mpi_ops.so"]
      import mpistrategy
      try:
        mpistrategy.init()
      except ImportError as e:
        print("IMPORT-ERROR:", e)
      """)
  assert "IMPORT-ERROR:" in proc.stdout, proc.stderr
  assert "make build" in proc.stdout


def test_cooperates_with_mpi4py_that_initialized_mpi():
  pytest.importorskip("mpi4py")
  proc = _python(f"""
      from mpi4py import MPI
      from mpistrategy import _library
      _library.SEARCH_PATHS.insert(0, {_library_path()!r})
      import mpistrategy, tensorflow as tf
      from mpistrategy import ops
      mpistrategy.init()
      assert ops.allreduce(tf.ones([2])).numpy().tolist() == [1, 1]
      mpistrategy.shutdown()
      mpistrategy.init()
      assert mpistrategy.size() == MPI.COMM_WORLD.Get_size() == 1
      MPI.COMM_WORLD.Barrier()       # mpi4py's MPI is still usable
      assert not MPI.Is_finalized()
      print("MPI4PY-OK")
      """)
  assert "MPI4PY-OK" in proc.stdout, proc.stdout + proc.stderr
  assert proc.returncode == 0, proc.stderr


def test_init_after_mpi_finalized_is_failed_precondition():
  pytest.importorskip("mpi4py")
  proc = _python(f"""
      from mpi4py import MPI
      MPI.Finalize()
      from mpistrategy import _library
      _library.SEARCH_PATHS.insert(0, {_library_path()!r})
      import mpistrategy, tensorflow as tf
      try:
        mpistrategy.init()
      except tf.errors.FailedPreconditionError as e:
        print("FAILED-PRECONDITION:", e)
      """)
  assert "FAILED-PRECONDITION:" in proc.stdout, proc.stdout + proc.stderr
  assert "finalized" in proc.stdout


def _run_on_two_ranks(script):
  """Runs `script` under `mpirun -np 2`: (process, its output, seconds)."""
  env = dict(os.environ)
  env.update({"TF_CPP_MIN_LOG_LEVEL": "3",
              "OMPI_ALLOW_RUN_AS_ROOT": "1",
              "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
  start = time.monotonic()
  proc = subprocess.run(
      ["mpirun", "-np", "2", "--oversubscribe",
       "--mca", "btl_vader_single_copy_mechanism", "none",
       sys.executable, "-P", "-c", textwrap.dedent(script)],
      capture_output=True, text=True, timeout=180, env=env, cwd=ROOT,
      check=False)
  return proc, proc.stdout + proc.stderr, time.monotonic() - start


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_uncaught_exception_aborts_every_rank():
  script = f"""
      from mpistrategy import _library
      _library.SEARCH_PATHS.insert(0, {_library_path()!r})
      import time, mpistrategy, tensorflow as tf
      from mpistrategy import ops
      mpistrategy.init()
      ops.allreduce(tf.ones([1]))
      if mpistrategy.rank() == 1:
        raise ValueError("boom on purpose")
      ops.allreduce(tf.ones([1]))  # would wait forever for rank 1
      time.sleep(60)
      """
  proc, output, elapsed = _run_on_two_ranks(script)
  assert proc.returncode != 0, output
  assert "[rank 1] ValueError: boom on purpose" in output, output
  assert elapsed < 120, elapsed


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_uncaught_exception_in_a_communicating_thread_aborts_every_rank():
  # Python ends only that thread; the other ranks waited for its next
  # collective until a stall timeout (for ever by default).
  script = f"""
      from mpistrategy import _library
      _library.SEARCH_PATHS.insert(0, {_library_path()!r})
      import threading, time, mpistrategy, tensorflow as tf
      from mpistrategy import ops
      mpistrategy.init()

      def train():
        with mpistrategy.collective_names("trainer"):
          ops.allreduce(tf.ones([1]))
          if mpistrategy.rank() == 1:
            raise ValueError("boom in a thread")
          ops.allreduce(tf.ones([1]))  # would wait forever for rank 1

      def idle():
        raise KeyError("a thread that never communicated")

      quiet = threading.Thread(target=idle)
      quiet.start()
      quiet.join()
      worker = threading.Thread(target=train, name="trainer-thread")
      worker.start()
      worker.join()
      time.sleep(60)
      """
  proc, output, elapsed = _run_on_two_ranks(script)
  assert proc.returncode != 0, output
  assert "Exception in thread trainer-thread" in output, output
  assert "[rank 1] ValueError: boom in a thread" in output, output
  assert "rank 1 (host" in output and "raised ValueError" in output, output
  # A thread that never communicated ends alone, as Python does.
  assert "KeyError: 'a thread that never communicated'" in output, output
  assert elapsed < 50, elapsed


def test_default_eager_names_only_from_the_main_thread():
  """Other threads must pass name= (issue #14: results silently mixed up)."""
  import threading
  results = {}

  def worker():
    try:
      ops.allreduce(tf.ones([2]))
      results["default"] = "no error"
    except ValueError as e:
      results["default"] = str(e)
    results["named"] = ops.allreduce(tf.ones([2]), name="worker/x").numpy()

  thread = threading.Thread(target=worker, name="my-worker")
  thread.start()
  thread.join(60)
  assert "only be issued from the main thread" in results["default"]
  assert "'my-worker'" in results["default"] and "name=" in results["default"]
  np.testing.assert_array_equal(results["named"], [1.0, 1.0])
  # The main thread keeps its default names.
  np.testing.assert_array_equal(ops.allreduce(tf.ones([2])).numpy(), [1, 1])


def test_forked_child_fails_at_once_and_exits_cleanly():
  script = textwrap.dedent("""
      import os, sys, time
      import tensorflow as tf
      import mpistrategy
      from mpistrategy import ops
      mpistrategy.init()
      ops.allreduce(tf.ones([1]))
      pid = os.fork()
      if pid == 0:
        start = time.time()
        try:
          ops.allreduce(tf.ones([1]), name="child")
          print("CHILD no error", flush=True)
        except tf.errors.FailedPreconditionError as e:
          print("CHILD", round(time.time() - start, 2), "forked" in e.message,
                flush=True)
        try:
          mpistrategy.init()
        except tf.errors.FailedPreconditionError:
          print("CHILD init refused", flush=True)
        sys.exit(0)
      _, status = os.waitpid(pid, 0)
      print("PARENT child status", status, flush=True)
      print("PARENT", ops.allreduce(tf.ones([1]), name="after").numpy()[0],
            flush=True)
      """)
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
  for name in list(env):
    if name.startswith(("OMPI_COMM_WORLD", "PMIX_", "MPISTRATEGY_")):
      del env[name]
  out = subprocess.run([sys.executable, "-c", script], env=env,
                       capture_output=True, text=True, timeout=120,
                       check=False)
  assert out.returncode == 0, out.stdout + out.stderr
  lines = out.stdout.splitlines()
  child = [l for l in lines if l.startswith("CHILD ")]
  assert child[0].endswith("True") and float(child[0].split()[1]) < 5, lines
  assert "CHILD init refused" in lines, lines
  assert "PARENT child status 0" in lines, lines
  assert "PARENT 1.0" in lines, lines
