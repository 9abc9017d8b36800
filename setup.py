"""Builds the C++ libraries for pip; the metadata lives in pyproject.toml.

    pip install mpistrategy-<version>.tar.gz      # sdist, with build isolation
    pip install .                                 # from a checkout
    pip install --no-build-isolation .            # against the TensorFlow
                                                  # already installed here
    MPISTRATEGY_CUDA=1 pip install .              # + NCCL GPU kernels

Compiles the sources that cc/sources.bzl lists for Bazel's
`//cc:_mpi_ops.so`, with the same flags, into mpistrategy/ops/_mpi_ops.so,
and those of `//cc:_config.so` (option validation; no TensorFlow, no MPI)
into mpistrategy/_config.so.
The op library is tied to the C++ ABI of the TensorFlow it is compiled against:
with build isolation that is the newest release that pyproject.toml's
build requirement allows, so install a matching TensorFlow at run time (the
runtime requirement has the same range).

Environment:
  MPICC: MPI compiler wrapper to ask for flags (default: `mpicc` on PATH,
    else the one mpi4py was built with).
  MPISTRATEGY_CUDA=1: also compile the GPU kernels.
  MPISTRATEGY_PREBUILT_LIBRARY: path of an op library already built (by
    `make build`); it is packaged as is instead of compiling.
  MPISTRATEGY_PREBUILT_CONFIG_LIBRARY: the same for mpistrategy/_config.so
    (without it, that small library is compiled: a few seconds).
  MAX_JOBS: how many compilers run at once (default: the CPUs this process
    may use, at most 8; each takes up to about 0.7 GB).
"""
import ast
import os
import shlex
import shutil
import subprocess
import sys
from concurrent import futures

from setuptools import Extension
from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
EXT_NAME = "mpistrategy.ops._mpi_ops"
CONFIG_EXT_NAME = "mpistrategy._config"
CUDA = os.environ.get("MPISTRATEGY_CUDA", "0") == "1"
PREBUILT = os.environ.get("MPISTRATEGY_PREBUILT_LIBRARY", "")
PREBUILT_CONFIG = os.environ.get("MPISTRATEGY_PREBUILT_CONFIG_LIBRARY", "")

# cc/sources.bzl list -> the Bazel package its paths are relative to.
_CPU_LISTS = {
    "COMMON_SRCS": "cc/common",
    "COMMON_MPI_SRCS": "cc/common",
    "ENGINE_CONFIG_SRCS": "cc/engine",
    "ENGINE_SRCS": "cc/engine",
    "PLANE_SRCS": "cc/transport",
    "MPI_TRANSPORT_SRCS": "cc/transport",
    "KERNEL_SRCS": "cc",
}
# The same for //cc:_config.so.
_CONFIG_LISTS = {
    "COMMON_SRCS": "cc/common",
    "ENGINE_CONFIG_SRCS": "cc/engine",
    "CONFIG_C_API_SRCS": "cc/engine",
}
_GPU_LISTS = {
    "COMMON_CUDA_SRCS": "cc/common",
    "CUDA_STREAM_SRCS": "cc/device",
    "NCCL_PLANE_SRCS": "cc/transport",
    "KERNEL_GPU_SRCS": "cc",
}


def _bazel_lists():
  """The string lists assigned in cc/sources.bzl, by name."""
  path = os.path.join(HERE, "cc", "sources.bzl")
  try:
    with open(path) as f:
      tree = ast.parse(f.read(), path)
  except OSError as e:
    sys.exit(f"setup.py: cannot read the source list {path}: {e}")
  lists = {}
  for node in tree.body:
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
      lists[node.targets[0].id] = ast.literal_eval(node.value)
  return lists


def _sources(wanted=None):
  """The .cc files of the op library (default) or of the lists `wanted`."""
  lists = _bazel_lists()
  if wanted is None:
    wanted = dict(_CPU_LISTS, **(_GPU_LISTS if CUDA else {}))
  sources = []
  for name, package in wanted.items():
    if name not in lists:
      sys.exit(f"setup.py: cc/sources.bzl has no list {name}")
    for file in lists[name]:
      if file.endswith(".cc"):
        sources.append(os.path.join(package, file))
  missing = [s for s in sources if not os.path.isfile(os.path.join(HERE, s))]
  if missing:
    sys.exit("setup.py: sources listed in cc/sources.bzl are missing: "
             + ", ".join(missing))
  return sources


def _tf_flags():
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  try:
    import tensorflow as tf
  except ImportError as e:
    sys.exit(f"setup.py: cannot import tensorflow ({e}); it is a build "
             "requirement (pyproject.toml)")
  include = tf.sysconfig.get_include()
  defines = [f for f in tf.sysconfig.get_compile_flags() if f.startswith("-D")]
  return include, defines, tf.sysconfig.get_link_flags()


def _mpicc():
  if os.environ.get("MPICC"):
    return os.environ["MPICC"]
  if shutil.which("mpicc"):
    return "mpicc"
  try:
    import mpi4py
    configured = mpi4py.get_config().get("mpicc")
    if configured and shutil.which(configured):
      return configured
  except ImportError:
    pass
  sys.exit("setup.py: no MPI compiler wrapper found: install MPI (Debian: "
           "apt-get install libopenmpi-dev) or set MPICC")


def _mpi(what):
  """Open MPI's `--showme:<what>`, or the same read from MPICH's `-show`."""
  mpicc = _mpicc()
  try:
    out = subprocess.check_output([mpicc, "--showme:" + what], text=True)
    return shlex.split(out)
  except (OSError, subprocess.CalledProcessError):
    out = subprocess.check_output([mpicc, "-show"], text=True)
    tokens = shlex.split(out)
    if what == "incdirs":
      return [t[2:] for t in tokens if t.startswith("-I")]
    return [t for t in tokens if t[:2] in ("-L", "-l", "-W")]


