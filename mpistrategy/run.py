"""`python -m mpistrategy.run` (`mpistrategyrun`): runs a script on N ranks.

```bash
python -m mpistrategy.run -np 4 train.py --epochs 3
python -m mpistrategy.run -H host1:4,host2:4 train.py       # 8 ranks
python -m mpistrategy.run -np 2 --stall-timeout-seconds 600 train.py
python -m mpistrategy.run --check
```

The launcher builds one `mpirun` command (or `srun` inside a Slurm
allocation), prints it on stderr, runs it and exits with its exit status.
The ranks run the script with the launcher's own interpreter
(`sys.executable`), so a virtual environment carries over.

* Engine options: every field of `mpistrategy.Options` has a flag
  (`fusion_threshold_bytes` -> `--fusion-threshold-bytes N`, booleans
  `--hierarchical-allreduce` / `--no-hierarchical-allreduce`).  A flag sets
  `MPISTRATEGY_<FIELD>` for every rank; values are validated by `Options`
  before anything is started.
* Environment: with Open MPI the launcher exports (`-x`) PATH, PYTHONPATH,
  LD_LIBRARY_PATH, PYTHONUNBUFFERED, TF_CPP_MIN_LOG_LEVEL,
  CUDA_VISIBLE_DEVICES and every NCCL_* and MPISTRATEGY_* variable that is
  set (Open MPI forwards OMPI_MCA_* itself); MPICH's and Slurm's launchers
  pass the whole environment by default.  Variables the launcher sets or
  changes appear on the printed command line with their values, so the
  printed line reproduces the launch.
* Signals: SIGINT, SIGTERM and SIGHUP are forwarded to the launched
  command's process group; if it has not exited `--kill-after` seconds
  after the first one, every process of its session is killed.
* Exit status: the command's; 128 + N when it died of signal N, or when the
  launcher was stopped by signal N and the command did not exit with 0.
* Output: every line carries its rank (Open MPI `--tag-output`:
  `[1,R]<stdout>:`; MPICH `-prepend-rank`: `[R] `; srun `--label`: `R: `)
  unless `--no-tag-output`.  The rank program runs behind
  `python -m mpistrategy.quiet`: ranks other than 0 do not print
  TensorFlow's start-up INFO/WARNING lines nor Python warnings (errors and
  tracebacks always pass); `--verbose` shows everything on every rank.
* Ranks and hosts: without -H/--hostfile (and outside a resource manager's
  allocation) -np N runs N ranks on this host even when N exceeds its cores
  (Open MPI `--oversubscribe`).  Without -np, the ranks are the sum of the
  slots of -H host:slots,... or of a host file that gives every host's
  slots.  As root, Open MPI gets `--allow-run-as-root`, said once on stderr.

Command construction (`parse_args`, `build_command`) needs neither
TensorFlow nor MPI; only `--check` imports them.
"""

import argparse
import dataclasses
import importlib.metadata
import inspect
import os
import platform
import re
import shlex
import shutil
import signal
import site
import subprocess
import sys
import time
import warnings

from mpistrategy import options as options_lib

__all__ = ["Command", "build_command", "detect_mpi_flavour", "find_launcher",
           "main", "make_parser", "parse_args"]

PROG = "mpistrategy.run"
CONSOLE_SCRIPT = "mpistrategyrun"  # pyproject.toml: mpistrategy.run:main

# Environment variables exported to the ranks by name (Open MPI `-x NAME`)
# when they are set, and prefixes of further ones.
EXPORTED_VARIABLES = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH",
                      "PYTHONUNBUFFERED", "TF_CPP_MIN_LOG_LEVEL",
                      "CUDA_VISIBLE_DEVICES")
EXPORTED_PREFIXES = ("NCCL_", "MPISTRATEGY_")

