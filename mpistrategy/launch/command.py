"""Command building: the `mpirun`/`srun` command line and its environment.

`build_command` turns parsed arguments into a `Command` for Open MPI, MPICH
(Hydra) or Slurm's `srun`; `find_launcher` and `detect_mpi_flavour` pick the
launcher.  Nothing here starts a process (except `mpirun --version`) or
imports TensorFlow or MPI.
"""

import dataclasses
import os
import re
import shlex
import shutil
import site
import subprocess
import sys
import warnings

from mpistrategy import options as options_lib

PROG = "mpistrategy.run"


CONSOLE_SCRIPT = "mpistrategyrun"  # pyproject.toml: mpistrategy.run:main


# Environment variables exported to the ranks by name (Open MPI `-x NAME`)
# when they are set, and prefixes of further ones.
EXPORTED_VARIABLES = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH",
                      "PYTHONUNBUFFERED", "TF_CPP_MIN_LOG_LEVEL",
                      "CUDA_VISIBLE_DEVICES")


# HOROVOD_*: the tuning variables of Horovod scripts (mpistrategy.horovod
# reads them), which horovodrun forwarded.
EXPORTED_PREFIXES = ("NCCL_", "MPISTRATEGY_", "HOROVOD_")


ENV_PREFIX = "MPISTRATEGY_"


# The rank program runs behind `python -m mpistrategy.quiet` (see there).
QUIET_MODULE = "mpistrategy.quiet"


# Set by resource managers inside an allocation: mpirun then takes the
# hosts and slots from the allocation, and `-np` beyond them is an error
# worth keeping.
_ALLOCATION_VARIABLES = ("SLURM_JOB_ID", "PBS_JOBID", "PBS_NODEFILE",
                         "LSB_JOBID", "PE_HOSTFILE", "FLUX_JOB_ID")


_HOST = re.compile(r"^([^\s:,]+)(?::(\d+))?$")


# How a user places ranks on CPUs in Open MPI's own terms: flags (without
# their dashes) and MCA parameters (`--mca NAME VALUE` or OMPI_MCA_NAME).
# Where the user sets a binding, the launcher adds none; where the user sets
# a mapping, it adds none; a rankfile or CPUs per rank set both.
_BINDING_FLAGS = frozenset({"bind-to", "cpus-per-proc", "cpus-per-rank",
                            "cpu-set", "cpu-list", "rankfile", "rf",
                            "use-hwthread-cpus"})
_MAPPING_FLAGS = frozenset({"map-by", "cpus-per-proc", "cpus-per-rank",
                            "rankfile", "rf", "npernode", "npersocket"})
_BINDING_PARAMETERS = frozenset({"hwloc_base_binding_policy",
                                 "hwloc_base_cpu_set", "hwloc_base_cpu_list",
                                 "rmaps_base_cpus_per_rank",
                                 "rmaps_rank_file_path"})
_MAPPING_PARAMETERS = frozenset({"rmaps_base_mapping_policy",
                                 "rmaps_base_cpus_per_rank",
                                 "rmaps_rank_file_path"})
# Flags that name hosts; with any of them the job is not on this host alone.
_HOST_FLAGS = frozenset({"H", "host", "hostfile", "machinefile",
                         "default-hostfile"})


def _user_placement(mpi_args, environ):
  """What the user's Open MPI arguments and variables already decide.

  Args:
    mpi_args: The `--mpi-args` tokens.
    environ: The launcher's environment.

  Returns:
    `(binds, maps, names_hosts)`: whether they set a binding, a mapping, and
    hosts.
  """
  binds = maps = names_hosts = False
  for i, arg in enumerate(mpi_args):
    if arg.startswith("-"):
      name = arg.lstrip("-").split("=", 1)[0]
      binds |= name in _BINDING_FLAGS
      maps |= name in _MAPPING_FLAGS
      names_hosts |= name in _HOST_FLAGS
      # `--map-by X:PE=n` binds n CPUs to each rank.
      if name == "map-by" and "pe=" in "".join(mpi_args[i + 1:i + 2]).lower():
        binds = True
    elif i > 0 and mpi_args[i - 1].lstrip("-") == "mca":
      binds |= arg in _BINDING_PARAMETERS
      maps |= arg in _MAPPING_PARAMETERS
  for name in _BINDING_PARAMETERS | _MAPPING_PARAMETERS:
    if "OMPI_MCA_" + name in environ:
      binds |= name in _BINDING_PARAMETERS
      maps |= name in _MAPPING_PARAMETERS
  return binds, maps, names_hosts


