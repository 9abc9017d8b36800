"""Collectives from several Python threads, and from a forked child.

--case threads: 4 threads per rank each run 20 eager allreduces of
  `tf.fill([3], i + 1)`, first with default names (must raise ValueError
  telling to pass name=, never return a wrong result), then with explicit
  per-thread names (must all be right).
--case fork: after a collective, the rank forks: the child's collective, its
  init() and a multiprocessing 'fork' worker's collective must fail at once
  with FailedPreconditionError; the parent then still works.

Events: DEFAULT (counts), NAMED (counts), CHILD (result), MP_CHILD (result),
PARENT_OK, FINISHED.
"""

import multiprocessing
import os
import sys
import threading
import time

import _rankio as io

p = io.parser(__doc__)
p.add_argument("--case", choices=["threads", "fork"], required=True)
args = p.parse_args()

import tensorflow as tf
import mpistrategy
from mpistrategy import ops

mpistrategy.init()
rank, size = mpistrategy.rank(), mpistrategy.size()
ops.allreduce(tf.ones([1]))  # the main thread may use default names


def run_threads(named):
  counts = {"ok": 0, "wrong": 0, "value_error": 0, "other": 0}
  messages = []
  lock = threading.Lock()

  def worker(i):
    for k in range(20):
      try:
        name = f"thread{i}" if named else None
        out = ops.allreduce(tf.fill([3], float(i + 1)), name=name)
        good = bool(tf.reduce_all(tf.equal(out, float((i + 1) * size))))
        with lock:
          counts["ok" if good else "wrong"] += 1
      except ValueError as e:
        with lock:
          counts["value_error"] += 1
          messages.append(str(e))
        return
      except Exception as e:  # pylint: disable=broad-except
        with lock:
          counts["other"] += 1
          messages.append(io.error_text(e))
        return
      del k

  threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return counts, messages


def child_collective():
  """In a fork child: 'OK <secs> <error>' or 'BAD <what>'."""
  start = time.time()
  try:
    ops.allreduce(tf.ones([1]), name="from_child")
    return "BAD the collective returned"
  except tf.errors.FailedPreconditionError as e:
    took = time.time() - start
    try:
      mpistrategy.init()
      return "BAD init() worked"
    except tf.errors.FailedPreconditionError:
      pass
    return f"OK {took:.2f} {io.one_line(e.message)}"
  except Exception as e:  # pylint: disable=broad-except
    return f"BAD {io.error_text(e)}"


def mp_target(queue):
  queue.put(child_collective())


if args.case == "threads":
  counts, messages = run_threads(named=False)
  io.emit("DEFAULT", f"{counts} {messages[:1]}")
  counts, messages = run_threads(named=True)
  io.emit("NAMED", f"{counts} {messages[:1]}")
else:
  read_end, write_end = os.pipe()
  pid = os.fork()
  if pid == 0:
    os.close(read_end)
    os.write(write_end, child_collective().encode())
    os.close(write_end)
    sys.exit(0)  # normal exit: atexit handlers must not hang or break MPI
  os.close(write_end)
  deadline = time.time() + 60
  text = b""
  while time.time() < deadline:
    chunk = os.read(read_end, 4096)
    if not chunk:
      break
    text += chunk
  status = None
  while time.time() < deadline + 30 and status is None:
    done, code = os.waitpid(pid, os.WNOHANG)
    if done:
      status = code
    else:
      time.sleep(0.1)
  if status is None:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    status = "HUNG (killed)"
  io.emit("CHILD", f"{text.decode()} | exit {status}")
  ctx = multiprocessing.get_context("fork")
  queue = ctx.Queue()
  proc = ctx.Process(target=mp_target, args=(queue,))
  proc.start()
  try:
    io.emit("MP_CHILD", queue.get(timeout=60))
  except Exception as e:  # pylint: disable=broad-except
    io.emit("MP_CHILD", f"BAD {io.error_text(e)}")
  proc.join(30)
  out = ops.allreduce(tf.ones([2]), name="parent_after_fork")
  if float(out.numpy()[0]) == size:
    io.emit("PARENT_OK")
mpistrategy.shutdown()
io.emit("FINISHED")