LAUNCHERS = ("auto", "mpirun", "srun")
DEFAULT_KILL_AFTER_SECONDS = 10.0
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_ENV_PREFIX = "MPISTRATEGY_"
# Options fields set by one of the launcher's own flags (--verbose), which
# therefore get no generated flag.
_LAUNCHER_FIELDS = ("verbose",)
# The rank program runs behind `python -m mpistrategy.quiet` (see there).
QUIET_MODULE = "mpistrategy.quiet"
# Set by resource managers inside an allocation: mpirun then takes the
# hosts and slots from the allocation, and `-np` beyond them is an error
# worth keeping.
_ALLOCATION_VARIABLES = ("SLURM_JOB_ID", "PBS_JOBID", "PBS_NODEFILE",
                         "LSB_JOBID", "PE_HOSTFILE", "FLUX_JOB_ID")
_METAVARS = {"int": "INT", "float": "NUMBER", "str": "TEXT"}
_HOST = re.compile(r"^([^\s:,]+)(?::(\d+))?$")


@dataclasses.dataclass
class Command:
  """What `build_command` decided; `main` prints `notes` and runs `argv`.

  Attributes:
    argv: The launcher command line (`mpirun ...` or `srun ...`).
    env: The environment to run it with.
    launcher: "mpirun" or "srun".
    notes: Hints and warnings for the user, one line each (printed on stderr
      before the launch).
  """
  argv: list
  env: dict
  launcher: str
  notes: list = dataclasses.field(default_factory=list)


# ---------------------------------------------------------------------------
# Arguments


def _option_fields():
  return dataclasses.fields(options_lib.Options)


def _option_flag(name):
  return "--" + name.replace("_", "-")


def _type_name(field):
  return field.type if isinstance(field.type, str) else field.type.__name__


def _field_help():
  """{field name: description} from the `Args:` section of `Options`."""
  helps = {}
  name = None
  in_args = False
  for line in inspect.cleandoc(options_lib.Options.__doc__ or "").splitlines():
    if not in_args:
      in_args = line.strip() == "Args:"
      continue
    if line and not line.startswith(" "):  # the next section (Raises:)
      break
    m = re.match(r"^  (\w+): (.*)$", line)
    if m:
      name = m.group(1)
      helps[name] = m.group(2)
    elif name is not None and line.strip():
      helps[name] += " " + line.strip()
  return helps


