"""The pip route, as a user takes it: an sdist installed with build isolation.

Builds the sdist from the checkout, checks what it carries, installs it into
a fresh virtual environment from a directory outside the checkout (pip then
compiles the op library in an isolated build environment with the
TensorFlow that pyproject.toml requires; no Bazel), and runs a 2-rank job
from a third directory through that environment's `mpistrategyrun`.  The
job must import mpistrategy and its op library from that environment only.

The isolated build environment gets its own TensorFlow, as on a user's
machine.  The fresh environment borrows the runtime requirements
(TensorFlow, mpi4py, numpy) from the test's own environment through a .pth
file, so pip finds them satisfied and installs only mpistrategy: a second
TensorFlow install would add about a minute and prove nothing more.  pip
still checks that the borrowed TensorFlow is in the range the package
requires, and the job must import mpistrategy from the fresh environment.

Slow (a TensorFlow install and a compile: about 2-3 minutes here), so it is
one test.
"""

import os
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import time

import pytest

from _job_env import ROOT
from _job_env import clean_env
from _job_env import leftovers

_SCRIPT = """
import tensorflow as tf
import mpistrategy
from mpistrategy import ops
from mpistrategy import _library

rank = mpistrategy.rank()
total = ops.allreduce(tf.fill([3], float(rank + 1)), name="pip-route")
print(f"MODULE {rank} {mpistrategy.__file__}", flush=True)
print(f"LIBRARY {rank} {_library.load().path}", flush=True)
print(f"VERSION {rank} {mpistrategy.__version__}", flush=True)
print(f"RESULT {rank} {mpistrategy.size()} {total.numpy().tolist()}",
      flush=True)
"""


def _run(argv, cwd, timeout, env=None):
  proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True,
                        text=True, timeout=timeout, check=False,
                        stdin=subprocess.DEVNULL)
  assert proc.returncode == 0, (
      f"{' '.join(map(str, argv))} failed ({proc.returncode})\n"
      f"--- stdout ---\n{proc.stdout[-4000:]}\n"
      f"--- stderr ---\n{proc.stderr[-6000:]}")
  return proc


def _version():
  namespace = {}
  with open(os.path.join(ROOT, "mpistrategy", "version.py")) as f:
    exec(compile(f.read(), "version.py", "exec"), namespace)  # pylint: disable=exec-used
  return namespace["__version__"]


def _sources_in_bazel_list():
  """The .cc files cc/sources.bzl lists, as paths relative to the root."""
  sys.path.insert(0, ROOT)
  try:
    import setup as setup_py
  finally:
    sys.path.remove(ROOT)
  return setup_py._sources()  # pylint: disable=protected-access


@pytest.mark.timeout(1500)
def test_sdist_installs_with_build_isolation_and_runs_two_ranks(tmp_path):
  version = _version()
  env = clean_env({"PIP_DISABLE_PIP_VERSION_CHECK": "1",
                   "PIP_NO_INPUT": "1", "TF_CPP_MIN_LOG_LEVEL": "2"})

  # 1. The sdist, built from the checkout as a release would be.
  dist = tmp_path / "dist"
  _run([sys.executable, "-m", "build", "--sdist", "--outdir", str(dist),
        ROOT], cwd=ROOT, timeout=300, env=env)
  sdist = dist / f"mpistrategy-{version}.tar.gz"
  assert sdist.is_file(), os.listdir(dist)
  with tarfile.open(sdist) as tar:
    names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
  for needed in ["pyproject.toml", "setup.py", "LICENSE", "README.md",
                 "cc/sources.bzl", "mpistrategy/version.py",
                 *_sources_in_bazel_list()]:
    assert needed in names, f"{needed} is missing from {sdist.name}"
  # Headers the sources include travel too.
  assert "cc/engine/engine.h" in names and "cc/kernels/tf_adapter.h" in names

  # 2. A fresh environment; pip runs from a directory outside the checkout.
  outside = tmp_path / "outside"
  outside.mkdir()
  venv = tmp_path / "venv"
  _run([sys.executable, "-m", "venv", str(venv)], cwd=outside, timeout=120,
       env=env)
  python = str(venv / "bin" / "python")
  site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
               "['purelib'])"], cwd=outside, timeout=60).stdout.strip()
  ours = sysconfig.get_paths()["purelib"]
  # Appended after the fresh site-packages, so its own mpistrategy wins.
  with open(os.path.join(site, "borrowed-requirements.pth"), "w") as f:
    f.write(ours + "\n")
  start = time.time()
  _run([python, "-m", "pip", "install", "--progress-bar", "off", str(sdist)],
       cwd=outside, timeout=1100, env=env)
  print(f"pip install of the sdist took {time.time() - start:.0f} s")

  # 3. A 2-rank job from a third directory, through the console script.
  work = tmp_path / "work"
  work.mkdir()
  (work / "train.py").write_text(textwrap.dedent(_SCRIPT))
  marker = f"pip-route-{os.getpid()}-{int(time.time())}"
  job_env = clean_env({"TF_CPP_MIN_LOG_LEVEL": "2"})
  # The job must import the fresh venv's copy, not a private install that
  # the caller named (make test sets no PYTHONPATH).
  job_env.pop("PYTHONPATH", None)
  job_env["PATH"] = f"{venv / 'bin'}{os.pathsep}{job_env.get('PATH', '')}"
  proc = subprocess.run(
      ["timeout", "-k", "10", "180", str(venv / "bin" / "mpistrategyrun"),
       "-np", "2", "train.py", marker],
      cwd=work, env=job_env, capture_output=True, text=True, timeout=240,
      check=False, stdin=subprocess.DEVNULL)
  output = proc.stdout + proc.stderr
  assert proc.returncode == 0, output[-8000:]
  for rank in range(2):
    assert f"MODULE {rank} {site}/mpistrategy/__init__.py" in output, output
    assert f"LIBRARY {rank} {site}/mpistrategy/ops/_mpi_ops.so" in output, \
        output
    assert f"VERSION {rank} {version}" in output, output
    assert f"RESULT {rank} 2 [3.0, 3.0, 3.0]" in output, output
  assert not leftovers(marker), f"processes of the job outlived it: {marker}"
