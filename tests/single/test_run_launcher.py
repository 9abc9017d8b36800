"""`python -m mpistrategy.run`: command construction, errors, signals, --check.

Nothing here starts MPI.  The commands are built from fixed environments;
fake `mpirun` and `srun` scripts on PATH stand in for MPICH and Slurm; the
signal tests run shell commands in place of the launcher.
"""

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from mpistrategy import Options
from mpistrategy import run
from mpistrategy.launch import supervise
from mpistrategy.launch import command as launch_command
from procs import alive

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
PYTHON = "/venv/bin/python"
MPIRUN = "/usr/bin/mpirun"
QUIET = [PYTHON, "-m", "mpistrategy.quiet"]


@pytest.fixture
def script(tmp_path):
  path = tmp_path / "train.py"
  path.write_text("print('hello')\n")
  return str(path)


def _environ(**extra):
  env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ROOT, "HOME": "/home/u",
         "TF_CONFIG": "{}"}
  env.update(extra)
  return env


def _build(argv, environ=None, launcher="mpirun", path=MPIRUN,
           flavour="openmpi", euid=1000, cpus=2, total_cpus=2):
  # A host of 2 CPUs unless a test says otherwise: the commands do not
  # depend on the machine that runs the tests.
  args = run.parse_args(argv)
  return run.build_command(args, _environ() if environ is None else environ,
                           launcher, path, mpi_flavour=flavour,
                           executable=PYTHON, euid=euid, cpus=cpus,
                           total_cpus=total_cpus)


def _placement(argv):
  """The CPU placement flags of an Open MPI command line."""
  out = []
  for i, a in enumerate(argv):
    if a == "--use-hwthread-cpus":
      out.append(a)
    elif a in ("--bind-to", "--map-by"):
      out += [a, argv[i + 1]]
  return out


