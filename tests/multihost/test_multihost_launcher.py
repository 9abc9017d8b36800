"""`python -m mpistrategy.run -H hosta:2,hostb:2` across simulated hosts.

The launcher runs on hosta and starts mpirun there; the agent and the TCP
settings go in through --mpi-args, the way a user passes their site's
flags.  Checked: exit status 0, 4 ranks with the right rank, size, local
rank and host, one allreduce across hosts, the elapsed time, and that no
process is left on either host.  Without -np the launcher derives the
number of ranks from -H (issue #14 item 5).
"""

import json

import pytest

from conftest import describe_hosts

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
