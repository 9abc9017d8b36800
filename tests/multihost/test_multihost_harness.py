"""The simulated hosts themselves: isolation and clean-up (no TensorFlow).

* The hosts see only their own subnet (no default route, no other address)
  and have their own hostnames.
* Creating hosts adds no interface to the root namespace.
* When the owner of a set of hosts is SIGKILLed (no `finally`, no atexit),
  its guardian still kills the processes on them and deletes the
  namespaces.
* `sweep_stale()` removes namespaces whose owner is gone.
"""

import os
import subprocess
import sys
import time

import pytest

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


@pytest.mark.timeout(90)
def test_guardian_cleans_up_after_a_killed_owner(cluster):
  del cluster  # only for the skip / required logic
  before = _root_links()
  code = (
      "import os, signal, subprocess, sys\n"
      f"sys.path.insert(0, {HERE!r})\n"
      "import hosts\n"
      "h = hosts.SimulatedHosts(['hostx', 'hosty']).up()\n"
      "p = subprocess.Popen(h.command('hostx', ['sleep', '300']),\n"
      "                     env=dict(os.environ, **h.env()),\n"
      "                     start_new_session=True)\n"
      "import time; time.sleep(1)\n"
      "print(h.prefix, h.workdir, p.pid, flush=True)\n"
      "os.kill(os.getpid(), signal.SIGKILL)\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, timeout=60, check=False)
  assert proc.returncode == -9, proc.stderr
  prefix, workdir, sleeper = proc.stdout.split()
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
  try:
    deadline = time.time() + 10
    while not hosts_lib.namespace_pids(name) and time.time() < deadline:
      time.sleep(0.1)
    assert hosts_lib.namespace_pids(name) == [sleeper.pid]
    assert name in hosts_lib.sweep_stale()
    assert name not in hosts_lib.namespaces()
    assert sleeper.wait(timeout=10) == -9
  finally:
    if sleeper.poll() is None:
      sleeper.kill()
    if name in hosts_lib.namespaces():
      subprocess.run(["ip", "netns", "del", name], check=False, timeout=30)
