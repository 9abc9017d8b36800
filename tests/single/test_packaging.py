"""The installed package: version, metadata, console script, version contract.

The sdist-to-fresh-venv route is tests/launcher/test_pip_route.py.
"""

import ast
import importlib.metadata
import os
import subprocess
import sys
import sysconfig
import threading
import warnings

import pytest

import mpistrategy
from mpistrategy import version

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))


def test_version_comes_from_one_place():
  assert mpistrategy.__version__ == version.__version__
  assert importlib.metadata.version("mpistrategy") == version.__version__
  with open(os.path.join(ROOT, "pyproject.toml")) as f:
    pyproject = f.read()
  assert 'version = { attr = "mpistrategy.version.__version__" }' in pyproject
  assert "__version__" not in open(os.path.join(ROOT, "setup.py")).read()


def test_every_public_name_resolves_after_a_plain_import():
  # The README writes `mpistrategy.gpu.pin_to_local_gpu`,
  # `mpistrategy.ops.allreduce`, ...: each must work after `import
  # mpistrategy` alone, in a fresh interpreter.
  code = ("import mpistrategy\n"
          "assert 'gpu' in mpistrategy.__all__\n"
          "for name in mpistrategy.__all__:\n"
          "  getattr(mpistrategy, name)\n"
          "mpistrategy.gpu.pin_to_local_gpu\n")
  subprocess.run([sys.executable, "-c", code], check=True, timeout=300,
                 capture_output=True)


def test_metadata_license_and_ranges():
  meta = importlib.metadata.metadata("mpistrategy")
  assert meta["Name"] == "mpistrategy"
  assert meta["License-Expression"] == "Apache-2.0"
  assert meta["Summary"]
  requires = importlib.metadata.requires("mpistrategy")
  tensorflow = [r for r in requires if r.startswith("tensorflow")]
  # A supported range, never the builder's exact version.
  assert tensorflow == ["tensorflow<2.22,>=2.21"], requires
  files = [str(f) for f in importlib.metadata.files("mpistrategy")]
  assert any(f.endswith("LICENSE") for f in files), files
  assert "mpistrategy/ops/_mpi_ops.so" in files
  assert "mpistrategy/_config.so" in files


def test_console_script_runs_the_launcher(tmp_path):
  script = os.path.join(sysconfig.get_path("scripts"), "mpistrategyrun")
  assert os.access(script, os.X_OK), script
  (tmp_path / "train.py").write_text("print('hi')\n")
  out = subprocess.run([script, "--dry-run", "-np", "2", "train.py"],
                       cwd=tmp_path, capture_output=True, text=True,
                       timeout=60, check=False)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "mpirun" in out.stdout and "train.py" in out.stdout


def test_requirements_pin_a_tested_release():
  pins = {}
  with open(os.path.join(ROOT, "requirements.txt")) as f:
    for line in f:
      if "==" in line and not line.startswith("#"):
        name, pin = line.strip().split("==")
        pins[name] = pin
  assert version._series(pins["tensorflow"]) in version.TESTED_TENSORFLOW  # pylint: disable=protected-access
  assert version._series(pins["keras"]) in version.TESTED_KERAS  # pylint: disable=protected-access


def test_tested_versions_give_no_message():
  for tf_series in version.TESTED_TENSORFLOW:
    for keras_series in version.TESTED_KERAS:
      assert version.untested_versions_message(
          tf_series + ".3", keras_series + ".0") is None
  assert version.untested_versions_message(None, None) is None


def test_untested_versions_are_named_with_the_patches():
  message = version.untested_versions_message("2.22.0", "3.15.1")
  assert "TensorFlow 2.22.0" in message and "Keras 3.15.1" not in message
  assert "TensorFlow 2.21.x" in message and "Keras 3.15.x" in message
  assert "BatchNormalization" in message
  message = version.untested_versions_message("2.21.0", "3.16.0")
  assert "Keras 3.16.0" in message and "TensorFlow 2.21.0" not in message