def _fake_bin(tmp_path, name, text):
  """Puts an executable shell script `name` in tmp_path/bin; returns PATH."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(exist_ok=True)
  path = bin_dir / name
  path.write_text("#!/bin/sh\n" + text)
  path.chmod(0o755)
  return f"{bin_dir}:/usr/bin:/bin"


def _main(monkeypatch, capsys, argv, **environ):
  """main(argv) with os.environ set to `environ`; (code, stdout, stderr)."""
  for name in list(os.environ):
    if name.startswith(("MPISTRATEGY_", "SLURM_")):
      monkeypatch.delenv(name)
  for name, value in environ.items():
    monkeypatch.setenv(name, value)
  code = run.main(argv)
  out, err = capsys.readouterr()
  return code, out, err


# --- Open MPI ----------------------------------------------------------------


def test_openmpi_command(monkeypatch, script):
  # As from a checkout on PYTHONPATH (an installed package: the same).
  monkeypatch.setattr(launch_command, "_package_parent", lambda: ROOT)
  environ = _environ(LD_LIBRARY_PATH="/opt/lib", NCCL_DEBUG="INFO",
                     CUDA_VISIBLE_DEVICES="0,1", TF_CPP_MIN_LOG_LEVEL="2",
                     MPISTRATEGY_CYCLE_TIME_MS="5", OMPI_MCA_btl="self",
                     HOROVOD_FUSION_THRESHOLD="0")
  command = _build(["-np", "4", "--stall-warning-seconds", "7", script,
                    "--epochs", "3"], environ)
  assert command.launcher == "mpirun"
  assert command.argv == [
      MPIRUN, "-np", "4", "--oversubscribe", "--tag-output",
      "--bind-to", "none", "--map-by", "slot",
      "-x", "CUDA_VISIBLE_DEVICES",
      # Horovod scripts' settings reach ranks on other hosts too.
      "-x", "HOROVOD_FUSION_THRESHOLD", "-x", "LD_LIBRARY_PATH",
      "-x", "MPISTRATEGY_CYCLE_TIME_MS",
      "-x", "MPISTRATEGY_STALL_WARNING_SECONDS=7.0",
      "-x", "NCCL_DEBUG", "-x", "PATH", "-x", "PYTHONPATH",
      "-x", "TF_CPP_MIN_LOG_LEVEL",
      *QUIET, PYTHON, script, "--epochs", "3"]
  # The flag's value is also in the environment mpirun runs with.
  assert command.env["MPISTRATEGY_STALL_WARNING_SECONDS"] == "7.0"
  assert command.env["MPISTRATEGY_CYCLE_TIME_MS"] == "5"
  assert command.notes == []


def test_flag_overrides_the_same_variable_in_the_environment(script):
  command = _build(["-np", "2", "--stall-warning-seconds", "7", script],
                   _environ(MPISTRATEGY_STALL_WARNING_SECONDS="3"))
  assert "MPISTRATEGY_STALL_WARNING_SECONDS=7.0" in command.argv
  assert "MPISTRATEGY_STALL_WARNING_SECONDS" not in command.argv
  assert command.env["MPISTRATEGY_STALL_WARNING_SECONDS"] == "7.0"


def test_hosts_and_hostfile(script, tmp_path):
  command = _build(["-np", "4", "-H", "host1:2,host2:2", script])
  i = command.argv.index("-H")
  assert command.argv[i + 1] == "host1:2,host2:2"

  hostfile = tmp_path / "hosts"
  hostfile.write_text("host1 slots=2\nhost2 slots=2\n")
  command = _build(["-np", "4", "--hostfile", str(hostfile), script])
  i = command.argv.index("--hostfile")
  assert command.argv[i + 1] == str(hostfile)
  assert "-H" not in command.argv


def test_mpi_args_are_split_and_win_over_defaults(script):
  command = _build(["-np", "2", "--mpi-args", "--mca btl tcp,self",
                    "--mpi-args=--bind-to core", script])
  argv = command.argv
  assert argv[argv.index("--mca"):argv.index(PYTHON)] == [
      "--mca", "btl", "tcp,self", "--bind-to", "core"]
  assert argv[argv.index(PYTHON):] == [*QUIET, PYTHON, script]
  assert argv.count("--bind-to") == 1
  assert "--map-by" in argv


def test_ranks_on_one_host_get_their_share_of_the_cpus(script):
  share = ["--use-hwthread-cpus", "--map-by", "slot:PE=1",
           "--bind-to", "hwthread"]
  assert _placement(_build(["-np", "2", script]).argv) == share
  assert _placement(_build(["-np", "2", script], cpus=16,
                           total_cpus=16).argv)[2] == "slot:PE=8"
  # The remainder stays unused rather than making shares unequal.
  assert _placement(_build(["-np", "3", script], cpus=16,
                           total_cpus=16).argv)[2] == "slot:PE=5"
  assert launch_command.cpu_share_flags(4, 8, 8) == [
      "--use-hwthread-cpus", "--map-by", "slot:PE=2", "--bind-to", "hwthread"]


def test_ranks_float_where_a_share_would_not_fit(script, tmp_path):
  floating = ["--bind-to", "none", "--map-by", "slot"]
  # More ranks than CPUs, one rank, and a launcher confined to part of the
  # host (Open MPI would bind outside that part).
  assert _placement(_build(["-np", "3", script]).argv) == floating
  assert _placement(_build(["-np", "1", script]).argv) == floating
  assert _placement(_build(["-np", "2", script], cpus=4,
                           total_cpus=8).argv) == floating
  # Several hosts: their CPUs are not known here.
  assert _placement(_build(["-H", "a:2,b:2", script], cpus=16,
                           total_cpus=16).argv) == floating
  hostfile = tmp_path / "hosts"
  hostfile.write_text("a slots=2\n")
  assert _placement(_build(["--hostfile", str(hostfile), script], cpus=16,
                           total_cpus=16).argv) == floating
  assert _placement(_build(["-np", "2", script], _environ(SLURM_JOB_ID="7"),
                           cpus=16, total_cpus=16).argv) == floating


@pytest.mark.parametrize("mpi_args,added", [
    # A binding of the user's: the launcher adds only the mapping.
    ("--bind-to core", ["--map-by", "slot"]),
    ("-bind-to core", ["--map-by", "slot"]),
    ("--mca hwloc_base_binding_policy core", ["--map-by", "slot"]),
    ("--use-hwthread-cpus", ["--map-by", "slot"]),
    # A mapping: only the binding (none, as on several hosts).
    ("--map-by socket", ["--bind-to", "none"]),
    ("--mca rmaps_base_mapping_policy core", ["--bind-to", "none"]),
    # Both: nothing (Open MPI refuses a rankfile beside --map-by).
    ("--map-by slot:PE=2", []),
    ("--cpus-per-proc 2", []),
    ("-rf ranks.txt", []),
    ("--rankfile ranks.txt", []),
    # Hosts named in --mpi-args: several hosts, so the ranks float.
    ("--host localhost:2", ["--bind-to", "none", "--map-by", "slot"]),
    ("-machinefile hosts.txt", ["--bind-to", "none", "--map-by", "slot"]),
])
def test_the_users_placement_wins_over_the_share(script, mpi_args, added):
  argv = _build(["-np", "2", "--mpi-args", mpi_args, script], cpus=16,
                total_cpus=16).argv
  # The user's flags come last, unchanged; before them, what the launcher
  # added itself.
  first_user_flag = argv.index(mpi_args.split()[0])
  assert argv[first_user_flag:argv.index(PYTHON)] == mpi_args.split()
  assert _placement(argv[:first_user_flag]) == added


@pytest.mark.parametrize("variable,added", [
    ("OMPI_MCA_hwloc_base_binding_policy", ["--map-by", "slot"]),
    ("OMPI_MCA_rmaps_base_mapping_policy", ["--bind-to", "none"]),
    ("OMPI_MCA_rmaps_rank_file_path", []),
])
def test_placement_variables_in_the_environment_win(script, variable, added):
  environ = _environ(**{variable: "x"})
  argv = _build(["-np", "2", script], environ, cpus=16, total_cpus=16).argv
  assert _placement(argv) == added


def test_verbose_says_how_the_ranks_were_placed(script):
  def placement(argv, **kw):
    details = _build(argv, **kw).details
    assert len([d for d in details if d.startswith("placement: ")]) == 1
    return next(d for d in details if d.startswith("placement: "))

  assert "each rank bound to 8 of this host's 16 CPUs" in placement(
      ["-np", "2", script], cpus=16, total_cpus=16)
  assert "3 ranks, 2 CPUs" in placement(["-np", "3", script])
  assert "one rank" in placement(["-np", "1", script])
  assert "4 of this host's 8 CPUs" in placement(["-np", "2", script],
                                                cpus=4, total_cpus=8)
  assert "several hosts" in placement(["-H", "a:1,b:1", script])
  assert "--mpi-args" in placement(["-np", "2", "--mpi-args=--bind-to core",
                                    script])


def test_script_arguments_are_not_parsed(script):
  args = run.parse_args(["-np", "2", script, "--mpi-args", "x", "-np", "9",
                         "--verbose"])
  assert args.num_proc == 2
  assert args.mpi_args == []
  assert not args.verbose
  assert args.command == [script, "--mpi-args", "x", "-np", "9", "--verbose"]
  args = run.parse_args(["-np", "2", "--", script, "-x"])
  assert args.command == [script, "-x"]


def test_program_on_path_is_run_as_given(script):
  command = _build(["-np", "2", "sh", "-c", "true"])
  assert command.argv[-3:] == ["sh", "-c", "true"]
  assert PYTHON not in _build(["-np", "2", "--verbose", "sh", "-c",
                               "true"]).argv


def test_compiled_program_given_by_path_is_run_as_given(script):
  # `horovodrun -np 2 /venv/bin/python train.py` users write the
  # interpreter's path; it must not become the script of another python.
  command = _build(["-np", "2", "--verbose", sys.executable, script])
  assert command.argv[-2:] == [sys.executable, script]
  assert PYTHON not in command.argv
  # A script (not compiled) still runs with the launcher's interpreter.
  assert _build(["-np", "2", "--verbose", script]).argv[-2:] == [PYTHON,
                                                                  script]


def test_unsplittable_mpi_args_are_named(script):
  with pytest.raises(ValueError,
                     match=r"--mpi-args=\"--tag-output 'x\": No closing "
                     "quotation"):
    _build(["-np", "2", "--mpi-args=--tag-output 'x", script])


def test_executable_script_of_another_interpreter_is_run_as_given(tmp_path):
  # A shell wrapper that sets up the rank's environment (it failed as a
  # Python script with a SyntaxError).
  wrapper = tmp_path / "wrapper.sh"
  wrapper.write_text("#!/bin/sh\nexec \"$@\"\n")
  wrapper.chmod(0o755)
  command = _build(["-np", "2", "--verbose", str(wrapper), "train.py"])
  assert command.argv[-2:] == [str(wrapper), "train.py"]
  assert PYTHON not in command.argv
  # An executable Python script, or a wrapper that cannot be executed,
  # still runs with the launcher's interpreter.
  for text, mode in (("#!/usr/bin/env python3\nprint(1)\n", 0o755),
                     ("#!/bin/sh\nexec \"$@\"\n", 0o644)):
    other = tmp_path / "other"
    other.write_text(text)
    other.chmod(mode)
    assert _build(["-np", "2", "--verbose", str(other)]).argv[-2:] == [
        PYTHON, str(other)]


def test_checkout_goes_on_pythonpath_for_the_ranks(monkeypatch, script):
  # The launcher's mpistrategy comes from a checkout outside site-packages.
  monkeypatch.setattr(launch_command, "_package_parent", lambda: ROOT)
  environ = _environ()
  del environ["PYTHONPATH"]
  command = _build(["-np", "2", script], environ)
  assert f"PYTHONPATH={ROOT}" in command.argv
  assert command.env["PYTHONPATH"] == ROOT
  environ["PYTHONPATH"] = "/other"
  command = _build(["-np", "2", script], environ)
  assert f"PYTHONPATH={ROOT}{os.pathsep}/other" in command.argv


def test_root_gets_allow_run_as_root_and_one_note(script):
  command = _build(["-np", "2", script], euid=0)
  assert command.argv.count("--allow-run-as-root") == 1
  assert command.argv.index("--allow-run-as-root") < command.argv.index(
      PYTHON)
  assert command.notes == [
      "running as root: added --allow-run-as-root, without which Open MPI "
      "refuses to start (common in containers)"]
  # Already allowed: nothing added, nothing said.
  for environ, argv in [
      (_environ(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"),
       ["-np", "2", script]),
      (_environ(), ["-np", "2", "--mpi-args=--allow-run-as-root", script])]:
    command = _build(argv, euid=0, environ=environ)
    assert command.argv.count("--allow-run-as-root") == (
        1 if "--mpi-args=--allow-run-as-root" in argv else 0), command.argv
    assert command.notes == []
  # Half of the variables is not enough for Open MPI: the flag is added.
  command = _build(["-np", "2", script], euid=0,
                   environ=_environ(OMPI_ALLOW_RUN_AS_ROOT="1"))
  assert "--allow-run-as-root" in command.argv
  # Not root, or not Open MPI: nothing.
  assert "--allow-run-as-root" not in _build(["-np", "2", script]).argv
  command = _build(["-np", "2", script], euid=0, flavour="mpich")
  assert "--allow-run-as-root" not in command.argv and not command.notes
  command = _build(["-np", "2", script], euid=0, launcher="srun",
                   path="/usr/bin/srun")
  assert "--allow-run-as-root" not in command.argv and not command.notes


# --- output lines, oversubscription, -np from slots ---------------------------


def test_rank_prefix_by_default_and_off_with_a_flag(script):
  cases = [("openmpi", "mpirun", MPIRUN, "--tag-output"),
           ("mpich", "mpirun", MPIRUN, "-prepend-rank"),
           ("openmpi", "srun", "/usr/bin/srun", "--label")]
  for flavour, launcher, path, flag in cases:
    command = _build(["-np", "2", script], flavour=flavour,
                     launcher=launcher, path=path)
    assert command.argv.count(flag) == 1, command.argv
    assert command.argv.index(flag) < command.argv.index(PYTHON)
    command = _build(["-np", "2", "--no-tag-output", script],
                     flavour=flavour, launcher=launcher, path=path)
    assert flag not in command.argv, command.argv
  # The user's own choice is not doubled.
  command = _build(["-np", "2", "--mpi-args=--tag-output", script])
  assert command.argv.count("--tag-output") == 1
  command = _build(["-np", "2", "--mpi-args=-l", script], flavour="mpich")
  assert "-prepend-rank" not in command.argv


def test_no_hosts_oversubscribes_this_host_only(script, tmp_path):
  assert "--oversubscribe" in _build(["-np", "3", script]).argv
  # Hosts given, or inside an allocation: their slots are the limit.
  assert "--oversubscribe" not in _build(
      ["-np", "3", "-H", "a:2,b:1", script]).argv
  hostfile = tmp_path / "hosts"
  hostfile.write_text("a slots=3\n")
  assert "--oversubscribe" not in _build(
      ["-np", "3", "--hostfile", str(hostfile), script]).argv
  for variable in ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID"):
    assert "--oversubscribe" not in _build(
        ["-np", "3", script], _environ(**{variable: "7"})).argv
  # The user's own mapping choice is kept as it is.
  for extra in ("--nooversubscribe", "--map-by=core:OVERSUBSCRIBE"):
    argv = _build(["-np", "3", f"--mpi-args={extra}", script]).argv
    assert "--oversubscribe" not in argv, argv


def test_number_of_ranks_from_host_slots(script, tmp_path):
  command = _build(["-H", "a:2,b:3", script])
  assert command.argv[1:3] == ["-np", "5"]
  command = _build(["-H", "a:2,b:2", script], launcher="srun",
                   path="/usr/bin/srun")
  assert "--ntasks=4" in command.argv
  # -np wins over the slots.
  assert _build(["-np", "3", "-H", "a:2,b:3", script]).argv[1:3] == [
      "-np", "3"]
  with pytest.raises(ValueError, match=r"-np/--num-proc is required: -H "
                     r"a:2,b gives no slot count for b"):
    _build(["-H", "a:2,b", script])
  hostfile = tmp_path / "hosts"
  hostfile.write_text("# two hosts\na slots=2 max_slots=4\n\nb slots=3\n")
  command = _build(["--hostfile", str(hostfile), script])
  assert command.argv[1:3] == ["-np", "5"]
  hostfile.write_text("a:2\nb:1  # MPICH style\n")
  command = _build(["--hostfile", str(hostfile), script], flavour="mpich")
  assert command.argv[1:3] == ["-np", "3"]
  for text in ("a\nb slots=2\n", "a cpu=2\n", "\n# nothing\n"):
    hostfile.write_text(text)
    with pytest.raises(ValueError, match="-np/--num-proc is required: "
                       "--hostfile .* does not give every host's slots"):
      _build(["--hostfile", str(hostfile), script])


def test_rank_program_runs_behind_the_quiet_wrapper_unless_verbose(script):
  command = _build(["-np", "2", script])
  assert command.argv[-5:] == [*QUIET, PYTHON, script]
  assert "MPISTRATEGY_VERBOSE" not in command.env
  command = _build(["-np", "2", "--verbose", script])
  assert command.argv[-2:] == [PYTHON, script]
  assert "mpistrategy.quiet" not in command.argv
  assert "MPISTRATEGY_VERBOSE=1" in command.argv
  assert command.env["MPISTRATEGY_VERBOSE"] == "1"
  # A program on PATH is wrapped as well.
  assert _build(["-np", "2", "sh", "-c", "true"]).argv[-6:] == [
      *QUIET, "sh", "-c", "true"]


# --- engine option flags -----------------------------------------------------


def test_every_options_field_has_a_flag(script):
  """Flags come from dataclasses.fields(Options), new fields included."""
  for field in dataclasses.fields(Options):
    flag = "--" + field.name.replace("_", "-")
    variable = "MPISTRATEGY_" + field.name.upper()
    default = getattr(Options(), field.name)
    if field.name == "verbose":  # the launcher's own --verbose sets it
      on = _build(["-np", "1", "--verbose", script])
      assert f"{variable}=1" in on.argv, on.argv
      assert variable not in _build(["-np", "1", script]).env
      continue
    if isinstance(default, bool):
      on = _build(["-np", "1", flag, script])
      off = _build(["-np", "1", "--no-" + flag[2:], script])
      assert f"{variable}=1" in on.argv, (flag, on.argv)
      assert f"{variable}=0" in off.argv, (flag, off.argv)
    else:
      value = str(default) if default != "" else "/tmp/out.json"
      command = _build(["-np", "1", flag, value, script])
      assert command.env[variable] == value, (flag, command.env[variable])
      assert f"{variable}={value}" in command.argv, (flag, command.argv)


def test_option_flag_values_parse_like_the_environment(script):
  options = Options.from_env(environ=_build(
      ["-np", "1", "--fusion-threshold-bytes", "1024", "--cycle-time-ms",
       "2.5", "--hierarchical-allreduce", "--no-abort-on-exception",
       "--timeline", "/tmp/t.json", script]).env)
  assert options.fusion_threshold_bytes == 1024
  assert options.cycle_time_ms == 2.5
  assert options.hierarchical_allreduce is True
  assert options.abort_on_exception is False
  assert options.timeline == "/tmp/t.json"


@pytest.mark.parametrize("argv, patterns", [
    (["--cycle-time-ms", "0"],
     ["--cycle-time-ms", "Options.cycle_time_ms", "> 0", "got 0"]),
    (["--fusion-threshold-bytes", "abc"],
     ["--fusion-threshold-bytes", "'abc'", "not an integer"]),
    (["--cache-capacity", "-1"],
     ["--cache-capacity", "Options.cache_capacity", "in [0, 2147483647]",
      "got -1"]),
    (["--stall-timeout-seconds", "soon"],
     ["--stall-timeout-seconds", "'soon'", "not a number"]),
])
def test_bad_option_values_name_the_flag(script, argv, patterns):
  with pytest.raises(ValueError) as info:
    _build(["-np", "2", *argv, script])
  for pattern in patterns:
    assert pattern in str(info.value), str(info.value)


def test_bad_option_value_in_the_environment_is_caught_first(script):
  with pytest.raises(ValueError) as info:
    _build(["-np", "2", script],
           _environ(MPISTRATEGY_STALL_TIMEOUT_SECONDS="-1"))
  assert "MPISTRATEGY_STALL_TIMEOUT_SECONDS" in str(info.value)
  assert ">= 0" in str(info.value)


def test_unknown_mpistrategy_variable_is_a_warning(script):
  command = _build(["-np", "2", script],
                   _environ(MPISTRATEGY_CYCLE_TIME="5"))
  assert any("MPISTRATEGY_CYCLE_TIME" in n and n.startswith("warning:")
             for n in command.notes), command.notes


# --- bad input through main() -----------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["-np", "0", "{script}"], "-np/--num-proc must be a positive integer, "
     "got 0"),
    (["{script}"], "-np/--num-proc is required"),
    (["-np", "2", "no_such_script.py"], "no_such_script.py: no such file"),
    (["-np", "2", "/tmp"], "/tmp: is a directory"),
    (["-np", "2"], "no script given"),
    (["-np", "2", "-H", "host1:0", "{script}"], "-H/--hosts: 'host1:0'"),
    (["-np", "2", "-H", "a:1", "--hostfile", "{script}", "{script}"],
     "give either -H/--hosts or --hostfile, not both"),
    (["-np", "2", "--hostfile", "/no/such/hosts", "{script}"],
     "--hostfile /no/such/hosts: no such file"),
    (["-np", "2", "--cycle-time-ms", "-1", "{script}"], "--cycle-time-ms"),
    # NaN would pass a `< 0` check and disable the kill.
    (["-np", "2", "--kill-after", "nan", "{script}"],
     "--kill-after must be a finite number >= 0, got nan"),
    (["-np", "2", "--kill-after", "-1", "{script}"], "--kill-after"),
])
def test_bad_input_fails_before_launching(monkeypatch, capsys, script, argv,
                                          message):
  argv = [a.replace("{script}", script) for a in argv]
  code, out, err = _main(monkeypatch, capsys, ["--dry-run"] + argv,
                         PATH="/usr/bin:/bin")
  assert code == 2, (out, err)
  assert out == ""
  assert f"mpistrategy.run: error: {message}" in err, err


def test_unparsable_arguments_exit_2(monkeypatch, capsys, script):
  code, _, err = _main(monkeypatch, capsys, ["-np", "two", script])
  assert code == 2
  assert "-np/--num-proc: invalid int value: 'two'" in err, err


def test_missing_launcher_is_reported(monkeypatch, capsys, script, tmp_path):
  code, _, err = _main(monkeypatch, capsys, ["-np", "2", script],
                       PATH=str(tmp_path))
  assert code == 1
  assert "mpirun (or mpiexec) not found on PATH" in err, err


# --- launcher selection: Slurm, MPICH -----------------------------------------


def test_srun_inside_a_slurm_allocation(monkeypatch, capsys, tmp_path,
                                        script):
  path = _fake_bin(tmp_path, "srun", "exit 0\n")
  code, out, err = _main(
      monkeypatch, capsys, ["-np", "4", "-H", "node1:2,node2:2",
                            "--stall-warning-seconds", "7", "--dry-run",
                            script, "--epochs", "3"],
      PATH=path, SLURM_JOB_ID="1234", MPISTRATEGY_CYCLE_TIME_MS="5")
  assert code == 0, err
  argv = out.strip().split()
  assert argv[:6] == [
      str(tmp_path / "bin" / "srun"), "--ntasks=4", "--nodes=2",
      "--nodelist=node1,node2", "--ntasks-per-node=2",
      "--kill-on-bad-exit=1"], argv
  assert "--export=ALL,MPISTRATEGY_STALL_WARNING_SECONDS=7.0" in argv[6]
  assert argv[-3:] == [script, "--epochs", "3"]
  assert argv[-4] == sys.executable


def test_srun_is_only_picked_in_an_allocation(tmp_path):
  path = _fake_bin(tmp_path, "srun", "exit 0\n")
  assert run.find_launcher("auto", {"PATH": path})[0] == "mpirun"
  assert run.find_launcher("auto", {"PATH": path, "SLURM_JOB_ID": "1"}) == (
      "srun", str(tmp_path / "bin" / "srun"))
  assert run.find_launcher("mpirun", {"PATH": path,
                                      "SLURM_JOB_ID": "1"})[0] == "mpirun"
  # In an allocation without srun on PATH: mpirun.
  assert run.find_launcher("auto", {"PATH": "/usr/bin:/bin",
                                    "SLURM_JOB_ID": "1"})[0] == "mpirun"
  with pytest.raises(ValueError, match="srun not found on PATH"):
    run.find_launcher("srun", {"PATH": str(tmp_path)})


def test_srun_rejects_what_it_cannot_express(script, tmp_path):
  with pytest.raises(ValueError, match="different numbers of tasks per host"):
    _build(["-np", "3", "-H", "a:2,b:1", script], launcher="srun",
           path="/usr/bin/srun")
  hostfile = tmp_path / "hosts"
  hostfile.write_text("a\n")
  with pytest.raises(ValueError, match="--hostfile is for mpirun"):
    _build(["-np", "3", "--hostfile", str(hostfile), script],
           launcher="srun", path="/usr/bin/srun")


def test_mpich_flavour_from_a_fake_mpirun(monkeypatch, capsys, tmp_path,
                                          script):
  path = _fake_bin(tmp_path, "mpirun",
                   'if [ "$1" = --version ]; then\n'
                   '  echo "HYDRA build details:"\n'
                   '  echo "    Version:                                 '
                   '4.1.2"\nfi\n')
  assert run.detect_mpi_flavour(str(tmp_path / "bin" / "mpirun"),
                                {"PATH": path}) == "mpich"
  code, out, err = _main(
      monkeypatch, capsys, ["-np", "4", "-H", "h1:2,h2:2", "--cycle-time-ms",
                            "5", "--dry-run", script], PATH=path)
  assert code == 0, err
  argv = out.strip().split()
  assert argv[:8] == [str(tmp_path / "bin" / "mpirun"), "-np", "4", "-hosts",
                      "h1:2,h2:2", "-genv", "MPISTRATEGY_CYCLE_TIME_MS",
                      "5.0"], argv
  assert "-x" not in argv and "--bind-to" not in argv, argv
  assert argv[-2:] == [sys.executable, script]


def test_unrecognised_mpirun_gets_open_mpi_flags_and_a_note(
    monkeypatch, capsys, tmp_path, script):
  path = _fake_bin(tmp_path, "mpirun", "echo 'some MPI 1.0'\n")
  code, out, err = _main(monkeypatch, capsys,
                         ["-np", "2", "--dry-run", script], PATH=path)
  assert code == 0, err
  assert "-x PATH" in out
  assert "could not tell which MPI" in err, err


def test_openmpi_is_detected():
  if not os.path.exists(MPIRUN):
    pytest.skip("no /usr/bin/mpirun")
  assert run.detect_mpi_flavour(MPIRUN, dict(os.environ)) == "openmpi"


def test_dry_run_prints_one_shell_quoted_line(monkeypatch, capsys, tmp_path,
                                              script):
  path = _fake_bin(tmp_path, "mpirun", "echo 'mpirun (Open MPI) 4.1.4'\n")
  code, out, err = _main(monkeypatch, capsys,
                         ["-np", "2", "--dry-run", script, "a b", "it's"],
                         PATH=path)
  assert code == 0, err
  assert out.count("\n") == 1
  assert out.rstrip().endswith("'a b' 'it'\"'\"'s'"), out
  assert "mpistrategy.run: " not in out


# --- running: exit status and signals -----------------------------------------


def _command(shell, launcher="mpirun"):
  return run.Command(argv=["sh", "-c", shell], env=dict(os.environ),
                     launcher=launcher)


def _signal_self_when(path, signum, timeout=30):
  """Sends `signum` to this process once `path` exists (a thread)."""
  def wait_and_signal():
    deadline = time.time() + timeout
    while not os.path.exists(path) and time.time() < deadline:
      time.sleep(0.05)
    time.sleep(0.2)
    os.kill(os.getpid(), signum)
  thread = threading.Thread(target=wait_and_signal, daemon=True)
  thread.start()
  return thread


@pytest.mark.timeout(60)
def test_exit_status_is_the_commands():
  assert run.run(_command("exit 3")) == 3
  assert run.run(_command("exit 0")) == 0
  assert run.run(_command("kill -SEGV $$")) == 128 + signal.SIGSEGV


def _rank_shell(ready, on_term):
  """An "mpirun" (sh) whose child, the "rank", exits `on_term` on SIGTERM.

  The child has OMPI_COMM_WORLD_RANK set, as ranks have.  A SIGTERM to the
  outer shell would end it with 143 (it waits for the child), so the tests
  see that the signal went to the "rank" only.
  """
  rank = (f"trap 'exit {on_term}' TERM; touch {ready}; "
          "while :; do sleep 0.1; done")
  return f"OMPI_COMM_WORLD_RANK=0 sh -c \"{rank}\"; exit $?"


@pytest.mark.timeout(60)
def test_sigterm_is_forwarded_to_the_ranks(tmp_path):
  ready = tmp_path / "ready"
  thread = _signal_self_when(str(ready), signal.SIGTERM)
  start = time.time()
  code = run.run(_command(_rank_shell(ready, 7)))
  thread.join()
  assert code == 128 + signal.SIGTERM
  assert time.time() - start < 20


@pytest.mark.timeout(60)
def test_ranks_that_exit_preempted_give_42_and_the_signal_is_configurable(
    tmp_path):
  ready = tmp_path / "ready"
  thread = _signal_self_when(str(ready), signal.SIGTERM)
  command = _command(_rank_shell(ready, 42).replace("TERM", "USR1"))
  command.env["MPISTRATEGY_PREEMPTION_SIGNAL"] = "USR1"
  start = time.time()
  code, received = supervise.run_attempt(command)
  thread.join()
  assert (code, received) == (42, [signal.SIGTERM])
  assert time.time() - start < 20


@pytest.mark.timeout(60)
def test_job_that_ignores_signals_is_killed_after_the_grace_period(tmp_path):
  """Including a process in its own process group (as mpirun's ranks are)."""
  ready = tmp_path / "ready"
  grandchild = (
      f"{sys.executable} -c \"import os, signal, time; os.setpgid(0, 0); "
      "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
      f"open('{tmp_path}/pid', 'w').write(str(os.getpid())); "
      f"open('{ready}', 'w').close(); time.sleep(60)\"")
  thread = _signal_self_when(str(ready), signal.SIGTERM)
  start = time.time()
  code = run.run(_command(f"trap '' TERM; {grandchild} & wait; sleep 60"),
                 kill_after=1.0)
  thread.join()
  assert code == 128 + signal.SIGKILL
  assert time.time() - start < 20
  pid = int((tmp_path / "pid").read_text())
  deadline = time.time() + 5
  while alive(pid) and time.time() < deadline:
    time.sleep(0.1)
  assert not alive(pid), "the process in its own group survived"


@pytest.mark.timeout(60)
def test_sigint_to_srun_is_sent_twice(tmp_path):
  """srun needs two SIGINTs within a second to end the step."""
  ready, log = tmp_path / "ready", tmp_path / "log"
  thread = _signal_self_when(str(ready), signal.SIGINT)
  code = run.run(_command(
      f"n=0; trap 'n=$((n+1)); echo int >> {log}; [ $n -ge 2 ] && exit 1' "
      f"INT; touch {ready}; while :; do sleep 0.05; done", launcher="srun"))
  thread.join()
  assert code == 128 + signal.SIGINT
  assert log.read_text().split() == ["int", "int"]


# --- --check ------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_check_reports_the_build():
  env = dict(os.environ)
  env["TF_CPP_MIN_LOG_LEVEL"] = "2"
  env["CUDA_VISIBLE_DEVICES"] = ""
  out = subprocess.run([sys.executable, "-P", "-m", "mpistrategy.run",
                        "--check"],
                       env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=200, check=False, stdin=subprocess.DEVNULL)
  text = out.stdout
  assert out.returncode == 0, out.stdout + out.stderr
  assert "\x00" not in text  # Open MPI's version string ends with NUL
  lines = text.splitlines()
  def line(prefix):
    found = [l for l in lines if l[4:].startswith(prefix)]
    assert len(found) == 1, f"no single {prefix!r} line in:\n{text}"
    assert found[0][:4] in ("[X] ", "[ ] ", "[?] "), found[0]
    return found[0]
  assert line("mpistrategy ").startswith("[X]")
  assert line("TensorFlow ").startswith("[X]")
  library = line("op library loads: ")
  assert library.startswith("[X]") and library.endswith("_mpi_ops.so"), \
      library
  line("CUDA kernels built")
  line("NCCL built")
  mpi = line("MPI library: ")
  assert mpi.startswith("[X]"), mpi
  line("MPI_THREAD_MULTIPLE")
  gpus = line("GPUs visible to TensorFlow: ")
  assert gpus.startswith("[ ] GPUs visible to TensorFlow: 0"), gpus
  line("mpirun: ")
  line("srun: ")


def test_check_fails_when_the_op_library_does_not_load(monkeypatch, capsys):
  from mpistrategy import _library

  def not_built():
    raise ImportError("_mpi_ops.so was not found (test)")

  monkeypatch.setattr(_library, "load", not_built)
  assert run.check(dict(os.environ)) == 1
  out = capsys.readouterr().out
  assert "[ ] op library: _mpi_ops.so was not found (test)" in out, out
  assert "[?] CUDA kernels built: unknown" in out, out


def test_launcher_starts_without_importing_tensorflow():
  # `import mpistrategy` loads the ops (and TensorFlow) lazily, so building
  # and printing the command takes milliseconds, not seconds.
  code = ("import sys, mpistrategy.run; "
          "assert 'tensorflow' not in sys.modules, 'tensorflow imported'; "
          "import mpistrategy; mpistrategy.Options(); "
          "assert 'tensorflow' not in sys.modules, 'tensorflow imported'")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, timeout=60, check=False)
  assert proc.returncode == 0, proc.stderr


