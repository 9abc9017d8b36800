"""The built op library: present, loadable, registers the MpiStrategy* ops.

These tests fail (never skip) when the library is missing: run `make build`.
Each load happens in a fresh interpreter, so nothing here depends on test
order or on what else the pytest process has imported.
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
LIB = os.path.join(ROOT, "mpistrategy", "ops", "_mpi_ops.so")
CONFIG_LIB = os.path.join(ROOT, "mpistrategy", "_config.so")
CUDA_LIB = os.path.join(ROOT, "build", "cuda", "_mpi_ops.so")

# Runs in a child interpreter: loads the library with tf.load_op_library and
# prints the registered op names and, per op, the device types of its kernels.
_PROBE = textwrap.dedent("""
    import json, os, sys
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    from tensorflow.core.framework import op_def_pb2
    from tensorflow.python.client import pywrap_tf_session as py_tf
    from tensorflow.python.framework import kernels

    path = sys.argv[1]
    module = tf.load_op_library(path)
    handle = py_tf.TF_LoadLibrary(path)   # same dlopen handle: lists its ops
    try:
        op_list = op_def_pb2.OpList.FromString(py_tf.TF_GetOpList(handle))
    finally:
        py_tf.TF_DeleteLibraryHandle(handle)
    ops = sorted(op.name for op in op_list.op)
    devices = {
        name: sorted({k.device_type for k in
                      kernels.get_registered_kernels_for_op(name).kernel})
        for name in ops
    }
    wrappers = sorted(n for n in dir(module) if not n.startswith("_"))
    print("@@PROBE@@" + json.dumps({"ops": ops, "devices": devices,
                                    "wrappers": wrappers}))
""")


def _probe(path):
    assert os.path.isfile(path), (
        "%s is missing: build it with `make build` (Bazel) or "
        "`pip install --no-build-isolation .`" % path)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _PROBE, path], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        "loading %s failed (exit %d):\n%s" % (path, proc.returncode,
                                               proc.stderr[-4000:]))
    line = [l for l in proc.stdout.splitlines() if l.startswith("@@PROBE@@")]
    assert line, proc.stdout + proc.stderr
    return json.loads(line[-1][len("@@PROBE@@"):])


@pytest.fixture(scope="module")
def cpu_lib():
    return _probe(LIB)


def test_library_is_built():
    assert os.path.isfile(LIB), "%s is missing: run `make build`" % LIB
    with open(LIB, "rb") as f:
        assert f.read(4) == b"\x7fELF", "%s is not an ELF shared object" % LIB


def test_library_registers_mpistrategy_ops(cpu_lib):
    ops = cpu_lib["ops"]
    assert ops, "the library registers no ops"
    assert all(name.startswith("MpiStrategy") for name in ops), (
        "every op must be named MpiStrategy*: %s" % ops)
    assert cpu_lib["wrappers"], "tf.load_op_library produced no op wrappers"


def test_every_op_has_a_cpu_kernel_and_no_gpu_kernel(cpu_lib):
    # mpistrategy/ops/_mpi_ops.so must stay the CPU build (make build-cuda
    # writes the GPU variant to build/cuda/ only).
    for name, devices in cpu_lib["devices"].items():
        assert "GPU" not in devices, (
            "%s has a GPU kernel in the CPU build" % name)
        assert "CPU" in devices, (
            "%s has no CPU kernel (devices: %s)" % (name, devices))


def test_library_links_only_tf_and_mpi():
    """-Wl,-z,defs resolved everything against TF and MPI: no CUDA/NCCL deps."""
    assert os.path.isfile(LIB), "%s is missing: run `make build`" % LIB
    readelf = shutil.which("readelf")
    assert readelf, "readelf (binutils) not found"
    out = subprocess.run([readelf, "-d", LIB], capture_output=True, text=True,
                         check=True).stdout
    needed = [l.split("[", 1)[1].rstrip("]") for l in out.splitlines()
              if "(NEEDED)" in l]
    assert any(n.startswith("libtensorflow_framework.so")
               for n in needed), needed
    assert any(n.startswith("libmpi.so") for n in needed), needed
    assert not [n for n in needed if "cuda" in n or "nccl" in n], needed


def test_config_library_needs_neither_tf_nor_mpi():
    """mpistrategy/_config.so (option validation) loads without TensorFlow
    and MPI, so that Options() and the launcher stay light."""
    assert os.path.isfile(CONFIG_LIB), (
        "%s is missing: run `make build`" % CONFIG_LIB)
    out = subprocess.run(["readelf", "-d", CONFIG_LIB], capture_output=True,
                         text=True, check=True).stdout
    needed = [l.split("[", 1)[1].rstrip("]") for l in out.splitlines()
              if "(NEEDED)" in l]
    assert needed, out
    assert not [n for n in needed if "tensorflow" in n or "mpi" in n
                or "python" in n], needed
    out = subprocess.run(["readelf", "--dyn-syms", "-W", CONFIG_LIB],
                         capture_output=True, text=True, check=True).stdout
    assert " mpistrategy_validate_config" in out, out


def test_cuda_build_registers_gpu_kernels_if_built():
    """`make build-cuda` output, when present, loads on a CPU-only machine."""
    if not os.path.isfile(CUDA_LIB):
        # `make test` always builds it first; in CI a missing file is a failure.
        assert not os.environ.get("CI"), (
            "%s is missing (make build-cuda)" % CUDA_LIB)
        pytest.skip("no %s (built by `make build-cuda`)" % CUDA_LIB)
    info = _probe(CUDA_LIB)
    assert all(name.startswith("MpiStrategy")
               for name in info["ops"]), info["ops"]
    assert any("GPU" in d for d in info["devices"].values()), (
        "the CUDA build registers no GPU kernel: %s" % info["devices"])


def test_cc_test_main_fails_on_failures_and_on_no_tests(tmp_path):
    """cc/testing/gtest_main.cc: a failing test makes the binary exit
    non-zero, later tests still run, and a filter that selects nothing is a
    failure too (plain gtest_main would pass it)."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    assert cxx, "no C++ compiler found"
    src = tmp_path / "sample_test.cc"
    src.write_text(textwrap.dedent("""
        #include <vector>
        #include <gtest/gtest.h>
        TEST(Sample, Fails) {
          int x = 1;
          EXPECT_EQ(x, 2) << "extra context";
        }
        TEST(Sample, Passes) { EXPECT_EQ((std::vector<int>{1, 2}).size(), 2u); }
    """))
    exe = tmp_path / "sample_test"
    subprocess.run([cxx, "-std=c++17", "-Wall", "-Werror", str(src),
                    os.path.join(ROOT, "cc", "testing", "gtest_main.cc"),
                    "-o", str(exe), "-lgtest", "-pthread"], check=True,
                   timeout=300)
    proc = subprocess.run([str(exe)], capture_output=True, text=True,
                          timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "sample_test.cc:6: Failure" in out and "extra context" in out, out
    assert "[       OK ] Sample.Passes" in out, out
    assert "[  FAILED  ] Sample.Fails" in out, out

    ok = subprocess.run([str(exe), "--gtest_filter=Sample.Passes"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    none = subprocess.run([str(exe), "--gtest_filter=NoSuchTest"],
                          capture_output=True, text=True, timeout=60)
    assert none.returncode == 1 and "no test ran" in none.stderr, (
        none.stdout + none.stderr)
