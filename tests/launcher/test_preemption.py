"""Preemption, `--restarts` and a resume on more ranks, end to end.

Each job is `python -m mpistrategy.run ... scripts/preempt_job.py` (a linear
model, fixed data, SGD), started by `Job` of test_run_launcher.py with a
hard timeout and a unique marker.  Checked: the exit status (42 on
preemption), the time from the signal to the exit, the checkpoint, the
step a restart resumes at, final weights equal to an uninterrupted run's
(trained in the same process after the resumed run, see the script), and
that no process of the job is left.
"""

import json
import os
import re
import signal
import time

import pytest

from test_run_launcher import Job

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "preempt_job.py")
TIMEOUT = 150             # per attempt
GRACE_SECONDS = 25.0      # the launcher's default --kill-after
PREEMPTED = 42

_SAVED = re.compile(r"mpistrategy: preempted: rank (\d+) saved after step "
                    r"(\d+)(?: \(batch \d+ of epoch \d+\))? and exits "
                    r"([0-9.]+) s after the signal with status 42")


def _start(launcher_args, script_args):
  return Job(launcher_args, script_args, script=SCRIPT)


def _pids(job):
  return [int(text) for text in job.events("PID")]


def _preempted(job, np_):
  """{rank: (saved step, seconds from the signal)} of the ranks' messages."""
  found = {}
  for line in job.stdout + job.stderr:
    m = _SAVED.search(line)
    if m:
      found[int(m.group(1))] = (int(m.group(2)), float(m.group(3)))
  assert sorted(found) == list(range(np_)), job.describe()
  # The signal was acted on: no rank may also call it unsaved.
  assert not [line for line in job.stdout + job.stderr
              if "after the last step boundary" in line or
              "Exception ignored" in line], job.describe()
  return found


def _finish(job, timeout):
  try:
    job.wait(timeout=timeout)
  finally:
    if job.returncode is None:
      job.kill()
      job.wait(timeout=30)
    job.assert_no_leftovers(_pids(job))


@pytest.mark.timeout(2 * TIMEOUT + 60)
def test_sigterm_to_the_launcher_saves_and_3_ranks_resume(tmp_path):
  ckpt = str(tmp_path / "ckpt")
  first = _start(["-np", "2"], ["--mode=loop", f"--dir={ckpt}",
                                "--slow=0.3"])
  try:
    if not first.wait_for("STEP", 3, timeout=TIMEOUT):
      pytest.fail("the job never reached step 3\n" + first.describe())
    sent = time.time()
    first.proc.send_signal(signal.SIGTERM)  # the launcher only
  finally:
    _finish(first, TIMEOUT)
  stop = first.end - sent
  assert first.returncode == PREEMPTED, first.describe()
  assert stop < GRACE_SECONDS, first.describe()
  saved = _preempted(first, 2)
  step = saved[0][0]
  assert saved[1][0] == step and step >= 3, saved
  assert os.path.exists(os.path.join(ckpt, "checkpoint")), os.listdir(ckpt)
  print(f"np 2: launcher gone {stop:.2f} s after SIGTERM; saved after "
        f"step {step}; ranks: {saved}")

  # The same script on 3 ranks resumes at the saved step; each rank now
  # trains 4 of the 12 rows of a global batch instead of 6.
  second = _start(["-np", "3"], ["--mode=loop", f"--dir={ckpt}"])
  _finish(second, TIMEOUT)
  assert second.returncode == 0, second.describe()
  assert second.events("START") == [str(step)] * 3, second.describe()
  done = second.events("DONE")
  assert len(done) == 3 and len(set(done)) == 1, second.describe()
  # Sums over 3 ranks instead of 2 may round differently.
  assert all(float(d) <= 1e-6 for d in second.events("REF")), (
      second.describe())


@pytest.mark.timeout(3 * TIMEOUT + 60)
def test_fit_preempted_on_one_rank_then_killed_restarts_and_completes(
    tmp_path):
  backup = str(tmp_path / "backup")
  # Attempt 1: rank 1 gets SIGTERM after global step 6 (epoch 0 of 8
  # batches); attempt 2: rank 0 is killed with SIGKILL after step 11, one
  # step after BackupAndRestore(save_freq=4) saved at step 10.
  job = _start(["-np", "2", "--restarts", "2"],
               ["--mode=fit", f"--dir={backup}", "--act=0:1:6:SIGTERM",
                "--act=1:0:11:SIGKILL"])
  _finish(job, 3 * TIMEOUT)
  assert job.returncode == 0, job.describe()
  launcher = "\n".join(job.stderr)
  for text in ("attempt 1 of 3 ended: preempted (exit status 42",
               "attempt 2 of 3 ended: exit status 137",
               "mpistrategy.run: attempt 3 of 3"):
    assert text in launcher, job.describe()
  saved = _preempted(job, 2)
  assert {s for s, _ in saved.values()} == {6}, saved
  assert "saved after step 6 (batch 6 of epoch 1)" in "\n".join(
      job.stdout + job.stderr)
  assert max(t for _, t in saved.values()) < GRACE_SECONDS, saved
  assert job.events("START") == ["0"] * 2 + ["6"] * 2 + ["10"] * 2, (
      job.describe())
  weights = [json.loads(d) for d in job.events("DONE")]
  assert len(weights) == 2 and weights[0] == weights[1], job.describe()
  # Same ranks, same batches in the same order: bit for bit.
  assert job.events("REF") == ["0.0", "0.0"], job.describe()
  assert not os.path.exists(backup)  # removed after the completed fit
  print(f"fit: 3 attempts in {job.end - job.start:.1f} s; preempted: "
        f"{saved}")
