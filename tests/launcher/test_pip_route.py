"""The pip route: `pip install --no-build-isolation .` without Bazel.

Builds a wheel from a copy of the sources (so the checkout's own op library
and build folders stay untouched), installs it into a folder of its own and
runs a 2-rank allreduce that imports mpistrategy from there only.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from _job_env import ROOT

_SCRIPT = """
import tensorflow as tf
import mpistrategy
from mpistrategy import ops
from mpistrategy.ops import _library

rank = mpistrategy.rank()
total = ops.allreduce(tf.fill([3], float(rank + 1)), name="pip-route")
print(f"MODULE {mpistrategy.__file__}", flush=True)
print(f"LIBRARY {_library.load().path}", flush=True)
print(f"RESULT {rank} {mpistrategy.size()} {total.numpy().tolist()}",
      flush=True)
"""


def _pip(args, timeout):
  proc = subprocess.run([sys.executable, "-m", "pip", "--no-input",
                         "--disable-pip-version-check", *args],
                        capture_output=True, text=True, timeout=timeout,
                        check=False)
  assert proc.returncode == 0, (
      f"pip {' '.join(args)} failed ({proc.returncode})\n--- stdout ---\n"
      f"{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}")


@pytest.mark.timeout(900)
def test_wheel_built_without_bazel_runs_on_two_ranks(tmp_path, launch):
  source = tmp_path / "source"
  source.mkdir()
  shutil.copy(os.path.join(ROOT, "setup.py"), source)
  ignore = shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info")
  for folder in ("cc", "mpistrategy"):
    shutil.copytree(os.path.join(ROOT, folder), source / folder,
                    ignore=ignore)
  dist = tmp_path / "dist"
  _pip(["wheel", "--no-build-isolation", "--no-deps", "--no-cache-dir",
        "-q", "-w", str(dist), str(source)], timeout=780)
  wheels = list(dist.glob("mpistrategy-*.whl"))
  assert len(wheels) == 1, os.listdir(dist)
  site = tmp_path / "site"
  _pip(["install", "--no-deps", "--no-cache-dir", "-q", "--target",
        str(site), str(wheels[0])], timeout=120)
  script = tmp_path / "pip_route.py"
  script.write_text(textwrap.dedent(_SCRIPT))

  # PYTHONPATH replaces the checkout's: only the installed copy is found.
  job = launch(str(script), np=2, env={"PYTHONPATH": str(site)}, timeout=90)
  job.assert_no_leftovers()
  assert not job.timed_out, job.describe()
  assert job.returncode == 0, job.describe()
  for rank in range(2):
    lines = job.rank_lines(rank)
    assert f"MODULE {site}/mpistrategy/__init__.py" in lines, job.describe()
    assert f"LIBRARY {site}/mpistrategy/ops/_mpi_ops.so" in lines, \
        job.describe()
    assert f"RESULT {rank} 2 [3.0, 3.0, 3.0]" in lines, job.describe()
