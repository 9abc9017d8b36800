"""The mpirun command line the benchmark drivers launch their jobs with.

The flags match the Makefile's MPIRUN_FLAGS (`make bench`, `make demo`): on
one host, ranks may outnumber cores (--oversubscribe) and float between them
(--bind-to none), and Open MPI's single-copy shared memory (CMA), which
fails in many containers, is off.
"""


def mpirun_command(np_, argv, exports=(), mpirun="mpirun"):
  """Returns the command that runs `argv` on `np_` ranks of this host.

  Args:
    np_: Number of ranks.
    argv: The program and its arguments, e.g. [sys.executable, script].
    exports: Environment variables to pass to the ranks: "NAME" (its value
      here) or "NAME=VALUE".
    mpirun: The mpirun executable.

  Returns:
    The command as a list of strings.
  """
  cmd = [mpirun, "-np", str(np_), "--oversubscribe", "--bind-to", "none",
         "--mca", "btl_vader_single_copy_mechanism", "none"]
  for name in exports:
    cmd += ["-x", name]
  return cmd + list(argv)