def cpu_share_flags(num_proc, cpus=None, total_cpus=None):
  """Open MPI flags that give each rank of a one-host job CPUs of its own.

  Ranks that may all run on every CPU of a host get in each other's way
  once their threads fill the cores: Linux tends to wake a thread on the
  CPU of the thread that woke it, so the two ranks' engine threads handing
  work to each other, or their Python threads waking after a step, end up
  taking turns on one core while another core idles (bench/RESULTS.md
  section 23: a tenth to a fifth of both cores idle in a Keras step on 2
  ranks over 2 CPUs).
  Binding each rank to `cpus // num_proc` consecutive logical CPUs of its
  own keeps them apart, and TensorFlow sizes its thread pools by that
  share.  Hardware threads count as CPUs, as they do for TensorFlow.

  Args:
    num_proc: Number of ranks, all on this host.
    cpus: Logical CPUs the launcher may run on (default: its affinity mask).
    total_cpus: Logical CPUs of the host (default: `os.cpu_count()`).

  Returns:
    The flags, or None where the ranks should float over every CPU: one
    rank, more ranks than CPUs, or a launcher restricted to part of the host
    (Open MPI would bind the ranks to CPUs outside that part).
  """
  return _cpu_share(num_proc, *_host_cpus(cpus, total_cpus))[0]


def _host_cpus(cpus, total_cpus):
  """`(cpus, total_cpus)` with the defaults of `cpu_share_flags` filled in."""
  if cpus is None:
    cpus = len(os.sched_getaffinity(0))
  if total_cpus is None:
    total_cpus = os.cpu_count() or cpus
  return cpus, total_cpus


def _cpu_share(num_proc, cpus, total_cpus):
  """`(flags, why)`: `cpu_share_flags`' answer and a line saying why."""
  if num_proc < 2:
    return None, "one rank"
  if num_proc > cpus:
    return None, f"{num_proc} ranks, {cpus} CPUs"
  if cpus < total_cpus:
    return None, (f"the launcher may use {cpus} of this host's {total_cpus} "
                  "CPUs, and Open MPI would bind outside them")
  share = cpus // num_proc
  return (["--use-hwthread-cpus", "--map-by", f"slot:PE={share}",
           "--bind-to", "hwthread"],
          f"each rank bound to {share} of this host's {cpus} CPUs, a share "
          "of its own")


@dataclasses.dataclass
class Command:
  """What `build_command` decided; `main` prints `notes` and runs `argv`.

  Attributes:
    argv: The launcher command line (`mpirun ...` or `srun ...`).
    env: The environment to run it with.
    launcher: "mpirun" or "srun".
    notes: Hints and warnings for the user, one line each (printed on stderr
      before the launch).
    details: How flags were chosen, one line each (printed with --verbose).
  """
  argv: list
  env: dict
  launcher: str
  notes: list = dataclasses.field(default_factory=list)
  details: list = dataclasses.field(default_factory=list)


def option_fields():
  return dataclasses.fields(options_lib.Options)


def option_flag(name):
  return "--" + name.replace("_", "-")


def type_name(field):
  return field.type if isinstance(field.type, str) else field.type.__name__


