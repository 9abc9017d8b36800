"""The mpirun command line the benchmark drivers launch their jobs with.

On one host, ranks may outnumber cores (--oversubscribe), and Open MPI's
single-copy shared memory (CMA), which fails in many containers, is off.
Ranks are placed on CPUs the way `mpistrategyrun` places them: each on a
share of the host's CPUs of its own where they fit
(`mpistrategy.launch.command.cpu_share_flags`), floating over all of them
(--bind-to none, the Makefile's MPIRUN_FLAGS) otherwise or when asked.
"""

import os
import sys

# The checkout's mpistrategy, the one the benchmarks' ranks import.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
from mpistrategy.launch.command import cpu_share_flags  # noqa: E402


def mpirun_command(np_, argv, exports=(), mpirun="mpirun", floating=False):
  """Returns the command that runs `argv` on `np_` ranks of this host.

  Args:
    np_: Number of ranks.
    argv: The program and its arguments, e.g. [sys.executable, script].
    exports: Environment variables to pass to the ranks: "NAME" (its value
      here) or "NAME=VALUE".
    mpirun: The mpirun executable.
    floating: Let every rank run on every CPU (--bind-to none) even where
      the ranks fit the CPUs.

  Returns:
    The command as a list of strings.
  """
  placement = None if floating else cpu_share_flags(np_)
  cmd = [mpirun, "-np", str(np_), "--oversubscribe"]
  cmd += placement or ["--bind-to", "none"]
  cmd += ["--mca", "btl_vader_single_copy_mechanism", "none"]
  for name in exports:
    cmd += ["-x", name]
  return cmd + list(argv)
