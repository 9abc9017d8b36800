"""Supervision: runs the command, forwards signals, kills what is left.

The command runs in a session of its own.  SIGINT and SIGHUP are forwarded
to its process group.  SIGTERM, the signal clusters send before they
preempt a job, goes to mpirun's children instead, the local ranks, as the
preemption signal (`mpistrategy.preemption`: SIGTERM unless
`--preemption-signal` says otherwise; a rank is a process under mpirun with
OMPI_COMM_WORLD_RANK, PMIX_RANK or PMI_RANK set, so the ssh connections to
other hosts are left alone): mpirun itself would SIGKILL the
ranks one second after a SIGTERM, too soon to save a checkpoint, while one
signalled rank is enough for every rank to save and exit with status 42.
(Without local ranks, and under srun, which forwards it to every task,
SIGTERM goes to the launcher's process group as the others do.)
`kill_after` seconds after the first signal every process of the session is
killed.
"""

import os
import signal
import subprocess
import sys
import time

from mpistrategy import preemption
from mpistrategy.launch import command as command_lib

# Slurm's default KillWait is 30 s between SIGTERM and SIGKILL; the job gets
# most of it to save a checkpoint and exit.
DEFAULT_KILL_AFTER_SECONDS = 25.0


FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def say(text):
  sys.stderr.write(f"{command_lib.PROG}: {text}\n")
  sys.stderr.flush()


def _all_pids():
  """Every PID in /proc (Linux; else none)."""
  try:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]
  except OSError:
    return []


def _pids_where(field, value):
  """PIDs whose /proc/PID/stat field `field` is `value` (Linux; else empty).

  Fields count from the one after "pid (comm)": 0 state, 1 ppid, 2 pgrp,
  3 session.
  """
  pids = []
  for pid in _all_pids():
    try:
      with open(f"/proc/{pid}/stat", encoding="ascii",
                errors="replace") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
      continue
    if len(fields) > field and fields[field] == str(value):
      pids.append(pid)
  return pids


def _session_pids(sid):
  """PIDs of the processes in session `sid`."""
  return _pids_where(3, sid)


