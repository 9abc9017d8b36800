"""Simulated hosts on one machine: network + UTS namespaces on a bridge.

`SimulatedHosts(["hosta", "hostb"]).up()` creates, for an owner process P:

* a namespace `mpsmh<P>-br` holding a Linux bridge `br0`;
* per host H a namespace `mpsmh<P>-H` with `lo` and `eth0`, one end of a veth
  pair whose other end (`v-H`) is a port of `br0`; `eth0` gets
  10.77.0.<i>/24, i = 1, 2, ...;
* a hosts file (`H` -> its address) that `agent.sh` bind-mounts over
  /etc/hosts, and a UTS namespace with hostname H for every command run on H;
* per host H a directory on a tmpfs of the hosts' own that `agent.sh`
  bind-mounts over /dev/shm, so that every host has a /dev/shm of its own
  and a job killed on it leaves nothing in the machine's /dev/shm.

Nothing is created in the root network namespace, and the only addresses
are the ones above, so the machine's own networking is untouched and no
other address is reachable from the hosts.  `down()` kills every process in
the host namespaces (by PID, from `ip netns pids`) and deletes the
namespaces, which removes every interface with them, unmounts the hosts'
tmpfs and removes their files.
Three things make sure that happens even when a test run dies half-way:
  * the pytest fixture calls `down()` in a `finally` and from `atexit`;
  * a guardian process (this file run as a script) waits for the owner to
    die and then removes the owner's namespaces, for the cases in which no
    Python code runs any more (SIGKILL, pytest-timeout's os._exit);
  * `sweep_stale()`, run before every set-up, removes the namespaces and
    files of owners that no longer exist.

`probe()` says why namespaces cannot be used here (not root, no `ip`, no
`unshare`, the kernel or container forbids them), or returns None.
"""

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# tests/ holds the helpers shared by the suites; this file also runs as a
# script (the guardian), where pytest has not put tests/ on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from procs import alive  # pylint: disable=g-import-not-at-top,wrong-import-position

HERE = os.path.dirname(os.path.abspath(__file__))
AGENT = os.path.join(HERE, "agent.sh")
NS_PREFIX = "mpsmh"
SUBNET = "10.77.0.0/24"
_ADDRESS = "10.77.0.{}"
_OWNED = re.compile(rf"^{NS_PREFIX}(\d+)-")
_CMD_TIMEOUT = 30


def _run(argv, check=True, env=None):
  """Runs a short administrative command; returns its CompletedProcess."""
  proc = subprocess.run(argv, capture_output=True, text=True, check=False,
                        timeout=_CMD_TIMEOUT, stdin=subprocess.DEVNULL,
                        env=env)
  if check and proc.returncode != 0:
    raise RuntimeError(f"`{shlex.join(argv)}` failed (exit {proc.returncode})"
                       f": {(proc.stderr or proc.stdout).strip()}")
  return proc


def _cmdline(pid):
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
  except OSError:
    return "?"


def namespaces():
  """Names of all named network namespaces (`ip netns list`)."""
  out = _run(["ip", "netns", "list"]).stdout
  return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(ns):
  """Live PIDs whose network namespace is `ns` ([] if `ns` is gone)."""
  proc = _run(["ip", "netns", "pids", ns], check=False)
  if proc.returncode != 0:
    return []
  return [int(p) for p in proc.stdout.split() if alive(int(p))]


def _remove(names):
  """Kills every process in the namespaces `names`, then deletes them."""
  deadline = time.time() + 20
  while True:
    pids = [p for ns in names for p in namespace_pids(ns)]
    if not pids or time.time() > deadline:
      break
    for pid in pids:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    time.sleep(0.1)
  errors = []
  for ns in names:
    proc = _run(["ip", "netns", "del", ns], check=False)
    if proc.returncode != 0 and ns in namespaces():
      errors.append(f"{ns}: {proc.stderr.strip()}")
  if errors:
    raise RuntimeError("could not delete namespaces: " + "; ".join(errors))


def _stale(name):
  match = _OWNED.match(name)
  return match is not None and not alive(int(match.group(1)))


def sweep_stale():
  """Removes the namespaces and files of runs whose owner process is gone.

  Returns:
    The namespaces removed.
  """
  stale = [ns for ns in namespaces() if _stale(ns)]
  if stale:
    _remove(stale)
  parent = tempfile.gettempdir()
  for name in os.listdir(parent):
    if _stale(name) and os.path.isdir(os.path.join(parent, name)):
      _remove_files(os.path.join(parent, name))
  return stale


def _shm_root(workdir):
  """Where the hosts' tmpfs is mounted (their /dev/shm directories)."""
  return os.path.join(workdir, "shm")


def _remove_files(workdir):
  """Unmounts the hosts' tmpfs (lazily: a process may still hold it) and
  removes `workdir`."""
  if os.path.ismount(_shm_root(workdir)):
    _run(["umount", "--lazy", _shm_root(workdir)], check=False)
  shutil.rmtree(workdir, ignore_errors=True)


