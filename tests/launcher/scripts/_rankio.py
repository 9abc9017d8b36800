"""Output helpers for the per-rank launcher scripts.

Every observation is one line, `@@ <rank> <unix time> <EVENT> <text>`, printed
and flushed at once, so the test (tests/launcher/conftest.py, `Job.events`)
can attribute it to a rank and time it against other ranks' events.
"""

import argparse
import os
import sys
import time


def env_rank():
  """This process's rank as told by the launcher (0 outside mpirun)."""
  for name in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
    value = os.environ.get(name)
    if value is not None and value.isdigit():
      return int(value)
  return 0


def one_line(text):
  return " | ".join(str(text).strip().splitlines())


def emit(event, text="", rank=None):
  rank = env_rank() if rank is None else rank
  line = f"@@ {rank} {time.time():.3f} {event} {one_line(text)}\n"
  # One write(2) per line: print() under PYTHONUNBUFFERED writes the text
  # and the newline separately, and mpirun --tag-output can then splice
  # another rank's line in between.
  sys.stdout.flush()
  os.write(sys.stdout.fileno(), line.encode("utf-8", errors="replace"))


def error_text(e):
  """`ClassName: message` of an exception, on one line."""
  message = getattr(e, "message", None) or str(e)
  return f"{type(e).__name__}: {one_line(message)}"


def parser(description):
  """An ArgumentParser that accepts the launcher's --marker argument."""
  p = argparse.ArgumentParser(description=description)
  p.add_argument("--marker", default="",
                 help="unique tag on the command line (for pgrep); unused")
  return p