# --- quiet ranks: mpistrategy._output and python -m mpistrategy.quiet ---------
# The subprocesses import mpistrategy as the tests do: the installed package,
# or the caller's PYTHONPATH.


def test_rank_comes_from_the_launchers_variables():
  from mpistrategy import _output
  assert _output.rank_from_env({}) is None
  assert _output.rank_from_env({"OMPI_COMM_WORLD_RANK": "3"}) == 3
  assert _output.rank_from_env({"PMI_RANK": "2"}) == 2
  assert _output.rank_from_env({"PMIX_RANK": "1"}) == 1
  assert _output.rank_from_env({"SLURM_PROCID": "5"}) == 5
  # mpirun inside a Slurm allocation: every rank has SLURM_PROCID=0.
  assert _output.rank_from_env({"SLURM_PROCID": "0",
                                "OMPI_COMM_WORLD_RANK": "4"}) == 4
  assert _output.verbose_from_env({"MPISTRATEGY_VERBOSE": "1"})
  assert not _output.verbose_from_env({"MPISTRATEGY_VERBOSE": "0"})


@pytest.mark.parametrize("line", [
    "WARNING: All log messages before absl::InitializeLog() is called are "
    "written to STDERR",
    "I0000 00:00:1796315091.956375    9843 cudart_stub.cc:31] Could not find "
    "cuda drivers on your machine, GPU will not be used.",
    "W0000 00:00:1796315091.956375    9843 gpu_device.cc:2344] Cannot dlopen "
    "some GPU libraries.",
    "I1203 16:00:01.123456   77 cpu_feature_guard.cc:227] This TensorFlow "
    "binary is optimized",
    "To enable the following instructions: AVX2 FMA, in other operations, "
    "rebuild TensorFlow with the appropriate compiler flags.",
    "2026-12-03 16:00:00.123456: I tensorflow/core/util/port.cc:153] oneDNN "
    "custom operations are on.",
    "WARNING:tensorflow:a tf logger warning",
    "INFO:absl:something",
])
def test_start_up_noise_is_recognised(line):
  from mpistrategy import _output
  assert _output.is_noise(line)
  assert _output.is_noise(line + "\n")