def probe():
  """Returns why simulated hosts cannot be made here, or None if they can."""
  if not sys.platform.startswith("linux"):
    return f"not Linux ({sys.platform})"
  if os.geteuid() != 0:
    return "not root (network namespaces need CAP_NET_ADMIN and CAP_SYS_ADMIN)"
  for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"),
                        ("mpirun", "openmpi-bin")):
    if shutil.which(tool) is None:
      return f"`{tool}` not found (Debian package {package})"
  name = f"{NS_PREFIX}{os.getpid()}-probe"
  try:
    proc = _run(["ip", "netns", "add", name], check=False)
    if proc.returncode != 0:
      return f"`ip netns add` failed: {proc.stderr.strip()}"
    proc = _run(["ip", "netns", "exec", name, "unshare", "--uts", "--",
                 "hostname", "mpsmh-probe"], check=False)
    if proc.returncode != 0:
      return (f"`unshare --uts` inside a network namespace failed: "
              f"{proc.stderr.strip()}")
    proc = _run(["ip", "-n", name, "link", "add", "p0", "type", "veth",
                 "peer", "name", "p1"], check=False)
    if proc.returncode != 0:
      return f"cannot create a veth pair: {proc.stderr.strip()}"
    proc = _run(["ip", "-n", name, "link", "add", "b0", "type", "bridge"],
                check=False)
    if proc.returncode != 0:
      return f"cannot create a bridge: {proc.stderr.strip()}"
  finally:
    if name in namespaces():
      _remove([name])
  return None


