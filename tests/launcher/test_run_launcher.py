"""`python -m mpistrategy.run` end to end: real jobs on 2 ranks.

pytest starts the launcher (which starts mpirun) with
scripts/run_launcher.py, a hard wall-clock timeout and a unique marker on
the command line, then checks what the ranks printed, the exit status, and
that no process of the job outlived it.  Open MPI tuning that this
container needs travels as OMPI_MCA_* variables (mpirun reads them itself).
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from _job_env import clean_env
from _job_env import leftovers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(HERE, "scripts", "run_launcher.py")
PYTHON = os.environ.get("PYTHON") or (
    os.path.join(ROOT, ".venv", "bin", "python")
    if os.path.exists(os.path.join(ROOT, ".venv", "bin", "python"))
    else sys.executable)
NP = 2
TIMEOUT = 150           # per job; the whole process group is killed then
STOP_SECONDS = 10.0     # SIGTERM to the launcher -> every process gone

_EVENT = re.compile(r"^@@ (\d+) ([0-9.]+) (\S+) ?(.*)$")


def _env(extra=None):
  # The launcher builds the mpirun command itself, so the tuning that
  # conftest's jobs pass as mpirun flags travels as OMPI_MCA_* variables:
  # single-copy shared memory (CMA) fails in many containers, and 2 ranks
  # may exceed the cores.
  return clean_env(dict({"OMPI_MCA_btl_vader_single_copy_mechanism": "none",
                         "OMPI_MCA_rmaps_base_oversubscribe": "1"},
                        **(extra or {})),
                   tf_log_level="2")


def _alive(pid):
  """True if `pid` exists and is not a zombie."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except (OSError, IndexError):
    return False