def make_parser():
  """Returns the `argparse.ArgumentParser` of `python -m mpistrategy.run`.

  The engine option flags are generated from the fields of
  `mpistrategy.Options`; their destinations are `option_<field>` and their
  defaults None (not given).

  Returns:
    An `argparse.ArgumentParser`.
  """
  prog = (CONSOLE_SCRIPT if os.path.basename(sys.argv[0]) == CONSOLE_SCRIPT
          else f"python -m {PROG}")
  parser = argparse.ArgumentParser(
      prog=prog, allow_abbrev=False,
      usage=f"{prog} [options] [-np N] [-H HOST:SLOTS,...] SCRIPT [ARGS ...]"
      f"\n       {prog} --check",
      description="Runs a Python training script on N MPI ranks with mpirun "
      "(or srun inside a Slurm allocation), using this interpreter.",
      epilog=f"Example: {prog} -H host1:2,host2:2 train.py --epochs 3 "
      "(4 ranks)")
  parser.add_argument(
      "-np", "--num-proc", dest="num_proc", type=int, metavar="N",
      help="number of ranks; default: the sum of the slots of -H or of a "
      "host file that gives every host's slots.  Without hosts, N ranks "
      "run on this host even if N exceeds its cores")
  parser.add_argument(
      "-H", "--hosts", metavar="HOST:SLOTS,...",
      help="hosts and their slot counts, e.g. host1:2,host2:2 (mpirun -H; "
      "srun --nodelist)")
  parser.add_argument(
      "--hostfile", metavar="FILE",
      help="the MPI implementation's host file (mpirun only)")
  parser.add_argument(
      "--launcher", choices=LAUNCHERS, default="auto",
      help="auto (the default): srun when SLURM_JOB_ID is set and srun is on "
      "PATH, otherwise mpirun")
  parser.add_argument(
      "--mpi-args", action="append", default=[], metavar="ARGS",
      help="extra arguments for mpirun or srun, split like a shell does, "
      "e.g. --mpi-args=\"--mca btl tcp,self\"; may be repeated")
  parser.add_argument(
      "--kill-after", type=float, default=DEFAULT_KILL_AFTER_SECONDS,
      metavar="SECONDS",
      help="after forwarding a signal, kill the job if it is still running "
      f"this many seconds later (default {DEFAULT_KILL_AFTER_SECONDS:g})")
  parser.add_argument(
      "--dry-run", action="store_true",
      help="print the command on stdout and exit without running it")
  parser.add_argument(
      "--tag-output", action=argparse.BooleanOptionalAction, default=True,
      help="prefix every output line with the rank that printed it (the "
      "default; Open MPI --tag-output: '[1,R]<stdout>:', MPICH "
      "-prepend-rank: '[R] ', srun --label: 'R: ')")
  parser.add_argument(
      "--verbose", action="store_true",
      help="also print how the launcher and the flags were chosen, and let "
      "every rank print TensorFlow's start-up lines and Python warnings "
      "(by default only rank 0 does; MPISTRATEGY_VERBOSE=1)")
  parser.add_argument(
      "--check", action="store_true",
      help="print what mpistrategy was built with and what it finds "
      "(TensorFlow, op library, MPI, CUDA, NCCL, GPUs) and exit")
  group = parser.add_argument_group(
      "engine options",
      "Each sets MPISTRATEGY_<FIELD> for every rank (see mpistrategy.Options).")
  helps = _field_help()
  for field in _option_fields():
    if field.name in _LAUNCHER_FIELDS:
      continue
    variable = _ENV_PREFIX + field.name.upper()
    text = helps.get(field.name, f"Options.{field.name}").replace("%", "%%")
    if _type_name(field) == "bool":
      group.add_argument(_option_flag(field.name), dest="option_" + field.name,
                         action=argparse.BooleanOptionalAction, default=None,
                         help=f"{text} ({variable})")
    else:
      group.add_argument(_option_flag(field.name), dest="option_" + field.name,
                         default=None,
                         metavar=_METAVARS.get(_type_name(field), "VALUE"),
                         help=f"{text} ({variable})")
  parser.add_argument(
      "command", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS ...]",
      help="the Python script and its arguments (a program found on PATH, "
      "e.g. `python train.py`, is run as given)")
  return parser


def _join_option_values(parser, argv):
  """Returns `argv` with `--mpi-args VALUE` written as `--mpi-args=VALUE`.

  argparse takes a separate value that starts with "-" (`--mpi-args
  "--mca btl tcp,self"`) for an option and fails.  Only the launcher's own
  options (before the script) are rewritten.
  """
  takes_value = {}
  for action in parser._actions:  # pylint: disable=protected-access
    for flag in action.option_strings:
      takes_value[flag] = action.nargs != 0
  out = list(argv)
  i = 0
  while i < len(out):
    token = out[i]
    if token == "--" or not token.startswith("-"):
      break  # the script starts here
    if token == "--mpi-args" and i + 1 < len(out):
      out[i:i + 2] = [f"--mpi-args={out[i + 1]}"]
    elif takes_value.get(token, False):
      i += 1  # skip the option's value
    i += 1
  return out


def parse_args(argv):
  """Parses the launcher's command line (without the program name).

  Args:
    argv: A list of str.

  Returns:
    An `argparse.Namespace`.

  Raises:
    SystemExit: The arguments do not parse (argparse printed the error) or
      `--help` was given.
  """
  parser = make_parser()
  args = parser.parse_args(_join_option_values(parser, argv))
  if args.command and args.command[0] == "--":
    args.command = args.command[1:]
  return args


# ---------------------------------------------------------------------------
# Command construction


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
    variables[_ENV_PREFIX + "VERBOSE"] = "1"
  for field in _option_fields():
    value = getattr(args, "option_" + field.name, None)
    if value is None:
      continue
    flag = _option_flag(field.name)
    if _type_name(field) != "bool":
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
    variables[_ENV_PREFIX + field.name.upper()] = text
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