def test_import_warns_once_for_an_untested_keras(tmp_path):
  # A fake `keras` distribution of another release, first on the path.
  site = tmp_path / "site"
  info = site / "keras-9.1.0.dist-info"
  info.mkdir(parents=True)
  (info / "METADATA").write_text("Metadata-Version: 2.1\nName: keras\n"
                                 "Version: 9.1.0\n")
  code = ("import warnings\n"
          "with warnings.catch_warnings(record=True) as w:\n"
          "  warnings.simplefilter('always')\n"
          "  import mpistrategy, mpistrategy.version as v\n"
          "  v.check_versions()\n"
          "print(len(w)); print(w[0].message)\n")
  env = dict(os.environ, PYTHONPATH=str(site))
  out = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=60,
                       check=True)
  count, message = out.stdout.split("\n", 1)
  assert count == "1", out.stdout
  assert "Keras 9.1.0" in message and "Keras 3.15.x" in message


def test_import_with_tested_versions_is_silent():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert version.untested_versions_message(
        importlib.metadata.version("tensorflow"),
        importlib.metadata.version("keras")) is None


def _bazel_lists():
  with open(os.path.join(ROOT, "cc", "sources.bzl")) as f:
    tree = ast.parse(f.read())
  return {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body
          if isinstance(n, ast.Assign)}


@pytest.mark.parametrize("package,lists", [
    ("cc/common", ["COMMON_SRCS", "COMMON_MPI_SRCS", "COMMON_CUDA_SRCS"]),
    ("cc/device", ["CUDA_STREAM_SRCS"]),
    ("cc/engine", ["ENGINE_CONFIG_SRCS", "CONFIG_C_API_SRCS",
                   "ENGINE_SRCS"]),
    ("cc/transport", ["PLANE_SRCS", "MPI_TRANSPORT_SRCS", "NCCL_PLANE_SRCS"]),
])
def test_source_list_has_every_library_file(package, lists):
  """A new .cc file must go into cc/sources.bzl, or neither build has it."""
  listed = {f for name in lists for f in _bazel_lists()[name]}
  present = {f for f in os.listdir(os.path.join(ROOT, package))
             if f.endswith(".cc") and not f.endswith(("_test.cc", "_check.cc"))
             and not f.startswith("fake_")}
  assert present <= listed, sorted(present - listed)


def test_source_list_has_every_kernel_file():
  lists = _bazel_lists()
  listed = set(lists["KERNEL_SRCS"]) | set(lists["KERNEL_GPU_SRCS"])
  present = {os.path.join(d, f) for d in ("kernels", "ops")
             for f in os.listdir(os.path.join(ROOT, "cc", d))
             if f.endswith(".cc")}
  assert present <= listed, sorted(present - listed)


def _setup_module():
  sys.path.insert(0, ROOT)
  try:
    import setup as setup_py  # pylint: disable=import-outside-toplevel
  finally:
    sys.path.remove(ROOT)
  return setup_py


def test_sources_compile_in_parallel_and_link_in_order(monkeypatch):
  """pip compiles the op library's sources at once, objects in source order."""
  setup_py = _setup_module()
  monkeypatch.setenv("MAX_JOBS", "3")
  lock = threading.Lock()
  running = [0, 0]  # now, most at once
  three_running = threading.Barrier(3, timeout=30)

  def compile_sources(sources, output_dir=None, **kwargs):
    assert len(sources) == 1 and output_dir == "tmp", (sources, output_dir)
    assert kwargs == {"debug": 0}, kwargs
    with lock:
      running[0] += 1
      running[1] = max(running)
    if sources[0] in ("a.cc", "b.cc", "c.cc"):
      three_running.wait()  # three compilers at once, or a timeout
    with lock:
      running[0] -= 1
    return [sources[0].replace(".cc", ".o")]

  compile_all = setup_py._compile_in_parallel(compile_sources)  # pylint: disable=protected-access
  sources = ["a.cc", "b.cc", "c.cc", "d.cc", "e.cc"]
  assert compile_all(sources, output_dir="tmp", debug=0) == [
      "a.o", "b.o", "c.o", "d.o", "e.o"]
  assert running[1] == 3


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_bad_max_jobs_is_named(monkeypatch, value):
  setup_py = _setup_module()
  monkeypatch.setenv("MAX_JOBS", value)
  with pytest.raises(SystemExit, match=(
      f"MAX_JOBS must be a whole number >= 1, got '{value}'")):
    setup_py._compile_jobs()  # pylint: disable=protected-access
