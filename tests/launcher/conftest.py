"""Fixtures for tests/launcher: one pytest process that starts `mpirun`.

Each test runs a per-rank program from tests/launcher/scripts/ under
`mpirun --tag-output` with a hard wall-clock timeout, then asserts on the exit
status, the elapsed time and what each rank printed.  Every job gets a unique
marker on its command line, so a test can check with `pgrep -f` that no
process of the job outlived it.

The scripts print through `scripts/_rankio.py`: one line per event,
`@@ <rank> <unix time> <EVENT> <text>`, which `Job.events()` parses.
"""

import dataclasses
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from _job_env import clean_env
from _job_env import leftovers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPTS = os.path.join(HERE, "scripts")
PYTHON = os.environ.get("PYTHON") or (
    os.path.join(ROOT, ".venv", "bin", "python")
    if os.path.exists(os.path.join(ROOT, ".venv", "bin", "python"))
    else sys.executable)
MPIRUN = os.environ.get("MPIRUN", "mpirun")

_TAG = re.compile(r"^\[(\d+),(\d+)\]<(stdout|stderr)>:(.*)$")
_TAG_INSIDE = re.compile(r"\[\d+,\d+\]<(?:stdout|stderr)>:")
_EVENT = re.compile(r"^@@ (\d+) ([0-9.]+) (\S+) ?(.*)$")


@dataclasses.dataclass
class Event:
  rank: int
  time: float
  name: str
  text: str


@dataclasses.dataclass
class Job:
  """A finished (or killed) mpirun/python job."""
  cmd: list
  returncode: int
  start: float       # time.time() just before the launch
  end: float         # time.time() when the launcher process was reaped
  stdout: str
  stderr: str
  timed_out: bool
  marker: str

  @property
  def elapsed(self):
    return self.end - self.start

  @property
  def output(self):
    return self.stdout + "\n" + self.stderr

  def rank_lines(self, rank):
    """Lines printed by `rank` (stdout and stderr, from --tag-output)."""
    lines = []
    for line in self.output.splitlines():
      m = _TAG.match(line)
      if m and int(m.group(2)) == rank:
        # A line written in several pieces carries a tag per piece.
        lines.append(_TAG_INSIDE.sub("", m.group(4)))
    return lines

  def rank_text(self, rank):
    return "\n".join(self.rank_lines(rank))

  def untagged_text(self):
    """Lines not attributed to a rank: mpirun's own messages."""
    return "\n".join(l for l in self.output.splitlines() if not _TAG.match(l))

  def events(self, name=None, rank=None):
    out = []
    for line in self.output.splitlines():
      m = _TAG.match(line)
      body = m.group(4) if m else line
      e = _EVENT.match(body)
      if not e:
        continue
      ev = Event(int(e.group(1)), float(e.group(2)), e.group(3), e.group(4))
      if (name is None or ev.name == name) and (rank is None or
                                                ev.rank == rank):
        out.append(ev)
    return out

  def event(self, name, rank):
    """The single `name` event of `rank`; fails the test if there is none."""
    evs = self.events(name, rank)
    assert evs, (f"rank {rank} printed no {name} event\n" + self.describe())
    return evs[0]

  def assert_no_leftovers(self, grace=5.0):
    """Fails (after killing them) if processes of this job still run."""
    assert_no_leftovers(self, grace)

  def describe(self, limit=12000):
    text = (f"command: {' '.join(self.cmd)}\nexit status: {self.returncode}"
            f"{' (TIMED OUT, killed)' if self.timed_out else ''}, "
            f"elapsed {self.elapsed:.1f} s\n--- stdout ---\n{self.stdout}"
            f"\n--- stderr ---\n{self.stderr}")
    return text if len(text) <= limit else "...\n" + text[-limit:]


def run_job(script, np=2, env=None, args=(), timeout=120, mpi=True):
  """Runs tests/launcher/scripts/`script` on `np` ranks (or without mpirun).

  Args:
    script: file name under tests/launcher/scripts/, or an absolute path.
    np: number of ranks.
    env: extra environment variables, forwarded to every rank.
    args: extra arguments for the script.
    timeout: hard wall-clock limit; the whole process group is killed then.
    mpi: False runs `python script` directly (a world of size 1).

  Returns:
    A `Job`.
  """
  marker = f"mpistrategy-launcher-{uuid.uuid4().hex[:12]}"
  path = script if os.path.isabs(script) else os.path.join(SCRIPTS, script)
  env = clean_env(env)
  prog = [PYTHON, path, f"--marker={marker}", *args]
  if mpi:
    forwarded = []
    for name in sorted(env):
      if name.startswith("MPISTRATEGY_") or name in (
          "PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL",
          "CUDA_VISIBLE_DEVICES"):
        forwarded += ["-x", name]
    cmd = [MPIRUN, "-np", str(np), "--oversubscribe", "--bind-to", "none",
           "--tag-output",
           "--mca", "btl_vader_single_copy_mechanism", "none",
           *forwarded, *prog]
  else:
    cmd = prog
  start = time.time()
  proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, errors="replace",
                          start_new_session=True)
  timed_out = False
  try:
    stdout, stderr = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    timed_out = True
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    for pid in leftovers(marker):
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    stdout, stderr = proc.communicate()
  end = time.time()
  return Job(cmd=cmd, returncode=proc.returncode, start=start, end=end,
             stdout=stdout, stderr=stderr, timed_out=timed_out, marker=marker)


def assert_no_leftovers(job, grace=5.0):
  """Fails (after killing them) if processes of `job` are still running."""
  deadline = time.time() + grace
  pids = leftovers(job.marker)
  while pids and time.time() < deadline:
    time.sleep(0.2)
    pids = leftovers(job.marker)
  if pids:
    detail = subprocess.run(["ps", "-o", "pid,stat,etime,args", "-p",
                             ",".join(map(str, pids))],
                            capture_output=True, text=True,
                            check=False).stdout
    for pid in pids:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    pytest.fail(f"processes of the job outlived it by {grace} s:\n{detail}\n"
                + job.describe())


# Started first, so that with two workers (the Makefile) the longest test,
# mostly downloads and a compile, overlaps the others instead of ending last.
_LONGEST_FIRST = ("test_pip_route.py",)


def pytest_collection_modifyitems(items):
  # Then the tests marked `alone` (below): the first worker runs them after
  # the pip route, while the second worker has plenty of other tests queued,
  # instead of one waiting idle for the pip route to end.
  items.sort(key=lambda item: (item.path.name not in _LONGEST_FIRST,
                               item.get_closest_marker("alone") is None))


# Tests marked `alone` judge state the whole host shares (segments in
# /dev/shm that any job may sweep): with two workers, they run while no
# other test of the run does.  Every test holds this file's lock, shared, or
# exclusive for `alone`.
_HOST_STATE_LOCK = os.path.join(tempfile.gettempdir(),
                                "mpistrategy-launcher-tests.lock")


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "alone: run while no other launcher test runs (it judges "
      "state the whole host shares)")


@pytest.fixture(autouse=True)
def _host_state_lock(request):
  exclusive = request.node.get_closest_marker("alone") is not None
  with open(_HOST_STATE_LOCK, "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    yield


@pytest.fixture(scope="session")
def mpirun_available():
  if shutil.which(MPIRUN) is None:
    pytest.skip(f"{MPIRUN} not found")
  return True


@pytest.fixture(scope="session")
def launch(mpirun_available):
  """`launch(script, np=2, env=None, args=(), timeout=120, mpi=True)`.

  Returns a `Job`; see `run_job`.
  """
  del mpirun_available
  return run_job