def _program(args, environ, executable):
  """The rank command: `python script args`, or a PATH program as given."""
  if not args.command:
    raise ValueError("no script given; usage: python -m mpistrategy.run "
                     "-np N script.py [args ...]")
  first = args.command[0]
  if os.path.isfile(first):
    return [executable, *args.command]
  if os.sep not in first and shutil.which(first, path=environ.get("PATH")):
    return list(args.command)
  raise ValueError(f"{first}: no such file (give the Python script to run, "
                   "or a program on PATH)")


def _package_parent():
  return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
                     num_proc, local_only, as_root):
  argv = [launcher_path, "-np", str(num_proc)]
  if hosts:
    argv += ["-H", ",".join(h if n is None else f"{h}:{n}" for h, n in hosts)]
  if args.hostfile:
    argv += ["--hostfile", args.hostfile]
  mpi_args = [a for s in args.mpi_args for a in shlex.split(s)]
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
  # starves TensorFlow's thread pools; the user's own choice wins.
  if not any(a.startswith("--bind-to") for a in mpi_args):
    argv += ["--bind-to", "none"]
  if not any(a.startswith("--map-by") for a in mpi_args):
    argv += ["--map-by", "slot"]
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
  mpi_args = [a for s in args.mpi_args for a in shlex.split(s)]
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
  mpi_args = [a for s in args.mpi_args for a in shlex.split(s)]
  if args.tag_output and not any(a in ("-l", "--label") for a in mpi_args):
    argv += ["--label"]
  return argv + mpi_args + program


def build_command(args, environ, launcher, launcher_path, mpi_flavour="openmpi",
                  executable=None, euid=None):
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
    mpi_args = [a for s in args.mpi_args for a in shlex.split(s)]
    as_root = (euid == 0 and "--allow-run-as-root" not in mpi_args and not (
        environ.get("OMPI_ALLOW_RUN_AS_ROOT") == "1" and
        environ.get("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM") == "1"))
    local_only = not hosts and args.hostfile is None and not any(
        environ.get(name) for name in _ALLOCATION_VARIABLES)
    argv = _openmpi_command(args, launcher_path, hosts, exported, set_vars,
                            program, num_proc, local_only, as_root)
    if as_root:
      notes.append(
          "running as root: added --allow-run-as-root, without which Open "
          "MPI refuses to start (common in containers)")
  return Command(argv=argv, env=env, launcher=launcher, notes=notes)


# ---------------------------------------------------------------------------
# Finding the launcher


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


# ---------------------------------------------------------------------------
# Running


def _say(text):
  sys.stderr.write(f"{PROG}: {text}\n")
  sys.stderr.flush()


def _session_pids(sid):
  """PIDs of the processes in session `sid` (Linux /proc; else empty)."""
  pids = []
  try:
    entries = os.listdir("/proc")
  except OSError:
    return pids
  for entry in entries:
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat", encoding="ascii",
                errors="replace") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
      continue
    # After "pid (comm)": state ppid pgrp session ...
    if len(fields) > 3 and fields[3] == str(sid):
      pids.append(int(entry))
  return pids