def option_variables(args, environ):
  """Returns the MPISTRATEGY_* variables set by the option flags.

  The flags' values are parsed as the ranks will parse the variables and
  validated together with the MPISTRATEGY_* variables already in `environ`
  (the ranks see both; a flag wins).

  Args:
    args: The `argparse.Namespace` from `parse_args`.
    environ: The launcher's environment.

  Returns:
    A tuple `(variables, warnings)`: a dict {name: value} and a list of
    warning lines (unknown MPISTRATEGY_* variables).

  Raises:
    ValueError: A value does not parse or `Options` rejects it; the message
      names the flag or the variable.
  """
  variables = {}
  if getattr(args, "verbose", False):
    variables[ENV_PREFIX + "VERBOSE"] = "1"
  for field in option_fields():
    value = getattr(args, "option_" + field.name, None)
    if value is None:
      continue
    flag = option_flag(field.name)
    if type_name(field) != "bool":
      value = options_lib._parse_env(  # pylint: disable=protected-access
          flag, field.name, field.type, value)
    try:
      options_lib.Options(**{field.name: value})
    except (TypeError, ValueError) as e:
      raise ValueError(f"{flag}: {e}") from None
    if isinstance(value, bool):
      text = "1" if value else "0"
    else:
      text = str(value)
    variables[ENV_PREFIX + field.name.upper()] = text
  merged = dict(environ)
  merged.update(variables)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    options_lib.Options.from_env(environ=merged)  # raises ValueError
  return variables, [str(w.message) for w in caught]


def _parse_hosts(text):
  """`host1:2,host2` -> [("host1", 2), ("host2", None)]."""
  hosts = []
  for item in text.split(","):
    m = _HOST.match(item.strip())
    if not m or (m.group(2) is not None and int(m.group(2)) < 1):
      raise ValueError(
          f"-H/--hosts: {item.strip()!r} is not HOST or HOST:SLOTS with "
          f"SLOTS >= 1 (in {text!r}; example: host1:2,host2:2)")
    hosts.append((m.group(1), None if m.group(2) is None else
                  int(m.group(2))))
  return hosts


_HOSTFILE_OPENMPI = re.compile(
    r"^(\S+)(?:\s+(?:slots|max[-_]slots)\s*=\s*\d+)*\s*$")


def _hostfile_slots(path):
  """The total of a host file's slots, or None if a line does not give them.

  Understands Open MPI's `host slots=N [max_slots=M]` and MPICH's `host:N`,
  one host a line, `#` comments.  A host without a count (which means "its
  number of cores" to Open MPI and 1 to MPICH) or any other syntax gives
  None: the launcher cannot know the count, so -np must be given.
  """
  total = 0
  with open(path, encoding="utf-8", errors="replace") as f:
    for line in f:
      line = line.split("#", 1)[0].strip()
      if not line:
        continue
      m = re.match(r"^\S+?\s+slots\s*=\s*(\d+)(?:\s|$)", line)
      if m and _HOSTFILE_OPENMPI.match(line):
        total += int(m.group(1))
        continue
      m = re.match(r"^[^\s:]+:(\d+)$", line)
      if m:
        total += int(m.group(1))
        continue
      return None
  return total or None


def _num_proc(args, hosts):
  """-np, or the slots of -H or the host file when -np is not given."""
  if args.num_proc is not None:
    if args.num_proc < 1:
      raise ValueError(
          f"-np/--num-proc must be a positive integer, got {args.num_proc}")
    return args.num_proc
  if hosts:
    missing = [h for h, n in hosts if n is None]
    if missing:
      raise ValueError(
          f"-np/--num-proc is required: -H {args.hosts} gives no slot count "
          f"for {', '.join(missing)} (write -H host1:2,host2:2 to run as "
          "many ranks as slots)")
    return sum(n for _, n in hosts)
  if args.hostfile is not None:
    total = _hostfile_slots(args.hostfile)
    if total is None:
      raise ValueError(
          f"-np/--num-proc is required: --hostfile {args.hostfile} does not "
          "give every host's slots ('host slots=N' or 'host:N' lines)")
    return total
  raise ValueError("-np/--num-proc is required (the number of ranks), or "
                   "-H host1:SLOTS,... to run as many ranks as slots")


def split_mpi_args(texts):
  """The launcher arguments of the `--mpi-args` values, split as a shell does.

  Args:
    texts: the `--mpi-args` values.

  Returns:
    A list of arguments.

  Raises:
    ValueError: a value cannot be split (an unclosed quote), naming it.
  """
  out = []
  for text in texts:
    try:
      out += shlex.split(text)
    except ValueError as e:
      raise ValueError(f"--mpi-args={text!r}: {e}") from None
  return out


