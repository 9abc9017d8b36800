"""Runs a benchmark under mpirun across simulated hosts on this machine.

    sudo .venv/bin/python bench/on_simulated_hosts.py --hosts 2,1 -- \
        bench/allreduce.py --sizes 4KB,4MB,64MB --planes shm,mpi

Brings up one network namespace per host (tests/multihost/hosts.py: a
bridge, a veth pair and an address of its own per host, its own hostname
and /dev/shm), starts `mpirun -H hosta:N,hostb:M,...` on the first host
with the harness's Open MPI settings (TCP on the hosts' subnet only, no
binding), runs the given script with this interpreter on every rank, and
tears everything down afterwards, also on Ctrl-C.  Needs root (namespaces
and mounts).  The script's output goes to this terminal; the exit status
is the job's.  Every host shares this machine's cores, and TCP goes
through the kernel: compare ratios measured in the same job, not absolute
times (bench/RESULTS.md section 22).
"""

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "multihost"))
import hosts as hosts_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

HOST_NAMES = ["hosta", "hostb", "hostc", "hostd"]


def main():
  p = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--hosts", required=True,
                 help="ranks per host, comma-separated (e.g. 2,1)")
  p.add_argument("--timeout", type=int, default=1800,
                 help="seconds before the job is killed (default 1800)")
  p.add_argument("script", help="the Python script every rank runs")
  p.add_argument("args", nargs=argparse.REMAINDER,
                 help="the script's arguments")
  a = p.parse_args()
  try:
    counts = [int(c) for c in a.hosts.split(",")]
  except ValueError:
    p.error(f"--hosts must be integers separated by commas, got {a.hosts!r}")
  if not counts or len(counts) > len(HOST_NAMES) or min(counts) < 1:
    p.error(f"--hosts needs 1 to {len(HOST_NAMES)} hosts of >= 1 rank each, "
            f"got {a.hosts!r}")
  why = hosts_lib.probe()
  if why is not None:
    sys.exit(f"simulated hosts cannot run here: {why}")
  names = HOST_NAMES[:len(counts)]
  cluster = hosts_lib.SimulatedHosts(names)
  cluster.up()
  try:
    argv = ["timeout", "-k", "5", str(a.timeout), "mpirun", "-H",
            ",".join(f"{h}:{n}" for h, n in zip(names, counts)),
            "-np", str(sum(counts)), *cluster.mpirun_flags()]
    for name in sorted(os.environ):
      if name.startswith("MPISTRATEGY_"):
        argv += ["-x", name]
    argv += [sys.executable, os.path.abspath(a.script), *a.args]
    env = dict(os.environ, **cluster.env(), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return subprocess.run(cluster.command(names[0], argv), env=env,
                          cwd=ROOT, check=False).returncode
  finally:
    cluster.down()


if __name__ == "__main__":
  sys.exit(main())