def _kill_session(proc):
  """SIGKILLs the command's process group and every process of its session.

  mpirun puts each local rank in a process group of its own (in mpirun's
  session, which `run` made new), so the group alone is not enough.
  """
  for kill, target in [(os.killpg, proc.pid)] + [
      (os.kill, pid) for pid in _session_pids(proc.pid)]:
    try:
      kill(target, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass


def _forward(proc, launcher, signum):
  try:
    os.killpg(proc.pid, signum)
    if launcher == "srun" and signum == signal.SIGINT:
      # srun answers one SIGINT with a status report; a second one within a
      # second aborts the step (SIGINT, then SIGTERM, SIGKILL to the tasks).
      time.sleep(0.1)
      os.killpg(proc.pid, signum)
  except ProcessLookupError:
    pass


def run(command, kill_after=DEFAULT_KILL_AFTER_SECONDS, verbose=False):
  """Runs `command` and forwards signals to it until it exits.

  The command runs in a new session, so a terminal's Ctrl-C reaches only
  the launcher, which forwards it once.

  Args:
    command: A `Command`.
    kill_after: Seconds after the first forwarded signal before the whole
      job is killed with SIGKILL.
    verbose: Print what happens to the signals.

  Returns:
    The exit status (see the module docstring).
  """
  received = []     # forwarded signal numbers, in order
  state = {"proc": None, "first": None}

  def on_signal(signum, unused_frame):
    received.append(signum)
    if state["first"] is None:
      state["first"] = time.monotonic()
    if verbose:
      _say(f"got {signal.Signals(signum).name}, forwarding it")
    if state["proc"] is not None:
      _forward(state["proc"], command.launcher, signum)

  previous = {s: signal.signal(s, on_signal) for s in FORWARDED_SIGNALS}
  try:
    try:
      proc = subprocess.Popen(command.argv, env=command.env,
                              start_new_session=True)
    except OSError as e:
      _say(f"error: cannot run {command.argv[0]}: {e}")
      return 127
    state["proc"] = proc
    for signum in received:  # arrived before the command started
      _forward(proc, command.launcher, signum)
    killed = False
    while True:
      try:
        returncode = proc.wait(timeout=0.2)
        break
      except subprocess.TimeoutExpired:
        pass
      if (state["first"] is not None and not killed and
          time.monotonic() - state["first"] > kill_after):
        _say(f"the job is still running {kill_after:g} s after "
             f"{signal.Signals(received[0]).name}; killing it")
        _kill_session(proc)
        killed = True
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)
  if returncode < 0:
    return 128 - returncode
  if received and returncode != 0:
    return 128 + received[0]
  return returncode


# ---------------------------------------------------------------------------
# --check


def _mark(ok):
  return {True: "[X]", False: "[ ]", None: "[?]"}[ok]


def _version(distribution):
  try:
    return importlib.metadata.version(distribution)
  except importlib.metadata.PackageNotFoundError:
    return None


def _mpi_library_version():
  """(first line of MPI_Get_library_version, mpi4py version) or an error."""
  try:
    import mpi4py  # pylint: disable=g-import-not-at-top
    mpi4py.rc.initialize = False  # only ask; do not start MPI
    mpi4py.rc.finalize = False
    from mpi4py import MPI  # pylint: disable=g-import-not-at-top
    # Open MPI's string ends with a NUL byte.
    text = MPI.Get_library_version().strip("\x00 \n").splitlines()[0].strip()
    return True, f"{text} (mpi4py {mpi4py.__version__})"
  except ImportError as e:
    return False, f"mpi4py not available ({e}); pip install mpi4py"
  except Exception as e:  # pylint: disable=broad-except
    return False, f"mpi4py could not load the MPI library: {e}"


def _thread_multiple(mpi_library):
  """(supported, how) for MPI_THREAD_MULTIPLE, without initialising MPI."""
  ompi_info = shutil.which("ompi_info")
  if "Open MPI" not in mpi_library or ompi_info is None:
    return None, "not determinable without initialising MPI"
  try:
    out = subprocess.run([ompi_info], capture_output=True, text=True,
                         errors="replace", timeout=30, check=False,
                         stdin=subprocess.DEVNULL).stdout
  except (OSError, subprocess.SubprocessError) as e:
    return None, f"ompi_info failed: {e}"
  m = re.search(r"MPI_THREAD_MULTIPLE:\s*(yes|no)", out)
  if not m:
    return None, "ompi_info does not say"
  return m.group(1) == "yes", "from ompi_info"


