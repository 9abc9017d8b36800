"""pip route (no Bazel).  Needs TensorFlow and MPI at build time, so:

    pip install --no-build-isolation .          # CPU kernels
    MPISTRATEGY_CUDA=1 pip install --no-build-isolation .   # + NCCL GPU kernels

Compiles the same sources with the same flags as `bazel build //cc:_mpi_ops.so`
(cc/{engine,transport,ops,kernels}/*.cc minus *_test.cc, fake_*.cc and, unless
MPISTRATEGY_CUDA=1, *_gpu.cc) into mpistrategy/ops/_mpi_ops.so.
Env: MPICC (default mpicc).
"""
import glob
import os
import re
import shlex
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
EXT_NAME = "mpistrategy.ops._mpi_ops"
CUDA = os.environ.get("MPISTRATEGY_CUDA", "0") == "1"


def _sources():
    srcs = []
    for d in ("engine", "transport", "ops", "kernels"):
        for path in sorted(glob.glob(os.path.join("cc", d, "*.cc"))):
            base = os.path.basename(path)
            if base.endswith("_test.cc") or base.startswith("fake_"):
                continue
            if base.endswith("_gpu.cc") and not CUDA:
                continue
            srcs.append(path)
    return srcs


def _tf_flags():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        import tensorflow as tf
    except ImportError as e:
        sys.exit("setup.py: cannot import tensorflow (%s); install it first and "
                 "use `pip install --no-build-isolation .`" % e)
    inc = tf.sysconfig.get_include()
    defines = [f for f in tf.sysconfig.get_compile_flags() if f.startswith("-D")]
    return tf.__version__, inc, defines, tf.sysconfig.get_link_flags()


def _mpi(what):
    mpicc = os.environ.get("MPICC", "mpicc")
    try:
        out = subprocess.check_output([mpicc, "--showme:" + what], text=True)
    except (OSError, subprocess.CalledProcessError):
        if what == "incdirs":  # MPICH-style wrapper
            out = subprocess.check_output([mpicc, "-show"], text=True)
            return [t[2:] for t in shlex.split(out) if t.startswith("-I")]
        if what == "link":
            out = subprocess.check_output([mpicc, "-show"], text=True)
            return [t for t in shlex.split(out) if t[:2] in ("-L", "-l", "-W")]
        raise
    return shlex.split(out)


def _version():
    try:
        with open(os.path.join(HERE, "mpistrategy", "__init__.py")) as f:
            m = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', f.read(), re.M)
            if m:
                return m.group(1)
    except OSError:
        pass
    return "0.1.0"


class BuildExt(build_ext):
    """Names the library exactly mpistrategy/ops/_mpi_ops.so (no ABI tag),
    the path mpistrategy.ops loads and `make build` writes."""

    def get_ext_filename(self, ext_name):
        # Called with the full dotted name and (from get_ext_fullpath) with
        # the last component only.
        if ext_name == EXT_NAME:
            return os.path.join(*EXT_NAME.split("."))[:-len("_mpi_ops")] + "_mpi_ops.so"
        if ext_name == EXT_NAME.rsplit(".", 1)[1]:
            return "_mpi_ops.so"
        return super().get_ext_filename(ext_name)

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = min(os.cpu_count() or 1, 4)


def _extensions():
    # Metadata-only invocations (egg_info, sdist, --version) need neither TF nor MPI.
    if not any(a.startswith(("build", "install", "bdist", "develop", "editable_wheel"))
               for a in sys.argv[1:]):
        return []
    srcs = _sources()
    if not srcs:
        sys.exit("setup.py: no sources found under cc/{engine,transport,ops,kernels}")
    _, tf_inc, tf_defines, tf_link = _tf_flags()
    # Same as Bazel -c opt (Python's own CFLAGS come first; -g0 drops its -g).
    cflags = ["-std=c++17", "-O2", "-g0", "-isystem", tf_inc, "-DOMPI_SKIP_MPICXX=1",
              "-DMPICH_SKIP_MPICXX=1"] + tf_defines
    for d in _mpi("incdirs"):
        cflags += ["-isystem", d]
    if CUDA:
        cflags.append("-DGOOGLE_CUDA=1")
        # CUDA 12 / NCCL headers bundled in the TF wheel; no CUDA library is
        # linked: libtensorflow_framework exports lazy-loading cuda*/nccl*
        # stubs (same as MPISTRATEGY_CUDA_LINK=tf in Bazel).
        for d in ("third_party/gpus/cuda/include",
                  "third_party/gpus/cuda/libcudacxx/include",
                  "external/cuda_nccl/include"):
            cflags += ["-isystem", os.path.join(tf_inc, d)]
    ext = Extension(
        EXT_NAME,
        sources=srcs,
        language="c++",
        include_dirs=["."],  # "cc/engine/common.h" style includes
        extra_compile_args=cflags,
        extra_link_args=tf_link + _mpi("link") + ["-Wl,-z,defs"],
    )
    return [ext]


def _installed_tf_version():
    try:
        from importlib.metadata import version
        return version("tensorflow")
    except Exception:
        return None


_exts = _extensions()
_tf_version = _installed_tf_version()

setup(
    name="mpistrategy",
    version=_version(),
    description="MPI/NCCL tf.distribute strategy for TensorFlow 2 / Keras 3",
    packages=find_packages(include=["mpistrategy", "mpistrategy.*"]),
    python_requires=">=3.9",
    # The C++ ABI of custom ops is per TensorFlow release.
    install_requires=(["tensorflow==" + _tf_version] if _tf_version else ["tensorflow"]),
    ext_modules=_exts,
    cmdclass={"build_ext": BuildExt},
    zip_safe=False,
)