def _compile_jobs():
  """How many compilers to run at once: MAX_JOBS, else the CPUs, at most 8."""
  value = os.environ.get("MAX_JOBS", "")
  if value:
    if not value.isdigit() or int(value) < 1:
      sys.exit(f"setup.py: MAX_JOBS must be a whole number >= 1, got {value!r}")
    return int(value)
  return max(1, min(len(os.sched_getaffinity(0)), 8))


def _compile_in_parallel(compile_sources):
  """Wraps a distutils `CCompiler.compile` to compile each source apart.

  Args:
    compile_sources: the compiler's own `compile` method.

  Returns:
    A function with the same arguments and result (the object files, in the
    order of the sources) that runs up to `_compile_jobs()` compilers at once.
  """

  def compile_all(sources, *args, **kwargs):
    jobs = min(_compile_jobs(), len(sources))
    if jobs <= 1:
      return compile_sources(sources, *args, **kwargs)
    with futures.ThreadPoolExecutor(jobs) as pool:
      parts = pool.map(lambda s: compile_sources([s], *args, **kwargs),
                       sources)
      return [obj for part in parts for obj in part]

  return compile_all


class BuildExt(build_ext):
  """Names the libraries mpistrategy/ops/_mpi_ops.so and
  mpistrategy/_config.so (no ABI tag: they are no Python modules), the paths
  mpistrategy/_library.py and mpistrategy/options.py load; packages
  MPISTRATEGY_PREBUILT_LIBRARY / MPISTRATEGY_PREBUILT_CONFIG_LIBRARY when
  set."""

  def get_ext_filename(self, fullname):
    # Called with the full dotted name and, from get_ext_fullpath, with the
    # last component only.
    for name in (EXT_NAME, CONFIG_EXT_NAME):
      if fullname == name:
        return name.replace(".", os.sep) + ".so"
      if fullname == name.rsplit(".", 1)[1]:
        return fullname + ".so"
    return super().get_ext_filename(fullname)

  # No `parallel` default: setuptools' parallel build_ext builds the two
  # extensions at once, and both compile cc/common/*.cc into the same object
  # files under build_temp (with different flags), so one linked a file the
  # other was rewriting ("_config.so ... returned non-zero exit status 1").
  # The sources of one extension are compiled in parallel instead
  # (_compile_in_parallel): 70 s serial on 2 cores, the bulk of a pip install.

  def build_extension(self, ext):
    if ext.name == CONFIG_EXT_NAME:
      prebuilt = PREBUILT_CONFIG
      variable = "MPISTRATEGY_PREBUILT_CONFIG_LIBRARY"
    else:
      prebuilt, variable = PREBUILT, "MPISTRATEGY_PREBUILT_LIBRARY"
    if not prebuilt:
      if ext.name == CONFIG_EXT_NAME:
        self._add_config_flags(ext)
      else:
        self._add_flags(ext)
      serial_compile = self.compiler.compile
      self.compiler.compile = _compile_in_parallel(serial_compile)
      try:
        super().build_extension(ext)
      finally:
        self.compiler.compile = serial_compile
      return
    target = self.get_ext_fullpath(ext.name)
    if not os.path.isfile(prebuilt):
      sys.exit(f"setup.py: {variable}={prebuilt} does not exist (run "
               "`make build`)")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copyfile(prebuilt, target)

  @staticmethod
  def _add_config_flags(ext):
    # As //cc:_config.so: plain C++, no TensorFlow, no MPI.
    ext.extra_compile_args = ["-std=c++17", "-O2", "-g0"]
    ext.extra_link_args = ["-Wl,-z,defs", "-Wl,-Bsymbolic"]

  @staticmethod
  def _add_flags(ext):
    # Queried here, not at import, so that sdist and metadata-only calls
    # need neither TensorFlow nor MPI.
    tf_include, tf_defines, tf_link = _tf_flags()
    # Same as Bazel's -c opt (Python's own CFLAGS come first; -g0 drops -g).
    flags = ["-std=c++17", "-O2", "-g0", "-isystem", tf_include,
             "-DOMPI_SKIP_MPICXX=1", "-DMPICH_SKIP_MPICXX=1"] + tf_defines
    for directory in _mpi("incdirs"):
      flags += ["-isystem", directory]
    if CUDA:
      flags.append("-DGOOGLE_CUDA=1")
      # CUDA 12 / NCCL headers bundled in the TF wheel; no CUDA library is
      # linked: libtensorflow_framework exports lazy-loading cuda*/nccl*
      # stubs (as MPISTRATEGY_CUDA_LINK=tf does in Bazel).
      for directory in ("third_party/gpus/cuda/include",
                        "third_party/gpus/cuda/libcudacxx/include",
                        "external/cuda_nccl/include"):
        flags += ["-isystem", os.path.join(tf_include, directory)]
    ext.extra_compile_args = flags
    ext.extra_link_args = tf_link + _mpi("link") + ["-Wl,-z,defs"]


if __name__ == "__main__":  # setuptools runs this file as __main__
  setup(
      ext_modules=[
          Extension(
              EXT_NAME,
              sources=_sources(),
              language="c++",
              include_dirs=["."],  # "cc/common/common.h" style includes
          ),
          Extension(
              CONFIG_EXT_NAME,
              sources=_sources(_CONFIG_LISTS),
              language="c++",
              include_dirs=["."],
          ),
      ],
      cmdclass={"build_ext": BuildExt},
  )
