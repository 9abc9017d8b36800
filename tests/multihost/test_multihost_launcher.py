"""`python -m mpistrategy.run -H hosta:2,hostb:2` across simulated hosts.

The launcher runs on hosta and starts mpirun there; the agent and the TCP
settings go in through --mpi-args, the way a user passes their site's
flags.  Checked: exit status 0, 4 ranks with the right rank, size, local
rank and host, one allreduce across hosts, the elapsed time, and that no
process is left on either host.  Without -np the launcher derives the
number of ranks from -H (issue #14 item 5).
"""

import json
import os
import time

import pytest

from conftest import describe_hosts
from conftest import wait_hosts_empty

SIZE = 4
TIMEOUT = 240


def _check(job):
  job.wait()
  left = None if job.cluster.empty() else describe_hosts(job.cluster)
  assert not job.timed_out, "the job hung\n" + job.describe()
  assert job.returncode == 0, job.describe()
  assert job.elapsed < TIMEOUT, job.describe()
  infos = [json.loads(t) for _, _, t in job.events("INIT")]
  assert sorted(i["rank"] for i in infos) == list(range(SIZE)), \
      job.describe()
  for info in infos:
    rank = info["rank"]
    assert info == {**info, "size": SIZE, "local_rank": rank % 2,
                    "local_size": 2, "sum": 10.0,
                    "host": "hosta" if rank < 2 else "hostb"}, (
                        f"rank {rank}: {info}\n" + job.describe())
  assert left is None, "processes outlived the job:\n" + left


@pytest.mark.timeout(TIMEOUT + 60)
def test_launcher_with_hosts_and_np(launcher_job):
  _check(launcher_job(["-H", "hosta:2,hostb:2", "-np", str(SIZE)],
                      ["--part", "topology"], timeout=TIMEOUT))


@pytest.mark.timeout(TIMEOUT + 60)
def test_launcher_derives_np_from_hosts(launcher_job):
  """No -np: 2 + 2 slots give 4 ranks."""
  _check(launcher_job(["-H", "hosta:2,hostb:2"], ["--part", "topology"],
                      timeout=TIMEOUT))


LOST_STEP = 5       # hostb crashes once rank 0 has done this many steps


@pytest.mark.timeout(2 * TIMEOUT + 60)
def test_lost_host_restart_goes_on_with_fewer_ranks(cluster, launcher_job,
                                                    tmp_path):
  """hostb crashes mid-fit; --restarts 1 --min-np 2 resumes on hosta alone.

  The crash: every process on hostb is killed and the agent no longer
  reaches it (as ssh to a dead machine).  The launcher's restart probes the
  hosts, drops hostb, and the job resumes from BackupAndRestore's backup
  with 2 ranks on hosta (the data sharded again for 2), to the end.
  """
  backup = str(tmp_path / "backup")
  job = launcher_job(
      ["-H", "hosta:2,hostb:2", "--restarts", "1", "--min-np", "2"],
      ["--part", "resume", f"--backup-dir={backup}", "--slow=0.3"],
      timeout=2 * TIMEOUT)
  deadline = time.time() + TIMEOUT
  while time.time() < deadline and not any(
      int(t) >= LOST_STEP for _, _, t in job.events("PROGRESS", 0)):
    if job.proc.poll() is not None:
      break
    time.sleep(0.2)
  if not any(int(t) >= LOST_STEP for _, _, t in job.events("PROGRESS", 0)):
    job.kill()
    job.wait()
    pytest.fail(f"rank 0 never reached step {LOST_STEP}\n" + job.describe())
  cluster.set_gone("hostb", True)
  assert cluster.kill_host("hostb") > 0
  job.wait()
  left = None if job.cluster.empty() else describe_hosts(job.cluster)
  assert not job.timed_out, "the job hung\n" + job.describe()
  assert job.returncode == 0, job.describe()
  out = job.output
  for text in ("attempt 1 of 2 ended: ",
               "lost hostb; going on with 2 ranks on hosta:2",
               "mpistrategy.run: attempt 2 of 2"):
    assert text in out, f"no {text!r}\n" + job.describe()
  resumed = job.events("RESUMED")
  # Attempt 1: 4 ranks from step 0; attempt 2: 2 ranks from a saved step.
  first = [t for r, _, t in resumed[:4]]
  assert first == ["0"] * 4, job.describe()
  second = {(r, t) for r, _, t in resumed[4:]}
  assert len(second) == 2 and {r for r, _ in second} == {0, 1}, job.describe()
  step = int(next(iter(second))[1])
  assert len({t for _, t in second}) == 1 and step >= 2, job.describe()
  finished = [json.loads(t) for _, _, t in job.events("FINISHED")]
  assert len(finished) == 2, job.describe()
  assert finished[0] == finished[1] and finished[0]["steps"] == 32, (
      job.describe())
  assert left is None, "processes outlived the job:\n" + left
  print(f"hostb lost after step {LOST_STEP}; resumed at step {step} on "
        f"hosta:2; whole job {job.elapsed:.1f} s")


@pytest.mark.timeout(TIMEOUT + 60)
def test_a_cut_off_host_leaves_no_segments_on_the_launchers_host(
    cluster, launcher_job):
  """hostb's link goes down mid-training: the job ends on the peer timeout.

  The launcher then removes the segments Open MPI left in hosta's
  /dev/shm that no live process maps.  A watcher each rank forks at the
  peer timeout (to end a stuck mpirun) was a copy of the rank: it kept
  those segments mapped past the launcher's clean-up, and they stayed.
  """
  shm = cluster.shm_dir("hosta")
  before = set(os.listdir(shm))
  job = launcher_job(["-H", "hosta:2,hostb:2", "--peer-timeout-seconds",
                      "10"], ["--part", "train", "--seconds", "120"],
                     timeout=TIMEOUT)
  if not job.wait_for("PROGRESS", range(SIZE), TIMEOUT / 2):
    job.kill()
    job.wait()
    pytest.fail("the job did not start training on every rank\n"
                + job.describe())
  cluster.set_link("hostb", False)
  job.wait()
  assert not job.timed_out, "the job hung\n" + job.describe()
  assert job.returncode != 0, job.describe()
  # The watchers end the cut-off host's daemon, then themselves.
  assert wait_hosts_empty(cluster, time.time() + 15), describe_hosts(cluster)
  left = sorted(n for n in set(os.listdir(shm)) - before
                if n.startswith("vader_segment."))
  assert not left, f"left in hosta's /dev/shm: {left}\n" + job.describe()
