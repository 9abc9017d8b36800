"""The command line of `python -m mpistrategy.run` and its `main`.

Every field of `mpistrategy.Options` gets a flag (`make_parser`); `main`
parses, builds the command (`command.build_command`), prints it and runs it
(`supervise.run`), or runs `--check`.
"""

import argparse
import inspect
import os
import re
import shlex
import signal
import subprocess
import sys

from mpistrategy import options as options_lib
from mpistrategy import preemption
from mpistrategy.launch import check as check_lib
from mpistrategy.launch import command as command_lib
from mpistrategy.launch import supervise

LAUNCHERS = ("auto", "mpirun", "srun")

# Tells the ranks which attempt of `--restarts` they are (0 = the first).
RESTART_VARIABLE = "MPISTRATEGY_RESTART_COUNT"


# Options fields set by one of the launcher's own flags (--verbose), which
# therefore get no generated flag.
_LAUNCHER_FIELDS = ("verbose",)


_METAVARS = {"int": "INT", "float": "NUMBER", "str": "TEXT"}


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
  console_script = command_lib.CONSOLE_SCRIPT
  prog = (console_script if os.path.basename(sys.argv[0]) == console_script
          else f"python -m {command_lib.PROG}")
  kill_after = supervise.DEFAULT_KILL_AFTER_SECONDS
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
      "--kill-after", type=float, default=kill_after, metavar="SECONDS",
      help="after forwarding a signal, kill the job if it is still running "
      f"this many seconds later (default {kill_after:g})")
  parser.add_argument(
      "--restarts", type=int, default=0, metavar="N",
      help="relaunch the whole job after it fails or is preempted (exit "
      f"status {preemption.EXIT_CODE}), at most N times (default 0); not "
      "after the launcher itself got a signal.  The ranks see the attempt "
      "as MPISTRATEGY_RESTART_COUNT (0, 1, ...) and resume from their "
      "checkpoint (BackupAndRestore, PreemptionCheckpointHandler)")
  parser.add_argument(
      "--min-np", type=int, metavar="M",
      help="with --restarts and -H (mpirun): before a restart, drop the hosts "
      "that no longer start a process (`mpirun -np 1 -H HOST true`) and go "
      "on with the remaining slots if they give at least M ranks")
  parser.add_argument(
      "--preemption-signal", metavar="SIGNAL",
      help="the signal that asks the ranks to save and exit with status "
      f"{preemption.EXIT_CODE} (default SIGTERM; "
      f"{preemption.SIGNAL_VARIABLE}); a SIGTERM to the launcher is sent to "
      "the local ranks as this signal")
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
  for field in command_lib.option_fields():
    if field.name in _LAUNCHER_FIELDS:
      continue
    variable = command_lib.ENV_PREFIX + field.name.upper()
    text = helps.get(field.name, f"Options.{field.name}").replace("%", "%%")
    flag = command_lib.option_flag(field.name)
    type_name = command_lib.type_name(field)
    if type_name == "bool":
      group.add_argument(flag, dest="option_" + field.name,
                         action=argparse.BooleanOptionalAction, default=None,
                         help=f"{text} ({variable})")
    else:
      group.add_argument(flag, dest="option_" + field.name,
                         default=None,
                         metavar=_METAVARS.get(type_name, "VALUE"),
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
    return check_lib.check(environ)
  if args.restarts < 0:
    supervise.say(f"error: --restarts must be >= 0, got {args.restarts}")
    return 2
  if args.min_np is not None and (args.min_np < 1 or not args.restarts or
                                  args.hosts is None):
    supervise.say(
        "error: --min-np M needs M >= 1, --restarts N and -H/--hosts (the "
        f"hosts it may drop); got --min-np {args.min_np}, --restarts "
        f"{args.restarts}, -H {args.hosts}")
    return 2
  if args.min_np is not None:
    try:
      start = command_lib._num_proc(  # pylint: disable=protected-access
          args, command_lib._parse_hosts(args.hosts))  # pylint: disable=protected-access
    except ValueError as e:
      supervise.say(f"error: {e}")
      return 2
    if args.min_np > start:
      supervise.say(f"error: --min-np {args.min_np} is more than the {start} "
                    f"ranks the job starts with (-np {args.num_proc}, -H "
                    f"{args.hosts})")
      return 2
  try:
    if args.preemption_signal is not None:
      signum = preemption.parse_signal(args.preemption_signal,
                                       "--preemption-signal")
      environ[preemption.SIGNAL_VARIABLE] = signum.name
    else:
      preemption.signal_from_env(environ)  # fails here, not on the ranks
  except ValueError as e:
    supervise.say(f"error: {e}")
    return 2
  if args.restarts > 0:
    environ[RESTART_VARIABLE] = "0"
  try:
    launcher, launcher_path = command_lib.find_launcher(args.launcher, environ)
  except ValueError as e:
    supervise.say(f"error: {e}")
    return 1
  flavour = None
  if launcher == "mpirun":
    flavour = command_lib.detect_mpi_flavour(launcher_path, environ)
  try:
    command = command_lib.build_command(args, environ, launcher, launcher_path,
                            mpi_flavour=flavour or "openmpi")
  except (ValueError, ImportError) as e:  # ImportError: not built (Options)
    supervise.say(f"error: {e}")
    return 2
  if args.verbose:
    if args.launcher != "auto":
      why = f"--launcher {args.launcher}"
    elif launcher == "srun":
      why = "auto: SLURM_JOB_ID is set and srun is on PATH"
    else:
      why = "auto: not inside a Slurm allocation with srun"
    supervise.say(f"launcher: {launcher_path} ({why}"
         f"{', ' + flavour if flavour else ''})")
    for name in sorted(set(command.env) - set(environ)) + sorted(
        n for n in environ if command.env.get(n) != environ[n]):
      supervise.say(f"setting {name}={command.env[name]}")
    for detail in command.details:
      supervise.say(detail)
  for note in command.notes:
    supervise.say(note)
  line = shlex.join(command.argv)
  if args.dry_run:
    print(line, flush=True)
    return 0
  supervise.say(line)
  attempts = args.restarts + 1
  attempt = 1
  while True:
    if attempts > 1:
      command.env[RESTART_VARIABLE] = str(attempt - 1)
      supervise.say(f"attempt {attempt} of {attempts}")
    code, received = supervise.run_attempt(
        command, kill_after=args.kill_after, verbose=args.verbose)
    if code == 0 or received or attempt == attempts:
      break
    supervise.say(f"attempt {attempt} of {attempts} ended: "
                  f"{describe_exit(code)}; restarting")
    if args.min_np is not None:
      try:
        command = _without_lost_hosts(args, environ, launcher, launcher_path,
                                      flavour, command)
      except ValueError as e:
        supervise.say(f"not restarting: {e}")
        return code
    attempt += 1
  if attempts > 1 and code != 0:
    # Each signal once (a stranger's one SIGTERM was listed twice).
    names = [signal.Signals(s).name for s in dict.fromkeys(received)]
    why = ("the launcher got " + ", ".join(names) if names else
           f"no restarts left (--restarts {args.restarts})")
    supervise.say(f"attempt {attempt} of {attempts} ended: "
                  f"{describe_exit(code)}; not restarting: {why}")
  if args.verbose:
    supervise.say(f"exit status {code}")
  return code


def _host_answers(launcher_path, host, environ, mpi_args):
  """True if mpirun can start a process on `host` within 60 s.

  The user's --mpi-args go along: a site's launch agent or network
  settings decide whether mpirun can reach a host at all.
  """
  argv = [launcher_path, "-np", "1", "-H", f"{host}:1"]
  if os.geteuid() == 0:
    argv.append("--allow-run-as-root")
  argv += command_lib.split_mpi_args(mpi_args)
  try:
    done = subprocess.run(argv + ["true"], env=environ,
                          stdin=subprocess.DEVNULL, capture_output=True,
                          timeout=60, check=False)
  except (OSError, subprocess.SubprocessError):
    return False
  return done.returncode == 0


def _without_lost_hosts(args, environ, launcher, launcher_path, flavour,
                        command):
  """The command for a restart on the hosts of -H that still answer.

  Returns `command` when every host answers; otherwise a new one with the
  answering hosts and min(-np, their slots) ranks (`args` is updated).

  Raises:
    ValueError: Fewer than --min-np ranks are left, or mpirun only.
  """
  if launcher != "mpirun":
    raise ValueError("--min-np works with mpirun only (under Slurm, "
                     "requeue the job instead)")
  hosts = command_lib._parse_hosts(args.hosts)  # pylint: disable=protected-access
  alive = [(h, n) for h, n in hosts
           if _host_answers(launcher_path, h, command.env, args.mpi_args)]
  if len(alive) == len(hosts):
    return command
  lost = ", ".join(h for h, n in hosts if (h, n) not in alive)
  slots = sum(1 if n is None else n for _, n in alive)
  num_proc = min(args.num_proc or slots, slots)
  if num_proc < args.min_np:
    raise ValueError(f"lost {lost}; {slots} slots left on the other hosts, "
                     f"fewer than --min-np {args.min_np}")
  args.hosts = ",".join(h if n is None else f"{h}:{n}" for h, n in alive)
  args.num_proc = num_proc
  supervise.say(f"lost {lost}; going on with {num_proc} ranks on "
                f"{args.hosts}")
  new = command_lib.build_command(args, environ, launcher, launcher_path,
                                  mpi_flavour=flavour or "openmpi")
  supervise.say(shlex.join(new.argv))
  return new


def describe_exit(code):
  """Says in words what the job's exit status `code` means."""
  if code == preemption.EXIT_CODE:
    return (f"preempted (exit status {code}: the ranks saved a checkpoint "
            "and exited)")
  if code > 128:
    try:
      name = signal.Signals(code - 128).name
    except ValueError:
      return f"exit status {code}"
    return f"exit status {code} (a process died of {name})"
  return f"exit status {code} (a rank failed)"
