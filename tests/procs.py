"""Process helpers shared by the test suites (read from /proc)."""


def alive(pid):
  """True if `pid` exists and is not a zombie.

  Args:
    pid: a process id.

  Returns:
    False for a process that has exited, even while its parent has not yet
    reaped it (state Z), so "no process left" checks do not wait on zombies.
  """
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except (OSError, IndexError):
    return False