def _runs_as_given(path):
  """Whether the file `path` is a program to run as it is.

  An ELF executable (a `python` binary, say), or an executable script whose
  `#!` line names another interpreter than Python (a shell wrapper that
  sets up the rank's environment).  A Python script, `#!` or not, runs
  under the launcher's interpreter.
  """
  try:
    with open(path, "rb") as f:
      head = f.readline(256)
  except OSError:
    return False
  if head.startswith(b"\x7fELF"):
    return True
  return (head.startswith(b"#!") and b"python" not in head and
          os.access(path, os.X_OK))


def _program(args, environ, executable):
  """The rank command: `python script args`, or a program as given.

  A program is one on PATH (`python train.py`), a compiled one given by
  its path (`.venv/bin/python train.py`, as `horovodrun` users write it)
  or an executable script for another interpreter (`./wrapper.sh
  train.py`); any other file is a script for the launcher's interpreter.
  """
  if not args.command:
    raise ValueError("no script given; usage: python -m mpistrategy.run "
                     "-np N script.py [args ...]")
  first = args.command[0]
  if os.path.isfile(first):
    if _runs_as_given(first):
      return list(args.command)
    return [executable, *args.command]
  if os.sep not in first and shutil.which(first, path=environ.get("PATH")):
    return list(args.command)
  if os.path.isdir(first):
    raise ValueError(f"{first}: is a directory (give the Python script to "
                     "run, or a program on PATH)")
  raise ValueError(f"{first}: no such file (give the Python script to run, "
                   "or a program on PATH)")


def _package_parent():
  # mpistrategy/launch/command.py -> the folder that holds mpistrategy/.
  return os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))


def _pythonpath(environ, package_parent):
  """PYTHONPATH for the ranks, or None to leave it as it is.

  The ranks run `python script.py`, so they import mpistrategy from the
  script's directory, PYTHONPATH or site-packages.  When the launcher's
  mpistrategy comes from somewhere else (a source checkout), its directory
  is put in front of PYTHONPATH so that the ranks import the same one.
  """
  real = os.path.realpath(package_parent)
  site_dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
  current = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  if any(os.path.realpath(p) == real for p in site_dirs + current):
    return None
  return os.pathsep.join([package_parent] + current)


def _openmpi_command(args, launcher_path, hosts, exported, set_vars, program,
                     num_proc, local_only, as_root, environ, cpus, total_cpus,
                     details):
  argv = [launcher_path, "-np", str(num_proc)]
  if hosts:
    argv += ["-H", ",".join(h if n is None else f"{h}:{n}" for h, n in hosts)]
  if args.hostfile:
    argv += ["--hostfile", args.hostfile]
  mpi_args = split_mpi_args(args.mpi_args)
  if as_root:
    argv += ["--allow-run-as-root"]
  # Without hosts Open MPI allows one rank per core; -np N on this host is
  # what the user asked for, as horovodrun does.
  if local_only and not any("oversubscribe" in a.lower() for a in mpi_args):
    argv += ["--oversubscribe"]
  if args.tag_output and not any(
      a in ("--tag-output", "-tag-output", "--output") for a in mpi_args):
    argv += ["--tag-output"]
  # Open MPI binds each rank to a core (np <= 2) or socket by default, which
  # starves TensorFlow's thread pools.  On one host each rank gets its share
  # of the CPUs instead (cpu_share_flags); elsewhere ranks float.  What the
  # user sets wins: the launcher then adds only what the user left open.
  user_binds, user_maps, user_hosts = _user_placement(mpi_args, environ)
  share = None
  if user_binds or user_maps:
    why = "as the --mpi-args or OMPI_MCA_* variables set it"
  elif not local_only or user_hosts:
    why = "several hosts: their CPUs are not known here"
  else:
    share, why = _cpu_share(num_proc, cpus, total_cpus)
  if share is not None:
    argv += share
    details.append(f"placement: {why}")
  else:
    if not user_binds:
      argv += ["--bind-to", "none"]
    if not user_maps:
      argv += ["--map-by", "slot"]
    details.append(f"placement: ranks float over every CPU ({why})")
  for name in exported:
    if name in set_vars:
      argv += ["-x", f"{name}={set_vars[name]}"]
    else:
      argv += ["-x", name]
  return argv + mpi_args + program


