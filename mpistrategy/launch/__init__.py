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

Modules: `cli` (the command line and `main`), `command` (command building;
needs neither TensorFlow nor MPI), `supervise` (running, signal forwarding,
killing what is left) and `check` (`--check`, the only one that imports
TensorFlow and mpi4py).  `mpistrategy/run.py` is the entry point
(`python -m mpistrategy.run`, the `mpistrategyrun` console script).
"""
