"""Fixtures for tests/multihost: jobs across simulated hosts.

The session fixture `cluster` makes hosts `hosta` and `hostb` (network + UTS
namespaces on a bridge; hosts.py) once for the whole run and removes them at
the end, whatever happened.  `mpirun_job` / `launcher_job` start a job on
hosta (mpirun there reaches hostb through agent.sh instead of ssh, over TCP
on 10.77.0.0/24 only) and return a `LiveJob`, whose output is read while it
runs, so a test can wait for a rank's event and then inject a fault.

After every test the hosts must be empty: the autouse fixture kills what is
left (and fails the test if the test itself did not check that), and puts
every link back up.

Skipping: where namespaces cannot be made (not root, no `ip`, no `unshare`,
a container that forbids them) every test is skipped with the reason, and
the summary says so in capitals.  With MULTIHOST_REQUIRED=1 (the Makefile
sets it when CI is set) that is an error instead: CI must run these tests.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "launcher"))
sys.path.insert(0, HERE)

from _job_env import clean_env
import hosts as hosts_lib

SCRIPT = os.path.join(HERE, "scripts", "mh_rank.py")
PYTHON = os.environ.get("PYTHON") or (
    os.path.join(ROOT, ".venv", "bin", "python")
    if os.path.exists(os.path.join(ROOT, ".venv", "bin", "python"))
    else sys.executable)
MPIRUN = os.environ.get("MPIRUN", "mpirun")
HOSTS = ("hosta", "hostb")

_TAG = re.compile(r"^\[(\d+),(\d+)\]<(stdout|stderr)>:(.*)$")
_TAG_INSIDE = re.compile(r"\[\d+,\d+\]<(?:stdout|stderr)>:")
_EVENT = re.compile(r"^@@ (\d+) ([0-9.]+) (\S+) ?(.*)$")

# Measurements for the summary ("Failure behaviour" table of the README).
# Tests run in pytest-xdist workers, so what a test records travels to the
# controller in its report (user_properties) and is printed from there.
TIMINGS = []
_TIMING_PROPERTY = "multihost_timing"
_SKIPPED_PREFIX = "MULTI-HOST TESTS SKIPPED: "
_SUMMARY_TIMINGS = []
_SKIP_REASON = []
_PROBED = []


class LiveJob:
  """A job started on hosta; its output is collected while it runs."""

  def __init__(self, cluster, argv, env, hard_timeout):
    self.cluster = cluster
    self.cmd = cluster.command("hosta", argv)
    self.hard_timeout = hard_timeout
    self.start = time.time()
    self.end = None
    self.timed_out = False
    self.returncode = None
    self._lines = []  # (stream, line)
    self._cv = threading.Condition()
    self.proc = subprocess.Popen(
        self.cmd, env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        errors="replace", start_new_session=True)
    self._readers = [threading.Thread(target=self._read, args=(s, n),
                                      daemon=True)
                     for s, n in ((self.proc.stdout, "out"),
                                  (self.proc.stderr, "err"))]
    for t in self._readers:
      t.start()
    # Records when the job ended, whoever waits for it and when.
    self._waiter = threading.Thread(target=self._wait_end, daemon=True)
    self._waiter.start()

  def _wait_end(self):
    self.proc.wait()
    self.end = time.time()

  def _read(self, stream, name):
    for line in stream:
      with self._cv:
        self._lines.append((name, line.rstrip("\n")))
        self._cv.notify_all()
    with self._cv:
      self._cv.notify_all()

  # ------------------------------------------------------------ output
  def lines(self):
    with self._cv:
      return [l for _, l in self._lines]

  @property
  def output(self):
    return "\n".join(self.lines())

  def rank_text(self, rank):
    """What `rank` printed (stdout and stderr, from --tag-output)."""
    out = []
    for line in self.lines():
      m = _TAG.match(line)
      if m and int(m.group(2)) == rank:
        out.append(_TAG_INSIDE.sub("", m.group(4)))
    return "\n".join(out)

  def untagged_text(self):
    return "\n".join(l for l in self.lines() if not _TAG.match(l))

  def events(self, name=None, rank=None):
    out = []
    for line in self.lines():
      m = _TAG.match(line)
      e = _EVENT.match(_TAG_INSIDE.sub("", m.group(4)) if m else line)
      if e and (name is None or e.group(3) == name) and (
          rank is None or int(e.group(1)) == rank):
        out.append((int(e.group(1)), float(e.group(2)), e.group(4)))
    return out

  def event_text(self, name, rank):
    evs = self.events(name, rank)
    assert evs, f"rank {rank} printed no {name} event\n" + self.describe()
    return evs[0][2]

  def wait_for(self, name, ranks, timeout):
    """Waits until each of `ranks` printed a `name` event (or the job ends).

    Returns:
      True if they all did within `timeout` seconds.
    """
    deadline = time.time() + timeout
    with self._cv:
      while True:
        seen = {r for r, _, _ in self.events(name)}
        if set(ranks) <= seen:
          return True
        if self.proc.poll() is not None and not any(
            t.is_alive() for t in self._readers):
          return False
        left = deadline - time.time()
        if left <= 0:
          return False
        self._cv.wait(min(left, 0.5))

  # ----------------------------------------------------------- the end
  def wait(self, timeout=None, kill=True):
    """Waits for the job to end, at most `timeout` s (default: until the
    hard limit); then kills it and every process on the hosts (unless
    `kill` is False).

    Returns:
      The exit status (None if it still runs).
    """
    if timeout is None:
      timeout = max(0.0, self.start + self.hard_timeout - time.time())
    self._waiter.join(timeout)
    if self._waiter.is_alive():
      if not kill:
        return None
      self.timed_out = True
      self.kill()
      self._waiter.join()
    for t in self._readers:
      t.join(timeout=10)
    self.returncode = self.proc.returncode
    return self.returncode

  def kill(self):
    """SIGKILLs the job's process group and every process on the hosts."""
    try:
      os.killpg(self.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    self.cluster.kill_all()
    self.proc.wait()

  @property
  def elapsed(self):
    return (self.end or time.time()) - self.start

  def describe(self, limit=12000):
    text = (f"command: {' '.join(self.cmd)}\nexit status: {self.returncode}"
            f"{' (TIMED OUT, killed)' if self.timed_out else ''}, elapsed "
            f"{self.elapsed:.1f} s\n--- output ---\n{self.output}")
    return text if len(text) <= limit else "...\n" + text[-limit:]


def rank_pids(job, size=4):
  """{rank: (pid, host)} from the ranks' PID events."""
  out = {}
  for rank in range(size):
    pid, host = job.event_text("PID", rank).split()
    out[rank] = (int(pid), host)
  return out


def op_results(job, rank):
  """{name: value} of `rank`'s OP events (mh_rank.py --part ops)."""
  return {json.loads(text)[0]: json.loads(text)[1]
          for _, _, text in job.events("OP", rank)}


def wait_hosts_empty(cluster, until):
  """Polls the hosts until no process is left or time `until` passes.

  Returns:
    The time when they were found empty, or None.
  """
  while True:
    if cluster.empty():
      return time.time()
    if time.time() > until:
      return None
    time.sleep(0.1)


def describe_hosts(cluster):
  return "\n".join(f"  {h}: pid {p}: {cmd[:200]}"
                   for h, procs in cluster.processes().items()
                   for p, cmd in procs) or "  (none)"


def record(scenario, text):
  TIMINGS.append(f"{scenario}: {text}")


def _job_env(cluster, extra):
  env = clean_env(extra)
  env.update(cluster.env())
  return env


def _forwarded(env):
  fwd = []
  for name in sorted(env):
    if name.startswith("MPISTRATEGY_") or name in (
        "PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL", "CUDA_VISIBLE_DEVICES"):
      fwd += ["-x", name]
  return fwd


@pytest.fixture(scope="session")
def cluster():
  """The simulated hosts hosta and hostb, for the whole session."""
  if not _PROBED:
    _PROBED.append(hosts_lib.probe())
  reason = _PROBED[0]
  if reason is not None:
    if os.environ.get("MULTIHOST_REQUIRED") == "1":
      pytest.fail(f"multi-host tests cannot run here: {reason} "
                  "(MULTIHOST_REQUIRED=1, e.g. CI: they must run)",
                  pytrace=False)
    pytest.skip(f"{_SKIPPED_PREFIX}{reason}")
  hosts = hosts_lib.SimulatedHosts(HOSTS)
  import atexit
  atexit.register(hosts.down)
  hosts.up()
  try:
    yield hosts
  finally:
    hosts.down()
    atexit.unregister(hosts.down)


@pytest.fixture(autouse=True)
def hosts_left_empty(request):
  """Before: the hosts are empty.  After: kill leftovers, links up."""
  if "cluster" not in request.fixturenames:
    yield
    return
  hosts = request.getfixturevalue("cluster")
  assert hosts.empty(), ("processes from an earlier test still run:\n"
                         + describe_hosts(hosts))
  try:
    yield
  finally:
    left = describe_hosts(hosts) if not hosts.empty() else None
    assert hosts.kill_all(), "could not kill:\n" + describe_hosts(hosts)
    for h in hosts.names:
      if not hosts.link_is_up(h):
        hosts.set_link(h, True)
      if hosts.is_gone(h):
        hosts.set_gone(h, False)
    # A test that failed already says why; this catches one that forgot.
    if left and not getattr(request.node, "_mh_failed", False):
      pytest.fail("processes were left on the hosts after the test:\n" + left)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
  report = yield
  if report.when == "call" and report.failed:
    item._mh_failed = True  # pylint: disable=protected-access
  if report.when == "teardown":
    report.user_properties.extend((_TIMING_PROPERTY, line) for line in TIMINGS)
    TIMINGS.clear()
  return report


def pytest_runtest_logreport(report):
  """Collects timings and the skip reason (in the controller under xdist)."""
  _SUMMARY_TIMINGS.extend(value for name, value in report.user_properties
                          if name == _TIMING_PROPERTY)
  if report.skipped and not _SKIP_REASON:
    longrepr = report.longrepr  # (path, line, message) for a skip
    message = str(longrepr[-1] if isinstance(longrepr, (tuple, list))
                  else longrepr)
    if _SKIPPED_PREFIX in message:
      _SKIP_REASON.append(message.split(_SKIPPED_PREFIX, 1)[1])


@pytest.fixture
def mpirun_job(cluster):
  """`mpirun_job(script_args, hosts=..., np=4, env=None, timeout=150)`.

  Starts `mpirun -H hosts -np np python mh_rank.py script_args` on hosta
  (`wrapper`, a list, before `python`; or `program script_args`, `program`
  a list, instead of the script),
  under `timeout`, and returns a `LiveJob` (whose hard limit is a few
  seconds more, so that a hung `timeout` cannot block the test either).
  """
  jobs = []

  def start(script_args, hosts="hosta:2,hostb:2", np=4, env=None,
            timeout=150, program=None, wrapper=()):
    env = _job_env(cluster, env)
    marker = f"mpistrategy-multihost-{uuid.uuid4().hex[:12]}"
    argv = ["timeout", "-k", "5", str(timeout), MPIRUN, "-H", hosts]
    if np is not None:
      argv += ["-np", str(np)]
    argv += [*cluster.mpirun_flags(), "--tag-output", *_forwarded(env)]
    if program is None:
      argv += [*wrapper, PYTHON, SCRIPT, f"--marker={marker}", *script_args]
    else:
      argv += [*program, *script_args]
    job = LiveJob(cluster, argv, env, hard_timeout=timeout + 10)
    jobs.append(job)
    return job

  yield start
  for job in jobs:
    if job.proc.poll() is None:
      job.kill()


@pytest.fixture
def launcher_job(cluster):
  """`launcher_job(launcher_args, script_args, timeout=150)`.

  Starts `python -m mpistrategy.run LAUNCHER_ARGS mh_rank.py SCRIPT_ARGS` on
  hosta under `timeout`, with the agent and the TCP settings given the way
  a user gives them (--mpi-args).
  """
  jobs = []

  def start(launcher_args, script_args, timeout=150):
    env = _job_env(cluster, None)
    marker = f"mpistrategy-multihost-{uuid.uuid4().hex[:12]}"
    mpi_args = " ".join(cluster.mca_flags() + ["--tag-output"])
    # -P: the installed mpistrategy, not the checkout (the working directory).
    argv = ["timeout", "-k", "5", str(timeout), PYTHON, "-P", "-m",
            "mpistrategy.run", *launcher_args, f"--mpi-args={mpi_args}",
            SCRIPT, f"--marker={marker}", *script_args]
    job = LiveJob(cluster, argv, env, hard_timeout=timeout + 10)
    jobs.append(job)
    return job

  yield start
  for job in jobs:
    if job.proc.poll() is None:
      job.kill()


def pytest_terminal_summary(terminalreporter):
  if _SKIP_REASON:
    terminalreporter.write_sep(
        "!", f"{_SKIPPED_PREFIX}{_SKIP_REASON[0]}", red=True, bold=True)
  if _SUMMARY_TIMINGS:
    terminalreporter.write_sep("-", "multi-host timings")
    for line in _SUMMARY_TIMINGS:
      terminalreporter.write_line(line)