@pytest.mark.parametrize("line", [
    "E0000 00:00:1796315262.894519   11660 cuda_platform.cc:52] failed call "
    "to cuInit",
    "F0000 00:00:1796315262.894519   11660 x.cc:1] Check failed",
    "2026-12-03 16:00:00.123456: E tensorflow/core/x.cc:1] an error",
    "ERROR:tensorflow:an error",
    "Traceback (most recent call last):",
    "[rank 1] RuntimeError: boom",
    "[mpistrategy rank 1] Stalled: collective \"x\" ...",
    "I0000 is how my script starts a line",
    "",
])
def test_errors_and_user_lines_are_not_noise(line):
  from mpistrategy import _output
  assert not _output.is_noise(line)


_NOISY = r"""
import sys, warnings
sys.stderr.write("I0000 00:00:1796315091.956375    9843 x.cc:31] info\n")
sys.stderr.write("E0000 00:00:1796315091.956375    9843 x.cc:31] error\n")
warnings.warn("a warning")
print("out " + sys.argv[1], flush=True)
sys.stderr.write("partial line without newline")
sys.exit(int(sys.argv[2]))
"""


def _quiet_run(tmp_path, environ, code=0):
  prog = tmp_path / "noisy.py"
  prog.write_text(_NOISY)
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("OMPI_", "PMI", "SLURM_", "MPISTRATEGY_",
                              "PYTHONWARNINGS"))}
  env.update(environ)
  return subprocess.run(
      [sys.executable, "-m", "mpistrategy.quiet", sys.executable, str(prog),
       "x", str(code)], env=env, capture_output=True, text=True, timeout=60,
      check=False)


