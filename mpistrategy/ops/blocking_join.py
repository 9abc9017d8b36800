"""A barrier that fails, instead of waiting, when other ranks went elsewhere.

A call that every rank must make (a collective checkpoint read, stopping
`fit`) cannot tell, by itself, a rank that is merely late from one that
skipped the call and went on.  A barrier named `MPIBlockingJoin/<what>` is a
*blocking join* to the engine (cc/engine/negotiator.h): when ranks that did
not enter it wait in another collective instead, the engine sees the two
sides crossed and, about a second later, fails the join on the ranks in it
and that collective on the others, each message naming both.  Where the
other ranks are in no collective at all (computing, or idle in Python),
only a timeout can end the wait: `join` gives up after `timeout` seconds.
"""

import contextvars
import re
import threading

import tensorflow as tf

PREFIX = "MPIBlockingJoin/"


def join(what, timeout):
  """Waits until every rank has entered the blocking join `what`.

  Args:
    what: the rest of the join's name; the engine's messages on every rank
      quote `PREFIX + what`, so it should say what the ranks are doing.
    timeout: seconds to wait for the other ranks, or None for ever.

  Returns:
    True once every rank joined; False after `timeout` seconds without them
    (the join then stays posted: the job cannot go on collectively).

  Raises:
    tf.errors.FailedPreconditionError: other ranks wait in other collectives
      instead; its message is the engine's, without TensorFlow's op
      decorations.
    Any other error of the barrier (a peer that raised, a shutdown).
  """
  from mpistrategy import ops  # pylint: disable=g-import-not-at-top
  box = {}

  def run():
    try:
      ops.barrier(name=PREFIX + what)
      box["done"] = True
    except BaseException as e:  # pylint: disable=broad-except
      box["error"] = e

  # In a thread of its own, so that the wait can end at `timeout`; in the
  # caller's context, for its `collective_names` prefixes.
  thread = threading.Thread(target=contextvars.copy_context().run,
                            args=(run,), name="mpistrategy-blocking-join",
                            daemon=True)
  thread.start()
  thread.join(timeout)
  error = box.get("error")
  if (isinstance(error, tf.errors.FailedPreconditionError) and
      "Blocking join" in error.message):
    detail = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", error.message)
    detail = re.sub(r"\s*\[Op:\w+\].*$", "", detail, flags=re.S)
    raise tf.errors.FailedPreconditionError(None, None, detail) from None
  if error is not None:
    raise error
  return "done" in box