def _mpich_command(args, launcher_path, hosts, set_vars, program, num_proc):
  # Hydra passes the whole environment by default (-genvall); -genv only
  # for what the launcher sets, so the printed line shows it.  Hydra does
  # not limit ranks to cores, so -np N runs on one host as it is.
  argv = [launcher_path, "-np", str(num_proc)]
  if hosts:
    argv += ["-hosts",
             ",".join(h if n is None else f"{h}:{n}" for h, n in hosts)]
  if args.hostfile:
    argv += ["-f", args.hostfile]
  for name in sorted(set_vars):
    argv += ["-genv", name, set_vars[name]]
  mpi_args = split_mpi_args(args.mpi_args)
  if args.tag_output and not any(
      a in ("-l", "-prepend-rank", "--prepend-rank", "-prepend-pattern")
      for a in mpi_args):
    argv += ["-prepend-rank"]
  return argv + mpi_args + program


def _srun_command(args, launcher_path, hosts, set_vars, program, num_proc):
  if args.hostfile:
    raise ValueError(
        "--hostfile is for mpirun; with srun give -H/--hosts (or "
        "--mpi-args=\"--nodefile FILE\"), or use --launcher mpirun")
  argv = [launcher_path, f"--ntasks={num_proc}"]
  if hosts:
    slots = {n for _, n in hosts}
    if len(slots) > 1:
      raise ValueError(
          f"srun cannot place different numbers of tasks per host "
          f"(-H {args.hosts}); give every host the same slot count, or use "
          "--launcher mpirun")
    argv += [f"--nodes={len(hosts)}",
             "--nodelist=" + ",".join(h for h, _ in hosts)]
    per_node = slots.pop()
    if per_node is not None:
      argv += [f"--ntasks-per-node={per_node}"]
  # A rank that exits non-zero ends the step, as it does under mpirun.
  argv += ["--kill-on-bad-exit=1"]
  # ALL: also when the site sets SLURM_EXPORT_ENV=NONE.  A value with a comma
  # cannot be written here; srun then takes it from the environment.
  exports = ["ALL"] + [name if "," in set_vars[name] else
                       f"{name}={set_vars[name]}" for name in sorted(set_vars)]
  argv += ["--export=" + ",".join(exports)]
  mpi_args = split_mpi_args(args.mpi_args)
  if args.tag_output and not any(a in ("-l", "--label") for a in mpi_args):
    argv += ["--label"]
  return argv + mpi_args + program