@pytest.mark.timeout(120)
def test_quiet_wrapper_on_rank_1_drops_noise_and_keeps_errors(tmp_path):
  result = _quiet_run(tmp_path, {"OMPI_COMM_WORLD_RANK": "1"}, code=3)
  assert result.returncode == 3, result
  assert result.stdout == "out x\n"
  assert "x.cc:31] info" not in result.stderr, result.stderr
  assert "a warning" not in result.stderr, result.stderr
  assert "E0000 00:00:1796315091.956375    9843 x.cc:31] error\n" in \
      result.stderr
  assert result.stderr.endswith("partial line without newline"), \
      result.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("environ", [
    {"OMPI_COMM_WORLD_RANK": "0"}, {},
    {"OMPI_COMM_WORLD_RANK": "1", "MPISTRATEGY_VERBOSE": "1"}])
def test_quiet_wrapper_keeps_everything_on_rank_0_or_verbose(tmp_path,
                                                            environ):
  result = _quiet_run(tmp_path, environ)
  assert result.returncode == 0, result
  assert "x.cc:31] info" in result.stderr, result.stderr
  assert "UserWarning: a warning" in result.stderr, result.stderr


_VERBOSE_LATER = r"""
import sys, warnings
import mpistrategy
from mpistrategy import _output
sys.stderr.write("I0000 00:00:1796315091.956375    9843 x.cc:31] before\n")
warnings.warn("warning before")
_output.undo_quiet()  # what init(Options(verbose=True)) does
sys.stderr.write("I0000 00:00:1796315091.956375    9843 x.cc:31] after\n")
warnings.warn("warning after")
"""