class Job:
  """One `python -m mpistrategy.run ...` process and what it printed."""

  def __init__(self, launcher_args, script_args=(), env=None):
    self.marker = f"mpistrategy-run-{uuid.uuid4().hex[:12]}"
    self.cmd = [PYTHON, "-m", "mpistrategy.run", *launcher_args, SCRIPT,
                f"--marker={self.marker}", *script_args]
    self.start = time.time()
    self.proc = subprocess.Popen(
        self.cmd, env=_env(env), cwd=ROOT, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        errors="replace", start_new_session=True)
    self.stdout, self.stderr = [], []
    self._readers = [
        threading.Thread(target=self._read, args=(self.proc.stdout,
                                                  self.stdout), daemon=True),
        threading.Thread(target=self._read, args=(self.proc.stderr,
                                                  self.stderr), daemon=True)]
    for t in self._readers:
      t.start()
    self.timed_out = False
    self.returncode = None
    self.end = None

  @staticmethod
  def _read(stream, lines):
    for line in stream:
      lines.append(line.rstrip("\n"))

  def wait(self, timeout=TIMEOUT):
    try:
      self.returncode = self.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self.timed_out = True
      self.kill()
      self.returncode = self.proc.wait()
    self.end = time.time()
    for t in self._readers:
      t.join(timeout=10)
    return self

  def kill(self):
    try:
      os.killpg(self.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    for pid in leftovers(self.marker):
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass

  def events(self, name, rank=None):
    out = []
    for line in list(self.stdout) + list(self.stderr):
      m = _EVENT.match(line)
      if m and m.group(3) == name and (rank is None or
                                       int(m.group(1)) == rank):
        out.append(m.group(4))
    return out

  def wait_for(self, name, count, timeout):
    """Waits until `count` ranks printed `name`; False on exit or timeout."""
    deadline = time.time() + timeout
    while time.time() < deadline:
      if len(self.events(name)) >= count:
        return True
      if self.proc.poll() is not None:
        return False
      time.sleep(0.1)
    return False

  def describe(self):
    text = (f"command: {' '.join(self.cmd)}\nexit status: {self.returncode}"
            f"{' (TIMED OUT, killed)' if self.timed_out else ''}\n"
            f"--- stdout ---\n" + "\n".join(self.stdout) +
            "\n--- stderr ---\n" + "\n".join(self.stderr))
    return text[-12000:]

  def assert_no_leftovers(self, pids=(), grace=5.0):
    deadline = time.time() + grace
    while time.time() < deadline:
      left = set(leftovers(self.marker)) | {p for p in pids if _alive(p)}
      if not left:
        return
      time.sleep(0.2)
    detail = subprocess.run(
        ["ps", "-o", "pid,stat,etime,args", "-p", ",".join(map(str, left))],
        capture_output=True, text=True, check=False).stdout
    self.kill()
    for pid in pids:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    pytest.fail(f"processes of the job outlived it by {grace} s:\n{detail}\n"
                + self.describe())


@pytest.fixture(scope="module", autouse=True)
def _needs_mpirun():
  if shutil.which("mpirun") is None or shutil.which("pgrep") is None:
    pytest.skip("mpirun or pgrep not found")


def _rank_pids(job):
  return [int(text) for text in job.events("PID")]


@pytest.mark.timeout(TIMEOUT + 30)
def test_runs_the_script_on_every_rank():
  job = Job(["-np", str(NP)]).wait()
  try:
    assert not job.timed_out, job.describe()
    assert job.returncode == 0, job.describe()
    for rank in range(NP):
      assert job.events("INIT", rank) == [f"rank={rank} size={NP}"], \
          job.describe()
      # SUM over ranks of rank + 1.
      assert job.events("RESULT", rank) == [f"{NP * (NP + 1) // 2:g}"], \
          job.describe()
      assert job.events("DONE", rank), job.describe()
    # The command was printed once, on stderr, shell-quoted, with this
    # interpreter.
    printed = [l for l in job.stderr if l.startswith("mpistrategy.run: ")
               and "mpirun" in l]
    assert len(printed) == 1, job.describe()
    assert f" -np {NP} " in printed[0], printed[0]
    assert PYTHON in printed[0] or os.path.realpath(PYTHON) in printed[0], \
        printed[0]
  finally:
    job.assert_no_leftovers(_rank_pids(job))


@pytest.mark.timeout(TIMEOUT + 30)
def test_option_flag_reaches_every_rank():
  job = Job(["-np", str(NP), "--stall-warning-seconds", "7",
             "--cycle-time-ms", "2.5"]).wait()
  try:
    assert job.returncode == 0, job.describe()
    for rank in range(NP):
      options = job.events("OPTIONS", rank)
      assert options, job.describe()
      assert "stall_warning_seconds=7.0" in options[0].split(), options[0]
      assert "cycle_time_ms=2.5" in options[0].split(), options[0]
  finally:
    job.assert_no_leftovers(_rank_pids(job))


@pytest.mark.timeout(TIMEOUT + 30)
def test_exit_code_of_a_rank_is_the_launchers():
  job = Job(["-np", str(NP)], ["--exit-rank", "1", "--exit-code", "3"]).wait()
  try:
    assert not job.timed_out, job.describe()
    assert job.events("EXIT", 1) == ["3"], job.describe()
    assert job.returncode == 3, job.describe()
  finally:
    job.assert_no_leftovers(_rank_pids(job))


@pytest.mark.timeout(TIMEOUT + 30)
def test_sigterm_to_the_launcher_ends_the_job():
  job = Job(["-np", str(NP)], ["--wait"])
  try:
    ready = job.wait_for("READY", NP, timeout=TIMEOUT)
    if not ready:
      job.kill()
      job.wait(timeout=30)
      pytest.fail("the ranks never got ready\n" + job.describe())
    pids = _rank_pids(job)
    assert len(pids) == NP, job.describe()
    sent = time.time()
    job.proc.send_signal(signal.SIGTERM)  # the launcher only
    job.wait(timeout=60)
    stop = job.end - sent
    assert not job.timed_out, job.describe()
    assert job.returncode == 128 + signal.SIGTERM, job.describe()
    assert stop <= STOP_SECONDS, (
        f"the launcher exited {stop:.1f} s after SIGTERM (limit "
        f"{STOP_SECONDS} s)\n" + job.describe())
    print(f"launcher gone {stop:.2f} s after SIGTERM")
    job.assert_no_leftovers(pids, grace=STOP_SECONDS - stop + 1.0)
  finally:
    if job.returncode is None:
      job.kill()
      job.wait(timeout=30)
    job.assert_no_leftovers(_rank_pids(job))
