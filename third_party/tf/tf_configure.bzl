"""Repository rule: locate an installed TensorFlow pip package.

Runs $PYTHON_BIN_PATH to ask tf.sysconfig where the headers and
libtensorflow_framework.so.N live, symlinks both into an external repository
and exposes @<name>//:tf_header_lib and @<name>//:libtensorflow_framework.

PYTHON_BIN_PATH: absolute path, a path relative to the workspace root, or a
bare command name looked up on PATH.  Unset: <workspace>/.venv/bin/python if
it exists, else `python3` from PATH.
"""

_PY = """
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
print("@@TF@@")
print(tf.sysconfig.get_include())
print(tf.sysconfig.get_lib())
print(" ".join(tf.sysconfig.get_compile_flags()))
print(" ".join(tf.sysconfig.get_link_flags()))
print(tf.__version__)
print(int(tf.test.is_built_with_cuda()))
"""

DEFAULT_PYTHON = ".venv/bin/python"

def _fail(msg):
    fail("\n\033[0;31mtf_configure:\033[0m %s\n" % msg)

def find_python(ctx):
    """Returns the path of the Python interpreter that has TensorFlow."""
    root = ctx.path(Label("//:WORKSPACE")).dirname
    python = ctx.os.environ.get("PYTHON_BIN_PATH", "")
    if not python:
        p = root.get_child(".venv").get_child("bin").get_child("python")
        if p.exists:
            return p
        python = "python3"
    if "/" in python:
        p = ctx.path(python) if python.startswith("/") else ctx.path("%s/%s" % (root, python))
        if not p.exists:
            _fail("PYTHON_BIN_PATH=%s does not exist (%s)" % (python, p))
        return p
    p = ctx.which(python)
    if p == None:
        _fail("'%s' not found on PATH; set PYTHON_BIN_PATH (or run `make venv`)" % python)
    return p

def _tf_configure_impl(ctx):
    python = find_python(ctx)
    r = ctx.execute(
        [python, "-c", _PY],
        environment = {"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""},
        timeout = 300,
    )
    if r.return_code != 0 or "@@TF@@" not in r.stdout:
        _fail("'%s -c import tensorflow' failed:\n%s" % (python, r.stderr))
    lines = r.stdout.split("@@TF@@\n")[1].strip().split("\n")
    inc, lib, cflags, lflags, version, cuda = lines[:6]

    defines = [f[2:] for f in cflags.split(" ") if f.startswith("-D")]
    libname = "libtensorflow_framework.so.2"
    for f in lflags.split(" "):
        if f.startswith("-l:"):
            libname = f[3:]
        elif f.startswith("-l"):
            libname = "lib%s.so" % f[2:]

    ctx.symlink(inc, "include")
    ctx.symlink(lib + "/" + libname, libname)
    ctx.file("tf_info.bzl", "\n".join([
        "TF_VERSION = %r" % version,
        "TF_IS_CUDA_BUILD = %s" % (cuda == "1"),
        "TF_CFLAGS = %r" % cflags.split(" "),
        "TF_LFLAGS = %r" % lflags.split(" "),
        "TF_PYTHON = %r" % str(python),
        "",
    ]))
    ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

exports_files(["tf_info.bzl"])

# TensorFlow {version} from {python}
# Headers of the installed wheel.  `includes` turns into -isystem, which also
# silences the (many) warnings g++ emits for TF/absl/Eigen/protobuf headers.
cc_library(
    name = "tf_header_lib",
    hdrs = glob(["include/**"], exclude = {excl}),
    includes = ["include"],
    defines = {defines},
)

cc_library(
    name = "libtensorflow_framework",
    srcs = ["{libname}"],
)
""".format(
        version = version,
        python = python,
        defines = repr(defines),
        libname = libname,
        # Bundled third-party trees not needed by op kernels; keeps the
        # number of declared inputs per compile action down (~18k -> ~9k).
        excl = repr(ctx.attr.exclude_globs),
    ))

tf_configure = repository_rule(
    implementation = _tf_configure_impl,
    environ = ["PYTHON_BIN_PATH"],
    local = True,
    attrs = {
        "exclude_globs": attr.string_list(default = [
            "include/external/**",
        ]),
    },
)