@pytest.mark.timeout(120)
def test_verbose_options_show_later_output_behind_the_wrapper(tmp_path):
  # The wrapper filters in its own process and set PYTHONWARNINGS=ignore
  # before the program started; Options(verbose=True) undoes both.
  prog = tmp_path / "verbose_later.py"
  prog.write_text(_VERBOSE_LATER)
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("OMPI_", "PMI", "SLURM_", "MPISTRATEGY_",
                              "PYTHONWARNINGS"))}
  env["OMPI_COMM_WORLD_RANK"] = "1"
  result = subprocess.run(
      [sys.executable, "-m", "mpistrategy.quiet", sys.executable, str(prog)],
      env=env, capture_output=True, text=True, timeout=60, check=False)
  assert result.returncode == 0, result
  assert "before" not in result.stderr, result.stderr
  assert "x.cc:31] after" in result.stderr, result.stderr
  assert "UserWarning: warning after" in result.stderr, result.stderr
  assert "MPISTRATEGY_QUIET_WRAPPER" not in result.stderr, result.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_quiet_wrapper_dies_of_the_childs_signal(tmp_path, signum):
  # SIGKILL: a rank killed with kill -9 must be reported as killed, not as
  # a traceback of the wrapper (which cannot install a handler for it).
  prog = tmp_path / "killme.py"
  prog.write_text(f"import os\nos.kill(os.getpid(), {int(signum)})\n")
  env = dict(os.environ, OMPI_COMM_WORLD_RANK="1")
  result = subprocess.run(
      [sys.executable, "-m", "mpistrategy.quiet", sys.executable, str(prog)],
      env=env, capture_output=True, text=True, timeout=60, check=False)
  assert result.returncode == -signum, result
  assert "Traceback" not in result.stderr, result.stderr


