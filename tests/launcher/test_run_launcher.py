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

from mpistrategy.launch import command as launch_command
from _job_env import clean_env
from _job_env import leftovers
from procs import alive

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
# Open MPI --tag-output, the launcher's default: "[1,<rank>]<stdout>:".
_TAG = re.compile(r"^\[\d+,(\d+)\]<(stdout|stderr)>:(.*)$")


def _untag(line):
  m = _TAG.match(line)
  return m.group(3) if m else line


def _env(extra=None):
  # The launcher builds the mpirun command itself, so the tuning that
  # conftest's jobs pass as mpirun flags travels as OMPI_MCA_* variables:
  # single-copy shared memory (CMA) fails in many containers, and 2 ranks
  # may exceed the cores.
  return clean_env(dict({"OMPI_MCA_btl_vader_single_copy_mechanism": "none",
                         "OMPI_MCA_rmaps_base_oversubscribe": "1"},
                        **(extra or {})),
                   tf_log_level="2")


class Job:
  """One `python -m mpistrategy.run ...` process and what it printed."""

  def __init__(self, launcher_args, script_args=(), env=None, script=None,
               env_drop=()):
    self.marker = f"mpistrategy-run-{uuid.uuid4().hex[:12]}"
    self.cmd = [PYTHON, "-m", "mpistrategy.run", *launcher_args,
                script or SCRIPT, f"--marker={self.marker}", *script_args]
    self.start = time.time()
    environ = _env(env)
    for name in env_drop:
      environ.pop(name, None)
    self.proc = subprocess.Popen(
        self.cmd, env=environ, cwd=ROOT, stdin=subprocess.DEVNULL,
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
      m = _EVENT.match(_untag(line))
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

  def rank_lines(self, rank, stream=None):
    """Lines tagged with `rank` (and `stream`, "stdout" or "stderr")."""
    out = []
    for line in list(self.stdout) + list(self.stderr):
      m = _TAG.match(line)
      if m and int(m.group(1)) == rank and stream in (None, m.group(2)):
        out.append(m.group(3))
    return out

  def describe(self):
    text = (f"command: {' '.join(self.cmd)}\nexit status: {self.returncode}"
            f"{' (TIMED OUT, killed)' if self.timed_out else ''}\n"
            f"--- stdout ---\n" + "\n".join(self.stdout) +
            "\n--- stderr ---\n" + "\n".join(self.stderr))
    return text[-12000:]

  def assert_no_leftovers(self, pids=(), grace=5.0):
    deadline = time.time() + grace
    while time.time() < deadline:
      left = set(leftovers(self.marker)) | {p for p in pids if alive(p)}
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
    # Where 2 ranks fit this host's CPUs, each runs on a share of its own
    # (cpu_share_flags); otherwise every rank may run on every CPU.
    cpus = [{int(c) for c in job.events("CPUS", rank)[0].split(",")}
            for rank in range(NP)]
    mine = os.sched_getaffinity(0)
    if launch_command.cpu_share_flags(NP) is not None:
      assert [len(c) for c in cpus] == [len(mine) // NP] * NP, cpus
      assert not cpus[0] & cpus[1], cpus
      assert cpus[0] | cpus[1] <= mine, cpus
    else:
      assert cpus == [mine] * NP, cpus
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


def _wait_until_ready(job):
  """Waits for every rank's READY; fails the test (job killed) otherwise."""
  if not job.wait_for("READY", NP, timeout=TIMEOUT):
    job.kill()
    job.wait(timeout=30)
    pytest.fail("the ranks never got ready\n" + job.describe())


@pytest.mark.timeout(TIMEOUT + 30)
def test_sigterm_to_the_launcher_ends_the_job():
  job = Job(["-np", str(NP)], ["--wait"])
  try:
    _wait_until_ready(job)
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


def _mapped_open_mpi_segments(pids):
  """Open MPI's /dev/shm segments that the processes `pids` map."""
  segments = set()
  for pid in pids:
    try:
      with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as f:
        segments.update(line.split()[-1] for line in f
                        if "/dev/shm/vader_segment." in line)
    except OSError:
      pass
  return segments


@pytest.mark.timeout(TIMEOUT + 30)
def test_ctrl_c_twice_leaves_no_open_mpi_segments():
  # A second Ctrl-C makes mpirun give up on its orderly teardown: the ranks
  # die without unlinking Open MPI's shared-memory files, which then fill a
  # container's small /dev/shm job after job.  The launcher removes them.
  job = Job(["-np", str(NP)], ["--wait"])
  segments = set()
  try:
    _wait_until_ready(job)
    pids = _rank_pids(job)
    segments = _mapped_open_mpi_segments(pids)
    if not segments:
      pytest.skip("the ranks map no Open MPI shared-memory segment here")
    job.proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    job.proc.send_signal(signal.SIGINT)
    job.wait(timeout=60)
    assert not job.timed_out, job.describe()
    assert job.returncode == 128 + signal.SIGINT, job.describe()
    job.assert_no_leftovers(pids)
    left = sorted(path for path in segments if os.path.exists(path))
    assert not left, f"left in /dev/shm: {left}\n" + job.describe()
  finally:
    if job.returncode is None:
      job.kill()
      job.wait(timeout=30)
    for path in segments:
      if os.path.exists(path):
        os.unlink(path)


# --- output: rank prefix, quiet ranks, more ranks than cores, -H slots -------

OUTPUT_SCRIPT = os.path.join(HERE, "scripts", "run_output.py")
# What _env() adds for the other tests, removed so that the launcher's own
# choices are tested: its --oversubscribe, its --allow-run-as-root, and
# TensorFlow's default log level.
_LAUNCHER_DECIDES = ("OMPI_MCA_rmaps_base_oversubscribe",
                     "TF_CPP_MIN_LOG_LEVEL", "OMPI_ALLOW_RUN_AS_ROOT",
                     "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")
_START_UP = re.compile(r"cudart_stub|cpu_feature_guard|absl::InitializeLog|"
                       r"oneDNN|To enable the following instructions")


def _launcher_lines(job):
  return [l for l in job.stderr if l.startswith("mpistrategy.run: ")]


@pytest.mark.timeout(TIMEOUT + 30)
def test_three_ranks_on_two_cores_tagged_and_quiet():
  cores = os.cpu_count() or 1
  np_ = max(3, cores + 1)
  if np_ > 8:
    pytest.skip(f"{cores} cores: -np {np_} would be too slow here")
  job = Job(["-np", str(np_)], script=OUTPUT_SCRIPT,
            env={"PYTHONUNBUFFERED": "1"}, env_drop=_LAUNCHER_DECIDES).wait()
  try:
    assert not job.timed_out, job.describe()
    assert job.returncode == 0, job.describe()
    launcher = _launcher_lines(job)
    command = [l for l in launcher if "mpirun" in l]
    assert len(command) == 1 and "--oversubscribe" in command[0], launcher
    assert "--tag-output" in command[0], launcher
    if os.geteuid() == 0:
      notes = [l for l in launcher if "--allow-run-as-root" in l and
               "running as root" in l]
      assert len(notes) == 1, launcher
    # Every line of the job carries its rank, except the launcher's own and
    # mpirun's.
    untagged = [l for l in job.stdout + job.stderr
                if l and not _TAG.match(l) and l not in launcher]
    assert not untagged, job.describe()
    for rank in range(np_):
      assert job.events("RESULT", rank) == [f"{np_:g}"], job.describe()
      # print() under PYTHONUNBUFFERED arrives as one whole, tagged line.
      assert job.rank_lines(rank, "stdout").count(
          f"plain print from rank {rank} of {np_}") == 1, job.describe()
      stderr = "\n".join(job.rank_lines(rank, "stderr"))
      if rank == 0:
        assert _START_UP.search(stderr), job.describe()
        assert "UserWarning: a Python warning from rank 0" in stderr, stderr
        assert "a tensorflow logger warning from rank 0" in stderr, stderr
      else:
        assert not _START_UP.search(stderr), job.describe()
        assert "warning" not in stderr.lower(), job.describe()
  finally:
    job.assert_no_leftovers(_rank_pids(job))


@pytest.mark.timeout(TIMEOUT + 30)
def test_verbose_lets_every_rank_print():
  job = Job(["-np", "2", "--verbose"], script=OUTPUT_SCRIPT,
            env_drop=_LAUNCHER_DECIDES).wait()
  try:
    assert job.returncode == 0, job.describe()
    stderr = "\n".join(job.rank_lines(1, "stderr"))
    assert "UserWarning: a Python warning from rank 1" in stderr, \
        job.describe()
    assert _START_UP.search(stderr), job.describe()
  finally:
    job.assert_no_leftovers(_rank_pids(job))


@pytest.mark.timeout(TIMEOUT + 30)
def test_ranks_from_host_slots_untagged_and_an_error_in_full():
  job = Job(["-H", "localhost:2", "--no-tag-output"], ["--raise-rank", "1"],
            script=OUTPUT_SCRIPT, env_drop=_LAUNCHER_DECIDES).wait()
  try:
    assert not job.timed_out, job.describe()
    assert job.returncode != 0, job.describe()
    command = [l for l in _launcher_lines(job) if "mpirun" in l]
    assert " -np 2 -H localhost:2 " in command[0], command
    assert "--tag-output" not in command[0], command
    assert not any(_TAG.match(l) for l in job.stdout + job.stderr), \
        job.describe()
    assert sorted(job.events("RESULT")) == ["2", "2"], job.describe()
    # Rank 1's traceback, every line of it, although rank 1 is quiet.
    text = "\n".join(job.stderr)
    for piece in ["[rank 1] Traceback (most recent call last):",
                  "[rank 1]     raise RuntimeError(f\"deliberate failure on "
                  "rank {rank}\")",
                  "[rank 1] RuntimeError: deliberate failure on rank 1"]:
      assert piece in text, job.describe()
    # ... while its warnings stay hidden and rank 0's are shown.
    assert "a Python warning from rank 1" not in text, job.describe()
  finally:
    job.assert_no_leftovers(_rank_pids(job))
