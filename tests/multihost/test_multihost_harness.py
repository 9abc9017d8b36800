"""The simulated hosts themselves: isolation and clean-up (no TensorFlow).

* The hosts see only their own subnet (no default route, no other address)
  and have their own hostnames.
* Every host has a /dev/shm of its own, which keeps what is written there
  from one command to the next; a killed MPI job's segments stay in it and
  never reach the machine's /dev/shm.
* Creating hosts adds no interface to the root namespace.
* When the owner of a set of hosts is SIGKILLed (no `finally`, no atexit),
  its guardian still kills the processes on them and deletes the
  namespaces.
* `sweep_stale()` removes the namespaces and files (the hosts' tmpfs
  unmounted) whose owner is gone.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from conftest import PYTHON
import hosts as hosts_lib

HERE = os.path.dirname(os.path.abspath(__file__))


def _root_links():
  out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True,
                       text=True, check=True, timeout=30).stdout
  return sorted(line.split(":")[1].strip() for line in out.splitlines())


@pytest.mark.timeout(60)
def test_hosts_see_only_their_subnet(cluster):
  env = dict(os.environ, **cluster.env())
  for host in cluster.names:
    routes = subprocess.run(["ip", "-n", cluster.ns(host), "-4", "route"],
                            capture_output=True, text=True, check=True,
                            timeout=30).stdout.strip().splitlines()
    assert len(routes) == 1 and routes[0].startswith(hosts_lib.SUBNET), \
        routes
    out = subprocess.run(
        cluster.command(host, ["sh", "-c", "hostname; ip -4 -o addr"]),
        env=env, capture_output=True, text=True, check=True,
        timeout=30).stdout
    assert out.splitlines()[0] == host, out
    assert f"inet {cluster.address[host]}/24" in out, out
    assert "default" not in routes


def _on(cluster, host, script):
  """Runs shell `script` on `host`; returns its output."""
  return subprocess.run(
      cluster.command(host, ["sh", "-c", script]),
      env=dict(os.environ, **cluster.env()), capture_output=True, text=True,
      check=True, timeout=30).stdout


@pytest.mark.timeout(60)
def test_each_host_has_its_own_dev_shm(cluster):
  name = f"mpsmh-probe-{uuid.uuid4().hex[:8]}"
  try:
    for host in cluster.names:
      _on(cluster, host, f"echo {host} > /dev/shm/{name}")
    assert not os.path.exists(os.path.join("/dev/shm", name))
    for host in cluster.names:
      # A later command on the same host finds the host's own file.
      assert _on(cluster, host, f"cat /dev/shm/{name}").strip() == host
      with open(os.path.join(cluster.shm_dir(host), name),
                encoding="ascii") as f:
        assert f.read().strip() == host
  finally:
    for host in cluster.names:
      path = os.path.join(cluster.shm_dir(host), name)
      if os.path.exists(path):
        os.remove(path)


def _machine_segments(names):
  """Open MPI's segments of hosts `names` in the machine's /dev/shm."""
  return {n for n in os.listdir("/dev/shm")
          if any(f".{host}." in n for host in names)}


@pytest.mark.timeout(150)
def test_killed_job_leaves_its_segments_on_its_hosts(cluster, mpirun_job):
  before = _machine_segments(cluster.names)
  on_hosts = {h: set(os.listdir(cluster.shm_dir(h))) for h in cluster.names}
  # Once every rank has set up shared memory, every process of the job
  # (mpirun, Open MPI's daemons, the ranks) dies by SIGKILL, as when its
  # hosts crash: nothing is left to remove the segments.
  code = ("import time\n"
          "from mpi4py import MPI\n"
          "MPI.COMM_WORLD.Barrier()\n"
          "print('@@', MPI.COMM_WORLD.rank, 0, 'READY', flush=True)\n"
          "time.sleep(300)\n")
  job = mpirun_job([], program=[PYTHON, "-c", code], timeout=60)
  assert job.wait_for("READY", range(4), 50), job.describe()
  assert cluster.kill_all(), "could not kill the job"
  job.wait()
  left = {h: set(os.listdir(cluster.shm_dir(h))) - on_hosts[h]
          for h in cluster.names}
  try:
    assert all(any(n.startswith("vader_segment.") for n in left[h])
               for h in cluster.names), (
                   f"expected Open MPI's segments on each host: {left}\n"
                   + job.describe())
    assert _machine_segments(cluster.names) == before
  finally:
    for host, names in left.items():
      for n in names:
        os.remove(os.path.join(cluster.shm_dir(host), n))


@pytest.mark.timeout(90)
def test_guardian_cleans_up_after_a_killed_owner(cluster):
  del cluster  # only for the skip / required logic
  before = _root_links()
  code = (
      "import os, signal, subprocess, sys\n"
      f"sys.path.insert(0, {HERE!r})\n"
      "import hosts\n"
      "h = hosts.SimulatedHosts(['hostx', 'hosty']).up()\n"
      "p = subprocess.Popen(h.command('hostx', ['sh', '-c',\n"
      "                     'echo x > /dev/shm/left; exec sleep 300']),\n"
      "                     env=dict(os.environ, **h.env()),\n"
      "                     start_new_session=True)\n"
      "import time; time.sleep(1)\n"
      "left = os.path.join(h.shm_dir('hostx'), 'left')\n"
      "print(h.prefix, h.workdir, p.pid, os.path.exists(left), flush=True)\n"
      "os.kill(os.getpid(), signal.SIGKILL)\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, timeout=60, check=False)
  assert proc.returncode == -9, proc.stderr
  prefix, workdir, sleeper, left = proc.stdout.split()
  assert left == "True", "hostx's /dev/shm file was not in its directory"
  deadline = time.time() + 20
  while time.time() < deadline and (
      any(ns.startswith(prefix) for ns in hosts_lib.namespaces()) or
      os.path.exists(workdir)):
    time.sleep(0.2)
  assert not [ns for ns in hosts_lib.namespaces() if ns.startswith(prefix)]
  assert not os.path.exists(workdir)
  assert not hosts_lib.alive(int(sleeper)), "the process on hostx lives"
  assert _root_links() == before


@pytest.mark.timeout(60)
def test_sweep_removes_namespaces_of_dead_owners(cluster):
  del cluster
  gone = subprocess.Popen(["true"])  # a PID that just ended
  gone.wait()
  name = f"{hosts_lib.NS_PREFIX}{gone.pid}-stale"
  subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
  sleeper = subprocess.Popen(["ip", "netns", "exec", name, "sleep", "300"],
                             start_new_session=True)
  # The files of the same dead owner, with its hosts' tmpfs still mounted.
  workdir = os.path.join(tempfile.gettempdir(), name)
  os.makedirs(os.path.join(workdir, "shm"))
  subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "mpsmh-test",
                  os.path.join(workdir, "shm")], check=True, timeout=30)
  try:
    deadline = time.time() + 10
    while not hosts_lib.namespace_pids(name) and time.time() < deadline:
      time.sleep(0.1)
    assert hosts_lib.namespace_pids(name) == [sleeper.pid]
    assert name in hosts_lib.sweep_stale()
    assert name not in hosts_lib.namespaces()
    assert sleeper.wait(timeout=10) == -9
    assert not os.path.ismount(os.path.join(workdir, "shm"))
    assert not os.path.exists(workdir)
  finally:
    if os.path.ismount(os.path.join(workdir, "shm")):
      subprocess.run(["umount", os.path.join(workdir, "shm")], check=False,
                     timeout=30)
    shutil.rmtree(workdir, ignore_errors=True)
    if sleeper.poll() is None:
      sleeper.kill()
    if name in hosts_lib.namespaces():
      subprocess.run(["ip", "netns", "del", name], check=False, timeout=30)