@pytest.mark.timeout(120)
def test_quiet_wrapper_forwards_sigterm(tmp_path):
  ready = tmp_path / "ready"
  prog = tmp_path / "wait.py"
  prog.write_text(
      "import signal, sys, time\n"
      "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
      f"open({str(ready)!r}, 'w').close()\n"
      "time.sleep(60)\n")
  env = dict(os.environ, OMPI_COMM_WORLD_RANK="1")
  proc = subprocess.Popen(
      [sys.executable, "-m", "mpistrategy.quiet", sys.executable, str(prog)],
      env=env)
  deadline = time.time() + 60
  while not ready.exists() and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=30) == 7


def test_import_quiets_python_warnings_on_rank_1_only(tmp_path):
  code = ("import warnings, logging, mpistrategy, sys\n"
          "warnings.warn('w')\n"
          "logging.getLogger('tensorflow').warning('tfw')\n"
          "print(logging.getLogger('tensorflow').getEffectiveLevel(), "
          "sys.stdout.line_buffering)\n")
  base = {k: v for k, v in os.environ.items()
          if not k.startswith(("OMPI_", "PMI", "SLURM_", "MPISTRATEGY_",
                               "PYTHONWARNINGS", "TF_CPP"))}
  results = {}
  for name, extra in [("rank1", {"OMPI_COMM_WORLD_RANK": "1"}),
                      ("rank0", {"OMPI_COMM_WORLD_RANK": "0"}),
                      ("verbose", {"OMPI_COMM_WORLD_RANK": "1",
                                   "MPISTRATEGY_VERBOSE": "1"}),
                      ("no_mpi", {})]:
    results[name] = subprocess.run(
        [sys.executable, "-c", code], env=dict(base, **extra),
        capture_output=True, text=True, timeout=60, check=True)
  assert results["rank1"].stdout.split() == ["40", "True"]
  assert "UserWarning" not in results["rank1"].stderr
  assert "tfw" not in results["rank1"].stderr
  for name in ("rank0", "verbose"):
    assert "UserWarning: w" in results[name].stderr, results[name]
    assert results[name].stdout.split()[1] == "True"
  # Outside MPI nothing changes.
  assert "UserWarning: w" in results["no_mpi"].stderr
  assert results["no_mpi"].stdout.split()[1] == "False"


