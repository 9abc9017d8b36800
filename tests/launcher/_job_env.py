"""Environment and leftover-process helpers shared by the launcher tests.

Used by conftest.py (jobs started with `mpirun`) and test_run_launcher.py
(jobs started with `python -m mpistrategy.run`).
"""

import os
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def clean_env(extra=None, tf_log_level="1"):
  """The environment of a test job.

  Drops what would make the job think it is part of another MPI job (when
  pytest itself runs under mpirun or in a Slurm allocation) and the caller's
  MPISTRATEGY_* settings (each test sets its own); keeps OMPI_MCA_* tuning.
  The jobs import the installed mpistrategy, as the tests do (see
  tests/conftest.py); a PYTHONPATH the caller set (a private install) is
  kept, and `make test` sets none.

  Args:
    extra: Variables to set on top, or None.
    tf_log_level: TF_CPP_MIN_LOG_LEVEL for the ranks.  "1" (INFO off,
      WARNING on) keeps the engine's stall warning visible.

  Returns:
    A new environment dict.
  """
  env = {k: v for k, v in os.environ.items()
         if k.startswith("OMPI_MCA_") or
         not k.startswith(("OMPI_", "PMIX_", "OPAL_", "MPISTRATEGY_",
                           "PMI_", "SLURM_"))}
  # Not unbuffered: Python would then write a traceback in fragments, and
  # --tag-output tags every fragment.  stderr is line-buffered anyway, and
  # the scripts write their events with one write(2) each (_rankio.emit).
  env.pop("PYTHONUNBUFFERED", None)
  env["TF_CPP_MIN_LOG_LEVEL"] = tf_log_level
  env["CUDA_VISIBLE_DEVICES"] = ""
  if os.geteuid() == 0:
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
  env.update(extra or {})
  return env


def leftovers(marker):
  """PIDs (other than ours) whose command line contains `marker`."""
  pgrep = shutil.which("pgrep")
  if pgrep is None:
    return []
  out = subprocess.run([pgrep, "-f", marker], capture_output=True, text=True,
                       check=False, timeout=30).stdout
  return [int(p) for p in out.split() if int(p) != os.getpid()]