class SimulatedHosts:
  """Hosts `names` as network namespaces on one bridge (see module doc)."""

  def __init__(self, names=("hosta", "hostb"), owner=None):
    self.names = list(names)
    self.owner = os.getpid() if owner is None else owner
    self.prefix = f"{NS_PREFIX}{self.owner}-"
    self.bridge_ns = self.prefix + "br"
    self.address = {h: _ADDRESS.format(i + 1)
                    for i, h in enumerate(self.names)}
    self.workdir = None
    self.hosts_file = None
    self._guardian = None
    self._created = []

  def ns(self, host):
    return self.prefix + host

  def shm_dir(self, host):
    """The directory that is /dev/shm on `host` (while the hosts are up)."""
    return os.path.join(_shm_root(self.workdir), host)

  # ------------------------------------------------------------ set-up
  def up(self):
    """Creates the namespaces, the bridge, the veths and the hosts file.

    Raises:
      RuntimeError: A step failed (everything created so far is removed).
    """
    sweep_stale()
    self.workdir = tempfile.mkdtemp(prefix=f"{NS_PREFIX}{self.owner}-")
    self.hosts_file = os.path.join(self.workdir, "hosts")
    with open(self.hosts_file, "w", encoding="ascii") as f:
      f.write("127.0.0.1 localhost\n")
      for host in self.names:
        f.write(f"{self.address[host]} {host}\n")
    self._start_guardian()
    try:
      self._mount_shm()
      self._add_ns(self.bridge_ns)
      br = ["ip", "-n", self.bridge_ns]
      _run(br + ["link", "add", "br0", "type", "bridge"])
      _run(br + ["link", "set", "br0", "up"])
      for host in self.names:
        ns = self.ns(host)
        self._add_ns(ns)
        _run(["ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer",
              "name", f"v-{host}"[:15], "netns", self.bridge_ns])
        _run(br + ["link", "set", f"v-{host}"[:15], "master", "br0"])
        _run(br + ["link", "set", f"v-{host}"[:15], "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{self.address[host]}/24",
              "dev", "eth0"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
      for host in self.names:
        out = _run(self.command(host, ["hostname"]),
                   env=dict(os.environ, **self.env())).stdout.strip()
        if out != host:
          raise RuntimeError(f"host {host} calls itself {out!r}")
    except BaseException:
      self.down()
      raise
    return self

  def _mount_shm(self):
    """A tmpfs as large as the machine's /dev/shm, a directory per host.

    Mounted in the machine's mount namespace, under the work directory, so
    that a command on one host can still start one on another (mpirun on
    hosta runs `agent.sh hostb ...`, whose /dev/shm directory the bind
    mount over hosta's /dev/shm would hide were it under /dev/shm).
    """
    root = _shm_root(self.workdir)
    os.makedirs(root)
    fs = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    size = f"size={fs.f_blocks * fs.f_frsize}," if fs and fs.f_blocks else ""
    _run(["mount", "-t", "tmpfs", "-o", f"{size}mode=0755",
          f"{NS_PREFIX}{self.owner}", root])
    for host in self.names:
      os.makedirs(self.shm_dir(host))
      os.chmod(self.shm_dir(host), 0o1777)  # as /dev/shm

  def _add_ns(self, ns):
    _run(["ip", "netns", "add", ns])
    self._created.append(ns)
    _run(["ip", "-n", ns, "link", "set", "lo", "up"])

  def _start_guardian(self):
    self._guardian = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--guard",
         str(self.owner), self.prefix, self.workdir],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)

  # --------------------------------------------------------- tear-down
  def down(self):
    """Kills every process on the hosts; deletes namespaces and files."""
    try:
      mine = [ns for ns in namespaces() if ns.startswith(self.prefix)]
      _remove([self.ns(h) for h in self.names if self.ns(h) in mine] +
              [ns for ns in mine if ns not in map(self.ns, self.names)])
      self._created = []
    finally:
      if self._guardian is not None:
        self._guardian.kill()
        self._guardian.wait()
        self._guardian = None
      if self.workdir:
        _remove_files(self.workdir)
        self.workdir = None

  # ------------------------------------------------------------- use
  def env(self):
    """Variables `agent.sh` needs (put them in the job's environment)."""
    return {"MULTIHOST_NS_PREFIX": self.prefix,
            "MULTIHOST_HOSTS_FILE": self.hosts_file,
            "MULTIHOST_SHM_DIR": _shm_root(self.workdir),
            "MULTIHOST_GONE_DIR": self._gone_dir()}

  def _gone_dir(self):
    return os.path.join(self.workdir, "gone")

  @contextlib.contextmanager
  def small_shm(self, host, size_bytes):
    """Within the block, `host`'s /dev/shm is a tmpfs of `size_bytes`.

    Mounted over the host's /dev/shm directory (hiding what is there), so
    only commands started on `host` inside the block see it; unmounted
    after it (lazily: a process may still hold it), and with the hosts.
    """
    path = self.shm_dir(host)
    _run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=1777",
          f"{self.prefix}{host}-shm", path])
    try:
      yield
    finally:
      _run(["umount", "--lazy", path], check=False)

  def set_gone(self, host, gone):
    """From now on `agent.sh` refuses to start anything on `host` (or not).

    With `kill_host`, this is a host that crashed: its processes die and
    mpirun cannot reach it any more.
    """
    os.makedirs(self._gone_dir(), exist_ok=True)
    marker = os.path.join(self._gone_dir(), host)
    if gone:
      open(marker, "w", encoding="ascii").close()
    elif os.path.exists(marker):
      os.remove(marker)

  def is_gone(self, host):
    return os.path.exists(os.path.join(self._gone_dir(), host))

  def kill_host(self, host):
    """SIGKILLs every process on `host`; the number killed."""
    pids = namespace_pids(self.ns(host))
    for pid in pids:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    return len(pids)

  def command(self, host, argv):
    """`argv` to run on `host` (through agent.sh, like `ssh host argv`)."""
    return [AGENT, host, shlex.join(argv)]

  def processes(self):
    """{host: [(pid, command line), ...]} of live processes on the hosts."""
    return {h: [(p, _cmdline(p)) for p in namespace_pids(self.ns(h))]
            for h in self.names}

  def empty(self):
    return not any(self.processes().values())

  def kill_all(self, timeout=20):
    """SIGKILLs every process on the hosts; True once none is left."""
    deadline = time.time() + timeout
    while True:
      pids = [p for h in self.names for p in namespace_pids(self.ns(h))]
      if not pids:
        return True
      if time.time() > deadline:
        return False
      for pid in pids:
        try:
          os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
      time.sleep(0.1)

  def set_link(self, host, up):
    """`ip link set eth0 up|down` inside `host`'s namespace."""
    _run(["ip", "-n", self.ns(host), "link", "set", "eth0",
          "up" if up else "down"])

  def link_is_up(self, host):
    out = _run(["ip", "-n", self.ns(host), "-o", "link", "show", "eth0"]).stdout
    return ",UP" in out or "<UP" in out

  def mca_flags(self):
    """Open MPI settings: our agent instead of ssh, TCP only on our subnet.

    (Single-copy shared memory between the ranks of one host fails in many
    containers, hence `none`.)
    """
    return ["--mca", "plm_rsh_agent", AGENT,
            "--mca", "btl", "tcp,self,vader",
            "--mca", "btl_tcp_if_include", SUBNET,
            "--mca", "oob_tcp_if_include", SUBNET,
            "--mca", "btl_vader_single_copy_mechanism", "none"]

  def mpirun_flags(self):
    """`mca_flags()` plus placement: as many ranks as slots, no binding."""
    return self.mca_flags() + ["--oversubscribe", "--bind-to", "none",
                               "--map-by", "slot"]


def _guard(owner, prefix, workdir):
  """Waits for process `owner` to end, then removes its namespaces."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGHUP, signal.SIG_IGN)
  while alive(owner):
    time.sleep(0.5)
  mine = [ns for ns in namespaces() if ns.startswith(prefix)]
  if mine:
    _remove(mine)
  _remove_files(workdir)


if __name__ == "__main__":
  if len(sys.argv) == 5 and sys.argv[1] == "--guard":
    _guard(int(sys.argv[2]), sys.argv[3], sys.argv[4])
  elif len(sys.argv) == 2 and sys.argv[1] == "--sweep":
    print("removed:", " ".join(sweep_stale()) or "nothing")
  else:
    sys.exit(f"usage: {sys.argv[0]} --sweep | --guard OWNER PREFIX WORKDIR")