def _kill_session(proc):
  """SIGKILLs the command's process group and every process of its session.

  mpirun puts each local rank in a process group of its own (in mpirun's
  session, which `run` made new), so the group alone is not enough.
  """
  for kill, target in [(os.killpg, proc.pid)] + [
      (os.kill, pid) for pid in _session_pids(proc.pid)]:
    try:
      kill(target, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass


# Set by Open MPI (and PMIx, MPICH) in each rank's environment, not in
# mpirun's other children (ssh to the remote daemons).
_RANK_VARIABLES = (b"OMPI_COMM_WORLD_RANK=", b"PMIX_RANK=", b"PMI_RANK=")


def _children(pid):
  """PIDs whose parent is `pid`."""
  return _pids_where(1, pid)


def _is_rank(pid):
  try:
    with open(f"/proc/{pid}/environ", "rb") as f:
      variables = f.read().split(b"\0")
  except OSError:
    return False
  return any(v.startswith(_RANK_VARIABLES) for v in variables)


def _local_ranks(pid):
  """The outermost processes under `pid` that are MPI ranks."""
  ranks, todo = [], _children(pid)
  while todo:
    child = todo.pop()
    if _is_rank(child):
      ranks.append(child)
    else:
      todo.extend(_children(child))
  return ranks


# Open MPI's shared-memory (vader) files, 4 MiB a rank: each rank unlinks
# its own at MPI_Finalize and mpirun those of ranks that died, unless mpirun
# itself is cut short (a second Ctrl-C, mpirun killed).
_SHM_DIR = "/dev/shm"
_OPEN_MPI_SEGMENT_PREFIX = "vader_segment."


def _open_mpi_segments():
  """Paths of Open MPI's segments in /dev/shm that this user owns."""
  try:
    entries = os.scandir(_SHM_DIR)
  except OSError:
    return set()
  with entries:
    return {e.path for e in entries
            if e.name.startswith(_OPEN_MPI_SEGMENT_PREFIX) and
            _owned_by_me(e)}


def _owned_by_me(entry):
  try:
    return entry.stat(follow_symlinks=False).st_uid == os.getuid()
  except OSError:
    return False


def _mapped_files():
  """Files that live processes map (as far as /proc/PID/maps can be read)."""
  mapped = set()
  for pid in _all_pids():
    try:
      with open(f"/proc/{pid}/maps", encoding="ascii",
                errors="replace") as f:
        mapped.update(line.split(maxsplit=5)[5].strip() for line in f
                      if _SHM_DIR in line)
    except (OSError, IndexError):
      continue
  return mapped


def _remove_left_segments(before, settle_seconds=1.0):
  """Removes Open MPI segments that appeared since `before` and are unused.

  After a second Ctrl-C (or mpirun killed) nobody unlinks the dead ranks'
  segments, and a container's small /dev/shm fills up job after job.  A
  segment is this job's when it appeared while the job ran; one that a
  live process still maps (another job's) is left alone.

  Args:
    before: `_open_mpi_segments()` from before the job started.
    settle_seconds: How long to wait for killed ranks to finish exiting
      (a dying process still lists its mappings).

  Returns:
    The paths removed.
  """
  removed = []
  deadline = time.monotonic() + settle_seconds
  while True:
    new = _open_mpi_segments() - before
    unused = new - _mapped_files()
    for path in sorted(unused):
      try:
        os.unlink(path)
        removed.append(path)
      except OSError:
        pass
    if unused == new or time.monotonic() > deadline:
      return removed
    time.sleep(0.1)


def _forward(proc, launcher, signum, preemption_signal=signal.SIGTERM):
  if launcher == "mpirun" and signum == signal.SIGTERM:
    ranks = _local_ranks(proc.pid)
    for pid in ranks:
      try:
        os.kill(pid, preemption_signal)
      except ProcessLookupError:
        pass
    if ranks:
      return
  try:
    os.killpg(proc.pid, signum)
    if launcher == "srun" and signum == signal.SIGINT:
      # srun answers one SIGINT with a status report; a second one within a
      # second aborts the step (SIGINT, then SIGTERM, SIGKILL to the tasks).
      time.sleep(0.1)
      os.killpg(proc.pid, signum)
  except ProcessLookupError:
    pass


def run(command, kill_after=DEFAULT_KILL_AFTER_SECONDS, verbose=False):
  """Runs `command` and forwards signals to it until it exits.

  The command runs in a new session, so a terminal's Ctrl-C reaches only
  the launcher, which forwards it once.

  Args:
    command: A `Command`.
    kill_after: Seconds after the first forwarded signal before the whole
      job is killed with SIGKILL.
    verbose: Print what happens to the signals.

  Returns:
    The exit status: the job's; `preemption.EXIT_CODE` (42) when the ranks
    saved and exited on a preemption signal; 128 + N when the launcher got
    signal N and the job then failed, or when the job died of signal N.
  """
  return run_attempt(command, kill_after, verbose)[0]


def run_attempt(command, kill_after=DEFAULT_KILL_AFTER_SECONDS,
                verbose=False):
  """Like `run`; returns `(exit status, signals the launcher received)`."""
  received = []     # forwarded signal numbers, in order
  state = {"proc": None, "first": None}
  preemption_signal = preemption.signal_from_env(command.env)

  def on_signal(signum, unused_frame):
    received.append(signum)
    if state["first"] is None:
      state["first"] = time.monotonic()
    if verbose:
      say(f"got {signal.Signals(signum).name}, forwarding it")
    if state["proc"] is not None:
      _forward(state["proc"], command.launcher, signum, preemption_signal)

  segments_before = _open_mpi_segments()
  previous = {s: signal.signal(s, on_signal) for s in FORWARDED_SIGNALS}
  try:
    try:
      proc = subprocess.Popen(command.argv, env=command.env,
                              start_new_session=True)
    except OSError as e:
      say(f"error: cannot run {command.argv[0]}: {e}")
      return 127
    state["proc"] = proc
    for signum in received:  # arrived before the command started
      _forward(proc, command.launcher, signum, preemption_signal)
    killed = False
    while True:
      try:
        returncode = proc.wait(timeout=0.2)
        break
      except subprocess.TimeoutExpired:
        pass
      if (state["first"] is not None and not killed and
          time.monotonic() - state["first"] > kill_after):
        say(f"the job is still running {kill_after:g} s after "
             f"{signal.Signals(received[0]).name}; killing it")
        _kill_session(proc)
        killed = True
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)
  # Processes of the job that outlived mpirun (a rank stuck in teardown).
  for pid in _session_pids(proc.pid):
    try:
      os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
  if received or returncode != 0:
    for path in _remove_left_segments(segments_before):
      if verbose:
        say(f"removed {path}, left by a rank that did not finish")
  if returncode < 0:
    return 128 - returncode, received
  if returncode == preemption.EXIT_CODE:
    return returncode, received
  if received and returncode != 0:
    return 128 + received[0], received
  return returncode, received
