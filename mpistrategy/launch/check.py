"""`--check`: what mpistrategy was built with and what it finds here.

The one part of the launcher that imports TensorFlow (and mpi4py).
"""

import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys

from mpistrategy.launch import command as command_lib

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
    import mpi4py
    mpi4py.rc.initialize = False  # only ask; do not start MPI
    mpi4py.rc.finalize = False
    from mpi4py import MPI
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
  package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  version = _version("mpistrategy") or "(not installed: source checkout)"
  lines.append(f"{_mark(True)} mpistrategy {version}: {package}")
  lines.append(f"{_mark(True)} Python {platform.python_version()}: "
               f"{sys.executable}")
  try:
    import tensorflow as tf
    lines.append(f"{_mark(True)} TensorFlow {tf.__version__}")
  except ImportError as e:
    tf = None
    lines.append(f"{_mark(False)} TensorFlow: cannot import ({e})")

  library = None
  if tf is not None:
    try:
      from mpistrategy import _library
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
      detail += f" ({command_lib.detect_mpi_flavour(found, environ)})"
    lines.append(f"{_mark(bool(found))} {name}: {detail}")
  if environ.get("SLURM_JOB_ID"):
    lines.append(f"{_mark(True)} inside Slurm job {environ['SLURM_JOB_ID']}")

  print("\n".join(lines), flush=True)
  return 0 if library is not None else 1