def check(environ):
  """Prints what mpistrategy was built with and finds; `--check`.

  Args:
    environ: The environment (for PATH and Slurm).

  Returns:
    0 when the op library loads, 1 otherwise.
  """
  lines = []
  package = os.path.dirname(os.path.abspath(__file__))
  version = _version("mpistrategy") or "(not installed: source checkout)"
  lines.append(f"{_mark(True)} mpistrategy {version}: {package}")
  lines.append(f"{_mark(True)} Python {platform.python_version()}: "
               f"{sys.executable}")
  try:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    lines.append(f"{_mark(True)} TensorFlow {tf.__version__}")
  except ImportError as e:
    tf = None
    lines.append(f"{_mark(False)} TensorFlow: cannot import ({e})")

  library = None
  if tf is not None:
    try:
      from mpistrategy import _library  # pylint: disable=g-import-not-at-top
      library = _library.load()
      lines.append(f"{_mark(True)} op library loads: {library.path}")
    except ImportError as e:
      lines.append(f"{_mark(False)} op library: {e}")
  else:
    lines.append(f"{_mark(False)} op library: needs TensorFlow")
  if library is not None:
    lines.append(f"{_mark(bool(library.c.mpistrategy_built_with_cuda()))} "
                 "CUDA kernels built")
    lines.append(f"{_mark(bool(library.c.mpistrategy_built_with_nccl()))} "
                 "NCCL built")
  else:
    lines.append(f"{_mark(None)} CUDA kernels built: unknown (no op library)")
    lines.append(f"{_mark(None)} NCCL built: unknown (no op library)")

  ok, text = _mpi_library_version()
  lines.append(f"{_mark(ok)} MPI library: {text}")
  supported, how = _thread_multiple(text if ok else "")
  lines.append(f"{_mark(supported)} MPI_THREAD_MULTIPLE ({how})")

  if tf is not None:
    gpus = tf.config.list_physical_devices("GPU")
    names = ", ".join(g.name for g in gpus) or "none"
    lines.append(f"{_mark(bool(gpus))} GPUs visible to TensorFlow: "
                 f"{len(gpus)} ({names})")
  else:
    lines.append(f"{_mark(None)} GPUs visible to TensorFlow: unknown")

  for name in ("mpirun", "srun"):
    found = shutil.which(name, path=environ.get("PATH"))
    detail = found or "not on PATH"
    if name == "mpirun" and found:
      detail += f" ({detect_mpi_flavour(found, environ)})"
    lines.append(f"{_mark(bool(found))} {name}: {detail}")
  if environ.get("SLURM_JOB_ID"):
    lines.append(f"{_mark(True)} inside Slurm job {environ['SLURM_JOB_ID']}")

  print("\n".join(lines), flush=True)
  return 0 if library is not None else 1


# ---------------------------------------------------------------------------
# main


def main(argv=None):
  """Runs the launcher; returns its exit status.

  Args:
    argv: The arguments (without the program name); default `sys.argv[1:]`.

  Returns:
    An int: 0 on success, 2 for bad arguments, 1 when no launcher is found,
    127 when it cannot be started, otherwise the job's exit status.
  """
  argv = sys.argv[1:] if argv is None else list(argv)
  environ = dict(os.environ)
  try:
    args = parse_args(argv)
  except SystemExit as e:  # argparse printed the error or the help
    return e.code if isinstance(e.code, int) else 2
  if args.check:
    return check(environ)
  try:
    launcher, launcher_path = find_launcher(args.launcher, environ)
  except ValueError as e:
    _say(f"error: {e}")
    return 1
  flavour = None
  if launcher == "mpirun":
    flavour = detect_mpi_flavour(launcher_path, environ)
  try:
    command = build_command(args, environ, launcher, launcher_path,
                            mpi_flavour=flavour or "openmpi")
  except ValueError as e:
    _say(f"error: {e}")
    return 2
  if args.verbose:
    if args.launcher != "auto":
      why = f"--launcher {args.launcher}"
    elif launcher == "srun":
      why = "auto: SLURM_JOB_ID is set and srun is on PATH"
    else:
      why = "auto: not inside a Slurm allocation with srun"
    _say(f"launcher: {launcher_path} ({why}"
         f"{', ' + flavour if flavour else ''})")
    for name in sorted(set(command.env) - set(environ)) + sorted(
        n for n in environ if command.env.get(n) != environ[n]):
      _say(f"setting {name}={command.env[name]}")
  for note in command.notes:
    _say(note)
  line = shlex.join(command.argv)
  if args.dry_run:
    print(line, flush=True)
    return 0
  _say(line)
  code = run(command, kill_after=args.kill_after, verbose=args.verbose)
  if args.verbose:
    _say(f"exit status {code}")
  return code


if __name__ == "__main__":
  sys.exit(main())