@pytest.mark.timeout(60)
def test_main_works_as_the_console_script(script):
  """What pip's `mpistrategyrun` wrapper does: sys.exit(main())."""
  wrapper = ("import sys\nfrom mpistrategy.run import main\n"
             "sys.argv[0] = '/venv/bin/mpistrategyrun'\nsys.exit(main())\n")
  env = dict(os.environ)
  result = subprocess.run([sys.executable, "-c", wrapper, "--help"], env=env,
                          capture_output=True, text=True, timeout=30,
                          check=False)
  assert result.returncode == 0, result
  assert result.stdout.startswith("usage: mpistrategyrun [options]"), \
      result.stdout
  result = subprocess.run(
      [sys.executable, "-c", wrapper, "--dry-run", "-H", "localhost:2",
       script], env=env, capture_output=True, text=True, timeout=30,
      check=False)
  assert result.returncode == 0, result
  assert " -np 2 -H localhost:2 " in result.stdout, result.stdout
  result = subprocess.run([sys.executable, "-c", wrapper, script], env=env,
                          capture_output=True, text=True, timeout=30,
                          check=False)
  assert result.returncode == 2, result
  assert "-np/--num-proc is required" in result.stderr, result.stderr


# --- restarts ---------------------------------------------------------------

# A fake mpirun: answers --version like Open MPI; a probe (`... -H HOST:1
# true`) fails for "deadhost" and without the site's launch agent (the
# user's --mpi-args); a job run appends its attempt and arguments to $LOG and
# exits 0 from the $SUCCEED_AT-th run on, else $FAIL_WITH.
_FAKE_MPIRUN = """\
if [ "$1" = "--version" ]; then echo "mpirun (Open MPI) 4.1.4"; exit 0; fi
case " $* " in *" deadhost:1 "*) exit 1;; esac
case " $* " in *" site-agent true ") exit 0;; *" true ") exit 1;; esac
echo "attempt=$MPISTRATEGY_RESTART_COUNT $*" >> "$LOG"
[ "$(wc -l < "$LOG")" -ge "$SUCCEED_AT" ] && exit 0
exit "$FAIL_WITH"
"""


def _restart_run(monkeypatch, tmp_path, capsys, argv, succeed_at, fail_with):
  tmp_path.mkdir(exist_ok=True)
  log = tmp_path / "log"
  monkeypatch.setenv("PATH", _fake_bin(tmp_path, "mpirun", _FAKE_MPIRUN))
  monkeypatch.setenv("LOG", str(log))
  monkeypatch.setenv("SUCCEED_AT", str(succeed_at))
  monkeypatch.setenv("FAIL_WITH", str(fail_with))
  code = run.main(argv)
  runs = log.read_text().splitlines() if log.exists() else []
  return code, runs, capsys.readouterr().err


@pytest.mark.timeout(60)
def test_restarts_after_preemption_and_failure_then_stops(
    monkeypatch, tmp_path, capsys, script):
  code, runs, err = _restart_run(monkeypatch, tmp_path, capsys,
                                 ["-np", "2", "--restarts", "2", script], 3, 42)
  assert code == 0
  assert [r.split()[0] for r in runs] == [
      "attempt=0", "attempt=1", "attempt=2"]
  assert "attempt 1 of 3 ended: preempted (exit status 42" in err
  assert "mpistrategy.run: attempt 3 of 3" in err
  code, runs, err = _restart_run(monkeypatch, tmp_path / "b", capsys,
                                 ["-np", "2", "--restarts", "1", script], 9, 1)
  assert code == 1 and len(runs) == 2
  assert ("attempt 2 of 2 ended: exit status 1 (a rank failed); not "
          "restarting: no restarts left (--restarts 1)") in err


@pytest.mark.timeout(60)
def test_min_np_drops_a_host_that_no_longer_answers(
    monkeypatch, tmp_path, capsys, script):
  argv = ["-H", "livehost:2,deadhost:2", "--restarts", "1", "--min-np", "2",
          "--mpi-args=--mca plm_rsh_agent site-agent", script]
  code, runs, err = _restart_run(monkeypatch, tmp_path, capsys, argv, 2, 1)
  assert code == 0
  assert "-np 4 -H livehost:2,deadhost:2 " in runs[0]
  assert "-np 2 -H livehost:2 " in runs[1]
  assert "lost deadhost; going on with 2 ranks on livehost:2" in err
  argv[argv.index("--min-np") + 1] = "3"
  code, runs, err = _restart_run(monkeypatch, tmp_path / "b", capsys, argv,
                                 2, 1)
  assert code == 1 and len(runs) == 1
  assert ("not restarting: lost deadhost; 2 slots left on the other hosts, "
          "fewer than --min-np 3") in err


@pytest.mark.parametrize("argv, message", [
    (["-np", "2", "--restarts", "-1", "{script}"], "--restarts must be >= 0"),
    (["-np", "2", "--min-np", "1", "{script}"], "--min-np M needs"),
    (["--min-np", "3", "--restarts", "1", "-H", "localhost:2", "{script}"],
     "--min-np 3 is more than the 2 ranks the job starts with"),
    (["-np", "2", "--min-np", "3", "--restarts", "1", "-H", "a:2,b:2",
      "{script}"], "--min-np 3 is more than the 2 ranks"),
    (["-np", "2", "--preemption-signal", "KILL", "{script}"],
     "--preemption-signal: SIGKILL cannot be caught"),
    (["-np", "2", "--preemption-signal", "NOPE", "{script}"],
     "--preemption-signal: 'NOPE' is not a signal name"),
])
def test_bad_restart_and_preemption_flags(capsys, script, argv, message):
  assert run.main([a.format(script=script) for a in argv]) == 2
  assert message in capsys.readouterr().err


def test_segments_a_job_left_are_removed_and_others_kept(tmp_path,
                                                         monkeypatch):
  import mmap  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(supervise, "_SHM_DIR", str(tmp_path))

  def segment(name):
    path = tmp_path / name
    path.write_bytes(b"\0" * 4096)
    return path

  older = segment("vader_segment.h.0.1.0")        # before the job
  before = supervise._open_mpi_segments()  # pylint: disable=protected-access
  left = segment("vader_segment.h.0.2.0")         # the job's, unused now
  in_use = segment("vader_segment.h.0.3.0")       # another job's, mapped
  other = segment("mpistrategy-123-abc")          # not Open MPI's
  with open(in_use, "r+b") as f, mmap.mmap(f.fileno(), 4096):
    removed = supervise._remove_left_segments(  # pylint: disable=protected-access
        before, settle_seconds=0.3)
  assert removed == [str(left)]
  assert not left.exists()
  assert older.exists() and in_use.exists() and other.exists()
