"""The engine's GPU data-plane logic across 2 simulated hosts, on CPU.

tests/gpu/engine_check on the fake device (cc/device/fake_device.h: host
memory, a stream that runs its work late on a thread of its own), built by
Bazel, under `mpirun -H hosta:2,hostb:2`: every collective and fusion,
checked element by element on every rank, through host staging over TCP and
through the hierarchical plane split by the real hosts (inside a host and
between hosts), as on GPU machines with NCCL's place taken by staging.
"""

import os
import re
import subprocess
import time

import pytest

from conftest import ROOT
from conftest import describe_hosts
from conftest import wait_hosts_empty

TARGET = "//tests/gpu/engine_check:engine_check_fake"
BINARY = os.path.join(ROOT, "bazel-bin", "tests", "gpu", "engine_check",
                      "engine_check_fake")
SIZE = 4
TIMEOUT = 120


@pytest.fixture(scope="module")
def engine_check():
  """The fake-device engine check (`make test`'s C++ stage builds it)."""
  if not os.path.exists(BINARY):
    proc = subprocess.run(["bazel", "build", TARGET], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200,
                          check=False, stdin=subprocess.DEVNULL)
    subprocess.run(["bazel", "shutdown"], cwd=ROOT, capture_output=True,
                   timeout=120, check=False)
    assert proc.returncode == 0, f"bazel build {TARGET}:\n{proc.stderr[-4000:]}"
  return BINARY


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("plane", ["staging", "hierarchical"])
def test_engine_check_on_the_fake_device(engine_check, mpirun_job, cluster,
                                         plane):
  args = ["--hierarchical"] if plane == "hierarchical" else []
  job = mpirun_job(args, program=[engine_check], timeout=TIMEOUT)
  job.wait()
  assert not job.timed_out, "the engine check hung\n" + job.describe()
  assert job.returncode == 0, job.describe()
  passed = {int(m.group(1)) for m in
            re.finditer(r"engine_check rank (\d+): PASS", job.output)}
  assert passed == set(range(SIZE)), job.describe()
  assert wait_hosts_empty(cluster, time.time() + 10), (
      "processes outlived the job:\n" + describe_hosts(cluster))