def build_command(args, environ, launcher, launcher_path, mpi_flavour="openmpi",
                  executable=None, euid=None, cpus=None, total_cpus=None):
  """Builds the launch command; runs nothing.

  Args:
    args: The `argparse.Namespace` from `parse_args`.
    environ: The launcher's environment (a mapping; not modified).
    launcher: "mpirun" or "srun" (see `find_launcher`).
    launcher_path: The launcher program to put first on the command line.
    mpi_flavour: For mpirun: "openmpi", "mpich" or "unknown" (treated as
      Open MPI); see `detect_mpi_flavour`.
    executable: The Python interpreter of the ranks; default `sys.executable`.
    euid: The effective user id (for the run-as-root hint); default
      `os.geteuid()`.
    cpus: Logical CPUs the launcher may run on (for `cpu_share_flags`);
      default its affinity mask.
    total_cpus: Logical CPUs of this host; default `os.cpu_count()`.

  Returns:
    A `Command`.

  Raises:
    ValueError: A bad argument: -np missing or < 1, a malformed -H, a missing
      host file or script, an option value `Options` rejects, a combination
      the launcher cannot express.  The message names the argument.
  """
  executable = executable or sys.executable
  euid = os.geteuid() if euid is None else euid
  if launcher not in ("mpirun", "srun"):
    raise ValueError(f"launcher must be 'mpirun' or 'srun', got {launcher!r}")
  if args.hosts is not None and args.hostfile is not None:
    raise ValueError("give either -H/--hosts or --hostfile, not both")
  if args.hostfile is not None and not os.path.isfile(args.hostfile):
    raise ValueError(f"--hostfile {args.hostfile}: no such file")
  if not args.kill_after >= 0 or args.kill_after == float("inf"):  # NaN too
    raise ValueError(
        f"--kill-after must be a finite number >= 0, got {args.kill_after:g}")
  hosts = _parse_hosts(args.hosts) if args.hosts is not None else []
  num_proc = _num_proc(args, hosts)
  cpus, total_cpus = _host_cpus(cpus, total_cpus)
  details = []
  program = _program(args, environ, executable)
  if not args.verbose:
    program = [executable, "-m", QUIET_MODULE] + program
  set_vars, notes = option_variables(args, environ)
  notes = [f"warning: {n}" for n in notes]
  pythonpath = _pythonpath(environ, _package_parent())
  if pythonpath is not None:
    set_vars["PYTHONPATH"] = pythonpath

  env = dict(environ)
  env.update(set_vars)
  if launcher == "srun":
    argv = _srun_command(args, launcher_path, hosts, set_vars, program,
                         num_proc)
  elif mpi_flavour == "mpich":
    argv = _mpich_command(args, launcher_path, hosts, set_vars, program,
                          num_proc)
  else:
    if mpi_flavour != "openmpi":
      notes.append(f"note: could not tell which MPI {launcher_path} belongs "
                   "to (`mpirun --version`); using Open MPI's flags")
    exported = sorted(
        name for name in env
        if name in EXPORTED_VARIABLES or name.startswith(EXPORTED_PREFIXES))
    mpi_args = split_mpi_args(args.mpi_args)
    as_root = (euid == 0 and "--allow-run-as-root" not in mpi_args and not (
        environ.get("OMPI_ALLOW_RUN_AS_ROOT") == "1" and
        environ.get("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM") == "1"))
    local_only = not hosts and args.hostfile is None and not any(
        environ.get(name) for name in _ALLOCATION_VARIABLES)
    argv = _openmpi_command(args, launcher_path, hosts, exported, set_vars,
                            program, num_proc, local_only, as_root, environ,
                            cpus, total_cpus, details)
    if as_root:
      notes.append(
          "running as root: added --allow-run-as-root, without which Open "
          "MPI refuses to start (common in containers)")
  return Command(argv=argv, env=env, launcher=launcher, notes=notes,
                 details=details)


def find_launcher(choice, environ):
  """Returns `(launcher, path)` for `--launcher choice`.

  Args:
    choice: "auto", "mpirun" or "srun".  "auto" picks srun inside a Slurm
      allocation (SLURM_JOB_ID set and srun on PATH), otherwise mpirun.
    environ: The environment whose PATH is searched.

  Returns:
    A tuple ("mpirun" or "srun", absolute path).

  Raises:
    ValueError: The launcher is not on PATH.
  """
  path = environ.get("PATH")
  if choice == "auto":
    srun = shutil.which("srun", path=path)
    choice = "srun" if environ.get("SLURM_JOB_ID") and srun else "mpirun"
  if choice == "srun":
    found = shutil.which("srun", path=path)
    if not found:
      raise ValueError("srun not found on PATH (--launcher srun)")
    return "srun", found
  for name in ("mpirun", "mpiexec"):
    found = shutil.which(name, path=path)
    if found:
      return "mpirun", found
  raise ValueError("mpirun (or mpiexec) not found on PATH; install an MPI "
                   "(e.g. apt-get install openmpi-bin) or use --launcher srun")


def detect_mpi_flavour(mpirun, environ):
  """Returns "openmpi", "mpich" or "unknown" from `mpirun --version`.

  Args:
    mpirun: Path of the mpirun program.
    environ: The environment to run it with.

  Returns:
    A str.
  """
  try:
    out = subprocess.run([mpirun, "--version"], env=dict(environ),
                         stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, errors="replace", timeout=20,
                         check=False)
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  text = out.stdout + out.stderr
  if re.search(r"Open MPI|OpenRTE|Spectrum MPI", text):
    return "openmpi"
  if re.search(r"HYDRA|MPICH|Intel\(R\) MPI|MVAPICH", text, re.IGNORECASE):
    return "mpich"
  return "unknown"
